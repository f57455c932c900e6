"""Faults with the real parts: Mosquitto, the aggregator (process or service), edge agents.

- kill -9 of the aggregator 3 times at seeded random moments of one fleet run: every upload
  applied exactly once, the run completes, the final cluster models equal a journal replay
  (`make soak` kills it 20 times in a run of 600 uploads);
- broker restart mid-run (kill -9) and with uploads queued for an offline aggregator
  (graceful restart, persistence): everyone reconnects, queued uploads arrive, none twice;
- network cuts and stalls between an agent and the broker (tests/tcp_proxy.py), mid-upload
  and mid-reply: the upload is applied exactly once after the link returns;
- the aggregator's disk fills (RLIMIT_FSIZE on its process: writes fail with EFBIG, torn
  writes included): it stops acknowledging and says why, its snapshot stays intact, and the
  upload is applied once when space returns or after a kill -9 and restart.
"""

from __future__ import annotations

import hashlib
import resource
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.journal import read_snapshot, scan_journal
from aggregator.service import AggregatorService
from edge_agent.protocol_client import RESYNC_REASONS, AgentError, EdgeAgent
from fedmq import protocol
from fedmq.models import model_spec
from soak.fleet_setup import pretrained_state, small_config, start_aggregator
from soak.kill_aggregator import run_kills
from tests.raw_agent import RawAgent
from tests.tcp_proxy import TcpProxy

SPEC = model_spec("digits-cnn")
CHEAP_REPLIES = {"cdfl.personalize_epochs": 1, "cdfl.personalize_min_steps": 0}
"""Speed only: replies still trained (and journalled), in a few steps, not the default 128:
these tests are about delivery, not what a reply learns."""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return pretrained_state(tmp_path_factory.mktemp("faults") / "pretrained")


def fresh_state(pretrained: Path, tmp_path: Path) -> Path:
    return pretrained_state(tmp_path / "state", cache=pretrained)


def noisy(agent: EdgeAgent, seed: int, scale: float = 0.01) -> torch.Tensor:
    noise = np.random.default_rng(seed).normal(0, scale, agent.spec.numel).astype(np.float32)
    return agent.installed.vector + torch.from_numpy(noise)


def journal_update_ids(state: Path) -> list[str]:
    """Update msg_ids of every journal generation still on disk, in order."""
    gens = sorted(int(p.stem.split("-")[1]) for p in state.glob("journal-*.log"))
    return [r["msg_id"] for g in gens for r in scan_journal(state / f"journal-{g}.log").records
            if r["op"] == "update"]


def upload_burst(agents: list[EdgeAgent], per_agent: int, pause_s: float = 0.0,
                 refused: Counter[str] | None = None) -> tuple[list[threading.Thread], list[str], list[str]]:
    """Each agent joins, then uploads `per_agent` times, waiting for each reply (agent i pauses
    (i + 1) x pause_s before each): the running threads, the msg_ids answered so far, and
    failures (repr), both filled as they happen. With `refused` (the soak drivers), an upload
    the aggregator refuses is counted there by reason and the agent goes on (joining again
    where the aggregator no longer knows its base); without it, a refusal is a failure."""
    uploaded: list[str] = []
    failures: list[str] = []
    lock = threading.Lock()

    def loop(i: int, agent: EdgeAgent) -> None:
        try:
            agent.join()
            for u in range(per_agent):
                time.sleep(pause_s * (i + 1))
                env = agent.update_envelope(noisy(agent, 100 * i + u), 100)
                try:
                    agent.upload(env)  # returns once the reply is installed
                except AgentError as e:
                    if refused is None or not e.refused:
                        raise
                    with lock:
                        refused[e.reason] += 1
                    if e.reason in RESYNC_REASONS:
                        agent.join()
                    continue
                with lock:
                    uploaded.append(env.msg_id)
        except Exception as e:  # noqa: BLE001 - asserted by the caller
            failures.append(repr(e))

    threads = [threading.Thread(target=loop, args=(i, a)) for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    return threads, uploaded, failures


# ---------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill_9_three_times_during_a_fleet_run(mosquitto, pretrained, tmp_path) -> None:
    """Three kills, one in each third of the run with uploads in flight: the later restarts
    replay a journal that earlier restarts wrote to. More kills repeat these cases (`make soak`)."""
    figures = run_kills(mosquitto.url, fresh_state(pretrained, tmp_path), fleet="kill", agents=6,
                        updates=6, kills=3, seed=1, workdir=tmp_path, settings=CHEAP_REPLIES)
    assert figures["failures"] == []
    assert figures["kills"] == 3 and figures["kills_mid_run"] == 3, figures["kill_log"]
    assert figures["completed"] and figures["uploads_answered"] == 36
    assert figures["lost"] == 0 and figures["applied_twice"] == 0 and figures["unexpected"] == 0
    assert figures["applied"] == 36
    assert figures["clusters_equal_replay"] and figures["epoch_live"] == figures["epoch_replay"] == 36
    assert figures["aggregator_exit_code"] == 0


# ---------------------------------------------------------------------------- broker restart


@pytest.mark.slow
def test_broker_restart_mid_run_and_with_queued_uploads(mosquitto, pretrained, tmp_path) -> None:
    state = fresh_state(pretrained, tmp_path)
    extra = {"broker.reconnect_min_s": 0.2, "broker.reconnect_max_s": 1.0, **CHEAP_REPLIES}
    cfg = small_config(mosquitto.url, state, "brk", **extra)
    svc = AggregatorService(cfg, build_engine(cfg)).start()
    agents = [EdgeAgent(cfg, f"b{i}", reply_timeout_s=5.0, retries=20).start() for i in range(4)]
    try:
        threads, uploaded, failures = upload_burst(agents, 6, pause_s=0.05)
        while len(uploaded) < 8 and not failures:
            time.sleep(0.01)
        mosquitto.restart(kill=True)  # mid-run, no persistence flush: the hard case
        for t in threads:
            t.join(120)
        assert not failures, failures
        assert len(uploaded) == 24
        assert svc.engine.counters["applied.update"] == 24
        assert sorted(journal_update_ids(state)) == sorted(uploaded)  # each once, nothing else
        assert svc.transport.connected and all(a.transport.connected for a in agents)

        # Queued: the aggregator is down, each agent publishes one upload and goes offline,
        # the broker restarts (persistence on SIGTERM), then the aggregator comes back alone.
        svc.stop()
        pending = []
        for i, a in enumerate(agents):
            env = a.update_envelope(noisy(a, 1000 + i), 100)
            assert a.channel.send(protocol.uplink(cfg.fleet, a.agent_id), env)[0].wait(60)
            pending.append((a.agent_id, a.installed, env))
            a.stop()
        mosquitto.restart()
        svc = AggregatorService(cfg, build_engine(cfg)).start()
        deadline = time.monotonic() + 30
        while svc.engine.counters["applied.update"] < 28 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.engine.counters["applied.update"] == 28, "queued uploads were not delivered"
        # The agents come back and re-send their pending upload: answered, not applied again.
        for agent_id, held, env in pending:
            back = EdgeAgent(cfg, agent_id, reply_timeout_s=5.0).start()
            try:
                back.restore(held.epoch, held.vector)
                installed, _ = back.upload(env, resend=True)
                assert installed.epoch > held.epoch
            finally:
                back.stop()
        assert svc.engine.counters["applied.update"] == 28
        assert svc.engine.counters["duplicates"] >= 4
        ids = journal_update_ids(state)
        assert len(ids) == len(set(ids)) == 28
    finally:
        svc.stop()
        for a in agents:
            a.transport.close()


# ---------------------------------------------------------------------------- network cuts


@pytest.fixture
def proxied(mosquitto, pretrained, tmp_path):
    """The aggregator on the broker directly; one agent behind a TcpProxy, keepalive 2 s."""
    state = fresh_state(pretrained, tmp_path)
    cfg = small_config(mosquitto.url, state, "net", **CHEAP_REPLIES)
    with TcpProxy(mosquitto.port) as proxy, AggregatorService(cfg, build_engine(cfg)) as svc:
        acfg = small_config(f"mqtt://127.0.0.1:{proxy.port}", state, "net", **{
            "broker.keepalive_s": 2, "broker.reconnect_min_s": 0.2, "broker.reconnect_max_s": 1.0,
            # A whole fp32 vector (55 kB): the cut lands inside the payload.
            "codec.name": "fp32", "codec.zstd": False, "codec.delta": False})
        agent = EdgeAgent(acfg, "car-net", reply_timeout_s=4.0, retries=20).start()
        agent.join()
        try:
            yield proxy, svc, agent, state
        finally:
            agent.transport.close()


def _upload_in_background(agent: EdgeAgent, env: protocol.Update) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(agent.upload(env)[0])
        except Exception as e:  # noqa: BLE001 - asserted by the caller
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.parametrize("fault", ["cut_mid_upload", "cut_mid_reply", "short_stall", "long_stall"])
def test_network_fault_between_agent_and_broker(proxied, fault) -> None:
    proxy, svc, agent, state = proxied
    env = agent.update_envelope(noisy(agent, 7), 100)
    size = len(protocol.encode(env))
    assert size > 50_000
    connects = agent._connects
    if fault == "cut_mid_upload":
        proxy.cut_after(size // 3, "up")
    elif fault == "cut_mid_reply":
        proxy.cut_after(2_000, "down")  # the reply (about 14 kB) is cut after 2 kB
    else:
        proxy.stall_after(size // 3, "up")
    t, out = _upload_in_background(agent, env)
    assert proxy.cut_done.wait(60), "the fault never triggered"
    time.sleep({"short_stall": 0.5, "long_stall": 6.0}.get(fault, 2.0))  # link down / stalled
    assert not out, "a reply got through a broken link"
    proxy.restore()
    t.join(60)
    assert out and not isinstance(out[0], Exception), out
    assert out[0].epoch == 1
    assert svc.engine.counters["applied.update"] == 1
    assert journal_update_ids(state) == [env.msg_id]
    if fault == "short_stall":
        assert agent._connects == connects  # the link only paused
    else:
        assert agent._connects > connects  # it reconnected by itself
        assert proxy.connections >= 2


# ---------------------------------------------------------------------------- disk full


class Lines:
    """A child's stdout, kept as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def wait_for(self, text: str, count: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(text in ln for ln in self.lines) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} x{count} in:\n{''.join(self.lines[-30:])}")
            time.sleep(0.05)

    def count(self, text: str) -> int:
        return sum(text in ln for ln in self.lines)


def _fill_disk(pid: int, state: Path) -> None:
    """The journal may grow by 100 bytes more: the next record's write is torn and fails."""
    limit = (state / "journal-1.log").stat().st_size + 100
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def _free_disk(pid: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


@pytest.mark.slow
def test_disk_full_stops_acks_keeps_the_checkpoint_and_recovers(mosquitto, pretrained, tmp_path) -> None:
    state = fresh_state(pretrained, tmp_path)
    log = tmp_path / "aggregator.log"

    def start() -> tuple[subprocess.Popen, Lines]:
        proc = start_aggregator(mosquitto.url, state, "disk", log, stdout=subprocess.PIPE,
                                settings={"aggregator.snapshot_every": 10**9})
        lines = Lines(proc)
        lines.wait_for("aggregator cdfl on")
        return proc, lines

    proc, lines = start()
    snapshot = state / "snapshot-1.msgpack"
    snapshot_digest = hashlib.sha256(snapshot.read_bytes()).digest()
    a = RawAgent(mosquitto.port, "disk", "car-disk")
    try:
        a.join(SPEC.hash)

        # 1. Disk full while an upload arrives: no reply (not acknowledged), and the log says why.
        _fill_disk(proc.pid, state)
        up1 = a.update_envelope(a.base * 1.01, SPEC.hash)
        a.send(up1)
        lines.wait_for("state.unwritable", timeout=30)
        assert "File too large" in "".join(ln for ln in lines.lines if "state.unwritable" in ln)
        with pytest.raises(TimeoutError):
            a.expect(up1.msg_id, timeout=2)
        assert hashlib.sha256(snapshot.read_bytes()).digest() == snapshot_digest
        # 2. Space comes back: the retry applies it, once.
        _free_disk(proc.pid)
        reply = a.expect(up1.msg_id, timeout=60)
        assert isinstance(reply, protocol.Model) and reply.epoch == 1, reply
        a.install(reply)

        # 3. Full again, then kill -9 while it cannot write: the restart replays a clean journal
        #    and the broker redelivers the never-acknowledged upload.
        _fill_disk(proc.pid, state)
        up2 = a.update_envelope(a.base * 0.99, SPEC.hash)
        failures = lines.count("state.unwritable")
        a.send(up2)
        lines.wait_for("state.unwritable", count=failures + 1, timeout=30)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert hashlib.sha256(snapshot.read_bytes()).digest() == snapshot_digest
        proc, lines = start()
        reply = a.expect(up2.msg_id, timeout=60)  # redelivered by the broker: never acknowledged
        assert isinstance(reply, protocol.Model) and reply.epoch == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        a.close()
    live = read_snapshot(state / "snapshot-2.msgpack")
    assert live["strategy"]["epoch"] == 2 and live["counters"]["applied.update"] == 2
    records = scan_journal(state / "journal-1.log").records
    assert [r["msg_id"] for r in records if r["op"] == "update"] == [up1.msg_id, up2.msg_id]


def test_tcp_proxy_passes_bytes_both_ways(mosquitto) -> None:
    """The proxy itself: a client behind it talks to the broker; down() resets it."""
    with TcpProxy(mosquitto.port) as proxy:
        a = RawAgent(proxy.port, "px", "through-proxy")
        b = RawAgent(mosquitto.port, "px", "direct")
        try:
            got = threading.Event()
            b.client.on_message = lambda *args: got.set()
            b.client.subscribe("fedmq/px/agents/through-proxy/up", qos=1)
            time.sleep(0.3)
            a.publish_raw(b"hello")
            assert got.wait(60)
            assert proxy.bytes["up"] > 0 and proxy.bytes["down"] > 0
            proxy.down()
            assert proxy.resets >= 1
        finally:
            a.client.loop_stop()
            b.close()
