"""A device that knows only docs/protocol.md joins a real CDFL aggregator on a real Mosquitto.

`ForeignDevice` is written as a device in another language would be: paho-mqtt, msgpack,
numpy, zstandard and onnxruntime, and none of fedmq's agent, transport, codec or protocol
classes. It takes everything from the aggregator's retained status and the published model
graph, joins, sends one update, receives its personalized model and runs it in the graph on
scikit-learn's digits. Only the test's own checks afterwards use fedmq, to verify that what
the device ran is what the aggregator sent.

Set FEDMQ_PROTOCOL_EXCHANGE=PATH to write the exchange, byte by byte, as docs/protocol.md
shows it (`pytest tests/test_protocol_join.py -s` prints it too).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
import pytest
import zstandard

ROOT = Path(__file__).resolve().parent.parent
FLEET = "join"
DEVICE = "dev-1"
DEADLINE_S = 180.0
DIGITS_MEAN, DIGITS_STD = 0.30555450916290283, 0.37612447142601013
"""docs/protocol.md, "Inputs": the digits fleet's input normalization."""


# ------------------------------------------------------------- the device (docs only)


def decode_tensor(t: dict[str, Any], base: np.ndarray | None) -> np.ndarray:
    """docs/codecs.md via docs/protocol.md: fp32 or int8, optional zstd, optional delta."""
    data = t["data"]
    if t.get("zstd"):
        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=8 * t["n"] + 1024)
    n = t["n"]
    if t["codec"] == "fp32":
        bits = np.frombuffer(data, "<u4", n)
        if t.get("delta"):
            assert base is not None and zlib.crc32(base.astype("<f4").tobytes()) == t["base"]
            bits = bits ^ base.astype("<f4").view("<u4")
        return bits.view("<f4").astype(np.float32)
    assert t["codec"] == "int8", t["codec"]
    block = t["block"]
    blocks = -(-n // block)
    scales = np.frombuffer(data, "<f4", blocks)
    q = np.frombuffer(data, "i1", n, offset=4 * blocks).astype(np.float32)
    content = q * np.repeat(scales, block)[:n]
    if t.get("delta"):
        assert base is not None and zlib.crc32(base.astype("<f4").tobytes()) == t["base"]
        return (base + content).astype(np.float32)
    return content.astype(np.float32)


def encode_int8(vector: np.ndarray, base: np.ndarray, block: int, use_zstd: bool) -> dict[str, Any]:
    """The advertised codec (int8, delta from the base the device holds), by the doc's rule."""
    content = (vector - base).astype(np.float64)
    n = content.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block)
    padded[:n] = content
    scales = (np.abs(padded.reshape(blocks, block)).max(axis=1) / 127.0).astype("<f4")
    safe = np.repeat(np.where(scales > 0, scales, 1.0), block)[:n]
    q = np.clip(np.rint(content / safe), -127, 127).astype("i1")
    data = scales.tobytes() + q.tobytes()
    if use_zstd:
        data = zstandard.ZstdCompressor(level=3).compress(data)
    return {"codec": "int8", "n": n, "zstd": use_zstd, "delta": True, "data": data, "block": block,
            "base": zlib.crc32(base.astype("<f4").tobytes())}


class ForeignDevice:
    """One MQTT client; records every message it sends or receives for the transcript."""

    def __init__(self, port: int, fleet: str, agent: str) -> None:
        self.fleet, self.agent = fleet, agent
        self.root = f"fedmq/{fleet}"
        self.inbox: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self.exchange: list[tuple[str, str, int, bool, bytes]] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"foreign-{agent}")
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload), bool(m.retain)))
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        for topic in (f"{self.root}/aggregator/status", f"{self.root}/model/onnx",
                      f"{self.root}/agents/{agent}/down"):
            self.client.subscribe(topic, qos=1)
        self.pieces: dict[str, dict[int, bytes]] = {}
        self.base: np.ndarray | None = None
        self.held: list[tuple[str, Any]] = []

    def receive(self, want: Any, deadline: float) -> tuple[str, Any]:
        """The next (topic, message) for which `want(topic, message)` holds; a msgpack
        envelope is decoded (chunks reassembled), the raw ONNX topic is left as bytes.
        Others are held for a later call (retained messages arrive in no promised order)."""
        for i, (topic, msg) in enumerate(self.held):
            if want(topic, msg):
                del self.held[i]
                return topic, msg
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the aggregator did not answer in time")
            try:
                topic, payload, retain = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            self.exchange.append(("aggregator -> device", topic, 1, retain, payload))
            msg: Any = payload
            if not topic.endswith("/model/onnx"):
                msg = msgpack.unpackb(payload, raw=False)
                if msg["type"] == "chunk":  # docs: "Chunking"
                    got = self.pieces.setdefault(msg["of"], {})
                    got[msg["index"]] = msg["data"]
                    if len(got) < msg["count"]:
                        continue
                    whole = b"".join(got[i] for i in range(msg["count"]))
                    assert hashlib.sha256(whole).digest() == msg["sha256"]
                    msg = msgpack.unpackb(whole, raw=False)
            if want(topic, msg):
                return topic, msg
            self.held.append((topic, msg))

    def send(self, envelope: dict[str, Any]) -> None:
        payload = msgpack.packb(envelope, use_bin_type=True)
        topic = f"{self.root}/agents/{self.agent}/up"
        self.exchange.append(("device -> aggregator", topic, 1, False, payload))
        self.client.publish(topic, payload, qos=1).wait_for_publish(10)

    def envelope(self, kind: str, **fields: Any) -> dict[str, Any]:
        # protocol.md: an agent's msg_ids rise (zero-padded nanoseconds, then a random tail).
        return {"v": 1, "type": kind, "agent": self.agent, "msg_id": f"{time.time_ns():020d}{uuid.uuid4().hex[:12]}",
                "sent_at": time.time(), **fields}

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run_in_graph(session: ort.InferenceSession, spec: dict[str, Any], vector: np.ndarray,
                 x: np.ndarray) -> np.ndarray:
    """docs: the received vector, cut in the spec's order, feeds the graph's parameter inputs."""
    feeds = {"x": x}
    offset = 0
    for name, shape in zip(spec["names"], spec["shapes"], strict=True):
        size = int(np.prod(shape))
        feeds[name] = vector[offset:offset + size].reshape(shape)
        offset += size
    assert offset == vector.size
    return session.run(["logits"], feeds)[0]


# ------------------------------------------------------------------------- transcript


def _annotate(value: Any) -> Any:
    if isinstance(value, bytes):
        return f"<bin {len(value)}: {value[:12].hex()}{'...' if len(value) > 12 else ''}>"
    if isinstance(value, dict):
        return {k: _annotate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_annotate(v) for v in value]
    return value


def transcript(exchange: list[tuple[str, str, int, bool, bytes]]) -> str:
    """Each message: direction, topic, QoS, retain, size, its first bytes in hex, and the
    msgpack map it holds (key order as on the wire, bin fields abbreviated)."""
    out = []
    for direction, topic, qos, retain, payload in exchange:
        head = f"# {direction}  {topic}  QoS {qos}  retain {'yes' if retain else 'no'}  {len(payload)} bytes"
        shown = len(payload) if len(payload) <= 256 else 48  # small messages whole
        hexed = payload[:shown].hex(" ") + (" ..." if len(payload) > shown else "")
        if topic.endswith("/model/onnx"):
            body = "(raw ONNX file, a protobuf ModelProto; not msgpack)"
        else:
            body = json.dumps(_annotate(msgpack.unpackb(payload, raw=False)), indent=1)
        out.append(f"{head}\n{hexed}\n{body}\n")
    return "\n".join(out)


# -------------------------------------------------------------------------------- test


@pytest.fixture
def aggregator(mosquitto, tmp_path):
    argv = [sys.executable, "-m", "fedmq.cli", "aggregator", "--broker", mosquitto.url,
            "--fleet", FLEET, "--clusters", "3", "--state-dir", str(tmp_path / "agg"),
            "--set", "device=cpu"]  # the data sizes are the defaults a user gets
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = (tmp_path / "aggregator.log").open("w")
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if proc.returncode not in (0, -15):
            print((tmp_path / "aggregator.log").read_text()[-4000:])


def wait_online(port: int, deadline: float) -> None:
    """Watch the status topic until the aggregator is online, so that the device below comes
    later and sees status and graph as retained copies, as most devices will."""
    online = queue.Queue()
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")
    watcher.on_message = lambda c, u, m: online.put(msgpack.unpackb(m.payload)["state"] == "online")
    watcher.connect("127.0.0.1", port)
    watcher.loop_start()
    watcher.subscribe(f"fedmq/{FLEET}/aggregator/status", qos=1)
    try:
        while not online.get(timeout=max(0.1, deadline - time.monotonic())):
            pass
    finally:
        watcher.disconnect()
        watcher.loop_stop()


@pytest.mark.slow
def test_a_device_that_knows_only_the_doc_joins_updates_and_runs_its_model(mosquitto, aggregator) -> None:
    deadline = time.monotonic() + DEADLINE_S
    wait_online(mosquitto.port, deadline)
    device = ForeignDevice(mosquitto.port, FLEET, DEVICE)
    try:
        # 1. The retained status says everything a join needs.
        _, status = device.receive(lambda t, m: t.endswith("/aggregator/status")
                                   and m["state"] == "online", deadline)
        assert status["v"] == 1 and status["role"] == "aggregator" and status["algorithm"] == "cdfl"
        spec = json.loads(status["model_spec"])
        assert hashlib.sha256(status["model_spec"].encode()).hexdigest()[:16] == status["model"]
        assert spec["input_shape"] == [1, 8, 8] and spec["num_classes"] == 10
        assert status["model_name"] == "digits-cnn" and status["clusters"] == 3
        codec, graph = status["codec"], status["graph"]
        assert codec["name"] == "int8" and graph["format"] == "onnx"
        assert graph["topic"] == f"fedmq/{FLEET}/model/onnx"

        # 2. The model graph: a retained ONNX file, checked against the status.
        _, onnx_file = device.receive(lambda t, m: t == graph["topic"], deadline)
        assert [retain for _, _, _, retain, _ in device.exchange[:2]] == [True, True]
        assert len(onnx_file) == graph["bytes"]
        assert hashlib.sha256(onnx_file).hexdigest() == graph["sha256"]
        session = ort.InferenceSession(onnx_file, providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == [graph["input"], *spec["names"]]

        # 3. join -> the whole model.
        join = device.envelope("join", model=status["model"], algorithm=status["algorithm"],
                               profile="", n_samples=100)
        device.send(join)
        _, reply = device.receive(lambda t, m: m.get("in_reply_to") == join["msg_id"], deadline)
        assert reply["type"] == "model" and reply["kind"] == "personalized", reply
        joined = decode_tensor(reply["tensors"][0], None)
        device.base = joined

        # 4. update (the advertised codec, a delta from what it holds) -> its personalized model.
        trained = joined + np.random.default_rng(0).normal(0, 1e-3, joined.size).astype(np.float32)
        update = device.envelope("update", model=status["model"], tau=reply["epoch"],
                                 tensor=encode_int8(trained, joined, codec["int8_block"], codec["zstd"]),
                                 n_samples=100, alpha=None, metrics={})
        device.send(update)
        _, answer = device.receive(lambda t, m: m.get("in_reply_to") == update["msg_id"], deadline)
        assert answer["type"] == "model", answer
        wire = answer["tensors"][0]
        personal = decode_tensor(wire, device.base if wire.get("delta") else None)

        # 5. Its model runs in the graph on digits.
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = ((digits.images.astype(np.float32) / 16.0 - DIGITS_MEAN) / DIGITS_STD)[:, None]
        logits = run_in_graph(session, spec, personal, x)
        accuracy = float((logits.argmax(1) == digits.target).mean())
    finally:
        device.close()

    # The test's own checks (fedmq allowed from here on): the device decoded exactly what the
    # aggregator sent, and the graph computes what fedmq's model computes.
    import torch

    from fedmq import codecs
    from fedmq.models import build_model, load_vector, model_spec

    assert status["model"] == model_spec("digits-cnn").hash
    np.testing.assert_array_equal(personal, codecs.decode(wire, base=joined if wire.get("delta") else None))
    want = load_vector(build_model("digits-cnn"), torch.from_numpy(personal)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(logits, want(torch.from_numpy(x)).numpy(), atol=1e-4)
    print(f"device accuracy on all 1797 digits: {accuracy:.3f}; graph {len(onnx_file)} bytes")
    assert accuracy > 0.5, accuracy  # a trained model, not noise (chance is 0.1)

    text = transcript(device.exchange)
    print(text)
    if os.environ.get("FEDMQ_PROTOCOL_EXCHANGE"):
        Path(os.environ["FEDMQ_PROTOCOL_EXCHANGE"]).write_text(text)


def test_join_advertisement_is_left_off_an_agents_status_and_round_trips() -> None:
    """Backwards compatibility: a status without the new fields is the same bytes as before,
    so receivers that predate them (v1 refuses unknown keys) still read agents' statuses."""
    from fedmq import protocol

    base = dict(agent="a1", msg_id="m1", sent_at=1.0, state="online", role="agent")
    plain = msgpack.unpackb(protocol.encode(protocol.Status(**base)))
    assert sorted(plain) == sorted(["v", "type", "agent", "msg_id", "sent_at", "state", "role",
                                    "algorithm", "epoch", "counters"])
    full = protocol.Status(**base, model="5a9e7b9f05416da4", model_name="digits-cnn",
                           model_spec="{}", clusters=3, codec={"name": "int8", "zstd": True},
                           graph={"topic": "fedmq/f/model/onnx", "bytes": 10})
    assert protocol.decode(protocol.encode(full), max_bytes=1 << 16) == full
    with pytest.raises(protocol.ProtocolError, match="bad_field"):
        protocol.encode(protocol.Status(**base, codec={"name": ["int8"]}))  # type: ignore[dict-item]
