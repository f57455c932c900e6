"""The embedded (amqtt) broker carries QoS 1 traffic between real paho MQTT 3.1.1 clients,
`fedmq broker` runs Mosquitto or it in the foreground until interrupted, and a Mosquitto that
could not bind its port is reported, never taken for the listener that holds it."""

from __future__ import annotations

import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from fedmq.broker import BrokerError, MosquittoBroker, find_mosquitto, free_port
from fedmq.embedded_broker import EmbeddedBroker
from tests.cli_process import BIN


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
    assert connected.wait(60), "no CONNACK from the embedded broker"
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
            assert subscribed.wait(60)
            assert [int(rc.value) for rc in granted] == [1], f"SUBACK granted {granted}"
            _connect(pub, broker)
            infos = [pub.publish(topic, p, qos=1) for p in payloads]
            for info in infos:
                info.wait_for_publish(10)
                assert info.is_published()
            assert all_in.wait(60), f"got {len(received)} of {len(payloads)} messages"
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


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_a_mosquitto_whose_port_another_process_listens_on_does_not_count_as_started(tmp_path):
    # Between free_port() and the broker's bind another process may take the port. A connect
    # then reaches that process: only the broker's own word says that it bound its listeners.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        broker = MosquittoBroker("allow_anonymous true\n", ports=[taken.getsockname()[1]], workdir=tmp_path)
        try:
            with pytest.raises(BrokerError, match="exited"):
                broker.start(timeout=60)
            assert "Address already in use" in broker.log_tail()
            assert broker.proc is None
        finally:
            broker.stop()  # a start that wrongly returned would leave a broker behind


def test_two_brokers_get_their_own_ports():
    with EmbeddedBroker() as a, EmbeddedBroker() as b:
        assert a.port != b.port


def test_non_loopback_bind_is_refused():
    with pytest.raises(BrokerError, match="loopback"):
        EmbeddedBroker(host="0.0.0.0")


# --------------------------------------------------------------------------- `fedmq broker`

REPO = Path(__file__).resolve().parent.parent


def _start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedmq.cli", "broker", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _read_url(proc: subprocess.Popen, timeout: float = 30) -> tuple[str, int]:
    """The `url: mqtt://host:port` line `fedmq broker` prints once it listens."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("url: "):
                host, port = line.split("://", 1)[1].strip().rsplit(":", 1)
                return host, int(port)
    proc.kill()
    raise AssertionError(f"no url line; stderr: {proc.stderr.read() if proc.stderr else ''}")


def _roundtrip(host: str, port: int) -> bytes:
    got: list[bytes] = []
    arrived = threading.Event()
    c = _client("cli-check")

    def on_message(client, userdata, msg):
        got.append(msg.payload)
        arrived.set()

    subscribed = threading.Event()
    c.on_message = on_message
    c.on_subscribe = lambda *a: subscribed.set()
    c.connect(host, port)
    c.loop_start()
    try:
        c.subscribe("fedmq/cli/agents/x/down", qos=1)
        assert subscribed.wait(60), "no SUBACK"
        c.publish("fedmq/cli/agents/x/down", b"ping", qos=1).wait_for_publish(10)
        assert arrived.wait(60), "message did not come back through the broker"
    finally:
        c.disconnect()
        c.loop_stop()
    return got[0]


def test_cli_embedded_broker_serves_until_interrupted():
    proc = _start_cli("--embedded", "--port", "0")
    try:
        host, port = _read_url(proc)
        assert _roundtrip(host, port) == b"ping"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0  # a requested stop is a clean stop
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(OSError), socket.create_connection((host, port), timeout=2):
        pass


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_cli_runs_mosquitto_and_stops_it_on_sigterm():
    # Not in pytest's 0700 tmp dir: under root, Mosquitto runs as user mosquitto and writes here.
    root = Path(tempfile.mkdtemp(prefix="fedmq-cli-"))
    root.chmod(0o755)
    proc = _start_cli("--port", "0", "--workdir", str(root / "b"))
    try:
        host, port = _read_url(proc)
        assert _roundtrip(host, port) == b"ping"
        assert "mosquitto version" in (root / "b" / "mosquitto.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    # mosquitto runs in its own session: it must have been stopped by pid, not left behind.
    with pytest.raises(OSError), socket.create_connection((host, port), timeout=2):
        pass


def test_cli_dry_run_prints_rendered_config_and_starts_nothing():
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "fedmq.cli", "broker", "--dry-run", "--port", str(port)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"url: mqtt://127.0.0.1:{port}" in out.stdout
    if find_mosquitto() is not None:
        assert f"listener {port} 127.0.0.1" in out.stdout
        assert "allow_anonymous true" in out.stdout and "set_tcp_nodelay true" in out.stdout
    else:
        assert "embedded" in out.stdout
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_cli_refuses_embedded_for_a_config_that_needs_auth():
    out = subprocess.run(
        [sys.executable, "-m", "fedmq.cli", "broker", "--embedded", "--config",
         "broker_config/prod.conf"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "embedded broker cannot provide" in out.stderr


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_fedmq_broker_on_a_port_in_use_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([str(BIN / "fedmq"), "broker", "--port", str(port)], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
    said = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    assert done.returncode == 1 and len(said) == 1, said
    assert f"port {port} is already in use" in said[0] and "--port 0" in said[0], said
