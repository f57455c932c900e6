"""Received messages waiting for the aggregator's worker, queued per sender and taken in turn.

A single FIFO let one agent's backlog delay everyone: 200 updates from car-2 sat in front of
car-1's one, whose reply took 98 s. Here each sender has its own queue and the
worker takes at most one message per sender per batch, senders in turn, and a sender served
in the previous batch waits while others are waiting: another agent's next message waits
for at most the batch in progress, then is worked on without the flooder's beside it. A sender that already has
`max_per_sender` messages waiting is told so by `over_quota` (the service refuses its next
update at once, acknowledged, instead of letting it fill the inbox and pause reading for
everyone). Back-pressure counts (messages, bytes) stay global.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from fedmq.transport import Message


class FairInbox:
    """Thread-safe: paho's network thread puts, the worker takes."""

    def __init__(self, max_per_sender: int = 0) -> None:
        self.max_per_sender = max_per_sender
        """Messages a sender may have waiting before `over_quota` (0 = no quota)."""
        self._cond = threading.Condition()
        self._queues: dict[str, deque[Message]] = {}
        self._turns: deque[str] = deque()
        """Senders with messages waiting, in the order they are served next."""
        self._last_served: set[str] = set()
        self.messages = 0
        self.bytes = 0
        self.peak = (0, 0)
        """Most (messages, bytes) ever waiting: what back-pressure bounds."""

    def put(self, sender: str, message: Message) -> tuple[int, int]:
        """Queue `message`; returns the (messages, bytes) now waiting."""
        with self._cond:
            q = self._queues.get(sender)
            if q is None:
                q = self._queues[sender] = deque()
                self._turns.append(sender)
            q.append(message)
            self.messages += 1
            self.bytes += len(message.payload)
            self.peak = (max(self.peak[0], self.messages), max(self.peak[1], self.bytes))
            self._cond.notify()
            return self.messages, self.bytes

    def over_quota(self, sender: str) -> bool:
        """Whether `sender` already has its quota of messages waiting."""
        with self._cond:
            return bool(self.max_per_sender) and len(self._queues.get(sender, ())) >= self.max_per_sender

    def waiting(self, sender: str) -> list[Message]:
        """A copy of `sender`'s waiting messages, oldest first."""
        with self._cond:
            return list(self._queues.get(sender, ()))

    def take(self, limit: int, timeout: float) -> list[Message]:
        """Up to `limit` messages, at most one per sender, senders in turn (waits up to
        `timeout` for the first). A sender served in the previous batch sits this one out
        while anyone else is waiting, so a flooder gets every other batch at most and another
        agent's message is worked on alone, not beside one of the flooder's."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            rested = [s for s in self._turns if s not in self._last_served]
            chosen = (rested or list(self._turns))[:limit]
            taken: list[Message] = []
            for sender in chosen:
                self._turns.remove(sender)
                q = self._queues[sender]
                taken.append(q.popleft())
                if q:
                    self._turns.append(sender)  # its next one waits for everyone else's turn
                else:
                    del self._queues[sender]
            self._last_served = set(chosen)
            self.messages -= len(taken)
            self.bytes -= sum(len(m.payload) for m in taken)
            return taken

    def qsize(self) -> int:
        return self.messages
