"""Deadline-aware training on the agent: soft stop, watchdog, eps_i, shards and cycling."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from edge_agent.deadline import (
    DeadlineLearner,
    EpochOutcome,
    RealEpochRunner,
    Shards,
    TrainSettings,
    UploadTimer,
    Watchdog,
    train_to_deadline,
)
from fedmq.config import CataFedSettings
from fedmq.data import load_dataset
from fedmq.models import build_model, to_vector


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_runner(clock: FakeClock, epoch_s: float):
    """Epochs of `epoch_s` simulated seconds; an epoch longer than the time left is cut there."""
    def run(start: torch.Tensor, epoch: int, left: float) -> EpochOutcome:
        if epoch_s > left:
            clock.t += left
            return EpochOutcome(start + 0.5, left, False, 10)
        clock.t += epoch_s
        return EpochOutcome(start + 1.0, epoch_s, True, 100)
    return run


def test_soft_stop_before_an_epoch_that_would_not_fit() -> None:
    clock = FakeClock()
    dog = Watchdog(10.0, clock)
    r = train_to_deadline(torch.zeros(2), fake_runner(clock, 3.0), epochs=5, time_left=dog.left)
    # epochs end at 3, 6, 9 s; at 9 s, 1 s is left < mean epoch 3 s: stop, the work counts
    assert (r.finished, r.epochs_done, r.soft_stopped, r.aborted) == (True, 3, True, False)
    assert torch.equal(r.vector, torch.full((2,), 3.0))
    assert clock.t == 9.0 and r.wasted_s == 0.0
    # Without the deadline pressure all epochs run.
    clock2 = FakeClock()
    r2 = train_to_deadline(torch.zeros(2), fake_runner(clock2, 1.0), epochs=5,
                           time_left=Watchdog(10.0, clock2).left)
    assert (r2.finished, r2.epochs_done, r2.soft_stopped) == (True, 5, False)


def test_watchdog_aborts_catafed_keeps_fedprox_partial_fedavg_ignores() -> None:
    clock = FakeClock()
    dog = Watchdog(6.0, clock)
    r = train_to_deadline(torch.zeros(2), fake_runner(clock, 7.0), epochs=2, time_left=dog.left)
    assert (r.finished, r.vector, r.aborted) == (False, None, True)  # I_i = 0
    assert r.wasted_s == 6.0 and clock.t == 6.0 and dog.expired()
    clock = FakeClock()
    dog = Watchdog(6.0, clock)
    p = train_to_deadline(torch.zeros(2), fake_runner(clock, 7.0), epochs=2, time_left=dog.left,
                          mode="fedprox")
    assert p.finished and p.aborted and torch.equal(p.vector, torch.full((2,), 0.5))
    clock = FakeClock()
    dog = Watchdog(6.0, clock)
    a = train_to_deadline(torch.zeros(2), fake_runner(clock, 7.0), epochs=2, time_left=dog.left,
                          mode="fedavg")
    assert a.finished and a.epochs_done == 2 and clock.t == 14.0  # late: the server drops it
    with pytest.raises(ValueError):
        train_to_deadline(torch.zeros(2), fake_runner(clock, 1), epochs=1, time_left=dog.left,
                          mode="fedsgd")


def test_watchdog_counts_from_the_receipt_of_the_invite() -> None:
    clock = FakeClock()
    clock.t = 100.0
    dog = Watchdog(5.0, clock, started_at=98.0)  # the invite arrived 2 s ago
    assert dog.left() == 3.0 and dog.elapsed() == 2.0


def test_upload_timer_eps_from_measured_uploads() -> None:
    t = UploadTimer(initial_s=0.2, factor=2.0, floor_s=0.05, window=3)
    assert t.eps == 0.2
    t.record(0.01)
    assert t.eps == 0.05  # the floor
    for s in (0.1, 0.2, 0.3):
        t.record(s)
    assert t.eps == pytest.approx(2.0 * 0.2)  # mean of the last three
    t.record(float("nan"))
    assert t.eps == pytest.approx(0.4)


def test_shards_halve_not_below_pi_and_cycle() -> None:
    s = Shards(100, min_shard=20, seed=3)
    assert (s.count, s.size) == (1, 100)
    assert s.halve() and (s.count, s.size) == (2, 50)
    assert s.halve() and (s.count, s.size) == (4, 25)
    assert not s.halve() and (s.count, s.size) == (4, 25)  # 12 < pi = 20
    assert [s.index(n) for n in range(6)] == [0, 1, 2, 3, 0, 1]
    parts = [s.indices(j) for j in range(4)]
    assert [len(p) for p in parts] == [25, 25, 25, 25]
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))  # disjoint, complete
    odd = Shards(101, 10)
    odd.halve()
    assert [len(odd.indices(j)) for j in range(2)] == [51, 50] and odd.size == 50
    with pytest.raises(IndexError):
        s.indices(4)


def test_learner_halves_after_abort_and_cycles_shards() -> None:
    x = torch.arange(64, dtype=torch.float32).view(64, 1, 1, 1)
    y = torch.zeros(64, dtype=torch.int64)
    learner = DeadlineLearner(x, y, CataFedSettings(min_shard=16, epochs=1), seed=0)
    seen: list[set[int]] = []

    def make_runner(xs, ys, anchor):
        def run(start, epoch, left):
            seen.append({int(v) for v in xs.view(-1)})
            ok = xs.shape[0] <= 32  # this "device" can do 32 samples in time
            return EpochOutcome(start, 1.0, ok, int(xs.shape[0]))
        return run

    w = learner.run_round(torch.zeros(1), make_runner, lambda: 10.0)
    assert (w.finished, w.n_samples, w.shard_used, w.shard_size) == (False, 0, 64, 32)
    w = learner.run_round(torch.zeros(1), make_runner, lambda: 10.0)  # round n_i = 1: shard 1
    assert (w.finished, w.n_samples, w.shard_index, w.shard_size) == (True, 32, 1, 32)
    w = learner.run_round(torch.zeros(1), make_runner, lambda: 10.0)  # n_i = 2: shard 0
    assert w.shard_index == 0
    assert len(seen[1]) == len(seen[2]) == 32 and not seen[1] & seen[2]
    fedavg = DeadlineLearner(x, y, CataFedSettings(epochs=1), algorithm="fedavg")
    assert fedavg.shard_size == 64
    assert fedavg.budget_s(10.0) == pytest.approx(10.0 - 0.2)


def real_data(n: int = 200):
    ds = load_dataset("digits")
    return ds.x[:n], ds.y[:n]


def test_real_runner_trains_and_its_watchdog_cuts_an_epoch() -> None:
    x, y = real_data()
    start = to_vector(build_model("digits-cnn", seed=0))
    runner = RealEpochRunner(TrainSettings("digits-cnn", lr=0.05), x, y)
    out = runner(start, 0, float("inf"))
    assert out.completed and out.samples == 200 and not torch.equal(out.vector, start)
    # No time left once fit starts: fit's max_seconds stops it before the first batch.
    cut = runner(start, 0, 1e-9)
    assert not cut.completed and cut.samples == 0
    # An emulated slow device (5 ms per sample = 1 s per epoch) against 0.2 s: aborted
    # without waiting the whole second; a stop request ends the wait at once.
    cancel = threading.Event()
    slow = RealEpochRunner(TrainSettings("digits-cnn"), x, y, extra_s_per_sample=0.005,
                           cancel=cancel)
    r = train_to_deadline(start, slow, epochs=2, time_left=Watchdog(0.2).left)
    assert (r.finished, r.aborted, r.vector) == (False, True, None)
    cancel.set()  # a stopping agent: the emulated delay ends at once, the epoch still trains
    assert slow(start, 0, 100.0).completed
