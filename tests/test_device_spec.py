"""The device spec: what a device without Python needs beside the model graph, published by the
aggregator (fedmq/device_spec.py, docs/protocol.md "Device spec").

Its numbers are fedmq's own: the normalization gives the loader's tensors bit for bit, the
feature map is the sketch estimator's, the reference sketch is fedmq/sketch.py's up to the last
float16 place. Its hash follows the model, the normalization and the feature map. A real
`fedmq aggregator` on a real Mosquitto publishes it retained and names its hash in its status.
"""

from __future__ import annotations

import json
import queue
import re
import struct
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
import torch

from fedmq import codecs, device_spec, protocol, sketch
from fedmq.data import clear_cache, load_dataset
from fedmq.data.sources import _digits_split
from fedmq.models import model_spec
from soak.fleet_setup import SMALL
from tests.cli_process import ROOT, CliProcess, cli_env

WAIT_S = 60.0
MNIST = {"scale": 255.0, "mean": [0.1307], "std": [0.3081]}


def documented_vectors() -> dict:
    """The JSON block under docs/protocol.md's "Test vectors"."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("### Test vectors", 1)[1]
    return json.loads(re.search(r"```json\n(.*?)\n```", section, re.S).group(1))


def write_idx(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist_files(root: Path, folder: str = "MNIST", n: int = 60) -> np.ndarray:
    """Small MNIST-format files (every pixel value occurs); the train images, raw."""
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    train[0].flat[:256] = np.arange(256)
    for split, images in (("train", train), ("t10k", train[: n // 2])):
        write_idx(root / folder / "raw" / f"{split}-images-idx3-ubyte", images)
        write_idx(root / folder / "raw" / f"{split}-labels-idx1-ubyte", np.arange(len(images)) % 10)
    return train


def test_the_documented_vectors_are_what_python_computes() -> None:
    doc, now = documented_vectors(), device_spec.published_vectors()
    assert doc["crc32"][0] == {"ascii": "123456789", "crc": "cbf43926"}  # CRC-32/ISO-HDLC's check value
    for case in doc["crc32"][1:]:
        assert f"{zlib.crc32(bytes.fromhex(case['f32'])):08x}" == case["crc"]
    for case in doc["float16"]:
        f32 = np.frombuffer(bytes.fromhex(case["f32"]), "<f4").copy()
        assert codecs.float32_to_half(f32).tobytes().hex() == case["f16"]
    assert len(doc["codecs"]) == len(now["codecs"]) >= 12
    assert {c["wire"] and msgpack.unpackb(bytes.fromhex(c["wire"]))["codec"] for c in doc["codecs"]} == set(codecs.CODECS)
    for case, fresh in zip(doc["codecs"], now["codecs"], strict=True):
        wire = msgpack.unpackb(bytes.fromhex(case["wire"]), raw=False)
        base = None if case["base"] is None else np.frombuffer(bytes.fromhex(case["base"]), "<f4")
        assert codecs.decode(wire, base=base).tobytes().hex() == case["decoded"], case["name"]
        if not wire["zstd"]:  # a zstd frame is any valid one; the rest is one byte string
            assert case == fresh, case["name"]
        else:
            assert {**case, "wire": None} == {**fresh, "wire": None}, case["name"]
    assert doc["normalize"] == now["normalize"] and doc["sketch"] == now["sketch"]


def test_normalizing_by_the_spec_gives_the_loaders_inputs_bit_for_bit(tmp_path) -> None:
    images, _, train, _ = _digits_split()
    digits = device_spec.for_dataset(model_spec("digits-cnn"), "digits-cnn", "digits")
    assert digits.doc["normalize"]["scale"] == 16.0 and digits.doc["labels"] == [str(d) for d in range(10)]
    ours = device_spec.reference_normalize(images[train], digits.doc["normalize"])
    assert ours.tobytes() == load_dataset("digits").x.numpy().tobytes()

    raw = write_mnist_files(tmp_path)
    clear_cache()
    try:
        mnist = device_spec.for_dataset(model_spec("cnn28"), "cnn28", "mnist", str(tmp_path))
        loaded = load_dataset("mnist", data_dir=str(tmp_path)).x.numpy()
    finally:
        clear_cache()
    assert mnist.doc["normalize"] == MNIST
    ours = device_spec.reference_normalize(raw[:, None], mnist.doc["normalize"])
    assert ours.tobytes() == loaded.tobytes()


def test_the_reference_sketch_is_fedmqs_up_to_the_last_float16_place() -> None:
    x = load_dataset("digits").x[:300]
    fmap = device_spec.feature_map(64)
    w, b = sketch._features(64)  # the aggregator's estimator's map, published as is
    assert fmap == np.concatenate([w.numpy().ravel(), b.numpy()]).astype("<f4").tobytes()
    ours = np.frombuffer(device_spec.reference_sketch(x.numpy().reshape(300, -1), fmap), "<f2")
    theirs = sketch.data_sketch(x).astype("<f2")
    apart = np.abs(ours.view("<i2").astype(int) - theirs.view("<i2").astype(int))
    print(f"reference vs fedmq/sketch.py: {int((apart > 0).sum())} of 1024 float16 values differ")
    assert apart.max() <= 1 and (apart > 0).sum() <= 8


def test_the_hash_follows_the_model_the_normalization_and_the_feature_map(monkeypatch) -> None:
    cnn28 = model_spec("cnn28")
    labels = tuple(map(str, range(10)))
    base = device_spec.build(cnn28, "cnn28", "mnist", scale=255, mean=(0.1307,), std=(0.3081,), labels=labels)
    assert base.doc["head"] == {"names": ["fc2.weight", "fc2.bias"], "start": cnn28.head[0], "end": cnn28.head[1],
                                "classes": 10, "features": 64}
    assert base.doc["sketch"]["bytes"] == len(base.feature_map or b"") == 785 * 1024 * 4
    same = device_spec.build(cnn28, "cnn28", "mnist", scale=255, mean=(0.1307,), std=(0.3081,), labels=labels)
    assert same.hash == base.hash and same.payload() == base.payload() and same.pieces() == base.pieces()
    others = {
        "model": device_spec.build(model_spec("cnn32-10"), "cnn32-10", "cifar10", scale=255, mean=(0.5,) * 3,
                                   std=(0.25,) * 3, labels=labels),
        "normalization": device_spec.build(cnn28, "cnn28", "fashionmnist", scale=255, mean=(0.2860,),
                                           std=(0.3530,), labels=labels),
        "labels": device_spec.build(cnn28, "cnn28", "mnist", scale=255, mean=(0.1307,), std=(0.3081,),
                                    labels=device_spec.FASHION_LABELS),
    }
    real = device_spec.feature_map
    monkeypatch.setattr(device_spec, "feature_map", lambda d: real(d)[:-4] + b"\0\0\0\0")
    others["feature map"] = device_spec.build(cnn28, "cnn28", "mnist", scale=255, mean=(0.1307,), std=(0.3081,),
                                              labels=labels)
    hashes = {what: spec.hash for what, spec in others.items()}
    assert base.hash not in hashes.values() and len(set(hashes.values())) == len(hashes), hashes


def test_a_reader_refuses_a_spec_that_is_not_the_advertised_one_in_one_line() -> None:
    spec = device_spec.build(model_spec("digits-cnn"), "digits-cnn", "digits", scale=16, mean=(0.3,), std=(0.4,),
                             labels=tuple("0123456789"))
    pieces = spec.pieces()
    assert len(pieces) == 5 and all(len(p) <= device_spec.PIECE_BYTES + 64 for p in pieces)  # 65 x 1024 x 4 bytes
    read = device_spec.parse(spec.payload(), pieces[::-1], spec.hash)  # pieces arrive in any order
    assert read.doc == spec.doc and read.feature_map == spec.feature_map
    with pytest.raises(device_spec.DeviceSpecError, match=f"advertises {spec.hash[::-1]}$"):
        device_spec.parse(spec.payload(), pieces, spec.hash[::-1])
    with pytest.raises(device_spec.DeviceSpecError, match="4 of its 5 feature map pieces"):
        device_spec.parse(spec.payload(), pieces[1:], spec.hash)
    other = device_spec.build(model_spec("digits-cnn"), "digits-cnn", "digits", scale=16, mean=(0.3,), std=(0.5,),
                              labels=tuple("0123456789"))
    with pytest.raises(device_spec.DeviceSpecError, match="4 of its 5"):  # a piece of another spec is none of its
        device_spec.parse(spec.payload(), [*pieces[1:], other.pieces()[0]], spec.hash)
    last = msgpack.unpackb(pieces[-1])
    tampered = msgpack.packb({**last, "data": last["data"][:-1] + b"\1"})
    with pytest.raises(device_spec.DeviceSpecError, match="SHA-256"):
        device_spec.parse(spec.payload(), [*pieces[:-1], tampered], spec.hash)
    for bad in (b"\xc1", msgpack.packb({"spec": spec.canonical_json}), msgpack.packb([1])):
        with pytest.raises(device_spec.DeviceSpecError) as e:
            device_spec.parse(bad, pieces)
        assert "\n" not in str(e.value)


def test_a_model_without_an_output_layer_has_no_head_and_big_inputs_no_feature_map() -> None:
    spec = model_spec("digits-cnn")
    headless = type(spec)(spec.arch, spec.names[:-1], spec.shapes[:-1], spec.input_shape, spec.num_classes)
    assert device_spec.head_cut(headless) is None
    big = type(spec)("big", spec.names, spec.shapes, (3, 64, 64), spec.num_classes)
    made = device_spec.build(big, "big", "folder:big", scale=255, mean=(0.5,) * 3, std=(0.2,) * 3, labels=("a",))
    assert made.doc["sketch"] is None and made.feature_map is None
    assert made.pieces() == [] and device_spec.parse(made.payload(), [], made.hash).feature_map is None


def messages(port: int, topics: list[str], count: int, client_id: str) -> dict[str, tuple[bytes, bool]]:
    """The first non-empty message on each of `count` topics (of the subscriptions `topics`) and
    whether it came retained."""
    got: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    watcher.on_message = lambda c, u, m: got.put((m.topic, bytes(m.payload), bool(m.retain)))
    watcher.connect("127.0.0.1", port)
    watcher.loop_start()
    seen: dict[str, tuple[bytes, bool]] = {}
    try:
        for topic in topics:
            watcher.subscribe(topic, qos=1)
        deadline = time.monotonic() + WAIT_S
        while len(seen) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"messages seen in {WAIT_S:.0f} s: {sorted(seen)}"
            try:
                topic, payload, retained = got.get(timeout=left)
            except queue.Empty:
                continue
            if payload:  # an empty one deletes a piece topic above the spec's pieces
                seen.setdefault(topic, (payload, retained))
    finally:
        watcher.disconnect()
        watcher.loop_stop()
    return seen


@pytest.mark.slow
def test_the_aggregator_publishes_its_device_spec_beside_the_graph(mosquitto, tmp_path) -> None:
    argv = ["fedmq", "aggregator", "--broker", mosquitto.url, "--fleet", "spec", "--state-dir", str(tmp_path / "agg"),
            "--log-level", "info"]
    for key, value in SMALL.items():
        argv += ["--set", f"{key}={value}"]
    topics = ["fedmq/spec/aggregator/status", "fedmq/spec/model/onnx", "fedmq/spec/model/device/#"]
    with CliProcess(argv, cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1")) as agg:
        agg.wait_for(r"aggregator\.started", WAIT_S)
        first = messages(mosquitto.port, topics, 3 + 5, "spec-watcher")  # the digits' feature map: 5 pieces
        later = messages(mosquitto.port, topics, 3 + 5, "spec-latecomer")  # all retained by now
    assert all(retained for _, retained in later.values()), sorted(later)
    seen = {topic.split("/", 2)[2]: value for topic, value in first.items()}
    status = protocol.decode(seen["aggregator/status"][0], 1 << 16)
    assert isinstance(status, protocol.Status)
    assert status.graph["device_topic"] == protocol.device_spec("spec") == "fedmq/spec/model/device"
    pieces = [payload for topic, (payload, _) in seen.items() if topic.startswith("model/device/")]
    assert sorted(t for t in seen if t.startswith("model/device/")) == [f"model/device/{i}" for i in range(5)]
    assert max(len(p) for p in pieces) <= device_spec.PIECE_BYTES + 64
    published = device_spec.parse(seen["model/device"][0], pieces, str(status.graph["device_spec"]))
    want = device_spec.for_dataset(model_spec("digits-cnn"), "digits-cnn", "digits")
    assert published.doc == want.doc and published.feature_map == want.feature_map
    assert published.doc["model"] == status.model and published.doc["model_name"] == status.model_name
    assert published.doc["input_shape"] == json.loads(status.model_spec)["input_shape"]
    assert torch.equal(torch.frombuffer(bytearray(published.feature_map or b""), dtype=torch.float32)[:64 * 1024],
                       sketch._features(64)[0].reshape(-1))
