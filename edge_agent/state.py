"""The agent's durable state: model, tau, pending upload, drift monitor, counters.

One file, `agent_state.msgpack`, in the agent's state dir (no pickle anywhere):

    {"format": "fedmq-agent-state", "version": 1, "sha256": <hex of body>, "body": <bin>}

`body` is a msgpack map of the fields, the model vector as raw little-endian float32
bytes. The checksum catches a torn or bit-flipped file that would still unpack.

Saving is atomic: the new file is written to a temporary name, fsynced, and renamed over
the old one (then the directory is fsynced), so a reader sees the old state or the new
one, never half. Before the rename the current file is hard-linked (copied where links
are not possible) to `agent_state.prev.msgpack`, so one older good copy exists.
`load` ignores leftover temporary files; if the current file is corrupt it logs that, moves
it aside as `agent_state.msgpack.damaged` (never overwritten) and falls back to the previous copy (one save older: at worst an upload is sent again, which
the aggregator dedupes by msg_id, or a model is re-downloaded); if both are bad it raises
`StateCorrupt` naming the files and what is wrong with each.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from fedmq import protocol
from fedmq.atomic_file import fsync_dir, keep_aside, write_temp
from fedmq.errors import RuntimeFailure
from fedmq.logs import event, get_logger
from fedmq.models import model_spec

log = get_logger("edge_agent.state")

STATE_FILE = "agent_state.msgpack"
PREVIOUS_FILE = "agent_state.prev.msgpack"
FORMAT = "fedmq-agent-state"
VERSION = 1


class StateCorrupt(RuntimeFailure):
    """No readable agent state although state files exist; the message names them."""


@dataclass
class PendingUpload:
    """An upload published but not yet acknowledged: sent again, byte for byte, after a restart."""

    msg_id: str
    payload: bytes
    created_at: float = 0.0


@dataclass
class AgentState:
    agent_id: str
    model_name: str
    spec_hash: str
    vector: torch.Tensor | None = None
    tau: int = -1
    """Epoch of the model last received (-1: none yet)."""
    pending: PendingUpload | None = None
    monitor: dict[str, Any] = field(default_factory=dict)
    """DriftMonitor.state_dict()."""
    counters: dict[str, int] = field(default_factory=dict)
    reference_accuracy: float | None = None
    saved_at: float = 0.0
    privacy: list[list[float]] = field(default_factory=list)
    """UplinkPrivacy.state_dict(): every DP release so far (the epsilon spent survives restarts)."""
    wire: torch.Tensor | None = None
    """With agent.keep_local_bn: the model as the aggregator's last reply decoded, which `vector`
    differs from in the agent's own batch norm; the base of the next deltas (None: `vector`)."""
    msg_id_floor: str = ""
    """protocol.msg_id_floor() when saved: after a restart the agent's msg_ids sort above
    every one it sent before, even if the clock went back (the aggregator needs them rising)."""

    def matches_zoo(self) -> bool:
        """True when the zoo still defines this model with the same spec (and the vector fits)."""
        try:
            spec = model_spec(self.model_name)
        except ValueError:
            return False
        return spec.hash == self.spec_hash and (self.vector is None or self.vector.numel() == spec.numel)

    # --- serialization -------------------------------------------------------------------

    def _body(self) -> bytes:
        vector, wire = (None if v is None else v.detach().to("cpu", torch.float32).contiguous().numpy()
                        .astype("<f4").tobytes() for v in (self.vector, self.wire))
        pending = None
        if self.pending is not None:
            pending = {"msg_id": self.pending.msg_id, "payload": bytes(self.pending.payload),
                       "created_at": self.pending.created_at}
        doc = {"agent_id": self.agent_id, "model_name": self.model_name, "spec_hash": self.spec_hash,
               "vector": vector, "tau": self.tau, "pending": pending, "monitor": self.monitor,
               "counters": self.counters, "reference_accuracy": self.reference_accuracy,
               "saved_at": self.saved_at, "msg_id_floor": self.msg_id_floor, "privacy": self.privacy}
        if wire is not None:  # only with agent.keep_local_bn: other agents' files stay as they were
            doc["wire"] = wire
        return msgpack.packb(doc, use_bin_type=True)

    @classmethod
    def _from_body(cls, body: bytes) -> AgentState:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=False)
        if not isinstance(doc, dict):
            raise ValueError("body is not a map")
        vector, wire = (_float32(doc.get(key), key) for key in ("vector", "wire"))
        if wire is not None and (vector is None or wire.shape != vector.shape):
            raise ValueError("wire does not fit vector")
        pending = None
        if doc["pending"] is not None:
            p = doc["pending"]
            pending = PendingUpload(str(p["msg_id"]), bytes(p["payload"]), float(p["created_at"]))
        ref = doc["reference_accuracy"]
        return cls(agent_id=str(doc["agent_id"]), model_name=str(doc["model_name"]),
                   spec_hash=str(doc["spec_hash"]), vector=vector, wire=wire, tau=int(doc["tau"]), pending=pending,
                   monitor=dict(doc["monitor"]), counters={str(k): int(v) for k, v in doc["counters"].items()},
                   reference_accuracy=None if ref is None else float(ref), saved_at=float(doc["saved_at"]),
                   msg_id_floor=str(doc.get("msg_id_floor", "")),
                   privacy=[[float(m), float(q), int(n)] for m, q, n in doc.get("privacy", [])])

    def to_bytes(self) -> bytes:
        body = self._body()
        return msgpack.packb({"format": FORMAT, "version": VERSION,
                              "sha256": hashlib.sha256(body).hexdigest(), "body": body}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, blob: bytes) -> AgentState:
        """Parse a state file's bytes; ValueError with the reason if anything is off."""
        try:
            outer = msgpack.unpackb(blob, raw=False)
        except Exception as exc:
            raise ValueError(f"not msgpack ({type(exc).__name__}: {exc})") from None
        if not isinstance(outer, dict) or outer.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if outer.get("version") != VERSION:
            raise ValueError(f"version {outer.get('version')!r}, this agent reads {VERSION}")
        body = outer.get("body")
        if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != outer.get("sha256"):
            raise ValueError("checksum mismatch (torn or damaged file)")
        try:
            return cls._from_body(body)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad fields ({type(exc).__name__}: {exc})") from None

    # --- files ---------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write atomically to `directory`/agent_state.msgpack, keeping the previous copy."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.saved_at = time.time()
        self.msg_id_floor = max(self.msg_id_floor, protocol.msg_id_floor())
        blob = self.to_bytes()
        current, previous = folder / STATE_FILE, folder / PREVIOUS_FILE
        tmp = write_temp(folder, STATE_FILE, blob)
        try:
            if current.exists():
                _keep_previous(current, previous)
            os.replace(tmp, current)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(folder)
        return current

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> AgentState | None:
        """The saved state, the previous copy if the current file is bad, None if there is none."""
        folder = Path(directory)
        problems: list[str] = []
        for name in (STATE_FILE, PREVIOUS_FILE):
            path = folder / name
            if not path.exists():
                continue
            try:
                state = cls.from_bytes(path.read_bytes())
            except (OSError, ValueError) as exc:
                problems.append((path, exc))
                continue
            for bad, exc in problems:  # logged here, not when both are bad: StateCorrupt says it all
                # Moved aside, so that the next save neither overwrites it nor makes it the
                # "previous" copy in place of the good one just read.
                aside = keep_aside(bad, move=True)
                event(log, "state.unreadable", level=logging.WARNING, file=str(bad), reason=str(exc),
                      kept_as=str(aside))
            if problems:
                event(log, "state.fallback_to_previous", level=logging.WARNING, file=str(path))
            return state
        if problems:
            raise StateCorrupt("no readable agent state: " + "; ".join(f"{p}: {e}" for p, e in problems)
                               + f". Move {folder} away to start afresh (the agent will rejoin).")
        return None


def _keep_previous(current: Path, previous: Path) -> None:
    """previous := current, atomically (a hard link where possible, else a synced copy)."""
    staging = previous.with_name(f".{previous.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    try:
        os.link(current, staging)
    except OSError:
        shutil.copyfile(current, staging)
        with open(staging, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(staging, previous)


def _float32(raw: object, key: str) -> torch.Tensor | None:
    """A vector field of the body: raw little-endian float32 bytes, or None."""
    if raw is None:
        return None
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise ValueError(f"{key} is not float32 bytes")
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32))
