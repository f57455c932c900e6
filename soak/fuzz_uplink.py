"""Fuzz campaign on the live uplink: hostile messages against a running aggregator.

A real Mosquitto, the aggregator service (in this process, so its queue and reassembler can
be watched), one honest `EdgeAgent` making a fixed sequence of uploads, and a fuzzer: a raw
MQTT client that has joined like any agent and then sends hostile messages on its uplink
topic, in windows of `WINDOW`, waiting after each window for one reply per message.

Hostile kinds (seeded, `KINDS`): random bytes; random msgpack values; valid envelopes with one
field mutated (wrong type, missing, unknown, another agent's id, bad version/type, envelope
types that belong on the downlink); tensor-map mutations (huge or negative n, unknown codec,
truncated or flipped data, NaN, delta without base, zstd flag lies); flipped bytes of a valid
envelope; huge declared sizes (msgpack headers declaring GiBs, chunks declaring TiBs,
oversize payloads); chunk floods (partial messages that never complete, inconsistent pieces);
garbage on other agents' uplinks and on malformed topics; replays of the honest agent's
applied uploads on its own topic. Every mutated message that still decodes as a Join or as
an Update with a plausible tau is regenerated, so every message is hostile by construction
(an update that is merely valid would be applied, and it is not a fuzz case).

What is checked (tests/test_fuzz_uplink.py; figures via `python -m soak.fuzz_uplink`):
every hostile message gets its reason (one error reply each; chunk floods one per partial
message; malformed topics a log line and a counter); replays are answered and applied
nothing; memory stays bounded (RSS, the service's inbox, the reassembler's bytes); and the
honest agent's final cluster models are bit-identical to a run without the fuzzer.
"""

from __future__ import annotations

import argparse
import hashlib
import queue
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import torch

from fedmq import codecs, protocol
from fedmq.errors import run_main
from fedmq.logs import get_logger
from fedmq.models import model_spec
from soak.fleet_setup import pretrained_state, rss_mib, small_config, write_figures

log = get_logger("soak")
SPEC = model_spec("digits-cnn")
WINDOW = 16
"""Hostile messages in flight before the fuzzer waits for their replies."""
CAMPAIGN_SETTINGS = {
    "protocol.chunk_timeout_s": 2.0,
    "protocol.max_pending_bytes": 1024 * 1024,
}
"""Tight limits so that floods hit them within seconds."""
FUTURE_TAU = 2**40
KINDS = ("random_bytes", "random_msgpack", "field", "tensor", "flip", "huge", "wrong_type",
         "other_agent")


class Fuzzer:
    """A raw paho client: publishes what it is given, counts every downlink answer it gets
    (receipts, which only announce an answer, are not counted)."""

    def __init__(self, port: int, fleet: str, agent: str = "fuzzer") -> None:
        self.fleet, self.agent = fleet, agent
        self.replies: queue.Queue[tuple[str, protocol.Envelope | None]] = queue.Queue()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fuzz-{fleet}-{agent}")
        self.client.max_inflight_messages_set(WINDOW * 4)
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a, **k: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        # Every agent's downlink but the honest one's: garbage sent on ghosts' topics is answered there.
        self.client.subscribe(f"fedmq/{fleet}/agents/+/down", qos=1)
        if not subscribed.wait(5):
            raise RuntimeError("fuzzer: no SUBACK")

    def _on_message(self, client, userdata, msg) -> None:
        agent = msg.topic.split("/")[3]
        if agent == "honest":
            return
        try:
            env: protocol.Envelope | None = protocol.decode(msg.payload, max_bytes=1 << 24)
        except protocol.ProtocolError:
            env = None
        if isinstance(env, protocol.Receipt):
            return  # "taken, reply on the way": not an answer (docs/protocol.md)
        self.replies.put((agent, env))

    def publish(self, payload: bytes, topic: str | None = None) -> mqtt.MQTTMessageInfo:
        return self.client.publish(topic or protocol.uplink(self.fleet, self.agent), payload, qos=1)

    def collect(self, n: int, timeout: float, quiet_s: float | None = None) -> list[tuple[str, protocol.Envelope | None]]:
        """Up to `n` replies within `timeout`; with `quiet_s`, also stop once none came for that long."""
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                out.append(self.replies.get(timeout=left if quiet_s is None else min(quiet_s, left)))
            except queue.Empty:
                break
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# ------------------------------------------------------------------------------ generation

_WRONG_VALUES: list[Any] = [None, "x", -1, 1.5, b"\x00" * 3, [1, 2], {"a": 1}, True, 2**63 - 1,
                            -(2**63), float("nan"), "a" * 5000, [[[]]], ""]


class Generator:
    """Hostile payloads, a pure function of the seed (plus fresh msg_ids)."""

    def __init__(self, seed: int, fleet: str, agent: str, base: np.ndarray) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.fleet, self.agent, self.base = fleet, agent, base
        self.regenerated = 0

    def _update_map(self) -> dict[str, Any]:
        v = self.base + self.np_rng.normal(0, 0.01, SPEC.numel).astype(np.float32)
        codec = self.rng.choice(["int8", "fp16", "fp32", "topk"])
        env = protocol.Update(agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                              model=SPEC.hash, tau=FUTURE_TAU, n_samples=10,
                              tensor=codecs.encode(v, codec, base=self.base if self.rng.random() < 0.5 else None))
        return msgpack.unpackb(protocol.encode(env), raw=False)

    def _envelope_map(self) -> dict[str, Any]:
        if self.rng.random() < 0.7:
            return self._update_map()
        env = protocol.Join(agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                            model=SPEC.hash, algorithm="cdfl")
        return msgpack.unpackb(protocol.encode(env), raw=False)

    def _random_value(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if depth > 3 or r < 0.4:
            return self.rng.choice(_WRONG_VALUES[:10] + [self.rng.randbytes(self.rng.randrange(50))])
        if r < 0.7:
            return [self._random_value(depth + 1) for _ in range(self.rng.randrange(5))]
        return {self.rng.choice(["v", "type", "agent", "msg_id", "tensor", "x", 1]): self._random_value(depth + 1)
                for _ in range(self.rng.randrange(5))}

    def _hostile(self, payload: bytes) -> bool:
        """False if `payload` would be a legitimate Join or plausible Update from this agent."""
        try:
            env = protocol.decode(payload, max_bytes=1 << 24)
            protocol.check_topic(protocol.parse_topic(protocol.uplink(self.fleet, self.agent)), env)
        except protocol.ProtocolError:
            return True
        if isinstance(env, protocol.Join):
            return False
        return not (isinstance(env, protocol.Update) and env.tau < FUTURE_TAU // 2)

    def message(self, kind: str) -> tuple[bytes, str | None]:
        """(payload, topic or None for the fuzzer's own uplink)."""
        for _ in range(100):
            payload, topic = self._make(kind)
            if topic is not None or self._hostile(payload):
                return payload, topic
            self.regenerated += 1
        raise RuntimeError(f"could not make a hostile {kind} message")

    def _make(self, kind: str) -> tuple[bytes, str | None]:
        rng = self.rng
        if kind == "random_bytes":
            return rng.randbytes(rng.randrange(0, 3000)), None
        if kind == "random_msgpack":
            return msgpack.packb(self._random_value(), use_bin_type=True), None
        if kind == "other_agent":
            doc = self._envelope_map()
            doc["agent"] = rng.choice(["honest", "someone-else", "aggregator"])
            if rng.random() < 0.5:  # garbage on a ghost agent's topic: answered on the ghost's downlink
                return rng.randbytes(rng.randrange(1, 500)), protocol.uplink(self.fleet, f"ghost-{rng.randrange(50)}")
            return msgpack.packb(doc, use_bin_type=True), None
        if kind == "wrong_type":
            t = rng.choice(["model", "error", "status", "round_invite", "ack", "report", "nonsense", ""])
            doc = self._envelope_map()
            doc["type"] = t
            if t == "report":  # a well-formed report: an uplink type this aggregator does not run
                doc = msgpack.unpackb(protocol.encode(protocol.Report(
                    agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), round=1,
                    finished=False, n_samples=1, shard_size=1)), raw=False)
            return msgpack.packb(doc, use_bin_type=True), None
        if kind == "field":
            doc = self._envelope_map()
            key = rng.choice(list(doc))
            op = rng.random()
            if op < 0.5:
                doc[key] = rng.choice(_WRONG_VALUES)
            elif op < 0.7:
                del doc[key]
            elif op < 0.85:
                doc[rng.choice(["extra", "x" * 100, "v2"])] = 1
            else:
                doc["v"] = rng.choice([0, 2, "1", 1.0])
            return msgpack.packb(doc, use_bin_type=True), None
        if kind == "tensor":
            doc = self._update_map()
            t = doc["tensor"]
            op = rng.randrange(10)
            if op == 0:
                t["n"] = rng.choice([2**31 - 1, 0, -1, SPEC.numel + 1, 2**62])
            elif op == 1:
                t["codec"] = rng.choice(["gzip", "", "int4", "FP32"])
            elif op == 2:
                t["data"] = t["data"][: rng.randrange(len(t["data"]))]
            elif op == 3:
                data = bytearray(t["data"])
                for _ in range(rng.randrange(1, 20)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                t["data"] = bytes(data)
            elif op == 4:
                bad = self.base.copy()
                bad[rng.randrange(SPEC.numel)] = rng.choice([np.nan, np.inf, -np.inf])
                t.update(codec="fp32", zstd=False, delta=False, data=bad.tobytes())
                t.pop("block", None), t.pop("base", None)
            elif op == 5:
                t["zstd"] = not t["zstd"]
            elif op == 6:
                t["delta"] = True
                t["base"] = rng.randrange(2**32)  # a base the aggregator does not hold
            elif op == 7:
                t["block"] = rng.choice([0, -5, 2**40, "big"])
            elif op == 8:  # a zstd bomb: 64 MiB of zeros in a small frame
                import zstandard

                t.update(codec="fp32", zstd=True, delta=False,
                         data=zstandard.ZstdCompressor().compress(bytes(64 * 1024 * 1024)))
                t.pop("block", None), t.pop("base", None)
            else:
                t["data"] = rng.randbytes(len(t["data"]))
            return msgpack.packb(doc, use_bin_type=True), None
        if kind == "flip":
            data = bytearray(msgpack.packb(self._update_map(), use_bin_type=True))
            for _ in range(rng.randrange(1, 9)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            return bytes(data), None
        if kind == "huge":
            op = rng.randrange(6)
            if op == 0:
                return b"\xc6\xff\xff\xff\xf0" + b"x" * 10, None  # bin32 declaring ~4 GiB
            if op == 1:
                return b"\xdd\x7f\xff\xff\xff" + b"\x00" * 10, None  # array32 of 2^31
            if op == 2:
                return b"\xdf\x7f\xff\xff\xff" + b"\xa1a\x01", None  # map32 of 2^31
            if op == 3:
                return rng.randbytes(300 * 1024), None  # above max_message_bytes
            if op == 4:  # a chunk declaring a TiB
                return protocol.encode(protocol.Chunk(
                    agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                    of=protocol.new_msg_id(), index=0, count=2, total_bytes=2**40,
                    sha256=bytes(32), data=b"x" * 100)), None
            doc = self._update_map()
            doc["pad"] = b"x" * (200 * 1024)  # fits the size limit, unknown field
            return msgpack.packb(doc, use_bin_type=True), None
        raise ValueError(kind)

    def chunk_flood(self, partials: int, contradict_every: int = 10) -> list[bytes]:
        """First pieces of `partials` messages that will never complete, plus (every
        `contradict_every`-th, 0 = none) a piece that contradicts it (same `of`, other count)."""
        out = []
        for i in range(partials):
            of = protocol.new_msg_id()
            total = 20_000
            out.append(protocol.encode(protocol.Chunk(
                agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), of=of,
                index=0, count=5, total_bytes=total, sha256=hashlib.sha256(bytes(total)).digest(),
                data=bytes(4000))))
            if contradict_every and i % contradict_every == 0:
                out.append(protocol.encode(protocol.Chunk(
                    agent=self.agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), of=of,
                    index=1, count=4, total_bytes=total, sha256=bytes(32), data=bytes(5000))))
        return out


# ------------------------------------------------------------------------------- the campaign


def run_campaign(broker_url: str, state_dir: Path, *, fleet: str, messages: int, seed: int = 0,
                 honest_updates: int = 20, floods: int = 2, flood_size: int = 60,
                 settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run; `messages=0` is the baseline (the fuzzer only joins). Returns the figures and
    the final cluster models (key "clusters", tensors). `settings` go over CAMPAIGN_SETTINGS."""
    from aggregator.bootstrap import build_engine
    from aggregator.service import AggregatorService
    from edge_agent.protocol_client import RESYNC_REASONS, AgentError, EdgeAgent

    port = int(broker_url.rsplit(":", 1)[1])
    cfg = small_config(broker_url, state_dir, fleet, **{**CAMPAIGN_SETTINGS, **(settings or {})})
    svc = AggregatorService(cfg, build_engine(cfg)).start()
    honest = EdgeAgent(cfg, "honest", reply_timeout_s=30.0).start()
    fuzzer = Fuzzer(port, fleet)
    samples: dict[str, float] = {"rss_max_mib": 0.0, "inbox_max": 0, "reassembler_max_bytes": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            samples["rss_max_mib"] = max(samples["rss_max_mib"], rss_mib())
            samples["inbox_max"] = max(samples["inbox_max"], svc._inbox.qsize())
            samples["reassembler_max_bytes"] = max(samples["reassembler_max_bytes"],
                                                   svc.channel.reassembler.pending_bytes)

    figures: dict[str, Any] = {"fleet": fleet, "messages": messages, "seed": seed}
    try:
        honest.join()
        join = protocol.Join(agent="fuzzer", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             model=SPEC.hash, algorithm="cdfl")
        fuzzer.publish(protocol.encode(join)).wait_for_publish(10)
        (_, joined), = fuzzer.collect(1, 30)
        assert isinstance(joined, protocol.Model), joined
        base = codecs.decode(joined.tensors[0])
        gen = Generator(seed, fleet, "fuzzer", base)
        rss_start = rss_mib()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        refused_before = Counter(svc.counters)
        dup_before = svc.engine.counters["duplicates"]

        sent: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        missing: list[str] = []
        flood_replies = 0
        replays = 0
        round_trips: list[float] = []
        applied_envelopes: list[bytes] = []
        honest_thread: threading.Thread | None = None
        honest_refused: Counter[str] = Counter()

        def honest_upload(i: int) -> None:
            v = honest.installed.vector + 0.01 * torch.from_numpy(
                np.random.default_rng([seed, i]).normal(size=SPEC.numel).astype(np.float32))
            env = honest.update_envelope(v, 100)
            t0 = time.perf_counter()
            try:
                honest.upload(env)
            except AgentError as e:  # a refusal is a figure (honest_refused), not a crash
                if not e.refused:
                    raise
                honest_refused[e.reason] += 1
                if e.reason in RESYNC_REASONS:
                    honest.join()
                return
            round_trips.append(time.perf_counter() - t0)
            applied_envelopes.append(protocol.encode(env))

        every = max(1, messages // honest_updates) if messages else 0
        flood_at = {messages * (j + 1) // (floods + 1) for j in range(floods)} if messages else set()
        i = 0
        n_honest = 0
        while n_honest < honest_updates or i < messages:
            if n_honest < honest_updates and (not messages or i >= n_honest * every):
                if honest_thread is not None:
                    honest_thread.join()
                    if messages and applied_envelopes:  # a replay of an applied upload
                        old = applied_envelopes[gen.rng.randrange(len(applied_envelopes))]
                        fuzzer.publish(old, protocol.uplink(fleet, "honest")).wait_for_publish(10)
                        replays += 1
                honest_thread = threading.Thread(target=honest_upload, args=(n_honest,))
                honest_thread.start()
                n_honest += 1
                if not messages:
                    honest_thread.join()
                    continue
            if i >= messages:
                continue
            if any(i <= f < i + WINDOW for f in flood_at):
                pieces = gen.chunk_flood(flood_size)
                for p in pieces:
                    fuzzer.publish(p)
                sent["chunk_flood"] += len(pieces)
                # Each partial message gets a reply (chunk_timeout, chunk_inconsistent, or
                # chunk_overflow beyond protocol.max_partials_per_sender); a contradicting
                # piece of a refused message is refused again: up to one reply per piece.
                # one more than can come, so an excess reply is caught below, not as a late one
                got = fuzzer.collect(len(pieces) + 1, timeout=120, quiet_s=3 * cfg.protocol.chunk_timeout_s)
                flood_replies += len(got)
                reasons.update(f"flood.{e.reason}" if isinstance(e, protocol.Error) else "flood.?" for _, e in got)
                ofs = {protocol.decode(p, cfg.protocol.max_message_bytes).of for p in pieces}
                answered = {getattr(e, "in_reply_to", None) for _, e in got}
                if ofs - answered or len(got) > len(pieces):
                    missing.append(f"chunk flood: {len(ofs - answered)} of {len(ofs)} partials unanswered, "
                                   f"{len(got)} replies for {len(pieces)} pieces")
            batch = []
            for _ in range(min(WINDOW, messages - i)):
                kind = KINDS[gen.rng.randrange(len(KINDS))]
                payload, topic = gen.message(kind)
                batch.append(kind)
                fuzzer.publish(payload, topic)
                sent[kind] += 1
                i += 1
            # collect returns as soon as all are in; the bound only matters on a machine busy with
            # other work (CI: a window took over 30 s beside a RabbitMQ cluster and two busy loops).
            got = fuzzer.collect(len(batch), timeout=120)
            for _, env in got:
                reasons[env.reason if isinstance(env, protocol.Error) else f"not_error:{type(env).__name__}"] += 1
            if len(got) != len(batch):
                missing.append(f"window ending at {i}: {len(got)} replies for {len(batch)} ({batch})")
        if honest_thread is not None:
            honest_thread.join()
        # Malformed topics: no agent to answer, a log line and a counter each.
        bad_topics = 0
        if messages:
            for topic in (f"fedmq/{fleet}/agents/bad agent!/up", f"fedmq/{fleet}/agents/{'x' * 80}/up"):
                fuzzer.publish(b"garbage", topic).wait_for_publish(10)
                bad_topics += 1
            time.sleep(0.5)
        extra = fuzzer.collect(10_000, timeout=3.0 if messages else 0.1)  # nothing more may come
        stop.set()
        sampler.join()
        refused = Counter(svc.counters) - refused_before
        figures.update(
            sent=dict(sent), sent_total=sum(sent.values()), replies=dict(reasons),
            replies_total=sum(reasons.values()), unanswered=missing, late_replies=len(extra),
            flood_replies=flood_replies,
            replays_sent=replays, duplicates_answered=svc.engine.counters["duplicates"] - dup_before,
            bad_topics_sent=bad_topics, bad_topics_logged=refused.get("refused.bad_topic", 0),
            regenerated=gen.regenerated, rss_start_mib=rss_start,
            rss_growth_mib=samples["rss_max_mib"] - rss_start, inbox_max=samples["inbox_max"],
            reassembler_max_bytes=samples["reassembler_max_bytes"],
            max_pending_bytes=cfg.protocol.max_pending_bytes,
            applied_updates=svc.engine.counters["applied.update"], honest_updates=len(round_trips),
            honest_refused=dict(sorted(honest_refused.items())),
            honest_round_trip_max_s=max(round_trips, default=0.0),
            honest_round_trip_p50_s=float(np.median(round_trips)) if round_trips else 0.0,
            aggregator_alive=svc._worker is not None and svc._worker.is_alive(),
            batch_failures=svc.counters.get("batch_failures", 0),
            internal_errors=svc.counters.get("refused.internal_error", 0),
        )
        figures["clusters"] = [c.clone() for c in svc.engine.strategy.state_dict()["clusters"]]
        figures["epoch"] = svc.engine.strategy.uploads_applied
    finally:
        stop.set()
        fuzzer.close()
        honest.stop()
        svc.stop()
    return figures


def compare(fuzzed: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    same = all(torch.equal(a, b) for a, b in zip(fuzzed["clusters"], baseline["clusters"], strict=True))
    return {"clusters_bit_identical": same, "epoch_fuzzed": fuzzed["epoch"], "epoch_baseline": baseline["epoch"]}


def main(argv: list[str] | None = None) -> int:
    from fedmq.broker import MosquittoBroker

    p = argparse.ArgumentParser(prog="python -m soak.fuzz_uplink", description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--honest-updates", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedmq-fuzz-") as tmp, MosquittoBroker.dev() as broker:
        cache = pretrained_state(Path(tmp) / "pretrained")
        t0 = time.perf_counter()
        fuzzed = run_campaign(broker.url, pretrained_state(Path(tmp) / "a", cache), fleet="fz-a",
                              messages=args.messages, seed=args.seed, honest_updates=args.honest_updates)
        seconds = time.perf_counter() - t0
        baseline = run_campaign(broker.url, pretrained_state(Path(tmp) / "b", cache), fleet="fz-b",
                                messages=0, seed=args.seed, honest_updates=args.honest_updates)
    result = {k: v for k, v in fuzzed.items() if k != "clusters"}
    result.update(compare(fuzzed, baseline), campaign_seconds=round(seconds, 1))
    path = write_figures("fuzz_uplink", result, args.out)
    print(f"fuzz campaign: {result['sent_total']} messages, {result['replies_total']} replies, "
          f"bit-identical={result['clusters_bit_identical']}, rss growth {result['rss_growth_mib']:.0f} MiB "
          f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.fuzz_uplink", main))
