"""A frozen backbone (`train=` in a model reference, fedmq/backbone.py): only the chosen layers
are trained, sent and aggregated; the backbone is the same fixed function everywhere, and the
spec's hash says so by content, wherever its file lies."""

from __future__ import annotations

import shutil
import signal

import numpy as np
import pytest
import torch

from aggregator.evaluator import ProxyEvaluator
from aggregator.personalize import resolve_layers
from edge_agent.inference import OnnxPredictor, TorchPredictor
from fedmq.data import RotatedClusters, load_dataset
from fedmq.errors import UsageError
from fedmq.models import (
    build_model,
    load_init_vector,
    load_vector,
    model_spec,
    resolve_model_name,
    to_vector,
)
from fedmq.training import fit
from tests.cli_process import CliProcess

BARS_DATA = "recipes.my_fleet:load_bars"
BARS_MODEL = "recipes.my_fleet:make_model?input=1x16x16&width=8"


def frozen(extra: str = "") -> str:
    return resolve_model_name(f"{BARS_MODEL}&train=head{extra}", BARS_DATA)


@pytest.fixture(scope="module")
def trained_whole(tmp_path_factory):
    """A whole bars model trained for a few epochs, saved as a user saves a checkpoint."""
    whole = resolve_model_name(BARS_MODEL, BARS_DATA)
    data = load_dataset(BARS_DATA)
    vector = fit(whole, to_vector(build_model(whole, seed=1)), data.x[:600], data.y[:600], epochs=3, lr=0.05).vector
    path = tmp_path_factory.mktemp("backbone") / "bars.pt"
    torch.save(load_vector(build_model(whole), vector).state_dict(), path)
    return whole, vector, path


def test_only_the_head_is_in_the_vector_and_the_backbone_is_the_same_whatever_the_seed() -> None:
    name = frozen()
    assert name == "recipes.my_fleet:make_model?input=1x16x16&train=head&width=8"
    spec, whole = model_spec(name), model_spec(resolve_model_name(BARS_MODEL, BARS_DATA))
    assert spec.names == ("9.weight", "9.bias") and spec.numel == 260 and whole.numel == 1604
    assert spec.frozen is not None and spec.hash != whole.hash
    a, b = build_model(name, seed=3), build_model(name, seed=5)
    assert [n for n, _ in a.named_parameters()] == ["9.weight", "9.bias"]
    assert torch.equal(dict(a.named_buffers())["0.weight"], dict(b.named_buffers())["0.weight"])
    a.train()
    assert not a[1].training and a[-1].training  # the backbone's batch norm stays a fixed function


def test_training_moves_the_head_and_leaves_the_backbone_and_its_statistics() -> None:
    name = frozen()
    data = load_dataset(BARS_DATA)
    start = to_vector(build_model(name, seed=0))
    result = fit(name, start, data.x[:200], data.y[:200], epochs=2, lr=0.05)
    assert result.vector.shape == start.shape and not torch.equal(result.vector, start)
    before = {n: t.clone() for n, t in build_model(name).named_buffers()}
    model = load_vector(build_model(name), result.vector).train()
    with torch.no_grad():
        model(data.x[:64])  # a train-mode pass would move batch-norm statistics: frozen ones stay
    assert all(torch.equal(before[n], t) for n, t in model.named_buffers())


def test_the_hash_follows_the_backbone_weights_not_the_files_path(trained_whole, tmp_path) -> None:
    whole, vector, path = trained_whole
    copy = tmp_path / "elsewhere.pt"
    shutil.copy(path, copy)
    here, there = frozen(f"&backbone={path}"), frozen(f"&backbone={copy}")
    assert here != there and model_spec(here).hash == model_spec(there).hash
    assert model_spec(here).hash != model_spec(frozen()).hash  # another backbone: another fleet
    built = dict(build_model(here).named_buffers())
    assert torch.equal(built["0.weight"].reshape(-1), vector[:72])  # the file's first conv, as saved
    # A user's whole checkpoint is a fine init file for the frozen model: its backbone keys are
    # known and skipped, its head is taken.
    end = model_spec(whole).param_numel  # the whole vector: parameters (the head last), then statistics
    assert torch.equal(load_init_vector(path, here), vector[end - 260:end])


@pytest.mark.parametrize(("query", "says"), [
    ("&train=head&backbone=/nowhere/w.pt", "backbone /nowhere/w.pt: no such file"),
    ("&backbone=w.pt", "backbone= goes with train="),
    ("&train=nothing", "no parameter under 'nothing'"),
    ("&train=0+1+4+5+9", "leaves nothing frozen"),
    ("&train=", "train= needs a value"),
])
def test_a_bad_train_or_backbone_is_one_clear_error(query, says) -> None:
    with pytest.raises(UsageError) as caught:
        resolve_model_name(BARS_MODEL + query, BARS_DATA)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_reply_over_a_frozen_backbone_trains_the_head_over_features_computed_once() -> None:
    name = frozen()
    spec = model_spec(name)
    data = load_dataset(BARS_DATA)
    clusters = RotatedClusters(data, load_dataset(BARS_DATA, train=False), 2, seed=0,
                               proxy_per_cluster=100, pretrain_per_cluster=100)
    ev = ProxyEvaluator(spec, [(p.x, p.y) for p in (clusters.proxy(k, 100) for k in range(2))], device="cpu")
    split, layers, why = resolve_layers(ev, "auto", 1_000_000)
    assert (layers, why) == ("head", "a frozen backbone") and split.fixed_lower
    rows = torch.arange(0, 50)
    first = ev.lower_features(to_vector(build_model(name, seed=1)), rows)
    again = ev.lower_features(to_vector(build_model(name, seed=2)), torch.arange(60, 90))
    assert again is first and ev.feature_misses == 1 and ev.feature_hits == 1


def test_the_edge_runs_a_frozen_model_in_onnx_runtime(tmp_path) -> None:
    name = frozen()
    x = load_dataset(BARS_DATA, train=False).x[:32]
    vector = to_vector(build_model(name, seed=4))
    np.testing.assert_allclose(OnnxPredictor(name, vector, path=tmp_path / "m.onnx").predict(x),
                               TorchPredictor(name, vector).predict(x), atol=1e-4, rtol=1e-4)


def test_a_fleet_sends_only_the_head_and_refuses_a_device_with_another_backbone(mosquitto, tmp_path,
                                                                                trained_whole) -> None:
    """`fedmq aggregator` and two `fedmq agent`s over a real Mosquitto: the one holding the same
    backbone under another path joins and uploads the head alone; the one holding another is
    refused as another fleet's model."""
    _, _, path = trained_whole
    copy = tmp_path / "device-copy.pt"
    shutil.copy(path, copy)
    other = tmp_path / "other.pt"
    state = torch.load(path, weights_only=True)
    state["0.weight"] = state["0.weight"] * 1.01
    torch.save(state, other)

    def common(backbone) -> list[str]:
        return ["--broker", mosquitto.url, "--fleet", "frozen", "--dataset", BARS_DATA,
                "--model", f"{BARS_MODEL}&train=head&backbone={backbone}",
                "--set", "codec.name=fp32"]  # exact bytes: 260 float32 values are 1,040 bytes

    server = ["fedmq", "aggregator", *common(path), "--clusters", "2", "--state-dir", str(tmp_path / "agg"),
              # CI time: a small server; the defaults are the bars recipe's in docs/models.md
              "--set", "data.proxy_per_cluster=100", "--set", "data.pretrain_per_cluster=200",
              "--set", "aggregator.pretrain_epochs=1"]
    aggregator = CliProcess(server, cwd=tmp_path)
    procs = [aggregator]
    try:
        aggregator.wait_for(r"^aggregator cdfl on ", timeout=300)
        agent = CliProcess(["fedmq", "agent", *common(copy), "--id", "car-1", "--state-dir", str(tmp_path / "car-1"),
                            # its 200 samples in 1 s, not the default stream's 10 s
                            "--set", "agent.poll_interval_s=0.1"], cwd=tmp_path)
        procs.append(agent)
        agent.wait_for(r"model\.installed .*via=join", timeout=300)
        agent.proc.send_signal(signal.SIGUSR1)
        done = agent.wait_for(r"model\.installed .*via=update .*uploaded=(\d+) .*downloaded=(\d+)", timeout=300)
        assert 1040 <= int(done.group(1)) < 4000, done.group(0)  # the head, not the 1,604-value model
        stranger = CliProcess(["fedmq", "agent", *common(other), "--id", "car-2",
                               "--state-dir", str(tmp_path / "car-2")], cwd=tmp_path)
        procs.append(stranger)
        stranger.wait_for(r"wrong_model", timeout=300)
        assert "model.installed" not in stranger.output
        for proc in procs:
            proc.stop()
        assert "Traceback" not in aggregator.output + agent.output, (aggregator.output + agent.output)[-3000:]
    finally:
        for proc in procs:
            proc.kill()
