"""The zoo's ResNet-20 (He et al.'s CIFAR variant) with batch norm and with GroupNorm: its
size, where its output layer lies in the vector, and its ONNX graph on real shapes images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_agent.inference import OnnxPredictor, TorchPredictor
from fedmq.data import load_dataset
from fedmq.models import build_model, model_spec, resolve_dataset_and_model, to_vector
from fedmq.onnx_export import export_onnx


@pytest.fixture(scope="module")
def shapes():
    return load_dataset("shapes", train=False)


@pytest.mark.parametrize("name, statistics", [("resnet20", 1376), ("resnet20-gn", 0)])
def test_resnet20_has_the_papers_size_and_its_head_is_the_linear_layer(name, statistics) -> None:
    spec = model_spec(name)
    assert spec.param_numel == 269_722  # He et al.: 0.27 M, shortcuts without weights
    assert spec.numel - spec.param_numel == statistics  # batch norm's running means and variances
    assert (spec.input_shape, spec.num_classes) == ((3, 32, 32), 10)
    model = build_model(name, seed=1)
    start, end = spec.head
    head = torch.cat([model.fc.weight.detach().reshape(-1), model.fc.bias.detach()])
    assert torch.equal(to_vector(model)[start:end], head)
    assert resolve_dataset_and_model("shapes", name) == {
        "dataset": "shapes", "model": name, "parameters": 269_722, **({"statistics": statistics} if statistics else {})}


def test_groupnorm_keeps_no_statistics_where_batch_norm_depends_on_them(shapes) -> None:
    """What a device could keep local (FedBN) exists only in the batch-norm variant: GroupNorm
    normalizes each sample by itself, so train and eval mode give the same logits."""
    x = shapes.x[:16]
    for name, same in (("resnet20-gn", True), ("resnet20", False)):
        model = build_model(name, seed=0)
        with torch.no_grad():
            train_mode, eval_mode = model.train()(x), model.eval()(x)
        assert torch.allclose(train_mode, eval_mode, atol=1e-5) is same, name


@pytest.mark.parametrize("name", ["resnet20", "resnet20-gn"])
def test_resnet20_runs_in_onnx_runtime_and_reuses_its_graph(name, shapes, tmp_path) -> None:
    vector = to_vector(build_model(name, seed=2))
    p = model_spec(name).param_numel
    vector[p:] += 0.1  # statistics that are not the initial ones: the graph must carry them
    x = shapes.x[:32]
    onnx_out = OnnxPredictor(name, vector, path=tmp_path / "model.onnx").predict(x)
    np.testing.assert_allclose(onnx_out, TorchPredictor(name, vector).predict(x), atol=1e-4, rtol=1e-4)
    _, info = export_onnx(name, vector * 1.01)
    assert info.reused_graph  # every weight and statistic is in the graph under its name
