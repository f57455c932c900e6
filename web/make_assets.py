"""Make the browser agent's bundled sample sets in web/assets/ (generated, not committed).

The page trains on samples of its own, raw as a camera or a drawing gives them; it normalizes
them, and sketches them, as the fleet's published device spec says (docs/protocol.md, "Device
spec"), so one page joins a fleet of any model whose input shape it has samples for:

- samples-1x8x8.json: scikit-learn's 8x8 digits, raw pixel values 0..16 (the digits fleets);
- samples-1x28x28.json: the same digits as 28x28 images of 0..255 pixels, each upsampled to
  20x20 and centred (the cnn28 fleets, e.g. scripts/digits28_files.py's stand-in for MNIST);
- samples-3x32x32.json: `shapes`' test images as 8-bit colour pixels (the 32x32 colour fleets).

    .venv/bin/python web/make_assets.py            # or: --samples 150 --out web/assets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

HERE = Path(__file__).resolve().parent


def upsampled(images: np.ndarray) -> np.ndarray:
    """8x8 digits (0..16) as 28x28 images of 0..255: bilinear to 20x20, centred."""
    big = F.interpolate(torch.from_numpy(images[:, None] / 16.0), size=(20, 20), mode="bilinear",
                        align_corners=False).numpy()[:, 0]
    out = np.zeros((len(images), 28, 28))
    out[:, 4:24, 4:24] = big
    return np.clip(np.rint(out * 255), 0, 255).astype(int)


def shapes_pixels(samples: int) -> tuple[np.ndarray, list[int]]:
    """The first `samples` of `shapes`' test split as 0..255 colour pixels (C, H, W), as a camera
    gives them: the page normalizes them by the fleet's device spec."""
    from fedmq.data.sources import shape_images

    images, labels = shape_images(train=False)
    pixels = np.clip(np.rint(images[:samples] * 255), 0, 255).astype(int)
    return pixels, labels[:samples].astype(int).tolist()


def make_assets(out: Path, samples: int = 150, offset: int = 1500) -> list[Path]:
    """Write the files into `out`; `samples` digits from index `offset` on (the tail of the set)."""
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    pick = slice(offset, offset + samples)
    labels = digits.target[pick].astype(int).tolist()
    source = f"sklearn load_digits()[{offset}:{offset + samples}]"
    sets = {"1x8x8": (digits.images[pick].astype(int), labels, 16, source),
            "1x28x28": (upsampled(digits.images[pick]), labels, 255, f"{source}, upsampled to 20x20 in 28x28"),
            "3x32x32": (*shapes_pixels(samples), 255, f"fedmq shapes test split [0:{samples}], 8-bit")}
    paths = []
    for shape, (pixels, set_labels, top, set_source) in sets.items():
        doc = {"source": set_source, "shape": [int(v) for v in shape.split("x")], "max": top,
               "pixels": pixels.reshape(samples, -1).tolist(), "labels": set_labels}
        path = out / f"samples-{shape}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "assets")
    parser.add_argument("--samples", type=int, default=150)
    args = parser.parse_args(argv)
    if not 1 <= args.samples <= 297:
        print(f"make_assets: --samples must be in 1..297, got {args.samples}", file=sys.stderr)
        return 2
    for path in make_assets(args.out, args.samples):
        print(f"{path} {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
