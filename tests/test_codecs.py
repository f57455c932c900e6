"""Codecs: round trips within stated error bounds, error feedback, malformed maps refused."""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedmq.codecs import (
    CODECS,
    CodecError,
    ErrorFeedback,
    base_checksum,
    decode,
    encode,
    encoded_size,
    float32_to_half,
    half_to_float32,
    topk_count,
)
from fedmq.config import Config
from fedmq.models import build_model, model_spec, to_vector

F16_MAX = 65504.0
TINY = 2.0**-149  # the smallest float32 subnormal


def varied_vector(n: int, seed: int) -> np.ndarray:
    """Magnitudes from subnormal to large, exact zeros and signed zeros, n not a block multiple."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 3, n)
    x[rng.random(n) < 0.05] = 0.0
    x[:3] = [-0.0, 1e-40, -3e-39]
    return x.astype(np.float32)


def block_scales(content: np.ndarray, block: int) -> np.ndarray:
    """Per-element int8 scale max|x_block| / 127, computed independently of the codec."""
    n = content.size
    padded = np.zeros(-(-n // block) * block)
    padded[:n] = np.abs(content.astype(np.float64))
    peak = padded.reshape(-1, block).max(axis=1)
    return np.repeat(peak / 127.0, block)[:n]


def allowed_error(codec: str, content: np.ndarray, block: int) -> np.ndarray:
    """The per-element error bound each codec promises on the value it encodes."""
    c = np.abs(content.astype(np.float64))
    if codec == "fp32":
        return np.zeros_like(c)
    if codec == "fp16":
        # round to nearest: half an ulp, 2^-11 relative; 2^-25 absolute in fp16's subnormal range
        return c * 2.0**-11 + 2.0**-25
    if codec == "int8":
        # s / 2, slack for the float32 product q * s and the float32 rounding of s
        return block_scales(content, block) / 2 * (1 + 2.0**-15) + TINY
    raise AssertionError(codec)


def check_round_trip(x: np.ndarray, codec: str, *, zstd: bool, base: np.ndarray | None,
                     block: int = 256) -> np.ndarray:
    wire = encode(x, codec, base=base, zstd=zstd, block=block)
    assert wire["codec"] == codec and wire["n"] == x.size
    assert wire["zstd"] is zstd and wire["delta"] is (base is not None)
    out = decode(wire, base=base)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert np.isfinite(out).all()
    if codec == "fp32":
        np.testing.assert_array_equal(out.view(np.uint32), x.view(np.uint32))  # bit-exact, -0.0 too
        return out
    content = x - base if base is not None else x
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    bound = allowed_error(codec, content, block)
    if base is not None:  # float32 rounding of v - b on the way in and b + d on the way out
        bound = bound + 2.0**-23 * (np.abs(content) + np.abs(x)) + TINY
    if not (err <= bound).all():
        worst = int(np.argmax(err - bound))
        raise AssertionError(f"{codec}: error {err[worst]:g} > bound {bound[worst]:g} at {worst}")
    return out


def topk_indices(wire: dict) -> np.ndarray:
    """Indices a topk map carries, read straight from its payload."""
    raw = wire["data"]
    if wire["zstd"]:
        raw = zstandard.ZstdDecompressor().decompress(raw)
    return np.cumsum(np.frombuffer(raw, dtype="<u4", count=wire["k"]).astype(np.int64))


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("zstd", [False, True])
@pytest.mark.parametrize("delta", [False, True])
def test_round_trip_within_bound(codec: str, zstd: bool, delta: bool) -> None:
    x = varied_vector(1000, seed=1)
    if codec == "fp16":
        x = np.clip(x, -F16_MAX / 2, F16_MAX / 2)
    base = (x + varied_vector(1000, seed=2) * 1e-3).astype(np.float32) if delta else None
    check_round_trip(x, codec, zstd=zstd, base=base)


def test_int8_error_is_at_most_half_a_scale_per_block() -> None:
    """The int8 bound, spelled out: per block max|err| <= (max|x_block| / 127) / 2."""
    block = 64
    x = varied_vector(64 * 5 + 17, seed=3)
    x[64:128] *= 1e4  # blocks of very different magnitude keep their own scale
    out = decode(encode(x, "int8", block=block, zstd=False))
    for start in range(0, x.size, block):
        xb = x[start:start + block].astype(np.float64)
        scale = np.abs(xb).max() / 127
        err = np.abs(out[start:start + block] - xb).max()
        assert err <= scale / 2 * (1 + 2.0**-15) + TINY, (start, err, scale)
        if scale > 0:  # a block's peak is exactly representable: q = +-127
            peak = int(np.argmax(np.abs(xb)))
            assert abs(out[start + peak] - xb[peak]) <= scale * 2.0**-15


def test_fp16_subnormals_and_overflow() -> None:
    x = np.array([2.0**-24, 3 * 2.0**-26, 2.0**-26, 1e-9, -6e-6, 65504.0, -1.0], dtype=np.float32)
    out = decode(encode(x, "fp16"))
    assert out[0] == 2.0**-24  # the smallest fp16 subnormal survives
    assert out[2] == 0.0 and out[3] == 0.0  # below half of it: flushed, error <= 2^-25
    assert (np.abs(out - x) <= np.abs(x) * 2.0**-11 + 2.0**-25).all()
    with pytest.raises(CodecError) as info:
        encode(np.array([1.0, 70000.0], dtype=np.float32), "fp16")
    assert info.value.reason == "out_of_range"


def test_fast_half_conversion_matches_numpy_bit_for_bit() -> None:
    """The codec converts through torch (numpy is slow on fp16 subnormals); numpy is the
    fallback, so both must give the same bits, subnormals, ties and signed zeros included."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(50000) * 10.0 ** rng.uniform(-9, 4.5, 50000)).clip(-65000, 65000).astype(np.float32)
    x = np.concatenate([x, np.float32([-0.0, 2.0**-25, 3 * 2.0**-26, 2.0**-24 * 1.5, 65504, -65519])])
    half = float32_to_half(x)
    np.testing.assert_array_equal(half.view(np.uint16), x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(half_to_float32(half).view(np.uint32),
                                  half.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("zstd", [False, True])
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_topk_keeps_exactly_the_k_largest(zstd: bool, delta: bool, values: str) -> None:
    rng = np.random.default_rng(4)
    n, ratio = 1003, 0.05
    x = (rng.standard_normal(n) * rng.uniform(0.01, 10, n)).astype(np.float32)
    base = rng.standard_normal(n).astype(np.float32) if delta else None
    content = x - base if delta else x
    wire = encode(x, "topk", base=base, zstd=zstd, ratio=ratio, topk_values=values)
    k = math.ceil(ratio * n)
    assert wire["k"] == k == topk_count(n, ratio)
    index = topk_indices(wire)
    assert index.size == k and np.unique(index).size == k
    dropped = np.setdiff1d(np.arange(n), index)
    assert np.abs(content[index]).min() >= np.abs(content[dropped]).max()
    out = decode(wire, base=base)
    if delta:
        np.testing.assert_array_equal(out[dropped], base[dropped])
    else:
        assert (out[dropped] == 0).all()
    sent = content[index].astype(np.float16).astype(np.float32) if values == "fp16" else content[index]
    expect = base[index] + sent if delta else sent
    np.testing.assert_array_equal(out[index], expect)


def test_torch_tensor_in_equals_numpy_in() -> None:
    t = torch.randn(777)
    base = torch.randn(777)
    for codec in CODECS:
        a = encode(t, codec, base=base)
        b = encode(t.numpy(), codec, base=base.numpy())
        assert a == b
        np.testing.assert_array_equal(decode(a, base=base), decode(b, base=base.numpy()))


def test_empty_vector_round_trips() -> None:
    empty = np.zeros(0, dtype=np.float32)
    for codec in CODECS:
        for zstd in (False, True):
            assert decode(encode(empty, codec, zstd=zstd)).size == 0


floats32 = st.one_of(
    st.just(0.0),
    st.floats(-2.0**-120, 2.0**-120, width=32),  # tiny, subnormals included
    st.floats(-2.0**100, 2.0**100, width=32),
    st.floats(-3.0, 3.0, width=32),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=hnp.arrays(np.float32, st.integers(0, 700), elements=floats32),
       codec=st.sampled_from(CODECS), zstd=st.booleans(), delta=st.booleans(),
       block=st.sampled_from([1, 7, 64, 256]), seed=st.integers(0, 2**16))
def test_round_trip_property(x: np.ndarray, codec: str, zstd: bool, delta: bool, block: int,
                             seed: int) -> None:
    base = None
    if delta:
        base = (x + np.random.default_rng(seed).standard_normal(x.size)).astype(np.float32)
    content = x - base if delta else x
    if codec == "topk":
        wire = encode(x, "topk", base=base, zstd=zstd, ratio=0.1)
        out = decode(wire, base=base)
        index = topk_indices(wire)
        kept = np.zeros(x.size, dtype=bool)
        kept[index] = True
        np.testing.assert_array_equal(out[~kept], base[~kept] if delta else 0.0)
        if not delta:
            np.testing.assert_array_equal(out[kept], content[kept])
        if kept.any() and (~kept).any():
            assert np.abs(content[kept]).min() >= np.abs(content[~kept]).max()
        return
    if codec == "fp16" and x.size and np.abs(content).max() > F16_MAX:
        with pytest.raises(CodecError) as info:
            encode(x, codec, base=base, zstd=zstd)
        assert info.value.reason == "out_of_range"
        return
    check_round_trip(x, codec, zstd=zstd, base=base, block=block)


# --- error feedback -----------------------------------------------------------------------


def running_sum_errors(feedback: ErrorFeedback | None, codec: str, steps: int,
                       checkpoints: tuple[int, ...], **kwargs) -> list[float]:
    """Relative error ||sum decoded - sum inputs|| / ||sum inputs|| at each checkpoint."""
    rng = np.random.default_rng(5)
    g = rng.standard_normal(5000)
    sum_in = np.zeros_like(g)
    sum_out = np.zeros_like(g)
    errors = []
    for step in range(1, steps + 1):
        x = (g + 0.05 * rng.standard_normal(g.size)).astype(np.float32)  # slowly varying
        sum_out += decode(encode(x, codec, feedback=feedback, **kwargs))
        sum_in += x
        if step in checkpoints:
            errors.append(float(np.linalg.norm(sum_out - sum_in) / np.linalg.norm(sum_in)))
    return errors


def test_topk_error_feedback_makes_the_running_sum_converge() -> None:
    checkpoints = (10, 50, 200)
    with_fb = running_sum_errors(ErrorFeedback(), "topk", 200, checkpoints, ratio=0.05)
    without = running_sum_errors(None, "topk", 200, checkpoints, ratio=0.05)
    print(f"\nrelative error of the running sum at {checkpoints}: "
          f"with feedback {with_fb}, without {without}")
    assert with_fb[0] > with_fb[1] > with_fb[2]
    assert with_fb[2] < 0.06
    assert min(without) > 0.5  # topk alone drops the same mass every time


def test_int8_error_feedback_shrinks_the_running_sum_error() -> None:
    with_fb = running_sum_errors(ErrorFeedback(), "int8", 100, (10, 100), block=256)
    without = running_sum_errors(None, "int8", 100, (10, 100), block=256)
    assert with_fb[1] < with_fb[0] / 5
    assert with_fb[1] < without[1] / 5


def test_error_feedback_with_delta_tracks_the_residual() -> None:
    rng = np.random.default_rng(6)
    base = rng.standard_normal(2000).astype(np.float32)
    x = (base + 0.01 * rng.standard_normal(2000)).astype(np.float32)
    fb = ErrorFeedback()
    wire = fb.encode(x, "topk", base=base, ratio=0.1)
    out = decode(wire, base=base)
    # what was not sent is exactly what the feedback keeps (up to float32 rounding)
    np.testing.assert_allclose(fb.residual, (x - base) - (out - base), atol=1e-7)
    assert fb.norm > 0
    # lossless fp32 sends the residual along and clears it
    fb.encode(x, "fp32", base=base)
    assert fb.norm == 0
    fb.encode(x, "topk")
    with pytest.raises(CodecError) as info:
        fb.encode(x[:10], "topk")  # a stream must keep its vector length
    assert info.value.reason == "feedback_length"


# --- malformed input ----------------------------------------------------------------------


def valid(codec: str, zstd: bool = False, n: int = 300) -> dict:
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    return encode(x, codec, zstd=zstd, block=64, ratio=0.1)


def replace_payload(wire: dict, raw: bytes) -> dict:
    return {**wire, "zstd": False, "data": raw}


def raw_of(wire: dict) -> bytearray:
    data = wire["data"]
    return bytearray(zstandard.ZstdDecompressor().decompress(data) if wire["zstd"] else data)


def with_bytes(wire: dict, offset: int, value: bytes) -> dict:
    raw = raw_of(wire)
    raw[offset:offset + len(value)] = value
    return replace_payload(wire, bytes(raw))


NAN32 = np.float32(np.nan).tobytes()
MALFORMED = {
    "not a map": ([1, 2], "not_a_map"),
    "missing data": ({k: v for k, v in valid("fp32").items() if k != "data"}, "missing_key"),
    "unknown codec": ({**valid("fp32"), "codec": "bf16"}, "unknown_codec"),
    "codec not str": ({**valid("fp32"), "codec": 3}, "unknown_codec"),
    "extra key": ({**valid("fp32"), "scale": 1.0}, "unknown_key"),
    "int8 without block": ({k: v for k, v in valid("int8").items() if k != "block"}, "missing_key"),
    "n str": ({**valid("fp32"), "n": "300"}, "bad_n"),
    "n bool": ({**valid("fp32"), "n": True}, "bad_n"),
    "n negative": ({**valid("fp32"), "n": -1}, "bad_n"),
    "n float": ({**valid("fp32"), "n": 300.0}, "bad_n"),
    "n mismatch": ({**valid("fp32"), "n": 301}, "bad_length"),
    "n mismatch zstd": ({**valid("fp16", zstd=True), "n": 299}, "bad_length"),
    "zstd not bool": ({**valid("fp32"), "zstd": 1}, "bad_type"),
    "delta not bool": ({**valid("fp32"), "delta": "no"}, "bad_type"),
    "data str": ({**valid("fp32"), "data": "abc"}, "bad_type"),
    "data list": ({**valid("fp32"), "data": [1, 2]}, "bad_type"),
    "truncated raw": ({**valid("int8"), "data": valid("int8")["data"][:-1]}, "bad_length"),
    "padded raw": ({**valid("topk"), "data": valid("topk")["data"] + b"\0"}, "bad_length"),
    "truncated zstd": ({**valid("fp32", True), "data": valid("fp32", True)["data"][:-5]}, "zstd_error"),
    "zstd garbage": ({**valid("fp32"), "zstd": True, "data": b"\x13" * 200}, "zstd_error"),
    "raw bytes flagged zstd": ({**valid("fp16"), "zstd": True}, "zstd_error"),
    "zstd trailing data": ({**valid("fp32", True), "data": valid("fp32", True)["data"] + b"xx"},
                           "zstd_error"),
    "zstd oversize input": ({**valid("fp32"), "zstd": True, "data": b"\0" * 4000}, "bad_length"),
    "block zero": ({**valid("int8"), "block": 0}, "bad_block"),
    "block str": ({**valid("int8"), "block": "64"}, "bad_block"),
    "nan scale": (with_bytes(valid("int8"), 0, NAN32), "bad_scale"),
    "inf scale": (with_bytes(valid("int8"), 4, np.float32(np.inf).tobytes()), "bad_scale"),
    "negative scale": (with_bytes(valid("int8"), 0, np.float32(-1).tobytes()), "bad_scale"),
    "int8 -128": (with_bytes(valid("int8"), 4 * 5 + 3, b"\x80"), "bad_quant"),
    "scale overflows output": (with_bytes(valid("int8"), 0, np.float32(3e38).tobytes()), "not_finite"),
    "k above n": ({**valid("topk"), "k": 301}, "bad_k"),
    "k float": ({**valid("topk"), "k": 30.0}, "bad_k"),
    "topk values int4": ({**valid("topk"), "values": "int4"}, "bad_values"),
    "topk values list": ({**valid("topk"), "values": ["fp32"]}, "bad_values"),
    "duplicate index": (with_bytes(valid("topk"), 4 * 7, np.uint32(0).tobytes()), "duplicate_index"),
    "index out of range": (with_bytes(valid("topk"), 4 * 29, np.uint32(300).tobytes()), "index_range"),
    "index gap overflow": (with_bytes(valid("topk"), 0, np.uint32(2**32 - 1).tobytes()), "index_range"),
    "topk nan value": (with_bytes(valid("topk"), 4 * 30, NAN32), "not_finite"),
    "fp32 nan": (with_bytes(valid("fp32"), 8, NAN32), "not_finite"),
    "fp16 inf": (with_bytes(valid("fp16"), 2, np.float16(np.inf).tobytes()), "not_finite"),
    "delta without base": ({**valid("fp32"), "delta": True}, "needs_base"),
    "exact above n": ({**valid("int8"), "exact": 301}, "bad_exact"),
    "exact negative": ({**valid("int8"), "exact": -1}, "bad_exact"),
    "exact bool": ({**valid("topk"), "exact": True}, "bad_exact"),
    "exact on fp32": ({**valid("fp32"), "exact": 3}, "unknown_key"),
    "exact without its tail": ({**valid("fp16"), "exact": 10}, "bad_length"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_map_raises_codec_error(case: str) -> None:
    wire, reason = MALFORMED[case]
    with pytest.raises(CodecError) as info:
        decode(wire)
    assert info.value.reason == reason, str(info.value)


def test_delta_base_checks() -> None:
    x = np.ones(100, dtype=np.float32)
    wire = encode(x, "int8", base=np.zeros(100, dtype=np.float32))
    for base, reason in [(None, "needs_base"), (np.zeros(99, np.float32), "base_length"),
                         (np.full(100, np.nan, np.float32), "not_finite"),
                         (np.zeros((10, 10), np.float32), "bad_shape"), ([0.0] * 100, "bad_type")]:
        with pytest.raises(CodecError) as info:
            decode(wire, base=base)
        assert info.value.reason == reason
    # a finite delta on a finite base may still overflow float32
    huge = encode(np.full(4, 3e38, np.float32), "int8", base=np.full(4, 2e38, np.float32))
    del huge["base"]  # the checksum is optional; without it the overflow is what is caught
    with pytest.raises(CodecError) as info, np.errstate(all="raise"):  # still a CodecError
        decode(huge, base=np.full(4, 3.4e38, np.float32))
    assert info.value.reason == "not_finite"


def test_max_n_is_enforced_before_reading_data() -> None:
    wire = valid("fp32")
    with pytest.raises(CodecError) as info:
        decode(wire, max_n=299)
    assert info.value.reason == "bad_n"
    huge = {**wire, "n": 2**40, "data": b""}
    with pytest.raises(CodecError) as info:
        decode(huge)
    assert info.value.reason == "bad_n"


@pytest.mark.parametrize("declare_size", [True, False])
def test_zstd_bomb_is_refused_without_allocating(declare_size: bool) -> None:
    """50 MiB of zeros squeezed into ~1.6 kB, claiming to be a 1000-value fp32 vector."""
    bomb_size = 50 * 2**20
    cctx = zstandard.ZstdCompressor(level=3)
    if declare_size:
        data = cctx.compress(b"\0" * bomb_size)
    else:
        chunks = cctx.compressobj()
        data = b"".join(chunks.compress(b"\0" * 2**20) for _ in range(50)) + chunks.flush()
    assert len(data) < 4000
    wire = {"codec": "fp32", "n": 1000, "zstd": True, "delta": False, "data": data}
    tracemalloc.start()
    try:
        with pytest.raises(CodecError) as info:
            decode(wire)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason in {"bad_length", "zstd_error"}
    assert peak < 1 * 2**20, f"decoding a bomb allocated {peak} bytes"


wire_values = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(),
                        st.text(max_size=8), st.binary(max_size=64), st.lists(st.integers(), max_size=3))


@settings(max_examples=300, deadline=None)
@given(codec=st.sampled_from(CODECS), zstd=st.booleans(), key=st.sampled_from(
    ["codec", "n", "zstd", "delta", "data", "block", "k", "values", "exact", "extra"]),
       value=wire_values, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                         max_size=4))
def test_fuzzed_maps_decode_or_raise_codec_error(codec, zstd, key, value, flips) -> None:
    wire = valid(codec, zstd=zstd, n=97)
    data = bytearray(wire["data"])
    for offset, byte in flips:
        if data:
            data[offset % len(data)] = byte
    wire = {**wire, "data": bytes(data), key: value}
    try:
        out = decode(wire)
    except CodecError:
        return
    assert out.dtype == np.float32 and out.size == wire["n"] and np.isfinite(out).all()


def test_encode_refuses_bad_input() -> None:
    good = np.ones(10, dtype=np.float32)
    cases = [
        (lambda: encode(np.array([1.0, np.nan], np.float32)), "not_finite"),
        (lambda: encode(np.array([3e38], np.float32), "int8", base=np.array([-3e38], np.float32)),
         "not_finite"),
        (lambda: encode(np.ones((2, 5), np.float32)), "bad_shape"),
        (lambda: encode(np.arange(10)), "bad_dtype"),
        (lambda: encode(torch.arange(10)), "bad_dtype"),
        (lambda: encode([1.0, 2.0]), "bad_type"),
        (lambda: encode(good, base=np.ones(9, np.float32)), "base_length"),
        (lambda: encode(good, "zfp"), "unknown_codec"),
        (lambda: encode(good, "topk", ratio=0.0), "bad_ratio"),
        (lambda: encode(good, "topk", topk_values="int8"), "bad_values"),
        (lambda: encode(good, "int8", block=0), "bad_block"),
    ]
    for make, reason in cases:
        with pytest.raises(CodecError) as info:
            make()
        assert info.value.reason == reason


# --- the wire map -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 10, 100, 20000, 200000])
def test_wire_map_shape_and_encoded_size(n: int) -> None:
    x = np.random.default_rng(8).standard_normal(n).astype(np.float32)
    for codec in CODECS:
        for zstd in (False, True):
            wire = encode(x, codec, zstd=zstd)
            assert isinstance(wire["codec"], str) and len(wire["codec"]) <= 16
            assert isinstance(wire["n"], int) and isinstance(wire["data"], bytes)
            assert all(isinstance(v, int | float | str | bool) for k, v in wire.items() if k != "data")
            packed = msgpack.packb(wire, use_bin_type=True)
            assert encoded_size(wire) == len(packed)
            back = msgpack.unpackb(packed, raw=False)
            np.testing.assert_array_equal(decode(back), decode(wire))


# --- the reference CNN ----------------------------------------------------------------------


def sgd_update(arch: str = "cnn28", steps: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(u, v): a seeded init and the same model after `steps` SGD steps (lr 0.05, batch 32)
    on random 28x28 inputs and labels; v - u is a realistic small update."""
    model = build_model(arch, seed=seed)
    u = to_vector(model).numpy().copy()
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shape = model_spec(arch).input_shape
    for _ in range(steps):
        x = torch.randn(32, *shape, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return u, to_vector(model).numpy().copy()


def test_reference_cnn_update_bytes_are_ordered() -> None:
    u, v = sgd_update("cnn28")
    assert v.size == model_spec("cnn28").numel
    sizes = {}
    for zstd in (False, True):
        for codec in CODECS:
            wire = encode(v, codec, base=u, zstd=zstd, ratio=0.05)
            sizes[codec, zstd] = encoded_size(wire)
            out = decode(wire, base=u)
            print(f"cnn28 delta {codec:5s} zstd={zstd!s:5s} {sizes[codec, zstd]:7d} B  "
                  f"max err {np.abs(out - v).max():.2e}")
        assert sizes["fp32", zstd] > sizes["fp16", zstd] > sizes["int8", zstd] > sizes["topk", zstd]
    assert sizes["fp32", False] >= 4 * v.size
    assert sizes["fp32", False] > sizes["fp32", True]  # XOR delta compresses


def test_delta_names_its_base_and_another_base_is_refused() -> None:
    base = np.linspace(-1, 1, 300, dtype=np.float32)
    v = base + 0.01
    for codec in CODECS:
        wire = encode(v, codec, base=base)
        assert wire["base"] == base_checksum(base)
        decode(wire, base=base)  # the right base decodes
        other = base.copy()
        other[7] += 1e-3
        with pytest.raises(CodecError) as info:
            decode(wire, base=other)
        assert info.value.reason == "base_mismatch"
    bad = encode(v, "int8", base=base)
    bad["base"] = "x"
    with pytest.raises(CodecError) as info:
        decode(bad, base=base)
    assert info.value.reason == "bad_base"


def test_agents_send_topk_with_error_feedback_and_the_ablation_drops_it() -> None:
    """Both agent kinds keep one ErrorFeedback for their uplink when the codec is topk: the
    second upload carries what the first left out (the running sum of what the server decodes
    tracks the sum of the updates); codec.error_feedback=false drops it."""
    import torch

    from edge_agent.protocol_client import EdgeAgent, Installed
    from edge_agent.round_agent import RoundAgent
    from fedmq.config import load_config
    from fedmq.data import load_dataset
    from fedmq.models import build_model, to_vector

    ds = load_dataset("digits")
    w0 = to_vector(build_model("digits-cnn", seed=0))
    step = torch.from_numpy(np.random.default_rng(0).normal(0, 0.01, w0.numel()).astype(np.float32))
    sums = {}
    for feedback in (True, False):
        cfg = load_config(None, {"codec.name": "topk", "codec.error_feedback": feedback})
        agent = EdgeAgent(cfg, "car-1")
        assert (agent.feedback is not None) == feedback
        assert (RoundAgent(cfg, "van-1", ds.x[:8], ds.y[:8]).feedback is not None) == feedback
        agent.installed = Installed(epoch=0, vector=w0.clone(), alpha=None, kind="personalized")
        got = np.zeros(w0.numel(), dtype=np.float64)
        for _ in range(40):  # the same update again and again, each against the same base
            env = agent.update_envelope(w0 + step, 10)
            got += decode(env.tensor, base=w0.numpy()) - w0.numpy()
        sums[feedback] = np.linalg.norm(got - 40 * step.numpy()) / np.linalg.norm(40 * step.numpy())
    assert sums[True] < 0.25 < 0.5 < sums[False]  # with feedback the dropped part arrives later


def test_downlink_codec_is_its_own_setting_and_an_unknown_one_stops_the_start(tmp_path) -> None:
    """codec.downlink=int8 under a topk uplink: the aggregator's replies are int8 (the agent's
    model whole), what agents send stays topk; an unknown downlink codec is a one-line
    ConfigError when the engine is built, not a failure at the first reply."""
    from aggregator.bootstrap import build_engine
    from fedmq import protocol
    from fedmq.config import ConfigError
    from soak.fleet_setup import pretrained_state, small_config
    from tests.engine_client import EngineClient

    state = pretrained_state(tmp_path / "state")
    cfg = small_config("mqtt://127.0.0.1:1", state, "f", **{"codec.name": "topk", "codec.downlink": "int8"})
    engine = build_engine(cfg)
    engine.recover()
    client = EngineClient(engine, "car-1", model_spec("digits-cnn"))
    assert cfg.codec.uses_feedback() and cfg.codec.encoder_params() == {"ratio": cfg.codec.topk_ratio}
    up = client.update(encode(client.base * 1.01, "topk", base=client.base, ratio=0.05))
    reply = client.send(up)
    assert isinstance(reply, protocol.Model) and reply.tensors[0]["codec"] == "int8"
    engine.journal.close()
    other = pretrained_state(tmp_path / "other", cache=state)
    bad = small_config("mqtt://127.0.0.1:1", other, "f", **{"codec.downlink": "bf16"})
    with pytest.raises(ConfigError, match="codec.downlink: unknown codec 'bf16'"):
        build_engine(bad)


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk"])
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("zstd", [False, True])
def test_the_exact_tail_travels_as_float32_and_the_rest_as_the_codec_sends_it(codec, delta, zstd) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    x[-40:] = rng.uniform(1e-3, 1e-2, 40)  # small variances beside weights ten times larger
    base = (x + 0.01 * rng.standard_normal(1000)).astype(np.float32) if delta else None
    feedback = ErrorFeedback()
    wire = encode(x, codec, base=base, zstd=zstd, block=64, ratio=0.1, exact=40, feedback=feedback)
    out = decode(wire, base=base)
    assert wire["exact"] == 40 and out.dtype == np.float32 and out.size == 1000
    if base is None:
        assert out[-40:].tobytes() == x[-40:].tobytes()
        head = decode(encode(x[:-40], codec, zstd=zstd, block=64, ratio=0.1))
        assert out[:-40].tobytes() == head.tobytes()  # the codec's part is what it sends alone
    else:  # the delta travels exactly; adding it back rounds once in float32
        assert np.abs(out[-40:] - x[-40:]).max() <= np.spacing(np.abs(x[-40:])).max()
    assert not feedback.residual[-40:].any()
    assert encode(x, codec, block=64, ratio=0.1, exact=0).keys() == encode(x, codec, block=64, ratio=0.1).keys()
    with pytest.raises(CodecError) as info:
        encode(x, codec, exact=1001)
    assert info.value.reason == "bad_exact"


def test_a_batch_norm_models_running_statistics_travel_as_float32_by_default() -> None:
    """Blocks of 256 that share a large variance with small ones zero the small ones; with the
    statistics sent exact (the default) every one arrives as it was."""
    spec, model = model_spec("resnet20"), build_model("resnet20", seed=0)
    stats = sum(b.numel() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var")))
    assert spec.statistics_numel == stats > 0 and model_spec("resnet20-gn").statistics_numel == 0
    rng = np.random.default_rng(1)
    for name, b in model.named_buffers():  # means of 0.1-0.2, variances of 0.001-0.01 and one of 5
        if name.endswith(("running_mean", "running_var")):
            low, high = (0.1, 0.2) if name.endswith("mean") else (1e-3, 1e-2)
            b.copy_(torch.from_numpy(rng.uniform(low, high, b.numel()).astype(np.float32)))
        if name.endswith("running_var"):
            b[0] = 5.0
    vector = to_vector(model).numpy()
    codec = Config().codec
    params = codec.encoder_params(statistics=stats)
    assert params == {"block": 256, "exact": stats} and codec.downlink_codec(stats) == ("int8", params)
    out = decode(encode(vector, "int8", **params))
    assert out[-stats:].tobytes() == vector[-stats:].tobytes() and out[-stats:].all()
    blocks = decode(encode(vector, "int8", block=256))  # the statistics coded like the weights
    assert (blocks[-stats:] == 0).sum() > stats // 4, (blocks[-stats:] == 0).sum()
    codec.exact_statistics = False
    assert codec.encoder_params(statistics=stats) == {"block": 256}
    assert Config().codec.encoder_params("fp32", statistics=stats) == {}


@pytest.mark.slow
def test_the_statistics_codec_script_scores_every_row_and_a_model_without_statistics_is_unchanged(tmp_path) -> None:
    """scripts/statistics_codec.py as docs/codecs.md runs it, on the digits scenario (no batch norm, seconds
    of pre-training): every row is there, and with no statistics the exact tail sends what int8 sent."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "statistics_codec.py"
    loaded = importlib.util.spec_from_file_location("statistics_codec", path)
    script = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(script)
    assert script.main(["--scenario", "rotated-digits", "--out", str(tmp_path / "t.json")]) == 0
    table = json.loads((tmp_path / "t.json").read_text())
    rows = table["accuracy_per_cluster"]
    assert table["statistics"] == 0 and len(rows) == 6 and all(len(r) == 3 for r in rows.values())
    assert rows["int8 on everything"] == rows["int8, statistics as float32 (the default)"]
    assert min(rows["exact (fp32)"]) > 0.5
