"""An agent waits for a slow reply instead of re-sending: a real Mosquitto, the real aggregator
(in-process, its strategy held at a gate the test opens), a real agent with a short reply
timeout, and a plain subscriber counting what crosses the uplink.

- a reply held for several reply timeouts: the upload crosses the uplink once, the agent
  heard receipts (renewed while the reply was late) and installs the reply;
- the receipts carry the aggregator's measured reply cost once a reply was timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from aggregator.receipts import MIN_EXPECT_S, UNMEASURED_S
from edge_agent.protocol_client import EdgeAgent
from fedmq import protocol
from tests.test_agent_e2e import Sniffer, aggregator, make_cfg, pretrained, wait_for  # noqa: F401 - fixtures

REPLY_TIMEOUT_S = 1.0


class Gate:
    """Holds the strategy's replies until opened: a reply as slow as the test needs, with no
    sleep standing in for the work."""

    def __init__(self, update_many: Callable) -> None:
        self.update_many = update_many
        self.open = threading.Event()
        self.entered = threading.Event()

    def __call__(self, uploads):
        self.entered.set()
        assert self.open.wait(300), "the test never released the reply"
        return self.update_many(uploads)


def _receipts(sniffed: list[protocol.Envelope], of: str) -> list[protocol.Receipt]:
    return [e for e in sniffed if isinstance(e, protocol.Receipt) and e.of == of]


class DownlinkTap:
    """Every downlink envelope of one agent, as a plain subscriber gets it."""

    def __init__(self, port: int, fleet: str, agent: str) -> None:
        import paho.mqtt.client as mqtt

        self.envelopes: list[protocol.Envelope] = []
        self._lock = threading.Lock()
        ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"tap-{agent}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a, **k: ready.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(protocol.downlink(fleet, agent), qos=1)
        assert ready.wait(60)

    def _on_message(self, client, userdata, msg) -> None:
        try:
            env = protocol.decode(bytes(msg.payload), max_bytes=1 << 26)
        except protocol.ProtocolError:
            return  # a chunk of a large reply is a valid envelope; anything else is not ours
        with self._lock:
            self.envelopes.append(env)

    def snapshot(self) -> list[protocol.Envelope]:
        with self._lock:
            return list(self.envelopes)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.slow
def test_a_slow_reply_is_waited_for_not_resent(mosquitto, aggregator, tmp_path) -> None:  # noqa: F811
    cfg = make_cfg(mosquitto.url, tmp_path)
    agg = aggregator(cfg)
    strategy = agg.svc.engine.strategy
    sniffer = Sniffer(mosquitto.port)
    tap = DownlinkTap(mosquitto.port, cfg.fleet, "car-1")
    agent = EdgeAgent(cfg, "car-1", reply_timeout_s=REPLY_TIMEOUT_S, retries=3).start()
    try:
        joined = agent.join(n_samples=10)

        # A first upload answered at once: the aggregator times one reply.
        first = agent.update_envelope(joined.vector.clone(), 10)
        agent.upload(first)
        measured = agg.svc.receipts.cost("update")
        assert measured != UNMEASURED_S  # timed before the reply went out

        # The second reply is held for more than three times what the agent waits without a
        # receipt, and past the first receipt's promise, so that only renewed receipts keep
        # the agent from re-sending.
        gate = Gate(strategy.update_many)
        strategy.update_many = gate
        second = agent.update_envelope(agent.installed.vector.clone(), 10)
        result: dict[str, object] = {}
        sender = threading.Thread(target=lambda: result.update(reply=agent.upload(second)), daemon=True)
        sender.start()
        assert gate.entered.wait(120), "the upload never reached the strategy"
        taken = time.monotonic()
        wait_for(lambda: len(_receipts(tap.snapshot(), second.msg_id)) >= 3, 120, "renewed receipts")
        wait_for(lambda: time.monotonic() - taken > 3 * REPLY_TIMEOUT_S + 2 * MIN_EXPECT_S, 120,
                 "the reply held past the first receipt's wait")
        gate.open.set()
        sender.join(120)
        assert not sender.is_alive() and "reply" in result, "the held reply was not installed"
        installed, _ = result["reply"]
        assert installed.epoch == 2 and agent.installed is installed

        # Each upload crossed the uplink exactly once, and was applied once.
        sent = [env.msg_id for env, _ in sniffer.updates()]
        assert sent.count(first.msg_id) == 1 and sent.count(second.msg_id) == 1, sent
        assert agent.counters["resends"] == 0
        assert agg.svc.engine.counters["applied.update"] == 2
        receipts = _receipts(tap.snapshot(), second.msg_id)
        assert agent.counters["receipts"] >= 3
        # The first receipt's estimate is the measured cost, not the unmeasured default.
        assert receipts[0].expect_s == pytest.approx(max(measured, MIN_EXPECT_S), rel=0.01, abs=0.01)
    finally:
        agent.stop()
        tap.close()
        sniffer.close()


def test_a_chunked_upload_gets_its_receipt_once_whole(mosquitto, aggregator, tmp_path) -> None:  # noqa: F811
    cfg = make_cfg(mosquitto.url, tmp_path, **{"protocol.chunk_bytes": 4096})
    agg = aggregator(cfg)
    tap = DownlinkTap(mosquitto.port, cfg.fleet, "car-1")
    sniffer = Sniffer(mosquitto.port)
    agent = EdgeAgent(cfg, "car-1", reply_timeout_s=60.0).start()
    try:
        joined = agent.join(n_samples=10)
        noise = torch.randn(joined.vector.shape, generator=torch.Generator().manual_seed(0))
        update = agent.update_envelope(joined.vector + 1e-3 * noise, 10)  # random bytes: no zstd gain
        agent.upload(update)
        with sniffer._lock:
            pieces = [protocol.decode(p, max_bytes=1 << 26) for _, p in sniffer.payloads]
        pieces = [c for c in pieces if isinstance(c, protocol.Chunk) and c.of == update.msg_id]
        assert len(pieces) == pieces[0].count > 1  # it travelled in pieces, each once
        # Sent when the last piece arrived (the reply itself travels in pieces too).
        wait_for(lambda: _receipts(tap.snapshot(), update.msg_id), 60, "the chunked upload's receipt")
        assert agent.installed.epoch == 1
        assert agg.svc.counters["sent.receipt"] >= 2  # the join's and the update's
        assert agg.svc.receipts.outstanding == 0
    finally:
        agent.stop()
        tap.close()
        sniffer.close()
