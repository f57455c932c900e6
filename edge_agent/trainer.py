"""Local training on the device: proximal SGD/Adam from the received model, and FedSoft's pieces.

CDFL's local objective is the local loss plus (rho/2) ||v - u||^2, u the model the agent
received. FedSoft-Async's is the local loss plus sum_k alpha_k (rho/2) ||v - w_k||^2 over
the K cluster models. The second is the first in disguise: its gradient
rho * sum_k alpha_k (v - w_k) = rho * A * (v - w_bar), with A = sum_k alpha_k and
w_bar = sum_k alpha_k w_k / A, so both run through one loop with a proximal centre and
an effective rho. The proximal gradient is added to the parameters' gradients directly
(no second forward pass); `final_loss` is the data loss alone.

Defaults (2 epochs, batch 32, SGD lr 0.01, momentum 0.9, rho 0.1) were set by a
measurement on rotated digits (docs/edge_agent.md): an lr of 0.05 lowered the
accuracy of good received models (by up to 0.025 here too); SGD lr 0.01 for 2 epochs
improved every case, partly trained (+0.16 to +0.26) and good (+0.03 to +0.08) models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from edge_agent.agent_algorithms import agent_algorithm
from fedmq.config import AgentSettings
from fedmq.privacy import DpSgd, UplinkPrivacy
from fedmq.training import (
    EVAL_BATCH,
    OPTIMIZERS,
    EpochCallback,
    TrainResult,
    evaluate,
    fit,
    per_sample_losses,
)

__all__ = ["OPTIMIZERS", "EpochCallback", "TrainResult", "estimate_alpha_argmin", "evaluate",
           "per_sample_losses", "train_cycle", "train_fedsoft", "train_local"]


def train_local(model_name: str, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
                epochs: int = 2, batch_size: int = 32, lr: float = 0.01, optimizer: str = "sgd",
                momentum: float = 0.9, weight_decay: float = 0.0, rho: float = 0.1, seed: int = 0,
                max_seconds: float | None = None, on_epoch: EpochCallback | None = None,
                dp: DpSgd | None = None) -> TrainResult:
    """Train from the received model `start` (u) on local data; loss + (rho/2)||v - u||^2.

    Deterministic given `seed` (it fixes the batch order; there is no other randomness).
    `max_seconds` stops at the first batch boundary past the budget (deadline-aware
    training); `on_epoch` may return False to stop after an epoch (CATA-Fed's rule: stop
    when the remaining time is below the mean epoch time).
    """
    start = start.detach().float().cpu()
    return fit(model_name, start, x, y, anchors=[(start, rho)], epochs=epochs,
               batch_size=batch_size, lr=lr, optimizer=optimizer, momentum=momentum,
               weight_decay=weight_decay, seed=seed, max_seconds=max_seconds, on_epoch=on_epoch, dp=dp)


def train_fedsoft(model_name: str, start: torch.Tensor, cluster_vectors: Sequence[torch.Tensor],
                  alpha: Sequence[float], x: torch.Tensor, y: torch.Tensor, *, epochs: int = 2,
                  batch_size: int = 32, lr: float = 0.01, optimizer: str = "sgd", momentum: float = 0.9,
                  weight_decay: float = 0.0, rho: float = 0.1, seed: int = 0,
                  max_seconds: float | None = None, on_epoch: EpochCallback | None = None,
                dp: DpSgd | None = None) -> TrainResult:
    """FedSoft-Async local step: loss + sum_k alpha_k (rho/2)||v - w_k||^2, from `start`.

    `start` is usually the alpha-mixture of the cluster models or the agent's own model.
    """
    if len(cluster_vectors) != len(alpha) or not cluster_vectors:
        raise ValueError(f"need one alpha per cluster model, got {len(alpha)} for {len(cluster_vectors)}")
    weights = torch.tensor([float(a) for a in alpha], dtype=torch.float64)
    if (weights < 0).any() or not torch.isfinite(weights).all():
        raise ValueError(f"alpha must be finite and >= 0, got {list(alpha)}")
    anchors = [(w, rho * float(a)) for w, a in zip(cluster_vectors, alpha, strict=True)]
    return fit(model_name, start.detach().float().cpu(), x, y, anchors=anchors, epochs=epochs,
               batch_size=batch_size, lr=lr, optimizer=optimizer, momentum=momentum,
               weight_decay=weight_decay, seed=seed, max_seconds=max_seconds, on_epoch=on_epoch, dp=dp)


def estimate_alpha_argmin(model_name: str, cluster_vectors: Sequence[torch.Tensor], x: torch.Tensor,
                          y: torch.Tensor, batch_size: int = EVAL_BATCH) -> list[float]:
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


def diverged(vector: torch.Tensor) -> bool:
    """Whether local training left NaN or Inf in the model: nothing a receiver could decode
    (the codecs refuse it), so the agent keeps the model it held and sends nothing."""
    return not bool(torch.isfinite(vector).all())


def agent_knobs(settings: AgentSettings) -> dict[str, Any]:
    """train_local's knobs from `[agent]`: one mapping for the device, the simulator and the
    ablation, so a `--set agent.*` reaches every agent that trains."""
    return dict(epochs=settings.epochs, batch_size=settings.batch_size, lr=settings.lr,
                optimizer=settings.optimizer, momentum=settings.momentum, weight_decay=settings.weight_decay,
                rho=settings.rho)


def train_cycle(model_name: str, algorithm: str, held: torch.Tensor, clusters: Sequence[torch.Tensor] | None,
                x: torch.Tensor, y: torch.Tensor, *, privacy: UplinkPrivacy | None = None, dp_seed: int = 0,
                **knobs: Any) -> tuple[TrainResult, list[float] | None]:
    """One cycle's local training as every agent runs it: the device, the simulator, the ablation.

    FedSoft-Async (`clusters`: the K received models) estimates alpha by argmin and trains from
    the alpha-mixture toward each model; CDFL and Local train from the `held` model. With DP
    on (`privacy.enabled`) alpha is released noisy (`UplinkPrivacy.release_alpha`), training
    runs DP-SGD (at privacy.batch_size) with noise seeded by `dp_seed`, and both are charged
    to `privacy`. `knobs` are train_local's. Returns the result and the alpha to upload (None
    unless FedSoft-Async).
    """
    if privacy is not None and not privacy.enabled:
        privacy = None
    dp = None
    if privacy is not None:
        dp = privacy.sgd(dp_seed)
        knobs["batch_size"] = privacy.batch(knobs.get("batch_size", 32))
    alpha: list[float] | None = None
    if agent_algorithm(algorithm).trains_from == "cluster_mixture":
        if not clusters:
            raise ValueError("fedsoft-async trains against the K cluster models: none received")
        alpha = estimate_alpha_argmin(model_name, clusters, x, y)
        if privacy is not None:
            alpha = privacy.release_alpha(alpha, len(y))
        start = sum(float(a) * w for a, w in zip(alpha, clusters, strict=True))
        result = train_fedsoft(model_name, start, clusters, alpha, x, y, dp=dp, **knobs)
    else:
        result = train_local(model_name, held, x, y, dp=dp, **knobs)
    if privacy is not None:
        privacy.spend(privacy.training(len(y), knobs.get("batch_size", 32), result.steps))
    return result, alpha
