"""The production broker config keeps agents apart: a real Mosquitto with
broker_config/prod.conf, files from `fedmq creds`, raw paho-mqtt 2.x clients over TLS.

Mosquitto grants a denied SUBSCRIBE in the SUBACK and PUBACKs a denied PUBLISH, so every ACL
check here looks at what arrives: the legitimate message must arrive (the probe works) and
the forbidden one must not (we then wait a further second for stragglers).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from fedmq import cli, protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.creds import (
    Credentials,
    CredentialsError,
    load_credentials,
    make_ca,
    make_credentials,
    mosquitto_hash,
    rotate_password,
    verify_mosquitto_hash,
)
from fedmq.service_logins import derived_password

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
PROD_CONF = REPO_BROKER_CONFIG / "prod.conf"
FLEET = "f1"
GRACE_S = 1.0  # how long a forbidden message gets to show up after the probes arrived


def topic(agent: str, kind: str) -> str:
    return f"fedmq/{FLEET}/agents/{agent}/{kind}"


AGG_STATUS = f"fedmq/{FLEET}/aggregator/status"


class Peer:
    """A paho client that records what it receives; connect() returns the CONNACK code."""

    def __init__(self, client_id: str, ca: Path | None, username: str | None, password: str | None):
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        if ca is not None:
            self.client.tls_set(ca_certs=str(ca))
        if username is not None:
            self.client.username_pw_set(username, password)
        self.messages: list[tuple[str, bytes]] = []
        self._cond = threading.Condition()
        self._connack = threading.Event()
        self.reason_code: mqtt.ReasonCode | None = None
        self.disconnected = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = lambda *a: self.disconnected.set()

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        self.reason_code = reason_code
        self._connack.set()

    def _on_message(self, client, userdata, msg):
        with self._cond:
            self.messages.append((msg.topic, msg.payload))
            self._cond.notify_all()

    def connect(self, port: int, timeout: float = 10) -> mqtt.ReasonCode:
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        assert self._connack.wait(timeout), "no CONNACK"
        assert self.reason_code is not None
        return self.reason_code

    def subscribe(self, *filters: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe([(f, 1) for f in filters])
        assert done.wait(60), "no SUBACK"

    def publish(self, topic_: str, payload: bytes, retain: bool = False) -> None:
        info = self.client.publish(topic_, payload, qos=1, retain=retain)
        info.wait_for_publish(10)  # a denied publish is PUBACKed too

    def wait_for(self, expected: tuple[str, bytes], timeout: float = 10) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: expected in self.messages, timeout)
        assert ok, f"{expected} never arrived; got {self.messages}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    return make_credentials(
        tmp_path_factory.mktemp("creds"), ["a1", "a2"], monitor_user="monitor"
    )


@pytest.fixture(scope="module")
def prod_broker(creds, tmp_path_factory) -> Iterator[MosquittoBroker]:
    if find_mosquitto() is None:
        pytest.skip("mosquitto not installed")
    with MosquittoBroker.from_file(
        PROD_CONF, path_map=creds.path_map(), workdir=tmp_path_factory.mktemp("prod-broker")
    ) as broker:
        yield broker


@pytest.fixture
def peers(creds, prod_broker) -> Iterator:
    """peers(user) -> a connected Peer with that user's generated password."""
    made: list[Peer] = []

    def connect(user: str, client_id: str | None = None) -> Peer:
        p = Peer(client_id or f"{user}-{len(made)}", creds.ca_cert, user, creds.users()[user])
        made.append(p)
        rc = p.connect(prod_broker.port)
        assert not rc.is_failure, f"{user} refused: {rc}\n{prod_broker.log_tail()}"
        return p

    yield connect
    for p in made:
        p.close()


# --------------------------------------------------------------------------- authentication


@needs_mosquitto
def test_anonymous_client_is_refused(creds, prod_broker):
    p = Peer("anon", creds.ca_cert, None, None)
    try:
        rc = p.connect(prod_broker.port)
    finally:
        p.close()
    assert rc.is_failure
    assert str(rc) == "Not authorized"  # MQTT 3.1.1 CONNACK 5, as paho names it


@needs_mosquitto
def test_wrong_password_is_refused_and_right_one_accepted(creds, prod_broker):
    bad = Peer("a1-bad", creds.ca_cert, "a1", creds.agents["a1"] + "x")
    other = Peer("a1-other", creds.ca_cert, "a1", creds.agents["a2"])  # a2's password
    good = Peer("a1-good", creds.ca_cert, "a1", creds.agents["a1"])
    try:
        assert bad.connect(prod_broker.port).is_failure
        assert other.connect(prod_broker.port).is_failure
        assert not good.connect(prod_broker.port).is_failure
    finally:
        for p in (bad, other, good):
            p.close()


@needs_mosquitto
def test_client_trusting_another_ca_is_refused(creds, prod_broker, tmp_path):
    _, foreign_ca = make_ca("somebody else's CA")
    foreign = tmp_path / "foreign-ca.crt"
    from cryptography.hazmat.primitives import serialization

    foreign.write_bytes(foreign_ca.public_bytes(serialization.Encoding.PEM))
    p = Peer("a1-foreign", foreign, "a1", creds.agents["a1"])
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
            p.client.connect("127.0.0.1", prod_broker.port)
    finally:
        p.close()


@needs_mosquitto
def test_plain_tcp_to_the_tls_port_gets_no_connack(prod_broker):
    # A well-formed MQTT 3.1.1 CONNECT (clean session, client id "plain") without TLS.
    var_header = b"\x00\x04MQTT\x04\x02\x00\x3c"
    payload = b"\x00\x05plain"
    packet = b"\x10" + bytes([len(var_header) + len(payload)]) + var_header + payload
    with socket.create_connection(("127.0.0.1", prod_broker.port), timeout=5) as s:
        s.sendall(packet)
        try:
            reply = s.recv(64)
        except ConnectionResetError:
            reply = b""
    assert not reply.startswith(b"\x20"), f"broker answered plain MQTT with a CONNACK: {reply!r}"
    assert reply == b"" or reply[:1] == b"\x15", f"expected a closed socket or a TLS alert, got {reply!r}"


# --------------------------------------------------------------------------- ACL


@needs_mosquitto
def test_agent_cannot_receive_another_agents_downlink(peers):
    a1, a2, agg = peers("a1"), peers("a2"), peers("aggregator")
    # a1 asks for a2's downlink outright and for every downlink by wildcard.
    a1.subscribe(topic("a2", "down"), "fedmq/+/agents/+/down")
    a2.subscribe(topic("a2", "down"))
    agg.publish(topic("a2", "down"), b"for-a2")
    agg.publish(topic("a1", "down"), b"for-a1")
    a2.wait_for((topic("a2", "down"), b"for-a2"))
    a1.wait_for((topic("a1", "down"), b"for-a1"))  # a1's own downlink does arrive
    time.sleep(GRACE_S)
    assert a1.messages == [(topic("a1", "down"), b"for-a1")]


@needs_mosquitto
def test_agent_cannot_publish_into_another_agents_uplink(peers):
    a1, agg = peers("a1"), peers("aggregator")
    agg.subscribe("fedmq/+/agents/+/up")
    a1.publish(topic("a2", "up"), b"spoofed-as-a2")
    a1.publish(topic("a1", "up"), b"own-update")
    agg.wait_for((topic("a1", "up"), b"own-update"))
    time.sleep(GRACE_S)
    assert agg.messages == [(topic("a1", "up"), b"own-update")]


@needs_mosquitto
def test_agent_cannot_publish_aggregator_status_or_any_downlink(peers):
    a1, a2, mon, agg = peers("a1"), peers("a2"), peers("monitor"), peers("aggregator")
    a1.subscribe(topic("a1", "down"))
    a2.subscribe(topic("a2", "down"))
    mon.subscribe(AGG_STATUS)
    for t in (AGG_STATUS, topic("a1", "down"), topic("a2", "down")):
        a1.publish(t, b"forged-by-a1")
    # Probes from the aggregator show each subscriber is listening.
    agg.publish(topic("a1", "down"), b"probe")
    agg.publish(topic("a2", "down"), b"probe")
    agg.publish(AGG_STATUS, b"probe")
    a1.wait_for((topic("a1", "down"), b"probe"))
    a2.wait_for((topic("a2", "down"), b"probe"))
    mon.wait_for((AGG_STATUS, b"probe"))
    time.sleep(GRACE_S)
    for p in (a1, a2, mon):
        assert all(payload != b"forged-by-a1" for _, payload in p.messages), p.messages


@needs_mosquitto
@pytest.mark.parametrize("victim", ["a1", "aggregator"])
def test_client_id_of_another_user_does_not_take_over_its_session(creds, prod_broker, peers, victim):
    """a2, with its own valid password, connects under the client id the victim uses (the
    agent's `fedmq-agent-f1-a1`, the aggregator's `fedmq-aggregator-f1`): prod.conf makes the
    client id the username, so the victim stays connected and its session keeps working."""
    client_id = protocol.agent_client_id(FLEET, "a1") if victim == "a1" else f"fedmq-aggregator-{FLEET}"
    target = Peer(client_id, creds.ca_cert, victim, creds.users()[victim])
    attacker = Peer(client_id, creds.ca_cert, "a2", creds.agents["a2"])
    watcher = peers("monitor")
    try:
        assert not target.connect(prod_broker.port).is_failure
        assert not attacker.connect(prod_broker.port).is_failure  # accepted, as itself
        # The broker drops a taken-over session before it answers the newcomer's CONNECT; a
        # QoS 1 round trip after that CONNACK shows the victim's connection is still there.
        status = topic(victim, "status") if victim == "a1" else AGG_STATUS
        watcher.subscribe(status)
        target.publish(status, b"still-here")
        watcher.wait_for((status, b"still-here"))
        assert not target.disconnected.is_set(), prod_broker.log_tail()
    finally:
        attacker.close()
        target.close()


@needs_mosquitto
def test_monitor_reads_status_topics_only(peers):
    mon, a1, agg = peers("monitor"), peers("a1"), peers("aggregator")
    mon.subscribe("fedmq/#")
    a1.publish(topic("a1", "up"), b"update")
    agg.publish(topic("a1", "down"), b"model")
    a1.publish(topic("a1", "status"), b"online")
    agg.publish(AGG_STATUS, b"online")
    mon.wait_for((topic("a1", "status"), b"online"))
    mon.wait_for((AGG_STATUS, b"online"))
    time.sleep(GRACE_S)
    assert {t for t, _ in mon.messages} == {topic("a1", "status"), AGG_STATUS}


@needs_mosquitto
def test_monitor_cannot_publish(peers):
    mon, a1 = peers("monitor"), peers("a1")
    a1.subscribe(topic("a1", "down"), AGG_STATUS)
    mon.publish(topic("a1", "down"), b"from-monitor")
    mon.publish(AGG_STATUS, b"from-monitor")
    peers("aggregator").publish(topic("a1", "down"), b"probe")
    a1.wait_for((topic("a1", "down"), b"probe"))
    time.sleep(GRACE_S)
    assert all(p != b"from-monitor" for _, p in a1.messages)


# --------------------------------------------------------------------------- rotation


def _try_connect(port: int, ca: Path, user: str, password: str, cid: str) -> mqtt.ReasonCode:
    p = Peer(cid, ca, user, password)
    try:
        return p.connect(port)
    finally:
        p.close()


@needs_mosquitto
def test_rotated_password_replaces_the_old_after_sighup(tmp_path):
    creds = make_credentials(tmp_path / "creds", ["a1", "a2"])
    old = creds.agents["a1"]
    with MosquittoBroker.from_file(PROD_CONF, path_map=creds.path_map(), workdir=tmp_path / "b") as broker:
        # Sessions made before the rotation, with a1's old password and a2's (unchanged) one.
        a1_early = Peer("a1-early", creds.ca_cert, "a1", old)
        a2_early = Peer("a2-early", creds.ca_cert, "a2", creds.agents["a2"])
        a1_pre = Peer("a1-pre", creds.ca_cert, "a1", old)
        try:
            assert not a1_early.connect(broker.port).is_failure
            assert not a2_early.connect(broker.port).is_failure
            new = rotate_password(creds.out_dir, "a1")
            assert new != old
            assert load_credentials(creds.out_dir).agents["a1"] == new
            # Until the broker re-reads passwd it still knows only the old password. The client
            # id is the username (prod.conf), so this login replaces a1_early's: one session per user.
            assert not a1_pre.connect(broker.port).is_failure
            assert a1_early.disconnected.wait(60), broker.log_tail()

            assert broker.proc is not None
            os.kill(broker.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 10
            while _try_connect(broker.port, creds.ca_cert, "a1", new, "a1-new").is_failure:
                assert time.monotonic() < deadline, f"new password never accepted\n{broker.log_tail()}"
                time.sleep(0.1)
            assert "Reloading config" in broker.log_path.read_text()
            rc = _try_connect(broker.port, creds.ca_cert, "a1", old, "a1-old")
            assert rc.is_failure and str(rc) == "Not authorized"
            # The session holding the old password is gone (Mosquitto 2.0.11 re-checks connected
            # clients on reload, and a1's new login replaces it anyway); the other agent's stays.
            assert a1_pre.disconnected.wait(60), broker.log_tail()
            assert not a2_early.disconnected.is_set() and a2_early.client.is_connected()
        finally:
            a1_early.close()
            a1_pre.close()
            a2_early.close()


# --------------------------------------------------------------------------- files


def test_hash_matches_mosquitto_passwd(tmp_path):
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("mosquitto_passwd not installed")
    path = tmp_path / "pw"
    subprocess.run([tool, "-c", "-b", str(path), "alice", "s3cret"], check=True)
    line = path.read_text().strip()
    user, hashed = line.split(":", 1)
    assert user == "alice" and hashed.startswith("$7$101$")
    assert verify_mosquitto_hash("s3cret", hashed)
    assert not verify_mosquitto_hash("s3cret!", hashed)
    # The same salt and count give mosquitto_passwd's exact line.
    import base64

    salt = base64.b64decode(hashed.split("$")[3])
    assert mosquitto_hash("s3cret", salt=salt) == hashed


@needs_mosquitto
def test_fleet_scoped_acl_keeps_an_agent_to_its_own_fleet(tmp_path):
    """`fedmq creds --fleet f1`: every rule names f1, so an agent cannot store retained
    messages under other fleet ids (5 x 90 MiB under invented fleets). An
    observer that may read everything (added to the ACL for this test only) sees what the
    broker kept: the message in f1, not the one in f2."""
    creds = make_credentials(tmp_path / "creds", ["a1"], monitor_user="observer", fleets=["f1"])
    acl = creds.acl.read_text()
    assert "fedmq/+/" not in acl and "topic write fedmq/f1/agents/a1/status" in acl
    assert load_credentials(creds.out_dir).fleets == ["f1"]
    creds.acl.write_text(acl + "topic read fedmq/#\n")  # the observer's extra right, this test only
    with MosquittoBroker.from_file(PROD_CONF, path_map=creds.path_map(), workdir=tmp_path / "b") as broker:
        a1 = Peer("a1", creds.ca_cert, "a1", creds.agents["a1"])
        observer = Peer("observer", creds.ca_cert, "observer", creds.users()["observer"])
        try:
            assert not a1.connect(broker.port).is_failure
            a1.publish("fedmq/f2/agents/a1/status", b"elsewhere", retain=True)
            a1.publish("fedmq/f1/agents/a1/status", b"home", retain=True)  # the probe, sent after
            assert not observer.connect(broker.port).is_failure
            observer.subscribe("fedmq/#")  # retained messages come with the SUBACK
            observer.wait_for(("fedmq/f1/agents/a1/status", b"home"))
            time.sleep(GRACE_S)
            assert ("fedmq/f2/agents/a1/status", b"elsewhere") not in observer.messages
        finally:
            a1.close()
            observer.close()


def test_files_modes_and_layout(creds):
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(creds.ca_key) == 0o600
    assert mode(creds.credentials_json) == 0o600
    assert mode(creds.private_dir) == 0o700
    assert mode(creds.passwd) & 0o007 == 0  # never world-readable
    assert mode(creds.server_key) & 0o007 == 0
    assert mode(creds.acl) == 0o644 and mode(creds.ca_cert) == 0o644
    # Nothing the broker must not hold is in the directory it mounts.
    mounted = {p.name for p in creds.config_dir.rglob("*")}
    assert "ca.key" not in mounted and "credentials.json" not in mounted
    users = dict(line.split(":", 1) for line in creds.passwd.read_text().splitlines())
    assert set(users) == {"a1", "a2", "aggregator", "aggregator-probe", "monitor"}
    for user, hashed in users.items():
        assert verify_mosquitto_hash(creds.users()[user], hashed)
    acl = creds.acl.read_text()
    assert "topic write fedmq/+/agents/a1/up" in acl and "user aggregator" in acl and "\npattern " not in acl


def test_rerun_keeps_ca_and_passwords_force_replaces(tmp_path):
    first = make_credentials(tmp_path, ["a1", "a2"])
    ca_pem = first.ca_cert.read_bytes()
    server_pem = first.server_cert.read_bytes()
    again = make_credentials(tmp_path, ["a1", "a3"])
    assert not again.ca_created and again.ca_cert.read_bytes() == ca_pem
    assert not again.server_cert_created and again.server_cert.read_bytes() == server_pem
    assert again.agents["a1"] == first.agents["a1"]
    assert again.aggregator_password == first.aggregator_password
    assert again.revoked == ["a2"]
    assert "a2:" not in again.passwd.read_text()
    renamed = make_credentials(tmp_path, ["a1"], hostnames=["broker.example.org"])
    assert renamed.server_cert_created and renamed.ca_cert.read_bytes() == ca_pem
    forced = make_credentials(tmp_path, ["a1"], force=True)
    assert forced.ca_created and forced.ca_cert.read_bytes() != ca_pem
    assert forced.agents["a1"] != first.agents["a1"]


@pytest.mark.parametrize("bad", ["a/b/c", "/b", "a+", "#", "%u", "a:b", "with space", "", "-x"])
def test_bad_agent_names_are_refused(tmp_path, bad):
    with pytest.raises(CredentialsError):
        make_credentials(tmp_path, ["ok", bad] if bad else [bad])


def test_agent_may_not_take_a_service_name(tmp_path):
    with pytest.raises(CredentialsError, match="taken"):
        make_credentials(tmp_path, ["a1", "aggregator"])


def test_cli_creates_and_rotates(tmp_path, capsys):
    agents_file = tmp_path / "agents.txt"
    agents_file.write_text("# fleet\nc3\n\nc4  # phone\n")
    out = tmp_path / "out"
    assert cli.main(["creds", "--out", str(out), "--agents", "c1,c2", "--agents-file",
                     str(agents_file), "--hostname", "mqtt.local,10.0.0.5"]) == 0
    made = load_credentials(out)
    assert sorted(made.agents) == ["c1", "c2", "c3", "c4"]
    assert made.hostnames[:2] == ["mqtt.local", "10.0.0.5"] and "127.0.0.1" in made.hostnames
    assert cli.main(["creds", "--out", str(out), "--rotate", "c2"]) == 0
    after = load_credentials(out)
    assert after.agents["c2"] != made.agents["c2"] and after.agents["c1"] == made.agents["c1"]
    assert cli.main(["creds", "--out", str(out), "--rotate", "nobody"]) == 2
    assert "unknown user" in capsys.readouterr().err


def test_cli_makes_reply_worker_users_and_keeps_them_on_a_rerun(tmp_path, capsys):
    """`--workers N` and `--worker NAME` (docs/scaling.md): the pool's and local workers' logins
    derive from the aggregator's password, a remote worker gets its own; the ACL names each."""
    out = tmp_path / "out"
    assert cli.main(["creds", "--out", str(out), "--agents", "c1", "--fleet", "f1",
                     "--workers", "2", "--worker", "gpu-1,gpu-2"]) == 0
    assert "reply workers gpu-1, gpu-2, aggregator-worker-0, aggregator-worker-1;" in capsys.readouterr().out
    made = load_credentials(out)
    users = made.users()
    assert users["aggregator-replies"] == derived_password(made.aggregator_password, "aggregator-replies")
    assert users["aggregator-worker-1"] != users["aggregator-worker-0"] != made.aggregator_password
    passwd = dict(line.split(":", 1) for line in made.passwd.read_text().splitlines())
    for user in ("aggregator-replies", "aggregator-worker-0", "gpu-2"):
        assert verify_mosquitto_hash(users[user], passwd[user]), user
    acl = made.acl.read_text()
    assert "user gpu-1\ntopic read fedmq/f1/workers/gpu-1/jobs\n" in acl
    assert "user aggregator-replies\ntopic write fedmq/f1/workers/+/jobs\n" in acl
    assert "pattern" not in acl.split("# Reply workers")[1]  # never by pattern: agents are not workers
    # A re-run without the flags keeps them; rotating the aggregator rotates what derives from it.
    assert cli.main(["creds", "--out", str(out), "--hostname", "mqtt.local"]) == 0
    assert load_credentials(out).users() == users
    assert cli.main(["creds", "--out", str(out), "--rotate", "aggregator"]) == 0
    rotated = load_credentials(out).users()
    assert rotated["aggregator-replies"] != users["aggregator-replies"] and rotated["gpu-1"] == users["gpu-1"]
    assert cli.main(["creds", "--out", str(out), "--rotate", "aggregator-worker-0"]) == 2
    assert "derived from aggregator's" in capsys.readouterr().err
    assert cli.main(["creds", "--out", str(out), "--worker", "c1"]) == 2
    assert cli.main(["creds", "--out", str(out), "--agents", "aggregator-replies"]) == 2
    assert cli.main(["creds", "--out", str(out), "--workers", "-1"]) == 2
    assert load_credentials(out).users() == rotated  # refused runs changed nothing


# --------------------------------------------------------------------------- as user mosquitto


@needs_mosquitto
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start mosquitto that drops privileges")
def test_generated_modes_let_mosquitto_run_as_its_own_user():
    """Started as root, Mosquitto drops to user `mosquitto` before reading passwd and the key:
    the modes and group `fedmq creds` chose must be enough (measured: with a root-only
    passwd it exits with code 13, with a root-only key with code 1)."""
    try:
        pwd.getpwnam("mosquitto")
    except KeyError:
        pytest.skip("no mosquitto user on this machine")
    root = Path(tempfile.mkdtemp(prefix="fedmq-asuser-"))  # outside pytest's 0700 tmp
    try:
        root.chmod(0o755)
        creds = make_credentials(root / "creds", ["a1"])
        (root / "creds").chmod(0o755)
        workdir = root / "broker"
        workdir.mkdir()
        workdir.chmod(0o777)  # persistence and log, written as mosquitto
        broker = MosquittoBroker.from_file(PROD_CONF, path_map=creds.path_map(), workdir=workdir)
        text = broker.config_path.read_text()
        assert "user root" in text
        broker.config_path.write_text(text.replace("user root", "user mosquitto"))
        with broker:
            owner = pwd.getpwuid(broker.log_path.stat().st_uid).pw_name
            assert owner == "mosquitto"
            assert not _try_connect(broker.port, creds.ca_cert, "a1", creds.agents["a1"], "a1").is_failure
            new = rotate_password(creds.out_dir, "a1")
            assert broker.proc is not None
            os.kill(broker.proc.pid, signal.SIGHUP)  # re-read as user mosquitto
            deadline = time.monotonic() + 10
            while _try_connect(broker.port, creds.ca_cert, "a1", new, "a1-new").is_failure:
                assert time.monotonic() < deadline, broker.log_tail()
                time.sleep(0.1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
