"""kill -9 of the aggregator at random moments during one fleet run.

A real Mosquitto, `fedmq aggregator` as a child process, and `agents` real `EdgeAgent`s (the
device's protocol code: pending upload re-sent with the same msg_id until a reply names it),
each making `updates` uploads (its held model plus seeded noise: the point is delivery, not
learning). While they run, the aggregator is killed with SIGKILL `kills` times, each at a
seeded random moment, and restarted on the same state dir. At the end it is stopped with
SIGTERM (a final snapshot of its in-memory state), and:

- every upload the agents made (each was PUBACKed by the broker) is in the journal exactly
  once, and nothing else is (`lost`, `applied_twice`, `unexpected`);
- the run completed: every agent got a reply to every upload; a refusal is a reply, counted
  by reason (`refused`), and the agent goes on (joining again where the aggregator no longer
  knows its base); an upload refused as `duplicate` was applied and its reply superseded;
- the final cluster models (the live process's last snapshot) are bit-identical to a replay
  of the journal onto the pre-trained models (`Engine.recover` on a copy without that snapshot);
- recovery time per kill: restart -> ready (`aggregator ... epoch=` line), and
  restart -> first reply an agent receives afterwards.

The journal must hold the whole run for the replay check, so snapshots are off during the
run (`aggregator.snapshot_every` huge); tests/test_aggregator_service.py covers kills with
snapshots in between.

    python -m soak.kill_aggregator --agents 20 --updates 30 --kills 20
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aggregator.journal import read_snapshot, scan_journal
from fedmq.errors import run_main
from fedmq.logs import get_logger
from soak.fleet_setup import (
    pretrained_state,
    small_config,
    start_aggregator,
    write_figures,
)

log = get_logger("soak")
RUN_SETTINGS = {"aggregator.snapshot_every": 10**9}


class AggregatorProcess:
    """The child process plus when it said it was ready."""

    def __init__(self, url: str, state: Path, fleet: str, log_path: Path,
                 settings: dict[str, Any] | None = None) -> None:
        self.url, self.state, self.fleet, self.log_path = url, state, fleet, log_path
        self.settings = {**RUN_SETTINGS, **(settings or {})}
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_at: float | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.ready_at = None
        self.proc = start_aggregator(self.url, self.state, self.fleet, self.log_path,
                                     settings=self.settings, stdout=subprocess.PIPE)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        with self.log_path.open("ab") as out:
            for line in proc.stdout:
                if self.ready_at is None and line.startswith(b"aggregator ") and b"epoch=" in line:
                    self.ready_at = time.monotonic()
                out.write(line)
                out.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM once it is ready (before, SIGTERM's default action would skip the snapshot)."""
        deadline = time.monotonic() + 60
        while self.ready_at is None and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def run_kills(broker_url: str, state: Path, *, fleet: str, agents: int = 6, updates: int = 5,
              kills: int = 5, seed: int = 0, pace_s: float = 0.4, workdir: Path,
              settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """`settings` go to the aggregator, its agents and the replay alike."""
    from edge_agent.protocol_client import RESYNC_REASONS, AgentError, EdgeAgent

    rng = random.Random(seed)
    pristine = workdir / "pretrained-copy"
    shutil.copytree(state, pristine)
    cfg = small_config(broker_url, state, fleet, **(settings or {}))
    agg = AggregatorProcess(broker_url, state, fleet, workdir / "aggregator.log", settings)
    agg.start()
    lock = threading.Lock()
    uploaded: list[str] = []
    reply_times: list[float] = []
    refused: Counter[str] = Counter()
    """Uploads the aggregator refused, by reason: counted, and the agent goes on (re-joining
    where the aggregator no longer knows its base)."""
    superseded: list[str] = []
    failures: list[str] = []

    def answered() -> int:
        with lock:
            return len(uploaded) + sum(refused.values())
    fleet_agents = [EdgeAgent(cfg, f"k{i:03d}", reply_timeout_s=4.0, retries=60) for i in range(agents)]
    # The kill loop meters how many uploads may start, so that every kill lands mid-run however
    # fast or slow this machine is (a purely time-based pace let short runs end before the last
    # kill). Uploads allowed past each kill point keep traffic in flight when it lands.
    gate = threading.Condition()
    allowed = [0]

    def allow(n: int) -> None:
        with gate:
            allowed[0] = max(allowed[0], n)
            gate.notify_all()

    def take() -> None:
        with gate:
            while allowed[0] <= 0:
                gate.wait(0.5)
            allowed[0] -= 1

    def agent_loop(i: int, agent: EdgeAgent) -> None:
        try:
            agent.join()
            pace = random.Random(f"{seed}-{i}")
            for u in range(updates):
                take()
                time.sleep(pace.uniform(0.05, pace_s))  # "training"; spreads the run over the kills
                noise = np.random.default_rng([seed, i, u]).normal(0, 0.01, agent.spec.numel)
                env = agent.update_envelope(agent.installed.vector + torch.from_numpy(noise.astype(np.float32)), 100)
                try:
                    agent.upload(env)
                except AgentError as e:
                    if not e.refused:
                        raise
                    with lock:
                        refused[e.reason] += 1
                        reply_times.append(time.monotonic())
                        if e.reason == "duplicate":  # applied, its reply superseded
                            superseded.append(env.msg_id)
                    if e.reason in RESYNC_REASONS:
                        agent.join()
                    continue
                with lock:
                    uploaded.append(env.msg_id)
                    reply_times.append(time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported in the figures
            failures.append(f"{agent.agent_id}: {e!r}")

    total = agents * updates
    kill_log: list[dict[str, float]] = []
    t0 = time.monotonic()
    for a in fleet_agents:
        a.start(timeout=30)
    threads = [threading.Thread(target=agent_loop, args=(i, a)) for i, a in enumerate(fleet_agents)]
    for t in threads:
        t.start()
    try:
        for k in range(kills):
            # A random moment inside stage k of kills + 1 equal stages of the run, plus a random
            # delay; uploads are let through up to a few beyond it, so some are in flight.
            lo = total * k // (kills + 1) + 1
            hi = max(lo, total * (k + 1) // (kills + 1))
            target = rng.randint(lo, hi)
            allow(target + agents - answered())
            deadline = time.monotonic() + 120
            while answered() < target and time.monotonic() < deadline and not failures:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.2))
            killed_at = time.monotonic()
            done_at_kill = answered()
            agg.kill()
            agg.start()
            restarted = agg.started_at
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not failures:
                with lock:
                    after = [t for t in reply_times if t > restarted]
                if after or answered() == total:
                    break
                time.sleep(0.01)
            first_reply = min(after) if after else None
            kill_log.append({"at_s": round(killed_at - t0, 3), "uploads_done": done_at_kill,
                             "restart_to_ready_s": round((agg.ready_at or time.monotonic()) - restarted, 3),
                             "restart_to_first_reply_s": round(first_reply - restarted, 3) if first_reply else None,
                             "kill_to_first_reply_s": round(first_reply - killed_at, 3) if first_reply else None})
        allow(total)
        for t in threads:
            t.join(timeout=300)
    finally:
        allow(total)
        stop_rc = agg.stop()
        for a in fleet_agents:
            a.stop()
    run_s = time.monotonic() - t0

    # What was applied: the whole run is journal-1 on top of the pre-trained snapshot-1.
    records = scan_journal(state / "journal-1.log").records
    applied = [r["msg_id"] for r in records if r["op"] == "update"]
    lost = sorted(set(uploaded) - set(applied))
    unexpected = sorted(set(applied) - set(uploaded) - set(superseded))
    twice = len(applied) - len(set(applied))
    live = read_snapshot(state / "snapshot-2.msgpack")
    # Replay the same applied sequence on a copy that lacks the live snapshot.
    replay_dir = workdir / "replay"
    shutil.copytree(pristine, replay_dir)
    shutil.copy(state / "journal-1.log", replay_dir / "journal-1.log")
    from aggregator.bootstrap import build_engine

    engine = build_engine(small_config(broker_url, replay_dir, fleet, **(settings or {})))
    replayed = engine.recover()
    engine.journal.close()
    replay_clusters = engine.strategy.state_dict()["clusters"]
    identical = all(torch.equal(a, b) for a, b in zip(live["strategy"]["clusters"], replay_clusters, strict=True))
    recov = [k["restart_to_first_reply_s"] for k in kill_log if k["restart_to_first_reply_s"] is not None]
    return {
        "agents": agents, "updates_per_agent": updates, "kills": len(kill_log), "seed": seed,
        "uploads_tried": total, "kills_mid_run": sum(k["uploads_done"] < total for k in kill_log), "uploads_answered": len(uploaded), "applied": len(applied),
        "refused": dict(sorted(refused.items())),
        "lost": len(lost), "applied_twice": twice, "unexpected": len(unexpected),
        "failures": failures, "completed": not failures and answered() == total,
        "replayed_records": replayed, "clusters_equal_replay": identical,
        "epoch_live": live["strategy"]["epoch"], "epoch_replay": engine.strategy.uploads_applied,
        "agent_resends": sum(a.counters["resends"] for a in fleet_agents),
        "aggregator_exit_code": stop_rc, "run_seconds": round(run_s, 1),
        "recovery_restart_to_first_reply_s": {
            "min": min(recov, default=None), "median": float(np.median(recov)) if recov else None,
            "max": max(recov, default=None)},
        "kill_log": kill_log,
    }


def main(argv: list[str] | None = None) -> int:
    from fedmq.broker import MosquittoBroker

    p = argparse.ArgumentParser(prog="python -m soak.kill_aggregator", description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=20)
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pace", type=float, default=2.0, help="most seconds an agent 'trains' between uploads")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedmq-kill-") as tmp, MosquittoBroker.dev() as broker:
        work = Path(tmp)
        state = pretrained_state(work / "state")
        figures = run_kills(broker.url, state, fleet="kill", agents=args.agents, updates=args.updates,
                            kills=args.kills, seed=args.seed, pace_s=args.pace, workdir=work)
    path = write_figures("kill_aggregator", figures, args.out)
    print(f"{figures['kills']} kills, {figures['uploads_tried']} uploads: lost {figures['lost']}, "
          f"applied twice {figures['applied_twice']}, refused {figures['refused'] or 0}, "
          f"replay equal {figures['clusters_equal_replay']} -> {path}")
    return 0 if figures["completed"] and not figures["lost"] and not figures["applied_twice"] else 1


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.kill_aggregator", main))
