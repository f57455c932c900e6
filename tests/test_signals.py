"""Signals become calls on a thread of their own (fedmq/signals.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedmq.signals import SignalRelay

ROOT = Path(__file__).resolve().parent.parent

# The main thread waits on an Event in a tight loop while signals pour in, each setting it.
# With `signal.signal(SIGUSR1, lambda *_: ev.set())` this deadlocks within seconds (the
# handler blocks on the lock the interrupted wait holds); through the relay it must not.
FLOOD = """
import signal, sys, threading, time
from fedmq.signals import SignalRelay
ev = threading.Event()
relay = SignalRelay({signal.SIGUSR1: ev.set})  # noqa: F841 (kept installed)
print("ready", flush=True)
waits, end = 0, time.monotonic() + 3.0
while time.monotonic() < end:
    ev.wait(0.0001)
    ev.clear()
    waits += 1
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the flood may still be arriving
print("done", waits, flush=True)
"""


def test_a_flood_of_signals_never_deadlocks_a_thread_waiting_on_the_event() -> None:
    proc = subprocess.Popen([sys.executable, "-c", FLOOD], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    sent = 0
    while proc.poll() is None and sent < 20000:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.001)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.startswith("done"), (proc.returncode, out, sent)
    assert sent > 100  # the flood happened while it waited


def test_each_signal_calls_its_action_off_the_main_thread_and_restore_puts_the_old_handler_back() -> None:
    called: list[tuple[int, str]] = []
    done = threading.Event()
    previous = signal.getsignal(signal.SIGUSR2)
    relay = SignalRelay({signal.SIGUSR2: lambda: (called.append((signal.SIGUSR2, threading.current_thread().name)),
                                                  done.set())})
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert done.wait(60)
        assert called == [(signal.SIGUSR2, "fedmq-signals")]
    finally:
        relay.restore()
    assert signal.getsignal(signal.SIGUSR2) == previous


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        out += [int(c) for c in text.split()]
    return out


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_sigterm_stops_a_soak_and_the_broker_it_started() -> None:
    """With SIGTERM's default action the soak died and its Mosquitto kept running; run_main
    makes SIGTERM unwind like Ctrl-C (fedmq/errors.py `unwind_on_sigterm`)."""
    # --messages: far more than it sends before the signal, so it is still running then.
    proc = subprocess.Popen([sys.executable, "-m", "soak.fuzz_uplink", "--messages", "100000000",
                             "--out", os.devnull], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        broker = None
        deadline = time.monotonic() + 120
        while broker is None and time.monotonic() < deadline and proc.poll() is None:
            broker = next((c for c in _children(proc.pid) if "mosquitto" in _command(c)), None)
            time.sleep(0.05)
        assert broker is not None, "the soak never started its broker"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    leaked = Path(f"/proc/{broker}").exists() and "mosquitto" in _command(broker)
    if leaked:  # the soak exited without stopping it (it waits for it when it does)
        os.kill(broker, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    assert not leaked, "the soak's broker outlived it"
