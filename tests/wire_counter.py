"""A broker-side subscriber that counts payload bytes on every agent's up and down topics:
the ground truth the simulator's own byte counts are checked against."""

from __future__ import annotations

import threading

from fedmq.config import Config
from fedmq.transport import Message, MqttTransport


class WireCounter:
    def __init__(self, url: str) -> None:
        cfg = Config()
        cfg.broker.url = url
        self.bytes = {"up": 0, "down": 0}
        self.lock = threading.Lock()
        self.transport = MqttTransport("wire-counter", cfg.broker, clean_start=True).connect()
        for kind in ("up", "down"):
            self.transport.subscribe(f"fedmq/+/agents/+/{kind}", self._count, qos=1)

    def _count(self, m: Message) -> None:
        with self.lock:
            self.bytes[m.topic.rsplit("/", 1)[1]] += len(m.payload)
