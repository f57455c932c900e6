// The live fleet page: every agent's retained status (state, epoch, accuracy, last upload)
// and the aggregator's own status and counters, updated as they change, and two charts drawn
// from the same statuses: each agent's accuracy over time and the uploads the aggregator
// applied per minute (uPlot, loaded by fleet.html as window.uPlot). Read-only: it subscribes
// to the status topics, which is all a monitor login may read.

import mqtt from "mqtt";
import * as P from "./fedmq.js";

const $ = (id) => document.getElementById(id);
const ACCURACY_KEYS = ["last_accuracy", "accuracy", "acc"]; // as fedmq/fleet_status.py reads them
const UPLOAD_KEYS = ["last_upload_at", "last_upload_time", "last_upload"];
const page = { agents: new Map(), aggregator: null, updates: 0, client: null, history: [] };
window.fedmqFleetPage = page;

// ------------------------------------------------------------------ charts

const SHOWN_MINUTES = 120; // the uploads chart's window
const MAX_POINTS = 2000; // per agent, and minutes of uploads kept: a page left open for days stays small
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const series = new Map(); // agent -> [{t, epoch, accuracy}]: a point each time its accuracy or epoch changed
const minutes = new Map(); // minute (unix s) -> uploads applied then
let applied = null; // the aggregator's applied-upload count at its last status
const charts = { accuracy: null, uploads: null, agents: "" };

/** A point when an agent's status brings an accuracy or epoch it did not have (a model
 *  installed): at the status's send time, the agent's clock. */
function notePoint(env, accuracy) {
  if (accuracy === null) return false;
  const points = series.get(env.agent) || [];
  const last = points[points.length - 1];
  if (last && last.accuracy === accuracy && last.epoch === (env.epoch ?? 0)) return false;
  points.push({ t: env.sent_at || Date.now() / 1000, epoch: env.epoch ?? 0, accuracy });
  if (points.length > MAX_POINTS) points.shift();
  series.set(env.agent, points);
  return true;
}

/** The uploads applied since the aggregator's previous status, counted in the minute of this
 *  one (its `applied.update` counter; the epoch where it has none). Uploads before the page
 *  opened are not counted: the first status is where counting starts. */
function noteUploads(env) {
  const count = (env.counters || {})["applied.update"] ?? env.epoch ?? 0;
  const before = applied;
  applied = count;
  if (before === null || count <= before) return before === null;
  const minute = Math.floor((env.sent_at || Date.now() / 1000) / 60) * 60;
  minutes.set(minute, (minutes.get(minute) || 0) + count - before);
  if (minutes.size > MAX_POINTS) minutes.delete(Math.min(...minutes.keys()));
  return true;
}

function chartWidth(id) {
  return Math.max(300, $(id).clientWidth || 400);
}

/** Both charts from the points held: remade when an agent appears, else given the new data. */
function drawCharts() {
  const uPlot = window.uPlot;
  if (!uPlot) return; // the chart library did not load: the tables still work
  const agents = [...series.keys()].sort();
  const times = [...new Set(agents.flatMap((a) => series.get(a).map((p) => p.t)))].sort((x, y) => x - y);
  const at = new Map(times.map((t, i) => [t, i]));
  const accData = [times, ...agents.map((a) => {
    const col = new Array(times.length).fill(null);
    for (const p of series.get(a)) col[at.get(p.t)] = p.accuracy;
    return col;
  })];
  if (charts.agents !== agents.join("\n") || !charts.accuracy) {
    if (charts.accuracy) charts.accuracy.destroy();
    charts.accuracy = new uPlot({
      width: chartWidth("accuracy-chart"), height: 200,
      scales: { y: { range: [0, 1] } },
      series: [{}, ...agents.map((a, i) => ({ label: a, stroke: COLOURS[i % COLOURS.length], spanGaps: true, points: { show: true, size: 6 } }))],
      axes: [{}, { label: "accuracy" }],
    }, accData, $("accuracy-chart"));
    charts.agents = agents.join("\n");
  } else {
    charts.accuracy.setData(accData);
  }
  // Every minute from two before the first upload seen to now (the last SHOWN_MINUTES), a bar
  // each: a minute without uploads shows as none.
  const seen = [...minutes.keys()];
  const last = Math.max(Math.floor(Date.now() / 60000) * 60, ...seen);
  const mins = [];
  for (let m = Math.max(seen.length ? Math.min(...seen) - 120 : last - 300, last - 60 * SHOWN_MINUTES); m <= last; m += 60) mins.push(m);
  const upData = [mins, mins.map((m) => minutes.get(m) || 0)];
  if (!charts.uploads) {
    charts.uploads = new uPlot({
      width: chartWidth("uploads-chart"), height: 200,
      scales: { y: { range: (u, min, max) => [0, Math.max(1, max)] } },
      series: [{}, { label: "uploads / min", stroke: "#1f3a5f", fill: "#1f3a5f55", paths: uPlot.paths.bars({ size: [0.6, 40] }), points: { show: false } }],
      axes: [{}, { label: "uploads" }],
    }, upData, $("uploads-chart"));
  } else {
    charts.uploads.setData(upData);
  }
}

/** What the charts hold (read back from the uPlot instances): scripts and the test see the
 *  points drawn, not only the statuses behind them. */
page.charts = () => {
  const acc = charts.accuracy;
  const points = {};
  if (acc) {
    acc.series.slice(1).forEach((s, i) => {
      points[s.label] = acc.data[0].map((t, j) => [t, acc.data[i + 1][j]]).filter(([, v]) => v !== null);
    });
  }
  const up = charts.uploads;
  return { accuracy: points, uploads: up ? up.data[0].map((t, j) => [t, up.data[1][j]]) : [],
    canvases: document.querySelectorAll(".chart canvas").length };
};

function first(counters, keys) {
  for (const k of keys) if (typeof counters[k] === "number") return counters[k];
  return null;
}

function ago(t) {
  if (!t) return "-";
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : s < 5400 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

function esc(s) {
  return String(s).replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]);
}

/** The table as data (what the page shows), for scripts and the test. */
page.rows = () =>
  [...page.agents.values()].sort((a, b) => a.agent.localeCompare(b.agent)).map((s) => ({
    agent: s.agent, state: s.state, epoch: s.epoch ?? 0,
    accuracy: first(s.counters || {}, ACCURACY_KEYS), lastUploadAt: first(s.counters || {}, UPLOAD_KEYS),
    uploads: (s.counters || {}).uploads ?? null, sentAt: s.sent_at,
  }));

function render() {
  const a = page.aggregator;
  const agg = a ? [
    ["state", a.state], ["algorithm", a.algorithm], ["epoch", a.epoch], ["model", `${a.model_name} ${a.model}`],
    ["clusters", a.clusters], ["codec", Object.entries(a.codec || {}).map(([k, v]) => `${k}=${v}`).join(" ")],
    ["started", a.started_at ? new Date(a.started_at * 1000).toISOString().replace("T", " ").slice(0, 19) : "-"],
    ["status sent", ago(a.sent_at)],
  ] : [["status", "no aggregator status yet"]];
  $("aggregator").innerHTML = agg.map(([k, v]) => `<dt>${k}</dt><dd>${esc(v)}</dd>`).join("");
  $("counters").innerHTML = a ? Object.entries(a.counters || {}).sort().map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("") : "";
  const rows = page.rows();
  $("count").textContent = `(${rows.filter((r) => r.state === "online").length} online of ${rows.length})`;
  $("agents").tBodies[0].innerHTML = rows.map((r) => `<tr data-agent="${esc(r.agent)}"><td>${esc(r.agent)}</td>` +
    `<td><span class="pill ${r.state}">${esc(r.state)}</span></td><td class="num">${r.epoch}</td>` +
    `<td class="num">${r.accuracy === null ? "-" : r.accuracy.toFixed(4)}</td><td>${ago(r.lastUploadAt)}</td>` +
    `<td class="num">${r.uploads ?? "-"}</td><td>${ago(r.sentAt)}</td></tr>`).join("");
}

/** Watch a fleet with a monitor login; resolves once subscribed ({refused} if not). */
page.watch = async ({ url, fleet, user, password }) => {
  P.checkId(fleet, "fleet");
  try {
    page.client = await mqtt.connectAsync(url, { username: user || undefined, password: password || undefined, protocolVersion: 4, reconnectPeriod: 2000 }, false);
  } catch (e) {
    $("state").textContent = `refused: ${e.message || e}`;
    $("state").className = "pill offline";
    return { refused: "connect_failed", detail: String(e.message || e) };
  }
  page.client.on("message", (topic, payload) => {
    if (!payload.length) { // a deleted retained status
      const m = topic.match(/agents\/([^/]+)\/status$/);
      if (m) page.agents.delete(m[1]);
      return render();
    }
    const env = P.readEnvelope(new Uint8Array(payload));
    if (env instanceof P.ProtocolRefusal || env.type !== "status") return;
    const accuracy = first(env.counters || {}, ACCURACY_KEYS);
    let moved;
    if (topic === P.topics.aggregatorStatus(fleet)) {
      page.aggregator = env;
      moved = noteUploads(env);
    } else {
      page.agents.set(env.agent, env);
      moved = notePoint(env, accuracy);
    }
    page.updates++;
    // What changed when (the last 1000 statuses): scripts can see the page follow the fleet.
    page.history.push({ agent: env.agent, state: env.state, epoch: env.epoch ?? 0, accuracy });
    if (page.history.length > 1000) page.history.shift();
    render();
    if (moved) drawCharts();
  });
  page.client.on("connect", () => { $("state").textContent = `watching ${fleet}`; $("state").className = "pill online"; });
  page.client.on("close", () => { $("state").textContent = "disconnected"; $("state").className = "pill offline"; });
  await page.client.subscribeAsync([P.topics.allAgentStatus(fleet), P.topics.aggregatorStatus(fleet)], { qos: 1 });
  $("state").textContent = `watching ${fleet}`;
  $("state").className = "pill online";
  drawCharts(); // empty until statuses come
  setInterval(() => (render(), drawCharts()), 5000); // the "ago" columns, the uploads chart's window
  return { ok: true };
};

const params = new URLSearchParams(location.search);
for (const key of ["url", "fleet", "user"]) if (params.get(key)) $("login").elements[key].value = params.get(key);
$("login").onsubmit = (e) => {
  e.preventDefault();
  const f = $("login").elements;
  page.ready = page.watch({ url: f.url.value, fleet: f.fleet.value, user: f.user.value, password: f.password.value });
};
page.loaded = true;
