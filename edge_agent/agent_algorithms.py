"""The agent side of each algorithm, in one table: what an agent sends and where its training
starts. The server side's table is aggregator/ (bootstrap.py ASYNC_STRATEGIES,
round_algorithms.py STRATEGIES); adding an algorithm touches one module per side, and the rest
of edge_agent/ asks these fields, never the algorithm's name.

    kind = agent_algorithm(cfg.agent.algorithm)
    if kind.sends_sketch: ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedmq.algorithms import ASYNC_AGENT, ASYNC_SERVER, ROUNDS


@dataclass(frozen=True)
class AgentAlgorithm:
    """One algorithm as an edge agent runs it."""

    name: str
    connects: bool = True
    """Talks to an aggregator (local never does: it installs its own training result)."""
    rounds: bool = False
    """Answers deadline-round invites (edge_agent/round_agent.py), not the drift loop."""
    trains_from: Literal["installed", "cluster_mixture", "invite"] = "installed"
    """Where local training starts: the model the agent holds (u), the alpha-mixture of the K
    cluster models it downloads (FedSoft-Async: alpha by per-sample argmin on its buffer, trained
    toward all K), or the round's global model W_t in the invite."""
    sends_sketch: bool = False
    """Each upload carries a 2 KB sketch of the training inputs (CDFL's sketch estimator)."""
    sends_alpha: bool = False
    """Each upload carries the agent's own mixture estimate alpha."""
    private: bool = False
    """Differential privacy of what it sends is built for it (privacy.epsilon > 0 allowed)."""
    trains_with: Literal["agent", "catafed", "fedavg"] = "agent"
    """The config section of its local epochs, batch size and lr."""
    deadline_mode: Literal["", "catafed", "fedavg", "fedprox"] = ""
    """Rounds: how it trains against the deadline (edge_agent/deadline.py train_to_deadline)."""
    shards: bool = False
    """Rounds: its per-round data is a shard that a missed deadline halves (CATA-Fed)."""
    proximal: bool = False
    """Rounds: trains with FedProx's proximal term toward W_t (fedavg.prox_mu)."""
    scores_start: bool = False
    """Rounds: reports its accuracy on the received W_t (TiFL's tier accuracies)."""


AGENT_ALGORITHMS: dict[str, AgentAlgorithm] = {a.name: a for a in (
    AgentAlgorithm("cdfl", sends_sketch=True, private=True),
    AgentAlgorithm("fedsoft-async", trains_from="cluster_mixture", sends_alpha=True, private=True),
    AgentAlgorithm("local", connects=False),
    AgentAlgorithm("fedasync"),  # the simulator's agents of the one-global-model baselines
    AgentAlgorithm("fedbuff"),
    AgentAlgorithm("catafed", rounds=True, trains_from="invite", trains_with="catafed",
                   deadline_mode="catafed", shards=True),
    AgentAlgorithm("fedavg", rounds=True, trains_from="invite", trains_with="fedavg", deadline_mode="fedavg"),
    AgentAlgorithm("fedprox", rounds=True, trains_from="invite", trains_with="fedavg", deadline_mode="fedprox",
                   proximal=True),
    AgentAlgorithm("tifl", rounds=True, trains_from="invite", trains_with="fedavg", deadline_mode="fedavg",
                   scores_start=True),
)}
"""Every algorithm an agent runs (fedmq.algorithms ASYNC_AGENT, the simulator's ASYNC_SERVER
baselines, and ROUNDS), by name."""


def agent_algorithm(name: str) -> AgentAlgorithm:
    """The agent side of algorithm `name`; ValueError naming the known ones."""
    try:
        return AGENT_ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"agent.algorithm must be one of {', '.join(AGENT_ALGORITHMS)}, got {name!r}") from None


assert set(AGENT_ALGORITHMS) == set(ASYNC_AGENT + ASYNC_SERVER + ROUNDS), "every agent algorithm has one entry"
