"""The aggregator's snapshot at a real model's size: the memory it takes beyond the state it
writes, and the time, built in memory then written (`snapshot_bytes`) against streamed into
the file (`snapshot_writer`, what the journal does), and read back.

The state is shaped as `Engine.state_dict()`'s for CDFL at K = 4 with N agents: the clusters,
their average and the direction guard's K vectors, and per agent the two bases it may have
trained from (float32 each) and its last reply as sent (one byte a value, int8). Each figure is
measured in a fresh process: its peak resident memory (VmHWM, reset before the step) minus
what it held before.

    python -m bench snapshot
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.process_memory import status_mb

MODELS = {"cnn28": "cnn28", "mobilenet_v3_small": "torchvision:mobilenet_v3_small?input=3x32x32&num_classes=10"}
K = 4


def engine_shaped_state(numel: int, agents: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    vectors = lambda n: torch.randn(n, numel, generator=g)  # noqa: E731
    return {"strategy": {"clusters": vectors(K), "averaged": vectors(K), "agreement": {"directions": vectors(K)}},
            "agents": {f"agent-{i:05d}": {"base": vectors(1)[0], "base_epoch": 2 * i + 1,
                                          "earlier": {2 * i: vectors(1)[0]}, "last_reply": bytes(numel),
                                          "last_msg_id": "m", "recent": ["m"], "high_water": "m"}
                       for i in range(agents)},
            "counters": {"applied.update": agents}}


def _tensors_in(tree: Any) -> Any:
    """The whole parsed tree converted after parsing, as the reader before did."""
    from aggregator.journal import _tensor_from_map

    if isinstance(tree, dict):
        return _tensor_from_map({k: _tensors_in(v) for k, v in tree.items()})
    return [_tensors_in(v) for v in tree] if isinstance(tree, list) else tree


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident size (Linux >= 4.0)
        f.write("5")


def measure(model: str, agents: int, how: str) -> dict[str, float]:
    """One figure, in this process: `how` is written (bytes / streamed) or read (bytes / streamed)."""
    import hashlib

    import msgpack

    from aggregator.journal import (
        SNAPSHOT_MAGIC,
        atomic_write,
        read_snapshot,
        snapshot_bytes,
        snapshot_writer,
    )
    from fedmq.models import model_spec

    numel = model_spec(MODELS[model]).numel
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snapshot-1.msgpack"
        state = engine_shaped_state(numel, agents)
        state_mb = sum(t.numel() * 4 for t in (state["strategy"]["clusters"], state["strategy"]["averaged"],
                                                state["strategy"]["agreement"]["directions"])) / 1e6
        state_mb += agents * (2 * numel * 4 + numel) / 1e6
        if how.startswith("read"):
            atomic_write(path, snapshot_writer(state))
            del state
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # the freed state goes back: reading starts level
        before = status_mb("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        if how == "write, built in memory":
            atomic_write(path, snapshot_bytes(state))
        elif how == "write, streamed":
            atomic_write(path, snapshot_writer(state))
        elif how == "read, whole file":  # the reader before: the file's bytes, the body sliced out, parsed, converted
            blob = path.read_bytes()
            body = blob[len(SNAPSHOT_MAGIC) + 32:]
            assert hashlib.sha256(body).digest() == blob[len(SNAPSHOT_MAGIC):len(SNAPSHOT_MAGIC) + 32]
            loaded = _tensors_in(msgpack.unpackb(body, raw=False, strict_map_key=False))
        else:
            loaded = read_snapshot(path)
        seconds = time.perf_counter() - t0
        peak = status_mb("VmHWM")
        if how.startswith("read"):
            assert len(loaded["agents"]) == agents
        return {"state_mb": round(state_mb, 1), "file_mb": round(path.stat().st_size / 1e6, 1),
                "extra_peak_mb": round(peak - before, 1), "seconds": round(seconds, 2)}


HOWS = ("write, built in memory", "write, streamed", "read, whole file", "read, streamed")


def run(quick: bool = False) -> dict[str, Any]:
    cases = [("cnn28", 200), ("mobilenet_v3_small", 5 if quick else 20)] if quick else \
        [("cnn28", 1000), ("mobilenet_v3_small", 20), ("mobilenet_v3_small", 100)]
    rows = []
    for model, agents in cases:
        row: dict[str, Any] = {"model": model, "agents": agents}
        for how in HOWS:
            code = f"import json; from bench.bench_snapshot import measure; print(json.dumps(measure({model!r}, {agents}, {how!r})))"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).resolve().parent.parent)
            fig = json.loads(out.stdout.strip().splitlines()[-1])
            row.update(state_mb=fig["state_mb"], file_mb=fig["file_mb"])
            row[how] = {"extra_peak_mb": fig["extra_peak_mb"], "seconds": fig["seconds"]}
        row["write: extra memory, streamed / built"] = round(
            row["write, streamed"]["extra_peak_mb"] / max(row["write, built in memory"]["extra_peak_mb"], 1e-9), 3)
        row["read: extra memory, streamed / whole file"] = round(
            row["read, streamed"]["extra_peak_mb"] / max(row["read, whole file"]["extra_peak_mb"], 1e-9), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}
