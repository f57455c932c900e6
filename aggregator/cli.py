"""Run the aggregator: subscribe to a fleet's uplinks, apply the algorithm, reply per agent.

examples:
  fedmq aggregator --broker mqtt://127.0.0.1:1883 --fleet demo --clusters 3
  fedmq aggregator --algorithm fedsoft-async --dataset mnist --data-dir ~/data --state-dir st/
  fedmq aggregator --config deploy/aggregator.toml --state-dir st/agg --set cdfl.beta0=0.1
  fedmq aggregator --algorithm catafed --set catafed.deadline_s=20   # deadline rounds
  fedmq aggregator --algorithm fedavg --min-agents 2 --set fedavg.clients_per_round=2

State (cluster models, journal) lives in --state-dir; a restart resumes from it. SIGTERM or
Ctrl-C stops cleanly (final snapshot, offline status). Deadline rounds (catafed, fedavg,
fedprox, tifl) wait for --min-agents agents (`fedmq agent --algorithm` the same) before round 1
and print one line per round.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from fedmq.algorithms import ASYNC_SERVER, ROUNDS
from fedmq.config import ConfigError, add_config_arguments, config_from_args, dry_run_json
from fedmq.errors import RuntimeFailure
from fedmq.logs import mask_secrets, setup_logging
from fedmq.signals import SignalRelay

ALGORITHMS = ASYNC_SERVER + ROUNDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("broker", "fleet", "ca_file", "cert_file", "key_file", "dataset",
                             "data_dir", "download", "model", "device", "seed", "log_level"))
    p.add_argument("--algorithm", choices=ALGORITHMS, help="server algorithm (default cdfl)")
    p.add_argument("--clusters", type=int, metavar="K", help="number of cluster models (default 3)")
    p.add_argument("--min-agents", type=int, metavar="N",
                   help="deadline rounds: agents to wait for before round 1 (catafed.min_agents; "
                        "default: the agents one round invites)")
    p.add_argument("--state-dir", metavar="DIR", help="snapshots and journal (default state/aggregator)")
    p.add_argument("--accept-journal-loss", action="store_true", default=None,
                   help="start although the journal is damaged, skipping (and logging) the damaged "
                        "records; without it a damaged journal stops the start and changes nothing")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: off)")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="address of the metrics endpoint (default 127.0.0.1; 0.0.0.0 in a container)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="CDFL: start N reply worker processes on this machine that train the replies "
                        "(aggregator.reply_workers; default 0: trained here). `fedmq worker` adds more elsewhere")
    p.add_argument("--init", metavar="FILE",
                   help="start the fleet from your own weights: the model's torch state dict (.pt) or raw "
                        "float32 vector (.f32), checked against the model (aggregator.init; a new state dir only)")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve the config, print it and exit without connecting")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, {"algorithm": "aggregator.algorithm", "clusters": "cdfl.clusters",
                                  "min_agents": "catafed.min_agents",
                                  "state_dir": "aggregator.state_dir",
                                  "accept_journal_loss": "aggregator.accept_journal_loss",
                                  "metrics_port": "metrics.port", "metrics_host": "metrics.host",
                                  "workers": "aggregator.reply_workers", "init": "aggregator.init"})
    setup_logging(cfg.log.level, cfg.log.json, auto="progress")
    _check_reply_workers(cfg)
    cfg.cdfl.check()
    from fedmq.model_for_data import fit_model

    fit_model(cfg)  # a folder dataset's model, from its images (the agents pick the same)
    if cfg.aggregator.init:  # a file that does not fit the model: one line now, not after the set-up
        from fedmq.models import load_init_vector, resolve_model_name

        load_init_vector(cfg.aggregator.init, resolve_model_name(cfg.model, cfg.data.dataset))
    if args.dry_run:
        from fedmq.transport import check_tls_files

        check_tls_files(cfg.broker)  # a missing --ca-file: one line, exit status 2
        print(dry_run_json(cfg))
        return 0
    stop = threading.Event()
    stops = {signal.SIGTERM: stop.set, signal.SIGINT: stop.set}  # also when started with SIGINT ignored
    from aggregator.journal import Journal
    from fedmq.state_dir import StateDirLock

    # Fail in a second, not after minutes of loading data and pre-training.
    Journal(cfg.aggregator.state_dir).check_writable()
    StateDirLock(cfg.aggregator.state_dir)  # held until this process exits
    if cfg.aggregator.algorithm in ROUNDS:
        SignalRelay(stops)
        return _run_rounds(cfg, stop)
    # Until it serves, a stop ends the start-up where it is (a real model pre-trains for
    # minutes); nothing has been acknowledged yet, and the caches are written whole or not at all.
    for sig in stops:
        signal.signal(sig, _interrupt)
    try:
        engine, service, pool, workers = _start(cfg)
        SignalRelay(stops)
    except KeyboardInterrupt:
        print("aggregator: stopped during start-up; nothing was served", flush=True)
        return 0
    metrics = None
    if cfg.metrics.port:
        from aggregator.prometheus import AggregatorMetrics

        metrics = AggregatorMetrics(service)
    with service:
        if metrics is not None:
            port = metrics.serve(cfg.metrics.port, cfg.metrics.host)
            print(f"metrics: http://{cfg.metrics.host}:{port}/metrics", flush=True)
        print(f"aggregator {cfg.aggregator.algorithm} on {mask_secrets(cfg.broker.url)} fleet={cfg.fleet} "
              f"K={cfg.cdfl.clusters} epoch={engine.strategy.uploads_applied}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(0.5) and not service.sole.failed.is_set():
                if workers is not None:
                    workers.poll()
    if workers is not None:
        workers.stop()
    if pool is not None:
        pool.close()
    if metrics is not None:
        metrics.close()
    if service.sole.failure:
        raise RuntimeFailure(service.sole.failure)
    return 0


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _start(cfg):
    """Everything before serving: data, pre-training, the sole-aggregator check, the reply pool."""
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService
    from fedmq.transport import check_reachable

    check_reachable(cfg.broker.url)
    engine = build_engine(cfg)
    service = AggregatorService(cfg, engine)
    # Before the reply pool connects: its login is shared with the serving aggregator's pool.
    service.sole.started()
    if not service.sole.clear_to_serve(cfg.broker, derived_logins=cfg.aggregator.derived_logins,
                                       network=service.transport.network):
        raise RuntimeFailure(service.sole.failure)
    pool, workers = _reply_pool(cfg, engine)
    return engine, service, pool, workers


def _check_reply_workers(cfg) -> None:
    """--workers / aggregator.reply_pool need a reply to hand out: said before minutes of set-up."""
    a, c = cfg.aggregator, cfg.cdfl
    if a.reply_workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {a.reply_workers}")
    if not (a.reply_workers or a.reply_pool):
        return
    if a.algorithm != "cdfl":
        raise ConfigError(f"--workers: reply workers train CDFL's replies; {a.algorithm} replies cost nothing to make")
    trains = c.personalization == "finetune" or (c.personalization.startswith("distill") and c.personalize_kd_weight == 0)
    if not trains or c.personalize_epochs == 0:
        raise ConfigError(f"--workers: cdfl.personalization = {c.personalization} (kd_weight "
                          f"{c.personalize_kd_weight:g}, {c.personalize_epochs} epochs) has no fine-tune for "
                          f"workers; they train finetune, or distill with personalize_kd_weight = 0")


def _reply_pool(cfg, engine):
    """CDFL with reply workers: the pool that hands them the replies, and the local workers
    (`--workers N`); (None, None) without them."""
    a = cfg.aggregator
    if not (a.reply_workers or a.reply_pool):
        return None, None
    if a.algorithm != "cdfl" or not engine.strategy.personalizer.trains_together():
        raise ConfigError("reply workers train CDFL's fine-tune replies (cdfl.personalization finetune, "
                          "or distill with personalize_kd_weight = 0); this aggregator has none to hand out")
    from aggregator.reply_jobs import reply_digest
    from aggregator.reply_pool import ReplyPool, pool_broker
    from aggregator.worker_cli import LocalWorkers

    strategy = engine.strategy
    pool = ReplyPool(strategy.personalizer, reply_digest(strategy.personalizer, strategy.evaluator), cfg.fleet,
                     pool_broker(cfg.broker, a.derived_logins), numel=engine.spec.numel, k=strategy.k, timeout_s=a.worker_timeout_s).start()
    strategy.personalizer = pool
    workers = LocalWorkers(cfg, a.reply_workers, a.worker_threads).start() if a.reply_workers else None
    return pool, workers


def _run_rounds(cfg, stop: threading.Event) -> int:
    """CATA-Fed / FedAvg / FedProx / TiFL: synchronous deadline rounds (aggregator/round_service.py)."""
    from aggregator.round_algorithms import make_round_strategy, min_agents
    from aggregator.round_service import RoundRecord, RoundService
    from fedmq.config import CataFedSettings
    from fedmq.data import load_dataset
    from fedmq.models import build_model, load_init_vector, resolve_model_name, to_vector
    from fedmq.training import evaluate
    from fedmq.transport import check_reachable

    algorithm = cfg.aggregator.algorithm
    try:
        wanted = min_agents(algorithm, cfg.catafed, cfg.fedavg)
    except ValueError as e:
        print(f"fedmq aggregator: {e}", file=sys.stderr)
        return 2
    if algorithm != "catafed":
        _warn_catafed_only(cfg.catafed, CataFedSettings())
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    test = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir, train=False,
                        download=cfg.data.download)
    start = (load_init_vector(cfg.aggregator.init, model_name) if cfg.aggregator.init
             else to_vector(build_model(model_name, seed=cfg.seed)))
    strategy = make_round_strategy(algorithm, cfg.catafed, start, seed=cfg.seed,
                                   fedavg=cfg.fedavg, tifl=cfg.tifl)
    check_reachable(cfg.broker.url)  # after every settings check (those are usage errors)

    def report(r: RoundRecord) -> None:
        acc = "-" if r.accuracy is None else f"{r.accuracy:.3f}"
        print(f"round {r.round + 1}: invited {len(r.selected)}, finished {len(r.finished)}, "
              f"stragglers {len(r.stragglers)}, dropouts {len(r.dropouts)}, {r.ended} after "
              f"{r.seconds:.1f} s, accuracy {acc}", flush=True)

    rounds = cfg.catafed.rounds
    with RoundService(cfg, strategy, model_name=model_name,
                      evaluate=lambda w: evaluate(model_name, w, test.x, test.y)[0],
                      state_dir=cfg.aggregator.state_dir) as service:
        left = max(0, rounds - strategy.round)  # catafed.rounds counts the rounds of the state dir
        if left:
            print(f"aggregator {algorithm} (rounds) on {mask_secrets(cfg.broker.url)} fleet={cfg.fleet} "
                  f"round={strategy.round}; waiting for {wanted} agents", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                records = service.run(rounds=left, stop=stop, min_agents=wanted, on_round=report)
                service.finished = not stop.is_set()
        else:
            records, service.finished = [], not service.sole.failed.is_set()
        if service.finished:  # stop() tells the agents, which exit
            target = cfg.catafed.target_accuracy
            why = (f"target accuracy {target:g} reached" if target and records and records[-1].accuracy is not None
                   and records[-1].accuracy >= target else f"catafed.rounds = {rounds} done")
            print(f"aggregator {algorithm}: finished after {strategy.round} rounds ({why}); agents told to "
                  f"stop. A restart on {cfg.aggregator.state_dir} runs only the rounds up to a larger "
                  f"catafed.rounds", flush=True)
    if service.sole.failure:
        raise RuntimeFailure(service.sole.failure)
    return 0


def _warn_catafed_only(given, defaults) -> None:
    """FedAvg/FedProx/TiFL read [fedavg]: say so when a CATA-Fed-only knob was changed for them."""
    for key, new in (("per_group", "clients_per_round"), ("epochs", "epochs"),
                     ("batch_size", "batch_size"), ("lr", "lr")):
        if getattr(given, key) != getattr(defaults, key):
            print(f"fedmq aggregator: catafed.{key} applies to CATA-Fed only; FedAvg/FedProx/TiFL "
                  f"read fedavg.{new}", file=sys.stderr)
