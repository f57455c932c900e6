"""ONNX export of zoo models: the agent's predictor and the aggregator's published graph.

In the kernel so that both sides use one exporter: the edge agent runs its received model in
ONNX Runtime (edge_agent/inference.py), and the aggregator publishes the fleet's model graph
for devices that do not run Python (docs/protocol.md, "Model graph").

A model is exported once per architecture; later models of the same spec only swap the
weights inside the cached ONNX graph. Both of torch's exporters name the graph's
initializers after the parameters (conv1.weight, ...) with the parameters' shapes, so a
new vector is written into them by name (shape-checked) in milliseconds, where a fresh
export costs 2-7 s with the dynamo exporter on this 2-core machine (0.01-0.08 s with the
legacy TorchScript one, which torch deprecates). If a graph does not hold every parameter
under its name, each model is exported afresh. The default exporter is dynamo
(`torch.onnx.export(..., dynamo=True, external_data=False)`: one self-contained file,
dynamic batch dimension); "legacy" is the fallback when dynamo fails, and "auto" means
exactly that order.

Zoo and torchvision models' graphs are also kept on disk (fedmq/disk_cache.py, `onnx/`),
named by the model's code (torchvision's version for its models), torch and onnx versions
and the exporter, so a restarted agent or aggregator does not export again. Models from a
factory are not: their code may change under the same parameter shapes.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedmq import disk_cache
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec, build_model, load_vector, model_spec, to_vector

log = get_logger("fedmq.onnx_export")

EXPORTERS = ("auto", "dynamo", "legacy")
INPUT_NAME = "x"
OUTPUT_NAME = "logits"


@dataclass
class ExportInfo:
    """How an ONNX file came to be: `exporter` used, and whether a cached graph was reused."""

    exporter: str
    seconds: float
    reused_graph: bool
    bytes: int


_GRAPHS: dict[str, tuple[Any, str]] = {}
"""spec hash -> (onnx.ModelProto whose initializers hold every parameter by name, exporter)."""


def _disk_name(model_name: str, exporter: str) -> str | None:
    """Cache entry of a model's graph, named by what made it (model code, versions, exporter):
    zoo models (our code) and torchvision's (its version fixes the code; a MobileNetV3
    export costs ~14 s here, paid again at every restart of every process without this).
    None for models from a factory, whose code may change under the same shapes."""
    import onnx

    from fedmq import models

    reference = models.parse_reference(model_name) if models.is_reference(model_name) else None
    if model_name in models.ZOO:
        code: bytes | str = Path(models.__file__).read_bytes()
        stem = model_name
    elif reference is not None and reference.source == "torchvision":
        import torchvision

        code = f"torchvision {torchvision.__version__}"
        stem = "torchvision-" + reference.name
    else:
        return None
    made_by = disk_cache.digest(model_name, model_spec(model_name).hash, code, torch.__version__,
                                onnx.__version__, exporter)
    return f"{stem}-{exporter}-{made_by}.onnx"


def _load_cached(model_name: str, exporter: str, spec: ModelSpec) -> Any | None:
    import onnx

    name = _disk_name(model_name, exporter)
    payload = disk_cache.read("onnx", name) if name else None
    if payload is None:
        return None
    try:
        graph = onnx.load_from_string(payload)
        if holds_every_parameter(graph, spec):
            return graph
        error = "it does not hold every parameter by name"
    except Exception as exc:  # protobuf's errors are many
        error = f"{type(exc).__name__}: {exc}"
    event(log, "cache.refused", logging.WARNING, path=str(disk_cache.entry_path("onnx", name)), error=error)
    return None


def _store_cached(model_name: str, exporter: str, graph: Any) -> None:
    name = _disk_name(model_name, exporter)
    if name is not None:
        disk_cache.write("onnx", name, graph.SerializeToString())


def model_at(model_name: str, vector: torch.Tensor) -> torch.nn.Module:
    """The zoo model `model_name` holding `vector`, on the CPU, in eval mode."""
    return load_vector(build_model(model_name), vector.detach().float().cpu()).eval()


def _fresh_export(model_name: str, vector: torch.Tensor, exporter: str) -> Any:
    """A new onnx.ModelProto of this model with these weights (dynamic batch dimension)."""
    import onnx

    spec = model_spec(model_name)
    model = model_at(model_name, vector)
    example = torch.zeros(2, *spec.input_shape)
    if exporter == "dynamo":
        program = torch.onnx.export(
            # optimize=False: the optimizer folds batch norm into the convolutions, and the
            # graph would no longer hold every state tensor under its name (ONNX Runtime
            # fuses them itself when it loads the graph).
            model, (example,), None, dynamo=True, external_data=False, verbose=False, optimize=False,
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: torch.export.Dim("batch")},))  # by position: forward's argument may have any name
        return program.model_proto
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(model, (example,), buffer, dynamo=False, input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME],
                          dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
    return onnx.load_from_string(buffer.getvalue())


def holds_every_parameter(graph: Any, spec: ModelSpec) -> bool:
    """True if every parameter of `spec` is an initializer of `graph` by name and shape."""
    dims = {init.name: tuple(init.dims) for init in graph.graph.initializer}
    return all(dims.get(name) == tuple(shape) for name, shape in zip(spec.names, spec.shapes, strict=True))


def _with_weights(graph: Any, spec: ModelSpec, vector: torch.Tensor) -> Any:
    """A copy of `graph` whose parameter initializers hold `vector` (names and shapes checked)."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(graph)
    params = spec.unflatten(vector.detach().float().cpu())
    for init in out.graph.initializer:
        if init.name in params:
            init.CopyFrom(numpy_helper.from_array(params[init.name].numpy(), init.name))
    return out


def export_onnx(model_name: str, vector: torch.Tensor, exporter: str = "auto",
                reuse_graph: bool = True) -> tuple[bytes, ExportInfo]:
    """The serialized ONNX model of `vector`, one self-contained blob (weights inside)."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    spec = model_spec(model_name)
    if vector.ndim != 1 or vector.numel() != spec.numel:
        raise ValueError(f"{model_name} has {spec.numel} parameters, got a vector of shape {tuple(vector.shape)}")
    t0 = time.perf_counter()
    cached = _GRAPHS.get(spec.hash) if reuse_graph else None
    if cached is not None and (exporter == "auto" or cached[1] == exporter):
        blob = _with_weights(cached[0], spec, vector).SerializeToString()
        return blob, ExportInfo(cached[1], time.perf_counter() - t0, True, len(blob))
    order = ["dynamo", "legacy"] if exporter == "auto" else [exporter]
    if reuse_graph:
        for name in order:
            graph = _load_cached(model_name, name, spec)
            if graph is not None:
                _GRAPHS[spec.hash] = (graph, name)
                blob = _with_weights(graph, spec, vector).SerializeToString()
                return blob, ExportInfo(name, time.perf_counter() - t0, True, len(blob))
    errors = []
    for name in order:
        try:
            graph = _fresh_export(model_name, vector, name)
        except Exception as exc:  # the exporter's failure modes are many; try the next one
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            event(log, "onnx.export_failed", exporter=name, error=f"{type(exc).__name__}: {exc}")
            continue
        if reuse_graph and holds_every_parameter(graph, spec):
            _GRAPHS[spec.hash] = (graph, name)
            _store_cached(model_name, name, graph)
        blob = graph.SerializeToString()
        return blob, ExportInfo(name, time.perf_counter() - t0, False, len(blob))
    raise RuntimeError(f"ONNX export of {model_name} failed: " + "; ".join(errors))


def fleet_graph(model_name: str, exporter: str = "auto") -> tuple[bytes, ExportInfo]:
    """The ONNX graph an aggregator publishes for its fleet: the architecture without weights.

    Every parameter is a required graph input named as in the ModelSpec (float32, its spec
    shape) instead of an initializer, next to `x` (N, *input_shape) -> `logits` (N, classes).
    A device runs any model it receives by feeding the received vector, cut in spec order,
    as those inputs: no protobuf editing, and the file stays small (the weights travel in
    the replies anyway). RuntimeError if the export does not hold every parameter by name."""
    import onnx

    spec = model_spec(model_name)
    # Any weights do (their initializers are removed below), but not zeros: an exporter may
    # merge equal constants and lose parameter names.
    vector = to_vector(build_model(model_name, seed=0))
    blob, info = export_onnx(model_name, vector, exporter)
    graph = onnx.load_from_string(blob)
    if not holds_every_parameter(graph, spec):
        raise RuntimeError(f"the {info.exporter} export of {model_name} does not hold every "
                           "parameter under its name; its weights could not be fed")
    params = set(spec.names)
    kept = [init for init in graph.graph.initializer if init.name not in params]
    del graph.graph.initializer[:]
    graph.graph.initializer.extend(kept)
    declared = {i.name for i in graph.graph.input}
    for name, shape in zip(spec.names, spec.shapes, strict=True):
        if name not in declared:
            graph.graph.input.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(shape)))
    onnx.checker.check_model(graph)
    out = graph.SerializeToString()
    info.bytes = len(out)
    return out, info
