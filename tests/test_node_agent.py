"""The JavaScript agent without a browser: web/fedmq.js and web/agent-cli.mjs in Node.js.

A second language on the device side, held to Python's numbers: it computes every published
test vector (docs/protocol.md, "Device spec") bit for bit, and as a command-line device it
joins a 28x28 fleet of a real `fedmq aggregator` on a real Mosquitto with nothing but the
published topics, uploads updates the aggregator applies, and refuses to upload once the fleet
publishes another device spec.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.journal import scan_journal
from fedmq import codecs, device_spec, protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker
from fedmq.creds import Credentials, make_credentials
from fedmq.data import clear_cache
from fedmq.models import model_spec
from soak.fleet_setup import SMALL, pretrained_state
from tests.cli_process import ROOT, CliProcess, cli_env
from tests.test_device_spec import documented_vectors, write_idx

WEB = ROOT / "web"
WAIT_S = 120.0


def node_missing() -> str | None:
    """Why Node.js tests cannot run here, or None (scripts/ensure_test_tools.py installs both)."""
    if shutil.which("node") is None:
        return "node not found (apt-get install nodejs npm)"
    if not (WEB / "node_modules" / "@msgpack" / "msgpack").is_dir():
        return "web/node_modules missing (npm ci --prefix web; scripts/ensure_test_tools.py does it)"
    return None


@pytest.fixture
def node() -> str:
    why = node_missing()
    if why is not None:
        pytest.skip(why)
    return "node"


_VECTORS = """
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
const [web, casePath] = process.argv.slice(2);
const P = await import(pathToFileURL(`${web}/fedmq.js`).href);
const { decode } = await import(pathToFileURL(`${web}/node_modules/@msgpack/msgpack/dist.esm/index.mjs`).href);
const { vectors, spec, pieces, hash } = JSON.parse(readFileSync(casePath, "utf8"));
const bytes = (h) => Uint8Array.from(Buffer.from(h, "hex"));
const f32 = (h) => new Float32Array(bytes(h).buffer);
const hex = (a) => Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString("hex");
const out = { crc32: [], float16: [], codecs: [], normalize: [] };
for (const c of vectors.crc32) out.crc32.push(P.crc32(c.ascii ? new TextEncoder().encode(c.ascii) : bytes(c.f32)).toString(16).padStart(8, "0"));
for (const c of vectors.float16) out.float16.push(hex(Uint16Array.of(P.floatToHalf(f32(c.f32)[0]))));
for (const c of vectors.codecs) {
  const wire = decode(bytes(c.wire));
  const base = c.base ? f32(c.base) : null;
  const got = { decoded: hex(P.decodeTensor(wire, base)) };
  if (wire.codec === "int8" && !wire.zstd) got.int8 = hex(P.packWire(P.encodeInt8(f32(c.vector), base, wire.block).wire));
  out.codecs.push(got);
}
for (const c of vectors.normalize) out.normalize.push(hex(P.normalize(Float32Array.from(c.pixels), c.normalize)));
// The sketch vector, from the device spec as a fleet publishes it (its reader checks it first).
const b64 = (s) => Uint8Array.from(Buffer.from(s, "base64"));
const device = await P.readDeviceSpec(b64(spec), pieces.map(b64).reverse(), hash);
const s = vectors.sketch;
const pixels = new Float32Array(s.samples * s.inputs);
for (let n = 0; n < s.samples; n++) for (let i = 0; i < s.inputs; i++) pixels[n * s.inputs + i] = (7 * i + 13 * n) % 256;
const x = P.normalize(pixels, device.doc.normalize, s.inputs);
const sketch = P.dataSketch(x, s.inputs, device.featureMap);
const sha = (b) => crypto.subtle.digest("SHA-256", b).then((d) => Buffer.from(d).toString("hex"));
out.sketch = { feature_map_sha256: device.doc.sketch.sha256, w_first: hex(device.featureMap.subarray(0, 4)),
  b_first: hex(device.featureMap.subarray(s.inputs * 1024, s.inputs * 1024 + 4)), sketch_first: Buffer.from(sketch.subarray(0, 16)).toString("hex"),
  sketch_sha256: await sha(sketch) };
console.log(JSON.stringify(out));
"""


def test_node_computes_every_published_vector_bit_for_bit(node, tmp_path) -> None:
    vectors = documented_vectors()
    mnist = device_spec.build(model_spec("cnn28"), "cnn28", "mnist", scale=255, mean=(0.1307,), std=(0.3081,),
                              labels=tuple(map(str, range(10))))
    case = {"vectors": vectors, "spec": base64.b64encode(mnist.payload()).decode(), "hash": mnist.hash,
            "pieces": [base64.b64encode(p).decode() for p in mnist.pieces()]}
    (tmp_path / "case.json").write_text(json.dumps(case))
    (tmp_path / "vectors.mjs").write_text(_VECTORS)
    proc = subprocess.run([node, str(tmp_path / "vectors.mjs"), str(WEB), str(tmp_path / "case.json")],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["crc32"] == [c["crc"] for c in vectors["crc32"]]
    assert got["float16"] == [c["f16"] for c in vectors["float16"]]
    for want, mine in zip(vectors["codecs"], got["codecs"], strict=True):
        assert mine["decoded"] == want["decoded"], want["name"]
        if "int8" in mine:  # the agent's own encoder writes Python's bytes
            assert mine["int8"] == want["wire"], want["name"]
    assert sum("int8" in mine for mine in got["codecs"]) == 2
    assert got["normalize"] == [c["inputs"] for c in vectors["normalize"]]
    assert got["sketch"] == {k: vectors["sketch"][k] for k in got["sketch"]}


# ------------------------------------------------------------------ a command-line device

FLEET = "f28"
NODE = "node-1"
CYCLES = 3
SAMPLES = 150
AGGREGATOR = {"cdfl.clusters": 2, "data.proxy_per_cluster": 100, "data.pretrain_per_cluster": 200,
              "aggregator.pretrain_epochs": 2, "aggregator.accuracy_every": 0, "cdfl.personalize_epochs": 1,
              "cdfl.personalize_min_steps": 8, "aggregator.status_every_s": 1, "device": "cpu"}
"""cnn28, K = 2, small server sets and short replies: a 28x28 fleet that starts in seconds."""


@pytest.fixture(scope="module")
def fleet28(tmp_path_factory) -> tuple[Path, Path]:
    if node_missing():
        pytest.skip(node_missing())
    return make_fleet28(tmp_path_factory)


def make_fleet28(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data root, pre-trained state dir): scripts/digits28_files.py's 28x28 stand-in, small, as
    MNIST and, the same images, as Fashion-MNIST (whose normalization differs); the aggregator's
    cluster models pre-trained once on the MNIST copy."""
    root = tmp_path_factory.mktemp("d28")
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "digits28_files.py"), str(root), "--train", "1200",
                           "--test", "300"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    shutil.copytree(root / "MNIST", root / "FashionMNIST")
    clear_cache()
    try:
        state = pretrained_state(tmp_path_factory.mktemp("state28") / "state", **{
            **AGGREGATOR, "data.dataset": "mnist", "data.data_dir": str(root), "model": "auto"})
    finally:
        clear_cache()
    return root, state


def start_aggregator(url: str, data: Path | None, state: Path, dataset: str = "mnist", *login: str,
                     password: str = "", fleet: str = FLEET, settings: dict | None = None) -> CliProcess:
    """`fedmq aggregator` of the 28x28 fleet (or of `fleet` with `settings`), once it says it started."""
    argv = ["fedmq", "aggregator", "--broker", url, "--fleet", fleet, "--state-dir", str(state),
            "--dataset", dataset, "--log-level", "info", *login]
    if data is not None:
        argv += ["--data-dir", str(data)]
    for key, value in (AGGREGATOR if settings is None else settings).items():
        argv += ["--set", f"{key}={value}"]
    agg = CliProcess(argv, cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1", FEDMQ_BROKER_PASSWORD=password))
    try:
        agg.wait_for(r"aggregator\.started", WAIT_S)
    except AssertionError:
        agg.stop()
        raise
    return agg


def node_agent(url: str, data: Path, out: Path, *extra: str, password: str = "", fleet: str = FLEET,
               files: tuple[Path, Path] | None = None) -> CliProcess:
    """agent-cli.mjs on the 28x28 files' test images (or `files`: IDX images and labels)."""
    raw = data / "MNIST" / "raw"
    images, labels = files or (raw / "t10k-images-idx3-ubyte", raw / "t10k-labels-idx1-ubyte")
    return CliProcess(["node", str(WEB / "agent-cli.mjs"), "--broker", url, "--fleet", fleet, "--id", NODE,
                       "--images", str(images), "--labels", str(labels), "--samples", str(SAMPLES), "--state-dir", str(out / "state"), "--report", str(out / "report.jsonl"),
                       "--timeout-s", str(int(WAIT_S)), *extra], cwd=ROOT, env=cli_env(FEDMQ_BROKER_PASSWORD=password))


def journal_records(state: Path) -> list[dict]:
    """Every record of every journal generation still on disk, in order."""
    gens = sorted(int(p.stem.split("-")[1]) for p in state.glob("journal-*.log"))
    return [r for g in gens for r in scan_journal(state / f"journal-{g}.log").records]


def report(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]


class Downlink:
    """Every message on the Node agent's downlink, seen by a second client (dev.conf has no ACL)."""

    def __init__(self, broker: MosquittoBroker, fleet: str = FLEET) -> None:
        self.seen: queue.Queue[bytes] = queue.Queue()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="downlink-watcher")
        self.client.on_message = lambda c, u, m: self.seen.put(bytes(m.payload))
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        self.client.subscribe(protocol.downlink(fleet, NODE), qos=1)
        assert subscribed.wait(WAIT_S)

    def models(self) -> dict[str, protocol.Model]:
        """in_reply_to -> the model that answered it (put together from its chunks where the
        fleet's protocol.max_message_bytes cut it)."""
        out = {}
        pieces = protocol.Reassembler(64 << 20, 256 << 20, WAIT_S)
        while not self.seen.empty():
            env = protocol.decode(self.seen.get(), 64 << 20)
            if isinstance(env, protocol.Chunk):
                whole = pieces.add(env, env.agent)
                env = protocol.decode(whole, 64 << 20) if whole is not None else None
            if isinstance(env, protocol.Model):
                out[env.in_reply_to] = env
        return out

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def samples_as_published(data: Path, published: device_spec.DeviceSpec) -> np.ndarray:
    """The Node agent's training inputs as Python makes them from the same file and spec."""
    raw = (data / "MNIST" / "raw" / "t10k-images-idx3-ubyte").read_bytes()
    pixels = np.frombuffer(raw[16:], np.uint8).reshape(-1, 1, 28, 28)[:SAMPLES]
    return device_spec.reference_normalize(pixels, published.doc["normalize"]).reshape(SAMPLES, -1)


@pytest.mark.slow
def test_the_node_agent_joins_a_28x28_fleet_and_every_upload_is_applied(mosquitto, fleet28, tmp_path) -> None:
    data, pristine = fleet28
    state = tmp_path / "agg"
    shutil.copytree(pristine, state)
    downlink = Downlink(mosquitto)
    agg = start_aggregator(mosquitto.url, data, state)
    try:
        node = node_agent(mosquitto.url, data, tmp_path, "--cycles", str(CYCLES))
        assert node.wait(WAIT_S * 2) == 0, node.output[-3000:]
        replies = downlink.models()
        # Images the fleet's model does not take: one line, before anything is sent.
        small = tmp_path / "small"
        write_idx(small / "images", np.zeros((4, 8, 8), np.uint8))
        write_idx(small / "labels", np.arange(4))
        wrong = CliProcess(["node", str(WEB / "agent-cli.mjs"), "--broker", mosquitto.url, "--fleet", FLEET,
                            "--id", "node-8x8", "--images", str(small / "images"), "--labels", str(small / "labels")],
                           cwd=ROOT)
        assert wrong.wait(WAIT_S) == 1
        assert wrong.lines[-1] == ("agent-cli: refused: wrong_input: the images are 8x8, the fleet's model takes "
                                   "1x28x28 (cnn28 on mnist)"), wrong.output
    finally:
        agg.stop()
        downlink.close()
    clear_cache()
    try:
        published = device_spec.for_dataset(model_spec("cnn28"), "cnn28", "mnist", str(data))
    finally:
        clear_cache()
    assert "dataset=mnist input=1x28x28 sketch=rff-1024-5eed-v1" in node.output
    sketch = device_spec.reference_sketch(samples_as_published(data, published), published.feature_map or b"")
    check_node_cycles(tmp_path, node, agg, state, replies, published, sketch)


def check_node_cycles(out: Path, node: CliProcess, agg: CliProcess, state: Path, replies: dict[str, protocol.Model],
                      published: device_spec.DeviceSpec, sketch: bytes) -> None:
    """What the Node agent's report says of its join and CYCLES cycles, held to Python's numbers:
    joined with the published device spec; every upload applied with the vector it sent and
    `sketch` (Python's reference sketch of its inputs), bit for bit; every model it installed
    the one Python decodes from the same replies."""
    joined, *cycles = report(out)
    print(node.output)
    assert joined["join"] and joined["deviceSpec"] == published.hash

    # Three cycles, each answered with a model; msg_ids rise, each tau the epoch it held.
    assert [c["refused"] for c in cycles] == [None] * CYCLES, cycles
    ids = [c["msgId"] for c in cycles]
    assert ids == sorted(ids) and len(set(ids)) == CYCLES
    assert [c["tau"] for c in cycles] == [joined["epoch"], *[c["epoch"] for c in cycles[:-1]]]

    # The aggregator applied every upload: the journal holds each with the vector the agent
    # sent, bit for bit, and its sketch.
    assert len(re.findall(rf"update\.applied .*agent={NODE}\b", agg.output)) == CYCLES, agg.output[-3000:]
    mine = [r for r in journal_records(state) if r["op"] == "update" and r["agent"] == NODE]
    assert [r["msg_id"] for r in mine] == ids
    for rec, cycle in zip(mine, cycles, strict=True):
        sent = np.frombuffer(base64.b64decode(cycle["uploaded"]), dtype="<f4")
        assert np.asarray(rec["vector"], dtype=np.float32).tobytes() == sent.tobytes()
        assert bytes(rec["sketch"]) == bytes.fromhex(cycle["sketch"]) == sketch

    # Every model it installed is the one Python decodes from the same replies, bit for bit.
    base = None
    for msg_id, held in [(joined["msgId"], joined), *[(c["msgId"], c) for c in cycles]]:
        wire = replies[msg_id].tensors[0]
        base = codecs.decode(wire, base=base if wire.get("delta") else None)
        assert codecs.base_checksum(base) == held["installedCrc"], msg_id
    print(f"node agent on {published.doc['dataset']}: join {joined['seconds']:.2f} s; cycles "
          + ", ".join(f"{c['seconds']:.2f} s (agent {c['computeS']:.2f} s, reply {c['replyS']:.2f} s)" for c in cycles)
          + "; accuracy " + " -> ".join(f"{c['accuracy']:.3f}" for c in cycles))


SHAPES_FLEET = "shapes"
SHAPES_MODEL = "fedmq.models:ColorCNN?width=16&hidden=64&num_classes=10"
"""The zoo's colour CNN made small (90 k parameters, 64 head features): a browser's 7 graph
runs per batch and 90 KB replies, where cnn32-10's 620 k parameters and 256 features would
take 26 runs and 620 KB."""
SHAPES = {**SMALL, "data.dataset": "shapes", "model": SHAPES_MODEL, "data.proxy_per_cluster": 100,
          "data.pretrain_per_cluster": 200, "aggregator.pretrain_lr": 0.03, "aggregator.pretrain_epochs": 12,
          "cdfl.personalize_epochs": 1, "cdfl.personalize_min_steps": 8, "aggregator.status_every_s": 1,
          "codec.name": "int8"}
"""A 32x32 colour fleet of `shapes`, K = 2, small server sets and short replies. Its 400
pre-training images at the default rate (0.05) and 2 epochs leave the net at chance
(`cluster.pretrain_stuck`); at 0.03 and 12 epochs (about 5 s on 2 busy cores) each cluster
starts at about 0.6 on its test images, so the agents' uploads have something to improve."""


def make_shapes_fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pre-trained state of the 32x32 colour fleet (pre-training is in the run's disk cache:
    a second module's fleet reads it)."""
    clear_cache()
    try:
        return pretrained_state(tmp_path_factory.mktemp("shapes") / "state", **SHAPES)
    finally:
        clear_cache()


def shapes_idx(root: Path, n: int = SAMPLES) -> tuple[Path, Path, np.ndarray]:
    """`shapes`' first n test images as 8-bit IDX files (n x 3 x 32 x 32, and labels): a colour
    device's local data; the files and the raw pixels."""
    from fedmq.data.sources import shape_images

    images, labels = shape_images(train=False)
    pixels = np.clip(np.rint(images[:n] * 255), 0, 255).astype(np.uint8)
    write_idx(root / "images", pixels)
    write_idx(root / "labels", labels[:n])
    return root / "images", root / "labels", pixels


@pytest.fixture(scope="module")
def shapes_fleet(tmp_path_factory) -> Path:
    if node_missing():
        pytest.skip(node_missing())
    return make_shapes_fleet(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.long("a 32x32 fleet pre-trained (5 s), its aggregator and a Node device: three cycles, a 12.6 MB feature map")
def test_the_node_agent_runs_three_cycles_on_a_32x32_colour_fleet(mosquitto, shapes_fleet, tmp_path) -> None:
    """Three channels, ten label names, a 12.6 MB feature map: all read from the published
    device spec by the same command-line device, whose sketch and models stay Python's."""
    from fedmq.models import resolve_model_name

    state = tmp_path / "agg"
    shutil.copytree(shapes_fleet, state)
    images, labels, pixels = shapes_idx(tmp_path / "idx")
    downlink = Downlink(mosquitto, SHAPES_FLEET)
    agg = start_aggregator(mosquitto.url, None, state, "shapes", fleet=SHAPES_FLEET, settings=SHAPES)
    try:
        node = node_agent(mosquitto.url, Path(), tmp_path, "--cycles", str(CYCLES), fleet=SHAPES_FLEET,
                          files=(images, labels))
        assert node.wait(WAIT_S * 2) == 0, node.output[-3000:]
        replies = downlink.models()
    finally:
        agg.stop()
        downlink.close()
    name = resolve_model_name(SHAPES_MODEL, "shapes")
    clear_cache()
    try:
        published = device_spec.for_dataset(model_spec(name), name, "shapes")
    finally:
        clear_cache()
    assert "dataset=shapes input=3x32x32 sketch=rff-1024-5eed-v1" in node.output
    x = device_spec.reference_normalize(pixels, published.doc["normalize"]).reshape(SAMPLES, -1)
    check_node_cycles(tmp_path, node, agg, state, replies, published,
                      device_spec.reference_sketch(x, published.feature_map or b""))


class ProdFleet28:
    """The 28x28 fleet behind prod.conf with the ACL `fedmq creds` writes: a copy of its
    pre-trained state, and logins for the aggregator and one agent (which may read the device
    spec and its pieces)."""

    def __init__(self, broker: MosquittoBroker, creds: Credentials, data: Path, state: Path) -> None:
        self.broker, self.creds, self.data, self.state = broker, creds, data, state
        self.users = creds.users()
        self.login = ("--ca-file", str(creds.ca_cert))

    def start(self, dataset: str = "mnist") -> CliProcess:
        """Its aggregator over mqtts; another `dataset` normalizes otherwise: another device spec."""
        return start_aggregator(f"mqtts://aggregator@127.0.0.1:{self.broker.port}", self.data, self.state, dataset,
                                *self.login, password=self.users["aggregator"])


@contextmanager
def prod_fleet28(tmp_path: Path, fleet28: tuple[Path, Path], agent: str) -> Iterator[ProdFleet28]:
    data, pristine = fleet28
    shutil.copytree(pristine, tmp_path / "agg")
    creds = make_credentials(tmp_path / "creds", [agent])
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        yield ProdFleet28(broker, creds, data, tmp_path / "agg")


@pytest.mark.slow
def test_an_agent_holding_an_old_device_spec_refuses_to_upload_in_one_line(fleet28, tmp_path) -> None:
    """Over mqtts against prod.conf, with the agent's own login."""
    with prod_fleet28(tmp_path, fleet28, NODE) as fleet:
        agg = fleet.start()
        node = node_agent(f"mqtts://localhost:{fleet.broker.port}", fleet.data, tmp_path, "--cycles", "1", "--stay",
                          *fleet.login, password=fleet.users[NODE])
        try:
            old = node.wait_for(r"agent\.joined .*device_spec=(\w+)", WAIT_S).group(1)
            node.wait_for(r"agent\.waiting", WAIT_S)
            agg.stop()
            # The same fleet and model, its normalization now Fashion-MNIST's: another device spec.
            agg = fleet.start("fashionmnist")
            new = node.wait_for(rf"device_spec\.changed agent={NODE} held={old} published=(\w+)", WAIT_S).group(1)
            assert new != old
            os.kill(node.proc.pid, signal.SIGUSR1)  # train and upload now
            node.wait_for(rf"agent\.joined .*device_spec={new}", WAIT_S)  # it read the new spec and joined again
            assert node.stop() == 0
        finally:
            node.kill()
            agg.stop()
    refused = [line for line in node.lines if "upload.refused" in line]
    assert refused == [f'upload.refused agent={NODE} reason=device_spec_changed detail="holds device spec {old}, '
                       f'the fleet publishes {new}: read it again and rejoin"'], node.output[-3000:]
    assert "dataset=fashionmnist" in node.output
    # Nothing reached the aggregator between the change and the new join: no upload, no error.
    assert not re.search(rf"update\.applied .*agent={NODE}\b", agg.output), agg.output[-3000:]
    assert not re.search(rf"(refus|reject)\w*\b.*agent={NODE}\b", agg.output), agg.output[-3000:]


def test_a_bad_command_line_is_one_line_and_status_2(node, tmp_path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([node, str(WEB / "agent-cli.mjs"), *args], capture_output=True, text=True, timeout=WAIT_S)

    (tmp_path / "notidx").write_bytes(b"PNG not IDX")
    for args, says in ((["--broker", "mqtt://127.0.0.1:1", "--id", "a"], "--fleet is required"),
                       (["--broker", "mqtt://127.0.0.1:1", "--fleet", "f", "--id", "a", "--images", str(tmp_path / "notidx"),
                         "--labels", str(tmp_path / "notidx")], "not an IDX file of unsigned bytes"),
                       (["--broker", "mqtt://h", "--fleet", "f", "--id", "a", "--images", "i", "--labels", "l",
                         "--cycles", "two"], "--cycles must be an integer >= 0, got two"),
                       (["--fleet", "f", "--colour"], "Unknown option '--colour'")):
        done = run(*args)
        assert done.returncode == 2 and done.stdout == "", (args, done.stderr)
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("agent-cli: "), done.stderr
        assert says in done.stderr, done.stderr
