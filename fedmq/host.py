"""The machine a figure was measured on. Benchmarks and experiments record it beside their
numbers: speed differs between machines, and so does float rounding, which grows over a few
hundred training steps into a different experiment result for the same command (0.921 against
0.915 received accuracy in docs/results_cdfl.md#headline). A variant and its control are a
pair only when they were made on the same machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe_host() -> dict[str, Any]:
    """Python, CPU (model, count), platform, and torch's version, threads and CUDA device."""
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "cpu_model": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info
