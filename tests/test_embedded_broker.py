"""The embedded (amqtt) broker carries QoS 1 traffic between real paho MQTT 3.1.1 clients."""

from __future__ import annotations

import socket
import threading

import paho.mqtt.client as mqtt
import pytest

from fedmq.broker import BrokerError
from fedmq.embedded_broker import EmbeddedBroker


def _client(client_id: str) -> mqtt.Client:
    return mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311
    )


def _connect(client: mqtt.Client, broker: EmbeddedBroker) -> None:
    connected = threading.Event()
    codes: list[object] = []

    def on_connect(c, userdata, flags, reason_code, properties):
        codes.append(reason_code)
        connected.set()

    client.on_connect = on_connect
    client.connect(broker.host, broker.port, keepalive=30)
    client.loop_start()
    assert connected.wait(10), "no CONNACK from the embedded broker"
    assert not codes[0].is_failure, f"embedded broker refused the connection: {codes[0]}"


def test_qos1_publish_subscribe_between_paho_clients():
    topic = "fedmq/demo/agents/a1/up"
    payloads = [f"update-{i}".encode() for i in range(20)]
    with EmbeddedBroker() as broker:
        assert broker.port > 0
        assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
        sub, pub = _client("aggregator"), _client("a1")
        received: list[mqtt.MQTTMessage] = []
        all_in = threading.Event()
        subscribed = threading.Event()
        granted: list[object] = []

        def on_message(c, userdata, msg):
            received.append(msg)
            if len(received) == len(payloads):
                all_in.set()

        def on_subscribe(c, userdata, mid, reason_codes, properties):
            granted.extend(reason_codes)
            subscribed.set()

        sub.on_message = on_message
        sub.on_subscribe = on_subscribe
        try:
            _connect(sub, broker)
            sub.subscribe("fedmq/+/agents/+/up", qos=1)
            assert subscribed.wait(10)
            assert [int(rc.value) for rc in granted] == [1], f"SUBACK granted {granted}"
            _connect(pub, broker)
            infos = [pub.publish(topic, p, qos=1) for p in payloads]
            for info in infos:
                info.wait_for_publish(10)
                assert info.is_published()
            assert all_in.wait(10), f"got {len(received)} of {len(payloads)} messages"
        finally:
            for c in (pub, sub):
                c.disconnect()
                c.loop_stop()
    assert [m.payload for m in received] == payloads
    assert {m.topic for m in received} == {topic}
    assert {m.qos for m in received} == {1}


def test_stop_closes_the_listener():
    broker = EmbeddedBroker().start()
    port = broker.port
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    broker.stop()
    assert not broker.running
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_two_brokers_get_their_own_ports():
    with EmbeddedBroker() as a, EmbeddedBroker() as b:
        assert a.port != b.port


def test_non_loopback_bind_is_refused():
    with pytest.raises(BrokerError, match="loopback"):
        EmbeddedBroker(host="0.0.0.0")
