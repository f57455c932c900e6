"""Deadline rounds over MQTT: the service that runs CATA-Fed, FedAvg or FedProx rounds.

Synchronous, unlike aggregator/service.py: one thread (the caller of `run`) owns the
strategy and drives rounds; paho's network thread only enqueues raw messages. Per round:
1. the strategy picks the agents (`open_round`); each gets a `RoundInvite` (W_t encoded
   once with the configured codec, no delta: agents need not hold anything; deadline T,
   round id) on its own downlink;
2. `Report`s are collected until every invited agent has reported (`catafed.close_early`)
   or the cut-off T + grace after sending; a finished report's tensor is a delta against
   the W_t the agent decoded (its CRC is checked), later reports are counted and dropped;
3. the strategy aggregates and updates the pool (`close_round`); the global model is
   evaluated when an evaluator is given; the state is snapshotted (atomic rename) when a
   state dir is given.
Presence comes from the agents' retained status topics (offline is their last will); an
agent's per-round data size from its `Join` (answered with an `Ack`) and its reports. Agents
re-send their Join when the aggregator's status goes online, so start order does not matter.

Durability: a snapshot after each round (W_t, round, per-agent table) is the whole state; a
crash mid-round loses that round (it is re-run from W_t after a restart), which costs at most
one deadline. That is cheaper than journaling every report, which would buy nothing: a
report is only useful within its own round. Reports are therefore auto-acknowledged.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import torch

from aggregator.catafed import RoundOutcome, RoundResult, RoundStrategy
from aggregator.journal import atomic_write
from aggregator.service import SoleAggregator, serve_fleet
from fedmq import codecs, protocol
from fedmq.channel import Channel, Refused
from fedmq.config import Config
from fedmq.logs import event, get_logger
from fedmq.models import model_spec
from fedmq.transport import Message, MqttTransport, Will

log = get_logger("aggregator.round_service")

STATE_FILE = "rounds.msgpack"


@dataclass
class RoundRecord:
    """One round as the service saw it."""

    round: int
    selected: list[str]
    finished: list[str]
    stragglers: list[str]
    dropouts: list[str]
    group: int | None
    ended: str
    """all_reported, cutoff, or empty (nobody to invite)."""
    seconds: float
    accuracy: float | None = None
    bytes_down: int = 0
    bytes_up: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    """Per-round data size of each invited agent as the server knew it when inviting."""


class RoundService:
    """Run a `RoundStrategy` against a broker. start(), run(...) or run_round(), stop()."""

    def __init__(self, cfg: Config, strategy: RoundStrategy, *, model_name: str,
                 evaluate: Callable[[torch.Tensor], float] | None = None,
                 client_id: str | None = None, state_dir: str | None = None) -> None:
        self.cfg = cfg
        cfg.codec.downlink_codec()  # an unknown downlink codec stops the start, not the first invite
        self.settings = cfg.catafed
        self.strategy = strategy
        self.spec = model_spec(model_name)
        if strategy.vector.numel() != self.spec.numel:
            raise ValueError(f"strategy holds {strategy.vector.numel()} parameters, "
                             f"{model_name} has {self.spec.numel}")
        self.evaluate = evaluate
        self.fleet = cfg.fleet
        self.state_path = Path(state_dir) / STATE_FILE if state_dir else None
        self.client_id = client_id or f"fedmq-rounds-{cfg.fleet}"
        self.sole = SoleAggregator(self.fleet, self.client_id, cfg.aggregator.takeover_grace_s,
                                   Path(state_dir) if state_dir else None)
        self._run_stop: threading.Event | None = None
        """run()'s stop event: set when another aggregator serves the fleet (`sole`)."""
        self.finished = False
        """The run is over (catafed.rounds done, or the target reached): the status published at
        stop() then carries counters["finished"] = 1, on which round agents stop (docs/catafed.md)."""
        self._inbox: queue.Queue[Message] = queue.Queue()
        self.counters: Counter[str] = Counter()
        self.records: list[RoundRecord] = []
        self._base: np.ndarray | None = None
        self._invited_at = 0.0
        self._round_bytes_up = 0
        self.transport = MqttTransport(
            self.client_id, cfg.broker, clean_start=False,
            will=Will(protocol.aggregator_status(self.fleet), self._status("offline")))
        self.channel = Channel(self.transport, cfg.protocol)

    def _status(self, state: str) -> bytes:
        return protocol.encode(protocol.Status(
            agent="aggregator", msg_id=self.sole.status_id(), sent_at=protocol.now(), state=state,
            role="aggregator", algorithm=self.strategy.name, epoch=self.strategy.round,
            counters={**self.counters, **({"finished": 1} if self.finished else {})},
            started_at=self.sole.started_wall))

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> RoundService:
        if self.state_path is not None and self.state_path.exists():
            self.strategy.load_state(msgpack.unpackb(self.state_path.read_bytes(), raw=False))
            event(log, "rounds.resumed", round=self.strategy.round)
        self.sole.started()
        if not self.sole.clear_to_serve(self.cfg.broker, derived_logins=self.cfg.aggregator.derived_logins):
            return self  # never connected; run() returns at once, `sole.failure` says why
        self.sole.record_instance()
        self.sole.watch(self.transport, self._aggregator_status)  # before serve_fleet's status
        serve_fleet(self.transport, self.fleet, lambda: self._status("online"), self._inbox.put)
        # Once more now that the uplinks are subscribed: agents that started first re-send
        # their Join on it (the one answering the connect's status may have come too early).
        self.transport.publish(protocol.aggregator_status(self.fleet), self._status("online"),
                               qos=1, retain=True)
        event(log, "rounds.started", fleet=self.fleet, algorithm=self.strategy.name,
              round=self.strategy.round)
        return self

    def _aggregator_status(self, message: Message) -> None:
        """Network thread: another aggregator on our fleet that started first stops this one."""
        if self.sole.must_stop(message):
            self.transport.give_up()
            if self._run_stop is not None:
                self._run_stop.set()

    def stop(self) -> None:
        if self.transport.connected and not self.sole.failed.is_set():  # the other one is online
            self.transport.publish(protocol.aggregator_status(self.fleet), self._status("offline"),
                                   qos=1, retain=True).wait(5)
        self.transport.close()

    def __enter__(self) -> RoundService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- messages

    def pump(self, until: float, *, stop: Callable[[], bool] = lambda: False) -> None:
        """Handle incoming messages until monotonic time `until` or `stop()` is true."""
        while not stop():
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                msg = self._inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                for r in self.channel.expire():
                    self._refuse(r)
                continue
            self._handle(msg)
            if self.channel.reassembler.evictions_pending:  # dropped to make room: answer now
                for r in self.channel.expire():
                    self._refuse(r)

    def wait_for_pool(self, n: int, timeout_s: float,
                      stop: threading.Event | None = None) -> bool:
        """Handle messages until at least `n` agents can be invited (or the timeout or `stop`)."""
        self.pump(time.monotonic() + timeout_s,
                  stop=lambda: len(self.strategy.pool()) >= n or (stop is not None and stop.is_set()))
        return len(self.strategy.pool()) >= n

    def _handle(self, msg: Message) -> None:
        try:
            got = self.channel.receive(msg)
        except Refused as r:
            self._refuse(r)
            return
        if got is None:
            return
        env, agent = got.envelope, got.topic.agent or ""
        if isinstance(env, protocol.Status):
            self.strategy.set_online(env.agent, env.state == "online")
            self.counters[f"status.{env.state}"] += 1
        elif isinstance(env, protocol.Join):
            self._join(agent, env)
        elif isinstance(env, protocol.Report):
            self._round_bytes_up += sum(len(m.payload) for m in got.messages)
            self._report(agent, env)
        else:
            self._error(agent, "unexpected_type", f"{env.TYPE} is not part of round-based "
                                                  "algorithms", env.msg_id)

    def _join(self, agent: str, env: protocol.Join) -> None:
        if env.model != self.spec.hash:
            self._error(agent, "wrong_model", f"this fleet runs {self.spec.hash}", env.msg_id)
            return
        if env.algorithm != self.strategy.name:
            self._error(agent, "wrong_algorithm", f"this fleet runs {self.strategy.name}",
                        env.msg_id)
            return
        if env.n_samples < 1:
            self._error(agent, "bad_field", "n_samples must be >= 1 for round-based algorithms",
                        env.msg_id)
            return
        self.strategy.register(agent, env.n_samples)
        self.counters["joins"] += 1
        ack = protocol.Ack(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                           in_reply_to=env.msg_id)
        self.channel.send(protocol.downlink(self.fleet, agent), ack)

    def _report(self, agent: str, env: protocol.Report) -> None:
        plan = self.strategy.plan
        if plan is None or env.round != plan.round:
            self.counters["reports.late"] += 1
            event(log, "report.late", agent=agent, round=env.round)
            return
        vector = None
        if env.finished:
            if env.tensor is None or env.model != self.spec.hash:
                self._error(agent, "bad_report", "a finished report needs the tensor of "
                                                 f"model {self.spec.hash}", env.msg_id)
                return
            try:
                decoded = codecs.decode(env.tensor, base=self._base if env.tensor.get("delta")
                                        else None, max_n=self.spec.numel)
            except codecs.CodecError as e:
                self._error(agent, f"codec_{e.reason}", str(e), env.msg_id)
                return
            if decoded.shape != (self.spec.numel,):
                self._error(agent, "wrong_shape", "the tensor does not fit the model", env.msg_id)
                return
            vector = torch.from_numpy(np.ascontiguousarray(decoded))
        result = RoundResult(agent, env.round, env.finished, env.n_samples, env.shard_size,
                             vector, torch.from_numpy(self._base.copy()), dict(env.metrics),
                             time.monotonic() - self._invited_at)
        if self.strategy.accept(result):
            self.counters["reports.finished" if env.finished else "reports.straggler"] += 1
        else:
            self.counters["reports.ignored"] += 1

    def _error(self, agent: str, reason: str, detail: str, in_reply_to: str) -> None:
        self.counters[f"errors.{reason}"] += 1
        event(log, "uplink.refused", agent=agent, reason=reason, detail=detail)
        err = protocol.Error(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             reason=reason, detail=detail[:4096], in_reply_to=in_reply_to)
        self.channel.send(protocol.downlink(self.fleet, agent), err)

    def _refuse(self, r: Refused) -> None:
        agent = r.topic.agent if r.topic is not None else None
        if agent and r.topic is not None and r.topic.kind == "up":
            self._error(agent, r.reason, r.detail, r.msg_id)
        else:
            self.counters[f"refused.{r.reason}"] += 1

    # ---------------------------------------------------------------- rounds

    def run_round(self, stop: threading.Event | None = None) -> RoundRecord | None:
        """One round; None if `stop` was set while it was open (the round is abandoned, as a
        crash would: no aggregation, no snapshot, re-run from W_t after a restart)."""
        s = self.settings
        t0 = time.monotonic()
        self.pump(t0)  # what already arrived (joins, statuses) counts for this selection
        plan = self.strategy.open_round()
        sizes = {a: self.strategy.agents[a].size for a in plan.selected}
        c = self.cfg.codec
        name, params = c.downlink_codec(self.spec.statistics_numel)
        wire = codecs.encode(self.strategy.vector.numpy(), name, zstd=c.zstd, **params)
        self._base = codecs.decode(wire, max_n=self.spec.numel)  # what every invitee will hold
        self._round_bytes_up = 0
        sent_before = self.channel.bytes_sent
        for agent in plan.selected:
            invite = protocol.RoundInvite(
                agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                round=plan.round, deadline_s=s.deadline_s, model=self.spec.hash, tensor=wire,
                epoch=plan.round)
            self.channel.send(protocol.downlink(self.fleet, agent), invite)
        self._invited_at = time.monotonic()
        cutoff = self._invited_at + s.deadline_s + s.grace_s
        if plan.selected:
            self.pump(cutoff, stop=lambda: (s.close_early and self.strategy.all_reported())
                      or (stop is not None and stop.is_set()))
        if stop is not None and stop.is_set():
            event(log, "round.abandoned", round=plan.round)
            return None
        ended = ("empty" if not plan.selected else
                 "all_reported" if self.strategy.all_reported() else "cutoff")
        outcome: RoundOutcome = self.strategy.close_round()
        accuracy = self.evaluate(self.strategy.vector) if self.evaluate is not None else None
        record = RoundRecord(outcome.round, outcome.selected, outcome.finished, outcome.stragglers,
                             outcome.dropouts, outcome.group, ended, time.monotonic() - t0,
                             accuracy, self.channel.bytes_sent - sent_before,
                             self._round_bytes_up, sizes)
        self.records.append(record)
        self._snapshot()
        event(log, "round.closed", round=record.round, ended=ended, finished=len(outcome.finished),
              stragglers=len(outcome.stragglers), dropouts=len(outcome.dropouts),
              accuracy=accuracy)
        return record

    def run(self, rounds: int | None = None, target_accuracy: float | None = None, *,
            min_agents: int = 1, wait_s: float = 30.0, first_wait_s: float = math.inf,
            stop: threading.Event | None = None,
            on_round: Callable[[RoundRecord], None] | None = None) -> list[RoundRecord]:
        """Rounds until E rounds (catafed.rounds), the target accuracy, or `stop`.

        Round 1 waits up to `first_wait_s` (default: until `stop`) for `min_agents` agents in
        the pool, so that a fleet started in any order begins with the agents it was sized
        for; each later round waits up to `wait_s` for them, then runs with the pool it has.
        `on_round` sees each round's record as it closes; `stop` also ends an open round
        without closing it. Another aggregator on the fleet that started first sets `stop`
        (`sole.failure` says so).
        """
        rounds = self.settings.rounds if rounds is None else rounds
        target = self.settings.target_accuracy if target_accuracy is None else target_accuracy
        stop = stop or threading.Event()
        self._run_stop = stop
        if self.sole.failed.is_set():
            stop.set()
        out: list[RoundRecord] = []
        give_up = time.monotonic() + first_wait_s
        while not stop.is_set() and time.monotonic() < give_up:
            if self.wait_for_pool(min_agents, min(wait_s, give_up - time.monotonic()), stop):
                break
            event(log, "rounds.waiting", level=30, pool=len(self.strategy.pool()),
                  wanted=min_agents)
        for _ in range(rounds):
            if stop.is_set():
                break
            if not self.wait_for_pool(min_agents, wait_s, stop):
                event(log, "rounds.no_agents", level=30, pool=len(self.strategy.pool()),
                      wanted=min_agents)
                if not self.strategy.pool():
                    continue
            record = self.run_round(stop)
            if record is None:
                break
            out.append(record)
            if on_round is not None:
                on_round(record)
            if target and record.accuracy is not None and record.accuracy >= target:
                break
        return out

    def _snapshot(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_path, msgpack.packb(self.strategy.state(), use_bin_type=True))
