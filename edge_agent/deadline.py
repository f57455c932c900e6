"""Deadline-aware local training for round-based algorithms (CATA-Fed, FedAvg, FedProx).

An agent invited to a round must report within T seconds of *its own receipt* of the invite
(clocks differ between machines, so no absolute time crosses the wire). It keeps eps_i back
for sending the report, measured from its own past uploads (`UploadTimer`), and trains epoch
by epoch (`train_to_deadline`):

- soft stop (CATA-Fed, FedProx): before each epoch, stop if the time left before T - eps_i
  is below the mean epoch time so far; the work done counts (I_i = 1);
- watchdog (`Watchdog`): an epoch still running at T - eps_i is cut at the next batch
  (fit's `max_seconds`). CATA-Fed then reports I_i = 0 and no model: a straggler. FedProx
  sends the partial model (partial work is accepted there). FedAvg has neither: it trains
  its E epochs whatever the time and the server drops it if it comes late.

A CATA-Fed straggler halves its data (`Shards`): 2^u shards of at least pi samples, used in
turn (shard j = n_i mod 2^u, n_i its rounds so far), and reports the new shard size so that
the server re-clusters it. Time comes from an `EpochRunner`: `RealEpochRunner` trains and
measures wall time (optionally emulating a slower device by a delay per sample);
sim/rounds.py has one on a simulated clock, so a 60 s deadline costs no 60 s of wall time.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from edge_agent.agent_algorithms import agent_algorithm
from fedmq.config import CataFedSettings
from fedmq.training import evaluate, fit

MODES = ("catafed", "fedavg", "fedprox")
"""How an agent trains against the deadline (module docstring); each round algorithm's is its `deadline_mode` (edge_agent/agent_algorithms.py)."""
RESIZE = ("halve", "fit")


# ----------------------------------------------------------------------------- time


class Watchdog:
    """T - eps_i on some clock, counted from the receipt of the invite."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic,
                 started_at: float | None = None) -> None:
        self.clock = clock
        self.started_at = clock() if started_at is None else started_at
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return self.clock() - self.started_at

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def expired(self) -> bool:
        return self.left() <= 0


class UploadTimer:
    """eps_i: the time an agent keeps back for its report, from its measured uploads."""

    def __init__(self, initial_s: float = 0.2, factor: float = 2.0, floor_s: float = 0.05,
                 window: int = 5) -> None:
        self.initial_s = initial_s
        self.factor = factor
        self.floor_s = floor_s
        self.samples: deque[float] = deque(maxlen=window)

    def record(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self.samples.append(float(seconds))

    @property
    def eps(self) -> float:
        if not self.samples:
            return max(self.floor_s, self.initial_s)
        return max(self.floor_s, self.factor * statistics.fmean(self.samples))

    @classmethod
    def from_settings(cls, s: CataFedSettings) -> UploadTimer:
        return cls(s.eps_initial_s, s.eps_factor, s.eps_min_s)


# ----------------------------------------------------------------------------- shards


class Shards:
    """A straggler's data split into 2^u shards of at least `min_shard` samples, cycled.

    Shards are contiguous slices of one fixed permutation of the data (np.array_split, so
    sizes differ by at most one); shard j of round n_i is j = n_i mod 2^u (the paper's
    j = n_i mod 2^u + 1, 1-based).
    """

    def __init__(self, n: int, min_shard: int, seed: int = 0) -> None:
        if n < 1 or min_shard < 1:
            raise ValueError(f"need n >= 1 and min_shard >= 1, got {n}, {min_shard}")
        self.n = n
        self.min_shard = min_shard
        self.u = 0
        self.order = np.random.default_rng([seed, 0x5AD]).permutation(n)

    @property
    def count(self) -> int:
        return 2 ** self.u

    @property
    def size(self) -> int:
        """The (smallest) shard size: what the agent reports as its per-round data size."""
        return self.n // self.count

    def can_halve(self) -> bool:
        return self.n // (2 * self.count) >= self.min_shard

    def double(self) -> bool:
        """u := u - 1 unless the data is whole again; True if it doubled."""
        if self.u == 0:
            return False
        self.u -= 1
        return True

    def halve(self) -> bool:
        """u := u + 1 unless shards would fall below min_shard; True if it halved."""
        if not self.can_halve():
            return False
        self.u += 1
        return True

    def shrink_to(self, samples: int) -> int:
        """Halve until a shard holds at most `samples` (at least once, never below min_shard);
        the number of halvings done."""
        done = 0
        while self.halve():
            done += 1
            if self.size <= samples:
                break
        return done

    def index(self, rounds_done: int) -> int:
        return rounds_done % self.count

    def indices(self, j: int) -> np.ndarray:
        if not 0 <= j < self.count:
            raise IndexError(f"shard {j} of {self.count}")
        return np.array_split(self.order, self.count)[j]


# ----------------------------------------------------------------------------- epochs


@dataclass
class EpochOutcome:
    """One epoch (or the part of it the deadline allowed)."""

    vector: torch.Tensor
    seconds: float
    completed: bool
    samples: int


EpochRunner = Callable[[torch.Tensor, int, float], EpochOutcome]
"""run(start_vector, epoch_index, seconds_left) -> EpochOutcome; seconds_left may be inf."""


@dataclass
class DeadlineResult:
    finished: bool
    """I_i: the agent has a model to report."""
    vector: torch.Tensor | None
    epochs_done: int
    seconds: float
    samples_seen: int
    soft_stopped: bool = False
    aborted: bool = False
    """The watchdog cut an epoch."""
    wasted_s: float = 0.0
    """Training time whose result is thrown away (the aborted epochs of a straggler)."""
    epoch_times: list[float] = field(default_factory=list)


def train_to_deadline(start: torch.Tensor, run_epoch: EpochRunner, *, epochs: int,
                      time_left: Callable[[], float], mode: str = "catafed") -> DeadlineResult:
    """Up to `epochs` epochs from `start`, stopping as the mode says (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    vector = start
    times: list[float] = []
    seen = 0
    used = 0.0
    for e in range(epochs):
        left = time_left() if mode != "fedavg" else math.inf
        if mode != "fedavg":
            if times and left < statistics.fmean(times):
                return DeadlineResult(True, vector, len(times), used, seen, soft_stopped=True,
                                      epoch_times=times)
            if left <= 0:
                return _aborted(mode, vector, times, used, seen, start)
        out = run_epoch(vector, e, left)
        used += out.seconds
        seen += out.samples
        if not out.completed:
            if mode == "fedprox":
                return DeadlineResult(out.samples > 0 or bool(times), out.vector, len(times), used,
                                      seen, aborted=True, epoch_times=times)
            return DeadlineResult(False, None, len(times), used, seen, aborted=True,
                                  wasted_s=used, epoch_times=times)
        vector = out.vector
        times.append(out.seconds)
    return DeadlineResult(True, vector, len(times), used, seen, epoch_times=times)


def _aborted(mode: str, vector: torch.Tensor, times: list[float], used: float, seen: int,
             start: torch.Tensor) -> DeadlineResult:
    if mode == "fedprox" and times:
        return DeadlineResult(True, vector, len(times), used, seen, aborted=True, epoch_times=times)
    return DeadlineResult(False, None, len(times), used, seen, aborted=True, wasted_s=used,
                          epoch_times=times)


@dataclass
class TrainSettings:
    model_name: str
    lr: float = 0.05
    batch_size: int = 32
    prox_mu: float = 0.0
    seed: int = 0
    momentum: float = 0.9


def epoch_seed(seed: int, round_id: int, epoch: int) -> int:
    """The batch-order seed of one epoch of one round: a new order every round and epoch."""
    return int(np.random.SeedSequence([seed, round_id, epoch]).generate_state(1)[0])


class RealEpochRunner:
    """Trains for real and measures wall time; the watchdog is fit's `max_seconds`.

    `extra_s_per_sample` emulates a slower device: that delay per sample is waited before
    the epoch's compute (capped at the time left, which then aborts the epoch). `cancel`
    interrupts the wait (the agent is stopping). Batches are shuffled by (seed, round_id,
    epoch), so an agent sees its data in a new order every round.
    """

    def __init__(self, train: TrainSettings, x: torch.Tensor, y: torch.Tensor, *,
                 anchor: torch.Tensor | None = None, extra_s_per_sample: float = 0.0,
                 cancel: threading.Event | None = None, round_id: int = 0) -> None:
        self.train, self.x, self.y = train, x, y
        self.round_id = round_id
        self.anchor = anchor
        self.extra = extra_s_per_sample
        self.cancel = cancel or threading.Event()

    def __call__(self, start: torch.Tensor, epoch: int, left: float) -> EpochOutcome:
        t0 = time.perf_counter()
        n = int(self.x.shape[0])
        delay = n * self.extra
        if delay > 0:
            if delay >= left:
                self.cancel.wait(max(left, 0.0))
                return EpochOutcome(start, time.perf_counter() - t0, False, 0)
            self.cancel.wait(delay)
        rest = left - (time.perf_counter() - t0)
        anchors = [(self.anchor, self.train.prox_mu)] if self.anchor is not None \
            and self.train.prox_mu > 0 else []
        r = fit(self.train.model_name, start, self.x, self.y, anchors=anchors, epochs=1,
                batch_size=self.train.batch_size, lr=self.train.lr, momentum=self.train.momentum,
                seed=epoch_seed(self.train.seed, self.round_id, epoch),
                max_seconds=rest if math.isfinite(rest) else None)
        completed = not r.stopped_early
        return EpochOutcome(r.vector, time.perf_counter() - t0, completed,
                            r.samples_seen if not completed else n)


# ----------------------------------------------------------------------------- one agent


@dataclass
class RoundWork:
    """What an agent did in one round: the fields of its Report, and counters."""

    finished: bool
    vector: torch.Tensor | None
    n_samples: int
    """Samples per epoch it trained on (0 for a straggler)."""
    shard_size: int
    """Its per-round data size from now on (halved after a CATA-Fed abort)."""
    shard_used: int
    shard_index: int
    result: DeadlineResult
    local_accuracy: float | None = None
    """TiFL: accuracy of the received model on the agent's own data (None: not scored)."""


RunnerFactory = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], EpochRunner]
"""make(x, y, anchor) -> an EpochRunner on that data (anchor: FedProx's centre W_t)."""


class DeadlineLearner:
    """One agent's side of deadline rounds, without I/O: data, shards, eps_i, training.

    `algorithm` is a round algorithm (fedmq/algorithms.py); it trains in its `deadline_mode` (edge_agent/agent_algorithms.py: TiFL's agents train as FedAvg's).
    CATA-Fed's ablation switches (`catafed.deadline_aware`, `catafed.partition`) and its
    `resize` rule act here. With `model_name`, a TiFL agent also scores the model it received
    on its own data (TiFL's per-tier accuracy comes from these scores).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, settings: CataFedSettings, *,
                 algorithm: str = "catafed", seed: int = 0, epochs: int | None = None,
                 model_name: str | None = None) -> None:
        self.kind = agent_algorithm(algorithm)
        if not self.kind.rounds:
            raise ValueError(f"{algorithm} is not a deadline-round algorithm")
        if settings.resize not in RESIZE:
            raise ValueError(f"catafed.resize must be one of {RESIZE}, got {settings.resize!r}")
        self.x, self.y = x, y
        self.settings = settings
        self.algorithm = algorithm
        self.mode = self.kind.deadline_mode
        if self.kind.shards and not settings.deadline_aware:
            self.mode = "fedavg"  # trains all its epochs; it still notices it was late
        self.model_name = model_name
        self.epochs = settings.epochs if epochs is None else epochs  # baselines: fedavg.epochs
        self.shards = Shards(int(x.shape[0]), settings.min_shard, seed)
        self.uploads = UploadTimer.from_settings(settings)
        self.rounds_done = 0
        self.halvings = 0
        self.regrowths = 0

    @property
    def shard_size(self) -> int:
        """Per-round data size: the shard size for CATA-Fed, all data for the baselines."""
        return self.shards.size if self.kind.shards else self.shards.n

    def budget_s(self, deadline_s: float) -> float:
        """T - eps_i: the watchdog's budget for a round of deadline T."""
        return deadline_s - self.uploads.eps

    def run_round(self, start: torch.Tensor, make_runner: RunnerFactory,
                  time_left: Callable[[], float]) -> RoundWork:
        if self.kind.shards:
            j = self.shards.index(self.rounds_done)
            idx = torch.from_numpy(self.shards.indices(j))
            x, y = self.x[idx], self.y[idx]
        else:
            j, x, y = 0, self.x, self.y
        score = None
        if self.kind.scores_start and self.model_name:
            score = evaluate(self.model_name, start, self.x, self.y)[0]
        anchor = start if self.mode == "fedprox" else None
        result = train_to_deadline(start, make_runner(x, y, anchor), epochs=self.epochs,
                                   time_left=time_left, mode=self.mode)
        self.rounds_done += 1
        missed = not result.finished or (self.mode != self.algorithm and time_left() < 0)
        if self.kind.shards and missed and self.settings.partition:
            self._shrink(result)
        elif (self.kind.shards and self.settings.regrow and result.finished
              and result.epochs_done == self.epochs
              and result.seconds <= 0.4 * self.budget_s(self.settings.deadline_s)
              and self.shards.double()):
            self.regrowths += 1
        n_used = int(x.shape[0]) if result.finished else 0
        return RoundWork(result.finished, result.vector, n_used, self.shard_size,
                         int(x.shape[0]), j, result, score)

    def _shrink(self, result: DeadlineResult) -> None:
        """A missed deadline: halve (the paper), or shrink to what the measured speed fits."""
        if self.settings.resize == "fit" and result.samples_seen > 0 and result.seconds > 0:
            speed = result.samples_seen / result.seconds
            budget = self.budget_s(self.settings.deadline_s)
            self.halvings += self.shards.shrink_to(max(1, int(0.8 * speed * budget)))
        elif self.shards.halve():
            self.halvings += 1
