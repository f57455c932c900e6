"""What the aggregator and its reply workers say to each other (docs/scaling.md).

A CDFL reply is the expensive part of an upload (an 8-epoch fine-tune on the proxy sets,
6.4 s of CPU on cnn28), and once its start is fixed it reads nothing but the proxy sets. So
the aggregator (the single writer of the cluster state and the journal) fixes each reply's
start, sends the job to a worker, and journals and answers the upload when the trained
vector comes back. Three messages, msgpack, on the fleet's `workers/` subtree:

- `fedmq/FLEET/workers/ID/status` (retained; `offline` is the last will): a worker is
  online with `slots` free job places and the `digest` of what it trains with;
- `fedmq/FLEET/workers/ID/jobs`: one job, `start` (float32) + alpha + seed;
- `fedmq/FLEET/workers/ID/done`: the trained vector, or why the job was refused.

The digest covers the model spec, every personalizer setting and the proxy data's bytes, so
a worker started with another config or data dir is never given a job: it would train
another reply than the one the writer would (the journal keeps what was sent either way).
Workers are trusted like the aggregator (its credentials, docs/scaling.md); every message is
still checked, and a malformed one is dropped with one log line, never applied.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
from torch import Tensor

from aggregator.evaluator import ProxyEvaluator
from aggregator.personalize import DistillPersonalizer, Personalizer

VERSION = 1
MAX_DIAG_KEYS = 16


class JobError(ValueError):
    """A worker message that cannot be used (the reason, one line)."""


def reply_digest(personalizer: Personalizer, evaluator: ProxyEvaluator) -> str:
    """What a reply depends on besides its job: the spec, the personalizer's settings and the
    proxy sets' bytes (sha256, 16 hex bytes)."""
    h = hashlib.sha256()
    h.update(evaluator.spec.hash.encode())
    settings = {"name": personalizer.name}
    if isinstance(personalizer, DistillPersonalizer):
        settings.update({k: getattr(personalizer, k) for k in (
            "epochs", "lr", "momentum", "batch_size", "kd_weight", "temperature", "rho", "samples",
            "min_steps", "tail_average", "layers")})
    h.update(repr(sorted(settings.items())).encode())
    for t in (evaluator.x, evaluator.y):
        h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    h.update(repr(list(evaluator.sizes)).encode())
    return h.hexdigest()[:32]


@dataclass
class WorkerStatus:
    worker: str
    state: str
    slots: int = 0
    digest: str = ""
    started_at: float = 0.0
    device: str = ""


@dataclass
class Job:
    job: str
    digest: str
    seed: int
    alpha: list[float]
    start: Tensor


@dataclass
class Done:
    job: str
    worker: str
    vector: Tensor | None = None
    error: str = ""
    diag: dict[str, Any] = field(default_factory=dict)


def _unpack(payload: bytes, limit: int) -> dict[str, Any]:
    if len(payload) > limit:
        raise JobError(f"{len(payload)} bytes, above the limit of {limit}")
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:
        raise JobError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise JobError(f"not a version {VERSION} worker message")
    return doc


def _text(doc: dict[str, Any], key: str, limit: int = 128) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise JobError(f"{key} must be a string of 1-{limit} characters")
    return value


def _vector(doc: dict[str, Any], key: str, numel: int) -> Tensor:
    raw = doc.get(key)
    if not isinstance(raw, bytes) or len(raw) != 4 * numel:
        raise JobError(f"{key} must be {numel} float32 values ({4 * numel} bytes)")
    values = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(values).all():
        raise JobError(f"{key} has non-finite values")
    return torch.from_numpy(values.copy())


def _f32(vector: Tensor) -> bytes:
    return vector.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()


def encode_status(s: WorkerStatus) -> bytes:
    return msgpack.packb({"v": VERSION, "worker": s.worker, "state": s.state, "slots": s.slots,
                          "digest": s.digest, "started_at": s.started_at, "device": s.device})


def decode_status(payload: bytes) -> WorkerStatus:
    doc = _unpack(payload, 4096)
    state = _text(doc, "state")
    if state not in ("online", "offline"):
        raise JobError(f"state must be online or offline, got {state!r}")
    slots = doc.get("slots", 0)
    if not isinstance(slots, int) or not 0 <= slots <= 64:
        raise JobError("slots must be an integer in [0, 64]")
    started = doc.get("started_at", 0.0)
    if not isinstance(started, (int, float)) or not math.isfinite(started):
        raise JobError("started_at must be a number")
    return WorkerStatus(worker=_text(doc, "worker"), state=state, slots=slots,
                        digest=str(doc.get("digest", ""))[:64], started_at=float(started),
                        device=str(doc.get("device", ""))[:32])


def encode_job(job: Job) -> bytes:
    return msgpack.packb({"v": VERSION, "job": job.job, "digest": job.digest, "seed": int(job.seed),
                          "alpha": [float(a) for a in job.alpha], "start": _f32(job.start)})


def decode_job(payload: bytes, numel: int, k: int) -> Job:
    doc = _unpack(payload, 4 * numel + 64 * 1024)
    alpha = doc.get("alpha")
    if (not isinstance(alpha, list) or len(alpha) != k
            or not all(isinstance(a, (int, float)) and math.isfinite(a) and a >= 0 for a in alpha)):
        raise JobError(f"alpha must be {k} finite non-negative numbers")
    seed = doc.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise JobError("seed must be an integer")
    return Job(job=_text(doc, "job"), digest=_text(doc, "digest", 64), seed=seed,
               alpha=[float(a) for a in alpha], start=_vector(doc, "start", numel))


def encode_done(done: Done) -> bytes:
    doc: dict[str, Any] = {"v": VERSION, "job": done.job, "worker": done.worker}
    if done.vector is not None:
        doc["vector"] = _f32(done.vector)
    if done.error:
        doc["error"] = done.error[:1024]
    doc["diag"] = {str(k): v for k, v in list(done.diag.items())[:MAX_DIAG_KEYS]
                   if isinstance(v, (int, float, str, bool))}
    return msgpack.packb(doc)


def decode_done(payload: bytes, numel: int) -> Done:
    doc = _unpack(payload, 4 * numel + 64 * 1024)
    job, worker = _text(doc, "job"), _text(doc, "worker")
    diag = doc.get("diag") or {}
    if not isinstance(diag, dict):
        raise JobError("diag must be a map")
    if "error" in doc:
        return Done(job=job, worker=worker, error=str(doc["error"])[:1024], diag=diag)
    return Done(job=job, worker=worker, vector=_vector(doc, "vector", numel), diag=diag)
