"""Make the browser agent's bundled files in web/assets/ (generated, not committed):

- digits.json: the page's own sample set, 8x8 sklearn digits as raw pixel values 0..16 with
  labels (the page normalizes them as fedmq's loader does, docs/protocol.md "Inputs");
- sketch-64.f32: the CDFL sketch's random feature map for 64-value inputs (fedmq/sketch.py:
  W [64, 1024] then b [1024], little-endian float32), made by numpy's PCG64 stream, which the
  browser cannot reproduce itself.

    .venv/bin/python web/make_assets.py            # or: --samples 150 --out web/assets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

from fedmq import sketch

HERE = Path(__file__).resolve().parent


def make_assets(out: Path, samples: int = 150, offset: int = 1500) -> list[Path]:
    """Write the files into `out`; `samples` digits from index `offset` on (the tail of the set)."""
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    pick = slice(offset, offset + samples)
    doc = {"source": f"sklearn load_digits()[{offset}:{offset + samples}]",
           "pixels": digits.data[pick].astype(int).tolist(), "labels": digits.target[pick].astype(int).tolist()}
    data_path = out / "digits.json"
    data_path.write_text(json.dumps(doc, separators=(",", ":")))
    w, b = sketch._features(64)  # the feature map the aggregator's sketch estimator uses
    map_path = out / "sketch-64.f32"
    map_path.write_bytes(np.concatenate([w.numpy().ravel(), b.numpy()]).astype("<f4").tobytes())
    return [data_path, map_path]


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
