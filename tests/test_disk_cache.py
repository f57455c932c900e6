"""The disk cache (fedmq/disk_cache.py): pre-trained cluster models, the aggregator's fleet
graph across restarts, and damaged entries.

The ONNX graphs it keeps are tested in tests/test_inference.py too.
"""

from __future__ import annotations

import logging

import pytest
import torch

from aggregator import bootstrap
from fedmq import disk_cache, models
from fedmq.config import load_config
from fedmq.data import clusters_from_settings
from fedmq.models import model_spec
from soak.fleet_setup import SMALL


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    return tmp_path


def pretrain(seed: int = 0):
    cfg = load_config(None, {**SMALL, "seed": seed})
    return bootstrap.pretrain_clusters(cfg, clusters_from_settings(cfg.data, 2, seed=seed), "digits-cnn")


def test_a_second_aggregator_reuses_the_pretraining_and_a_damaged_entry_is_trained_again(
        cache, monkeypatch, caplog) -> None:
    first = pretrain()
    kept, = (cache / "pretrain").iterdir()
    trained = []
    real_fit = bootstrap.fit
    monkeypatch.setattr(bootstrap, "fit", lambda *a, **k: trained.append(1) or real_fit(*a, **k))
    again = pretrain()
    assert not trained and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # Another seed is other data and another start: trained, not served.
    pretrain(seed=1)
    assert trained and len(list((cache / "pretrain").iterdir())) == 2
    # One flipped bit: the entry is named in a warning, trained again, the same models result.
    raw = bytearray(kept.read_bytes())
    raw[-5] ^= 0x10
    kept.write_bytes(bytes(raw))
    trained.clear()
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        third = pretrain()
    assert trained and all(torch.equal(a, b) for a, b in zip(first, third, strict=True))
    refused = [r for r in caplog.records if r.getMessage() == "cache.refused"]
    assert refused and refused[0].fields["path"] == str(kept)
    assert disk_cache.read("pretrain", kept.name) is not None  # rewritten whole


def test_a_second_aggregator_start_takes_its_graph_from_the_disk_cache(cache, monkeypatch, caplog, mosquitto,
                                                                        tmp_path) -> None:
    """The fleet's ONNX graph (a MobileNetV3's dynamo export: 7-30 s on 2 cores) is exported
    by the first start only; the restart, a new process, says `cached` and publishes the same
    graph."""
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService
    from fedmq import onnx_export
    from soak.fleet_setup import small_config

    exported: list[str] = []
    real_export = onnx_export._fresh_export
    monkeypatch.setattr(onnx_export, "_fresh_export",
                        lambda name, *a, **k: exported.append(name) or real_export(name, *a, **k))
    cfg = small_config(mosquitto.url, tmp_path / "state", "graphs")
    graphs, cached = [], []
    for _ in range(2):
        monkeypatch.setattr(onnx_export, "_GRAPHS", {})  # each start in a new process
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedmq"), AggregatorService(cfg, build_engine(cfg)) as svc:
            graphs.append(svc.graph)
        lines = [r for r in caplog.records if r.getMessage() == "graph.exported"]
        assert len(lines) == 1, caplog.records
        cached.append(lines[0].fields["cached"])
    assert exported == ["digits-cnn"], "the restart exported the graph again"
    assert cached == [False, True]
    assert graphs[0] is not None and graphs[0] == graphs[1]


def test_an_unwritable_cache_costs_only_the_work(monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(blocker))
    disk_cache.write("pretrain", "x", b"payload")  # no exception
    assert disk_cache.read("pretrain", "x") is None
    assert len(pretrain()) == 2


def test_entries_round_trip_and_short_files_are_refused(cache) -> None:
    disk_cache.write("onnx", "a", b"\x00" * 10)
    assert disk_cache.read("onnx", "a") == b"\x00" * 10
    (cache / "onnx" / "b").write_bytes(b"fedmq")
    assert disk_cache.read("onnx", "b") is None
    assert disk_cache.read("onnx", "absent") is None


def test_the_zoo_resnet_built_for_other_data_is_kept_and_another_factory_is_not(cache) -> None:
    """A factory in fedmq.models is code the key covers (the zoo's ResNet-20 built for MNIST
    pre-trains once); a user's factory may change under the same shapes, so it is never kept."""
    cfg = load_config(None, SMALL)
    pools = [clusters_from_settings(cfg.data, 2, seed=0).pretrain(k, 20) for k in range(2)]
    ours = "fedmq.models:ResNet20?in_channels=1&input=1x8x8&num_classes=10"
    name = bootstrap._pretrain_cache_name(cfg, ours, pools)
    assert name is not None and name == bootstrap._pretrain_cache_name(cfg, ours, pools)
    assert bootstrap._pretrain_cache_name(cfg, ours.replace("num_classes=10", "num_classes=9"), pools) != name
    assert bootstrap._pretrain_cache_name(cfg, "tests.model_factories:tiny_mlp?input=1x8x8", pools) is None


def test_a_frozen_backbone_file_rewritten_under_its_path_is_another_entry(cache, tmp_path, monkeypatch) -> None:
    """The entry's name covers the backbone's weights, not only the path they were read from
    (as an aggregator started again after the file changed sees them)."""
    cfg = load_config(None, SMALL)
    pools = [clusters_from_settings(cfg.data, 2, seed=0).pretrain(k, 20) for k in range(2)]
    whole = "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10"
    path = tmp_path / "backbone.f32"
    torch.zeros(model_spec(whole).numel).numpy().tofile(path)
    model = f"{whole}&train=head&backbone={path}"
    first = bootstrap._pretrain_cache_name(cfg, model, pools)
    torch.full((model_spec(whole).numel,), 0.01).numpy().tofile(path)
    monkeypatch.setattr(models, "_SPEC_CACHE", {})  # a new process: specs are built once per process
    second = bootstrap._pretrain_cache_name(cfg, model, pools)
    assert second not in (None, first) and "/" not in first + second  # one file in the cache's folder
