"""A CLI process under test: its output collected line by line, waited on by event.

Tests that start `fedmq ...` as a user would need the same three things: start it with this
venv's `fedmq` on PATH, wait until a line proves something happened (never a fixed sleep;
CI may be busy), and stop it the way a user or a service manager does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment a user of this checkout has: its venv's `fedmq` and `python` first."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class CliProcess:
    """`argv` (a list, or a shell line run by bash) with stdout and stderr merged and kept."""

    def __init__(self, argv: Sequence[str] | str, *, cwd: Path, env: dict[str, str] | None = None,
                 prefix: Sequence[str] = (), default_sigint: bool = False) -> None:
        """`default_sigint`: start it with SIGINT's default action, as a terminal does, even where the
        suite itself was started as a background job (bash ignores SIGINT in those, and an ignored
        signal stays ignored across exec)."""
        command = ["bash", "-c", f"exec {argv}"] if isinstance(argv, str) else list(argv)
        self.argv = [*prefix, *command]
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(self.argv, cwd=cwd, env=env or cli_env(), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_default_sigint if default_sigint else None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 180.0) -> re.Match[str]:
        """The first output line matching `pattern` (re.search), waiting up to `timeout` s."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} from {' '.join(self.argv)} "
                                         f"(exit {self.proc.poll()}); output:\n{self.output[-4000:]}")
                self._changed.wait(min(left, 1.0))

    def wait(self, timeout: float = 600.0) -> int:
        """Wait for exit; a process still running after `timeout` s is killed and fails."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{' '.join(self.argv)} still running after {timeout:.0f} s; "
                                 f"output:\n{self.output[-4000:]}") from None
        self._reader.join(30)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Ask it to stop as a service manager does; kill it if it does not within `timeout`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(30)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def __enter__(self) -> CliProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
