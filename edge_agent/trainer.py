"""Local training on the device: proximal SGD/Adam from the received model, and FedSoft's pieces.

CDFL's local objective is the local loss plus (rho/2) ||v - u||^2, u the model the agent
received. FedSoft-Async's is the local loss plus sum_k alpha_k (rho/2) ||v - w_k||^2 over
the K cluster models. The second is the first in disguise: its gradient
rho * sum_k alpha_k (v - w_k) = rho * A * (v - w_bar), with A = sum_k alpha_k and
w_bar = sum_k alpha_k w_k / A, so both run through one loop with a proximal centre and
an effective rho. The proximal gradient is added to the parameters' gradients directly
(no second forward pass); `final_loss` is the data loss alone.

Defaults (2 epochs, batch 32, SGD lr 0.01, momentum 0.9, rho 0.1) were set by a
measurement on rotated digits (docs/edge_agent.md): DESIGN.md's lr 0.05 lowered the
accuracy of good received models (by up to 0.025 here too); SGD lr 0.01 for 2 epochs
improved every case, partly trained (+0.16 to +0.26) and good (+0.03 to +0.08) models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.models import build_model, load_vector, model_spec, to_vector

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


def _train(model_name: str, start: torch.Tensor, center: torch.Tensor | None, rho: float,
           x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, lr: float,
           optimizer: str, momentum: float, weight_decay: float, seed: int,
           max_seconds: float | None, on_epoch: EpochCallback | None) -> TrainResult:
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
    model.train()
    params = list(model.parameters())
    centers: list[torch.Tensor] = []
    if center is not None and rho > 0:
        offset = 0
        for p in params:
            centers.append(center[offset:offset + p.numel()].view_as(p).detach().float())
            offset += p.numel()
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    samples_seen = 0
    epochs_done = 0
    final_loss = math.nan
    stopped_early = False
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator)
        total, count = 0.0, 0
        for i in range(0, n, batch_size):
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                stopped_early = True
                break
            idx = order[i:i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
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
                       final_loss, stopped_early)


def train_local(model_name: str, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
                epochs: int = 2, batch_size: int = 32, lr: float = 0.01, optimizer: str = "sgd",
                momentum: float = 0.9, weight_decay: float = 0.0, rho: float = 0.1, seed: int = 0,
                max_seconds: float | None = None, on_epoch: EpochCallback | None = None) -> TrainResult:
    """Train from the received model `start` (u) on local data; loss + (rho/2)||v - u||^2.

    Deterministic given `seed` (it fixes the batch order; there is no other randomness).
    `max_seconds` stops at the first batch boundary past the budget (deadline-aware
    training); `on_epoch` may return False to stop after an epoch (CATA-Fed's rule: stop
    when the remaining time is below the mean epoch time).
    """
    start = start.detach().float().cpu()
    return _train(model_name, start, start, rho, x, y, epochs=epochs, batch_size=batch_size, lr=lr,
                  optimizer=optimizer, momentum=momentum, weight_decay=weight_decay, seed=seed,
                  max_seconds=max_seconds, on_epoch=on_epoch)


def train_fedsoft(model_name: str, start: torch.Tensor, cluster_vectors: Sequence[torch.Tensor],
                  alpha: Sequence[float], x: torch.Tensor, y: torch.Tensor, *, epochs: int = 2,
                  batch_size: int = 32, lr: float = 0.01, optimizer: str = "sgd", momentum: float = 0.9,
                  weight_decay: float = 0.0, rho: float = 0.1, seed: int = 0,
                  max_seconds: float | None = None, on_epoch: EpochCallback | None = None) -> TrainResult:
    """FedSoft-Async local step: loss + sum_k alpha_k (rho/2)||v - w_k||^2, from `start`.

    `start` is usually the alpha-mixture of the cluster models or the agent's own model.
    """
    if len(cluster_vectors) != len(alpha) or not cluster_vectors:
        raise ValueError(f"need one alpha per cluster model, got {len(alpha)} for {len(cluster_vectors)}")
    weights = torch.tensor([float(a) for a in alpha], dtype=torch.float64)
    if (weights < 0).any() or not torch.isfinite(weights).all():
        raise ValueError(f"alpha must be finite and >= 0, got {list(alpha)}")
    mass = float(weights.sum())
    stacked = torch.stack([w.detach().float().cpu() for w in cluster_vectors]).double()
    center = (weights @ stacked / mass).float() if mass > 0 else None
    return _train(model_name, start.detach().float().cpu(), center, rho * mass, x, y, epochs=epochs,
                  batch_size=batch_size, lr=lr, optimizer=optimizer, momentum=momentum,
                  weight_decay=weight_decay, seed=seed, max_seconds=max_seconds, on_epoch=on_epoch)


@torch.no_grad()
def per_sample_losses(model_name: str, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                      batch_size: int = 1024) -> torch.Tensor:
    """Cross-entropy of each sample under the model `vector`, shape (N,)."""
    _check_data(model_name, x, y)
    model = _model_at(model_name, vector).eval()
    out = [nn.functional.cross_entropy(model(x[i:i + batch_size]), y[i:i + batch_size], reduction="none")
           for i in range(0, x.shape[0], batch_size)]
    return torch.cat(out) if out else torch.empty(0)


@torch.no_grad()
def evaluate(model_name: str, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, mean loss) of the model `vector` on (x, y): the agent's reference accuracy."""
    _check_data(model_name, x, y)
    if x.shape[0] == 0:
        return math.nan, math.nan
    model = _model_at(model_name, vector).eval()
    correct, loss = 0, 0.0
    for i in range(0, x.shape[0], batch_size):
        logits = model(x[i:i + batch_size])
        correct += int((logits.argmax(1) == y[i:i + batch_size]).sum())
        loss += float(nn.functional.cross_entropy(logits, y[i:i + batch_size], reduction="sum"))
    return correct / x.shape[0], loss / x.shape[0]


def estimate_alpha_argmin(model_name: str, cluster_vectors: Sequence[torch.Tensor], x: torch.Tensor,
                          y: torch.Tensor, batch_size: int = 1024) -> list[float]:
    """FedSoft's estimate: alpha_k = share of local samples on which w_k has the lowest loss.

    Exact ties (e.g. two identical cluster models) split that sample equally between the
    tied models, so identical models get identical shares instead of the first taking all.
    """
    if not cluster_vectors:
        raise ValueError("need at least one cluster model")
    if x.shape[0] == 0:
        return [1.0 / len(cluster_vectors)] * len(cluster_vectors)
    losses = torch.stack([per_sample_losses(model_name, w, x, y, batch_size) for w in cluster_vectors])
    best = losses.min(dim=0, keepdim=True).values
    winners = (losses == best).double()
    shares = (winners / winners.sum(dim=0, keepdim=True)).sum(dim=1) / x.shape[0]
    return [float(s) for s in shares]
