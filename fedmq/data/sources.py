"""Datasets as whole in-memory tensors: scikit-learn's digits offline, torchvision's on disk.

Every dataset here is small enough (at most ~100k images of up to 3x32x32) to hold as one
float32 tensor, which makes rotation, mixing and batched evaluation plain tensor indexing
instead of per-sample `__getitem__` calls. A loaded split is cached for the process.

Files are read from a data root in torchvision's own layout (so a root that torchvision
already filled works as is). Nothing is downloaded unless `download=True` (the CLI's
`--download`); a missing dataset raises `DatasetNotFound` saying where it looked and how to
get it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedmq.config import default_data_dir
from fedmq.dataset_names import (  # noqa: F401 (names and data roots need no torch; importable from here as before)
    DATASETS,
    EXPECTED_FILES,
    OFFLINE,
    UnknownDataset,
    canonical_dataset,
    dataset_for_data_dir,
    datasets_in,
    is_factory,
    offline_with_data_dir,
)
from fedmq.errors import RuntimeFailure, UsageError


class DatasetNotFound(FileNotFoundError, RuntimeFailure):
    """A dataset's files are not in the data root (and downloading was not asked for)."""


@dataclass(repr=False)
class Dataset:
    """Images and labels of one split, as tensors.

    `x` is (N, C, H, W) float32, already normalized with `mean` and `std` (per channel,
    applied to pixels in [0, 1]); `y` is (N,) int64 in [0, num_classes). `background`
    is the normalized value of a black pixel: rotation fills the uncovered corners with it.
    Loaded splits are shared through a per-process cache: treat the tensors as read-only.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str
    mean: tuple[float, ...] = field(default=(0.0,))
    std: tuple[float, ...] = field(default=(1.0,))

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or self.x.dtype != torch.float32:
            raise ValueError(f"{self.name}: x must be (N, C, H, W) float32, got {tuple(self.x.shape)} {self.x.dtype}")
        if self.y.shape != (self.x.shape[0],) or self.y.dtype != torch.int64:
            raise ValueError(f"{self.name}: y must be ({self.x.shape[0]},) int64, got {tuple(self.y.shape)} {self.y.dtype}")
        if len(self.mean) != self.x.shape[1] or len(self.std) != self.x.shape[1]:
            raise ValueError(f"{self.name}: mean/std need one value per channel ({self.x.shape[1]})")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, n={len(self)}, shape={self.image_shape}, "
                f"classes={self.num_classes}, device={self.x.device})")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W): what a model's input_shape must be."""
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    @property
    def background(self) -> tuple[float, ...]:
        return tuple(-m / s for m, s in zip(self.mean, self.std, strict=True))

    def subset(self, idx: Sequence[int] | np.ndarray | torch.Tensor, name: str | None = None) -> Dataset:
        """The samples at `idx` (in that order; repeats allowed) as a new Dataset."""
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return Dataset(self.x[index], self.y[index], self.num_classes, name or self.name, self.mean, self.std)

    def with_x(self, x: torch.Tensor, name: str | None = None) -> Dataset:
        """Same labels and normalization, new images (e.g. rotated)."""
        return Dataset(x, self.y, self.num_classes, name or self.name, self.mean, self.std)

    def to(self, device: str | torch.device) -> Dataset:
        return Dataset(self.x.to(device), self.y.to(device), self.num_classes, self.name, self.mean, self.std)


# Published per-channel statistics of the train splits; the others are measured on load.
_KNOWN_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashionmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}

_cache: dict[tuple[str, str, bool], Dataset] = {}
_cache_lock = threading.Lock()


def load_dataset(name: str, *, data_dir: str | os.PathLike[str] | None = None, train: bool = True,
                 download: bool = False) -> Dataset:
    """One split of a dataset as normalized tensors, cached per process.

    `name` is one of DATASETS (case and '-'/'_' ignored) or `folder:NAME` for images laid
    out as `<data_dir>/NAME/{train,test}/<class>/*.png` (torchvision's ImageFolder; classes
    sorted by directory name). `data_dir` defaults to `default_data_dir()`. With
    `download=False` (the default) nothing touches the network and a missing dataset raises
    DatasetNotFound.
    """
    key_name = canonical_dataset(name)
    root = str(Path(data_dir if data_dir is not None else default_data_dir()).expanduser().resolve())
    key = (key_name, root if key_name not in OFFLINE else "", train)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    data = _load_uncached(key_name, root, train, download)
    with _cache_lock:
        return _cache.setdefault(key, data)


def clear_cache() -> None:
    """Forget loaded splits (tests that rewrite files under the same root)."""
    with _cache_lock:
        _cache.clear()


def _not_found(name: str, root: str, detail: str = "") -> DatasetNotFound:
    expected = EXPECTED_FILES.get(name)
    if name.startswith("folder:"):
        sub = name.split(":", 1)[1]
        where = f"put images in {root}/{sub}/train/<class>/*.png and {root}/{sub}/test/<class>/*.png"
        how = where
    else:
        files = ", ".join(f"{root}/{f}" for f in expected or [])
        how = (f"download it with --download (or --set data.download=true), or put torchvision's "
               f"files there ({files}), or point --data-dir / FEDMQ_DATA_DIR at a root that has them")
    msg = f"dataset {name!r} not found in data root {root}: {how}"
    if detail:
        msg += f" [{detail}]"
    return DatasetNotFound(msg)


def _load_uncached(name: str, root: str, train: bool, download: bool) -> Dataset:
    if name == "digits":
        return _load_digits(train)
    if name == "synthetic":
        return _load_synthetic(train)
    if name in ("shapes", "shapeslit"):
        return _load_shapes(train, lit=name == "shapeslit")
    if is_factory(name):
        return _load_factory(name, root, train)
    if name.startswith("folder:"):
        return _load_folder(name, root, train)
    expected = EXPECTED_FILES[name]
    if not download and name in ("mnist", "fashionmnist", "svhn", "usps"):
        # Check ourselves: torchvision's USPS would raise a bare FileNotFoundError from bz2.
        missing = [f for f in expected if not os.path.isfile(os.path.join(root, f))]
        if missing:
            partial = len(missing) < len(expected)
            raise _not_found(name, root, f"missing {', '.join(missing)}" if partial else "")
    try:
        images, labels, num_classes = _read_torchvision(name, root, train, download)
    except (RuntimeError, FileNotFoundError) as e:
        # torchvision: "Dataset not found or corrupted. You can use download=True ..."
        raise _not_found(name, root, str(e)) from e
    if name in _KNOWN_STATS:
        mean, std = _KNOWN_STATS[name]
    else:  # usps: statistics of its own train split
        mean, std = _train_stats(name, root, train, images)
    return _normalized(images, labels, num_classes, name, mean, std)


def _read_torchvision(name: str, root: str, train: bool, download: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """uint8 images (N, C, H, W) and int64 labels from torchvision's own classes."""
    from torchvision import datasets as tvd

    if download:
        os.makedirs(root, exist_ok=True)
    if name in ("mnist", "fashionmnist"):
        cls = tvd.MNIST if name == "mnist" else tvd.FashionMNIST
        ds = cls(root, train=train, download=download)
        return ds.data.numpy()[:, None], ds.targets.numpy().astype(np.int64), 10
    if name in ("cifar10", "cifar100"):
        cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
        ds = cls(root, train=train, download=download)
        return (np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)), np.asarray(ds.targets, dtype=np.int64),
                len(ds.classes))
    if name == "svhn":
        ds = tvd.SVHN(root, split="train" if train else "test", download=download)
        return np.asarray(ds.data), np.asarray(ds.labels, dtype=np.int64), 10
    if name == "usps":
        ds = tvd.USPS(root, train=train, download=download)
        return np.asarray(ds.data)[:, None], np.asarray(ds.targets, dtype=np.int64), 10
    raise AssertionError(name)


def _train_stats(name: str, root: str, train: bool, images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std in [0, 1] of the train split (loaded from the cache if not this one)."""
    if not train:
        ref = load_dataset(name, data_dir=root, train=True)
        return ref.mean, ref.std
    pixels = images.astype(np.float64) / 255.0
    mean = pixels.mean(axis=(0, 2, 3))
    std = pixels.std(axis=(0, 2, 3))
    return tuple(float(m) for m in mean), tuple(float(max(s, 1e-6)) for s in std)


def _normalized(images: np.ndarray, labels: np.ndarray, num_classes: int, name: str,
                mean: Sequence[float], std: Sequence[float], scale: float = 255.0) -> Dataset:
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(scale)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    x = (x - m) / s
    y = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
    return Dataset(x, y, num_classes, name, tuple(float(v) for v in mean), tuple(float(v) for v in std))


DIGITS_TEST_FRACTION = 0.3
DIGITS_SPLIT_SEED = 0


def _load_synthetic(train: bool) -> Dataset:
    """A generated 10-class task of 8x8 one-channel images: 6000 train and 1500 test images.

    A second offline dataset for experiments (`--dataset synthetic`), harder than digits and
    with more samples. Each class has 3 modes (prototypes made of 3 random Gaussian blobs of
    either sign, drawn once from a fixed seed); an image is one of its class's modes with a
    random contrast in [0.7, 1.3], shifted by up to one pixel (wrapping) and with Gaussian
    pixel noise sigma 0.25. A CNN trained centrally on all of the train split reaches about
    0.9 test accuracy, so there is room between algorithms. Deterministic on every machine.
    """
    protos_rng = np.random.default_rng(12345)
    yy, xx = np.mgrid[0:8, 0:8]
    protos = np.zeros((10, 3, 8, 8))
    for c in range(10):
        for m in range(3):
            img = np.zeros((8, 8))
            for _ in range(3):
                cy, cx = protos_rng.uniform(0, 7, 2)
                s = protos_rng.uniform(0.8, 2.0)
                a = protos_rng.choice([-1, 1]) * protos_rng.uniform(0.5, 1)
                img += a * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * s * s))
            protos[c, m] = img / np.abs(img).max()
    n = 6000 if train else 1500
    rng = np.random.default_rng(1 if train else 2)
    labels = rng.integers(0, 10, n)
    modes = rng.integers(0, 3, n)
    x = protos[labels, modes] * rng.uniform(0.7, 1.3, (n, 1, 1))
    shifts = rng.integers(-1, 2, (n, 2))
    for i in range(n):
        x[i] = np.roll(x[i], (int(shifts[i, 0]), int(shifts[i, 1])), axis=(0, 1))
    x = x + rng.normal(0.0, 0.25, x.shape)
    return Dataset(torch.from_numpy(x[:, None].astype(np.float32)),
                   torch.from_numpy(labels.astype(np.int64)), 10, "synthetic")


_Mask = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
SHAPE_MASKS: dict[str, _Mask] = {
    # (dy, dx) from the centre in radii, (ay, ax) their absolute values -> pixels inside
    "disc": lambda dy, dx, ay, ax: dy ** 2 + dx ** 2 <= 1,
    "square": lambda dy, dx, ay, ax: np.maximum(ay, ax) <= 0.8,
    "triangle": lambda dy, dx, ay, ax: (dy <= 0.8) & (ax <= (dy + 1) / 2),
    "ring": lambda dy, dx, ay, ax: np.abs(np.sqrt(dy ** 2 + dx ** 2) - 0.75) <= 0.22,
    "cross": lambda dy, dx, ay, ax: ((ay <= 0.25) | (ax <= 0.25)) & (np.maximum(ay, ax) <= 1),
    "hbar": lambda dy, dx, ay, ax: (ay <= 0.3) & (ax <= 1),
    "vbar": lambda dy, dx, ay, ax: (ax <= 0.3) & (ay <= 1),
    "diamond": lambda dy, dx, ay, ax: ay + ax <= 1,
    "x": lambda dy, dx, ay, ax: (((np.abs(dy - dx) <= 0.3) | (np.abs(dy + dx) <= 0.3))
                                 & (np.maximum(ay, ax) <= 0.9)),
    "frame": lambda dy, dx, ay, ax: (np.maximum(ay, ax) <= 0.9) & (np.maximum(ay, ax) >= 0.6),
}
SHAPES = tuple(SHAPE_MASKS)


LIGHT_RAMP = 0.2
"""shapes-lit: light added to the top row and taken from the bottom row (linear between), in
[0, 1] pixel units. Additive, so a shape keeps its contrast against its background at every
row: a multiplicative falloff to half left the bottom rows' shapes in the noise
(scripts/shapes_lighting.py measures both)."""

LIT_MEAN, LIT_STD = (0.4994, 0.4993, 0.5007), (0.3061, 0.3040, 0.3050)
"""shapes-lit's per-channel statistics (train split, measured), for its normalization."""


def _load_shapes(train: bool, lit: bool = False) -> Dataset:
    """A generated 10-class task of 32x32 colour images: 6000 train and 1500 test images.

    The offline stand-in for a colour dataset (`--dataset shapes`, the real-sized model's
    scenario, docs/models.md): class = the shape drawn (SHAPES), with a random colour, size
    (radius 5-11 px), centre (within 4 px of the middle) and background colour, plus
    Gaussian pixel noise sigma 0.1; colour says nothing about the class. Deterministic.

    Most shapes look the same after a quarter turn, so rotated clusters of `shapes` look alike
    to anything that sees only inputs (docs/results_realsize.md). `shapes-lit` (lit=True) is the
    same images lit from above, as photographs are (`light_from_above`), so a rotation shows;
    it is normalized with its own statistics.
    """
    if lit:
        x, labels = shape_images(train, light_from_above)
        return _normalized(x, labels, len(SHAPES), "shapeslit", LIT_MEAN, LIT_STD, scale=1.0)
    x, labels = shape_images(train)
    return _normalized(x, labels, len(SHAPES), "shapes", (0.5,) * 3, (0.3,) * 3, scale=1.0)


def light_from_above(images: np.ndarray, ramp: float = LIGHT_RAMP) -> np.ndarray:
    """Each row gets light from +ramp at the top to -ramp at the bottom (in place)."""
    images += np.linspace(ramp, -ramp, images.shape[-2], dtype=np.float32)[:, None]
    return images


def shape_images(train: bool, light: Callable[[np.ndarray], np.ndarray] | None = None,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`shapes`' images in [0, 1] (n, 3, 32, 32) and their labels, `light` applied to the clean
    images before the noise and the clip: the same draws whatever the light."""
    n = 6000 if train else 1500
    rng = np.random.default_rng(31 if train else 32)
    labels = rng.integers(0, len(SHAPES), n)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)
    images = np.empty((n, 3, 32, 32), dtype=np.float32)
    for i, c in enumerate(labels):
        cy, cx = 15.5 + rng.uniform(-4, 4, 2)
        r = rng.uniform(5, 11)
        dy, dx = (yy - cy) / r, (xx - cx) / r
        mask = SHAPE_MASKS[SHAPES[c]](dy, dx, np.abs(dy), np.abs(dx))  # only the shape drawn
        background, colour = rng.uniform(0, 1, (2, 3, 1, 1))
        colour = np.where(np.abs(colour - background) < 0.3, 1.0 - background, colour)
        images[i] = np.where(mask[None], colour, background)
    if light is not None:
        images = light(images)
    images += rng.normal(0.0, 0.1, images.shape).astype(np.float32)
    return np.clip(images, 0, 1), labels


def _load_factory(name: str, root: str, train: bool) -> Dataset:
    """A dataset factory by import path: `factory(train=..., data_dir=...)` returns a fedmq
    Dataset (used as is), an (x, y) pair of tensors or arrays, or a torch Dataset of
    (image, label) items; images in [0, 1] are normalized with the train split's
    per-channel statistics, and the class count is the train split's largest label + 1."""
    from fedmq.models import import_factory

    factory = import_factory(name, "dataset")
    try:
        made = factory(train=train, data_dir=root)
    except TypeError as exc:
        raise UsageError(f"dataset {name}: call it as factory(train=bool, data_dir=str): {exc}") from None
    if isinstance(made, Dataset):
        return made
    if isinstance(made, tuple) and len(made) == 2:
        x, y = (torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in made)
    elif hasattr(made, "__getitem__") and hasattr(made, "__len__"):
        items = [made[i] for i in range(len(made))]
        if not items:
            raise ValueError(f"dataset {name}: the {'train' if train else 'test'} split is empty")
        x = torch.stack([torch.as_tensor(item[0]) for item in items])
        y = torch.as_tensor([int(item[1]) for item in items])
    else:
        raise UsageError(f"dataset {name}: the factory returned {type(made).__name__}; return a torch Dataset "
                         f"of (image, label), an (x, y) pair, or a fedmq Dataset")
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"dataset {name}: need images (N, C, H, W) and labels (N,), got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    images = x.float().numpy()
    labels = y.long().numpy()
    if train:
        mean = tuple(float(v) for v in images.mean(axis=(0, 2, 3)))
        std = tuple(float(max(v, 1e-6)) for v in images.std(axis=(0, 2, 3)))
        num_classes = int(labels.max()) + 1
    else:
        ref = load_dataset(name, data_dir=root, train=True)
        mean, std, num_classes = ref.mean, ref.std, ref.num_classes
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"dataset {name}: labels must lie in [0, {num_classes}) (the train split's), "
                         f"got {int(labels.min())}..{int(labels.max())}")
    return _normalized(images, labels, num_classes, name, mean, std, scale=1.0)


def _load_digits(train: bool) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images): a fixed stratified 70/30 split.

    scikit-learn ships no split, so ours is `train_test_split(test_size=0.3, stratify=y,
    random_state=0)`: 1257 train and 540 test images, the same on every machine.
    Pixel values 0..16 are scaled to [0, 1], then normalized with the train split's statistics.
    """
    images, labels, idx_train, idx_test = _digits_split()
    ref = images[idx_train] / 16.0
    mean = (float(ref.mean()),)
    std = (float(ref.std()),)
    idx = idx_train if train else idx_test
    return _normalized(images[idx], labels[idx], 10, "digits", mean, std, scale=16.0)


def _digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Images (1797, 1, 8, 8) 0..16, labels, and the sorted train / test indices.

    Kept in the disk cache (fedmq/disk_cache.py), named by scikit-learn's version: importing
    scikit-learn for its loader and splitter costs 0.6 s of every agent's start, reading the
    kept split a millisecond. The cache holds scikit-learn's (1797, 8, 8) array and both paths
    add the channel axis the same way: its stride reaches the tensors, and torch's convolutions
    round differently for another stride of the same values (a replayed journal then no longer
    rebuilds the live clusters bit for bit).
    """
    import importlib.metadata
    import io

    from fedmq import disk_cache

    name = disk_cache.digest("digits-2", importlib.metadata.version("scikit-learn"),
                             str(DIGITS_TEST_FRACTION), str(DIGITS_SPLIT_SEED)) + ".npz"
    kept = disk_cache.read("data", name)
    if kept is not None:
        try:
            with np.load(io.BytesIO(kept)) as z:
                flat, target, idx_train, idx_test = z["images"], z["target"], z["train"], z["test"]
        except (ValueError, KeyError, OSError):
            kept = None  # checksummed, so only a format change lands here: make it again
    if kept is None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        bunch = load_digits()
        flat, target = bunch.images, bunch.target
        idx_train, idx_test = train_test_split(np.arange(len(target)), test_size=DIGITS_TEST_FRACTION,
                                               stratify=target, random_state=DIGITS_SPLIT_SEED)
        idx_train.sort()
        idx_test.sort()
        buf = io.BytesIO()
        np.savez(buf, images=flat, target=target, train=idx_train, test=idx_test)
        disk_cache.write("data", name, buf.getvalue())
    images = flat.astype(np.float32)[:, None]  # (1797, 1, 8, 8), 0..16
    return images, target.astype(np.int64), idx_train, idx_test


def _load_folder(name: str, root: str, train: bool) -> Dataset:
    """Images in `<root>/NAME/{train,test}/<class>/` (ImageFolder layout), all one size."""
    from PIL import Image
    from torchvision.datasets import ImageFolder

    sub = name.split(":", 1)[1]
    split_dir = os.path.join(root, sub, "train" if train else "test")
    try:
        folder = ImageFolder(split_dir, loader=lambda p: p)  # paths only; we decode below
    except (FileNotFoundError, RuntimeError) as e:
        raise _not_found(name, root, str(e)) from e
    if not train:
        ref = load_dataset(name, data_dir=root, train=True)
        train_classes = _folder_classes(root, sub)
        if folder.classes != train_classes:
            raise ValueError(f"{name}: test classes {folder.classes} differ from train classes {train_classes}")
    arrays = []
    grey = None
    size = None
    for path, _ in folder.samples:
        with Image.open(path) as img:
            if grey is None:
                grey = img.mode in ("1", "L", "I", "I;16", "F")
                size = img.size
            if img.size != size:
                raise ValueError(f"{name}: all images must be one size; {path} is {img.size}, expected {size}")
            arr = np.asarray(img.convert("L" if grey else "RGB"), dtype=np.uint8)
        arrays.append(arr[None] if grey else arr.transpose(2, 0, 1))
    images = np.stack(arrays)
    labels = np.asarray(folder.targets, dtype=np.int64)
    if train:
        mean, std = _train_stats(name, root, True, images)
    else:
        mean, std = ref.mean, ref.std
    return _normalized(images, labels, len(folder.classes), name, mean, std)


def _folder_classes(root: str, sub: str) -> list[str]:
    train_dir = Path(root, sub, "train")
    return sorted(p.name for p in train_dir.iterdir() if p.is_dir())
