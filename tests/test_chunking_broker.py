"""Chunking over a real Mosquitto: a 20 MiB update in 4 MiB chunks arrives bit-exact, and a
message with a missing chunk times out cleanly in the Reassembler."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest

from fedmq import protocol as p
from fedmq.broker import MosquittoBroker

pytestmark = pytest.mark.broker

FLEET, AGENT = "chunktest", "car-1"
CHUNK_BYTES = 4 * 1024 * 1024
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
WAIT_S = 60.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Receiver:
    """An aggregator-like subscriber on all uplinks: decode, check topic, reassemble."""

    def __init__(self, port: int, reassembler: p.Reassembler, expect_chunks: int) -> None:
        self.reassembler = reassembler
        self.expect_chunks = expect_chunks
        self.chunks_seen = 0
        self.whole: list[bytes] = []
        self.errors: list[BaseException] = []
        self.subscribed = threading.Event()
        self.done = threading.Event()  # a whole message, all expected chunks, or an error
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="receiver")
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        client.subscribe(p.all_uplinks(FLEET), qos=1)

    def _on_message(self, client, userdata, msg) -> None:
        try:
            topic = p.parse_topic(msg.topic)
            env = p.decode(msg.payload, CHUNK_BYTES + p.CHUNK_OVERHEAD_BYTES)
            p.check_topic(topic, env)
            assert isinstance(env, p.Chunk), f"expected chunks, got {env.TYPE}"
            self.chunks_seen += 1
            whole = self.reassembler.add(env, sender=topic.agent or "")
            if whole is not None:
                self.whole.append(whole)
                self.done.set()
            elif self.chunks_seen == self.expect_chunks:
                self.done.set()
        except BaseException as e:  # surfaced by the test thread, not lost in paho's loop
            self.errors.append(e)
            self.done.set()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _sender(port: int) -> mqtt.Client:
    connected = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=AGENT)
    client.on_connect = lambda *a: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(WAIT_S), "sender did not connect"
    return client


def _publish_all(client: mqtt.Client, payloads: list[bytes]) -> None:
    infos = [client.publish(p.uplink(FLEET, AGENT), b, qos=1) for b in payloads]
    for info in infos:
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"publish not acknowledged: rc={info.rc}"


@pytest.fixture
def big_update() -> Iterator[tuple[p.Update, bytes]]:
    data = os.urandom(20 * 1024 * 1024)
    update = p.Update(AGENT, p.new_msg_id(), p.now(), model="3f2a9c0e1b2d4f6a", tau=3,
                      tensor={"codec": "fp32", "n": len(data) // 4, "data": data},
                      n_samples=1200, metrics={"loss": 0.42})
    yield update, p.encode(update)


def test_20_mib_update_reassembles_bit_exact(mosquitto: MosquittoBroker, big_update) -> None:
    update, payload = big_update
    chunks = p.split(payload, agent=AGENT, chunk_bytes=CHUNK_BYTES)
    assert len(chunks) == 6 and all(len(c) <= CHUNK_BYTES + p.CHUNK_OVERHEAD_BYTES for c in chunks)
    r = p.Reassembler(MAX_MESSAGE_BYTES, 4 * MAX_MESSAGE_BYTES, timeout_s=30.0)
    receiver = Receiver(mosquitto.port, r, expect_chunks=len(chunks))
    sender = _sender(mosquitto.port)
    try:
        assert receiver.subscribed.wait(WAIT_S), "receiver did not subscribe"
        _publish_all(sender, chunks)
        assert receiver.done.wait(WAIT_S), f"only {receiver.chunks_seen} chunks arrived"
    finally:
        sender.disconnect()
        sender.loop_stop()
        receiver.close()
    assert not receiver.errors, receiver.errors
    assert len(receiver.whole) == 1
    assert receiver.whole[0] == payload
    assert p.decode(receiver.whole[0], MAX_MESSAGE_BYTES) == update
    assert r.pending_messages == 0 and r.pending_bytes == 0


def test_missing_chunk_times_out_and_frees_memory(mosquitto: MosquittoBroker, big_update) -> None:
    update, payload = big_update
    chunks = p.split(payload, agent=AGENT, chunk_bytes=CHUNK_BYTES)
    sent = chunks[:2] + chunks[3:]  # chunk 2 never leaves the sender
    clock = FakeClock()
    r = p.Reassembler(MAX_MESSAGE_BYTES, 4 * MAX_MESSAGE_BYTES, timeout_s=30.0, clock=clock)
    receiver = Receiver(mosquitto.port, r, expect_chunks=len(sent))
    sender = _sender(mosquitto.port)
    try:
        assert receiver.subscribed.wait(WAIT_S), "receiver did not subscribe"
        _publish_all(sender, sent)
        assert receiver.done.wait(WAIT_S), f"only {receiver.chunks_seen} chunks arrived"
    finally:
        sender.disconnect()
        sender.loop_stop()
        receiver.close()
    assert not receiver.errors, receiver.errors
    assert receiver.whole == [] and receiver.chunks_seen == len(sent)
    assert r.pending_messages == 1 and r.pending_bytes == len(payload)
    assert r.stored_bytes == len(payload) - len(p.decode(chunks[2], len(chunks[2])).data)
    clock.t += 29.0
    assert r.expire() == []  # not yet
    clock.t += 2.0
    assert r.expire() == [(AGENT, update.msg_id, "chunk_timeout")]
    assert r.pending_messages == 0 and r.pending_bytes == 0 and r.stored_bytes == 0
