"""Fleet simulator: idle agents per process, and uploads per second end to end.

1. Idle: 1,000 EdgeAgents (each its own MQTT connection, client id and persistent session)
   connected from this one process on one NetworkLoop thread: connect time, RSS per idle
   agent, threads, CPU while idle. (paho's own loop, a thread and a select() per client,
   stops at ~340 clients: select() cannot watch descriptors past 1023.)
2. Throughput: a CDFL fleet on rotated digits (the digits CNN), agents -> Mosquitto ->
   aggregator -> agents, with one and two agent workers; where the time goes: agent
   training, agent encoding, aggregator (Engine.handle: decode, estimate, update, journal),
   broker and the rest of the round trip, and the simulator's own accuracy measurements.
"""

from __future__ import annotations

import threading
import time

from bench.process_memory import status_mb
from fedmq.broker import MosquittoBroker
from fedmq.config import Config


def idle_agents(n: int) -> dict:
    from edge_agent.protocol_client import EdgeAgent
    from fedmq.transport import NetworkLoop, use_network

    with MosquittoBroker.dev() as broker:
        cfg = Config()
        cfg.broker.url = broker.url
        cfg.fleet = "bench-idle"
        network = NetworkLoop("bench-network")
        agents = []
        rss0 = status_mb()
        t0 = time.perf_counter()
        with use_network(network):
            for i in range(n):
                agents.append(EdgeAgent(cfg, f"idle-{i:05d}").start(timeout=30))
        connect_s = time.perf_counter() - t0
        rss1 = status_mb()
        cpu0, w0 = time.process_time(), time.perf_counter()
        time.sleep(5.0)
        idle_cpu = (time.process_time() - cpu0) / (time.perf_counter() - w0)
        connected = sum(a.transport.connected for a in agents)
        threads = threading.active_count()
        t1 = time.perf_counter()
        for a in agents:
            a.stop()
        stop_s = time.perf_counter() - t1
        network.close()
    return {"agents": n, "connected": connected, "connect_s": round(connect_s, 2),
            "agents_per_s": round(n / connect_s, 1), "rss_per_idle_agent_kb": round((rss1 - rss0) * 1024 / n, 1),
            "process_rss_mb": round(rss1, 1), "threads_in_process": threads,
            "idle_cpu_percent_of_one_core": round(100 * idle_cpu, 2), "stop_s": round(stop_s, 2)}


def throughput(agents: int, updates_per_agent: float, workers: int) -> dict:
    from sim.fleet import RunSpec, run_fleet

    cfg = Config()
    cfg.log.level = "error"
    cfg.fleet = "bench-fleet"
    spec = RunSpec(scenario="rotated-digits", method="cdfl", clusters=3, agents=agents, seed=0,
                   updates_per_agent=updates_per_agent, workers=workers, test_samples=300)
    with MosquittoBroker.dev() as broker:
        t0 = time.perf_counter()
        result = run_fleet(spec, cfg, broker_url=broker.url)
        total_s = time.perf_counter() - t0
    u = result.updates
    span = max(r.t for r in u)
    train = sum(r.compute_s for r in u)
    encode = sum(r.encode_s for r in u)
    round_trip = sum(r.round_trip_s for r in u)
    agg = result.info["aggregator_busy_s"]
    return {
        "agents": agents, "workers": workers, "updates": len(u), "model": "digits-cnn",
        "samples_per_update_mean": round(sum(r.n_samples for r in u) / len(u), 1),
        "uploads_per_s": round(len(u) / span, 2), "run_wall_s": round(total_s, 1),
        "updates_span_s": round(span, 2),
        "per_update_ms": {
            "agent_training_cpu": round(1000 * train / len(u), 2),
            "agent_encode": round(1000 * encode / len(u), 2),
            "round_trip": round(1000 * round_trip / len(u), 2),
            "aggregator_engine": round(1000 * agg / len(u), 2),
            "broker_network_reply_decode": round(1000 * (round_trip - agg) / len(u), 2),
            "sim_accuracy_measurements_and_rest": round(
                1000 * (span * workers - train - encode - round_trip) / len(u), 2),
        },
        "aggregator_batches": result.info["aggregator_batches"],
        "bytes_up_per_update": round(sum(r.bytes_up for r in u) / len(u)),
        "bytes_down_per_update": round(sum(r.bytes_down for r in u) / len(u)),
    }


def run(quick: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    n_idle = 200 if quick else 1000
    fleet = (10, 2) if quick else (60, 5)
    return {
        "idle": idle_agents(n_idle),
        "throughput_1_worker": throughput(*fleet, workers=1),
        "throughput_2_workers": throughput(*fleet, workers=2),
    }
