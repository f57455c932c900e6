"""Codecs on the reference CNN: bytes per update, error, encode and decode speed.

The update: a cnn28 built with seed 0 (u) trained 5 SGD steps (lr 0.05, batch 32) on
random 28x28 inputs and labels from a fixed generator (v). "delta" rows encode v against
the base u (what an agent sends after training from the model it received); "full" rows
encode v alone. Errors are |decoded - v|; `update_rel_err` is ||decoded - v|| / ||v - u||,
the share of the update that was lost. Speeds are MB/s of the fp32 input (4 n bytes),
single-threaded numpy/zstd on this machine.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fedmq.codecs import CODECS, ErrorFeedback, decode, encode, encoded_size
from fedmq.models import build_model, model_spec, to_vector

ARCH = "cnn28"
SGD_STEPS = 5


def sgd_update(arch: str = ARCH, steps: int = SGD_STEPS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(u, v): a seeded init and the same model after `steps` SGD steps on random data."""
    model = build_model(arch, seed=seed)
    u = to_vector(model).numpy().copy()
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shape = model_spec(arch).input_shape
    for _ in range(steps):
        x = torch.randn(32, *shape, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return u, to_vector(model).numpy().copy()


def seconds_per_call(call, min_time: float, min_reps: int = 3) -> float:
    """Mean seconds per call over at least `min_reps` calls and `min_time` seconds."""
    call()  # warm up
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < min_time:
        call()
        reps += 1
    return (time.perf_counter() - start) / reps


def feedback_convergence(u: np.ndarray, v: np.ndarray, steps: int) -> dict:
    """Send the same update `steps` times with topk(0.05): relative error of the running sum."""
    update = v - u
    out = {}
    for name, feedback in (("with_feedback", ErrorFeedback()), ("without_feedback", None)):
        total = np.zeros(update.size, dtype=np.float64)
        for _ in range(steps):
            total += decode(encode(v, "topk", base=u, feedback=feedback), base=u) - u
        out[name] = round(float(np.linalg.norm(total - steps * update) / np.linalg.norm(steps * update)), 4)
    return out


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    u, v = sgd_update()
    n = v.size
    mb = 4 * n / 1e6
    fp32_raw = encoded_size(encode(v, "fp32", zstd=False))
    update_norm = float(np.linalg.norm(v - u))
    min_time = 0.05 if quick else 0.5
    variants = [(codec, {}) for codec in CODECS] + [("topk", {"topk_values": "fp16"})]
    rows = []
    for codec, extra in variants:
        label = codec + ("/fp16" if extra else "")
        for mode in ("delta", "full"):
            base = u if mode == "delta" else None
            for zstd in (False, True):
                wire = encode(v, codec, base=base, zstd=zstd, **extra)
                out = decode(wire, base=base)
                err = np.abs(out.astype(np.float64) - v)
                size = encoded_size(wire)
                enc_s = seconds_per_call(lambda: encode(v, codec, base=base, zstd=zstd, **extra), min_time)  # noqa: B023
                dec_s = seconds_per_call(lambda: decode(wire, base=base), min_time)  # noqa: B023
                rows.append({
                    "codec": label, "mode": mode, "zstd": zstd,
                    "bytes": size, "ratio_to_fp32_raw": round(size / fp32_raw, 4),
                    "max_abs_err": float(f"{err.max():.3e}"), "mean_abs_err": float(f"{err.mean():.3e}"),
                    "update_rel_err": round(float(np.linalg.norm(err) / update_norm), 4),
                    "encode_MBps": round(mb / enc_s, 1), "decode_MBps": round(mb / dec_s, 1),
                })
                print(f"{label:9s} {mode:5s} zstd={zstd!s:5s} {size:8d} B  x{size / fp32_raw:.3f}  "
                      f"max {err.max():.2e} mean {err.mean():.2e}  "
                      f"enc {mb / enc_s:7.1f} MB/s  dec {mb / dec_s:7.1f} MB/s", flush=True)
    return {
        "model": ARCH, "params": n, "fp32_raw_bytes": fp32_raw,
        "update": f"{SGD_STEPS} SGD steps (lr 0.05, batch 32) on random 28x28 data, seed 0",
        "update_max_abs": float(f"{np.abs(v - u).max():.3e}"),
        "update_mean_abs": float(f"{np.abs(v - u).mean():.3e}"),
        "defaults": {"int8_block": 256, "topk_ratio": 0.05, "zstd_level": 3},
        "rows": rows,
        "topk_feedback_running_sum_rel_err": feedback_convergence(u, v, 10 if quick else 40),
    }
