"""A bare MQTT test client that speaks the protocol by hand (paho + fedmq.protocol only).

Integration tests use it to poke the aggregator exactly as a device would, including with
bytes no real agent would send.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import paho.mqtt.client as mqtt

from fedmq import codecs, protocol


class RawAgent:
    def __init__(self, port: int, fleet: str, agent: str, *, client_id: str | None = None,
                 ca_file: str | None = None, password: str | None = None, clean_start: bool = True) -> None:
        """With `password`, it logs in as user `agent` (over TLS trusting `ca_file`, if given),
        as on a broker with broker_config/prod.conf."""
        self.fleet, self.agent = fleet, agent
        self.inbox: queue.Queue[protocol.Envelope] = queue.Queue()
        self._subscribed = threading.Event()
        self.disconnects = 0
        """How often the broker closed this connection (a session taken over shows here)."""
        self._closing = False
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"raw-{fleet}-{agent}",
                                  clean_session=clean_start)
        if ca_file is not None:
            self.client.tls_set(ca_certs=str(ca_file))
        if password is not None:
            self.client.username_pw_set(agent, password)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a, **k: self._subscribed.set()
        self.client.on_disconnect = self._on_disconnect
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(protocol.downlink(fleet, agent), qos=1)
        assert self._subscribed.wait(60), "no SUBACK"
        self.base: np.ndarray | None = None
        self.epoch = 0

    def _on_disconnect(self, *args) -> None:
        if not self._closing:
            self.disconnects += 1

    def _on_message(self, client, userdata, msg) -> None:
        self.inbox.put(protocol.decode(msg.payload, max_bytes=1 << 27))

    def publish_raw(self, payload: bytes, topic: str | None = None) -> None:
        info = self.client.publish(topic or protocol.uplink(self.fleet, self.agent), payload, qos=1)
        info.wait_for_publish(10)

    def send(self, env: protocol.Envelope) -> None:
        self.publish_raw(protocol.encode(env))

    def expect(self, in_reply_to: str, timeout: float = 120.0) -> protocol.Envelope:
        """The next downlink answering `in_reply_to` (others are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.agent}: no reply to {in_reply_to} in {timeout}s")
            try:
                env = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            if getattr(env, "in_reply_to", None) == in_reply_to:
                return env

    def join(self, spec_hash: str, algorithm: str = "cdfl", timeout: float = 120.0) -> protocol.Model:
        env = protocol.Join(agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                            model=spec_hash, algorithm=algorithm, n_samples=100)
        self.send(env)
        reply = self.expect(env.msg_id, timeout)
        assert isinstance(reply, protocol.Model), reply
        self.install(reply)
        return reply

    def install(self, reply: protocol.Model) -> None:
        wire = reply.tensors[0]
        self.base = codecs.decode(wire, base=self.base if wire["delta"] else None)
        self.epoch = reply.epoch

    def update_envelope(self, vector: np.ndarray, spec_hash: str, *, codec: str = "int8",
                        msg_id: str | None = None, delta: bool = True) -> protocol.Update:
        """delta=False sends the whole vector: valid whatever reply the aggregator sent last."""
        wire = codecs.encode(vector, codec, base=self.base if delta else None, zstd=True)
        return protocol.Update(agent=self.agent, msg_id=msg_id or protocol.new_msg_id(),
                               sent_at=protocol.now(), model=spec_hash, tau=self.epoch,
                               tensor=wire, n_samples=100)

    def close(self) -> None:
        # DISCONNECT first: it wakes paho's loop, which then ends; stopped first, the loop
        # would finish its 1 s select before the DISCONNECT could go.
        self._closing = True
        self.client.disconnect()
        self.client.loop_stop()
