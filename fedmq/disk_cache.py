"""Results worth keeping between processes: ONNX graphs, pre-trained clusters, the digits split.

Both are pure functions of their inputs and cost seconds to minutes to make again (a dynamo
export is most of an agent's start-up on a small device; pre-training on MNIST-sized proxy
sets takes minutes on a CPU), so a restarted agent or an aggregator on a fresh state dir
reuses them. Entries are named by a digest of everything that made them. Each file carries
the SHA-256 of its payload: one that does not match is named in a warning and made again
(a cache holds nothing acknowledged), and a directory that cannot be written only costs
the work. Where: $FEDMQ_CACHE_DIR, else $XDG_CACHE_HOME/fedmq, else ~/.cache/fedmq.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

from fedmq.config import user_cache_root
from fedmq.logs import event, get_logger

log = get_logger("fedmq.disk_cache")
MAGIC = b"fedmq-cache-1\n"


def cache_dir() -> Path:
    return Path(os.environ.get("FEDMQ_CACHE_DIR") or user_cache_root())


def digest(*parts: str | bytes) -> str:
    """A short name for what made an entry."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:24]


def entry_path(kind: str, name: str) -> Path:
    return cache_dir() / kind / name


def read(kind: str, name: str) -> bytes | None:
    """The payload kept under `kind/name`, or None (absent or damaged: then a warning names it)."""
    path = entry_path(kind, name)
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        event(log, "cache.refused", logging.WARNING, path=str(path), error=str(exc))
        return None
    head, payload = raw[:len(MAGIC) + 32], raw[len(MAGIC) + 32:]
    if head[:len(MAGIC)] != MAGIC or hashlib.sha256(payload).digest() != head[len(MAGIC):]:
        event(log, "cache.refused", logging.WARNING, path=str(path), error="checksum mismatch")
        return None
    return payload


def write(kind: str, name: str, payload: bytes) -> None:
    """Atomically (other processes may read the entry meanwhile); best effort."""
    path = entry_path(kind, name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError as exc:
        event(log, "cache.unwritable", path=str(path), error=str(exc))
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
