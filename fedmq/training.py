"""Supervised training of a zoo model from a flat vector, with optional proximal anchors.

One loop serves the server (pre-training cluster models) and the device (local training
with the proximal term (rho/2)||v - u||^2, or FedSoft's sum_k alpha_k (rho/2)||v - w_k||^2).
Deterministic for a given seed on a given machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.models import build_model, load_vector, to_vector


@dataclass
class TrainResult:
    vector: torch.Tensor
    epochs_done: int
    samples_seen: int
    seconds: float
    final_loss: float
    stopped_early: bool = False


def fit(
    model_name: str,
    start: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.01,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    anchors: Sequence[tuple[torch.Tensor, float]] = (),
    seed: int = 0,
    max_seconds: float | None = None,
    should_stop: Callable[[int, float], bool] | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train from `start` on (x, y); each anchor (w, c) adds (c/2)||v - w||^2 to the loss.

    `max_seconds` stops mid-epoch; `should_stop(epochs_done, elapsed)` is asked before each
    epoch (deadline-aware training stops when the next epoch would not fit).
    """
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"need matching, non-empty x and y, got {len(x)} and {len(y)}")
    model: nn.Module = load_vector(build_model(model_name), start)
    model.train()
    params = list(model.parameters())
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum,
                                                     weight_decay=weight_decay)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; use sgd or adam")
    anchor_views = [(w.detach().to(x.device), float(c)) for w, c in anchors if c > 0]
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    seen, done, loss_value, stopped = 0, 0, float("nan"), False
    for epoch in range(epochs):
        elapsed = time.perf_counter() - t0
        if should_stop is not None and should_stop(epoch, elapsed):
            stopped = True
            break
        order = torch.randperm(len(x), generator=gen)
        total, batches = 0.0, 0
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            if anchor_views:
                v = torch.cat([p.reshape(-1) for p in params])
                for w, c in anchor_views:
                    loss = loss + 0.5 * c * torch.sum((v - w) ** 2)
            loss.backward()
            opt.step()
            total += loss.item()
            batches += 1
            seen += len(idx)
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stopped = True
                break
        loss_value = total / max(batches, 1)
        if stopped:
            break
        done += 1
        if on_epoch is not None:
            on_epoch(epoch, loss_value)
    return TrainResult(to_vector(model), done, seen, time.perf_counter() - t0, loss_value, stopped)


@torch.no_grad()
def evaluate(model_name: str, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = 1024) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the model `vector` on (x, y)."""
    model = load_vector(build_model(model_name), vector).eval()
    loss, correct = 0.0, 0
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size])
        loss += float(nn.functional.cross_entropy(logits, y[i : i + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[i : i + batch_size]).sum())
    n = max(len(x), 1)
    return loss / n, correct / n
