"""One agent speaking to an aggregator Engine directly (the wire is tested elsewhere): joins,
sends, and installs replies as a device would. tests/test_poisoning.py and soak/poisoning.py
build on it."""

from __future__ import annotations

import numpy as np

from aggregator.engine import Engine, Inbound
from fedmq import codecs, protocol
from fedmq.models import ModelSpec


class EngineClient:
    def __init__(self, engine: Engine, agent: str, spec: ModelSpec) -> None:
        self.engine, self.agent, self.spec = engine, agent, spec
        self.base: np.ndarray | None = None
        self.epoch = 0
        join = protocol.Join(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             model=spec.hash, algorithm="cdfl")
        self.install(self.send(join))

    def send(self, env: protocol.Envelope) -> protocol.Envelope:
        (reply,) = self.engine.handle([Inbound(self.agent, env)])
        return reply

    def install(self, reply: protocol.Envelope) -> bool:
        """Hold the model a reply carries (False, and nothing changes, for any other reply)."""
        if not isinstance(reply, protocol.Model):
            return False
        wire = reply.tensors[0]
        self.base = codecs.decode(wire, base=self.base if wire["delta"] else None)
        self.epoch = reply.epoch
        return True

    def update(self, tensor: dict, **fields) -> protocol.Update:
        return protocol.Update(**{"agent": self.agent, "msg_id": protocol.new_msg_id(),
                                  "sent_at": protocol.now(), "model": self.spec.hash, "tau": self.epoch,
                                  "tensor": tensor, "n_samples": 100, **fields})
