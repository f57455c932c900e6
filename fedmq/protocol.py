"""Wire protocol v1: topics, envelopes, strict decoding and chunking, in one place.

Everything that crosses the broker is defined here, so the aggregator, the edge agent, the
simulator and a device written in another language all read the same rules (docs/protocol.md
is the reference for the latter). Three decisions shape the module:

- Strict in v1. A received payload is checked completely (size, msgpack limits, version,
  type, every field's type and range, no unknown or missing keys) before an envelope object
  exists, and every failure is a `ProtocolError` with a stable `reason` code that can go
  straight into an `Error` reply. Loosening later is compatible; tightening is not.
- Declarative schema. Each envelope is a frozen dataclass whose fields carry their wire rule
  (`Annotated[int, NonNegInt]`); the decoder is a loop over that table, so adding a field is
  one line and encoder and decoder cannot drift apart.
- Chunking below the protocol. A payload above the chunk size travels as `Chunk` envelopes
  that the receiver's `Reassembler` puts back together (bounded memory, timeout, sha256)
  before the whole payload is decoded like any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import secrets
import threading
import time
import typing
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import msgpack

PROTOCOL_VERSION = 1
TOPIC_ROOT = "fedmq"

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_TENSOR_N = 2**31 - 1
"""Most elements one encoded tensor may declare."""
MAX_CHUNKS = 65_536
"""Most pieces one chunked message may declare (bounds per-message bookkeeping)."""
MAX_STR_BYTES = 64 * 1024
"""msgpack-level cap on any one string; field rules are tighter (in characters)."""
MAX_CONTAINER_LEN = 1024
"""msgpack-level cap on any one array or map; field rules are tighter."""
CHUNK_OVERHEAD_BYTES = 1024
"""Upper bound on a `Chunk` envelope's size beyond its data: a receiver decodes a single MQTT
message with `max_bytes = chunk_bytes + CHUNK_OVERHEAD_BYTES`."""

REASONS: dict[str, str] = {
    "malformed": "not one well-formed msgpack map within the decoder's limits",
    "too_large": "payload or declared message size above the limit",
    "bad_version": "`v` missing or not a version this side speaks",
    "unknown_type": "`type` missing or not an envelope type",
    "missing_field": "a required field is absent",
    "unknown_field": "a field this version does not define",
    "bad_field": "a field has the wrong type, length or range",
    "bad_id": "a fleet or agent id outside [A-Za-z0-9_.-]{1,64}",
    "bad_topic": "a topic outside the fedmq/{fleet}/... tree",
    "wrong_topic": "an envelope type that does not belong on this topic",
    "agent_mismatch": "the envelope's agent is not the topic's agent",
    "chunk_inconsistent": "a piece contradicts the others (count, size, hash, content)",
    "chunk_corrupt": "the reassembled payload does not match its sha256",
    "chunk_overflow": "too much partially reassembled data is pending",
    "chunk_timeout": "a partial message saw no new piece within the timeout",
}
"""Every `ProtocolError.reason` this module raises or reports, with its meaning."""


class ProtocolError(ValueError):
    """Anything wrong with a topic, envelope or chunk. `reason` is a stable short code (a key
    of `REASONS`) fit for an `Error` reply; `message` says what exactly was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def _show(value: object) -> str:
    """A short, safe description of a hostile value for error messages: never the repr of a
    container (could be huge or deeply nested), at most 40 characters of a string."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
        return text if len(text) <= 40 else f"{type(value).__name__} {text[:20]}..."
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} chars)"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{type(value).__name__}[{len(value)}]"
    if isinstance(value, list | tuple | dict):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# ------------------------------------------------------------------------------------- ids


_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def validate_id(value: object, what: str = "id") -> str:
    """Return `value` if it can be a fleet or agent id: one whole MQTT topic level, so that
    ACL patterns (`%u`, `%c`) bind an agent to its own subtree. `.` and `..` are refused too:
    ids also become directory names on devices and in checkpoints."""
    if (
        not isinstance(value, str)
        or not _ID_PATTERN.fullmatch(value)
        or value in (".", "..")
    ):
        raise ProtocolError("bad_id", f"{what} must match [A-Za-z0-9_.-]{{1,64}}, got {_show(value)}")
    return value


# ---------------------------------------------------------------------------------- topics

TopicKind = Literal["up", "down", "status", "aggregator_status"]
_AGENT_KINDS = ("up", "down", "status")


@dataclass(frozen=True)
class Topic:
    """A parsed fedmq topic; `agent` is None for the aggregator's status topic."""

    fleet: str
    kind: TopicKind
    agent: str | None = None

    def __str__(self) -> str:
        if self.kind == "aggregator_status":
            return aggregator_status(self.fleet)
        if self.kind not in _AGENT_KINDS or self.agent is None:
            raise ProtocolError("bad_topic", f"no topic of kind {self.kind!r} for agent {self.agent!r}")
        fleet, agent = validate_id(self.fleet, "fleet"), validate_id(self.agent, "agent")
        return f"{TOPIC_ROOT}/{fleet}/agents/{agent}/{self.kind}"


def uplink(fleet: str, agent: str) -> str:
    """Agent -> aggregator: join, update, report (and their chunks)."""
    return str(Topic(fleet, "up", agent))


def downlink(fleet: str, agent: str) -> str:
    """Aggregator -> one agent: model, round invite, error, ack (and their chunks)."""
    return str(Topic(fleet, "down", agent))


def agent_status(fleet: str, agent: str) -> str:
    """Retained online/offline of one agent (offline is its last will)."""
    return str(Topic(fleet, "status", agent))


def agent_client_id(fleet: str, agent: str) -> str:
    """An agent's MQTT client id: fleet and agent, so that two fleets on one broker whose agents
    share a name keep a session each (a broker drops the older of two clients with one id)."""
    return f"fedmq-agent-{validate_id(fleet, 'fleet')}-{validate_id(agent, 'agent')}"


def aggregator_status(fleet: str) -> str:
    """Retained online/offline of the aggregator (offline is its last will)."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/aggregator/status"


def model_graph(fleet: str) -> str:
    """Retained ONNX file of the fleet's model architecture (raw bytes, not an envelope), for
    devices that do not run Python; the aggregator's status names it (`graph.topic`)."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/model/onnx"


def device_spec(fleet: str) -> str:
    """Retained device spec beside the graph (fedmq/device_spec.py: msgpack, not an envelope):
    input normalization, label names, head cut and the sketch's feature map; the aggregator's
    status names its hash (`graph.device_spec`)."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/model/device"


def device_spec_piece(fleet: str, index: int) -> str:
    """Retained piece `index` of the device spec's feature map (fedmq/device_spec.py)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ProtocolError("bad_topic", f"a piece index is an int >= 0, got {index!r}")
    return f"{device_spec(fleet)}/{index}"


def all_uplinks(fleet: str) -> str:
    """What the aggregator subscribes to for every agent's uploads."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/agents/+/up"


def all_agent_status(fleet: str) -> str:
    """What the aggregator subscribes to for every agent's presence."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/agents/+/status"



def worker_status(fleet: str, worker: str) -> str:
    """Retained presence of one reply worker (offline is its last will); aggregator/reply_jobs.py."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/workers/{validate_id(worker, 'worker')}/status"


def worker_jobs(fleet: str, worker: str) -> str:
    """Aggregator -> one reply worker: the replies it is asked to train."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/workers/{validate_id(worker, 'worker')}/jobs"


def worker_done(fleet: str, worker: str) -> str:
    """Reply worker -> aggregator: trained replies (or why a job was refused)."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/workers/{validate_id(worker, 'worker')}/done"


def all_workers(fleet: str, kind: str) -> str:
    """What the aggregator subscribes to for every worker's `status` or `done`."""
    return f"{TOPIC_ROOT}/{validate_id(fleet, 'fleet')}/workers/+/{kind}"


def parse_topic(topic: object) -> Topic:
    """The `Topic` a concrete (wildcard-free) fedmq topic names; ProtocolError("bad_topic")
    for anything else."""
    if not isinstance(topic, str):
        raise ProtocolError("bad_topic", f"topic must be a str, got {_show(topic)}")
    parts = topic.split("/")
    try:
        if len(parts) == 5 and parts[0] == TOPIC_ROOT and parts[2] == "agents" \
                and parts[4] in _AGENT_KINDS:
            return Topic(validate_id(parts[1], "fleet"), parts[4],  # type: ignore[arg-type]
                         validate_id(parts[3], "agent"))
        if len(parts) == 4 and parts[0] == TOPIC_ROOT and parts[2:] == ["aggregator", "status"]:
            return Topic(validate_id(parts[1], "fleet"), "aggregator_status")
    except ProtocolError as e:
        raise ProtocolError("bad_topic", f"{_show(topic)}: {e.message}") from None
    raise ProtocolError("bad_topic", f"{_show(topic)} is not a fedmq v{PROTOCOL_VERSION} topic")


# ----------------------------------------------------------------------------- field rules


class Rule:
    """One field's wire rule: `check` returns the (normalized) value or raises bad_field."""

    def check(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    @staticmethod
    def fail(where: str, expected: str, value: object) -> typing.NoReturn:
        raise ProtocolError("bad_field", f"{where}: expected {expected}, got {_show(value)}")


@dataclass(frozen=True)
class IntRule(Rule):
    """A msgpack int (never a bool, never a float) in [lo, hi]."""

    lo: int = INT64_MIN
    hi: int = INT64_MAX

    def check(self, value: Any, where: str) -> int:
        if type(value) is not int or not self.lo <= value <= self.hi:
            self.fail(where, f"int in [{self.lo}, {self.hi}]", value)
        return value


@dataclass(frozen=True)
class NumRule(Rule):
    """A finite number in [lo, hi]; a msgpack int is accepted (many encoders write 30.0 as
    30) and normalized to float, a bool is not."""

    lo: float = -math.inf
    hi: float = math.inf

    def check(self, value: Any, where: str) -> float:
        if type(value) is int and INT64_MIN <= value <= INT64_MAX:
            value = float(value)
        if type(value) is not float or not math.isfinite(value) or not self.lo <= value <= self.hi:
            self.fail(where, f"finite number in [{self.lo}, {self.hi}]", value)
        return value


@dataclass(frozen=True)
class BoolRule(Rule):
    def check(self, value: Any, where: str) -> bool:
        if type(value) is not bool:
            self.fail(where, "bool", value)
        return value


@dataclass(frozen=True)
class StrRule(Rule):
    """A str of lo..hi characters, optionally one of `choices` or matching `pattern`."""

    lo: int = 0
    hi: int = 256
    pattern: str | None = None
    choices: tuple[str, ...] = ()

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str or not self.lo <= len(value) <= self.hi:
            self.fail(where, f"str of {self.lo}..{self.hi} chars", value)
        if self.choices and value not in self.choices:
            self.fail(where, f"one of {list(self.choices)}", value)
        if self.pattern is not None and value and not re.fullmatch(self.pattern, value):
            self.fail(where, f"str matching {self.pattern}", value)
        return value


@dataclass(frozen=True)
class BytesRule(Rule):
    """msgpack bin (bytes) of lo..hi bytes; hi None leaves it to the decoder's max_bytes."""

    lo: int = 0
    hi: int | None = None

    def check(self, value: Any, where: str) -> bytes:
        if type(value) is not bytes or len(value) < self.lo or (
            self.hi is not None and len(value) > self.hi
        ):
            self.fail(where, f"bytes of {self.lo}..{self.hi if self.hi is not None else ''}", value)
        return value


@dataclass(frozen=True)
class OptionalRule(Rule):
    """nil, or whatever `inner` accepts."""

    inner: Rule

    def check(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)


@dataclass(frozen=True)
class ListRule(Rule):
    """An array of lo..hi items, each checked by `item`."""

    item: Rule
    lo: int = 0
    hi: int = 64

    def check(self, value: Any, where: str) -> list[Any]:
        if type(value) is not list or not self.lo <= len(value) <= self.hi:
            self.fail(where, f"array of {self.lo}..{self.hi} items", value)
        return [self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class MapRule(Rule):
    """A map of at most `hi` entries with str keys checked by `key` and values by `value`."""

    key: StrRule
    value: Rule
    hi: int = 64

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict or len(value) > self.hi:
            self.fail(where, f"map of at most {self.hi} entries", value)
        out: dict[str, Any] = {}
        for k, v in value.items():
            key = self.key.check(k, f"{where} key")
            out[key] = self.value.check(v, f"{where}[{key!r}]")
        return out


@dataclass(frozen=True)
class AnyOfRule(Rule):
    """The first of `rules` whose Python type matches the value decides."""

    rules: tuple[tuple[type, Rule], ...]
    expected: str

    def check(self, value: Any, where: str) -> Any:
        for tp, rule in self.rules:
            if type(value) is tp:
                return rule.check(value, where)
        self.fail(where, self.expected, value)


# Reusable rules: the vocabulary the envelope tables below are written in.
Token = r"[!-~]+"  # printable ASCII without space: safe in logs and file names of records
AgentId = StrRule(1, 64, pattern=_ID_PATTERN.pattern)
MsgId = StrRule(1, 64, pattern=Token)
ReplyTo = StrRule(0, 64, pattern=Token)
SpecHash = StrRule(1, 64, pattern=Token)
OptSpecHash = StrRule(0, 64, pattern=Token)
Name = StrRule(1, 64, pattern=Token)
OptName = StrRule(0, 64, pattern=Token)
MAX_MODEL_NAME = 512
"""Longest canonical model name (a reference with its arguments: `torchvision:NAME?k=v&...`)."""
ModelName = StrRule(0, MAX_MODEL_NAME, pattern=Token)
NonNegInt = IntRule(0, INT64_MAX)
SentAt = NumRule(0.0)
MAX_SKETCH = 4096
"""Most values in an update's data sketch."""
Alpha = OptionalRule(ListRule(NumRule(0.0), 1, 64))
Metrics = MapRule(StrRule(1, 64), NumRule(), 64)
Counters = MapRule(
    StrRule(1, 64),
    AnyOfRule(((int, IntRule()), (float, NumRule()), (str, StrRule(0, 256))), "int, float or str"),
    64,
)
Settings = MapRule(
    StrRule(1, 32),
    AnyOfRule(((bool, BoolRule()), (int, IntRule()), (float, NumRule()), (str, StrRule(0, 256))),
              "bool, int, float or str"),
    32,
)
"""A flat map of named settings (the aggregator status's `codec` and `graph`)."""


_TENSOR_KEYS: dict[str, Rule] = {
    "codec": StrRule(1, 16),
    "n": IntRule(1, MAX_TENSOR_N),
    "data": BytesRule(),
}
_EXTRA_KEY = StrRule(1, 32)
_SCALAR = AnyOfRule(
    (
        (type(None), OptionalRule(BoolRule())),  # nil passes OptionalRule as None
        (bool, BoolRule()),
        (int, IntRule()),
        (float, NumRule()),
        (str, StrRule(0, 256)),
        (bytes, BytesRule()),
    ),
    "a scalar (nil, bool, int, float, str, bytes)",
)


@dataclass(frozen=True)
class TensorMapRule(Rule):
    """The outer shape of an encoded tensor map (fedmq/codecs.py owns what is inside):
    `codec` (str 1..16), `n` (element count), `data` (bytes), plus at most `max_extra`
    codec-specific keys whose values are scalars (nil, bool, int, float, str, bytes)."""

    max_extra: int = 16

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict or len(value) > len(_TENSOR_KEYS) + self.max_extra:
            self.fail(where, f"tensor map of at most {len(_TENSOR_KEYS) + self.max_extra} keys",
                      value)
        missing = [k for k in _TENSOR_KEYS if k not in value]
        if missing:
            raise ProtocolError("missing_field", f"{where}: tensor map lacks {missing}")
        out: dict[str, Any] = {}
        for k, v in value.items():
            rule = _TENSOR_KEYS.get(k) if type(k) is str else None
            if rule is None:
                key = _EXTRA_KEY.check(k, f"{where} key")
                out[key] = _SCALAR.check(v, f"{where}[{key!r}]")
            else:
                out[k] = rule.check(v, f"{where}[{k!r}]")
        return out


Tensor = TensorMapRule()


# ------------------------------------------------------------------------------- envelopes


def now() -> float:
    """Wall-clock seconds for `sent_at` (comparable across machines, unlike monotonic)."""
    return time.time()


_last_micros = 0
_ids_lock = threading.Lock()


def new_msg_id() -> str:
    """A unique id that sorts after every id this process made or was told of
    (`msg_ids_after`): 32 hex chars, microseconds since the epoch (never going back, even if
    the clock does), then 72 random bits. The aggregator applies an agent's msg_id only if it
    is above the highest it applied from that agent (protocol.md)."""
    global _last_micros
    with _ids_lock:
        _last_micros = max(time.time_ns() // 1000, _last_micros + 1)
        micros = _last_micros
    return f"{micros:014x}{secrets.token_hex(9)}"


def msg_ids_after(msg_id: str) -> None:
    """Make later `new_msg_id()`s sort after `msg_id` (one this agent sent before a restart,
    perhaps under a clock that was ahead); ids not made by `new_msg_id` are ignored."""
    global _last_micros
    try:
        micros = int(msg_id[:14], 16) if len(msg_id) == 32 else 0
    except ValueError:
        return
    with _ids_lock:
        _last_micros = max(_last_micros, micros)


def msg_id_floor() -> str:
    """An id at or above every one `new_msg_id` has made: persist it, pass it to
    `msg_ids_after` on the next start."""
    with _ids_lock:
        return f"{_last_micros:014x}{'0' * 18}"


@dataclass(frozen=True)
class Envelope:
    """Fields every envelope carries. `agent` is always the agent the exchange is about (the
    topic's agent): the sender on `up`, the addressee on `down`."""

    TYPE: ClassVar[str] = ""
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset()
    """Fields added after v1 shipped: left off the wire while at their default, so a receiver
    that predates them still reads what it always read (v1 refuses unknown keys)."""

    agent: Annotated[str, AgentId]
    msg_id: Annotated[str, MsgId]
    sent_at: Annotated[float, SentAt]

    def cross_check(self) -> None:
        """Constraints between fields; per-field rules live in the annotations."""


@dataclass(frozen=True)
class Join(Envelope):
    """An agent announces itself: which model (spec hash) and algorithm it runs."""

    TYPE: ClassVar[str] = "join"

    model: Annotated[str, SpecHash]
    algorithm: Annotated[str, Name]
    profile: Annotated[str, OptName] = ""
    n_samples: Annotated[int, NonNegInt] = 0


@dataclass(frozen=True)
class Update(Envelope):
    """A locally trained model: `tensor` encodes it (or its delta), `tau` is the epoch of the
    model it started from; FedSoft-Async adds the agent's own `alpha`. `sketch` (optional,
    little-endian float16) describes the training data for CDFL's mixture estimate, made by
    the feature map `sketch_method` (fedmq/sketch.py); `noised` says the model was trained with DP-SGD."""

    TYPE: ClassVar[str] = "update"
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"noised"})
    """An upload without DP is the same bytes as before the field existed."""

    model: Annotated[str, SpecHash]
    tau: Annotated[int, NonNegInt]
    tensor: Annotated[dict[str, Any], Tensor]
    n_samples: Annotated[int, NonNegInt]
    alpha: Annotated[list[float] | None, Alpha] = None
    metrics: Annotated[dict[str, float], Metrics] = field(default_factory=dict)
    sketch: Annotated[bytes | None, OptionalRule(BytesRule(2, 2 * MAX_SKETCH))] = None
    sketch_method: Annotated[str, StrRule(0, 64)] = ""
    noised: Annotated[bool, BoolRule()] = False
    """Trained with DP-SGD (privacy.epsilon): CDFL then pulls its clusters toward the upload
    instead of adding its noisy step (docs/privacy.md)."""

    def cross_check(self) -> None:
        if self.sketch is not None and len(self.sketch) % 2:
            Rule.fail("update.sketch", "float16 bytes (an even length)", self.sketch)
        if self.sketch is not None and not self.sketch_method:
            Rule.fail("update.sketch_method", "the sketch's method name", self.sketch_method)


@dataclass(frozen=True)
class Model(Envelope):
    """Aggregator -> agent: one personalized model, or all K cluster models (FedSoft-Async),
    or the global model, at aggregator epoch `epoch`."""

    TYPE: ClassVar[str] = "model"

    epoch: Annotated[int, NonNegInt]
    model: Annotated[str, SpecHash]
    tensors: Annotated[list[dict[str, Any]], ListRule(Tensor, 1, 64)]
    in_reply_to: Annotated[str, ReplyTo] = ""
    alpha: Annotated[list[float] | None, Alpha] = None
    kind: Annotated[str, StrRule(choices=("personalized", "clusters", "global"))] = "personalized"


@dataclass(frozen=True)
class Error(Envelope):
    """A refusal: `reason` is a stable code (see REASONS and the services' own codes)."""

    TYPE: ClassVar[str] = "error"

    reason: Annotated[str, Name]
    detail: Annotated[str, StrRule(0, 4096)] = ""
    in_reply_to: Annotated[str, ReplyTo] = ""


@dataclass(frozen=True)
class Ack(Envelope):
    """The effect of message `in_reply_to` is durable."""

    TYPE: ClassVar[str] = "ack"

    in_reply_to: Annotated[str, MsgId]


@dataclass(frozen=True)
class Receipt(Envelope):
    """Aggregator -> agent: message `of` was taken and its reply is on the way, expected within
    `expect_s` seconds of this receipt (its own recent reply times times the messages queued
    `ahead`). Sent when the message arrives and again whenever that expectation ran out, so an
    agent re-sends only when receipts stop (the aggregator is down). A type of its own, so a
    receiver that predates it refuses it (`unknown_type`) and goes on waiting as before; `of`,
    not `in_reply_to`, so nothing that matches replies by `in_reply_to` takes it for one."""

    TYPE: ClassVar[str] = "receipt"

    of: Annotated[str, MsgId]
    expect_s: Annotated[float, NumRule(0.0, 86400.0)]
    ahead: Annotated[int, NonNegInt] = 0


@dataclass(frozen=True)
class Status(Envelope):
    """Retained presence of an agent or the aggregator (offline is the last will).

    The aggregator's status also advertises what a device needs to join without any other
    source (docs/protocol.md, "Joining"): the model spec (hash, zoo name, canonical JSON
    whose SHA-256 gives the hash), K, the codec settings and where the model graph is."""

    TYPE: ClassVar[str] = "status"
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset(
        {"model", "model_name", "model_spec", "clusters", "codec", "graph", "started_at", "heartbeat_s"})

    state: Annotated[str, StrRule(choices=("online", "offline"))]
    role: Annotated[str, StrRule(choices=("agent", "aggregator"))]
    algorithm: Annotated[str, OptName] = ""
    epoch: Annotated[int, NonNegInt] = 0
    counters: Annotated[dict[str, float | int | str], Counters] = field(default_factory=dict)
    model: Annotated[str, OptSpecHash] = ""
    model_name: Annotated[str, ModelName] = ""
    model_spec: Annotated[str, StrRule(0, 16384)] = ""
    clusters: Annotated[int, NonNegInt] = 0
    codec: Annotated[dict[str, bool | int | float | str], Settings] = field(default_factory=dict)
    graph: Annotated[dict[str, bool | int | float | str], Settings] = field(default_factory=dict)
    started_at: Annotated[float, SentAt] = 0.0
    """When this aggregator started (its wall clock): of two on one fleet, the later one yields."""
    heartbeat_s: Annotated[float, NumRule(0.0, 3600.0)] = 0.0
    """The sender (the aggregator, or an agent) re-publishes its online status at least this often
    while connected (0: it does not say): a live delivery within about two of these tells a
    serving aggregator from a dead one's retained status, and three missed ones mark a member
    whose session ended without a last will offline."""


@dataclass(frozen=True)
class RoundInvite(Envelope):
    """CATA-Fed / FedAvg: train on the global model and report within `deadline_s`."""

    TYPE: ClassVar[str] = "round_invite"

    round: Annotated[int, NonNegInt]
    deadline_s: Annotated[float, NumRule(0.0)]
    model: Annotated[str, SpecHash]
    tensor: Annotated[dict[str, Any], Tensor]
    epoch: Annotated[int, NonNegInt] = 0


@dataclass(frozen=True)
class Report(Envelope):
    """CATA-Fed / FedAvg: the outcome of one round; a straggler sends `finished=False`, no
    tensor, and its new `shard_size`."""

    TYPE: ClassVar[str] = "report"

    round: Annotated[int, NonNegInt]
    finished: Annotated[bool, BoolRule()]
    n_samples: Annotated[int, NonNegInt]
    shard_size: Annotated[int, NonNegInt]
    model: Annotated[str, OptSpecHash] = ""
    tensor: Annotated[dict[str, Any] | None, OptionalRule(Tensor)] = None
    metrics: Annotated[dict[str, float], Metrics] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk(Envelope):
    """Piece `index` of `count` of the message `of` (its msg_id), whose whole payload has
    `total_bytes` bytes and the given sha256. Pieces 0..count-2 all have the same length and
    the last holds the rest, so every piece's offset is known."""

    TYPE: ClassVar[str] = "chunk"

    of: Annotated[str, MsgId]
    index: Annotated[int, IntRule(0, MAX_CHUNKS - 1)]
    count: Annotated[int, IntRule(1, MAX_CHUNKS)]
    total_bytes: Annotated[int, IntRule(1, INT64_MAX)]
    sha256: Annotated[bytes, BytesRule(32, 32)]
    data: Annotated[bytes, BytesRule(1)]

    def cross_check(self) -> None:
        if self.index >= self.count:
            Rule.fail("chunk.index", f"index below count {self.count}", self.index)
        if self.count > self.total_bytes:
            Rule.fail("chunk.count", f"count at most total_bytes {self.total_bytes}", self.count)
        if len(self.data) > self.total_bytes:
            Rule.fail("chunk.data", f"at most total_bytes {self.total_bytes} bytes", self.data)


@dataclass(frozen=True)
class _Schema:
    cls: type[Envelope]
    rules: dict[str, Rule]
    required: frozenset[str]
    defaults: dict[str, Any]


def _schema_of(cls: type[Envelope]) -> _Schema:
    """The wire table of one envelope class, read from its annotated dataclass fields."""
    hints = typing.get_type_hints(cls, include_extras=True)
    rules: dict[str, Rule] = {}
    required: set[str] = set()
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Rule)]
        if len(meta) != 1:
            raise TypeError(f"{cls.__name__}.{f.name} needs exactly one wire Rule annotation")
        rules[f.name] = meta[0]
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
        else:
            required.add(f.name)
    return _Schema(cls, rules, frozenset(required), defaults)


ENVELOPE_TYPES: dict[str, type[Envelope]] = {
    c.TYPE: c for c in (Join, Update, Model, Error, Ack, Receipt, Status, RoundInvite, Report, Chunk)
}
_SCHEMAS: dict[str, _Schema] = {t: _schema_of(c) for t, c in ENVELOPE_TYPES.items()}

UPLINK_TYPES = frozenset({"join", "update", "report", "chunk"})
DOWNLINK_TYPES = frozenset({"model", "round_invite", "error", "ack", "receipt", "chunk"})


# ------------------------------------------------------------------------- encode / decode


def encode(envelope: Envelope) -> bytes:
    """The msgpack bytes of `envelope`, checked by the same rules the receiver applies, so a
    sender's bug is a ProtocolError("bad_field") here and not a refusal over there."""
    schema = _SCHEMAS.get(getattr(envelope, "TYPE", ""))
    if schema is None or type(envelope) is not schema.cls:
        raise ProtocolError("unknown_type", f"cannot encode {type(envelope).__name__}")
    doc: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": schema.cls.TYPE}
    for name, rule in schema.rules.items():
        value = getattr(envelope, name)
        if name in schema.cls.OMIT_WHEN_DEFAULT and value == schema.defaults[name]:
            continue
        doc[name] = rule.check(value, f"{schema.cls.TYPE}.{name}")
    envelope.cross_check()
    return msgpack.packb(doc, use_bin_type=True)


def _refuse_ext(code: int, data: bytes) -> typing.NoReturn:
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def _map_without_duplicate_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """Duplicate keys are refused: parsers differ on which copy wins, a smuggling vector."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a msgpack map")
    return out


def decode(payload: bytes, max_bytes: int) -> Envelope:
    """The envelope in `payload`, or ProtocolError; nothing else escapes.

    Order: size (`too_large`), msgpack with limits so that no declared length can allocate
    more than the payload holds (`malformed`; ext types, duplicate keys, non-str/bytes map
    keys, bad UTF-8, trailing bytes and nesting beyond msgpack's C stack of 1024 are refused
    there), then `v`, `type`, unknown and missing keys, and each field's rule.
    msgpack's `max_buffer_size` is a streaming-Unpacker option; the size check before
    unpacking plays its role here.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise ProtocolError("malformed", f"payload must be bytes, got {_show(payload)}")
    size = memoryview(payload).nbytes
    if size > max_bytes:
        raise ProtocolError("too_large", f"payload of {size} bytes exceeds {max_bytes}")
    try:
        doc = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            timestamp=0,
            object_pairs_hook=_map_without_duplicate_keys,
            ext_hook=_refuse_ext,
            max_bin_len=max_bytes,
            max_str_len=min(max_bytes, MAX_STR_BYTES),
            max_array_len=min(max_bytes, MAX_CONTAINER_LEN),
            max_map_len=min(max_bytes, MAX_CONTAINER_LEN),
            max_ext_len=0,
        )
    except Exception as e:  # msgpack, UnicodeDecodeError, StackError, MemoryError ...
        raise ProtocolError("malformed", f"not a msgpack envelope ({type(e).__name__}: "
                                         f"{str(e)[:120]})") from None
    if type(doc) is not dict:
        raise ProtocolError("malformed", f"top level must be a map, got {_show(doc)}")
    version = doc.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"v must be {PROTOCOL_VERSION}, got {_show(version)}")
    kind = doc.get("type")
    schema = _SCHEMAS.get(kind) if type(kind) is str else None
    if schema is None:
        raise ProtocolError("unknown_type", f"type {_show(kind)} is not one of "
                                            f"{sorted(ENVELOPE_TYPES)}")
    unknown = [k for k in doc if k not in schema.rules and k not in ("v", "type")]
    if unknown:
        raise ProtocolError("unknown_field", f"{kind}: unknown field(s) "
                                             f"{', '.join(_show(k) for k in unknown[:5])}")
    missing = sorted(schema.required - doc.keys())
    if missing:
        raise ProtocolError("missing_field", f"{kind}: missing {missing}")
    values = {
        name: rule.check(doc[name], f"{kind}.{name}")
        for name, rule in schema.rules.items()
        if name in doc
    }
    envelope = schema.cls(**values)
    envelope.cross_check()
    return envelope


def check_topic(topic: Topic, envelope: Envelope) -> None:
    """Refuse an envelope that does not belong on `topic`: wrong type for the direction, a
    status of the wrong role, or an `agent` field other than the topic's agent (an agent may
    only speak for itself; the broker's ACL binds it to its own topics)."""
    kind = envelope.TYPE
    allowed = {
        "up": UPLINK_TYPES,
        "down": DOWNLINK_TYPES,
        "status": frozenset({"status"}),
        "aggregator_status": frozenset({"status"}),
    }[topic.kind]
    if kind not in allowed:
        raise ProtocolError("wrong_topic", f"a {kind} envelope does not belong on {topic}")
    if isinstance(envelope, Status):
        role = "aggregator" if topic.kind == "aggregator_status" else "agent"
        if envelope.role != role:
            raise ProtocolError("wrong_topic", f"a {envelope.role} status on {topic}")
    if topic.agent is not None and envelope.agent != topic.agent:
        raise ProtocolError(
            "agent_mismatch", f"envelope agent {envelope.agent!r} on the topic of {topic.agent!r}"
        )


# -------------------------------------------------------------------------------- chunking


def readable_msg_id(payload: bytes, max_bytes: int) -> str:
    """The msg_id of a payload that failed to decode, if it has a readable one ("" if not),
    so that its refusal can name it in `in_reply_to` (the sender learns which message)."""
    if len(payload) > max_bytes:
        return ""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        msg_id = doc.get("msg_id") if isinstance(doc, dict) else None
    except Exception:
        return ""
    if isinstance(msg_id, str) and 0 < len(msg_id) <= 64 and re.fullmatch(Token, msg_id):
        return msg_id
    return ""


def _msg_id_of(payload: bytes) -> str:
    try:
        msg_id = msgpack.unpackb(payload, raw=False)["msg_id"]
    except Exception:
        msg_id = None
    if not isinstance(msg_id, str):
        raise ProtocolError("malformed", "payload is not an envelope with a msg_id; pass of=")
    return msg_id


def split(
    payload: bytes, *, agent: str, chunk_bytes: int, of: str | None = None
) -> list[bytes]:
    """`[payload]` if it fits in `chunk_bytes`, else the encoded `Chunk` envelopes that carry
    it, in order. `of` defaults to the msg_id inside `payload` (an encoded envelope). Each
    chunk is at most `chunk_bytes + CHUNK_OVERHEAD_BYTES` bytes on the wire. (A receiver
    refuses more pieces than its `protocol.max_chunks` or half its in-flight window, 32 with
    the shipped broker configs: the sender's `chunk_bytes` must be at least its message size
    / 32.)"""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if len(payload) <= chunk_bytes:
        return [bytes(payload)]
    count = -(-len(payload) // chunk_bytes)
    if count > MAX_CHUNKS:
        raise ProtocolError("too_large", f"{len(payload)} bytes in pieces of {chunk_bytes} "
                                         f"needs {count} chunks, over {MAX_CHUNKS}")
    of = of if of is not None else _msg_id_of(payload)
    digest = hashlib.sha256(payload).digest()
    view = memoryview(payload)
    sent_at = now()
    return [
        encode(Chunk(agent=agent, msg_id=new_msg_id(), sent_at=sent_at, of=of, index=i,
                     count=count, total_bytes=len(payload), sha256=digest,
                     data=bytes(view[i * chunk_bytes:(i + 1) * chunk_bytes])))
        for i in range(count)
    ]


@dataclass
class _Partial:
    count: int
    total_bytes: int
    sha256: bytes
    piece_bytes: int
    last_seen: float
    pieces: dict[int, bytes] = field(default_factory=dict)

    def expected_len(self, index: int) -> int:
        if index < self.count - 1:
            return self.piece_bytes
        return self.total_bytes - (self.count - 1) * self.piece_bytes


def _piece_bytes(chunk: Chunk) -> int | None:
    """The common length of pieces 0..count-2 implied by one piece, or None if none fits."""
    n, count, total = len(chunk.data), chunk.count, chunk.total_bytes
    if count == 1:
        return total if n == total else None
    if chunk.index < count - 1:
        piece = n
    else:
        rest = total - n
        if rest % (count - 1):
            return None
        piece = rest // (count - 1)
    last = total - (count - 1) * piece
    return piece if 1 <= last <= piece else None


class Reassembler:
    """Puts chunked messages back together, keyed by (sender, of).

    Memory is bounded by declared size: the first piece of a message reserves its
    `total_bytes` against `max_pending_bytes` (refused with "chunk_overflow" if it does not
    fit), and every piece's length is checked against its slot, so the bytes actually stored
    never exceed the reservation. A message that would exceed `max_message_bytes` is refused
    ("too_large") before anything is stored. A sender may have at most
    `max_partials_per_sender` partial messages open ("chunk_overflow" beyond), so one agent's
    chunk flood cannot take the pending memory the others' uploads need. A piece that contradicts its message (other
    count, size, hash, piece length, or different content for an index already held) drops
    the whole partial message ("chunk_inconsistent"); the sender must send it again.

    Held pieces are bounded too: a receiver that acknowledges pieces only with their whole
    message keeps each stored piece as an unacknowledged delivery, a slot of the broker's
    in-flight window toward it, and a full window stops everyone's traffic. At most
    `max_held_pieces` distinct pieces are stored at once, all senders together: a message
    declaring more is refused at its first piece ("too_large"), and a new piece that would go
    over drops a partial message of the sender holding the most pieces: its own message
    ("chunk_overflow", raised) if that is its sender, else the other sender's largest one,
    reported by the next `expire()` ("chunk_overflow"). So one sender's unfinished messages
    never take more than the bound, and never keep another sender's message out of it.

    Not thread-safe: one caller thread (the MQTT service's message loop) owns it. `add` does
    not expire anything itself: the caller runs `expire()` periodically (and before `add`
    when it wants stale partials to make room) so that it learns what it must answer.
    """

    def __init__(
        self,
        max_message_bytes: int,
        max_pending_bytes: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        remember_completed: int = 1024,
        max_partials_per_sender: int = 0,
        max_chunks: int = 0,
        max_held_pieces: int = 0,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_held_pieces = max_held_pieces
        """Most pieces of unfinished messages stored at once, all senders together (0 = no
        bound); a caller may change it at any time (Channel: half the in-flight window)."""
        self._held = 0
        self._evicted: list[tuple[str, str]] = []
        self.max_chunks = max_chunks
        """Most pieces a message may declare (0 = MAX_CHUNKS only)."""
        self.max_partials_per_sender = max_partials_per_sender
        """0 = no per-sender limit (only max_pending_bytes)."""
        self.max_pending_bytes = max_pending_bytes
        self.timeout_s = timeout_s
        self.clock = clock
        self._partials: dict[tuple[str, str], _Partial] = {}
        self._reserved = 0
        # QoS 1 may redeliver a piece after its message completed; remember recent
        # completions so such a piece does not start a partial that can only time out.
        self._completed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember_completed

    @property
    def pending_bytes(self) -> int:
        """Bytes reserved by partial messages (sum of their declared total_bytes)."""
        return self._reserved

    @property
    def stored_bytes(self) -> int:
        """Bytes of pieces actually held (at most pending_bytes)."""
        return sum(len(d) for p in self._partials.values() for d in p.pieces.values())

    @property
    def pending_messages(self) -> int:
        return len(self._partials)

    @property
    def held_pieces(self) -> int:
        """Distinct pieces stored in partial messages (at most max_held_pieces when bounded)."""
        return self._held

    @property
    def evictions_pending(self) -> bool:
        """Partial messages dropped to make room that the next `expire()` reports."""
        return bool(self._evicted)

    def holds(self, sender: str, of: str) -> bool:
        """Whether a partial message (sender, of) is open."""
        return (sender, of) in self._partials

    def _drop(self, key: tuple[str, str]) -> None:
        partial = self._partials.pop(key, None)
        if partial is not None:
            self._reserved -= partial.total_bytes
            self._held -= len(partial.pieces)

    def _make_room(self, key: tuple[str, str]) -> None:
        """One piece of `key` is about to be stored with `max_held_pieces` already held: drop
        a partial message of the sender holding the most (counting the arriving piece; a tie
        goes against the arriving one, so what is held stays)."""
        per_sender: dict[str, int] = {}
        for (s, _), p in self._partials.items():
            per_sender[s] = per_sender.get(s, 0) + len(p.pieces)
        per_sender[key[0]] = per_sender.get(key[0], 0) + 1
        hog = max(per_sender, key=lambda s: (per_sender[s], s == key[0]))
        if hog == key[0]:
            self._drop(key)
            raise ProtocolError("chunk_overflow", f"message {key[1]!r} from {key[0]!r} dropped: the "
                                f"receiver holds at most {self.max_held_pieces} pieces of unfinished "
                                f"messages and {key[0]!r} holds the most; send it again later")
        victim = max((k for k in self._partials if k[0] == hog), key=lambda k: len(self._partials[k].pieces))
        self._drop(victim)
        self._evicted.append(victim)

    def drop(self, sender: str, of: str) -> bool:
        """Forget a partial message (e.g. the sender's session ended); True if there was one."""
        had = (sender, of) in self._partials
        self._drop((sender, of))
        return had

    def _inconsistent(self, key: tuple[str, str], what: str) -> typing.NoReturn:
        self._drop(key)
        raise ProtocolError("chunk_inconsistent", f"message {key[1]!r} from {key[0]!r}: {what}; "
                                                  "partial message dropped")

    def add(self, chunk: Chunk, sender: str) -> bytes | None:
        """Store one piece; the whole payload (sha256 verified) when it was the last one,
        else None. `sender` is the agent id of the topic the chunk came on."""
        if chunk.agent != sender:
            raise ProtocolError("agent_mismatch", f"chunk of agent {chunk.agent!r} on the topic "
                                                  f"of {sender!r}")
        chunk.cross_check()
        key = (sender, chunk.of)
        if key in self._completed:
            return None
        if chunk.total_bytes > self.max_message_bytes:
            self._drop(key)
            raise ProtocolError("too_large", f"message {chunk.of!r} declares {chunk.total_bytes} "
                                             f"bytes, over {self.max_message_bytes}")
        if self.max_chunks and chunk.count > self.max_chunks:
            self._drop(key)
            raise ProtocolError("too_large", f"message {chunk.of!r} declares {chunk.count} pieces, over "
                                             f"{self.max_chunks} (send larger pieces)")
        if self.max_held_pieces and chunk.count > self.max_held_pieces:
            self._drop(key)
            raise ProtocolError("too_large", f"message {chunk.of!r} declares {chunk.count} pieces, over "
                                             f"the {self.max_held_pieces} the receiver may hold "
                                             f"unacknowledged (send larger pieces)")
        partial = self._partials.get(key)
        if partial is None:
            piece = _piece_bytes(chunk)
            if piece is None:
                raise ProtocolError("chunk_inconsistent", f"piece {chunk.index} of {chunk.count} "
                                    f"has {len(chunk.data)} bytes, impossible for "
                                    f"{chunk.total_bytes}")
            cap = self.max_partials_per_sender
            if cap and sum(1 for s, _ in self._partials if s == sender) >= cap:
                raise ProtocolError("chunk_overflow", f"message {chunk.of!r}: {sender!r} already "
                                    f"has {cap} partial messages open (max_partials_per_sender)")
            if self._reserved + chunk.total_bytes > self.max_pending_bytes:
                raise ProtocolError("chunk_overflow", f"message {chunk.of!r} of "
                                    f"{chunk.total_bytes} bytes does not fit: {self._reserved} of "
                                    f"{self.max_pending_bytes} pending bytes in use")
            partial = _Partial(chunk.count, chunk.total_bytes, chunk.sha256, piece, self.clock())
            self._partials[key] = partial
            self._reserved += chunk.total_bytes
        elif (chunk.count, chunk.total_bytes, chunk.sha256) != (
            partial.count, partial.total_bytes, partial.sha256
        ):
            self._inconsistent(key, f"piece {chunk.index} declares other count/size/sha256")
        if len(chunk.data) != partial.expected_len(chunk.index):
            self._inconsistent(key, f"piece {chunk.index} has {len(chunk.data)} bytes, expected "
                                    f"{partial.expected_len(chunk.index)}")
        held = partial.pieces.get(chunk.index)
        if held is not None and held != chunk.data:
            self._inconsistent(key, f"piece {chunk.index} arrived twice with different content")
        if held is None:
            if self.max_held_pieces and self._held >= self.max_held_pieces:
                self._make_room(key)
            self._held += 1
        partial.pieces[chunk.index] = chunk.data
        partial.last_seen = self.clock()
        if len(partial.pieces) < partial.count:
            return None
        self._drop(key)
        payload = b"".join(partial.pieces[i] for i in range(partial.count))
        if hashlib.sha256(payload).digest() != partial.sha256:
            raise ProtocolError("chunk_corrupt", f"message {chunk.of!r} from {sender!r}: sha256 "
                                                 "of the reassembled payload does not match")
        self._completed[key] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)
        return payload

    def expire(self) -> list[tuple[str, str, str]]:
        """Drop partial messages that received no piece for more than `timeout_s` (idle time,
        so a slow but steady sender is not cut off; memory stays bounded by the reservation)
        and return (sender, of, "chunk_timeout") for each, for the caller to log and answer;
        first (sender, of, "chunk_overflow") for each partial dropped to make room since."""
        evicted, self._evicted = self._evicted, []
        t = self.clock()
        stale = [k for k, p in self._partials.items() if t - p.last_seen > self.timeout_s]
        for key in stale:
            self._drop(key)
        return [(s, of, "chunk_overflow") for s, of in evicted] + [(s, of, "chunk_timeout") for s, of in stale]
