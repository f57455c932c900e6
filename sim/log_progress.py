"""Progress of a long simulator command where stderr is not a terminal: a log gets a line at
most once a minute (done, rate, time left) instead of tqdm's bar, which in a file is one
huge line. A terminal keeps the bar."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm


class LogProgress:
    """tqdm's `update` / `set_postfix_str` / `close`, printed as throttled lines."""

    def __init__(self, total: int, unit: str = "updates", every_s: float = 60.0, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.unit, self.every_s = total, unit, every_s
        self.out = out or sys.stdout
        self.clock = clock
        self.done = 0
        self.postfix = ""
        self.t0 = self._last = clock()
        self._first: float | None = None
        self._lock = threading.Lock()  # agents report from their worker threads

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        with self._lock:
            if self.done == 0:
                self._first = self.clock()
            self.done += n
            self._print_if_due()

    def _print_if_due(self) -> None:
        now = self.clock()
        if not (now - self._last >= self.every_s and self.done < self.total):
            return
        self._last = now
        elapsed = now - self.t0
        # The rate since the first update: what came before it (pre-training) does not repeat.
        if self.done >= 2 and self._first is not None and now > self._first:
            left = f"about {(now - self._first) / (self.done - 1) * (self.total - self.done):.0f} s left"
        else:
            left = "time left known after the first few"
        print(f"progress: {self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f} %), "
              f"{elapsed:.0f} s, {left}" + (f", {self.postfix}" if self.postfix else ""),
              file=self.out, flush=True)

    def keep_talking(self) -> LogProgress:
        """Also print while no update comes (pre-training, a slow reply, writing the report):
        a line at least every `every_s` until `close`."""
        self._stop = threading.Event()

        def talk() -> None:
            while not self._stop.wait(min(1.0, self.every_s / 4)):
                with self._lock:
                    self._print_if_due()

        threading.Thread(target=talk, name="fedmq-progress", daemon=True).start()
        return self

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def progress_bar(total: int, unit: str = "updates") -> tqdm | LogProgress:
    """tqdm's bar on a terminal, else a line a minute."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=unit, unit="upd", dynamic_ncols=True)
    return LogProgress(total, unit)
