"""Crash-safe file writes: a reader (or a restart after kill -9) sees the old file or the
new one, never half of either.

The recipe is the usual one: write a temp file in the same directory, fsync it, rename it
over the target, fsync the directory so the rename itself is durable. Modes and group are
set on the temp file before any byte is written, so a secret is never briefly readable.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make renames and creations in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Content = bytes | Callable[[BinaryIO], None]
"""What a file is to hold: its bytes, or a writer that streams them into the open file (a
state of hundreds of MB is then never also held as one more copy in memory)."""


def write_temp(folder: Path, name: str, blob: Content, *, mode: int | None = None,
               gid: int | None = None) -> Path:
    """A fsynced temp file `.NAME.*.tmp` in `folder` holding `blob` (the caller renames it).

    `gid` changes the group (PermissionError when this process may not)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        if gid is not None:
            os.fchown(fd, -1, gid)
        with os.fdopen(fd, "wb") as f:
            if callable(blob):
                blob(f)
            else:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def atomic_write(path: str | os.PathLike[str], blob: Content, *, mode: int | None = None,
                 gid: int | None = None) -> None:
    """Replace `path` with `blob` atomically and durably (creating parent dirs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_temp(path.parent, path.name, blob, mode=mode, gid=gid)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def keep_aside(path: str | os.PathLike[str], *, move: bool = False) -> Path:
    """Keep a damaged file's bytes as `NAME.damaged` (`.damaged.2`, ... if taken) for a person
    to look at: a hard link (a copy where links fail) or, with `move`, the file itself, so
    that the original name can be written afresh without overwriting what was damaged."""
    path = Path(path)
    for n in range(1, 1000):
        aside = path.with_name(f"{path.name}.damaged" + (f".{n}" if n > 1 else ""))
        if aside.exists():
            continue
        if move:
            os.rename(path, aside)
        else:
            try:
                os.link(path, aside)
            except OSError:
                aside.write_bytes(path.read_bytes())
        fsync_dir(path.parent)
        return aside
    raise FileExistsError(f"too many damaged copies of {path} kept aside; clear them out")
