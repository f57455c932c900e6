"""`fedmq sim report`'s stage tables: client accuracy in fifths of the run, and paired by seed.

A method that starts behind and ends ahead must show as such; the runs here are written as
`fedmq sim run` writes them (summary.json and updates.csv), with accuracies chosen so that
every figure in the tables can be worked out by hand."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from fedmq.errors import UsageError
from sim.report import (
    load_runs,
    load_with,
    row_styles,
    stage_means,
    tables,
    variant_name,
    write_report,
)


def write_run_files(out: Path, method: str, seed: int, received: list[float]) -> None:
    d = out / "runs" / f"rotated-digits_K2_{method}_s{seed}"
    d.mkdir(parents=True)
    with open(d / "updates.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["event", "acc_after"])
        w.writeheader()
        w.writerows({"event": i, "acc_after": a} for i, a in enumerate(received))
    mean = sum(received) / len(received)
    (d / "summary.json").write_text(json.dumps({
        "spec": {"scenario": "rotated-digits", "method": method, "clusters": 2, "seed": seed},
        "client_acc": mean, "cluster_acc": math.nan, "client_acc_before": mean, "client_acc_held": mean,
        "kl": math.nan, "bytes_down_per_update": 0, "bytes_up_per_update": 0, "compute_s_per_update": 1.0,
        "staleness_mean": 0.0, "updates": len(received)}))


def test_stage_means_split_a_run_into_near_equal_consecutive_parts():
    assert stage_means([0.0] * 5 + [1.0] * 5, stages=2) == [0.0, 1.0]
    assert stage_means(list(range(10)), stages=5) == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert stage_means([1.0, 2.0, 3.0], stages=2) == [1.5, 3.0]  # 3 uploads: 2 then 1
    with pytest.raises(ValueError):
        stage_means([], stages=0)


def test_a_method_behind_early_and_ahead_late_shows_both(tmp_path):
    # CDFL: 0.5 for the first three fifths, 0.9 for the last two; Local flat at 0.7 (+0.1 on seed 1)
    for seed, bump in ((0, 0.0), (1, 0.1)):
        write_run_files(tmp_path, "cdfl", seed, [0.5] * 60 + [0.9] * 40)
        write_run_files(tmp_path, "local", seed, [0.7 + bump] * 100)
    text = tables(load_runs(tmp_path))
    assert "| CDFL | 0.500 ± 0.000 | 0.500 ± 0.000 | 0.500 ± 0.000 | 0.900 ± 0.000 | 0.900 ± 0.000 |" in text
    assert "| Local | 0.750 ± 0.050 | 0.750 ± 0.050 |" in text
    # whole run: CDFL 0.66 against 0.7 / 0.8; last fifth: 0.9 against 0.7 / 0.8 (t interval, 1 df: 12.7 x 5 / sqrt 2)
    row = next(line for line in text.splitlines() if line.startswith("| CDFL - Local |"))
    assert row == "| CDFL - Local | 0, 1 | -4.0 / -14.0 (-9.0 ± 63.5) | +20.0 / +10.0 (+15.0 ± 63.5) |"


def test_one_method_or_no_common_seed_pairs_nothing(tmp_path):
    write_run_files(tmp_path, "cdfl", 0, [0.5] * 10)
    assert "paired by seed" not in tables(load_runs(tmp_path))
    write_run_files(tmp_path, "local", 1, [0.5] * 10)
    assert "paired by seed" not in tables(load_runs(tmp_path))


def test_a_control_in_its_own_dir_is_paired_with_the_run_it_controls(tmp_path):
    # the run: CDFL 0.8 flat; its frozen control, written by a `--set` run into DIR-frozen: 0.75 / 0.7
    run, control = tmp_path / "fleet", tmp_path / "fleet-frozen"
    for seed, drop in ((0, 0.05), (1, 0.1)):
        write_run_files(run, "cdfl", seed, [0.8] * 50)
        write_run_files(run, "local", seed, [0.7] * 50)
        write_run_files(control, "cdfl", seed, [0.8 - drop] * 50)
    report, _, text = write_report(run, "fedmq sim report fleet --with fleet-frozen", [control])
    assert "| CDFL (frozen) | 0.725 ± 0.025 |" in text  # Table 1, right below CDFL
    assert text.index("| CDFL |") < text.index("| CDFL (frozen) |") < text.index("| Local |")
    assert "| CDFL - CDFL (frozen) | 0, 1 | +5.0 / +10.0 (+7.5 ± 31.8) | +5.0 / +10.0 (+7.5 ± 31.8) |" in text
    assert "fedmq sim report fleet --with fleet-frozen" in report.read_text()
    # the control's own dir is read, never written
    assert not (control / "report.md").exists() and not (control / "figures").exists()


def test_with_refuses_its_own_dir_a_dir_without_runs_and_two_of_one_name(tmp_path):
    run = tmp_path / "fleet"
    write_run_files(run, "cdfl", 0, [0.8] * 10)
    for other in ("a/x", "b/x"):
        write_run_files(tmp_path / other, "cdfl", 0, [0.7] * 10)
    assert variant_name(run, tmp_path / "fleet-frozen") == "frozen"
    assert variant_name(run, tmp_path / "other") == "other"
    assert variant_name(tmp_path / "x-server-lr", tmp_path / "x-fedsoft") == "fedsoft"  # cut at a separator
    assert variant_name(tmp_path / "x-one", tmp_path / "x-other") == "other"
    with pytest.raises(UsageError, match="own dir"):
        load_with(run, [run])
    with pytest.raises(FileNotFoundError, match="no runs under"):
        load_with(run, [tmp_path / "empty"])
    with pytest.raises(UsageError, match="both be named 'x'"):
        load_with(run, [tmp_path / "a/x", tmp_path / "b/x"])


def test_each_with_dirs_row_of_a_method_is_drawn_its_own_way():
    """Four CDFL rows from four dirs are four lines of CDFL's colour that a reader tells apart
    (line, marker, bar hatch), and the run's own row stays the plain one."""
    rows = ["cdfl", "cdfl (fedsoft)", "cdfl (half)", "cdfl (ramp)", "cdfl (seeded-frozen)", "fedsoft-async (fedsoft)",
            "local"]
    styles = row_styles(rows)
    cdfl = [styles[m] for m in rows[:5]]
    assert styles["cdfl"] == ("-", "o", None) == styles["local"]
    for part in range(3):
        assert len({repr(s[part]) for s in cdfl}) == 5
    assert styles["fedsoft-async (fedsoft)"] == styles["cdfl (fedsoft)"]  # the first other dir of its method
