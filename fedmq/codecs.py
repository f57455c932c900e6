"""Model codecs: a flat float32 parameter vector <-> a small msgpack-ready map.

A model (or, better, its delta from a base both sides hold) travels as one map:

    {"codec": "int8", "n": 106154, "zstd": True, "delta": True, "data": b"...", "block": 256}

`data` is the codec's raw payload (little-endian), optionally compressed by one zstd frame.
Codec-specific keys are scalars only, so the wire protocol can check the outer shape
without knowing the codec. A delta map (`"delta": True`) also carries ``base``, the CRC-32
of the base's float32 bytes, so a receiver that holds another base refuses it
(`base_mismatch`) instead of decoding noise.

- ``fp32``: the values as float32, exact. With a base, the payload is the bitwise XOR of
  the float32 bit patterns of vector and base: arithmetic (v - b) + b is not always v in
  float32, XOR is, and near-equal floats share their high bits, so zstd shrinks it.
- ``fp16``: the values (or v - b) as float16: relative error <= 2^-11, absolute error
  <= 2^-25 below fp16's normal range; a value beyond +-65504 cannot be sent (CodecError).
- ``int8``: blockwise symmetric quantization, key ``block``. Per block of `block` values
  one float32 scale s = max|x| / 127 and q = round(x / s) in [-127, 127]; error <= s / 2.
  Payload: ceil(n / block) float32 scales, then n int8 values.
- ``topk``: the k = ceil(ratio * n) largest-magnitude entries, keys ``k`` and ``values``
  ("fp32" or "fp16"). Payload: k uint32 index gaps (indices ascending; the first gap is
  the first index, each next gap >= 1, so indices are unique by construction and gaps
  compress well), then k values. The rest decode as zero (or as the base, with delta).

Any lossy map may carry ``exact``: its last `exact` values (of the content: the delta when
there is a base) travel as float32 after the codec's own payload, which then covers the first
n - exact. A model's vector ends with its running statistics (batch norm's means and
variances, fedmq/models.py `state_tensors`); an int8 block that mixes them with weights
quantizes a small variance to 0 and the layer divides by sqrt(eps) (MobileNetV3-small on
shapes: 0.81 accuracy decoded exact, 0.47 through int8 blocks of 256).

`decode` validates the whole map (types, n against `max_n`, payload length against n,
zstd output bounded by the expected size, index range and order, finite scales and output)
before it trusts anything, and raises `CodecError` with a short `reason` for anything
malformed: never another exception type on bad input.

`ErrorFeedback` is the sender-side memory of what a lossy codec did not send (see there).
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zstandard

TOPK_VALUE_DTYPES = ("fp32", "fp16")
ZSTD_LEVEL = 3
MAX_N = 2**28
MAX_BLOCK = 2**20

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U32 = np.dtype("<u4")
_I8 = np.dtype("i1")
_VALUE_DTYPE = {"fp32": _F32, "fp16": _F16}
_FP16_MAX = float(np.finfo(np.float16).max)

_BASE_KEYS = frozenset({"codec", "n", "zstd", "delta", "data"})
_OPTIONAL_KEYS = frozenset({"base", "exact"})
_CODEC_KEYS: dict[str, frozenset[str]] = {"fp32": frozenset()}
"""Codec -> its own map keys (the lossy ones are added from LOSSY below)."""


class CodecError(ValueError):
    """A vector that cannot be encoded or a map that cannot be decoded.

    `reason` is a short code (e.g. "bad_length", "needs_base", "not_finite") that a
    receiver can put into its error reply.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ErrorFeedback:
    """Sender-side residual memory for lossy codecs (topk above all; int8 and fp16 too).

    Each encode compresses ``content + residual`` instead of ``content`` (content being the
    vector, or vector - base with delta) and keeps ``residual := (content + residual) -
    what the receiver will decode``. Nothing is lost, only delayed: after T messages the
    sum of decoded contents equals the sum of inputs minus the current residual, which
    stays bounded, so the relative error of the running sum shrinks like 1/T; without
    feedback, topk drops the same small entries every time and the error never shrinks.

    Keep one instance per stream (per agent and direction) and per vector layout; a
    residual of the wrong length is a CodecError("feedback_length"). `reset()` when the
    stream restarts (a new model spec, a resync to a full model).
    """

    def __init__(self) -> None:
        self.residual: np.ndarray | None = None

    def encode(self, vector: Any, codec: str = "topk", **kwargs: Any) -> dict:
        """`encode(vector, codec, feedback=self, **kwargs)`."""
        return encode(vector, codec, feedback=self, **kwargs)

    def reset(self) -> None:
        self.residual = None

    @property
    def norm(self) -> float:
        """L2 norm of what has not been sent yet (0 before the first encode)."""
        return 0.0 if self.residual is None else float(np.linalg.norm(self.residual.astype(np.float64)))


def _as_vector(value: Any, what: str) -> np.ndarray:
    """A 1-D float32 numpy array from a numpy array or torch tensor (no copy if possible)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise CodecError("bad_dtype", f"{what} must be a floating tensor, got {value.dtype}")
        value = value.detach().to(device="cpu", dtype=torch.float32).numpy()
    if not isinstance(value, np.ndarray):
        raise CodecError("bad_type", f"{what} must be a numpy array or torch tensor, got {type(value).__name__}")
    if value.ndim != 1:
        raise CodecError("bad_shape", f"{what} must be 1-D, got shape {value.shape}")
    if value.dtype.kind != "f":
        raise CodecError("bad_dtype", f"{what} must be floating, got {value.dtype}")
    return np.ascontiguousarray(value, dtype=np.float32)


def _require_finite(x: np.ndarray, what: str) -> None:
    if x.size and not np.isfinite(x).all():
        raise CodecError("not_finite", f"{what} holds NaN or Inf")


def _payload_size(codec: str, n: int, params: dict) -> int:
    """Bytes of the uncompressed payload a valid map of this codec and n must carry."""
    if codec == "fp32":
        return 4 * n
    exact = params.get("exact", 0)
    return LOSSY[codec].payload_size(n - exact, params) + 4 * exact


# --- encoders: content (float32) -> (payload bytes, codec keys, reconstruction) ------------
# The reconstruction is what decode() will return for this content (before adding a base);
# ErrorFeedback needs it, so it is computed only when asked for.


def _torch_or_none() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; numpy is the fallback
        return None
    return torch


def float32_to_half(x: np.ndarray) -> np.ndarray:
    """float32 -> float16, round to nearest even. numpy takes a slow path for fp16 subnormals
    (15-300x slower on small update deltas); torch's conversion is vectorized and gives the
    same bits, so it is used when torch is importable."""
    torch = _torch_or_none()
    if torch is None:
        return x.astype(_F16)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).half().numpy()


def half_to_float32(h: np.ndarray) -> np.ndarray:
    torch = _torch_or_none()
    if torch is None:
        return h.astype(np.float32)
    return torch.from_numpy(np.array(h, dtype=_F16)).float().numpy()


def _encode_fp16(content: np.ndarray, want_recon: bool) -> tuple[bytes, dict, np.ndarray | None]:
    if content.size and float(np.abs(content).max()) > _FP16_MAX:
        raise CodecError("out_of_range", f"a value beyond +-{_FP16_MAX:g} cannot be sent as fp16")
    half = float32_to_half(content)
    return half.tobytes(), {}, half_to_float32(half) if want_recon else None


def _int8_quantize(content: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales float32 per block, q int8): q = round(x / s), |q| <= 127, |x - q s| <= s / 2."""
    n = content.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float64)
    padded[:n] = content
    padded = padded.reshape(blocks, block)
    peak = np.abs(padded).max(axis=1) if blocks else np.zeros(0)
    scales = (peak / 127.0).astype(np.float32)
    # Rounding the scale to float32 may shrink it; nudge it up so |x / s| <= 127 always.
    low = scales.astype(np.float64) * 127.0 < peak
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    safe = np.where(scales > 0, scales, 1.0).astype(np.float64)
    q = np.rint(padded / safe[:, None])
    np.clip(q, -127, 127, out=q)
    return scales, q.astype(_I8).reshape(-1)[:n]


def _int8_dequantize(scales: np.ndarray, q: np.ndarray, block: int) -> np.ndarray:
    n = q.size
    blocks = scales.size
    out = np.zeros(blocks * block, dtype=np.float32)
    out[:n] = q
    out = out.reshape(blocks, block)
    out *= scales[:, None]
    return out.reshape(-1)[:n]


def _encode_int8(content: np.ndarray, block: int, want_recon: bool) -> tuple[bytes, dict, np.ndarray | None]:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise CodecError("bad_block", f"block must be an int in 1..{MAX_BLOCK}, got {block!r}")
    scales, q = _int8_quantize(content, block)
    payload = scales.astype(_F32).tobytes() + q.tobytes()
    recon = _int8_dequantize(scales, q, block) if want_recon else None
    return payload, {"block": block}, recon


def topk_count(n: int, ratio: float) -> int:
    """k = ceil(ratio * n), at least 1 for a non-empty vector, at most n."""
    if not (isinstance(ratio, int | float) and not isinstance(ratio, bool) and 0 < ratio <= 1):
        raise CodecError("bad_ratio", f"ratio must be in (0, 1], got {ratio!r}")
    return min(n, max(1 if n else 0, math.ceil(ratio * n)))


def _encode_topk(content: np.ndarray, ratio: float, values: str,
                 want_recon: bool) -> tuple[bytes, dict, np.ndarray | None]:
    if values not in TOPK_VALUE_DTYPES:
        raise CodecError("bad_values", f"topk values must be one of {TOPK_VALUE_DTYPES}, got {values!r}")
    n = content.size
    k = topk_count(n, ratio)
    if k == n:
        index = np.arange(n, dtype=np.int64)
    else:
        index = np.sort(np.argpartition(np.abs(content), n - k)[n - k:])
    kept = content[index]
    if values == "fp16" and k and float(np.abs(kept).max()) > _FP16_MAX:
        raise CodecError("out_of_range", f"a kept value beyond +-{_FP16_MAX:g} cannot be sent as fp16")
    gaps = np.diff(index, prepend=0).astype(_U32)
    sent = float32_to_half(kept) if values == "fp16" else kept
    recon = None
    if want_recon:
        recon = np.zeros(n, dtype=np.float32)
        recon[index] = sent
    return gaps.tobytes() + sent.tobytes(), {"k": k, "values": values}, recon


def _decode_fp16(raw: bytes, n: int, params: dict) -> np.ndarray:
    return half_to_float32(np.frombuffer(raw, dtype=_F16))


def _check_int8(wire: dict, n: int) -> dict:
    return {"block": _check_int(wire, "block", 1, MAX_BLOCK, "bad_block")}


def _decode_int8(raw: bytes, n: int, params: dict) -> np.ndarray:
    block = params["block"]
    blocks = -(-n // block)
    scales = np.frombuffer(raw, dtype=_F32, count=blocks)
    if blocks and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError("bad_scale", "int8 scales must be finite and non-negative")
    q = np.frombuffer(raw, dtype=_I8, offset=4 * blocks)
    if n and int(q.min()) < -127:
        raise CodecError("bad_quant", "int8 values must lie in -127..127")
    return _int8_dequantize(scales.astype(np.float32), q, block)


def _check_topk(wire: dict, n: int) -> dict:
    k = _check_int(wire, "k", 0, n, "bad_k")
    if not isinstance(wire["values"], str) or wire["values"] not in TOPK_VALUE_DTYPES:
        raise CodecError("bad_values", f"topk values must be one of {TOPK_VALUE_DTYPES}, got {wire['values']!r}")
    return {"k": k, "values": wire["values"]}


def _decode_topk(raw: bytes, n: int, params: dict) -> np.ndarray:
    k = params["k"]
    gaps = np.frombuffer(raw, dtype=_U32, count=k).astype(np.int64)
    if k > 1 and int(gaps[1:].min()) < 1:
        raise CodecError("duplicate_index", "topk indices must be strictly ascending (gaps >= 1)")
    index = np.cumsum(gaps)
    if k and int(index[-1]) >= n:
        raise CodecError("index_range", f"topk index {int(index[-1])} out of range for n={n}")
    values = np.frombuffer(raw, dtype=_VALUE_DTYPE[params["values"]], offset=4 * k)
    if params["values"] == "fp16":
        values = half_to_float32(values)
    content = np.zeros(n, dtype=np.float32)
    content[index] = values
    return content


@dataclass(frozen=True)
class LossyCodec:
    """One lossy codec: everything `encode` and `decode` need from it, in one place.

    It works on the content (the vector, or vector - base) and never sees the base: the
    delta, the base checksum, zstd, error feedback and the map's outer checks are shared.
    Adding a codec is one entry in LOSSY (and its knob in config.CodecSettings.encoder_params).
    """

    keys: frozenset[str]
    """Its scalar keys in the map, besides codec, n, zstd, delta, data (and base)."""
    encode: Callable[[np.ndarray, dict, bool], tuple[bytes, dict, np.ndarray | None]]
    """(content, options {block, ratio, values}, want the reconstruction) -> (payload, keys, recon)."""
    check: Callable[[dict, int], dict]
    """(map, n) -> its validated keys, or CodecError."""
    payload_size: Callable[[int, dict], int]
    """(n, keys) -> bytes of the uncompressed payload."""
    decode: Callable[[bytes, int, dict], np.ndarray]
    """(payload, n, keys) -> the content, or CodecError."""


LOSSY: dict[str, LossyCodec] = {
    "fp16": LossyCodec(frozenset(), lambda c, o, r: _encode_fp16(c, r), lambda w, n: {},
                       lambda n, p: 2 * n, _decode_fp16),
    "int8": LossyCodec(frozenset({"block"}), lambda c, o, r: _encode_int8(c, o["block"], r),
                       _check_int8, lambda n, p: 4 * (-(-n // p["block"])) + n, _decode_int8),
    "topk": LossyCodec(frozenset({"k", "values"}),
                       lambda c, o, r: _encode_topk(c, o["ratio"], o["values"], r), _check_topk,
                       lambda n, p: p["k"] * (4 + _VALUE_DTYPE[p["values"]].itemsize), _decode_topk),
}
"""Codec name -> its implementation; fp32 (lossless, an XOR with the base) is the one other."""
CODECS: tuple[str, ...] = ("fp32", *LOSSY)
"""Every codec name a map may carry."""
_CODEC_KEYS.update({name: c.keys for name, c in LOSSY.items()})


def encode(vector: Any, codec: str = "int8", *, base: Any = None, zstd: bool = True,
           block: int = 256, ratio: float = 0.05, feedback: ErrorFeedback | None = None,
           topk_values: str = "fp32", level: int = ZSTD_LEVEL, exact: int = 0) -> dict:
    """Encode a 1-D float vector (numpy or torch) as a wire map; see the module docstring.

    Keywords: `base` (same length, held by the receiver too: the map carries the delta
    and is marked "delta": True), `zstd` (default True), `block` (int8's block size, 256),
    `ratio` (topk's share of kept entries, 0.05), `topk_values` ("fp32" or "fp16"),
    `feedback` (an ErrorFeedback: its residual is added first, and what this message
    leaves out is kept), `level` (zstd's level, 3), `exact` (a lossy codec's last values
    sent as float32: a model's running statistics, `ModelSpec.statistics_numel`; 0).
    """
    with np.errstate(all="ignore"):  # overflow is checked explicitly, never warned or raised
        return _encode(vector, codec, base, zstd, block, ratio, feedback, topk_values, level, exact)


def _encode(vector: Any, codec: str, base: Any, zstd: bool, block: int, ratio: float,
            feedback: ErrorFeedback | None, topk_values: str, level: int, exact: int = 0) -> dict:
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError("unknown_codec", f"codec must be one of {CODECS}, got {codec!r}")
    x = _as_vector(vector, "vector")
    _require_finite(x, "vector")
    b = None
    if base is not None:
        b = _as_vector(base, "base")
        if b.size != x.size:
            raise CodecError("base_length", f"base has {b.size} values, vector {x.size}")
        _require_finite(b, "base")
    n = x.size
    if n > MAX_N:
        raise CodecError("bad_n", f"vector of {n} values exceeds {MAX_N}")
    if isinstance(exact, bool) or not isinstance(exact, int) or not 0 <= exact <= n:
        raise CodecError("bad_exact", f"exact must be an int in 0..{n}, got {exact!r}")
    if codec == "fp32":
        exact = 0  # every value is exact already

    residual = None
    if feedback is not None and feedback.residual is not None:
        residual = feedback.residual
        if residual.size != n:
            raise CodecError("feedback_length", f"feedback holds {residual.size} values, vector {n}")
    want_recon = feedback is not None

    if codec == "fp32":
        # Lossless: the residual (left by an earlier lossy message) is sent in full.
        target = x if residual is None else x + residual
        _require_finite(target, "vector + feedback residual")
        bits = target.view(_U32)
        payload = (bits ^ b.view(_U32) if b is not None else bits).astype(_U32).tobytes()
        params: dict = {}
        if feedback is not None:
            feedback.residual = np.zeros(n, dtype=np.float32)
    else:
        content = x - b if b is not None else x
        _require_finite(content, "vector - base")
        if residual is not None:
            content = content + residual
            _require_finite(content, "content + feedback residual")
        options = {"block": block, "ratio": ratio, "values": topk_values}
        payload, params, recon = LOSSY[codec].encode(content[:n - exact], options, want_recon)
        if exact:
            tail = content[n - exact:].astype(_F32)
            payload += tail.tobytes()
            params = {**params, "exact": exact}
            recon = None if recon is None else np.concatenate([recon, tail])
        if feedback is not None:
            feedback.residual = (content - recon).astype(np.float32)

    if zstd:
        payload = zstandard.ZstdCompressor(level=level).compress(payload)
    wire = {"codec": codec, "n": n, "zstd": bool(zstd), "delta": b is not None, "data": payload, **params}
    if b is not None:
        wire["base"] = base_checksum(b)
    return wire


def base_checksum(base: Any) -> int:
    """CRC-32 of the base's float32 bytes: a delta map names the base it was taken against,
    so a receiver holding another base refuses it ("base_mismatch") instead of decoding noise."""
    return zlib.crc32(_as_vector(base, "base").tobytes())


def _check_int(wire: dict, key: str, low: int, high: int, reason: str) -> int:
    value = wire[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CodecError(reason, f"{key!r} must be an int in {low}..{high}, got {value!r}")
    return value


def _check_map(wire: Any, max_n: int) -> tuple[str, int, dict]:
    """Validate the map's shape and scalars: (codec, n, codec params)."""
    if not isinstance(wire, dict):
        raise CodecError("not_a_map", f"an encoded vector is a map, got {type(wire).__name__}")
    missing = _BASE_KEYS - wire.keys()
    if missing:
        raise CodecError("missing_key", f"missing {', '.join(sorted(map(str, missing)))}")
    codec = wire["codec"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError("unknown_codec", f"codec must be one of {CODECS}, got {codec!r}")
    required = _BASE_KEYS | _CODEC_KEYS[codec]
    unknown = wire.keys() - required - _OPTIONAL_KEYS
    if unknown:
        raise CodecError("unknown_key", f"{codec} map has unexpected keys {sorted(map(repr, unknown))}")
    missing = required - wire.keys()
    if missing:
        raise CodecError("missing_key", f"{codec} map lacks {', '.join(sorted(missing))}")
    n = _check_int(wire, "n", 0, max_n, "bad_n")
    exact = 0
    if "exact" in wire:
        if codec not in LOSSY:
            raise CodecError("unknown_key", f"{codec} map has unexpected keys ['exact']")
        exact = _check_int(wire, "exact", 0, n, "bad_exact")
    if "base" in wire:
        _check_int(wire, "base", 0, 2**32 - 1, "bad_base")
    for key in ("zstd", "delta"):
        if not isinstance(wire[key], bool):
            raise CodecError("bad_type", f"{key!r} must be a bool, got {type(wire[key]).__name__}")
    if not isinstance(wire["data"], bytes | bytearray):
        raise CodecError("bad_type", f"'data' must be bytes, got {type(wire['data']).__name__}")
    params = LOSSY[codec].check(wire, n - exact) if codec in LOSSY else {}
    return codec, n, {**params, "exact": exact} if exact else params


def _payload(wire: dict, expected: int) -> bytes:
    """The raw payload, exactly `expected` bytes; zstd output can never exceed that."""
    data = bytes(wire["data"])
    if not wire["zstd"]:
        if len(data) != expected:
            raise CodecError("bad_length", f"payload has {len(data)} bytes, expected {expected}")
        return data
    # A zstd frame is never much larger than its input; refuse absurd sizes unread.
    if len(data) > expected + expected // 128 + 1024:
        raise CodecError("bad_length", f"zstd payload of {len(data)} bytes for {expected} raw bytes")
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError("zstd_error", f"not a zstd frame: {exc}") from None
    # decompress() trusts a declared size over max_output_size, so check it first.
    if declared != -1 and declared != expected:
        raise CodecError("bad_length", f"zstd frame declares {declared} bytes, expected {expected}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=max(expected, 1), allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError("zstd_error", f"zstd payload does not decompress to {expected} bytes: {exc}") from None
    if len(raw) != expected:
        raise CodecError("bad_length", f"zstd payload decompressed to {len(raw)} bytes, expected {expected}")
    return raw


def decode(wire: Any, base: Any = None, *, max_n: int = MAX_N) -> np.ndarray:
    """The float32 vector (length n) a map encodes; CodecError on anything malformed.

    A delta map needs the `base` it was made against (CodecError "needs_base" without it).
    A decoded vector with NaN or Inf is refused ("not_finite").
    """
    with np.errstate(all="ignore"):  # overflow becomes "not_finite", never a warning
        return _decode(wire, base, max_n)


def _decode(wire: Any, base: Any, max_n: int) -> np.ndarray:
    codec, n, params = _check_map(wire, max_n)
    b = None
    if wire["delta"]:
        if base is None:
            raise CodecError("needs_base", "a delta map needs the base it was encoded against")
        b = _as_vector(base, "base")
        if b.size != n:
            raise CodecError("base_length", f"base has {b.size} values, map has n={n}")
        _require_finite(b, "base")
        if "base" in wire and wire["base"] != base_checksum(b):
            raise CodecError("base_mismatch", "the delta was taken against another base than "
                                              "the one held here")
    raw = _payload(wire, _payload_size(codec, n, params))

    if codec == "fp32":
        bits = np.frombuffer(raw, dtype=_U32)
        out = (bits ^ b.view(_U32) if b is not None else bits.copy()).view(np.float32)
        _require_finite(out, "decoded vector")
        return out
    exact = params.get("exact", 0)
    if not exact:
        content = LOSSY[codec].decode(raw, n, params)
    else:  # slicing copies the payload: only a map with a tail pays for it
        cut = len(raw) - 4 * exact
        content = np.concatenate([LOSSY[codec].decode(raw[:cut], n - exact, params),
                                  np.frombuffer(raw, dtype=_F32, offset=cut)])
    out = content + b if b is not None else content
    _require_finite(out, "decoded vector")
    return out


def _bin_header(length: int) -> int:
    return 2 if length < 2**8 else 3 if length < 2**16 else 5


def encoded_size(wire: dict) -> int:
    """Bytes this map costs inside a msgpack envelope (exact, without copying the payload)."""
    data = wire.get("data", b"")
    shell = msgpack.packb({**wire, "data": b""}, use_bin_type=True)
    return len(shell) - _bin_header(0) + _bin_header(len(data)) + len(data)
