"""One agent per state dir, and by default one state dir per agent id: two agents started side
by side without --state-dir (as the README starts them) never share one, and a second agent on
a dir another holds exits at once with one line naming the holder's pid."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fedmq.broker import free_port
from tests.cli_process import BIN, CliProcess, cli_env


def test_a_second_agent_on_a_held_state_dir_exits_naming_the_holder(tmp_path: Path) -> None:
    # A local agent never connects: no broker is needed to hold its state dir.
    with CliProcess([str(BIN / "fedmq"), "agent", "--id", "van-1", "--algorithm", "local"], cwd=tmp_path) as first:
        first.wait_for(r"^agent van-1 \(local")
        assert (tmp_path / "state" / "agent-van-1" / "lock").read_text().split() == [str(first.proc.pid)]
        second = subprocess.run([str(BIN / "fedmq"), "agent", "--id", "van-1",
                                 "--broker", f"mqtt://127.0.0.1:{free_port()}"],
                                cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert second.returncode == 1, second.stderr
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert "state/agent-van-1" in lines[0] and "in use by another agent" in lines[0], lines[0]
        assert f"pid {first.proc.pid}" in lines[0], lines[0]
        # Another id gets a state dir of its own by default.
        other = subprocess.run([str(BIN / "fedmq"), "agent", "--id", "van-2", "--algorithm", "local",
                                "--max-steps", "1"], cwd=tmp_path, env=cli_env(), capture_output=True,
                               text=True, timeout=300)
        assert other.returncode == 0, other.stderr[-3000:]
        assert (tmp_path / "state" / "agent-van-2" / "agent_state.msgpack").exists()
        assert first.proc.poll() is None  # the holder was not disturbed
    assert first.proc.returncode == 0, first.output[-3000:]
