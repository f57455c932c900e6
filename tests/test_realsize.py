"""The real-size scenario (docs/simulator.md): its fleet and settings, the command line's
precedence over them, a folder dataset through --data-dir, and a short run of the batch-norm
ResNet-20 with FedBN agents over a real broker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmq.config import Config
from sim.fleet import RunSpec, configure, make_schedule
from sim.scenarios import get_scenario
from tests.cli_process import cli_env
from tests.test_data import write_mnist_like
from tests.test_models import run_cli


def test_the_scenario_is_k4_resnet20_with_at_least_400_uploads_a_run() -> None:
    scenario = get_scenario("realsize-shapes")
    assert (scenario.clusters, scenario.agents, scenario.dataset) == (4, 20, "shapes")
    for seed in range(5):
        assert len(make_schedule(seed, scenario.agents, scenario.updates_per_agent)) >= 400
    _, cfg = configure(RunSpec(scenario="realsize-shapes", clusters=4, agents=20))
    assert cfg.model == "resnet20-gn" and cfg.cdfl.clusters == 4
    assert (cfg.data.min_samples, cfg.data.max_samples, cfg.cdfl.personalize_samples) == (150, 350, 128)
    mine = Config(model="resnet20")  # what the command line set stays set
    mine.cdfl.personalize_samples = 64
    _, cfg = configure(RunSpec(scenario="realsize-shapes", clusters=4), mine)
    assert (cfg.model, cfg.cdfl.personalize_samples, cfg.data.max_samples) == ("resnet20", 64, 350)


def test_the_plan_takes_the_scenarios_fleet_unless_the_command_line_names_one(tmp_path, warm_python) -> None:
    plan = ["sim", "run", "--scenario", "realsize-shapes", "--methods", "cdfl,fedsoft-async,local",
            "--seeds", "1", "--out", "out", "--dry-run"]
    done = run_cli(*plan, cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert "K=4: 6000 train / 1500 test images, per cluster proxy 100, pretrain 300" in done.stdout
    assert "checkpoints on 1500 test images" in done.stdout  # fewer than 2,000: all of them
    uploads = len(make_schedule(0, 20, 22.0))
    assert f"3 runs (methods cdfl, fedsoft-async, local; K 4; seeds 0), {3 * uploads} updates in all" in done.stdout
    done = run_cli(*plan, "--clusters", "2", "--agents", "4", "--updates-per-agent", "1",
                   cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert f"K 2; seeds 0), {3 * len(make_schedule(0, 4, 1.0))} updates in all" in done.stdout
    done = run_cli("sim", "run", "--out", "out", "--dry-run", cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert "K=3:" in done.stdout and "3 runs" in done.stdout  # the paper's scenario keeps the paper's fleet


def test_the_mobilenet_scenario_is_the_same_fleet_with_a_pretraining_that_starts_mobilenet(
        tmp_path, warm_python) -> None:
    resnet, mobilenet = get_scenario("realsize-shapes"), get_scenario("realsize-shapes-mobilenet")
    fleet = ("dataset", "kind", "clusters", "agents", "updates_per_agent", "test_samples")
    assert [getattr(mobilenet, f) for f in fleet] == [getattr(resnet, f) for f in fleet]
    _, r = configure(RunSpec(scenario="realsize-shapes", clusters=4, agents=20))
    _, m = configure(RunSpec(scenario="realsize-shapes-mobilenet", clusters=4, agents=20))
    assert m.model == "torchvision:mobilenet_v3_small"
    assert (m.data.pretrain_per_cluster, m.aggregator.pretrain_epochs, m.aggregator.pretrain_lr) == (750, 20, 0.01)
    assert (m.cdfl, m.agent) == (r.cdfl, r.agent)  # the same replies and agents
    assert (m.data.proxy_per_cluster, m.data.min_samples, m.data.max_samples) == (100, 150, 350)
    done = run_cli("sim", "run", "--scenario", "realsize-shapes-mobilenet", "--methods", "cdfl,local", "--seeds", "1",
                   "--out", "out", "--dry-run", cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert "model torchvision:mobilenet_v3_small, pre-training 20 epochs at 0.01" in done.stdout
    assert "per cluster proxy 100, pretrain 750" in done.stdout
    assert f"2 runs (methods cdfl, local; K 4; seeds 0), {2 * len(make_schedule(0, 20, 22.0))} updates" in done.stdout


def write_folder(root: Path, name: str, per_class: tuple[int, int]) -> None:
    """`root/name/{train,test}/<class>/*.png`: 32x32 colour squares, one hue per class."""
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "test"), per_class, strict=True):
        for c in range(10):
            folder = root / name / split / str(c)
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 60, (32, 32, 3), dtype=np.uint8)
                pixels[8:24, 8:24, c % 3] = 100 + 15 * c
                Image.fromarray(pixels, mode="RGB").save(folder / f"{i}.png")


def test_realsize_runs_on_a_folder_dataset_under_data_dir(tmp_path, warm_python) -> None:
    write_folder(tmp_path / "data", "tiles", (30, 5))
    plan = ["sim", "run", "--scenario", "realsize", "--set", "data.dataset=folder:tiles",
            "--data-dir", str(tmp_path / "data"), "--methods", "cdfl,local", "--out", "out", "--dry-run"]
    done = run_cli(*plan, cwd=tmp_path, env=cli_env(), warm=warm_python)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "proxy_per_cluster" in lines[0], done.stderr
    done = run_cli(*plan, "--set", "data.proxy_per_cluster=10", "--set", "data.pretrain_per_cluster=20",
                   cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert "dataset folder:tiles" in done.stdout and "K=4: 300 train / 50 test images" in done.stdout


def test_an_offline_scenario_runs_its_fleet_on_the_data_under_data_dir(tmp_path, warm_python) -> None:
    """The results' commands run unchanged on other data by adding --data-dir: the real-size
    scenarios on the dataset found there (MNIST-shaped here), the rotated ones as rotated-NAME."""
    write_mnist_like(tmp_path / "data", "MNIST", n_train=7000, n_test=2500)

    def plan(*flags: str) -> tuple[int, str]:
        done = run_cli("sim", "run", *flags, "--data-dir", str(tmp_path / "data"), "--methods", "cdfl,local",
                       "--out", "out", "--dry-run", cwd=tmp_path, env=cli_env(), warm=warm_python)
        return done.returncode, done.stdout + done.stderr

    code, out = plan("--scenario", "realsize-shapes-mobilenet")
    assert code == 0, out
    assert "scenario realsize-mobilenet:" in out and "dataset mnist from" in out
    assert "model torchvision:mobilenet_v3_small, pre-training 20 epochs at 0.01" in out
    assert "per cluster proxy 100, pretrain 750" in out and "K 4" in out
    code, out = plan("--scenario", "realsize-shapes")
    assert code == 0 and "scenario realsize:" in out and "dataset mnist from" in out
    assert "model resnet20-gn (built for mnist: fedmq.models:ResNet20?in_channels=1&input=1x28x28" in out
    assert "scenario.data_dir" in out  # the swap is said, not silent
    assert "checkpoints on 2000 test images" in out  # a fixed draw of the 2,500: checkpoints stall the fleet
    code, out = plan("--scenario", "rotated-shapes")
    assert code == 0 and "scenario rotated-mnist:" in out, out
    # named: the dataset the command names; an offline one named, or a scenario without a twin: one line
    code, out = plan("--scenario", "realsize", "--set", "data.dataset=digits")
    assert code == 2 and "'digits' is made offline" in out and len(out.strip().splitlines()) == 1, out
    code, out = plan("--scenario", "digits-domains")
    assert code == 2 and "'digits-domains' is made offline" in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.slow
def test_a_short_run_of_the_batch_norm_resnet20_with_fedbn_agents(tmp_path, warm_python) -> None:
    """The batch-norm variant with FedBN agents: the aggregator turns its proxy refresh off by itself
    (with it, the clusters blew up within two uploads). One pre-training epoch and one epoch of the
    scenario's start model (15 by default: 2 minutes here; tests/test_start_model.py tests it): the
    run is about the fleet."""
    out = tmp_path / "out"
    done = run_cli("sim", "run", "--scenario", "realsize-shapes", "--methods", "cdfl", "--clusters", "2",
                   "--agents", "3", "--updates-per-agent", "1", "--test-samples", "20",
                   "--set", "model=resnet20", "--set", "aggregator.pretrain_epochs=1", "--set", "aggregator.start_epochs=1",
                   "--set", "agent.keep_local_bn=true", "--set", "data.proxy_per_cluster=30",
                   "--set", "data.pretrain_per_cluster=40", "--set", "data.min_samples=40",
                   "--set", "data.max_samples=60", "--out", str(out), cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    summary = json.loads((out / "runs" / "realsize-shapes_K2_cdfl_s0" / "summary.json").read_text())
    assert summary["updates"] == len(make_schedule(0, 3, 1.0)) > 0 and not summary.get("refused"), summary
    assert np.isfinite(summary["client_acc"]) and np.isfinite(summary["cluster_acc"])
    assert summary["command"].startswith("fedmq sim run --scenario realsize-shapes ")  # what made it, overrides too
    assert "agent.keep_local_bn=true" in summary["command"]
    assert "start: a model trained on 1200 public unrotated train images" in done.stdout  # the scenario's start
