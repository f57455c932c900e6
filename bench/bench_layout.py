"""One SGD training step, and one scoring pass, per zoo model in torch's default layout (NCHW)
and channels-last.

CPU training and scoring lay 4-D weights out channels-last (fedmq/models.py
`trains_channels_last`): oneDNN's convolutions and max pooling take that path. Both layouts are
timed in one run, each twice, alternating, with the median of their steps; the ratio is what the
layout buys here. The scoring pass is `fedmq.training.evaluate`'s: EVAL_BATCH samples, forward only.

    OMP_NUM_THREADS=1 python -m bench layout     # -> bench/results/layout.json
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.bench_reply_ceiling import step_cost
from fedmq.models import build_model, model_spec
from fedmq.training import EVAL_BATCH

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


def forward_ms(name: str, channels_last: bool, repeats: int) -> float:
    """Median milliseconds of one forward pass of `name` over EVAL_BATCH samples, no gradients."""
    spec = model_spec(name)
    x = torch.rand((EVAL_BATCH, *spec.input_shape), generator=torch.Generator().manual_seed(0))
    model = build_model(name, seed=0).eval()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    times = []
    with torch.inference_mode():
        model(x)
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(quick: bool = False) -> dict:
    repeats = 5 if quick else 20
    rows = {}
    for name in MODELS[:2] if quick else MODELS:
        row = {}
        for part, cost, batch in (("step", step_ms, BATCH), ("forward", forward_ms, EVAL_BATCH)):
            nchw, nhwc = [], []
            for _ in range(2):
                nchw.append(cost(name, False, repeats))
                nhwc.append(cost(name, True, repeats))
            a, b = statistics.mean(nchw), statistics.mean(nhwc)
            prefix = "" if part == "step" else "forward_"
            row |= {f"{prefix}nchw_ms": round(a, 2), f"{prefix}channels_last_ms": round(b, 2),
                    f"{prefix}speedup": round(a / b, 2)}
            print(f"{name:62s} {part:7s} ({batch:3d}) NCHW {a:8.2f} ms  channels-last {b:8.2f} ms  x{a / b:4.2f}",
                  flush=True)
        rows[name] = row
    return {"batch": BATCH, "forward_batch": EVAL_BATCH, "torch_threads": torch.get_num_threads(),
            "load_before": round(os.getloadavg()[0], 1), "rows": rows}
