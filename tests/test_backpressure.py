"""Back-pressure: a consumer that stops reading its socket bounds its own queue, and loses nothing.

Mosquitto 2.0.11 keeps delivering to a manual-ack subscriber that acks as it goes (the
in-flight window does not bound it, soak/broker_window.py), so the aggregator bounds its
inbox itself: `MqttTransport.pause_reading` on a `NetworkLoop`, with TCP flow control holding
the rest at the broker.
"""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from fedmq.config import BrokerSettings
from fedmq.transport import Message, MqttTransport, NetworkLoop, TransportError
from tests.raw_agent import RawAgent
from tests.test_aggregator_service import FLEET, SPEC, make_cfg, pretrained  # noqa: F401

PAYLOAD = b"x" * 20_000


def _consumer(url: str, network: NetworkLoop, keepalive_s: int = 30) -> tuple[MqttTransport, list[Message]]:
    got: list[Message] = []
    t = MqttTransport("consumer", BrokerSettings(url=url, keepalive_s=keepalive_s), manual_ack=True,
                      network=network)
    t.connect()
    t.subscribe("bp/in", lambda m: (got.append(m), t.ack(m)), qos=1)
    return t, got


def _wait(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_paused_transport_takes_nothing_then_everything_after_resume(mosquitto) -> None:
    network = NetworkLoop("bp-test")
    consumer, got = _consumer(mosquitto.url, network)
    producer = MqttTransport("producer", BrokerSettings(url=mosquitto.url)).connect()
    try:
        consumer.pause_reading()
        handles = [producer.publish("bp/in", PAYLOAD + i.to_bytes(4, "big")) for i in range(60)]
        assert all(h.wait(60) for h in handles)  # the broker took them all
        # Paused, the consumer still publishes: the window does not wait for unread PUBACKs.
        own = [consumer.publish("bp/out", b"reply", timeout=1) for _ in range(consumer.window + 5)]
        time.sleep(0.5)
        assert got == []
        assert not any(h.done for h in own)  # their PUBACKs sit unread in the socket
        consumer.resume_reading()
        assert _wait(lambda: len(got) == 60)
        assert sorted(int.from_bytes(m.payload[-4:], "big") for m in got) == list(range(60))
        assert all(h.wait(60) for h in own)
    finally:
        producer.close()
        consumer.close()
        network.close()


def test_pause_before_connect_is_a_clear_error_and_changes_nothing(mosquitto) -> None:
    network = NetworkLoop("bp-early")
    t = MqttTransport("early", BrokerSettings(url=mosquitto.url), network=network)
    try:
        with pytest.raises(TransportError, match="before the first connect"):
            t.pause_reading()
        assert not t.reading_paused
        got: list[Message] = []
        t.connect()
        t.subscribe("bp/early", got.append, qos=1)
        MqttTransport("early-producer", BrokerSettings(url=mosquitto.url)).connect().publish(
            "bp/early", b"hello").wait(60)
        assert _wait(lambda: len(got) == 1)
    finally:
        t.close()
        network.close()


def test_long_pause_keeps_the_connection_alive(mosquitto) -> None:
    """Paused for three keepalives: paho would drop a connection that received nothing for a
    keepalive after a PINGREQ; the loop's keepalive reads (one packet per half keepalive)
    prevent that, and take in only a trickle of the backlog."""
    network = NetworkLoop("bp-keepalive")
    consumer, got = _consumer(mosquitto.url, network, keepalive_s=2)
    drops: list[str] = []
    consumer.on_disconnect_hooks.append(lambda t, reason: drops.append(reason))
    producer = MqttTransport("producer", BrokerSettings(url=mosquitto.url)).connect()
    try:
        consumer.pause_reading()
        for i in range(40):
            producer.publish("bp/in", PAYLOAD + i.to_bytes(4, "big")).wait(60)
        time.sleep(6.0)
        assert drops == [] and consumer.connected
        assert network.keepalive_reads >= 3
        assert len(got) <= network.keepalive_reads < 40  # one packet per keepalive read
        consumer.resume_reading()
        assert _wait(lambda: len(got) == 40)
        assert drops == []
    finally:
        producer.close()
        consumer.close()
        network.close()


@pytest.mark.slow
def test_aggregator_inbox_stays_bounded_and_nothing_is_lost(mosquitto, pretrained, tmp_path) -> None:  # noqa: F811
    """A slow engine and a burst of uploads: the inbox never holds more than its limit (a pause
    takes effect at the next packet, even inside one socket read), and every upload is
    answered and applied once."""
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    limit, inflight = 4, 4
    cfg = make_cfg(mosquitto.url, state, **{
        "aggregator.inbox_max_messages": limit, "aggregator.max_batch": 1, "cdfl.personalization": "mixture",
        "broker.max_inflight": inflight})
    engine = build_engine(cfg)
    handle = engine.handle

    def slow_handle(inbound):  # an engine slower than the fleet: the situation back-pressure is for
        time.sleep(0.05)
        return handle(inbound)

    engine.handle = slow_handle  # type: ignore[method-assign]
    agents = [RawAgent(mosquitto.port, FLEET, f"car-{i}") for i in range(16)]
    with AggregatorService(cfg, engine) as svc:
        try:
            for a in agents:
                a.join(SPEC.hash)
            rng = np.random.default_rng(0)
            sent: list[tuple[RawAgent, str]] = []

            def burst(a: RawAgent) -> None:  # one upload each, all at once
                up = a.update_envelope(a.base + rng.normal(0, 0.01, SPEC.numel).astype(np.float32),
                                       SPEC.hash)
                a.send(up)
                sent.append((a, up.msg_id))

            threads = [threading.Thread(target=burst, args=(a,)) for a in agents]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            replies = [a.expect(msg_id, timeout=120) for a, msg_id in sent]
        finally:
            for a in agents:
                a.close()
        assert len(replies) == 16 and all(r.TYPE == "model" for r in replies), replies
        assert engine.counters["applied.update"] == 16  # each applied once, none lost
        assert svc.counters["backpressure.paused"] >= 1
        assert svc.inbox_peak[0] <= limit, svc.inbox_peak
        assert not svc.transport.reading_paused  # drained: reading again
