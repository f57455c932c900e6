"""What the aggregator says while it starts: pre-training's progress at the default level."""

from __future__ import annotations

import logging

from aggregator.bootstrap import PROGRESS_EVERY_S, PretrainProgress
from fedmq.logs import PROGRESS


def test_pretraining_reports_an_epoch_at_the_default_level_every_so_often(caplog) -> None:
    now = [0.0]
    progress = PretrainProgress(3, clock=lambda: now[0])
    progress.next_model("shared", 4)
    with caplog.at_level(logging.INFO, logger="fedmq"):
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
