"""sim.rounds_live: the simulator's fleets run as RoundService + RoundAgents over a real Mosquitto.

One small run (4 agents, 3 rounds, CATA-Fed and FedAvg, a 20 s deadline at 0.05 wall s per
simulated second) with its simulated twin; the checks are on what does not depend on how
busy the machine is: the output loads as sim/rounds.py's, every run has its rounds and real
accuracies, and every invitation the live service sent is the one the strategy makes from
the fleet's data sizes and the reports the service got (FedAvg's never depend on timing, so
they equal the twin's too). No timing ratio is asserted: the run's rounds end on the
service's own cut-offs, and the test only waits for `main` to return.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aggregator.catafed import RoundResult
from aggregator.round_algorithms import make_round_strategy
from fedmq.config import CataFedSettings, FedAvgSettings
from fedmq.data import load_dataset
from fedmq.errors import run_main
from sim import rounds_live
from sim.rounds import FleetSpec, load_results, non_iid_fleet

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 3


def replay_invitations(algorithm: str, data: dict, live_rounds: list[dict]) -> None:
    """Feed a fresh strategy the fleet and the reports the live service got; it must invite
    the same agents with the same sizes, and see the same silent ones, every round."""
    catafed = CataFedSettings(**data["settings"])
    strategy = make_round_strategy(algorithm, catafed, torch.zeros(4), seed=0,
                             fedavg=FedAvgSettings.like(catafed))
    for d in non_iid_fleet(FleetSpec(**data["fleet"]), load_dataset("digits"), 0):
        strategy.register(d.agent, int(d.x.shape[0]))
    for rec in live_rounds:
        plan = strategy.open_round()
        assert plan.selected == rec["selected"], rec
        assert rec["sizes"] == {a: strategy.agents[a].size for a in plan.selected}
        for a in rec["finished"]:
            n = rec["sizes"][a]
            strategy.accept(RoundResult(a, plan.round, True, n, n, torch.ones(4)))
        for a in rec["stragglers"]:
            strategy.accept(RoundResult(a, plan.round, False, 0, rec["sizes_after"][a]))
        outcome = strategy.close_round()
        assert sorted(outcome.dropouts) == sorted(rec["silent"])


@pytest.mark.slow
def test_live_runs_match_the_strategy_and_the_twin(mosquitto, tmp_path) -> None:
    out = tmp_path / "out"
    assert rounds_live.main(["--broker", mosquitto.url, "--twin", "--out", str(out),
                             "--algorithms", "catafed,fedavg", "--agents", "4", "--seeds", "1",
                             "--rounds", str(ROUNDS), "--time-scale", "0.05"]) == 0
    runs, target, data = load_results(out / "results.json")
    assert target == 0.6 and data["time_scale"] == 0.05 and data["fleet"]["dropout_p"] == 0.0
    assert [r.algorithm for r in runs] == ["catafed", "catafed (sim)", "fedavg", "fedavg (sim)"]
    for r in runs:
        assert r.seed == 0 and r.strategy == r.algorithm.removesuffix(" (sim)")
        assert [x.round for x in r.rounds] == list(range(ROUNDS))
        assert all(0.0 < x.accuracy <= 1.0 for x in r.rounds)
        assert all(x.selected == x.finished + x.stragglers + x.late + x.dropouts for x in r.rounds)
        times = [x.time_s for x in r.rounds]
        assert all(0 < a < b for a, b in zip(times, times[1:], strict=False))
    live = {x["algorithm"]: x for x in data["live"]}
    twin = {x["algorithm"]: x["rounds"] for x in data["twin_invited"]}
    assert set(live) == set(twin) == {"catafed", "fedavg"}
    for algorithm, lv in live.items():
        assert lv["errors"] == [] and len(lv["rounds"]) == ROUNDS
        run = next(r for r in runs if r.algorithm == algorithm)
        assert [len(x["selected"]) for x in lv["rounds"]] == [x.selected for x in run.rounds]
        replay_invitations(algorithm, data, lv["rounds"])
        for rep in lv["reports"]:  # every report answers an invitation of its round
            assert rep["agent"] in lv["rounds"][rep["round"]]["selected"], rep
        # Round 1 depends on the fleet and the seed only: the simulator invites the same agents.
        assert lv["rounds"][0]["selected"] == twin[algorithm][0]
    assert [x["selected"] for x in live["fedavg"]["rounds"]] == twin["fedavg"]
    assert [x["algorithm"] for x in data["live_vs_sim"]] == ["catafed", "fedavg"]
    table = (out / "table.md").read_text()
    assert "| catafed (sim) |" in table and "same invitees" in table
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "live_vs_sim.png").stat().st_size > 0


def test_bad_flag_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "sim.rounds_live", "--time-scale", "x"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=180)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1, done.stderr
    assert "python -m sim.rounds_live" in lines[0] and "--time-scale" in lines[0] and "'x'" in lines[0]


@pytest.mark.parametrize("argv, names", [
    (["--time-scale", "0"], ["--time-scale", "> 0"]),
    (["--algorithms", "catafed,nope"], ["--algorithms", "'nope'"]),
    (["--set", "catafed.per_group=none"], ["catafed.per_group", "none"]),
])
def test_bad_value_is_one_line_and_exit_2(argv, names, capsys) -> None:
    """Checked before any broker or training starts (run in-process: no broker is given)."""
    assert run_main("python -m sim.rounds_live", rounds_live.main, argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m sim.rounds_live: "), lines
    for name in names:
        assert name in lines[0], (name, lines[0])
