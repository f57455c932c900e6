"""ONNX Runtime inference agrees with torch; the torch fallback takes over and says why."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from edge_agent import inference
from edge_agent.inference import OnnxPredictor, TorchPredictor, export_onnx, make_predictor
from fedmq import onnx_export
from fedmq.models import build_model, model_spec, to_vector


def random_inputs(model_name: str, batch: int, seed: int) -> np.ndarray:
    shape = model_spec(model_name).input_shape
    return np.random.default_rng(seed).standard_normal((batch, *shape)).astype(np.float32)


@pytest.mark.parametrize("model_name", ["digits-cnn", "cnn28"])
def test_onnx_matches_torch_and_reuses_the_graph(model_name: str, tmp_path) -> None:
    first = to_vector(build_model(model_name, seed=1))
    second = to_vector(build_model(model_name, seed=2))
    for i, vector in enumerate([first, second]):
        path = tmp_path / f"model-{i}.onnx"
        onnx_predictor = OnnxPredictor(model_name, vector, path=path)
        torch_predictor = TorchPredictor(model_name, vector)
        assert path.is_file() and "CPUExecutionProvider" in onnx_predictor.providers
        for batch in (1, 64):
            x = random_inputs(model_name, batch, seed=batch)
            got, want = onnx_predictor.predict(x), torch_predictor.predict(x)
            assert got.shape == (batch, 10)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        print(f"{model_name} model {i}: {onnx_predictor.export}")
    # the second model only swapped weights into the first one's graph
    assert onnx_predictor.export.reused_graph
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-0.onnx", "model-1.onnx"]


def test_legacy_exporter_matches_torch() -> None:
    vector = to_vector(build_model("digits-cnn", seed=3))
    blob, info = export_onnx("digits-cnn", vector, exporter="legacy", reuse_graph=False)
    assert info.exporter == "legacy" and not info.reused_graph and len(blob) == info.bytes
    predictor = OnnxPredictor("digits-cnn", vector, exporter="legacy")
    x = random_inputs("digits-cnn", 32, seed=0)
    np.testing.assert_allclose(predictor.predict(x), TorchPredictor("digits-cnn", vector).predict(x), atol=1e-4)


def test_wrong_input_shape_is_a_clear_error() -> None:
    predictor = make_predictor("digits-cnn", to_vector(build_model("digits-cnn", seed=0)), prefer="torch")
    with pytest.raises(ValueError, match="wants inputs"):
        predictor.predict(np.zeros((4, 1, 28, 28), np.float32))


def test_fallback_when_onnxruntime_is_missing(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now fails
    vector = to_vector(build_model("digits-cnn", seed=0))
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        predictor = make_predictor("digits-cnn", vector)
    assert isinstance(predictor, TorchPredictor)
    assert "onnxruntime not importable" in (predictor.fallback_reason or "")
    logged = [r for r in caplog.records if r.getMessage() == "inference.fallback"]
    assert logged and "onnxruntime not importable" in logged[0].fields["reason"]
    x = random_inputs("digits-cnn", 3, seed=0)
    with torch.no_grad():
        want = build_model("digits-cnn", seed=0)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(predictor.predict(x), want, atol=1e-6)


def test_fallback_when_export_fails(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(onnx_export, "_GRAPHS", {})
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))  # no graph kept by another test

    def broken_export(*args, **kwargs):
        raise RuntimeError("exporter broken for this test")

    monkeypatch.setattr(torch.onnx, "export", broken_export)
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        predictor = make_predictor("digits-cnn", to_vector(build_model("digits-cnn", seed=0)))
    assert isinstance(predictor, TorchPredictor)
    assert "exporter broken for this test" in (predictor.fallback_reason or "")
    assert any(r.getMessage() == "inference.fallback" for r in caplog.records)


def test_providers_prefer_cuda_when_offered() -> None:
    both = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert inference.choose_providers(both) == both
    assert inference.choose_providers(both, prefer_cuda=False) == ["CPUExecutionProvider"]
    assert inference.choose_providers(["AzureExecutionProvider", "CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match="offers none"):
        inference.choose_providers(["AzureExecutionProvider"])


def test_a_new_process_reuses_the_graph_kept_on_disk_and_refuses_a_damaged_one(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(onnx_export, "_GRAPHS", {})
    first = to_vector(build_model("digits-cnn", seed=0))
    blob, info = export_onnx("digits-cnn", first)
    assert not info.reused_graph
    kept, = (tmp_path / "onnx").glob("digits-cnn-*.onnx")  # fedmq/disk_cache.py
    monkeypatch.setattr(onnx_export, "_GRAPHS", {})  # as in a new process
    second = to_vector(build_model("digits-cnn", seed=1))
    blob2, info2 = export_onnx("digits-cnn", second)
    assert info2.reused_graph and info2.exporter == info.exporter
    x = random_inputs("digits-cnn", 4, seed=0)
    with torch.no_grad():
        want = build_model("digits-cnn", seed=1)(torch.from_numpy(x)).numpy()
    import onnxruntime as ort

    got = ort.InferenceSession(blob2, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    # A damaged file is named in a warning and replaced by a fresh export.
    kept.write_bytes(kept.read_bytes()[:-100])
    monkeypatch.setattr(onnx_export, "_GRAPHS", {})
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        _, info3 = export_onnx("digits-cnn", second)
    assert not info3.reused_graph
    refused = [r for r in caplog.records if r.getMessage() == "cache.refused"]
    assert refused and refused[0].fields["path"] == str(kept)
    monkeypatch.setattr(onnx_export, "_GRAPHS", {})
    assert export_onnx("digits-cnn", second)[1].reused_graph
    # Models from a factory are not kept on disk (their code may change under the same shapes).
    assert onnx_export._disk_name("mypkg.nets:make_model", "dynamo") is None
    # torchvision's are: its version fixes their code, and a new version names a new entry.
    import torchvision

    tv = "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10"
    name = onnx_export._disk_name(tv, "dynamo")
    assert name is not None and name.startswith("torchvision-mobilenet_v3_small-dynamo-")
    monkeypatch.setattr(torchvision, "__version__", "0.0.1")
    assert onnx_export._disk_name(tv, "dynamo") not in (None, name)
