"""One agent floods valid updates at 20x another's rate: is the other starved or made stale?

The aggregator runs in this process (small digits config) against a real Mosquitto. car-1
makes `--rounds` update round trips, one every `--pace` seconds, and times each reply; in the
flood phase car-2 sends valid updates at `--ratio` x car-1's rate throughout. Each setting runs
a no-flood and a flood phase on a fresh copy of one pre-trained state:

- `default`: staleness counts each agent at most once (`cdfl.staleness_cap` 1), queue quota
  4 per agent (`aggregator.max_queued_per_agent`), senders served in turn;
- `papers_staleness`: the same with the papers' staleness (every upload counts, cap 0);
- `no_quota`: senders in turn but no quota (the flood fills the inbox).

Figures per setting and phase: car-1's reply latency (median, p90, max), how many of its
updates were judged stale and refused (by reason; a refused round trip is an answer: car-1
goes on), and what became of car-2's (applied, refused `rate_limited`).

    python -m soak.flood_fairness            # -> soak/results/flood_fairness.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from edge_agent.protocol_client import RESYNC_REASONS
from fedmq import protocol
from fedmq.broker import MosquittoBroker
from fedmq.errors import run_main
from fedmq.models import model_spec
from soak.fleet_setup import pretrained_state, small_config, write_figures
from tests.raw_agent import RawAgent

SPEC = model_spec("digits-cnn")
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "papers_staleness": {"cdfl.staleness_cap": 0},
    "no_quota": {"aggregator.max_queued_per_agent": 0},
}


def flooding_agent(port: int, fleet: str, gap: float, stop: Any, joined: Any, sent: Any,
                   auth: dict[str, str] | None = None) -> None:
    """car-2, in its own process as a real device would be (not competing with the aggregator
    for this process's GIL): valid whole-vector updates every `gap` s, installing its replies
    as they come so that its tau stays fresh. `auth`: RawAgent's ca_file and password (prod.conf)."""
    flooder = RawAgent(port, fleet, "car-2", **(auth or {}))
    flooder.join(SPEC.hash)
    joined.set()

    def installs() -> None:
        while not stop.is_set():
            try:
                env = flooder.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(env, protocol.Model):
                flooder.install(env)

    threading.Thread(target=installs, daemon=True).start()
    next_at = time.monotonic()
    while not stop.is_set():
        # A whole vector: valid whichever reply the aggregator sent car-2 last.
        flooder.send(flooder.update_envelope(flooder.base * (1 + 1e-4 * (sent.value % 7)), SPEC.hash,
                                             delta=False))
        sent.value += 1
        next_at += gap
        stop.wait(max(0.0, next_at - time.monotonic()))
    flooder.close()


def phase(broker: MosquittoBroker, state: Path, fleet: str, extra: dict[str, Any], *, flood: bool,
          rounds: int, pace: float, ratio: float, starved_after: float = 120.0) -> dict[str, Any]:
    """car-1's round trips, with or without car-2's flood; a reply that takes `starved_after`
    seconds ends the phase (car-1 starved)."""
    cfg = small_config(broker.url, state, fleet, **extra)
    seen: list[dict[str, Any]] = []
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        record = svc.progress.applied
        svc.progress.applied = lambda applied: (seen.extend(applied), record(applied))[1]
        honest = RawAgent(broker.port, fleet, "car-1")
        latencies: list[float] = []
        refused: dict[str, int] = {}
        starved = False
        ctx = multiprocessing.get_context("spawn")
        stop, joined, sent = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
        flooder = ctx.Process(target=flooding_agent, args=(broker.port, fleet, pace / ratio, stop, joined, sent),
                              daemon=True)
        try:
            honest.join(SPEC.hash)
            if flood:
                flooder.start()
                if not joined.wait(120):
                    raise RuntimeError("the flooding agent did not join in 120 s")
            for i in range(rounds):
                up = honest.update_envelope(honest.base * (1.0 + 0.001 * (i + 1)), SPEC.hash)
                t0 = time.perf_counter()
                honest.send(up)
                try:
                    reply = honest.expect(up.msg_id, timeout=starved_after)
                except TimeoutError:  # what the control without a quota shows: car-1 starved
                    starved = True
                    break
                latencies.append(time.perf_counter() - t0)
                if isinstance(reply, protocol.Error):  # an answer too: counted, and car-1 goes on
                    refused[reply.reason] = refused.get(reply.reason, 0) + 1
                    if reply.reason in RESYNC_REASONS:
                        honest.join(SPEC.hash)
                else:
                    honest.install(reply)
                time.sleep(max(0.0, pace - latencies[-1]))
        finally:
            stop.set()
            if flood:
                flooder.join(60)
            honest.close()
    # After the service stopped: its worker has reported every batch.
    mine = [a for a in seen if a["agent"] == "car-1"]
    theirs = [a for a in seen if a["agent"] == "car-2"]
    if len(latencies) < 2:
        return {"car1_rounds": len(latencies), "car1_starved_s": starved_after if starved else None,
                "car1_refused": refused, "car2_sent": sent.value}
    qs = statistics.quantiles(latencies, n=10)
    return {"car1_rounds": len(latencies), "car1_starved_s": starved_after if starved else None,
            "car1_latency_s": {"median": round(statistics.median(latencies), 3),
                               "p90": round(qs[-1], 3), "max": round(max(latencies), 3)},
            "car1_stale": sum(bool(a["stale"]) for a in mine), "car1_refused": refused,
            "car1_staleness_max": max((a["staleness"] for a in mine), default=0),
            "car2_sent": sent.value, "car2_applied": len(theirs),
            "car2_stale": sum(bool(a["stale"]) for a in theirs),
            "car2_refused_rate_limited": svc.counters["refused.rate_limited"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak.flood_fairness", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="car-1's round trips per phase (default 20)")
    p.add_argument("--pace", type=float, default=1.0, help="seconds between car-1's uploads (default 1)")
    p.add_argument("--ratio", type=float, default=20.0, help="car-2's rate / car-1's (default 20)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument("--out", type=Path, default=None, help="figures file (default soak/results/flood_fairness.json)")
    args = p.parse_args(argv)
    figures: dict[str, Any] = {"rounds": args.rounds, "pace_s": args.pace, "ratio": args.ratio}
    with tempfile.TemporaryDirectory() as tmp, MosquittoBroker.dev(workdir=Path(tmp) / "broker") as broker:
        pristine = pretrained_state(Path(tmp) / "pristine", fleet="flood")
        for name in args.settings.split(","):
            for flood in (False, True):
                state = Path(tmp) / f"{name}-{flood}"
                shutil.copytree(pristine, state)
                got = phase(broker, state, f"flood-{name}-{int(flood)}", SETTINGS[name], flood=flood,
                            rounds=args.rounds, pace=args.pace, ratio=args.ratio)
                figures.setdefault(name, {})["flood" if flood else "no_flood"] = got
                print(name, "flood" if flood else "no flood", got, flush=True)
            f = figures[name]
            if "car1_latency_s" in f["flood"]:
                for q in ("median", "p90"):
                    f[f"latency_ratio_{q}"] = round(f["flood"]["car1_latency_s"][q]
                                                    / f["no_flood"]["car1_latency_s"][q], 2)
    print(f"wrote {write_figures('flood_fairness', figures, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.flood_fairness", main))
