"""Load: N agents upload at once (the reference CNN, int8 delta + zstd) against one aggregator.

The aggregator runs as its own process (`serve` mode of this module: CDFL on scikit-learn's
digits upscaled to 28x28, so the reference CNN `cnn28`, 106 k parameters, has proxy data
offline); it reports its worker queue, RSS and applied count every 0.05 s. The driver starts
a real Mosquitto, the N `EdgeAgent`s on one network loop, joins them, then releases all
uploads at once (one thread per agent) and waits for every reply. Counted three times:
at the agents (uploads sent, replies installed), at the broker (a subscriber on every
uplink topic sees each publish), at the aggregator (journal records). Back-pressure: the
aggregator stops reading its socket while its inbox holds `aggregator.inbox_max_messages`
(or _bytes) unprocessed messages, so the broker holds the rest of the burst; the inbox's
true peak (messages, bytes), the number of pauses and the RSS are reported.
Latency: upload sent -> personalized model installed, per agent (p50/p99). An upload the
aggregator refuses is answered, not lost: counted by reason (`refused`).

    python -m soak.load_burst --agents 1000          # figures -> soak/results/load_burst.json
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import torch

from fedmq import protocol
from fedmq.config import Config, load_config
from fedmq.errors import run_main
from fedmq.signals import SignalRelay
from soak.fleet_setup import REPO, rss_mib, write_figures

FLEET = "burst"


def burst_config(broker_url: str, state_dir: Path, model: str, agents: int) -> Config:
    return load_config(None, {
        "fleet": FLEET, "broker.url": broker_url, "aggregator.state_dir": str(state_dir),
        "model": model, "cdfl.clusters": 2, "cdfl.tau0": agents, "data.dataset": "digits",
        "data.proxy_per_cluster": 150, "data.pretrain_per_cluster": 300,
        "aggregator.pretrain_epochs": 2, "aggregator.accuracy_every": 0, "device": "cpu",
        "aggregator.snapshot_every": 10**9,
        # The burst measures delivery and back-pressure; the figures in docs/reliability.md
        # were made with the cheap mixture reply (finetune adds a training per reply).
        "cdfl.personalization": "mixture"})


def clusters_for(model: str, cfg: Config):
    """Rotated digits clusters, upscaled to 28x28 for cnn28 (the reference CNN)."""
    from fedmq.data import RotatedClusters, load_dataset

    train = load_dataset("digits", train=True)
    test = load_dataset("digits", train=False)
    if model == "cnn28":
        def up(d):
            return d.with_x(torch.nn.functional.interpolate(d.x, size=(28, 28), mode="bilinear",
                                                            align_corners=False).contiguous())
        train, test = up(train), up(test)
    return RotatedClusters(train, test, cfg.cdfl.clusters, seed=cfg.seed,
                           proxy_per_cluster=cfg.data.proxy_per_cluster,
                           pretrain_per_cluster=cfg.data.pretrain_per_cluster)


def serve(broker_url: str, state_dir: Path, model: str, agents: int) -> int:
    """The aggregator process: build, start, print stats lines until SIGTERM."""
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService

    torch.set_num_threads(1)
    cfg = burst_config(broker_url, state_dir, model, agents)
    stop = threading.Event()
    SignalRelay({signal.SIGTERM: stop.set})
    svc = AggregatorService(cfg, build_engine(cfg, clusters=clusters_for(model, cfg))).start()
    print("ready", flush=True)
    while not stop.wait(0.05):
        print(f"stats inbox={svc._inbox.qsize()} rss={rss_mib():.1f} "
              f"applied={svc.engine.counters['applied.update']} peak={svc.inbox_peak[0]} "
              f"peak_bytes={svc.inbox_peak[1]} paused={svc.counters['backpressure.paused']}", flush=True)
    svc.stop()
    return 0


class BrokerCounter:
    """Counts every publish on the fleet's uplinks, as the broker routes them."""

    def __init__(self, port: int) -> None:
        self.count = 0
        self.bytes = 0
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="burst-counter")
        self.client.on_message = self._on_message
        ok = threading.Event()
        self.client.on_subscribe = lambda *a, **k: ok.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(f"fedmq/{FLEET}/agents/+/up", qos=0)
        ok.wait(5)

    def _on_message(self, client, userdata, msg) -> None:
        self.count += 1
        self.bytes += len(msg.payload)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run_burst(broker_url: str, workdir: Path, *, agents: int, model: str = "cnn28",
              seed: int = 0) -> dict[str, Any]:
    from edge_agent.protocol_client import AgentError, EdgeAgent
    from fedmq.transport import NetworkLoop, use_network

    state = workdir / "aggregator"
    cfg = burst_config(broker_url, state, model, agents)
    proc = subprocess.Popen([sys.executable, "-m", "soak.load_burst", "serve", "--broker", broker_url,
                             "--state", str(state), "--model", model, "--agents", str(agents)],
                            stdout=subprocess.PIPE, stderr=(workdir / "aggregator.log").open("wb"),
                            cwd=REPO)
    stats: dict[str, float] = {"inbox_max": 0, "rss_max": 0.0, "rss_start": 0.0, "applied": 0,
                               "peak": 0, "peak_bytes": 0, "paused": 0}
    ready = threading.Event()

    def read() -> None:
        for raw in proc.stdout:
            line = raw.decode()
            if line.startswith("ready"):
                ready.set()
            elif line.startswith("stats"):
                kv = dict(p.split("=") for p in line.split()[1:])
                stats["inbox_max"] = max(stats["inbox_max"], int(kv["inbox"]))
                stats["rss_max"] = max(stats["rss_max"], float(kv["rss"]))
                stats["rss_start"] = stats["rss_start"] or float(kv["rss"])
                stats["applied"] = int(kv["applied"])
                for key in ("peak", "peak_bytes", "paused"):
                    stats[key] = int(kv[key])

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600):
        proc.kill()
        raise RuntimeError(f"aggregator did not start: {(workdir / 'aggregator.log').read_text()[-2000:]}")
    port = int(broker_url.rsplit(":", 1)[1])
    counter = BrokerCounter(port)
    network = NetworkLoop("burst-network")
    fleet: list[EdgeAgent] = []
    try:
        with use_network(network):
            for i in range(agents):
                fleet.append(EdgeAgent(cfg, f"a{i:05d}", reply_timeout_s=600.0, retries=2).start(timeout=60))
        t_join = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda a: a.join(), fleet))
        join_s = time.monotonic() - t_join
        rss_agents = rss_mib()
        envs = []
        for i, a in enumerate(fleet):
            noise = np.random.default_rng([seed, i]).normal(0, 0.01, a.spec.numel).astype(np.float32)
            envs.append(a.update_envelope(a.installed.vector + torch.from_numpy(noise), 100))
        go = threading.Event()
        latency: list[float] = [float("nan")] * agents
        errors: list[str] = []
        refused: dict[str, str] = {}
        """msg_id -> reason, for uploads the aggregator refused: answered, not lost."""

        def upload(i: int) -> None:
            go.wait()
            t0 = time.monotonic()
            try:
                fleet[i].upload(envs[i])
                latency[i] = time.monotonic() - t0
            except AgentError as e:
                if not e.refused:
                    errors.append(f"{fleet[i].agent_id}: {e!r}")  # counted as lost
                else:
                    refused[envs[i].msg_id] = e.reason
            except Exception as e:  # noqa: BLE001 - counted as lost
                errors.append(f"{fleet[i].agent_id}: {e!r}")

        before_broker = counter.count
        inbox_max_connect, stats["inbox_max"] = stats["inbox_max"], 0  # the burst's own from here
        threads = [threading.Thread(target=upload, args=(i,), daemon=True) for i in range(agents)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        go.set()
        for t in threads:
            t.join(1800)
        burst_s = time.monotonic() - t0
        time.sleep(1.0)  # the last stats line
        answered = [x for x in latency if x == x]
        figures = {
            "agents": agents, "model": model, "numel": fleet[0].spec.numel,
            "upload_bytes_mean": float(np.mean([len(protocol.encode(e)) for e in envs])),
            "uploads_sent_at_agents": agents, "replies_at_agents": len(answered),
            "uploads_seen_at_broker": counter.count - before_broker,
            "applied_at_aggregator": int(stats["applied"]),
            "lost": agents - len(answered) - len(refused), "errors": errors[:10],
            "refused": dict(sorted(Counter(refused.values()).items())),
            "resends": sum(a.counters["resends"] for a in fleet),
            "latency_p50_s": float(np.percentile(answered, 50)) if answered else None,
            "latency_p99_s": float(np.percentile(answered, 99)) if answered else None,
            "latency_max_s": max(answered, default=None),
            "burst_seconds": round(burst_s, 2), "uploads_per_s": round(len(answered) / burst_s, 1),
            "join_seconds": round(join_s, 2),
            "aggregator_inbox_max": int(stats["inbox_max"]),
            "aggregator_inbox_max_while_connecting": int(inbox_max_connect),
            "aggregator_inbox_peak_messages": int(stats["peak"]),
            "aggregator_inbox_peak_bytes": int(stats["peak_bytes"]),
            "aggregator_inbox_limit_messages": cfg.aggregator.inbox_max_messages,
            "aggregator_reading_paused_times": int(stats["paused"]),
            "aggregator_rss_start_mib": stats["rss_start"], "aggregator_rss_max_mib": stats["rss_max"],
            "driver_rss_mib_after_joins": rss_agents,
        }
    finally:
        for a in fleet:
            a.transport.close()
        network.close()
        counter.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    from aggregator.journal import scan_journal

    # The whole run is journal-1 (snapshots off until the final one).
    ids = [r["msg_id"] for r in scan_journal(state / "journal-1.log").records if r["op"] == "update"]
    # A refused upload is not in the journal, unless refused as `duplicate` (applied already).
    sent_ids = {e.msg_id for e in envs} - {m for m, reason in refused.items() if reason != "duplicate"}
    figures.update(journal_updates=len(ids), applied_twice=len(ids) - len(set(ids)),
                   journal_matches_sent=set(ids) == sent_ids)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak.load_burst", description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="burst", choices=["burst", "serve"])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--model", default="cnn28")
    p.add_argument("--broker", default="")
    p.add_argument("--state", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.mode == "serve":
        return serve(args.broker, args.state, args.model, args.agents)
    from fedmq.broker import MosquittoBroker

    with tempfile.TemporaryDirectory(prefix="fedmq-burst-") as tmp, MosquittoBroker.dev() as broker:
        figures = run_burst(broker.url, Path(tmp), agents=args.agents, model=args.model, seed=args.seed)
    path = write_figures("load_burst", figures, args.out)
    print(f"{args.agents} agents: lost {figures['lost']}, applied {figures['applied_at_aggregator']}, "
          f"refused {figures['refused'] or 0}, "
          f"p50 {figures['latency_p50_s']:.2f}s p99 {figures['latency_p99_s']:.2f}s -> {path}")
    return 0 if figures["lost"] == 0 and figures["applied_twice"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.load_burst", main))
