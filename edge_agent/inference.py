"""On-device inference: ONNX Runtime on an exported model, with a plain torch fallback.

    predictor = make_predictor("cnn28", vector, path=state_dir / "model.onnx")
    logits = predictor.predict(x)          # x: (N, C, H, W) float32 numpy

Export. A model is exported once per architecture; later models of the same spec only
swap the weights inside the cached ONNX graph. Both of torch's exporters name the graph's
initializers after the parameters (conv1.weight, ...) with the parameters' shapes, so a
new vector is written into them by name (shape-checked) in milliseconds, where a fresh
export costs 2-7 s with the dynamo exporter on this 2-core machine (0.01-0.08 s with the
legacy TorchScript one, which torch deprecates). If a graph does not hold every parameter
under its name, each model is exported afresh. The default exporter is dynamo
(`torch.onnx.export(..., dynamo=True, external_data=False)`: one self-contained file,
dynamic batch dimension); "legacy" is the fallback when dynamo fails, and "auto" means
exactly that order.

Runtime. CUDAExecutionProvider first when this onnxruntime build offers it, then CPU;
`intra_op_num_threads` bounds the CPU threads (1 by default: a device runs other things).
If onnxruntime is not importable or the export/session fails, `make_predictor` logs why
and returns a `TorchPredictor`.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedmq.atomic_file import atomic_write
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec, build_model, load_vector, model_spec

log = get_logger("edge_agent.inference")

EXPORTERS = ("auto", "dynamo", "legacy")
INPUT_NAME = "x"
OUTPUT_NAME = "logits"


class Predictor(Protocol):
    backend: str

    def predict(self, x: np.ndarray) -> np.ndarray: ...


def _as_batch(spec: ModelSpec, x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if x.ndim != 1 + len(spec.input_shape) or tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(f"{spec.arch} wants inputs (N, {', '.join(map(str, spec.input_shape))}), got {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _model_at(model_name: str, vector: torch.Tensor) -> torch.nn.Module:
    return load_vector(build_model(model_name), vector.detach().float().cpu()).eval()


class TorchPredictor:
    """The model in eager torch: the reference, and the fallback where ONNX Runtime is not."""

    backend = "torch"

    def __init__(self, model_name: str, vector: torch.Tensor, fallback_reason: str | None = None) -> None:
        self.model_name = model_name
        self.spec = model_spec(model_name)
        self.model = _model_at(model_name, vector)
        self.fallback_reason = fallback_reason

    @torch.inference_mode()
    def predict(self, x: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.model(torch.from_numpy(_as_batch(self.spec, x))).numpy()


@dataclass
class ExportInfo:
    """How an ONNX file came to be: `exporter` used, and whether a cached graph was reused."""

    exporter: str
    seconds: float
    reused_graph: bool
    bytes: int


_GRAPHS: dict[str, tuple[Any, str]] = {}
"""spec hash -> (onnx.ModelProto whose initializers hold every parameter by name, exporter)."""


def _fresh_export(model_name: str, vector: torch.Tensor, exporter: str) -> Any:
    """A new onnx.ModelProto of this model with these weights (dynamic batch dimension)."""
    import onnx

    spec = model_spec(model_name)
    model = _model_at(model_name, vector)
    example = torch.zeros(2, *spec.input_shape)
    if exporter == "dynamo":
        program = torch.onnx.export(
            model, (example,), None, dynamo=True, external_data=False, verbose=False,
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_shapes={INPUT_NAME: {0: torch.export.Dim("batch")}})
        return program.model_proto
    import io

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(model, (example,), buffer, dynamo=False, input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME],
                          dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
    return onnx.load_from_string(buffer.getvalue())


def _holds_every_parameter(graph: Any, spec: ModelSpec) -> bool:
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
    errors = []
    for name in order:
        try:
            graph = _fresh_export(model_name, vector, name)
        except Exception as exc:  # the exporter's failure modes are many; try the next one
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            event(log, "onnx.export_failed", exporter=name, error=f"{type(exc).__name__}: {exc}")
            continue
        if reuse_graph and _holds_every_parameter(graph, spec):
            _GRAPHS[spec.hash] = (graph, name)
        blob = graph.SerializeToString()
        return blob, ExportInfo(name, time.perf_counter() - t0, False, len(blob))
    raise RuntimeError(f"ONNX export of {model_name} failed: " + "; ".join(errors))


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never half."""
    atomic_write(path, data)


def choose_providers(available: list[str], prefer_cuda: bool = True) -> list[str]:
    """CUDA first when this onnxruntime build has it (and it is wanted), then CPU."""
    wanted = (["CUDAExecutionProvider"] if prefer_cuda else []) + ["CPUExecutionProvider"]
    chosen = [p for p in wanted if p in available]
    if not chosen:
        raise RuntimeError(f"onnxruntime offers none of {wanted}; it has {available}")
    return chosen


class OnnxPredictor:
    """A model exported to ONNX and run by an onnxruntime InferenceSession.

    `path`: where the .onnx file goes (the agent's state dir; written atomically) or None
    to keep it in memory. `export` tells how the file was made.
    """

    backend = "onnxruntime"

    def __init__(self, model_name: str, vector: torch.Tensor, *, path: str | os.PathLike[str] | None = None,
                 exporter: str = "auto", intra_op_num_threads: int = 1, prefer_cuda: bool = True) -> None:
        import onnxruntime as ort

        self.model_name = model_name
        self.spec = model_spec(model_name)
        blob, self.export = export_onnx(model_name, vector, exporter)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_num_threads
        options.inter_op_num_threads = 1
        providers = choose_providers(ort.get_available_providers(), prefer_cuda)
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            write_atomic(self.path, blob)
            self.session = ort.InferenceSession(str(self.path), options, providers=providers)
        else:
            self.session = ort.InferenceSession(blob, options, providers=providers)
        self.providers = self.session.get_providers()

    def predict(self, x: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.session.run([OUTPUT_NAME], {INPUT_NAME: _as_batch(self.spec, x)})[0]


def make_predictor(model_name: str, vector: torch.Tensor, prefer: str = "onnx", *,
                   path: str | os.PathLike[str] | None = None, exporter: str = "auto",
                   intra_op_num_threads: int = 1, prefer_cuda: bool = True) -> OnnxPredictor | TorchPredictor:
    """ONNX Runtime when asked for and possible, else torch (and a logged reason why)."""
    if prefer not in ("onnx", "torch"):
        raise ValueError(f"prefer must be 'onnx' or 'torch', got {prefer!r}")
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    if prefer == "torch":
        return TorchPredictor(model_name, vector)
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        reason = f"onnxruntime not importable: {exc}"
    else:
        try:
            return OnnxPredictor(model_name, vector, path=path, exporter=exporter,
                                 intra_op_num_threads=intra_op_num_threads, prefer_cuda=prefer_cuda)
        except Exception as exc:  # export or session creation: fall back, say why
            reason = f"ONNX path failed: {type(exc).__name__}: {exc}"
    event(log, "inference.fallback", level=30, model=model_name, backend="torch", reason=reason)
    return TorchPredictor(model_name, vector, fallback_reason=reason)
