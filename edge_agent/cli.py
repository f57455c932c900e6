"""Run an edge agent: serve predictions, watch accuracy, train and upload on drift.

examples:
  fedmq agent --broker mqtt://127.0.0.1:1883 --fleet demo --id car-7 --profile car --state-dir st/car-7
  fedmq agent --id phone-2 --profile phone --algorithm fedsoft-async --dataset digits
  fedmq agent --id cam-1 --source directory --source-dir /var/lib/cam/samples --algorithm local
  fedmq agent --id car-7 --update-now          # one upload as soon as enough samples are in
  fedmq agent --id car-8 --algorithm fedavg    # deadline rounds: answer the aggregator's invites

State (model, tau, pending upload, detector, counters) lives in --state-dir (default
state/agent-ID; one agent per dir, a second exits naming the first's pid); a restart
resumes from it and first re-sends an upload that was never answered. SIGUSR1 asks for an
update now; SIGTERM or Ctrl-C stops cleanly: training ends at the next epoch, an upload in
flight stays pending on disk (sent after the next start), the status goes offline.

With --algorithm catafed, fedavg or fedprox the agent joins deadline rounds (an aggregator
started with the same --algorithm): it holds n samples of the dataset's train split, n drawn
in [data.min_samples, data.max_samples] from (seed, id), trains on each invite and prints one
line per round. It keeps no state on disk (a round is only useful within its deadline), and
exits 0 when the aggregator says its run is over (docs/catafed.md).

It exits 1 with one line when retrying cannot help: the broker refuses its own topics to its
login (under broker_config/prod.conf a login is one agent's id, in its fleets), or another
process with the same id holds its session (the one that connected last stops).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import zlib

from fedmq.algorithms import ASYNC_AGENT, ROUNDS
from fedmq.config import add_config_arguments, config_from_args, dry_run_json
from fedmq.logs import event, get_logger, mask_secrets, setup_logging
from fedmq.signals import SignalRelay

log = get_logger("agent")



def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("broker", "fleet", "ca_file", "cert_file", "key_file", "dataset",
                             "data_dir", "download", "model", "seed", "log_level"))
    p.add_argument("--id", dest="agent_id", metavar="ID", help="agent id (required; config agent.id)")
    p.add_argument("--algorithm", choices=ASYNC_AGENT + ROUNDS,
                   help=f"{ASYNC_AGENT[0]} (default), {', '.join(a for a in ASYNC_AGENT[1:] if a != 'local')}, "
                        f"local (never talks to a server), or the deadline rounds {', '.join(ROUNDS)}")
    p.add_argument("--profile", choices=("car", "phone", "device"), help="device profile (default device)")
    p.add_argument("--state-dir", metavar="DIR", help="durable state (default state/agent-ID); one agent per dir")
    p.add_argument("--clusters", type=int, metavar="K", help="rotation clusters of the dataset source (default 3)")
    p.add_argument("--source", choices=("dataset", "directory"), help="where labelled samples come from")
    p.add_argument("--source-dir", metavar="DIR", help="folder of the directory source")
    p.add_argument("--update-now", action="store_true",
                   help="train and upload once as soon as the buffer holds agent.min_samples_to_train samples")
    p.add_argument("--max-steps", type=int, metavar="N", help="stop after N polls (tests, batch runs)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, {"agent_id": "agent.id", "algorithm": "agent.algorithm",
                                  "profile": "agent.profile", "state_dir": "agent.state_dir",
                                  "clusters": "cdfl.clusters", "source": "agent.source",
                                  "source_dir": "agent.source_dir"})
    setup_logging(cfg.log.level, cfg.log.json, auto="progress")
    from fedmq.model_for_data import fit_model

    fit_model(cfg)  # a folder dataset's model, from its images (the aggregator picks the same)
    if args.dry_run:
        from fedmq.transport import check_tls_files

        check_tls_files(cfg.broker)  # a missing --ca-file: one line, exit status 2
        print(dry_run_json(cfg))
        return 0
    if not cfg.agent.id:
        print("fedmq agent: --id (or agent.id) is required", file=sys.stderr)
        return 2
    if cfg.agent.algorithm in ROUNDS:
        return _run_rounds(cfg)
    from edge_agent.agent_loop import DeviceAgent, make_source
    from edge_agent.profiles import get_profile
    from fedmq.state_dir import StateDirLock, check_writable

    # Said now, not at the first save or at SIGTERM, minutes or hours into the run.
    check_writable(cfg.agent.state_path())
    StateDirLock(cfg.agent.state_path(), role="agent")  # held until this process exits

    profile = get_profile(cfg.agent.profile, seed=cfg.seed)
    device = DeviceAgent(cfg, make_source(cfg, profile), profile=profile)
    actions = {signal.SIGTERM: device.request_stop, signal.SIGINT: device.request_stop}
    if hasattr(signal, "SIGUSR1"):
        actions[signal.SIGUSR1] = device.trigger
    SignalRelay(actions)
    if args.update_now:
        device.trigger()
    try:
        device.start()
        print(f"agent {device.agent_id} ({device.algorithm}, {device.profile.name}) on {mask_secrets(cfg.broker.url)} "
              f"fleet={cfg.fleet} tau={device.tau} backend={device.predictor.backend if device.predictor else '-'}",
              flush=True)
        device.run(max_steps=args.max_steps)
    finally:
        device.close()
        event(log, "agent.stopped", agent=device.agent_id, tau=device.tau,
              pending=device.state.pending.msg_id if device.state.pending else None, counters=device.counters)
    return 0


def _run_rounds(cfg) -> int:
    """A round agent (edge_agent/round_agent.py) on its share of the dataset until SIGTERM/Ctrl-C."""
    import numpy as np
    import torch

    from edge_agent.round_agent import RoundAgent, RoundLog
    from fedmq.data import load_dataset

    train = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir, download=cfg.data.download)
    lo, hi = min(cfg.data.min_samples, cfg.data.max_samples), cfg.data.max_samples
    if lo < 1:
        print("fedmq agent: data.min_samples must be >= 1", file=sys.stderr)
        return 2
    seed = zlib.crc32(cfg.agent.id.encode())  # agents differ in data and batch order
    rng = np.random.default_rng([cfg.seed, seed])
    n = min(int(rng.integers(lo, hi + 1)), len(train.y))
    idx = torch.from_numpy(np.sort(rng.choice(len(train.y), size=n, replace=False)))

    def say(r: RoundLog) -> None:
        what = (f"trained {r.n_samples} samples x {r.epochs} epochs in {r.train_s:.1f} s"
                if r.finished else f"cut by the deadline after {r.train_s:.1f} s, shard now {r.shard_size}")
        print(f"round {r.round + 1}: {what}, report sent in {r.upload_s:.2f} s", flush=True)

    agent = RoundAgent(cfg, cfg.agent.id, train.x[idx], train.y[idx], algorithm=cfg.agent.algorithm,
                       seed=cfg.seed * 2**32 + seed, on_round=say)
    stop = threading.Event()
    SignalRelay({signal.SIGTERM: stop.set, signal.SIGINT: stop.set})
    try:
        agent.start()
        print(f"agent {agent.agent_id} ({agent.algorithm}, rounds) on {mask_secrets(cfg.broker.url)} "
              f"fleet={cfg.fleet} samples={n}", flush=True)
        while not stop.wait(0.5) and not agent.finished.is_set() and agent.fatal is None:
            pass
        agent.guard.check()  # its login refused its topics, or its session taken: exit status 1
        if agent.finished.is_set():
            print(f"agent {agent.agent_id}: the aggregator finished after {agent.finished_after} rounds; "
                  f"stopping", flush=True)
    finally:
        agent.stop()
        event(log, "agent.stopped", agent=agent.agent_id, counters=agent.counters)
    return 0
