"""CATA-Fed's server side as a pure round strategy: grouping, PF selection, aggregation.

Our reading of the paper's Algorithm 2 (docs/catafed.md has the reasons):

- Agents in the pool are clustered into P groups by their current per-round data size
  |D_ij| with an exact 1-D k-means (dynamic programming over the sorted sizes: optimal and
  deterministic, no random restarts). Groups are numbered by ascending centre.
- Each agent keeps a proportional-fair average A_i, updated after every round:
  A_i := (1 - 1/t_c) A_i + (1/t_c) r_i [i was invited]. Its priority is r_i / A_i.
- Each group's candidate set is its best N members by r_i / A_i; the group with the highest
  sum of its candidates' priorities is invited (ties: the lower group index).
- W_{t+1} = W_t + sum_i psi_i I_i (W_t^i - B_i), with B_i the model agent i started from
  (W_t as the agent decoded it) and psi normalized over the finishers only, so a straggler
  (I_i = 0) never shrinks the model; with B_i = W_t this is the paper's sum psi_i I_i W_t^i,
  and the server's fp32 W_t never absorbs the downlink codec's quantization error.
  No finisher: W_t is kept.
- Invited agents that sent nothing by the cut-off leave the pool until they come back
  online (`set_online(agent, True)` after having left); a straggler's report (finished=False)
  carries its new shard size, which triggers re-clustering before the next selection.

No MQTT in here: aggregator/round_service.py drives it over the wire, sim/rounds.py on a simulated
clock. `RoundStrategy` holds what the baselines in aggregator/fedavg.py share.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from aggregator.aggregation import weighted_delta_mean
from fedmq.config import CataFedSettings

RATES = ("samples", "throughput")
WEIGHTS = ("samples", "uniform")
SELECTIONS = ("pf", "random")


def kmeans_1d(values: Sequence[float], k: int) -> list[int]:
    """Optimal 1-D k-means labels of `values` (group ids 0..k'-1 by ascending centre).

    Dynamic programming over the sorted values (cost = within-group sum of squares), so
    the result is the global optimum and deterministic; k' = min(k, number of distinct
    values). Equal values always share a group. O(k n^2) with numpy rows: fine for fleets
    of thousands.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(values)
    if n == 0:
        return []
    x = np.asarray(values, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    s = x[order]
    distinct = np.unique(s)
    k = min(k, len(distinct))
    if k == len(distinct):  # every distinct value its own group
        return [int(np.searchsorted(distinct, v)) for v in x]
    # Work on distinct values with multiplicities, so equal values cannot be split.
    counts = np.array([np.sum(s == d) for d in distinct], dtype=np.float64)
    m = len(distinct)
    c1 = np.concatenate([[0.0], np.cumsum(counts)])
    c2 = np.concatenate([[0.0], np.cumsum(counts * distinct)])
    c3 = np.concatenate([[0.0], np.cumsum(counts * distinct ** 2)])

    def cost(j: np.ndarray, i: int) -> np.ndarray:
        """Sum of squares of distinct[j..i] (inclusive), vectorized over j."""
        w = c1[i + 1] - c1[j]
        s1 = c2[i + 1] - c2[j]
        return (c3[i + 1] - c3[j]) - s1 * s1 / w

    inf = math.inf
    dp = np.full((k, m), inf)
    arg = np.zeros((k, m), dtype=np.int64)
    dp[0] = [cost(np.array([0]), i)[0] for i in range(m)]
    for g in range(1, k):
        for i in range(g, m):
            j = np.arange(g, i + 1)  # first index of the last group
            total = dp[g - 1, j - 1] + cost(j, i)
            best = int(np.argmin(total))  # first minimum: deterministic
            dp[g, i] = total[best]
            arg[g, i] = j[best]
    bounds = []
    i = m - 1
    for g in range(k - 1, -1, -1):
        start = int(arg[g, i]) if g else 0
        bounds.append(start)
        i = start - 1
    starts = sorted(bounds)
    group_of_distinct = np.searchsorted(np.array(starts), np.arange(m), side="right") - 1
    return [int(group_of_distinct[np.searchsorted(distinct, v)]) for v in x]


@dataclass
class AgentInfo:
    """What the server knows of one agent."""

    agent: str
    size: int
    """Current per-round data size |D_ij| (its shard size)."""
    online: bool = True
    in_pool: bool = True
    """False from a missed cut-off until the agent comes back online."""
    avg: float = 1.0
    """A_i, the proportional-fair average of the rate it was served."""
    throughput: float = 0.0
    """Samples per second it last reported (0 = not measured yet)."""
    group: int = 0
    invited: int = 0
    finished: int = 0
    stragglers: int = 0
    dropouts: int = 0


@dataclass
class RoundResult:
    """One agent's answer to a round invite, decoded."""

    agent: str
    round: int
    finished: bool
    n_samples: int
    shard_size: int
    vector: torch.Tensor | None = None
    """W_t^i, the agent's trained model (None for a straggler)."""
    base: torch.Tensor | None = None
    """The model the agent started from (W_t as it decoded it); None means W_t itself."""
    metrics: dict[str, float] = field(default_factory=dict)
    latency_s: float | None = None
    """Seconds from the invite to this report as the server measured them (None: unknown)."""


@dataclass
class RoundPlan:
    round: int
    selected: list[str]
    group: int | None = None
    priorities: dict[int, float] = field(default_factory=dict)


@dataclass
class RoundOutcome:
    """What one round did; the service and the simulator log and count these."""

    round: int
    selected: list[str]
    finished: list[str]
    stragglers: list[str]
    """Reported finished=False (CATA-Fed: the watchdog aborted)."""
    dropouts: list[str]
    """Sent nothing by the cut-off."""
    group: int | None
    weights: dict[str, float]
    changed: bool
    """False when no agent finished and W_t was kept."""


def aggregate(current: torch.Tensor, results: Sequence[RoundResult], weights: str = "samples"
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """W_t + sum psi_i (W_t^i - B_i) over finishers, psi normalized over them; W_t if none.

    Returns the new vector and psi per finisher. A result without `base` started from W_t.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    done = [r for r in results if r.finished and r.vector is not None]
    if not done:
        return current.clone(), {}
    raw = [float(r.n_samples) if weights == "samples" else 1.0 for r in done]
    if sum(raw) <= 0:
        raw = [1.0] * len(done)
    total = sum(raw)
    psi = {r.agent: w / total for r, w in zip(done, raw, strict=True)}
    deltas = [r.vector.double() - (current if r.base is None else r.base).double() for r in done]
    return weighted_delta_mean(current, deltas, [psi[r.agent] for r in done], normalize=False), psi


class RoundStrategy:
    """Pool, rounds and aggregation shared by CATA-Fed and the deadline baselines.

    Call order per round: `open_round()` -> `accept(result)` for each report ->
    `close_round()`. Between rounds: `register`, `set_online`, `set_size`.
    """

    name = "rounds"
    leave_on_silence = True
    """Whether an invited agent silent at the cut-off leaves the pool (CATA-Fed: yes)."""
    rng_salt = 0
    """Mixed with the seed: each strategy draws from its own stream (state() keeps it)."""

    def __init__(self, settings: CataFedSettings, initial: torch.Tensor, *, seed: int = 0) -> None:
        if settings.weights not in WEIGHTS:
            raise ValueError(f"catafed.weights must be one of {WEIGHTS}, got {settings.weights!r}")
        if settings.rate not in RATES:
            raise ValueError(f"catafed.rate must be one of {RATES}, got {settings.rate!r}")
        if settings.selection not in SELECTIONS:
            raise ValueError(f"catafed.selection must be one of {SELECTIONS}, "
                             f"got {settings.selection!r}")
        if settings.groups < 1 or settings.per_group < 1 or settings.pf_window < 1:
            raise ValueError("catafed.groups, per_group and pf_window must be >= 1")
        self.settings = settings
        self.vector = initial.detach().float().clone()
        self.round = 0
        self.seed = seed
        self.agents: dict[str, AgentInfo] = {}
        self.plan: RoundPlan | None = None
        self._results: dict[str, RoundResult] = {}
        self.history: list[RoundOutcome] = []
        self.rng = np.random.default_rng([seed, self.rng_salt])

    # ---------------------------------------------------------------- the pool

    def register(self, agent: str, size: int) -> None:
        """An agent joined (or re-joined) with `size` samples per round; it is online."""
        info = self.agents.get(agent)
        if info is None:
            start = self.settings.pf_initial if self.settings.pf_initial > 0 else float(size)
            self.agents[agent] = AgentInfo(agent, int(size), avg=start)
        else:
            self.set_size(agent, size)
            self.set_online(agent, True)

    def set_online(self, agent: str, online: bool) -> None:
        """Presence from the agent's retained status; coming online puts it back in the pool."""
        info = self.agents.get(agent)
        if info is None:
            return
        if online and not info.online:
            info.in_pool = True
        if online and not info.in_pool and not self._is_open_for(agent):
            info.in_pool = True
        info.online = online

    def _is_open_for(self, agent: str) -> bool:
        return self.plan is not None and agent in self.plan.selected

    def set_size(self, agent: str, size: int) -> None:
        info = self.agents.get(agent)
        if info is not None and int(size) != info.size:
            info.size = int(size)
            self.sizes_changed()

    def sizes_changed(self) -> None:
        """Hook: CATA-Fed re-clusters."""

    def pool(self) -> list[str]:
        """Agents that can be invited: known, online, not out for a missed cut-off."""
        return sorted(a for a, i in self.agents.items() if i.online and i.in_pool and i.size > 0)

    # ---------------------------------------------------------------- rounds

    def select(self) -> RoundPlan:
        raise NotImplementedError

    def open_round(self) -> RoundPlan:
        if self.plan is not None:
            raise RuntimeError(f"round {self.plan.round} is still open")
        plan = self.select()
        self.plan = plan
        self._results = {}
        for a in plan.selected:
            self.agents[a].invited += 1
        return plan

    def accept(self, result: RoundResult) -> bool:
        """Take one report of the open round; False (ignored) if it is not one we wait for:
        another round, an agent not invited, or a second report of the same agent."""
        plan = self.plan
        if plan is None or result.round != plan.round or result.agent not in plan.selected \
                or result.agent in self._results:
            return False
        if result.finished and result.vector is None:
            return False
        self._results[result.agent] = result
        return True

    def all_reported(self) -> bool:
        return self.plan is not None and set(self._results) >= set(self.plan.selected)

    def close_round(self) -> RoundOutcome:
        plan = self.plan
        if plan is None:
            raise RuntimeError("no round is open")
        results = list(self._results.values())
        new, psi = aggregate(self.vector, results, self.settings.weights)
        finished = [r.agent for r in results if r.finished]
        stragglers = [r.agent for r in results if not r.finished]
        dropouts = [a for a in plan.selected if a not in self._results]
        for r in results:
            info = self.agents[r.agent]
            if r.finished:
                info.finished += 1
            else:
                info.stragglers += 1
            if r.metrics.get("samples_per_s", 0.0) > 0:
                info.throughput = float(r.metrics["samples_per_s"])
        self.on_results(results)
        for a in dropouts:
            self.agents[a].dropouts += 1
            if self.leave_on_silence:
                self.agents[a].in_pool = False
        self.after_round(plan)
        self.vector = new
        outcome = RoundOutcome(plan.round, list(plan.selected), finished, stragglers, dropouts,
                               plan.group, psi, bool(psi))
        self.history.append(outcome)
        self.round += 1
        self.plan = None
        self._results = {}
        return outcome

    def on_results(self, results: list[RoundResult]) -> None:
        """Hook: what a strategy does with the reports (CATA-Fed: new shard sizes)."""

    def after_round(self, plan: RoundPlan) -> None:
        """Hook: per-round bookkeeping (CATA-Fed: the PF averages)."""

    # ---------------------------------------------------------------- durability

    def state(self) -> dict:
        """Everything needed to resume between rounds (msgpack-ready, plus the vector); the
        random selection's generator too, so a resumed run draws what the live one would."""
        return {"name": self.name, "round": self.round,
                "vector": self.vector.numpy().tobytes(),
                "agents": {a: {k: v for k, v in vars(i).items()} for a, i in self.agents.items()},
                "rng": json.dumps(self.rng.bit_generator.state)}

    def load_state(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state of {state.get('name')!r}, strategy is {self.name!r}")
        vec = torch.from_numpy(np.frombuffer(state["vector"], dtype=np.float32).copy())
        if vec.shape != self.vector.shape:
            raise ValueError(f"state vector has {vec.numel()} values, model {self.vector.numel()}")
        self.vector = vec
        self.round = int(state["round"])
        if "rng" in state:  # snapshots from before the generator was kept have none
            self.rng.bit_generator.state = json.loads(state["rng"])
        # Presence is re-learned from the retained statuses after a restart.
        self.agents = {a: AgentInfo(**{**d, "online": False}) for a, d in state["agents"].items()}
        self.sizes_changed()


class CataFed(RoundStrategy):
    """CATA-Fed: data-size groups, proportional-fair group selection, straggler resizing."""

    name = "catafed"
    rng_salt = 0xCA7A  # catafed.selection = random only

    def __init__(self, settings: CataFedSettings, initial: torch.Tensor, *, seed: int = 0) -> None:
        super().__init__(settings, initial, seed=seed)
        self._stale_groups = True
        self.reclusterings = 0

    def sizes_changed(self) -> None:
        self._stale_groups = True

    def register(self, agent: str, size: int) -> None:
        new = agent not in self.agents
        super().register(agent, size)
        if new:
            self._stale_groups = True

    def rate(self, info: AgentInfo) -> float:
        """r_i: the per-round data size, or the measured throughput where asked and known."""
        if self.settings.rate == "throughput" and info.throughput > 0:
            return info.throughput
        return float(info.size)

    def priority(self, info: AgentInfo) -> float:
        return self.rate(info) / max(info.avg, 1e-12)

    def recluster(self) -> None:
        """1-D k-means of the pool's sizes into P groups (agents outside the pool keep theirs)."""
        pool = self.pool()
        labels = kmeans_1d([self.agents[a].size for a in pool], self.settings.groups)
        for a, g in zip(pool, labels, strict=True):
            self.agents[a].group = g
        self._stale_groups = False
        self.reclusterings += 1

    def candidates(self) -> dict[int, list[str]]:
        """Each group's best N pool members by r_i / A_i (ties: agent id)."""
        groups: dict[int, list[str]] = {}
        for a in self.pool():
            groups.setdefault(self.agents[a].group, []).append(a)
        return {g: sorted(members, key=lambda a: (-self.priority(self.agents[a]), a))
                [: self.settings.per_group] for g, members in sorted(groups.items())}

    def select(self) -> RoundPlan:
        every = self.settings.recluster_every
        due = self._stale_groups if every <= 0 else (self.reclusterings == 0
                                                      or self.round % every == 0)
        if due or any(self.agents[a].group >= self.settings.groups for a in self.pool()):
            self.recluster()
        if self.settings.selection == "random":  # the ablation without PF
            groups: dict[int, list[str]] = {}
            for a in self.pool():
                groups.setdefault(self.agents[a].group, []).append(a)
            if not groups:
                return RoundPlan(self.round, [], None, {})
            g = sorted(groups)[int(self.rng.integers(len(groups)))]
            n = min(self.settings.per_group, len(groups[g]))
            picked = sorted(self.rng.choice(groups[g], size=n, replace=False).tolist())
            return RoundPlan(self.round, picked, g, {})
        cands = self.candidates()
        prios = {g: sum(self.priority(self.agents[a]) for a in members)
                 for g, members in cands.items()}
        if not prios:
            return RoundPlan(self.round, [], None, {})
        best = min(prios, key=lambda g: (-prios[g], g))
        return RoundPlan(self.round, cands[best], best, prios)

    def on_results(self, results: list[RoundResult]) -> None:
        for r in results:
            if r.shard_size > 0:
                self.set_size(r.agent, r.shard_size)

    def after_round(self, plan: RoundPlan) -> None:
        beta = 1.0 / self.settings.pf_window
        served = set(plan.selected)
        for a, info in self.agents.items():
            info.avg = (1 - beta) * info.avg + beta * (self.rate(info) if a in served else 0.0)
