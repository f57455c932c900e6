"""The device loop without a server: Local mode, durable state across restarts, knobs, the CLI.

Local mode never opens a connection (the broker URL points at a closed port), so these
tests need no broker; the protocol side is tests/test_agent_e2e.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_agent.agent_loop import DeviceAgent, parse_knobs
from edge_agent.drift import ThresholdDetector
from edge_agent.sources import DatasetSource
from edge_agent.state import AgentState
from fedmq.broker import free_port
from fedmq.config import Config, load_config
from fedmq.data import clusters_from_settings
from fedmq.training import evaluate
from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent
LOCAL = {
    "data.dataset": "digits", "cdfl.clusters": 2, "agent.algorithm": "local", "agent.id": "solo",
    "agent.min_samples_to_train": 200, "agent.buffer_size": 400, "agent.poll_batch": 50,
    "agent.epochs": 5, "agent.lr": 0.05, "agent.inference": "onnx",
}


def local_cfg(tmp_path: Path, **extra) -> Config:
    closed = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens: Local mode must not connect
    return load_config(None, {**LOCAL, "broker.url": closed, "agent.state_dir": str(tmp_path / "solo"), **extra})


@pytest.fixture(scope="module")
def pools():
    cfg = load_config(None, LOCAL)
    clusters = clusters_from_settings(cfg.data, 2, seed=0)
    rng = np.random.default_rng(0)
    pools = [(d.x, d.y) for d in (clusters.take(k, 400, rng) for k in range(2))]
    test = clusters.take(0, 300, rng, split="test")
    return pools, (test.x, test.y)


def test_local_mode_trains_on_trigger_installs_and_resumes_after_restart(tmp_path, pools) -> None:
    cluster_pools, test = pools
    cfg = local_cfg(tmp_path)
    device = DeviceAgent(cfg, DatasetSource(cluster_pools, [1.0, 0.0], seed=1)).start()
    assert device.agent is None and device.tau == -1
    start = device.state.vector.clone()
    acc_start = evaluate(device.model_name, start, *test)[0]
    device.trigger()
    cycle = None
    for _ in range(20):
        cycle = cycle or device.step()
    assert cycle is not None and cycle.trigger == "manual" and cycle.outcome == "local"
    assert cycle.samples == 200 and cycle.epochs_done == 5
    acc_trained = evaluate(device.model_name, device.state.vector, *test)[0]
    assert acc_trained > acc_start + 0.2, (acc_start, acc_trained)
    assert device.predictor.backend == "onnxruntime"
    assert (Path(cfg.agent.state_dir) / "model.onnx").exists()
    observed = device.monitor.observed
    device.close()

    again = DeviceAgent(cfg, DatasetSource(cluster_pools, [1.0, 0.0], seed=2)).start()
    try:
        assert torch.equal(again.state.vector, device.state.vector)
        assert again.monitor.observed == observed
        assert again.counters["cycles"] == 1 and again.counters["starts"] == 2
        assert again.state.reference_accuracy == device.state.reference_accuracy
    finally:
        again.close()


def test_training_that_diverges_keeps_the_held_model_and_sends_nothing(tmp_path, pools) -> None:
    """A rate that blows the weights up to Inf/NaN is an outcome (`diverged`, counted), not a
    crash: the held model stays installed and the agent goes on predicting with it."""
    cluster_pools, _ = pools
    cfg = local_cfg(tmp_path, **{"agent.lr": 1e30, "agent.rho": 0.0})  # why: an absurd rate diverges at once
    device = DeviceAgent(cfg, DatasetSource(cluster_pools, [1.0, 0.0], seed=1)).start()
    try:
        start = device.state.vector.clone()
        device.trigger()
        cycle = None
        for _ in range(20):
            cycle = cycle or device.step()
        assert cycle is not None and cycle.outcome == "diverged", cycle
        assert device.counters["train_diverged"] == 1 and device.counters.get("cycles") == 1
        assert torch.equal(device.state.vector, start) and torch.isfinite(device.state.vector).all()
        assert device.step() is None  # the loop goes on
    finally:
        device.close()


def test_drift_waits_for_samples_after_the_detection(tmp_path, pools) -> None:
    cluster_pools, _ = pools
    cfg = local_cfg(tmp_path, **{"agent.min_update_interval_s": 0, "agent.samples_after_drift": 150,
                                 "agent.detector_knobs": "window=100,delta=0.15"})
    source = DatasetSource(cluster_pools, [1.0, 0.0], seed=3)
    device = DeviceAgent(cfg, source).start()
    try:
        assert isinstance(device.monitor.detector, ThresholdDetector)
        assert device.monitor.detector.window == 100 and device.monitor.detector.delta == 0.15
        device.trigger()
        while device.step() is None:
            pass
        for _ in range(10):
            assert device.step() is None
        source.set_mixture([0.0, 1.0])  # rotated digits: the trained model fails on them
        cycle, polls_before_detection = None, None
        while cycle is None:
            before = device.monitor.observed
            cycle = device.step()
            if polls_before_detection is None and device.counters.get("drifts"):
                polls_before_detection = before  # detected within this poll
        assert cycle.trigger == "drift" and device.counters["drifts"] == 1
        assert device.monitor.observed - polls_before_detection >= 150
    finally:
        device.close()


def test_parse_knobs_reads_numbers_and_words() -> None:
    assert parse_knobs(["window=100", "delta=0.15", "direction=both"]) == {
        "window": 100, "delta": 0.15, "direction": "both"}
    with pytest.raises(ValueError, match="name=value"):
        parse_knobs(["window"])


def test_saved_state_of_another_model_is_not_loaded(tmp_path, pools) -> None:
    cluster_pools, _ = pools
    cfg = local_cfg(tmp_path)
    AgentState("solo", "cnn28", "0" * 16, vector=torch.zeros(3), tau=9).save(cfg.agent.state_dir)
    device = DeviceAgent(cfg, DatasetSource(cluster_pools, seed=4)).start()
    try:
        assert device.tau == -1 and device.state.model_name == device.model_name
    finally:
        device.close()
    assert AgentState.load(cfg.agent.state_dir).model_name == device.model_name


def _cli(warm: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m fedmq.cli agent ARGS`, forked from the warm interpreter (tests/warm_python.py)."""
    return subprocess.run(client_argv(warm, "python", "-m", "fedmq.cli", "agent", *args), capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def test_cli_dry_run_maps_flags_and_requires_an_id(tmp_path, warm_python) -> None:
    out = _cli(warm_python, "--dry-run", "--id", "car-7", "--profile", "car", "--state-dir", str(tmp_path),
               "--algorithm", "fedsoft-async", "--set", "agent.epochs=3")
    assert out.returncode == 0, out.stderr
    agent = json.loads(out.stdout)["agent"]
    assert agent["id"] == "car-7" and agent["profile"] == "car" and agent["epochs"] == 3
    assert agent["state_dir"] == str(tmp_path) and agent["algorithm"] == "fedsoft-async"
    missing = _cli(warm_python, "--algorithm", "local")
    assert missing.returncode == 2 and "--id" in missing.stderr


@pytest.mark.slow
def test_cli_local_agent_runs_without_a_broker_and_saves_state(tmp_path, warm_python) -> None:
    state = tmp_path / "cam"
    out = _cli(warm_python, "--id", "cam-1", "--algorithm", "local", "--state-dir", str(state), "--dataset", "digits",
               "--broker", f"mqtt://127.0.0.1:{free_port()}", "--update-now", "--max-steps", "8",
               "--clusters", "2", "--set", "agent.poll_interval_s=0", "--set", "agent.poll_batch=50",
               "--set", "agent.min_samples_to_train=200", "--set", "agent.epochs=1")
    assert out.returncode == 0, out.stdout + out.stderr
    saved = AgentState.load(state)
    assert saved.counters["cycles"] == 1 and saved.counters["samples"] == 400
    assert saved.pending is None and saved.tau == -1
