"""Broker nodes killed again and again under a fleet's uploads (docs/scaling.md).

    python -m soak.cluster_failover                    # 2 nodes, 8 agents, 6 kills
    python -m soak.cluster_failover --kills 10 --agents 12 --uploads-per-kill 6

A real RabbitMQ cluster on this machine (fedmq/rabbitmq_cluster.py). The agents list node A
first, the aggregator node B. Each round every agent uploads `--uploads-per-kill` times while,
after a third of the round's uploads are acknowledged, one node is killed with -9; once the
round's uploads are all answered the node is started again and rejoins. Rounds alternate the
victim: the agents' node, then the node that now holds everyone (agents and aggregator
together). Checked at the end, and written to soak/results/cluster_failover.json:
every acknowledged upload is in the journal exactly once (0 lost, 0 applied twice), every
agent on a killed node is connected again within --back-within seconds, every upload
answered (applied, or refused: a refusal is counted by reason and the agent goes on); plus the seconds each agent took to come back, per kill.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fedmq.errors import run_main
from soak.fleet_setup import pretrained_state, small_config, write_figures

FLEET = "failover-soak"
FAST = {"broker.reconnect_min_s": 0.2, "broker.reconnect_max_s": 1.0,
        "broker.protocol": "3.1.1"}  # RabbitMQ 3.10 speaks no v5; short reconnects: the soak's clock


def run(agents: int, kills: int, uploads_per_kill: int, back_within_s: float, out: Path | None = None
        ) -> dict[str, Any]:
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService
    from edge_agent.protocol_client import EdgeAgent
    from fedmq.rabbitmq_cluster import ClusterError, RabbitCluster
    from tests.test_faults import journal_update_ids, upload_burst

    work = Path(tempfile.mkdtemp(prefix="fedmq-failover-soak-"))
    state = pretrained_state(work / "state")
    figures: dict[str, Any] = {"broker": "RabbitMQ 3.10, 2 nodes, session queues mirrored", "agents": agents,
                               "kills": kills, "uploads_per_kill": uploads_per_kill, "rounds": []}
    t0 = time.perf_counter()
    with RabbitCluster(2) as cluster:
        a, b = cluster.nodes
        figures["cluster_start_s"] = round(time.perf_counter() - t0, 1)
        # The journal must hold the whole run to count each acknowledged upload once: no snapshots.
        cfg = small_config(f"{b.url},{a.url}", state, FLEET, **FAST, **{"aggregator.snapshot_every": 10**9})
        svc = AggregatorService(cfg, build_engine(cfg)).start()
        acfg = small_config(f"{a.url},{b.url}", state, FLEET, **FAST)
        fleet = [EdgeAgent(acfg, f"f{i:02d}", reply_timeout_s=5.0, retries=40).start(timeout=120)
                 for i in range(agents)]
        back: dict[str, float] = {}
        for agent in fleet:
            agent.transport.on_connect_hooks.append(
                lambda t, _, name=agent.agent_id: back.setdefault(name, time.monotonic()))
        acknowledged: list[str] = []
        failures: list[str] = []
        refused: Counter[str] = Counter()
        try:
            for k in range(kills):
                victim = 0 if k % 2 == 0 else 1
                port = cluster.nodes[victim].mqtt_port
                on_victim = [ag.agent_id for ag in fleet if ag.transport.address.port == port]
                aggregator_on_victim = svc.transport.address.port == port
                refused_now: Counter[str] = Counter()  # a refusal is an answer, counted by reason
                threads, uploaded, burst_failures = upload_burst(fleet, uploads_per_kill, refused=refused_now)

                def answered(uploaded: list[str] = uploaded, refused_now: Counter[str] = refused_now) -> int:
                    return len(uploaded) + sum(refused_now.values())

                deadline = time.monotonic() + 600
                while (answered() < agents * uploads_per_kill // 3 and not burst_failures
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                if answered() < agents * uploads_per_kill // 3 and not burst_failures:
                    # stalled before this round's kill: record it and stop the soak
                    stall = (f"round {k + 1}: {len(uploaded)} of {agents * uploads_per_kill} uploads answered "
                             f"in 600 s before the kill; aggregator connected={svc.transport.connected} "
                             f"reading_paused={svc.transport.reading_paused} inbox_bytes={svc.inbox_bytes} "
                             f"unacked_on_its_channel={_unacked(cluster, svc)} "
                             f"counters {dict(svc.engine.counters)}")
                    figures["stalled"] = stall
                    print(f"STALLED {stall}", flush=True)
                    for ag in fleet:  # the burst threads end when their retries run out
                        ag.transport.close()
                    for t in threads:
                        t.join(60)
                    acknowledged += uploaded
                    refused += refused_now
                    break
                back.clear()
                killed_at = time.monotonic()
                cluster.kill(victim)
                for t in threads:
                    t.join(900)
                failures += burst_failures
                acknowledged += uploaded
                refused += refused_now
                late = {name: round(at - killed_at, 2) for name, at in back.items() if name in on_victim}
                missing = sorted(set(on_victim) - set(late))
                figures["rounds"].append({
                    "kill": k + 1, "victim": cluster.nodes[victim].name.split("-")[0], "agents_on_victim": len(on_victim),
                    "aggregator_on_victim": aggregator_on_victim, "uploads_answered": len(uploaded),
                    "back_max_s": max(late.values(), default=0.0),
                    "back_mean_s": round(statistics.fmean(late.values()), 2) if late else 0.0,
                    "not_back": missing, "failures": burst_failures, "refused": dict(refused_now)})
                r = figures["rounds"][-1]
                r["aggregator_unacked"] = _unacked(cluster, svc)
                r["aggregator_unacked_own_count"] = svc.transport.unacked  # what the client holds unacked
                print(f"kill {k + 1}/{kills}: {r['victim']} ({r['agents_on_victim']} agents"
                      f"{', the aggregator' if aggregator_on_victim else ''}), {len(uploaded)} uploads answered, "
                      f"back within {r['back_max_s']} s (mean {r['back_mean_s']}), "
                      f"{len(missing)} not back, {len(burst_failures)} failures, "
                      f"{r['aggregator_unacked']} unacknowledged on the aggregator's channel", flush=True)
                t1 = time.perf_counter()
                try:
                    cluster.restart(victim)
                except ClusterError as e:  # a node that does not come back ends the soak, recorded
                    figures["stalled"] = f"round {k + 1}: {r['victim']} did not restart: {e}"[:2000]
                    print(f"STALLED {figures['stalled']}", flush=True)
                    break
                r["restart_s"] = round(time.perf_counter() - t1, 1)
        finally:
            svc.stop()
            for ag in fleet:
                ag.transport.close()
        journal = journal_update_ids(state)
    backs = [r["back_max_s"] for r in figures["rounds"]]
    figures.update(
        uploads_acknowledged=len(acknowledged), uploads_expected=agents * uploads_per_kill * kills,
        refused=dict(sorted(refused.items())),
        rounds_completed=len(figures["rounds"]),
        in_journal=len(journal), lost=len(set(acknowledged) - set(journal)),
        applied_twice=len(journal) - len(set(journal)), applied=svc.engine.counters["applied.update"],
        duplicates_answered=svc.engine.counters["duplicates"], failures=failures,
        back_max_s=max(backs, default=0.0), back_within_s=back_within_s,
        agents_not_back=sum(len(r["not_back"]) for r in figures["rounds"]))
    figures["ok"] = ("stalled" not in figures and not failures and figures["lost"] == 0 and figures["applied_twice"] == 0
                     and figures["uploads_acknowledged"] + sum(refused.values()) == figures["uploads_expected"]
                     and figures["agents_not_back"] == 0 and figures["back_max_s"] <= back_within_s)
    path = write_figures("cluster_failover", figures, out)
    print(f"{figures['uploads_acknowledged']}/{figures['uploads_expected']} uploads acknowledged, "
          f"{figures['lost']} lost, {figures['applied_twice']} applied twice, agents back within "
          f"{figures['back_max_s']} s (limit {back_within_s}); {'OK' if figures['ok'] else 'FAILED'} -> {path}")
    return figures


def _unacked(cluster: Any, svc: Any) -> int | None:
    """Deliveries the broker counts as unacknowledged on the aggregator's channel (its MQTT
    prefetch, 10, is where the stalls stopped): None when it cannot be read."""
    from fedmq.rabbitmq_cluster import ClusterError

    try:
        sock = svc.transport._client.socket()
        port = sock.getsockname()[1] if sock is not None else None
    except (AttributeError, OSError):
        return None
    node = next((n for n in cluster.nodes if n.mqtt_port == svc.transport.address.port), None)
    if port is None or node is None:
        return None
    try:
        lines = cluster.ctl(node, "list_channels", "name", "messages_unacknowledged", timeout=30).splitlines()
    except ClusterError:
        return None
    counts = [int(line.rsplit(None, 1)[1]) for line in lines if f":{port} -> " in line and line.rsplit(None, 1)[1].isdigit()]
    return max(counts, default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak.cluster_failover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--uploads-per-kill", type=int, default=4, help="uploads per agent in each round")
    p.add_argument("--back-within", type=float, default=10.0, metavar="S",
                   help="seconds an agent may take to reconnect after its node died (default 10)")
    p.add_argument("--out", type=Path, default=None, help="results file (default soak/results/cluster_failover.json)")
    args = p.parse_args(argv)
    if min(args.agents, args.kills, args.uploads_per_kill) < 1:
        p.error("--agents, --kills and --uploads-per-kill must be >= 1")
    from fedmq.rabbitmq_cluster import installed

    if not installed():
        print("python -m soak.cluster_failover: needs rabbitmq-server and root (apt-get install rabbitmq-server)",
              file=sys.stderr)
        return 2
    return 0 if run(args.agents, args.kills, args.uploads_per_kill, args.back_within, args.out)["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.cluster_failover", main))
