"""On-device inference: ONNX Runtime on an exported model, with a plain torch fallback.

    predictor = make_predictor("cnn28", vector, path=state_dir / "model.onnx")
    logits = predictor.predict(x)          # x: (N, C, H, W) float32 numpy

Export: `fedmq.onnx_export` (in the kernel, shared with the aggregator's published graph);
a model is exported once per architecture and later models only swap its weights.

Runtime. CUDAExecutionProvider first when this onnxruntime build offers it, then CPU;
`intra_op_num_threads` bounds the CPU threads (1 by default: a device runs other things).
If onnxruntime is not importable or the export/session fails, `make_predictor` logs why
and returns a `TorchPredictor`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fedmq.atomic_file import atomic_write
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec, model_spec
from fedmq.onnx_export import (  # noqa: F401  (re-exported: the agent's inference API)
    EXPORTERS,
    INPUT_NAME,
    OUTPUT_NAME,
    ExportInfo,
    export_onnx,
    model_at,
)

log = get_logger("edge_agent.inference")


class Predictor(Protocol):
    backend: str

    def predict(self, x: np.ndarray) -> np.ndarray: ...


def _as_batch(spec: ModelSpec, x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if x.ndim != 1 + len(spec.input_shape) or tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(f"{spec.arch} wants inputs (N, {', '.join(map(str, spec.input_shape))}), got {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


class TorchPredictor:
    """The model in eager torch: the reference, and the fallback where ONNX Runtime is not."""

    backend = "torch"

    def __init__(self, model_name: str, vector: torch.Tensor, fallback_reason: str | None = None) -> None:
        self.model_name = model_name
        self.spec = model_spec(model_name)
        self.model = model_at(model_name, vector)
        self.fallback_reason = fallback_reason

    @torch.inference_mode()
    def predict(self, x: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.model(torch.from_numpy(_as_batch(self.spec, x))).numpy()


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
