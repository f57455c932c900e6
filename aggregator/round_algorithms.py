"""Deadline-round algorithms by name: the one map the aggregator and the simulator use.

Names come from fedmq/algorithms.py (ROUNDS); each maps to its strategy class. Settings:
CATA-Fed reads [catafed]; the baselines read [fedavg] (N, epochs, lr) and TiFL also [tifl].
"""

from __future__ import annotations

import torch

from aggregator.catafed import CataFed, RoundStrategy
from aggregator.fedavg import FedAvgDeadline, FedProx
from aggregator.tifl import TiFL
from fedmq.algorithms import ROUNDS
from fedmq.config import CataFedSettings, FedAvgSettings, TiflSettings

STRATEGIES: dict[str, type[RoundStrategy]] = {"catafed": CataFed, "fedavg": FedAvgDeadline,
                                              "fedprox": FedProx, "tifl": TiFL}
"""Algorithm name -> round strategy, for the service and the simulator."""
assert tuple(STRATEGIES) == ROUNDS, "fedmq/algorithms.py ROUNDS and this map must agree"


def make_round_strategy(algorithm: str, settings: CataFedSettings, initial: torch.Tensor, *,
                  seed: int = 0, fedavg: FedAvgSettings | None = None,
                  tifl: TiflSettings | None = None) -> RoundStrategy:
    """The round strategy called `algorithm`; `fedavg` holds the baselines' own settings
    (None: CATA-Fed's N, see aggregator/fedavg.py), `tifl` TiFL's."""
    try:
        cls = STRATEGIES[algorithm]
    except KeyError:
        raise ValueError(f"round algorithm must be one of {', '.join(STRATEGIES)}, "
                         f"got {algorithm!r}") from None
    if cls is TiFL:
        return TiFL(settings, initial, seed=seed, fedavg=fedavg, tifl=tifl)
    if issubclass(cls, FedAvgDeadline):
        return cls(settings, initial, seed=seed, fedavg=fedavg)
    return cls(settings, initial, seed=seed)


def min_agents(algorithm: str, settings: CataFedSettings, fedavg: FedAvgSettings) -> int:
    """Agents to wait for before round 1: catafed.min_agents, or (0) those one round invites."""
    if settings.min_agents < 0:
        raise ValueError(f"catafed.min_agents must be >= 0, got {settings.min_agents}")
    if settings.min_agents:
        return settings.min_agents
    return settings.per_group if algorithm == "catafed" else fedavg.clients_per_round
