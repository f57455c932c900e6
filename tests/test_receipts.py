"""The reply-time estimates receipts carry (aggregator/receipts.py), on a hand-driven clock."""

from __future__ import annotations

import pytest

from aggregator.receipts import MAX_AGE_S, MIN_EXPECT_S, UNMEASURED_S, ReplyClock


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_estimates_follow_measured_costs_and_the_queue_ahead() -> None:
    clock = Clock()
    rc = ReplyClock(clock)
    # Nothing timed yet: the unmeasured default.
    assert rc.taken("a", "m1", "update") == (UNMEASURED_S, 0)
    rc.batch_started([("a", "m1")])
    clock.t += 30.0
    rc.batch_done([("a", "m1")], 30.0, {"update": 1})
    assert rc.cost("update") == 30.0 and rc.outstanding == 0
    # A batch of two updates that took 40 s: 20 s each; the median of 30 and 20 is 25.
    rc.taken("a", "m2", "update")
    rc.taken("b", "m3", "update")
    rc.batch_started([("a", "m2"), ("b", "m3")])
    clock.t += 40.0
    rc.batch_done([("a", "m2"), ("b", "m3")], 40.0, {"update": 2})
    assert rc.cost("update") == 25.0
    # While a batch of one update is 10 s into its work, a join and two updates queue behind it.
    rc.taken("a", "m4", "update")
    rc.batch_started([("a", "m4")])
    clock.t += 10.0
    assert rc.taken("c", "j1", "join") == (15.0 + UNMEASURED_S, 1)
    assert rc.taken("d", "m5", "update") == (15.0 + UNMEASURED_S + 25.0, 2)
    assert rc.taken("e", "m6", "update") == (15.0 + UNMEASURED_S + 50.0, 3)
    # A copy of a waiting message keeps its place.
    assert rc.taken("d", "m5", "update") == (15.0 + UNMEASURED_S + 25.0, 2)
    # Replies answered from the journal cost nothing and teach nothing.
    rc.batch_done([("a", "m4")], 0.01, {})
    assert rc.cost("update") == 25.0


def test_overdue_messages_get_fresh_promises_until_answered() -> None:
    clock = Clock()
    rc = ReplyClock(clock)
    rc.taken("a", "m1", "update")
    rc.batch_started([("a", "m1")])
    assert rc.overdue() == []
    clock.t += UNMEASURED_S
    # The batch ran past its estimate: promised again, half as long again as it has taken.
    assert rc.overdue() == [("a", "m1", UNMEASURED_S / 2, 0)]
    assert rc.overdue() == []
    clock.t += UNMEASURED_S / 2
    assert rc.overdue() == [("a", "m1", UNMEASURED_S * 3 / 4, 0)]
    rc.answered("a", "m1")
    clock.t += 100.0
    assert rc.overdue() == [] and rc.outstanding == 0


def test_a_short_overrun_is_promised_min_expect_s() -> None:
    clock = Clock()
    rc = ReplyClock(clock)
    rc.batch_done([], 1.0, {"update": 1})
    rc.taken("a", "m1", "update")
    rc.batch_started([("a", "m1")])
    clock.t += MIN_EXPECT_S
    assert rc.overdue() == [("a", "m1", MIN_EXPECT_S, 0)]


def test_a_message_never_answered_is_forgotten() -> None:
    clock = Clock()
    rc = ReplyClock(clock)
    rc.taken("a", "lost", "update")
    clock.t += MAX_AGE_S + 1
    assert rc.overdue() == [] and rc.outstanding == 0


@pytest.mark.parametrize("work", [{"join": 2}, {"update": 1, "join": 1}])
def test_joins_and_updates_are_timed_apart(work) -> None:
    rc = ReplyClock(Clock())
    rc.batch_done([], 4.0, work)
    if "update" in work:
        assert rc.cost("update") == 4.0 and rc.cost("join") == UNMEASURED_S
    else:
        assert rc.cost("join") == 2.0 and rc.cost("update") == UNMEASURED_S
