"""Ctrl-C during `fedmq sim run` says in one line what it kept, and what it kept is a report."""

from __future__ import annotations

import signal
import subprocess

import pytest

from fedmq.broker import find_mosquitto
from tests.cli_process import BIN, CliProcess


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_ctrl_c_between_runs_keeps_the_finished_run_and_says_so(tmp_path) -> None:
    out = tmp_path / "out"
    # One pre-training epoch, Local then CDFL: this is about stopping, not about what is learnt;
    # CDFL's run starts a broker and an aggregator, so it is still under way when the signal comes.
    argv = [str(BIN / "fedmq"), "sim", "run", "--methods", "local,cdfl", "--agents", "4",
            "--updates-per-agent", "1", "--set", "aggregator.pretrain_epochs=1", "--out", str(out)]
    run = CliProcess(argv, cwd=tmp_path, default_sigint=True)  # Ctrl-C reaches it, as in a terminal
    try:
        run.wait_for(r"^run 1/2 rotated-digits_K3_local_s0: ", timeout=600)
        run.stop(signal.SIGINT)  # what Ctrl-C sends the terminal's process group
    finally:
        run.stop(signal.SIGKILL)
    assert run.proc.returncode == 130, run.output[-3000:]
    said = [ln for ln in run.lines if "fedmq sim run:" in ln]
    assert len(said) == 1 and "Traceback" not in run.output, run.output[-3000:]
    assert f"kept the 1 finished run of 2 in {out}" in said[0] and "rotated-digits_K3_cdfl_s0 was under way" in said[0]
    assert [p.name for p in (out / "runs").iterdir()] == ["rotated-digits_K3_local_s0"]
    report = subprocess.run([str(BIN / "fedmq"), "sim", "report", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert report.returncode == 0 and "| Local |" in report.stdout, report.stderr[-2000:]
