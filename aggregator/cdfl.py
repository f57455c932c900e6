"""CDFL, client-driven asynchronous FL: K cluster models, one personalized reply per upload.

Our reading of the paper (docs/cdfl.md). Upload (v, tau) at t := t + 1:
1. staleness d = t - tau; if d > tau0 (0: the number of agents seen) the clusters stay
   bit-identical, but the agent still gets a personalized model from the estimate;
2. estimate alpha over the clusters (aggregator/estimators.py, chosen by name);
3. beta_k = beta0 * alpha_k * s(d) with the hinge s; w_k := (1 - beta_k) w_k + beta_k v;
4. reply u = sum_k alpha_k w_k (after the update) and t.

`SoftClusters` holds what CDFL and FedSoft-Async share (cluster models, epochs, the
staleness rule and step 3); they differ only in where alpha comes from and what is sent.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from aggregator.aggregation import hinge_staleness, latest_per_agent
from aggregator.cluster_refresh import refresh_cluster
from aggregator.estimators import EstimationBatch, Estimator, make_estimator, uniform
from aggregator.evaluator import Proxy, ProxyEvaluator
from aggregator.personalize import (
    Personalizer,
    PersonalizeRequest,
    alpha_mixture,
    make_personalizer,
)
from aggregator.strategy import (
    Reply,
    Strategy,
    Upload,
    UploadLedger,
    check_alpha,
    check_vector,
)
from fedmq.config import CDFLSettings, ConfigError, resolve_trunk_share
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec

log = get_logger("aggregator")

UPDATE_RULES = ("alpha", "sharpen", "confidence", "delta")


def update_weights(alpha: Sequence[float], rule: str = "alpha", power: float = 2.0) -> list[float]:
    """The per-cluster share of beta0 an upload gets (step 3), so clusters stay specialists.

    alpha: alpha_k (the paper). sharpen: alpha_k^power renormalized (a mixed upload pulls its
    dominant cluster, barely the others). confidence: alpha_k times the estimate's confidence
    1 - H(alpha) / log K (an upload whose mixture is unclear moves no cluster much).
    delta: alpha_k, applied to the upload's step v - base instead of v - w_k (see _step).
    """
    a = [max(0.0, float(x)) for x in alpha]
    if rule in ("alpha", "delta") or len(a) < 2:
        return a
    if rule == "sharpen":
        p = [x ** power for x in a]
        total = sum(p)
        return [x / total for x in p] if total > 0 else a
    entropy = -sum(x * math.log(x) for x in a if x > 0)
    confidence = max(0.0, 1.0 - entropy / math.log(len(a)))
    return [x * confidence for x in a]


class ClusterAgreement:
    """Where each cluster's applied steps have been heading, and how far to trust a step that
    points the other way (`cdfl.direction_guard`, the delta rule only).

    Per cluster, an exponential average of the unit directions of the steps it took, each
    weighted by the upload's alpha share. An upload's step is compared with the alpha-weighted
    mix of its clusters' directions. Below the fleet's own floor (`floor`: 0, or lower where
    the fleet's recent cosines spread wide) its cluster steps are scaled by 1 + (cos - floor) /
    guard, never below MIN_TRUST (so an honest step that disagrees still contributes). In
    soak/poisoning.py's fleet every honest cosine was above 0 (median 0.32) and a sign flip's
    -0.06 to -0.63: the floor is 0 there. In docs/simulator.md's fleet (60 agents uploading 3
    times each, at staleness 40) 29 % of honest cosines were below 0, down to -0.28, median
    0.40: judged against 0 they cost 1.9 pp of client accuracy at K = 3; the floor (median - 2
    MAD) spares part of them. Only steps the guard took (in part) teach the directions; a cluster
    needs WARMUP of them before the guard judges against it."""

    WARMUP = 2
    MEMORY = 0.8
    MIN_TRUST = 0.1
    WINDOW = 50
    """Recent cosines the floor is read from, at most PER_AGENT (the latest) of any one agent's,
    so an attacker's own flips cannot lower the floor for its next ones."""
    PER_AGENT = 3
    SPREAD = 2.0
    """The floor is min(0, median - SPREAD x MAD) of the window: robust while under half of it
    comes from attackers. At 3 the soak's x5 sign flip did 12.7 pp of harm on one seed (4.1 at
    2, as with a floor of 0)."""
    FLOOR_WARMUP = 10
    """Cosines in the window before the floor moves below 0 (a few are no fleet's spread)."""

    def __init__(self, k: int, numel: int, guard: float) -> None:
        self.guard = float(guard)
        self.directions = torch.zeros(k, numel) if guard > 0 else None
        self.seen = [0] * k
        self.recent: deque[tuple[str, float]] = deque(maxlen=self.WINDOW)

    def floor(self) -> float:
        counted = torch.tensor(latest_per_agent(self.recent, self.PER_AGENT), dtype=torch.float64)
        if len(counted) < self.FLOOR_WARMUP:
            return 0.0
        median = float(counted.median())
        mad = float((counted - median).abs().median())
        return min(0.0, median - self.SPREAD * mad)

    def trust(self, step: Tensor, alpha: Sequence[float], agent: str = "") -> float:
        """The share of `step` to take (1: whole); a judged step's cosine joins the window."""
        if self.directions is None or any(a > 0 and n < self.WARMUP for a, n in zip(alpha, self.seen, strict=True)):
            return 1.0
        mix = torch.as_tensor(list(alpha), dtype=torch.float32) @ self.directions
        norms = float(torch.linalg.vector_norm(mix)) * float(torch.linalg.vector_norm(step))
        if norms == 0.0:
            return 1.0
        cos = float(step.float() @ mix) / norms
        floor = self.floor()
        self.recent.append((agent, cos))
        return 1.0 if cos >= floor else max(self.MIN_TRUST, 1.0 + (cos - floor) / self.guard)

    def add(self, step: Tensor, alpha: Sequence[float], trust: float) -> None:
        if self.directions is None or trust <= 0:
            return
        length = float(torch.linalg.vector_norm(step))
        if length == 0.0:
            return
        unit = step.float() / length
        for k, a in enumerate(alpha):
            w = (1.0 - self.MEMORY) * a * trust
            if w > 0:
                self.directions[k].mul_(1.0 - w).add_(unit, alpha=w)
                self.seen[k] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"directions": None if self.directions is None else self.directions.clone(), "seen": list(self.seen),
                "recent": [[agent, cos] for agent, cos in self.recent]}

    def load_state_dict(self, d: dict[str, Any] | None) -> None:
        """A state saved without the guard (or with it off) starts it afresh; one saved before
        the floor starts with an empty window."""
        if self.directions is None or not d or d.get("directions") is None:
            return
        if tuple(d["directions"].shape) != tuple(self.directions.shape):
            raise ValueError(f"state directions {tuple(d['directions'].shape)}, expected {tuple(self.directions.shape)}")
        self.directions = d["directions"].detach().to("cpu", torch.float32).clone()
        self.seen = [int(n) for n in d["seen"]]
        self.recent.clear()
        self.recent.extend((str(agent), float(cos)) for agent, cos in d.get("recent", []))


class SoftClusters(Strategy):
    """K cluster vectors with staleness-gated, alpha-weighted asynchronous updates."""

    def server_models(self) -> Tensor:
        return self.served()

    def served(self) -> Tensor:
        """The cluster models the server reports (accuracy, metrics): the iterates here."""
        return self.clusters

    def __init__(self, spec: ModelSpec, clusters: Tensor | Sequence[Tensor], *, tau0: int = 0,
                 beta0: float = 0.025, hinge_a: float = 10.0, hinge_b: float = 5.0,
                 update_rule: str = "alpha", update_power: float = 2.0, server_lr: float = 1.0,
                 delta_hinge_a: float = 0.1, delta_tau0: int = 0, staleness_cap: int = 1,
                 delta_moves_head: bool = True, trunk_share: float = 0.0,
                 direction_guard: float = 0.0, server_lr_ramp: int = 0) -> None:
        super().__init__()
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"update_rule must be one of {', '.join(UPDATE_RULES)}, got {update_rule!r}")
        self.update_rule = update_rule
        self.update_power = float(update_power)
        w = torch.stack(list(clusters)) if not isinstance(clusters, Tensor) else clusters
        if w.ndim != 2 or w.shape[1] != spec.numel or w.shape[0] < 1:
            raise ValueError(f"clusters must be [K, {spec.numel}], got {tuple(w.shape)}")
        if tau0 < 0 or not 0.0 <= beta0 <= 1.0 or hinge_a < 0 or hinge_b < 0:
            raise ValueError(f"need tau0 >= 0, 0 <= beta0 <= 1, a, b >= 0; got tau0={tau0} "
                             f"beta0={beta0} a={hinge_a} b={hinge_b}")
        if server_lr < 0 or delta_hinge_a < 0 or delta_tau0 < 0 or server_lr_ramp < 0:
            raise ValueError(f"need server_lr, delta_hinge_a, delta_tau0, server_lr_ramp >= 0; got {server_lr}, "
                             f"{delta_hinge_a}, {delta_tau0}, {server_lr_ramp}")
        self.server_lr = float(server_lr)
        self.server_lr_ramp = int(server_lr_ramp)
        """delta rule: applied uploads over which the step grows linearly from server_lr to 1 (0 = none)."""
        self.delta_hinge_a = float(delta_hinge_a)
        self.delta_tau0 = int(delta_tau0)
        if not 0.0 <= trunk_share <= 1.0:
            raise ValueError(f"cdfl.trunk_share must be in [0, 1], got {trunk_share}")
        self.trunk_share = float(trunk_share)
        """delta rule: how much of an agent's step below the output layer every cluster takes
        whatever its alpha (1: the layers below the heads learn from every upload, as one trunk)."""
        self.delta_head = None if delta_moves_head else spec.head
        """delta rule: the span of the output layer (its weight and bias, the spec's last two
        parameters) that an agent's step leaves alone; None = none."""
        self.spec = spec
        self.clusters = w.detach().to("cpu", torch.float32).clone()
        self.k = int(w.shape[0])
        self.tau0 = int(tau0)
        self.beta0 = float(beta0)
        self.hinge_a = float(hinge_a)
        self.hinge_b = float(hinge_b)
        self.versions = [0] * self.k
        """Bumped whenever w_k changes (keys the evaluator's cluster-loss cache)."""
        self.cluster_updated = [0] * self.k
        """Epoch of each cluster's last change."""
        self.agents_seen: dict[str, int] = {}
        """Agent -> clock when first seen (insertion-ordered)."""
        self.last_reply_version: dict[str, int] = {}
        """Agent -> clock of the last reply it was sent."""
        self.ledger = UploadLedger(staleness_cap)
        if direction_guard < 0:
            raise ValueError(f"cdfl.direction_guard must be >= 0, got {direction_guard}")
        self.agreement = ClusterAgreement(self.k, spec.numel, direction_guard)

    # ------------------------------------------------------------------ shared rules

    def staleness_threshold(self, delta: bool = False) -> int:
        if delta:
            return self.delta_tau0 if self.delta_tau0 > 0 else 5 * max(1, len(self.agents_seen))
        return self.tau0 if self.tau0 > 0 else max(1, len(self.agents_seen))

    def _see(self, agent: str) -> None:
        self.agents_seen.setdefault(agent, self.uploads_applied)

    def mixture(self, alpha: Sequence[float]) -> Tensor:
        """sum_k alpha_k w_k (float32)."""
        return alpha_mixture(self.clusters, alpha)

    def delta_rate(self) -> float:
        """The delta rule's step now: server_lr, ramped linearly to 1 over server_lr_ramp uploads
        (a warm-up: the fleet's first steps, the largest, taken small). From strong pre-trained
        clusters the full step cost them whenever it came (docs/results_realsize.md)."""
        if self.server_lr_ramp <= 0:
            return self.server_lr
        done = min(1.0, self.uploads_applied / self.server_lr_ramp)
        return self.server_lr + (1.0 - self.server_lr) * done

    def _step(self, upload: Upload, vector: Tensor, alpha: list[float]) -> dict[str, Any]:
        """Steps 1 and 3 at t := t + 1; returns what happened for Reply.info."""
        self._see(upload.agent)
        self.uploads_applied += 1
        d = self.ledger.staleness(upload.tau, self.uploads_applied)
        self.ledger.record(upload.agent, self.uploads_applied)
        # The delta rule: what the agent learned from its data, v - base, added to each cluster
        # in its share, w_k += server_lr alpha_k s(d) (v - base). The paper's pull toward v,
        # w_k += beta_k (v - w_k), also drags a specialist toward the agent's starting point (a
        # mixture of clusters), hence its small beta0 and steep staleness discount; a step from
        # an older base is still a step down the agent's loss, so it is discounted gently.
        # A DP-SGD upload's step is mostly noise: added whole it wrecks the clusters (0.25 at
        # epsilon 1 on digits); the pull rule's small convex step averages it out (0.955).
        base = upload.base if self.update_rule == "delta" and not upload.noised else None
        delta = base is not None
        threshold = self.staleness_threshold(delta)
        s = hinge_staleness(d, self.delta_hinge_a if delta else self.hinge_a, self.hinge_b)
        info: dict[str, Any] = {"staleness": d, "uploads_since": self.uploads_applied - int(upload.tau),
                                "tau0": threshold, "s": s}
        if d > threshold:
            self.counters["stale"] += 1
            info.update(stale=True, betas=[0.0] * self.k)
            return info
        rate = self.delta_rate() if delta else self.beta0
        weights = update_weights(alpha, self.update_rule, self.update_power)
        betas = [rate * a * s for a in weights]
        trunk_betas = betas
        step = None
        if base is not None:
            step = vector - base.to(vector.dtype)
            if self.delta_head is not None:
                step[self.delta_head[0]:self.delta_head[1]] = 0.0
            info["rule"] = "delta"
            if self.trunk_share > 0.0:
                trunk_betas = [rate * s * ((1.0 - self.trunk_share) * a + self.trunk_share) for a in weights]
                info["trunk_betas"] = trunk_betas
        if step is not None:
            trust = self.agreement.trust(step, alpha, upload.agent)
            if trust < 1.0:
                betas = [b * trust for b in betas]
                trunk_betas = [b * trust for b in trunk_betas]
                info["trust"] = round(trust, 4)
            self.agreement.add(step, alpha, trust)
        refused: list[int] = []
        for k, (beta, trunk_beta) in enumerate(zip(betas, trunk_betas, strict=True)):
            if max(beta, trunk_beta) <= 0.0:
                continue
            if step is not None:
                before = self.clusters[k].clone() if trunk_beta != beta and self._guards_trunk() else None
                self._delta_step(k, step, vector, beta, trunk_beta)
                if before is not None:
                    shared = self.clusters[k].clone()
                    self.clusters[k].copy_(before)
                    self._delta_step(k, step, vector, beta, beta)  # the alpha share alone
                    if self._shared_step_kept(k, shared, self.clusters[k]):
                        self.clusters[k].copy_(shared)
                    else:
                        refused.append(k)
            else:
                self.clusters[k].mul_(1.0 - beta).add_(vector, alpha=beta)
            self._changed(k)
        self.counters["applied"] += 1
        if refused:
            self.counters["trunk_refused"] += len(refused)
            info["trunk_refused"] = refused
        info.update(stale=False, betas=betas)
        return info

    def _delta_step(self, k: int, step: Tensor, vector: Tensor, beta: float, trunk_beta: float) -> None:
        """w_k += the agent's step: trunk_beta below the output layer, beta on it."""
        stats = self.spec.param_numel  # running statistics from here on: averaged, never stepped
        head0, head1 = self.spec.head
        # A step on a variance can make it negative (w_k's is smaller than base - v's):
        # statistics take the pull rule instead, a convex mixture (beta <= 1 here).
        self.clusters[k][:stats].add_(step[:stats], alpha=trunk_beta)
        if trunk_beta != beta:  # the output layer keeps its alpha share
            self.clusters[k][head0:head1].add_(step[head0:head1], alpha=beta - trunk_beta)
        if stats < self.spec.numel:
            b = min(beta, 1.0)
            self.clusters[k][stats:].mul_(1.0 - b).add_(vector[stats:], alpha=b)

    def _guards_trunk(self) -> bool:
        """Whether the shared part of a trunk step must prove itself (CDFL, cdfl.trunk_guard)."""
        return False

    def _shared_step_kept(self, k: int, shared: Tensor, own: Tensor) -> bool:
        return True

    def _changed(self, k: int) -> None:
        """w_k moved at this clock: the evaluator's cluster-loss cache keys on versions."""
        self.versions[k] += 1
        self.cluster_updated[k] = self.uploads_applied

    def _base_state(self) -> dict[str, Any]:
        return {"epoch": self.uploads_applied, "clusters": self.clusters.clone(), "versions": list(self.versions),
                "cluster_updated": list(self.cluster_updated), "agents_seen": dict(self.agents_seen),
                "last_epoch": dict(self.last_reply_version), "counters": dict(self.counters),
                "k": self.k, "spec": self.spec.hash, "ledger": self.ledger.state_dict(),
                "agreement": self.agreement.state_dict()}

    def _load_base(self, d: dict[str, Any]) -> None:
        if d.get("spec") != self.spec.hash or int(d["k"]) != self.k:
            raise ValueError(f"state for spec {d.get('spec')} with K={d.get('k')} does not fit "
                             f"{self.spec.arch} ({self.spec.hash}) with K={self.k}")
        clusters = d["clusters"]
        if tuple(clusters.shape) != tuple(self.clusters.shape):
            raise ValueError(f"state clusters {tuple(clusters.shape)}, expected {tuple(self.clusters.shape)}")
        self.uploads_applied = int(d["epoch"])
        self.clusters = clusters.detach().to("cpu", torch.float32).clone()
        self.versions = [int(v) for v in d["versions"]]
        self.cluster_updated = [int(v) for v in d["cluster_updated"]]
        self.agents_seen = {str(a): int(e) for a, e in d["agents_seen"].items()}
        self.last_reply_version = {str(a): int(e) for a, e in d["last_epoch"].items()}
        self.ledger.load_state_dict(d.get("ledger", {}))
        self.agreement.load_state_dict(d.get("agreement"))
        self.counters.clear()
        self.counters.update(d["counters"])


GPU_REPLY_BATCH = 8
"""cdfl.reply_batch = 0 on a GPU: 8 queued replies trained together paid 1.57x (cnn28) and 3.64x
(digits model) on an H200, against 0.71x and 2.54x on a 2-core CPU (docs/results_cdfl.md#cost)."""


def resolve_reply_batch(requested: int, device: torch.device) -> int:
    """cdfl.reply_batch as set, or for 0 (auto) the batch that paid on this kind of device."""
    if requested:
        return requested
    return GPU_REPLY_BATCH if device.type == "cuda" else 1


def share_groups(alphas: Sequence[Sequence[float]], tolerance: float) -> list[list[int]]:
    """Indices of queued uploads grouped so that within a group every two alphas differ by at
    most `tolerance` in every coordinate (complete linkage; greedy, in queue order). The mean
    of a group then lies within `tolerance` of each member (the max-norm ball is convex)."""
    groups: list[list[int]] = []
    for i, a in enumerate(alphas):
        for members in groups:
            if all(max(abs(float(x) - float(y)) for x, y in zip(a, alphas[j], strict=True)) <= tolerance
                   for j in members):
                members.append(i)
                break
        else:
            groups.append([i])
    return groups


def estimator_options(settings: CDFLSettings, name: str) -> dict[str, Any]:
    """The options cdfl.* give estimator `name` (the variant's own, or sim.ablation's extras)."""
    options = {"normalize": settings.metrics_normalize, "at": settings.direction_at,
               "mode": settings.evidence_mode, "floor": settings.estimator_floor,
               "epochs": settings.trajectory_epochs, "lr": settings.trajectory_lr,
               "rho": settings.trajectory_rho, "metric_weights": settings.metric_weights,
               "temperature": settings.temperature}
    if name == "sketch":
        options.update(fallback=settings.sketch_fallback, sketch_floor=settings.sketch_floor,
                       sketch_shrinkage=settings.sketch_shrinkage)
    return options


def cdfl_evaluator(spec: ModelSpec, proxies: Sequence[Proxy], settings: CDFLSettings,
                   device: str = "auto") -> ProxyEvaluator:
    """The proxy evaluator [cdfl] configures (the aggregator's and every reply worker's)."""
    return ProxyEvaluator(spec, proxies, device=device, batch=settings.proxy_batch,
                          chunk=settings.eval_chunk or None, compile=settings.eval_compile,
                          formulation=settings.eval_formulation, workers=settings.eval_workers or None)


def cdfl_personalizer(settings: CDFLSettings, evaluator: ProxyEvaluator) -> Personalizer:
    """The reply [cdfl] configures (the aggregator's and every reply worker's); ConfigError
    naming the key for a value out of range or an unknown name."""
    settings.check()
    try:
        return make_personalizer(settings.personalization, evaluator, epochs=settings.personalize_epochs,
                                 lr=settings.personalize_lr, batch_size=settings.personalize_batch_size,
                                 samples=settings.personalize_samples,
                                 min_steps=settings.personalize_min_steps,
                                 tail_average=settings.personalize_tail_average,
                                 rho=settings.personalize_rho,
                                 kd_weight=settings.personalize_kd_weight,
                                 temperature=settings.personalize_temperature,
                                 start=settings.personalize_start,
                                 blend_grid=settings.personalize_blend_grid,
                                 mixture_guard=settings.personalize_mixture_guard,
                                 layers=settings.personalize_layers,
                                 head_above=settings.personalize_head_above)
    except ValueError as exc:  # an unknown personalization or start, a blend grid out of [0, 1]
        raise ConfigError(f"[cdfl] reply: {exc}") from None


class CDFL(SoftClusters):
    """CDFL server: estimates alpha from the upload on proxy data, replies one personalized model."""

    name = "cdfl"

    def __init__(self, spec: ModelSpec, clusters: Tensor | Sequence[Tensor], proxies: Sequence[Proxy],
                 *, tau0: int = 0, beta0: float = 0.025, hinge_a: float = 10.0, hinge_b: float = 5.0,
                 estimator: str | Estimator = "metrics", metric_weights: Sequence[float] = (1.0, 1.0, 1.0),
                 temperature: float = 1.0, estimator_options: dict[str, Any] | None = None,
                 device: str = "auto", proxy_batch: int = 1000,
                 evaluator: ProxyEvaluator | None = None, update_rule: str = "alpha",
                 update_power: float = 2.0, personalization: str | Personalizer = "mixture",
                 personalize_options: dict[str, Any] | None = None, seed: int = 0,
                 refresh_steps: int = 0, refresh_lr: float = 0.01, reply_uses_upload: bool = True,
                 server_lr: float = 1.0, delta_hinge_a: float = 0.1, delta_tau0: int = 0,
                 staleness_cap: int = 1, reply_batch: int = 0, delta_moves_head: bool = True,
                 trunk_share: float = 0.0, refresh_all: bool = False, trunk_guard: bool = False,
                 average: float = 0.0, reply_average: float = 0.0, direction_guard: float = 0.0,
                 server_lr_ramp: int = 0, reply_share: float = 0.0) -> None:
        super().__init__(spec, clusters, tau0=tau0, beta0=beta0, hinge_a=hinge_a, hinge_b=hinge_b,
                         update_rule=update_rule, update_power=update_power, server_lr=server_lr,
                         server_lr_ramp=server_lr_ramp,
                         delta_hinge_a=delta_hinge_a, delta_tau0=delta_tau0, staleness_cap=staleness_cap,
                         delta_moves_head=delta_moves_head, trunk_share=trunk_share,
                         direction_guard=direction_guard)
        if refresh_steps < 0 or refresh_lr <= 0:
            raise ValueError(f"need cluster_refresh_steps >= 0 and cluster_refresh_lr > 0, "
                             f"got {refresh_steps} and {refresh_lr}")
        self.refresh_steps = int(refresh_steps)
        self.refresh_lr = float(refresh_lr)
        self.refresh_all = bool(refresh_all)
        self.trunk_guard = bool(trunk_guard)
        if not 0.0 <= average < 1.0:
            raise ValueError(f"cdfl.cluster_average must be in [0, 1), got {average}")
        self.average = float(average)
        self.averaged = self.clusters.clone() if self.average > 0.0 else None
        """cdfl.cluster_average: an exponential average of the cluster iterates, the cluster
        models the server reports. Replies are still made from the iterates: an agent's step is
        relative to the reply it trained from, and added to an average it was not taken from it
        made both the clusters and the replies worse (docs/results_cdfl.md#cluster-updates)."""
        if not 0.0 <= reply_average < 1.0:
            raise ValueError(f"cdfl.reply_average must be in [0, 1), got {reply_average}")
        self.reply_average = float(reply_average)
        self.reply_averaged = self.clusters.clone() if self.reply_average > 0.0 else None
        """cdfl.reply_average: a short exponential average of the iterates the replies are made
        from (None: from the iterates themselves)."""
        self.reply_uses_upload = bool(reply_uses_upload)
        if reply_batch < 0:
            raise ValueError(f"need cdfl.reply_batch >= 0 (0 = auto), got {reply_batch}")
        if evaluator is None:
            if len(proxies) != self.k:
                raise ValueError(f"{len(proxies)} proxy sets for {self.k} clusters")
            evaluator = ProxyEvaluator(spec, proxies, device=device, batch=proxy_batch)
        elif evaluator.num_sets != self.k:
            raise ValueError(f"evaluator has {evaluator.num_sets} proxy sets for {self.k} clusters")
        self.evaluator = evaluator
        self.reply_batch = resolve_reply_batch(int(reply_batch), evaluator.device)
        if isinstance(estimator, Estimator):
            self.estimator = estimator
        else:
            options = {"metric_weights": metric_weights, "temperature": temperature}
            options.update(estimator_options or {})
            self.estimator = make_estimator(estimator, **options)
        self.personalizer = (personalization if isinstance(personalization, Personalizer)
                             else make_personalizer(personalization, evaluator, **(personalize_options or {})))
        if not 0.0 <= reply_share <= 1.0:
            raise ValueError(f"cdfl.reply_share must be in [0, 1], got {reply_share}")
        if reply_share > 0 and self.reply_uses_upload and self.personalizer.reads_upload():
            raise ValueError("cdfl.reply_share shares replies that do not read the upload: it needs "
                             "cdfl.personalize_start = mixture or dominant (or cdfl.reply_uses_upload = false)")
        self.reply_share = float(reply_share)
        """cdfl.reply_share: the largest alpha difference within a group of queued uploads that
        take one reply (0 = every upload its own)."""
        self.seed = int(seed)
        self.last_sent: dict[str, Tensor] = {}
        """Agent -> the personalized vector it was last sent (u_m), kept only when the
        estimator needs it (P floats per agent, in memory and in checkpoints)."""

    @classmethod
    def from_settings(cls, spec: ModelSpec, clusters: Tensor | Sequence[Tensor], proxies: Sequence[Proxy],
                      settings: CDFLSettings, device: str = "auto", **kwargs: Any) -> CDFL:
        options = estimator_options(settings, settings.estimator)
        refresh = settings.cluster_refresh_steps
        if refresh and spec.statistics_numel > 0:
            # The refresh trains with batch norm in eval mode, against running statistics that
            # uploads mix and codecs round: on ResNet-20 a weight went from 1 to 571 in two
            # uploads and the replies turned NaN. Such models take the paper's rule alone.
            # A user who set the refresh themselves hears it at the default level (a sim's too).
            asked = (refresh, settings.cluster_refresh_lr) != (CDFLSettings.cluster_refresh_steps,
                                                               CDFLSettings.cluster_refresh_lr)
            event(log, "cluster_refresh.off", logging.WARNING if asked else logging.INFO,
                  reason="the model keeps batch-norm statistics", arch=spec.arch,
                  ignored=f"cdfl.cluster_refresh_steps={refresh} cdfl.cluster_refresh_lr={settings.cluster_refresh_lr}")
            refresh = 0
        if "evaluator" not in kwargs:
            kwargs["evaluator"] = cdfl_evaluator(spec, proxies, settings, device)
        return cls(spec, clusters, proxies, tau0=settings.tau0, beta0=settings.beta0,
                   hinge_a=settings.hinge_a, hinge_b=settings.hinge_b, estimator=settings.estimator,
                   metric_weights=settings.metric_weights, temperature=settings.temperature,
                   estimator_options=options, device=device, proxy_batch=settings.proxy_batch,
                   update_rule=settings.update_rule, update_power=settings.update_power,
                   personalization=cdfl_personalizer(settings, kwargs["evaluator"]),
                   refresh_steps=refresh, refresh_lr=settings.cluster_refresh_lr,
                   refresh_all=settings.cluster_refresh_all,
                   reply_uses_upload=settings.reply_uses_upload, server_lr=settings.server_lr,
                   server_lr_ramp=settings.server_lr_ramp,
                   delta_hinge_a=settings.delta_hinge_a, delta_tau0=settings.delta_tau0,
                   staleness_cap=settings.staleness_cap, reply_batch=settings.reply_batch,
                   delta_moves_head=settings.delta_moves_head,
                   trunk_share=resolve_trunk_share(settings.trunk_share, len(clusters)),
                   trunk_guard=settings.trunk_guard, average=settings.cluster_average,
                   reply_average=settings.reply_average, direction_guard=settings.direction_guard,
                   reply_share=settings.reply_share, **kwargs)

    def _guards_trunk(self) -> bool:
        return self.trunk_guard

    def served(self) -> Tensor:
        return self.averaged if self.averaged is not None else self.clusters

    def _shared_step_kept(self, k: int, shared: Tensor, own: Tensor) -> bool:
        """cdfl.trunk_guard: cluster k takes the whole trunk step only where its loss on its
        own proxy set is no higher than with the alpha share alone (the shared part broke a
        cluster at trunk_share 0.5, docs/results_cdfl.md#cluster-updates)."""
        return self.evaluator.loss_on(shared, k) <= self.evaluator.loss_on(own, k)

    @property
    def reply_is_trained(self) -> bool:
        """Whether a reply costs a training (then the journal keeps the reply vector, so that
        replay after a crash does not train every reply again), or is shared (replay, one upload
        at a time, could not make it again)."""
        return self.personalizer.name != "mixture" or self.reply_share > 0

    def _step(self, upload: Upload, vector: Tensor, alpha: list[float]) -> dict[str, Any]:
        """Steps 1 and 3, then the proxy refresh of every cluster with a share of the upload."""
        info = super()._step(upload, vector, alpha)
        if self.refresh_steps and not info["stale"]:
            # Which clusters are refreshed depends on alpha and staleness, not on beta0: with
            # beta0 = 0 (the frozen control) the server's data is used exactly as with uploads.
            t0 = time.perf_counter()
            for k, share in enumerate(update_weights(alpha, self.update_rule, self.update_power)):
                if share > 0.0 or self.refresh_all:
                    self.clusters[k] = refresh_cluster(
                        self.evaluator, self.clusters[k], k, steps=self.refresh_steps, lr=self.refresh_lr,
                        seed=(self.seed * 1_000_003 + self.uploads_applied) * 64 + k, counters=self.counters)
                    if info["betas"][k] == 0.0:  # step 3 did not mark it changed
                        self._changed(k)
            info["refresh_seconds"] = time.perf_counter() - t0
        if not info["stale"]:
            # Each applied upload's iterates enter the averages: an agent's step is one noisy
            # sample of its cluster's descent, and an average keeps what the steps share.
            for avg, decay in ((self.averaged, self.average), (self.reply_averaged, self.reply_average)):
                if avg is not None:
                    avg.mul_(decay).add_(self.clusters, alpha=1.0 - decay)
        return info

    def replied_from(self) -> Tensor:
        """The cluster models replies are made from: the iterates, or their short average."""
        return self.reply_averaged if self.reply_averaged is not None else self.clusters

    def _personalized(self, agent: str, alpha: list[float], info: dict[str, Any],
                      upload: Tensor | None = None, sent: Tensor | None = None) -> Reply:
        """Step 4: one model for the agent (aggregator/personalize.py; joins get the mixture).

        Seeded by (seed, clock): journal replay of the same record rebuilds the same model;
        `sent` (from the journal, checked by the caller) skips rebuilding it."""
        if sent is not None:
            u = sent
            info.update(personalization="journal")
        elif upload is None:
            u = alpha_mixture(self.replied_from(), alpha)
        else:
            u, diag = self.personalizer.personalize(self._request(alpha, upload))
            self._made(info, diag)
        return self._reply(agent, alpha, info, u, self.uploads_applied)

    def _made(self, info: dict[str, Any], diag: dict[str, Any]) -> None:
        """Record how a trained reply was made; a start the mixture guard moved to one cluster
        is counted (`mixture_guarded`), as the clusters leaving one basin show first there."""
        info.update(personalization=self.personalizer.name, personalize=diag)
        if diag.get("start") == "cluster":
            self.counters["mixture_guarded"] += 1

    def _request(self, alpha: list[float], upload: Tensor) -> PersonalizeRequest:
        return PersonalizeRequest(self.replied_from(), alpha, upload if self.reply_uses_upload else None,
                                  seed=self.seed * 1_000_003 + self.uploads_applied)

    def _reply(self, agent: str, alpha: list[float], info: dict[str, Any], u: Tensor, epoch: int) -> Reply:
        if self.estimator.needs_base:
            self.last_sent[agent] = u
        self.last_reply_version[agent] = epoch
        return Reply(agent=agent, epoch=epoch, vectors=[u], kind="personalized", alpha=alpha, info=info)

    def join(self, agent: str, n_samples: int = 0) -> Reply:
        self._see(agent)
        self.counters["joins"] += 1
        return self._personalized(agent, uniform(self.k), {"join": True})

    def estimate_many(self, uploads: Sequence[Upload], vectors: Tensor) -> list[tuple[list[float], dict[str, Any]]]:
        """Alpha for every upload against the clusters as they are now (one batched evaluation)."""
        batch = EstimationBatch(evaluator=self.evaluator, clusters=self.clusters, versions=list(self.versions),
                                vectors=vectors, bases=[self._base_of(u) for u in uploads],
                                sketches=[u.sketch for u in uploads])
        return self.estimator.estimate(batch)

    def _base_of(self, upload: Upload) -> Tensor | None:
        if upload.base is not None:
            return check_vector(upload.base, self.spec.numel, f"base of {upload.agent}")
        return self.last_sent.get(upload.agent)

    def update_many(self, uploads: list[Upload]) -> list[Reply]:
        """Estimate all uploads at once, then apply steps 1, 3 and 4 one by one, in order.

        Approximation: the whole batch is estimated against the clusters as they were at the
        start of the batch (F(w_k; D_k) comes from the evaluator's cache, recomputed only for
        clusters that changed). With beta0 = 0.025 a batch of 32 moves a cluster by at most
        ~1 - 0.975^32 of the way, and estimation only ranks clusters, so this is small.
        """
        if not uploads:
            return []
        vectors = torch.stack([check_vector(u.vector, self.spec.numel, f"upload from {u.agent}")
                               for u in uploads])
        t0 = time.perf_counter()
        estimates = self.estimate_many(uploads, vectors)
        seconds = time.perf_counter() - t0
        if self.reply_share > 0 and len(uploads) > 1:
            return self._shared_replies(uploads, vectors, estimates, seconds)
        together = len(uploads) > 1 and self._chunk(len(uploads)) > 1
        replies: list[Reply] = []
        queued: list[tuple[str, list[float], dict[str, Any], PersonalizeRequest, int]] = []
        for upload, vector, (alpha, diag) in zip(uploads, vectors, estimates, strict=True):
            info = self._stepped(upload, vector, alpha, diag, len(uploads), seconds)
            if not together:
                replies.append(self._personalized(upload.agent, alpha, info, vector))
                continue
            # Each reply starts from the clusters as they are after its own upload; the
            # trainings themselves read only the proxy sets, so they can run together later.
            request = self._request(alpha, vector)
            self.personalizer.fix_start(request)
            queued.append((upload.agent, alpha, info, request, self.uploads_applied))
        made = self._train([q[3] for q in queued])
        for (agent, alpha, info, _, epoch), (u, diag) in zip(queued, made, strict=True):
            self._made(info, diag)
            replies.append(self._reply(agent, alpha, info, u, epoch))
        return replies

    def _stepped(self, upload: Upload, vector: Tensor, alpha: list[float], diag: dict[str, Any],
                 batch: int, seconds: float) -> dict[str, Any]:
        """Steps 1 and 3 for one upload of a batch estimated in `seconds`; the reply's info."""
        info = self._step(upload, vector, alpha)
        info.update(estimator=self.estimator.name, estimate=diag, batch=batch, estimate_seconds=seconds)
        return info

    def _chunk(self, n: int) -> int:
        """How many of n replies train in one call: all n for reply workers
        (aggregator/reply_pool.py), cdfl.reply_batch in-process; 1 when they train one by one."""
        if not self.personalizer.trains_together():
            return 1
        return n if getattr(self.personalizer, "fan_out", False) else self.reply_batch

    def _train(self, requests: list[PersonalizeRequest]) -> list[tuple[Tensor, dict[str, Any]]]:
        """The replies for `requests` (their starts fixed or read from their clusters): trained
        together in chunks of cdfl.reply_batch, all at once by reply workers, else one by one."""
        size = self._chunk(len(requests))
        if size > 1:
            return [m for i in range(0, len(requests), size)
                    for m in self.personalizer.personalize_many(requests[i:i + size])]
        return [self.personalizer.personalize(r) for r in requests]

    def _shared_replies(self, uploads: list[Upload], vectors: Tensor,
                        estimates: list[tuple[list[float], dict[str, Any]]], seconds: float) -> list[Reply]:
        """cdfl.reply_share: apply every upload of the batch, then train one reply per group of
        close alphas, for the group's mean alpha, from the clusters after the whole batch.

        A reply that does not read the upload depends on it only through alpha and the clusters
        it moved; a group's reply sees every upload of the batch, so it is at least as fresh as
        each member's own would have been. Each member's alpha is within the tolerance of the
        mean it was trained for (the groups are complete-linkage in the max norm)."""
        done: list[tuple[str, list[float], dict[str, Any], int]] = []
        for upload, vector, (alpha, diag) in zip(uploads, vectors, estimates, strict=True):
            info = self._stepped(upload, vector, alpha, diag, len(uploads), seconds)
            done.append((upload.agent, alpha, info, self.uploads_applied))
        groups = share_groups([d[1] for d in done], self.reply_share)
        # Seeded by the group's last upload, as an unshared reply is by its own.
        requests = [PersonalizeRequest(self.replied_from(),
                                       [sum(done[i][1][k] for i in members) / len(members) for k in range(self.k)],
                                       None, seed=self.seed * 1_000_003 + done[members[-1]][3])
                    for members in groups]
        made = self._train(requests)
        replies: list[Reply | None] = [None] * len(done)
        for members, (u, diag) in zip(groups, made, strict=True):
            self.counters["replies_shared"] += len(members) - 1
            for i in members:
                agent, alpha, info, _ = done[i]
                info.update(shared=len(members), replied_at=self.uploads_applied)
                self._made(info, diag)
                replies[i] = self._reply(agent, alpha, info, u.clone(), self.uploads_applied)
        return [r for r in replies if r is not None]

    def apply(self, upload: Upload, alpha: list[float] | None = None, sent: Tensor | None = None,
              replied_at: int | None = None) -> Reply:
        """One upload with a given alpha (journal replay); `replied_at` is the version a shared
        reply was made at (cdfl.reply_share: after its whole batch), so replay restores it."""
        if alpha is None:
            return self.update_many([upload])[0]
        alpha = check_alpha(alpha, self.k)
        vector = check_vector(upload.vector, self.spec.numel, f"upload from {upload.agent}")
        if sent is not None:  # checked before any change
            sent = check_vector(sent, self.spec.numel, f"journaled reply to {upload.agent}")
        if replied_at is not None and sent is None:
            raise ValueError(f"a shared reply to {upload.agent} (replied_at {replied_at}) needs its journaled vector")
        info = self._step(upload, vector, alpha)
        info.update(estimator="given")
        if replied_at is not None:
            info.update(personalization="journal", replied_at=int(replied_at))
            return self._reply(upload.agent, alpha, info, sent, int(replied_at))
        return self._personalized(upload.agent, alpha, info, vector, sent=sent)

    def _kept_average(self, d: dict[str, Any], key: str) -> Tensor:
        kept = d.get(key)
        if kept is not None and tuple(kept.shape) != tuple(self.clusters.shape):
            raise ValueError(f"state {key} clusters {tuple(kept.shape)}, expected {tuple(self.clusters.shape)}")
        return (self.clusters if kept is None else kept).detach().to("cpu", torch.float32).clone()

    def state_dict(self) -> dict[str, Any]:
        d = self._base_state()
        d["algorithm"] = self.name
        d["last_sent"] = {a: v.clone() for a, v in self.last_sent.items()}
        for key, avg in (("averaged", self.averaged), ("reply_averaged", self.reply_averaged)):
            if avg is not None:
                d[key] = avg.clone()
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("algorithm") != self.name:
            raise ValueError(f"state is for {d.get('algorithm')!r}, not {self.name!r}")
        self._load_base(d)
        self.last_sent = {str(a): v.detach().to("cpu", torch.float32).clone() for a, v in d["last_sent"].items()}
        # A state saved without an average (or with it off) starts it from the iterates.
        if self.average > 0.0:
            self.averaged = self._kept_average(d, "averaged")
        if self.reply_average > 0.0:
            self.reply_averaged = self._kept_average(d, "reply_averaged")
        self.evaluator.invalidate()
