// Drives web/agent.html and web/fleet.html in headless Chromium (playwright-core, the
// distribution's chromium) as a user would, and writes what they showed as JSON. Run by
// tests/test_browser.py:
//
//   node web/drive.mjs PLAN.json OUT_DIR
//
// PLAN: {base, chromium, spki, agent: {url, fleet, agent, password}, cycles, drift_bits,
//        monitor: {url, fleet, user, password}, python_agent, screenshots,
//        pick: {folder, files: [{path, name, label}]}, charts: {points_before}, stale}

import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [planPath, outDir] = process.argv.slice(2);
const plan = JSON.parse(readFileSync(planPath, "utf8"));
const out = { console: [], steps: {} };
const say = (step, fields = {}) => console.log(JSON.stringify({ step, t: Date.now() / 1000, ...fields }));
const save = () => writeFileSync(join(outDir, "driver.json"), JSON.stringify(out));

const userData = mkdtempSync(join(tmpdir(), "fedmq-chromium-"));
const args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"];
// The broker's certificate comes from the fleet's own CA (fedmq creds): trust exactly its key.
if (plan.spki) args.push(`--ignore-certificate-errors-spki-list=${plan.spki}`);
const context = await chromium.launchPersistentContext(userData, {
  executablePath: plan.chromium, headless: true, args, viewport: { width: 1000, height: 760 },
});
const timeout = (plan.timeout_s || 120) * 1000;
context.setDefaultTimeout(timeout);

function watch(page, name) {
  page.on("console", (m) => out.console.push(`${name} ${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => out.console.push(`${name} pageerror: ${e.message}`));
}

async function loadMetrics(page) {
  return page.evaluate(() => {
    const nav = performance.getEntriesByType("navigation")[0];
    const res = performance.getEntriesByType("resource");
    const files = [nav, ...res].map((e) => ({ name: e.name.replace(location.origin, ""), bytes: e.encodedBodySize, transfer: e.transferSize }));
    return { domContentLoadedMs: nav.domContentLoadedEventEnd, loadMs: nav.loadEventEnd, files,
      bytes: files.reduce((s, f) => s + f.bytes, 0) };
  });
}

let status = 0;
try {
  // ---------------------------------------------------------------- codecs, no broker
  // Each case: an encoded tensor map (msgpack, base64) and its base; the page's decoding and
  // an int8 encoding of its own come back as float32 bytes.
  if (plan.codec_cases) {
    const page = await context.newPage();
    watch(page, "codecs");
    await page.goto(`${plan.base}/agent.html`);
    await page.waitForFunction(() => window.fedmqAgentPage && window.fedmqAgentPage.loaded);
    out.steps.codecs = await page.evaluate(async (cases) => {
      const P = await import("./fedmq.js");
      const { decode } = await import("@msgpack/msgpack");
      const bytes = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
      const b64 = (u8) => { let s = ""; for (let i = 0; i < u8.length; i += 0x8000) s += String.fromCharCode(...u8.subarray(i, i + 0x8000)); return btoa(s); };
      const f32 = (s) => new Float32Array(bytes(s).buffer);
      return cases.map((c) => {
        const base = c.base ? f32(c.base) : null;
        let decoded = null;
        let refused = null;
        try {
          decoded = b64(new Uint8Array(P.decodeTensor(decode(bytes(c.wire)), base).buffer));
        } catch (e) {
          refused = e.reason || String(e);
        }
        const mine = c.vector ? P.encodeInt8(f32(c.vector), base, c.block || 256) : null;
        return { decoded, refused, int8: mine && { wire: b64(P.packWire(mine.wire)), decoded: b64(new Uint8Array(mine.decoded.buffer)) } };
      });
    }, plan.codec_cases);
    await page.close();
    say("codecs", { cases: out.steps.codecs.length });
  }
  if (!plan.agent) throw Object.assign(new Error("done"), { done: true });

  // ---------------------------------------------------------------- the agent page
  const agentPage = await context.newPage();
  watch(agentPage, "agent");
  const a = plan.agent;
  const t0 = Date.now();
  await agentPage.goto(`${plan.base}/agent.html?url=${encodeURIComponent(a.url)}&fleet=${a.fleet}&agent=${a.agent}`);
  await agentPage.waitForFunction(() => window.fedmqAgentPage && window.fedmqAgentPage.loaded);
  await agentPage.fill("input[name=password]", a.password || "");
  await agentPage.click("#login button");
  await agentPage.waitForFunction(() => window.fedmqAgentPage.ready);
  const joined = await agentPage.evaluate(() => window.fedmqAgentPage.ready);
  const readyMs = Date.now() - t0;
  out.steps.join = { ...joined, readyMs };
  out.steps.agentLoad = await loadMetrics(agentPage);
  say("joined", { refused: joined.refused || null, readyMs });
  save();
  if (joined.refused) throw new Error(`join refused: ${joined.refused} ${joined.detail}`);

  out.steps.parity = await agentPage.evaluate(() => window.fedmqAgentPage.parity());
  say("parity");

  // A digit drawn with the mouse on the pad, then predicted.
  const pad = await agentPage.locator("#pad").boundingBox();
  await agentPage.mouse.move(pad.x + 80, pad.y + 25);
  await agentPage.mouse.down();
  for (const [x, y] of [[80, 60], [80, 100], [80, 140]]) await agentPage.mouse.move(pad.x + x, pad.y + y, { steps: 4 });
  await agentPage.mouse.up();
  await agentPage.click("#predict");
  await agentPage.waitForFunction(() => document.getElementById("prediction").textContent.startsWith("prediction"));
  out.steps.drawn = await agentPage.textContent("#prediction");

  // Local data from images the user picks: a folder of label folders, then loose images each
  // given its label in the page's list; refused while one has none.
  if (plan.pick) {
    const picked = () => agentPage.evaluate(() => window.fedmqAgentPage.pickedResult);
    const use = async () => {
      await agentPage.evaluate(() => (window.fedmqAgentPage.pickedResult = null));
      await agentPage.click("#use-picked");
      await agentPage.waitForFunction(() => window.fedmqAgentPage.pickedResult);
      return picked();
    };
    await agentPage.setInputFiles("#folders", plan.pick.folder);
    await agentPage.setInputFiles("#images", plan.pick.files.map((f) => f.path));
    out.steps.pickedUnlabelled = await use();
    for (const f of plan.pick.files) await agentPage.selectOption(`#picked select[data-path="${f.name}"]`, { label: f.label });
    out.steps.pickedRows = await agentPage.evaluate(() => window.fedmqAgentPage.picked.map((p) => ({ path: p.path, label: p.label })));
    out.steps.picked = await use();
    out.steps.pickedParity = await agentPage.evaluate(() => window.fedmqAgentPage.parity());
    say("picked", { images: out.steps.picked.images });
  }

  // The drift rule on a given stream of outcomes, window and delta as the plan says.
  if (plan.drift_bits) {
    out.steps.drift = await agentPage.evaluate(async ({ bits, window, delta, reference }) => {
      const { ThresholdDetector } = await import("./fedmq.js");
      const d = new ThresholdDetector(window, delta, reference);
      return bits.map((b) => d.update(b === 1));
    }, plan.drift_bits);
  }

  // ---------------------------------------------------------------- the fleet page
  let fleetPage = null;
  if (plan.monitor) {
    fleetPage = await context.newPage();
    watch(fleetPage, "fleet");
    const m = plan.monitor;
    const t1 = Date.now();
    await fleetPage.goto(`${plan.base}/fleet.html?url=${encodeURIComponent(m.url)}&fleet=${m.fleet}&user=${m.user}`);
    await fleetPage.waitForFunction(() => window.fedmqFleetPage && window.fedmqFleetPage.loaded);
    await fleetPage.fill("input[name=password]", m.password);
    await fleetPage.click("#login button");
    await fleetPage.waitForFunction(() => window.fedmqFleetPage.ready);
    out.steps.watch = await fleetPage.evaluate(() => window.fedmqFleetPage.ready);
    out.steps.fleetLoad = { ...(await loadMetrics(fleetPage)), watchingMs: Date.now() - t1 };
  }

  out.steps.cycles = [];
  for (let i = 0; i < (plan.cycles || 0); i++) {
    const r = await agentPage.evaluate(async () => {
      const r = await window.fedmqAgentPage.cycle();
      const p = window.fedmqAgentPage;
      const up = p.results[p.results.length - 1].uploaded;
      let s = "";
      const bytes = new Uint8Array(up.buffer);
      for (let j = 0; j < bytes.length; j += 0x8000) s += String.fromCharCode(...bytes.subarray(j, j + 0x8000));
      return { ...r, uploaded: btoa(s) };
    });
    out.steps.cycles.push(r);
    say("cycle", { i, refused: r.refused || null, epoch: r.epoch, accuracy: r.accuracy });
    if (fleetPage && plan.charts) {
      // The fleet page's charts follow: this cycle's point on the agent's accuracy line (one
      // more than it had) and one more upload counted per minute, timed from the reply.
      const want = { agent: a.agent, points: plan.charts.points_before + i + 1, uploads: i + 1 };
      const shownAt = Date.now();
      await fleetPage.waitForFunction((w) => {
        const c = window.fedmqFleetPage.charts();
        return (c.accuracy[w.agent] || []).length >= w.points && c.uploads.reduce((s, [, n]) => s + n, 0) >= w.uploads;
      }, want, { timeout });
      out.steps.charts = out.steps.charts || [];
      out.steps.charts.push({ ...(await fleetPage.evaluate(() => window.fedmqFleetPage.charts())), lagMs: Date.now() - shownAt });
    }
    save();
  }

  // The fleet publishes another device spec (the test restarts its aggregator with another
  // normalization once this says "cycles_done"): the page, holding the old one, refuses to upload
  // with one line in its log and sends nothing.
  if (plan.stale) {
    say("cycles_done");
    await agentPage.waitForFunction(() => {
      const a = window.fedmqAgentPage.agent;
      const s = a.aggregator;
      return s && s.state === "online" && s.graph && s.graph.device_spec && s.graph.device_spec !== a.device.hash;
    });
    const r = await agentPage.evaluate(async () => {
      const a = window.fedmqAgentPage.agent;
      const before = a.counters.uploads;
      const r = await window.fedmqAgentPage.cycle();
      return { ...r, held: a.device.hash, published: a.aggregator.graph.device_spec, uploads: a.counters.uploads - before };
    });
    const log = await agentPage.textContent("#log");
    out.steps.stale = { ...r, refusedLines: log.split("\n").filter((l) => l.includes(".refused")).map((l) => l.replace(/^\S+ /, "")) };
    say("stale", { refused: r.refused || null });
  }

  // The sample stream through the agent's own predictions and drift rule, its labels
  // permuted (the data drifted): the rule fires; the update it asks for waits for more samples.
  if (plan.stream) {
    out.steps.stream = await agentPage.evaluate(async (s) => {
      const p = window.fedmqAgentPage;
      Object.assign(p.agent.settings, { samplesAfterDrift: s.samples_after_drift });
      p.agent.detector.window = s.window;
      const relabel = Array.from({ length: 10 }, (_, k) => (k + 1) % 10);
      const r = await p.stream(relabel);
      return { ...r, pending: p.agent.driftPending, reference: p.agent.detector.reference };
    }, plan.stream);
    say("stream", out.steps.stream);
  }

  if (fleetPage) {
    // Both agents' received accuracy on the page: the browser's and the Python agent's.
    const want = { phone: a.agent, python: plan.python_agent, epoch: out.steps.cycles.at(-1)?.epoch ?? 0 };
    // ... and the aggregator's status caught up with the last upload.
    await fleetPage.waitForFunction((w) => {
      const rows = window.fedmqFleetPage.rows();
      const get = (id) => rows.find((r) => r.agent === id);
      const ph = get(w.phone);
      const py = w.python ? get(w.python) : { accuracy: 0 };
      const agg = window.fedmqFleetPage.aggregator;
      return ph && py && ph.accuracy !== null && py.accuracy !== null && ph.epoch >= w.epoch && agg && agg.epoch >= w.epoch;
    }, want, { timeout });
    out.steps.fleetRows = await fleetPage.evaluate(() => window.fedmqFleetPage.rows());
    out.steps.fleetHistory = await fleetPage.evaluate(() => window.fedmqFleetPage.history);
    out.steps.chartsEnd = await fleetPage.evaluate(() => window.fedmqFleetPage.charts());
    out.steps.aggregatorStatus = await fleetPage.evaluate(() => ({ epoch: window.fedmqFleetPage.aggregator.epoch, counters: window.fedmqFleetPage.aggregator.counters }));
    out.steps.fleetText = await fleetPage.textContent("#agents");
    out.steps.aggregatorText = await fleetPage.textContent("#aggregator");
    out.steps.countersText = await fleetPage.textContent("#counters");
    if (plan.screenshots) {
      await fleetPage.screenshot({ path: join(plan.screenshots, "browser-fleet.png"), fullPage: true });
      await agentPage.screenshot({ path: join(plan.screenshots, "browser-agent.png"), fullPage: true });
    }
    say("fleet", { rows: out.steps.fleetRows.length });
  }
  await agentPage.evaluate(() => window.fedmqAgentPage.agent.close());

  // A wrong password, a broker that is not there: the page says it was refused (and throws
  // nothing at the user).
  out.steps.refusals = [];
  for (const b of plan.refusals || []) {
    const bad = await context.newPage();
    watch(bad, "refusal");
    await bad.goto(`${plan.base}/agent.html?url=${encodeURIComponent(b.url)}&fleet=${b.fleet}&agent=${b.agent}`);
    await bad.waitForFunction(() => window.fedmqAgentPage && window.fedmqAgentPage.loaded);
    await bad.fill("input[name=password]", b.password);
    await bad.click("#login button");
    await bad.waitForFunction(() => window.fedmqAgentPage.ready);
    const r = { ...(await bad.evaluate(() => window.fedmqAgentPage.ready)), log: await bad.textContent("#log"),
      buttonsDisabled: await bad.evaluate(() => document.getElementById("cycle").disabled) };
    out.steps.refusals.push(r);
    say("refusal", { refused: r.refused });
    await bad.close();
  }
} catch (e) {
  if (!e.done) {
    out.error = String(e.stack || e);
    say("error", { error: out.error });
    status = 1;
  }
} finally {
  save();
  await context.close();
  rmSync(userData, { recursive: true, force: true });
}
process.exit(status);
