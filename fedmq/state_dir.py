"""A role's durable state dir, checked and locked at start (aggregator and agent alike).

A state dir that is a file, read-only or full would otherwise fail on the first save, minutes
(or, for an agent, hours) into a run; two processes on one state dir would overwrite each
other's state. Both are said at start, as one line: `check_writable` (exit status 1) and
`StateDirLock` (exit status 1, naming the holder's pid).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from fedmq.errors import RuntimeFailure


class StateDirUnwritable(OSError, RuntimeFailure):
    """The state dir cannot be created or written (a file in the way, read-only, full)."""


class StateDirBusy(RuntimeFailure):
    """Another process holds the state dir (two writers of one state would overwrite each other)."""


def check_writable(state_dir: str | os.PathLike[str]) -> None:
    """Create `state_dir` if needed and write (and fsync) a probe file in it; StateDirUnwritable
    naming the dir and the reason if that fails."""
    path = Path(state_dir)
    if path.exists() and not path.is_dir():
        raise StateDirUnwritable(errno.ENOTDIR, f"cannot use state dir {path}: it is a file, not a directory; "
                                     f"pass another --state-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise StateDirUnwritable(e.errno, f"cannot write state dir {path}: {e.strerror or e}; "
                                          f"pass a writable --state-dir") from e


class StateDirLock:
    """An exclusive lock on a state dir for this process's lifetime (`flock` on `DIR/lock`,
    released by the kernel when the process dies, kill -9 included). `role` names the holder
    in the message a second process gets ("aggregator", "agent")."""

    def __init__(self, state_dir: str | os.PathLike[str], role: str = "aggregator") -> None:
        import fcntl

        self.path = Path(state_dir) / "lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise StateDirBusy(f"state dir {self.path.parent} is in use by another {role} (pid "
                               f"{holder}); stop it, or pass another --state-dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
