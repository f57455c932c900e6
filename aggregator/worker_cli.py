"""Run a CDFL reply worker: train the personalized replies of a fleet's aggregator.

examples:
  fedmq worker --broker mqtt://127.0.0.1:1883 --fleet garage --id box-2
  fedmq worker --broker mqtt://127.0.0.1:1883 --fleet garage --slots 2 --threads 1

On a GPU machine: --device cuda --slots 4 (jobs train side by side on the device).

Start it with the aggregator's config (model, dataset, data dir, [cdfl] settings, seed): it
draws the same proxy sets and announces a digest of them; the aggregator gives jobs only to
workers whose digest is its own (`worker.mismatch` in its log otherwise). Any number may
run, on any machine that reaches the broker; `fedmq aggregator --workers N` starts N on its
own machine. SIGTERM or Ctrl-C stops cleanly (the job in hand is finished first).

Under broker_config/prod.conf a worker logs in as its own user (`fedmq creds --worker NAME`),
and its id is that user name: the ACL gives each worker user its own topics only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from fedmq.config import Config, add_config_arguments, config_from_args, dry_run_json
from fedmq.logs import event, get_logger, mask_secrets, setup_logging
from fedmq.service_logins import PASSWORD_ENV, derived_url, derived_user, url_user, worker_role
from fedmq.signals import SignalRelay

log = get_logger("aggregator")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("broker", "fleet", "ca_file", "cert_file", "key_file", "dataset",
                             "data_dir", "download", "model", "device", "seed", "log_level"))
    p.add_argument("--clusters", type=int, metavar="K", help="number of cluster models (default 3), as the aggregator's")
    p.add_argument("--id", metavar="NAME",
                   help="this worker's name, unique in the fleet (default: the broker URL's user "
                        "name, else HOSTNAME-PID)")
    p.add_argument("--slots", type=int, default=1, metavar="N",
                   help="jobs trained at once (default 1; more on a GPU)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch threads (default 0: torch's own choice, all cores)")
    p.add_argument("--dry-run", action="store_true", help="resolve the config, print it and exit")


def run(args: argparse.Namespace) -> int:
    from aggregator.reply_worker import ReplyWorker, build_reply_parts, worker_config_from_env

    cfg = worker_config_from_env(config_from_args(args, {"clusters": "cdfl.clusters"}))
    setup_logging(cfg.log.level, cfg.log.json, auto="progress")
    if args.dry_run:
        print(dry_run_json(cfg))
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from fedmq.transport import check_reachable

    check_reachable(cfg.broker.url)
    worker_id = args.id or url_user(cfg.broker.url) or f"{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    SignalRelay({signal.SIGTERM: stop.set, signal.SIGINT: stop.set})
    spec, evaluator, personalizer = build_reply_parts(cfg)
    with ReplyWorker(cfg, worker_id, spec, evaluator, personalizer, slots=args.slots) as worker:
        print(f"worker {worker_id} on {mask_secrets(cfg.broker.url)} fleet={cfg.fleet} model={spec.arch} "
              f"slots={args.slots} device={evaluator.device} digest={worker.digest[:12]}", flush=True)
        parent = int(os.environ.get("FEDMQ_WORKER_PARENT", "0"))
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(0.5):
                if parent and os.getppid() != parent:  # started by an aggregator that is gone
                    event(log, "worker.orphaned", level=30, worker=worker_id, action="stopping")
                    break
    return 0


class LocalWorkers:
    """`fedmq aggregator --workers N`: N `fedmq worker` processes on this machine, each with
    the aggregator's resolved config (environment, not argv), restarted when one exits."""

    def __init__(self, cfg: Config, n: int, threads: int = 0) -> None:
        self.cfg, self.n = cfg, n
        self.threads = threads or max(1, (os.cpu_count() or 1) // max(1, n))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.restarts = 0
        self._user = url_user(cfg.broker.url) if cfg.aggregator.derived_logins else None

    def worker_id(self, i: int) -> str:
        """USER-worker-I when it logs in as its own derived user (its id is its user name, as the
        ACL wants), else FLEET-local-I."""
        return derived_user(self._user, worker_role(i)) if self._user else f"{self.cfg.fleet}-local-{i}"

    def _env(self, i: int) -> dict[str, str]:
        """The aggregator's config, with worker i's own login: it never sees the aggregator's password."""
        cfg = self.cfg
        if self._user:
            cfg = dataclasses.replace(cfg, broker=dataclasses.replace(
                cfg.broker, url=derived_url(cfg.broker.url, worker_role(i))))
        env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV or not self._user}  # ours, not theirs
        return {**env, "FEDMQ_WORKER_CONFIG": json.dumps(dataclasses.asdict(cfg)),
                "OMP_NUM_THREADS": str(self.threads), "FEDMQ_WORKER_PARENT": str(os.getpid())}

    def _spawn(self, i: int) -> None:
        argv = [sys.executable, "-m", "fedmq", "worker", "--id", self.worker_id(i), "--threads", str(self.threads)]
        self.procs[i] = subprocess.Popen(argv, env=self._env(i), stdin=subprocess.DEVNULL)

    def start(self) -> LocalWorkers:
        for i in range(self.n):
            self._spawn(i)
        event(log, "workers.started", workers=self.n, threads_each=self.threads)
        return self

    def poll(self) -> None:
        """Restart any worker that exited (a crash costs its job a re-dispatch, nothing more)."""
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                event(log, "worker.exited", level=30, worker=self.worker_id(i), code=p.returncode, action="restarting")
                self.restarts += 1
                self._spawn(i)

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
