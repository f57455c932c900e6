"""Reply workers: CDFL uploads/s with the replies trained in the aggregator, by 1 and by 2
`ReplyWorker` processes over a real Mosquitto, and the writer's own ceiling.

The world is bench_replies': cnn28, K = 4, 1000 random 28x28 proxy samples per cluster, the
default CDFL (sketch estimate, delta update, one refresh step, 8-epoch fine-tune reply from
the alpha-mixture). Each setting applies the same queue of uploads in one `update_many`, as
the engine does with a batch: the writer estimates, moves the clusters and fixes each reply's
start, and the replies are trained where the setting says:

- in the aggregator, with 1 and with 2 torch threads (today's aggregator on this machine);
- by 1 and by 2 worker processes (1 torch thread each; the writer runs on 1 thread);
- nowhere: the paper's mixture reply, which costs no training: the writer's own ceiling.

Workers get the same proxy sets from the same seed, so their digest matches the writer's.
On this 2-core machine two workers use both cores; more need more cores (docs/scaling.md).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from aggregator.cdfl import CDFL, cdfl_evaluator, cdfl_personalizer
from aggregator.reply_jobs import reply_digest
from aggregator.reply_pool import ReplyPool
from aggregator.strategy import Upload
from bench.bench_aggregator import ARCH, K, random_world
from fedmq.broker import MosquittoBroker
from fedmq.config import CDFLSettings, Config
from fedmq.models import model_spec
from fedmq.sketch import data_sketch

FLEET = "bench-scaling"


def _settings(**fields) -> CDFLSettings:
    return CDFLSettings(clusters=K, tau0=1000, **fields)


def _serve(url: str, worker_id: str, n_proxy: int, threads: int, stop) -> None:
    """A worker process: the bench world's proxy sets and the default reply."""
    from aggregator.reply_worker import ReplyWorker

    torch.set_num_threads(threads)
    spec = model_spec(ARCH)
    proxies, _ = random_world(n_proxy)
    settings = _settings()
    evaluator = cdfl_evaluator(spec, proxies, settings, "cpu")
    cfg = Config()
    cfg.broker.url, cfg.fleet = url, FLEET
    with ReplyWorker(cfg, worker_id, spec, evaluator, cdfl_personalizer(settings, evaluator)):
        stop.wait()


def _uploads(clusters: torch.Tensor, sketch: torch.Tensor, n: int, tau: int, seed: int) -> list[Upload]:
    g = torch.Generator().manual_seed(seed)
    return [Upload(f"agent{i}", clusters[i % K] + 0.01 * torch.randn(clusters.shape[1], generator=g),
                   tau=tau, sketch=sketch, base=clusters[i % K], msg_id=f"m{seed}-{i}") for i in range(n)]


def _time_queue(strategy: CDFL, clusters: torch.Tensor, sketch: torch.Tensor, queued: int, warm: int = 1) -> dict:
    # warm-up: one reply per worker (a process's first training pays for allocations)
    strategy.update_many(_uploads(clusters, sketch, warm, strategy.uploads_applied, seed=99))
    ups = _uploads(clusters, sketch, queued, strategy.uploads_applied, seed=1)
    t0 = time.perf_counter()
    replies = strategy.update_many(ups)
    seconds = time.perf_counter() - t0
    per_reply = [r.info.get("personalize", {}).get("seconds", 0.0) for r in replies]
    return {"uploads": queued, "seconds": round(seconds, 2), "uploads_per_s": round(queued / seconds, 4),
            "reply_train_s_median": round(sorted(per_reply)[len(per_reply) // 2], 3),
            "made_by": sorted({str(r.info.get("personalize", {}).get("worker", "aggregator")) for r in replies})}


def _train_alone(n_proxy: int, replies: int) -> float:
    """A process that trains `replies` default replies back to back, no broker: seconds."""
    from aggregator.personalize import PersonalizeRequest

    torch.set_num_threads(1)
    spec = model_spec(ARCH)
    proxies, clusters = random_world(n_proxy)
    settings = _settings()
    personalizer = cdfl_personalizer(settings, cdfl_evaluator(spec, proxies, settings, "cpu"))

    def request(i: int) -> PersonalizeRequest:
        return PersonalizeRequest(torch.empty(0), [1.0 / K] * K, None, seed=i, start=clusters[i % K].clone(),
                                  start_info={})

    personalizer.personalize(request(0))  # warm-up
    t0 = time.perf_counter()
    for i in range(replies):
        personalizer.personalize(request(i + 1))
    return time.perf_counter() - t0


def compute_only(n_proxy: int, replies: int) -> dict:
    """The control: the same replies trained in 1 and in 2 processes at once with no broker and no
    writer. What 2 processes gain here is what this machine's 2 cores give this training; the
    workers cannot scale better than this."""
    ctx = mp.get_context("spawn")
    out = {}
    for n in (1, 2):
        with ctx.Pool(n) as pool:
            seconds = max(pool.starmap(_train_alone, [(n_proxy, replies)] * n))
        out[f"{n} process(es)"] = {"replies": n * replies, "seconds": round(seconds, 2),
                                   "replies_per_s": round(n * replies / seconds, 4)}
    out["2 / 1"] = round(out["2 process(es)"]["replies_per_s"] / out["1 process(es)"]["replies_per_s"], 3)
    return out


def run(quick: bool = False) -> dict:
    n_proxy = 250 if quick else 1000
    queued = 4 if quick else 12
    spec = model_spec(ARCH)
    proxies, clusters = random_world(n_proxy)
    sketch = data_sketch(torch.cat([proxies[0][0][:300], proxies[1][0][:100]]))
    threads0 = torch.get_num_threads()
    out: dict = {"arch": ARCH, "K": K, "proxy_per_cluster": n_proxy, "queued_uploads": queued,
                 "cores": mp.cpu_count(), "settings": {}}
    rows = out["settings"]

    def strategy(**fields) -> CDFL:
        return CDFL.from_settings(spec, clusters, proxies, _settings(**fields), device="cpu")

    for threads in (1, 2):
        torch.set_num_threads(threads)
        rows[f"in the aggregator, {threads} thread(s)"] = _time_queue(strategy(), clusters, sketch, queued)
        print(f"in-process {threads} thread(s): {rows[f'in the aggregator, {threads} thread(s)']}", flush=True)
        ceiling = _time_queue(strategy(personalization="mixture"), clusters, sketch, 4 * queued)
        rows[f"writer ceiling (mixture reply), {threads} thread(s)"] = ceiling
        print(f"writer ceiling {threads} thread(s): {ceiling}", flush=True)

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    with MosquittoBroker.dev() as broker:
        cfg = Config()
        cfg.broker.url = broker.url
        for n in (1, 2):
            stop = ctx.Event()
            procs = [ctx.Process(target=_serve, args=(broker.url, f"w{i}", n_proxy, 1, stop), daemon=True)
                     for i in range(n)]
            for p in procs:
                p.start()
            writer = strategy()
            local = writer.personalizer
            pool = ReplyPool(local, reply_digest(local, writer.evaluator), FLEET, cfg.broker,
                             numel=spec.numel, k=K, client_id=f"bench-pool-{n}").start()
            writer.personalizer = pool
            try:
                if not pool.wait_for_workers(n, 300):
                    raise RuntimeError(f"{n} worker(s) did not come online within 300 s")
                name = f"{n} worker(s), 1 thread each"
                rows[name] = _time_queue(writer, clusters, sketch, queued, warm=n)
                rows[name]["jobs_sent"] = pool.counters["jobs.sent"]
                print(f"{name}: {rows[name]}", flush=True)
            finally:
                pool.close()
                stop.set()
                for p in procs:
                    p.join(60)
    torch.set_num_threads(threads0)
    out["control: training alone, no broker"] = compute_only(n_proxy, queued // 2)
    print(f"control: {out['control: training alone, no broker']}", flush=True)
    r = {k: v["uploads_per_s"] for k, v in rows.items()}
    best_in_process = max(r["in the aggregator, 1 thread(s)"], r["in the aggregator, 2 thread(s)"])
    out["ratios"] = {
        "2 workers / 1 worker": round(r["2 worker(s), 1 thread each"] / r["1 worker(s), 1 thread each"], 3),
        "2 workers / in the aggregator (best)": round(r["2 worker(s), 1 thread each"] / best_in_process, 3),
        "1 worker / in the aggregator, 1 thread": round(r["1 worker(s), 1 thread each"]
                                                        / r["in the aggregator, 1 thread(s)"], 3),
    }
    out["ratios"]["control: 2 processes / 1, training alone"] = out["control: training alone, no broker"]["2 / 1"]
    out["uploads_per_day"] = {k: round(v * 86400) for k, v in r.items()}
    return out
