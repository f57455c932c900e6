"""The aggregator's Prometheus endpoint, scraped over HTTP while a real Mosquitto carries
uploads from raw MQTT clients: every counter equals what the test sent, rejections by reason.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aggregator.bootstrap import build_engine
from aggregator.prometheus import AggregatorMetrics
from aggregator.service import AggregatorService
from fedmq import codecs, protocol
from fedmq.config import load_config
from fedmq.models import model_spec
from tests.raw_agent import RawAgent

FLEET = "m"
SPEC = model_spec("digits-cnn")
# Speed only: small server sets; the defaults start the aggregator in test_documented_commands.
SMALL = {
    "fleet": FLEET, "cdfl.clusters": 2, "data.dataset": "digits", "data.proxy_per_cluster": 100,
    "data.pretrain_per_cluster": 200, "aggregator.pretrain_epochs": 1, "device": "cpu",
    "protocol.max_message_bytes": 256 * 1024, "protocol.chunk_bytes": 64 * 1024,
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    state = tmp_path_factory.mktemp("metrics-pretrained") / "state"
    engine = build_engine(load_config(None, {**SMALL, "aggregator.state_dir": str(state)}))
    engine.recover()
    engine.journal.close()
    return state


def scrape(port: int) -> dict[str, float]:
    """`name{label="v",...}` -> value for every sample the endpoint serves."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_scraped_counters_match_what_was_sent(mosquitto, pretrained, tmp_path) -> None:
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    cfg = load_config(None, {**SMALL, "broker.url": mosquitto.url, "aggregator.state_dir": str(state),
                             "aggregator.accuracy_every": 0})
    service = AggregatorService(cfg, build_engine(cfg))
    metrics = AggregatorMetrics(service)
    assert metrics.observe_batch in service.batch_observers
    agent = stranger = None
    with service:
        port = metrics.serve(0)
        try:
            before = scrape(port)
            assert before['fedmq_aggregator_uploads_total{result="applied"}'] == 0
            assert before["fedmq_aggregator_broker_connected"] == 1
            assert before["fedmq_aggregator_queue_depth"] == 0
            assert before[f'fedmq_aggregator_info{{algorithm="cdfl",fleet="{FLEET}"}}'] == 1

            agent = RawAgent(mosquitto.port, FLEET, "car-1")
            agent.join(SPEC.hash)
            rng = np.random.default_rng(0)
            for _ in range(2):  # two good uploads
                up = agent.update_envelope(agent.base + rng.normal(0, 0.01, SPEC.numel).astype(np.float32),
                                           SPEC.hash)
                agent.send(up)
                reply = agent.expect(up.msg_id)
                assert isinstance(reply, protocol.Model)
                agent.install(reply)
            agent.send(up)  # a replay of the last one: answered again, counted as duplicate
            assert isinstance(agent.expect(up.msg_id), protocol.Model)

            # Rejections: 2 x wrong_shape, 1 x malformed, 1 x too_large, 1 x unknown_agent.
            for _ in range(2):
                bad = protocol.Update(**{**up.__dict__, "msg_id": protocol.new_msg_id(),
                                         "tensor": codecs.encode(np.zeros(10, np.float32), "fp32")})
                agent.send(bad)
                assert agent.expect(bad.msg_id).reason == "wrong_shape"
            agent.publish_raw(b"\x93not msgpack")
            assert agent.expect("").reason == "malformed"
            agent.publish_raw(msgpack.packb({"v": 1, "type": "update", "pad": b"x" * (300 * 1024)}))
            assert agent.expect("").reason == "too_large"
            stranger = RawAgent(mosquitto.port, FLEET, "never-joined")
            lost = protocol.Update(agent="never-joined", msg_id=protocol.new_msg_id(),
                                   sent_at=protocol.now(), model=SPEC.hash, tau=0, n_samples=1,
                                   tensor=codecs.encode(np.zeros(SPEC.numel, np.float32), "fp32"))
            stranger.send(lost)
            assert stranger.expect(lost.msg_id).reason == "unknown_agent"

            # Presence: two agents say online (retained), then one says offline.
            for name, state_ in (("car-1", "online"), ("car-2", "online"), ("car-2", "offline")):
                status = protocol.Status(agent=name, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                         state=state_, role="agent")
                agent.publish_raw(protocol.encode(status), protocol.agent_status(FLEET, name))
            wait_for(lambda: service.presence.get("car-2") == "offline")

            m = scrape(port)
            # as the scrape saw them: stopping writes a final snapshot
            snapshot = max(state.glob("snapshot-*.msgpack"), key=lambda f: int(f.stem.split("-")[1]))
            on_disk = {"snapshot": snapshot.stat().st_size,
                       "journal": (state / f"journal-{snapshot.stem.split('-')[1]}.log").stat().st_size}
        finally:
            for client in (agent, stranger):
                if client is not None:
                    client.close()
            metrics.close()

    assert m['fedmq_aggregator_uploads_total{result="applied"}'] == 2
    assert m['fedmq_aggregator_uploads_total{result="stale"}'] == 0
    assert m["fedmq_aggregator_joins_total"] == 1
    assert m["fedmq_aggregator_duplicates_total"] == 1
    rejected = {k: v for k, v in m.items() if k.startswith("fedmq_aggregator_rejected_total")}
    assert rejected == {
        'fedmq_aggregator_rejected_total{reason="malformed"}': 1,
        'fedmq_aggregator_rejected_total{reason="too_large"}': 1,
        'fedmq_aggregator_rejected_total{reason="unknown_agent"}': 1,
        'fedmq_aggregator_rejected_total{reason="wrong_shape"}': 2,
    }
    assert m["fedmq_aggregator_epoch"] == 2
    assert m['fedmq_aggregator_state_bytes{part="snapshot"}'] == on_disk["snapshot"]
    assert m['fedmq_aggregator_state_bytes{part="journal"}'] == on_disk["journal"] > 0
    assert m["fedmq_aggregator_connected_agents"] == 1
    assert m['fedmq_aggregator_agents{state="offline"}'] == 1
    # Replies: join + 2 models + the replayed one; errors: 2 wrong_shape + malformed + too_large + unknown_agent.
    assert m['fedmq_aggregator_replies_total{type="model"}'] == 4
    # Errors for malformed/too_large are sent by the service's refusal path, not counted as replies.
    assert m['fedmq_aggregator_replies_total{type="error"}'] == 3
    # Latency: one evaluation per batch holding good uploads; end to end for every update answered.
    assert m["fedmq_aggregator_evaluation_seconds_count"] == 2
    assert m["fedmq_aggregator_end_to_end_seconds_count"] == 6  # 2 good, 1 replay, 2 wrong_shape, 1 unknown
    assert m["fedmq_aggregator_batch_seconds_count"] >= 7
    assert m["fedmq_aggregator_evaluation_seconds_sum"] > 0
    accuracy = getattr(service.engine, "cluster_accuracy", None)
    if accuracy:  # the engine refreshes it between batches (aggregator.accuracy_every)
        for k, value in enumerate(accuracy):
            assert m[f'fedmq_aggregator_cluster_accuracy{{cluster="{k}"}}'] == pytest.approx(value)
            assert 0.0 <= value <= 1.0


def test_cluster_accuracy_is_recomputed_only_after_uploads_moved_the_models(pretrained, tmp_path, monkeypatch) -> None:
    """accuracy_every = 0 means after every batch that applied an upload: a batch of refused
    or duplicate messages moves no model (a fuzzed aggregator evaluated after each one)."""
    from aggregator.strategy import Upload

    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    engine = build_engine(load_config(None, {**SMALL, "aggregator.state_dir": str(state)}))
    engine.recover()
    calls: list[int] = []
    real = engine.evaluator.accuracy_on
    monkeypatch.setattr(engine.evaluator, "accuracy_on", lambda w, k: calls.append(k) or real(w, k))
    engine.refresh_cluster_accuracy(0)
    assert calls == [0, 1] and len(engine.cluster_accuracy) == 2
    engine.refresh_cluster_accuracy(0)  # nothing applied since
    assert calls == [0, 1]
    engine.strategy.join("car-1")
    w = engine.strategy.clusters.mean(0)
    engine.strategy.apply(Upload("car-1", w + 0.01, tau=0, base=w))
    engine.refresh_cluster_accuracy(0)
    assert calls == [0, 1, 0, 1]
    engine.journal.close()
