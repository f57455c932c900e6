"""The Mosquitto launcher: real broker on a free port, restart keeps persistence."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt

from fedmq.broker import MosquittoBroker, rewrite_config


def _roundtrip(port: int, topic: str) -> bytes:
    got: list[bytes] = []
    done = threading.Event()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)

    def on_message(client, userdata, msg):
        got.append(msg.payload)
        done.set()

    c.on_message = on_message
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        c.subscribe(topic, qos=1)
        time.sleep(0.2)
        c.publish(topic, b"hello", qos=1).wait_for_publish(5)
        assert done.wait(60), "no message came back through the broker"
    finally:
        c.loop_stop()
        c.disconnect()
    return got[0]


def test_dev_broker_routes_messages(mosquitto: MosquittoBroker) -> None:
    assert _roundtrip(mosquitto.port, "fedmq/t/agents/a/up") == b"hello"


def test_rewrite_moves_listeners_and_maps_paths(tmp_path) -> None:
    text = "listener 8883\ncafile /mosquitto/config/ca.crt\npid_file /run/x.pid\nlistener 1883 0.0.0.0\n"
    out = rewrite_config(text, [1111, 2222], tmp_path, {"/mosquitto/config/": "/tmp/c/"})
    assert "listener 1111 127.0.0.1" in out
    assert "listener 2222 127.0.0.1" in out
    assert "cafile /tmp/c/ca.crt" in out
    assert "pid_file" not in out
    assert f"persistence_location {tmp_path}/" in out


def test_restart_same_port(mosquitto: MosquittoBroker) -> None:
    port = mosquitto.port
    mosquitto.restart()
    assert mosquitto.port == port
    assert _roundtrip(port, "fedmq/t/x") == b"hello"
