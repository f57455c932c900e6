// The live fleet page: every agent's retained status (state, epoch, accuracy, last upload)
// and the aggregator's own status and counters, updated as they change. Read-only: it
// subscribes to the status topics, which is all a monitor login may read.

import mqtt from "mqtt";
import * as P from "./fedmq.js";

const $ = (id) => document.getElementById(id);
const ACCURACY_KEYS = ["last_accuracy", "accuracy", "acc"]; // as fedmq/fleet_status.py reads them
const UPLOAD_KEYS = ["last_upload_at", "last_upload_time", "last_upload"];
const page = { agents: new Map(), aggregator: null, updates: 0, client: null, history: [] };
window.fedmqFleetPage = page;

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
    if (topic === P.topics.aggregatorStatus(fleet)) page.aggregator = env;
    else page.agents.set(env.agent, env);
    page.updates++;
    // What changed when (the last 1000 statuses): scripts can see the page follow the fleet.
    page.history.push({ agent: env.agent, state: env.state, epoch: env.epoch ?? 0, accuracy: first(env.counters || {}, ACCURACY_KEYS) });
    if (page.history.length > 1000) page.history.shift();
    render();
  });
  page.client.on("connect", () => { $("state").textContent = `watching ${fleet}`; $("state").className = "pill online"; });
  page.client.on("close", () => { $("state").textContent = "disconnected"; $("state").className = "pill offline"; });
  await page.client.subscribeAsync([P.topics.allAgentStatus(fleet), P.topics.aggregatorStatus(fleet)], { qos: 1 });
  $("state").textContent = `watching ${fleet}`;
  $("state").className = "pill online";
  setInterval(render, 5000); // the "ago" columns
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
