"""What one trained update costs a device, per model: seconds and peak memory.

Each model trains in a fresh process (`python -m bench.bench_device --one NAME`), so the peak
resident memory it reports is that model's alone; the process's memory after importing torch
and building the model is reported beside it, so what training adds is read off directly.
Training is the agent's own (edge_agent.trainer.train_local with the agent's defaults: 2
epochs, batch 32, SGD 0.01 / 0.9, the proximal term) on `SAMPLES` random samples of the
model's input shape: the cost does not depend on the values.

    python -m bench device            # -> bench/results/device.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SAMPLES = 350
"""The real-size scenario's largest agent (data.max_samples in realsize-shapes)."""
MODELS = ("cnn28", "resnet20-gn", "resnet20", "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10",
          "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10&train=head")
"""The last: its backbone frozen (fedmq/backbone.py), so the device trains and sends the classifier."""


def one(name: str, samples: int) -> dict:
    """Train one update of `name` here; the figures of this process."""
    import torch

    from bench.process_memory import status_mb
    from edge_agent.trainer import train_local
    from fedmq.config import AgentSettings
    from fedmq.models import build_model, model_spec, to_vector

    torch.set_num_threads(1)
    spec = model_spec(name)
    start = to_vector(build_model(name, seed=0))
    g = torch.Generator().manual_seed(0)
    x = torch.rand((samples, *spec.input_shape), generator=g)
    y = torch.randint(0, spec.num_classes, (samples,), generator=g)
    before = round(status_mb("VmRSS"), 1)
    a = AgentSettings()
    t0 = time.perf_counter()
    train_local(name, start, x, y, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, momentum=a.momentum,
                rho=a.rho)
    seconds = time.perf_counter() - t0
    peak = round(status_mb("VmHWM"), 1)
    return {"model": name, "parameters": spec.param_numel, "upload_values": spec.numel, "samples": samples, "epochs": a.epochs,
            "batch_size": a.batch_size, "train_s": round(seconds, 2), "rss_before_training_mb": before,
            "peak_rss_mb": peak, "training_adds_mb": round(peak - before, 1)}


def run(quick: bool = False) -> dict:
    samples = 64 if quick else SAMPLES
    rows = []
    for name in MODELS[:1] if quick else MODELS:
        out = subprocess.run([sys.executable, "-m", "bench.bench_device", "--one", name, "--samples", str(samples)],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:60s} {row['train_s']:7.2f} s  peak {row['peak_rss_mb']:7.1f} MB "
              f"(+{row['training_adds_mb']} MB training)", flush=True)
        rows.append(row)
    return {"load_before": round(os.getloadavg()[0], 1), "rows": rows}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="one model's update in this process (what `run` starts per model)")
    parser.add_argument("--one", required=True)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    args = parser.parse_args()
    print(json.dumps(one(args.one, args.samples)), flush=True)
