"""Proxy refresh: keep CDFL's cluster models specialists while they learn from mixed uploads.

The paper's step 3 pulls each cluster model toward every upload, w_k := (1 - beta_k) w_k +
beta_k v. An upload is an agent's own model trained on a mixture of clusters, so over a long
run that stream blurs the specialists: at K = 4 and 6, 25 updates per agent, CDFL's clusters
ended 0.5-1 pp below FedSoft-Async's (docs/results_cdfl.md#paper-sized-fleets), whichever alpha or
update rule was used. The server already holds a labelled proxy set D_k per cluster; after
step 3, each cluster the upload moved takes a few SGD steps on its own D_k, which pulls it
back toward a specialist while it keeps what the uploads taught it.

`cfg.cdfl.cluster_refresh_steps` (0: off, the paper's rule). A step that would raise its own
batch's loss is retried at half the rate (see `refresh_cluster`), so the configured rate is a
ceiling, safe on models whose minima are sharper than the one it was tuned on. Deterministic
for a seed on CPU, so journal replay rebuilds the same clusters.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from aggregator.evaluator import ProxyEvaluator
from fedmq.models import trains_channels_last

BACKTRACKS = 4
"""Halvings of the rate a refresh step may try before it is skipped (lr / 16 at the least)."""


def refresh_cluster(evaluator: ProxyEvaluator, vector: Tensor, k: int, *, steps: int, lr: float,
                    batch_size: int = 64, seed: int = 0, backtracks: int = BACKTRACKS,
                    counters: Counter[str] | None = None) -> Tensor:
    """`vector` after `steps` plain SGD mini-batches on proxy set k (true labels), on CPU.

    Each step must lower the loss on its own mini-batch: a step that raises it is undone and
    tried at half the rate, up to `backtracks` times, then skipped. A rate tuned on one model
    can sit above the stable rate of another's minimum (ResNet-20 pre-trained at 0.01 and
    refreshed at 0.05: one cluster's step grew from 0.08 to 1.5 in four uploads and its
    accuracy fell from 0.94 to 0.18: docs/results_realsize.md, "Collapsed replies"). The check
    costs one forward pass of the batch per try and keeps the refresh from ever climbing its own
    batch's loss.
    `counters` (when given) counts `refresh_halved` per halving and `refresh_skipped` per step
    skipped."""
    if steps < 0 or lr <= 0 or batch_size < 1 or backtracks < 0:
        raise ValueError(f"need steps >= 0, lr > 0, batch_size >= 1, backtracks >= 0; "
                         f"got {steps}, {lr}, {batch_size}, {backtracks}")
    if not 0 <= k < evaluator.num_sets:
        raise ValueError(f"cluster {k} is not one of the evaluator's {evaluator.num_sets} proxy sets")
    if steps == 0:
        return vector
    ev = evaluator
    lo, hi = ev.offsets[k], ev.offsets[k + 1]
    gen = torch.Generator().manual_seed(int(seed))
    w = vector.detach().to(ev.device, torch.float32).clone()
    nhwc = trains_channels_last(ev.device)

    def batch_loss(v: Tensor, idx: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(ev.module, ev.spec.unflatten(v, nhwc), (ev.x[idx],)), ev.y[idx])

    for _ in range(steps):
        idx = (torch.randint(lo, hi, (min(batch_size, hi - lo),), generator=gen)).to(ev.device)
        v = w.clone().requires_grad_(True)
        with torch.enable_grad():
            loss = batch_loss(v, idx)
            (grad,) = torch.autograd.grad(loss, v)
        with torch.no_grad():
            rate = lr
            for _ in range(backtracks + 1):
                tried = w - rate * grad
                after = batch_loss(tried, idx)
                if bool(torch.isfinite(after)) and float(after) < float(loss):
                    w = tried
                    break
                rate /= 2.0
                if counters is not None:
                    counters["refresh_halved"] += 1
            else:
                if counters is not None:
                    counters["refresh_skipped"] += 1
    return w.to("cpu", torch.float32)
