"""What the broker refuses an agent, against a real Mosquitto 2.0.11 and real MQTT clients.

Mosquitto answers an ACL-denied QoS 1 publish of an MQTT 5 client with PUBACK 0x87 (Not
authorized) and grants an ACL-denied SUBSCRIBE (0x01, then delivers nothing). When another
client connects with a session's client id it closes the old connection with no DISCONNECT
(no 0x8E), and two processes with one id then take the session from each other at every
reconnect. So: a refused publish is one line naming the login and the topic, and counted; an
agent whose login may not use its own topics (`fedmq agent` as users run it, under
broker_config/prod.conf with `fedmq creds`) says why and exits 1; of two agents with one id,
the one that connected last exits 1 with one line and the other keeps its session; a broker
restart is never taken for a second agent.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmq import protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.config import BrokerSettings, load_config
from fedmq.creds import Credentials, make_credentials
from fedmq.fleet_status import FleetWatcher
from fedmq.logs import EventFormatter
from fedmq.transport import TAKEOVER_WINDOW_S, MqttTransport
from tests.cli_process import ROOT, CliProcess, cli_env

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

FLEET = "f1"
WAIT_S = 120.0


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    return make_credentials(tmp_path_factory.mktemp("creds"), ["car-1", "car-2"], monitor_user="monitor",
                            fleets=[FLEET])


@pytest.fixture
def prod(creds, tmp_path) -> Iterator[MosquittoBroker]:
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        yield broker


def agent_argv(broker: MosquittoBroker, creds: Credentials, login: str, agent: str, state: Path,
               *extra: str) -> list[str]:
    """`fedmq agent` as a device runs it: the login in the URL, its password from the environment."""
    return ["fedmq", "agent", "--broker", f"mqtts://{login}@127.0.0.1:{broker.port}",
            "--ca-file", str(creds.ca_cert), "--fleet", FLEET, "--id", agent, "--state-dir", str(state),
            "--set", "broker.keepalive_s=1", *extra]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("fedmq agent:")]


def connected_at(broker: MosquittoBroker, login: str) -> list[int]:
    """The broker's clock (whole seconds) at each connection it accepted for `login`."""
    return [int(m.group(1)) for m in re.finditer(rf"^(\d+): New client connected .* as {re.escape(login)} \(",
                                                 broker.log_path.read_text(errors="replace"), re.M)]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(0.05)


# --------------------------------------------------------------------------- refused publishes


def test_a_refused_publish_is_one_line_naming_login_and_topic_and_counted(prod, creds, caplog) -> None:
    s = BrokerSettings(url=f"mqtts://car-1:{creds.agents['car-1']}@localhost:{prod.port}", ca_file=str(creds.ca_cert))
    t = MqttTransport("car-1", s).connect()
    try:
        other = protocol.uplink(FLEET, "car-2")
        with caplog.at_level(logging.DEBUG, logger="fedmq"):
            for _ in range(3):
                h = t.publish(other, b"not mine")
                with pytest.raises(Exception, match=r"Not authorized \(0x87\)"):
                    h.wait(30)
            assert t.publish(protocol.uplink(FLEET, "car-1"), b"mine").wait(30)
            # Denied too, but Mosquitto 2.0.11 grants it and delivers nothing: no refusal to see.
            t.subscribe(protocol.downlink(FLEET, "car-2"), lambda m: None)
        assert t.refused == {"publish": 3}
        said = [r for r in caplog.records if r.getMessage().startswith("transport.publish_refused")]
        warned = [r for r in said if r.levelno == logging.WARNING]
        assert len(warned) == 1 and len(said) == 3, [r.getMessage() for r in said]
        line = EventFormatter(False).format(warned[0])
        assert "login=car-1" in line and f"topic={other}" in line and "Not authorized (0x87)" in line, line
        assert creds.agents["car-1"] not in caplog.text
    finally:
        t.close()


# --------------------------------------------------------------------------- the wrong login


def test_an_agent_whose_login_is_another_agents_says_why_and_exits_1(prod, creds, tmp_path) -> None:
    """car-1's login running as car-2: every topic of car-2 is refused to it (PUBACK 0x87), and
    retrying cannot change that. Read without its reason code, the refusal looks like an
    aggregator that never answers: `join.failed reason=no_reply ... asking again`, for ever."""
    proc = CliProcess(agent_argv(prod, creds, "car-1", "car-2", tmp_path / "car-2"), cwd=ROOT,
                      env=cli_env(FEDMQ_BROKER_PASSWORD=creds.agents["car-1"]))
    code = proc.wait(WAIT_S)
    ended = time.time()
    out = proc.output
    assert code == 1, out[-3000:]
    assert "Traceback" not in out and creds.agents["car-1"] not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out[-3000:]  # stdout and stderr together: that line and nothing else
    line = lines[0]
    for name in ("fedmq agent:", "login 'car-1'", f"fedmq/{FLEET}/agents/car-2/", "Not authorized (0x87)",
                 "--id car-1"):
        assert name in line, (name, line)
    seen = connected_at(prod, "car-1")
    assert seen, prod.log_tail()
    said_after = ended - seen[0]
    print(f"wrong login: said and exited {said_after:.1f} s after the broker accepted it")
    assert said_after <= 10 + 1, said_after  # the broker's log has whole seconds


# --------------------------------------------------------------------------- one id, two processes


@pytest.mark.slow
def test_two_agents_with_one_id_leave_one_running_and_one_line(prod, creds, tmp_path) -> None:
    """Two `fedmq agent --id car-1` with car-1's login (two state dirs: one device copied onto
    another). prod.conf makes the login the client id, so they take the session from each
    other. The one started last stops with one line; the first keeps its session."""
    env = cli_env(FEDMQ_BROKER_PASSWORD=creds.agents["car-1"])
    cfg = load_config(None, {"fleet": FLEET, "broker.url": f"mqtts://monitor:{creds.users()['monitor']}"
                                                         f"@localhost:{prod.port}",
                             "broker.ca_file": str(creds.ca_cert)})
    first = second = None
    with FleetWatcher(cfg) as watch:
        try:
            first = CliProcess(agent_argv(prod, creds, "car-1", "car-1", tmp_path / "first"), cwd=ROOT, env=env)
            # Connected for longer than a takeover window, by its own heartbeats (every 2 s).
            live: list[float] = []
            wait_until(lambda: _heard(watch, "car-1", live) and live[-1] - live[0] > TAKEOVER_WINDOW_S,
                       WAIT_S, "the first agent's heartbeats over a takeover window")
            second = CliProcess(agent_argv(prod, creds, "car-1", "car-1", tmp_path / "second"), cwd=ROOT, env=env)
            wait_until(lambda: first.proc.poll() is not None or second.proc.poll() is not None, WAIT_S,
                       "one of the two agents stopped")
            code = second.wait(30)
            assert code == 1 and first.proc.poll() is None, (first.output[-2000:], second.output[-2000:])
            said = error_lines(second.output)
            assert len(said) == 1, second.output[-3000:]
            assert "another process is connected as agent 'car-1'" in said[0] and "login 'car-1'" in said[0], said
            assert "Traceback" not in second.output and creds.agents["car-1"] not in second.output
            assert not error_lines(first.output), first.output[-3000:]

            # The first keeps its session: two more heartbeats and no session taken since.
            takeovers = prod.log_tail(100_000).count("already connected, closing old connection")
            after = time.time()
            beats: list[float] = []
            wait_until(lambda: _heard(watch, "car-1", beats) and sum(b > after for b in beats) >= 2, 60,
                       "two heartbeats of the first agent after the second stopped")
            assert prod.log_tail(100_000).count("already connected, closing old connection") == takeovers
            assert first.proc.poll() is None, first.output[-3000:]
            assert first.stop() == 0, first.output[-3000:]
        finally:
            for p in (first, second):
                if p is not None:
                    p.kill()


def _heard(watch: FleetWatcher, agent: str, times: list[float]) -> bool:
    """Record when `agent`'s latest live status came (our clock); True once one did."""
    with watch._lock:
        seen = watch.agents.get(agent)
    live = seen is not None and seen.state == "online" and seen.heard_at == seen.received_at
    if live and (not times or times[-1] != seen.received_at):
        times.append(seen.received_at)
    return bool(times)


def test_two_clients_with_one_client_id_on_dev_conf_one_yields(mosquitto) -> None:
    """dev.conf: no logins, the client id (fedmq-agent-FLEET-ID for agents) alone names the
    session. The transport that connected last is told, once; the other stays connected."""
    s = BrokerSettings(url=mosquitto.url)
    told: dict[str, str] = {}
    both: list[MqttTransport] = []

    def transport(name: str) -> MqttTransport:
        t = MqttTransport(protocol.agent_client_id("f", "twin"), s)

        def taken(tr: MqttTransport, why: str) -> None:
            told[name] = why
            tr.give_up()

        t.on_taken_over_hooks.append(taken)
        both.append(t)
        return t

    try:
        first = transport("first").connect()
        first._connected_at -= TAKEOVER_WINDOW_S  # as if connected for a while already
        second = transport("second").connect()
        wait_until(lambda: told, 60, "one transport told of the takeover")
        assert list(told) == ["second"] and "same client id" in told["second"], told
        assert first.wait_connected(30)
        got = threading.Event()
        first.subscribe("twin/t", lambda m: got.set())
        assert first.publish("twin/t", b"x").wait(30) and got.wait(30)  # the survivor works
        assert not second.connected and second.yielded
        assert list(told) == ["second"]
    finally:
        for t in both:
            t.close()


def test_a_restarting_broker_is_not_taken_for_a_second_agent(mosquitto) -> None:
    """A broker restart also closes connections with no DISCONNECT (SIGTERM included) and is
    back before the reconnect: four in a row, each soon after the reconnect, are not a takeover."""
    told: list[str] = []
    t = MqttTransport(protocol.agent_client_id("f", "solo"), BrokerSettings(url=mosquitto.url))
    t.on_taken_over_hooks.append(lambda tr, why: told.append(why))
    t.connect()
    try:
        for kill in (False, True, False, True):
            mosquitto.restart(kill=kill)
            assert t.wait_connected(60)
        got = threading.Event()
        t.subscribe("solo/t", lambda m: got.set())  # a round trip: the probes of the cuts are done by now
        assert t.publish("solo/t", b"x").wait(30) and got.wait(30)
        wait_until(lambda: not any(th.name.startswith("takeover-probe") for th in threading.enumerate()), 30,
                   "the takeover probes finished")
        assert told == [] and not t.yielded
    finally:
        t.close()


# --------------------------------------------------------------------------- --dry-run


def test_dry_run_says_a_missing_ca_file_in_one_line(tmp_path) -> None:
    missing = tmp_path / "nope" / "ca.crt"
    for argv in (["agent", "--id", "car-1"], ["fleet", "status"]):
        done = subprocess.run([sys.executable, "-m", "fedmq.cli", *argv, "--broker", "mqtts://car-1@h:8883",
                               "--ca-file", str(missing), "--dry-run"], cwd=ROOT, env=cli_env(),
                              capture_output=True, text=True, timeout=WAIT_S)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, (argv, done.stdout[-2000:], done.stderr[-2000:])
        assert "--ca-file" in lines[0] and str(missing) in lines[0] and "no such file" in lines[0], lines
    present = tmp_path / "ca.crt"
    present.write_text("-----BEGIN CERTIFICATE-----\n")
    done = subprocess.run([sys.executable, "-m", "fedmq.cli", "fleet", "status", "--ca-file", str(present),
                           "--dry-run"], cwd=ROOT, env={**cli_env(), "FEDMQ_BROKER_PASSWORD": ""},
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0 and str(present) in done.stdout, done.stderr
