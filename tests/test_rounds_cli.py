"""A round fleet run entirely from the CLI, as a user runs it: `fedmq aggregator --algorithm
fedavg --min-agents 2` and two `fedmq agent --algorithm fedavg` processes against a real
Mosquitto, until the first round closed with both agents' updates in it.

The second agent starts only once the first has joined: round 1 inviting both shows that the
aggregator waited for --min-agents instead of starting with the first agent to arrive.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 120.0
FLEET = "rounds-cli"
# A round closes as soon as both report (catafed.close_early); T = 20 s only bounds a round
# whose report is lost, short enough for a test and long enough for a loaded CI machine.
ROUND = ("--set", "catafed.deadline_s=20")
# 100-200 samples per agent (default 500-2000): a round trains in well under a second.
AGENT_DATA = ("--set", "data.min_samples=100", "--set", "data.max_samples=200")


class Proc:
    """A `fedmq` subprocess whose output lines are read on a thread, for waiting on them."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self._new: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, "-m", "fedmq.cli", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)

    def wait_for(self, text: str, timeout_s: float = WAIT_S) -> str:
        """The first output line containing `text`; fails (showing the output) at the deadline
        or when the process ended without printing it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in list(self.lines):
                if text in line:
                    return line
            ended = self.proc.poll() is not None and self._new.empty()
            assert not ended and time.monotonic() < deadline, (
                f"no line with {text!r} (exit {self.proc.poll()}):\n" + "\n".join(self.lines))
            with contextlib.suppress(queue.Empty):
                self._new.get(timeout=1.0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.mark.slow
def test_fedavg_round_fleet_from_the_cli(mosquitto, tmp_path) -> None:
    common = ("--broker", mosquitto.url, "--fleet", FLEET)
    state = tmp_path / "agg"
    aggregator = Proc("aggregator", "--algorithm", "fedavg", "--min-agents", "2", *common,
                      "--state-dir", str(state), *ROUND)
    agents: list[Proc] = []
    try:
        aggregator.wait_for("waiting for 2 agents")
        for agent_id in ("car-1", "car-2"):
            agent = Proc("agent", "--algorithm", "fedavg", "--id", agent_id, *common, *AGENT_DATA)
            agents.append(agent)
            agent.wait_for(f"agent {agent_id} (fedavg, rounds)")
        line = aggregator.wait_for("round 1:")
        assert "invited 2, finished 2" in line and "all_reported" in line, \
            "\n".join([line] + [x for a in agents for x in a.lines])
        accuracy = float(line.rsplit("accuracy ", 1)[1])
        assert 0.0 <= accuracy <= 1.0
        for agent in agents:
            assert "trained" in agent.wait_for("round 1:")
        assert (state / "rounds.msgpack").exists()
        assert msgpack.unpackb((state / "rounds.msgpack").read_bytes(), raw=False)
    finally:
        codes = [p.stop() for p in (*agents, aggregator)]
    assert codes == [0, 0, 0], "\n".join(aggregator.lines + [x for a in agents for x in a.lines])


def test_round_settings_errors_are_one_line() -> None:
    # Both are refused before any connection: no broker needed.
    for args, expected in ((("--set", "catafed.prox_mu=0.1"), "set fedavg.prox_mu instead"),
                           (("--min-agents", "-1"), "catafed.min_agents must be >= 0, got -1")):
        done = subprocess.run([sys.executable, "-m", "fedmq.cli", "aggregator", "--algorithm",
                               "fedavg", "--broker", "mqtt://127.0.0.1:1", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=WAIT_S)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr
