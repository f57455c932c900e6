"""The agent side of deadline rounds over MQTT (CATA-Fed, FedAvg, FedProx).

A `RoundAgent` connects with its last will (offline), announces itself with a `Join` carrying
its per-round data size after every (re)connect and whenever the aggregator's status says
online (so an agent started before the aggregator still joins), and waits for `RoundInvite`s
on its downlink. Time is measured from the *receipt* of an invite (the aggregator's clock is not
ours): paho's thread stamps it, the agent's own thread decodes W_t, trains under the
deadline (edge_agent/deadline.py) and sends a `Report`: with the trained model as a delta
against the W_t it decoded when it finished, or `finished=False` and its new, halved shard
size when the watchdog stopped it (CATA-Fed). The time from publishing the report to the
broker's PUBACK is its measured upload time, from which eps_i follows.

An invite that is already past its deadline when the agent gets to it (it arrived while the
agent was busy with an older one) is skipped: the server has closed that round anyway.

When the aggregator's run is over it goes offline with counters["finished"] in its status:
the agent sets `finished` (the CLI then says so and exits 0). A finished status retained from
an earlier run, before this agent saw its aggregator online, is ignored.

An Error reply (a join or report the aggregator refused: `wrong_algorithm`, `bad_report`,
`codec_*`, ...) is an outcome, never a crash: it is counted, in total (`refused`) and by reason
(`refused.<reason>`), in `counters` and the retained status, and the agent answers the next
invite as usual.

CATA-Fed agents train with `catafed.epochs/batch_size/lr`, FedAvg and FedProx agents with
`[fedavg]`'s; batches are shuffled anew each round (seeded by the agent's seed and the round).

The broker refusing the agent's own topics to its login, or another process with its id, sets
`fatal` (protocol_client.SessionGuard): the agent stops answering and the CLI exits 1 with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edge_agent.agent_algorithms import agent_algorithm
from edge_agent.deadline import DeadlineLearner, RealEpochRunner, RoundWork, TrainSettings, Watchdog
from edge_agent.protocol_client import SessionGuard, refusal_counter
from fedmq import codecs, protocol
from fedmq.channel import Channel, Refused
from fedmq.config import Config
from fedmq.errors import RuntimeFailure, UsageError
from fedmq.logs import event, get_logger
from fedmq.models import model_spec, resolve_model_name
from fedmq.transport import Message, MqttTransport, TransportError, Will

log = get_logger("agent.rounds")


@dataclass
class RoundLog:
    """One round as this agent lived it (for tests, the simulator and debugging)."""

    round: int
    finished: bool
    shard_used: int
    shard_size: int
    n_samples: int
    epochs: int
    train_s: float
    upload_s: float
    eps_s: float


class RoundAgent:
    """One device in a round-based fleet. start(); it answers invites on its own thread."""

    def __init__(self, cfg: Config, agent_id: str, x: torch.Tensor, y: torch.Tensor, *,
                 algorithm: str = "catafed", extra_s_per_sample: float = 0.0,
                 seed: int = 0, on_round: Callable[[RoundLog], None] | None = None) -> None:
        self.cfg = cfg
        self.agent_id = protocol.validate_id(agent_id, "agent id")
        self.fleet = cfg.fleet
        self.algorithm = algorithm
        if cfg.privacy.epsilon > 0:  # never send an update without the noise that was asked for
            raise UsageError(f"privacy.epsilon: differential privacy is built for the asynchronous agents "
                             f"(cdfl, fedsoft-async), not yet for {algorithm} rounds (docs/privacy.md)")
        self.model_name = resolve_model_name(cfg.model, cfg.data.dataset)
        self.spec = model_spec(self.model_name)
        self.kind = kind = agent_algorithm(algorithm)
        if kind.trains_with == "catafed":
            c = cfg.catafed
            self.learner = DeadlineLearner(x, y, c, algorithm=algorithm, seed=seed)
            self.train = TrainSettings(self.model_name, c.lr, c.batch_size, 0.0, seed)
        else:  # FedAvg, FedProx and TiFL agents train with [fedavg]
            f = cfg.fedavg
            self.learner = DeadlineLearner(x, y, cfg.catafed, algorithm=algorithm, seed=seed,
                                           epochs=f.epochs, model_name=self.model_name)
            self.train = TrainSettings(self.model_name, f.lr, f.batch_size,
                                       f.prox_mu if kind.proximal else 0.0, seed,
                                       f.momentum)
        self.extra_s_per_sample = extra_s_per_sample
        self.feedback = codecs.ErrorFeedback() if cfg.codec.uses_feedback() else None
        """What top-k left out of earlier reports, added to the next (codec.error_feedback)."""
        self.on_round = on_round  # called on the agent's thread with each RoundLog (the CLI prints it)
        self.log: list[RoundLog] = []
        self.errors: list[str] = []
        self.counters: dict[str, int] = {"invites": 0, "reports": 0, "skipped": 0, "refused": 0}
        self._invites: queue.Queue[tuple[protocol.RoundInvite, float]] = queue.Queue()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._seen_online = False  # a finished status retained from an earlier run is not ours
        self.finished = threading.Event()
        """Set when the aggregator this agent served says its run is over (its last status
        carries counters["finished"]); `finished_after` is then the rounds it ran."""
        self.finished_after = 0
        self.transport = MqttTransport(
            protocol.agent_client_id(self.fleet, self.agent_id), cfg.broker, clean_start=False,
            will=Will(protocol.agent_status(self.fleet, self.agent_id), self._status("offline")))
        self.channel = Channel(self.transport, cfg.protocol)
        self.guard = SessionGuard(self.transport, self.fleet, self.agent_id, self.counters)
        self.guard.on_fatal.append(lambda _error: self._stop.set())

    @property
    def fatal(self) -> RuntimeFailure | None:
        """Why this agent cannot go on (its login refused its topics, its session taken), or None."""
        return self.guard.fatal

    def _status(self, state: str) -> bytes:
        return protocol.encode(protocol.Status(
            agent=self.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), state=state,
            role="agent", algorithm=self.algorithm, counters=dict(getattr(self, "counters", {}))))

    def _join(self) -> protocol.Join:
        return protocol.Join(agent=self.agent_id, msg_id=protocol.new_msg_id(),
                             sent_at=protocol.now(), model=self.spec.hash,
                             algorithm=self.algorithm, n_samples=self.learner.shard_size)

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 10.0) -> RoundAgent:
        subscribed = threading.Event()

        def announce(t: MqttTransport, _: bool) -> None:
            t.publish(protocol.agent_status(self.fleet, self.agent_id), self._status("online"),
                      qos=1, retain=True)
            if subscribed.is_set():  # a reconnect: the transport re-subscribed before this hook
                self.channel.send(protocol.uplink(self.fleet, self.agent_id), self._join())

        # The first Join waits for our downlink's SUBACK (an invite may answer it at once): it
        # is sent when the aggregator's retained status, subscribed to last, says online.
        self.transport.on_connect_hooks.append(announce)
        try:
            self.transport.connect(timeout)
            self.transport.subscribe(protocol.downlink(self.fleet, self.agent_id), self._on_down, qos=1)
            subscribed.set()
            self.transport.subscribe(protocol.aggregator_status(self.fleet), self._on_aggregator, qos=1)
        except TransportError:
            self.guard.check()  # the connection given up for a reason of the guard's: that one
            raise
        self.guard.check()
        self._worker = threading.Thread(target=self._run, name=f"round-agent-{self.agent_id}",
                                        daemon=True)
        self._worker.start()
        return self

    def stop(self) -> None:
        """Leave cleanly: offline status, then disconnect."""
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=30)
        try:
            if self.transport.connected and self.fatal is None:  # fatal: its topics are not its login's
                self.transport.publish(protocol.agent_status(self.fleet, self.agent_id),
                                       self._status("offline"), qos=1, retain=True).wait(5)
        finally:
            self.transport.close()

    def kill(self) -> None:
        """Vanish as a crash or a lost network would: no goodbye, the broker sends the will."""
        self._stop.set()
        self.transport.kill()

    def __enter__(self) -> RoundAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- downlink

    def _on_down(self, message: Message) -> None:
        received_at = time.monotonic()
        try:
            got = self.channel.receive(message)
        except Refused as r:
            self.errors.append(r.reason)
            return
        if got is None:
            return
        env = got.envelope
        if isinstance(env, protocol.RoundInvite):
            self._invites.put((env, received_at))
        elif isinstance(env, protocol.Error):
            self.errors.append(env.reason)
            self.counters["refused"] += 1
            key = refusal_counter(env.reason)
            self.counters[key] = self.counters.get(key, 0) + 1
            event(log, "agent.refused", level=30, agent=self.agent_id, reason=env.reason,
                  detail=env.detail, action="counted; answering the next invite as usual")
            if self.transport.connected:  # operators see the counts (`fedmq fleet status`)
                self.transport.publish(protocol.agent_status(self.fleet, self.agent_id),
                                       self._status("online"), qos=1, retain=True)

    def _on_aggregator(self, message: Message) -> None:
        try:
            got = self.channel.receive(message)
        except Refused as r:
            self.errors.append(r.reason)
            return
        if got is None or not isinstance(got.envelope, protocol.Status):
            return
        if got.envelope.state == "online":
            self._seen_online = True
            self.channel.send(protocol.uplink(self.fleet, self.agent_id), self._join())
        elif got.envelope.counters.get("finished") and self._seen_online:
            self.finished_after = got.envelope.epoch
            self.finished.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                invite, received_at = self._invites.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self.handle_invite(invite, received_at)
            except Exception:  # a bad round must not kill the agent
                log.exception("round %s failed", invite.round)
                self.errors.append("round_failed")

    def handle_invite(self, invite: protocol.RoundInvite, received_at: float) -> None:
        self.counters["invites"] += 1
        dog = Watchdog(self.learner.budget_s(invite.deadline_s), started_at=received_at)
        if invite.deadline_s - dog.elapsed() <= 0:
            self.counters["skipped"] += 1
            return
        if invite.model != self.spec.hash:
            self.errors.append("wrong_model")
            return
        try:
            start = codecs.decode(invite.tensor, max_n=self.spec.numel)
        except codecs.CodecError as e:
            self.errors.append(f"codec_{e.reason}")
            return
        base = torch.from_numpy(np.ascontiguousarray(start))

        def make_runner(x: torch.Tensor, y: torch.Tensor, anchor: torch.Tensor | None):
            return RealEpochRunner(self.train, x, y, anchor=anchor, round_id=invite.round,
                                   extra_s_per_sample=self.extra_s_per_sample, cancel=self._stop)

        eps = self.learner.uploads.eps
        work = self.learner.run_round(base, make_runner, dog.left)
        if self._stop.is_set():
            return
        upload_s = self._send_report(invite, work, start)
        entry = RoundLog(invite.round, work.finished, work.shard_used, work.shard_size,
                         work.n_samples, work.result.epochs_done, work.result.seconds, upload_s, eps)
        self.log.append(entry)
        # The CLI prints one line per round (on_round); the event is for log shippers (info).
        event(log, "round.done", agent=self.agent_id, round=invite.round,
              finished=work.finished, samples=work.n_samples, epochs=work.result.epochs_done,
              seconds=work.result.seconds, upload_s=upload_s)
        if self.on_round is not None:
            self.on_round(entry)

    def _send_report(self, invite: protocol.RoundInvite, work: RoundWork, base: np.ndarray) -> float:
        c = self.cfg.codec
        tensor: dict[str, Any] | None = None
        if work.finished and work.vector is not None:
            tensor = codecs.encode(work.vector.detach().cpu().numpy(), c.name,
                                   base=base if c.delta else None, zstd=c.zstd,
                                   feedback=self.feedback,
                                   **c.encoder_params(statistics=self.spec.statistics_numel))
        r = work.result
        metrics = {"epochs": float(r.epochs_done), "train_s": float(r.seconds),
                   "eps_s": float(self.learner.uploads.eps), "shard_index": float(work.shard_index)}
        if r.seconds > 0 and r.samples_seen > 0:
            metrics["samples_per_s"] = r.samples_seen / r.seconds
        if work.local_accuracy is not None:
            metrics["accuracy"] = float(work.local_accuracy)
        report = protocol.Report(
            agent=self.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
            round=invite.round, finished=work.finished, n_samples=work.n_samples,
            shard_size=work.shard_size, model=self.spec.hash if tensor is not None else "",
            tensor=tensor, metrics=metrics)
        t0 = time.monotonic()
        handles = self.channel.send(protocol.uplink(self.fleet, self.agent_id), report)
        try:
            for h in handles:
                h.wait(invite.deadline_s)
        except TransportError as e:  # refused by the broker: counted (SessionGuard) and said once
            self.errors.append("upload_refused")
            event(log, "report.refused", level=10, agent=self.agent_id, round=invite.round, error=str(e))
        upload_s = time.monotonic() - t0
        self.learner.uploads.record(upload_s)
        self.counters["reports"] += 1
        return upload_s
