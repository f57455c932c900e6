"""The most replies per second this machine can make when every layer trains.

A fine-tune reply is a fixed amount of arithmetic: its SGD steps (personalize_epochs over the
kept proxy samples, stretched to personalize_min_steps) times one training step's FLOPs
(forward, backward and the update; torch's flop counter). Dividing by the FLOP rate a training
step reaches here gives the reply's floor in seconds and the ceiling in uploads per second,
before the estimate, the cluster update and the journal add to it. The matmul rate beside it is
what the cores do at their best. cnn28 (106 k parameters) at the realistic server budget
(K = 2, 100 proxy samples per cluster) against the `head` recipe's step.

    python -m bench reply_ceiling      # -> bench/results/reply_ceiling.json
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from aggregator.evaluator import LayerSplit
from aggregator.personalize import reply_schedule
from bench.bench_aggregator import matmul_gflops
from fedmq.config import CDFLSettings
from fedmq.models import build_model, model_spec, trains_channels_last

ARCH = "cnn28"
K, PROXY_PER_CLUSTER = 2, 100


def reply_steps(settings: CDFLSettings, kept: int) -> int:
    """SGD steps of one reply over `kept` proxy samples, as the aggregator plans them."""
    epochs, per_epoch = reply_schedule(settings.personalize_epochs, settings.personalize_samples,
                                       settings.personalize_batch_size, settings.personalize_min_steps, kept)
    return epochs * per_epoch


def step_cost(model: torch.nn.Module, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               repeats: int) -> tuple[float, float]:
    """(FLOPs, median seconds) of one SGD step of `params` on (x, y)."""
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    with FlopCounterMode(display=False) as counter:
        step()
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(counter.get_total_flops()), statistics.median(times)


def run(quick: bool = False) -> dict:
    settings = CDFLSettings()
    batch = settings.personalize_batch_size
    repeats = 10 if quick else 50
    spec = model_spec(ARCH)
    g = torch.Generator().manual_seed(0)
    x = torch.rand((batch, *spec.input_shape), generator=g)
    y = torch.randint(0, spec.num_classes, (batch,), generator=g)
    model = build_model(ARCH, seed=0)
    nchw_flops, nchw_s = step_cost(model, list(model.parameters()), x, y, repeats)
    if trains_channels_last("cpu"):  # the layout the aggregator's replies train in
        model = build_model(ARCH, seed=0).to(memory_format=torch.channels_last)
    all_flops, all_s = step_cost(model, list(model.parameters()), x, y, repeats)
    split = LayerSplit(model, spec, torch.device("cpu"))
    with torch.no_grad():
        features = split.lower(x)
    head = split.upper.train()
    head_flops, head_s = step_cost(head, list(head.parameters()), features, y, repeats)
    peak = matmul_gflops(torch.device("cpu"))
    steps = reply_steps(settings, K * PROXY_PER_CLUSTER)
    steps_no_floor = reply_steps(CDFLSettings(personalize_min_steps=0), K * PROXY_PER_CLUSTER)
    rows = {}
    for name, n, flops, seconds in (("every layer (default for cnn28)", steps, all_flops, all_s),
                                    ("every layer, personalize_min_steps = 0", steps_no_floor, all_flops, all_s),
                                    ("every layer, torch's default layout (NCHW)", steps, nchw_flops, nchw_s),
                                    ("head (personalize_layers = head)", steps, head_flops, head_s)):
        rows[name] = {"steps": n, "step_gflop": round(flops / 1e9, 4), "step_ms": round(1e3 * seconds, 2),
                      "achieved_gflops": round(flops / seconds / 1e9, 1),
                      "reply_floor_s": round(n * seconds, 3), "max_uploads_per_s": round(1 / (n * seconds), 2)}
        print(f"{name:42s} {n:4d} steps x {1e3 * seconds:6.2f} ms = {n * seconds:6.3f} s "
              f"({flops / seconds / 1e9:5.1f} GFLOP/s): <= {1 / (n * seconds):5.2f} uploads/s", flush=True)
    return {"arch": ARCH, "K": K, "proxy_per_cluster": PROXY_PER_CLUSTER, "batch": batch,
            "torch_threads": torch.get_num_threads(), "matmul_gflops": round(peak, 1),
            "load_before": round(os.getloadavg()[0], 1), "rows": rows,
            "needed_for_2_per_s_gflops": round(2 * steps * all_flops / 1e9, 1),
            "cores": os.cpu_count(), "note": f"{math.ceil(K * PROXY_PER_CLUSTER / batch)} batches per epoch"}
