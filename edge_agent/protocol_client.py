"""The edge agent's protocol loop: join, install what arrives, train, upload, repeat.

An `EdgeAgent` owns one MQTT connection (its own client id and persistent session) and the
model it currently holds. Every exchange is request/reply by msg_id: an upload stays
*pending* until the aggregator's reply names it (`in_reply_to`), and is re-sent with the
same msg_id after `reply_timeout_s` (the aggregator may be restarting; it applies a msg_id
once and answers a replay with the reply it already sent).

Deltas on the wire are taken against the model both sides know the agent holds: the agent
installs exactly what it decodes, and the aggregator tracks that same vector.

While the aggregator works on a reply it sends `receipt`s (docs/protocol.md): each one
moves the re-send to `reply_timeout_s` plus RECEIPT_MARGIN times the reply time it expects,
so a slow reply is waited for, not re-sent for; the agent re-sends only when receipts stop
(the aggregator is down). A reply is re-sent for at once (not after the timeout) when the
connection comes back, since the broker may have lost it. A downlink that cannot be
installed (malformed, wrong spec or shape, a delta against another base, NaN) is logged
(`downlink.rejected` with its reason) and ignored: the current model stays installed and
the request keeps waiting for a good reply (a re-send makes the aggregator repeat its real
one). Replies to requests no longer waited for (a second answer to a re-sent upload) and
receipts that come after the reply are dropped.

With `agent.keep_local_bn` (FedBN, Li et al. 2021) the agent keeps its own batch-norm
weights, biases and running statistics when it installs a reply after its first: the
model it runs and trains (`Installed.vector`) is the reply with those entries its own,
while deltas both ways stay against what it decoded (`Installed.wire`), the model the
aggregator knows it holds. Its uploads still carry its statistics, which the server
averages into the cluster models as before.

What retrying cannot mend ends the agent (`SessionGuard`): the broker refusing its own topics
to its login (MQTT 5 reason code 0x87: the login is another agent's, or not in this fleet)
raises `LoginRefused`, and another process holding its session (the same id, so the same
client id, or under prod.conf the same login) raises `SessionTakenOver` in the one taken
over soon after it connected, so the other keeps working. Every other refusal by the broker is
counted (`broker_refused`) and logged by the transport, and the agent carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edge_agent.agent_algorithms import agent_algorithm
from fedmq import codecs, protocol, sketch
from fedmq.channel import Channel, Received, Refused
from fedmq.config import Config
from fedmq.errors import RuntimeFailure, UsageError
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec, batch_norm_index, model_spec, resolve_model_name
from fedmq.transport import Message, MqttTransport, Refusal, TransportError, Will

log = get_logger("agent")

REJOIN_REASONS = frozenset({"unknown_agent", "no_base", "codec_no_base", "codec_base_mismatch"})
"""Errors that mean the aggregator and the agent disagree on what the agent holds: join again."""

RESYNC_REASONS = REJOIN_REASONS | {"bad_tau"}
"""Refusals after which a sender drops its upload and joins again (the device agent, the
simulator, the soak drivers): the aggregator no longer knows the model the upload started from."""

RECEIPT_MARGIN = 2.0
"""After a receipt, wait reply_timeout_s plus this many times its `expect_s` before re-sending:
an estimate from recent reply times may be short, and renewed receipts keep the wait going."""

INVALID_DOWNLINK = frozenset({"unexpected_reply", "wrong_model", "wrong_shape"})
"""Agent-side reasons (besides codec_*) for refusing a reply; the request keeps waiting."""


HEARTBEAT_KEEPALIVES = 2
"""A device agent re-publishes its retained online status every this many broker keepalives
(advertised as Status.heartbeat_s): a session cut without a last will (Mosquitto 2.0.11 sends
none when a reload drops a rotated login) then shows offline in `fedmq fleet status` once the
heartbeats stop (fedmq/fleet_status.py, STALE_HEARTBEATS)."""


def heartbeat_s(cfg: Config) -> float:
    """How often a device agent renews its retained online status."""
    return float(HEARTBEAT_KEEPALIVES * cfg.broker.keepalive_s)


class LoginRefused(RuntimeFailure):
    """The broker refuses this agent's own topics to its login: retrying cannot help (exit 1)."""


class SessionTakenOver(RuntimeFailure):
    """Another process holds this agent's session (same id): this one stops (exit 1)."""


class SessionGuard:
    """Watches an agent's transport for what retrying cannot mend, and stops it.

    - The broker refuses (0x87 Not authorized) a publish or subscribe on one of the agent's own
      topics: the ACL gives them to another login, so every retry would be refused too.
    - Another client took the session (transport.TAKEOVER_STRIKES): two processes with one id.
      The one taken over soon after it connected stops; the other keeps the session.

    Either way `fatal` holds the one-line error, the transport gives up (no more reconnects, so
    the other process's session is left alone) and every `on_fatal` callback runs (any thread).
    Other refusals are counted in `counters["broker_refused"]` and left to the transport's log.
    """

    def __init__(self, transport: MqttTransport, fleet: str, agent_id: str,
                 counters: dict[str, Any]) -> None:
        self.transport = transport
        self.fleet, self.agent_id = fleet, agent_id
        self.counters = counters
        self.own_topics = {protocol.uplink(fleet, agent_id), protocol.agent_status(fleet, agent_id),
                           protocol.downlink(fleet, agent_id)}
        self.fatal: RuntimeFailure | None = None
        self.on_fatal: list[Callable[[RuntimeFailure], None]] = []
        self._lock = threading.Lock()
        transport.on_refused_hooks.append(self._refused)
        transport.on_taken_over_hooks.append(self._taken_over)

    def check(self) -> None:
        """Raise the fatal error, if there is one."""
        if self.fatal is not None:
            raise self.fatal

    def _refused(self, transport: MqttTransport, r: Refusal) -> bool:
        self.counters["broker_refused"] = self.counters.get("broker_refused", 0) + 1
        if not (r.not_authorized and r.topic in self.own_topics):
            return False
        who = f"login {r.login!r}" if r.login else "an anonymous login"
        if r.login and r.login != self.agent_id:
            fix = (f"the ACL gives login {r.login!r} the topics of agent {r.login!r} only: run it with "
                   f"--id {r.login}, or give agent {self.agent_id!r} a login of its own (`fedmq creds`)")
        else:
            fix = (f"the ACL does not give agent {self.agent_id!r} fleet {self.fleet!r}: check --fleet, "
                   f"or add the agent to the fleet (`fedmq creds --agents {self.fleet}/{self.agent_id}`)")
        self._fail(LoginRefused(f"the broker refused {who} to {r.kind} {r.topic}: {r.reason}, so "
                                f"retrying cannot help; {fix}"))
        return True

    def _taken_over(self, transport: MqttTransport, why: str) -> None:
        login = transport.address.username
        who = f"login {login!r}" if login else f"client id {transport.client_id!r}"
        self._fail(SessionTakenOver(
            f"another process is connected as agent {self.agent_id!r} ({who}): {why}; this one stops "
            f"and leaves the session to it: run one process per agent id (another device needs an "
            f"id and a login of its own)"))

    def _fail(self, error: RuntimeFailure) -> None:
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = error
        event(log, "agent.stopping", logging.DEBUG, agent=self.agent_id, reason=str(error))
        self.transport.give_up()
        for callback in list(self.on_fatal):
            callback(error)


def refusal_counter(reason: str) -> str:
    """The counter of refusals for `reason`: `refused.<reason>`, cut to the 64 characters a
    status counter's name may have (a reason may have 64 itself)."""
    return f"refused.{reason}"[:64]


class AgentError(RuntimeError):
    """The aggregator refused a request, or never answered it."""

    def __init__(self, reason: str, detail: str, *, refused: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.refused = refused
        """True when the aggregator answered with an Error reply (a refusal, an outcome the
        sender counts by reason and carries on from); False when no usable answer came."""


@dataclass
class Installed:
    """A model the agent received and now holds."""

    epoch: int
    vector: torch.Tensor
    alpha: list[float] | None
    kind: str
    clusters: list[torch.Tensor] = field(default_factory=list)
    """FedSoft-Async: all K cluster models (vector is then their alpha-mixture)."""
    bytes_down: int = 0
    wire: torch.Tensor | None = None
    """What the reply decoded to, where the agent kept its own batch norm (agent.keep_local_bn):
    the model the aggregator tracks for it, the base of the deltas both ways. None: `vector`."""

    @property
    def base(self) -> torch.Tensor:
        """The vector deltas on the wire are taken against."""
        return self.vector if self.wire is None else self.wire


class EdgeAgent:
    """One device's connection to the fleet. `start()`, `join()`, then `upload()` cycles."""

    def __init__(self, cfg: Config, agent_id: str, *, algorithm: str = "cdfl", profile: str = "",
                 reply_timeout_s: float = 20.0, retries: int = 10, heartbeat_s: float = 0.0) -> None:
        self.cfg = cfg
        self.agent_id = protocol.validate_id(agent_id, "agent id")
        self.algorithm = algorithm
        self.kind = agent_algorithm(algorithm)
        """What this algorithm's agent sends (edge_agent/agent_algorithms.py)."""
        self.profile = profile
        self.model_name = resolve_model_name(cfg.model, cfg.data.dataset)
        self.spec: ModelSpec = model_spec(self.model_name)
        self.reply_timeout_s = reply_timeout_s
        self.retries = retries
        self.fleet = cfg.fleet
        self.installed: Installed | None = None
        self._replies: dict[str, tuple[Received, int]] = {}
        self._receipts: dict[str, protocol.Receipt] = {}
        """msg_id waited for -> the latest receipt naming it, not yet seen by the wait."""
        self._waiting: set[str] = set()
        self._connects = 0
        self._interrupted = False
        self.last_rejection: str | None = None
        """Reason the last refused downlink was refused (for operators and tests)."""
        self.local_index = batch_norm_index(self.model_name) if cfg.agent.keep_local_bn else None
        """Positions of the vector this agent keeps its own on install (agent.keep_local_bn); None: off."""
        self.trained: torch.Tensor | None = None
        """With keep_local_bn: the model of the upload waiting for its reply, whose batch norm the
        reply's install keeps (None: the installed model's)."""
        if self.local_index is not None and not len(self.local_index):
            event(log, "keep_local_bn.unused", logging.WARNING, agent=self.agent_id, model=self.model_name,
                  reason="the model has no batch norm: every reply is installed whole")
        self.feedback = codecs.ErrorFeedback() if cfg.codec.uses_feedback() else None
        """What top-k left out of earlier uploads, added to the next (codec.error_feedback);
        kept in memory only: a restarted agent starts with none."""
        self._cond = threading.Condition()
        self.transport = MqttTransport(
            protocol.agent_client_id(self.fleet, self.agent_id), cfg.broker, clean_start=False,
            will=Will(protocol.agent_status(self.fleet, self.agent_id), self._status("offline")),
        )
        self.channel = Channel(self.transport, cfg.protocol)
        self.counters: dict[str, float] = {"uploads": 0, "resends": 0, "errors": 0, "rejected": 0,
                                         "joins": 0}
        self.guard = SessionGuard(self.transport, self.fleet, self.agent_id, self.counters)
        """Stops the agent when its login may not use its topics or another process has its session."""
        self.guard.on_fatal.append(lambda _error: self._wake())
        self.heartbeat_s = heartbeat_s
        """Re-publish the retained online status this often (0: only on changes), advertised in
        it: `fedmq fleet status` shows an agent offline once its heartbeats stop."""
        self._beats = threading.Event()
        self._beat_thread: threading.Thread | None = None
        a = cfg.agent
        self.privacy = cfg.privacy.mechanisms(plan=dict(
            n=a.min_samples_to_train, batch_size=a.batch_size, epochs=a.epochs,
            sketch=self.sends_sketch(a.min_samples_to_train),
            alpha=self.kind.sends_alpha))
        """DP of what this agent sends, and the epsilon it has spent (privacy.epsilon; off by default)."""
        if self.privacy.enabled and not self.kind.private:
            raise UsageError(f"privacy.epsilon: differential privacy is built for cdfl and fedsoft-async "
                             f"agents, not for {algorithm} (docs/privacy.md)")
        if self.privacy.enabled:
            self.counters["epsilon"] = 0.0

    # ------------------------------------------------------------------ lifecycle

    def _status(self, state: str) -> bytes:
        return protocol.encode(protocol.Status(
            agent=self.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), state=state,
            role="agent", algorithm=self.algorithm,
            epoch=self.installed.epoch if self.installed else 0,
            counters=dict(getattr(self, "counters", {})),
            heartbeat_s=getattr(self, "heartbeat_s", 0.0) if state == "online" else 0.0))

    def start(self, timeout: float = 10.0) -> EdgeAgent:
        # After every (re)connect: the broker may have published our will meanwhile.
        self.transport.on_connect_hooks.append(
            lambda t, _: t.publish(protocol.agent_status(self.fleet, self.agent_id),
                                   self._status("online"), qos=1, retain=True))
        self.transport.on_connect_hooks.append(lambda t, _: self._connected_again())
        try:
            self.transport.connect(timeout)
            # The SUBACK gets the same time as the CONNACK: a broker creating thousands of sessions
            # at once (a cluster, mirrored queues) can take longer than the default 10 s for it.
            self.transport.subscribe(protocol.downlink(self.fleet, self.agent_id), self._on_down, qos=1,
                                     timeout=timeout)
        except TransportError:
            self.guard.check()  # the connection given up for a reason of the guard's: that one
            raise
        self.guard.check()
        if self.heartbeat_s > 0 and self._beat_thread is None:
            self._beat_thread = threading.Thread(target=self._heartbeat, name=f"heartbeat-{self.agent_id}",
                                                 daemon=True)
            self._beat_thread.start()
        return self

    @property
    def fatal(self) -> RuntimeFailure | None:
        """Why this agent cannot go on (its login refused its topics, its session taken), or None."""
        return self.guard.fatal

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _heartbeat(self) -> None:
        while not self._beats.wait(self.heartbeat_s):
            try:
                self.publish_status()
            except TransportError as e:  # closed meanwhile, or the window stayed full
                event(log, "status.heartbeat_failed", logging.DEBUG, agent=self.agent_id, error=str(e))

    def awaiting(self, msg_id: str) -> bool:
        """Whether a reply naming `msg_id` would be taken now (a reply before that is unexpected)."""
        with self._cond:
            return msg_id in self._waiting

    def publish_status(self) -> None:
        """Re-publish the retained online status with the current counters: `fedmq fleet
        status` reads an agent's last accuracy and last upload time from there."""
        if self.transport.connected:
            self.transport.publish(protocol.agent_status(self.fleet, self.agent_id),
                                   self._status("online"), qos=1, retain=True)

    def stop(self) -> None:
        """Say offline and disconnect. The connection closes even if the status publish fails:
        a transport left open reconnects on its own and fights a later client of the same id."""
        self._beats.set()
        try:
            if self.transport.connected and self.fatal is None:  # fatal: its topics are not its login's
                self.transport.publish(protocol.agent_status(self.fleet, self.agent_id),
                                       self._status("offline"), qos=1, retain=True).wait(5)
        finally:
            self.transport.close()

    def interrupt(self) -> None:
        """Make a waiting request (and every later one) raise AgentError("interrupted") now.

        For shutdown: the caller keeps its pending upload on disk and re-sends it after a restart.
        """
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def _connected_again(self) -> None:
        with self._cond:
            self._connects += 1
            self._cond.notify_all()

    def restore(self, epoch: int, vector: torch.Tensor, alpha: list[float] | None = None,
                wire: torch.Tensor | None = None) -> Installed:
        """Hold a model saved before a restart (the aggregator still tracks it as our base)."""
        if vector.shape != (self.spec.numel,):
            raise AgentError("wrong_shape", f"saved vector has shape {tuple(vector.shape)}, "
                                            f"{self.model_name} has {self.spec.numel} parameters")
        if wire is not None and wire.shape != vector.shape:
            raise AgentError("wrong_shape", f"saved wire vector has shape {tuple(wire.shape)}, "
                                            f"the model {tuple(vector.shape)}")
        self.installed = Installed(epoch, vector.detach().float().cpu(), alpha, "personalized",
                                   wire=None if wire is None else wire.detach().float().cpu())
        return self.installed

    def __enter__(self) -> EdgeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ downlink

    def _on_down(self, message: Message) -> None:
        try:
            got = self.channel.receive(message)
        except Refused as r:
            self.counters["errors"] += 1
            event(log, "downlink.refused", agent=self.agent_id, reason=r.reason, detail=r.detail)
            return
        if got is None:
            return
        if isinstance(got.envelope, protocol.Receipt):
            with self._cond:
                if got.envelope.of in self._waiting:  # a late one (after the reply) is no news
                    self._receipts[got.envelope.of] = got.envelope
                    self._cond.notify_all()
            return
        key = getattr(got.envelope, "in_reply_to", "")
        size = sum(len(m.payload) for m in got.messages)
        with self._cond:
            if key not in self._waiting:
                event(log, "downlink.unexpected", agent=self.agent_id, type=got.envelope.TYPE,
                      in_reply_to=key, reason=getattr(got.envelope, "reason", None))
                return
            self._replies[key] = (got, size)
            self._cond.notify_all()

    def _exchange(self, env: protocol.Envelope) -> tuple[Installed, int]:
        """Send `env` until a reply that can be installed arrives; install it: (installed, bytes up).

        Re-sends after `reply_timeout_s` (up to `retries` times) and at once after a reconnect
        (not counted against `retries`); each receipt moves the re-send to `reply_timeout_s`
        plus RECEIPT_MARGIN times the reply time it announces. An Error reply raises
        AgentError with its reason (a
        first `duplicate` only makes it ask once more, see below); a reply that cannot be
        installed is logged and ignored, and the wait goes on.
        """
        up = 0
        tries = 0
        sends = 0
        rejection: str | None = None
        asked_again = False
        with self._cond:
            self._waiting.add(env.msg_id)
        try:
            while True:
                self.guard.check()
                if self._interrupted:
                    raise AgentError("interrupted", f"{env.TYPE} {env.msg_id} stays pending")
                before = self.channel.bytes_sent
                self.channel.send(protocol.uplink(self.fleet, self.agent_id), env)
                up += self.channel.bytes_sent - before
                sends += 1
                if sends > 1:
                    self.counters["resends"] += 1
                deadline = time.monotonic() + self.reply_timeout_s
                reconnected = again = False
                while True:
                    with self._cond:
                        connects = self._connects
                        while (env.msg_id not in self._replies and not self._interrupted
                               and self._connects == connects and env.msg_id not in self._receipts
                               and self.guard.fatal is None):
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self._cond.wait(left)
                        got = self._replies.pop(env.msg_id, None)
                        receipt = self._receipts.pop(env.msg_id, None)
                        reconnected = self._connects != connects
                    self.guard.check()
                    if got is None and receipt is not None and not reconnected:
                        # Taken: the reply is being made. Wait for it, not re-send.
                        deadline = max(deadline, time.monotonic() + self.reply_timeout_s
                                       + RECEIPT_MARGIN * receipt.expect_s)
                        self.counters["receipts"] = self.counters.get("receipts", 0) + 1
                        event(log, "reply.expected", agent=self.agent_id, msg_id=env.msg_id,
                              expect_s=receipt.expect_s, ahead=receipt.ahead,
                              wait_s=round(deadline - time.monotonic(), 1))
                        continue
                    if got is None:
                        break
                    reply = got[0].envelope
                    if isinstance(reply, protocol.Error) and reply.reason == "rate_limited":
                        # The aggregator already holds its quota of our messages (copies re-sent
                        # while it was down): keep waiting; the timeout re-sends as usual.
                        self.counters["rate_limited"] = self.counters.get("rate_limited", 0) + 1
                        event(log, "reply.rate_limited", agent=self.agent_id, msg_id=env.msg_id,
                              action="waiting for the queued copy's reply")
                        continue
                    if isinstance(reply, protocol.Error) and reply.reason == "duplicate" and not asked_again:
                        # Two copies of one request (ours after a reconnect, paho's own) can
                        # meet in one aggregator batch: the second is answered "duplicate",
                        # possibly before the first's reply. Ask once more: a replay of the
                        # last applied msg_id is answered with its real reply.
                        asked_again = again = True
                        self.counters["duplicates"] = self.counters.get("duplicates", 0) + 1
                        event(log, "reply.duplicate", agent=self.agent_id, msg_id=env.msg_id,
                              action="asking again for the applied upload's reply")
                        break
                    try:
                        return self._install(reply, got[1]), up
                    except AgentError as e:
                        if not isinstance(got[0].envelope, protocol.Model):
                            raise
                        self.counters["rejected"] += 1
                        self.last_rejection = rejection = e.reason
                        event(log, "downlink.rejected", level=30, agent=self.agent_id,
                              in_reply_to=env.msg_id, reason=e.reason, detail=e.detail,
                              action="current model kept; waiting for a valid reply")
                if self._interrupted:
                    continue  # raises at the top of the loop
                if again:
                    continue
                if reconnected:
                    event(log, "request.resend_after_reconnect", agent=self.agent_id, msg_id=env.msg_id)
                    continue
                tries += 1
                if tries > self.retries:
                    reason = rejection or "no_reply"
                    raise AgentError(reason, f"{env.TYPE} {env.msg_id} got no installable reply "
                                             f"after {tries} tries of {self.reply_timeout_s}s")
        finally:
            with self._cond:
                self._waiting.discard(env.msg_id)
                self._replies.pop(env.msg_id, None)
                self._receipts.pop(env.msg_id, None)

    def _install(self, reply: protocol.Envelope, bytes_down: int) -> Installed:
        if isinstance(reply, protocol.Error):
            self.counters["errors"] += 1
            raise AgentError(reply.reason, reply.detail, refused=True)
        if not isinstance(reply, protocol.Model):
            raise AgentError("unexpected_reply", f"a {reply.TYPE} answered a request")
        if reply.model != self.spec.hash:
            raise AgentError("wrong_model", f"received spec {reply.model}, running {self.spec.hash}")
        base = self.installed.base.numpy() if self.installed is not None else None
        try:
            decoded = [codecs.decode(w, base=base if w["delta"] else None, max_n=self.spec.numel)
                       for w in reply.tensors]
        except codecs.CodecError as e:
            # The current model stays installed: a bad download changes nothing.
            raise AgentError(f"codec_{e.reason}", str(e)) from None
        if any(d.shape != (self.spec.numel,) for d in decoded):
            raise AgentError("wrong_shape", "a received tensor does not fit the model")
        vectors = [torch.from_numpy(np.ascontiguousarray(d)) for d in decoded]
        if reply.kind == "clusters":
            alpha = reply.alpha or [1.0 / len(vectors)] * len(vectors)
            mixed = sum(a * v for a, v in zip(alpha, vectors, strict=True))
            installed = Installed(reply.epoch, mixed, reply.alpha, reply.kind, vectors, bytes_down)
        else:
            installed = Installed(reply.epoch, vectors[0], reply.alpha, reply.kind, [], bytes_down)
        own = self.local_index
        if own is not None and len(own) and self.installed is not None:  # the first model has nothing of ours yet
            mine = self.trained if self.trained is not None else self.installed.vector
            installed.wire = installed.vector
            installed.vector = installed.vector.clone()
            installed.vector[own] = mine[own]
        self.installed = installed
        self.trained = None
        return installed

    # ------------------------------------------------------------------ requests

    def join(self, n_samples: int = 0) -> Installed:
        env = protocol.Join(agent=self.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                            model=self.spec.hash, algorithm=self.algorithm, profile=self.profile,
                            n_samples=n_samples)
        self.counters["joins"] += 1
        self.trained = None  # a join answers no upload: the installed model's batch norm is kept
        installed, _ = self._exchange(env)
        return installed

    def update_envelope(self, vector: torch.Tensor, n_samples: int, *,
                        alpha: list[float] | None = None,
                        metrics: dict[str, float] | None = None,
                        inputs: torch.Tensor | None = None) -> protocol.Update:
        """The upload of `vector`, encoded as a delta against the installed model.

        With the training `inputs`, a CDFL upload carries their data sketch (fedmq/sketch.py)
        unless `agent.send_sketch` is off. With DP on (privacy.epsilon) `vector` must come from
        DP-SGD, whose steps the trainer charged; the sketch is noised and charged here
        (BudgetSpent if that would take epsilon past the budget); `metrics` (noiseless) are
        left out, and so is an `alpha` that `privacy.release_alpha` did not noise."""
        if self.installed is None:
            raise AgentError("not_joined", "join before uploading")
        summary = None
        if inputs is not None and self.sends_sketch(inputs.shape[0]):
            values = sketch.data_sketch(inputs)
            if self.privacy.enabled:  # `vector` comes from DP-SGD (train_cycle): the sketch is the rest
                values = self.privacy.release_sketch(values, inputs.shape[0])
            summary = values.astype("<f2").tobytes()
        if self.privacy.enabled:
            self.counters["epsilon"] = round(self.privacy.spent(), 4)
            metrics = None
            if alpha is not None and alpha != self.privacy.released_alpha:
                alpha = None  # never a noiseless estimate
        c = self.cfg.codec
        base = self.installed.base.numpy() if (c.delta and self.installed.kind != "clusters") else None
        wire = codecs.encode(vector.detach().cpu().numpy(), c.name, base=base, zstd=c.zstd,
                             feedback=self.feedback, **c.encoder_params(statistics=self.spec.statistics_numel))
        if self.local_index is not None:
            self.trained = vector.detach().float().cpu().clone()
        return protocol.Update(agent=self.agent_id, msg_id=protocol.new_msg_id(),
                               sent_at=protocol.now(), model=self.spec.hash,
                               tau=self.installed.epoch, tensor=wire, n_samples=n_samples,
                               alpha=alpha, metrics=metrics or {}, sketch=summary,
                               sketch_method=sketch.METHOD if summary is not None else "",
                               noised=self.privacy.enabled)

    def sends_sketch(self, n: int) -> bool:
        """Whether an upload with n training inputs carries their sketch (never of fewer than
        agent.sketch_min_samples: the sketch of a few samples reveals them)."""
        a = self.cfg.agent
        return a.send_sketch and self.kind.sends_sketch and n >= a.sketch_min_samples

    def upload(self, env: protocol.Update, *, resend: bool = False) -> tuple[Installed, int]:
        """Send an update until answered; install the reply. Returns (installed, bytes up).

        `resend=True`: `env` was sent before (a pending upload after a restart or a failed
        wait); it is not counted as a new upload.
        """
        if resend:
            self.counters["resends"] += 1
        else:
            self.counters["uploads"] += 1
        return self._exchange(env)

    def decode_pending(self, payload: bytes) -> protocol.Update:
        """The Update stored as a pending upload (its bytes re-encode identically)."""
        env = protocol.decode(payload, max_bytes=self.cfg.protocol.max_message_bytes)
        if not isinstance(env, protocol.Update) or env.agent != self.agent_id:
            raise AgentError("bad_pending", f"stored pending upload is a {env.TYPE} of {env.agent}")
        if self.local_index is not None and self.installed is not None:  # its batch norm, as it was sent
            with_base = env.tensor.get("delta")
            try:
                self.trained = torch.from_numpy(np.ascontiguousarray(codecs.decode(
                    env.tensor, base=self.installed.base.numpy() if with_base else None, max_n=self.spec.numel)))
            except codecs.CodecError:
                self.trained = None  # the install then keeps the held model's batch norm
        return env
