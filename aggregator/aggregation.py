"""The aggregation arithmetic every strategy shares, as pure functions of tensors.

Strategies decide *what* to combine (who finished, which buffer, which cluster); the sums
themselves live here, once: FedAvg / FedProx / TiFL / CATA-Fed (`weighted_delta_mean` over a
round's finishers), FedBuff (`weighted_delta_mean` over its buffer), FedAsync (`mix`), and
the staleness functions that discount old uploads (a parameter, not built into a strategy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from torch import Tensor

Staleness = Callable[[float], float]
"""s(d): the weight of an upload that is d steps stale (1 when fresh)."""


def hinge_staleness(d: float, a: float, b: float) -> float:
    """s(d) = 1 if d <= b else 1 / (a (d - b) + 1): full weight while fresh, then a hinge
    (FedAsync's and CDFL's)."""
    return 1.0 if d <= b else 1.0 / (a * (d - b) + 1.0)


def polynomial_staleness(d: float, exponent: float) -> float:
    """s(d) = (1 + d)^-exponent (FedBuff's, with exponent 0.5)."""
    return float((1.0 + max(d, 0.0)) ** -exponent)


def weighted_delta_mean(current: Tensor, deltas: Sequence[Tensor], weights: Sequence[float],
                        *, scale: float = 1.0, normalize: bool = True) -> Tensor:
    """current + scale * sum_i w_i delta_i (w normalized to sum 1 when `normalize`), in
    float64 and returned as float32; `current` itself when there is nothing to add.

    FedAvg-style rounds pass W_t^i - B_i with psi_i; FedBuff passes its buffered deltas
    with their staleness weights and normalize=False after dividing by K."""
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} deltas but {len(weights)} weights")
    if not deltas:
        return current.clone()
    w = [float(x) for x in weights]
    if normalize:
        total = sum(w)
        w = [x / total for x in w] if total > 0 else [1.0 / len(w)] * len(w)
    acc = current.double().clone()
    for wi, d in zip(w, deltas, strict=True):
        acc += scale * wi * d.double()
    return acc.float()


def mix(model: Tensor, vector: Tensor, a: float) -> Tensor:
    """(1 - a) model + a vector, in place on `model` (FedAsync's step)."""
    return model.mul_(1.0 - a).add_(vector, alpha=a)


def latest_per_agent(recent: Iterable[tuple[str, float]], per_agent: int) -> list[float]:
    """The values of `recent` (oldest first), keeping at most the latest `per_agent` of any one
    agent's: one agent's many uploads cannot move a fleet statistic for its own next ones."""
    taken: Counter[str] = Counter()
    kept = []
    for agent, value in reversed(list(recent)):
        if taken[agent] < per_agent:
            taken[agent] += 1
            kept.append(value)
    return kept
