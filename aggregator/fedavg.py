"""The deadline baselines' server sides: FedAvg with a deadline, and FedProx.

Both invite N agents drawn uniformly at random from the pool each round, with the same
deadline T and cut-off T + grace as CATA-Fed, and aggregate exactly as CATA-Fed does
(`aggregate` in aggregator/catafed.py: psi normalized over the finishers). What differs is
on the agent (edge_agent/deadline.py): a FedAvg agent trains its E epochs whatever the
deadline, so a slow one reports late and its update is dropped (wasted work); a FedProx agent
trains with the proximal term (mu/2)||w - W_t||^2 and sends whatever it has at T - eps_i
(partial work is accepted). Neither resizes shards nor clusters anything, and an agent that
misses a cut-off stays in the pool: these baselines know only presence (online/offline).
N is `fedavg.clients_per_round`; without a `FedAvgSettings` the baseline takes CATA-Fed's N
(the simulator's like-for-like comparison).
"""

from __future__ import annotations

import torch

from aggregator.catafed import RoundPlan, RoundStrategy
from fedmq.config import CataFedSettings, FedAvgSettings


class FedAvgDeadline(RoundStrategy):
    """FedAvg (McMahan et al.) under a round deadline: random N, late updates dropped."""

    name = "fedavg"
    leave_on_silence = False
    rng_salt = 0xFEDA

    def __init__(self, settings: CataFedSettings, initial: torch.Tensor, *, seed: int = 0,
                 fedavg: FedAvgSettings | None = None) -> None:
        super().__init__(settings, initial, seed=seed)
        self.fedavg = fedavg or FedAvgSettings.like(settings)
        if self.fedavg.clients_per_round < 1:
            raise ValueError("fedavg.clients_per_round must be >= 1, "
                             f"got {self.fedavg.clients_per_round}")

    def select(self) -> RoundPlan:
        pool = self.pool()
        n = min(self.fedavg.clients_per_round, len(pool))
        picked = sorted(self.rng.choice(pool, size=n, replace=False).tolist()) if n else []
        return RoundPlan(self.round, picked, None, {})


class FedProx(FedAvgDeadline):
    """FedProx (Li et al.): FedAvg's server; agents add the proximal term and send partial work."""

    name = "fedprox"
