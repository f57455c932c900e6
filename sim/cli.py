"""Simulated fleets: run the CDFL paper's comparisons over a real broker, then report.

    fedmq sim run --methods cdfl,fedsoft-async,local \\
        --clusters 2,3,4 --seeds 3 --updates-per-agent 5 --out results/
    fedmq sim report results/

`run` starts a broker (the one given with --broker, else Mosquitto, else the embedded one)
and, for every (K, method, seed), a fresh aggregator and 20*K edge agents (each its own MQTT
client), and writes results/runs/LABEL/{updates,clusters,agents}.csv and summary.json, then
the report (report.md and figures/). One run can also be split over processes and
machines that share a broker (`sim aggregator`, `sim agents --first-agent I --count N`,
`sim merge`; sim/split.py). `report` also reads a `sim rounds --out` dir (CATA-Fed).
See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fedmq.algorithms import ASYNC_SERVER, DISPLAY, ROUNDS
from fedmq.config import Config, add_config_arguments, config_from_args, dataset_named
from fedmq.errors import UsageError
from fedmq.logs import mask_secrets, setup_logging
from fedmq.signals import SignalRelay
from sim.log_progress import LogProgress, progress_bar
from sim.seeds import int_list, seed_list

if TYPE_CHECKING:
    from sim.scenarios import Scenario

FLEET_METHODS = (*ASYNC_SERVER, "local")
"""What a simulated fleet runs (sim/fleet.py METHODS): the asynchronous server algorithms, and
agents training alone."""


def _add_part_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that decide one run; every process of a split run gets the same ones."""
    add_config_arguments(p, ("broker", "fleet", "log_level", "data_dir", "download", "seed"))
    _add_init_argument(p)
    p.add_argument("--dry-run", action="store_true",
                   help="check the scenario, dataset and flags, print the plan and exit")
    p.add_argument("--scenario", help="as in `fedmq sim run` (default rotated-digits, or the dataset under --data-dir)")
    p.add_argument("--method", default="cdfl", help=f"{', '.join(FLEET_METHODS)} (default cdfl)")
    p.add_argument("--clusters", type=int, help="K (default: the scenario's, 3 for most)")
    p.add_argument("--agents", type=int, help="agents in the whole fleet (default: the scenario's, 20*K for most)")
    p.add_argument("--updates-per-agent", type=float,
                   help="mean updates per agent (default: the scenario's, 25 for most)")
    p.add_argument("--min-samples", type=int, help="fewest samples per agent (default data.min_samples, 500)")
    p.add_argument("--max-samples", type=int, help="most samples per agent (default data.max_samples, 2000)")
    p.add_argument("--test-samples", type=int, help="test samples per agent and cycle (default: the scenario's, 300 for most)")
    p.add_argument("--out", required=True, type=Path,
                   help="output dir; the part goes to OUT/parts/LABEL/ (merge with `fedmq sim merge OUT`)")


def _add_init_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", metavar="FILE",
                   help="start every run from your own weights (aggregator.init): the model's torch state dict "
                        "(.pt) or float32 vector (.f32); the server's clusters and Local agents start from them")


def check_init(cfg: Config, scenario: Scenario) -> None:
    """aggregator.init against the model the scenario runs: a file that does not fit is one
    line (exit 2) before any run starts, and in a dry run."""
    if not cfg.aggregator.init:
        return
    import copy

    from fedmq.models import load_init_vector, resolve_model_name
    from sim.scenarios import apply_defaults

    resolved = copy.deepcopy(cfg)
    apply_defaults(scenario, resolved)
    load_init_vector(resolved.aggregator.init, resolve_model_name(resolved.model, resolved.data.dataset))


def fleet_defaults(args: argparse.Namespace, scenario: Scenario) -> None:
    """--clusters, --agents, --updates-per-agent and --test-samples not given: the scenario's (the real-size
    fleet's differ from the paper's 3 clusters, 20*K agents and 25 uploads each)."""
    # What the user gave (a scenario's 0 agents means 20*K, resolved per run).
    for flag, value, low in (("--agents", args.agents, 1), ("--updates-per-agent", args.updates_per_agent, 0),
                             ("--test-samples", args.test_samples, 1), ("--workers", getattr(args, "workers", 1), 1)):
        if value is not None and (value < low if low else value <= 0):
            raise UsageError(f"{flag} must be {'>= ' + str(low) if low else '> 0'}, got {value:g}")
    if args.clusters is None:
        args.clusters = str(scenario.fixed_clusters or scenario.clusters)
    if args.agents is None:
        args.agents = scenario.agents
    if args.updates_per_agent is None:
        args.updates_per_agent = scenario.updates_per_agent
    if args.test_samples is None:
        args.test_samples = scenario.test_samples


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sim_command", metavar="{run,report,rounds,ablation,aggregator,agents,merge}")
    r = sub.add_parser("run", help="run scenarios x methods x K x seeds and write CSV/JSON + report")
    add_config_arguments(r, ("broker", "fleet", "log_level", "data_dir", "download", "seed"))
    r.add_argument("--scenario",
                   help="rotated-digits (default; with --data-dir: the rotated scenario of the dataset there), rotated-mnist, rotated-fashionmnist, rotated-cifar100, "
                        "rotated-shapes, digits-domains, rotated (the dataset --set data.dataset=NAME names), "
                        "realsize-shapes or realsize (resnet20-gn, K = 4, >= 400 uploads a run; docs/simulator.md), "
                        "realsize-shapes-mobilenet (the same fleet, MobileNetV3-small) or realsize-mobilenet; "
                        "an offline scenario with --data-dir runs its fleet on the dataset there")
    _add_init_argument(r)
    r.add_argument("--methods", default="cdfl,fedsoft-async,local",
                   help=f"comma list of {', '.join(FLEET_METHODS)} (default cdfl,fedsoft-async,local)")
    r.add_argument("--clusters", help="K, or a comma list (default: the scenario's, 3 for most)")
    r.add_argument("--agents", type=int, help="agents per run (default: the scenario's, 20*K for most)")
    r.add_argument("--seeds", default="1",
                   help="number of seeds (N: seeds base..base+N-1, base from --seed) or a comma list")
    r.add_argument("--updates-per-agent", type=float,
                   help="mean updates per agent (default: the scenario's, 25 for most: the paper's)")
    r.add_argument("--workers", type=int, default=1,
                   help="agent worker threads (default 1: the run is a pure function of the seed)")
    r.add_argument("--min-samples", type=int, help="fewest samples per agent (default data.min_samples, 500)")
    r.add_argument("--max-samples", type=int, help="most samples per agent (default data.max_samples, 2000)")
    r.add_argument("--test-samples", type=int, help="test samples per agent and cycle (default: the scenario's, 300 for most)")
    r.add_argument("--out", required=True, type=Path, help="output dir")
    r.add_argument("--dry-run", action="store_true",
                   help="check the scenario, dataset, methods and flags, print the plan and exit")
    rep = sub.add_parser("report", help="table (paper's Table 1) and figures from a run's output dir "
                                        "(sim run, a split run's parts, or sim rounds)")
    rep.add_argument("out", type=Path, help="the --out dir of `fedmq sim run`, `sim agents` or `sim rounds`")
    rep.add_argument("--with", dest="with_dirs", metavar="DIR", type=Path, action="append", default=[],
                     help="another `sim run` dir (a control: the same fleet with other --set values) whose "
                          "runs join the tables as rows named by that dir, paired by seed (repeatable)")
    rounds = sub.add_parser("rounds", add_help=False, prefix_chars="+",
                            help=f"{', '.join(DISPLAY[a] for a in ROUNDS)} deadline rounds on a simulated "
                                 "clock (fedmq sim rounds --help)")
    rounds.add_argument("rest", nargs=argparse.REMAINDER)
    ablation = sub.add_parser("ablation", add_help=False, prefix_chars="+",
                              help="replay one fleet per CDFL variant (personalization, estimator, "
                                   "update rule) and compare (fedmq sim ablation --help)")
    ablation.add_argument("rest", nargs=argparse.REMAINDER)
    agg = sub.add_parser("aggregator", help="the aggregator of a run split over processes: serves one "
                                            "run's fleet on --broker until every update is applied")
    _add_part_arguments(agg)
    ag = sub.add_parser("agents", help="agents I..I+N-1 of a seeded fleet against an external "
                                       "aggregator (`fedmq sim aggregator`) on --broker")
    _add_part_arguments(ag)
    ag.add_argument("--first-agent", type=int, default=0, help="index of this process's first agent (0)")
    ag.add_argument("--count", type=int, default=0,
                    help="agents in this process (default: from --first-agent to the end of the fleet)")
    ag.add_argument("--workers", type=int, default=1, help="agent worker threads in this process (1)")
    ag.add_argument("--wait", type=float, default=300.0,
                    help="seconds to wait for the aggregator to come online (300)")
    merge = sub.add_parser("merge", help="merge a split run's parts (OUT/parts/LABEL/*) into OUT/runs/LABEL")
    merge.add_argument("out", type=Path, help="the --out dir the processes wrote to")


def run(args: argparse.Namespace) -> int:
    from sim.report import write_report

    if args.sim_command == "report":
        # with --with the report holds more than its dir's own runs: say what made it
        report, paths, text = write_report(args.out, invoked_command() if args.with_dirs else None, args.with_dirs)
        print(text)
        print(f"report: {report}")
        for p in paths:
            print(f"figure: {p}")
        return 0
    if args.sim_command == "rounds":
        from sim.rounds import main as rounds_main

        return rounds_main(args.rest, prog="fedmq sim rounds")
    if args.sim_command == "ablation":
        from sim.ablation import main as ablation_main

        return ablation_main(args.rest, prog="fedmq sim ablation")
    if args.sim_command in ("aggregator", "agents"):
        return run_part(args)
    if args.sim_command == "merge":
        from sim.split import SplitRunError, merge_parts

        try:
            merged = merge_parts(args.out)
        except SplitRunError as e:
            print(f"fedmq sim merge: {e}", file=sys.stderr)
            return 1
        if not merged:
            print(f"fedmq sim merge: no parts under {args.out / 'parts'}; give the --out dir that "
                  f"`fedmq sim agents` and `fedmq sim aggregator` wrote to", file=sys.stderr)
            return 1
        for d in merged:
            print(f"merged: {d}")
        return 0
    if args.sim_command != "run":
        print("usage: fedmq sim {run,report,rounds,aggregator,agents,merge} ... (see fedmq sim run --help)",
              file=sys.stderr)
        return 2
    return run_experiments(args)


def run_part(args: argparse.Namespace) -> int:
    """`fedmq sim aggregator` / `fedmq sim agents`: one process of a split run."""
    import signal
    import threading

    from sim.fleet import METHODS, RunSpec, fleet_name, local_training, make_schedule
    from sim.scenarios import resolve_scenario
    from sim.split import run_agents_part, run_aggregator_part

    cfg = config_from_args(args, {"min_samples": "data.min_samples", "max_samples": "data.max_samples",
                                  "init": "aggregator.init"})
    if args.fleet is None:
        cfg.fleet = "sim"
    setup_logging(cfg.log.level, cfg.log.json)
    if args.method not in METHODS:
        print(f"fedmq sim {args.sim_command}: unknown method {args.method!r}; one of {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    scenario = resolve_scenario(args.scenario, cfg, args.data_dir, dataset_named(args))
    check_init(cfg, scenario)
    fleet_defaults(args, scenario)
    spec = RunSpec(scenario=scenario.name, method=args.method, clusters=int(args.clusters), agents=args.agents,
                   seed=cfg.seed, updates_per_agent=args.updates_per_agent,
                   workers=getattr(args, "workers", 1), test_samples=args.test_samples,
                   cluster_test_samples=scenario.cluster_test_samples, **local_training(cfg.agent))
    print(f"run {spec.label}: fleet {fleet_name(cfg.fleet, spec)} on {mask_secrets(cfg.broker.url)}", flush=True)
    if args.dry_run:
        from sim.scenarios import describe_plan

        print(describe_plan(spec.scenario, cfg, [spec.clusters]))
        print(f"{spec.resolved_agents()} agents, {spec.updates_per_agent:g} updates per agent; "
              f"output {args.out} (dry run: nothing started)")
        return 0
    if args.sim_command == "aggregator":
        stop = threading.Event()
        SignalRelay({signal.SIGTERM: stop.set, signal.SIGINT: stop.set})
        d = run_aggregator_part(spec, cfg, args.out, stop=stop, command=invoked_command())
        import json

        complete = json.loads((d / "part.json").read_text())["complete"]
        print(f"part: {d}" + ("" if complete else " (stopped before the run was complete)"), flush=True)
        return 0 if complete else 1
    count = args.count or spec.resolved_agents() - args.first_agent
    mine = range(args.first_agent, args.first_agent + count)
    events = sum(1 for a, _ in make_schedule(spec.seed, spec.resolved_agents(), spec.updates_per_agent)
                 if a in mine)
    bar = progress_bar(events)
    try:
        d = run_agents_part(spec, cfg, args.out, first=args.first_agent, count=count, wait_s=args.wait,
                            progress=bar.update, command=invoked_command())
    finally:
        bar.close()
    print(f"part: {d}", flush=True)
    return 0


def invoked_command() -> str | None:
    """This process's `fedmq sim ...` command line, as a run records it, a broker password
    masked (None when not run so)."""
    if "sim" not in sys.argv:
        return None
    return mask_secrets("fedmq sim " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("sim") + 1:]))


def run_experiments(args: argparse.Namespace) -> int:
    from sim.fleet import (
        METHODS,
        RunSpec,
        describe_split,
        local_training,
        make_schedule,
        run_fleet,
        write_run,
    )
    from sim.report import write_report
    from sim.scenarios import resolve_scenario

    cfg = config_from_args(args, {"min_samples": "data.min_samples", "max_samples": "data.max_samples",
                                  "init": "aggregator.init"})
    if args.fleet is None:
        cfg.fleet = "sim"
    setup_logging(cfg.log.level, cfg.log.json)
    scenario = resolve_scenario(args.scenario, cfg, args.data_dir, dataset_named(args))
    check_init(cfg, scenario)
    fleet_defaults(args, scenario)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            print(f"fedmq sim run: unknown method {m!r}; one of {', '.join(METHODS)}", file=sys.stderr)
            return 2
    seeds = seed_list(args.seeds, cfg.seed)
    clusters = int_list(args.clusters, "--clusters", minimum=1)
    specs = [RunSpec(scenario=scenario.name, method=m, clusters=k, agents=args.agents, seed=s,
                     updates_per_agent=args.updates_per_agent, workers=args.workers,
                     test_samples=args.test_samples, cluster_test_samples=scenario.cluster_test_samples,
                     **local_training(cfg.agent))
             for k in clusters for s in seeds for m in methods]
    total = sum(len(make_schedule(sp.seed, sp.resolved_agents(), sp.updates_per_agent)) for sp in specs)
    from sim.scenarios import describe_plan

    # A real run checks what a dry run does (data, set sizes, one training step) before it
    # writes anything: what would fail an hour in fails here, in one line, with no --out left.
    print(describe_plan(scenario.name, cfg, clusters), flush=True)
    if args.dry_run:
        print(f"{len(specs)} runs (methods {', '.join(methods)}; K {', '.join(map(str, clusters))}; "
              f"seeds {', '.join(map(str, seeds))}), {total} updates in all; output {args.out} "
              "(dry run: nothing started)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    command = invoked_command()
    bar = progress_bar(total)
    finished = 0
    try:
        for i, sp in enumerate(specs):
            bar.set_postfix_str(sp.label)
            t0 = time.perf_counter()
            result = run_fleet(sp, cfg, broker_url=cfg.broker.url if args.broker else None,
                               progress=bar.update)
            write_run(result, args.out, command)
            finished += 1  # kept once written, before anything says so
            if isinstance(bar, LogProgress):  # no bar in a log: one line per finished run too
                refused = result.summary()["refused"]
                print(f"run {i + 1}/{len(specs)} {sp.label}: {len(result.updates)} updates in "
                      f"{time.perf_counter() - t0:.0f} s ({describe_split(result.info['wall_split'])})"
                      + (f", {sum(refused.values())} refused ("
                         + ", ".join(f"{k} {n}" for k, n in refused.items()) + ")" if refused else ""),
                      flush=True)
    except KeyboardInterrupt:
        bar.close()
        kept = (f"kept the {finished} finished run{'s' if finished != 1 else ''} of {len(specs)} in {args.out} "
                f"(`fedmq sim report {args.out}` reads them)" if finished else f"no run had finished; {args.out} holds none")
        print(("\n" if sys.stderr.isatty() else "")  # below the bar
              + f"fedmq sim run: stopped; {kept}; "
            + (f"{specs[finished].label} was under way and is not kept" if finished < len(specs)
               else "the report was not written"),
              file=sys.stderr)
        return 130
    finally:
        bar.close()
    report, paths, text = write_report(args.out, command)
    print(text)
    print(f"report: {report}")
    for p in paths:
        print(f"figure: {p}")
    return 0
