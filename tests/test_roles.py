"""Each login does its role's work and no more: two fleets on a real Mosquitto with
broker_config/prod.conf and files from `fedmq creds`, on its TLS MQTT listener and on its
secure WebSocket listener, checked by what is delivered.

A denied PUBLISH is acknowledged with reason code 0x87 (Not authorized) to an MQTT 5 client
and routed nowhere. So every forbidden publish here is asserted twice: its PUBACK says 0x87,
and once the legitimate probes sent after it reached every reader that would have seen it
(Mosquitto routes in order on one thread, and delivers in order to each session), none of
those readers got it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from fedmq import cli
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.creds import (
    Credentials,
    CredentialsError,
    load_credentials,
    make_credentials,
    parse_agents,
)

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
FLEETS = ("garage", "depot")
AGENTS = ["garage/car-1", "garage/car-2", "depot/van-1"]
WAIT_S = 60.0
"""Generous: CI may share the machine."""
NOT_AUTHORIZED = 0x87


def t(fleet: str, *levels: str) -> str:
    return "/".join(("fedmq", fleet, *levels))


class Client:
    """An MQTT 5 paho client over TLS (MQTT or secure WebSockets) that keeps what it receives
    and the reason code of every PUBACK."""

    def __init__(self, creds: Credentials, user: str, broker: MosquittoBroker, transport: str) -> None:
        port = broker.port if transport == "tcp" else broker.ws_port
        assert port is not None
        self.user = user
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5,
                                  transport=transport)
        self.client.tls_set(ca_certs=str(creds.ca_cert))
        self.client.username_pw_set(user, creds.users()[user])
        self.received: list[tuple[str, bytes]] = []
        self.pubacks: dict[int, int] = {}
        self._cond = threading.Condition()
        connected = threading.Event()
        self.client.on_connect = lambda *a: connected.set()
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self._subacks: set[int] = set()
        self.client.connect("127.0.0.1", port, keepalive=60)
        self.client.loop_start()
        assert connected.wait(WAIT_S), f"{user}: no CONNACK"

    def _on_message(self, client, userdata, msg) -> None:
        with self._cond:
            self.received.append((msg.topic, msg.payload))
            self._cond.notify_all()

    def _on_publish(self, client, userdata, mid, reason, properties) -> None:
        with self._cond:
            self.pubacks[mid] = reason.value
            self._cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reasons, properties) -> None:
        with self._cond:
            self._subacks.add(mid)
            self._cond.notify_all()

    def subscribe(self, *filters: str) -> None:
        _, mid = self.client.subscribe([(f, mqtt.SubscribeOptions(qos=1)) for f in filters])
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self._subacks, WAIT_S), f"{self.user}: no SUBACK"

    def publish(self, topic: str, payload: bytes) -> int:
        """The PUBACK's reason code."""
        mid = self.client.publish(topic, payload, qos=1).mid
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self.pubacks, WAIT_S), f"{self.user}: no PUBACK on {topic}"
            return self.pubacks[mid]

    def wait_for(self, item: tuple[str, bytes]) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: item in self.received, WAIT_S), \
                f"{self.user} never got {item}; got {self.received}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    return make_credentials(tmp_path_factory.mktemp("creds"), AGENTS, fleets=list(FLEETS), monitor_user="ops")


@pytest.fixture(scope="module")
def broker(creds, tmp_path_factory) -> Iterator[MosquittoBroker]:
    if find_mosquitto() is None:
        pytest.skip("mosquitto not installed")
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path_factory.mktemp("prod-broker")) as b:
        yield b


@pytest.fixture(params=["tcp", "websockets"])
def login(request, creds, broker) -> Iterator:
    """login(user) -> a connected Client on the listener the test is parametrized with."""
    made: list[Client] = []

    def connect(user: str) -> Client:
        made.append(Client(creds, user, broker, request.param))
        return made[-1]

    yield connect
    for c in made:
        c.close()


# --------------------------------------------------------------------------- by delivery


@needs_mosquitto
def test_a_monitor_publishes_nothing_anywhere(login) -> None:
    """Not as an agent of its own name (the pattern ACL let it join both fleets as agent
    `ops`), not on any agent's topics, not on the aggregator's."""
    readers = {f: login(f"aggregator-{f}") for f in FLEETS}
    members = {"garage": login("car-1"), "depot": login("van-1")}
    for f in FLEETS:
        readers[f].subscribe(t(f, "agents", "+", "up"), t(f, "agents", "+", "status"))
        name = members[f].user
        members[f].subscribe(t(f, "agents", name, "down"), t(f, "aggregator", "status"), t(f, "model", "onnx"),
                             t(f, "model", "device"), t(f, "model", "device", "+"))
    ops = login("ops")
    for f in FLEETS:
        for topic in (t(f, "agents", "ops", "up"), t(f, "agents", "ops", "status"),
                      t(f, "agents", members[f].user, "up"), t(f, "agents", members[f].user, "status"),
                      t(f, "agents", members[f].user, "down"), t(f, "aggregator", "status"), t(f, "model", "onnx"),
                      t(f, "model", "device"), t(f, "model", "device", "0")):
            assert ops.publish(topic, b"from-monitor") == NOT_AUTHORIZED, topic
    for f in FLEETS:  # the probes: each reader's legitimate traffic, sent after
        name = members[f].user
        for topic in (t(f, "agents", name, "up"), t(f, "agents", name, "status")):
            assert members[f].publish(topic, b"probe") == 0
            readers[f].wait_for((topic, b"probe"))
        for topic in (t(f, "agents", name, "down"), t(f, "aggregator", "status"), t(f, "model", "onnx"),
                      t(f, "model", "device"), t(f, "model", "device", "0")):
            assert readers[f].publish(topic, b"probe") == 0
            members[f].wait_for((topic, b"probe"))
    for c in (*readers.values(), *members.values()):
        assert all(p != b"from-monitor" for _, p in c.received), (c.user, c.received)


@needs_mosquitto
def test_an_agent_of_one_fleet_works_there_and_nowhere_else(login) -> None:
    garage, depot = login("aggregator-garage"), login("aggregator-depot")
    garage.subscribe(t("garage", "agents", "+", "up"))
    depot.subscribe(t("depot", "agents", "+", "up"), t("depot", "agents", "+", "status"))
    car2 = login("car-2")
    car2.subscribe(t("garage", "agents", "car-2", "down"), t("depot", "agents", "car-2", "down"))
    assert car2.publish(t("depot", "agents", "car-2", "up"), b"into-depot") == NOT_AUTHORIZED
    assert car2.publish(t("depot", "agents", "car-2", "status"), b"into-depot") == NOT_AUTHORIZED
    # depot's aggregator answering car-2 there reaches no one either.
    assert depot.publish(t("depot", "agents", "car-2", "down"), b"depot-reply") == 0
    # In garage it works both ways; its reply is the probe for what depot sent it first.
    assert car2.publish(t("garage", "agents", "car-2", "up"), b"into-garage") == 0
    garage.wait_for((t("garage", "agents", "car-2", "up"), b"into-garage"))
    assert garage.publish(t("garage", "agents", "car-2", "down"), b"garage-reply") == 0
    car2.wait_for((t("garage", "agents", "car-2", "down"), b"garage-reply"))
    assert [p for _, p in car2.received] == [b"garage-reply"]
    van1 = login("van-1")  # depot's own member, the probe for depot's aggregator
    assert van1.publish(t("depot", "agents", "van-1", "up"), b"probe") == 0
    depot.wait_for((t("depot", "agents", "van-1", "up"), b"probe"))
    assert all(p != b"into-depot" for _, p in depot.received), depot.received


@needs_mosquitto
def test_an_aggregator_works_in_its_own_fleet_only(login) -> None:
    car1 = login("car-1")
    car1.subscribe(t("garage", "agents", "car-1", "down"), t("garage", "aggregator", "status"))
    depot = login("aggregator-depot")
    for topic in (t("garage", "agents", "car-1", "down"), t("garage", "aggregator", "status"),
                  t("garage", "agents", "car-1", "up")):
        assert depot.publish(topic, b"from-depot") == NOT_AUTHORIZED, topic
    garage = login("aggregator-garage")
    assert garage.publish(t("garage", "agents", "car-1", "down"), b"probe") == 0
    car1.wait_for((t("garage", "agents", "car-1", "down"), b"probe"))
    assert all(p != b"from-depot" for _, p in car1.received), car1.received


# --------------------------------------------------------------------------- fleet membership


def test_agents_name_their_fleets() -> None:
    assert parse_agents(["garage/car-1", "car-2", " depot/car-1 ", ""]) == (
        ["car-1", "car-2"], {"car-1": ["garage", "depot"]})
    with pytest.raises(CredentialsError, match="both bare"):
        parse_agents(["car-1", "garage/car-1"])
    with pytest.raises(CredentialsError, match="bad fleet id"):
        parse_agents(["ga+rage/car-1"])
    with pytest.raises(CredentialsError, match="bad username"):
        parse_agents(["garage/"])


def test_a_fleet_no_flag_grants_is_refused_and_nothing_is_written(tmp_path) -> None:
    with pytest.raises(CredentialsError, match="depot"):
        make_credentials(tmp_path / "c", ["garage/car-1", "depot/van-1"], fleets=["garage"])
    assert not (tmp_path / "c").exists()


def test_the_acl_has_a_block_per_login_and_no_pattern(creds) -> None:
    acl = creds.acl.read_text()
    assert "\npattern " not in acl and "%u" not in acl and "fedmq/+/" not in acl
    blocks: dict[str, list[str]] = {}
    for line in acl.splitlines():
        if line.startswith("user "):
            current = blocks.setdefault(line.split()[1], [])
        elif line.startswith("topic "):
            current.append(line)
    assert set(blocks) == set(creds.users())
    assert blocks["car-2"] == [
        "topic write fedmq/garage/agents/car-2/up", "topic write fedmq/garage/agents/car-2/status",
        "topic read fedmq/garage/agents/car-2/down", "topic read fedmq/garage/aggregator/status",
        "topic read fedmq/garage/model/onnx", "topic read fedmq/garage/model/device",
        "topic read fedmq/garage/model/device/+"]
    assert all(" read " in line for line in blocks["ops"])
    assert not any("depot" in line for line in blocks["aggregator-garage"] + blocks["aggregator-garage-probe"])


def test_cli_takes_fleet_agents_and_keeps_them_on_a_rerun(tmp_path, capsys) -> None:
    out = tmp_path / "creds"
    listed = tmp_path / "agents.txt"
    listed.write_text("# the depot's vans\ndepot/van-1\ndepot/van-2  # spare\n")
    assert cli.main(["creds", "--out", str(out), "--agents", "garage/car-1,bus-1", "--agents-file", str(listed),
                     "--fleet", "garage", "--fleet", "depot"]) == 0
    assert "4 agents (3 in named fleets only)" in capsys.readouterr().out
    first = load_credentials(out)
    assert first.fleets_of("car-1") == ["garage"] and first.fleets_of("van-2") == ["depot"]
    assert first.fleets_of("bus-1") == ["garage", "depot"]
    assert cli.main(["creds", "--out", str(out), "--hostname", "broker.example.org"]) == 0  # no agents: all kept
    again = load_credentials(out)
    assert again.agent_fleets == first.agent_fleets and again.agents == first.agents
    acl = again.acl.read_text()
    assert "topic write fedmq/garage/agents/car-1/up" in acl and "fedmq/depot/agents/car-1/" not in acl


def test_cli_refuses_a_stray_fleet_in_one_line(tmp_path, capsys) -> None:
    out: Path = tmp_path / "creds"
    assert cli.main(["creds", "--out", str(out), "--agents", "garage/car-1,depott/van-1", "--fleet", "garage",
                     "--fleet", "depot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "depott" in err and "--fleet" in err, err
    assert not out.exists()


# --------------------------------------------------------------------------- the aggregator's logins


@needs_mosquitto
@pytest.mark.parametrize("case", ["wrong password", "no broker"])
def test_an_aggregator_that_cannot_log_in_says_why_in_one_line(case, creds, broker, tmp_path) -> None:
    """Its probe connects first; a refusal there must not send the user to `fedmq creds` when the
    password is wrong or no broker listens: the one line is the aggregator's own connect's."""
    import subprocess

    from tests.cli_process import BIN, cli_env

    url = (f"mqtts://aggregator-garage:wrong@127.0.0.1:{broker.port}" if case == "wrong password"
           else "mqtt://127.0.0.1:1")
    done = subprocess.run([str(BIN / "fedmq"), "aggregator", "--broker", url, "--ca-file", str(creds.ca_cert),
                           "--fleet", "garage", "--state-dir", str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=300, env=cli_env(), cwd=tmp_path)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    assert done.returncode == 1 and len(lines) == 1, lines
    assert "fedmq creds` again" not in lines[0] and "wrong" not in lines[0], lines
    assert ("refused user 'aggregator-garage'" if case == "wrong password" else "no broker listens") in lines[0]
