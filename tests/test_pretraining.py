"""Server-side pre-training (aggregator/bootstrap.py): its rate is a key, and a pre-training that
learned nothing says so instead of handing every reply a model at chance."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from aggregator import bootstrap
from fedmq.config import ConfigError, load_config
from fedmq.data import clusters_from_settings
from soak.fleet_setup import SMALL


def pretrain(**overrides):
    cfg = load_config(None, {**SMALL, **overrides})
    return bootstrap.pretrain_clusters(cfg, clusters_from_settings(cfg.data, 2, seed=0), "digits-cnn")


def stuck(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "cluster.pretrain_stuck"]


def test_a_shared_model_left_at_chance_is_trained_again_slower_and_says_so(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        pretrain()
    assert not stuck(caplog)  # the default rate trains the digits CNN
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedmq"):
        rescued = pretrain(**{"aggregator.pretrain_lr": 0.5})  # the shared model stays at chance at 0.5
    first, = stuck(caplog)
    assert first.fields["cluster"] == "shared" and "again" in first.fields["then"]
    shared = [r.fields for r in caplog.records if r.getMessage() == "cluster.pretrained"
              and r.fields["cluster"] == "shared"]
    assert [f.get("lr") for f in shared] == [None, 0.1] and shared[1]["loss"] < 0.9 * math.log(10)
    assert all(torch.isfinite(v).all() for v in rescued)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        pretrain(**{"aggregator.pretrain_lr": 50.0})  # far past any rate that trains, a fifth too
    assert "aggregator.pretrain_lr" in stuck(caplog)[-1].fields["hint"]


@pytest.mark.parametrize("value", [0, -0.1])
def test_a_pretraining_rate_that_is_not_positive_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="aggregator.pretrain_lr"):
        load_config(None, {**SMALL, "aggregator.pretrain_lr": value})
