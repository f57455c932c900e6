"""Shared fixtures: a real Mosquitto on a free loopback port, quiet torch."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedmq.broker import MosquittoBroker

torch.set_num_threads(1)
# The fedmq processes tests spawn too: three xdist workers on two cores, each starting an aggregator
# and agents with a thread per core, oversubscribe the machine (a test of 8 s idle took 162 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

RUN_ENV = ("TMPDIR", "FEDMQ_CACHE_DIR")


def pytest_configure(config) -> None:
    """One folder for the run, removed at its end: the $TMPDIR of the xdist workers and of every
    process a test starts (so nothing a browser, a killed broker or a command under test leaves
    there outlives the run), holding one ONNX graph, pre-training and data cache for all of them
    (not the user's ~/.cache). This process keeps its own TMPDIR: pytest's basetemp, where a
    failed test's tmp_path stays, is made there."""
    if hasattr(config, "workerinput"):
        return
    config.epmd_before = _epmd_pids()
    run = Path(tempfile.mkdtemp(prefix="fedmq-test-run-", dir=tempfile.gettempdir()))
    run.chmod(0o755)  # users mosquitto and rabbitmq read what tests make under it
    config.fedmq_run_dir = run
    config.fedmq_saved_env = {name: os.environ.get(name) for name in RUN_ENV}
    os.environ["TMPDIR"] = str(run)
    os.environ.setdefault("FEDMQ_CACHE_DIR", str(run / "cache"))


def _epmd_pids() -> set[int]:
    """Erlang's port mapper: the first RabbitMQ node of a run starts it as a daemon of its own."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "epmd":
                pids.add(int(proc.name))
        except OSError:
            continue
    return pids


EXIT_WATCHDOG_S = 300
"""Seconds a test process may take from the end of its tests to its exit (fixture teardown
included: a Mosquitto or a warm interpreter each stop within 90 s at the most). The xdist
controller waits a minute longer, so that a stuck worker's stacks are the ones printed."""


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    # A process (an xdist worker or the controller) still alive this long after its tests
    # ended is stuck in teardown or interpreter exit (a thread that never ends): every thread's
    # stack goes to stderr and it exits 1, instead of holding the run until CI's limit.
    worker = hasattr(session.config, "workerinput")
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S + (0 if worker else 60), exit=True)
    yield
    # After fixture teardown: interpreter exit waits for each non-daemon thread still running.
    left = [t.name for t in threading.enumerate()
            if t.is_alive() and not t.daemon and t is not threading.main_thread()]
    if left:
        sys.stderr.write(f"[pid {os.getpid()}] threads still running after the tests: {', '.join(left)}\n")


def pytest_unconfigure(config) -> None:
    run = getattr(config, "fedmq_run_dir", None)
    if run is not None:
        shutil.rmtree(run, ignore_errors=True)
        for name, value in config.fedmq_saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    before = getattr(config, "epmd_before", None)
    epmd = shutil.which("epmd")
    if before is not None and epmd and _epmd_pids() - before:
        # Started by this run's RabbitMQ nodes (all stopped by now): nothing the run started stays.
        subprocess.run([epmd, "-kill"], capture_output=True, timeout=30, check=False)


LONG_S = 30.0
"""A test that takes longer on an idle 2-core machine says why: @pytest.mark.long("why")."""


PROCESS_FIXTURES = frozenset({"mosquitto", "shared_mosquitto", "warm_python", "scratch", "netns", "dry_run_checkout"})
"""Fixtures that start a broker or another process (or need one): a test using one, directly
or through another fixture, takes seconds rather than milliseconds."""


def _tier(item) -> int:
    if item.get_closest_marker("long"):
        return 2
    if item.get_closest_marker("slow"):
        return 3
    return 1 if PROCESS_FIXTURES.intersection(item.fixturenames) else 0


def pytest_collection_modifyitems(config, items) -> None:
    """By cost: tests in-process first, then those with a broker or a process of their own, so
    that a change that breaks one fails in the first minutes; then the long ones, then the other
    slow ones, so that xdist's workers end on tests of seconds, not with one worker idle while
    another runs a minute-long fleet. Stable within each tier."""
    for item in items:
        mark = item.get_closest_marker("long")
        why = (mark.args[0] if mark.args else mark.kwargs.get("why")) if mark else ""
        if mark and (not isinstance(why, str) or not why.strip() or "\n" in why):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.long takes the one-line reason why it needs "
                                    f"over {LONG_S:.0f} s")
    items.sort(key=_tier)


@pytest.fixture
def mosquitto(tmp_path) -> Iterator[MosquittoBroker]:
    """A fresh Mosquitto with broker_config/dev.conf on a free port, for one test."""
    with MosquittoBroker.dev(workdir=tmp_path / "broker") as broker:
        yield broker


@pytest.fixture(scope="session")
def shared_mosquitto(tmp_path_factory) -> Iterator[MosquittoBroker]:
    """One Mosquitto for tests that only need a broker and use their own topics."""
    with MosquittoBroker.dev(workdir=tmp_path_factory.mktemp("shared-broker")) as broker:
        yield broker


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory) -> Iterator[Path]:
    """The socket of a warm interpreter that forks short command lines (tests/warm_python.py)."""
    from tests.cli_process import ROOT, CliProcess, cli_env

    sock = tmp_path_factory.mktemp("warm") / "sock"
    proc = CliProcess([sys.executable, "-m", "tests.warm_python", str(sock)], cwd=ROOT, env=cli_env())
    try:
        proc.wait_for("^ready", timeout=300)
        yield sock
    finally:
        proc.stop(signal.SIGKILL)


def pytest_terminal_summary(terminalreporter) -> None:
    """How many documented commands the suite ran, and how (the docs are executed); the tests
    that took over LONG_S without saying why (on a busy machine, a hint, not a verdict)."""
    reports = [r for reports in terminalreporter.stats.values() for r in reports if getattr(r, "when", "")]
    ran = [r for r in reports if "test_documented_commands" in r.nodeid and r.when == "call"]
    if ran:
        from tests.test_documented_commands import summary

        terminalreporter.write_line(f"{summary()}; {len(ran)} documented-command tests ran")
    took: dict[str, float] = {}
    for r in reports:
        if "long" not in r.keywords:
            took[r.nodeid] = took.get(r.nodeid, 0.0) + r.duration
    over = sorted((s, nodeid) for nodeid, s in took.items() if s > LONG_S)
    for s, nodeid in reversed(over):
        terminalreporter.write_line(f"{s:.1f}s with no @pytest.mark.long reason: {nodeid}")


@pytest.fixture(scope="session")
def world_of_two_rotations():
    """Two rotation clusters (0 / 180 deg), specialists pre-trained from one init, proxies."""
    from fedmq.data import RotatedClusters, load_dataset
    from fedmq.models import build_model, to_vector
    from fedmq.training import fit

    clusters = RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), 2, seed=0,
                               proxy_per_cluster=150, pretrain_per_cluster=300)
    start = to_vector(build_model("digits-cnn", seed=0))
    specialists = []
    for k in range(2):
        d = clusters.pretrain(k, 300)
        specialists.append(fit("digits-cnn", start, d.x, d.y, epochs=10, lr=0.05, momentum=0.9, seed=k).vector)
    proxies = [(p.x, p.y) for p in (clusters.proxy(k, 150) for k in range(2))]
    return clusters, torch.stack(specialists), proxies
