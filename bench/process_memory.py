"""A process's memory as Linux reports it in /proc/PID/status, for the benchmarks."""

from __future__ import annotations


def status_mb(field: str = "VmRSS", pid: int | str = "self") -> float:
    """`field` (VmRSS: resident now, VmHWM: its peak) of process `pid` in MB; nan if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")
