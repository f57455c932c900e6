"""One SGD training step per zoo model in torch's default layout (NCHW) and channels-last.

CPU training lays 4-D weights out channels-last (fedmq/models.py `trains_channels_last`):
oneDNN's convolutions and max pooling take that path. Both layouts are timed in one run, each
twice, alternating, with the median of their steps; the ratio is what the layout buys here.

    OMP_NUM_THREADS=1 python -m bench layout     # -> bench/results/layout.json
"""

from __future__ import annotations

import os
import statistics

import torch

from bench.bench_reply_ceiling import step_cost
from fedmq.models import build_model, model_spec

MODELS = ("digits-cnn", "cnn28", "cnn32", "resnet20", "resnet20-gn",
          "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10")
BATCH = 32


def step_ms(name: str, channels_last: bool, repeats: int) -> float:
    """Median milliseconds of one SGD step (forward, backward, update) of `name` on BATCH samples."""
    spec = model_spec(name)
    g = torch.Generator().manual_seed(0)
    x = torch.rand((BATCH, *spec.input_shape), generator=g)
    y = torch.randint(0, spec.num_classes, (BATCH,), generator=g)
    model = build_model(name, seed=0).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return 1e3 * step_cost(model, list(model.parameters()), x, y, repeats)[1]


def run(quick: bool = False) -> dict:
    repeats = 5 if quick else 20
    rows = {}
    for name in MODELS[:2] if quick else MODELS:
        nchw, nhwc = [], []
        for _ in range(2):
            nchw.append(step_ms(name, False, repeats))
            nhwc.append(step_ms(name, True, repeats))
        a, b = statistics.mean(nchw), statistics.mean(nhwc)
        rows[name] = {"nchw_ms": round(a, 2), "channels_last_ms": round(b, 2), "speedup": round(a / b, 2)}
        print(f"{name:62s} NCHW {a:8.2f} ms  channels-last {b:8.2f} ms  x{a / b:4.2f}", flush=True)
    return {"batch": BATCH, "torch_threads": torch.get_num_threads(), "load_before": round(os.getloadavg()[0], 1),
            "rows": rows}
