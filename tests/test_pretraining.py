"""Server-side pre-training (aggregator/bootstrap.py): its rate is a key, and a pre-training that
learned nothing says so instead of handing every reply a model at chance."""

from __future__ import annotations

import logging

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


def test_a_pretraining_that_learned_nothing_warns_and_a_healthy_one_does_not(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        healthy = pretrain()
    assert not stuck(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        blown = pretrain(**{"aggregator.pretrain_lr": 50.0})  # far past any rate that trains
    warned = stuck(caplog)
    assert warned and "aggregator.pretrain_lr" in warned[0].fields["hint"]
    assert {r.fields["cluster"] for r in warned} <= {0, 1}  # the clusters are judged, not the shared start
    assert not all(torch.equal(a, b) for a, b in zip(healthy, blown, strict=True))


@pytest.mark.parametrize("value", [0, -0.1])
def test_a_pretraining_rate_that_is_not_positive_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="aggregator.pretrain_lr"):
        load_config(None, {**SMALL, "aggregator.pretrain_lr": value})
