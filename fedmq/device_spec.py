"""What a device needs beside the model graph, published by the aggregator (docs/protocol.md,
"Device spec").

The model spec says what a weight vector means; a device that runs no Python also needs what
fedmq's loaders and sketch do on the Python side: how raw pixels become the model's input
(scale, per-channel mean and std), what each output means (label names), which layers it may
train alone (the head), and the CDFL sketch's random feature map, numpy's PCG64 stream that
another language cannot reproduce cheaply, so it travels as a blob. The aggregator publishes
all of it retained on `fedmq/{fleet}/model/device` (`protocol.device_spec`) and names its hash
in its status (`graph.device_spec`), so a device knows when it changed.

The spec proper is canonical JSON (sorted keys, no spaces); its hash is the first 16 hex
digits of its SHA-256, as the model spec's; the feature map is covered through its SHA-256 in
the JSON. The spec's message is one msgpack map, `spec` (str) and `pieces` (int); the feature
map follows in that many pieces of at most PIECE_BYTES, each retained on its own topic
`fedmq/{fleet}/model/device/{i}` (`protocol.device_spec_piece`) as a msgpack map `spec` (the
hash), `index`, `data`: a small device's MQTT buffer takes no message of megabytes, and a reader
on a slow link (Mosquitto 2.0.11 sends a WebSocket subscriber about 45 KB/s) reads the spec at
once and the map later, or not at all.

`reference_normalize` and `reference_sketch` define bit for bit what a device computes (the
sketch in float64, summed in a fixed order, so every language gets the same float16 bits);
`published_vectors` holds the numbers docs/protocol.md publishes for them and for every codec.

    python -m fedmq.device_spec vectors      # the test vectors, as docs/protocol.md prints them
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from fedmq import codecs, sketch
from fedmq.errors import RuntimeFailure
from fedmq.models import ModelSpec

FORMAT = "fedmq-device-spec/1"
"""The spec's `format`: a device refuses another."""

MAX_FEATURE_MAP_BYTES = 32 * 1024 * 1024
"""A feature map above this (inputs of more than 8,191 values) is not published: its fleet's
devices send no sketch, and the aggregator estimates their mixture from the model alone."""

PIECE_BYTES = 64 * 1024
"""The feature map's piece size: one retained message each, small enough for any MQTT client."""

MAX_PIECES = MAX_FEATURE_MAP_BYTES // PIECE_BYTES
"""Piece topics the aggregator keeps empty beyond its own pieces: a larger map published earlier
leaves no stale pieces for new subscribers."""

MAX_SPEC_CHARS = 64 * 1024
"""The spec's JSON (label names included) stays within one msgpack str of the decoder's limit."""

FASHION_LABELS = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                  "Ankle boot")
CIFAR10_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class DeviceSpecError(RuntimeFailure):
    """A device spec payload that does not match its advertised hash or its own checksums."""


@dataclass(frozen=True)
class DeviceSpec:
    """The published document (`doc`, JSON-ready) and the sketch's feature map (bytes or None)."""

    doc: dict[str, Any]
    feature_map: bytes | None

    @property
    def canonical_json(self) -> str:
        return json.dumps(self.doc, sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON (the feature map through its SHA-256)."""
        return hashlib.sha256(self.canonical_json.encode()).hexdigest()[:16]

    def payload(self) -> bytes:
        """The retained message on `fedmq/{fleet}/model/device`."""
        return msgpack.packb({"spec": self.canonical_json, "pieces": len(self.pieces())}, use_bin_type=True)

    def pieces(self) -> list[bytes]:
        """The retained messages on `fedmq/{fleet}/model/device/{i}`: the feature map, in order."""
        blob = self.feature_map or b""
        return [msgpack.packb({"spec": self.hash, "index": i, "data": blob[at:at + PIECE_BYTES]}, use_bin_type=True)
                for i, at in enumerate(range(0, len(blob), PIECE_BYTES))]


def build(model: ModelSpec, model_name: str, dataset: str, *, scale: float, mean: tuple[float, ...],
          std: tuple[float, ...], labels: tuple[str, ...]) -> DeviceSpec:
    """The device spec of a fleet running `model` on `dataset` normalized by (scale, mean, std)."""
    channels = model.input_shape[0] if model.input_shape else 1
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"{dataset}: {len(mean)} means and {len(std)} stds for {channels} input channels")
    inputs = math.prod(model.input_shape)
    fmap = feature_map(inputs) if 4 * inputs * (sketch.DIM + 1) <= MAX_FEATURE_MAP_BYTES else None
    doc: dict[str, Any] = {
        "format": FORMAT,
        "model": model.hash,
        "model_name": model_name,
        "dataset": dataset,
        "input_shape": list(model.input_shape),
        "normalize": {"scale": float(scale), "mean": [float(m) for m in mean], "std": [float(s) for s in std]},
        "labels": list(labels),
        "head": head_cut(model),
        "sketch": None if fmap is None else {
            "method": sketch.METHOD, "dim": sketch.DIM, "inputs": inputs, "bytes": len(fmap),
            "sha256": hashlib.sha256(fmap).hexdigest()},
    }
    spec = DeviceSpec(doc, fmap)
    if len(spec.canonical_json) > MAX_SPEC_CHARS:
        raise ValueError(f"{dataset}: the device spec's JSON is {len(spec.canonical_json)} chars, "
                         f"more than {MAX_SPEC_CHARS}")
    return spec


def for_dataset(model: ModelSpec, model_name: str, dataset: str, data_dir: str | None = None) -> DeviceSpec:
    """The device spec of `dataset` as fedmq's loader normalizes it (the loaded split is cached)."""
    from fedmq.data import load_dataset
    from fedmq.dataset_names import canonical_dataset

    key = canonical_dataset(dataset)
    data = load_dataset(key, data_dir=data_dir)
    return build(model, model_name, key, scale=pixel_scale(key), mean=data.mean, std=data.std,
                 labels=label_names(key, data.num_classes, data_dir))


def pixel_scale(dataset: str) -> float:
    """The largest raw input value the loader divides by: 16 for scikit-learn's digits, 1 for the
    synthetic task (no pixels), 255 (8-bit pixels) for every image dataset."""
    return {"digits": 16.0, "synthetic": 1.0}.get(dataset, 255.0)


def label_names(dataset: str, classes: int, data_dir: str | None = None) -> tuple[str, ...]:
    """What each label means, as the dataset names it; the label's number where it names none."""
    known: dict[str, tuple[str, ...]] = {"fashionmnist": FASHION_LABELS, "cifar10": CIFAR10_LABELS}
    names = known.get(dataset)
    if names is None and dataset in ("shapes", "shapeslit"):
        from fedmq.data.sources import SHAPES

        names = SHAPES
    if names is None and data_dir is not None and dataset == "cifar100":
        names = _cifar100_names(Path(data_dir) / "cifar-100-python" / "meta")
    if names is None and data_dir is not None and dataset.startswith("folder:"):
        train = Path(data_dir, dataset.split(":", 1)[1], "train")
        names = tuple(sorted(p.name for p in train.iterdir() if p.is_dir())) if train.is_dir() else None
    if names is None or len(names) != classes:
        names = tuple(map(str, range(classes)))
    return tuple(names)


def _cifar100_names(meta: Path) -> tuple[str, ...] | None:
    try:
        with open(meta, "rb") as f:
            return tuple(pickle.load(f, encoding="latin1")["fine_label_names"])
    except (OSError, KeyError, pickle.UnpicklingError, EOFError):
        return None


def head_cut(model: ModelSpec) -> dict[str, Any] | None:
    """The output layer a device may train alone over fixed features (`ModelSpec.head`): its
    weight [classes, features] and bias [classes], or None where the last two parameters are not
    such a layer."""
    trainable = model.trainable if model.trainable is not None else len(model.names)
    if trainable < 2:
        return None
    w, b = model.shapes[trainable - 2], model.shapes[trainable - 1]
    if len(w) != 2 or tuple(b) != (w[0],) or w[0] != model.num_classes:
        return None
    start, end = model.head
    return {"names": [model.names[trainable - 2], model.names[trainable - 1]], "start": start, "end": end,
            "classes": int(w[0]), "features": int(w[1])}


def feature_map(inputs: int) -> bytes:
    """The sketch's feature map for `inputs` values (fedmq/sketch.py, what the aggregator's sketch
    estimator uses): W [inputs, DIM] row-major, then b [DIM], little-endian float32."""
    w, b = sketch._features(inputs)
    return np.concatenate([w.numpy().ravel(), b.numpy()]).astype("<f4").tobytes()


def _unpack(payload: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise DeviceSpecError(f"{what}: not one msgpack map ({e})") from None


def parse(payload: bytes, pieces: list[bytes], advertised: str | None = None) -> DeviceSpec:
    """A received device spec and its feature map's pieces (any order), checked: its hash
    against `advertised` (the status's `graph.device_spec`), every piece's against its hash, and
    the feature map against the length and SHA-256 the spec names."""
    doc = _unpack(payload, "device spec")
    if (not isinstance(doc, dict) or set(doc) != {"spec", "pieces"} or not isinstance(doc["spec"], str)
            or not isinstance(doc["pieces"], int) or not 0 <= doc["pieces"] <= MAX_PIECES):
        raise DeviceSpecError(f"device spec: a map of exactly spec (str) and pieces (int, 0..{MAX_PIECES})")
    spec_hash = hashlib.sha256(doc["spec"].encode()).hexdigest()[:16]
    got: dict[int, bytes] = {}
    for raw in pieces:
        piece = _unpack(raw, "device spec piece")
        if not isinstance(piece, dict) or set(piece) != {"spec", "index", "data"} or not isinstance(piece["data"], bytes):
            raise DeviceSpecError("device spec piece: a map of exactly spec (str), index (int) and data (bin)")
        if piece["spec"] == spec_hash and isinstance(piece["index"], int) and 0 <= piece["index"] < doc["pieces"]:
            got[piece["index"]] = piece["data"]
    if len(got) != doc["pieces"]:
        raise DeviceSpecError(f"device spec: {len(got)} of its {doc['pieces']} feature map pieces")
    blob = b"".join(got[i] for i in range(doc["pieces"])) if doc["pieces"] else None
    spec = DeviceSpec(json.loads(doc["spec"]), blob)
    if spec.canonical_json != doc["spec"]:
        raise DeviceSpecError("device spec: its JSON is not canonical (sorted keys, no spaces)")
    if spec.doc.get("format") != FORMAT:
        raise DeviceSpecError(f"device spec: format {spec.doc.get('format')!r}, this reader knows {FORMAT}")
    if advertised is not None and spec.hash != advertised:
        raise DeviceSpecError(f"device spec: hash {spec.hash}, the aggregator's status advertises {advertised}")
    described = spec.doc.get("sketch")
    if (described is None) != (spec.feature_map is None):
        raise DeviceSpecError("device spec: a feature map goes with a sketch entry, and only with one")
    if described is not None and hashlib.sha256(spec.feature_map or b"").hexdigest() != described["sha256"]:
        raise DeviceSpecError("device spec: the feature map's SHA-256 differs from the spec's")
    return spec


# --------------------------------------------------------------- what a device computes


def reference_normalize(pixels: np.ndarray, normalize: dict[str, Any]) -> np.ndarray:
    """Raw values [N, C, ...] -> model inputs, float32 at every step as fedmq's loader computes
    them: x = ((p / scale) - mean[c]) / std[c], mean and std rounded to float32."""
    p = np.asarray(pixels, dtype=np.float32)
    shape = (1, -1) + (1,) * (p.ndim - 2)
    mean = np.asarray(normalize["mean"], dtype=np.float32).reshape(shape)
    std = np.asarray(normalize["std"], dtype=np.float32).reshape(shape)
    return ((p / np.float32(normalize["scale"])) - mean) / std


def reference_sketch(x: np.ndarray, fmap: bytes) -> bytes:
    """The CDFL sketch of inputs x [N, d] (float32) as a device sends it, bit for bit: for each
    input, z_j = b_j + sum_i x_i W_ij in float64 with i rising, then cos(z_j) in float64; the mean
    over inputs (summed in input order) rounded to float32, then to float16 (nearest even),
    little-endian. fedmq's own agent computes the same features in float32 (fedmq/sketch.py):
    it may differ in the last float16 place of a few values, which the estimator cannot tell."""
    x = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
    n, d = x.shape
    table = np.frombuffer(fmap, dtype="<f4")
    if table.size != (d + 1) * sketch.DIM:
        raise ValueError(f"a feature map of {table.size} values is not for {d} inputs")
    w = table[:d * sketch.DIM].reshape(d, sketch.DIM).astype(np.float64)
    b = table[d * sketch.DIM:].astype(np.float64)
    z = np.repeat(b[None], n, axis=0)
    xs = x.astype(np.float64)
    for i in range(d):  # one input value at a time: the order every language can follow
        z += xs[:, i:i + 1] * w[i]
    total = np.zeros(sketch.DIM)
    for row in np.cos(z):
        total += row
    return (total / n).astype(np.float32).astype("<f2").tobytes()


# ------------------------------------------------------------------------- test vectors


def _hex32(values: Any) -> str:
    return np.asarray(values, dtype="<f4").tobytes().hex()


def _codec_cases() -> list[tuple[str, dict[str, Any], np.ndarray, np.ndarray | None]]:
    """(name, wire map, vector, base): every codec whole and as a delta, zstd, a statistics tail."""
    base = np.array([0.5, -1.25, 3.0, 0.0, 0.001, -7.5, 2.0, 0.25], dtype=np.float32)
    vector = (base + np.array([0.125, -0.5, 0.0, 1.5, -0.002, 0.75, 0.0, -0.0625], dtype=np.float32))
    vector = vector.astype(np.float32)
    cases: list[tuple[str, dict[str, Any], np.ndarray, np.ndarray | None]] = []
    for codec, extra in (("fp32", {}), ("fp16", {}), ("int8", {"block": 4}), ("topk", {"ratio": 0.5}),
                         ("topk", {"ratio": 0.5, "topk_values": "fp16"})):
        for b in (None, base):
            name = f"{codec}{'/fp16' if extra.get('topk_values') else ''} {'delta' if b is not None else 'whole'}"
            cases.append((name, codecs.encode(vector, codec, base=b, zstd=False, **extra), vector, b))
    cases.append(("int8 delta zstd", codecs.encode(vector, "int8", base=base, zstd=True, block=4), vector, base))
    cases.append(("fp16 exact=2 delta", codecs.encode(vector, "fp16", base=base, zstd=False, exact=2), vector, base))
    return cases


def vector_pixels(n: int, shape: tuple[int, ...]) -> np.ndarray:
    """The sketch vector's raw inputs: pixel (s, i) = (7 i + 13 s) mod 256, easy to make anywhere."""
    d = math.prod(shape)
    s, i = np.meshgrid(np.arange(n), np.arange(d), indexing="ij")
    return ((7 * i + 13 * s) % 256).astype(np.float32).reshape(n, *shape)


def published_vectors() -> dict[str, Any]:
    """What docs/protocol.md publishes: CRC-32, float16 rounding, every codec, normalization and
    the sketch of a 28x28 fleet (MNIST's normalization)."""
    out: dict[str, Any] = {}
    base = np.array([0.5, -1.25, 3.0, 0.0, 0.001, -7.5, 2.0, 0.25], dtype=np.float32)
    out["crc32"] = [{"ascii": "123456789", "crc": f"{zlib.crc32(b'123456789'):08x}"},
                    {"f32": _hex32(base), "crc": f"{codecs.base_checksum(base):08x}"}]
    halves = np.array([1.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, -0.333333343267, 6.1e-05, 2.0 ** -25, 0.99999994],
                      dtype=np.float32)
    out["float16"] = [{"f32": _hex32([h]), "f16": np.float32(h).astype("<f2").tobytes().hex()} for h in halves]
    out["codecs"] = [{"name": name, "base": None if b is None else _hex32(b), "vector": _hex32(v),
                      "wire": msgpack.packb(wire, use_bin_type=True).hex(),
                      "decoded": _hex32(codecs.decode(wire, base=b))} for name, wire, v, b in _codec_cases()]
    mnist = {"scale": 255.0, "mean": [0.1307], "std": [0.3081]}
    digits = {"scale": 16.0, "mean": [0.30555450916290283], "std": [0.37612447142601013]}
    out["normalize"] = [
        {"normalize": mnist, "pixels": [0, 1, 2, 127, 128, 254, 255],
         "inputs": _hex32(reference_normalize(np.array([[0, 1, 2, 127, 128, 254, 255]]), mnist))},
        {"normalize": digits, "pixels": list(range(17)),
         "inputs": _hex32(reference_normalize(np.arange(17)[None], digits))}]
    shape = (1, 28, 28)
    fmap = feature_map(math.prod(shape))
    x = reference_normalize(vector_pixels(3, shape), mnist).reshape(3, -1)
    sk = reference_sketch(x, fmap)
    out["sketch"] = {"inputs": math.prod(shape), "samples": 3, "normalize": mnist,
                     "pixels": "(7 i + 13 s) mod 256 for input value i of sample s",
                     "feature_map_sha256": hashlib.sha256(fmap).hexdigest(),
                     "w_first": _hex32(np.frombuffer(fmap, "<f4")[:4]),
                     "b_first": _hex32(np.frombuffer(fmap, "<f4")[math.prod(shape) * sketch.DIM:][:4]),
                     "sketch_first": sk[:16].hex(), "sketch_sha256": hashlib.sha256(sk).hexdigest()}
    return out


def vectors_json() -> str:
    """The test vectors as docs/protocol.md prints them: one entry a line."""
    v = published_vectors()
    lines = ["{"]
    keys = list(v)
    for k in keys:
        value = v[k]
        comma = "," if k != keys[-1] else ""
        if isinstance(value, list):
            lines.append(f' "{k}": [')
            lines += [f"  {json.dumps(item, separators=(', ', ': '))}{',' if i < len(value) - 1 else ''}"
                      for i, item in enumerate(value)]
            lines.append(f" ]{comma}")
        else:
            lines.append(f' "{k}": {json.dumps(value, separators=(", ", ": "))}{comma}')
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["vectors"]:
        print("usage: python -m fedmq.device_spec vectors", file=sys.stderr)
        return 2
    print(vectors_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
