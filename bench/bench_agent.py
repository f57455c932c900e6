"""What one update costs an edge agent with the reference CNN ("cnn28"), on this machine.

- local training: 1 epoch and the default 2 epochs on 1000 local samples (digits upscaled
  to 28x28, 70 % upright / 30 % rotated 180 degrees), trainer defaults otherwise;
- upload bytes of that update: raw fp32 and the codecs (delta from the received model);
- ONNX export: a fresh export with each exporter, and the weight swap into a cached graph;
- inference latency, ONNX Runtime against eager torch, batch 1 and 256, one thread each
  (the agent's default), median over repeats;
- (full run only) the sweep that set the trainer's defaults: accuracy change on a local
  rotated-digits test mixture after local training, for a partly trained and a good
  received model, over optimizer / lr / epochs (digits-cnn, 800 local samples).
"""

from __future__ import annotations

import statistics
import time

import msgpack
import numpy as np
import torch
from sklearn.datasets import load_digits

from edge_agent.inference import OnnxPredictor, TorchPredictor, export_onnx
from edge_agent.trainer import evaluate, train_local
from fedmq.models import build_model, model_spec, to_vector

MODEL = "cnn28"


def _digits(size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size is not None:
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def _mixture(x: torch.Tensor, y: torch.Tensor, props: list[float], seed: int):
    """Each sample rotated by k * 90 degrees with probability props[k]."""
    ks = np.random.default_rng(seed).choice(len(props), size=len(y), p=props)
    out = x.clone()
    for k in range(1, len(props)):
        sel = torch.from_numpy(ks == k)
        out[sel] = torch.rot90(x[sel], k, dims=(-2, -1))
    return out, y


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


def _update_cost(quick: bool) -> dict:
    x, y = _digits(28)
    lx, ly = _mixture(x[:1000], y[:1000], [0.7, 0.0, 0.3, 0.0], seed=0)
    u = to_vector(build_model(MODEL, seed=0))
    train_local(MODEL, u, lx, ly, epochs=1)  # warm-up: the first run in a process is ~5x slower
    repeats = 1 if quick else 3
    one = [train_local(MODEL, u, lx, ly, epochs=1) for _ in range(repeats)]
    two = [train_local(MODEL, u, lx, ly) for _ in range(repeats)]  # the default: 2 epochs
    one_s = statistics.median(r.seconds for r in one)
    two_s = statistics.median(r.seconds for r in two)
    out: dict = {
        "model": MODEL, "parameters": model_spec(MODEL).numel, "local_samples": 1000,
        "torch_threads": torch.get_num_threads(), "median_of": repeats,
        "train_1_epoch_s": round(one_s, 3),
        "train_default_2_epochs_s": round(two_s, 3),
        "train_sample_epochs_per_s": round(2000 / two_s, 1),
    }
    v = two[0].vector
    upload = {"raw_fp32_bytes": 4 * v.numel()}
    try:
        from fedmq import codecs
    except ImportError:
        upload["note"] = "fedmq.codecs not importable: raw fp32 only"
    else:
        for label, kwargs in [("fp32_delta_zstd", {"codec": "fp32"}), ("fp16_delta_zstd", {"codec": "fp16"}),
                              ("int8_delta_zstd", {"codec": "int8"}), ("topk5%_delta_zstd", {"codec": "topk"})]:
            wire = codecs.encode(v, base=u, zstd=True, **kwargs)
            upload[f"{label}_bytes"] = len(msgpack.packb(wire, use_bin_type=True))
    out["upload"] = upload
    return out


def onnx_cost(quick: bool, model: str = MODEL) -> dict:
    """Export times (fresh, and a weight swap into the cached graph) and inference latency,
    ONNX Runtime against torch, one thread, batch 1 and 256."""
    shape = model_spec(model).input_shape
    vector = to_vector(build_model(model, seed=1))
    export = {}
    for label, exporter in [("dynamo_first_in_process_s", "dynamo"), ("dynamo_again_s", "dynamo"),
                            ("legacy_s", "legacy")]:
        blob, info = export_onnx(model, vector, exporter=exporter, reuse_graph=False)
        export[label] = round(info.seconds, 3)
        export["onnx_bytes"] = len(blob)
    export_onnx(model, vector, exporter="dynamo")  # fills the graph cache
    _, info = export_onnx(model, to_vector(build_model(model, seed=2)), exporter="dynamo")
    export["weight_swap_into_cached_graph_s"] = round(info.seconds, 4)
    t0 = time.perf_counter()
    onnx_predictor = OnnxPredictor(model, vector, intra_op_num_threads=1)
    export["predictor_with_cached_graph_s"] = round(time.perf_counter() - t0, 3)
    export["providers"] = onnx_predictor.providers

    torch_predictor = TorchPredictor(model, vector)
    latency = {}
    for batch, repeats in [(1, 50 if quick else 300), (256, 5 if quick else 30)]:
        x = np.random.default_rng(batch).standard_normal((batch, *shape)).astype(np.float32)
        assert np.abs(onnx_predictor.predict(x) - torch_predictor.predict(x)).max() < 1e-4
        latency[f"batch{batch}"] = {
            "onnxruntime_ms": _median_ms(lambda x=x: onnx_predictor.predict(x), repeats),
            "torch_ms": _median_ms(lambda x=x: torch_predictor.predict(x), repeats),
        }
    return {"export": export, "inference_1_thread": latency}


def _trainer_sweep() -> list[dict]:
    """Accuracy change after local training from a partly trained / a good received model."""
    x, y = _digits(None)
    glob, local, test = slice(0, 600), slice(600, 1400), slice(1400, None)
    gx = torch.cat([torch.rot90(x[glob], k, dims=(-2, -1)) for k in range(4)])
    gy = y[glob].repeat(4)
    u0 = to_vector(build_model("digits-cnn", seed=0))
    starts = {"partial": train_local("digits-cnn", u0, gx, gy, epochs=1, lr=0.05, rho=0.0, seed=1).vector,
              "good": train_local("digits-cnn", u0, gx, gy, epochs=8, lr=0.05, rho=0.0, seed=1).vector}
    configs = [("sgd", 0.05, 1), ("sgd", 0.02, 1), ("sgd", 0.01, 1), ("sgd", 0.005, 1), ("sgd", 0.01, 2),
               ("sgd", 0.02, 2), ("adam", 1e-3, 1), ("adam", 1e-3, 2), ("adam", 3e-4, 1)]
    mixtures = [[0.7, 0, 0.3, 0], [0, 0.5, 0, 0.5], [0.4, 0.2, 0.2, 0.2]]
    gains: dict[tuple, list[float]] = {}
    for props in mixtures:
        for seed in (0, 1):
            lx, ly = _mixture(x[local], y[local], props, seed)
            tx, ty = _mixture(x[test], y[test], props, seed + 100)
            for start_name, start in starts.items():
                base = evaluate("digits-cnn", start, tx, ty)[0]
                for opt, lr, epochs in configs:
                    r = train_local("digits-cnn", start, lx, ly, epochs=epochs, lr=lr, optimizer=opt, seed=seed)
                    gain = evaluate("digits-cnn", r.vector, tx, ty)[0] - base
                    gains.setdefault((opt, lr, epochs, start_name), []).append(gain)
    rows = []
    for opt, lr, epochs in configs:
        row: dict = {"optimizer": opt, "lr": lr, "epochs": epochs}
        for start_name in starts:
            g = gains[(opt, lr, epochs, start_name)]
            row[f"{start_name}_mean_gain"] = round(float(np.mean(g)), 3)
            row[f"{start_name}_min_gain"] = round(float(np.min(g)), 3)
        rows.append(row)
    return rows


def run(quick: bool) -> dict:
    # One thread, as on a device that runs other things (and as the agent defaults to):
    # on this shared 2-core machine two threads made training times swing 1.4-4.4 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = {"update": _update_cost(quick), "onnx": onnx_cost(quick)}
        if not quick:
            figures["trainer_defaults_sweep"] = _trainer_sweep()
    finally:
        torch.set_num_threads(threads)
    return figures
