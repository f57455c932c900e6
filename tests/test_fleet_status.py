"""`fedmq fleet status` against a real Mosquitto: agents' retained status and last wills.

A real `EdgeAgent` runs in a subprocess with a 1 s keepalive; after kill -9 the broker
publishes its last will, and `fleet status --watch` shows it offline within the keepalive
window (Mosquitto declares a client dead after 1.5 keepalives). Under broker_config/prod.conf:
an agent cut by a password rotation and reload gets no will from Mosquitto 2.0.11 and shows
offline once its heartbeats stop; a login that may not read the fleet is said in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from fedmq import protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.config import load_config
from fedmq.creds import Credentials, make_credentials, rotate_password
from fedmq.fleet_status import STALE_HEARTBEATS, FleetWatcher, render_table
from tests.cli_process import CliProcess, cli_env

ROOT = Path(__file__).resolve().parent.parent
FLEET = "fs"
KEEPALIVE_S = 2

AGENT_SCRIPT = textwrap.dedent("""
    import sys, time
    from edge_agent.protocol_client import EdgeAgent
    from fedmq.config import load_config
    cfg = load_config(None, {"fleet": sys.argv[2], "broker.url": sys.argv[1],
                             "broker.keepalive_s": int(sys.argv[4]), "data.dataset": "digits"})
    agent = EdgeAgent(cfg, sys.argv[3]).start()
    print("started", flush=True)
    while True:
        time.sleep(60)
""")


def fedmq(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedmq.cli", *args]


def publish_status(port: int, agent: str, state: str, epoch: int, counters: dict) -> None:
    env = protocol.Status(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                          state=state, role="agent", algorithm="cdfl", epoch=epoch, counters=counters)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{agent}")
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.publish(protocol.agent_status(FLEET, agent), protocol.encode(env), qos=1, retain=True).wait_for_publish(10)
    c.disconnect()
    c.loop_stop()


def start_agent(url: str, agent: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", AGENT_SCRIPT, url, FLEET, agent, str(KEEPALIVE_S)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "started", line + proc.stdout.read()
    return proc


def test_status_lists_counters_of_retained_status(mosquitto) -> None:
    now = time.time()
    publish_status(mosquitto.port, "car-1", "online", 7,
                   {"uploads": 3, "last_accuracy": 0.875, "last_upload_at": now - 3 * 3600})
    publish_status(mosquitto.port, "car-2", "offline", 2, {"uploads": 1})
    out = subprocess.run(fedmq("fleet", "status", "--broker", mosquitto.url, "--fleet", FLEET, "--json"),
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = {a["name"]: a for a in doc["agents"]}
    assert rows["car-1"]["state"] == "online" and rows["car-1"]["epoch"] == 7
    assert rows["car-1"]["last_accuracy"] == 0.875
    assert abs(rows["car-1"]["last_upload_at"] - (now - 3 * 3600)) < 1e-3
    assert rows["car-2"]["state"] == "offline" and rows["car-2"]["last_accuracy"] is None
    assert doc["aggregator"] is None

    table = subprocess.run(fedmq("fleet", "status", "--broker", mosquitto.url, "--fleet", FLEET),
                           cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "1 of 2 agents online" in table
    car1 = next(line for line in table.splitlines() if line.startswith("car-1"))
    assert car1.split()[:4] == ["car-1", "online", "7", "0.875"]
    assert "3h ago" in car1  # the upload time, rendered relative to now


@pytest.mark.parametrize("how", ["kill-9", "freeze"])
@pytest.mark.slow
def test_dead_agent_goes_offline_within_keepalive_window(mosquitto, how: str) -> None:
    """kill -9 closes the socket (the broker sees it at once); SIGSTOP freezes the agent with
    its socket open, like a device that lost its network: only the keepalive catches that."""
    proc = start_agent(mosquitto.url, "car-9")
    try:
        cfg = load_config(None, {"fleet": FLEET, "broker.url": mosquitto.url})
        with FleetWatcher(cfg) as w:
            w.settle()
            _, agents = w.snapshot()
        assert [(a.name, a.state) for a in agents] == [("car-9", "online")]

        watch = subprocess.Popen(fedmq("fleet", "status", "--broker", mosquitto.url, "--fleet", FLEET,
                                       "--json", "--watch", "0.2"),
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        states: list[tuple[float, str]] = []
        done = threading.Event()

        def read() -> None:
            for line in watch.stdout:
                doc = json.loads(line)
                state = {a["name"]: a["state"] for a in doc["agents"]}.get("car-9", "absent")
                states.append((time.monotonic(), state))
                if state == "offline":
                    done.set()
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 30
            while not states and time.monotonic() < deadline:
                time.sleep(0.05)
            assert states and states[-1][1] == "online", states
            proc.send_signal(signal.SIGKILL if how == "kill-9" else signal.SIGSTOP)
            killed = time.monotonic()
            # Mosquitto cuts a silent client 1.5 keepalives after its last packet, but 2.0.11
            # overshoots by seconds (measured 1.6-7.0 s for a 2 s keepalive on 2 busy cores);
            # kill -9 is seen at once (0.1-0.2 s) since the socket closes.
            window = 1.5 * KEEPALIVE_S + 8.0
            assert done.wait(window + 10), f"never shown offline: {states[-3:]}"
            shown_after = next(t for t, s in states if s == "offline") - killed
            print(f"{how}: offline shown {shown_after:.2f} s later (keepalive {KEEPALIVE_S} s)")
            assert shown_after <= window, f"offline shown {shown_after:.1f}s after the kill"
        finally:
            watch.send_signal(signal.SIGINT)
            try:
                watch.wait(60)
            except subprocess.TimeoutExpired:
                watch.kill()
                watch.wait(5)
        assert watch.returncode == 0, watch.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()  # SIGKILL also ends a stopped process
            proc.wait(10)


def test_clean_stop_and_will_keep_last_online_values(mosquitto) -> None:
    """A will carries connect-time values; the watcher keeps what the agent said since."""
    cfg = load_config(None, {"fleet": FLEET, "broker.url": mosquitto.url})
    with FleetWatcher(cfg) as w:
        will = protocol.Status(agent="car-5", msg_id=protocol.new_msg_id(), sent_at=time.time() - 100,
                               state="offline", role="agent", epoch=0)
        publish_status(mosquitto.port, "car-5", "online", 12, {"uploads": 4})
        deadline = time.monotonic() + 10
        while "car-5" not in w.agents and time.monotonic() < deadline:
            time.sleep(0.05)
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="will-sim")
        c.connect("127.0.0.1", mosquitto.port)
        c.loop_start()
        c.publish(protocol.agent_status(FLEET, "car-5"), protocol.encode(will), qos=1,
                  retain=True).wait_for_publish(10)
        c.disconnect()
        c.loop_stop()
        while w.agents["car-5"].state != "offline" and time.monotonic() < deadline:
            time.sleep(0.05)
        car5 = w.agents["car-5"]
        assert (car5.state, car5.epoch, car5.counters.get("uploads")) == ("offline", 12, 4)
        text = render_table(FLEET, None, [car5])
        assert "0 of 1 agents online" in text and "aggregator: no status" in text



# --------------------------------------------------------------------------- prod.conf

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
PROD_FLEET = "f1"


@pytest.fixture
def prod(tmp_path):
    creds = make_credentials(tmp_path / "creds", ["car-1", "car-2"], monitor_user="monitor", fleets=[PROD_FLEET])
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        yield broker, creds


def login_url(broker: MosquittoBroker, creds: Credentials, user: str) -> str:
    return f"mqtts://{user}:{creds.users()[user]}@localhost:{broker.port}"


def publish_as(broker: MosquittoBroker, creds: Credentials, user: str, topic: str, env: protocol.Envelope) -> None:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5)
    c.tls_set(ca_certs=str(creds.ca_cert))
    c.username_pw_set(user, creds.users()[user])
    c.connect("localhost", broker.port)
    c.loop_start()
    try:
        info = c.publish(topic, protocol.encode(env), qos=1, retain=True)
        info.wait_for_publish(30)
        assert info.is_published()
    finally:
        c.disconnect()
        c.loop_stop()


def status_run(broker: MosquittoBroker, creds: Credentials, user: str, fleet: str = PROD_FLEET
               ) -> subprocess.CompletedProcess:
    return subprocess.run(fedmq("fleet", "status", "--broker", login_url(broker, creds, user), "--ca-file",
                                str(creds.ca_cert), "--fleet", fleet, "--json"),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@needs_mosquitto
def test_a_login_that_may_not_read_the_fleet_is_told_in_one_line(prod) -> None:
    """Mosquitto grants an ACL-denied subscription and sends nothing: what arrived is checked
    against what must be there. The monitor reads the fleet; an agent's login reads only the
    aggregator's status; nobody's login reads another fleet."""
    broker, creds = prod
    status = protocol.Status(agent="aggregator", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             state="online", role="aggregator", algorithm="cdfl", epoch=3,
                             counters={"applied.join": 2, "applied.update": 3})
    publish_as(broker, creds, creds.aggregator_user, protocol.aggregator_status(PROD_FLEET), status)
    car2 = protocol.Status(agent="car-2", msg_id=protocol.new_msg_id(), sent_at=protocol.now(), state="online",
                           role="agent", algorithm="cdfl", epoch=3, counters={"uploads": 3})
    publish_as(broker, creds, "car-2", protocol.agent_status(PROD_FLEET, "car-2"), car2)

    ok = status_run(broker, creds, "monitor")
    assert ok.returncode == 0, ok.stderr
    assert [a["name"] for a in json.loads(ok.stdout)["agents"]] == ["car-2"]

    for user, fleet, names in (("car-1", PROD_FLEET, ("user 'car-1'", "aggregator status", "no agent's status")),
                               ("monitor", "f2", ("user 'monitor'", "nothing of fleet 'f2'"))):
        done = status_run(broker, creds, user, fleet)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and not done.stdout and len(lines) == 1, (user, done.stdout, done.stderr)
        assert lines[0].startswith("fedmq fleet status: ") and "monitor login" in lines[0], lines[0]
        for name in names:
            assert name in lines[0], (name, lines[0])
        assert creds.users()[user] not in done.stderr


@needs_mosquitto
@pytest.mark.slow
def test_an_agent_cut_by_a_password_rotation_shows_offline(prod, tmp_path) -> None:
    """`fedmq creds --rotate car-1`, then SIGHUP: Mosquitto 2.0.11 cuts car-1's session and
    publishes no last will, so its retained status still says online. `fedmq agent` renews
    that status every 2 keepalives (heartbeat_s); once STALE_HEARTBEATS are missing, fleet
    status shows it offline."""
    broker, creds = prod
    agent = CliProcess(["fedmq", "agent", "--broker", f"mqtts://car-1@127.0.0.1:{broker.port}", "--ca-file",
                        str(creds.ca_cert), "--fleet", PROD_FLEET, "--id", "car-1", "--state-dir",
                        str(tmp_path / "car-1"), "--set", "broker.keepalive_s=1"],
                       cwd=ROOT, env=cli_env(FEDMQ_BROKER_PASSWORD=creds.agents["car-1"]))
    cfg = load_config(None, {"fleet": PROD_FLEET, "broker.url": login_url(broker, creds, "monitor"),
                             "broker.ca_file": str(creds.ca_cert)})
    try:
        with FleetWatcher(cfg) as w:
            # Online, and kept online by its heartbeats for longer than the staleness rule.
            heard: list[float] = []
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, f"no heartbeats: {w.snapshot()}\n{agent.output[-3000:]}"
                _, agents = w.snapshot()
                if agents and agents[0].state == "online" and agents[0].heartbeat_s:
                    if not heard or heard[-1] != agents[0].heard_at:
                        heard.append(agents[0].heard_at)
                    if heard[-1] - heard[0] > STALE_HEARTBEATS * agents[0].heartbeat_s:
                        break
                time.sleep(0.1)
            assert agents[0].heartbeat_s == 2.0 and not agents[0].stale

            rotate_password(creds.out_dir, "car-1")
            assert broker.proc is not None
            os.kill(broker.proc.pid, signal.SIGHUP)
            cut = time.monotonic()
            while True:
                _, agents = w.snapshot()
                if agents[0].state == "offline":
                    break
                assert time.monotonic() - cut < 60, f"still {agents[0]}\n{broker.log_tail()}"
                time.sleep(0.1)
            shown_after = time.monotonic() - cut
            print(f"rotation: shown offline {shown_after:.1f} s after the reload (heartbeat 2 s)")
            assert agents[0].stale
            assert "Client car-1 disconnected" in broker.log_tail(200)

        # The one-shot command as an operator runs it says the same.
        done = status_run(broker, creds, "monitor")
        assert done.returncode == 0, done.stderr
        row = json.loads(done.stdout)["agents"][0]
        assert (row["name"], row["state"], row["stale"]) == ("car-1", "offline", True)
        assert "0 of 1 agents online" in subprocess.run(
            fedmq("fleet", "status", "--broker", login_url(broker, creds, "monitor"), "--ca-file",
                  str(creds.ca_cert), "--fleet", PROD_FLEET), cwd=ROOT, capture_output=True, text=True,
            timeout=120).stdout
    finally:
        agent.stop()
