"""The start model a fleet personalizes (`fedmq start-model`, data.public_images): its public
images are no one else's and the same for every seed and K, the command writes a file `--init`
reads, the disk cache serves the second run, a budget cuts it with a warning and no cache entry,
and every cluster model of a fleet with public images specializes from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregator import bootstrap
from aggregator.start_model import augmented, start_model
from fedmq.config import Config, ConfigError, check_config, load_config
from fedmq.data import clusters_from_settings, load_dataset
from fedmq.data.clusters import DatasetTooSmall, RotatedClusters
from fedmq.models import load_init_vector
from tests.cli_process import cli_env
from tests.test_models import run_cli


def _digits(k: int, seed: int, public: int) -> RotatedClusters:
    return RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), k, seed=seed,
                           proxy_per_cluster=60, pretrain_per_cluster=80, public=public)


def test_public_images_are_disjoint_from_every_pool_and_the_same_for_every_seed_and_k() -> None:
    publics = []
    for k, seed in ((2, 0), (3, 1), (4, 7)):
        data = _digits(k, seed, 200)
        public = set(data._public.tolist())
        assert len(public) == data.public_size == 200
        for purpose in ("proxy", "pretrain", "agents"):
            for c in range(k):
                assert not public & set(data.pool(purpose, c).tolist()), (purpose, c)
        publics.append(public)
        assert torch.equal(data.public().x, load_dataset("digits").x[np.sort(list(public))])  # unrotated
    assert publics[0] == publics[1] == publics[2]
    # auto: a fifth of digits' 1,257; none: the pools are those of a fleet without public images
    assert _digits(2, 0, -1).public_size == 1257 // 5
    none, before = _digits(3, 5, 0), RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), 3,
                                                      seed=5, proxy_per_cluster=60, pretrain_per_cluster=80)
    assert all(np.array_equal(none.pool("agents", c), before.pool("agents", c)) for c in range(3))
    with pytest.raises(DatasetTooSmall, match="data.public_images=700 does not fit"):
        _digits(2, 0, 700)


def test_augmentation_shifts_and_mirrors_without_changing_content() -> None:
    x = load_dataset("shapes").x[:64]
    g = torch.Generator().manual_seed(0)
    assert torch.equal(augmented(x, "none", g), x)
    flipped = augmented(x, "flip", g)
    mirrored = [bool(torch.equal(a, b.flip(2))) for a, b in zip(flipped, x, strict=True)]
    kept = [bool(torch.equal(a, b)) for a, b in zip(flipped, x, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True)) and 10 < sum(mirrored) < 54
    cropped = augmented(x, "crop", g)
    assert cropped.shape == x.shape and not torch.equal(cropped, x)
    # a shift moves pixels, it does not make them: every row of a shifted image's centre is in the original
    assert all(torch.isin(c[:, 12:20, 12:20], o).all() or (c[:, 12:20, 12:20] == 0).any()
               for c, o in zip(cropped, x, strict=True))


def test_start_model_command_writes_what_init_reads_and_the_cache_serves_the_second(tmp_path, warm_python) -> None:
    env = cli_env(FEDMQ_CACHE_DIR=str(tmp_path / "cache"))  # its own cache: the first run must train
    # Digits: offline and seconds; crop only (a mirrored digit is another sign).
    argv = ["start-model", "--dataset", "digits", "--epochs", "4", "--set", "aggregator.start_augment=crop"]
    done = run_cli(*argv, "--out", "start.pt", cwd=tmp_path, env=env, warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert "trained on 251 public digits images" in done.stdout and "--init start.pt" in done.stdout
    assert "start.ready" in done.stderr and "left_s=" in done.stderr
    vector = load_init_vector(tmp_path / "start.pt", "digits-cnn")
    again = run_cli(*argv, "--out", "start.f32", cwd=tmp_path, env=env, warm=warm_python)
    assert again.returncode == 0 and "(from the cache)" in again.stdout, again.stderr
    assert torch.equal(load_init_vector(tmp_path / "start.f32", "digits-cnn"), vector)
    # nothing is overwritten, a wrong name or augmentation is one line, and none leaves a file
    before = sorted(p.name for p in tmp_path.iterdir())
    for extra, said in ((["--out", "start.pt"], "exists"), (["--out", "start.txt"], ".pt"),
                        (["--out", "start2.pt", "--set", "aggregator.start_augment=rotate"], "start_augment")):
        done = run_cli(*argv, *extra, cwd=tmp_path, env=env, warm=warm_python)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_budget_cuts_the_start_with_a_warning_and_keeps_no_cache_entry(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    cfg = load_config(None, {"data.public_images": 200, "aggregator.start_epochs": 50,
                             "aggregator.start_max_seconds": 0.3})
    result = start_model(cfg, _digits(2, 0, 200), "digits-cnn")
    assert not result.cached and result.seconds < 30
    assert "start.budget_spent" in caplog.text
    assert not (tmp_path / "start").exists() or not any((tmp_path / "start").iterdir())


def test_every_cluster_of_a_fleet_with_public_images_specializes_from_the_start(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    cfg = load_config(None, {"data.public_images": 300, "aggregator.start_epochs": 3,
                             "aggregator.start_augment": "crop", "data.proxy_per_cluster": 60,
                             "data.pretrain_per_cluster": 80, "aggregator.pretrain_epochs": 1})
    data = clusters_from_settings(cfg.data, 2, seed=0)
    start = start_model(cfg, data, "digits-cnn").vector
    vectors = bootstrap.pretrain_clusters(cfg, data, "digits-cnn")
    # one epoch at a fifth of the rate moves each cluster a little from the start, not from a random init
    fresh = bootstrap.pretrain_clusters(load_config(None, {"data.proxy_per_cluster": 60, "data.pretrain_per_cluster": 80,
                                                           "aggregator.pretrain_epochs": 1}),
                                        clusters_from_settings(Config().data, 2, seed=0), "digits-cnn")
    for v, f in zip(vectors, fresh, strict=True):
        assert (v - start).norm() < 0.5 * (f - start).norm()


def test_the_config_refuses_what_does_not_fit() -> None:
    for key, value in (("data.public_images", -2), ("aggregator.start_epochs", 0),
                       ("aggregator.start_max_seconds", -1), ("aggregator.start_augment", "rotate")):
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            check_config(load_config(None, {key: value}))


def test_a_start_that_learned_nothing_says_so(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    # A rate far too high: the loss ends at chance's or above (MobileNetV3-small at 0.05 does on shapes).
    cfg = load_config(None, {"data.public_images": 200, "aggregator.start_epochs": 2, "aggregator.pretrain_lr": 50.0})
    start_model(cfg, _digits(2, 0, 200), "digits-cnn")
    stuck = [r for r in caplog.records if getattr(r, "fields", {}).get("cluster") == "start"]
    assert stuck and "pretrain_lr" in stuck[0].fields["hint"]
