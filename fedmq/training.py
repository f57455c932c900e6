"""Supervised training of a zoo model from a flat vector, with proximal anchors.

One loop serves the server (pre-training cluster models, distillation later) and the device
(CDFL's local objective, loss + (rho/2)||v - u||^2, and FedSoft's sum_k alpha_k (rho/2)
||v - w_k||^2; see edge_agent/trainer.py). Deterministic for a given seed on a given machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.models import build_model, load_vector, model_spec, to_vector, trains_channels_last
from fedmq.optimizers import SGD, Adam
from fedmq.privacy import DpSgd, private_gradients

OPTIMIZERS = ("sgd", "adam")


@dataclass
class TrainResult:
    """What one local training run produced. `epochs_done` counts complete epochs."""

    vector: torch.Tensor
    epochs_done: int
    samples_seen: int
    seconds: float
    final_loss: float
    stopped_early: bool = False
    steps: int = 0
    """Mini-batches taken (what DP-SGD's accountant charges)."""


EpochCallback = Callable[[int, float], "bool | None"]
"""on_epoch(epoch_index, mean_loss_of_that_epoch); returning False stops training."""


def _check_data(model_name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    spec = model_spec(model_name)
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(f"{model_name} wants inputs (N, {', '.join(map(str, spec.input_shape))}), "
                         f"got {tuple(x.shape)}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"labels must be ({x.shape[0]},), got {tuple(y.shape)}")


def _model_at(model_name: str, vector: torch.Tensor) -> nn.Module:
    spec = model_spec(model_name)
    if vector.ndim != 1 or vector.numel() != spec.numel:
        raise ValueError(f"{model_name} has {spec.numel} parameters, got a vector of shape {tuple(vector.shape)}")
    return load_vector(build_model(model_name), vector.detach().float().cpu())


def fit(model_name: str, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
        anchors: Sequence[tuple[torch.Tensor, float]] = (), epochs: int = 1, batch_size: int = 32,
        lr: float = 0.01, optimizer: str = "sgd", momentum: float = 0.9, weight_decay: float = 0.0,
        seed: int = 0, max_seconds: float | None = None,
        on_epoch: EpochCallback | None = None, dp: DpSgd | None = None,
        min_batch: int | None = None) -> TrainResult:
    """Train from `start` on (x, y); each anchor (w, c) adds (c/2)||v - w||^2 to the loss.

    Anchors are folded into one proximal centre: sum_k c_k (v - w_k) = C (v - w_bar) with
    C = sum_k c_k and w_bar = sum_k c_k w_k / C, and that gradient is added to the
    parameters' gradients directly (no second pass); `final_loss` is the data loss alone.
    Deterministic given `seed`, dropout included. `max_seconds` stops at the first batch boundary past the
    budget; `on_epoch(epoch, mean_loss)` may return False to stop after that epoch. `dp`:
    DP-SGD (fedmq/privacy.py), per-sample gradients clipped and noised; `steps` in the result
    counts the mini-batches, what the privacy accountant charges. `min_batch`: a batch-norm
    model's shortest last batch (a shorter one joins the batch before it); None: half the
    batch size (`short_batch`), never under 2.
    """
    center, rho = _fold_anchors(anchors)
    _check_data(model_name, x, y)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if epochs < 0 or batch_size < 1 or lr <= 0 or rho < 0:
        raise ValueError("need epochs >= 0, batch_size >= 1, lr > 0, rho >= 0")
    if optimizer == "sgd" and lr * rho >= 2 * (1 + momentum):
        # the proximal term alone is a quadratic: heavy-ball SGD on it diverges beyond this
        raise ValueError(f"unstable: SGD with lr * rho = {lr * rho:g} >= 2 * (1 + momentum) "
                         f"= {2 * (1 + momentum):g} diverges; lower lr or rho")
    t0 = time.perf_counter()
    model = _model_at(model_name, start)
    if dp is None and trains_channels_last("cpu"):  # DP's per-sample gradients keep torch's layout
        model = model.to(memory_format=torch.channels_last)
    model.train()
    params = list(model.parameters())
    centers: list[torch.Tensor] = []
    if center is not None and rho > 0:
        offset = 0
        for p in params:
            centers.append(center[offset:offset + p.numel()].view_as(p).detach().float())
            offset += p.numel()
    if optimizer == "sgd":
        opt: SGD | Adam = SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        opt = Adam(params, lr=lr, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    samples_seen = 0
    steps = 0
    epochs_done = 0
    final_loss = math.nan
    stopped_early = False
    starts = list(range(0, n, batch_size))
    spec = model_spec(model_name)
    if dp is not None and spec.param_numel < spec.numel:
        raise ValueError(f"{model_name}: DP-SGD needs per-sample gradients, which batch norm does not have "
                         "(it mixes the samples of a batch); use a model without it (e.g. GroupNorm)")
    noise = torch.Generator().manual_seed(dp.seed) if dp is not None else None
    shortest = short_batch(batch_size) if min_batch is None else max(2, min_batch)
    if spec.param_numel < spec.numel and len(starts) > 1 and n - starts[-1] < shortest:
        # Batch norm normalizes each channel over the batch: on a handful of samples (one value
        # per channel after MobileNetV3's pooling) its gradients explode. A tail of 2 took a
        # pre-trained MobileNetV3 from 0.81 to chance in one update, 3-4 to 0.31-0.66
        # (docs/models.md). A short tail joins the batch before it; models without statistics
        # keep their draws.
        starts.pop()
    ends = starts[1:] + [n]
    # Dropout draws from torch's global generator: seeded here and restored after, so that a
    # model with dropout (MobileNetV3's classifier) trains the same for the same seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for epoch in range(epochs):
            order = torch.randperm(n, generator=generator)
            total, count = 0.0, 0
            for i, end in zip(starts, ends, strict=True):
                if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                    stopped_early = True
                    break
                idx = order[i:end]
                opt.zero_grad(set_to_none=True)
                if dp is not None:
                    assert noise is not None
                    loss = private_gradients(model, x[idx], y[idx], dp, noise)
                else:
                    loss = loss_fn(model(x[idx]), y[idx])
                    loss.backward()
                steps += 1
                if centers:
                    with torch.no_grad():
                        for p, c in zip(params, centers, strict=True):
                            p.grad.add_(p - c, alpha=rho)
                opt.step()
                total += float(loss.detach()) * len(idx)
                count += len(idx)
            samples_seen += count
            if count:
                final_loss = total / count
            if stopped_early:
                break
            epochs_done += 1
            if on_epoch is not None and on_epoch(epoch, final_loss) is False:
                stopped_early = epochs_done < epochs
                break
    return TrainResult(to_vector(model), epochs_done, samples_seen, time.perf_counter() - t0,
                       final_loss, stopped_early, steps)


def short_batch(batch_size: int) -> int:
    """Batch-norm models train no batch smaller than this (half the batch size, at least 2)."""
    return max(2, batch_size // 2)


def _fold_anchors(anchors: Sequence[tuple[torch.Tensor, float]]) -> tuple[torch.Tensor | None, float]:
    kept = [(w.detach().float().cpu(), float(c)) for w, c in anchors if float(c) > 0]
    if any(c < 0 for _, c in anchors):
        raise ValueError("anchor strengths must be >= 0")
    if not kept:
        return None, 0.0
    mass = sum(c for _, c in kept)
    center = sum(c * w.double() for w, c in kept) / mass
    return center.float(), mass


EVAL_BATCH = 256
"""Samples per forward pass when scoring a model. On a CPU, one thread, 256 is 2-4x faster than
1024 (digits-cnn 0.03 / 0.10 s, cnn28 0.88 / 1.82 s on 3,000 samples; resnet20-gn 5.3 / 9.8 s
on 1,500): the activations of a larger batch no longer fit the caches."""


def _evaluated(model_name: str, vector: torch.Tensor) -> nn.Module:
    """The model `vector` for forward passes only: in eval mode, and channels-last where training
    is (a forward pass gains more than a training step: `python -m bench layout`)."""
    model = _model_at(model_name, vector).eval()
    return model.to(memory_format=torch.channels_last) if trains_channels_last("cpu") else model


@torch.no_grad()
def per_sample_losses(model_name: str, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                      batch_size: int = EVAL_BATCH) -> torch.Tensor:
    """Cross-entropy of each sample under the model `vector`, shape (N,)."""
    _check_data(model_name, x, y)
    model = _evaluated(model_name, vector)
    out = [nn.functional.cross_entropy(model(x[i:i + batch_size]), y[i:i + batch_size], reduction="none")
           for i in range(0, x.shape[0], batch_size)]
    return torch.cat(out) if out else torch.empty(0)


@torch.no_grad()
def evaluate(model_name: str, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = EVAL_BATCH) -> tuple[float, float]:
    """(accuracy, mean loss) of the model `vector` on (x, y): the agent's reference accuracy."""
    _check_data(model_name, x, y)
    if x.shape[0] == 0:
        return math.nan, math.nan
    model = _evaluated(model_name, vector)
    correct, loss = 0, 0.0
    for i in range(0, x.shape[0], batch_size):
        logits = model(x[i:i + batch_size])
        correct += int((logits.argmax(1) == y[i:i + batch_size]).sum())
        loss += float(nn.functional.cross_entropy(logits, y[i:i + batch_size], reduction="sum"))
    return correct / x.shape[0], loss / x.shape[0]
