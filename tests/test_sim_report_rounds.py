"""`fedmq sim report` on `fedmq sim rounds` output: sim.rounds' own table and plots, from the files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedmq.cli import main
from sim.report import is_rounds_dir, write_report

COMMITTED = Path(__file__).resolve().parent.parent / "docs" / "results_catafed"


def test_report_rebuilds_the_committed_catafed_table(tmp_path, capsys):
    out = tmp_path / "catafed"
    shutil.copytree(COMMITTED, out)
    assert main(["sim", "report", str(out)]) == 0
    report = (out / "report.md").read_text()
    # the table sim.rounds printed when it ran, rebuilt from results.json alone
    assert (COMMITTED / "table.md").read_text() in report
    assert "| catafed | 5/5 | 198 s |" in report
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
    assert "6 agents" in text and "at most 2 rounds" in text
    assert [p.name for p in figures] == ["rounds_accuracy.png", "rounds_cost.png"]
    assert all(p.stat().st_size > 5000 for p in figures)


def test_report_says_what_it_looked_for(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"something": "else"}))
    assert not is_rounds_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="fedmq sim rounds"):
        write_report(tmp_path)
