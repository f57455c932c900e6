"""Durable aggregator state: snapshots plus a write-ahead journal.

The aggregator acknowledges an upload to the broker only after the upload's journal record
is on disk (fsync), so `kill -9` at any moment loses no acknowledged update: on restart the
newest snapshot is loaded and the journal after it is replayed. A record holds what replay
needs to redo the update bit-exactly (the decoded vector and the alpha that was used), so
replay does not depend on batch composition or thread count.

Files in the state dir, `N` a generation number:
    snapshot-N.msgpack   the state at the start of generation N (atomic: tmp, fsync, rename)
    journal-N.log        records applied since; each `u32 length | u32 crc32 | msgpack`
A torn record at the end of a journal (a crash mid-write, never acknowledged) is dropped.
Values are msgpack-native plus torch tensors, stored as dtype, shape and raw bytes (no pickle).
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from fedmq.atomic_file import atomic_write as write_atomically
from fedmq.errors import RuntimeFailure

_HEADER = struct.Struct("<II")
_TENSOR = "__tensor__"


class JournalError(OSError, RuntimeFailure):
    """The state dir cannot be written (disk full, read-only, permissions)."""


class JournalCorrupt(RuntimeFailure):
    """The state dir has snapshots but none can be read: refuse to start over them."""


def _pack_value(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {_TENSOR: str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": t.numpy().tobytes()}
    if isinstance(obj, dict):
        return {k: _pack_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack_value(v) for v in obj]
    return obj


def _unpack_value(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            arr = np.frombuffer(obj["data"], dtype=np.dtype(obj[_TENSOR])).reshape(obj["shape"])
            return torch.from_numpy(arr.copy())
        return {k: _unpack_value(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack_value(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    return msgpack.packb(_pack_value(obj), use_bin_type=True)


def loads(blob: bytes) -> Any:
    return _unpack_value(msgpack.unpackb(blob, raw=False, strict_map_key=False))


def atomic_write(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` so that a crash leaves either the old or the new file."""
    try:
        write_atomically(path, blob)
    except OSError as e:
        raise JournalError(e.errno, f"cannot write {path}: {e.strerror or e}") from e


class Journal:
    """Snapshots and the journal of one state dir; one writer (the aggregator's worker)."""

    def __init__(self, state_dir: str | os.PathLike[str], fsync: bool = True) -> None:
        self.dir = Path(state_dir)
        self.fsync = fsync
        self.generation = 0
        self.records_since_snapshot = 0
        self._file: Any = None

    def _snapshot_path(self, gen: int) -> Path:
        return self.dir / f"snapshot-{gen}.msgpack"

    def _journal_path(self, gen: int) -> Path:
        return self.dir / f"journal-{gen}.log"

    def _generations(self) -> list[int]:
        gens = []
        for p in self.dir.glob("snapshot-*.msgpack"):
            try:
                gens.append(int(p.stem.split("-", 1)[1]))
            except ValueError:
                continue
        return sorted(gens)

    def has_state(self) -> bool:
        """Whether this dir holds a snapshot to resume from."""
        return self.dir.is_dir() and bool(self._generations())

    def load(self) -> tuple[Any | None, list[Any]]:
        """The newest snapshot (None for a new state dir) and the records after it."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(e.errno, f"cannot create state dir {self.dir}: {e.strerror}; "
                                        f"pass a writable --state-dir") from e
        problems = []
        for gen in reversed(self._generations()):
            try:
                snapshot = loads(self._snapshot_path(gen).read_bytes())
                if not isinstance(snapshot, dict):
                    raise ValueError(f"a {type(snapshot).__name__}, not a snapshot")
            except (OSError, ValueError, msgpack.UnpackException) as e:
                problems.append(f"{self._snapshot_path(gen).name}: {e}")
                continue  # an unreadable snapshot: fall back to the one before
            # Journals of later generations follow on from this one (their snapshots were
            # this state plus this journal), so a fallback replays them all in order.
            later = [g for g in self._generations() if g > gen]
            records = []
            for g in [gen, *later]:
                records += self._read_records(self._journal_path(g))
            self.generation = max([gen, *later])
            self.records_since_snapshot = len(records)
            return snapshot, records
        if problems:
            raise JournalCorrupt(f"no readable snapshot in state dir {self.dir} ({'; '.join(problems)}); "
                                 f"move it away to start afresh, or point --state-dir elsewhere")
        return None, []

    def _read_records(self, path: Path) -> list[Any]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        records, pos = [], 0
        while pos + _HEADER.size <= len(data):
            length, crc = _HEADER.unpack_from(data, pos)
            body = data[pos + _HEADER.size : pos + _HEADER.size + length]
            if len(body) < length or zlib.crc32(body) != crc:
                break  # torn tail: written but never acknowledged
            records.append(loads(body))
            pos += _HEADER.size + length
        if pos != len(data):
            # Cut the torn tail so that later appends follow the last good record.
            with open(path, "r+b") as f:
                f.truncate(pos)
        return records

    def append(self, records: list[Any]) -> None:
        """Append records and make them durable before returning (the ack point)."""
        if not records:
            return
        blob = bytearray()
        for rec in records:
            body = dumps(rec)
            blob += _HEADER.pack(len(body), zlib.crc32(body)) + body
        try:
            if self._file is None:
                self._file = open(self._journal_path(self.generation), "ab")  # noqa: SIM115 (kept open across appends)
            self._file.write(blob)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError as e:
            self._close_file()
            raise JournalError(e.errno, f"cannot append to journal in {self.dir}: {e.strerror or e}") from e
        self.records_since_snapshot += len(records)

    def snapshot(self, state: Any) -> None:
        """Write `state` as generation N+1 and start its empty journal; drop older files."""
        gen = self.generation + 1
        atomic_write(self._snapshot_path(gen), dumps(state))
        self._close_file()
        old = self.generation
        self.generation = gen
        self.records_since_snapshot = 0
        for g in self._generations():
            if g < old:
                self._snapshot_path(g).unlink(missing_ok=True)
                self._journal_path(g).unlink(missing_ok=True)
        # Keep generation `old` one more round: a fallback if the new snapshot is unreadable.

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()
