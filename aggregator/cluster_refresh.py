"""Proxy refresh: keep CDFL's cluster models specialists while they learn from mixed uploads.

The paper's step 3 pulls each cluster model toward every upload, w_k := (1 - beta_k) w_k +
beta_k v. An upload is an agent's own model trained on a mixture of clusters, so over a long
run that stream blurs the specialists: at K = 4 and 6, 25 updates per agent, CDFL's clusters
ended 0.5-1 pp below FedSoft-Async's (docs/results_cdfl.md#paper-sized-fleets), whichever alpha or
update rule was used. The server already holds a labelled proxy set D_k per cluster; after
step 3, each cluster the upload moved takes a few SGD steps on its own D_k, which pulls it
back toward a specialist while it keeps what the uploads taught it.

`cfg.cdfl.cluster_refresh_steps` (0: off, the paper's rule). Deterministic for a seed on CPU,
so journal replay rebuilds the same clusters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from aggregator.evaluator import ProxyEvaluator


def refresh_cluster(evaluator: ProxyEvaluator, vector: Tensor, k: int, *, steps: int, lr: float,
                    batch_size: int = 64, seed: int = 0) -> Tensor:
    """`vector` after `steps` plain SGD mini-batches on proxy set k (true labels), on CPU."""
    if steps < 0 or lr <= 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0, lr > 0, batch_size >= 1; got {steps}, {lr}, {batch_size}")
    if not 0 <= k < evaluator.num_sets:
        raise ValueError(f"cluster {k} is not one of the evaluator's {evaluator.num_sets} proxy sets")
    if steps == 0:
        return vector
    ev = evaluator
    lo, hi = ev.offsets[k], ev.offsets[k + 1]
    gen = torch.Generator().manual_seed(int(seed))
    w = vector.detach().to(ev.device, torch.float32).clone().requires_grad_(True)
    with torch.enable_grad():
        for _ in range(steps):
            idx = (torch.randint(lo, hi, (min(batch_size, hi - lo),), generator=gen)).to(ev.device)
            logits = functional_call(ev.module, ev.spec.unflatten(w), (ev.x[idx],))
            loss = F.cross_entropy(logits, ev.y[idx])
            (grad,) = torch.autograd.grad(loss, w)
            with torch.no_grad():
                w -= lr * grad
    return w.detach().to("cpu", torch.float32)
