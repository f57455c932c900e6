// The JavaScript agent as a command-line device in Node.js: no browser, no Python. It joins a
// fleet with the same module the browser page runs (agent.js), reads the fleet's published
// device spec for everything it must compute as fedmq does (input normalization, head, the
// sketch's feature map), trains the output layer on images from IDX files (MNIST's format) and
// uploads. docs/device_protocol.md walks through it.
//
//   node web/agent-cli.mjs --broker mqtt://127.0.0.1:1883 --fleet garage --id node-1 \
//       --images t10k-images-idx3-ubyte --labels t10k-labels-idx1-ubyte --cycles 3
//
// The password comes from FEDMQ_BROKER_PASSWORD (as `fedmq agent`'s). One line per event on
// stdout; a refusal that ends it is one line on stderr, exit status 1 (2: a bad command line).
// SIGUSR1 runs one more update cycle (with --stay); SIGTERM or SIGINT leaves with an offline status.

import { mkdirSync, readFileSync, renameSync, writeFileSync, appendFileSync } from "node:fs";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { BrowserAgent } from "./agent.js";
import * as P from "./fedmq.js";

const USAGE = "usage: node web/agent-cli.mjs --broker URL --fleet FLEET --id AGENT --images IDX --labels IDX "
  + "[--samples N] [--offset N] [--cycles N] [--stay] [--state-dir DIR] [--ca-file CA] [--report FILE] [--timeout-s S]";

class Usage extends Error {}

function options(argv) {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      options: {
        broker: { type: "string" }, fleet: { type: "string" }, id: { type: "string" },
        images: { type: "string" }, labels: { type: "string" },
        samples: { type: "string", default: "200" }, offset: { type: "string", default: "0" },
        cycles: { type: "string", default: "1" }, stay: { type: "boolean", default: false },
        "state-dir": { type: "string" }, "ca-file": { type: "string" }, report: { type: "string" },
        "timeout-s": { type: "string", default: "120" }, help: { type: "boolean", default: false },
      },
    }).values;
  } catch (e) {
    throw new Usage(e.message);
  }
  if (parsed.help) {
    console.log(USAGE);
    process.exit(0);
  }
  for (const key of ["broker", "fleet", "id", "images", "labels"]) if (!parsed[key]) throw new Usage(`--${key} is required`);
  const int = (key, low) => {
    const v = Number(parsed[key]);
    if (!Number.isInteger(v) || v < low) throw new Usage(`--${key} must be an integer >= ${low}, got ${parsed[key]}`);
    return v;
  };
  return { ...parsed, samples: int("samples", 1), offset: int("offset", 0), cycles: int("cycles", 0), timeoutS: int("timeout-s", 1) };
}

/** An IDX file (MNIST's format: big-endian dims, unsigned bytes) as {dims, data}. */
export function readIdx(path) {
  const bytes = readFileSync(path);
  if (bytes.length < 4 || bytes[0] !== 0 || bytes[1] !== 0 || bytes[2] !== 0x08) {
    throw new Usage(`${path}: not an IDX file of unsigned bytes (magic 0x0000 08 NN)`);
  }
  const ndim = bytes[3];
  const dims = [];
  for (let i = 0; i < ndim; i++) dims.push(bytes.readUInt32BE(4 + 4 * i));
  const at = 4 + 4 * ndim;
  const size = dims.reduce((a, b) => a * b, 1);
  if (bytes.length !== at + size) throw new Usage(`${path}: ${bytes.length - at} data bytes, its dims ${dims.join("x")} say ${size}`);
  return { dims, data: new Uint8Array(bytes.buffer, bytes.byteOffset + at, size) };
}

/** The raw samples the agent trains on: `count` images from `offset`, and their labels. */
function rawSamples(o) {
  const images = readIdx(o.images);
  const labels = readIdx(o.labels);
  if (labels.dims.length !== 1 || labels.dims[0] !== images.dims[0]) {
    throw new Usage(`${o.labels}: ${labels.dims.join("x")} labels for ${images.dims[0]} images`);
  }
  const n = Math.min(o.samples, images.dims[0] - o.offset);
  if (n < 1) throw new Usage(`--offset ${o.offset} leaves no image of ${images.dims[0]}`);
  const d = images.dims.slice(1).reduce((a, b) => a * b, 1);
  return { n, shape: images.dims.slice(1), pixels: images.data.subarray(o.offset * d, (o.offset + n) * d),
    labels: Int32Array.from(labels.data.subarray(o.offset, o.offset + n)) };
}

/** The samples as the fleet's model takes them: normalized by the device spec it publishes. */
function samplesFor(raw, agent) {
  const { doc } = agent.device;
  const shape = doc.input_shape;
  const own = raw.shape.length === shape.length - 1 ? [1, ...raw.shape] : raw.shape; // IDX images carry no channel axis
  if (own.join("x") !== shape.join("x")) {
    throw new Refused("wrong_input", `the images are ${raw.shape.join("x")}, the fleet's model takes ${shape.join("x")} (${doc.model_name} on ${doc.dataset})`);
  }
  const classes = Math.min(agent.spec.num_classes, doc.labels.length);
  const bad = raw.labels.find((y) => y >= classes);
  if (bad !== undefined) throw new Refused("wrong_labels", `label ${bad}, the fleet knows ${classes} (${doc.labels.join(", ")})`);
  const perChannel = shape.slice(1).reduce((a, b) => a * b, 1);
  return { n: raw.n, x: P.normalize(raw.pixels, doc.normalize, perChannel), y: raw.labels, d: shape.reduce((a, b) => a * b, 1) };
}

class Refused extends Error {
  constructor(reason, detail) {
    super(`${reason}: ${detail}`);
    this.reason = reason;
    this.detail = detail;
  }
}

/** The msg_id floor in the state dir, so ids rise across restarts (localStorage's part in a browser). */
function fileStorage(dir) {
  if (!dir) return null;
  mkdirSync(dir, { recursive: true });
  const path = (key) => join(dir, key.replace(/[^A-Za-z0-9_.-]/g, "_"));
  return {
    getItem: (key) => {
      try {
        return readFileSync(path(key), "utf8").trim();
      } catch {
        return null;
      }
    },
    setItem: (key, value) => {
      writeFileSync(`${path(key)}.tmp`, value);
      renameSync(`${path(key)}.tmp`, path(key));
    },
  };
}

function b64(array) {
  return Buffer.from(array.buffer, array.byteOffset, array.byteLength).toString("base64");
}

async function main() {
  const started = performance.now();
  const o = options(process.argv.slice(2));
  const raw = rawSamples(o);
  const url = new URL(o.broker);
  const user = decodeURIComponent(url.username || "") || o.id;
  url.username = "";
  url.password = "";
  const say = (line) => console.log(line);
  const agent = new BrowserAgent({
    url: url.href.replace(/\/$/, ""), fleet: o.fleet, agent: o.id, password: process.env.FEDMQ_BROKER_PASSWORD,
    profile: "node", deviceSpec: true, storage: fileStorage(o["state-dir"]),
    mqtt: { username: user, ...(o["ca-file"] ? { ca: readFileSync(o["ca-file"]), rejectUnauthorized: true } : {}) },
  }, say);
  const report = (entry) => o.report && appendFileSync(o.report, JSON.stringify(entry) + "\n");

  const join = async () => {
    agent.samples = samplesFor(raw, agent);
    const t = performance.now();
    const joined = await agent.join();
    if (joined.refused) throw new Refused(joined.refused, joined.detail);
    const seconds = (performance.now() - t) / 1000;
    say(`agent.joined agent=${o.id} epoch=${joined.epoch} samples=${raw.n} device_spec=${agent.device.hash} join_s=${seconds.toFixed(3)} since_start_s=${((performance.now() - started) / 1000).toFixed(3)}`);
    report({ join: true, msgId: joined.msgId, epoch: joined.epoch, seconds, deviceSpec: agent.device.hash, installedCrc: P.baseChecksum(agent.base) });
  };

  const connected = await agent.connect(o.timeoutS);
  if (connected.refused) throw new Refused(connected.refused, connected.detail);
  await join();

  // SIGUSR1 asks for a cycle, SIGTERM or SIGINT to leave: taken between cycles, never inside one.
  const asked = { cycles: 0, stop: false, wake: null };
  const poke = () => asked.wake && asked.wake();
  process.on("SIGUSR1", () => (asked.cycles++, poke()));
  for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => ((asked.stop = true), poke()));

  let done = 0;
  const cycle = async () => {
    const r = await agent.cycle();
    if (r.refused === "device_spec_changed") { // the one line is logged; read the new spec, join again
      report({ refused: r.refused, detail: r.detail });
      const again = await agent.reload(o.timeoutS);
      if (again.refused) throw new Refused(again.refused, again.detail);
      await join();
      return;
    }
    done++;
    report({ cycle: done, msgId: r.msgId, tau: r.tau, refused: r.refused || null, epoch: r.epoch ?? null,
      accuracy: r.accuracy ?? null, accHeld: r.accHeld, seconds: r.seconds, computeS: r.computeS, replyS: r.replyS,
      bytes: r.bytes, sketch: r.sketchBytes ? Buffer.from(r.sketchBytes).toString("hex") : null,
      uploaded: r.uploaded ? b64(r.uploaded) : null, installedCrc: agent.base ? P.baseChecksum(agent.base) : null });
    const outcome = r.refused ? `refused=${r.refused}` : `epoch=${r.epoch} accuracy=${r.accuracy.toFixed(4)}`;
    say(`cycle.done agent=${o.id} cycle=${done} ${outcome} cycle_s=${(r.seconds || 0).toFixed(3)} `
      + `compute_s=${(r.computeS || 0).toFixed(3)} reply_s=${(r.replyS || 0).toFixed(3)}`);
  };
  for (let tries = 0; done < o.cycles && tries < o.cycles + 3 && !asked.stop; tries++) await cycle();
  if (!o.stay) return agent;
  say(`agent.waiting agent=${o.id} cycles=${done} (SIGUSR1: one more cycle; SIGTERM: leave)`);
  while (!asked.stop) {
    if (asked.cycles > 0) {
      asked.cycles--;
      await cycle();
      continue;
    }
    await new Promise((resolve) => (asked.wake = resolve));
    asked.wake = null;
  }
  return agent;
}

let agent = null;
try {
  agent = await main();
  await agent.close();
  process.exit(0);
} catch (e) {
  if (e instanceof Usage) {
    console.error(`agent-cli: ${e.message} (${USAGE})`);
    process.exit(2);
  }
  if (e instanceof Refused) {
    console.error(`agent-cli: refused: ${e.message}`);
    process.exit(1);
  }
  throw e;
}
