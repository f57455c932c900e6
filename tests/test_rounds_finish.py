"""A round aggregator that has run its catafed.rounds says so in one closing line, exits 0 and
tells its agents, which say so and exit 0; a restart on the same state dir runs no more rounds
than catafed.rounds counts (docs/catafed.md). Real Mosquitto, the CLI as a user runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmq.broker import MosquittoBroker, find_mosquitto
from tests.cli_process import BIN, CliProcess

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
WAIT_S = 240.0
ROUNDS = ["--set", "catafed.rounds=2", "--set", "catafed.per_group=1", "--set", "catafed.groups=1",
          "--set", "catafed.deadline_s=5", "--set", "catafed.epochs=1", "--set", "data.min_samples=50",
          "--set", "data.max_samples=100"]


def test_a_finished_round_aggregator_says_so_and_its_agent_exits(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    fedmq = str(BIN / "fedmq")
    common = ["--broker", mosquitto.url, "--fleet", "depot", "--algorithm", "catafed", *ROUNDS]
    state = tmp_path / "rounds"
    aggregator = CliProcess([fedmq, "aggregator", *common, "--min-agents", "1", "--state-dir", str(state)],
                            cwd=tmp_path)
    with aggregator, CliProcess([fedmq, "agent", *common, "--id", "van-1"], cwd=tmp_path) as agent:
        aggregator.wait_for(r"^round 2: invited 1", WAIT_S)
        closing = aggregator.wait_for(r"^aggregator catafed: finished after (\d+) rounds", WAIT_S)
        assert closing.group(1) == "2" and "catafed.rounds = 2 done" in closing.string
        assert aggregator.wait(WAIT_S) == 0, aggregator.output[-3000:]
        agent.wait_for(r"^agent van-1: the aggregator finished after 2 rounds; stopping", WAIT_S)
        assert agent.wait(WAIT_S) == 0, agent.output[-3000:]
    # A restart on the finished state dir runs nothing more, says so and exits 0.
    with CliProcess([fedmq, "aggregator", *common, "--min-agents", "1", "--state-dir", str(state)],
                    cwd=tmp_path) as again:
        again.wait_for(r"^aggregator catafed: finished after 2 rounds", WAIT_S)
        assert again.wait(WAIT_S) == 0, again.output[-3000:]
        assert not any(line.startswith("round ") for line in again.lines), again.output
