// The browser agent's page: a login form, the model's state, a drawing pad, the event log.
// window.fedmqAgentPage exposes the same actions to scripts (tests/test_browser.py drives it).

import { BrowserAgent, argmax, loadRawSamples, normalizedSamples } from "./agent.js";
import * as P from "./fedmq.js";

const $ = (id) => document.getElementById(id);
const logLines = [];
const page = { agent: null, samples: null, results: [], ready: null };
window.fedmqAgentPage = page;

function log(line) {
  const stamp = new Date().toISOString().slice(11, 23);
  logLines.push(`${stamp} ${line}`);
  $("log").textContent = logLines.slice(-200).join("\n");
  $("log").scrollTop = 1e9;
}

function show(agent) {
  const s = agent.aggregator;
  const rows = [
    ["aggregator", s ? `${s.state} (${s.algorithm}, epoch ${s.epoch})` : "-"],
    ["model", s ? `${s.model_name} ${s.model} (${agent.spec ? agent.spec.numel : "?"} values)` : "-"],
    ["codec", s && s.codec ? Object.entries(s.codec).map(([k, v]) => `${k}=${v}`).join(" ") : "-"],
    ["my epoch", agent.base ? String(agent.epoch) : "not joined"],
    ["accuracy", agent.counters.last_accuracy !== undefined ? agent.counters.last_accuracy.toFixed(4) : "-"],
    ["uploads", `${agent.counters.uploads} (${agent.counters.refused} refused${agent.counters.last_refusal ? ", last: " + agent.counters.last_refusal : ""})`],
    ["drift", `${agent.counters.drifts} detected; window ${agent.detector.bits.length}/${agent.detector.window}, reference ${agent.detector.reference === null ? "-" : agent.detector.reference.toFixed(3)}`],
    ["local data", `${page.samples ? page.samples.n : 0} samples`],
  ];
  $("model").innerHTML = rows.map(([k, v]) => `<dt>${k}</dt><dd${/refused/.test(v) && agent.counters.refused ? ' class="refused"' : ""}>${escape(v)}</dd>`).join("");
  const online = agent.client && agent.client.connected;
  $("state").textContent = online ? `${agent.agent} online` : "offline";
  $("state").className = "pill " + (online ? "online" : "offline");
}

function escape(s) {
  return String(s).replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]);
}

/** The page fetches a feature map of up to 512 KiB over the broker's WebSockets (the digits' is
 *  266 KB, about 6 s from an idle Mosquitto 2.0.11, which sends a WebSocket subscriber about
 *  45 KB/s); a larger one would cost a minute or more, so the page then sends no sketch and the
 *  aggregator estimates its mixture from the model alone. */
const PAGE_SETTINGS = { featureMapMaxBytes: 512 * 1024 };

/** Join with these settings; the result of the join (or the refusal) comes back. The fleet's
 *  device spec says how to normalize and sketch the page's samples, and which it needs. */
page.connect = async ({ url, fleet, agent, password, settings }) => {
  const a = new BrowserAgent({ url, fleet, agent, password, settings: { ...PAGE_SETTINGS, ...settings }, deviceSpec: true }, log);
  a.onChange(show);
  page.agent = a;
  let joined;
  try {
    const connected = await a.connect();
    joined = connected.refused ? connected : await samplesFor(a);
    if (!joined) joined = await a.join();
  } catch (e) {
    joined = { refused: "connect_failed", detail: String(e.message || e) };
  }
  if (joined.refused) log(`join.refused reason=${joined.refused} detail=${JSON.stringify(joined.detail || "")}`);
  if (a.device) labelOptions($("label"), a.device.doc.labels);
  show(a);
  for (const id of ["cycle", "stream", "predict", "add", "images", "folders"]) $(id).disabled = !!joined.refused;
  return joined;
};

/** Fill a <select> with the fleet's label names (from its device spec), valued by index. */
function labelOptions(select, labels, chosen = null) {
  select.innerHTML = labels.map((name, i) => `<option value="${i}"${i === chosen ? " selected" : ""}>${escape(name)}</option>`).join("");
}

/** The page's own samples for the fleet's input shape, normalized by its device spec; a refusal
 *  where the page bundles none of that shape. */
async function samplesFor(a) {
  const shape = a.device.doc.input_shape;
  const raw = await loadRawSamples(shape);
  if (!raw) { // the user's own images will be its data
    const d = shape.reduce((x, y) => x * y, 1);
    page.samples = a.samples = { n: 0, x: new Float32Array(0), y: new Int32Array(0), raw: [], d };
    log(`samples.none agent=${a.agent} input=${shape.join("x")} detail="no bundled samples of this shape: pick labelled images"`);
    return null;
  }
  page.samples = a.samples = normalizedSamples(raw, a.device);
  log(`samples.loaded agent=${a.agent} samples=${raw.n} input=${shape.join("x")} dataset=${a.device.doc.dataset}`);
  return null;
}

page.cycle = async () => {
  const r = await page.agent.cycle();
  page.results.push(r);
  show(page.agent);
  return { ...r, uploaded: undefined, sketchBytes: undefined };
};

/** Test-then-train over the sample set (in order, or relabelled by `relabel`): each prediction
 *  feeds the drift rule; a pending drift that the interval allows starts a cycle. */
page.stream = async (relabel = null) => {
  const a = page.agent;
  const { n, x, y, d } = page.samples;
  let cycles = 0;
  for (let s = 0; s < n; s++) {
    await a.observe(x.subarray(s * d, (s + 1) * d), relabel ? relabel[y[s]] : y[s]);
    if (a.shouldUpdate()) {
      await page.cycle();
      cycles++;
    }
  }
  show(a);
  return { observed: a.counters.observed, drifts: a.counters.drifts, cycles };
};

/** The held model's logits on every bundled sample, and what they were computed from. */
page.parity = async () => {
  const a = page.agent;
  const logits = await a.logits(page.samples.x);
  return {
    logits: Array.from(logits), classes: a.spec.num_classes, pixels: page.samples.raw, normalize: a.device.doc.normalize, labels: a.device.doc.labels,
    inputShape: a.spec.input_shape, names: a.spec.names, shapes: a.spec.shapes,
    vector: b64(new Uint8Array(a.base.buffer)), graph: b64(a.graph), graphSha256: a.aggregator.graph.sha256,
  };
};

function b64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

// ------------------------------------------------------------------ drawing pad

const pad = $("pad");
const ctx = pad.getContext("2d");
function clearPad() {
  ctx.fillStyle = "#000";
  ctx.fillRect(0, 0, pad.width, pad.height);
}
clearPad();
let drawing = false;
pad.addEventListener("pointerdown", (e) => {
  drawing = true;
  ctx.beginPath();
  ctx.moveTo(e.offsetX, e.offsetY);
});
pad.addEventListener("pointermove", (e) => {
  if (!drawing) return;
  ctx.strokeStyle = "#fff";
  ctx.lineWidth = 16;
  ctx.lineCap = "round";
  ctx.lineTo(e.offsetX, e.offsetY);
  ctx.stroke();
});
for (const ev of ["pointerup", "pointerleave"]) pad.addEventListener(ev, () => (drawing = false));

/** An image (the pad, a picked file's bitmap) as one raw input of the fleet's shape [C, H, W]:
 *  shrunk by a canvas (an image of that size is taken pixel for pixel), 0..255 rescaled to the
 *  spec's raw range (16 for digits); on a one-channel fleet made grey and, with `paper`,
 *  inverted where its background is light (a digit written on paper). */
function rawPixels(source, paper = false) {
  const [channels, h, w] = page.agent.spec.input_shape;
  const small = document.createElement("canvas");
  [small.width, small.height] = [w, h];
  const sctx = small.getContext("2d");
  sctx.imageSmoothingEnabled = true;
  sctx.imageSmoothingQuality = "high";
  sctx.drawImage(source, 0, 0, w, h);
  const img = sctx.getImageData(0, 0, w, h).data;
  const top = page.agent.device.doc.normalize.scale;
  const out = new Float32Array(channels * h * w);
  if (channels === 1) {
    let mean = 0;
    for (let i = 0; i < h * w; i++) mean += out[i] = (img[4 * i] + img[4 * i + 1] + img[4 * i + 2]) / 3;
    const invert = paper && mean / (h * w) > 128;
    for (let i = 0; i < h * w; i++) out[i] = ((invert ? 255 - out[i] : out[i]) / 255) * top;
    return out;
  }
  for (let c = 0; c < channels; c++) for (let i = 0; i < h * w; i++) out[c * h * w + i] = (img[4 * i + c] / 255) * top;
  return out;
}

const padPixels = () => rawPixels(pad);

function padInput() {
  const [, h, w] = page.agent.spec.input_shape;
  return P.normalize(padPixels(), page.agent.device.doc.normalize, h * w);
}

page.predictPad = async () => {
  const a = page.agent;
  const logits = await a.logits(padInput());
  const k = argmax(logits, 0, a.spec.num_classes);
  const max = Math.max(...logits);
  const exps = Array.from(logits, (z) => Math.exp(z - max));
  const p = exps[k] / exps.reduce((s, v) => s + v, 0);
  $("prediction").textContent = `prediction: ${a.device.doc.labels[k]} (p = ${p.toFixed(2)})`;
  return { label: k, name: a.device.doc.labels[k], p };
};

$("predict").onclick = () => page.predictPad();
$("clear").onclick = () => {
  clearPad();
  $("prediction").textContent = "-";
};
$("file").onchange = async () => {
  const file = $("file").files[0];
  if (!file) return;
  const bitmap = await createImageBitmap(file);
  ctx.drawImage(bitmap, 0, 0, pad.width, pad.height);
  if (page.agent.spec.input_shape[0] === 1) greyOnBlack();
  await page.predictPad();
};

/** A one-channel fleet's digits are light on dark: the pad's picture made grey, and inverted
 *  where its background is light (a digit written on paper). */
function greyOnBlack() {
  const img = ctx.getImageData(0, 0, pad.width, pad.height);
  let mean = 0;
  for (let i = 0; i < img.data.length; i += 4) {
    const g = (img.data[i] + img.data[i + 1] + img.data[i + 2]) / 3;
    img.data[i] = img.data[i + 1] = img.data[i + 2] = g;
    mean += g;
  }
  if (mean / (img.data.length / 4) > 128) for (let i = 0; i < img.data.length; i += 4) img.data[i] = img.data[i + 1] = img.data[i + 2] = 255 - img.data[i];
  ctx.putImageData(img, 0, 0);
}
// ------------------------------------------------------------------ picked images

page.picked = []; // {file, path, label: index or null}: picked, not yet in the local data

/** The label a picked file's folder names (`.../triangle/3.png` -> "triangle"), or null. */
function folderLabel(path, labels) {
  const parts = path.split("/");
  if (parts.length < 2) return null;
  const folder = parts[parts.length - 2].toLowerCase();
  const i = labels.findIndex((name) => name.toLowerCase() === folder);
  return i < 0 ? null : i;
}

function renderPicked() {
  const labels = page.agent ? page.agent.device.doc.labels : [];
  const rows = page.picked.map((p, i) => `<tr><td>${escape(p.path)}</td><td><select data-i="${i}" data-path="${escape(p.path)}">` +
    `<option value=""${p.label === null ? " selected" : ""}>label?</option>` +
    labels.map((name, k) => `<option value="${k}"${k === p.label ? " selected" : ""}>${escape(name)}</option>`).join("") + "</select></td></tr>");
  $("picked").tBodies[0].innerHTML = rows.join("");
  for (const sel of $("picked").querySelectorAll("select")) {
    sel.onchange = () => (page.picked[Number(sel.dataset.i)].label = sel.value === "" ? null : Number(sel.value));
  }
  const unlabelled = page.picked.filter((p) => p.label === null).length;
  $("picked-state").textContent = page.picked.length ? `${page.picked.length} picked, ${unlabelled} without a label` : "none picked";
  for (const id of ["use-picked", "add-picked"]) $(id).disabled = !page.picked.length;
}

function pick(input) {
  const labels = page.agent.device.doc.labels;
  for (const file of input.files) {
    if (file.type && !file.type.startsWith("image/")) continue; // a folder holds other files too
    const path = file.webkitRelativePath || file.name;
    page.picked.push({ file, path, label: folderLabel(path, labels) });
  }
  input.value = "";
  renderPicked();
}
$("images").onchange = () => pick($("images"));
$("folders").onchange = () => pick($("folders"));

/** The picked images, each labelled, as local data: instead of the samples held (`replace`) or
 *  added to them. Refused while any has no label; an unreadable file is left out and said. */
page.usePicked = async (replace) => {
  const unlabelled = page.picked.filter((p) => p.label === null);
  if (!page.picked.length || unlabelled.length) {
    const detail = page.picked.length ? `${unlabelled.length} picked images have no label (${unlabelled[0].path})` : "no images picked";
    log(`sample.refused reason=no_label detail=${JSON.stringify(detail)}`);
    return { refused: "no_label", detail };
  }
  const raws = [];
  const labels = [];
  const paths = [];
  for (const p of page.picked) {
    try {
      const bitmap = await createImageBitmap(p.file, { colorSpaceConversion: "none", premultiplyAlpha: "none" });
      raws.push(rawPixels(bitmap, true));
      labels.push(p.label);
      paths.push(p.path);
    } catch (e) {
      log(`sample.refused reason=not_an_image path=${JSON.stringify(p.path)}`);
    }
  }
  const s = replace ? { ...page.samples, n: 0, x: new Float32Array(0), y: new Int32Array(0), raw: [] } : page.samples;
  const { normalize, input_shape: shape } = page.agent.device.doc;
  const perChannel = shape[1] * shape[2];
  const x = new Float32Array(s.x.length + raws.length * s.d);
  x.set(s.x);
  raws.forEach((r, i) => x.set(P.normalize(r, normalize, perChannel), s.x.length + i * s.d));
  page.samples = { ...s, n: s.n + raws.length, x, y: Int32Array.from([...s.y, ...labels]), raw: [...s.raw, ...raws.map((r) => Array.from(r))] };
  page.agent.samples = page.samples;
  page.picked = [];
  renderPicked();
  const counts = labels.reduce((m, k) => ((m[k] = (m[k] || 0) + 1), m), {});
  log(`samples.picked agent=${page.agent.agent} images=${raws.length} ${replace ? "replaced" : "added"} samples=${page.samples.n} ` +
    `labels=${Object.entries(counts).map(([k, v]) => `${page.agent.device.doc.labels[k]}:${v}`).join(",")}`);
  show(page.agent);
  return { ok: true, images: raws.length, samples: page.samples.n, labels, paths };
};
$("use-picked").onclick = async () => (page.pickedResult = await page.usePicked(true));
$("add-picked").onclick = async () => (page.pickedResult = await page.usePicked(false));

$("add").onclick = () => {
  const label = Number($("label").value);
  const labels = page.agent.device.doc.labels;
  if (!Number.isInteger(label) || label < 0 || label >= labels.length) {
    return log(`sample.refused reason=bad_label detail="pick one of the fleet's ${labels.length} labels"`);
  }
  const s = page.samples;
  const x = new Float32Array(s.x.length + s.d);
  x.set(s.x);
  x.set(padInput(), s.x.length);
  const y = new Int32Array(s.n + 1);
  y.set(s.y);
  y[s.n] = label;
  page.samples = { ...s, n: s.n + 1, x, y, raw: [...s.raw, Array.from(padPixels())] };
  page.agent.samples = page.samples;
  log(`sample.added label=${label} samples=${page.samples.n}`);
  show(page.agent);
};

// ------------------------------------------------------------------ the form

const params = new URLSearchParams(location.search);
for (const key of ["url", "fleet", "agent"]) if (params.get(key)) $("login").elements[key].value = params.get(key);
$("login").onsubmit = (e) => {
  e.preventDefault();
  const f = $("login").elements;
  page.ready = page.connect({ url: f.url.value, fleet: f.fleet.value, agent: f.agent.value, password: f.password.value });
};
$("cycle").onclick = () => page.cycle();
$("stream").onclick = () => page.stream();
page.loaded = true;
