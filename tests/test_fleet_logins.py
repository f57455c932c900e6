"""Two fleets on one prod.conf Mosquitto, from ONE `fedmq creds` run: each fleet's aggregator
logs in as its own user (so holds its own MQTT session), both serve at once, and two monitors
with logins of their own watch the fleets at the same time. Restarts of an aggregator on its
own state dir come up without waiting for the broker to fire its will: after SIGTERM (its
status says offline) and after kill -9 of one whose link had gone silent first (a dead host:
the broker still holds its connection and its status still says online, but it was our own
predecessor on this state dir)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fedmq import protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto
from fedmq.creds import load_credentials
from fedmq.models import model_spec
from soak.fleet_setup import SMALL, pretrained_state
from tests.cli_process import ROOT, CliProcess, cli_env
from tests.raw_agent import RawAgent
from tests.tcp_proxy import TcpProxy

FLEETS = ("garage", "depot")
AGENTS = {"garage": "car-1", "depot": "van-1"}
MONITORS = ("ops", "dashboard")
SPEC = model_spec("digits-cnn")
WAIT_S = 300.0
"""Generous: the machine may be shared."""


def round_trip(agent: RawAgent) -> protocol.Envelope:
    """One whole-vector update (valid whatever reply came last) and its reply."""
    up = agent.update_envelope(agent.base * 1.001, SPEC.hash, codec="fp32", delta=False)
    agent.send(up)
    return agent.expect(up.msg_id, timeout=WAIT_S)


class Monitor:
    """`fedmq fleet status --watch --json` as one monitor login, its documents kept."""

    def __init__(self, url: str, ca: Path, fleet: str) -> None:
        self.docs: list[dict] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            ["fedmq", "fleet", "status", "--broker", url, "--ca-file", str(ca), "--fleet", fleet,
             "--json", "--watch", "0.3"], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.docs.append(doc)
                self._cond.notify_all()

    def wait_for(self, predicate, timeout: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: any(predicate(d) for d in self.docs), timeout)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def aggregator_online(epoch_at_least: int = 0):
    def ok(doc: dict) -> bool:
        agg = doc.get("aggregator") or {}
        return agg.get("state") == "online" and int(agg.get("epoch") or 0) >= epoch_at_least
    return ok


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_two_fleets_aggregators_and_two_monitors_serve_at_once_on_prod_conf(tmp_path) -> None:
    out = tmp_path / "creds"
    made = subprocess.run(
        ["fedmq", "creds", "--out", str(out), "--agents", ",".join(AGENTS.values()),
         *[a for f in FLEETS for a in ("--fleet", f)], "--monitor-user", ",".join(MONITORS)],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    creds = load_credentials(out)
    logins = {f: creds.aggregator_for(f) for f in FLEETS}
    assert len({user for user, _ in logins.values()}) == 2, logins  # one login per fleet
    users = creds.users()
    assert set(MONITORS) <= set(users)
    pristine = pretrained_state(tmp_path / "pristine")

    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        proxy = TcpProxy(broker.port).start()

        def url(user: str, port: int = broker.port) -> str:
            return f"mqtts://{user}:{users[user]}@127.0.0.1:{port}"

        procs: list[CliProcess] = []

        def aggregator(fleet: str, state: Path, port: int = broker.port) -> CliProcess:
            argv = ["fedmq", "aggregator", "--broker", url(logins[fleet][0], port), "--ca-file", str(creds.ca_cert),
                    "--fleet", fleet, "--state-dir", str(state), "--log-level", "info"]
            for key, value in SMALL.items():
                argv += ["--set", f"{key}={value}"]
            proc = CliProcess(argv, cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1"))
            procs.append(proc)
            return proc

        states = {}
        for f in FLEETS:
            states[f] = tmp_path / f"state-{f}"
            shutil.copytree(pristine, states[f])
        monitors: list[Monitor] = []
        agents: dict[str, RawAgent] = {}
        try:
            # garage's aggregator reaches the broker through a link the test can silence.
            running = {"garage": aggregator("garage", states["garage"], proxy.port),
                       "depot": aggregator("depot", states["depot"])}
            for proc in running.values():
                proc.wait_for(r"aggregator\.started", WAIT_S)
            # Two monitors at once, each its own login, one per fleet.
            monitors = [Monitor(url(m), creds.ca_cert, f) for m, f in zip(MONITORS, FLEETS, strict=True)]
            for f, name in AGENTS.items():
                agents[f] = RawAgent(broker.port, f, name, ca_file=str(creds.ca_cert), password=users[name])
                agents[f].join(SPEC.hash, timeout=WAIT_S)
            for _ in range(3):
                for f in FLEETS:
                    assert isinstance(round_trip(agents[f]), protocol.Model), f
            for m in monitors:
                assert m.wait_for(aggregator_online(3)), "".join(m.lines)[-3000:]
            # Both served all along: neither lost its connection to the other.
            for proc in running.values():
                said = proc.output
                assert "transport.disconnected" not in said and "another aggregator" not in said, said[-3000:]
                assert proc.proc.poll() is None, said[-3000:]
            for m in monitors:
                assert m.proc.poll() is None, "".join(m.lines)[-3000:]

            # SIGTERM, then a restart on the same state dir: the status says offline, so it
            # serves at once.
            assert running["depot"].stop() == 0
            t0 = time.monotonic()
            running["depot"] = aggregator("depot", states["depot"])
            running["depot"].wait_for(r"aggregator\.clear .*status=offline", WAIT_S)
            running["depot"].wait_for(r"aggregator\.started", WAIT_S)
            after_sigterm_s = time.monotonic() - t0

            # Its link silenced, then kill -9: the broker holds the dead connection until
            # 1.5 keepalives pass (45 s by default), so the retained status still says online;
            # the restart knows that status was its predecessor's and serves at once.
            proxy.stall()
            running["garage"].kill()
            t0 = time.monotonic()
            running["garage"] = aggregator("garage", states["garage"])
            clear = running["garage"].wait_for(r"aggregator\.(clear|waiting)\b.*", WAIT_S)
            assert clear.group(1) == "clear" and "predecessor" in clear.group(0), clear.group(0)
            running["garage"].wait_for(r"aggregator\.started", WAIT_S)
            after_kill_s = time.monotonic() - t0
            print(f"restart on its own state dir: after SIGTERM {after_sigterm_s:.1f} s, "
                  f"after kill -9 {after_kill_s:.1f} s (start-up included)")

            for f in FLEETS:
                assert isinstance(round_trip(agents[f]), protocol.Model), f
            for m in monitors:
                assert m.wait_for(aggregator_online(4)), "".join(m.lines)[-3000:]
                assert m.proc.poll() is None
            # The broker saw each fleet's aggregator connect under its own user.
            log = broker.log_tail(10_000_000)
            for user, _ in logins.values():
                assert re.search(rf" as {re.escape(user)} \(", log), user
        finally:
            for a in agents.values():
                a.close()
            for m in monitors:
                m.close()
            for proc in procs:
                proc.stop()
            proxy.close()
