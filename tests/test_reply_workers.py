"""Reply workers (issue 18): CDFL's trained replies made by `fedmq worker` processes over a
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
    decode_done,
    encode_done,
    encode_job,
    reply_digest,
)
from aggregator.reply_pool import ReplyPool
from aggregator.reply_worker import ReplyWorker, build_reply_parts
from aggregator.strategy import Upload
from fedmq import protocol
from fedmq.config import Config
from fedmq.models import build_model, to_vector
from fedmq.transport import MqttTransport
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
    finally:
        pool.close()
        for w in workers:
            w.stop()


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
