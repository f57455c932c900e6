"""When an agent should expect its reply: the estimate a `receipt` envelope carries.

A CDFL reply that fine-tunes a real-sized model costs tens of seconds, and an upload may
wait behind others; an agent that only knows a fixed reply timeout re-sends a large upload
it is already being answered for. So the aggregator says, when it takes a message, how long
its reply should take: the median of its own recent per-message costs (per kind: a join
costs little, an update a fine-tune), summed over the messages queued ahead of it, plus what
remains of the batch it is working on (half its time so far, once it is later than its
estimate). When that time has passed without a reply, it says so again with a fresh
estimate (`overdue`), so a living aggregator keeps its agents waiting
and only a dead one makes them re-send.

Thread-safe: the network thread takes messages, the worker starts and ends batches, a timer
asks for the overdue ones.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

UNMEASURED_S = 10.0
"""Per-message cost assumed before any batch of that kind was timed. Receipts are renewed
when it proves too short, so it only sets how often the first reply's agents hear from us."""

MIN_EXPECT_S = 2.0
"""Shortest estimate a receipt carries, and so the shortest interval between two receipts of
one message: a late batch is re-announced at this pace at most."""

WINDOW = 32
"""Per-message costs kept per kind for the median (recent behaviour, not the start's)."""

MAX_PENDING = 4096
"""Messages tracked at most; the oldest are forgotten first (their agents re-send, as before)."""

MAX_AGE_S = 3600.0
"""A message unanswered this long is forgotten: no more receipts; its agent re-sends (taken
again) if it still waits. Bounds what a message lost to a bug could cost an agent."""


@dataclass
class _Pending:
    agent: str
    kind: str
    taken_at: float
    promised_at: float = 0.0
    in_batch: bool = False


class ReplyClock:
    """Outstanding messages in the order they were taken, and what a reply costs."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._costs: dict[str, deque[float]] = {}
        self._batch_started = 0.0
        self._batch_cost = 0.0

    def cost(self, kind: str) -> float:
        """Median seconds one message of `kind` took in recent batches."""
        with self._lock:
            return self._cost(kind)

    def _cost(self, kind: str) -> float:
        costs = self._costs.get(kind)
        return statistics.median(costs) if costs else UNMEASURED_S

    def taken(self, agent: str, msg_id: str, kind: str) -> tuple[float, int]:
        """A message arrived: (seconds its reply should take, messages ahead of it). A copy of
        a message already waiting keeps its place and gets a fresh estimate."""
        with self._lock:
            now = self.clock()
            key = (agent, msg_id)
            if key not in self._pending:
                while len(self._pending) >= MAX_PENDING:
                    del self._pending[next(iter(self._pending))]
                self._pending[key] = _Pending(agent, kind, now)
            return self._promise(key, now)

    def _promise(self, key: tuple[str, str], now: float) -> tuple[float, int]:
        """Estimate for `key` (caller holds the lock), remembered as its promise."""
        for other_key, estimate in self._promises(now, stop_at=key):
            if other_key == key:
                return estimate
        raise KeyError(key)

    def _promises(self, now: float, stop_at: tuple[str, str] | None = None
                  ) -> list[tuple[tuple[str, str], tuple[float, int]]]:
        """New promises, in one pass in take order, for `stop_at` or else for every message
        whose promise ran out: each waits for what remains of the running batch, then for the
        messages taken before it, then for its own cost."""
        in_batch = sum(1 for p in self._pending.values() if p.in_batch)
        elapsed = now - self._batch_started
        remaining = self._batch_cost - elapsed
        if in_batch and remaining <= 0:
            # Later than estimated: expect half as long again as it has taken, so that the
            # receipts of a long batch space out instead of coming every MIN_EXPECT_S.
            remaining = elapsed / 2
        remaining = max(remaining, 0.0)
        queued_cost, queued = 0.0, 0
        out = []
        for key, pending in self._pending.items():
            if pending.in_batch:
                expect, ahead = remaining, 0
            else:
                expect, ahead = remaining + queued_cost + self._cost(pending.kind), in_batch + queued
                queued_cost += self._cost(pending.kind)
                queued += 1
            if (key == stop_at) if stop_at is not None else pending.promised_at <= now:
                expect = max(expect, MIN_EXPECT_S)
                pending.promised_at = now + expect
                out.append((key, (expect, ahead)))
            if key == stop_at:
                break
        return out

    def batch_started(self, keys: Iterable[tuple[str, str]]) -> None:
        """The worker took these messages into one batch."""
        with self._lock:
            now = self.clock()
            cost = 0.0
            for key in keys:
                pending = self._pending.get(key)
                if pending is not None:
                    pending.in_batch = True
                    cost += self._cost(pending.kind)
            self._batch_started, self._batch_cost = now, cost

    def batch_done(self, keys: Iterable[tuple[str, str]], seconds: float, work: dict[str, int]) -> None:
        """The batch's replies went out after `seconds`; `work` counts the messages of each
        kind that cost work (applied, not answered from the journal): their per-message cost
        is the batch's seconds over their number (an update's fine-tune dwarfs a join)."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)
            self._batch_cost = 0.0
            kind = "update" if work.get("update") else "join" if work.get("join") else ""
            if kind:
                self._costs.setdefault(kind, deque(maxlen=WINDOW)).append(seconds / work[kind])

    def answered(self, agent: str, msg_id: str) -> None:
        """Answered outside a batch (refused): no longer outstanding."""
        with self._lock:
            self._pending.pop((agent, msg_id), None)

    def overdue(self) -> list[tuple[str, str, float, int]]:
        """(agent, msg_id, expect_s, ahead) of every message whose promise ran out, each with a
        fresh promise."""
        with self._lock:
            now = self.clock()
            for key in [k for k, p in self._pending.items() if now - p.taken_at > MAX_AGE_S]:
                del self._pending[key]
            late = self._promises(now)
            return [(key[0], key[1], expect, ahead) for key, (expect, ahead) in late]

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending)
