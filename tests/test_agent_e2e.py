"""The edge agent end to end: a real Mosquitto, the real aggregator (in-process), real agents.

- drift: an agent whose data mixture shifts detects it, trains, uploads, installs a
  personalized model that does better on its new mixture than the model it held;
- a malformed downlink is refused with a logged reason and the current model stays;
- the broker restarts mid-upload: the agent reconnects, re-sends, the cycle completes;
- the agent (a `fedmq agent` subprocess) is killed mid-cycle: after a restart it keeps tau
  and re-sends its pending upload once, byte for byte; the aggregator applies it once;
- SIGTERM during training: the upload it produced survives on disk, is not sent before
  the exit, and is sent exactly once after the restart.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from edge_agent.agent_loop import DeviceAgent
from edge_agent.inference import TorchPredictor
from edge_agent.protocol_client import EdgeAgent
from edge_agent.sources import DatasetSource
from edge_agent.state import AgentState
from fedmq import codecs, protocol
from fedmq.config import Config, load_config
from fedmq.data import clusters_from_settings
from fedmq.fleet_status import FleetWatcher
from fedmq.models import model_spec
from fedmq.training import evaluate

FLEET = "t"
SPEC = model_spec("digits-cnn")
ROOT = Path(__file__).resolve().parent.parent
# Cluster models good enough that a cluster shift is visible (0.9 on their own cluster), so
# pre-trained apart: after shared pre-training (the default) each digits cluster model serves
# both rotations (0.93 / 0.92 on either mixture) and the drift test's shift costs nothing.
SERVER = {
    "aggregator.pretrain_shared": False,
    "fleet": FLEET, "cdfl.clusters": 2, "data.dataset": "digits", "data.proxy_per_cluster": 150,
    "data.pretrain_per_cluster": 400, "aggregator.pretrain_epochs": 10, "device": "cpu",
    "protocol.chunk_bytes": 64 * 1024, "protocol.max_message_bytes": 256 * 1024,
}
AGENT = {
    "agent.min_update_interval_s": 0, "agent.buffer_size": 600, "agent.min_samples_to_train": 200,
    "agent.samples_after_drift": 200, "agent.train_on_newest": 250, "agent.poll_batch": 25,
    "agent.poll_interval_s": 0.02, "agent.save_every_s": 0.5,
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A state dir with pre-trained cluster models, copied by each test (pre-training once)."""
    state = tmp_path_factory.mktemp("pretrained") / "state"
    cfg = load_config(None, {**SERVER, "aggregator.state_dir": str(state)})
    engine = build_engine(cfg)
    engine.recover()
    engine.journal.close()
    return state


def make_cfg(url: str, tmp: Path, agent_id: str = "car-1", **extra) -> Config:
    return load_config(None, {**SERVER, **AGENT, "broker.url": url, "aggregator.state_dir": str(tmp / "agg"),
                              "agent.id": agent_id, "agent.state_dir": str(tmp / agent_id), **extra})


class Aggregator:
    """The real aggregator service, in-process, that a test can stop and start again."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.svc: AggregatorService | None = None

    def start(self) -> AggregatorService:
        self.svc = AggregatorService(self.cfg, build_engine(self.cfg)).start()
        return self.svc

    def stop(self) -> None:
        if self.svc is not None:
            self.svc.stop()
            self.svc = None


@pytest.fixture
def aggregator(pretrained, tmp_path) -> Iterator[Callable[[Config], Aggregator]]:
    made: list[Aggregator] = []

    def make(cfg: Config) -> Aggregator:
        shutil.copytree(pretrained, cfg.aggregator.state_dir)
        agg = Aggregator(cfg)
        agg.start()
        made.append(agg)
        return agg

    yield make
    for agg in made:
        agg.stop()


def subscribed(port: int, client_id: str, topic: str, on_message: Callable) -> mqtt.Client:
    """A plain paho client on the test broker, returned once its QoS 1 subscription is granted."""
    ready = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    client.on_message = on_message
    client.on_subscribe = lambda *a, **k: ready.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.subscribe(topic, qos=1)
    assert ready.wait(60)
    return client


class Sniffer:
    """Every uplink of the fleet, as the broker delivers it to a plain subscriber."""

    def __init__(self, port: int) -> None:
        self.payloads: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self.client = subscribed(port, "sniffer", f"fedmq/{FLEET}/agents/+/up", self._on_message)

    def _on_message(self, client, userdata, msg) -> None:
        with self._lock:
            self.payloads.append((msg.topic, bytes(msg.payload)))

    def updates(self) -> list[tuple[protocol.Update, bytes]]:
        with self._lock:
            items = list(self.payloads)
        out = []
        for _, payload in items:
            env = protocol.decode(payload, max_bytes=1 << 26)
            if isinstance(env, protocol.Update):
                out.append((env, payload))
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def rotated_pools(cfg: Config, rng: np.random.Generator, n: int = 600):
    clusters = clusters_from_settings(cfg.data, cfg.cdfl.clusters, seed=cfg.seed)
    pools = [(d.x, d.y) for d in (clusters.take(k, n, rng) for k in range(clusters.num_clusters))]
    return clusters, pools


def mixture_test_set(clusters, mixture, rng, n: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [clusters.take(k, int(round(m * n)), rng, split="test") for k, m in enumerate(mixture) if m > 0]
    return torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts])


def step_until_cycle(device: DeviceAgent, limit: int = 2000):
    for _ in range(limit):
        cycle = device.step()
        if cycle is not None:
            return cycle
    raise AssertionError(f"no update cycle in {limit} steps; counters {device.counters}")


class Worker(threading.Thread):
    """step_until_cycle in a thread, keeping its result or exception for the test to check."""

    def __init__(self, device: DeviceAgent) -> None:
        super().__init__(daemon=True)
        self.device = device
        self.cycle = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.cycle = step_until_cycle(self.device)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def result(self, timeout: float = 60):
        self.join(timeout)
        assert not self.is_alive(), "the update cycle did not finish"
        if self.error is not None:
            raise self.error
        return self.cycle


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# ---------------------------------------------------------------------------------- in-process


def test_drift_upload_personalized_model_beats_held_model(mosquitto, aggregator, tmp_path) -> None:
    # CDFL with beta0 = 0.5 (the paper's 0.025 barely moves the clusters toward one agent:
    # docs/edge_agent.md has both figures), default estimator, default local training.
    cfg = make_cfg(mosquitto.url, tmp_path, **{"cdfl.beta0": 0.5})
    agg = aggregator(cfg)
    rng = np.random.default_rng(1)
    clusters, pools = rotated_pools(cfg, rng)
    source = DatasetSource(pools, [0.9, 0.1], seed=3)
    old_test = mixture_test_set(clusters, [0.9, 0.1], rng)
    new_test = mixture_test_set(clusters, [0.1, 0.9], rng)
    device = DeviceAgent(cfg, source).start()
    try:
        assert device.tau == 0 and device.predictor.backend == "onnxruntime"
        # First cycle (manual): the agent's model becomes one for its cluster-0-heavy data.
        device.trigger()
        first = step_until_cycle(device)
        assert first.trigger == "manual" and first.outcome == "installed" and device.tau == 1
        # Stationary data: no drift.
        for _ in range(20):
            assert device.step() is None
        assert device.counters.get("drifts", 0) == 0
        held = device.state.vector.clone()
        acc_held_old = evaluate(device.model_name, held, *old_test)[0]
        acc_before = evaluate(device.model_name, held, *new_test)[0]

        source.set_mixture([0.1, 0.9])  # the car drives into another area
        cycle = step_until_cycle(device)
        assert cycle.trigger == "drift" and cycle.outcome == "installed"
        assert device.counters["drifts"] == 1 and device.tau == 2
        assert cycle.installed is not None
        acc_after = evaluate(device.model_name, device.state.vector, *new_test)[0]
        print(f"\nheld model: {acc_held_old:.3f} on the old mixture, {acc_before:.3f} on the new; "
              f"after local training {cycle.acc_trained:.3f} (its training data); personalized model "
              f"received: {acc_after:.3f} on the new mixture; alpha {cycle.installed.alpha}")
        assert acc_after >= acc_before + 0.1, (acc_before, acc_after)
        assert agg.svc.engine.counters["applied.update"] == 2

        # Operators see the last accuracy and upload time in the retained status.
        with FleetWatcher(cfg) as watcher:
            watcher.settle()
            _, agents = watcher.snapshot()
        (me,) = [p for p in agents if p.name == device.agent_id]
        assert me.state == "online" and me.epoch == 2
        assert me.last_accuracy == pytest.approx(device.state.reference_accuracy, abs=1e-4)
        assert me.last_upload_at is not None and abs(me.last_upload_at - time.time()) < 120

        # ONNX Runtime serves exactly the installed model (within 1e-4 of torch).
        x = new_test[0][:64].numpy()
        reference = TorchPredictor(device.model_name, device.state.vector).predict(x)
        assert np.abs(device.predictor.predict(x) - reference).max() < 1e-4

        # Everything is on disk: a new DeviceAgent resumes at tau 2 with the same model.
        device.close()
        saved = AgentState.load(cfg.agent.state_dir)
        assert saved.tau == 2 and saved.pending is None and torch.equal(saved.vector, device.state.vector)
        assert saved.counters["drifts"] == 1 and saved.monitor["observed"] == device.monitor.observed
    finally:
        device.close()


def upload_with_no_aggregator(agg, device: DeviceAgent) -> tuple[Worker, str]:
    """Stop the aggregator, then trigger an update: (its worker, the pending upload's msg_id),
    once the upload is on disk and sent, awaiting a reply that only the test can forge (a
    reply before the send would be unexpected)."""
    agg.stop()
    device.trigger()
    worker = Worker(device)
    worker.start()
    wait_for(lambda: device.state.pending is not None, 120, "the pending upload")
    pending_id = device.state.pending.msg_id
    wait_for(lambda: device.agent.awaiting(pending_id), 120, "the upload awaiting its reply")
    return worker, pending_id


def test_malformed_downlink_is_refused_and_model_kept(mosquitto, aggregator, tmp_path) -> None:
    cfg = make_cfg(mosquitto.url, tmp_path)
    agg = aggregator(cfg)
    rng = np.random.default_rng(2)
    _, pools = rotated_pools(cfg, rng, 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.5, 0.5], seed=4)).start()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    agent_log = logging.getLogger("fedmq.agent")
    old_level = agent_log.level
    agent_log.addHandler(handler)
    agent_log.setLevel(logging.INFO)
    forger = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="forger")
    forger.connect("127.0.0.1", mosquitto.port)
    forger.loop_start()
    down = protocol.downlink(FLEET, device.agent_id)
    try:
        before = device.state.vector.clone()
        # 1. Not an envelope at all.
        forger.publish(down, b"\x93not msgpack", qos=1).wait_for_publish(5)
        wait_for(lambda: device.agent.counters["errors"] >= 1, 120, "the refusal of garbage")
        # 2. A well-formed Model answering the pending upload, but a delta against another base.
        worker, pending_id = upload_with_no_aggregator(agg, device)
        other_base = np.random.default_rng(0).normal(size=SPEC.numel).astype(np.float32)
        forged = protocol.Model(agent=device.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                epoch=7, model=SPEC.hash, in_reply_to=pending_id,
                                tensors=[codecs.encode(other_base * 1.1, "int8", base=other_base)])
        forger.publish(down, protocol.encode(forged), qos=1).wait_for_publish(5)
        wait_for(lambda: device.agent.counters["rejected"] >= 1, 120, "the refusal of the forged model")
        assert torch.equal(device.state.vector, before) and device.tau == 0
        assert torch.equal(device.agent.installed.vector, before)
        assert device.state.pending is not None  # still waiting for the real reply
        # 3. The real aggregator comes back: its reply is installed.
        agg.start()
        assert worker.result().outcome == "installed"
        assert device.tau == 1 and device.state.pending is None
        assert not torch.equal(device.state.vector, before)
    finally:
        agent_log.removeHandler(handler)
        agent_log.setLevel(old_level)
        forger.disconnect()
        forger.loop_stop()
        device.close()
    reasons = {r.getMessage(): r.__dict__.get("fields", {}).get("reason") for r in records}
    assert reasons.get("downlink.refused") == "malformed", reasons
    assert reasons.get("downlink.rejected") == "codec_base_mismatch", reasons


def test_refused_upload_is_counted_by_reason_and_the_model_kept(mosquitto, aggregator, tmp_path) -> None:
    """A refusal that needs no re-join (here `loss_outlier`, answered by a raw client while the
    aggregator is down, so no real reply races it): the upload is dropped, the model kept, the
    refusal counted by reason in the counters, status() and the retained status."""
    cfg = make_cfg(mosquitto.url, tmp_path)
    agg = aggregator(cfg)
    _, pools = rotated_pools(cfg, np.random.default_rng(5), 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.5, 0.5], seed=6)).start()
    forger = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="refuser")
    forger.connect("127.0.0.1", mosquitto.port)
    forger.loop_start()
    try:
        before = device.state.vector.clone()
        worker, pending_id = upload_with_no_aggregator(agg, device)
        refusal = protocol.Error(agent=device.agent_id, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 reason="loss_outlier", detail="update raises the best proxy loss",
                                 in_reply_to=pending_id)
        forger.publish(protocol.downlink(FLEET, device.agent_id), protocol.encode(refusal),
                       qos=1).wait_for_publish(5)
        cycle = worker.result(120)
        assert cycle.outcome == "dropped" and cycle.refused == "loss_outlier"
        assert device.counters["refused"] == 1 and device.counters["refused.loss_outlier"] == 1
        assert "rejoins" not in device.counters
        assert device.state.pending is None and device.tau == 0
        assert torch.equal(device.state.vector, before)
        assert device.status()["counters"]["refused.loss_outlier"] == 1
        device.step()  # and goes on
        with FleetWatcher(cfg) as watcher:
            watcher.settle()
            _, agents = watcher.snapshot()
        (me,) = [p for p in agents if p.name == device.agent_id]
        assert me.counters.get("refused.loss_outlier") == 1, me.counters
        device.close()
        assert AgentState.load(cfg.agent.state_dir).counters["refused.loss_outlier"] == 1
    finally:
        forger.disconnect()
        forger.loop_stop()
        device.close()


class Refuser:
    """A raw client answering every uplink of one agent with a refusal, by message type: stands
    in for an aggregator the agent no longer matches (the real one is down meanwhile)."""

    def __init__(self, port: int, agent: str, reasons: dict[type, str]) -> None:
        self.agent, self.reasons = agent, reasons
        self.answered: list[str] = []
        self.client = subscribed(port, "refuser", protocol.uplink(FLEET, agent), self._on_message)

    def _on_message(self, client, userdata, msg) -> None:
        env = protocol.decode(bytes(msg.payload), max_bytes=1 << 26)
        reason = self.reasons[type(env)]
        self.answered.append(type(env).__name__)
        refusal = protocol.Error(agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 reason=reason, detail="refused by the test", in_reply_to=env.msg_id)
        client.publish(protocol.downlink(FLEET, self.agent), protocol.encode(refusal), qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_refused_join_keeps_the_model_and_the_agent_joins_when_its_next_update_is_due(
        mosquitto, aggregator, tmp_path) -> None:
    """A refusal that asks for a re-join (`unknown_agent`), then the join itself refused
    (`wrong_model`, as from an aggregator that now runs another model): an outcome, not a crash.
    The agent keeps predicting with the model it held, counts the refusal, and joins again when
    its next update is due; once the real aggregator is back that join and upload go through."""
    # Speed only: the stopped aggregator's session keeps what the stand-in answered, so back, it
    # may refuse the agent's next join (rate_limited) and the agent waits one reply timeout: 5 s, not 20.
    cfg = make_cfg(mosquitto.url, tmp_path, **{"agent.reply_timeout_s": 5})
    agg = aggregator(cfg)
    _, pools = rotated_pools(cfg, np.random.default_rng(9), 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.5, 0.5], seed=10)).start()
    refuser = None
    try:
        before = device.state.vector.clone()
        agg.stop()
        refuser = Refuser(mosquitto.port, device.agent_id,
                          {protocol.Update: "unknown_agent", protocol.Join: "wrong_model"})
        device.trigger()
        cycle = step_until_cycle(device)
        assert cycle.outcome == "resynced" and cycle.refused == "unknown_agent"
        assert device.counters["join_refused"] == 1 and device.counters["join_refused.wrong_model"] == 1
        assert device.state.pending is None and device.tau == 0
        assert torch.equal(device.state.vector, before)  # still the model it predicts with
        assert device.status()["counters"]["join_refused.wrong_model"] == 1
        # The next due update asks to join first: refused again, so nothing is trained or sent.
        device.trigger()
        for _ in range(200):
            assert device.step() is None
            if device.counters["join_refused"] == 2:
                break
        assert device.counters["join_refused"] == 2, device.counters
        assert refuser.answered == ["Update", "Join", "Join"]
        refuser.close()
        refuser = None
        agg.start()
        device.trigger()
        cycle = step_until_cycle(device)
        assert cycle.outcome == "installed" and device.tau >= 1
        assert device.counters["join_refused"] == 2 and device.counters["uploads"] == 1
        assert AgentState.load(cfg.agent.state_dir).counters["join_refused.wrong_model"] == 2
    finally:
        if refuser is not None:
            refuser.close()
        device.close()


def test_a_diverged_training_sends_nothing_and_the_agent_joins_again_at_its_next_update(
        mosquitto, aggregator, tmp_path) -> None:
    """A local training that ends in NaN is an outcome: nothing is sent, the held model stays,
    and the next due update starts with a join instead of retraining the model that diverged."""
    cfg = make_cfg(mosquitto.url, tmp_path, **{"agent.lr": 1e30, "agent.rho": 0.0})  # why: an absurd rate diverges
    aggregator(cfg)
    _, pools = rotated_pools(cfg, np.random.default_rng(11), 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.5, 0.5], seed=12)).start()
    try:
        before = device.state.vector.clone()
        joins = device.agent.counters["joins"]
        device.trigger()
        cycle = step_until_cycle(device)
        assert cycle.outcome == "diverged" and device.counters["train_diverged"] == 1, cycle
        assert device.state.pending is None and not device.counters.get("uploads")
        assert torch.equal(device.state.vector, before) and device.agent.counters["joins"] == joins
        device.trigger()
        cycle = step_until_cycle(device)  # joins first, then trains from the join's model: diverges again
        assert device.agent.counters["joins"] == joins + 1 and cycle.outcome == "diverged", cycle
        assert device.counters["train_diverged"] == 2 and not device.counters.get("uploads")
    finally:
        device.close()


def test_aggregator_that_lost_its_state_refuses_and_the_agent_joins_again(mosquitto, aggregator, pretrained,
                                                                          tmp_path) -> None:
    """An aggregator restarted without its state no longer knows the agent (`unknown_agent`): the
    upload is dropped, counted by reason, the agent joins again and its next cycle is applied."""
    cfg = make_cfg(mosquitto.url, tmp_path)
    agg = aggregator(cfg)
    _, pools = rotated_pools(cfg, np.random.default_rng(7), 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.6, 0.4], seed=8)).start()
    try:
        assert device.tau == 0
        agg.stop()
        shutil.rmtree(cfg.aggregator.state_dir)
        shutil.copytree(pretrained, cfg.aggregator.state_dir)
        agg.start()
        device.trigger()
        cycle = step_until_cycle(device)
        assert cycle.outcome == "resynced" and cycle.refused == "unknown_agent"
        assert device.counters["refused.unknown_agent"] == 1 and device.counters["rejoins"] == 1
        assert agg.svc.engine.counters["rejected.unknown_agent"] == 1
        assert agg.svc.engine.counters["applied.join"] == 1
        again = step_until_cycle(device)  # the re-join asked for a new cycle: trained anew
        assert again.outcome == "installed" and device.tau == 1
        assert agg.svc.engine.counters["applied.update"] == 1
        assert device.counters["refused"] == 1
    finally:
        device.close()


def test_broker_restart_mid_upload_cycle_completes(mosquitto, aggregator, tmp_path) -> None:
    cfg = make_cfg(mosquitto.url, tmp_path, **{"broker.reconnect_min_s": 0.1, "broker.reconnect_max_s": 0.5})
    agg = aggregator(cfg)
    rng = np.random.default_rng(3)
    _, pools = rotated_pools(cfg, rng, 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.7, 0.3], seed=5)).start()
    try:
        for _ in range(10):  # fill the buffer while connected
            device.step()
        mosquitto.stop()
        device.trigger()
        worker = Worker(device)
        worker.start()
        wait_for(lambda: device.state.pending is not None, 120, "the pending upload")
        time.sleep(0.5)
        restart_broker(mosquitto)
        assert worker.result().outcome == "installed"
        assert device.tau == 1 and device.state.pending is None
        assert agg.svc.engine.counters["applied.update"] == 1
    finally:
        device.close()


def restart_broker(broker) -> None:
    deadline = time.monotonic() + 10
    while True:  # the old socket may linger briefly
        try:
            broker.start()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# ---------------------------------------------------------------------------------- subprocess


def start_agent(cfg: Config, log: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "fedmq.cli", "agent", "--broker", cfg.broker.url, "--fleet", FLEET,
            "--id", cfg.agent.id, "--state-dir", cfg.agent.state_dir, "--dataset", "digits",
            "--clusters", "2", "--log-level", "info", *extra]
    for k, v in {**SERVER, **AGENT}.items():
        if k.startswith(("agent.", "data.", "protocol.")):
            args += ["--set", f"{k}={v}"]
    return subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT)


def saved_state(cfg: Config) -> AgentState | None:
    try:
        return AgentState.load(cfg.agent.state_dir)
    except Exception:  # noqa: BLE001 - mid-write on first creation; poll again
        return None


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout)


@pytest.mark.slow
def test_agent_killed_mid_cycle_keeps_tau_and_resends_pending_once(mosquitto, aggregator, tmp_path) -> None:
    cfg = make_cfg(mosquitto.url, tmp_path, **{"agent.reply_timeout_s": 120})
    agg = aggregator(cfg)
    sniffer = Sniffer(mosquitto.port)
    log = tmp_path / "agent.log"
    proc = start_agent(cfg, log, "--set", "agent.reply_timeout_s=120")
    try:
        wait_for(lambda: (s := saved_state(cfg)) is not None and s.tau == 0, 60, "the join")
        agg.stop()  # no reply will come: the upload stays pending
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: (s := saved_state(cfg)) is not None and s.pending is not None, 60, "a pending upload")
        wait_for(lambda: len(sniffer.updates()) == 1, 120, "the upload on the wire")
        pending = saved_state(cfg).pending
        stop(proc, signal.SIGKILL)  # mid-cycle, no goodbye

        agg.start()
        proc = start_agent(cfg, log, "--set", "agent.reply_timeout_s=120")
        wait_for(lambda: (s := saved_state(cfg)) is not None and s.tau == 1 and s.pending is None,
                 60, "the reply installed after the restart")
        assert stop(proc) == 0
    finally:
        stop(proc, signal.SIGKILL)
        sniffer.close()
    sent = [(env, payload) for env, payload in sniffer.updates() if env.msg_id == pending.msg_id]
    assert len(sent) == 2, f"sent before the kill and re-sent once after: {len(sent)}\n{log.read_text()[-3000:]}"
    assert sent[0][1] == sent[1][1] == pending.payload  # byte for byte, same msg_id, same tau
    assert sent[1][0].tau == 0
    assert len(sniffer.updates()) == 2  # no other upload
    engine = agg.svc.engine
    assert engine.counters["applied.update"] == 1 and engine.strategy.uploads_applied == 1


@pytest.mark.slow
def test_sigterm_during_training_keeps_upload_and_sends_it_once_after_restart(mosquitto, aggregator,
                                                                                tmp_path) -> None:
    cfg = make_cfg(mosquitto.url, tmp_path)
    agg = aggregator(cfg)
    sniffer = Sniffer(mosquitto.port)
    log = tmp_path / "agent.log"
    # Long training (many epochs) so that SIGTERM lands inside it.
    proc = start_agent(cfg, log, "--update-now", "--set", "agent.epochs=400", "--set", "agent.max_train_seconds=0")
    try:
        wait_for(lambda: "train.started" in log.read_text(), 60, "training to start")
        time.sleep(0.3)
        assert stop(proc) == 0
        text = log.read_text()
        assert "upload.deferred" in text, text[-3000:]
        pending = AgentState.load(cfg.agent.state_dir).pending
        assert pending is not None
        assert sniffer.updates() == []  # nothing was sent before the exit
        wait_for(lambda: agg.svc.presence.get(cfg.agent.id) == "offline", 120, "the offline status")

        proc = start_agent(cfg, log)
        wait_for(lambda: (s := saved_state(cfg)) is not None and s.tau == 1 and s.pending is None,
                 60, "the pending upload answered after the restart")
        assert stop(proc) == 0
    finally:
        stop(proc, signal.SIGKILL)
        sniffer.close()
    sent = [payload for env, payload in sniffer.updates() if env.msg_id == pending.msg_id]
    assert sent == [pending.payload], log.read_text()[-3000:]
    engine = agg.svc.engine
    assert engine.counters["applied.update"] == 1 and engine.counters["duplicates"] == 0


def test_fedsoft_async_agent_estimates_alpha_locally_and_gets_all_clusters(mosquitto, tmp_path) -> None:
    cfg = make_cfg(mosquitto.url, tmp_path, **{"aggregator.algorithm": "fedsoft-async",
                                               "agent.algorithm": "fedsoft-async"})
    agg = Aggregator(cfg)  # fresh state dir: pre-trains its own cluster models
    agg.start()
    rng = np.random.default_rng(6)
    _, pools = rotated_pools(cfg, rng, 300)
    device = DeviceAgent(cfg, DatasetSource(pools, [0.0, 1.0], seed=7)).start()
    try:
        assert device.agent.installed.kind == "clusters" and len(device.agent.installed.clusters) == 2
        device.trigger()
        cycle = step_until_cycle(device)
        assert cycle.outcome == "installed" and device.tau == 1
        assert cycle.alpha is not None and cycle.alpha[1] > 0.8  # all its data is cluster 1
        assert cycle.installed.kind == "clusters"
        strategy = agg.svc.engine.strategy.state_dict()
        assert agg.svc.engine.counters["applied.update"] == 1 and strategy["epoch"] == 1
    finally:
        device.close()
        agg.stop()


def test_an_agent_or_aggregator_whose_offline_status_fails_still_disconnects(mosquitto, aggregator,
                                                                           tmp_path) -> None:
    """stop() closes the connection even when the status publish raises: a transport left
    open reconnects on its own and takes the session back from the next client of its id."""
    from fedmq.transport import TransportError

    def refused(*_args, **_kwargs):
        raise TransportError("publish to the status topic failed: not authorized")

    cfg = make_cfg(mosquitto.url, tmp_path, agent_id="car-stop")
    agg = aggregator(cfg)
    agent = EdgeAgent(cfg, "car-stop").start(timeout=60)
    for name, stop, transport in (("agent", agent.stop, agent.transport), ("aggregator", agg.stop, agg.svc.transport)):
        publish = transport.publish
        transport.publish = refused  # the broker's refusal, as a reason code would raise it
        with pytest.raises(TransportError, match="not authorized"):
            stop()
        assert not transport.connected, name
        with pytest.raises(TransportError, match="closed transport"):
            publish("x/y", b"", qos=1)


def test_agents_of_two_fleets_with_one_name_keep_a_session_each(mosquitto, tmp_path):
    """Two fleets on one development broker (docker-compose.fleets.yml), each with a car-1: each
    agent keeps its connection. With one client id the broker drops the older client, and the
    two take the session from each other for as long as both run."""
    dropped: list[str] = []
    agents: list[EdgeAgent] = []
    try:
        for fleet in ("garage", "phones"):
            agent = EdgeAgent(make_cfg(mosquitto.url, tmp_path / fleet, fleet=fleet), "car-1")
            agent.transport.on_disconnect_hooks.append(lambda _t, _why, fleet=fleet: dropped.append(fleet))
            agents.append(agent.start(timeout=60))
        # A round trip through each after both are connected: a dropped client has noticed by
        # the time its own message comes back.
        for agent in agents:
            echoed = threading.Event()
            topic = f"test/{agent.fleet}/echo"
            agent.transport.subscribe(topic, lambda _msg, echoed=echoed: echoed.set(), qos=1, timeout=60)
            agent.transport.publish(topic, b"x", qos=1)
            assert echoed.wait(60), agent.fleet
        assert dropped == []
        assert len({a.transport.client_id for a in agents}) == 2
    finally:
        for agent in agents:
            agent.stop()
