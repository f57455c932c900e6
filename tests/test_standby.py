"""An aggregator tells a live aggregator from a dead one by its heartbeat, not by a retained
"online" (aggregator/service.py, SoleAggregator).

A standby restored from a copy of a serving aggregator's state dir never takes that one's
MQTT session: on broker_config/prod.conf (credentials from `fedmq creds`, so the aggregator's
user IS its client id) three agents upload while `fedmq aggregator` starts on the copy. The
copy names the serving one as its own predecessor, so its retained "online" looks like a dead
predecessor's; the standby's probe waits for a heartbeat instead, gets one, and exits with
one line. Every upload is answered once, by the serving aggregator, which never lost its
connection. The other side: a copy whose aggregator did die serves after the heartbeat window,
and a stopping aggregator's last word stays "offline", never a late heartbeat."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from aggregator.bootstrap import build_engine
from aggregator.service import INSTANCE_FILE, AggregatorService, SoleAggregator, heartbeat_window
from fedmq import protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.config import BrokerSettings
from fedmq.creds import Credentials, make_credentials
from fedmq.models import model_spec
from soak.fleet_setup import SMALL, pretrained_state, small_config
from tests.cli_process import ROOT, CliProcess, cli_env
from tests.raw_agent import RawAgent

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

FLEET = "garage"
AGENTS = ("car-1", "car-2", "car-3")
UPLOADS = 20
"""Per agent; the first half before the standby's probe connects, the rest while it decides."""
SPEC = model_spec("digits-cnn")
FAST = {**SMALL, "cdfl.personalization": "mixture"}
"""Replies without training: what is under test is who answers, not the reply."""
WAIT_S = 120.0
"""Generous: the machine may be shared."""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """Pre-trained once; each test copies it (`pretrained_state(into, cache=...)`)."""
    return pretrained_state(tmp_path_factory.mktemp("pretrained") / "state")


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    """What `fedmq creds --agents car-1,car-2,car-3` writes (the function it runs)."""
    return make_credentials(tmp_path_factory.mktemp("creds"), AGENTS)


@pytest.fixture
def prod_broker(creds, tmp_path) -> Iterator[MosquittoBroker]:
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        yield broker


def restored_elsewhere(state: Path, into: Path) -> Path:
    """A copy of a serving aggregator's state dir as a standby on another machine reads it: the
    instance record names a host that is not this one, so no pid check can tell that its
    aggregator still runs."""
    shutil.copytree(state, into)
    record = json.loads((into / INSTANCE_FILE).read_text())
    (into / INSTANCE_FILE).write_text(json.dumps({**record, "host": f"not-{record['host']}"}) + "\n")
    return into


def sessions(broker: MosquittoBroker, user: str) -> int:
    """Connections the broker accepted as `user` (under prod.conf, that user's one session)."""
    return broker.log_tail(10_000_000).count(f" as {user} (")


def test_a_standby_from_a_copied_state_dir_never_takes_the_serving_session(creds, prod_broker, pretrained,
                                                                            tmp_path) -> None:
    users = creds.users()
    user, password = creds.aggregator_for(FLEET)
    url = f"mqtts://{user}:{password}@127.0.0.1:{prod_broker.port}"
    serving_dir = pretrained_state(tmp_path / "serving", cache=pretrained)
    cfg = small_config(url, serving_dir, FLEET, **{**FAST, "broker.ca_file": str(creds.ca_cert)})
    heard: dict[str, list[protocol.Envelope]] = {name: [] for name in AGENTS}
    sent: dict[str, list[str]] = {name: [] for name in AGENTS}
    failures: list[str] = []
    probing, standby_done = threading.Event(), threading.Event()
    agents: list[RawAgent] = []
    standby: CliProcess | None = None
    with AggregatorService(cfg, build_engine(cfg)) as serving:
        try:
            for name in AGENTS:
                a = RawAgent(prod_broker.port, FLEET, name, ca_file=str(creds.ca_cert), password=users[name])

                def on_message(client, userdata, msg, a: RawAgent = a) -> None:
                    env = protocol.decode(msg.payload, max_bytes=1 << 27)
                    heard[a.agent].append(env)  # every downlink, so that a second answer cannot hide
                    a.inbox.put(env)

                a.client.on_message = on_message
                agents.append(a)
                a.join(SPEC.hash, timeout=WAIT_S)
            standby_dir = restored_elsewhere(serving_dir, tmp_path / "standby")

            def upload(a: RawAgent, seed: int) -> None:
                try:
                    for i in range(UPLOADS):
                        if i == UPLOADS // 2 and not probing.wait(WAIT_S):
                            raise TimeoutError("the standby never probed")
                        if i >= UPLOADS // 2:
                            standby_done.wait(0.25)  # spread over the standby's decision (a heartbeat: 2 s)
                        up = a.update_envelope(a.base * (1 + 0.001 * ((seed + i) % 7 + 1)), SPEC.hash,
                                               codec="fp32", delta=False)
                        sent[a.agent].append(up.msg_id)
                        a.send(up)
                        reply = a.expect(up.msg_id, timeout=WAIT_S)
                        if isinstance(reply, protocol.Model):
                            a.install(reply)
                except Exception as e:  # reported below: the test fails
                    failures.append(f"{a.agent}: {type(e).__name__}: {e}"[:300])

            threads = [threading.Thread(target=upload, args=(a, 100 * i), daemon=True) for i, a in enumerate(agents)]
            for t in threads:
                t.start()
            argv = ["fedmq", "aggregator", "--broker", url, "--ca-file", str(creds.ca_cert), "--fleet", FLEET,
                    "--state-dir", str(standby_dir), "--log-level", "info"]
            for key, value in FAST.items():
                argv += ["--set", f"{key}={value}"]
            before = {u: sessions(prod_broker, u) for u in (user, f"{user}-probe")}
            standby = CliProcess(argv, cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1"))
            first = standby.wait_for(r"aggregator\.(heartbeat_wait|clear|waiting)\b", WAIT_S)
            probing.set()
            assert first.group(1) == "heartbeat_wait", standby.output[-3000:]
            code = standby.wait(WAIT_S)
            standby_done.set()
            for t in threads:
                t.join(WAIT_S)
            for a in agents:  # a barrier: an answer sent before this join's reached the agent before it
                a.join(SPEC.hash, timeout=WAIT_S)
            dropped = {a.agent: a.disconnects for a in agents if a.disconnects}
        finally:
            probing.set()
            standby_done.set()
            if standby is not None:
                standby.stop()
            for a in agents:
                a.close()
        applied = serving.engine.counters["applied.update"]
        assert not serving.sole.failed.is_set()

    assert not failures, failures
    assert standby is not None
    uploads = [m for name in AGENTS for m in sent[name]]
    assert len(uploads) == len(AGENTS) * UPLOADS
    answers = Counter(e.in_reply_to for name in AGENTS for e in heard[name]
                      if isinstance(e, (protocol.Model, protocol.Error)) and e.in_reply_to in set(sent[name]))
    twice = {m: n for m, n in answers.items() if n > 1}
    assert not twice, f"{len(twice)} of {len(uploads)} uploads answered more than once"
    assert all(isinstance(e, protocol.Model) for name in AGENTS for e in heard[name]
               if getattr(e, "in_reply_to", None) in set(sent[name])), "an upload was refused"
    assert len(answers) == len(uploads) and applied == len(uploads), (len(answers), applied)
    # The standby: exit 1, one line saying why, and never a connection as the aggregator.
    assert code == 1, standby.output[-3000:]
    why = [line for line in standby.lines if "another aggregator" in line]
    assert len(why) == 1 and "another aggregator is live for fleet 'garage' (heartbeat" in why[0], why
    assert "Traceback" not in standby.output and "aggregator.started" not in standby.output
    assert sessions(prod_broker, user) == before[user], prod_broker.log_tail(50)
    assert sessions(prod_broker, f"{user}-probe") == before[f"{user}-probe"] + 1, prod_broker.log_tail(50)
    assert not dropped, dropped


class StatusWatcher:
    """A plain MQTT client on the fleet's aggregator status: every delivery, retained or live."""

    def __init__(self, port: int) -> None:
        self.got: list[tuple[protocol.Status, bool]] = []
        self._cond = threading.Condition()
        subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{protocol.new_msg_id()[-8:]}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(protocol.aggregator_status(FLEET), qos=1)
        assert subscribed.wait(60), "no SUBACK"

    def _on_message(self, client, userdata, msg) -> None:
        env = protocol.decode(msg.payload, max_bytes=1 << 20)
        assert isinstance(env, protocol.Status)
        with self._cond:
            self.got.append((env, bool(msg.retain)))
            self._cond.notify_all()

    def wait_for(self, ok, timeout: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: ok(self.got), timeout)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_copy_of_a_dead_aggregators_state_dir_serves_after_the_heartbeat_window(mosquitto, tmp_path) -> None:
    """Its aggregator died on its host (kill -9, the broker not yet aware): the retained status
    says online and advertises a heartbeat that never comes, so the standby serves once the
    window passed, without waiting 1.5 keepalives for the will."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "lock").write_text(f"{os.getpid()}\n")  # as the journal's lock, held by this process
    started = protocol.now() - 600
    (state / INSTANCE_FILE).write_text(json.dumps({"started_at": started, "pid": 1, "host": "gone-host"}) + "\n")
    dead = protocol.Status(agent="aggregator", msg_id=protocol.new_msg_id(), sent_at=protocol.now() - 1,
                           state="online", role="aggregator", algorithm="cdfl", epoch=7, started_at=started,
                           heartbeat_s=0.5)
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dead-aggregator")
    publisher.connect("127.0.0.1", mosquitto.port)
    publisher.loop_start()
    try:
        publisher.publish(protocol.aggregator_status(FLEET), protocol.encode(dead), qos=1, retain=True).wait_for_publish(30)
    finally:
        publisher.disconnect()
        publisher.loop_stop()
    broker = BrokerSettings(url=mosquitto.url)
    sole = SoleAggregator(FLEET, f"fedmq-aggregator-{FLEET}", 60.0, state)
    t0 = time.monotonic()
    assert sole.clear_to_serve(broker), sole.failure
    took = time.monotonic() - t0
    assert heartbeat_window(0.5) <= took < broker.keepalive_s * 1.5, took


def test_a_stopped_aggregators_last_status_is_offline_after_its_heartbeats(mosquitto, pretrained, tmp_path) -> None:
    """Idle, it re-publishes its retained status every heartbeat_s (sent_at moving on); once
    stopped, what the broker keeps is its offline status, no heartbeat after it."""
    state = pretrained_state(tmp_path / "state", cache=pretrained)
    cfg = small_config(mosquitto.url, state, FLEET, **{**FAST, "aggregator.heartbeat_s": 0.2})
    watcher = StatusWatcher(mosquitto.port)
    try:
        with AggregatorService(cfg, build_engine(cfg)):
            def beats(got: list[tuple[protocol.Status, bool]]) -> bool:
                live = {env.sent_at for env, retained in got if env.state == "online" and not retained}
                return len(live) >= 3
            assert watcher.wait_for(beats), watcher.got
            assert all(env.heartbeat_s == 0.2 for env, _ in watcher.got)
    finally:
        watcher.close()
    after = StatusWatcher(mosquitto.port)
    try:
        assert after.wait_for(lambda got: bool(got)), "no retained status"
        assert after.got[0][0].state == "offline" and after.got[0][1], after.got
    finally:
        after.close()
