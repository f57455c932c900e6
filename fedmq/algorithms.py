"""Algorithm names, in one place for the CLIs, the simulator and the reports.

The aggregator maps each server name to its strategy (aggregator/bootstrap.py
ASYNC_STRATEGIES for the asynchronous ones, aggregator/round_algorithms.py STRATEGIES for
deadline rounds); both assert at import that they cover exactly these names. The CLIs' choices,
the agent's checks and the simulator's methods derive from these tuples. The kernel holds only names so that aggregator/ and edge_agent/
can share them without importing each other.
"""

from __future__ import annotations

ASYNC_SERVER: tuple[str, ...] = ("cdfl", "fedsoft-async", "fedasync", "fedbuff")
"""Asynchronous server algorithms (an upload is answered when it arrives)."""
ASYNC_AGENT: tuple[str, ...] = ("cdfl", "fedsoft-async", "local")
"""What an asynchronous edge agent runs (local: never talks to a server)."""
ROUNDS: tuple[str, ...] = ("catafed", "fedavg", "fedprox", "tifl")
"""Deadline-round algorithms: the same name on the aggregator and on its agents."""

DISPLAY: dict[str, str] = {"cdfl": "CDFL", "fedsoft-async": "FedSoft-Async", "fedasync": "FedAsync",
                           "fedbuff": "FedBuff", "local": "Local", "catafed": "CATA-Fed",
                           "fedavg": "FedAvg", "fedprox": "FedProx", "tifl": "TiFL"}
"""How reports and figures name each algorithm (an unknown name is shown as it is)."""
