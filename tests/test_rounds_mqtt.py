"""Deadline rounds over a real Mosquitto, in real time: RoundService + RoundAgents.

CATA-Fed: a round with one straggler (an emulated slow device) and one dropout (killed on
receipt of the invite: the broker publishes its will) ends at the cut-off with the straggler
reported and the dropout out of the pool; the straggler's next round trains on a halved shard
and finishes; the dropout comes back online, re-enters the pool and is invited again.
FedAvg: a late update is dropped and the late agent stays in the pool. A round agent draws a
new batch order every round. Every wait is on an event (polled, generous deadline): an agent
appends to its log after the broker acknowledged its report, so after the server has it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from aggregator.catafed import CataFed
from aggregator.fedavg import FedAvgDeadline
from aggregator.round_service import RoundService
from aggregator.tifl import TiFL
from edge_agent.round_agent import RoundAgent
from fedmq import codecs, protocol
from fedmq.channel import Channel
from fedmq.config import Config, load_config
from fedmq.data import load_dataset
from fedmq.models import build_model, to_vector
from fedmq.training import evaluate, fit
from fedmq.transport import Message, MqttTransport

MODEL = "digits-cnn"
WAIT_S = 120.0


def make_cfg(url: str, **extra) -> Config:
    return load_config(None, {"fleet": "r", "broker.url": url, "data.dataset": "digits",
                              "catafed.groups": 1, "catafed.per_group": 3, "catafed.epochs": 1,
                              "catafed.min_shard": 16, "catafed.lr": 0.05, "fedavg.epochs": 1,
                              "fedavg.lr": 0.05, **extra})


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.02)


def data(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = load_dataset("digits")
    return ds.x[lo:hi], ds.y[lo:hi]


class VanishingAgent(RoundAgent):
    """Gets the invite, then its connection dies (no report, no goodbye)."""

    def handle_invite(self, invite: protocol.RoundInvite, received_at: float) -> None:
        self.counters["invites"] += 1
        self.transport.kill()


@pytest.mark.slow
def test_catafed_round_with_straggler_and_dropout(mosquitto) -> None:
    # T = 8 s and eps_i = 0.2 s before any upload was measured: a 7.8 s budget. The slow
    # device needs 50 ms per sample: 10 s for its 200 samples (the watchdog aborts), 5 s
    # for a 100-sample shard (it finishes). Margins of seconds, for a busy 2-core machine.
    cfg = make_cfg(mosquitto.url, **{"catafed.deadline_s": 8.0, "catafed.grace_s": 2.0})
    test = load_dataset("digits", train=False)
    start = to_vector(build_model(MODEL, seed=0))
    fit(MODEL, start, *data(0, 32))  # torch's first call (seconds when loaded) is no round's
    strategy = CataFed(cfg.catafed, start)
    service = RoundService(cfg, strategy, model_name=MODEL,
                           evaluate=lambda v: evaluate(MODEL, v, test.x, test.y)[0])
    fast = RoundAgent(cfg, "fast", *data(0, 100))
    slow = RoundAgent(cfg, "slow", *data(100, 300), extra_s_per_sample=0.05)
    gone = VanishingAgent(cfg, "gone", *data(300, 400))
    back = None
    with service:
        try:
            for a in (fast, slow, gone):
                a.start()
            assert service.wait_for_pool(3, WAIT_S)
            first = service.run_round()
            assert sorted(first.selected) == ["fast", "gone", "slow"]
            assert first.sizes == {"fast": 100, "gone": 100, "slow": 200}
            assert (first.finished, first.stragglers, first.dropouts) == (["fast"], ["slow"], ["gone"])
            assert first.ended == "cutoff"
            assert not torch.equal(strategy.vector, start)  # the finisher's update is in
            wait_until(lambda: len(slow.log) >= 1, "the straggler's log of round 1")
            assert slow.log[-1].finished is False and slow.log[-1].shard_used == 200
            assert strategy.agents["slow"].size == 100  # the straggler's report: halved
            assert strategy.pool() == ["fast", "slow"]  # the dropout left the pool
            assert service.counters["status.offline"] >= 1  # its last will

            second = service.run_round()
            assert sorted(second.selected) == ["fast", "slow"] and second.sizes["slow"] == 100
            assert sorted(second.finished) == ["fast", "slow"] and second.ended == "all_reported"
            wait_until(lambda: len(slow.log) >= 2, "the straggler's log of round 2")
            assert slow.log[-1].shard_used == 100 and slow.log[-1].n_samples == 100
            assert slow.log[-1].upload_s > 0

            back = RoundAgent(cfg, "gone", *data(300, 400))  # online again, same id
            back.start()
            assert service.wait_for_pool(3, WAIT_S)
            third = service.run_round()
            assert "gone" in third.selected and "gone" in third.finished
            assert third.accuracy is not None and 0.0 <= third.accuracy <= 1.0
            assert strategy.round == 3
        finally:
            for a in (fast, slow, back):
                if a is not None:
                    a.stop()


@pytest.mark.slow
def test_fedavg_drops_a_late_update_and_keeps_the_agent(mosquitto) -> None:
    # Cut-off at T + grace = 5 s; the late agent needs 8 s (80 ms per sample), the other
    # well under a second: margins of seconds both ways, for a busy 2-core machine.
    cfg = make_cfg(mosquitto.url, **{"catafed.deadline_s": 4.0, "catafed.grace_s": 1.0,
                                     "fedavg.clients_per_round": 2})
    start = to_vector(build_model(MODEL, seed=0))
    fit(MODEL, start, *data(0, 32))  # torch's first call (seconds when loaded) is no round's
    strategy = FedAvgDeadline(cfg.catafed, start, fedavg=cfg.fedavg)
    service = RoundService(cfg, strategy, model_name=MODEL)
    on_time = RoundAgent(cfg, "on-time", *data(0, 100), algorithm="fedavg")
    late = RoundAgent(cfg, "late", *data(100, 200), algorithm="fedavg", extra_s_per_sample=0.08)
    wrong = RoundAgent(cfg, "wrong", *data(200, 300), algorithm="catafed")
    with service:
        try:
            for a in (on_time, late, wrong):
                a.start()
            assert service.wait_for_pool(2, WAIT_S)
            record = service.run_round()
            assert sorted(record.selected) == ["late", "on-time"]  # "wrong" never entered the pool
            assert record.finished == ["on-time"] and record.dropouts == ["late"]
            assert record.ended == "cutoff"
            wait_until(lambda: len(late.log) >= 1, "the late agent's report")
            assert late.log[-1].finished  # it did finish: 8 s of work, after the cut-off
            service.pump(time.monotonic() + WAIT_S, stop=lambda: service.counters["reports.late"] > 0)
            assert service.counters["reports.late"] == 1
            assert sorted(strategy.pool()) == ["late", "on-time"]
            wait_until(lambda: "wrong_algorithm" in wrong.errors, "the refusal of the wrong algorithm")
        finally:
            for a in (on_time, late, wrong):
                a.stop()


def test_tifl_profiles_over_the_wire_and_stops_inviting_the_late_agent(mosquitto) -> None:
    # Cut-off at 5 s; "late" needs 8 s (80 ms per sample). Round 1 profiles both (N = 2):
    # "fast" reports with a latency the server measured and its score of the model it got;
    # "late" misses the cut-off, so it is beyond T_max and round 2 invites "fast" alone.
    cfg = make_cfg(mosquitto.url, **{"catafed.deadline_s": 4.0, "catafed.grace_s": 1.0,
                                     "fedavg.clients_per_round": 2, "tifl.tiers": 2})
    start = to_vector(build_model(MODEL, seed=0))
    fit(MODEL, start, *data(0, 32))  # torch's first call (seconds when loaded) is no round's
    strategy = TiFL(cfg.catafed, start, fedavg=cfg.fedavg, tifl=cfg.tifl)
    service = RoundService(cfg, strategy, model_name=MODEL)
    fast = RoundAgent(cfg, "fast", *data(0, 100), algorithm="tifl")
    late = RoundAgent(cfg, "late", *data(100, 200), algorithm="tifl", extra_s_per_sample=0.08)
    with service:
        try:
            for a in (fast, late):
                a.start()
            assert service.wait_for_pool(2, WAIT_S)
            first = service.run_round()
            assert sorted(first.selected) == ["fast", "late"] and first.group is None
            assert first.finished == ["fast"] and first.dropouts == ["late"]
            assert 0 < strategy.latency["fast"] < 5.0 and strategy.latency["late"] == float("inf")
            # its score is of the int8 model it decoded: within a few of 100 predictions of W_0's
            assert abs(strategy.score["fast"] - evaluate(MODEL, start, *data(0, 100))[0]) <= 0.03
            second = service.run_round()
            assert second.selected == ["fast"] and second.group == 0
        finally:
            for a in (fast, late):
                a.stop()


def test_report_for_a_closed_round_changes_nothing(mosquitto) -> None:
    cfg = make_cfg(mosquitto.url, **{"catafed.deadline_s": 2.0})
    strategy = CataFed(cfg.catafed, to_vector(build_model(MODEL, seed=0)))
    with RoundService(cfg, strategy, model_name=MODEL) as service, \
            RoundAgent(cfg, "a", *data(0, 60)) as agent:
        assert service.wait_for_pool(1, WAIT_S)
        service.run_round()
        before = strategy.vector.clone()
        # Replay the agent's last report after its round closed: counted late, ignored.
        stale = protocol.Report(agent="a", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                round=0, finished=False, n_samples=0, shard_size=5)
        agent.channel.send(protocol.uplink(cfg.fleet, "a"), stale).pop().wait(60)
        service.pump(time.monotonic() + WAIT_S, stop=lambda: service.counters["reports.late"] > 0)
        assert service.counters["reports.late"] == 1
        assert torch.equal(strategy.vector, before) and strategy.agents["a"].size == 60


def test_round_agent_draws_a_new_batch_order_each_round(mosquitto) -> None:
    # The same W_t and the same data in rounds 1 and 2: the reports can differ only by the
    # batch order. Round 1 again reproduces its report (seeded by (seed, round), not noise).
    cfg = make_cfg(mosquitto.url, **{"codec.name": "fp32"})
    start = to_vector(build_model(MODEL, seed=0)).numpy()
    wire = codecs.encode(start, "fp32")
    reports: queue.Queue[protocol.Report] = queue.Queue()
    server = MqttTransport("fedmq-test-rounds-server", cfg.broker)
    channel = Channel(server, cfg.protocol)

    def on_up(message: Message) -> None:
        got = channel.receive(message)
        if got is not None and isinstance(got.envelope, protocol.Report):
            reports.put(got.envelope)

    server.connect(WAIT_S)
    server.subscribe(protocol.uplink(cfg.fleet, "s"), on_up, qos=1)
    try:
        with RoundAgent(cfg, "s", *data(0, 200), algorithm="fedavg", seed=7) as agent:
            vectors = []
            for round_id in (1, 2, 1):
                channel.send(protocol.downlink(cfg.fleet, "s"), protocol.RoundInvite(
                    agent="s", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                    round=round_id, deadline_s=WAIT_S, model=agent.spec.hash, tensor=wire,
                    epoch=round_id))
                report = reports.get(timeout=WAIT_S)
                assert report.round == round_id and report.finished
                vectors.append(codecs.decode(report.tensor, base=start))
    finally:
        server.close()
    assert not np.array_equal(vectors[0], vectors[1])
    assert np.array_equal(vectors[0], vectors[2])


@pytest.mark.long("the probe waits out the will of the shipped keepalive (1.5 x 30 s + 5 s): a round service's "
                  "status carries no heartbeat")
def test_a_second_round_aggregator_on_the_fleet_stops_and_the_first_serves_on(mosquitto) -> None:
    """Two round services for one fleet (one client id, as two `fedmq aggregator --algorithm
    catafed` runs), started a moment apart with the shipped defaults: the later one stops with
    a clear reason before taking the session (its probe saw the first online) and no offline
    status over the other's; the first still runs a round."""
    import threading

    cfg = make_cfg(mosquitto.url)
    first = RoundService(cfg, CataFed(cfg.catafed, to_vector(build_model(MODEL, seed=0))), model_name=MODEL)
    second = RoundService(cfg, CataFed(cfg.catafed, to_vector(build_model(MODEL, seed=0))), model_name=MODEL)
    with first:
        second.start()
        stop = threading.Event()
        try:
            runner = threading.Thread(target=second.run, kwargs={"rounds": 1, "stop": stop})
            runner.start()
            assert second.sole.failed.wait(WAIT_S), "the second round service never stopped"
            runner.join(WAIT_S)
            assert not runner.is_alive() and stop.is_set()
            assert "another aggregator is online for fleet 'r'" in second.sole.failure
        finally:
            second.stop()
        with RoundAgent(cfg, "a", *data(0, 60)):
            assert first.wait_for_pool(1, WAIT_S)  # its session is back: the agent's join arrived
            assert first.run_round() is not None
        assert not first.sole.failed.is_set()


def test_refusals_are_counted_by_reason_and_the_agent_serves_on(mosquitto) -> None:
    """An Error reply never stops a round agent: a join refused for the wrong algorithm and a
    refusal answered by a raw client are counted by reason (counters and retained status), and
    the refused agent still trains and reports in the next round."""
    import paho.mqtt.client as mqtt

    from fedmq.fleet_status import FleetWatcher

    cfg = make_cfg(mosquitto.url, **{"catafed.deadline_s": 3.0})
    strategy = CataFed(cfg.catafed, to_vector(build_model(MODEL, seed=0)))
    raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="refuser")
    raw.connect("127.0.0.1", mosquitto.port)
    raw.loop_start()
    try:
        with RoundService(cfg, strategy, model_name=MODEL) as service, \
                RoundAgent(cfg, "good", *data(0, 60)) as good, \
                RoundAgent(cfg, "wrong", *data(60, 120), algorithm="fedavg") as wrong:
            assert service.wait_for_pool(1, WAIT_S)
            service.pump(time.monotonic() + WAIT_S, stop=lambda: service.counters["errors.wrong_algorithm"] > 0)
            wait_until(lambda: wrong.counters.get("refused.wrong_algorithm", 0) >= 1,
                       "the refusal of the wrong algorithm")
            refusal = protocol.Error(agent="good", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                     reason="bad_report", detail="refused", in_reply_to=protocol.new_msg_id())
            raw.publish(protocol.downlink(cfg.fleet, "good"), protocol.encode(refusal), qos=1).wait_for_publish(30)
            wait_until(lambda: good.counters.get("refused.bad_report") == 1, "the counted refusal")
            record = service.run_round()
            assert record.finished == ["good"] and sorted(strategy.pool()) == ["good"]
            wait_until(lambda: len(good.log) == 1 and good.counters["reports"] == 1, "the good agent's report")
            assert good.counters["refused"] == 1 and wrong.counters["refused"] >= 1
            with FleetWatcher(cfg) as watcher:
                watcher.settle()
                _, agents = watcher.snapshot()
            seen = {a.name: a.counters for a in agents}
            assert seen["good"].get("refused.bad_report") == 1, seen
            assert seen["wrong"].get("refused.wrong_algorithm", 0) >= 1, seen
    finally:
        raw.disconnect()
        raw.loop_stop()
