"""A user's own image folder (`folder:NAME` under `--data-dir`, docs/data.md) in one try: a default
model from its images, a dry run that trains the model one step on them, a folder too small to
split refused in one line, pre-training bounded by epochs and by time, and help texts that name
every algorithm the registry has."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from aggregator import bootstrap
from fedmq.algorithms import ASYNC_SERVER, DISPLAY, ROUNDS
from fedmq.cli import build_parser
from fedmq.config import load_config
from fedmq.data import clusters_from_settings
from fedmq.models import build_model, default_model_for_images, model_spec
from soak.fleet_setup import SMALL
from tests.cli_process import cli_env
from tests.test_models import run_cli

CLASSES = 5


def write_folder(root: Path, name: str, size: int, per_class: tuple[int, int]) -> Path:
    """`root/name/{train,test}/c<k>/*.png`: grey size x size images, class k a bright band at its
    own rows on a noisy background, so that a small CNN learns them in an epoch."""
    rng = np.random.default_rng(0)
    band = size // CLASSES
    for split, n in zip(("train", "test"), per_class, strict=True):
        for c in range(CLASSES):
            folder = root / name / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 70, (size, size), dtype=np.uint8)
                pixels[c * band:(c + 1) * band] += 150
                Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")
    return root


def sim_run(*flags: str, out: Path, warm: Path):
    return run_cli("sim", "run", "--out", str(out), *flags, cwd=out.parent, env=cli_env(), warm=warm)


def own(name: str, data: Path) -> list[str]:
    """The flags that run the rotated fleet on the folder `data/name`."""
    return ["--scenario", "rotated", "--set", f"data.dataset=folder:{name}", "--data-dir", str(data)]


def sim_run_flags() -> set[str]:
    """Every option string `fedmq sim run` takes."""
    run = build_parser(load={"sim"}).parse_args(["sim", "run", "--out", "o"])._parser
    return {option for action in run._actions for option in action.option_strings}


@pytest.mark.slow
def test_a_folder_of_500_images_runs_on_the_first_try_without_naming_a_model(tmp_path, warm_python) -> None:
    data = write_folder(tmp_path / "data", "pets", 28, (80, 20))  # 400 train, 100 test
    out = tmp_path / "out"
    # Size only (the fleet's default is 60 agents, 25 uploads each, 500-2000 samples, 50 epochs of
    # pre-training): one CDFL fleet of 2 agents, 2 uploads in all, 1 epoch of pre-training.
    small = ["--methods", "cdfl", "--clusters", "2", "--agents", "2", "--updates-per-agent", "1",
             "--min-samples", "20", "--max-samples", "40", "--test-samples", "20",
             "--set", "aggregator.pretrain_epochs=1"]
    done = sim_run(*own("pets", data), *small, out=out, warm=warm_python)
    assert done.returncode == 0, done.stderr[-3000:]
    model = "fedmq.models:ReferenceCNN?input=1x28x28&num_classes=5"
    assert f"model {model} (the default for 1x28x28 images in 5 classes; --set model=NAME" in done.stdout
    assert "one training step of the model on 32 images" in done.stdout
    summary = json.loads((out / "runs" / "rotated_K2_cdfl_s0" / "summary.json").read_text())
    assert summary["updates"] == 2 and "Traceback" not in done.stderr
    assert (out / "report.md").is_file()


def test_a_six_image_folder_is_refused_in_one_line_with_nothing_written(tmp_path, warm_python) -> None:
    data = write_folder(tmp_path / "data", "tiny", 28, (1, 1))
    Image.fromarray(np.zeros((28, 28), np.uint8), mode="L").save(data / "tiny" / "train" / "c0" / "extra.png")
    for extra in (["--dry-run"], []):  # the real run refuses before it writes anything too
        out = tmp_path / "out"
        done = sim_run(*own("tiny", data), *extra, out=out, warm=warm_python)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
        assert "needs at least 30 train images and has 6" in lines[0], lines[0]
        assert not out.exists()


def test_a_dry_run_trains_the_model_one_step_so_a_model_that_does_not_fit_fails_there(tmp_path, warm_python) -> None:
    """Where the run would have died in pre-training with a traceback, the dry run says why in
    one line, and each flag the line suggests is one `fedmq sim run` takes."""
    data = write_folder(tmp_path / "data", "small", 20, (8, 2))
    for flags in ([*own("small", data), "--set", "model=cnn28"], ["--scenario", "rotated-shapes", "--set", "model=cnn28"]):
        done = sim_run(*flags, "--dry-run", out=tmp_path / "out", warm=warm_python)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1 and "cnn28 takes 1x28x28" in lines[0], done.stderr[-3000:]
        suggested = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", lines[0].partition(": ")[2]))
        assert suggested <= sim_run_flags(), (suggested - sim_run_flags(), lines[0])
    # The default for 20x20 images: ResNet-20 (GroupNorm) built for one channel and 5 classes.
    done = sim_run(*own("small", data), "--dry-run", out=tmp_path / "out", warm=warm_python)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model fedmq.models:ResNet20?in_channels=1&input=1x20x20&norm=group&num_classes=5 (the default" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape, classes, model", [
    ((1, 28, 28), 10, "cnn28"),
    ((3, 32, 32), 10, "cnn32-10"),
    ((1, 28, 28), 5, "fedmq.models:ReferenceCNN?input=1x28x28&num_classes=5"),
    ((3, 32, 32), 7, "fedmq.models:ColorCNN?input=3x32x32&num_classes=7"),
    ((3, 20, 24), 5, "fedmq.models:ResNet20?in_channels=3&input=3x20x24&norm=group&num_classes=5"),
])
def test_the_default_model_takes_the_images_shape_and_class_count(shape, classes, model) -> None:
    assert default_model_for_images(shape, classes) == model
    spec = model_spec(model)
    assert (spec.input_shape, spec.num_classes) == (shape, classes)
    assert build_model(model, seed=0)(torch.zeros(2, *shape)).shape == (2, classes)


def test_auto_pretraining_epochs_stop_at_50_for_a_small_pool() -> None:
    assert bootstrap.pretrain_epochs(0, 4) == 50  # 10,000 samples would be 2,500 epochs
    assert bootstrap.pretrain_epochs(0, 418) == 24 and bootstrap.pretrain_epochs(0, 2000) == 5
    assert bootstrap.pretrain_epochs(300, 4) == 300  # asked for: as asked
    # from a trained start (--init, a start model) about 2,000 samples, within [1, 10]
    assert bootstrap.pretrain_epochs(0, 1000, from_start=True) == 2
    assert bootstrap.pretrain_epochs(0, 4, from_start=True) == 10 and bootstrap.pretrain_epochs(0, 5000, from_start=True) == 1
    assert bootstrap.pretrain_epochs(7, 1000, from_start=True) == 7


def test_pretraining_stops_at_its_time_budget_and_says_so(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    # 100,000 epochs of digits would take hours; the budget ends it within about a second.
    cfg = load_config(None, {**SMALL, "aggregator.pretrain_epochs": 100_000, "aggregator.pretrain_max_seconds": 1.0})
    with caplog.at_level(logging.INFO, logger="fedmq"):
        vectors = bootstrap.pretrain_clusters(cfg, clusters_from_settings(cfg.data, 2, seed=0), "digits-cnn")
    assert len(vectors) == 2 and all(torch.isfinite(v).all() for v in vectors)
    spent = [r for r in caplog.records if r.getMessage() == "pretrain.budget_spent"]
    assert [r.fields["model"] for r in spent] == ["shared", "cluster 0", "cluster 1"]
    assert all(r.levelno == logging.WARNING and "pretrain_max_seconds" in r.fields["hint"] for r in spent)
    assert sum(r.fields["seconds"] for r in spent) < 3.0
    assert not list(tmp_path.rglob("*.f32"))  # a time-cut pre-training is not kept


def test_help_names_every_algorithm_of_the_registry() -> None:
    text = build_parser(load=set()).format_help()
    for name in ASYNC_SERVER + ROUNDS:
        assert DISPLAY[name] in text, name
    methods = build_parser(load={"sim"}).parse_args(["sim", "run", "--out", "o"])._parser.format_help()  # --methods
    for name in (*ASYNC_SERVER, "local"):
        assert name in " ".join(methods.split()), name


def test_the_aggregator_an_agent_and_start_model_pick_the_folders_model_without_being_told(tmp_path, warm_python) -> None:
    data = write_folder(tmp_path / "data", "mine", 28, (40, 8))
    own_data = ["--dataset", "folder:mine", "--data-dir", str(data)]
    picked = set()
    for argv in (["aggregator", *own_data, "--dry-run"], ["agent", "--id", "car-1", *own_data, "--dry-run"]):
        done = run_cli(*argv, cwd=tmp_path, env=cli_env(), warm=warm_python)
        assert done.returncode == 0, done.stderr
        picked.add(json.loads(done.stdout)["resolved"]["model"])
    assert picked == {default_model_for_images((1, 28, 28), CLASSES)}
    env = cli_env(FEDMQ_CACHE_DIR=str(tmp_path / "cache"))  # its own cache: this start trains
    done = run_cli("start-model", *own_data, "--epochs", "1", "--set", "aggregator.start_augment=crop",
                   "--out", "start.pt", cwd=tmp_path, env=env, warm=warm_python)
    assert done.returncode == 0 and "trained on 40 public folder:mine images" in done.stdout, done.stderr
    done = run_cli("aggregator", *own_data, "--init", "start.pt", "--dry-run", cwd=tmp_path, env=cli_env(),
                   warm=warm_python)
    assert done.returncode == 0, done.stderr
