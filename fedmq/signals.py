"""Signals (SIGTERM, SIGINT, SIGUSR1) turned into calls on a thread of their own.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread
is, including inside `threading.Event.wait()` while it holds the event's lock. A handler that
calls `event.set()` then blocks on that same lock, in the same thread, for ever: the process
ignores SIGTERM until it is killed (seen once in CI as `fedmq broker` not stopping within 60 s;
reproduced in a loop in a few seconds). Here the handler only writes the signal's number to a
pipe, which takes no lock; a daemon thread reads it and makes the call, so `stop.set()`,
`device.request_stop()` and the like run where they may wait for a lock the main thread holds.

    relay = SignalRelay({signal.SIGTERM: stop.set, signal.SIGINT: stop.set})
    ...
    relay.restore()   # the previous handlers (optional; a CLI just exits)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fedmq.logs import get_logger

log = get_logger("signals")


class SignalRelay:
    """Install handlers for the signals in `actions`; each signal calls its action on the relay
    thread, in the order they arrived. Replaces whatever handler (or SIG_IGN, as for background
    jobs of a non-interactive shell) was there; `restore()` puts those back."""

    def __init__(self, actions: Mapping[int, Callable[[], None]]) -> None:
        self._actions = dict(actions)
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe drops a signal rather than blocking a handler
        self._previous: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._relay, name="fedmq-signals", daemon=True)
        self._thread.start()
        for sig in self._actions:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError when full: the stop is already queued
            os.write(self._write, bytes([signum]))

    def _relay(self) -> None:
        while True:
            try:
                got = os.read(self._read, 64)
            except OSError:
                got = b""
            if not got:  # restore() closed the write end
                os.close(self._read)
                return
            for signum in got:
                action = self._actions.get(signum)
                if action is None:
                    continue
                try:
                    action()
                except Exception:  # a failing action must not end the relay
                    log.exception("action for signal %s raised", signum)

    def restore(self) -> None:
        """Put the previous handlers back; the relay thread ends."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        with contextlib.suppress(OSError):
            os.close(self._write)
