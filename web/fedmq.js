// fedmq wire protocol v1 in JavaScript (docs/protocol.md): envelopes, rising msg_ids, chunks,
// every model codec, the fleet's device spec, the CDFL data sketch, the drift rule and head
// training. No DOM and no transport here: agent.js joins a fleet with these (in a browser or
// in Node.js, agent-cli.mjs), fleet.js reads statuses.

import { encode as packb, decode as unpackb } from "@msgpack/msgpack";
import { decompress as zstdDecompress } from "fzstd";

export const VERSION = 1;

// ------------------------------------------------------------------------- topics

const ID = /^[A-Za-z0-9_.-]{1,64}$/;

export function checkId(id, what) {
  if (!ID.test(id) || id === "." || id === "..") throw new Error(`${what} must match [A-Za-z0-9_.-]{1,64}, got ${JSON.stringify(id)}`);
  return id;
}

export const topics = {
  up: (fleet, agent) => `fedmq/${fleet}/agents/${agent}/up`,
  down: (fleet, agent) => `fedmq/${fleet}/agents/${agent}/down`,
  agentStatus: (fleet, agent) => `fedmq/${fleet}/agents/${agent}/status`,
  allAgentStatus: (fleet) => `fedmq/${fleet}/agents/+/status`,
  aggregatorStatus: (fleet) => `fedmq/${fleet}/aggregator/status`,
  graph: (fleet) => `fedmq/${fleet}/model/onnx`,
  deviceSpec: (fleet) => `fedmq/${fleet}/model/device`,
};

/** An agent's MQTT client id, as Python's `protocol.agent_client_id`: two fleets on one
 *  broker whose agents share a name keep a session each. */
export const agentClientId = (fleet, agent) => `fedmq-agent-${fleet}-${agent}`;

// ------------------------------------------------------------------------- msg_ids

// An agent's msg_ids must rise (sort as strings after every one it sent before, across
// restarts and clock changes): 14 hex digits of microseconds that never go back, then 72
// random bits, as Python's new_msg_id. The floor lives in localStorage under the agent's
// key, so a reload, or a clock set back, still rises above what was sent.
export class MsgIds {
  constructor(storageKey, storage = globalThis.localStorage) {
    this.key = storageKey;
    this.storage = storage;
    this.last = 0;
    const saved = storage ? storage.getItem(storageKey) : null;
    if (saved && /^[0-9a-f]{14}/.test(saved)) this.last = parseInt(saved.slice(0, 14), 16);
  }

  next() {
    const now = Math.floor((performance.timeOrigin + performance.now()) * 1000);
    this.last = Math.max(now, this.last + 1);
    const rand = new Uint8Array(9);
    crypto.getRandomValues(rand);
    const id = this.last.toString(16).padStart(14, "0") + hex(rand);
    if (this.storage) this.storage.setItem(this.key, id);
    return id;
  }
}

export function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// ------------------------------------------------------------------------- envelopes

export function nowSeconds() {
  return (performance.timeOrigin + performance.now()) / 1000;
}

/** One envelope: the common fields, then the type's own (left out while at their default). */
export function envelope(type, agent, msgId, fields) {
  return packb({ v: VERSION, type, agent, msg_id: msgId, sent_at: nowSeconds(), ...fields });
}

const TYPES = new Set(["join", "update", "report", "chunk", "model", "round_invite", "error", "ack", "receipt", "status"]);

/** An encoded tensor map as msgpack bytes (what an envelope's `tensor` field holds). */
export function packWire(wire) {
  return packb(wire);
}

/** A received envelope as an object, or an Error naming why it is refused (never thrown). */
export function readEnvelope(payload, maxBytes = 64 * 1024 * 1024) {
  if (payload.byteLength > maxBytes) return new ProtocolRefusal("too_large", `${payload.byteLength} bytes`);
  let env;
  try {
    env = unpackb(payload, { maxStrLength: 65536, maxArrayLength: 1024, maxMapLength: 1024 });
  } catch (e) {
    return new ProtocolRefusal("malformed", String(e.message || e));
  }
  if (env === null || typeof env !== "object" || Array.isArray(env) || env instanceof Uint8Array) {
    return new ProtocolRefusal("malformed", "not a map");
  }
  if (env.v !== VERSION) return new ProtocolRefusal("bad_version", `v=${env.v}`);
  if (!TYPES.has(env.type)) return new ProtocolRefusal("unknown_type", String(env.type));
  return env;
}

export class ProtocolRefusal extends Error {
  constructor(reason, detail = "") {
    super(`${reason}${detail ? ": " + detail : ""}`);
    this.reason = reason;
    this.detail = detail;
  }
}

// ------------------------------------------------------------------------- chunks

/** Envelopes to publish for one encoded message: itself, or chunks of `chunkBytes`. */
export async function chunked(payload, agent, msgId, ids, chunkBytes = 8 * 1024 * 1024) {
  if (payload.byteLength <= chunkBytes) return [payload];
  const sha = new Uint8Array(await crypto.subtle.digest("SHA-256", payload));
  const count = Math.ceil(payload.byteLength / chunkBytes);
  const out = [];
  for (let i = 0; i < count; i++) {
    const data = payload.subarray(i * chunkBytes, Math.min(payload.byteLength, (i + 1) * chunkBytes));
    out.push(envelope("chunk", agent, ids.next(), { of: msgId, index: i, count, total_bytes: payload.byteLength, sha256: sha, data }));
  }
  return out;
}

/** Reassembles chunked downlinks (per `of`); `add` returns the whole payload when complete. */
export class Reassembler {
  constructor(maxBytes = 64 * 1024 * 1024) {
    this.maxBytes = maxBytes;
    this.partial = new Map();
  }

  async add(chunk) {
    const { of, index, count, total_bytes: total, sha256, data } = chunk;
    if (total > this.maxBytes) return new ProtocolRefusal("too_large", `chunked message of ${total} bytes`);
    let p = this.partial.get(of);
    if (!p) {
      p = { count, total, sha256, pieces: new Map() };
      this.partial.set(of, p);
    }
    if (p.count !== count || p.total !== total || hex(p.sha256) !== hex(sha256)) {
      this.partial.delete(of);
      return new ProtocolRefusal("chunk_inconsistent", of);
    }
    p.pieces.set(index, data);
    if (p.pieces.size < count) return null;
    this.partial.delete(of);
    const whole = new Uint8Array(total);
    let at = 0;
    for (let i = 0; i < count; i++) {
      whole.set(p.pieces.get(i), at);
      at += p.pieces.get(i).byteLength;
    }
    const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", whole));
    if (at !== total || hex(digest) !== hex(sha256)) return new ProtocolRefusal("chunk_corrupt", of);
    return whole;
  }
}

// ------------------------------------------------------------------------- codecs

const CRC_TABLE = (() => {
  const t = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    t[n] = c >>> 0;
  }
  return t;
})();

/** CRC-32 (zlib's) of bytes. */
export function crc32(bytes) {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** The `base` checksum of a delta map: CRC-32 of the base's little-endian float32 bytes. */
export function baseChecksum(vector) {
  return crc32(new Uint8Array(vector.buffer, vector.byteOffset, vector.byteLength));
}

export function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}

const F32 = new Float32Array(1);
const U32 = new Uint32Array(F32.buffer);

/** float32 -> float16 bits, round to nearest even (as numpy and torch). */
export function floatToHalf(x) {
  F32[0] = x;
  const bits = U32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rem = mant & ((1 << shift) - 1);
    const mid = 1 << (shift - 1);
    if (rem > mid || (rem === mid && half & 1)) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && half & 1)) half++;
  return sign | half;
}

function payloadSize(codec, n, wire) {
  if (codec === "fp32") return 4 * n;
  const exact = wire.exact || 0;
  if (exact) return payloadSize(codec, n - exact, { ...wire, exact: 0 }) + 4 * exact;
  if (codec === "fp16") return 2 * n;
  if (codec === "int8") return 4 * Math.ceil(n / wire.block) + n;
  if (codec === "topk") return wire.k * (4 + (wire.values === "fp16" ? 2 : 4));
  throw new ProtocolRefusal("unknown_codec", String(codec));
}

/**
 * The float32 vector an encoded tensor map holds (docs/codecs.md): fp32 (XOR with the base
 * when a delta), fp16, int8 (blockwise scales), topk, each optionally zstd-compressed, a
 * lossy map's last `exact` values (running statistics) as float32 after its payload. A
 * delta is added to `base` in float32, exactly as the aggregator computes it, so both sides
 * hold the same bits (the next `base` checksum depends on it). ProtocolRefusal on anything
 * malformed or a base that is not the one the map names.
 */
export function decodeTensor(wire, base = null) {
  const { codec, n } = wire;
  if (!Number.isInteger(n) || n < 0) throw new ProtocolRefusal("bad_n", String(n));
  const exact = wire.exact === undefined ? 0 : wire.exact;
  if (!Number.isInteger(exact) || exact < 0 || exact > n || (exact && codec === "fp32")) throw new ProtocolRefusal("bad_exact", String(exact));
  const coded = n - exact;
  let b = null;
  if (wire.delta) {
    if (!base) throw new ProtocolRefusal("needs_base", "a delta needs the base it was made against");
    if (base.length !== n) throw new ProtocolRefusal("base_length", `${base.length} != ${n}`);
    if (wire.base !== undefined && wire.base !== baseChecksum(base)) throw new ProtocolRefusal("base_mismatch", "the delta names another base");
    b = base;
  }
  const expected = payloadSize(codec, n, wire);
  let raw = wire.data;
  if (wire.zstd) {
    try {
      raw = zstdDecompress(raw);
    } catch (e) {
      throw new ProtocolRefusal("zstd_error", String(e.message || e));
    }
  }
  if (raw.byteLength !== expected) throw new ProtocolRefusal("bad_length", `${raw.byteLength} bytes, expected ${expected}`);
  const bytes = new Uint8Array(raw); // aligned copy
  const view = new DataView(bytes.buffer);
  const out = new Float32Array(n);
  if (codec === "fp32") {
    const outBits = new Uint32Array(out.buffer);
    const baseBits = b ? new Uint32Array(b.buffer, b.byteOffset, n) : null;
    for (let i = 0; i < n; i++) {
      const bits = view.getUint32(4 * i, true);
      outBits[i] = baseBits ? (bits ^ baseBits[i]) >>> 0 : bits;
    }
  } else {
    const content = new Float32Array(n);
    const tail = expected - 4 * exact;
    for (let i = 0; i < exact; i++) content[coded + i] = view.getFloat32(tail + 4 * i, true);
    if (codec === "fp16") {
      for (let i = 0; i < coded; i++) content[i] = halfToFloat(view.getUint16(2 * i, true));
    } else if (codec === "int8") {
      const blocks = Math.ceil(coded / wire.block);
      const scales = new Float32Array(blocks);
      for (let j = 0; j < blocks; j++) {
        scales[j] = view.getFloat32(4 * j, true);
        if (!Number.isFinite(scales[j]) || scales[j] < 0) throw new ProtocolRefusal("bad_scale", "int8 scales must be finite and >= 0");
      }
      for (let i = 0; i < coded; i++) {
        const q = view.getInt8(4 * blocks + i);
        if (q < -127) throw new ProtocolRefusal("bad_quant", "int8 values lie in -127..127");
        content[i] = q * scales[Math.floor(i / wire.block)];
      }
    } else if (codec === "topk") {
      const k = wire.k;
      let index = 0;
      for (let j = 0; j < k; j++) {
        const gap = view.getUint32(4 * j, true);
        if (j > 0 && gap < 1) throw new ProtocolRefusal("duplicate_index", "topk gaps must be >= 1");
        index += gap;
        if (index >= coded) throw new ProtocolRefusal("index_range", `${index} >= ${coded}`);
        content[index] = wire.values === "fp16" ? halfToFloat(view.getUint16(4 * k + 2 * j, true)) : view.getFloat32(4 * k + 4 * j, true);
      }
    }
    for (let i = 0; i < n; i++) out[i] = b ? content[i] + b[i] : content[i]; // float32 sum on store
  }
  for (let i = 0; i < n; i++) if (!Number.isFinite(out[i])) throw new ProtocolRefusal("not_finite", "decoded vector holds NaN or Inf");
  return out;
}

function roundHalfEven(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/**
 * `vector` as an int8 map (as fedmq/codecs.py makes it): per block of `block` values one
 * float32 scale s = max|x| / 127 (nudged up so |x / s| <= 127), q = round-half-even(x / s).
 * With `base`, the map carries vector - base and names the base by its checksum. No zstd:
 * the aggregator decodes either way. Returns {wire, decoded}: decoded is what the receiver
 * will rebuild.
 */
export function encodeInt8(vector, base = null, block = 256) {
  const n = vector.length;
  const content = new Float32Array(n);
  for (let i = 0; i < n; i++) content[i] = base ? vector[i] - base[i] : vector[i];
  const blocks = Math.ceil(n / block);
  const bytes = new Uint8Array(4 * blocks + n);
  const view = new DataView(bytes.buffer);
  const decoded = new Float32Array(n);
  for (let j = 0; j < blocks; j++) {
    let peak = 0;
    const end = Math.min(n, (j + 1) * block);
    for (let i = j * block; i < end; i++) peak = Math.max(peak, Math.abs(content[i]));
    let s = Math.fround(peak / 127);
    if (s * 127 < peak) s = nextUpFloat32(s);
    view.setFloat32(4 * j, s, true);
    const safe = s > 0 ? s : 1;
    for (let i = j * block; i < end; i++) {
      const q = Math.max(-127, Math.min(127, roundHalfEven(content[i] / safe)));
      view.setInt8(4 * blocks + i, q);
      decoded[i] = Math.fround(Math.fround(q * s) + (base ? base[i] : 0));
    }
  }
  const wire = { codec: "int8", n, zstd: false, delta: base !== null, data: bytes, block };
  if (base) wire.base = baseChecksum(base);
  return { wire, decoded };
}

function nextUpFloat32(x) {
  F32[0] = x;
  U32[0] += x >= 0 ? 1 : -1;
  return F32[0];
}

// ------------------------------------------------------------------------- the model spec

/** The aggregator's advertised spec, checked: SHA-256(model_spec)[:16] must equal `model`. */
export async function readSpec(status) {
  const digest = hex(new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(status.model_spec))));
  if (digest.slice(0, 16) !== status.model) throw new ProtocolRefusal("bad_spec", `spec hash ${digest.slice(0, 16)} != ${status.model}`);
  const spec = JSON.parse(status.model_spec);
  const sizes = spec.shapes.map((s) => s.reduce((a, b) => a * b, 1));
  const offsets = [];
  let at = 0;
  for (const size of sizes) {
    offsets.push(at);
    at += size;
  }
  spec.numel = at;
  spec.sizes = sizes;
  spec.offsets = offsets;
  const trainable = spec.trainable ?? spec.names.length;
  // The head (spec.head in Python): the output layer, the last two trainable parameters.
  spec.headWeight = trainable - 2;
  spec.headBias = trainable - 1;
  spec.head = [offsets[spec.headWeight], offsets[spec.headBias] + sizes[spec.headBias]];
  spec.features = spec.shapes[spec.headWeight][1];
  return spec;
}

/** The digits fleet's normalization (what its device spec publishes), for the page's bundled samples. */
export const NORMALIZE = { digits: { scale: 16, mean: [0.30555450916290283], std: [0.37612447142601013] } };

/**
 * Raw values (pixels, samples after one another, channels first) as model inputs, bit for bit
 * as fedmq's loader makes them (the device spec's `normalize`): x = ((p / scale) - mean[c]) /
 * std[c], every step rounded to float32, mean and std too. `perChannel`: values per channel
 * in one sample (H * W).
 */
export function normalize(pixels, how = NORMALIZE.digits, perChannel = pixels.length) {
  const channels = how.mean.length;
  const mean = how.mean.map(Math.fround);
  const std = how.std.map(Math.fround);
  const out = new Float32Array(pixels.length);
  for (let i = 0; i < pixels.length; i++) {
    const c = Math.floor(i / perChannel) % channels;
    out[i] = Math.fround(Math.fround(pixels[i] / how.scale) - mean[c]) / std[c];
  }
  return out;
}

// ------------------------------------------------------------------------- device spec

export const DEVICE_SPEC_FORMAT = "fedmq-device-spec/1";
export const DEVICE_SPEC_PIECE_BYTES = 64 * 1024; // a feature map piece's data at most (fedmq/device_spec.py PIECE_BYTES)

async function sha256Hex(bytes) {
  return hex(new Uint8Array(await crypto.subtle.digest("SHA-256", bytes)));
}

/** A device spec piece's message as {spec, index, data}, or null if it is none (an empty message
 *  deletes a piece topic). */
export function readDeviceSpecPiece(payload) {
  if (!payload.byteLength) return null;
  try {
    const p = unpackb(payload, { maxMapLength: 8 });
    return p && typeof p.spec === "string" && Number.isInteger(p.index) && p.data instanceof Uint8Array ? p : null;
  } catch {
    return null;
  }
}

/** What a device spec message announces: its hash and how many feature map pieces follow. */
export async function deviceSpecHead(payload) {
  let msg;
  try {
    msg = unpackb(payload, { maxStrLength: 65536, maxMapLength: 16 });
  } catch (e) {
    throw new ProtocolRefusal("bad_device_spec", `not msgpack: ${e.message || e}`);
  }
  if (!msg || typeof msg.spec !== "string" || Object.keys(msg).length !== 2 || !Number.isInteger(msg.pieces) || msg.pieces < 0) {
    throw new ProtocolRefusal("bad_device_spec", "a map of exactly spec (str) and pieces (int)");
  }
  return { hash: (await sha256Hex(new TextEncoder().encode(msg.spec))).slice(0, 16), pieces: msg.pieces, spec: msg.spec };
}

/**
 * The fleet's device spec (docs/protocol.md, "Device spec") from its retained message and its
 * feature map's pieces (raw payloads or readDeviceSpecPiece's objects, any order), checked:
 * SHA-256(spec)[:16] must equal `advertised` (the status's `graph.device_spec`; null: not
 * checked here), the assembled feature map the spec's length and SHA-256. Returns {hash, doc,
 * featureMap (Float32Array or null)}; a ProtocolRefusal (thrown) names what does not match,
 * `incomplete` while pieces are missing. `withoutFeatureMap`: read the spec alone (no sketch).
 */
export async function readDeviceSpec(payload, pieces = [], advertised = null, withoutFeatureMap = false) {
  const msg = await deviceSpecHead(payload);
  const hash = msg.hash;
  if (advertised != null && hash !== advertised) throw new ProtocolRefusal("bad_device_spec", `hash ${hash}, the aggregator advertises ${advertised}`);
  const doc = JSON.parse(msg.spec);
  if (doc.format !== DEVICE_SPEC_FORMAT) throw new ProtocolRefusal("bad_device_spec", `format ${doc.format}, this agent reads ${DEVICE_SPEC_FORMAT}`);
  if (withoutFeatureMap) return { hash, doc, featureMap: null };
  const got = new Map();
  for (const raw of pieces) {
    const p = raw instanceof Uint8Array ? readDeviceSpecPiece(raw) : raw;
    if (p && p.spec === hash && p.index < msg.pieces) got.set(p.index, p.data);
  }
  if (got.size < msg.pieces) throw new ProtocolRefusal("incomplete", `${got.size} of ${msg.pieces} feature map pieces`);
  let featureMap = null;
  if (doc.sketch) {
    const blob = new Uint8Array(doc.sketch.bytes);
    let at = 0;
    for (let i = 0; i < msg.pieces; i++) {
      const data = got.get(i);
      if (at + data.byteLength > blob.byteLength) throw new ProtocolRefusal("bad_device_spec", "the feature map's pieces are longer than the spec says");
      blob.set(data, at);
      at += data.byteLength;
    }
    if (at !== blob.byteLength || (await sha256Hex(blob)) !== doc.sketch.sha256) {
      throw new ProtocolRefusal("bad_device_spec", "the feature map differs from the spec's length or SHA-256");
    }
    featureMap = new Float32Array(blob.buffer); // little-endian, as every platform ORT runs on
  } else if (msg.pieces) {
    throw new ProtocolRefusal("bad_device_spec", "feature map pieces without a sketch entry");
  }
  return { hash, doc, featureMap };
}

// ------------------------------------------------------------------------- data sketch

export const SKETCH_METHOD = "rff-1024-5eed-v1";
export const SKETCH_DIM = 1024;

/**
 * The CDFL data sketch (docs/protocol.md, "Device spec"; fedmq/device_spec.py
 * reference_sketch), bit for bit: per input z_j = b_j + sum_i x_i W_ij in float64 with i
 * rising, cos(z_j) in float64, the mean over inputs rounded to float32 then float16 (nearest
 * even), little-endian. W [d, 1024] and b [1024] are the fleet's published feature map.
 */
export function dataSketch(inputs, d, featureMap) {
  if (featureMap.length !== (d + 1) * SKETCH_DIM) throw new Error(`a feature map of ${featureMap.length} values is not for ${d} inputs`);
  const w = featureMap.subarray(0, d * SKETCH_DIM);
  const b = featureMap.subarray(d * SKETCH_DIM, d * SKETCH_DIM + SKETCH_DIM);
  const total = new Float64Array(SKETCH_DIM);
  const n = inputs.length / d;
  const acc = new Float64Array(SKETCH_DIM);
  for (let s = 0; s < n; s++) {
    acc.set(b);
    for (let i = 0; i < d; i++) {
      const xi = inputs[s * d + i]; // a float32 times a float32 is exact in float64
      const row = i * SKETCH_DIM;
      for (let j = 0; j < SKETCH_DIM; j++) acc[j] += xi * w[row + j];
    }
    for (let j = 0; j < SKETCH_DIM; j++) total[j] += Math.cos(acc[j]);
  }
  const out = new Uint8Array(2 * SKETCH_DIM);
  const view = new DataView(out.buffer);
  for (let j = 0; j < SKETCH_DIM; j++) view.setUint16(2 * j, floatToHalf(total[j] / n), true);
  return out;
}

// ------------------------------------------------------------------------- drift

/**
 * The Python agent's default drift rule (edge_agent/drift.py ThresholdDetector): drift when
 * the accuracy over the last `window` predictions falls more than `delta` below the
 * reference, the installed model's accuracy on local data; with no reference the first full
 * window's accuracy becomes it. One alarm per drift: the window starts afresh after it.
 */
export class ThresholdDetector {
  constructor(window = 200, delta = 0.1, reference = null) {
    this.window = window;
    this.delta = delta;
    this.reference = reference;
    this.bits = [];
    this.errors = 0;
    this.drift = false;
  }

  update(correct) {
    if (this.drift) {
      this.bits = [];
      this.errors = 0;
    }
    this.drift = false;
    const bit = correct ? 0 : 1;
    if (this.bits.length === this.window) this.errors -= this.bits.shift();
    this.bits.push(bit);
    this.errors += bit;
    if (this.bits.length < this.window) return false;
    const acc = 1 - this.errors / this.bits.length;
    if (this.reference === null) this.reference = acc;
    else if (acc < this.reference - this.delta) this.drift = true;
    return this.drift;
  }

  get windowAccuracy() {
    return this.bits.length ? 1 - this.errors / this.bits.length : null;
  }

  setReference(accuracy) {
    this.reference = accuracy;
    this.bits = [];
    this.errors = 0;
    this.drift = false;
  }
}

// ------------------------------------------------------------------------- head training

/**
 * Train the output layer (W [C, F], b [C]) on features h [N, F] and labels: softmax cross
 * entropy, mini-batch SGD with momentum, plus the proximal term (rho/2)||v - u||^2 toward the
 * received head u, with the Python agent's defaults (2 epochs, batch 32, lr 0.01, momentum
 * 0.9, rho 0.1). Returns new {W, b} (float32) and the mean loss of the last epoch.
 */
export function trainHead(h, labels, W0, b0, F, C, opts = {}) {
  const { epochs = 2, batchSize = 32, lr = 0.01, momentum = 0.9, rho = 0.1, seed = 0 } = opts;
  const N = labels.length;
  const W = Float64Array.from(W0);
  const b = Float64Array.from(b0);
  const vW = new Float64Array(W.length);
  const vb = new Float64Array(b.length);
  const rng = mulberry32(seed);
  const order = Array.from({ length: N }, (_, i) => i);
  let lastLoss = NaN;
  const p = new Float64Array(C);
  for (let epoch = 0; epoch < epochs; epoch++) {
    for (let i = N - 1; i > 0; i--) {
      const j = Math.floor(rng() * (i + 1));
      [order[i], order[j]] = [order[j], order[i]];
    }
    let lossSum = 0;
    for (let start = 0; start < N; start += batchSize) {
      const batch = order.slice(start, start + batchSize);
      const gW = new Float64Array(W.length);
      const gb = new Float64Array(b.length);
      for (const s of batch) {
        let max = -Infinity;
        for (let c = 0; c < C; c++) {
          let z = b[c];
          for (let f = 0; f < F; f++) z += W[c * F + f] * h[s * F + f];
          p[c] = z;
          if (z > max) max = z;
        }
        let sum = 0;
        for (let c = 0; c < C; c++) sum += (p[c] = Math.exp(p[c] - max));
        for (let c = 0; c < C; c++) p[c] /= sum;
        lossSum -= Math.log(Math.max(p[labels[s]], 1e-12));
        p[labels[s]] -= 1;
        for (let c = 0; c < C; c++) {
          gb[c] += p[c];
          for (let f = 0; f < F; f++) gW[c * F + f] += p[c] * h[s * F + f];
        }
      }
      const m = batch.length;
      for (let i = 0; i < W.length; i++) {
        vW[i] = momentum * vW[i] + gW[i] / m + rho * (W[i] - W0[i]);
        W[i] -= lr * vW[i];
      }
      for (let c = 0; c < C; c++) {
        vb[c] = momentum * vb[c] + gb[c] / m + rho * (b[c] - b0[c]);
        b[c] -= lr * vb[c];
      }
    }
    lastLoss = lossSum / N;
  }
  return { W: Float32Array.from(W), b: Float32Array.from(b), loss: lastLoss };
}

function mulberry32(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
