"""Round settings refused from the CLI in one line.

The round fleet itself (`fedmq aggregator --algorithm fedavg --min-agents 2` and two agents,
docs/catafed.md) runs as written in tests/test_documented_commands.py: the agents start one
after the other, round 1 inviting both shows the aggregator waited for --min-agents, and the
round snapshot is on disk.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 120.0


def test_round_settings_errors_are_one_line(warm_python) -> None:
    # Both are refused before any connection: no broker needed.
    for args, expected in ((("--set", "catafed.prox_mu=0.1"), "set fedavg.prox_mu instead"),
                           (("--min-agents", "-1"), "--min-agents (catafed.min_agents) must be >= 0, got -1")):
        done = subprocess.run(client_argv(warm_python, "python", "-m", "fedmq.cli", "aggregator", "--algorithm",
                                          "fedavg", "--broker", "mqtt://127.0.0.1:1", *args), cwd=ROOT,
                              capture_output=True, text=True, timeout=WAIT_S)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr
