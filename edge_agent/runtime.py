"""The edge agent's protocol loop: join, install what arrives, train, upload, repeat.

An `EdgeAgent` owns one MQTT connection (its own client id and persistent session) and the
model it currently holds. Every exchange is request/reply by msg_id: an upload stays
*pending* until the aggregator's reply names it (`in_reply_to`), and is re-sent with the
same msg_id after `reply_timeout_s` (the aggregator may be restarting; it applies a msg_id
once and answers a replay with the reply it already sent).

Deltas on the wire are taken against the model both sides know the agent holds: the agent
installs exactly what it decodes, and the aggregator tracks that same vector.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedmq import codecs, protocol
from fedmq.channel import Channel, Received, Refused
from fedmq.config import Config
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec, model_spec, resolve_model_name
from fedmq.transport import Message, MqttTransport, Will

log = get_logger("agent")


class AgentError(RuntimeError):
    """The aggregator refused a request, or never answered it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


class EdgeAgent:
    """One device's connection to the fleet. `start()`, `join()`, then `upload()` cycles."""

    def __init__(self, cfg: Config, agent_id: str, *, algorithm: str = "cdfl", profile: str = "",
                 reply_timeout_s: float = 20.0, retries: int = 10) -> None:
        self.cfg = cfg
        self.agent_id = protocol.validate_id(agent_id, "agent id")
        self.algorithm = algorithm
        self.profile = profile
        self.model_name = resolve_model_name(cfg.model, cfg.data.dataset)
        self.spec: ModelSpec = model_spec(self.model_name)
        self.reply_timeout_s = reply_timeout_s
        self.retries = retries
        self.fleet = cfg.fleet
        self.installed: Installed | None = None
        self._replies: dict[str, tuple[Received, int]] = {}
        self._cond = threading.Condition()
        self.transport = MqttTransport(
            f"fedmq-agent-{self.agent_id}", cfg.broker, clean_start=False,
            will=Will(protocol.agent_status(self.fleet, self.agent_id), self._status("offline")),
        )
        self.channel = Channel(self.transport, cfg.protocol)
        self.counters: dict[str, int] = {"uploads": 0, "resends": 0, "errors": 0}

    # ------------------------------------------------------------------ lifecycle

    def _status(self, state: str) -> bytes:
        return protocol.encode(protocol.Status(
            agent=self.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), state=state,
            role="agent", algorithm=self.algorithm,
            epoch=self.installed.epoch if self.installed else 0,
            counters=dict(getattr(self, "counters", {}))))

    def start(self, timeout: float = 10.0) -> EdgeAgent:
        # After every (re)connect: the broker may have published our will meanwhile.
        self.transport.on_connect_hooks.append(
            lambda t, _: t.publish(protocol.agent_status(self.fleet, self.agent_id),
                                   self._status("online"), qos=1, retain=True))
        self.transport.connect(timeout)
        self.transport.subscribe(protocol.downlink(self.fleet, self.agent_id), self._on_down, qos=1)
        return self

    def stop(self) -> None:
        if self.transport.connected:
            self.transport.publish(protocol.agent_status(self.fleet, self.agent_id),
                                   self._status("offline"), qos=1, retain=True).wait(5)
        self.transport.close()

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
        key = getattr(got.envelope, "in_reply_to", "")
        size = sum(len(m.payload) for m in got.messages)
        with self._cond:
            self._replies[key] = (got, size)
            self._cond.notify_all()

    def _request(self, env: protocol.Envelope) -> tuple[protocol.Envelope, int, int]:
        """Send `env` until its reply arrives: (reply, bytes up, bytes down)."""
        up = 0
        for attempt in range(self.retries + 1):
            before = self.channel.bytes_sent
            self.channel.send(protocol.uplink(self.fleet, self.agent_id), env)
            up += self.channel.bytes_sent - before
            if attempt:
                self.counters["resends"] += 1
            deadline = time.monotonic() + self.reply_timeout_s
            with self._cond:
                while env.msg_id not in self._replies:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                got = self._replies.pop(env.msg_id, None)
            if got is not None:
                return got[0].envelope, up, got[1]
        raise AgentError("no_reply", f"{env.TYPE} {env.msg_id} unanswered after "
                                     f"{self.retries + 1} tries of {self.reply_timeout_s}s")

    def _install(self, reply: protocol.Envelope, bytes_down: int) -> Installed:
        if isinstance(reply, protocol.Error):
            self.counters["errors"] += 1
            raise AgentError(reply.reason, reply.detail)
        if not isinstance(reply, protocol.Model):
            raise AgentError("unexpected_reply", f"a {reply.TYPE} answered a request")
        if reply.model != self.spec.hash:
            raise AgentError("wrong_model", f"received spec {reply.model}, running {self.spec.hash}")
        base = self.installed.vector.numpy() if self.installed is not None else None
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
        self.installed = installed
        return installed

    # ------------------------------------------------------------------ requests

    def join(self, n_samples: int = 0) -> Installed:
        env = protocol.Join(agent=self.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                            model=self.spec.hash, algorithm=self.algorithm, profile=self.profile,
                            n_samples=n_samples)
        reply, _, down = self._request(env)
        return self._install(reply, down)

    def update_envelope(self, vector: torch.Tensor, n_samples: int, *,
                        alpha: list[float] | None = None,
                        metrics: dict[str, float] | None = None) -> protocol.Update:
        """The upload of `vector`, encoded as a delta against the installed model."""
        if self.installed is None:
            raise AgentError("not_joined", "join before uploading")
        c = self.cfg.codec
        base = self.installed.vector.numpy() if (c.delta and self.installed.kind != "clusters") else None
        params: dict[str, Any] = {"block": c.int8_block} if c.name == "int8" else (
            {"ratio": c.topk_ratio} if c.name == "topk" else {})
        wire = codecs.encode(vector.detach().cpu().numpy(), c.name, base=base, zstd=c.zstd, **params)
        return protocol.Update(agent=self.agent_id, msg_id=protocol.new_msg_id(),
                               sent_at=protocol.now(), model=self.spec.hash,
                               tau=self.installed.epoch, tensor=wire, n_samples=n_samples,
                               alpha=alpha, metrics=metrics or {})

    def upload(self, env: protocol.Update) -> tuple[Installed, int]:
        """Send an update until answered; install the reply. Returns (installed, bytes up)."""
        self.counters["uploads"] += 1
        reply, up, down = self._request(env)
        return self._install(reply, down), up
