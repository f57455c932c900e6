"""MNIST-format files made from scikit-learn's 8x8 digits: a 28x28 stand-in, not MNIST.

    python scripts/digits28_files.py DIR    # writes DIR/MNIST/raw/*-ubyte (60,000 train / 10,000 test)

Then `--data-dir DIR` runs any experiment command on it exactly as on MNIST (rotated-mnist,
cnn28). It is for timing and for a 28x28 check of what held on 8x8 digits, offline: each image
is a digits image upsampled to 20x20, placed at a random offset of up to 2 px from the centre
of a 28x28 frame, with a random stroke gain (0.8-1.2) and pixel noise (sigma 0.05). Train
images come from fedmq's digits train split, test images from its test split, so the two
share no base image; but 60,000 images are drawn from 1,257 bases, so it has far less variety
than MNIST. docs/results_cdfl.md#headline reports runs on it. Deterministic.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedmq.data.sources import _digits_split  # noqa: E402


def write_idx(path: Path, array: np.ndarray) -> None:
    """One IDX file as torchvision's MNIST reader expects it (uint8 images or labels)."""
    with open(path, "wb") as f:
        f.write(struct.pack(">IIII", 2051, *array.shape) if array.ndim == 3 else struct.pack(">II", 2049, len(array)))
        f.write(array.astype(np.uint8).tobytes())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/digits28_files.py", description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="data root to write MNIST/raw/ under")
    p.add_argument("--train", type=int, default=60000)
    p.add_argument("--test", type=int, default=10000)
    args = p.parse_args(argv)
    raw = args.root / "MNIST" / "raw"
    if any(raw.glob("*-ubyte")):
        p.error(f"{raw} already holds IDX files; give an empty root")
    raw.mkdir(parents=True, exist_ok=True)
    images, labels, train_idx, test_idx = _digits_split()
    big = F.interpolate(torch.from_numpy(images / 16.0), size=(20, 20), mode="bilinear",
                        align_corners=False).numpy()[:, 0]
    rng = np.random.default_rng(0)
    for split, idx, n in (("train", train_idx, args.train), ("t10k", test_idx, args.test)):
        pick = rng.choice(idx, n)
        out = np.zeros((n, 28, 28), np.float32)
        dy, dx = rng.integers(2, 7, n), rng.integers(2, 7, n)
        gain = rng.uniform(0.8, 1.2, n)
        for i, j in enumerate(pick):
            out[i, dy[i]:dy[i] + 20, dx[i]:dx[i] + 20] = big[j]
        out = np.clip(out * gain[:, None, None] + rng.normal(0, 0.05, out.shape), 0, 1) * 255
        write_idx(raw / f"{split}-images-idx3-ubyte", out)
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels[pick])
    print(f"wrote {args.train} train and {args.test} test images to {raw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
