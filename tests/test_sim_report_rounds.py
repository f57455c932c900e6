"""`fedmq sim report` on `fedmq sim rounds` output: sim.rounds' own table and plots, from the files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedmq.cli import main
from sim.report import is_rounds_dir, write_report

COMMITTED = Path(__file__).resolve().parent.parent / "results" / "catafed" / "ablation"


def test_report_rebuilds_the_committed_catafed_table(tmp_path, capsys):
    out = tmp_path / "catafed"
    shutil.copytree(COMMITTED, out)
    assert main(["sim", "report", str(out)]) == 0
    report = (out / "report.md").read_text()
    # the table sim.rounds printed when it ran, rebuilt from results.json alone
    assert (COMMITTED / "table.md").read_text() in report
    assert "| catafed | 20/20 |" in report and "| catafed - no-pf | 20 (" in report
    for name in ("rounds_accuracy.png", "rounds_cost.png"):
        assert (out / "figures" / name).stat().st_size > 5000
        assert f"(figures/{name})" in report
    assert "report:" in capsys.readouterr().out


def test_report_covers_a_fresh_rounds_run(tmp_path):
    out = tmp_path / "rounds"
    assert main(["sim", "rounds", "--algorithms", "catafed,fedavg", "--agents", "6", "--rounds", "2",
                 "--groups", "2", "--per-group", "2", "--epochs", "1", "--target", "0.99",
                 "--out", str(out)]) == 0
    assert is_rounds_dir(out)
    (out / "table.md").unlink()  # the report needs results.json only
    (out / "accuracy.png").unlink()
    report, figures, text = write_report(out)
    results = json.loads((out / "results.json").read_text())
    assert [r["algorithm"] for r in results["summary"]] == ["catafed", "fedavg"]
    assert "| catafed | 0/1 |" in text and "| fedavg | 0/1 |" in text  # 0.99 is out of reach in 2 rounds
    assert "| catafed - fedavg | 1 (0) | - |" in text  # paired by fleet, nothing to pair in time
    assert "6 agents" in text and "at most 2 rounds" in text
    assert [p.name for p in figures] == ["rounds_accuracy.png", "rounds_cost.png"]
    assert all(p.stat().st_size > 5000 for p in figures)


@pytest.mark.slow
def test_sweep_runs_every_setting_and_summarizes_the_paired_comparisons(tmp_path, capsys):
    from sim.rounds_sweep import main as sweep

    out = tmp_path / "sweep"
    # two settings, two fleets, a few rounds: the real grid is docs/results_catafed.md's command
    assert sweep(["--dataset", "synthetic", "--alphas", "1.0", "--slow-shares", "0,0.5",
                  "--seeds", "2", "--algorithms", "catafed,tifl", "--target", "0.15",
                  "--until", "120", "--jobs", "0", "--out", str(out), "--",  # 0: a worker per core
                  "--agents", "6", "--groups", "2", "--per-group", "2", "--epochs", "1"]) == 0
    for sub in ("a1-s0", "a1-s50"):
        data = json.loads((out / sub / "results.json").read_text())
        assert data["dataset"] == "synthetic" and len(data["runs"]) == 4
        assert {r["seed"] for r in data["runs"]} == {0, 1}
        assert all(r["rounds"][-1]["time_s"] >= 120 for r in data["runs"])  # --until, not --rounds
    assert data["fleet"]["slow_share"] == 0.5 and data["fleet"]["agents"] == 6
    summary = (out / "summary.md").read_text()
    assert summary.count("| catafed - tifl |") == 2 and "| 1 | 50 % |" in summary
    assert (out / "summary.png").stat().st_size > 5000
    assert "python -m sim.rounds --algorithms catafed,tifl" in capsys.readouterr().out


def test_report_says_what_it_looked_for(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"something": "else"}))
    assert not is_rounds_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="fedmq sim rounds"):
        write_report(tmp_path)


def test_rounds_and_sweep_run_unchanged_on_held_out_data_through_data_dir(tmp_path):
    """Acceptance reruns these commands on MNIST through --data-dir: small MNIST-format files
    written here stand in for it (cnn28 chosen by --model auto)."""
    from sim.rounds_sweep import main as sweep
    from tests.test_data import write_mnist_like

    write_mnist_like(tmp_path / "data", "MNIST", n_train=400, n_test=60)
    out = tmp_path / "mnist"
    assert sweep(["--data-dir", str(tmp_path / "data"), "--alphas", "0.3",  # the dataset found there
                  "--slow-shares", "0.3", "--seeds", "1", "--algorithms", "catafed,tifl",
                  "--target", "0.5", "--until", "40", "--jobs", "1", "--out", str(out), "--",
                  "--agents", "4", "--groups", "2", "--per-group", "2", "--epochs", "1"]) == 0
    data = json.loads((out / "a0.3-s30" / "results.json").read_text())
    assert data["dataset"] == "mnist" and data["model"] == "cnn28"
    assert {r["algorithm"] for r in data["runs"]} == {"catafed", "tifl"}
    assert (out / "summary.md").is_file()
