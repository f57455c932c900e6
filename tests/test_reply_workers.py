"""Reply workers (docs/scaling.md): CDFL's trained replies made by `fedmq worker` processes over a
real Mosquitto, the aggregator staying the single writer (aggregator/reply_pool.py).

The writer side here is a CDFL strategy built from the same config as the workers (the
proxy sets a worker draws); its replies are compared with the same strategy's replies made
in-process, upload for upload."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import msgpack
import pytest
import torch

from aggregator.cdfl import CDFL
from aggregator.reply_jobs import (
    Done,
    Job,
    JobError,
    WorkerStatus,
    decode_done,
    encode_done,
    encode_job,
    encode_status,
    reply_digest,
)
from aggregator.reply_pool import ReplyPool, pool_broker
from aggregator.reply_worker import ReplyWorker, build_reply_parts
from aggregator.strategy import Upload
from aggregator.worker_cli import LocalWorkers
from fedmq import protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.config import Config
from fedmq.creds import make_credentials
from fedmq.models import build_model, to_vector
from fedmq.transport import MqttTransport, TransportError
from tests.cli_process import ROOT, CliProcess

WAIT_S = 180  # workers import torch and draw the proxy sets: seconds idle, a minute on a loaded CI


def _cfg(broker_url: str, fleet: str) -> Config:
    cfg = Config()
    cfg.broker.url, cfg.fleet = broker_url, fleet
    cfg.cdfl.personalize_epochs = 2  # the default 8 makes each job 4x longer and proves nothing more
    return cfg


def _strategy(cfg: Config) -> CDFL:
    spec, evaluator, personalizer = build_reply_parts(cfg)
    clusters = torch.stack([to_vector(build_model(spec.arch, seed=k)) for k in range(cfg.cdfl.clusters)])
    return CDFL.from_settings(spec, clusters, [], cfg.cdfl, device="cpu", evaluator=evaluator, seed=cfg.seed)


def _uploads(strategy: CDFL, n: int) -> list[Upload]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        base = strategy.clusters[i % strategy.k].clone()
        out.append(Upload(f"agent-{i}", base + 0.01 * torch.randn(base.shape, generator=g), tau=0, base=base,
                          msg_id=f"m{i}"))
    return out


def _worker(cfg: Config, worker_id: str, *extra: str) -> CliProcess:
    argv = ["fedmq", "worker", "--broker", cfg.broker.url, "--fleet", cfg.fleet, "--id", worker_id,
            "--threads", "1", "--set", f"cdfl.personalize_epochs={cfg.cdfl.personalize_epochs}", *extra]
    return CliProcess(argv, cwd=ROOT)


def _pool(strategy: CDFL, cfg: Config, timeout_s: float = 300.0) -> ReplyPool:
    local = strategy.personalizer
    pool = ReplyPool(local, reply_digest(local, strategy.evaluator), cfg.fleet, cfg.broker,
                     numel=strategy.spec.numel, k=strategy.k, timeout_s=timeout_s).start()
    strategy.personalizer = pool
    return pool


def _same_replies(a, b) -> None:
    assert [r.agent for r in a] == [r.agent for r in b]
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x.vectors[0], y.vectors[0], atol=1e-5), x.agent
        assert x.alpha == y.alpha


@pytest.mark.slow
def test_workers_train_the_same_replies_as_the_aggregator_and_share_the_batch(mosquitto) -> None:
    cfg = _cfg(mosquitto.url, "pool")
    here = _strategy(cfg)
    there = copy.deepcopy(here)
    workers = [_worker(cfg, f"w{i}") for i in range(2)]
    pool = _pool(there, cfg)
    try:
        assert pool.wait_for_workers(2, WAIT_S), "\n".join(w.output for w in workers)
        uploads = _uploads(here, 4)
        expected = here.update_many(uploads)
        got = there.update_many(copy.deepcopy(uploads))
        _same_replies(expected, got)
        assert torch.equal(here.clusters, there.clusters)  # the writer's state never left it
        made_by = {r.info["personalize"]["worker"] for r in got}
        assert made_by == {"w0", "w1"}, made_by  # one batch, both workers
        assert pool.counters["replies.remote"] == 4 and pool.counters["replies.local"] == 0
        # cdfl.reply_share: a batch whose alphas all lie within the tolerance is one job, and
        # every member gets the reply a worker trained for the group's mean alpha.
        here.reply_share = there.reply_share = 1.0
        uploads = _uploads(here, 4)
        expected = here.update_many(uploads)
        got = there.update_many(copy.deepcopy(uploads))
        _same_replies(expected, got)
        assert pool.counters["replies.remote"] == 5 and pool.counters["replies.local"] == 0  # one more job
        assert there.counters["replies_shared"] == 3
        assert len({r.info["personalize"]["worker"] for r in got}) == 1
        assert all(torch.equal(r.vectors[0], got[0].vectors[0]) for r in got)
    finally:
        pool.close()
        for w in workers:
            w.stop()


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
@pytest.mark.slow
def test_under_prod_conf_the_pool_and_every_worker_log_in_as_their_own_users(tmp_path) -> None:
    """prod.conf keys sessions by user name (use_username_as_clientid): the reply pool and each
    worker need a login of their own (`fedmq creds --workers 1 --worker box-2`), the aggregator's
    own connection is never taken over, and the ACL keeps agents and other workers off the jobs."""
    fleet = "secure"
    creds = make_credentials(tmp_path / "creds", ["car-1"], workers=["box-2", "box-3"], local_workers=1,
                             fleets=[fleet])
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        def url(user: str) -> str:
            return f"mqtts://{user}:{creds.users()[user]}@127.0.0.1:{broker.port}"

        def login(user: str) -> Config:
            cfg = _cfg(url(user), fleet)
            cfg.broker.ca_file = str(creds.ca_cert)
            return cfg

        cfg = login("aggregator")
        here = _strategy(cfg)
        there = copy.deepcopy(here)
        dropped: list[object] = []
        main = MqttTransport(f"fedmq-aggregator-{fleet}", cfg.broker, clean_start=True)
        main.on_disconnect_hooks.append(lambda _t, reason: dropped.append(reason))
        main.connect(timeout=30)
        local = LocalWorkers(cfg, 1, threads=1)
        assert creds.aggregator_password not in local._env(0)["FEDMQ_WORKER_CONFIG"]
        local.start()
        remote = CliProcess(["fedmq", "worker", "--broker", url("box-2"), "--ca-file", str(creds.ca_cert),
                             "--fleet", fleet, "--threads", "1",
                             "--set", f"cdfl.personalize_epochs={cfg.cdfl.personalize_epochs}"], cwd=ROOT)
        pool = ReplyPool(there.personalizer, reply_digest(there.personalizer, there.evaluator), fleet,
                         pool_broker(cfg.broker), numel=there.spec.numel, k=there.k).start()
        there.personalizer = pool
        agent = MqttTransport("car-1", login("car-1").broker, clean_start=True).connect(30)
        snoop = MqttTransport("box-3", login("box-3").broker, clean_start=True).connect(30)
        overheard: list[str] = []
        try:
            assert pool.wait_for_workers(2, WAIT_S), remote.output[-3000:] + broker.log_tail()
            assert set(pool.workers) == {"aggregator-worker-0", "box-2"}  # ids are their user names
            # An agent announcing itself as a worker is not heard; a worker user is (the control).
            intruder = WorkerStatus("car-1", "online", slots=4, digest=pool.digest, started_at=time.time())
            with pytest.raises(TransportError, match="Not authorized"):  # MQTT 5 says so in the PUBACK
                agent.publish(protocol.worker_status(fleet, "car-1"), encode_status(intruder), qos=1).wait(30)
            snoop.publish(protocol.worker_status(fleet, "box-3"), encode_status(WorkerStatus("box-3", "offline")),
                          qos=1).wait(30)
            deadline = time.monotonic() + WAIT_S
            while "box-3" not in pool.workers and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "box-3" in pool.workers and "car-1" not in pool.workers
            # Another worker's jobs are not delivered to box-3.
            for w in ("aggregator-worker-0", "box-2"):
                snoop.subscribe(protocol.worker_jobs(fleet, w), lambda m: overheard.append(m.topic), qos=1)
            uploads = _uploads(here, 4)
            _same_replies(here.update_many(uploads), got := there.update_many(copy.deepcopy(uploads)))
            assert {r.info["personalize"]["worker"] for r in got} == {"aggregator-worker-0", "box-2"}
            assert pool.counters["replies.remote"] == 4
            time.sleep(1.0)  # stragglers: a job a snoop could read would have been sent with its batch
            assert overheard == []
            assert main.connected and dropped == [], "a second login as the aggregator took its session"
        finally:
            for t in (pool, agent, snoop, main):
                t.close()
            local.stop()
            remote.stop()


@pytest.mark.slow
def test_a_worker_killed_mid_job_costs_a_redispatch_not_a_reply(mosquitto) -> None:
    cfg = _cfg(mosquitto.url, "kill")
    here = _strategy(cfg)
    there = copy.deepcopy(here)
    victim, survivor = _worker(cfg, "victim"), _worker(cfg, "survivor")
    pool = _pool(there, cfg)
    try:
        assert pool.wait_for_workers(2, WAIT_S), victim.output + survivor.output
        uploads = _uploads(here, 4)
        expected = here.update_many(uploads)
        got: list = []
        batch = threading.Thread(target=lambda: got.extend(there.update_many(copy.deepcopy(uploads))))
        batch.start()
        deadline = time.monotonic() + WAIT_S
        while not pool.workers.get("victim") or not pool.workers["victim"].busy:
            assert time.monotonic() < deadline and batch.is_alive(), "the victim never got a job"
            time.sleep(0.005)
        os.killpg(victim.proc.pid, signal.SIGKILL)  # mid-job: its will says offline
        batch.join(WAIT_S)
        assert not batch.is_alive()
        _same_replies(expected, got)
        assert pool.counters["jobs.redispatched"] >= 1
        assert {r.info["personalize"]["worker"] for r in got} <= {"survivor", "aggregator"}
    finally:
        pool.close()
        victim.stop()
        survivor.stop()


def test_without_a_worker_online_the_aggregator_trains_the_replies_itself(mosquitto) -> None:
    cfg = _cfg(mosquitto.url, "alone")
    here = _strategy(cfg)
    there = copy.deepcopy(here)
    pool = _pool(there, cfg)
    try:
        uploads = _uploads(here, 2)
        _same_replies(here.update_many(uploads), there.update_many(copy.deepcopy(uploads)))
        assert pool.counters["replies.local"] == 2 and pool.counters["jobs.sent"] == 0
    finally:
        pool.close()


def test_a_worker_with_other_proxy_data_gets_no_job_and_bad_messages_change_nothing(mosquitto) -> None:
    cfg = _cfg(mosquitto.url, "mismatch")
    here = _strategy(cfg)
    there = copy.deepcopy(here)
    other = _worker(cfg, "other-seed", "--seed", "7")  # draws other proxy samples
    pool = _pool(there, cfg)
    raw = MqttTransport("hostile", cfg.broker, clean_start=True).connect()
    try:
        deadline = time.monotonic() + WAIT_S
        while "other-seed" not in pool.workers:
            assert time.monotonic() < deadline and other.proc.poll() is None, other.output
            time.sleep(0.05)
        assert pool.online == 0
        # Garbage and a forged result on the worker topics: refused with a log line, no effect.
        raw.publish(protocol.worker_status(cfg.fleet, "junk"), b"\x00not msgpack", qos=1).wait(10)
        raw.publish(protocol.worker_done(cfg.fleet, "other-seed"),
                    msgpack.packb({"v": 1, "job": "x", "worker": "other-seed", "vector": b"\x00" * 8}), qos=1).wait(10)
        raw.publish(protocol.worker_status(cfg.fleet, "spoof"),
                    msgpack.packb({"v": 1, "worker": "someone-else", "state": "online", "slots": 4,
                                   "digest": pool.digest}), qos=1).wait(10)
        uploads = _uploads(here, 2)
        _same_replies(here.update_many(uploads), there.update_many(copy.deepcopy(uploads)))
        assert pool.counters["jobs.sent"] == 0 and pool.counters["replies.local"] == 2
        assert "junk" not in pool.workers and "someone-else" not in pool.workers
    finally:
        raw.close()
        pool.close()
        other.stop()


def test_a_worker_refuses_a_malformed_job_and_the_wire_checks_results() -> None:
    cfg = Config()
    spec, evaluator, personalizer = build_reply_parts(cfg)
    worker = ReplyWorker(cfg, "unit", spec, evaluator, personalizer)
    for payload in (b"junk", msgpack.packb({"v": 1, "job": "j", "digest": "d", "seed": 0, "alpha": [1.0],
                                            "start": b"\x00" * 4})):
        done = worker.train(payload)
        assert done.vector is None and done.error
    good = Done("j", "w", vector=torch.zeros(spec.numel))
    assert torch.equal(decode_done(encode_done(good), spec.numel).vector, torch.zeros(spec.numel))
    nan = Done("j", "w", vector=torch.full((spec.numel,), float("nan")))
    with pytest.raises(JobError, match="non-finite"):
        decode_done(encode_done(nan), spec.numel)
    with pytest.raises(JobError, match="float32"):
        decode_done(encode_done(good), spec.numel + 1)


def test_two_slots_train_side_by_side_without_sharing_a_model() -> None:
    """--slots 2: two jobs trained at once in one worker give what each gives alone (each slot
    has its own module: functional_call swaps parameters in place)."""
    cfg = Config()
    cfg.cdfl.personalize_epochs = 2  # short jobs; the overlap is what is tested
    spec, evaluator, personalizer = build_reply_parts(cfg)
    worker = ReplyWorker(cfg, "slots", spec, evaluator, personalizer, slots=2)
    g = torch.Generator().manual_seed(0)
    jobs = [encode_job(Job(f"j{i}", worker.digest, i, [0.5, 0.3, 0.2], 0.1 * torch.randn(spec.numel, generator=g)))
            for i in range(2)]
    alone = [worker.train(j, worker._slot_personalizers[0]).vector for j in jobs]
    together: list = [None, None]

    def run(i: int) -> None:
        together[i] = worker.train(jobs[i], worker._slot_personalizers[i]).vector

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for a, b in zip(alone, together, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
