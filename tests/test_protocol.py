"""Wire protocol v1: topics, envelope round trips, strict decoding (with a fuzzer), chunking."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq import protocol as p
from fedmq.protocol import (
    Ack,
    Chunk,
    Envelope,
    Error,
    Join,
    Model,
    ProtocolError,
    Reassembler,
    Receipt,
    Report,
    RoundInvite,
    Status,
    Topic,
    Update,
    decode,
    encode,
    split,
)

MAX = 1 << 20
T0 = 1_750_000_000.25


def tensor(n: int = 4, **extra: object) -> dict:
    return {"codec": "fp32", "n": n, "data": os.urandom(4 * n), **extra}


SAMPLES: list[Envelope] = [
    Join("car-1", "m1", T0, model="3f2a9c0e1b2d4f6a", algorithm="cdfl"),
    Join("car-1", "m2", T0, model="3f2a9c0e1b2d4f6a", algorithm="cdfl", profile="car",
         n_samples=1500),
    Update("car-1", "m3", T0, model="3f2a", tau=7, tensor=tensor(8, scale=0.5, zstd=True,
           base=None, idx=b"\x00\x01", note="delta"), n_samples=900),
    Update("phone.2", "m4", T0, model="3f2a", tau=0, tensor=tensor(), n_samples=1,
           alpha=[0.25, 0.75], metrics={"loss": 0.31, "acc": 0.9}),
    Model("car-1", "m5", T0, epoch=12, model="3f2a", tensors=[tensor()]),
    Model("car-1", "m6", T0, epoch=12, model="3f2a", tensors=[tensor(), tensor(2)],
          in_reply_to="m4", alpha=[0.5, 0.5], kind="clusters"),
    Error("car-1", "m7", T0, reason="unknown_model"),
    Error("car-1", "m8", T0, reason="bad_field", detail="update.tau: expected int",
          in_reply_to="m3"),
    Ack("car-1", "m9", T0, in_reply_to="m3"),
    Status("car-1", "m10", T0, state="online", role="agent"),
    Status("aggregator", "m11", T0, state="offline", role="aggregator", algorithm="cdfl",
           epoch=40, counters={"updates": 12, "queue_s": 0.5, "device": "cuda"}),
    RoundInvite("car-1", "m12", T0, round=3, deadline_s=30.0, model="3f2a", tensor=tensor()),
    Report("car-1", "m13", T0, round=3, finished=True, n_samples=800, shard_size=800,
           model="3f2a", tensor=tensor(), metrics={"epochs": 2.0}),
    Report("car-1", "m14", T0, round=3, finished=False, n_samples=0, shard_size=400),
    Chunk("car-1", "m15", T0, of="m3", index=1, count=3, total_bytes=10,
          sha256=hashlib.sha256(b"x").digest(), data=b"abcd"),
    Receipt("car-1", "m16", T0, of="m3", expect_s=26.5, ahead=2),
    Status("aggregator", "m17", T0, state="online", role="aggregator",  # a reference with its arguments
           model_name="torchvision:mobilenet_v3_small?bn_momentum=0.01&input=3x32x32&num_classes=10"),
]


# ---------------------------------------------------------------------------------- topics


def test_topic_builders_and_parse_round_trip() -> None:
    assert p.uplink("f1", "car-7") == "fedmq/f1/agents/car-7/up"
    assert p.downlink("f1", "car-7") == "fedmq/f1/agents/car-7/down"
    assert p.agent_status("f1", "car-7") == "fedmq/f1/agents/car-7/status"
    assert p.aggregator_status("f1") == "fedmq/f1/aggregator/status"
    assert p.all_uplinks("f1") == "fedmq/f1/agents/+/up"
    assert p.all_agent_status("f1") == "fedmq/f1/agents/+/status"
    for build, kind in ((p.uplink, "up"), (p.downlink, "down"), (p.agent_status, "status")):
        topic = build("fleet_A.1", "a-b.c_9")
        assert p.parse_topic(topic) == Topic("fleet_A.1", kind, "a-b.c_9")
        assert str(p.parse_topic(topic)) == topic
    assert p.parse_topic("fedmq/f1/aggregator/status") == Topic("f1", "aggregator_status", None)


@pytest.mark.parametrize("bad", ["", "a/b", "a+", "#", "car 1", "ü", "x" * 65, ".", "..", None, 7])
def test_bad_ids_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError) as e:
        p.validate_id(bad)
    assert e.value.reason == "bad_id"
    with pytest.raises(ProtocolError):
        p.uplink("f", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    "fedmq/f/agents/a/sideways", "fedmq/f/agents/+/up", "fedmq/#", "other/f/agents/a/up",
    "fedmq/f/agents/a/up/extra", "fedmq/f/agents//up", "fedmq/f/aggregator/down",
    "/fedmq/f/agents/a/up", "fedmq/f/agents/a", "", None, b"fedmq/f/agents/a/up",
])
def test_bad_topics_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError) as e:
        p.parse_topic(bad)
    assert e.value.reason == "bad_topic"


def test_check_topic_binds_type_direction_and_agent() -> None:
    up, down = p.parse_topic(p.uplink("f", "car-1")), p.parse_topic(p.downlink("f", "car-1"))
    p.check_topic(up, SAMPLES[2])
    p.check_topic(down, SAMPLES[4])
    for topic, env, reason in [
        (up, SAMPLES[4], "wrong_topic"),  # a model on the uplink
        (down, SAMPLES[2], "wrong_topic"),
        (p.parse_topic(p.uplink("f", "car-2")), SAMPLES[2], "agent_mismatch"),
        (p.parse_topic(p.aggregator_status("f")), SAMPLES[9], "wrong_topic"),  # agent role
    ]:
        with pytest.raises(ProtocolError) as e:
            p.check_topic(topic, env)
        assert e.value.reason == reason


# ------------------------------------------------------------------------------- envelopes


@pytest.mark.parametrize("env", SAMPLES, ids=lambda e: f"{e.TYPE}-{e.msg_id}")
def test_every_envelope_type_round_trips(env: Envelope) -> None:
    payload = encode(env)
    back = decode(payload, MAX)
    assert back == env and type(back) is type(env)
    doc = msgpack.unpackb(payload)
    assert doc["v"] == p.PROTOCOL_VERSION and doc["type"] == env.TYPE


def test_samples_cover_every_type() -> None:
    assert {e.TYPE for e in SAMPLES} == set(p.ENVELOPE_TYPES)


def test_optional_fields_may_be_omitted_on_the_wire() -> None:
    """A small device may leave out fields that have defaults."""
    payload = msgpack.packb({"v": 1, "type": "status", "agent": "a", "msg_id": "1",
                             "sent_at": 5, "state": "online", "role": "agent"})
    env = decode(payload, MAX)
    assert env == Status("a", "1", 5.0, state="online", role="agent", counters={})
    assert isinstance(env.sent_at, float)  # an int where a number goes is normalized


def test_new_msg_id_is_unique_and_ordered() -> None:
    ids = [p.new_msg_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert [i[:14] for i in ids] == sorted(i[:14] for i in ids)
    assert all(1 <= len(i) <= 64 for i in ids)


def _doc(env: Envelope) -> dict:
    return msgpack.unpackb(encode(env))


def _with(env: Envelope, **changes: object) -> bytes:
    return msgpack.packb({**_doc(env), **changes}, use_bin_type=True)


UPDATE, MODEL, CHUNK = SAMPLES[3], SAMPLES[5], SAMPLES[14]
DEEP = b"\x91" * 5000 + b"\xc0"


@pytest.mark.parametrize("payload,reason", [
    (b"", "malformed"),
    (b"\xc1", "malformed"),  # never-used msgpack byte
    (msgpack.packb([1, 2]), "malformed"),
    (encode(UPDATE) + b"\x00", "malformed"),  # trailing bytes
    (b"\xc6\xff\xff\xff\xff", "malformed"),  # bin32 declaring 4 GiB
    (b"\xdd\xff\xff\xff\xff", "malformed"),  # array32 declaring 2**32-1 items
    (b"\xdf\xff\xff\xff\xff", "malformed"),  # map32 declaring 2**32-1 entries
    (DEEP, "malformed"),
    (b"\x81\xa1v\xd6\xff\x00\x00\x00\x01", "malformed"),  # ext (timestamp) value
    (b"\x82\xa1v\x01\xa1v\x01", "malformed"),  # duplicate key
    (b"\x81\x01\x01", "malformed"),  # int map key
    (b"\x81\xa2\xff\xfe\x01", "malformed"),  # invalid UTF-8
    (_with(UPDATE, v=2), "bad_version"),
    (_with(UPDATE, v=True), "bad_version"),
    (_with(UPDATE, type="teleport"), "unknown_type"),
    (_with(UPDATE, type=None), "unknown_type"),
    (_with(UPDATE, extra=1), "unknown_field"),
    (msgpack.packb({**_doc(UPDATE), b"tau": 1}, use_bin_type=True), "unknown_field"),
    (msgpack.packb({k: v for k, v in _doc(UPDATE).items() if k != "tau"}), "missing_field"),
    (_with(UPDATE, tau=True), "bad_field"),  # bool is not int
    (_with(UPDATE, tau=1.0), "bad_field"),
    (_with(UPDATE, tau=-1), "bad_field"),
    (_with(UPDATE, tau=2**63), "bad_field"),  # beyond int64
    (_with(UPDATE, sent_at=math.nan), "bad_field"),
    (_with(UPDATE, sent_at=math.inf), "bad_field"),
    (_with(UPDATE, sent_at="now"), "bad_field"),
    (_with(UPDATE, agent="car/1"), "bad_field"),
    (_with(UPDATE, msg_id=""), "bad_field"),
    (_with(UPDATE, msg_id="x" * 65), "bad_field"),
    (_with(UPDATE, alpha=[]), "bad_field"),
    (_with(UPDATE, alpha=[0.5] * 65), "bad_field"),
    (_with(UPDATE, alpha=[-0.1, 1.1]), "bad_field"),
    (_with(UPDATE, alpha=[math.nan]), "bad_field"),
    (_with(UPDATE, alpha=(0.5, True)), "bad_field"),
    (_with(UPDATE, metrics={"loss": "low"}), "bad_field"),
    (_with(UPDATE, metrics={"": 1.0}), "bad_field"),
    (_with(UPDATE, tensor={"codec": "fp32", "n": 1}), "missing_field"),
    (_with(UPDATE, tensor={**tensor(), "n": 0}), "bad_field"),
    (_with(UPDATE, tensor={**tensor(), "n": 2**31}), "bad_field"),
    (_with(UPDATE, tensor={**tensor(), "codec": "x" * 17}), "bad_field"),
    (_with(UPDATE, tensor={**tensor(), "data": "not bytes"}), "bad_field"),
    (_with(UPDATE, tensor={**tensor(), "nested": [1]}), "bad_field"),
    (_with(UPDATE, tensor={**tensor(), "nested": {"a": 1}}), "bad_field"),
    (_with(UPDATE, tensor=[1, 2]), "bad_field"),
    (_with(MODEL, tensors=[]), "bad_field"),
    (_with(MODEL, tensors=[tensor()] * 65), "bad_field"),
    (_with(MODEL, kind="everything"), "bad_field"),
    (_with(CHUNK, index=3), "bad_field"),  # index >= count
    (_with(CHUNK, sha256=b"\x00" * 31), "bad_field"),
    (_with(CHUNK, data=b"x" * 11), "bad_field"),  # more than total_bytes
    (_with(SAMPLES[6], detail="d" * 4097), "bad_field"),
    (_with(SAMPLES[10], counters={"c": [1]}), "bad_field"),
    (_with(SAMPLES[10], state="away"), "bad_field"),
])
def test_invalid_payloads_are_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(payload, MAX)
    assert e.value.reason == reason, e.value


def test_size_limit_comes_first_and_is_inclusive() -> None:
    payload = encode(UPDATE)
    assert decode(payload, len(payload)) == UPDATE
    with pytest.raises(ProtocolError) as e:
        decode(payload, len(payload) - 1)
    assert e.value.reason == "too_large"
    with pytest.raises(ProtocolError) as e:  # even garbage is refused by size first
        decode(b"\xc1" * 100, 99)
    assert e.value.reason == "too_large"


def test_declared_bin_larger_than_max_bytes_cannot_allocate() -> None:
    """A bin header declaring 2 GiB in a 19-byte payload is refused by msgpack's limits, not
    answered with an allocation or a MemoryError."""
    hostile = b"\x81\xa4data\xc6\x7f\xff\xff\xff" + b"x" * 10
    with pytest.raises(ProtocolError) as e:
        decode(hostile, 64)
    assert e.value.reason == "malformed"


def test_encode_refuses_what_decode_would_refuse() -> None:
    for bad in (
        dataclasses.replace(UPDATE, alpha=[math.nan]),
        dataclasses.replace(UPDATE, tau=True),
        dataclasses.replace(UPDATE, agent="a/b"),
        dataclasses.replace(UPDATE, tensor={"codec": "fp32", "n": 1, "data": bytearray(4)}),
        dataclasses.replace(CHUNK, index=5),
    ):
        with pytest.raises(ProtocolError) as e:
            encode(bad)
        assert e.value.reason == "bad_field"
    with pytest.raises(ProtocolError) as e:
        encode(Envelope("a", "1", T0))
    assert e.value.reason == "unknown_type"


# ---------------------------------------------------------------- fuzzing: only ProtocolError

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=80), st.binary(max_size=40),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=12,
)


def _assert_decodes_or_refuses(payload: bytes) -> None:
    try:
        env = decode(payload, 4096)
    except ProtocolError as e:
        assert e.reason in p.REASONS
        return
    assert type(env) in p.ENVELOPE_TYPES.values()
    assert decode(encode(env), 4096) == env


@st.composite
def _mutated_doc(draw: st.DrawFn) -> bytes:
    doc = _doc(draw(st.sampled_from(SAMPLES)))
    target = doc
    nested = [k for k, v in doc.items() if isinstance(v, dict)]
    if nested and draw(st.booleans()):
        target = doc[draw(st.sampled_from(nested))]
    op = draw(st.sampled_from(["replace", "drop", "add"]))
    keys = sorted(target, key=str)
    if not keys:  # an empty metrics or counters map
        op, keys = "add", ["x"]
    if op == "replace":
        target[draw(st.sampled_from(keys))] = draw(_values)
    elif op == "drop":
        del target[draw(st.sampled_from(keys))]
    else:
        target[draw(st.one_of(st.text(max_size=10), st.sampled_from(keys)))] = draw(_values)
    return msgpack.packb(doc, use_bin_type=True)


@st.composite
def _mutated_bytes(draw: st.DrawFn) -> bytes:
    data = bytearray(encode(draw(st.sampled_from(SAMPLES))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif len(data) > 1:
            del data[i:i + draw(st.integers(1, 8))]
    return bytes(data)


_FUZZ = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_FUZZ
@given(st.binary(max_size=600))
def test_fuzz_arbitrary_bytes(payload: bytes) -> None:
    _assert_decodes_or_refuses(payload)


@_FUZZ
@given(_mutated_bytes())
def test_fuzz_byte_mutations_of_valid_envelopes(payload: bytes) -> None:
    _assert_decodes_or_refuses(payload)


@_FUZZ
@given(_mutated_doc())
def test_fuzz_field_mutations_of_valid_envelopes(payload: bytes) -> None:
    _assert_decodes_or_refuses(payload)


# -------------------------------------------------------------------------------- chunking


def _chunks(payload: bytes, chunk_bytes: int, agent: str = "car-1", of: str = "big-1") -> list[Chunk]:
    encoded = split(payload, agent=agent, chunk_bytes=chunk_bytes, of=of)
    return [decode(c, chunk_bytes + p.CHUNK_OVERHEAD_BYTES) for c in encoded]  # type: ignore[misc]


def test_split_leaves_small_payloads_alone_and_reads_msg_id() -> None:
    small = encode(UPDATE)
    assert split(small, agent="phone.2", chunk_bytes=len(small)) == [small]
    pieces = [decode(c, MAX) for c in split(small, agent="phone.2", chunk_bytes=64)]
    assert all(isinstance(c, Chunk) and c.of == UPDATE.msg_id for c in pieces)
    assert [c.index for c in pieces] == list(range(len(pieces)))
    assert {len(c.data) for c in pieces[:-1]} == {64}
    assert all(c.sha256 == hashlib.sha256(small).digest() for c in pieces)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _reassembler(**kw: object) -> Reassembler:
    args = {"max_message_bytes": 10_000, "max_pending_bytes": 20_000, "timeout_s": 30.0}
    return Reassembler(**{**args, **kw})  # type: ignore[arg-type]


def test_reassembles_in_order_out_of_order_and_with_duplicates() -> None:
    payload = os.urandom(9_000)
    chunks = _chunks(payload, 1_000)
    assert len(chunks) == 9
    r = _reassembler()
    assert [r.add(c, "car-1") for c in chunks][-1] == payload
    r = _reassembler()
    order = [8, 3, 0, 3, 5, 8, 1, 2, 4, 6, 7]  # the last piece first, two QoS 1 duplicates
    results = [r.add(chunks[i], "car-1") for i in order]
    assert results[:-1] == [None] * 10 and results[-1] == payload
    assert r.pending_bytes == 0 and r.pending_messages == 0
    assert r.add(chunks[4], "car-1") is None  # a late duplicate does not start a new message
    assert r.pending_messages == 0


def test_a_message_of_more_pieces_than_allowed_is_refused_at_its_first_piece() -> None:
    """Hundreds of one-byte pieces kept a receiver busy for nothing; more than the
    broker's in-flight window could never complete anyway (chunks are acked with the whole)."""
    chunks = _chunks(os.urandom(640), 1)
    r = _reassembler(max_chunks=64)
    with pytest.raises(ProtocolError) as info:
        r.add(chunks[0], "car-1")
    assert info.value.reason == "too_large" and "640 pieces, over 64" in str(info.value)
    assert r.pending_messages == 0 and r.pending_bytes == 0
    fits = _chunks(os.urandom(640), 10)  # 64 pieces: accepted
    assert [r.add(c, "car-1") for c in fits][-1] is not None


def test_two_senders_with_the_same_msg_id_do_not_mix() -> None:
    a, b = os.urandom(3_000), os.urandom(3_000)
    ca, cb = _chunks(a, 1_000, agent="a", of="m"), _chunks(b, 1_000, agent="b", of="m")
    r = _reassembler()
    out = [r.add(x, "a") for x in ca[:2]] + [r.add(y, "b") for y in cb] + [r.add(ca[2], "a")]
    assert out[-2] == b and out[-1] == a


def test_corrupt_piece_fails_sha256_and_frees_memory() -> None:
    payload = os.urandom(3_000)
    chunks = _chunks(payload, 1_000)
    bad = dataclasses.replace(chunks[1], data=bytes(1_000))
    r = _reassembler()
    r.add(chunks[0], "car-1")
    r.add(bad, "car-1")
    with pytest.raises(ProtocolError) as e:
        r.add(chunks[2], "car-1")
    assert e.value.reason == "chunk_corrupt"
    assert r.pending_bytes == 0 and r.pending_messages == 0


def test_duplicate_index_with_other_content_drops_the_message() -> None:
    chunks = _chunks(os.urandom(3_000), 1_000)
    r = _reassembler()
    r.add(chunks[0], "car-1")
    with pytest.raises(ProtocolError) as e:
        r.add(dataclasses.replace(chunks[0], data=os.urandom(1_000)), "car-1")
    assert e.value.reason == "chunk_inconsistent"
    assert r.pending_messages == 0 and r.pending_bytes == 0


@pytest.mark.parametrize("change", [
    {"count": 4}, {"total_bytes": 2_999}, {"sha256": bytes(32)}, {"data": b"x" * 999},
])
def test_piece_contradicting_its_message_is_refused(change: dict) -> None:
    chunks = _chunks(os.urandom(3_000), 1_000)
    r = _reassembler()
    r.add(chunks[0], "car-1")
    with pytest.raises(ProtocolError) as e:
        r.add(dataclasses.replace(chunks[1], **change), "car-1")
    assert e.value.reason == "chunk_inconsistent"
    assert r.pending_messages == 0


def test_first_piece_with_impossible_length_is_refused() -> None:
    last = _chunks(os.urandom(3_000), 1_000)[2]
    with pytest.raises(ProtocolError) as e:  # a last piece longer than the others
        _reassembler().add(dataclasses.replace(last, total_bytes=3_500, data=b"y" * 1_500),
                           "car-1")
    assert e.value.reason == "chunk_inconsistent"


def test_declared_size_over_limit_is_refused_before_storing() -> None:
    chunk = _chunks(os.urandom(3_000), 1_000)[0]
    r = _reassembler(max_message_bytes=2_999)
    with pytest.raises(ProtocolError) as e:
        r.add(chunk, "car-1")
    assert e.value.reason == "too_large"
    assert r.pending_messages == 0 and r.pending_bytes == 0


def test_pending_memory_is_bounded_by_declared_sizes() -> None:
    r = _reassembler(max_pending_bytes=7_000)
    first = _chunks(os.urandom(4_000), 1_000, of="one")
    second = _chunks(os.urandom(4_000), 1_000, of="two")
    r.add(first[0], "car-1")
    assert r.pending_bytes == 4_000 and r.stored_bytes == 1_000
    with pytest.raises(ProtocolError) as e:
        r.add(second[0], "car-1")
    assert e.value.reason == "chunk_overflow"
    assert r.pending_bytes == 4_000 and r.pending_messages == 1  # the first is untouched
    for c in first[1:]:
        r.add(c, "car-1")
    assert r.pending_bytes == 0
    assert [r.add(c, "car-1") for c in second][-1] is not None  # room again


def test_chunk_from_another_agent_is_refused() -> None:
    chunk = _chunks(os.urandom(3_000), 1_000, agent="car-1")[0]
    r = _reassembler()
    with pytest.raises(ProtocolError) as e:
        r.add(chunk, "car-2")
    assert e.value.reason == "agent_mismatch"
    assert r.pending_messages == 0


def test_partial_message_times_out_on_an_injected_clock() -> None:
    clock = FakeClock()
    r = _reassembler(timeout_s=30.0, clock=clock)
    stalled = _chunks(os.urandom(3_000), 1_000, of="stalled")
    steady = _chunks(os.urandom(3_000), 1_000, of="steady")
    r.add(stalled[0], "car-1")
    r.add(steady[0], "car-1")
    clock.t += 20
    r.add(steady[1], "car-1")  # progress resets the idle timer of `steady` only
    assert r.expire() == []
    clock.t += 15
    assert r.expire() == [("car-1", "stalled", "chunk_timeout")]
    assert r.pending_messages == 1 and r.pending_bytes == 3_000
    assert r.add(steady[2], "car-1") is not None
    clock.t += 100
    assert r.expire() == [] and r.pending_bytes == 0


def test_held_pieces_stay_within_the_bound_and_the_biggest_holder_gives_way() -> None:
    """Each held piece is an unacknowledged delivery: the bound keeps them below the broker's
    in-flight window whatever the senders do, and a sender over its share loses its own
    unfinished message, never another's."""
    r = _reassembler(max_held_pieces=6, max_pending_bytes=100_000)
    with pytest.raises(ProtocolError) as e:  # could never complete within the bound
        r.add(_chunks(os.urandom(7_000), 1_000, agent="car-2", of="seven")[0], "car-2")
    assert e.value.reason == "too_large" and r.held_pieces == 0 and r.pending_messages == 0
    hog = _chunks(os.urandom(5_000), 1_000, agent="car-2", of="hog")
    for c in hog[:4]:
        assert r.add(c, "car-2") is None
    assert r.add(hog[0], "car-2") is None and r.held_pieces == 4  # a copy holds nothing more
    honest = _chunks(os.urandom(3_000), 1_000, agent="car-1", of="honest")
    payload = b"".join(c.data for c in honest)
    assert r.add(honest[0], "car-1") is None and r.add(honest[1], "car-1") is None
    assert r.held_pieces == 6 and not r.evictions_pending
    assert r.add(honest[2], "car-1") == payload  # room made by dropping car-2's message
    assert r.evictions_pending and r.held_pieces == 0
    assert r.expire() == [("car-2", "hog", "chunk_overflow")] and not r.evictions_pending
    # Alone at the bound, a sender loses the message its arriving piece belongs to.
    first, second = (_chunks(os.urandom(4_000), 1_000, agent="car-2", of=of) for of in ("a", "b"))
    for c in first[:3] + second[:3]:
        assert r.add(c, "car-2") is None
    with pytest.raises(ProtocolError) as e:
        r.add(second[3], "car-2")
    assert e.value.reason == "chunk_overflow"
    assert r.held_pieces == 3 and r.pending_messages == 1 and not r.evictions_pending


# ---------------------------------------------------------------------------- the reference


def test_reference_page_names_every_type_field_and_reason() -> None:
    """docs/protocol.md is what device implementers read: it must not fall behind the code."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    for kind, cls in p.ENVELOPE_TYPES.items():
        heading = f"### `{kind}`"
        assert heading in text, heading
        section = text.split(heading, 1)[1].split("\n### ", 1)[0]
        for f in dataclasses.fields(cls):
            if f.name not in ("agent", "msg_id", "sent_at"):
                assert f"| `{f.name}` |" in section, f"{kind}.{f.name} missing from the docs"
    for reason in p.REASONS:
        assert f"| `{reason}` |" in text, f"reason {reason} missing from the docs"


def test_one_sender_cannot_take_the_pending_memory_of_others() -> None:
    r = _reassembler(max_pending_bytes=20_000, max_partials_per_sender=2)
    flood = [_chunks(os.urandom(3_000), 1_000, of=f"flood-{i}") for i in range(3)]
    r.add(flood[0][0], "car-1")
    r.add(flood[1][0], "car-1")
    with pytest.raises(ProtocolError) as e:
        r.add(flood[2][0], "car-1")
    assert e.value.reason == "chunk_overflow" and "car-1" in str(e.value)
    assert r.pending_messages == 2 and r.pending_bytes == 6_000  # the refused one holds nothing
    honest = _chunks(os.urandom(3_000), 1_000, agent="car-2", of="honest")
    assert [r.add(c, "car-2") for c in honest][-1] is not None  # another sender still fits
    assert r.add(flood[0][1], "car-1") is None  # an open partial of car-1 still takes pieces
    assert r.add(flood[0][2], "car-1") is not None


def test_msg_ids_keep_rising_when_the_clock_goes_back_and_across_a_restart(monkeypatch) -> None:
    """The aggregator applies an agent's msg_id only above the highest it applied from it."""
    monkeypatch.setattr(p, "_last_micros", p._last_micros)  # restored after: other tests' ids stay current
    first = p.new_msg_id()
    monkeypatch.setattr(p.time, "time_ns", lambda: 10**18)  # the clock set back decades
    later = [p.new_msg_id() for _ in range(3)]
    assert first < later[0] < later[1] < later[2]
    ahead = f"{(1 << 55):014x}" + "ab" * 9  # an id sent before a restart under a clock far ahead
    p.msg_ids_after(ahead)
    assert p.new_msg_id() > ahead and p.msg_id_floor() >= ahead[:14]
    p.msg_ids_after("m1")  # not one of ours: ignored
