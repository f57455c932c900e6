"""The aggregator's inbox: per-sender queues taken in turn, a per-sender quota, global counts."""

from __future__ import annotations

import threading

from aggregator.inbox import FairInbox
from fedmq.transport import Message


def msg(agent: str, i: int, size: int = 10) -> Message:
    return Message(topic=f"fedmq/f/agents/{agent}/up", payload=bytes([i % 256]) * size, qos=1,
                   retain=False, mid=i)


def test_a_flooders_backlog_delays_another_sender_by_one_message_at_most() -> None:
    inbox = FairInbox(max_per_sender=0)
    for i in range(200):
        inbox.put("car-2", msg("car-2", i))
    inbox.put("car-1", msg("car-1", 999))
    first = inbox.take(limit=128, timeout=1)
    assert [m.topic.split("/")[3] for m in first] == ["car-2", "car-1"]  # one each, in turn
    assert inbox.qsize() == 199 and inbox.bytes == 199 * 10 and inbox.peak == (201, 2010)
    # The flooder's messages keep their order, one per take.
    assert [inbox.take(128, 1)[0].mid for _ in range(3)] == [1, 2, 3]
    # Served in the previous batch: car-2 sits out while car-3 waits; car-3 is worked on alone.
    inbox.put("car-3", msg("car-3", 500))
    assert [m.mid for m in inbox.take(128, 1)] == [500]
    assert [m.mid for m in inbox.take(128, 1)] == [4]


def test_quota_counts_waiting_messages_per_sender() -> None:
    inbox = FairInbox(max_per_sender=2)
    inbox.put("a", msg("a", 1))
    assert not inbox.over_quota("a")
    inbox.put("a", msg("a", 2))
    assert inbox.over_quota("a") and not inbox.over_quota("b")
    inbox.take(10, 1)
    assert not inbox.over_quota("a")
    assert not FairInbox(0).over_quota("a")


def test_take_waits_for_a_put_and_times_out_empty() -> None:
    inbox = FairInbox()
    assert inbox.take(4, timeout=0.01) == []
    got: list = []
    t = threading.Thread(target=lambda: got.extend(inbox.take(4, timeout=60)))
    t.start()
    inbox.put("a", msg("a", 7))
    t.join(60)
    assert [m.mid for m in got] == [7]
