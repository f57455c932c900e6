"""A small fleet end to end over a real broker: CDFL against FedSoft-Async and Local, in a minute or two.

What runs: a broker (the one you name with --broker, else Mosquitto with broker_config/dev.conf
when it is installed, else the embedded pure-Python broker), and for each method the
aggregator (K rotation clusters of scikit-learn's digits, pre-trained cluster models) with
20 edge agents, each its own MQTT client. Agents update at seeded random times; every cycle
brings new data (a new mixture of the clusters), local training, an upload and a download.
This is `fedmq sim run` with small settings (docs/simulator.md); it prints the paper's
Table 1 for this run, the cost table and where the figures are.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from fedmq.config import add_config_arguments, config_from_args
from fedmq.logs import setup_logging
from sim.log_progress import LogProgress

PROGRESS_EVERY_S = 10.0
"""At most this long without a line while the demo runs."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("broker", "fleet", "seed", "log_level"))
    p.add_argument("--agents", type=int, default=20, help="number of edge agents (default 20)")
    p.add_argument("--clusters", type=int, default=3, help="K rotation clusters (default 3)")
    p.add_argument("--cycles", type=float, default=3, help="mean updates per agent (default 3)")
    p.add_argument("--methods", default="cdfl,fedsoft-async,local",
                   help="comma list (default cdfl,fedsoft-async,local)")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fedmq-demo",
                   help="where CSVs, report.md and figures go (default: $TMPDIR/fedmq-demo)")


def run(args: argparse.Namespace) -> int:
    from sim.fleet import (
        EMBEDDED_PROTOCOL,
        RunSpec,
        make_schedule,
        run_fleet,
        running_broker,
        write_run,
    )
    from sim.report import write_report

    cfg = config_from_args(args)
    if args.fleet is None:
        cfg.fleet = "demo"
    setup_logging(cfg.log.level, cfg.log.json)
    cfg.data.min_samples, cfg.data.max_samples = 200, 400  # small: a minute or two on 2 cores
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    specs = [RunSpec(scenario="rotated-digits", method=m, clusters=args.clusters, agents=args.agents,
                     seed=cfg.seed, updates_per_agent=args.cycles, test_samples=200) for m in methods]
    total = sum(len(make_schedule(s.seed, s.resolved_agents(), s.updates_per_agent)) for s in specs)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with running_broker(args.broker) as (url, kind):
        print(f"broker: {kind} at {url}")
        if kind == "embedded":
            cfg.broker.protocol = EMBEDDED_PROTOCOL
        # A line every 10 s, in a terminal too: pre-training and slow replies move no bar.
        bar = LogProgress(total, "uploads", every_s=PROGRESS_EVERY_S).keep_talking()
        try:
            for spec in specs:
                bar.set_postfix_str(f"{spec.method}: starting (pre-training its models)")

                def step(n: int = 1, method: str = spec.method) -> None:
                    bar.set_postfix_str(method)
                    bar.update(n)

                result = run_fleet(spec, cfg, broker_url=url, progress=step)
                write_run(result, args.out)
                print(f"{spec.method}: {len(result.updates)} updates done, {time.perf_counter() - t0:.0f} s",
                      flush=True)
            bar.set_postfix_str("writing the report and figures")
            report, paths, text = write_report(args.out, "fedmq demo")
        finally:
            bar.close()
    print()
    print(text)
    print(f"{len(specs)} runs, {total} updates, wall {time.perf_counter() - t0:.0f}s")
    print(f"report: {report}")
    for p in paths:
        print(f"figure: {p}")
    return 0
