"""fedmq on a real 2-node RabbitMQ cluster (docs/scaling.md), started as a user would:
`fedmq broker --rabbitmq 2`. Agents on one node, the aggregator on the other, the agents'
node killed (-9 on its Erlang VM) during a burst of uploads.

Must hold: every upload acknowledged to its agent is in the journal exactly once (0 lost, 0
applied twice), every agent is connected again (to the other node) within 10 s of the kill,
and every upload gets its reply. The agents and the aggregator are given both nodes' URLs
(their own first), as docs/scaling.md tells a user to. The command reports the dead node
and keeps the other serving; Ctrl-C then stops it and removes the nodes' files."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from edge_agent.protocol_client import EdgeAgent
from fedmq.config import BrokerSettings
from fedmq.rabbitmq_cluster import installed
from fedmq.transport import MqttTransport
from soak.fleet_setup import pretrained_state, small_config
from tests.cli_process import CliProcess
from tests.test_faults import CHEAP_REPLIES, journal_update_ids, upload_burst

pytestmark = pytest.mark.skipif(not installed(), reason="rabbitmq-server is not installed (make test installs it)")

AGENTS, UPLOADS, BACK_WITHIN_S = 4, 6, 10.0


@pytest.mark.slow
def test_a_node_lost_during_a_burst_loses_nothing_and_every_agent_is_back(tmp_path: Path) -> None:
    with CliProcess(["fedmq", "broker", "--rabbitmq", "2", "--port", "0"], cwd=tmp_path) as broker:
        a_url, b_url = broker.wait_for(r"^url: (\S+)$", timeout=300).group(1).split(",")
        broker.wait_for("Ctrl-C stops every node", timeout=60)
        a_name, a_group = broker.wait_for(rf"^node (\S+) {re.escape(a_url)} group (\d+) ", timeout=10).groups()
        workdir = Path(re.search(r"log (\S+)/node0/server\.out", broker.output).group(1))
        cross_node_message(a_url, b_url)
        state = pretrained_state(tmp_path / "state")
        fast = {"broker.reconnect_min_s": 0.2, "broker.reconnect_max_s": 1.0}  # the test's clock, not the default 0.5-30 s
        # Speed only: replies trained in a few steps, not 128 (the test is about delivery).
        cfg = small_config(f"{b_url},{a_url}", state, "cluster", **fast, **CHEAP_REPLIES)
        svc = AggregatorService(cfg, build_engine(cfg)).start()
        acfg = small_config(f"{a_url},{b_url}", state, "cluster", **fast)
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
            os.killpg(int(a_group), signal.SIGKILL)  # the agents' node, mid-burst, as the command's line says
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
            assert all(ag.transport.address.port == int(b_url.rsplit(":", 1)[1]) for ag in agents)
            broker.wait_for(rf"^node {re.escape(a_name)} exited .*; 1 left$", timeout=60)
        finally:
            svc.stop()
            for ag in agents:
                ag.transport.close()
        assert broker.stop(signal.SIGINT, timeout=120) == 0, broker.output[-3000:]
        assert not workdir.exists()


def cross_node_message(a_url: str, b_url: str) -> None:
    """A live message published on node A reaches a subscriber on node B: the nodes are one cluster."""
    got = threading.Event()
    sub = MqttTransport("sub", BrokerSettings(url=b_url, protocol="3.1.1"), clean_start=True).connect(60)
    pub = MqttTransport("pub", BrokerSettings(url=a_url, protocol="3.1.1"), clean_start=True).connect(60)
    try:
        sub.subscribe("fedmq/cli-cluster/probe", lambda m: got.set(), qos=1)
        pub.publish("fedmq/cli-cluster/probe", b"across", qos=1).wait(60)
        assert got.wait(60), "a message published on node A never reached node B"
    finally:
        sub.close()
        pub.close()
