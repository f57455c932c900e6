"""10,000 connected agents on a 2-node RabbitMQ cluster, with uploads flowing (docs/scaling.md).

    python -m soak.cluster_fleet                     # 10,000 agents in 4 processes
    python -m soak.cluster_fleet --agents 2000 --processes 2

Each process holds its share of EdgeAgents on one NetworkLoop thread (epoll, one MQTT
connection, persistent session and downlink subscription each); half the processes list node
A first, half node B, so both nodes carry connections. The aggregator (the small digits
CDFL of the other soak runs) is connected to node B. Once every agent is connected, a few
agents per process join and upload in a burst while the rest stay connected. Written to
soak/results/cluster_fleet.json: connect time, client memory per agent, each node's Erlang
VM memory before and after, and the burst's uploads/s and answers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fedmq.errors import run_main
from soak.fleet_setup import RESULTS, pretrained_state, rss_mib, small_config, write_figures

FLEET = "cluster-soak"
FAST = {"broker.reconnect_min_s": 0.5, "broker.reconnect_max_s": 5.0,
        "broker.protocol": "3.1.1"}  # RabbitMQ 3.10 speaks no v5: `auto` would first try it and be refused


def _raise_fd_limit(n: int = 65536) -> None:
    """Open files up to `n` or the hard limit (a connection is one)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


def _agents(urls: str, state: str, first: int, n: int, active: int, uploads: int, out: Any,
            go: Any, done: Any) -> None:
    """One process: n connected agents, `active` of them upload `uploads` times after `go`."""
    import torch

    from edge_agent.protocol_client import EdgeAgent
    from fedmq.transport import NetworkLoop, use_network
    from tests.test_faults import upload_burst

    torch.set_num_threads(1)
    _raise_fd_limit()
    cfg = small_config(urls, Path(state), FLEET, **FAST)
    network = NetworkLoop(f"soak-agents-{first}")
    rss0 = rss_mib()
    t0 = time.perf_counter()
    with use_network(network):
        agents = [EdgeAgent(cfg, f"a{first + i:05d}", reply_timeout_s=30.0, retries=10).start(timeout=120)
                  for i in range(n)]
    connect_s = time.perf_counter() - t0
    rss1 = rss_mib()
    out.put({"kind": "connected", "first": first, "agents": n, "connect_s": round(connect_s, 2),
             "rss_per_agent_kib": round((rss1 - rss0) * 1024 / n, 1), "process_rss_mib": round(rss1, 1),
             "connected": sum(a.transport.connected for a in agents)})
    go.wait()
    t1 = time.perf_counter()
    refused: Counter[str] = Counter()  # a refusal is counted by reason, never a failure
    threads, uploaded, failures = upload_burst(agents[:active], uploads, refused=refused)
    for t in threads:
        t.join(600)
    out.put({"kind": "burst", "first": first, "uploads": len(uploaded), "failures": failures[:3],
             "refused": dict(refused),
             "seconds": round(time.perf_counter() - t1, 2),
             "still_connected": sum(a.transport.connected for a in agents)})
    done.wait()
    for a in agents:
        a.transport.close()
    network.close()


def _beam_rss_mib(root_pid: int) -> float:
    """RSS of the Erlang VM under a node's runuser process (its descendants summed)."""
    total, stack = 0.0, [root_pid]
    while stack:
        pid = stack.pop()
        try:
            total += rss_mib(pid) if "beam" in Path(f"/proc/{pid}/comm").read_text() else 0.0
            for tid in Path(f"/proc/{pid}/task").iterdir():
                stack += [int(c) for c in (tid / "children").read_text().split()]
        except OSError:
            continue
    return round(total, 1)


def _reports(q: Any, procs: list[Any], kind: str, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """One `kind` report per process; SystemExit naming the stall when a process died without one."""
    import queue

    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            got.append(q.get(timeout=5))
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"stalled before every process reported {kind}: {len(got)} of {len(procs)} did"
                                 f"{'; died: ' + ', '.join(dead) if dead else ''}") from None
    return got


def _sample_fds(cluster: Any, samples: list[dict[str, Any]], stop: Any, t0: float, every_s: float = 15.0) -> None:
    """Each node's open files and sockets against its limits, every `every_s`, printed as it goes:
    a node out of file handles stalls queue declarations (and so SUBACKs) without a word."""
    from fedmq.rabbitmq_cluster import ClusterError

    while not stop.wait(every_s):
        row: dict[str, Any] = {"t_s": round(time.perf_counter() - t0, 1)}
        for node in cluster.nodes:
            try:
                row[node.name.split("-")[0]] = cluster.file_descriptors(node)
            except ClusterError as e:
                row[node.name.split("-")[0]] = str(e)[:200]
        samples.append(row)
        print(f"fds {row}", flush=True)


def run(agents: int, processes: int, active: int, uploads: int, out: Path,
        late_aggregator: bool = False, nodes: int = 2, mirrors: int = 0) -> dict[str, Any]:
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService
    from fedmq.rabbitmq_cluster import RabbitCluster

    _raise_fd_limit()
    work = Path(f"/tmp/fedmq-cluster-soak-{int(time.time())}")
    state = pretrained_state(work / "state")
    figures: dict[str, Any] = {"late_aggregator": late_aggregator, "agents": agents, "processes": processes, "active_per_process": active,
                               "uploads_per_active_agent": uploads,
                               "broker": f"RabbitMQ 3.10, {nodes} nodes, each session queue on "
                                         f"{mirrors or nodes} of them"}
    t0 = time.perf_counter()
    with RabbitCluster(nodes, fd_limit=65536, mirrors=mirrors) as cluster:
        a, b = cluster.nodes[:2]
        import threading

        sampling, fd_samples = threading.Event(), []
        threading.Thread(target=_sample_fds, args=(cluster, fd_samples, sampling, t0), daemon=True).start()
        figures["fd_limit_per_node"] = cluster.file_descriptors(a).get("total_limit")
        figures["cluster_start_s"] = round(time.perf_counter() - t0, 1)
        idle_vm = [_beam_rss_mib(n.proc.pid) for n in cluster.nodes if n.proc is not None]
        cfg = small_config(f"{b.url},{a.url}", state, FLEET, **FAST)
        svc = AggregatorService(cfg, build_engine(cfg))
        if not late_aggregator:
            svc.start()
        ctx = mp.get_context("spawn")
        q, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
        share = agents // processes
        procs = []
        for p in range(processes):  # process p's agents start on node p mod N, the others next
            order = cluster.nodes[p % nodes:] + cluster.nodes[:p % nodes]
            urls = ",".join(n.url for n in order)
            procs.append(ctx.Process(target=_agents, args=(urls, str(state), p * share, share, active, uploads,
                                                           q, go, done), daemon=True))
        t1 = time.perf_counter()
        for proc in procs:
            proc.start()
        connected = _reports(q, procs, "connected")
        figures["connect_wall_s"] = round(time.perf_counter() - t1, 1)
        figures["per_process"] = connected
        figures["connected"] = sum(c["connected"] for c in connected)
        figures["client_rss_per_agent_kib"] = round(sum(c["rss_per_agent_kib"] for c in connected) / len(connected), 1)
        loaded_vm = [_beam_rss_mib(n.proc.pid) for n in cluster.nodes if n.proc is not None]
        figures["broker_vm_rss_mib"] = {"idle": idle_vm, "connected": loaded_vm}
        figures["broker_rss_per_connection_kib"] = round(
            (sum(loaded_vm) - sum(idle_vm)) * 1024 / max(1, figures["connected"]), 1)
        if late_aggregator:
            t3 = time.perf_counter()
            svc.start()
            figures["aggregator_start_after_connect_s"] = round(time.perf_counter() - t3, 1)
        applied0 = svc.engine.counters["applied.update"]
        t2 = time.perf_counter()
        go.set()
        bursts = _reports(q, procs, "burst")
        seconds = time.perf_counter() - t2
        applied = svc.engine.counters["applied.update"] - applied0
        figures["burst"] = {"uploads_answered": sum(x["uploads"] for x in bursts),
                            "uploads_expected": processes * active * uploads,
                            "applied": applied, "seconds": round(seconds, 2),
                            "uploads_per_s": round(applied / seconds, 2),
                            "failures": [f for x in bursts for f in x["failures"]],
                            "refused": dict(sum((Counter(x["refused"]) for x in bursts), Counter())),
                            "still_connected": sum(x["still_connected"] for x in bursts)}
        done.set()
        for proc in procs:
            proc.join(120)
        svc.stop()
        sampling.set()
        figures["fd_samples"] = fd_samples
    path = write_figures("cluster_fleet", figures, out)
    print(f"-> {path}")
    return figures


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m soak.cluster_fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--active", type=int, default=10, help="agents per process that upload (default 10)")
    p.add_argument("--uploads", type=int, default=5, help="uploads per active agent (default 5)")
    p.add_argument("--nodes", type=int, default=2, help="broker nodes (default 2)")
    p.add_argument("--mirrors", type=int, default=0,
                   help="nodes holding each session queue (default 0: every node)")
    p.add_argument("--late-aggregator", action="store_true",
                   help="start the aggregator only once every agent is connected")
    p.add_argument("--out", type=Path, default=RESULTS / "cluster_fleet.json")
    args = p.parse_args()
    import json

    print(json.dumps(run(args.agents, args.processes, args.active, args.uploads, args.out,
                         args.late_aggregator, args.nodes, args.mirrors), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.cluster_fleet", main))
