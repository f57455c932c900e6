"""Simulated fleets: run the CDFL paper's comparisons over a real broker, then report.

    fedmq sim run --scenario rotated-digits --methods cdfl,fedsoft-async,local \\
        --clusters 2,3,4 --seeds 3 --updates-per-agent 5 --out results/
    fedmq sim report results/

`run` starts a broker (the one given with --broker, else Mosquitto, else the embedded one)
and, for every (K, method, seed), a fresh aggregator and 20*K edge agents (each its own MQTT
client), and writes results/runs/LABEL/{updates,clusters,agents}.csv and summary.json, then
the report (report.md and figures/). See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from tqdm import tqdm

from fedmq.config import add_config_arguments, config_from_args
from fedmq.logs import setup_logging


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sim_command", metavar="{run,report,rounds}")
    r = sub.add_parser("run", help="run scenarios x methods x K x seeds and write CSV/JSON + report")
    add_config_arguments(r, ("broker", "fleet", "log_level", "data_dir", "seed"))
    r.add_argument("--scenario", default="rotated-digits",
                   help="rotated-digits (default), rotated-mnist, rotated-fashionmnist, rotated-cifar100, "
                        "digits-domains")
    r.add_argument("--methods", default="cdfl,fedsoft-async,local",
                   help="comma list of cdfl, fedsoft-async, fedasync, local (default cdfl,fedsoft-async,local)")
    r.add_argument("--clusters", type=_int_list, default=[3], help="K, or a comma list (default 3)")
    r.add_argument("--agents", type=int, default=0, help="agents per run (default 20*K)")
    r.add_argument("--seeds", default="1",
                   help="number of seeds (N: seeds base..base+N-1, base from --seed) or a comma list")
    r.add_argument("--updates-per-agent", type=float, default=25.0,
                   help="mean updates per agent (default 25, the paper's)")
    r.add_argument("--workers", type=int, default=1,
                   help="agent worker threads (default 1: the run is a pure function of the seed)")
    r.add_argument("--min-samples", type=int, help="fewest samples per agent (default data.min_samples, 500)")
    r.add_argument("--max-samples", type=int, help="most samples per agent (default data.max_samples, 2000)")
    r.add_argument("--test-samples", type=int, default=300, help="test samples per agent and cycle (300)")
    r.add_argument("--out", required=True, type=Path, help="output dir")
    rep = sub.add_parser("report", help="table (paper's Table 1) and figures from a run's output dir")
    rep.add_argument("out", type=Path, help="the --out dir of `fedmq sim run`")
    rounds = sub.add_parser("rounds", add_help=False, prefix_chars="+",
                            help="CATA-Fed vs FedAvg/FedProx deadline rounds on a simulated clock "
                                 "(fedmq sim rounds --help)")
    rounds.add_argument("rest", nargs=argparse.REMAINDER)


def _seeds(text: str, base: int) -> list[int]:
    if "," in text:
        return _int_list(text)
    return list(range(base, base + int(text)))


def run(args: argparse.Namespace) -> int:
    from sim.report import write_report

    if args.sim_command == "report":
        report, paths, text = write_report(args.out)
        print(text)
        print(f"report: {report}")
        for p in paths:
            print(f"figure: {p}")
        return 0
    if args.sim_command == "rounds":
        from sim.rounds import main as rounds_main

        return rounds_main(args.rest)
    if args.sim_command != "run":
        print("usage: fedmq sim {run,report,rounds} ... (see fedmq sim run --help)", file=sys.stderr)
        return 2
    return run_experiments(args)


def run_experiments(args: argparse.Namespace) -> int:
    from sim.fleet import METHODS, RunSpec, get_scenario, make_schedule, run_fleet, write_run
    from sim.report import write_report

    cfg = config_from_args(args, {"min_samples": "data.min_samples", "max_samples": "data.max_samples"})
    if args.fleet is None:
        cfg.fleet = "sim"
    setup_logging(cfg.log.level, cfg.log.json)
    scenario = get_scenario(args.scenario)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            print(f"fedmq sim run: unknown method {m!r}; one of {', '.join(METHODS)}", file=sys.stderr)
            return 2
    seeds = _seeds(args.seeds, cfg.seed)
    specs = [RunSpec(scenario=scenario.name, method=m, clusters=k, agents=args.agents, seed=s,
                     updates_per_agent=args.updates_per_agent, workers=args.workers,
                     test_samples=args.test_samples)
             for k in args.clusters for s in seeds for m in methods]
    total = sum(len(make_schedule(sp.seed, sp.resolved_agents(), sp.updates_per_agent)) for sp in specs)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "fedmq sim " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("sim") + 1:]) \
        if "sim" in sys.argv else None
    bar = tqdm(total=total, desc="updates", unit="upd", dynamic_ncols=True)
    try:
        for sp in specs:
            bar.set_postfix_str(sp.label)
            result = run_fleet(sp, cfg, broker_url=cfg.broker.url if args.broker else None,
                               progress=bar.update)
            write_run(result, args.out)
    finally:
        bar.close()
    report, paths, text = write_report(args.out, command)
    print(text)
    print(f"report: {report}")
    for p in paths:
        print(f"figure: {p}")
    return 0
