"""Ablation runner: the same fleet (same seeds, data, schedule and start models) per variant.

A variant is a method (cdfl, fedsoft-async, local) plus config overrides, e.g.
`cdfl-distill=cdfl:cdfl.personalization=distill,cdfl.beta0=0.1`; `central`,
`central-clusters`, `central-personal` and `central-personal-scratch` are references beside
them (one model, one per cluster, or one per agent's true mixture, trained on the pooled data
of the whole run; no fleet). For every (K, seed) the
scenario's clusters are built and the cluster models pre-trained once; every variant then
starts from those same models and replays the same seeded schedule
(`sim.fleet.make_schedule`) with the same per-cycle data (`sim.scenarios.draw_cycle`) and
the same local-training seeds as the fleet runner. Differences between rows are the
variants' doing, not the draw's.

Two engines:
- in-process (default): the strategy is driven directly (`update` per upload, the agent's
  model passed as the base), no broker and no codec: what the fleet does minus the wire.
  Download size is counted in float32 models per reply (CDFL 1, FedSoft-Async K).
- `--wire`: each variant runs through the fleet runner (`sim.fleet.run_fleet`: real
  Mosquitto, real EdgeAgents, int8-delta codec), recording MQTT payload bytes.

Besides each variant's own estimator, `--estimators a,b,...` scores other estimators on the
very same uploads (same vector, base and clusters) of every CDFL variant: KL per estimator
on identical inputs.

    python -m sim.ablation --clusters 2,3 --seeds 2 --agents 12 --updates-per-agent 3 \
        --variant local=local --variant fedsoft=fedsoft-async \
        --variant cdfl-mixture=cdfl:cdfl.personalization=mixture \
        --variant "cdfl-distill=cdfl:cdfl.personalization=distill" \
        --out sim/results/ablation
"""

from __future__ import annotations

import copy
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmq.algorithms import ASYNC_AGENT
from fedmq.config import (
    AgentSettings,
    Config,
    add_config_arguments,
    config_from_args,
    dataset_named,
    load_config,
)
from fedmq.errors import ArgumentParser, run_main
from fedmq.host import describe_host
from fedmq.logs import event, get_logger, setup_logging
from fedmq.sketch import data_sketch
from sim.figures import epsilon_figure
from sim.fleet import (
    RunSpec,
    agent_privacy,
    configure,
    dp_seed,
    kl_divergence,
    local_training,
    make_schedule,
)
from sim.scenarios import build_clusters, draw_cycle, resolve_scenario
from sim.seeds import int_list, seed_list
from sim.stats import paired_interval

log = get_logger("sim")

CENTRAL = "central"
"""Not a fleet: one model trained on the pooled data of every cycle of the run, the reference
a federated method approaches (and a check on whether a target is reachable at all)."""
CENTRAL_CLUSTERS = "central-clusters"
"""Not a fleet either: K models, model k trained on every pooled sample of cluster k, and each
test sample scored by its own cluster's model. An upper bound for one personalized model per
agent, which must serve its whole mixture (at K = 2 the clusters are 0 and 180 degrees, where
a 6 and a 9 look alike to one model for both; measured on rotated digits the gap to `central`
is small: 0.956 against 0.947, docs/results_cdfl.md#ceilings)."""
CENTRAL_PERSONAL = "central-personal"
"""The best one model per agent we know how to build: for each cycle, `central`'s model fine-tuned
on the pooled data resampled by that cycle's true mixture, so it knows every label the fleet saw
and the agent's mixture exactly (its prior settles what one model cannot route, a 6 against a
turned 9). Its cluster accuracy fine-tunes on one cluster's share alone."""
CENTRAL_PERSONAL_SCRATCH = "central-personal-scratch"
"""`central-personal`, each model trained from Local's start as `central`'s is instead of
fine-tuned from it: alpha (1, 0) then trains what `central-clusters` trains for cluster 0."""
CEILINGS = (CENTRAL, CENTRAL_CLUSTERS, CENTRAL_PERSONAL, CENTRAL_PERSONAL_SCRATCH)
MIXTURE_GRID = 20
"""`central-personal(-scratch)` rounds each mixture to twentieths and trains one model per rounded mixture:
at K = 2 at most 21 models instead of one per cycle (300)."""
METHODS = (*ASYNC_AGENT, *CEILINGS)  # what an agent runs (the variants replay agents), and the ceilings
CENTRAL_EPOCHS = 5
"""Passes over the pooled data; 15 gave the same accuracy within 0.1 pp (rotated digits, K = 2)."""


@dataclass(frozen=True)
class Variant:
    name: str
    method: str
    settings: tuple[tuple[str, str], ...] = ()
    """Dotted config keys and their values, as --set would give them."""

    @classmethod
    def parse(cls, text: str) -> Variant:
        """`NAME=METHOD[:key=value,key=value]`; a bare METHOD names itself."""
        name, sep, rest = text.partition("=")
        if not sep:
            name, rest = text, text
        method, _, opts = rest.partition(":")
        method = method.strip()
        if method not in METHODS:
            raise ValueError(f"variant {text!r}: method must be one of {', '.join(METHODS)}")
        settings = []
        for item in filter(None, (o.strip() for o in opts.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"variant {text!r}: {item!r} is not key=value")
            settings.append((key.strip(), value.strip()))
        return cls(name.strip(), method, tuple(settings))

    def config(self, base: Config) -> Config:
        return load_config(None, dict(self.settings), base=copy.deepcopy(base))


CONTROLS = {"frozen": (("cdfl.beta0", "0"), ("cdfl.server_lr", "0")),
            "proxy-only": (("cdfl.reply_uses_upload", "false"),)}
"""A CDFL variant's controls, run on the same fleet. frozen: the uploads never move the clusters
(server data used exactly as in the variant, refresh included), so variant - frozen is what
the fleet's uploads add (the federation gain). proxy-only: the reply is built without the
agent's upload, so variant - proxy-only is what the agent's own upload adds (the client gain)."""

WIRE_ONE_FLEET = "--jobs: --wire runs one fleet at a time (fleets would share the broker's topics)"
"""Why --wire with --jobs is refused, by the CLI and by run_ablation alike."""


def with_controls(variants: Sequence[Variant], controls: Sequence[str]) -> list[Variant]:
    """Each CDFL variant followed by its controls `NAME/frozen`, `NAME/proxy-only`."""
    out: list[Variant] = []
    names = {v.name for v in variants}
    for v in variants:
        out.append(v)
        if v.method != "cdfl":
            continue
        for c in controls:
            name = f"{v.name}/{c}"
            if name not in names:
                out.append(Variant(name, v.method, v.settings + CONTROLS[c]))
    return out


DEFAULT_VARIANTS = ("local=local", "fedsoft-async=fedsoft-async", "cdfl=cdfl",
                    "cdfl-upload=cdfl:cdfl.personalize_start=upload,cdfl.update_rule=alpha,"
                    "aggregator.pretrain_shared=false",
                    "cdfl-paper=cdfl:cdfl.personalization=mixture,cdfl.cluster_refresh_steps=0,"
                    "cdfl.update_rule=alpha,aggregator.pretrain_shared=false")
"""Today's CDFL defaults (a reply fine-tuned from the cluster mixture, clusters moved by the
agents' steps: docs/results_cdfl.md#the-reply); the upload-start reply (the agent's upload
fine-tuned on proxy data, which the fleet's uploads never reach); and the
paper as written (mixture reply, no refresh). CDFL variants get their controls."""


@dataclass
class AblationSpec:
    scenario: str = "rotated-digits"
    clusters: int = 3
    seed: int = 0
    agents: int = 0
    updates_per_agent: float = 3.0
    test_samples: int = 300
    queue: int = 1
    """Uploads the strategy takes at once (`update_many`), as a loaded aggregator finds them
    queued: their agents train side by side from what they held before the batch."""

    def run_spec(self, method: str, cfg: Config | None = None) -> RunSpec:
        """The fleet runner's spec; local training (epochs, lr, rho) is the variant's `agent.*`."""
        return RunSpec(scenario=self.scenario, method=method, clusters=self.clusters, agents=self.agents,
                       seed=self.seed, updates_per_agent=self.updates_per_agent,
                       test_samples=self.test_samples, **local_training((cfg or Config()).agent))


@dataclass
class VariantResult:
    variant: str
    method: str
    clusters: int
    seed: int
    updates: int
    acc_held: float
    """The model held when new data arrived (before local training), on the new test mixture."""
    acc_trained: float
    """After local training (what is uploaded)."""
    acc_received: float
    """The model installed from the reply, on the mixture it was made for (Local: the trained one)."""
    kl: float
    cluster_acc: float
    models_down_per_update: float
    bytes_down_per_update: float
    client_compute_s: float
    aggregator_s_per_upload: float
    estimator_kl: dict[str, float] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    engine: str = "in-process"
    server_share: float = math.nan
    """The server's labelled samples (proxy + pre-training, all clusters) over the samples the
    fleet trained on in the run (every cycle's training set, counted per draw)."""
    refused: dict[str, int] = field(default_factory=dict)
    """--wire: uploads the aggregator refused, by reason (each a cycle in which the agent kept
    its model); in-process the strategy is driven directly and refuses none."""
    replies_shared: float = 0.0
    """Share of uploads answered by a reply trained for a group of them (cdfl.reply_share)."""


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.mean(xs)) if xs else math.nan


class Fleet:
    """What all variants of one (K, seed) share: config, clusters, pre-trained models, schedule."""

    def __init__(self, spec: AblationSpec, base: Config) -> None:
        from aggregator.bootstrap import resolve_device
        from fedmq.models import model_spec, resolve_model_name

        self.spec = spec
        self.scenario, self.cfg = configure(spec.run_spec("cdfl", base), base)
        self.clusters = build_clusters(self.scenario, self.cfg, spec.clusters)
        self.model_name = resolve_model_name(self.cfg.model, self.cfg.data.dataset)
        self.model_spec = model_spec(self.model_name)
        self.device = resolve_device(self.cfg.device)
        t0 = time.perf_counter()
        self._starts: dict[tuple[bool, int], list[torch.Tensor]] = {}
        self.starts(self.cfg)
        self.pretrain_s = time.perf_counter() - t0
        proxies = [self.clusters.proxy(k, self.cfg.data.proxy_per_cluster or None) for k in range(spec.clusters)]
        self.proxies = [(p.x, p.y) for p in proxies]
        self.n_agents = spec.run_spec("cdfl").resolved_agents()
        self.schedule = make_schedule(spec.seed, self.n_agents, spec.updates_per_agent)
        self.tests = [self.clusters.test(k) for k in range(spec.clusters)]
        self._data: dict[tuple[int, int], Any] = {}
        server = spec.clusters * (self.clusters.proxy_size + self.clusters.pretrain_size)
        fleet_samples = sum(len(self.data(a, c)[0]) for a, c in self.schedule)
        self.server_share = server / max(1, fleet_samples)

    def starts(self, cfg: Config) -> list[torch.Tensor]:
        """The pre-trained cluster models for a variant's pre-training keys (trained once each)."""
        from aggregator.bootstrap import pretrain_clusters

        a = cfg.aggregator
        key = (a.pretrain_shared, a.pretrain_epochs)
        if key not in self._starts:
            self._starts[key] = pretrain_clusters(cfg, self.clusters, self.model_name)
        return self._starts[key]

    def data(self, agent: int, cycle: int) -> Any:
        key = (agent, cycle)
        if key not in self._data:
            self._data[key] = draw_cycle(self.scenario, self.clusters, self.cfg, self.spec.seed, agent, cycle,
                                         self.spec.test_samples)
        return self._data[key]


def _ceiling_result(fleet: Fleet, variant: Variant, acc: float, cluster: float) -> VariantResult:
    """A ceiling's row: its accuracy stands for held, trained and received alike; no KL, no traffic."""
    spec = fleet.spec
    return VariantResult(
        variant=variant.name, method=variant.method, clusters=spec.clusters, seed=spec.seed,
        updates=len(fleet.schedule),
        acc_held=acc, acc_trained=acc, acc_received=acc, kl=math.nan, cluster_acc=cluster,
        models_down_per_update=0.0, bytes_down_per_update=0.0, client_compute_s=math.nan,
        aggregator_s_per_upload=math.nan, settings=dict(variant.settings), server_share=fleet.server_share)


def run_central(fleet: Fleet, variant: Variant) -> VariantResult:
    """A ceiling: models from Local's start trained on every cycle's training set at once (as if
    the fleet's data were pooled on a server), scored on every cycle's test mixture as the
    replies are, and on each cluster's test set. `central`: one model for all; `central-clusters`:
    one per cluster, each sample (train and test) going to its own cluster's model."""
    from fedmq.training import evaluate, fit

    spec, name = fleet.spec, fleet.model_name
    cfg = variant.config(fleet.cfg)
    sets = [fleet.data(a, c) for a, c in fleet.schedule]
    x = torch.cat([train.data.x for train, _ in sets])
    y = torch.cat([train.data.y for train, _ in sets])
    start = torch.stack(fleet.starts(cfg)).mean(0)
    a = cfg.agent

    def trained(keep: torch.Tensor | None) -> torch.Tensor:
        xs, ys = (x, y) if keep is None else (x[keep], y[keep])
        return fit(name, start, xs, ys, epochs=CENTRAL_EPOCHS, batch_size=a.batch_size, lr=a.lr,
                   momentum=a.momentum, seed=spec.seed).vector

    owner = torch.cat([torch.as_tensor(train.cluster) for train, _ in sets])
    if variant.method == CENTRAL_PERSONAL:
        return _central_personal(fleet, variant, a, trained(None), a.epochs, x, y, owner)
    if variant.method == CENTRAL_PERSONAL_SCRATCH:
        return _central_personal(fleet, variant, a, start, CENTRAL_EPOCHS, x, y, owner)
    if variant.method == CENTRAL:
        models = [trained(None)] * spec.clusters
    else:
        models = [trained(owner == k) for k in range(spec.clusters)]

    def routed(test: Any) -> float:
        """Accuracy on a test mixture, each sample scored by its cluster's model."""
        owner = torch.as_tensor(test.cluster)
        right = 0.0
        for k in range(spec.clusters):
            keep = owner == k
            if keep.any():
                right += evaluate(name, models[k], test.data.x[keep], test.data.y[keep])[0] * int(keep.sum())
        return right / len(test)

    acc = _mean([routed(test) for _, test in sets])
    cluster = _mean([evaluate(name, w, t.x, t.y)[0] for w, t in zip(models, fleet.tests, strict=True)])
    return _ceiling_result(fleet, variant, acc, cluster)


def resample_by_mixture(owner: torch.Tensor, alpha: Sequence[float], generator: torch.Generator) -> torch.Tensor:
    """len(owner) indices into a pool whose sample i belongs to cluster owner[i], drawn with
    replacement so that cluster k's expected share is alpha_k, whatever its share of the pool."""
    per_cluster = torch.bincount(owner, minlength=len(alpha)).clamp(min=1).double()
    weights = torch.as_tensor(alpha, dtype=torch.float64)[owner] / per_cluster[owner]
    return torch.multinomial(weights, len(owner), replacement=True, generator=generator)


def _central_personal(fleet: Fleet, variant: Variant, a: AgentSettings, start: torch.Tensor, epochs: int,
                      x: torch.Tensor, y: torch.Tensor, owner: torch.Tensor) -> VariantResult:
    """`central-personal(-scratch)`: for each cycle, `start` trained `epochs` passes (the agent's
    batch size and lr) on the pool resampled by the cycle's true alpha rounded to `MIXTURE_GRID`
    (a sample of cluster k drawn with probability alpha_k / n_k, as many draws as the pool holds).
    One model per distinct rounded mixture."""
    from fedmq.training import evaluate, fit

    spec, name = fleet.spec, fleet.model_name
    models: dict[tuple[int, ...], torch.Tensor] = {}

    def personal(alpha: Sequence[float]) -> torch.Tensor:
        key = tuple(round(float(v) * MIXTURE_GRID) for v in alpha)
        if key not in models:
            salt = len(models)
            pick = resample_by_mixture(owner, key, torch.Generator().manual_seed(spec.seed * 1_000_003 + salt))
            models[key] = fit(name, start, x[pick], y[pick], epochs=epochs, batch_size=a.batch_size,
                              lr=a.lr, momentum=a.momentum, seed=spec.seed + salt).vector
        return models[key]

    accs = []
    for agent, cycle in fleet.schedule:
        train, test = fleet.data(agent, cycle)
        accs.append(evaluate(name, personal(train.alpha.tolist()), test.data.x, test.data.y)[0])
    eye = torch.eye(spec.clusters).tolist()
    cluster = _mean([evaluate(name, personal(e), t.x, t.y)[0] for e, t in zip(eye, fleet.tests, strict=True)])
    event(log, "ablation.central_personal", models=len(models), cycles=len(fleet.schedule))
    return _ceiling_result(fleet, variant, _mean(accs), cluster)


def queued_batches(schedule: Sequence[tuple[int, int]], queue: int) -> list[list[tuple[int, int]]]:
    """The schedule as batches of `queue` events of distinct agents: each batch takes the earliest
    events whose agents are not in it yet (an agent waits for its reply before its next cycle, so
    it is queued once at most); the events passed over keep their order for the next batches."""
    if queue < 1:
        raise ValueError(f"--queue: need at least 1 upload at a time, got {queue}")
    if queue == 1:
        return [[e] for e in schedule]
    left = list(schedule)
    batches: list[list[tuple[int, int]]] = []
    while left:
        batch: list[tuple[int, int]] = []
        agents: set[int] = set()
        rest: list[tuple[int, int]] = []
        for a, c in left:
            if len(batch) < queue and a not in agents:
                batch.append((a, c))
                agents.add(a)
            else:
                rest.append((a, c))
        batches.append(batch)
        left = rest
    return batches


def run_variant(fleet: Fleet, variant: Variant, estimators: Sequence[str] = ()) -> VariantResult:
    """Replay the fleet's schedule with one variant, in-process."""
    if variant.method in CEILINGS:
        return run_central(fleet, variant)
    from aggregator.bootstrap import make_strategy, sketch_references
    from aggregator.cdfl import estimator_options
    from aggregator.estimators import EstimationBatch, SketchEstimator, make_estimator
    from aggregator.strategy import Upload
    from edge_agent.trainer import agent_knobs, train_cycle
    from fedmq.training import evaluate

    spec, name = fleet.spec, fleet.model_name
    cfg = variant.config(fleet.cfg)
    cfg.aggregator.algorithm = variant.method if variant.method != "local" else "cdfl"
    local = cfg.agent  # local training: epochs, lr, rho (a variant may set agent.*)
    strategy = None
    extra = {}
    if variant.method != "local":
        strategy = make_strategy(cfg, fleet.model_spec, [v.clone() for v in fleet.starts(cfg)],
                                 fleet.proxies, device=fleet.device, data=fleet.clusters)
        if variant.method == "cdfl":
            extra = {e: make_estimator(e, **estimator_options(cfg.cdfl, e)) for e in estimators}
            own = strategy.estimator
            for est in extra.values():  # the same references as the variant's own sketch estimator
                if isinstance(est, SketchEstimator):
                    est.references = (own.references if isinstance(own, SketchEstimator)
                                      else sketch_references(cfg, fleet.clusters, fleet.proxies))
    uniform_start = torch.stack(fleet.starts(cfg)).mean(0)
    busiest = max(Counter(a for a, _ in fleet.schedule).values(), default=1)
    privacy = {a: p for a in range(fleet.n_agents)
               if (p := agent_privacy(cfg, variant.method, a, busiest, local.epochs, local.batch_size))}

    def sketch_of(a: int, x: torch.Tensor) -> np.ndarray:
        return privacy[a].release_sketch(data_sketch(x), len(x)) if a in privacy else data_sketch(x)

    held: dict[int, torch.Tensor] = {}
    held_clusters: dict[int, list[torch.Tensor]] = {}
    tau: dict[int, int] = {}
    for a in range(fleet.n_agents):
        if strategy is None:
            held[a] = uniform_start
            continue
        reply = strategy.join(f"sim-{a:05d}")
        if reply.kind == "clusters":
            held_clusters[a] = list(reply.vectors)
            held[a] = torch.stack(reply.vectors).mean(0)
        else:
            held[a] = reply.vectors[0]
        tau[a] = reply.epoch
    rows: dict[str, list[float]] = {k: [] for k in ("held", "trained", "received", "kl", "models", "compute", "agg")}
    est_kl: dict[str, list[float]] = {e: [] for e in extra}

    def _train_event(a: int, c: int) -> list[tuple[int, Upload, Any, torch.Tensor, torch.Tensor]]:
        """Cycle c of agent a up to its upload (Local: to the end of the cycle)."""
        train, test = fleet.data(a, c)
        x, y, xt, yt = train.data.x, train.data.y, test.data.x, test.data.y
        seed = int(np.random.default_rng([spec.seed, a, c, 1]).integers(2**31))
        rows["held"].append(evaluate(name, held[a], xt, yt)[0])
        cpu0 = time.thread_time()
        result, alpha_own = train_cycle(name, variant.method, held[a], held_clusters.get(a), x, y,
                                        privacy=privacy.get(a), dp_seed=dp_seed(spec.seed, a, c),
                                        **agent_knobs(local), seed=seed)
        rows["compute"].append(time.thread_time() - cpu0)
        acc_trained = evaluate(name, result.vector, xt, yt)[0]
        rows["trained"].append(acc_trained)
        if strategy is None:
            held[a] = result.vector
            rows["received"].append(acc_trained)
            return []
        upload = Upload(f"sim-{a:05d}", result.vector, tau[a], n_samples=len(train), alpha=alpha_own,
                        base=held[a] if variant.method == "cdfl" else None,
                        sketch=sketch_of(a, x) if variant.method == "cdfl" else None, noised=a in privacy)
        for e, est in extra.items():
            batch = EstimationBatch(evaluator=strategy.evaluator, clusters=strategy.clusters,
                                    versions=list(strategy.versions), vectors=result.vector[None],
                                    bases=[held[a]], sketches=[upload.sketch])
            est_kl[e].append(kl_divergence(train.alpha, est.estimate(batch)[0][0]))
        return [(a, upload, train, xt, yt)]

    for batch in queued_batches(fleet.schedule, fleet.spec.queue):
        pending: list[tuple[int, Upload, Any, torch.Tensor, torch.Tensor]] = []
        for a, c in batch:
            pending += _train_event(a, c)
        if strategy is None or not pending:
            continue
        t0 = time.perf_counter()
        replies = strategy.update_many([p[1] for p in pending])
        per_upload = (time.perf_counter() - t0) / len(pending)
        for (a, upload, train, xt, yt), reply in zip(pending, replies, strict=True):
            rows["agg"].append(per_upload)
            rows["models"].append(float(len(reply.vectors)))
            if reply.kind == "clusters":
                held_clusters[a] = list(reply.vectors)
                held[a] = sum(float(al) * w for al, w in zip(upload.alpha, reply.vectors, strict=True))
            else:
                held[a] = reply.vectors[0]
            tau[a] = reply.epoch
            rows["received"].append(evaluate(name, held[a], xt, yt)[0])
            alpha_est = upload.alpha if upload.alpha is not None else reply.alpha
            rows["kl"].append(kl_divergence(train.alpha, alpha_est))

    cluster_acc = math.nan
    if strategy is not None:
        accs = [evaluate(name, w, t.x, t.y)[0] for w, t in zip(strategy.server_models(), fleet.tests, strict=True)]
        cluster_acc = float(np.mean(accs))
    models = _mean(rows["models"]) if rows["models"] else 0.0
    return VariantResult(
        variant=variant.name, method=variant.method, clusters=spec.clusters, seed=spec.seed,
        updates=len(fleet.schedule), acc_held=_mean(rows["held"]), acc_trained=_mean(rows["trained"]),
        acc_received=_mean(rows["received"]), kl=_mean(rows["kl"]), cluster_acc=cluster_acc,
        models_down_per_update=models, bytes_down_per_update=models * 4 * fleet.model_spec.numel,
        client_compute_s=_mean(rows["compute"]), aggregator_s_per_upload=_mean(rows["agg"]),
        estimator_kl={e: _mean(v) for e, v in est_kl.items()}, settings=dict(variant.settings),
        server_share=fleet.server_share,
        replies_shared=(strategy.counters.get("replies_shared", 0) / len(rows["agg"])
                        if strategy is not None and rows["agg"] else 0.0))


def run_variant_wire(spec: AblationSpec, variant: Variant, base: Config,
                     broker_url: str | None = None) -> VariantResult:
    """The same variant through the fleet runner (MQTT, EdgeAgents, the configured codec)."""
    from sim.fleet import run_fleet

    cfg = variant.config(base)
    result = run_fleet(spec.run_spec(variant.method, cfg), cfg, broker_url=broker_url)
    s = result.summary()
    u = result.updates
    return VariantResult(
        variant=variant.name, method=variant.method, clusters=spec.clusters, seed=spec.seed,
        updates=len(u), acc_held=s["client_acc_held"], acc_trained=s["client_acc_before"],
        acc_received=s["client_acc"], kl=s["kl"], cluster_acc=s["cluster_acc"],
        models_down_per_update=math.nan, bytes_down_per_update=s["bytes_down_per_update"],
        client_compute_s=s["compute_s_per_update"],
        aggregator_s_per_upload=(s.get("aggregator_busy_s", math.nan) / max(1, len(u))
                                 if variant.method != "local" else math.nan),
        settings=dict(variant.settings), engine="wire", refused=dict(s["refused"]))


def run_fleet_variants(spec: AblationSpec, variants: Sequence[Variant], base: Config,
                       estimators: Sequence[str] = (), wire: bool = False, broker_url: str | None = None,
                       on_result: Any = None) -> list[VariantResult]:
    """Every variant on one (K, seed) fleet, in order."""
    fleet = None if wire else Fleet(spec, base)
    out = []
    for v in variants:
        t0 = time.perf_counter()
        r = run_variant_wire(spec, v, base, broker_url) if wire else run_variant(fleet, v, estimators)
        event(log, "ablation.variant", variant=v.name, k=spec.clusters, seed=spec.seed,
              seconds=round(time.perf_counter() - t0, 1), received=r.acc_received, kl=r.kl)
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


def _start_worker(level: str, json_logs: bool) -> None:
    """A `--jobs` worker: one thread, as the serial runner uses, so its floats are the same."""
    setup_logging(level, json_logs)
    torch.set_num_threads(1)


def run_ablation(variants: Sequence[Variant], *, clusters: Sequence[int], seeds: Sequence[int],
                 base: Config | None = None, scenario: str = "rotated-digits", agents: int = 0,
                 updates_per_agent: float = 3.0, test_samples: int = 300, estimators: Sequence[str] = (),
                 queue: int = 1, wire: bool = False, broker_url: str | None = None,
                 on_result: Any = None, jobs: int = 1, prior: Sequence[VariantResult] = ()) -> list[VariantResult]:
    """Every variant on the same fleet for each (K, seed); results in (K, seed, variant) order.

    `jobs` > 1 runs that many fleets at once, each in its own single-threaded process: a fleet
    depends only on its (K, seed), so the figures equal the serial run's (timings aside, which
    then share the CPU). `prior` results (a resumed run's) are kept and not run again."""
    base = base or Config()
    specs = [AblationSpec(scenario=scenario, clusters=k, seed=seed, agents=agents,
                          updates_per_agent=updates_per_agent, test_samples=test_samples, queue=queue)
             for k in clusters for seed in seeds]
    have = {(r.clusters, r.seed, r.variant): r for r in prior}
    todo = {i: [v for v in variants if (s.clusters, s.seed, v.name) not in have] for i, s in enumerate(specs)}
    todo = {i: vs for i, vs in todo.items() if vs}
    if jobs <= 1 or len(todo) <= 1:
        fresh = {i: run_fleet_variants(specs[i], vs, base, estimators, wire, broker_url, on_result)
                 for i, vs in todo.items()}
    else:
        if wire:
            raise ValueError(WIRE_ONE_FLEET)
        fresh = _run_fleets_at_once(specs, todo, base, estimators, on_result, jobs)
    out = []
    for i, s in enumerate(specs):
        got = {r.variant: r for r in fresh.get(i, [])}
        out += [got.get(v.name) or have[(s.clusters, s.seed, v.name)] for v in variants]
    return out


def _run_fleets_at_once(specs: Sequence[AblationSpec], todo: dict[int, list[Variant]], base: Config,
                        estimators: Sequence[str], on_result: Any, jobs: int) -> dict[int, list[VariantResult]]:
    """`run_fleet_variants` for each fleet in `todo`, `jobs` spawned workers at a time; each
    variant's result reaches `on_result` as it ends. An error, Ctrl-C or SIGTERM ends the
    workers at once (the results so far are already in OUT: `--resume` goes on from them)."""
    import multiprocessing
    import queue

    spawn = multiprocessing.get_context("spawn")
    done: dict[int, list[VariantResult]] = {}
    with spawn.Manager() as manager:
        finished = manager.Queue()
        pool = spawn.Pool(min(jobs, len(todo)), initializer=_start_worker, initargs=(base.log.level, base.log.json))
        try:
            pending = {i: pool.apply_async(run_fleet_variants,
                                           (specs[i], vs, base, estimators, False, None, finished.put))
                       for i, vs in todo.items()}
            while pending or not finished.empty():
                try:
                    r = finished.get(timeout=1.0)
                except queue.Empty:
                    pass
                else:
                    if on_result is not None:
                        on_result(r)
                for i in [i for i, job in pending.items() if job.ready()]:
                    done[i] = pending.pop(i).get()  # a worker's error ends the run here
            pool.close()
        except BaseException:
            pool.terminate()
            raise
        finally:
            pool.join()
    return done


# ---------------------------------------------------------------------------------- report

COLUMNS = [("acc_held", "held", 3), ("acc_trained", "trained", 3), ("acc_received", "received", 3),
           ("kl", "KL", 3), ("cluster_acc", "cluster", 3), ("models_down_per_update", "models/reply", 0),
           ("bytes_down_per_update", "bytes down/update", 0),
           ("client_compute_s", "client s", 3), ("aggregator_s_per_upload", "agg s/upload", 3),
           ("server_share", "server data / fleet data", 3)]


def summarize(results: Sequence[VariantResult]) -> list[dict[str, Any]]:
    """Mean and std over seeds per (K, variant), in first-seen order."""
    groups: dict[tuple[int, str], list[VariantResult]] = {}
    for r in results:
        groups.setdefault((r.clusters, r.variant), []).append(r)
    rows = []
    for (k, v), rs in groups.items():
        row: dict[str, Any] = {"K": k, "variant": v, "method": rs[0].method, "seeds": len(rs)}
        for attr, _, _ in COLUMNS:
            vals = [getattr(r, attr) for r in rs]
            row[attr] = _mean(vals)
            finite = [x for x in vals if not math.isnan(x)]
            row[attr + "_std"] = float(np.std(finite)) if len(finite) > 1 else 0.0
        for e in rs[0].estimator_kl:
            row["estkl_" + e] = _mean([r.estimator_kl.get(e, math.nan) for r in rs])
        refused: dict[str, int] = {}
        for r in rs:
            for reason, n in r.refused.items():
                refused[reason] = refused.get(reason, 0) + int(n)
        if refused:  # summed over seeds
            row["refused"] = dict(sorted(refused.items()))
        if any(r.replies_shared for r in rs):
            row["replies_shared"] = _mean([r.replies_shared for r in rs])
        rows.append(row)
    for row in rows:
        for control, gain in (("frozen", "fed"), ("proxy-only", "client")):
            ctl = groups.get((row["K"], f"{row['variant']}/{control}"))
            if not ctl:
                continue
            own = {r.seed: r for r in groups[(row["K"], row["variant"])]}
            for attr, short in (("acc_received", "received"), ("cluster_acc", "cluster")):
                diffs = [getattr(own[c.seed], attr) - getattr(c, attr) for c in ctl if c.seed in own]
                row[f"{gain}_gain_{short}"], row[f"{gain}_gain_{short}_ci"] = paired_interval(diffs)
    for method, name, pairs in REFERENCES:
        refs = {k: rs for (k, _), rs in groups.items() if rs[0].method == method}
        for row in rows:
            ref = {r.seed: r for r in refs.get(row["K"], [])}
            if row["method"] == method or not ref:
                continue
            mine = [r for r in groups[(row["K"], row["variant"])] if r.seed in ref]
            for attr, short in pairs:
                diffs = [getattr(r, attr) - getattr(ref[r.seed], attr) for r in mine]
                row[f"{name}_gain_{short}"], row[f"{name}_gain_{short}_ci"] = paired_interval(diffs)
            row[f"{name}_kl"] = _mean([ref[r.seed].kl for r in mine])
    return rows


REFERENCES = (("local", "local", (("acc_received", "received"), ("acc_trained", "trained"))),
              ("fedsoft-async", "fedsoft", (("acc_received", "received"), ("cluster_acc", "cluster"))))
"""Every other row is paired by seed with the same fleet's row of these methods."""

GAINS = [("fed_gain_received", "fed gain received (pp)"), ("fed_gain_cluster", "fed gain cluster (pp)"),
         ("client_gain_received", "client gain received (pp)"), ("client_gain_cluster", "client gain cluster (pp)"),
         ("local_gain_received", "received - Local (pp)"), ("local_gain_trained", "trained - Local (pp)"),
         ("fedsoft_gain_received", "received - FedSoft (pp)"), ("fedsoft_gain_cluster", "cluster - FedSoft (pp)")]
"""Paired over seeds, variant minus its control (or minus the `local` or `fedsoft-async`
variant of the same fleet), in percentage points, ± the 95 % t interval."""


@dataclass(frozen=True)
class Target:
    text: str
    key: str
    """A summary row's key: a paired gain, or `kl` (judged against `fedsoft_kl`)."""
    least: float = 0.0
    """The gain must be at least this; `strict`: above it."""
    strict: bool = False
    least_from_k4: float | None = None
    """A larger bar at K >= 4 (the federation gain's +3 pp)."""

    def bar(self, k: int) -> float:
        return self.least_from_k4 if self.least_from_k4 is not None and k >= 4 else self.least

    def met(self, row: dict[str, Any]) -> bool | None:
        """Judged on the mean over seeds; None where the row lacks the figure."""
        if self.key == "kl":
            ref = row.get("fedsoft_kl", math.nan)
            return None if math.isnan(ref) or math.isnan(row["kl"]) else bool(row["kl"] < ref)
        v = row.get(self.key, math.nan)
        if math.isnan(v):
            return None
        return bool(v > self.bar(row["K"]) if self.strict else v >= self.bar(row["K"]) - 1e-12)


TARGETS = (
    Target("received >= Local + 3 pp", "local_gain_received", 0.03),
    Target("federation gain, received: > 0, >= +3 pp at K >= 4", "fed_gain_received", 0.0, True, 0.03),
    Target("federation gain, cluster: > 0", "fed_gain_cluster", 0.0, True),
    Target("trained >= Local", "local_gain_trained"),
    Target("received >= FedSoft-Async", "fedsoft_gain_received"),
    Target("cluster >= FedSoft-Async", "fedsoft_gain_cluster"),
    Target("KL < FedSoft-Async's argmin", "kl"),
)
"""What a CDFL reply must show against its controls and baselines
(docs/results_cdfl.md#headline)."""


def targets_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per CDFL variant whose fleets also ran its frozen control, Local and FedSoft-Async: each
    target per K, met or missed, and the reply's cost; empty when no variant has all three."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows if r["method"] == "cdfl"):
        mine = sorted((r for r in rows if r["variant"] == variant and "fed_gain_received" in r
                       and "local_gain_received" in r and "fedsoft_gain_received" in r), key=lambda r: r["K"])
        if not mine:
            continue
        lines = [f"Targets for `{variant}` (judged on the mean over seeds; ± the paired 95 % t interval):", "",
                 "| target | " + " | ".join(f"K={r['K']}" for r in mine) + " | verdict |",
                 "|---|" + "---|" * (len(mine) + 1)]
        for t in TARGETS:
            cells, missed = [], []
            for r in mine:
                ok = t.met(r)
                if t.key == "kl":
                    cell = f"{r['kl']:.3f} vs {r.get('fedsoft_kl', math.nan):.3f}"
                else:
                    cell = f"{100 * r[t.key]:+.1f}" + (f" ± {100 * r[t.key + '_ci']:.1f}" if r["seeds"] > 1 else "")
                cells.append(cell + ("" if ok is None else " met" if ok else " **missed**"))
                missed += [str(r["K"])] if ok is False else []
            verdict = f"**missed** at K = {', '.join(missed)}" if missed else "met"
            lines.append(f"| {t.text} | " + " | ".join(cells) + f" | {verdict} |")
        lines.append("| reply cost per upload (s) | "
                     + " | ".join(f"{r['aggregator_s_per_upload']:.2f}" for r in mine) + " | - |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    est = sorted({k for r in rows for k in r if k.startswith("estkl_")})
    gains = [g for g in GAINS if any(g[0] in r for r in rows)]
    # a partial extra seed leaves some rows with fewer seeds: then say how many each row has
    uneven = len({r["seeds"] for r in rows}) > 1
    refusals = any(r.get("refused") for r in rows)  # a column only where an upload was refused
    shared = any(r.get("replies_shared") for r in rows)  # and where replies were shared
    head = ["K", "variant", *(["seeds"] if uneven else []), *[c[1] for c in COLUMNS],
            *[g[1] for g in gains], *[e[6:] + " KL" for e in est],
            *(["refused (all seeds)"] if refusals else []), *(["uploads on a shared reply"] if shared else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["K"]), r["variant"], *([str(r["seeds"])] if uneven else [])]
        for attr, _, digits in COLUMNS:
            v = r[attr]
            if isinstance(v, float) and math.isnan(v):
                cells.append("-")
            elif r["seeds"] > 1 and attr.startswith("acc") or attr in ("kl", "cluster_acc") and r["seeds"] > 1:
                cells.append(f"{v:.{digits}f} ± {r[attr + '_std']:.{digits}f}")
            else:
                cells.append(f"{v:.{digits}f}")
        for attr, _ in gains:
            v = r.get(attr, math.nan)
            cells.append("-" if math.isnan(v) else f"{100 * v:+.1f}"
                         + (f" ± {100 * r[attr + '_ci']:.1f}" if r["seeds"] > 1 else ""))
        cells += ["-" if math.isnan(r.get(e, math.nan)) else f"{r[e]:.3f}" for e in est]
        if refusals:
            cells.append(", ".join(f"{k} {n}" for k, n in r.get("refused", {}).items()) or "0")
        if shared:
            cells.append(f"{r.get('replies_shared', 0.0):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(results: Sequence[VariantResult], out: Path, command: str | None = None,
                  sources: Sequence[str] = (), hosts: Sequence[dict[str, Any]] | None = None,
                  note: str | None = None) -> str:
    """results.json (every run, the summary, the machine(s) they ran on: `hosts`, default this
    one) and table.md, headed by the command(s) that made them (and `note`)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    data: dict[str, Any] = {"command": command, "runs": [asdict(r) for r in results], "summary": rows,
                            "hosts": list(hosts) if hosts is not None else [describe_host()]}
    if sources:
        data["sources"] = list(sources)
    if note:
        data["note"] = note
    (out / "results.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    text = markdown_table(rows)
    targets = targets_table(rows)
    text += f"\n\n{targets}" if targets else ""
    head = ((f"`{command}`\n\n" if command else "") + "".join(f"from `{c}`\n\n" for c in sources)
            + (f"**{note}**\n\n" if note else ""))
    (out / "table.md").write_text(head + text + "\n")
    if epsilon_figure(data["runs"], out / "epsilon.png") is not None:
        text += f"\n\nfigure: {out / 'epsilon.png'}"
    return text


def rewrite_results(out: Path) -> str:
    """Rebuild table.md from results.json (after the table's format changed)."""
    data = json.loads((out / "results.json").read_text())
    return write_results([VariantResult(**r) for r in data["runs"]], out, data.get("command"),
                         data.get("sources", ()), hosts=data.get("hosts", []), note=data.get("note"))


def machine_of(host: dict[str, Any]) -> str:
    """What makes two runs of one command give different floats, from a results.json `hosts` entry."""
    return (f"{host.get('cpu_model')} ({host.get('machine')}), {host.get('cpus')} CPUs, python {host.get('python')}, "
            f"torch {host.get('torch')}, {host.get('torch_threads')} threads")


def merge_results(sources: Sequence[Path], out: Path, command: str | None = None) -> tuple[str, str | None]:
    """One table from runs made by separate commands (e.g. a seed added later, run in parallel),
    and the note on it where they came from different machines.

    A (K, seed, variant, engine) present twice is kept once where both copies have the same
    figures (one deterministic run made twice, e.g. beside two different controls) and refused
    where they differ, as is a source given twice: averaging a run with itself would shrink
    the spread and count one seed as two. Runs from different machines (or from a
    source that does not say) are merged with a note in the table: float rounding differs
    between CPUs and grows over a run, so a variant and its control make a pair only when
    one machine ran both (docs/results_cdfl.md#headline).
    """
    runs: list[VariantResult] = []
    commands: list[str] = []
    hosts: list[dict[str, Any]] = []
    machines: set[str] = set()
    seen: dict[tuple[int, int, str, str], tuple[Path, VariantResult]] = {}
    twice = [str(src) for src, n in Counter(Path(s).resolve() for s in sources).items() if n > 1]
    if twice:
        raise ValueError(f"{', '.join(twice)} given twice")
    for src in sources:
        data = json.loads((src / "results.json").read_text())
        commands.extend(data.get("sources") or ([data["command"]] if data.get("command") else []))
        hosts += [h for h in data.get("hosts", []) if h not in hosts]
        machines |= {machine_of(h) for h in data.get("hosts", [])} or {"a source that records no machine"}
        for r in data["runs"]:
            run = VariantResult(**r)
            key = (run.clusters, run.seed, run.variant, run.engine)
            if key in seen:
                if _figures(seen[key][1]) == _figures(run):
                    continue
                raise ValueError(f"K={key[0]} seed={key[1]} {key[2]} ({key[3]}) is in both {seen[key][0]} and {src} "
                                 "with different figures")
            seen[key] = (src, run)
            runs.append(run)
    note = machines_note(machines)
    return write_results(runs, out, command, commands, hosts=hosts, note=note), note


def _figures(r: VariantResult) -> tuple[Any, ...]:
    """What makes two records of a run the same run: all but its timings (NaN equal to NaN)."""
    keep = ("updates", "acc_held", "acc_trained", "acc_received", "kl", "cluster_acc",
            "models_down_per_update", "bytes_down_per_update", "server_share")
    return (*(repr(getattr(r, k)) for k in keep), sorted(r.settings.items()), sorted(r.estimator_kl.items()))


def machines_note(machines: set[str]) -> str | None:
    """The table's warning when its runs came from more than one machine."""
    if len(machines) <= 1:
        return None
    return (f"Runs from {len(machines)} machines ({'; '.join(sorted(machines))}): float rounding differs "
            "between machines; compare a variant only with a control from the same machine.")


def _plan_of(command: str | None) -> list[str]:
    """A command's arguments without those that say where and how it runs, not what it computes."""
    plan: list[str] = []
    skip = False
    for w in shlex.split(command or ""):
        if skip or w == "--resume" or w.split("=")[0] in ("--jobs", "--out") and "=" in w:
            skip = False
            continue
        skip = w in ("--jobs", "--out")
        if not skip:
            plan.append(w)
    return plan


def resumable(out: Path, command: str) -> tuple[list[VariantResult], list[dict[str, Any]]]:
    """The runs OUT/results.json holds from this same command (an interrupted run), and the
    machines they ran on; refused if the file is not a results file or came from another command."""
    path = out / "results.json"
    try:
        data = json.loads(path.read_text())
        runs = [VariantResult(**r) for r in data["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a results file this command can resume ({type(e).__name__}: {e})") from e
    if _plan_of(data.get("command")) != _plan_of(command):
        raise ValueError(f"{path} holds the runs of another command ({data.get('command')}); "
                         "resume with that command, or give another --out")
    hosts = list(data.get("hosts", []))
    here = describe_host()
    return runs, hosts + ([here] if here not in hosts else [])


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim.ablation") -> int:
    p = ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_config_arguments(p, ("broker", "log_level", "data_dir", "seed", "device"))
    p.add_argument("--scenario", help="a scenario of sim/scenarios.py (default rotated-digits, or the rotated "
                   "scenario of the dataset under --data-dir)")
    p.add_argument("--clusters", default="3", help="K or a comma list")
    p.add_argument("--seeds", default="1", help="N (seeds base..base+N-1) or a comma list")
    p.add_argument("--agents", type=int, default=0, help="agents per fleet (default 20*K)")
    p.add_argument("--updates-per-agent", type=float, default=3.0)
    p.add_argument("--test-samples", type=int, default=300)
    p.add_argument("--queue", type=int, default=1, metavar="N",
                   help="uploads the aggregator takes at once, as a loaded one finds them queued; their "
                        "agents train side by side from what they held (default 1: one at a time)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=METHOD[:key=value,...] (repeatable); METHOD: " + ", ".join(METHODS)
                        + "; default: " + " ".join(DEFAULT_VARIANTS))
    p.add_argument("--controls", default="frozen,proxy-only",
                   help="controls run after every CDFL variant on the same fleet, comma list of frozen "
                        "(cdfl.beta0=0: the uploads never move the clusters) and proxy-only "
                        "(cdfl.reply_uses_upload=false), or none; the table gains the federation and "
                        "client gains (default: %(default)s)")
    p.add_argument("--estimators", default="", help="also score these estimators on every CDFL upload")
    p.add_argument("--wire", action="store_true", help="run each variant through the fleet runner (MQTT)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run N (K, seed) fleets at once, one process and one thread each; 0: one per CPU "
                        "core. The figures equal a serial run's; the timing columns then share the CPU "
                        "(default 1)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--resume", action="store_true",
                   help="keep the runs OUT/results.json already holds from this same command (one that was "
                        "interrupted) and run only the rest")
    p.add_argument("--report", action="store_true", help="only rebuild OUT/table.md from OUT/results.json")
    p.add_argument("--merge", action="append", type=Path, default=[], metavar="DIR",
                   help="only write OUT from the runs in DIR/results.json (repeatable; runs nothing)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the scenario, dataset, variants and their keys, print the plan and exit")
    args = p.parse_args(argv)
    command = "python -m sim.ablation " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.report:
        print(rewrite_results(args.out))
        return 0
    if args.merge:
        try:
            text, note = merge_results(args.merge, args.out, command)
            print(text)
            if note:
                print(f"{prog}: --merge: warning: {note}", file=sys.stderr)
        except (OSError, ValueError, KeyError) as e:
            print(f"{prog}: --merge: {e}", file=sys.stderr)
            return 2
        return 0
    cfg = config_from_args(args)
    setup_logging(cfg.log.level, cfg.log.json)
    args.scenario = resolve_scenario(args.scenario, cfg, args.data_dir, dataset_named(args)).name
    try:
        variants = [Variant.parse(v) for v in (args.variant or DEFAULT_VARIANTS)]
        controls = [c.strip() for c in args.controls.split(",") if c.strip() and c.strip() != "none"]
        unknown = [c for c in controls if c not in CONTROLS]
        if unknown:
            raise ValueError(f"--controls: unknown {', '.join(unknown)}; use {', '.join(CONTROLS)} or none")
        variants = with_controls(variants, controls)
        ceilings = [v.name for v in variants if v.method in CEILINGS]
        if args.jobs < 0:
            raise ValueError(f"--jobs: {args.jobs} is negative; give N >= 1, or 0 for one per CPU core")
        if args.wire and args.jobs != 1:
            raise ValueError(WIRE_ONE_FLEET)
        if args.queue < 1 or (args.wire and args.queue != 1):
            raise ValueError(f"--queue: need N >= 1, got {args.queue}" if args.queue < 1 else
                             "--queue: over MQTT (--wire) the aggregator's own queue decides; run without it")
        if args.wire and ceilings:
            raise ValueError(f"--wire: {', '.join(ceilings)} pools the fleet's data on one machine, it is "
                             "not a fleet; run it without --wire")
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    seeds = seed_list(args.seeds, cfg.seed)
    clusters = int_list(args.clusters, "--clusters", minimum=1)
    estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    jobs = min(args.jobs or os.cpu_count() or 1, len(seeds) * len(clusters))
    prior: list[VariantResult] = []
    hosts: list[dict[str, Any]] | None = None
    if args.resume and (args.out / "results.json").exists():
        try:
            prior, hosts = resumable(args.out, command)
        except ValueError as e:
            print(f"{prog}: --resume: {e}", file=sys.stderr)
            return 2
    note = machines_note({machine_of(h) for h in hosts}) if hosts else None
    if args.dry_run:
        from sim.scenarios import describe_plan

        try:
            for v in variants:
                v.config(cfg).cdfl.check()  # every key=value is a real config key, in range
        except ValueError as e:
            print(f"python -m sim.ablation: {e}", file=sys.stderr)
            return 2
        print(describe_plan(args.scenario, cfg, clusters))
        for v in variants:
            print(f"  variant {v.name}: {v.method}" + "".join(f", {k}={val}" for k, val in v.settings))
        print(f"{len(variants)} variants x K {', '.join(map(str, clusters))} x seeds "
              f"{', '.join(map(str, seeds))}, {args.updates_per_agent:g} updates per agent"
              f"{f', {args.queue} uploads at a time' if args.queue > 1 else ''}"
              f"{' over MQTT' if args.wire else ''}, {jobs} fleet{'s' if jobs > 1 else ''} at a time; "
              f"output {args.out}" + (f", {len(prior)} runs kept from it" if args.resume else "")
              + " (dry run: nothing run)")
        return 0
    torch.set_num_threads(1)
    done: list[VariantResult] = list(prior)
    if prior:
        print(f"resuming: {len(prior)} runs kept from {args.out / 'results.json'}", flush=True)

    def progress(r: VariantResult) -> None:
        done.append(r)
        write_results(done, args.out, command, hosts=hosts, note=note)
        print(f"K={r.clusters} seed={r.seed} {r.variant}: held {r.acc_held:.3f} trained {r.acc_trained:.3f} "
              f"received {r.acc_received:.3f} KL {r.kl:.3f} cluster {r.cluster_acc:.3f} "
              f"agg {r.aggregator_s_per_upload:.3f}s {r.estimator_kl}"
              + (f" refused {r.refused}" if r.refused else ""), flush=True)

    results = run_ablation(variants, clusters=clusters, seeds=seeds, base=cfg, scenario=args.scenario,
                           agents=args.agents, updates_per_agent=args.updates_per_agent,
                           test_samples=args.test_samples, estimators=estimators, queue=args.queue,
                           wire=args.wire,
                           broker_url=cfg.broker.url if args.broker else None, on_result=progress, jobs=jobs,
                           prior=prior)
    print(write_results(results, args.out, command, hosts=hosts, note=note))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m sim.ablation", main))
