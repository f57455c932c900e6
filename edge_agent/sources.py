"""Where an agent's labelled samples come from, and the buffer that keeps the recent ones.

A `DataSource` is a stream: `poll(max_items)` returns up to that many new (x, y) samples,
x a (C, H, W) float32 tensor in the model's input space, y an int label.

- `DatasetSource` (simulator, demo): draws from per-cluster pools by a mixture that the
  caller changes over time (`set_mixture`), e.g. as a car drives from area to area.
- `DirectorySource` (real devices): another process drops files into a folder,
  `<root>/<label>/<name>.png` or `.npy`; each file is consumed exactly once (see there).

`LocalBuffer` keeps the last N samples: the local training set and the data the agent
evaluates a newly installed model on.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fedmq.logs import event, get_logger

log = get_logger("edge_agent.sources")

Sample = tuple[torch.Tensor, int]


class DataSource(Protocol):
    def poll(self, max_items: int) -> list[Sample]: ...


def _check_mixture(mixture: Sequence[float], k: int) -> np.ndarray:
    alpha = np.asarray(mixture, dtype=np.float64)
    if alpha.shape != (k,) or not np.isfinite(alpha).all() or (alpha < 0).any() or alpha.sum() <= 0:
        raise ValueError(f"mixture must be {k} non-negative finite weights with a positive sum, got {list(mixture)}")
    return alpha / alpha.sum()


class DatasetSource:
    """An endless stream drawn from per-cluster pools (x_k, y_k) by a changeable mixture.

    Each sample picks cluster k with probability mixture[k], then a uniform sample of
    pool k (with replacement). Seeded: the same seed, pools and calls give the same stream.
    `drawn[k]` counts the samples taken from cluster k so far.
    """

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 mixture: Sequence[float] | None = None, seed: int = 0) -> None:
        if not pools:
            raise ValueError("need at least one cluster pool")
        for k, (x, y) in enumerate(pools):
            if x.ndim != 4 or y.shape != (x.shape[0],) or x.shape[0] == 0:
                raise ValueError(f"pool {k}: want x (N, C, H, W) and y (N,) with N > 0, "
                                 f"got {tuple(x.shape)} and {tuple(y.shape)}")
        self.pools = [(x, y) for x, y in pools]
        self.mixture = _check_mixture(mixture if mixture is not None else [1.0] * len(pools), len(pools))
        self.rng = np.random.default_rng(seed)
        self.drawn = np.zeros(len(pools), dtype=np.int64)
        self.last_clusters: list[int] = []

    def set_mixture(self, mixture: Sequence[float]) -> None:
        self.mixture = _check_mixture(mixture, len(self.pools))

    def poll(self, max_items: int) -> list[Sample]:
        clusters = self.rng.choice(len(self.pools), size=max(0, max_items), p=self.mixture)
        out: list[Sample] = []
        for k in clusters:
            x, y = self.pools[k]
            i = int(self.rng.integers(x.shape[0]))
            out.append((x[i], int(y[i])))
        self.drawn += np.bincount(clusters, minlength=len(self.pools))
        self.last_clusters = [int(k) for k in clusters]
        return out


class SampleRejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


SUFFIXES = (".png", ".npy")
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial")


class DirectorySource:
    """New samples dropped into a folder: `<root>/<label>/<name>.png` or `<name>.npy`.

    Contract with the writer: write to a hidden name or one ending in .tmp/.part, then
    rename into place (rename is atomic); such names are never read. Files are taken
    oldest first (mtime). Each file is claimed by renaming it into `<root>/done/<label>/`
    *before* it is read, so no file is ever consumed twice, across restarts too (a crash
    between claim and read loses that one sample rather than duplicating it). With
    `keep_done=False` consumed files are deleted instead of archived.

    A sample must match `input_shape` (C, H, W) exactly; nothing is resized or converted:
    - .npy: a floating array of exactly that shape, finite, taken as model input as is;
    - .png: 8-bit grayscale (C = 1) or RGB (C = 3) of exactly H x W; pixels / 255, then
      (p - mean) / std per channel when `mean`/`std` are given (the dataset's normalization).
    The label is the folder name, an integer in [0, num_classes). Anything else is moved to
    `<root>/rejected/<label>/`, logged with its reason and counted in `skipped[reason]`.
    """

    def __init__(self, root: str | os.PathLike[str], input_shape: Sequence[int], num_classes: int, *,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 keep_done: bool = True) -> None:
        self.root = Path(root)
        self.input_shape = tuple(int(s) for s in input_shape)
        if len(self.input_shape) != 3:
            raise ValueError(f"input_shape must be (C, H, W), got {self.input_shape}")
        self.num_classes = num_classes
        c = self.input_shape[0]
        self.mean = np.zeros(c, np.float32) if mean is None else np.asarray(mean, np.float32)
        self.std = np.ones(c, np.float32) if std is None else np.asarray(std, np.float32)
        if self.mean.shape != (c,) or self.std.shape != (c,) or (self.std <= 0).any():
            raise ValueError(f"mean and std need {c} values each, std > 0")
        self.keep_done = keep_done
        self.done_dir = self.root / "done"
        self.rejected_dir = self.root / "rejected"
        self.root.mkdir(parents=True, exist_ok=True)
        self.consumed = 0
        self.skipped: Counter[str] = Counter()

    def _candidates(self) -> list[Path]:
        found: list[tuple[int, str, Path]] = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(".") or entry.path in (str(self.done_dir), str(self.rejected_dir)):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    with os.scandir(entry.path) as files:
                        for f in files:
                            if self._is_ready(f):
                                found.append((f.stat().st_mtime_ns, f.path, Path(f.path)))
                elif self._is_ready(entry):
                    found.append((entry.stat().st_mtime_ns, entry.path, Path(entry.path)))
        found.sort()
        return [p for _, _, p in found]

    @staticmethod
    def _is_ready(entry: os.DirEntry) -> bool:
        return (entry.is_file(follow_symlinks=False) and not entry.name.startswith(".")
                and not entry.name.endswith(PARTIAL_SUFFIXES))

    def poll(self, max_items: int) -> list[Sample]:
        out: list[Sample] = []
        for path in self._candidates():
            if len(out) >= max_items:
                break
            label_dir = path.parent.name if path.parent != self.root else ""
            claimed = self._move(path, self.done_dir / (label_dir or "_"))
            if claimed is None:
                continue  # someone else took it (or it vanished): not ours to count
            try:
                label = self._label(label_dir)
                x = self._read(claimed)
            except SampleRejected as exc:
                self._reject(claimed, label_dir, exc)
                continue
            if not self.keep_done:
                claimed.unlink(missing_ok=True)
            self.consumed += 1
            out.append((x, label))
        return out

    def _label(self, name: str) -> int:
        if not name:
            raise SampleRejected("no_label", "files must sit in a folder named after their label")
        try:
            label = int(name)
        except ValueError:
            raise SampleRejected("bad_label", f"folder {name!r} is not an integer label") from None
        if not 0 <= label < self.num_classes:
            raise SampleRejected("bad_label", f"label {label} is outside [0, {self.num_classes})")
        return label

    def _read(self, path: Path) -> torch.Tensor:
        suffix = path.suffix.lower()
        if suffix == ".npy":
            array = self._read_npy(path)
        elif suffix == ".png":
            array = self._read_png(path)
        else:
            raise SampleRejected("unknown_type", f"{path.name}: want one of {', '.join(SUFFIXES)}")
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))

    def _read_npy(self, path: Path) -> np.ndarray:
        try:
            array = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise SampleRejected("unreadable", f"{path.name}: {type(exc).__name__}: {exc}") from None
        if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
            raise SampleRejected("bad_dtype", f"{path.name}: want a floating array, got {getattr(array, 'dtype', type(array))}")
        if array.shape != self.input_shape:
            raise SampleRejected("wrong_shape", f"{path.name}: shape {array.shape}, want {self.input_shape}")
        if not np.isfinite(array).all():
            raise SampleRejected("not_finite", f"{path.name} holds NaN or Inf")
        return array

    def _read_png(self, path: Path) -> np.ndarray:
        try:
            from PIL import Image
        except ImportError:
            raise SampleRejected("png_unsupported", "Pillow is not installed") from None
        try:
            with Image.open(path) as image:
                image.load()
                mode, pixels = image.mode, np.asarray(image)
        except Exception as exc:
            raise SampleRejected("unreadable", f"{path.name}: {type(exc).__name__}: {exc}") from None
        channels = {"L": 1, "RGB": 3}.get(mode)
        if channels is None:
            raise SampleRejected("unsupported_mode", f"{path.name}: PNG mode {mode}, want L (grayscale) or RGB")
        chw = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
        if chw.shape != self.input_shape:
            raise SampleRejected("wrong_shape", f"{path.name}: shape {chw.shape}, want {self.input_shape}")
        scaled = chw.astype(np.float32) / 255.0
        return (scaled - self.mean[:, None, None]) / self.std[:, None, None]

    def _move(self, path: Path, folder: Path) -> Path | None:
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / path.name
        if target.exists():  # a new file reusing an old name: keep both
            target = folder / f"{path.stem}.{os.getpid()}-{self.consumed + sum(self.skipped.values())}{path.suffix}"
        try:
            os.replace(path, target)
        except FileNotFoundError:
            return None
        return target

    def _reject(self, path: Path, label_dir: str, exc: SampleRejected) -> None:
        self.skipped[exc.reason] += 1
        event(log, "source.skipped", level=logging.WARNING, file=str(path.name), label_dir=label_dir,
              reason=exc.reason, detail=str(exc))
        self._move(path, self.rejected_dir / (label_dir or "_"))


class LocalBuffer:
    """The last `capacity` labelled samples (oldest fall out): local training data."""

    def __init__(self, capacity: int = 2000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._samples: deque[Sample] = deque(maxlen=capacity)
        self.added = 0

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, x: torch.Tensor, y: int) -> None:
        self._samples.append((x, int(y)))
        self.added += 1

    def extend(self, samples: Sequence[Sample]) -> None:
        for x, y in samples:
            self.add(x, y)

    def clear(self) -> None:
        self._samples.clear()

    def tensors(self, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x (N, C, H, W), y (N,)) of the buffered samples, or of the newest `last` of them."""
        samples = list(self._samples)[-last:] if last else list(self._samples)
        if not samples:
            raise ValueError("the buffer is empty")
        return torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples], dtype=torch.int64)
