// The JavaScript agent: joins a fedmq fleet with an agent's login (MQTT over WebSockets in a
// browser, any MQTT URL in Node.js: agent-cli.mjs), runs the fleet's published ONNX graph in
// ONNX Runtime Web, watches its accuracy for drift, trains the output layer and uploads it
// (int8 delta + CDFL sketch), installs its personalized model. What a device must do is
// docs/protocol.md ("Joining"); this is that list in JavaScript. With `deviceSpec` it takes the
// input normalization, head and sketch feature map from the fleet's published device spec and
// refuses to upload once the fleet publishes another. Refusals come back as values
// ({refused: reason}), never as throws.

import mqtt from "mqtt";
import * as ort from "onnxruntime-web";
import * as P from "./fedmq.js";

ort.env.wasm.wasmPaths = new URL("./node_modules/onnxruntime-web/dist/", import.meta.url).href;
ort.env.wasm.numThreads = 1; // threads need cross-origin isolation, which a plain static server does not give

const PIECES_AT_ONCE = 16;

export const DEFAULTS = {
  replyTimeoutS: 20, // agent.reply_timeout_s
  sends: 3, // a request is sent this often (same msg_id) before the wait is given up
  sketchMinSamples: 100, // agent.sketch_min_samples: no sketch of fewer inputs (it would reveal them)
  window: 200, // drift rule: agent.detector threshold's window and delta
  delta: 0.1,
  minUpdateIntervalS: 60, // agent.min_update_interval_s
  samplesAfterDrift: 100, // agent.samples_after_drift: new samples to see after a drift before training
  train: { epochs: 2, batchSize: 32, lr: 0.01, momentum: 0.9, rho: 0.1 },
  // A larger feature map is not fetched (no sketch is sent): Mosquitto 2.0.11 sends an otherwise
  // idle WebSocket subscriber about 45 KB/s, over a minute for a 28x28 fleet's 3.2 MB.
  featureMapMaxBytes: Infinity,
};

export class BrowserAgent {
  /** opts: url (ws:// or wss://; mqtt:// or mqtts:// in Node.js), fleet, agent, password, profile,
   *  deviceSpec (read the fleet's device spec: required to be ready), storage (the msg_id floor's
   *  store, localStorage by default), mqtt (more MQTT.js options, e.g. a CA); log(line) gets one
   *  line per event. */
  constructor(opts, log = () => {}) {
    this.url = opts.url;
    this.fleet = P.checkId(opts.fleet, "fleet");
    this.agent = P.checkId(opts.agent, "agent");
    this.password = opts.password || undefined;
    this.profile = opts.profile || "browser";
    this.settings = { ...DEFAULTS, ...(opts.settings || {}) };
    this.log = log;
    this.useDeviceSpec = !!opts.deviceSpec;
    this.mqttOptions = opts.mqtt || {};
    this.ids = new P.MsgIds(`fedmq.msg_id.${this.fleet}.${this.agent}`, opts.storage || globalThis.localStorage);
    this.reassembler = new P.Reassembler();
    this.waiters = new Map(); // msg_id -> {settle, receipt}
    this.aggregator = null; // its latest status
    this.graph = null; // bytes of the published ONNX graph
    this.session = null;
    this.spec = null;
    this.device = null; // the device spec held: {hash, doc, featureMap}
    this.deviceMessage = null; // its retained message as last received
    this.devicePieces = new Map(); // piece topic -> {spec, index, data}, as last received
    this._parsedDevice = null;
    this.loadError = null;
    this._loadingModel = null;
    this._loading = null;
    this.base = null; // Float32Array: the model held (the aggregator's base for our deltas)
    this.epoch = 0;
    this.algorithm = "cdfl";
    this.detector = new P.ThresholdDetector(this.settings.window, this.settings.delta);
    this.driftPending = false;
    this.driftSeenAt = 0;
    this.lastUpdateAt = null;
    this.counters = { uploads: 0, installs: 0, refused: 0, drifts: 0, observed: 0, correct: 0 };
    this.listeners = new Set();
    this._statusReady = null;
  }

  onChange(fn) {
    this.listeners.add(fn);
  }

  _changed() {
    for (const fn of this.listeners) fn(this);
  }

  _event(name, fields = {}) {
    const kv = Object.entries(fields).map(([k, v]) => `${k}=${typeof v === "number" ? +v.toFixed(4) : v}`);
    this.log(`${name} agent=${this.agent} ${kv.join(" ")}`);
  }

  // ---------------------------------------------------------------- connection

  /** Connect, subscribe (QoS 1), wait for the aggregator's online status and the graph. */
  async connect(timeoutS = 60) {
    this._armReady();
    const will = P.envelope("status", this.agent, this.ids.next(), { state: "offline", role: "agent", algorithm: this.algorithm });
    this.client = await mqtt.connectAsync(this.url, {
      clientId: P.agentClientId(this.fleet, this.agent), // prod.conf makes it the username anyway
      username: this.agent,
      password: this.password,
      protocolVersion: 4,
      clean: false, // a reply sent while the page was away is kept by the broker
      reconnectPeriod: 2000,
      connectTimeout: timeoutS * 1000,
      will: { topic: P.topics.agentStatus(this.fleet, this.agent), payload: will, qos: 1, retain: true },
      ...this.mqttOptions,
    }, false); // a first connection that fails is a refusal (later drops reconnect by themselves)
    this.client.on("message", (topic, payload) => this._onMessage(topic, new Uint8Array(payload)));
    this.client.on("connect", () => {
      this._event("transport.reconnected");
      this.publishStatus();
    });
    this.client.on("error", (e) => this._event("transport.error", { error: JSON.stringify(String(e.message || e)) }));
    const wanted = [P.topics.aggregatorStatus(this.fleet), P.topics.graph(this.fleet), P.topics.down(this.fleet, this.agent)];
    if (this.useDeviceSpec) wanted.push(P.topics.deviceSpec(this.fleet)); // its pieces: _fetchPieces
    await this.client.subscribeAsync(wanted, { qos: 1 });
    this._event("transport.connected", { url: this.url });
    const waited = await this._waitReady(timeoutS);
    if (waited.refused) return waited;
    await this.publishStatus();
    return { ok: true };
  }

  _armReady() {
    let resolveReady;
    this._statusReady = new Promise((r) => (resolveReady = r));
    this._resolveReady = resolveReady;
  }

  async _waitReady(timeoutS) {
    const ready = await Promise.race([this._statusReady, sleep(timeoutS * 1000).then(() => null)]);
    if (ready) return { ok: true };
    if (this.loadError) return { refused: this.loadError.reason || "load_failed", detail: this.loadError.message };
    const s = this.aggregator;
    if (this.useDeviceSpec && s && s.state === "online" && s.graph && s.graph.sha256) {
      const topic = P.topics.deviceSpec(this.fleet);
      const detail = !s.graph.device_spec
        ? "the aggregator advertises no device spec (graph.device_spec): it could not make one for its dataset"
        : `no device spec ${s.graph.device_spec} on ${topic} in ${timeoutS} s (does the broker's ACL let this login read it?)`;
      return { refused: "no_device_spec", detail };
    }
    return { refused: "no_aggregator", detail: `no online aggregator status with its graph in ${timeoutS} s` };
  }

  /** Drop the model and device spec held and read the fleet's current ones (then join again). */
  async reload(timeoutS = 60) {
    [this.spec, this.session, this.device, this.base, this._loading, this._loadingModel] = [null, null, null, null, null, null];
    this.loadError = null;
    this._armReady();
    this._check();
    return this._waitReady(timeoutS);
  }

  async close() {
    if (!this.client) return;
    await this.client.publishAsync(P.topics.agentStatus(this.fleet, this.agent), this._status("offline"), { qos: 1, retain: true });
    await this.client.endAsync();
  }

  async _onMessage(topic, payload) {
    if (topic === P.topics.graph(this.fleet)) {
      this.graph = payload;
      return this._check();
    }
    if (topic === P.topics.deviceSpec(this.fleet)) {
      this.deviceMessage = payload;
      return this._check();
    }
    if (topic.startsWith(`${P.topics.deviceSpec(this.fleet)}/`)) {
      const piece = P.readDeviceSpecPiece(payload);
      if (piece) this.devicePieces.set(topic, piece);
      else this.devicePieces.delete(topic);
      const waiter = this._pieceWaiter;
      if (waiter && waiter.group.delete(topic) && waiter.group.size === 0) waiter.resolve(true);
      return;
    }
    let env = P.readEnvelope(payload);
    if (env instanceof P.ProtocolRefusal) return this._event("downlink.refused", { reason: env.reason });
    if (topic === P.topics.aggregatorStatus(this.fleet)) {
      this.aggregator = env;
      const stale = this.staleDeviceSpec();
      if (stale && this._staleSeen !== env.graph?.device_spec) { // said once per published spec
        this._staleSeen = env.graph?.device_spec;
        this._event("device_spec.changed", { held: this.device.hash, published: env.graph?.device_spec || "none" });
      }
      this._changed();
      return this._check();
    }
    if (env.type === "chunk") {
      const whole = await this.reassembler.add(env);
      if (whole === null) return;
      if (whole instanceof P.ProtocolRefusal) return this._event("downlink.refused", { reason: whole.reason });
      env = P.readEnvelope(whole);
      if (env instanceof P.ProtocolRefusal) return this._event("downlink.refused", { reason: env.reason });
    }
    if (env.agent !== this.agent) return this._event("downlink.refused", { reason: "agent_mismatch" });
    if (env.type === "receipt") {
      const w = this.waiters.get(env.of);
      if (w) w.receipt(env);
      return;
    }
    const w = this.waiters.get(env.in_reply_to);
    if (w) w.settle(env);
    else this._event("downlink.unexpected", { type: env.type, in_reply_to: env.in_reply_to || "-" });
  }

  /** _checkReady from a message handler: a model or device spec that cannot be loaded is
   *  logged and kept as the reason connect() gives, never an unhandled rejection. */
  async _check() {
    try {
      await this._checkReady();
    } catch (e) {
      this.loadError = e;
      this._event("load.refused", { reason: e.reason || "load_failed", detail: JSON.stringify(String(e.message || e)) });
    }
  }

  async _checkReady() {
    const s = this.aggregator;
    if (!s || s.state !== "online" || !this.graph || !s.graph || !s.graph.sha256) return;
    const sha = P.hex(new Uint8Array(await crypto.subtle.digest("SHA-256", this.graph)));
    if (sha !== s.graph.sha256 || this.graph.byteLength !== s.graph.bytes) {
      this._event("graph.mismatch", { sha256: sha, advertised: s.graph.sha256 });
      return;
    }
    let device = null;
    if (this.useDeviceSpec) {
      device = await this._deviceSpec(s.graph.device_spec);
      if (!device) return; // not advertised, not here yet, or another one than advertised: wait
    }
    // The graph, the device spec and the status each call this, and the status repeats: the
    // first call for a model loads it, and every call waits for that load, so none says ready
    // before the session. An agent that reads the device spec keeps what it loaded until
    // reload(): its samples are normalized by that spec, so a spec that changes is refused at
    // the next upload instead of being swapped in under them.
    const key = this.useDeviceSpec ? `${s.model}/${device.hash}` : s.model;
    if (this._loadingModel !== key && !(this.useDeviceSpec && this._loading)) {
      this._loadingModel = key;
      this._loading = this._load(s, this.graph, device).catch((e) => {
        [this._loadingModel, this._loading] = [null, null]; // the next message tries again
        throw e;
      });
    }
    await this._loading;
    this.loadError = null;
    this._resolveReady(true);
  }

  /** The feature map's pieces the device spec message held announces, PIECES_AT_ONCE topics at a
   *  time (each a retained message of its own): a reader never holds more than a megabyte of
   *  pieces in flight, and the pieces of a stale spec are never asked for. */
  async _fetchPieces() {
    if (this._fetching) {
      this._fetchAgain = true; // a newer spec message came: start over once this pass ends
      return;
    }
    this._fetching = true;
    try {
      do {
        this._fetchAgain = false;
        let head;
        try {
          head = await P.deviceSpecHead(this.deviceMessage);
        } catch (e) {
          this._event("device_spec.refused", { reason: e.reason, detail: JSON.stringify(e.detail || e.message) });
          return;
        }
        if (head.pieces * P.DEVICE_SPEC_PIECE_BYTES > this.settings.featureMapMaxBytes) {
          this._withoutMap = head.hash;
          this._event("device_spec.sketch_skipped", { hash: head.hash, pieces: head.pieces, limit_bytes: this.settings.featureMapMaxBytes });
          break;
        }
        const want = [];
        for (let i = 0; i < head.pieces; i++) {
          const topic = `${P.topics.deviceSpec(this.fleet)}/${i}`;
          const held = this.devicePieces.get(topic);
          if (!held || held.spec !== head.hash) want.push(topic);
        }
        for (let at = 0; at < want.length && !this._fetchAgain; at += PIECES_AT_ONCE) {
          const topics = want.slice(at, at + PIECES_AT_ONCE);
          const group = new Set(topics); // emptied as they arrive
          const arrived = new Promise((resolve) => (this._pieceWaiter = { group, resolve }));
          await this.client.subscribeAsync(topics, { qos: 1 });
          const got = await Promise.race([arrived, sleep(3 * this.settings.replyTimeoutS * 1000).then(() => false)]);
          this._pieceWaiter = null;
          await this.client.unsubscribeAsync(topics);
          if (!got) {
            this._event("device_spec.piece_missing", { topics: [...group].join(","), of: head.pieces });
            return;
          }
        }
      } while (this._fetchAgain);
      const head = await P.deviceSpecHead(this.deviceMessage);
      if (this._withoutMap !== head.hash && head.pieces) {
        const full = await P.readDeviceSpec(this.deviceMessage, [...this.devicePieces.values()], head.hash);
        this._map = { hash: full.hash, featureMap: full.featureMap };
        this._event("device_spec.feature_map", { hash: full.hash, pieces: head.pieces, bytes: full.doc.sketch.bytes });
        this._installMap();
      }
    } finally {
      this._fetching = false;
    }
  }

  /** Fetch the held device spec's feature map in the background (after the join: over a slow
   *  link its pieces would queue ahead of the join's reply). */
  _startFetch() {
    if (!this.device || !this.device.doc.sketch || this.featureMap || this._fetching) return;
    this._fetchPieces().catch((e) => this._event("device_spec.unfetched", { error: JSON.stringify(String(e.message || e)) }));
  }

  /** The fetched feature map, for the device spec held if it is that spec's. */
  _installMap() {
    if (!this.device || !this._map || this._map.hash !== this.device.hash) return;
    this.featureMap = this.device.featureMap = this._map.featureMap;
    for (const resolve of this._mapWaiters || []) resolve(this.featureMap);
    this._mapWaiters = [];
  }

  /** The held device spec's feature map, waiting up to `timeoutS` for its pieces (fetched after
   *  the join: the first update needs it, the join does not); null where there is none to send. */
  async featureMapReady(timeoutS = 3 * this.settings.replyTimeoutS) {
    if (!this.device) return this.featureMap || null; // the page's bundled map, without a device spec
    if (!this.device.doc.sketch || this._withoutMap === this.device.hash) return null;
    if (this.featureMap) return this.featureMap;
    const arrived = new Promise((resolve) => (this._mapWaiters = [...(this._mapWaiters || []), resolve]));
    this._startFetch();
    const map = await Promise.race([arrived, sleep(timeoutS * 1000).then(() => null)]);
    if (!map) this._event("device_spec.feature_map_missing", { hash: this.device.hash, waited_s: timeoutS });
    return map;
  }

  /** The received device spec (without its feature map: _fetchPieces brings that) if its hash
   *  is `advertised`, parsed once per message; null otherwise. */
  async _deviceSpec(advertised) {
    if (!advertised || !this.deviceMessage) return null;
    const seen = this._parsedDevice;
    if (!seen || seen.message !== this.deviceMessage || seen.advertised !== advertised) {
      const message = this.deviceMessage;
      const spec = await P.readDeviceSpec(message, [], advertised, true).catch((e) => e);
      this._parsedDevice = { message, advertised, spec };
      if (spec instanceof Error && !/advertises/.test(spec.detail)) {
        this._event("device_spec.refused", { reason: spec.reason, detail: JSON.stringify(spec.detail || spec.message) });
      }
    }
    const spec = this._parsedDevice.spec;
    return spec instanceof Error || spec.hash !== advertised ? null : spec;
  }

  /** The spec and the inference session of model `s.model` (and its device spec), swapped in
   *  together once all are made. */
  async _load(s, graph, device) {
    const spec = await P.readSpec(s);
    spec.hash = s.model;
    if (device) {
      const d = device.doc;
      if (d.model !== s.model) throw new P.ProtocolRefusal("bad_device_spec", `for model ${d.model}, the fleet runs ${s.model}`);
      if (d.input_shape.join("x") !== spec.input_shape.join("x")) throw new P.ProtocolRefusal("bad_device_spec", "its input shape is not the model's");
      if (!d.head || d.head.start !== spec.head[0] || d.head.end !== spec.head[1]) {
        throw new P.ProtocolRefusal("no_head", "the fleet's model has no output layer this agent can train alone");
      }
      if (d.sketch && d.sketch.dim !== P.SKETCH_DIM) throw new P.ProtocolRefusal("bad_device_spec", `a sketch of ${d.sketch.dim} features`);
    }
    const session = await ort.InferenceSession.create(graph, { executionProviders: ["wasm"] });
    [this.spec, this.session, this.algorithm, this.device] = [spec, session, s.algorithm || "cdfl", device];
    this._event("graph.loaded", { model: s.model_name, bytes: graph.byteLength, params: spec.numel });
    if (device) {
      this.featureMap = null;
      this._event("device_spec.loaded", { hash: device.hash, dataset: device.doc.dataset, input: device.doc.input_shape.join("x"),
        sketch: device.doc.sketch ? device.doc.sketch.method : "none" });
      this._installMap();
    }
  }

  /** Why an upload now would be refused by this agent: the fleet publishes another device spec
   *  than the one held (its normalization, feature map or model changed). */
  staleDeviceSpec() {
    if (!this.device) return null;
    const advertised = this.aggregator && this.aggregator.graph ? this.aggregator.graph.device_spec : undefined;
    if (advertised === this.device.hash) return null;
    return { reason: "device_spec_changed", detail: `holds device spec ${this.device.hash}, the fleet publishes ${advertised || "none"}: read it again and rejoin` };
  }

  // ---------------------------------------------------------------- requests

  /** Publish an envelope (chunked when large) and wait for the reply naming it: the reply
   *  envelope, or {refused: "no_reply"} after `sends` tries. Receipts stretch the wait. */
  async _request(msgId, payload) {
    const pieces = await P.chunked(payload, this.agent, msgId, this.ids);
    const topic = P.topics.up(this.fleet, this.agent);
    for (let attempt = 0; attempt < this.settings.sends; attempt++) {
      const reply = await new Promise((resolve) => {
        let timer;
        const arm = (seconds) => {
          clearTimeout(timer);
          timer = setTimeout(() => resolve(null), seconds * 1000);
        };
        this.waiters.set(msgId, {
          settle: (env) => {
            clearTimeout(timer);
            resolve(env);
          },
          receipt: (r) => {
            this._event("upload.receipt", { of: msgId, expect_s: r.expect_s, ahead: r.ahead ?? 0 });
            arm(this.settings.replyTimeoutS + 2 * r.expect_s);
          },
        });
        arm(this.settings.replyTimeoutS);
        (async () => {
          for (const piece of pieces) await this.client.publishAsync(topic, piece, { qos: 1 });
        })().catch((e) => this._event("uplink.failed", { error: JSON.stringify(String(e.message || e)) }));
      });
      this.waiters.delete(msgId);
      if (reply) return reply;
      this._event("upload.resend", { msg_id: msgId, attempt: attempt + 1 });
    }
    return { type: "error", reason: "no_reply", detail: `no reply to ${msgId} after ${this.settings.sends} sends` };
  }

  _refusal(env, what) {
    this.counters.refused++;
    this.counters.last_refusal = env.reason;
    this._event(`${what}.refused`, { reason: env.reason, detail: JSON.stringify(env.detail || "") });
    this._changed();
    return { refused: env.reason, detail: env.detail || "" };
  }

  /** Join: the reply holds the whole model, our base from now on. */
  async join() {
    const msgId = this.ids.next();
    const payload = P.envelope("join", this.agent, msgId, {
      model: this.spec.hash, algorithm: this.algorithm, profile: this.profile, n_samples: this.samples ? this.samples.n : 0,
    });
    const reply = await this._request(msgId, payload);
    if (reply.type !== "model") return this._refusal(reply, "join");
    const installed = await this._install(reply, "join", msgId);
    this._startFetch();
    return installed;
  }

  async _install(reply, via, msgId) {
    let vector;
    try {
      vector = P.decodeTensor(reply.tensors[0], this.base);
    } catch (e) {
      return this._refusal({ reason: e.reason || "codec_error", detail: e.message }, "model");
    }
    if (vector.length !== this.spec.numel) return this._refusal({ reason: "wrong_shape", detail: `${vector.length} values` }, "model");
    this.base = vector;
    this.epoch = reply.epoch;
    this.counters.installs++;
    const acc = this.samples && this.samples.n ? await this.accuracy(this.samples) : null;
    this.detector.setReference(acc);
    this.driftPending = false;
    if (acc !== null) this.counters.last_accuracy = Math.round(acc * 1e4) / 1e4;
    this._event("model.installed", { via, epoch: this.epoch, accuracy: acc ?? "-", alpha: (reply.alpha || []).map((a) => a.toFixed(3)).join(",") });
    await this.publishStatus();
    this._changed();
    return { ok: true, via, msgId, epoch: this.epoch, accuracy: acc, alpha: reply.alpha || null };
  }

  _status(state) {
    const counters = {};
    for (const [k, v] of Object.entries(this.counters)) if (v !== undefined && v !== null) counters[k] = v;
    return P.envelope("status", this.agent, this.ids.next(), { state, role: "agent", algorithm: this.algorithm, epoch: this.epoch, counters });
  }

  /** The retained online status with the counters (last_accuracy, last_upload_at, ...): what
   *  fleet pages and `fedmq fleet status` show. */
  async publishStatus() {
    if (this.client && this.client.connected) {
      await this.client.publishAsync(P.topics.agentStatus(this.fleet, this.agent), this._status("online"), { qos: 1, retain: true });
    }
  }

  // ---------------------------------------------------------------- inference

  _params(vector) {
    const feeds = {};
    this.spec.names.forEach((name, i) => {
      const off = this.spec.offsets[i];
      feeds[name] = new ort.Tensor("float32", vector.slice(off, off + this.spec.sizes[i]), this.spec.shapes[i]);
    });
    return feeds;
  }

  /** Logits [n, classes] of normalized inputs (Float32Array, n * input size) under `vector`. */
  async logits(inputs, vector = this.base) {
    const d = this.spec.input_shape.reduce((a, b) => a * b, 1);
    const n = inputs.length / d;
    const feeds = this._params(vector);
    feeds.x = new ort.Tensor("float32", inputs, [n, ...this.spec.input_shape]);
    const out = await this.session.run(feeds);
    return out[this.aggregator.graph.output || "logits"].data;
  }

  /** Features h [n, F] at the output layer's input, read from the published graph itself:
   *  logits = W h + b is linear in the head, so feeding W = rows of the identity (b = 0)
   *  makes the graph output C features per run. */
  async features(inputs) {
    const { features: F, num_classes: C } = this.spec;
    const d = this.spec.input_shape.reduce((a, b) => a * b, 1);
    const n = inputs.length / d;
    const h = new Float32Array(n * F);
    const probe = Float32Array.from(this.base);
    const [w0] = [this.spec.offsets[this.spec.headWeight]];
    const b0 = this.spec.offsets[this.spec.headBias];
    for (let g = 0; g < F; g += C) {
      probe.fill(0, w0, w0 + C * F);
      probe.fill(0, b0, b0 + C);
      for (let c = 0; c < C && g + c < F; c++) probe[w0 + c * F + g + c] = 1;
      const out = await this.logits(inputs, probe);
      for (let s = 0; s < n; s++) for (let c = 0; c < C && g + c < F; c++) h[s * F + g + c] = out[s * C + c];
    }
    return h;
  }

  async accuracy(samples, vector = this.base) {
    const out = await this.logits(samples.x, vector);
    let ok = 0;
    for (let s = 0; s < samples.n; s++) ok += argmax(out, s, this.spec.num_classes) === samples.y[s];
    return ok / samples.n;
  }

  /** Predict then learn (test-then-train): one labelled sample's outcome feeds the drift rule. */
  async observe(x, label) {
    const out = await this.logits(x);
    const correct = argmax(out, 0, this.spec.num_classes) === label;
    this.counters.observed++;
    this.counters.correct += correct;
    // A drift counts once until the update it asks for (the detector fires again each
    // window while the data stays drifted), as in the Python agent.
    if (this.detector.update(correct) && !this.driftPending) {
      this.counters.drifts++;
      this.driftSeenAt = this.counters.observed;
      this.driftPending = true;
      this._event("drift.detected", { window_accuracy: this.detector.windowAccuracy, reference: this.detector.reference });
    }
    return correct;
  }

  /** As the Python agent decides (edge_agent/drift.py DriftMonitor, agent_loop.py): a drift
   *  is pending, `samplesAfterDrift` samples came since (they describe the new data), and the
   *  last update is at least `minUpdateIntervalS` old. */
  shouldUpdate(nowS = Date.now() / 1000) {
    return this.driftPending && this.counters.observed - this.driftSeenAt >= this.settings.samplesAfterDrift &&
      (this.lastUpdateAt === null || nowS - this.lastUpdateAt >= this.settings.minUpdateIntervalS);
  }

  // ---------------------------------------------------------------- an update cycle

  /** Train the head on the local samples, upload it (int8 delta from the base, with the
   *  sketch), install the reply. Returns what happened, a refusal included. */
  async cycle(seed = this.counters.uploads) {
    const t0 = performance.now();
    const stale = this.staleDeviceSpec();
    if (stale) return { ...this._refusal(stale, "upload"), seconds: 0 };
    if (!this.samples || !this.samples.n) {
      return { ...this._refusal({ reason: "no_samples", detail: "no local samples to train on: add labelled images first" }, "upload"), seconds: 0 };
    }
    this.driftPending = false;
    this.lastUpdateAt = Date.now() / 1000;
    const { x, y, n } = this.samples;
    const { features: F, num_classes: C } = this.spec;
    const h = await this.features(x);
    // The features reproduce the graph's own logits (the head is W h + b): checked each time.
    const logits = await this.logits(x);
    const [w0, b0] = [this.spec.offsets[this.spec.headWeight], this.spec.offsets[this.spec.headBias]];
    let featureError = 0;
    for (let s = 0; s < n; s++) {
      for (let c = 0; c < C; c++) {
        let z = this.base[b0 + c];
        for (let f = 0; f < F; f++) z += this.base[w0 + c * F + f] * h[s * F + f];
        featureError = Math.max(featureError, Math.abs(z - logits[s * C + c]));
      }
    }
    const accHeld = await this.accuracy(this.samples);
    const trained = P.trainHead(h, y, this.base.subarray(w0, w0 + C * F), this.base.subarray(b0, b0 + C), F, C, { ...this.settings.train, seed });
    const vector = Float32Array.from(this.base);
    vector.set(trained.W, w0);
    vector.set(trained.b, b0);
    const accTrained = await this.accuracy(this.samples, vector);
    const block = (this.aggregator.codec && this.aggregator.codec.int8_block) || 256;
    const { wire, decoded } = P.encodeInt8(vector, this.base, block);
    const d = this.spec.input_shape.reduce((a, b) => a * b, 1);
    const fields = {
      model: this.spec.hash, tau: this.epoch, tensor: wire, n_samples: n,
      metrics: { loss: trained.loss, acc_held: accHeld, acc_trained: accTrained },
    };
    const featureMap = n >= this.settings.sketchMinSamples ? await this.featureMapReady() : null;
    if (featureMap) {
      fields.sketch = P.dataSketch(x, d, featureMap);
      fields.sketch_method = this.device ? this.device.doc.sketch.method : P.SKETCH_METHOD;
    }
    const changed = this.staleDeviceSpec(); // while it trained
    if (changed) return { ...this._refusal(changed, "upload"), seconds: 0 };
    const msgId = this.ids.next();
    const payload = P.envelope("update", this.agent, msgId, fields);
    this.counters.uploads++;
    this.counters.last_upload_at = Math.round(Date.now()) / 1000;
    this._event("train.done", { samples: n, loss: trained.loss, acc_held: accHeld, acc_trained: accTrained, feature_error: featureError });
    await this.publishStatus();
    const sentAt = performance.now();
    const reply = await this._request(msgId, payload);
    const result = { msgId, tau: fields.tau, bytes: payload.byteLength, sketch: !!fields.sketch, sketchBytes: fields.sketch || null, featureError, accHeld, accTrained, loss: trained.loss, uploaded: decoded, seconds: 0,
      computeS: (sentAt - t0) / 1000, replyS: (performance.now() - sentAt) / 1000 };
    if (reply.type !== "model") return { ...result, ...this._refusal(reply, "upload") };
    const installed = await this._install(reply, "update", msgId);
    result.seconds = (performance.now() - t0) / 1000;
    return { ...result, ...installed };
  }
}

export function argmax(values, row, width) {
  let best = 0;
  for (let c = 1; c < width; c++) if (values[row * width + c] > values[row * width + best]) best = c;
  return best;
}

function sleep(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

/** The bundled raw sample set for inputs of `shape` [C, H, W] (assets/samples-CxHxW.json, made
 *  by web/make_assets.py): pixels as a camera or a drawing gives them (0..max), or null if the
 *  page has none of that shape. */
export async function loadRawSamples(shape, base = new URL("./assets/", import.meta.url)) {
  const res = await fetch(new URL(`samples-${shape.join("x")}.json`, base));
  if (!res.ok) return null;
  const doc = await res.json();
  return { n: doc.labels.length, raw: doc.pixels, y: Int32Array.from(doc.labels), shape: doc.shape, max: doc.max };
}

/** Raw samples as the fleet's model takes them: rescaled to the spec's raw range where theirs
 *  differs, then normalized as its device spec says (bit for bit fedmq's loader's). */
export function normalizedSamples(raw, device) {
  const { normalize, input_shape: shape } = device.doc;
  const d = shape.reduce((a, b) => a * b, 1);
  const pixels = Float32Array.from(raw.raw.flat());
  if (raw.max !== normalize.scale) for (let i = 0; i < pixels.length; i++) pixels[i] = (pixels[i] * normalize.scale) / raw.max;
  return { n: raw.n, x: P.normalize(pixels, normalize, d / shape[0]), y: raw.y, raw: raw.raw, d };
}
