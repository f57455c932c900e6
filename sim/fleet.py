"""One simulated fleet run: a broker, the aggregator, N edge agents, a seeded schedule.

The agents are the edge agent's own code (`edge_agent.protocol_client.EdgeAgent`), each a real MQTT
client with its own connection, client id and persistent session; they share this process
and a few worker threads. What an agent does in one cycle:

1. new data arrives (a new mixture: `sim.scenarios.draw_cycle`, a pure function of
   (seed, agent, cycle));
2. it trains from the model it holds (CDFL: proximal to the received model; FedSoft-Async:
   estimates its mixture by per-sample argmin over the K received models, then trains with
   proximal terms toward each; Local: from its own model, and never talks to anyone);
3. it uploads the encoded delta and installs the reply (CDFL: one personalized model;
   FedSoft-Async: all K models).

When agents update is drawn from the seed: each agent's update times are a Poisson process
(on average `updates_per_agent` in the run), merged into one order of events. `workers`
threads take events in that order; an agent's cycles run one after another. With one
worker the run is a pure function of the seed; with more, arrivals at the aggregator depend
on thread timing, and the order they really happened in is recorded (`arrival`).

Every `eval_every` events all workers drain and the cluster models are scored on each
cluster's test set (the aggregator is idle then: every agent has its reply).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmq.algorithms import ASYNC_SERVER
from fedmq.config import AgentSettings, Config
from fedmq.errors import RuntimeFailure
from fedmq.logs import event, get_logger
from fedmq.privacy import UplinkPrivacy
from fedmq.transport import NetworkLoop, use_network
from sim.scenarios import Scenario, apply_defaults, build_clusters, draw_cycle, get_scenario

log = get_logger("sim")

METHODS: dict[str, str] = {**{name: name for name in ASYNC_SERVER}, "local": ""}
"""Simulator method -> aggregator algorithm ('' = no server): every asynchronous one, and local."""


@dataclass
class RunSpec:
    """Everything that decides one run (written to summary.json)."""

    scenario: str = "rotated-digits"
    method: str = "cdfl"
    clusters: int = 3
    agents: int = 0
    """0: 20 * K, the paper's fleet size."""
    seed: int = 0
    updates_per_agent: float = 25.0
    """Mean number of updates per agent (Poisson)."""
    workers: int = 1
    test_samples: int = 300
    cluster_test_samples: int = 0
    """Test images per cluster the cluster models are scored on at each checkpoint: a fixed draw
    (0, or more than the split holds: all of it). The real-size scenarios take 2,000: on CIFAR-10's
    10,000 per cluster, evaluation was 787 s of a 1,341 s run of 99 uploads (the fleet waits)."""
    eval_every: int = 0
    """Events between cluster-accuracy checkpoints (0: about ten per run)."""
    local_epochs: int = 2
    """The agents' local training (`agent.epochs`, `agent.lr`, `agent.rho`: `local_training`); the
    other `agent.*` knobs come from the run's config."""
    local_lr: float = 0.01
    rho: float = 0.1

    def resolved_agents(self) -> int:
        return self.agents or 20 * self.clusters

    @property
    def label(self) -> str:
        return f"{self.scenario}_K{self.clusters}_{self.method}_s{self.seed}"


@dataclass
class UpdateRecord:
    """One upload-download cycle of one agent (one row of updates.csv)."""

    event: int
    """Position in the seeded schedule."""
    arrival: int
    """Order in which the cycle finished (thread timing; = event with one worker)."""
    agent: str
    cycle: int
    n_samples: int
    tau: int
    epoch: int
    staleness: int
    acc_held: float
    """The model held when new data arrived, on the new test mixture."""
    acc_before: float
    """The agent's trained model (before the download)."""
    acc_after: float
    """The model installed from the download (Local: its trained model)."""
    kl: float
    """KL(true alpha || estimated alpha); NaN for Local."""
    alpha_true: list[float]
    alpha_est: list[float] | None
    bytes_up: int
    bytes_down: int
    compute_s: float
    """Agent CPU seconds for this update: mixture estimate (FedSoft) + local training."""
    encode_s: float
    round_trip_s: float
    """Upload sent -> reply installed (broker + aggregator + codec on the way back)."""
    t: float
    """Seconds since the first event."""
    refused: str = ""
    """The reason the aggregator refused this upload ('' when applied), or "diverged": local
    training left NaN or Inf and nothing was sent. Either is an outcome, not a failure: the agent
    keeps the model it held (after a re-join for the reasons that need one) and the run goes on."""


@dataclass
class RunResult:
    spec: RunSpec
    updates: list[UpdateRecord]
    cluster_acc: list[dict[str, Any]]
    """Checkpoints: {'events': n, 'acc': [per cluster]}."""
    agent_bytes: dict[str, dict[str, int]]
    """Per agent: up and down bytes in total, the join included."""
    wall_s: float
    broker: str
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        u = self.updates
        applied = [r for r in u if not r.refused]
        def mean(xs: list[float]) -> float:
            xs = [x for x in xs if not math.isnan(x)]
            return float(np.mean(xs)) if xs else math.nan
        final = self.cluster_acc[-1]["acc"] if self.cluster_acc else []
        n_agents = max(1, len(self.agent_bytes))
        return {
            "spec": asdict(self.spec), "label": self.spec.label, "broker": self.broker,
            "updates": len(u), "wall_s": round(self.wall_s, 2),
            "client_acc": mean([r.acc_after for r in u]),
            "client_acc_before": mean([r.acc_before for r in u]),
            "client_acc_held": mean([r.acc_held for r in u]),
            "cluster_acc": float(np.mean(final)) if final else math.nan,
            "cluster_acc_per_cluster": final,
            "kl": mean([r.kl for r in u]),
            "bytes_up_per_update": mean([float(r.bytes_up) for r in u]),
            "bytes_down_per_update": mean([float(r.bytes_down) for r in u]),
            "bytes_up_per_agent": sum(b["up"] for b in self.agent_bytes.values()) / n_agents,
            "bytes_down_per_agent": sum(b["down"] for b in self.agent_bytes.values()) / n_agents,
            "compute_s_per_update": mean([r.compute_s for r in u]),
            "staleness_mean": mean([float(r.staleness) for r in applied]),
            "round_trip_s_mean": mean([r.round_trip_s for r in applied]),
            "refused": refusal_counts(u),
            **self.info,
        }


def refusal_counts(records: list[UpdateRecord]) -> dict[str, int]:
    """How many uploads the aggregator refused, by reason (sorted; empty when none was)."""
    return dict(sorted(Counter(r.refused for r in records if r.refused).items()))


def kl_divergence(p: list[float] | np.ndarray, q: list[float] | np.ndarray, eps: float = 1e-6) -> float:
    """KL(p || q) in nats, q floored at eps and renormalized (an estimate of exactly 0 is finite)."""
    p = np.asarray(p, dtype=np.float64)
    q = np.maximum(np.asarray(q, dtype=np.float64), eps)
    q = q / q.sum()
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


def make_schedule(seed: int, agents: int, updates_per_agent: float) -> list[tuple[int, int]]:
    """(agent, cycle) in time order: each agent's updates are Poisson(mean) uniform times."""
    rng = np.random.default_rng([seed, 0x5343484544])
    times: list[tuple[float, int]] = []
    for a in range(agents):
        count = int(rng.poisson(updates_per_agent))
        times.extend((float(t), a) for t in rng.uniform(0.0, 1.0, size=count))
    times.sort()
    next_cycle = [0] * agents
    out = []
    for _, a in times:
        out.append((a, next_cycle[a]))
        next_cycle[a] += 1
    return out


EMBEDDED_PROTOCOL = "3.1.1"
"""amqtt speaks MQTT 3.1.1 only and stalls concurrent clients that try v5 first."""


@contextlib.contextmanager
def running_broker(url: str | None) -> Iterator[tuple[str, str]]:
    """(url, kind): the broker given, else Mosquitto (dev.conf), else the embedded one."""
    if url:
        yield url, "external"
        return
    from fedmq.broker import MosquittoBroker, find_mosquitto

    if find_mosquitto():
        with MosquittoBroker.dev() as b:
            yield b.url, "mosquitto"
        return
    from fedmq.embedded_broker import EmbeddedBroker

    with EmbeddedBroker() as b:
        yield b.url, "embedded"


class _Dispatcher:
    """Hands out events in schedule order; pauses everyone at checkpoints; keeps agents' cycles in order."""

    def __init__(self, schedule: list[tuple[int, int]], eval_every: int,
                 checkpoint: Callable[[int], None], positions: list[int] | None = None) -> None:
        self.schedule = schedule
        self.positions = positions
        """Each entry's place in the whole fleet's schedule (a part of a split run); None: i."""
        self.eval_every = eval_every
        self.checkpoint = checkpoint
        self.cond = threading.Condition()
        self.next = 0
        self.done = 0
        self.done_cycles: dict[int, int] = {}
        self.failed: BaseException | None = None
        self.draining = False
        """A checkpoint is waiting for the events before it: nobody takes another until it ran."""

    def take(self) -> tuple[int, int, int] | None:
        with self.cond:
            # wait_for releases the lock: without this, others would take events past a
            # checkpoint while it drains, and their finishes could carry `done` past it.
            self.cond.wait_for(lambda: not self.draining or self.failed is not None)
            if self.next >= len(self.schedule) or self.failed:
                return None
            i = self.next
            if self.eval_every and i and i % self.eval_every == 0:
                self.draining = True
                try:
                    self.cond.wait_for(lambda: self.done == i or self.failed is not None)
                    if self.failed:
                        return None
                    self.checkpoint(i)  # the events before i are done, none after it taken
                finally:
                    self.draining = False
                    self.cond.notify_all()
            self.next += 1
            agent, cycle = self.schedule[i]
            self.cond.wait_for(lambda: self.done_cycles.get(agent, 0) == cycle or self.failed is not None)
            if self.failed:
                return None
            return (self.positions[i] if self.positions is not None else i), agent, cycle

    def finish(self, agent: int) -> int:
        with self.cond:
            self.done += 1
            self.done_cycles[agent] = self.done_cycles.get(agent, 0) + 1
            self.cond.notify_all()
            return self.done - 1

    def fail(self, e: BaseException) -> None:
        with self.cond:
            self.failed = self.failed or e
            self.cond.notify_all()


def configure(spec: RunSpec, base: Config | None = None) -> tuple[Scenario, Config]:
    """The run's Config: the scenario's dataset, K, tau0 = number of agents, the method's algorithm."""
    scenario = get_scenario(spec.scenario)
    if spec.method not in METHODS:
        raise ValueError(f"unknown method {spec.method!r}; one of {', '.join(METHODS)}")
    if scenario.fixed_clusters and spec.clusters != scenario.fixed_clusters:
        raise ValueError(f"{scenario.name} has {scenario.fixed_clusters} clusters; use --clusters "
                         f"{scenario.fixed_clusters}")
    cfg = copy.deepcopy(base) if base is not None else Config()
    cfg.seed = spec.seed
    apply_defaults(scenario, cfg)
    cfg.cdfl.clusters = spec.clusters
    if cfg.cdfl.tau0 == 0:
        cfg.cdfl.tau0 = spec.resolved_agents()
    cfg.aggregator.algorithm = METHODS[spec.method] or "cdfl"
    return scenario, cfg


def fleet_name(base: str, spec: RunSpec) -> str:
    """One fleet (topic prefix, sessions) per run, so runs may share a broker."""
    return f"{base}.{spec.method}.K{spec.clusters}.s{spec.seed}"[:64]


def start_aggregator(cfg: Config, clusters: Any, stack: contextlib.ExitStack, busy: dict[str, float],
                     after_batch: Callable[[list[Any]], None] | None = None,
                     before_start: Callable[[Any], None] | None = None) -> Any:
    """The aggregator in this process (journal in a temp dir), stopped when `stack` closes.

    Returns the running AggregatorService (its `engine`, `presence`). `before_start(engine)`
    runs before it connects; `after_batch(batch)` after each batch it handles.
    """
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fedmq-sim-"))
    cfg.aggregator.state_dir = f"{tmp}/aggregator"
    engine = build_engine(cfg, clusters=clusters)
    _time_engine(engine, busy, after_batch)
    if before_start is not None:
        before_start(engine)
    service = stack.enter_context(AggregatorService(cfg, engine))
    if service.sole.failed.is_set():  # it never connected: the agents' joins would wait forever
        raise RuntimeFailure(f"the simulated fleet's aggregator did not start: {service.sole.failure}")
    return service


def start_agents(cfg: Config, spec: RunSpec, indices: range, stack: contextlib.ExitStack) -> list[Any]:
    """Agents sim-IIIII for `indices`, connected on one epoll thread and joined."""
    from edge_agent.protocol_client import EdgeAgent

    # All agents' connections on one epoll thread (paho's own loop is a thread and a
    # select() per client, which stops at ~340 clients); closed after the agents.
    network = NetworkLoop("sim-network")
    stack.callback(network.close)
    agents = []
    with use_network(network):
        for i in indices:
            agent = EdgeAgent(cfg, agent_name(i), algorithm=spec.method, reply_timeout_s=60.0)
            agent.start(timeout=30.0)
            stack.callback(agent.stop)
            agents.append(agent)
    for agent in agents:
        agent.join()
    return agents


def server_models(strategy: Any, k: int) -> list[torch.Tensor]:
    """The server's models to score on the K clusters' test sets: its K cluster models, or
    its one global model K times (FedAsync, FedBuff)."""
    models = list(strategy.server_models())
    return models * k if len(models) == 1 else models


def dp_seed(seed: int, agent: int, cycle: int) -> int:
    """DP-SGD's noise seed for one simulated cycle: the run stays a pure function of its seed."""
    return int(np.random.default_rng([seed, agent, cycle, 2]).integers(2**63))


def agent_privacy(cfg: Config, method: str, agent: int, busiest: int, epochs: int,
                  batch_size: int = 32) -> UplinkPrivacy | None:
    """A simulated agent's DP mechanisms; None with DP off or for Local (which sends nothing).

    The budget is spread over privacy.uploads uploads, or over the busiest agent's count in the
    schedule where that is more, so that no agent runs out mid-run; planned for the scenario's
    smallest draw (data.min_samples), which costs the most epsilon per upload. The sketch and
    alpha noise is seeded by (seed, agent)."""
    if cfg.privacy.epsilon <= 0 or method == "local":
        return None
    settings = copy.deepcopy(cfg.privacy)
    settings.uploads = max(settings.uploads, busiest)
    return settings.mechanisms(seed=int(np.random.default_rng([cfg.seed, agent, 3]).integers(2**63)), plan=dict(
        n=cfg.data.min_samples, batch_size=batch_size, epochs=epochs,
        sketch=method == "cdfl" and cfg.agent.send_sketch, alpha=method == "fedsoft-async"))


def agent_name(index: int) -> str:
    return f"sim-{index:05d}"


class Stopwatch:
    """Seconds spent per kind of work, summed over threads (agents' cycles may run side by side)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.spent[kind] += time.perf_counter() - t0


WALL_PARTS = ("setup_s", "agents_training_s", "aggregator_s", "evaluation_s", "rest_s")
"""summary.json's `wall_split`: where a run's wall time went."""


def wall_split(wall_s: float, setup_s: float, spent: dict[str, float], aggregator_s: float,
               workers: int) -> dict[str, float]:
    """A run's wall split into set-up (pre-training, broker, aggregator and agents starting),
    agents' local training, the aggregator's work on uploads, evaluation (agents scoring their
    models and the cluster models' checkpoints) and the rest (data drawn per cycle, encoding,
    messaging, waiting). The aggregator works while an agent waits for its reply, so its share is
    taken out of that wait. With several workers the agents' parts run side by side and are
    divided by their number."""
    share = 1.0 / max(1, workers)
    parts = {"setup_s": setup_s, "agents_training_s": spent.get("training", 0.0) * share,
             "aggregator_s": aggregator_s,
             "evaluation_s": spent.get("evaluation", 0.0) * share + spent.get("cluster_evaluation", 0.0)}
    parts["rest_s"] = max(0.0, wall_s - sum(parts.values()))
    return {k: round(v, 2) for k, v in parts.items()}


def describe_split(split: dict[str, float]) -> str:
    """`wall_split` as a progress line says it."""
    names = {"setup_s": "set-up", "agents_training_s": "agents' training", "aggregator_s": "aggregator",
             "evaluation_s": "evaluation", "rest_s": "rest"}
    return ", ".join(f"{names[k]} {split[k]:.0f} s" for k in WALL_PARTS if k in split)


@dataclass
class CyclePlayer:
    """Plays one agent's cycle: new data, local training, upload, install; one UpdateRecord."""

    spec: RunSpec
    scenario: Scenario
    clusters: Any
    cfg: Config
    model_name: str
    clock: Stopwatch = field(default_factory=Stopwatch)

    def play(self, i: int, a: int, c: int, agent: Any, held: dict[int, torch.Tensor] | None) -> UpdateRecord:
        """`agent` is the EdgeAgent (None for Local, whose models live in `held`)."""
        from edge_agent.protocol_client import RESYNC_REASONS, AgentError
        from edge_agent.trainer import agent_knobs, diverged, train_cycle
        from fedmq.training import evaluate

        spec, model_name = self.spec, self.model_name
        local = spec.method == "local"
        train, test = draw_cycle(self.scenario, self.clusters, self.cfg, spec.seed, a, c, spec.test_samples)
        x, y, xt, yt = train.data.x, train.data.y, test.data.x, test.data.y
        seed = int(np.random.default_rng([spec.seed, a, c, 1]).integers(2**31))
        start = held[a] if local else agent.installed.vector
        with self.clock.timing("evaluation"):
            acc_held = evaluate(model_name, start, xt, yt)[0]
        cpu0 = time.thread_time()
        with self.clock.timing("training"):
            result, alpha_own = train_cycle(
                model_name, spec.method, start, None if local else agent.installed.clusters, x, y,
                privacy=None if local else agent.privacy, dp_seed=dp_seed(spec.seed, a, c),
                **{**agent_knobs(self.cfg.agent), "epochs": spec.local_epochs, "lr": spec.local_lr,
                   "rho": spec.rho},
                seed=seed)
        compute_s = time.thread_time() - cpu0
        with self.clock.timing("evaluation"):
            acc_before = evaluate(model_name, result.vector, xt, yt)[0]
        bad = diverged(result.vector)
        if bad:  # as a device does: nothing is sent, and it joins again
            event(log, "sim.train_diverged", level=30, agent=agent_name(a), cycle=c,
                  action="model kept, no upload" + ("" if local else ", joins again"))
        if local:
            if not bad:
                held[a] = result.vector
            return UpdateRecord(i, 0, agent_name(a), c, len(train), 0, 0, 0, acc_held, acc_before,
                                acc_held if bad else acc_before, math.nan, train.alpha.tolist(), None, 0, 0,
                                compute_s, 0.0, 0.0, 0.0, refused="diverged" if bad else "")
        if bad:  # a diverged model trains to NaN again: the agent joins again
            return self._refused(i, c, agent, "diverged", True, train, xt, yt, agent.installed.epoch,
                                 acc_held, acc_before, None, 0, 0, compute_s, 0.0, 0.0)
        tau = agent.installed.epoch
        e0 = time.perf_counter()
        env = agent.update_envelope(result.vector, len(train), alpha=alpha_own, inputs=x)
        encode_s = time.perf_counter() - e0
        r0 = time.perf_counter()
        sent0, got0 = agent.channel.bytes_sent, agent.channel.bytes_received
        try:
            installed, up = agent.upload(env)
        except AgentError as e:
            if not e.refused:
                raise  # no answer at all: the aggregator is gone, the run cannot go on
            rejoin = e.reason in RESYNC_REASONS
            event(log, "sim.upload_refused", level=30, agent=agent.agent_id, cycle=c, reason=e.reason,
                  detail=e.detail, action="join again" if rejoin else "model kept")
            return self._refused(i, c, agent, e.reason, rejoin, train, xt, yt, tau, acc_held, acc_before, alpha_own,
                                 agent.channel.bytes_sent - sent0, agent.channel.bytes_received - got0,
                                 compute_s, encode_s, time.perf_counter() - r0)
        round_trip = time.perf_counter() - r0
        with self.clock.timing("evaluation"):
            acc_after = evaluate(model_name, installed.vector, xt, yt)[0]
        alpha_est = alpha_own if alpha_own is not None else installed.alpha
        kl = kl_divergence(train.alpha, alpha_est) if alpha_est else math.nan
        return UpdateRecord(i, 0, agent.agent_id, c, len(train), tau, installed.epoch,
                            installed.epoch - tau, acc_held, acc_before, acc_after, kl,
                            train.alpha.tolist(), [float(v) for v in alpha_est] if alpha_est else None,
                            up, installed.bytes_down, compute_s, encode_s, round_trip, 0.0)

    def _refused(self, i: int, c: int, agent: Any, reason: str, rejoin: bool, train: Any, xt: torch.Tensor,
                 yt: torch.Tensor, tau: int, acc_held: float, acc_before: float,
                 alpha_own: list[float] | None, up: int, down: int, compute_s: float,
                 encode_s: float, round_trip: float) -> UpdateRecord:
        """The record of an upload that was refused, or never sent (`reason` "diverged"): the
        trained model is dropped and the agent keeps the one it held, as a device does
        (edge_agent/agent_loop.py); with `rejoin` (the two sides disagree on that model, or it
        diverged) it joins again and holds the join's."""
        from edge_agent.protocol_client import AgentError
        from fedmq.training import evaluate

        rejoined = rejoin
        if rejoined:
            j0, g0 = agent.channel.bytes_sent, agent.channel.bytes_received
            try:
                agent.join()
            except AgentError as j:
                if not j.refused:
                    raise  # no answer at all: the aggregator is gone, the run cannot go on
                rejoined = False  # an outcome too: it keeps the model it held, its next upload asks again
                event(log, "sim.join_refused", level=30, agent=agent.agent_id, cycle=c, reason=j.reason,
                      detail=j.detail, action="model kept")
            up += agent.channel.bytes_sent - j0
            down += agent.channel.bytes_received - g0
        kept = agent.installed
        acc_after = evaluate(self.model_name, kept.vector, xt, yt)[0] if rejoined else acc_held
        kl = kl_divergence(train.alpha, alpha_own) if alpha_own else math.nan
        return UpdateRecord(i, 0, agent.agent_id, c, len(train), tau, kept.epoch, 0, acc_held,
                            acc_before, acc_after, kl, train.alpha.tolist(),
                            [float(v) for v in alpha_own] if alpha_own else None, up, down,
                            compute_s, encode_s, round_trip, 0.0, refused=reason)


def play_events(dispatcher: _Dispatcher, player: CyclePlayer, agents: dict[int, Any],
                held: dict[int, torch.Tensor] | None, workers: int,
                progress: Callable[[int], None] | None = None) -> tuple[list[UpdateRecord], float]:
    """Run the dispatcher's events on `workers` threads: (records, unix time of the first event).

    A record's `t` is seconds from the first event; `arrival` is the order the cycles finished.
    """
    records: list[UpdateRecord] = []
    lock = threading.Lock()
    t_first: list[float] = []
    t_first_unix: list[float] = []

    def worker() -> None:
        torch.set_num_threads(1)
        while True:
            item = dispatcher.take()
            if item is None:
                return
            i, a, c = item
            try:
                with lock:
                    if not t_first:
                        t_first.append(time.perf_counter())
                        t_first_unix.append(time.time())
                rec = player.play(i, a, c, agents.get(a), held)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                event(log, "sim.cycle_failed", level=40, agent=a, cycle=c, error=repr(e))
                dispatcher.fail(e)
                return
            with lock:
                rec.t = time.perf_counter() - t_first[0]
                rec.arrival = dispatcher.finish(a)
                records.append(rec)
            if progress is not None:
                progress(1)

    threads = [threading.Thread(target=worker, name=f"sim-worker-{w}") for w in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if dispatcher.failed is not None:
        raise RuntimeError(f"{player.spec.label}: a cycle failed: {dispatcher.failed!r}") from dispatcher.failed
    records.sort(key=lambda r: r.event)
    return records, (t_first_unix[0] if t_first_unix else time.time())


def local_training(agent: AgentSettings) -> dict[str, float]:
    """RunSpec's local training from `[agent]`: `--set agent.lr=...` reaches the simulated agents
    (`fedmq sim run` and the ablation's variants alike)."""
    return {"local_epochs": agent.epochs, "local_lr": agent.lr, "rho": agent.rho}


def run_fleet(spec: RunSpec, base: Config | None = None, *, broker_url: str | None = None,
              progress: Callable[[int], None] | None = None, clusters=None) -> RunResult:
    """Run one scenario x method x seed end to end; returns every record."""
    from aggregator.bootstrap import pretrain_clusters
    from fedmq.models import resolve_model_name
    from fedmq.training import evaluate

    scenario, cfg = configure(spec, base)
    n_agents = spec.resolved_agents()
    clusters = clusters or build_clusters(scenario, cfg, spec.clusters)
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    schedule = make_schedule(spec.seed, n_agents, spec.updates_per_agent)
    eval_every = spec.eval_every or max(1, math.ceil(len(schedule) / 10))
    local = spec.method == "local"
    n_test = spec.cluster_test_samples
    test_sets = [clusters.test(k, n_test if 0 < n_test < len(clusters.pool("test", k)) else None)
                 for k in range(spec.clusters)]
    cluster_acc: list[dict[str, Any]] = []
    busy = {"seconds": 0.0, "batches": 0}

    player = CyclePlayer(spec, scenario, clusters, cfg, model_name)

    def score_clusters(vectors: list[torch.Tensor], events: int) -> None:
        if local:
            return  # Local has no cluster models
        with player.clock.timing("cluster_evaluation"):
            accs = [evaluate(model_name, w, t.x, t.y)[0] for w, t in zip(vectors, test_sets, strict=True)]
        cluster_acc.append({"events": events, "acc": accs})

    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        engine = None
        held: dict[int, torch.Tensor] | None = None
        if local:
            url, kind = "", "none"
            # Local agents start where a joining CDFL agent does: the uniform mixture of the
            # server's pre-trained cluster models (same seed, same models).
            start_vectors = pretrain_clusters(cfg, clusters, model_name)
            start = torch.stack(start_vectors).mean(0)
            held = dict.fromkeys(range(n_agents), start)
            agents: dict[int, Any] = {}
            current_clusters: Callable[[], list[torch.Tensor]] = lambda: start_vectors  # noqa: E731
        else:
            url, kind = stack.enter_context(running_broker(broker_url))
            cfg.broker.url = url
            if kind == "embedded":
                cfg.broker.protocol = EMBEDDED_PROTOCOL
            cfg.fleet = fleet_name(cfg.fleet, spec)
            engine = start_aggregator(cfg, clusters, stack, busy).engine
            agents = dict(enumerate(start_agents(cfg, spec, range(n_agents), stack)))
            busiest = max(Counter(a for a, _ in schedule).values(), default=1)
            for a, agent in agents.items():
                agent.privacy = agent_privacy(cfg, spec.method, a, busiest, spec.local_epochs) or agent.privacy
            current_clusters = lambda: server_models(engine.strategy, len(test_sets))  # noqa: E731

        score_clusters(current_clusters(), 0)
        setup_s = time.perf_counter() - t_start - player.clock.spent["cluster_evaluation"]
        dispatcher = _Dispatcher(schedule, eval_every, lambda i: score_clusters(current_clusters(), i))
        records, _ = play_events(dispatcher, player, agents, held, spec.workers, progress)
        score_clusters(current_clusters(), len(schedule))
        agent_bytes = {}
        info: dict[str, Any] = {"events": len(schedule), "agents": n_agents}
        if not local:
            for agent in agents.values():
                agent_bytes[agent.agent_id] = {"up": agent.channel.bytes_sent,
                                               "down": agent.channel.bytes_received}
            info.update(aggregator_info(engine, busy))
    wall = time.perf_counter() - t_start  # the aggregator's shutdown included, in the rest
    info["wall_split"] = wall_split(wall, setup_s, player.clock.spent, busy["seconds"], spec.workers)
    return RunResult(spec, records, cluster_acc, agent_bytes, wall, kind, info)


def aggregator_info(engine: Any, busy: dict[str, float]) -> dict[str, Any]:
    """The aggregator's counters (the engine's and its strategy's: stale uploads, the cluster
    refresh's halved and skipped steps), busy time and its state dir's largest size, as
    summary.json holds them."""
    return {"aggregator_counters": {k: int(v) for k, v in engine.counters.items()},
            "strategy_counters": {k: int(v) for k, v in sorted(engine.strategy.counters.items())},
            "stale_updates": int(engine.strategy.counters.get("stale", 0)),
            "aggregator_busy_s": round(busy["seconds"], 4),
            "aggregator_batches": busy["batches"],
            **({"state_dir_peak_bytes": engine.journal.peak_bytes} if engine.journal is not None else {})}


def _time_engine(engine: Any, busy: dict[str, float],
                 after_batch: Callable[[list[Any]], None] | None = None) -> None:
    """Count the aggregator's time in Engine.handle (validation, decode, strategy, journal).

    `after_batch(batch)` runs after each batch, outside the counted time.
    """
    handle = engine.handle

    def timed(batch: list[Any]) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return handle(batch)
        finally:
            busy["seconds"] += time.perf_counter() - t0
            busy["batches"] += 1
            if after_batch is not None:
                after_batch(batch)

    engine.handle = timed


# ---------------------------------------------------------------------------------- output

UPDATE_COLUMNS = [f for f in UpdateRecord.__dataclass_fields__]


def write_run(result: RunResult, out: Path, command: str | None = None) -> Path:
    """updates.csv, clusters.csv, agents.csv and summary.json under out/runs/LABEL/; `command`,
    the command line that made the run, goes into summary.json: a run's label does not say
    which `--set` overrides it ran with, and two dirs of the same method differ only by them."""
    import csv

    d = out / "runs" / result.spec.label
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "updates.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(UPDATE_COLUMNS)
        for r in result.updates:
            row = asdict(r)
            w.writerow([json.dumps(row[c]) if isinstance(row[c], list | type(None)) else row[c]
                        for c in UPDATE_COLUMNS])
    with open(d / "clusters.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["events", *[f"acc_{k}" for k in range(result.spec.clusters)]])
        for cp in result.cluster_acc:
            w.writerow([cp["events"], *cp["acc"]])
    with open(d / "agents.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["agent", "bytes_up", "bytes_down"])
        for a, b in sorted(result.agent_bytes.items()):
            w.writerow([a, b["up"], b["down"]])
    summary = result.summary() if command is None else {**result.summary(), "command": command}
    (d / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    return d
