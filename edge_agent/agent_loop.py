"""The long-running edge agent: source -> buffer -> predictor -> drift monitor -> trainer -> EdgeAgent.

Every `step()` polls the data source and tests before it trains: each new labelled sample
is predicted by the installed model (ONNX Runtime), the outcome feeds the drift monitor,
and the sample joins the local buffer. An update cycle starts when the monitor asks for
one (drift, or a manual trigger: `trigger()` / SIGUSR1 / `--update-now`), the profile says
the device may update now, and enough samples arrived since the drift was detected (they
describe the new data; what came before describes the old). A cycle:

1. trains from the installed model u on the newest buffered samples (proximal to u; in
   FedSoft-Async toward every cluster model with alpha estimated locally by per-sample
   argmin; in Local mode the result is simply installed and nothing is sent);
2. encodes the upload (codec from `codec.*`, by default an int8 delta against u + zstd),
   stores it as the *pending* upload in the state dir (atomically), then publishes it;
3. waits for the aggregator's reply (re-sending the same msg_id after a timeout or a
   reconnect), installs it (tau := its epoch), scores it on the buffer (the detector's new
   reference), exports it for ONNX Runtime, clears the pending upload and saves.

A restarted agent loads its state: model, tau, detector, counters; a pending upload is
re-sent byte for byte before anything else (the aggregator applies a msg_id once and
answers a replay with the reply it already sent). `request_stop()` (SIGTERM) ends training
at the next epoch boundary, keeps the upload it produced as pending without sending it,
interrupts a wait for a reply, saves, and publishes `offline`; the next start sends it.

Errors from the aggregator: unknown_agent, no_base, a base mismatch or a tau ahead of its
epoch mean the two sides disagree on what the agent holds: the pending upload is dropped,
the agent joins again and trains anew on its next step. A `duplicate` means the upload was
applied and its reply superseded: the pending upload is dropped and the model kept. Any
other refusal (loss_outlier, bad_sketch, ...) drops the upload and keeps the model too. Every
refusal is counted, in total (`refused`) and by reason (`refused.<reason>`), in the saved
counters, `status()` and the retained status that `fedmq fleet status` reads.

The broker refusing the agent's own topics to its login, or another process with its id, ends
the agent (protocol_client.SessionGuard): training stops at the next epoch, an upload stays
pending on disk, and `start()` or `run()` raises the one-line error (exit status 1). While
connected it renews its retained online status every `heartbeat_s(cfg)` seconds.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent.agent_algorithms import agent_algorithm
from edge_agent.drift import DriftMonitor, make_detector
from edge_agent.inference import OnnxPredictor, TorchPredictor, make_predictor
from edge_agent.profiles import DeviceProfile, get_profile
from edge_agent.protocol_client import (
    RESYNC_REASONS,
    AgentError,
    EdgeAgent,
    Installed,
    heartbeat_s,
    refusal_counter,
)
from edge_agent.sources import DatasetSource, DataSource, DirectorySource, LocalBuffer
from edge_agent.state import AgentState, PendingUpload
from edge_agent.trainer import agent_knobs, diverged, evaluate, train_cycle
from fedmq import protocol
from fedmq.algorithms import ASYNC_AGENT
from fedmq.config import AgentSettings, Config
from fedmq.logs import PROGRESS, event, get_logger
from fedmq.models import build_model, model_spec, resolve_model_name, to_vector
from fedmq.privacy import BudgetSpent

log = get_logger("agent")

ALGORITHMS = ASYNC_AGENT
MODEL_FILE = "model.onnx"


@dataclass
class Cycle:
    """One update cycle, for logs, tests and the simulator's metrics."""

    trigger: str
    """drift or manual"""
    samples: int
    tau: int
    """Epoch of the model the training started from."""
    acc_held: float
    """The held model's accuracy on the training samples (the new data) before training."""
    acc_trained: float
    train_seconds: float
    epochs_done: int
    msg_id: str = ""
    bytes_up: int = 0
    outcome: str = "pending"
    """installed, interrupted (pending kept for the next start), resynced, dropped, local, or
    not_joined (a join the cycle needed was refused: nothing trained)."""
    installed: Installed | None = None
    alpha: list[float] | None = None
    refused: str = ""
    """Why the aggregator refused the upload (resynced or dropped); '' otherwise."""


def parse_knobs(items: list[str]) -> dict[str, Any]:
    """`["window=100", "delta=0.15"]` -> {"window": 100, "delta": 0.15} (numbers or words)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"detector knob must be name=value, got {item!r}")
        text = raw.strip()
        value: Any = text
        for cast in (int, float):
            try:
                value = cast(text)
                break
            except ValueError:
                continue
        out[key.strip()] = value
    return out


def make_source(cfg: Config, profile: DeviceProfile, clock: Callable[[], float] = time.time) -> DataSource:
    """The data source `agent.source` names: profile-driven rotation clusters, or a folder."""
    s = cfg.agent
    if s.source == "directory":
        if not s.source_dir:
            raise ValueError("agent.source=directory needs agent.source_dir")
        spec = model_spec(resolve_model_name(cfg.model, cfg.data.dataset))
        num_classes = int(spec.shapes[-1][0])  # the classifier's last bias: one per class
        return DirectorySource(s.source_dir, spec.input_shape, num_classes)
    if s.source != "dataset":
        raise ValueError(f"agent.source must be dataset or directory, got {s.source!r}")
    return ProfileDatasetSource(cfg, profile, clock)


class ProfileDatasetSource:
    """Rotation clusters of `data.dataset` in the mixture the device profile has at time t.

    t = (clock() - start) * `agent.time_scale`: a car's route or a phone's day, replayed
    at any speed. The clusters are the aggregator's (same dataset, K and seed), drawn
    from the agents' pools, which the server never trains or evaluates on.
    """

    def __init__(self, cfg: Config, profile: DeviceProfile, clock: Callable[[], float] = time.time) -> None:
        from fedmq.data import clusters_from_settings

        clusters = clusters_from_settings(cfg.data, cfg.cdfl.clusters, seed=cfg.seed)
        rng = np.random.default_rng([cfg.seed, 0xA6E, sum(map(ord, cfg.agent.id))])
        pools = []
        for k in range(clusters.num_clusters):
            data = clusters.take(k, min(len(clusters.pool("agents", k)), cfg.data.max_samples), rng)
            pools.append((data.x, data.y))
        self.k = clusters.num_clusters
        self.profile = profile
        self.clock = clock
        self.start = clock()
        self.time_scale = cfg.agent.time_scale
        self.inner = DatasetSource(pools, profile.next_mixture(0.0, self.k), seed=int(rng.integers(2**31)))

    def profile_time(self) -> float:
        return max(0.0, (self.clock() - self.start) * self.time_scale)

    def poll(self, max_items: int) -> list[tuple[torch.Tensor, int]]:
        self.inner.set_mixture(self.profile.next_mixture(self.profile_time(), self.k))
        return self.inner.poll(max_items)


class DeviceAgent:
    """One device's agent loop. `start()`, then `step()` repeatedly (or `run()`), then `close()`."""

    def __init__(self, cfg: Config, source: DataSource, *, agent_id: str | None = None,
                 profile: DeviceProfile | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.settings: AgentSettings = cfg.agent
        s = self.settings
        self.agent_id = protocol.validate_id(agent_id or s.id, "agent id")
        if s.algorithm not in ALGORITHMS:
            raise ValueError(f"agent.algorithm must be one of {', '.join(ALGORITHMS)}, got {s.algorithm!r}")
        self.algorithm = s.algorithm
        self.kind = agent_algorithm(s.algorithm)
        """What this algorithm's agent sends and where it trains from (edge_agent/agent_algorithms.py)."""
        self.model_name = resolve_model_name(cfg.model, cfg.data.dataset)
        self.spec = model_spec(self.model_name)
        self.profile = profile or get_profile(s.profile, seed=cfg.seed)
        self.source = source
        self.clock = clock
        self.state_dir = Path(s.state_path())
        self.buffer = LocalBuffer(s.buffer_size)
        self.monitor = DriftMonitor(make_detector(s.detector, **parse_knobs(s.detector_knobs)),
                                    s.min_update_interval_s)
        self.agent: EdgeAgent | None = None
        self.state = AgentState(self.agent_id, self.model_name, self.spec.hash)
        self._state_loaded = False  # until start() has read the state dir; close() saves only after
        self.predictor: OnnxPredictor | TorchPredictor | None = None
        self.counters: dict[str, int] = {}
        self.cycles: list[Cycle] = []
        self._stop = threading.Event()
        self._manual = threading.Event()
        self._started_at = clock()
        self._last_save = 0.0
        self._drift_seen_at: int | None = None
        """monitor.observed when the pending drift was first seen (samples since then are new data)."""
        self._said_budget_spent = False
        self._join_due = False
        """A join was refused while the agent held a model: it keeps predicting with it and joins
        again, instead of uploading, when its next update is due."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def tau(self) -> int:
        return self.state.tau

    def start(self) -> DeviceAgent:
        """Load the saved state, connect, finish a pending upload or join, build the predictor."""
        saved = AgentState.load(self.state_dir)  # StateCorrupt: close() then leaves the files alone
        self._state_loaded = True
        if saved is not None and (saved.agent_id != self.agent_id or not saved.matches_zoo()
                                  or saved.model_name != self.model_name):
            event(log, "state.discarded", level=logging.WARNING, dir=str(self.state_dir),
                  reason=f"saved for {saved.agent_id}/{saved.model_name} ({saved.spec_hash}), "
                         f"running {self.agent_id}/{self.model_name} ({self.spec.hash})")
            saved = None
        if saved is not None:
            self.state = saved
            protocol.msg_ids_after(saved.msg_id_floor)
            if saved.pending is not None:
                protocol.msg_ids_after(saved.pending.msg_id)
            if saved.monitor:
                self.monitor.load_state_dict(saved.monitor)
                self.monitor.min_interval_s = self.settings.min_update_interval_s
            self.counters.update(saved.counters)
        self._count("starts")
        if self.kind.connects:
            self.agent = EdgeAgent(self.cfg, self.agent_id, algorithm=self.algorithm,
                                   profile=self.profile.name,
                                   reply_timeout_s=self.settings.reply_timeout_s, retries=2,
                                   heartbeat_s=heartbeat_s(self.cfg))
            self.agent.guard.on_fatal.append(lambda _error: self._stop.set())  # training ends at the next epoch
            self.agent.counters.update({k: self.counters[k] for k in ("resends", "errors", "rejected")
                                        if k in self.counters})
            self.agent.counters.update(self._refusal_counters())
            self.agent.privacy.load_state_dict(self.state.privacy)
            if self.agent.privacy.enabled:
                self.agent.counters["epsilon"] = round(self.agent.privacy.spent(), 4)
            self.agent.start()
            if self.state.vector is not None:
                self.agent.restore(max(self.state.tau, 0), self.state.vector, wire=self.state.wire)
        event(log, "agent.started", agent=self.agent_id, algorithm=self.algorithm, tau=self.state.tau,
              pending=self.state.pending.msg_id if self.state.pending else None,
              resumed=saved is not None)
        if self.state.pending is not None and self.agent is not None:
            self._resend_pending()
        if self.state.vector is None:
            if self.agent is None:
                self.state.vector = to_vector(build_model(self.model_name, seed=self.cfg.seed))
            elif not self._stop.is_set():
                self._join()
        self._check_fatal()
        if self.predictor is None and self.state.vector is not None:
            self._make_predictor()
        self.save()
        return self

    def _check_fatal(self) -> None:
        """Raise why the agent cannot go on (its login refused its topics, its session taken)."""
        if self.agent is not None:
            self.agent.guard.check()

    def close(self) -> None:
        """Save (a pending upload stays pending), publish offline, disconnect."""
        if self._state_loaded:  # never over state that start() could not read
            self.save()
        if self.agent is not None:
            self.agent.stop()

    def request_stop(self) -> None:
        """Shutdown (SIGTERM, relayed by fedmq.signals: it takes locks, so never call it from a
        signal handler itself): the loop then ends its cycle and returns."""
        self._stop.set()
        if self.agent is not None:
            self.agent.interrupt()

    def trigger(self) -> None:
        """Manual update request (SIGUSR1 through fedmq.signals, --update-now)."""
        self._manual.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self, max_steps: int | None = None) -> None:
        """Step every `poll_interval_s` until `request_stop()` (or `max_steps`)."""
        steps = 0
        while not self._stop.is_set() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
            self._stop.wait(self.settings.poll_interval_s)
        self._check_fatal()

    # ------------------------------------------------------------------ the loop

    def step(self) -> Cycle | None:
        """Poll, predict, observe, buffer; run an update cycle when one is due. Returns it."""
        if self._manual.is_set():
            self._manual.clear()
            self.monitor.trigger()
            self._count("manual_triggers")
            event(log, "update.asked", level=PROGRESS, agent=self.agent_id, by="manual")
        samples = self.source.poll(self.settings.poll_batch)
        if samples:
            self._observe(samples)
        cycle = None
        if self._update_due():
            if self._join_due and not self._join():
                self.monitor.update_started(self.clock())  # answered: the next one joins again
            else:
                cycle = self.update()
        elif self.clock() - self._last_save >= self.settings.save_every_s:
            self.save()
        return cycle

    def _observe(self, samples: list[tuple[torch.Tensor, int]]) -> None:
        assert self.predictor is not None
        x = torch.stack([x for x, _ in samples])
        y = np.array([y for _, y in samples])
        predicted = self.predictor.predict(x.numpy()).argmax(axis=1)
        for ok in predicted == y:
            if self.monitor.observe(bool(ok)) and self._drift_seen_at is None:
                self._drift_seen_at = self.monitor.observed
                self._count("drifts")
                event(log, "drift.detected", level=PROGRESS, agent=self.agent_id,
                      observed=self.monitor.observed,
                      accuracy=self.monitor.correct / max(1, self.monitor.observed))
        self.buffer.extend(samples)
        self._count("samples", len(samples))

    def _update_due(self) -> bool:
        now = self.clock()
        if not self.monitor.should_update(now):
            return False
        need = min(self.settings.min_samples_to_train, self.buffer.capacity)
        if len(self.buffer) < need:
            return False
        seen = self._drift_seen_at
        if (self.monitor.drift_pending and not self.monitor.trigger_pending and seen is not None
                and self.monitor.observed - seen < self.settings.samples_after_drift):
            return False
        return (self.profile.can_update((now - self._started_at) * self.settings.time_scale)
                and not self._budget_spent())

    def _budget_spent(self) -> bool:
        """With DP on: whether the next upload would take epsilon past privacy.epsilon. The
        agent then stops uploading (it keeps predicting) and says so, once per start."""
        if self.agent is None or not self.agent.privacy.enabled:
            return False
        try:
            self.agent.privacy.check(self._planned_release())
        except BudgetSpent as exc:
            if not self._said_budget_spent:
                self._said_budget_spent = True
                self.agent.counters["budget_spent"] = 1
                event(log, "privacy.budget_spent", level=logging.WARNING, agent=self.agent_id,
                      epsilon=self.agent.privacy.spent(), budget=self.agent.privacy.epsilon,
                      action="uploads stopped; predicting on", detail=str(exc))
                self.agent.publish_status()
            self.monitor.update_started(self.clock())  # the request is answered: no upload
            return True
        return False

    def _planned_release(self) -> list[tuple[float, float, int]]:
        """What the next upload charges: DP-SGD over the training samples, and the sketch."""
        assert self.agent is not None
        s = self.settings
        n = min(len(self.buffer), s.train_on_newest or len(self.buffer))
        privacy = self.agent.privacy
        return privacy.upload_releases(max(n, 1), privacy.batch(s.batch_size), s.epochs,
                                       sketch=self.agent.sends_sketch(n), alpha=self.kind.sends_alpha)

    def update(self) -> Cycle:
        """One update cycle now (train, persist the upload, send it, install the reply)."""
        s = self.settings
        trigger = "manual" if self.monitor.trigger_pending else "drift"
        self.monitor.update_started(self.clock())
        self._drift_seen_at = None
        # The K cluster models are not kept on disk: fetch them again.
        if (self.kind.trains_from == "cluster_mixture" and self.agent is not None
                and (self.agent.installed is None or not self.agent.installed.clusters)
                and not self._join()):
            cycle = Cycle(trigger, 0, self.state.tau, math.nan, math.nan, 0.0, 0, outcome="not_joined")
            self.cycles.append(cycle)
            return cycle
        held = self.state.vector
        assert held is not None
        x, y = self.buffer.tensors(last=s.train_on_newest or None)
        acc_held, _ = evaluate(self.model_name, held, x, y)
        privacy = self.agent.privacy if self.agent is not None else None
        seed = self.cfg.seed + self.counters.get("cycles", 0)
        knobs = dict(agent_knobs(s), seed=seed, max_seconds=s.max_train_seconds or None,
                     on_epoch=lambda _epoch, _loss: not self._stop.is_set())
        event(log, "train.started", agent=self.agent_id, trigger=trigger, samples=len(y), tau=self.state.tau)
        clusters = (self.agent.installed.clusters if self.kind.trains_from == "cluster_mixture" and self.agent is not None
                    and self.agent.installed is not None else None)
        # DP-SGD's noise must not be predictable from the state: fresh entropy
        result, alpha = train_cycle(self.model_name, self.algorithm, held, clusters, x, y, privacy=privacy,
                                    dp_seed=int.from_bytes(os.urandom(8), "little"), **knobs)
        acc_trained, _ = evaluate(self.model_name, result.vector, x, y)
        self._count("cycles")
        cycle = Cycle(trigger, len(y), self.state.tau, acc_held, acc_trained, result.seconds,
                      result.epochs_done, alpha=alpha)
        self.cycles.append(cycle)
        event(log, "train.done", level=PROGRESS, agent=self.agent_id, trigger=trigger, samples=len(y),
              seconds=result.seconds, epochs=result.epochs_done, loss=result.final_loss,
              acc_held=acc_held, acc_trained=acc_trained, stopped_early=result.stopped_early)
        if diverged(result.vector):  # an outcome, not a crash: the held model stays, nothing is sent
            self._count("train_diverged")
            cycle.outcome = "diverged"
            # The same model would diverge again: with a server, the next update starts from a join's.
            self._join_due = self.agent is not None
            event(log, "train.diverged", logging.WARNING, agent=self.agent_id, samples=len(y), loss=result.final_loss,
                  action="model kept, no upload" + ("; joins again at the next update" if self._join_due else ""),
                  hint="lower agent.lr if it repeats")
            return cycle
        if self.agent is None:  # Local: the trained model is the model
            self._install_vector(result.vector, self.state.tau, None, via="local")
            cycle.outcome = "local"
            return cycle
        env = self.agent.update_envelope(result.vector, len(y), alpha=alpha,
                                         metrics={"acc_held": acc_held, "acc_trained": acc_trained,
                                                  "train_loss": result.final_loss}, inputs=x)
        self.state.pending = PendingUpload(env.msg_id, protocol.encode(env), time.time())
        self.save()  # the durability point: from here on this upload is sent until answered
        cycle.msg_id = env.msg_id
        if self._stop.is_set():
            cycle.outcome = "interrupted"
            event(log, "upload.deferred", agent=self.agent_id, msg_id=env.msg_id,
                  reason="stopping; sent after the next start")
            return cycle
        self._send(env, cycle, resend=False)
        return cycle

    # ------------------------------------------------------------------ requests

    def _join(self) -> bool:
        """Join until a model is installed (True), the agent stops, or the aggregator refuses.

        A refused join (the fleet now runs another model, say) is an outcome: counted as
        `join_refused` and `join_refused.<reason>`; an agent that holds a model keeps it and joins
        again when its next update is due (False). Only an agent with no model at all, which
        has nothing to run, fails its start with the refusal (AgentError)."""
        assert self.agent is not None
        while not self._stop.is_set():
            try:
                installed = self.agent.join(len(self.buffer))
            except AgentError as e:
                if e.reason == "interrupted":
                    return False
                self._count("join_failures")
                if e.refused or (e.reason != "no_reply" and not e.reason.startswith("codec_")):
                    self._count("join_refused")
                    self._count(f"join_refused.{e.reason}"[:64])
                    if self.state.vector is None:
                        event(log, "join.refused", level=logging.ERROR, agent=self.agent_id, reason=e.reason,
                              detail=e.detail, action="no model to run: stopping")
                        raise
                    self._join_due = True
                    event(log, "join.refused", level=logging.WARNING, agent=self.agent_id, reason=e.reason,
                          detail=e.detail, action="model kept; joining again when the next update is due")
                    self.agent.counters.update(self._refusal_counters())
                    self.agent.publish_status()
                    self.save()
                    return False
                event(log, "join.failed", level=logging.WARNING, agent=self.agent_id, reason=e.reason,
                      detail=e.detail, action="asking again")
                continue
            self._join_due = False
            self._installed(installed, via="join")
            return True
        return False

    def _resend_pending(self) -> None:
        assert self.agent is not None and self.state.pending is not None
        env = self.agent.decode_pending(self.state.pending.payload)
        event(log, "upload.resume", level=PROGRESS, agent=self.agent_id, msg_id=env.msg_id, tau=env.tau)
        cycle = Cycle("resume", env.n_samples, env.tau, math.nan, math.nan, 0.0, 0, msg_id=env.msg_id)
        self.cycles.append(cycle)
        self._send(env, cycle, resend=True)

    def _send(self, env: protocol.Update, cycle: Cycle, *, resend: bool) -> None:
        """Send until installed, interrupted or refused; the pending upload is on disk meanwhile."""
        assert self.agent is not None
        sent_at = time.monotonic()
        while True:
            try:
                self.agent.counters["last_upload_at"] = round(time.time(), 3)
                installed, up = self.agent.upload(env, resend=resend)
            except AgentError as e:
                if e.reason == "interrupted":
                    cycle.outcome = "interrupted"
                    return
                if not e.refused and (e.reason == "no_reply" or (e.reason.startswith("codec_")
                                                               and e.reason not in RESYNC_REASONS)):
                    # No reply, or only replies this agent could not decode: never a refusal
                    # (the aggregator's own codec_* Error is one, and re-sending would repeat it).
                    resend = True  # the aggregator may be down: same msg_id again, for as long as it takes
                    event(log, "upload.waiting", level=PROGRESS, agent=self.agent_id, msg_id=env.msg_id,
                          reason=e.reason, waited_s=round(time.monotonic() - sent_at, 1))
                    continue
                self._refused(env, cycle, e)
                return
            cycle.bytes_up += up
            cycle.outcome = "installed"
            cycle.installed = installed
            self._count("uploads")
            self._installed(installed, via="update", uploaded=cycle.bytes_up,
                            waited_s=round(time.monotonic() - sent_at, 2))
            return

    def _refused(self, env: protocol.Update, cycle: Cycle, e: AgentError) -> None:
        """Whatever the reason, a refusal is counted (`refused`, `refused.<reason>`) and the agent
        goes on: joins again where the two sides disagree on its model, else keeps it."""
        self._count("refused")
        self._count(refusal_counter(e.reason))
        cycle.refused = e.reason
        if self.agent is not None:  # the retained status shows them too (`fedmq fleet status`)
            self.agent.counters.update(self._refusal_counters())
            self.agent.publish_status()
        self.state.pending = None
        if e.reason in RESYNC_REASONS:
            cycle.outcome = "resynced"
            event(log, "upload.refused", level=logging.WARNING, agent=self.agent_id, msg_id=env.msg_id,
                  reason=e.reason, detail=e.detail, action="join again, retrain")
            self.save()
            self._count("rejoins")
            if self._join():
                self.monitor.trigger()  # the trained update is lost with its base: train anew
        else:
            cycle.outcome = "dropped"
            level = logging.INFO if e.reason == "duplicate" else logging.WARNING
            event(log, "upload.refused", level=level, agent=self.agent_id, msg_id=env.msg_id,
                  reason=e.reason, detail=e.detail, action="dropped; model kept")
            self.save()

    # ------------------------------------------------------------------ installing

    def _installed(self, installed: Installed, *, via: str, **extra: Any) -> None:
        self.state.wire = None if installed.wire is None else installed.wire.clone()  # saved with the vector
        self._install_vector(installed.vector, installed.epoch, installed.alpha, via=via,
                             **extra, downloaded=installed.bytes_down)

    def _install_vector(self, vector: torch.Tensor, epoch: int, alpha: list[float] | None, *,
                        via: str, **extra: Any) -> None:
        """Hold `vector` as the model (tau := epoch) and say so: the cycle's last progress line,
        with `via` (join, update or local) and the bytes up and down in `extra`."""
        acc = None
        if len(self.buffer):
            acc, _ = evaluate(self.model_name, vector, *self.buffer.tensors(self.settings.train_on_newest or None))
        self.state.vector = vector.detach().float().cpu().clone()
        self.state.tau = epoch
        self.state.pending = None
        self.state.reference_accuracy = acc
        self.monitor.model_installed(acc)
        self._drift_seen_at = None
        self._make_predictor()
        self._count("installs")
        event(log, "model.installed", level=PROGRESS, agent=self.agent_id, via=via, epoch=epoch,
              accuracy=acc, alpha=alpha, **extra, backend=self.predictor.backend if self.predictor else None)
        self.save()
        if self.agent is not None:
            if acc is not None and not self.agent.privacy.enabled:  # with DP on, no noiseless figures leave
                self.agent.counters["last_accuracy"] = round(float(acc), 4)
            self.agent.publish_status()

    def _make_predictor(self) -> None:
        s = self.settings
        assert self.state.vector is not None
        self.predictor = make_predictor(self.model_name, self.state.vector, s.inference,
                                        path=self.state_dir / MODEL_FILE, exporter=s.onnx_exporter,
                                        intra_op_num_threads=s.onnx_threads)

    # ------------------------------------------------------------------ state

    def _refusal_counters(self) -> dict[str, int]:
        return {k: v for k, v in self.counters.items()
                if k in ("refused", "join_refused") or k.startswith(("refused.", "join_refused."))}

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def save(self) -> None:
        if self.agent is not None:
            for k in ("resends", "errors", "rejected"):
                self.counters[k] = self.agent.counters.get(k, 0)
            self.state.privacy = self.agent.privacy.state_dict()
        self.state.monitor = self.monitor.state_dict()
        self.state.counters = dict(self.counters)
        self.state.save(self.state_dir)
        self._last_save = self.clock()

    def status(self) -> dict[str, Any]:
        return {"agent": self.agent_id, "algorithm": self.algorithm, "tau": self.state.tau,
                "pending": self.state.pending.msg_id if self.state.pending else None,
                "buffer": len(self.buffer), "counters": dict(self.counters),
                "backend": self.predictor.backend if self.predictor else None}


__all__ = ["ALGORITHMS", "Cycle", "DeviceAgent", "ProfileDatasetSource", "make_source", "parse_knobs"]
