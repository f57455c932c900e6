"""What every soak driver starts from: a small digits fleet config, a pre-trained aggregator
state dir (pre-training once, copied per run), the aggregator as a real subprocess, and RSS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedmq.config import Config, load_config

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "soak" / "results"

SMALL: dict[str, Any] = {
    "cdfl.clusters": 2, "data.dataset": "digits", "data.proxy_per_cluster": 150,
    "data.pretrain_per_cluster": 300, "aggregator.pretrain_epochs": 2, "device": "cpu",
    "protocol.chunk_bytes": 64 * 1024, "protocol.max_message_bytes": 256 * 1024,
    "aggregator.accuracy_every": 0,
}
"""The digits CNN (13.7 k parameters), K = 2, small proxy sets: fast to start and to restart."""


def small_config(broker_url: str, state_dir: Path, fleet: str, **extra: Any) -> Config:
    return load_config(None, {**SMALL, "fleet": fleet, "broker.url": broker_url,
                              "aggregator.state_dir": str(state_dir), **extra})


def pretrained_state(into: Path, cache: Path | None = None, **extra: Any) -> Path:
    """A state dir holding the pre-trained cluster models (first snapshot) at `into`.

    With `cache`, pre-training happens once there and later calls copy it.
    """
    from aggregator.bootstrap import build_engine

    source = cache or into
    if not (source / "snapshot-1.msgpack").exists():
        cfg = load_config(None, {**SMALL, "aggregator.state_dir": str(source), **extra})
        engine = build_engine(cfg)
        engine.recover()
        engine.journal.close()
    if source != into:
        shutil.copytree(source, into)
    return into


def start_aggregator(broker_url: str, state_dir: Path, fleet: str, log: Path, *,
                     settings: dict[str, Any] | None = None, extra_args: list[str] | None = None,
                     preexec_fn: Any = None, stdout: Any = None) -> subprocess.Popen:
    """`fedmq aggregator` as a child process (so it can be killed -9 and restarted)."""
    args = [sys.executable, "-m", "fedmq.cli", "aggregator", "--broker", broker_url,
            "--state-dir", str(state_dir), "--log-level", "info"]
    for k, v in {**SMALL, "fleet": fleet, **(settings or {})}.items():
        args += ["--set", f"{k}={v}"]
    args += extra_args or []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = stdout if stdout is not None else log.open("ab")
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            preexec_fn=preexec_fn)


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def write_figures(name: str, figures: dict[str, Any], out: Path | None = None) -> Path:
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1, default=float) + "\n")
    return path
