"""Durable aggregator state: checksummed snapshots plus a write-ahead journal.

The aggregator acknowledges an upload to the broker only after the upload's journal record
is on disk (fsync), so `kill -9` at any moment loses no acknowledged update: on restart the
newest snapshot is loaded and the journal after it is replayed. A record holds what replay
needs to redo the update bit-exactly (the decoded vector and the alpha that was used), so
replay does not depend on batch composition or thread count.

Files in the state dir, `N` a generation number:
    snapshot-N.msgpack   `FMQSNAP2 | sha256(body) | body`: the state at the start of
                         generation N (atomic: tmp, fsync, rename)
    journal-N.log        `FMQJRNL2` then records applied since, each
                         `u32 length | u32 crc32(body) | u32 crc32(length, crc) | body`

Damage is told apart from a crash. A crash mid-append leaves a *torn tail*: the last record
incomplete (its checksummed header says it runs past the end of the file, or fewer bytes
than a header remain, or zeros the file system never filled in). It was never acknowledged,
so it is cut off, with a warning. Anything else that fails a checksum is *damage*, which
may hold acknowledged updates: loading stops with `JournalCorrupt`, naming the file, the
byte offset and the record, and changes nothing. With `accept_loss` (the aggregator's
`--accept-journal-loss`) the damaged bytes are skipped (the records after them are found
again by their checksums), the loss is logged by file and byte range, a copy of each damaged
file is kept as `NAME.damaged`, and the caller starts a new generation at once, so nothing is
ever appended after damage. An unreadable newest snapshot falls back to the one before it
plus every later journal, which recovers the same state exactly.
Values are msgpack-native plus torch tensors, stored as dtype, shape and raw bytes (no pickle).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np
import torch

from fedmq.atomic_file import Content, keep_aside
from fedmq.atomic_file import atomic_write as write_atomically
from fedmq.errors import RuntimeFailure
from fedmq.logs import event, get_logger
from fedmq.state_dir import StateDirUnwritable, check_writable

log = get_logger("aggregator.journal")

JOURNAL_MAGIC = b"FMQJRNL\x02"
SNAPSHOT_MAGIC = b"FMQSNAP\x02"
_RECORD = struct.Struct("<III")  # length, crc32(body), crc32 of the first 8 header bytes
_TENSOR = "__tensor__"


class JournalError(OSError, RuntimeFailure):
    """The state dir cannot be written (disk full, read-only, permissions)."""


class JournalCorrupt(RuntimeFailure):
    """Durable state is damaged or does not fit: refuse to start over it (nothing is changed)."""


class DamagedFile(ValueError):
    """A snapshot that fails its checksum or does not parse; the message says how."""


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


def _tensor_from_map(obj: dict[str, Any]) -> Any:
    """msgpack's object_hook: a tensor's map becomes the tensor as soon as it is read, so its
    bytes are freed at once rather than held beside every tensor of the state."""
    if _TENSOR in obj:
        arr = np.frombuffer(obj["data"], dtype=np.dtype(obj[_TENSOR])).reshape(obj["shape"])
        return torch.from_numpy(arr.copy())
    return obj


def dumps(obj: Any) -> bytes:
    """The format's reference encoding: msgpack's own `packb` of the tree, each tensor a map of
    dtype, shape and raw bytes. The journal writes these same bytes streamed (`_stream_value`),
    never built whole; tests hold the two equal, and write damaged files with this one."""
    return msgpack.packb(_pack_value(obj), use_bin_type=True)


def loads(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False, object_hook=_tensor_from_map)


def atomic_write(path: Path, blob: Content) -> None:
    """Write `blob` (bytes, or a writer into the open file) to `path` so that a crash leaves
    either the old or the new file."""
    try:
        write_atomically(path, blob)
    except OSError as e:
        raise JournalError(e.errno, f"cannot write {path}: {e.strerror or e}") from e


def snapshot_bytes(state: Any) -> bytes:
    body = dumps(state)
    return SNAPSHOT_MAGIC + hashlib.sha256(body).digest() + body


def _bin_header(n: int) -> bytes:
    """msgpack's bin 8/16/32 header, as `packb(bytes, use_bin_type=True)` writes it."""
    if n < 1 << 8:
        return b"\xc4" + struct.pack(">B", n)
    if n < 1 << 16:
        return b"\xc5" + struct.pack(">H", n)
    return b"\xc6" + struct.pack(">I", n)


def _stream_value(obj: Any, write: Callable[[bytes | memoryview], None], packer: msgpack.Packer) -> None:
    """`dumps(obj)`'s bytes, in pieces: a tensor's values are written from its own memory."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        write(packer.pack_map_header(3) + packer.pack(_TENSOR) + packer.pack(str(t.dtype).removeprefix("torch."))
              + packer.pack("shape") + packer.pack(list(t.shape)) + packer.pack("data"))
        values = t.numpy().reshape(-1).view(np.uint8)
        write(_bin_header(values.nbytes))
        write(memoryview(values))
    elif isinstance(obj, dict):
        write(packer.pack_map_header(len(obj)))
        for k, v in obj.items():
            write(packer.pack(k))
            _stream_value(v, write, packer)
    elif isinstance(obj, (list, tuple)):
        write(packer.pack_array_header(len(obj)))
        for v in obj:
            _stream_value(v, write, packer)
    else:
        write(packer.pack(obj))


def snapshot_writer(state: Any) -> Callable[[BinaryIO], None]:
    """Writes `snapshot_bytes(state)` into an open file without building it in memory: the
    body streams out while it is hashed, then the digest goes into the header. A real-size
    fleet's state is hundreds of MB (two bases per agent: 12 MB for MobileNetV3-small), and
    built as bytes first it takes 3-4 copies at once (`python -m bench snapshot`)."""

    def write_into(f: BinaryIO) -> None:
        digest = hashlib.sha256()
        f.write(SNAPSHOT_MAGIC + bytes(digest.digest_size))

        def write(piece: bytes | memoryview) -> None:
            digest.update(piece)
            f.write(piece)

        _stream_value(state, write, msgpack.Packer(use_bin_type=True))
        f.seek(len(SNAPSHOT_MAGIC))
        f.write(digest.digest())

    return write_into


def read_snapshot(path: Path) -> dict[str, Any]:
    """A snapshot file's state; DamagedFile (or OSError) if it is not a whole, intact one."""
    head = len(SNAPSHOT_MAGIC) + 32
    with open(path, "rb") as f:
        header = f.read(head)
        if len(header) < head or not header.startswith(SNAPSHOT_MAGIC):
            raise DamagedFile("not a fedmq snapshot (bad header)")
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        if digest.digest() != header[len(SNAPSHOT_MAGIC):]:
            raise DamagedFile("checksum mismatch (damaged file)")
        # Read again, parsed as it streams in: memory holds the state, not the file beside it.
        f.seek(head)
        body_size = os.fstat(f.fileno()).st_size - head
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, object_hook=_tensor_from_map,
                                    max_buffer_size=max(body_size, 1 << 20))
        try:
            state = unpacker.unpack()
            extra = next(unpacker, unpacker) is not unpacker  # anything after the state
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData) as e:
            raise DamagedFile(f"does not parse ({type(e).__name__}: {e})") from None
        if extra:
            raise DamagedFile("does not parse (data after the state)")
    if not isinstance(state, dict):
        raise DamagedFile(f"holds a {type(state).__name__}, not a state")
    return state


def _frame(body: bytes) -> bytes:
    head = struct.pack("<II", len(body), zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def _frame_header(obj: Any) -> bytes:
    """`_frame(dumps(obj))`'s header, from a pass over the body's pieces that keeps none of them:
    a record then goes to the file as header plus `_stream_value`, never built as bytes (a
    MobileNetV3 upload's record is 12 MB: its vector and its trained reply)."""
    length, crc = 0, 0

    def count(piece: bytes | memoryview) -> None:
        nonlocal length, crc
        length += len(piece)
        crc = zlib.crc32(piece, crc)

    _stream_value(obj, count, msgpack.Packer(use_bin_type=True))
    head = struct.pack("<II", length, crc)
    return head + struct.pack("<I", zlib.crc32(head))


@dataclass
class JournalScan:
    """What one journal file holds: its intact records and what could not be read."""

    path: Path
    records: list[Any] = field(default_factory=list)
    good_end: int = 0
    """Where the torn tail starts (the file's size when there is none)."""
    torn_bytes: int = 0
    damage: list[tuple[int, int, int]] = field(default_factory=list)
    """(first byte, end byte, index of the next intact record) of each damaged stretch."""

    def describe_damage(self) -> str:
        spans = ", ".join(f"bytes {a}-{b} before record {i}" for a, b, i in self.damage)
        return f"{self.path.name}: {spans}"


def _frame_at(data: bytes, pos: int) -> tuple[str, int]:
    """('ok', length) for an intact record at pos; ('torn', 0) for an incomplete last one;
    ('damaged', 0) otherwise."""
    rest = len(data) - pos
    if rest < _RECORD.size:
        return "torn", 0  # a header cut short
    length, crc, head_crc = _RECORD.unpack_from(data, pos)
    if zlib.crc32(data[pos:pos + 8]) != head_crc:
        return "damaged", 0
    if _RECORD.size + length > rest:
        return "torn", 0  # the header is intact and says the body runs past the end
    body = data[pos + _RECORD.size:pos + _RECORD.size + length]
    return ("ok", length) if zlib.crc32(body) == crc else ("damaged", 0)


def scan_journal(path: Path, *, resync: bool = False) -> JournalScan:
    """Read a journal file without changing it; `resync` also reads past damage."""
    scan = JournalScan(Path(path))
    try:
        data = scan.path.read_bytes()
    except FileNotFoundError:
        return scan
    if not data:
        return scan  # created but never written (no header yet)
    pos = len(JOURNAL_MAGIC)
    if not data.startswith(JOURNAL_MAGIC):
        if len(data) < pos and JOURNAL_MAGIC.startswith(data):
            scan.torn_bytes = len(data)  # the header itself torn
            return scan
        if not resync:
            scan.damage.append((0, len(data), 0))
            return scan
        pos = 0
    while pos < len(data):
        kind, length = _frame_at(data, pos)
        if kind == "ok":
            scan.records.append(loads(data[pos + _RECORD.size:pos + _RECORD.size + length]))
            pos += _RECORD.size + length
            continue
        if kind == "torn" or data.count(0, pos) == len(data) - pos:
            break  # torn, or zeros the file system allocated but a crash never filled in
        start, nxt = pos, pos + 1
        while resync and nxt < len(data) and _frame_at(data, nxt)[0] != "ok":
            nxt += 1
        end = nxt if resync else len(data)
        scan.damage.append((start, end, len(scan.records)))
        if not resync:
            return scan
        pos = end
    scan.good_end = pos
    scan.torn_bytes = len(data) - pos
    return scan


class Journal:
    """Snapshots and the journal of one state dir; one writer (the aggregator's worker)."""

    def __init__(self, state_dir: str | os.PathLike[str], fsync: bool = True,
                 accept_loss: bool = False) -> None:
        self.dir = Path(state_dir)
        self.fsync = fsync
        self.accept_loss = accept_loss
        self.generation = 0
        self.records_since_snapshot = 0
        self.bytes_since_snapshot = 0
        """Journal bytes after the newest snapshot (with the magic), as on disk."""
        self.snapshot_size = 0
        """Bytes of the newest snapshot file (0 before the first)."""
        self.peak_bytes = 0
        """The most bytes this dir's snapshots and journals took since this object was made,
        measured after each append and while a new snapshot and the two generations before it
        were all on disk."""
        self.snapshot_file: Path | None = None
        """The snapshot the last `load` returned."""
        self.needs_snapshot = False
        """The last `load` skipped damage or fell back past a damaged snapshot: the caller
        must snapshot before appending, so that nothing is ever written after damage."""
        self._damaged: list[Path] = []
        self._file: Any = None

    def _snapshot_path(self, gen: int) -> Path:
        return self.dir / f"snapshot-{gen}.msgpack"

    def _journal_path(self, gen: int) -> Path:
        return self.dir / f"journal-{gen}.log"

    def _generations(self, pattern: str = "snapshot-*.msgpack") -> list[int]:
        gens = []
        for p in self.dir.glob(pattern):
            try:
                gens.append(int(p.name.split("-", 1)[1].split(".", 1)[0]))
            except ValueError:
                continue
        return sorted(gens)

    def check_writable(self) -> None:
        """JournalError now, not after minutes of set-up, when the state dir cannot be
        created or written (a file in the way, read-only, full)."""
        try:
            check_writable(self.dir)
        except StateDirUnwritable as e:
            raise JournalError(e.errno, e.strerror) from e.__cause__

    def has_state(self) -> bool:
        """Whether this dir holds a snapshot to resume from."""
        return self.dir.is_dir() and bool(self._generations())

    def load(self) -> tuple[Any | None, list[Any]]:
        """The newest intact snapshot (None for a new state dir) and the records after it.

        Raises JournalCorrupt, changing nothing, when acknowledged records cannot be read
        (unless `accept_loss`) or when no snapshot is readable."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(e.errno, f"cannot create state dir {self.dir}: {e.strerror}; "
                                        f"pass a writable --state-dir") from e
        self.needs_snapshot, self._damaged, self.snapshot_file = False, [], None
        problems: list[str] = []
        for gen in reversed(self._generations()):
            path = self._snapshot_path(gen)
            try:
                snapshot = read_snapshot(path)
            except (OSError, DamagedFile) as e:
                problems.append(f"{path.name}: {e}")
                continue  # fall back to the one before: it plus the later journals is the same state
            # Journals of later generations follow on from this one (their snapshots were
            # this state plus this journal), so a fallback replays them all in order.
            later = sorted(g for g in set(self._generations("journal-*.log")) if g > gen)
            records = self._read_journals([gen, *later])
            if problems:
                self.needs_snapshot = True
                self._damaged += [self._snapshot_path(g) for g in self._generations() if g > gen]
                event(log, "state.snapshot_damaged", level=logging.WARNING, damaged="; ".join(problems),
                      recovered_from=path.name, journals_replayed=len(later) + 1)
            self.snapshot_file = path
            self.generation = max([gen, *later])
            self.records_since_snapshot = len(records)
            self.snapshot_size = path.stat().st_size
            self.bytes_since_snapshot = sum(self._journal_path(g).stat().st_size for g in [gen, *later]
                                            if self._journal_path(g).exists())
            return snapshot, records
        if problems:
            raise JournalCorrupt(f"no readable snapshot in state dir {self.dir} ({'; '.join(problems)}); "
                                 f"nothing was changed: move it away to start afresh, or point --state-dir elsewhere")
        if self._generations("journal-*.log"):
            raise JournalCorrupt(f"state dir {self.dir} has journals but no snapshot; nothing was changed: "
                                 f"move it away to start afresh, or point --state-dir elsewhere")
        return None, []

    def _read_journals(self, gens: list[int]) -> list[Any]:
        scans = [scan_journal(self._journal_path(g), resync=self.accept_loss) for g in gens]
        damaged = [s for s in scans if s.damage]
        if damaged and not self.accept_loss:
            first = damaged[0]
            start, _, index = first.damage[0]
            raise JournalCorrupt(
                f"journal {first.path} is damaged at byte {start} (record {index}; the records from "
                f"there on may be acknowledged updates); nothing was changed. Restart with "
                f"--accept-journal-loss to skip the damaged bytes (a copy is kept as "
                f"{first.path.name}.damaged), or restore the state dir from a backup")
        for s in damaged:
            self._damaged.append(s.path)
            self.needs_snapshot = True
            event(log, "journal.records_lost", level=logging.ERROR, file=str(s.path),
                  damaged=s.describe_damage(), kept=len(s.records))
        for s in scans:
            if s.torn_bytes and not s.damage:
                # A crash mid-append: never acknowledged. Cut it so later appends follow
                # the last good record.
                event(log, "journal.torn_tail", level=logging.WARNING, file=str(s.path),
                      dropped_bytes=s.torn_bytes, kept=len(s.records))
                with open(s.path, "r+b") as f:
                    f.truncate(s.good_end)
        return [r for s in scans for r in s.records]

    def set_aside_damaged(self) -> None:
        """Keep a copy `NAME.damaged` of each damaged file the last load read past (call
        after the new snapshot is durable; the originals then age out with their generation)."""
        for path in self._damaged:
            aside = keep_aside(path)
            event(log, "state.damaged_kept", level=logging.WARNING, file=str(path), copy=str(aside))
        self._damaged = []
        self.needs_snapshot = False

    def append(self, records: list[Any]) -> None:
        """Append records and make them durable before returning (the ack point)."""
        if not records:
            return
        heads = [_frame_header(rec) for rec in records]  # a record that cannot be written fails here, before any byte
        try:
            if self._file is None:
                path = self._journal_path(self.generation)
                self._file = open(path, "ab")  # noqa: SIM115 (kept open across appends)
            start = self._file.tell()
            if start == 0:
                self._file.write(JOURNAL_MAGIC)
            packer = msgpack.Packer(use_bin_type=True)
            for head, rec in zip(heads, records, strict=True):
                self._file.write(head)
                _stream_value(rec, self._file.write, packer)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            end = self._file.tell()
        except OSError as e:
            self._close_file()
            raise JournalError(e.errno, f"cannot append to journal in {self.dir}: {e.strerror or e}") from e
        self.records_since_snapshot += len(records)
        self.bytes_since_snapshot += end - start
        self._measure()

    def snapshot(self, state: Any) -> None:
        """Write `state` as generation N+1 and start its empty journal; drop older files."""
        gen = self.generation + 1
        atomic_write(self._snapshot_path(gen), snapshot_writer(state))
        self._measure()
        self._close_file()
        old = self.generation
        self.generation = gen
        self.records_since_snapshot = self.bytes_since_snapshot = 0
        self.snapshot_size = self._snapshot_path(gen).stat().st_size
        for g in self._generations() + self._generations("journal-*.log"):
            if g < old:
                self._snapshot_path(g).unlink(missing_ok=True)
                self._journal_path(g).unlink(missing_ok=True)
        # Keep generation `old` one more round: a fallback if the new snapshot is unreadable.

    def _measure(self) -> None:
        files = [*self.dir.glob("snapshot-*.msgpack"), *self.dir.glob("journal-*.log")]
        self.peak_bytes = max(self.peak_bytes, sum(p.stat().st_size for p in files if p.exists()))

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()
