"""TiFL (Chai et al., "TiFL: A Tier-based Federated Learning System", HPDC 2020) under a deadline.

TiFL groups clients into tiers of similar response latency and invites N clients of one tier
per round, so that a round waits for clients of one speed only. Our reading, as a round
strategy beside FedAvg and FedProx (same deadline T, cut-off T + grace, aggregation and
agents: a TiFL agent trains its E epochs like FedAvg's, and a late report is dropped):

- Profiling. The paper profiles every client before training. Here profiling is part of the
  run and its time counts: while online agents have no measured latency, a round invites N of
  them at random. An agent's latency is the server's time from invite to report; an agent
  silent at the cut-off gets latency infinity (the paper's T_max: it is a dropout and is not
  invited again) until it comes back online after having been offline, when it is profiled
  anew.
- Tiers: 1-D k-means (the exact one CATA-Fed uses) of the finite latencies into m tiers,
  fastest first, recomputed when a latency changes; a tier's latency is the mean of its
  members' last measurements.
- Selection (the paper's Algorithm 2): each tier has credits (times it may be chosen over
  the run); a tier is drawn with probabilities among tiers with credits and N of its members
  are invited uniformly at random (all of them if fewer). Every I rounds the probabilities
  are recomputed from the tiers' accuracies, ranked ascending: the tier of rank i (0 = least
  accurate) of n gets (n - i) / (n (n + 1) / 2), so the tier the model serves worst is
  chosen most. A tier's accuracy is the mean of its members' last reported scores of the
  model they received on their own data (the `accuracy` metric of their reports). Static
  policy (`tifl.adaptive = false`): uniform over tiers with credits.
- When every tier's credits are spent, all credits are renewed (the paper sizes credits to
  the run; a run longer than planned keeps going rather than stopping).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from aggregator.catafed import RoundPlan, RoundResult, kmeans_1d
from aggregator.fedavg import FedAvgDeadline
from fedmq.config import CataFedSettings, FedAvgSettings, TiflSettings


def rank_probabilities(accuracy: dict[int, float]) -> dict[int, float]:
    """TiFL's ChangeProbs: tiers ranked by ascending accuracy, rank i of n gets (n-i)/(n(n+1)/2)."""
    n = len(accuracy)
    order = sorted(accuracy, key=lambda t: (accuracy[t], t))
    total = n * (n + 1) / 2
    return {t: (n - i) / total for i, t in enumerate(order)}


class TiFL(FedAvgDeadline):
    """Tiers by measured latency, credit-limited adaptive tier selection (module docstring)."""

    name = "tifl"
    leave_on_silence = False
    rng_salt = 0x71F1

    def __init__(self, settings: CataFedSettings, initial: torch.Tensor, *, seed: int = 0,
                 fedavg: FedAvgSettings | None = None, tifl: TiflSettings | None = None) -> None:
        super().__init__(settings, initial, seed=seed, fedavg=fedavg)
        self.tifl = tifl or TiflSettings()
        if self.tifl.tiers < 1 or self.tifl.interval < 1 or self.tifl.credits < 0:
            raise ValueError("tifl.tiers and tifl.interval must be >= 1, tifl.credits >= 0")
        self.latency: dict[str, float] = {}
        """Last measured response latency per agent (inf: silent at the cut-off)."""
        self.score: dict[str, float] = {}
        """Last reported accuracy of the received model on the agent's own data."""
        self.tier_of: dict[str, int] = {}
        self.credits: dict[int, int] = {}
        self.probs: dict[int, float] = {}
        self._stale_tiers = True
        self.profiling_rounds = 0

    # ---------------------------------------------------------------- presence

    def set_online(self, agent: str, online: bool) -> None:
        info = self.agents.get(agent)
        if info is not None and online and not info.online and math.isinf(
                self.latency.get(agent, 0.0)):
            del self.latency[agent]  # back after being away: profile it again
            self._stale_tiers = True
        super().set_online(agent, online)

    # ---------------------------------------------------------------- tiers

    def full_credits(self) -> int:
        return self.tifl.credits or max(1, math.ceil(self.settings.rounds / self.tifl.tiers))

    def retier(self) -> None:
        """k-means of the finite latencies into m tiers, fastest first; credits per tier."""
        timed = sorted(a for a, t in self.latency.items() if math.isfinite(t) and a in self.agents)
        labels = kmeans_1d([self.latency[a] for a in timed], self.tifl.tiers)
        self.tier_of = dict(zip(timed, labels, strict=True))
        tiers = sorted(set(labels))
        self.credits = {t: self.credits.get(t, self.full_credits()) for t in tiers}
        if set(self.probs) != set(tiers):
            self.probs = {t: 1.0 / len(tiers) for t in tiers}
        self._stale_tiers = False

    def members(self) -> dict[int, list[str]]:
        pool = set(self.pool())
        out: dict[int, list[str]] = {}
        for a, t in sorted(self.tier_of.items()):
            if a in pool:
                out.setdefault(t, []).append(a)
        return out

    def tier_accuracy(self) -> dict[int, float]:
        """Mean last score per tier; a tier with no score yet counts as the least accurate."""
        out = {}
        for t in self.credits:
            scores = [self.score[a] for a, x in self.tier_of.items() if x == t and a in self.score]
            out[t] = float(np.mean(scores)) if scores else -1.0
        return out

    # ---------------------------------------------------------------- selection

    def select(self) -> RoundPlan:
        pool = self.pool()
        n_max = self.fedavg.clients_per_round
        unprofiled = [a for a in pool if a not in self.latency]
        if unprofiled:  # profiling: measure who is fast before tiering
            n = min(n_max, len(unprofiled))
            picked = sorted(self.rng.choice(unprofiled, size=n, replace=False).tolist())
            self.profiling_rounds += 1
            return RoundPlan(self.round, picked, None, {})
        if self._stale_tiers:
            self.retier()
        if self.tifl.adaptive and self.round > 0 and self.round % self.tifl.interval == 0:
            self.probs = rank_probabilities(self.tier_accuracy())
        groups = self.members()
        if not groups:  # every online agent missed a cut-off: try them again rather than stall
            if not pool:
                return RoundPlan(self.round, [], None, {})
            n = min(n_max, len(pool))
            return RoundPlan(self.round, sorted(self.rng.choice(pool, size=n, replace=False)
                                                .tolist()), None, {})
        live = [t for t in groups if self.credits.get(t, 0) > 0]
        if not live:
            self.credits = {t: self.full_credits() for t in self.credits}
            live = list(groups)
        weights = np.array([self.probs.get(t, 0.0) if self.tifl.adaptive else 1.0 for t in live])
        if weights.sum() <= 0:
            weights = np.ones(len(live))
        tier = live[int(self.rng.choice(len(live), p=weights / weights.sum()))]
        self.credits[tier] -= 1
        n = min(n_max, len(groups[tier]))
        picked = sorted(self.rng.choice(groups[tier], size=n, replace=False).tolist())
        return RoundPlan(self.round, picked, tier, {t: self.probs.get(t, 0.0) for t in live})

    # ---------------------------------------------------------------- feedback

    def on_results(self, results: list[RoundResult]) -> None:
        for r in results:
            if r.latency_s is not None and math.isfinite(r.latency_s):
                if self.latency.get(r.agent) != r.latency_s:
                    self.latency[r.agent] = float(r.latency_s)
                    self._stale_tiers = True
            elif r.agent not in self.latency:
                self.latency[r.agent] = self.settings.deadline_s  # reported, time unknown
                self._stale_tiers = True
            if "accuracy" in r.metrics:
                self.score[r.agent] = float(r.metrics["accuracy"])

    def after_round(self, plan: RoundPlan) -> None:
        reported = set(self._results)
        for a in plan.selected:
            if a not in reported:  # silent at the cut-off: beyond T_max
                self.latency[a] = math.inf
                self.tier_of.pop(a, None)
                self._stale_tiers = True

    # ---------------------------------------------------------------- durability

    def state(self) -> dict:
        return {**super().state(), "tifl": {
            "latency": {a: (None if math.isinf(t) else t) for a, t in self.latency.items()},
            "score": self.score, "credits": {str(t): c for t, c in self.credits.items()},
            "probs": {str(t): p for t, p in self.probs.items()},
            "profiling_rounds": self.profiling_rounds}}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        t = state.get("tifl", {})
        self.latency = {a: (math.inf if v is None else float(v))
                        for a, v in t.get("latency", {}).items()}
        self.score = {a: float(v) for a, v in t.get("score", {}).items()}
        self.credits = {int(k): int(v) for k, v in t.get("credits", {}).items()}
        self.probs = {int(k): float(v) for k, v in t.get("probs", {}).items()}
        self.profiling_rounds = int(t.get("profiling_rounds", 0))
        self._stale_tiers = True
