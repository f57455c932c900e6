"""Hostile input on the live uplink (soak/fuzz_uplink.py has the generator and the campaign).

2,000 hostile messages of every kind (and a chunk flood) against a running aggregator over a
real Mosquitto, while an honest agent makes 10 uploads: the aggregator stays up, every message
gets its reason, replays apply nothing, memory stays bounded, and the honest agent's cluster
models are bit-identical to a run without the fuzzer. `make soak` sends 50,000. Plus the targeted cases: impersonation through the envelope's agent
field, and a chunk flood that fills the broker's in-flight window.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from fedmq import codecs, protocol
from fedmq.models import model_spec
from soak.fleet_setup import pretrained_state, small_config
from soak.fuzz_uplink import CAMPAIGN_SETTINGS, KINDS, Fuzzer, Generator, compare, run_campaign
from tests.raw_agent import RawAgent

SPEC = model_spec("digits-cnn")
MESSAGES = 2_000
"""About 250 of each kind: every generator branch several times over."""
HONEST = 10
FLOOD = 60
# A flood's held partials are answered at the chunk timeout, and the fuzzer then listens for
# three timeouts more: one flood of 1 s timeouts shows what the soak's two floods of 2 s show.
# Speed only: the honest agent's replies are trained in a few steps, not 128 (what it checks
# is that the fuzzing changes none of its models, whatever a reply costs).
SIZE = {"honest_updates": HONEST, "floods": 1, "flood_size": FLOOD,
        "settings": {"protocol.chunk_timeout_s": 1.0, "cdfl.personalize_epochs": 1, "cdfl.personalize_min_steps": 0}}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return pretrained_state(tmp_path_factory.mktemp("fuzz") / "pretrained")


@pytest.mark.slow
def test_fuzz_campaign_on_the_live_uplink(mosquitto, pretrained, tmp_path) -> None:
    fuzzed = run_campaign(mosquitto.url, pretrained_state(tmp_path / "a", pretrained), fleet="fz-a",
                          messages=MESSAGES, seed=0, **SIZE)
    baseline = run_campaign(mosquitto.url, pretrained_state(tmp_path / "b", pretrained), fleet="fz-b",
                            messages=0, seed=0, **SIZE)
    assert fuzzed["aggregator_alive"] and fuzzed["batch_failures"] == 0
    assert fuzzed["sent_total"] >= MESSAGES
    assert all(fuzzed["sent"].get(kind, 0) >= 100 for kind in KINDS), fuzzed["sent"]
    # Every hostile message got its reason: one error reply each (a chunk flood: every partial
    # message answered, with a reply for each piece refused outright), none late, malformed
    # topics logged and counted.
    assert fuzzed["unanswered"] == [], fuzzed["unanswered"][:5]
    assert fuzzed["late_replies"] == 0
    assert all(not r.startswith("not_error") for r in fuzzed["replies"]), fuzzed["replies"]
    assert fuzzed["replies_total"] == fuzzed["sent_total"] - fuzzed["sent"]["chunk_flood"] + fuzzed["flood_replies"]
    assert FLOOD <= fuzzed["flood_replies"] <= fuzzed["sent"]["chunk_flood"]
    assert fuzzed["bad_topics_logged"] == fuzzed["bad_topics_sent"] == 2
    assert fuzzed["internal_errors"] == 0  # every message was refused by a check, not by a crash
    # Replays of applied uploads were answered and applied nothing.
    assert fuzzed["duplicates_answered"] == fuzzed["replays_sent"] > 0
    assert fuzzed["applied_updates"] == fuzzed["honest_updates"] == HONEST
    # Bounded: the worker's queue (the fuzzer keeps 16 in flight; the broker's window does not
    # bound it on Mosquitto 2.0.11, see docs/reliability.md), partial messages by max_pending_bytes.
    assert fuzzed["inbox_max"] <= 64 + 16
    assert fuzzed["reassembler_max_bytes"] <= CAMPAIGN_SETTINGS["protocol.max_pending_bytes"]
    assert fuzzed["rss_growth_mib"] < 200, fuzzed["rss_growth_mib"]
    # The fuzzing changed nothing the honest agent's uploads did.
    same = compare(fuzzed, baseline)
    assert same["epoch_fuzzed"] == same["epoch_baseline"] == HONEST
    assert same["clusters_bit_identical"]


def test_envelope_naming_another_agent_is_refused(mosquitto, pretrained, tmp_path) -> None:
    """Impersonation on one's own topic (the broker's ACL only vouches for the topic)."""
    cfg = small_config(mosquitto.url, pretrained_state(tmp_path / "s", pretrained), "imp")
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        victim = RawAgent(mosquitto.port, "imp", "victim")
        mallory = RawAgent(mosquitto.port, "imp", "mallory")
        try:
            victim.join(SPEC.hash)
            mallory.join(SPEC.hash)
            before = [c.clone() for c in svc.engine.strategy.state_dict()["clusters"]]
            forged = protocol.Update(agent="victim", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                     model=SPEC.hash, tau=0, n_samples=1,
                                     tensor=codecs.encode(victim.base * 50, "fp32"))
            mallory.send(forged)  # on mallory's own uplink topic
            # Refused by the channel's topic check, before the engine, naming the forged msg_id.
            err = mallory.expect(forged.msg_id)
            assert isinstance(err, protocol.Error) and err.reason == "agent_mismatch", err
            forged_join = protocol.Join(agent="victim", msg_id=protocol.new_msg_id(),
                                        sent_at=protocol.now(), model=SPEC.hash, algorithm="cdfl")
            mallory.send(forged_join)
            assert mallory.expect(forged_join.msg_id).reason == "agent_mismatch"
            after = svc.engine.strategy.state_dict()["clusters"]
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            assert svc.engine.counters["applied.update"] == 0
            # The victim is untouched: its next honest update still applies against its own base.
            up = victim.update_envelope(victim.base * 1.001, SPEC.hash)
            victim.send(up)
            assert isinstance(victim.expect(up.msg_id), protocol.Model)
        finally:
            victim.close()
            mallory.close()


def test_chunk_flood_is_capped_per_sender(mosquitto, pretrained, tmp_path) -> None:
    """80 partial messages from one agent that never complete. Chunks are acked only with their
    message (durability), so uncapped they would hold the broker's in-flight window to the
    aggregator until they time out. With protocol.max_partials_per_sender (2) the sender keeps
    2 open (answered chunk_timeout later) and the other 78 are refused and acked at once
    (chunk_overflow); an honest upload sent meanwhile is applied once."""
    settings = {**CAMPAIGN_SETTINGS, "protocol.max_pending_bytes": 64 * 1024 * 1024}
    cfg = small_config(mosquitto.url, pretrained_state(tmp_path / "s", pretrained), "flood", **settings)
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        fuzzer = Fuzzer(mosquitto.port, "flood")
        honest = RawAgent(mosquitto.port, "flood", "honest")
        try:
            honest.join(SPEC.hash)
            gen = Generator(1, "flood", "fuzzer", np.zeros(SPEC.numel, np.float32))
            pieces = gen.chunk_flood(80, contradict_every=0)
            for p in pieces:
                fuzzer.publish(p)
            time.sleep(0.3)
            up = honest.update_envelope(honest.base * 1.001, SPEC.hash)
            honest.send(up)
            assert isinstance(honest.expect(up.msg_id, timeout=60), protocol.Model)
            replies = fuzzer.collect(80, timeout=60)
            assert len(replies) == 80
            reasons = Counter(e.reason for _, e in replies)
            assert reasons == {"chunk_overflow": 78, "chunk_timeout": 2}, reasons
            assert svc.engine.counters["applied.update"] == 1
            assert svc.channel.reassembler.pending_messages == 0
        finally:
            fuzzer.close()
            honest.close()


def _piece(agent: str, of: str, index: int, count: int) -> bytes:
    """Piece `index` of a `count`-byte message of one-byte pieces that is never sent whole."""
    return protocol.encode(protocol.Chunk(
        agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), of=of, index=index,
        count=count, total_bytes=count, sha256=hashlib.sha256(bytes(count)).digest(), data=bytes(1)))


def _until(cond: Callable[[], bool], timeout: float = 120.0) -> bool:
    """Poll a counter the aggregator's worker moves (no event to wait on from outside)."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def test_unfinished_chunks_never_fill_the_in_flight_window(mosquitto, pretrained, tmp_path) -> None:
    """Unfinished messages of one sender (2 x 63 pieces, then 2 x 30) with a chunk timeout of an
    hour: pieces are acknowledged only with their message, so without a bound on what is held
    they would fill the broker's in-flight window toward the aggregator (64, dev.conf) and another
    agent's join would wait for the timeout. Held: pieces of unfinished messages stay within half
    the window, the join is answered, copies of a held piece are acknowledged at once."""
    cfg = small_config(mosquitto.url, pretrained_state(tmp_path / "s", pretrained), "stall",
                       **{"protocol.chunk_timeout_s": 3600.0})
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        fuzzer = Fuzzer(mosquitto.port, "stall")
        honest = RawAgent(mosquitto.port, "stall", "honest")
        r = svc.channel.reassembler
        try:
            budget = svc.channel.held_budget()
            assert svc.transport.window == 64 and budget == 32
            big = [protocol.new_msg_id(), protocol.new_msg_id()]
            for of in big:  # 64 pieces declared: more than may be held, refused at each piece
                for i in range(63):
                    fuzzer.publish(_piece("fuzzer", of, i, 64))
            honest.join(SPEC.hash, timeout=120)
            assert Counter(e.reason for _, e in fuzzer.collect(126, timeout=120)) == {"too_large": 126}
            assert _until(lambda: r.held_pieces == 0 and svc.transport.unacked == 0)
            held, over = protocol.new_msg_id(), protocol.new_msg_id()
            for of in (held, over):  # 30 pieces each of two 31-piece messages
                for i in range(30):
                    fuzzer.publish(_piece("fuzzer", of, i, 31))
            for _ in range(5):  # copies of a held piece: the older copy is acknowledged
                fuzzer.publish(_piece("fuzzer", held, 0, 31))
            honest.join(SPEC.hash, timeout=120)
            # The second message reaches the bound at its third piece and is refused; each later
            # piece starts it again, refused again three pieces on: 30 pieces, 10 refusals.
            overflow = fuzzer.collect(10, timeout=120)
            assert [(e.reason, e.in_reply_to) for _, e in overflow] == [("chunk_overflow", over)] * 10
            assert _until(lambda: r.held_pieces == 30 and svc.transport.unacked == 30), \
                (r.held_pieces, svc.transport.unacked)
            assert r.pending_messages == 1 and r.held_pieces <= budget
        finally:
            fuzzer.close()
            honest.close()


def test_a_sender_over_its_share_gives_way_to_another_senders_chunked_upload(mosquitto, pretrained, tmp_path) -> None:
    """One sender holds 31 pieces of a message it never finishes (the bound is 32); another
    agent's upload in 6 pieces still completes: the biggest holder's message is dropped and
    answered chunk_overflow, the upload is applied, and nothing of the dropped one stays unacked."""
    cfg = small_config(mosquitto.url, pretrained_state(tmp_path / "s", pretrained), "share",
                       **{"protocol.chunk_timeout_s": 3600.0})
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        fuzzer = Fuzzer(mosquitto.port, "share")
        honest = RawAgent(mosquitto.port, "share", "honest")
        r = svc.channel.reassembler
        try:
            honest.join(SPEC.hash, timeout=120)
            hog = protocol.new_msg_id()
            for i in range(31):
                fuzzer.publish(_piece("fuzzer", hog, i, 32))
            assert _until(lambda: r.held_pieces == 31), r.held_pieces
            up = honest.update_envelope(honest.base * 1.001, SPEC.hash, codec="fp32")
            payload = protocol.encode(up)
            pieces = protocol.split(payload, agent="honest", chunk_bytes=-(-len(payload) // 6))
            assert len(pieces) == 6
            for piece in pieces:
                honest.publish_raw(piece)
            assert isinstance(honest.expect(up.msg_id, timeout=120), protocol.Model)
            [(_, dropped)] = fuzzer.collect(1, timeout=120)
            assert (dropped.reason, dropped.in_reply_to) == ("chunk_overflow", hog)
            assert svc.engine.counters["applied.update"] == 1
            assert _until(lambda: svc.transport.unacked == 0 and r.held_pieces == 0), \
                (svc.transport.unacked, r.held_pieces)
        finally:
            fuzzer.close()
            honest.close()


def test_empty_uplink_message_is_answered_unless_it_deletes_a_retained_one(mosquitto, pretrained, tmp_path) -> None:
    """A live empty message is garbage like any other (one `malformed` reply); an empty retained
    one deletes what the topic kept and is dropped unanswered (MQTT 5 keeps its retain flag)."""
    cfg = small_config(mosquitto.url, pretrained_state(tmp_path / "s", pretrained), "empty")
    with AggregatorService(cfg, build_engine(cfg)):
        fuzzer = Fuzzer(mosquitto.port, "empty")
        try:
            fuzzer.client.publish(protocol.uplink("empty", "fuzzer"), b"", qos=1, retain=True).wait_for_publish(10)
            fuzzer.publish(b"").wait_for_publish(10)
            (agent, err), = fuzzer.collect(1, timeout=60)
            assert agent == "fuzzer" and isinstance(err, protocol.Error) and err.reason == "malformed", err
            assert fuzzer.collect(1, timeout=2.0) == []  # the deletion got no reply
        finally:
            fuzzer.close()
