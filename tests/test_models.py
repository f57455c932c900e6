"""Your model, your data (docs/models.md): torchvision models and factories by import path,
batch-norm statistics, dataset factories, and fleets over a real Mosquitto that run them.

The factory example is the one docs/models.md documents (recipes/my_fleet.py); its fleet
block runs as written in tests/test_documented_commands.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.cluster_refresh import refresh_cluster
from aggregator.evaluator import ProxyEvaluator
from aggregator.personalize import DistillPersonalizer, PersonalizeRequest
from edge_agent.inference import OnnxPredictor, TorchPredictor
from fedmq.data import RotatedClusters, load_dataset
from fedmq.errors import UsageError
from fedmq.models import build_model, load_vector, model_spec, resolve_model_name, to_vector
from fedmq.onnx_export import export_onnx
from fedmq.training import evaluate, fit
from tests.cli_process import BIN, ROOT, CliProcess, cli_env
from tests.warm_python import client_argv

MOBILENET = "torchvision:mobilenet_v3_small"
BARS_DATA = "recipes.my_fleet:load_bars"
BARS_MODEL = "recipes.my_fleet:make_model?input=1x16x16&width=8"


def test_a_torchvision_reference_takes_the_datasets_shape_and_its_hash_covers_the_architecture() -> None:
    name = resolve_model_name(MOBILENET, "shapes")
    assert name == "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10"
    assert resolve_model_name(name, "shapes") == name  # the canonical name is what state files keep
    spec = model_spec(name)
    assert (spec.input_shape, spec.num_classes) == ((3, 32, 32), 10)
    assert 1_400_000 < spec.param_numel < spec.numel  # parameters, then batch-norm statistics
    others = {model_spec(resolve_model_name(m, "shapes")).hash
              for m in ("torchvision:mobilenet_v3_small?num_classes=100", "torchvision:resnet18", "cnn32-10")}
    assert len(others) == 3 and spec.hash not in others
    # Zoo specs are unchanged by the new fields: old state dirs and devices keep their hashes.
    assert model_spec("cnn28").hash == "526d918077a9032e"
    assert model_spec("digits-cnn").hash == "5a9e7b9f05416da4"


def test_a_torchvision_model_takes_a_one_channel_dataset_with_a_stem_of_its_own() -> None:
    """torchvision builds for RGB; on MNIST-shaped data the first convolution takes one channel,
    the rest of the network as torchvision builds it. An RGB model is built exactly as before."""
    gray = model_spec(resolve_model_name(MOBILENET, "mnist"))
    rgb = model_spec(resolve_model_name(MOBILENET, "shapes"))
    assert gray.input_shape == (1, 28, 28) and rgb.numel - gray.numel == 2 * 16 * 3 * 3  # two channels fewer
    model = build_model(gray.arch, seed=3).eval()
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert torch.equal(to_vector(build_model(gray.arch, seed=3)), to_vector(model))  # the stem is seeded too
    assert rgb.hash == "efd9a0da6e54d6f9"  # as before one-channel stems: RGB state files and caches keep


def test_a_resnet20_is_built_for_the_datasets_shape_and_other_zoo_models_say_they_do_not_fit() -> None:
    """The real-size fleet's ResNet-20 on MNIST (1x28x28) or CIFAR-100 (100 classes) is the same
    network built for it, by reference; on its own shape it is the zoo entry, hash unchanged."""
    assert resolve_model_name("resnet20-gn", "shapes") == "resnet20-gn"
    assert model_spec("resnet20-gn").hash == "f077db48948878f2"
    gray = resolve_model_name("resnet20-gn", "mnist")
    assert gray == "fedmq.models:ResNet20?in_channels=1&input=1x28x28&norm=group&num_classes=10"
    assert build_model(gray, seed=0)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    many = model_spec(resolve_model_name("resnet20", "cifar100"))
    assert many.num_classes == 100 and many.numel > model_spec("resnet20").numel  # a wider head, batch norm kept
    with pytest.raises(UsageError) as err:
        resolve_model_name("cnn32-10", "mnist")
    assert "takes 3x32x32 inputs of 10 classes; mnist has 1x28x28" in str(err.value) and "auto (cnn28)" in str(err.value)
    assert resolve_model_name("cnn32-10", "folder:tiles") == "cnn32-10"  # a folder's shape is the user's to know


@pytest.mark.parametrize("model, dataset, says", [
    ("torchvision:nosuchnet", "shapes", "torchvision has no model 'nosuchnet'"),
    ("nosuchpkg.nets:make", "shapes", "cannot import 'nosuchpkg.nets'"),
    ("recipes.my_fleet:nothing", "shapes", "no callable 'nothing'"),
    ("recipes.my_fleet:make_model?width=eight", "digits", "refused its arguments"),
    ("torchvision:squeezenet1_1", "digits", "forward pass on inputs (N, 1, 8, 8) failed"),
    ("recipes.my_fleet:make_model", BARS_DATA, "add input=CxHxW"),
    ("torchvision:resnet18?input=3x", "shapes", "input must be CxHxW"),
    ("torchvision:resnet18?depth", "shapes", "'depth' is not key=value"),
    ("torchvision:resnet18?bn_momentum=0", "shapes", "bn_momentum must be in (0, 1]"),
    ("torchvision:resnet18?bn_momentum=fast", "shapes", "bn_momentum must be in (0, 1]"),
    (BARS_MODEL + "&tag=" + "a" * 500, BARS_DATA, "more than the 512 the protocol carries"),
])
def test_a_bad_reference_is_one_clear_error(model, dataset, says) -> None:
    with pytest.raises(UsageError) as err:
        resolve_model_name(model, dataset)
    assert says in str(err.value) and "\n" not in str(err.value)


def bn_momenta(name: str) -> set[float | None]:
    return {m.momentum for m in build_model(name).modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}


def test_batch_norm_momentum_is_the_models_own_unless_the_reference_names_one() -> None:
    """MobileNetV3 keeps torchvision's 0.01 (in a fleet it scored above 0.1, docs/models.md);
    `bn_momentum=` sets every batch-norm layer's, and is part of the model's name and hash."""
    assert bn_momenta(resolve_model_name(MOBILENET, "shapes")) == {0.01}
    own = resolve_model_name(MOBILENET + "?bn_momentum=0.1", "shapes")
    assert "bn_momentum=0.1" in own and bn_momenta(own) == {0.1}
    assert model_spec(own).hash != model_spec(resolve_model_name(MOBILENET, "shapes")).hash
    assert bn_momenta(resolve_model_name(BARS_MODEL, BARS_DATA)) == {0.1}  # the factory's own
    assert bn_momenta(resolve_model_name(BARS_MODEL + "&bn_momentum=0.3", BARS_DATA)) == {0.3}


def run_cli(*argv: str, cwd: Path, env: dict[str, str], warm: Path | None = None) -> subprocess.CompletedProcess:
    """`fedmq ARGV`, forked from the warm interpreter if given (tests/warm_python.py)."""
    fedmq = client_argv(warm, "fedmq") if warm else [str(BIN / "fedmq")]
    return subprocess.run([*fedmq, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_dry_run_resolves_the_model_and_a_factory_in_the_working_directory(tmp_path, warm_python) -> None:
    done = run_cli("agent", "--id", "a", "--dataset", "shapes", "--model", MOBILENET, "--dry-run",
                   cwd=ROOT, env=cli_env(), warm=warm_python)
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)["resolved"]
    assert resolved["model"] == "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10"
    assert resolved["parameters"] == 1_528_106 and resolved["statistics"] > 0
    # A team's own module in its working directory, with no PYTHONPATH: found as uvicorn finds apps.
    (tmp_path / "mynets.py").write_text("from torch import nn\n\ndef tiny(classes=10):\n"
                                        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, classes))\n")
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    done = run_cli("agent", "--id", "a", "--model", "mynets:tiny", "--dry-run", cwd=tmp_path, env=env, warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resolved"]["parameters"] == 650
    done = run_cli("agent", "--id", "a", "--model", "torchvision:nosuchnet", "--dry-run", cwd=tmp_path, env=env, warm=warm_python)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "nosuchnet" in lines[0], done.stderr


def test_a_dataset_factory_is_normalized_by_its_train_split() -> None:
    train, test = load_dataset(BARS_DATA), load_dataset(BARS_DATA, train=False)
    assert train.image_shape == (1, 16, 16) and (len(train), len(test)) == (1600, 400)
    assert train.num_classes == test.num_classes == 4 and test.mean == train.mean
    assert abs(float(train.x.mean())) < 1e-4 and abs(float(train.x.std()) - 1) < 1e-3
    with pytest.raises(UsageError, match="module.path:function"):
        load_dataset("recipes.my_fleet:load bars")


@pytest.fixture(scope="module")
def bars():
    """Two rotation clusters of the example's bars, a model pre-trained on them, proxies."""
    name = resolve_model_name(BARS_MODEL, BARS_DATA)
    clusters = RotatedClusters(load_dataset(BARS_DATA), load_dataset(BARS_DATA, train=False), 2, seed=0,
                               proxy_per_cluster=100, pretrain_per_cluster=300)
    d = clusters.pretrain(0, 300)
    start = fit(name, to_vector(build_model(name, seed=0)), d.x, d.y, epochs=3, lr=0.05).vector
    proxies = [(p.x, p.y) for p in (clusters.proxy(k, 100) for k in range(2))]
    return name, clusters, start, proxies


def test_batch_norm_statistics_travel_with_the_weights_and_no_server_step_moves_them(bars) -> None:
    name, clusters, start, proxies = bars
    spec = model_spec(name)
    p = spec.param_numel
    d = clusters.pretrain(1, 300)
    trained = fit(name, start, d.x, d.y, epochs=1, lr=0.05).vector
    assert not torch.equal(trained[p:], start[p:])  # the device's statistics are in what it sends
    assert torch.equal(to_vector(load_vector(build_model(name), trained)), trained)
    negative = trained.clone()
    negative[p:] = -1.0  # a lossy codec's rounding can push a tiny variance below 0: used as 0
    assert all((t >= 0).all() for n, t in spec.unflatten(negative).items() if n.endswith("running_var"))
    assert all((b >= 0).all() for n, b in load_vector(build_model(name), negative).named_buffers()
               if n.endswith("running_var"))
    stale = torch.cat([trained[:p], start[p:]])  # the same weights with other statistics
    test = clusters.take(1, 300, np.random.default_rng(0), split="test")
    assert evaluate(name, trained, test.x, test.y) != evaluate(name, stale, test.x, test.y)

    ev = ProxyEvaluator(spec, proxies, device="cpu")
    assert ev.formulation == "stacked"  # the fused CPU plan knows no batch norm: it steps aside
    refreshed = refresh_cluster(ev, trained, 0, steps=5, lr=0.05)
    assert torch.equal(refreshed[p:], trained[p:]) and not torch.equal(refreshed[:p], trained[:p])

    clusters_w = torch.stack([start, trained])
    personalizer = DistillPersonalizer(ev, epochs=2, kd_weight=0.0, start="mixture")
    requests = [PersonalizeRequest(clusters_w, alpha, trained, seed=i)
                for i, alpha in enumerate(([0.3, 0.7], [0.6, 0.4], [0.5, 0.5]))]
    alone = [personalizer.personalize(r)[0] for r in requests]
    for r in requests:
        personalizer.fix_start(r)
    together = [v for v, _ in personalizer.personalize_many(requests)]  # torch.func vmap(grad)
    for a, b, r in zip(alone, together, requests, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert torch.equal(a[p:], r.start[p:])  # the mixture's statistics, untouched by training
        assert not torch.equal(a[:p], r.start[:p])


def test_onnx_runtime_runs_a_batch_norm_model_and_reuses_its_graph(bars, tmp_path) -> None:
    name, clusters, start, _ = bars
    x = clusters.take(0, 64, np.random.default_rng(1), split="test").x
    onnx_out = OnnxPredictor(name, start, path=tmp_path / "model.onnx").predict(x)
    np.testing.assert_allclose(onnx_out, TorchPredictor(name, start).predict(x), atol=1e-4, rtol=1e-4)
    _, info = export_onnx(name, start * 1.01)
    assert info.reused_graph  # every state tensor is in the graph under its name: weights swap in


@pytest.mark.slow
def test_a_torchvision_fleet_over_mosquitto_with_a_reply_in_several_chunks(mosquitto, tmp_path) -> None:
    """`fedmq aggregator` and `fedmq agent` with MobileNetV3-small on the shapes dataset."""
    common = ["--broker", mosquitto.url, "--fleet", "tv", "--dataset", "shapes", "--model", MOBILENET,
              # 256 kB pieces: the int8 reply (1.4 MB) spans 6; the default 8 MiB would hold it whole.
              "--set", "protocol.chunk_bytes=262144"]
    server = ["fedmq", "aggregator", *common, "--clusters", "2", "--state-dir", str(tmp_path / "agg"),
              # CI time: the defaults (10,000 samples of pre-training per cluster, 8-epoch replies)
              # take 2 min to start and 45 s per reply here; docs/models.md measures them.
              "--set", "data.proxy_per_cluster=50", "--set", "data.pretrain_per_cluster=200",
              "--set", "aggregator.pretrain_epochs=1", "--set", "cdfl.personalize_epochs=1"]
    aggregator = CliProcess(server, cwd=tmp_path)
    agent = None
    try:
        aggregator.wait_for(r"^aggregator cdfl on ", timeout=600)
        agent = CliProcess(["fedmq", "agent", *common, "--id", "van-1", "--state-dir", str(tmp_path / "van-1"),
                            # its 200 samples in 1 s, not the default stream's 10 s
                            "--set", "agent.poll_interval_s=0.1"], cwd=tmp_path)
        agent.wait_for(r"model\.installed .*via=join", timeout=300)
        agent.proc.send_signal(signal.SIGUSR1)  # ask for an update now, as `fedmq agent --help` says
        done = agent.wait_for(r"model\.installed .*via=update .*uploaded=(\d+) .*downloaded=(\d+)", timeout=600)
        assert int(done.group(1)) > 262144 and int(done.group(2)) > 2 * 262144, done.group(0)
        aggregator.wait_for(r"update\.applied agent=van-1 epoch=1", timeout=60)
        for proc in (agent, aggregator):
            assert proc.stop() == 0, proc.output[-3000:]
            assert "Traceback" not in proc.output, proc.output[-3000:]
        # The snapshot and journal of a batch-norm model bring the fleet back where it was.
        # Both processes exported MobileNetV3 once between them: its graph is on disk for the next.
        assert list((Path(os.environ["FEDMQ_CACHE_DIR"]) / "onnx").glob("torchvision-mobilenet_v3_small-*.onnx"))
        aggregator = CliProcess(server, cwd=tmp_path)
        aggregator.wait_for(r"^aggregator cdfl on .* epoch=1$", timeout=300)
        assert aggregator.stop() == 0 and "Traceback" not in aggregator.output, aggregator.output[-3000:]
    finally:
        for proc in (agent, aggregator):
            if proc is not None:
                proc.kill()



def test_batch_norm_trains_when_the_last_batch_would_hold_one_sample() -> None:
    """MobileNetV3 pools to 1x1: batch norm on one sample has one value per channel and fails."""
    name = resolve_model_name(MOBILENET, "shapes")
    data = load_dataset("shapes")
    result = fit(name, to_vector(build_model(name, seed=0)), data.x[:33], data.y[:33], epochs=1, batch_size=32)
    assert result.samples_seen == 33 and np.isfinite(result.final_loss)



@pytest.mark.parametrize(("model", "n", "steps"), [("resnet20", 66, 2), ("resnet20", 80, 3), ("resnet20-gn", 66, 3)])
def test_batch_norm_never_trains_on_a_short_tail(model: str, n: int, steps: int) -> None:
    """A tail under half the batch joins the batch before it for a batch-norm model (on 2-4
    samples its gradients explode: a pre-trained MobileNetV3 went to chance in one update);
    a tail of half or more stands, and a model without statistics keeps every draw."""
    data = load_dataset("shapes")
    result = fit(model, to_vector(build_model(model, seed=0)), data.x[:n], data.y[:n], epochs=1, batch_size=32)
    assert result.samples_seen == n and result.steps == steps


def test_the_delta_rule_mixes_statistics_and_never_makes_a_variance_negative(bars) -> None:
    """w_k += b (v - base) on a running variance goes below 0 when w_k's is smaller than
    base's - v's (a MobileNetV3 fleet's replies turned NaN so): statistics take the pull rule,
    w_k := (1 - b) w_k + b v, while the parameters take the step."""
    from aggregator.cdfl import CDFL
    from aggregator.strategy import Upload
    from fedmq.config import CDFLSettings

    name, _, start, proxies = bars
    spec = model_spec(name)
    p = spec.param_numel
    var = torch.cat([torch.full((int(np.prod(shape)),), n.endswith("running_var"))
                     for n, shape in zip(spec.names, spec.shapes, strict=True)])
    clusters = torch.stack([start, start])
    clusters[:, var] = 0.1
    base, upload = start.clone(), start.clone()
    base[var], upload[var] = 2.0, 0.5  # v - base = -1.5 on every variance
    step = 0.01 * torch.randn(p, generator=torch.Generator().manual_seed(0))
    upload[:p] += step
    settings = CDFLSettings(clusters=2, tau0=100, update_rule="delta", server_lr=0.5, personalization="mixture",
                            cluster_refresh_steps=0, delta_moves_head=True)
    strategy = CDFL.from_settings(spec, clusters, proxies, settings, device="cpu")
    strategy.join("car-1")
    strategy.apply(Upload("car-1", upload, tau=0, base=base), alpha=[0.8, 0.2])
    for k, b in enumerate((0.5 * 0.8, 0.5 * 0.2)):
        torch.testing.assert_close(strategy.clusters[k, :p], clusters[k, :p] + b * step)
        torch.testing.assert_close(strategy.clusters[k, var], torch.full((int(var.sum()),), (1 - b) * 0.1 + b * 0.5))


@pytest.mark.slow
def test_the_batch_tail_script_trains_every_tail_and_leaves_a_model_without_statistics_alone(tmp_path) -> None:
    """scripts/batch_tail.py as docs/models.md runs it, on the digits scenario (no batch norm, seconds of
    pre-training): every tail and draw has both rules, and without statistics the two train alike."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "batch_tail.py"
    loaded = importlib.util.spec_from_file_location("batch_tail", path)
    script = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(script)
    assert script.main(["--scenario", "rotated-digits", "--batches", "2", "--out", str(tmp_path / "t.json")]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 2 * len(script.TAILS) * script.DRAWS
    for kept, now in zip(rows[::2], rows[1::2], strict=True):
        assert (kept["rule"], now["rule"]) == ("tail kept", "fit") and kept["tail"] == now["tail"]
        assert kept["steps"] == now["steps"] and kept["accuracy"] == now["accuracy"] > 0.1
