"""`alone` in `python -m sim.rounds`: the same agents, each training only on its own data.

The control for "does federation help": its accuracy is the mean over agents of each one's
own model on the federated runs' test set (sklearn digits, offline, tiny fleets).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from edge_agent.deadline import epoch_seed
from fedmq.config import FedAvgSettings, load_config
from fedmq.data import load_dataset
from fedmq.errors import UsageError
from fedmq.models import build_model, resolve_model_name, to_vector
from fedmq.training import evaluate, fit
from sim.report import write_report
from sim.rounds import (
    FleetSpec,
    load_results,
    main,
    non_iid_fleet,
    parse_variants,
    simulate_alone,
    start_pool,
    start_vector,
)
from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300.0


def test_alone_runs_from_the_cli_and_reports_as_a_row(tmp_path, warm_python):
    out = tmp_path / "rounds"
    done = subprocess.run(
        client_argv(warm_python, "python", "-m", "sim.rounds", "--algorithms", "fedavg,alone", "--agents", "6",
                    "--rounds", "3", "--epochs", "1", "--target", "0.99", "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    data = json.loads((out / "results.json").read_text())
    assert [r["algorithm"] for r in data["summary"]] == ["fedavg", "alone"]
    alone = next(r for r in data["runs"] if r["algorithm"] == "alone")
    assert alone["strategy"] == "alone" and len(alone["rounds"]) == 3
    cutoff = data["settings"]["deadline_s"] + data["settings"]["grace_s"]
    for i, r in enumerate(alone["rounds"]):
        assert len(r["agent_accuracy"]) == 6  # every agent's own model, every round
        assert r["accuracy"] == pytest.approx(statistics.fmean(r["agent_accuracy"]), abs=1e-12)
        assert r["time_s"] == pytest.approx((i + 1) * cutoff)  # a round is the federated cut-off
    fedavg = next(r for r in data["runs"] if r["algorithm"] == "fedavg")
    assert all(r["agent_accuracy"] == [] for r in fedavg["rounds"])
    low, high = next(r for r in data["summary"] if r["algorithm"] == "alone")["agents_final_range"]
    assert 0 <= low < high <= 1
    table = (out / "table.md").read_text()
    assert "| alone | 0/1 |" in table and "| fedavg - alone | 1 (0) |" in table
    assert f"the worst agent ends at {low:.3f}, the best at {high:.3f}" in table
    # `fedmq sim report` reads it unchanged, from results.json alone
    (out / "table.md").unlink()
    _, figures, text = write_report(out)
    assert "| alone | 0/1 |" in text and "| fedavg - alone | 1 (0) |" in text
    assert all(p.stat().st_size > 5000 for p in figures)


def test_alone_is_the_mean_of_each_agents_own_model():
    spec = FleetSpec(agents=4, slow_share=0.0, min_samples=60, max_samples=120, label_alpha=0.2)
    settings = load_config(overrides={"catafed.rounds": "2", "catafed.epochs": "2"}).catafed
    fedavg = FedAvgSettings.like(settings)
    run = simulate_alone(spec, settings, seed=3)
    # straight from the definition: the federated runs' start model, E epochs a round on the
    # agent's own data with FedAvg's lr, batch, momentum and batch orders, scored on the test set
    model = resolve_model_name("auto", "digits")
    test = load_dataset("digits", train=False)
    start = to_vector(build_model(model, seed=3))
    expected = []
    for d in non_iid_fleet(spec, load_dataset("digits"), 3):
        v = start
        for r in range(2):
            for e in range(2):
                v = fit(model, v, d.x, d.y, epochs=1, batch_size=fedavg.batch_size, lr=fedavg.lr,
                        momentum=fedavg.momentum, seed=epoch_seed(3, r, e)).vector
        expected.append(evaluate(model, v, test.x, test.y)[0])
    assert len(set(expected)) > 1  # agents on different label mixes end in different places
    assert run.rounds[-1].agent_accuracy == pytest.approx(expected, abs=1e-9)
    assert run.rounds[-1].accuracy == pytest.approx(statistics.fmean(expected), abs=1e-9)
    assert run.bytes_up == run.bytes_down == 0 and run.wasted_s == 0  # nothing on a wire


def test_fedavg_ends_above_agents_training_alone_on_a_non_iid_fleet(tmp_path):
    # label_alpha 0.1: an agent sees one or two digits. 15 rounds measured: FedAvg 0.61-0.77,
    # alone 0.27-0.46 over seeds 0-4 (25-36 pp apart on every seed). Fewer rounds are too
    # early: at 3 alone was ahead on seed 0, at 6 FedAvg led seeds 0-2 by only 3-12 pp.
    out = tmp_path / "noniid"
    assert main(["--algorithms", "fedavg,alone", "--agents", "6", "--rounds", "15",
                 "--slow-share", "0", "--label-alpha", "0.1", "--seeds", "0,1",
                 "--out", str(out)]) == 0
    runs, _, data = load_results(out / "results.json")
    for seed in (0, 1):
        fed, alone = (next(r for r in runs if r.algorithm == a and r.seed == seed)
                      for a in ("fedavg", "alone"))
        assert len(fed.rounds) == len(alone.rounds) == 15
        # the agents' mean is the control: one agent with a wide label mix can come close
        # (seed 0: the best agent alone ends at 0.68, FedAvg at 0.67)
        assert fed.final_accuracy > alone.final_accuracy + 0.15, (seed, fed.final_accuracy,
                                                                  alone.final_accuracy)
    (pair,) = data["paired"]
    assert pair["other"] == "alone" and pair["dacc_pp"] > 15


def test_a_pretrained_start_is_shared_by_every_run_and_its_images_by_no_agent(tmp_path):
    """--pretrain N: the seeded init trained centrally on N training images; every algorithm and
    the alone control start from it, and none of those images is an agent's."""
    train = load_dataset("digits")
    spec = FleetSpec(agents=6, slow_share=0.0)
    held = set(start_pool(len(train.y), 0, 400).tolist())
    pooled = torch.cat([d.x for d in non_iid_fleet(spec, train, 0, 400)]).flatten(1)
    held_x = train.x[sorted(held)].flatten(1)
    assert len(held) == 400
    assert not bool((torch.cdist(pooled, held_x) == 0).any())  # no agent holds a held-out image
    model = resolve_model_name("auto", "digits")
    start = start_vector(model, train, 0, 400, epochs=10)
    test = load_dataset("digits", train=False)
    random_acc = evaluate(model, start_vector(model, train, 0), test.x, test.y)[0]
    assert evaluate(model, start, test.x, test.y)[0] > random_acc + 0.5  # measured 0.86 against 0.08
    out = tmp_path / "pretrained"
    assert main(["--algorithms", "fedavg,alone", "--agents", "6", "--rounds", "1", "--epochs", "1",
                 "--pretrain", "400", "--pretrain-epochs", "10", "--out", str(out)]) == 0
    runs, _, data = load_results(out / "results.json")
    assert data["pretrain"] == {"images": 400, "epochs": 10}
    assert main(["--algorithms", "fedavg,alone", "--agents", "6", "--rounds", "1", "--epochs", "1",
                 "--out", str(tmp_path / "random")]) == 0
    from_random, _, _ = load_results(tmp_path / "random" / "results.json")
    # one round from the trained start ends far above one round from the random init
    for r, q in zip(runs, from_random, strict=True):
        assert r.algorithm == q.algorithm and r.final_accuracy > q.final_accuracy + 0.15, (r, q)
    with pytest.raises(UsageError, match="--pretrain must be in"):
        main(["--pretrain", "5000", "--dry-run"])


def test_alone_is_a_variant_base_only_where_it_runs(warm_python):
    v = parse_variants("alone,long=alone:fedavg.epochs=3", alone=True)
    assert [(x.label, x.algorithm, x.overrides) for x in v] == [
        ("alone", "alone", {}), ("long", "alone", {"fedavg.epochs": "3"})]
    with pytest.raises(UsageError, match="unknown algorithm 'alone'"):
        parse_variants("fedavg,alone")  # the live twin: no service trains alone
    done = subprocess.run(client_argv(warm_python, "python", "-m", "sim.rounds", "--algorithms",
                                      "alone:fedavg.epochs=0", "--dry-run"),
                          cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "epochs" in lines[0], done.stderr
