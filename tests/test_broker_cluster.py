"""fedmq on a real 2-node RabbitMQ cluster (issue 18): agents on one node, the aggregator on
the other, the agents' node killed (-9) during a burst of uploads.

Must hold: every upload acknowledged to its agent is in the journal exactly once (0 lost, 0
applied twice), every agent is connected again (to the other node) within 10 s of the kill,
and every upload gets its reply. The agents and the aggregator are given both nodes' URLs
(their own first), as docs/scaling.md tells a user to."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from edge_agent.protocol_client import EdgeAgent
from soak.fleet_setup import pretrained_state, small_config
from tests.rabbitmq_cluster import RabbitCluster, installed
from tests.test_faults import journal_update_ids, upload_burst

pytestmark = pytest.mark.skipif(not installed(), reason="rabbitmq-server is not installed (make test installs it)")

AGENTS, UPLOADS, BACK_WITHIN_S = 4, 6, 10.0


def test_a_node_lost_during_a_burst_loses_nothing_and_every_agent_is_back(tmp_path: Path) -> None:
    with RabbitCluster() as cluster:
        a, b = cluster.nodes
        state = pretrained_state(tmp_path / "state")
        fast = {"broker.reconnect_min_s": 0.2, "broker.reconnect_max_s": 1.0}  # the test's clock, not the default 0.5-30 s
        svc = AggregatorService(small_config(f"{b.url},{a.url}", state, "cluster", **fast),
                                build_engine(small_config(f"{b.url},{a.url}", state, "cluster", **fast))).start()
        acfg = small_config(f"{a.url},{b.url}", state, "cluster", **fast)
        agents = [EdgeAgent(acfg, f"c{i}", reply_timeout_s=5.0, retries=20).start() for i in range(AGENTS)]
        back: dict[str, float] = {}
        killed_at: list[float] = []
        for agent in agents:
            agent.transport.on_connect_hooks.append(
                lambda t, _, name=agent.agent_id: killed_at and back.setdefault(name, time.monotonic()))
        try:
            threads, uploaded, failures = upload_burst(agents, UPLOADS)
            deadline = time.monotonic() + 300
            while len(uploaded) < AGENTS * 2 and not failures:
                assert time.monotonic() < deadline, "the burst did not start"
                time.sleep(0.01)
            killed_at.append(time.monotonic())
            cluster.kill(0)  # the agents' node, mid-burst
            for t in threads:
                t.join(300)
            assert not failures, failures
            assert len(uploaded) == AGENTS * UPLOADS
            assert sorted(journal_update_ids(state)) == sorted(uploaded)  # each acknowledged one, once
            assert svc.engine.counters["applied.update"] == AGENTS * UPLOADS
            late = {name: round(at - killed_at[0], 2) for name, at in back.items()}
            assert set(late) == {ag.agent_id for ag in agents}, late
            assert max(late.values()) <= BACK_WITHIN_S, late
            print(f"agents back after (s): {late}; duplicates answered: {svc.engine.counters['duplicates']}")
            assert all(ag.transport.address.port == b.mqtt_port for ag in agents)
        finally:
            svc.stop()
            for ag in agents:
                ag.transport.close()
