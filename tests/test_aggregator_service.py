"""The aggregator over a real Mosquitto, driven by raw MQTT clients.

join -> model; update -> personalized model; bad uploads -> error reply and unchanged state;
a replayed msg_id -> applied once; kill -9 during a burst -> every upload applied exactly once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.journal import Journal
from aggregator.service import AggregatorService
from fedmq import codecs, protocol
from fedmq.config import Config, load_config
from fedmq.models import model_spec
from fedmq.transport import Message
from tests.raw_agent import RawAgent

FLEET = "t"
SPEC = model_spec("digits-cnn")
# Speed only: small server sets so each aggregator starts in a second or two; the defaults
# start the aggregator in test_documented_commands.
SMALL = {
    "fleet": FLEET, "cdfl.clusters": 2, "data.dataset": "digits", "data.proxy_per_cluster": 150,
    "data.pretrain_per_cluster": 300, "aggregator.pretrain_epochs": 2, "device": "cpu",
    "protocol.chunk_bytes": 64 * 1024, "protocol.max_message_bytes": 256 * 1024,
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A state dir with pre-trained cluster models, copied by each test (pre-training once)."""
    state = tmp_path_factory.mktemp("pretrained") / "state"
    cfg = load_config(None, {**SMALL, "aggregator.state_dir": str(state)})
    engine = build_engine(cfg)
    engine.recover()  # writes the first snapshot
    engine.journal.close()
    return state


def make_cfg(broker_url: str, state: Path, **extra) -> Config:
    return load_config(None, {**SMALL, "broker.url": broker_url, "aggregator.state_dir": str(state),
                              **extra})


@pytest.fixture
def service(mosquitto, pretrained, tmp_path):
    with started_service(mosquitto, pretrained, tmp_path) as svc:
        yield svc


@contextlib.contextmanager
def started_service(mosquitto, pretrained: Path, tmp_path: Path, **extra) -> Iterator[AggregatorService]:
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    cfg = make_cfg(mosquitto.url, state, **extra)
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        yield svc


def clusters_of(svc: AggregatorService) -> list[torch.Tensor]:
    return [c.clone() for c in svc.engine.strategy.state_dict()["clusters"]]


def test_join_then_update_gets_personalized_model(service, mosquitto) -> None:
    a = RawAgent(mosquitto.port, FLEET, "car-1")
    try:
        joined = a.join(SPEC.hash)
        assert joined.kind == "personalized" and joined.epoch == 0
        assert joined.alpha is not None and np.allclose(joined.alpha, [0.5, 0.5])
        assert a.base.shape == (SPEC.numel,) and np.isfinite(a.base).all()
        v = a.base + np.random.default_rng(0).normal(0, 0.01, SPEC.numel).astype(np.float32)
        up = a.update_envelope(v, SPEC.hash)
        a.send(up)
        reply = a.expect(up.msg_id)
        assert isinstance(reply, protocol.Model), reply
        assert reply.epoch == 1
        assert reply.alpha is not None and abs(sum(reply.alpha) - 1) < 1e-6
        assert min(reply.alpha) >= 0
        a.install(reply)
        assert service.engine.counters["applied.update"] == 1
    finally:
        a.close()


def _nan_update(a: RawAgent) -> protocol.Update:
    bad = np.zeros(SPEC.numel, dtype=np.float32)
    bad[3] = np.nan
    wire = codecs.encode(np.zeros(SPEC.numel, dtype=np.float32), "fp32", zstd=False)
    wire["data"] = bad.tobytes()  # a codec never emits NaN; a hostile sender can
    return protocol.Update(agent=a.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                           model=SPEC.hash, tau=0, tensor=wire, n_samples=1)


def test_bad_uploads_get_errors_and_change_nothing(service, mosquitto) -> None:
    a = RawAgent(mosquitto.port, FLEET, "car-2")
    try:
        a.join(SPEC.hash)
        before = clusters_of(service)
        epoch = service.engine.strategy.uploads_applied
        cases: list[tuple[str, bytes, str]] = []

        ok = a.update_envelope(a.base, SPEC.hash)
        wrong_shape = protocol.Update(**{**ok.__dict__, "msg_id": protocol.new_msg_id(),
                                         "tensor": codecs.encode(np.zeros(10, np.float32), "fp32")})
        cases.append(("wrong_shape", protocol.encode(wrong_shape), wrong_shape.msg_id))
        nan = _nan_update(a)
        cases.append(("codec_not_finite", protocol.encode(nan), nan.msg_id))
        wrong_spec = protocol.Update(**{**ok.__dict__, "msg_id": protocol.new_msg_id(), "model": "0" * 16})
        cases.append(("wrong_model", protocol.encode(wrong_spec), wrong_spec.msg_id))
        future = protocol.Update(**{**ok.__dict__, "msg_id": protocol.new_msg_id(), "tau": 999})
        cases.append(("bad_tau", protocol.encode(future), future.msg_id))
        readable = msgpack.unpackb(protocol.encode(protocol.Update(**{**ok.__dict__, "msg_id": protocol.new_msg_id()})))
        readable["tau"] = -5  # decodes as msgpack, fails the envelope's rules: named in in_reply_to
        cases.append(("bad_field", msgpack.packb(readable, use_bin_type=True), readable["msg_id"]))
        cases.append(("malformed", b"\x93not msgpack at all", ""))
        oversize = msgpack.packb({"v": 1, "type": "update", "pad": b"x" * (300 * 1024)})
        cases.append(("too_large", oversize, ""))

        for reason, payload, msg_id in cases:
            a.publish_raw(payload)
            err = a.expect(msg_id)
            assert isinstance(err, protocol.Error), (reason, err)
            assert err.reason == reason, (reason, err.reason, err.detail)
            assert err.detail

        stranger = RawAgent(mosquitto.port, FLEET, "never-joined")
        try:
            up = protocol.Update(agent="never-joined", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 model=SPEC.hash, tau=0, n_samples=1,
                                 tensor=codecs.encode(np.zeros(SPEC.numel, np.float32), "fp32"))
            stranger.send(up)
            assert stranger.expect(up.msg_id).reason == "unknown_agent"
        finally:
            stranger.close()

        after = clusters_of(service)
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        assert service.engine.strategy.uploads_applied == epoch
        assert service.engine.counters["applied.update"] == 0
    finally:
        a.close()


def test_same_msg_id_twice_is_applied_once(service, mosquitto) -> None:
    a = RawAgent(mosquitto.port, FLEET, "car-3")
    try:
        a.join(SPEC.hash)
        up = a.update_envelope(a.base * 1.01, SPEC.hash)
        a.send(up)
        first = a.expect(up.msg_id)
        a.send(up)  # e.g. re-sent after a reconnect
        second = a.expect(up.msg_id)
        assert isinstance(first, protocol.Model) and isinstance(second, protocol.Model)
        assert second.epoch == first.epoch == 1
        assert service.engine.counters["applied.update"] == 1
        assert service.engine.counters["duplicates"] == 1
    finally:
        a.close()


def _start_aggregator(url: str, state: Path, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "fedmq.cli", "aggregator", "--broker", url, "--state-dir", str(state),
            "--log-level", "info"]
    # Speed only: replies trained in a few steps, not 128 (the kill tests are about delivery).
    for k, v in {**SMALL, "aggregator.snapshot_every": 7, "cdfl.personalize_epochs": 1,
                 "cdfl.personalize_min_steps": 0}.items():
        args += ["--set", f"{k}={v}"]
    return subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.slow
def test_kill_9_during_burst_applies_every_upload_exactly_once(mosquitto, pretrained, tmp_path) -> None:
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    log = tmp_path / "aggregator.log"
    proc = _start_aggregator(mosquitto.url, state, log)
    agents = [RawAgent(mosquitto.port, FLEET, f"burst-{i}") for i in range(6)]
    rounds = 4
    sent: list[str] = []
    lock = threading.Lock()
    failures: list[str] = []

    def agent_loop(a: RawAgent) -> None:
        try:
            join = protocol.Join(agent=a.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 model=SPEC.hash, algorithm="cdfl")
            reply = _send_until_answered(a, join)
            a.install(reply)
            rng = np.random.default_rng(abs(hash(a.agent)) % 2**32)
            for _ in range(rounds):
                v = a.base + rng.normal(0, 0.01, SPEC.numel).astype(np.float32)
                up = a.update_envelope(v, SPEC.hash)
                with lock:
                    sent.append(up.msg_id)
                reply = _send_until_answered(a, up)
                assert isinstance(reply, protocol.Model), (f"{type(reply).__name__} {getattr(reply, 'reason', '')}: "
                                                           f"{getattr(reply, 'detail', '')}")
                a.install(reply)
        except Exception as e:  # noqa: BLE001 (reported below)
            failures.append(f"{a.agent}: {e!r}")

    threads = [threading.Thread(target=agent_loop, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    kills = 0
    try:
        for _ in range(3):  # kill -9 while uploads are in flight, restart, repeat
            deadline = time.monotonic() + 60
            while len(sent) < (kills + 1) * 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
            proc = _start_aggregator(mosquitto.url, state, log)
        for t in threads:
            t.join(timeout=120)
        assert not failures, failures + [log.read_text()[-3000:]]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        for a in agents:
            a.close()
    assert kills == 3
    assert len(sent) == len(agents) * rounds
    # The journal (snapshots every 7 records) plus the final epoch tell what was applied.
    snapshot, records = Journal(state).load()
    assert snapshot["strategy"]["epoch"] + sum(r["op"] == "update" for r in records) == len(sent)
    applied = snapshot["counters"].get("applied.update", 0) + sum(r["op"] == "update" for r in records)
    assert applied == len(sent), "an upload was lost or applied twice"
    ids = [r["msg_id"] for r in records if r["op"] == "update"]
    assert len(ids) == len(set(ids))


def _send_until_answered(a: RawAgent, env: protocol.Envelope, tries: int = 20) -> protocol.Envelope:
    """What a real agent does: the same msg_id again until a reply comes (the aggregator may be down)."""
    for _ in range(tries):
        a.send(env)
        try:
            return a.expect(env.msg_id, timeout=6)
        except TimeoutError:
            continue
    raise TimeoutError(f"{a.agent}: {env.msg_id} never answered")


if os.environ.get("FEDMQ_KEEP"):  # pragma: no cover - debugging aid
    pass


@pytest.mark.parametrize("algorithm", ["fedsoft-async", "fedasync"])
def test_baselines_over_the_broker(mosquitto, tmp_path, algorithm: str) -> None:
    """FedSoft-Async sends all K models and takes the agent's alpha; FedAsync one global model."""
    cfg = make_cfg(mosquitto.url, tmp_path / "state", **{"aggregator.algorithm": algorithm,
                                                         "aggregator.accuracy_every": 0})
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        a = RawAgent(mosquitto.port, FLEET, "phone-1")
        try:
            join = protocol.Join(agent=a.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 model=SPEC.hash, algorithm=algorithm)
            a.send(join)
            got = a.expect(join.msg_id)
            assert isinstance(got, protocol.Model)
            if algorithm == "fedsoft-async":
                assert got.kind == "clusters" and len(got.tensors) == 2
                assert not any(w["delta"] for w in got.tensors)
                models = [codecs.decode(w) for w in got.tensors]
                v = 0.5 * (models[0] + models[1])
                bad = protocol.Update(agent=a.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                      model=SPEC.hash, tau=got.epoch, n_samples=10, alpha=[0.9, 0.9],
                                      tensor=codecs.encode(v, "fp32"))
                a.send(bad)
                err = a.expect(bad.msg_id)
                assert isinstance(err, protocol.Error) and err.reason == "bad_alpha", err
                before = clusters_of(svc)
                up = protocol.Update(agent=a.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                     model=SPEC.hash, tau=got.epoch, n_samples=10, alpha=[0.75, 0.25],
                                     tensor=codecs.encode(v, "int8"))
                a.send(up)
                reply = a.expect(up.msg_id)
                assert reply.kind == "clusters" and reply.epoch == 1
                after = clusters_of(svc)
                # Cluster 0 moved 3x as far toward v as cluster 1 (beta = beta0 * alpha_k).
                moved = [float((x - y).norm()) for x, y in zip(after, before, strict=True)]
                d = [float((torch.from_numpy(v) - y).norm()) for y in before]
                assert moved[0] / d[0] == pytest.approx(3 * moved[1] / d[1], rel=0.05)
            else:
                assert got.kind == "global" and len(got.tensors) == 1
                a.install(got)
                up = a.update_envelope(a.base + 0.01, SPEC.hash)
                a.send(up)
                reply = a.expect(up.msg_id)
                assert reply.kind == "global" and reply.epoch == 1
            assert svc.engine.counters["applied.update"] == 1
            assert len(svc.engine.cluster_accuracy) == 2
            assert all(0.0 <= acc <= 1.0 for acc in svc.engine.cluster_accuracy)
        finally:
            a.close()


def test_a_message_that_breaks_the_strategy_is_refused_and_the_queue_moves_on(service, mosquitto) -> None:
    """A poison message must not wedge the service (unacked messages block the broker's window)."""
    a = RawAgent(mosquitto.port, FLEET, "car-poison")
    try:
        a.join(SPEC.hash)
        real = service.engine.strategy.update_many

        def breaks_on_poison(uploads):
            if any(u.n_samples == 666 for u in uploads):
                raise RuntimeError("an input no check foresaw")
            return real(uploads)

        service.engine.strategy.update_many = breaks_on_poison
        poison = protocol.Update(**{**a.update_envelope(a.base, SPEC.hash).__dict__, "n_samples": 666})
        refused_then_applied(service, a, poison, "internal_error")
    finally:
        a.close()


def refused_then_applied(svc: AggregatorService, a: RawAgent, up: protocol.Update, reason: str) -> None:
    """`up` is refused with `reason` and changes nothing; the agent's next upload is applied."""
    before = clusters_of(svc)
    a.send(up)
    err = a.expect(up.msg_id)
    assert isinstance(err, protocol.Error) and err.reason == reason, err
    assert all(torch.equal(x, y) for x, y in zip(before, clusters_of(svc), strict=True))
    assert svc.engine.strategy.uploads_applied == 0 and svc.counters[f"refused.{reason}"] == 1
    good = a.update_envelope(a.base + 0.01, SPEC.hash)
    a.send(good)
    assert isinstance(a.expect(good.msg_id), protocol.Model)
    assert svc.engine.counters["applied.update"] == 1


def test_finite_values_that_overflow_the_models_are_refused_not_finite(service, mosquitto) -> None:
    """1e20 passes every codec check and overflows the reply's forward pass: the upload is
    refused `not_finite` (an outcome, not internal_error), nothing of it is kept, and the
    agent's next upload is applied."""
    a = RawAgent(mosquitto.port, FLEET, "car-huge")
    try:
        a.join(SPEC.hash)
        huge = a.base.copy()
        huge[123] = 1e20
        refused_then_applied(service, a, a.update_envelope(huge, SPEC.hash, codec="fp32"), "not_finite")
        assert service.counters["refused.internal_error"] == 0
    finally:
        a.close()


def test_a_flooding_agent_neither_starves_nor_stales_another(service, mosquitto) -> None:
    """car-2 fires 20 valid updates at once before each of car-1's (a 20x rate): car-1 is
    answered every time, none of its updates is judged stale (staleness counts each agent at
    most once), and car-2's excess beyond its queue quota is refused `rate_limited` at once.
    The latency figures, with and without the flood, are in soak/flood_fairness.py."""
    honest, flooder = RawAgent(mosquitto.port, FLEET, "car-1"), RawAgent(mosquitto.port, FLEET, "car-2")
    seen: list[dict] = []
    all_three = threading.Event()
    record = service.progress.applied

    def applied(batch: list[dict]) -> None:  # the worker reports a batch after sending its replies
        seen.extend(batch)
        if sum(a["agent"] == "car-1" for a in seen) >= 3:
            all_three.set()
        record(batch)

    service.progress.applied = applied
    try:
        honest.join(SPEC.hash)
        flooder.join(SPEC.hash)
        for i in range(3):
            # Whole vectors: each is valid although car-2 installs none of the replies.
            flood = [flooder.update_envelope(flooder.base * (1 + 0.001 * j), SPEC.hash, delta=False)
                     for j in range(20)]
            for env in flood:
                flooder.send(env)
            up = honest.update_envelope(honest.base * (1.0 + 0.01 * (i + 1)), SPEC.hash)
            honest.send(up)
            reply = honest.expect(up.msg_id, timeout=120)
            assert isinstance(reply, protocol.Model), reply
            honest.install(reply)
        assert all_three.wait(120)
        mine = [a for a in seen if a["agent"] == "car-1"]
        assert len(mine) == 3 and not any(a["stale"] for a in mine), mine
        assert max(a["staleness"] for a in mine) <= 2  # 1 + car-2, however often it uploaded
        assert service.counters["refused.rate_limited"] > 0
        assert service.engine.counters["applied.update"] > 3  # car-2's were applied too, not refused as invalid
    finally:
        honest.close()
        flooder.close()


@pytest.mark.slow
def test_retained_status_follows_the_epoch(mosquitto, pretrained, tmp_path) -> None:
    """The retained online status was published once at connect, so a device joining later read
    that epoch; now it is re-published (at most every aggregator.status_every_s) when it moves."""
    # Speed only: re-published within 1 s of the move, not the default 10 (the same path).
    with started_service(mosquitto, pretrained, tmp_path, **{"aggregator.status_every_s": 1}) as service:
        _status_follows_the_epoch(service, mosquitto)


def _status_follows_the_epoch(service: AggregatorService, mosquitto) -> None:
    a = RawAgent(mosquitto.port, FLEET, "car-5")
    watcher = RawAgent(mosquitto.port, FLEET, "watcher")
    got = threading.Event()
    try:
        a.join(SPEC.hash)
        up = a.update_envelope(a.base * 1.01, SPEC.hash)
        a.send(up)
        assert isinstance(a.expect(up.msg_id), protocol.Model)

        def on_status(client, userdata, msg) -> None:
            env = protocol.decode(msg.payload, max_bytes=1 << 20)
            if env.state == "online" and env.epoch >= 1:
                got.set()

        watcher.client.message_callback_add(protocol.aggregator_status(FLEET), on_status)
        watcher.client.subscribe(protocol.aggregator_status(FLEET), qos=1)
        assert got.wait(120), "the retained status never showed the new epoch"
        # Every delivery the aggregator took is acknowledged, its own statuses coming back
        # included: each one left unacked holds a slot of the broker's in-flight window until the
        # aggregator stalls (the RabbitMQ failover soak found this).
        deadline = time.monotonic() + 60
        while service.transport.unacked and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.transport.unacked == 0, f"{service.transport.unacked} deliveries never acknowledged"
    finally:
        a.close()
        watcher.close()


def test_a_second_aggregator_on_the_fleet_stops_instead_of_taking_turns(mosquitto, pretrained, tmp_path) -> None:
    """Both use the fleet's client id (as two `fedmq aggregator` runs would), with the shipped
    defaults. The newcomer reads the fleet's status through its probe connection first, sees
    the running one online and its heartbeat come, and stops with a clear reason before it
    ever takes the session (and with no offline status over the other's). The other serves on."""
    dirs = []
    for name in ("running", "second"):
        shutil.copytree(pretrained, tmp_path / name)
        dirs.append(tmp_path / name)
    running = AggregatorService(make_cfg(mosquitto.url, dirs[0]), build_engine(make_cfg(mosquitto.url, dirs[0])))
    second = AggregatorService(make_cfg(mosquitto.url, dirs[1]), build_engine(make_cfg(mosquitto.url, dirs[1])))
    with running:
        second.start()
        try:
            assert second.sole.failed.wait(60), "the newcomer never stopped"
            assert "another aggregator is live for fleet 't' (heartbeat" in second.sole.failure
        finally:
            second.stop()
        a = RawAgent(mosquitto.port, FLEET, "car-7")
        try:
            a.join(SPEC.hash, timeout=120)  # answered: the running aggregator has its session back
        finally:
            a.close()
        assert running.engine.counters["applied.join"] == 1 and not running.sole.failed.is_set()


def test_a_predecessors_queued_status_does_not_stop_a_restarted_aggregator(service) -> None:
    """After kill -9 the persistent session may still hold the dead process's last online
    status, delivered live to its successor: sent before this start, it is not another
    aggregator. One sent after the start is."""
    from fedmq.transport import Message

    def status(sent_at: float) -> Message:
        env = protocol.Status(agent="aggregator", msg_id=protocol.new_msg_id(), sent_at=sent_at, state="online",
                              role="aggregator", algorithm="cdfl", epoch=3)
        return Message(topic=protocol.aggregator_status(FLEET), payload=protocol.encode(env), qos=1,
                       retain=False, mid=1)

    service._aggregator_status(status(service.sole.started_wall - 5))
    assert not service.sole.failed.is_set()
    service._aggregator_status(status(protocol.now()))
    assert service.sole.failed.is_set() and "another aggregator is online" in service.sole.failure


def test_copies_of_an_answered_join_do_not_use_up_the_agents_quota(mosquitto, pretrained, tmp_path) -> None:
    """An agent re-sends its join while the aggregator is down; after the restart the first copy
    is answered and the agent's update arrives while the other copies still wait: copies count
    once, so the update is queued, not refused `rate_limited` (found by a loaded CI run of the
    kill -9 burst test). Four distinct waiting messages still refuse a fifth."""
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    cfg = make_cfg(mosquitto.url, state)
    svc = AggregatorService(cfg, build_engine(cfg))  # not started: the test fills its inbox
    refused: list[str] = []
    svc._refuse = lambda r: refused.append(r.msg_id)  # the quota's decision, not its reply

    def message(env: protocol.Envelope) -> Message:
        return Message(protocol.uplink(FLEET, "car-9"), protocol.encode(env), qos=1, retain=False, mid=1)

    quota = cfg.aggregator.max_queued_per_agent
    join = protocol.Join(agent="car-9", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                         model=SPEC.hash, algorithm="cdfl")
    for _ in range(quota):
        svc._receive(message(join))
    following = protocol.Join(agent="car-9", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                              model=SPEC.hash, algorithm="cdfl")  # any next uplink: here another join
    svc._receive(message(following))
    assert refused == [] and len(svc._inbox.waiting("car-9")) == quota + 1
    for _ in range(quota - 2):
        svc._receive(message(protocol.Join(agent="car-9", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                           model=SPEC.hash, algorithm="cdfl")))
    assert refused == []  # quota distinct messages waiting now
    extra = protocol.Join(agent="car-9", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                          model=SPEC.hash, algorithm="cdfl")
    svc._receive(message(extra))
    assert refused == [extra.msg_id]


def test_a_restart_restores_the_cluster_accuracy_instead_of_evaluating_before_it_serves(pretrained, tmp_path) -> None:
    """The metric goes into the snapshot with the epoch it was computed at; a restart on the same
    state dir takes it from there (evaluating every cluster model cost a MobileNetV3-small
    aggregator 5 s of its start). A snapshot without it (an older state dir) is evaluated."""
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    cfg = make_cfg("mqtt://127.0.0.1:1", state)  # never connects: the engine alone
    first = build_engine(cfg)
    first.recover()
    first.refresh_cluster_accuracy()
    measured = list(first.cluster_accuracy)
    assert len(measured) == 2
    first.snapshot_if_due(force=True)
    first.journal.close()

    again = build_engine(cfg)
    again.evaluator.accuracy_on = lambda *a: pytest.fail("evaluated again at restart")
    again.recover()
    again.refresh_cluster_accuracy(cfg.aggregator.accuracy_every)
    assert again.cluster_accuracy == measured
    again.journal.close()

    older = tmp_path / "older"
    shutil.copytree(pretrained, older)  # its snapshot was written before any accuracy
    engine = build_engine(make_cfg("mqtt://127.0.0.1:1", older))
    engine.recover()
    assert engine.cluster_accuracy == []
    engine.refresh_cluster_accuracy(cfg.aggregator.accuracy_every)
    assert engine.cluster_accuracy == measured
    engine.journal.close()


def test_presence_counts_an_agent_whose_heartbeats_stopped_as_offline(monkeypatch) -> None:
    """Mosquitto publishes no will for a session a reload cuts (a rotated password): an agent
    that renews its status every heartbeat_s and stopped is offline after three missed ones."""
    import time as time_module

    from aggregator.service import AggregatorService
    from fedmq.fleet_status import STALE_HEARTBEATS

    now = [1000.0]
    monkeypatch.setattr(time_module, "monotonic", lambda: now[0])
    svc = object.__new__(AggregatorService)  # only its presence bookkeeping is exercised
    svc._heard = {"car-1": ("online", 60.0, 1000.0), "car-2": ("online", 0.0, 1000.0),
                  "car-3": ("offline", 60.0, 1000.0)}
    assert svc.presence == {"car-1": "online", "car-2": "online", "car-3": "offline"}
    now[0] += STALE_HEARTBEATS * 60.0 + 1
    assert svc.presence == {"car-1": "offline", "car-2": "online", "car-3": "offline"}
