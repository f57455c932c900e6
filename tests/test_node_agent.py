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
import shutil
import subprocess

import pytest

from fedmq import device_spec
from fedmq.models import model_spec
from tests.cli_process import ROOT
from tests.test_device_spec import documented_vectors

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
const { vectors, spec, hash } = JSON.parse(readFileSync(casePath, "utf8"));
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
const device = await P.readDeviceSpec(Uint8Array.from(Buffer.from(spec, "base64")), hash);
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
    case = {"vectors": vectors, "spec": base64.b64encode(mnist.payload()).decode(), "hash": mnist.hash}
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
