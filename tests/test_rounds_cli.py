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


def test_sim_rounds_starts_every_algorithm_from_an_init_file(tmp_path, warm_python) -> None:
    """`python -m sim.rounds --init FILE`: the deadline rounds on the start a fleet of the
    asynchronous algorithms gets (`fedmq start-model`'s file), seen in the first round's accuracy."""
    import json

    from fedmq.data import load_dataset
    from fedmq.models import build_model, to_vector
    from fedmq.training import fit

    train = load_dataset("digits")
    trained = fit("digits-cnn", to_vector(build_model("digits-cnn", seed=3)), train.x, train.y, epochs=8, lr=0.05,
                  momentum=0.9, seed=0).vector
    trained.numpy().tofile(tmp_path / "start.f32")
    first = {}
    for name, extra in (("init", ["--init", str(tmp_path / "start.f32")]), ("random", [])):
        out = tmp_path / name
        done = subprocess.run(client_argv(warm_python, "python", "-m", "sim.rounds", "--algorithms", "fedavg",
                                          "--rounds", "1", "--agents", "6", "--jobs", "1", *extra, "--out", str(out)),
                              cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
        assert done.returncode == 0, done.stderr
        first[name] = json.loads((out / "results.json").read_text())["runs"][0]["rounds"][0]["accuracy"]
    assert first["init"] > 0.8 > 0.5 > first["random"], first
    done = subprocess.run(client_argv(warm_python, "python", "-m", "sim.rounds", "--init", str(tmp_path / "start.f32"),
                                      "--pretrain", "100", "--dry-run"), cwd=ROOT, capture_output=True, text=True,
                          timeout=WAIT_S)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "give one" in lines[0], done.stderr
