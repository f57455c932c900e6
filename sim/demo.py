"""A small CDFL fleet end to end over a real broker, in a few minutes on a laptop CPU.

What runs: a broker (the one you name with --broker, else Mosquitto with broker_config/dev.conf
when it is installed, else the embedded pure-Python broker), the aggregator (CDFL, K rotation
clusters of scikit-learn's digits, pre-trained cluster models, journal in a temp dir), and N
edge agents, each its own MQTT client. Every agent joins, then repeats: new local data (a new
mixture of the clusters) arrives, it trains from the model it holds, uploads the int8 delta,
and installs the personalized model the aggregator sends back. The table at the end shows the
accuracy of the model each agent holds on its current test mixture, and bytes on the wire.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from fedmq.config import add_config_arguments, config_from_args
from fedmq.logs import setup_logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("broker", "fleet", "seed", "log_level"))
    p.add_argument("--agents", type=int, default=12, help="number of edge agents (default 12)")
    p.add_argument("--clusters", type=int, default=3, help="K rotation clusters (default 3)")
    p.add_argument("--cycles", type=int, default=3, help="upload cycles per agent (default 3)")


@dataclass
class CycleRecord:
    agent: str
    cycle: int
    acc_received_before: float
    """Accuracy on the new test mixture of the model the agent held when its data changed."""
    acc_local: float
    """... after local training on the new data (what Local alone would have)."""
    acc_personalized: float
    """... of the personalized model the aggregator sent back."""
    bytes_up: int
    bytes_down: int
    epoch: int


def _broker(url: str | None):
    """A context manager yielding a broker URL: the one given, Mosquitto, or embedded."""
    if url:
        return contextlib.nullcontext(url)
    from fedmq.broker import MosquittoBroker, find_mosquitto

    if find_mosquitto():
        broker = MosquittoBroker.dev()
        kind = "mosquitto"
    else:
        from fedmq.embedded_broker import EmbeddedBroker

        broker = EmbeddedBroker()
        kind = "embedded"

    @contextlib.contextmanager
    def running():
        with broker as b:
            print(f"broker: {kind} at {b.url}")
            yield b.url

    return running()


def run(args: argparse.Namespace) -> int:
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService
    from edge_agent.runtime import EdgeAgent
    from fedmq.data import clusters_from_settings, draw_agent
    from fedmq.training import evaluate, fit

    cfg = config_from_args(args, {"clusters": "cdfl.clusters"})
    if args.fleet is None:
        cfg.fleet = "demo"
    setup_logging(cfg.log.level, cfg.log.json)
    cfg.data.dataset = "digits"
    cfg.data.proxy_per_cluster = 200
    cfg.data.pretrain_per_cluster = 400
    cfg.aggregator.pretrain_epochs = 15
    cfg.cdfl.beta0 = 0.1
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedmq-demo-") as tmp, _broker(args.broker) as url:
        cfg.broker.url = url
        cfg.aggregator.state_dir = f"{tmp}/aggregator"
        clusters = clusters_from_settings(cfg.data, cfg.cdfl.clusters, seed=cfg.seed)
        print(f"data: {clusters!r}")
        print("aggregator: pre-training cluster models ...", flush=True)
        engine = build_engine(cfg, clusters=clusters)
        records: list[CycleRecord] = []
        lock = threading.Lock()
        errors: list[str] = []
        bar = tqdm(total=args.agents * args.cycles, desc="uploads", unit="upload")

        def agent_main(i: int) -> None:
            rng = np.random.default_rng([cfg.seed, i])
            try:
                with EdgeAgent(cfg, f"agent-{i:03d}") as agent:
                    agent.join()
                    for c in range(args.cycles):
                        train, test = draw_agent(clusters, rng, min_samples=200, max_samples=400,
                                                 test_samples=200)
                        held = agent.installed.vector
                        acc_before, _ = evaluate(agent.model_name, held, test.data.x, test.data.y)
                        result = fit(agent.model_name, held, train.data.x, train.data.y, epochs=2,
                                     lr=0.02, anchors=[(held, 0.1)], seed=int(rng.integers(2**31)))
                        acc_local, _ = evaluate(agent.model_name, result.vector, test.data.x, test.data.y)
                        env = agent.update_envelope(result.vector, len(train))
                        installed, up = agent.upload(env)
                        acc_pers, _ = evaluate(agent.model_name, installed.vector, test.data.x, test.data.y)
                        with lock:
                            records.append(CycleRecord(agent.agent_id, c, acc_before, acc_local,
                                                       acc_pers, up, installed.bytes_down, installed.epoch))
                            bar.update(1)
            except Exception as e:  # reported in the summary
                with lock:
                    errors.append(f"agent-{i:03d}: {e!r}")

        with AggregatorService(cfg, engine):
            threads = [threading.Thread(target=agent_main, args=(i,)) for i in range(args.agents)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        bar.close()
        wall = time.perf_counter() - t_start
        _print_summary(records, errors, engine, wall, args)
        accs = []
        for k, w in enumerate(engine.strategy.state_dict()["clusters"]):
            test = clusters.test(k)
            accs.append(f"{evaluate(engine.spec.arch, w, test.x, test.y)[0]:.3f}")
        print(f"cluster models on their clusters' test sets: {', '.join(accs)}")
    return 1 if errors or not records else 0


def _print_summary(records: list[CycleRecord], errors: list[str], engine, wall: float,
                   args: argparse.Namespace) -> None:
    def mean(xs: list[float]) -> str:
        return f"{statistics.fmean(xs):.3f}" if xs else "-"

    print()
    print("| cycle | uploads | acc. held model on new data | after local training | personalized model received |")
    print("|---|---|---|---|---|")
    for c in range(args.cycles):
        rs = [r for r in records if r.cycle == c]
        print(f"| {c} | {len(rs)} | {mean([r.acc_received_before for r in rs])} | "
              f"{mean([r.acc_local for r in rs])} | {mean([r.acc_personalized for r in rs])} |")
    up = [r.bytes_up for r in records]
    down = [r.bytes_down for r in records]
    print()
    print(f"agents {args.agents}, K {args.clusters}, uploads applied {engine.counters['applied.update']}, "
          f"final epoch {engine.strategy.epoch}, wall {wall:.1f}s")
    if up:
        print(f"bytes per upload: mean {statistics.fmean(up):.0f} up, {statistics.fmean(down):.0f} down "
              f"(fp32 model: {engine.spec.numel * 4} bytes)")
    for e in errors:
        print(f"error: {e}")
