"""Device profiles: how fast a device trains, when it can talk, how its data shifts.

A profile is pure and seeded: the same (name, seed) answers every question about time t
the same way, in any order of questions, so a simulated fleet is reproducible. Time t is
seconds since the start of the simulation; `start_hour` is the wall-clock hour at t = 0
(for daily patterns).

- `CarProfile`: connectivity is a two-state Markov chain (online / offline, exponential
  durations with the given means: tunnels, dead zones on the move); it can update
  whenever it is online. Its data follows the area it drives through: a route is a
  sequence of areas with exponential dwell times, each area has a primary cluster (never
  the previous area's), and the mixture puts `primary_share` on it.
- `PhoneProfile`: online most of the time (a Markov chain with long online spells), but
  uploads only while charging *and* on Wi-Fi: a daily charging window (start jittered per
  day) inside a daily home Wi-Fi window. Its data follows the place of the day (home,
  work, elsewhere), each place with its own primary cluster.

`train_seconds(n_samples, epochs)` turns work into time (a simulator sleeps or charges it);
the default speeds are assumptions about device classes relative to the reference CNN,
not measurements (bench/bench_agent.py measures this machine).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np


class _Timeline:
    """Segment start times t_0 = 0 < t_1 < ... drawn lazily from one seeded stream.

    Segment i lasts Exp(mean_i) where mean_i comes from `means` cycled (alternating states
    for a Markov chain with two means, one mean for areas). `token(i)` is a seeded random
    integer per segment (for choosing clusters). Extending on demand keeps answers
    independent of the order of queries.
    """

    def __init__(self, seed: int, stream: int, means: tuple[float, ...]) -> None:
        if any(m <= 0 for m in means):
            raise ValueError(f"mean durations must be > 0, got {means}")
        self._rng = np.random.default_rng([seed, stream])
        self._means = means
        self.starts: list[float] = [0.0]
        self.tokens: list[int] = [int(self._rng.integers(2**31))]

    def index_at(self, t: float) -> int:
        if t < 0:
            raise ValueError(f"time must be >= 0, got {t}")
        while self.starts[-1] <= t:
            i = len(self.starts) - 1
            self.starts.append(self.starts[-1] + float(self._rng.exponential(self._means[i % len(self._means)])))
            self.tokens.append(int(self._rng.integers(2**31)))
        return bisect.bisect_right(self.starts, t) - 1


def _primary_mixture(primary: int, num_clusters: int, primary_share: float) -> np.ndarray:
    if num_clusters < 1:
        raise ValueError(f"need at least one cluster, got {num_clusters}")
    if num_clusters == 1:
        return np.ones(1)
    alpha = np.full(num_clusters, (1.0 - primary_share) / (num_clusters - 1))
    alpha[primary] = primary_share
    return alpha


@dataclass
class DeviceProfile:
    """What every profile answers; subclasses set the behaviour."""

    name: str = "device"
    seed: int = 0
    samples_per_s: float = 500.0
    """Training throughput on the reference CNN (sample-epochs per second)."""
    overhead_s: float = 1.0
    """Fixed cost of one update (loading data, export, encoding)."""
    start_hour: float = 8.0
    primary_share: float = 0.8

    def train_seconds(self, n_samples: int, epochs: float) -> float:
        return self.overhead_s + n_samples * epochs / self.samples_per_s

    def online(self, t: float) -> bool:
        return True

    def can_update(self, t: float) -> bool:
        return self.online(t)

    def primary_cluster(self, t: float, num_clusters: int) -> int:
        return 0

    def next_mixture(self, t: float, num_clusters: int) -> np.ndarray:
        """The mixture over clusters that the device's new data follows from time t on."""
        return _primary_mixture(self.primary_cluster(t, num_clusters), num_clusters, self.primary_share)

    def hour_of_day(self, t: float) -> float:
        return (self.start_hour + t / 3600.0) % 24.0

    def day(self, t: float) -> int:
        return int((self.start_hour + t / 3600.0) // 24.0)


@dataclass
class CarProfile(DeviceProfile):
    name: str = "car"
    samples_per_s: float = 500.0
    mean_online_s: float = 600.0
    mean_offline_s: float = 45.0
    area_mean_s: float = 900.0
    _link: _Timeline = field(init=False, repr=False, compare=False)
    _route: _Timeline = field(init=False, repr=False, compare=False)
    _clusters: dict[int, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._link = _Timeline(self.seed, 1, (self.mean_online_s, self.mean_offline_s))
        self._route = _Timeline(self.seed, 2, (self.area_mean_s,))
        self._clusters = {}

    def online(self, t: float) -> bool:
        return self._link.index_at(t) % 2 == 0  # segments alternate online, offline, ...

    def area(self, t: float) -> int:
        """Index of the area the car is in at time t (0, 1, 2, ... along the route)."""
        return self._route.index_at(t)

    def primary_cluster(self, t: float, num_clusters: int) -> int:
        if num_clusters < 1:
            raise ValueError(f"need at least one cluster, got {num_clusters}")
        i = self._route.index_at(t)
        clusters = self._clusters.setdefault(num_clusters, [self._route.tokens[0] % num_clusters])
        while len(clusters) <= i:  # each new area moves to another cluster than the last
            token = self._route.tokens[len(clusters)]
            step = 1 + token % (num_clusters - 1) if num_clusters > 1 else 0
            clusters.append((clusters[-1] + step) % num_clusters)
        return clusters[i]


PLACES = ("home", "work", "elsewhere")


@dataclass
class PhoneProfile(DeviceProfile):
    name: str = "phone"
    samples_per_s: float = 200.0
    mean_online_s: float = 3 * 3600.0
    mean_offline_s: float = 300.0
    charge_start_h: float = 23.0
    charge_hours: float = 7.0
    charge_jitter_h: float = 1.0
    """Each day's charging starts up to this many hours earlier or later (seeded)."""
    home_from_h: float = 19.0
    home_until_h: float = 8.0
    """Home (and home Wi-Fi) from this hour to that hour the next morning."""
    work_from_h: float = 9.0
    work_until_h: float = 17.0
    _link: _Timeline = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._link = _Timeline(self.seed, 1, (self.mean_online_s, self.mean_offline_s))

    def online(self, t: float) -> bool:
        return self._link.index_at(t) % 2 == 0

    def place(self, t: float) -> str:
        hour = self.hour_of_day(t)
        if _in_daily_window(hour, self.home_from_h, self.home_until_h):
            return "home"
        if _in_daily_window(hour, self.work_from_h, self.work_until_h):
            return "work"
        return "elsewhere"

    def on_wifi(self, t: float) -> bool:
        return self.place(t) == "home"

    def charging(self, t: float) -> bool:
        """In tonight's (or last night's) charging window, each night's start jittered."""
        hours = self.start_hour + t / 3600.0
        for day in (math.floor(hours / 24.0) - 1, math.floor(hours / 24.0)):
            jitter = np.random.default_rng([self.seed, 3, day + 1]).uniform(-1, 1) * self.charge_jitter_h
            start = day * 24.0 + self.charge_start_h + jitter
            if start <= hours < start + self.charge_hours:
                return True
        return False

    def can_update(self, t: float) -> bool:
        return self.online(t) and self.on_wifi(t) and self.charging(t)

    def primary_cluster(self, t: float, num_clusters: int) -> int:
        order = np.random.default_rng([self.seed, 4]).permutation(max(num_clusters, len(PLACES)))
        return int(order[PLACES.index(self.place(t))]) % num_clusters


def _in_daily_window(hour: float, start: float, end: float) -> bool:
    """hour in [start, end), the window possibly wrapping past midnight."""
    return start <= hour < end if start <= end else hour >= start or hour < end


PROFILES: dict[str, type[DeviceProfile]] = {"car": CarProfile, "phone": PhoneProfile, "device": DeviceProfile}


def get_profile(name: str, seed: int = 0, **overrides: float) -> DeviceProfile:
    """A profile by name ("car", "phone", "device": always online, one cluster) and seed."""
    try:
        cls = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {', '.join(PROFILES)}") from None
    return cls(seed=seed, **overrides)
