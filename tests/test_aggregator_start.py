"""What the aggregator says while it starts: pre-training's progress at the default level."""

from __future__ import annotations

import logging
import signal

from aggregator.bootstrap import PROGRESS_EVERY_S, PretrainProgress, pretrain_log
from fedmq.logs import PROGRESS
from tests.cli_process import BIN, CliProcess


def test_pretraining_reports_an_epoch_at_the_default_level_every_so_often(caplog) -> None:
    now = [0.0]
    progress = PretrainProgress(3, clock=lambda: now[0])
    progress.next_model("shared", 4)
    # Its own logger: setup_logging("auto"), run in-process by the simulator's tests, leaves that
    # logger's level at PROGRESS, which a level set on "fedmq" would not lower.
    with caplog.at_level(logging.INFO, logger=pretrain_log.name):
        for epoch, seconds in enumerate([3.0, 4.0, 5.0, 30.0]):  # a quick epoch, then a slow one
            now[0] += seconds
            progress(epoch, 1.5 - epoch / 10)
        progress.next_model("cluster 0", 2)
        now[0] += PROGRESS_EVERY_S / 2
        progress(0, 0.9)
    lines = [r for r in caplog.records if r.getMessage() == "pretrain.epoch"]
    assert len(lines) == 5  # every epoch at info
    shown = [r.fields for r in lines if r.levelno == PROGRESS]
    assert [(f["model"], f["epoch"], f["of_models"]) for f in shown] == [("shared", "3/4", "1/3"),
                                                                         ("shared", "4/4", "1/3")]
    assert shown[-1]["seconds"] == 42.0 and shown[-1]["loss"] == 1.2


def test_sigterm_during_pretraining_stops_the_aggregator_with_one_line(mosquitto, tmp_path) -> None:
    """A real model pre-trains for minutes; a service manager's stop must end that, not wait it out."""
    # pretrain_epochs: far more than it trains before the signal, so it is still pre-training then.
    argv = [str(BIN / "fedmq"), "aggregator", "--broker", mosquitto.url, "--fleet", "stop-early",
            "--state-dir", str(tmp_path / "st"), "--log-level", "info",
            "--set", "aggregator.pretrain_epochs=100000"]
    with CliProcess(argv, cwd=tmp_path) as aggregator:
        aggregator.wait_for(r"pretrain\.epoch", timeout=180)
        code = aggregator.stop(signal.SIGTERM, timeout=120)
    assert code == 0, aggregator.output[-3000:]
    assert "stopped during start-up; nothing was served" in aggregator.output
    assert "Traceback" not in aggregator.output
    assert "fleet=stop-early" not in aggregator.output  # never served


def test_a_sim_run_shows_its_pretraining_at_the_default_level(tmp_path) -> None:
    """`fedmq sim run` holds its many components to warnings, yet a real model's pre-training
    runs for minutes before the first update: its progress is shown, not silence."""
    # pretrain_epochs: far more than it trains before the line, so it is still pre-training then.
    argv = [str(BIN / "fedmq"), "sim", "run", "--methods", "cdfl", "--seeds", "1", "--out", str(tmp_path / "o"),
            "--set", "aggregator.pretrain_epochs=100000"]
    with CliProcess(argv, cwd=tmp_path) as sim:
        line = sim.wait_for(r"pretrain\.epoch", timeout=180)
        sim.stop(signal.SIGTERM, timeout=120)
    assert "progress" in line.string and "of_models=" in line.string
    assert "Traceback" not in sim.output


def test_pretraining_progress_estimates_the_end_from_its_plan_within_the_budget() -> None:
    now = [0.0]
    progress = PretrainProgress(2, clock=lambda: now[0], budget_s=100.0, work=[300, 100])
    progress.next_model("shared", 3)
    now[0] = 10.0
    assert progress.left_s(0) == 30.0  # 100 of 400 samples seen in 10 s: 300 to go at that rate
    progress.next_model("cluster 0", 1)
    now[0] = 80.0
    assert progress.left_s(0) == 0.0  # the plan is done
    now[0] = 0.0
    progress = PretrainProgress(1, clock=lambda: now[0], budget_s=100.0, work=[1000])
    progress.next_model("shared", 10)
    now[0] = 90.0
    assert progress.left_s(0) == 10.0  # the rate says 810 s more; the budget ends it in 10
    assert PretrainProgress(1).left_s(0) is None  # no plan, no estimate
