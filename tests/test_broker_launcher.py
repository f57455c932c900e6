"""The Mosquitto launcher: real broker on a free port, restart keeps persistence."""

from __future__ import annotations

import os
import re
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from fedmq.broker import BrokerError, MosquittoBroker, rewrite_config


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
        c.disconnect()
        c.loop_stop()
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


def test_rewrite_pins_every_listener_to_its_address_family(tmp_path) -> None:
    """Mosquitto 2.0.11 binds a WebSockets listener's IPv4 address only when the listener is
    IPv4-only; the config's own placement (interface, family) gives way to the launcher's."""
    text = ("listener 8883\nprotocol mqtt\nsocket_domain ipv6\nbind_interface eth0\n"
            "listener 9883 10.0.0.5\nprotocol websockets\n")
    out = rewrite_config(text, [1111, 2222], tmp_path)
    assert re.findall(r"^(?:listener|socket_domain|bind_interface|protocol) .*$", out, re.M) == [
        "listener 1111 127.0.0.1", "socket_domain ipv4", "protocol mqtt",
        "listener 2222 127.0.0.1", "socket_domain ipv4", "protocol websockets"]
    v6 = rewrite_config("listener 9001\nprotocol websockets\n", [3333], tmp_path, bind="::1")
    assert "listener 3333 ::1\nsocket_domain ipv6\n" in v6


@pytest.mark.parametrize("line", ["port 1883", "bind_address 0.0.0.0"])
def test_rewrite_refuses_a_default_listener_it_cannot_place(tmp_path, line: str) -> None:
    with pytest.raises(BrokerError, match=f"`{line}` opens a listener the launcher cannot place"):
        rewrite_config(f"{line}\nlistener 9001\nprotocol websockets\n", [1111, 2222], tmp_path)


def test_rewrite_names_the_user_mosquitto_runs_as(tmp_path) -> None:
    text = "listener 1883\nuser someone\n"
    users = [re.findall(r"^user .*$", rewrite_config(text, [1111], tmp_path, user=u), re.M) for u in (None, "mosquitto")]
    if os.geteuid() == 0:
        assert users == [["user root"], ["user mosquitto"]]
    else:  # Mosquitto started by another user cannot switch: no `user` line at all
        assert users == [[], []]


def test_restart_same_port(mosquitto: MosquittoBroker) -> None:
    port = mosquitto.port
    mosquitto.restart()
    assert mosquitto.port == port
    assert _roundtrip(port, "fedmq/t/x") == b"hello"
