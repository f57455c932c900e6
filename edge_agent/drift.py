"""Drift detectors on the stream of correctness bits, and the monitor that turns drift into uploads.

An agent predicts every labelled sample before it learns from it (test-then-train), so it
sees a stream of bits `correct`. Each detector watches that stream in the river style:

    detector.update(x)          # x = 1 - correct (the error), or any value in [0, 1]
    if detector.drift_detected: ...

and keeps a small state that `state_dict()` / `load_state_dict()` persist as plain
msgpack-able values (the agent saves it with its model). Detectors look for an *increase*
of the error only: a model that gets better is no reason to upload.

- `ThresholdDetector`: accuracy over the last `window` bits against a reference accuracy
  (measured right after the last model install); drift when the full window falls more
  than `delta` below it. Easy to explain to an operator, and the reference makes it
  absolute: it compares against what this model did on this device.
- `PageHinkley`: river's definition (river >= 0.15, mode "up") with other defaults (see
  the class for why: river's forgetting factor makes false alarms on long streams).
- `ADWIN`: adaptive windowing (Bifet & Gavalda 2007) with river's cut test, kept exact:
  the window is a bit list of at most `max_window` values (see the class).
- `DDM`: Gama et al.'s drift detection method, with a warning zone.

All are `DriftDetector`s (drift and warning flags, lazy restart after a drift, saved state
with its `kind`), registered in `DETECTORS` by name.

`DriftMonitor` wraps one detector and decides when the agent should train and upload:
after drift (or a manual trigger), but not more often than `min_interval_s`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, ClassVar

import numpy as np


class DriftDetector(ABC):
    """river's shape: `update(x)`, then read `drift_detected` (and `warning_detected`, the
    zone before a drift where a detector has one). A drift is acted on by the caller; the
    detector restarts lazily at the next `update` (`_after_drift`). Subclasses implement
    `_update` (setting the flags), `reset`, `_state` and `_load`; `kind` names them in the
    registry (`DETECTORS`) and in saved states, `binary` says whether `x` is read as a bit.
    """

    kind: ClassVar[str]
    binary: ClassVar[bool] = False
    """True: `x` >= 0.5 is an error, else correct; False: `x` is a value in [0, 1]."""

    def __init__(self) -> None:
        self._drift = False
        self._warning = False

    @property
    def drift_detected(self) -> bool:
        return self._drift

    @property
    def warning_detected(self) -> bool:
        return self._warning

    def update(self, x: float) -> None:
        if self._drift:
            self._after_drift()
        self._drift = self._warning = False
        self._update(float(x))

    @abstractmethod
    def _update(self, x: float) -> None: ...

    def _after_drift(self) -> None:
        """What a drift costs the statistics (default: everything); runs at the next update."""
        self.reset()

    @abstractmethod
    def reset(self) -> None:
        """Forget every statistic and flag."""

    def set_reference(self, accuracy: float | None) -> None:
        """A new model is installed; the statistics described the old one (`accuracy`, its
        accuracy on local data, is used by detectors that compare against a reference)."""
        self.reset()

    @abstractmethod
    def _state(self) -> dict[str, Any]: ...

    @abstractmethod
    def _load(self, state: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self._state(), "drift": self._drift, "warning": self._warning}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"state of a {state.get('kind')!r} detector cannot load into {self.kind!r}")
        self._load(state)
        self._drift = bool(state["drift"])
        self._warning = bool(state.get("warning", False))


class ThresholdDetector(DriftDetector):
    """Drift when accuracy over the last `window` bits < reference - `delta` (window full).

    The reference is the accuracy the installed model is expected to have on this device:
    `set_reference(acc)` right after an install (the agent evaluates the new model on its
    buffer). With no reference set, the first full window's accuracy becomes the reference
    (self-calibrating). Defaults: window 200, delta 0.1. At accuracy 0.9 the window's
    standard deviation is 0.021, so delta is ~4.7 sigma: no alarm in 10,000 stationary
    samples; a drop to 0.6 is caught after ~70 samples.
    """

    kind = "threshold"
    binary = True

    def __init__(self, window: int = 200, delta: float = 0.1, reference: float | None = None) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0.0 <= delta <= 1.0:
            raise ValueError(f"delta must be in [0, 1], got {delta}")
        self.window = window
        self.delta = delta
        self.reference: float | None = reference
        self._bits: deque[int] = deque(maxlen=window)
        self._errors = 0

    def _after_drift(self) -> None:
        """One alarm per drift: judge a fresh window next, against the same reference."""
        self._bits.clear()
        self._errors = 0

    def _update(self, x: float) -> None:
        """`x` is the error of one prediction (1 - correct); values >= 0.5 count as wrong."""
        bit = 1 if x >= 0.5 else 0
        if len(self._bits) == self.window:
            self._errors -= self._bits[0]
        self._bits.append(bit)
        self._errors += bit
        if len(self._bits) < self.window:
            return
        acc = self.window_accuracy
        if self.reference is None:
            self.reference = acc
        elif acc < self.reference - self.delta:
            self._drift = True

    @property
    def window_accuracy(self) -> float | None:
        return None if not self._bits else 1.0 - self._errors / len(self._bits)

    def set_reference(self, accuracy: float | None) -> None:
        """New model installed: new reference, and an empty window (old bits judged the old model)."""
        self.reference = accuracy
        self._bits.clear()
        self._errors = 0
        self._drift = False

    def reset(self) -> None:
        self.set_reference(None)

    def _state(self) -> dict[str, Any]:
        return {"window": self.window, "delta": self.delta, "reference": self.reference,
                "bits": bytes(self._bits)}

    def _load(self, state: dict[str, Any]) -> None:
        self.window = int(state["window"])
        self.delta = float(state["delta"])
        self.reference = None if state["reference"] is None else float(state["reference"])
        self._bits = deque(bytes(state["bits"]), maxlen=self.window)
        self._errors = sum(self._bits)


class PageHinkley(DriftDetector):
    """Page-Hinkley test for an increase of the mean, as river (>= 0.15) defines it, mode "up".

    Per value x: the running mean m_n of all values since the last reset (plain mean),
    dev = x - m_n, S := alpha * S + dev - delta, M := min(M, S); drift when
    n >= min_instances and S - M > threshold. After a drift the next update starts afresh
    (river resets lazily too).

    The definition is river's, our defaults are not. river's (delta 0.005, threshold 50,
    alpha 1 - 1e-4) raise false alarms on long stationary 0/1 error streams: the forgetting
    factor pulls S towards the fixed point -delta / (1 - alpha) while M, the all-time
    minimum, does not forget, so once S settles there (after ~1/(1 - alpha) samples) S - M
    is a driftless wander that crosses any threshold. Measured on Bernoulli(0.1) errors,
    20 seeds: river's defaults give 1 false alarm in 20 x 10,000 samples and 21 in
    20 x 50,000. Ours, alpha 1 (no forgetting: S - M is a random walk reflected at 0 with
    drift -delta), delta 0.05 (half the smallest error increase worth an upload),
    threshold 20: 0 false alarms in 20 x 50,000, and a jump of the error 0.1 -> 0.4 is
    caught after 70 samples (median; at most 111).
    """

    kind = "page_hinkley"

    def __init__(self, min_instances: int = 30, delta: float = 0.05, threshold: float = 20.0,
                 alpha: float = 1.0) -> None:
        if min_instances < 1 or threshold <= 0 or not 0 < alpha <= 1:
            raise ValueError("PageHinkley needs min_instances >= 1, threshold > 0, 0 < alpha <= 1")
        super().__init__()
        self.min_instances = min_instances
        self.delta = delta
        self.threshold = threshold
        self.alpha = alpha
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.sum = 0.0
        self.min_sum = math.inf
        self._drift = self._warning = False

    def _update(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / self.n
        self.sum = self.alpha * self.sum + (x - self.mean) - self.delta
        self.min_sum = min(self.min_sum, self.sum)
        self._drift = self.n >= self.min_instances and self.sum - self.min_sum > self.threshold

    def _state(self) -> dict[str, Any]:
        return {"min_instances": self.min_instances, "delta": self.delta, "threshold": self.threshold,
                "alpha": self.alpha, "n": self.n, "mean": self.mean, "sum": self.sum,
                "min_sum": None if math.isinf(self.min_sum) else self.min_sum}

    def _load(self, state: dict[str, Any]) -> None:
        self.min_instances = int(state["min_instances"])
        self.delta = float(state["delta"])
        self.threshold = float(state["threshold"])
        self.alpha = float(state["alpha"])
        self.n = int(state["n"])
        self.mean = float(state["mean"])
        self.sum = float(state["sum"])
        self.min_sum = math.inf if state["min_sum"] is None else float(state["min_sum"])


class ADWIN(DriftDetector):
    """Adaptive windowing (Bifet & Gavalda 2007), exact and bounded.

    The window holds the last values (at most `max_window`; the oldest fall out). Every
    `clock` updates, every split W = W0 . W1 (W1 the newest, both at least
    `min_window_length` long, splits every `clock` values) is tested with river's bound:

        m = 1 / (n0 - min_len + 1) + 1 / (n1 - min_len + 1)
        dd = log(2 * log(n) / delta)
        cut when |mean0 - mean1| > sqrt(2 * m * var(W) * dd) + 2/3 * dd * m

    and on a cut the older part W0 is dropped (the window shrinks to the recent data).
    river keeps an exponential histogram of buckets (O(log W) memory, approximate split
    points); with bits, a bounded window of up to a few thousand values is small (one byte
    each) and lets us test the split points exactly with one numpy cumsum. Only cuts where
    the newer part has the *higher* error raise `drift_detected` (`direction="up"`); a cut
    the other way (the model got better) still shrinks the window. `direction="both"`
    reports both, like river.
    """

    kind = "adwin"

    def __init__(self, delta: float = 0.002, clock: int = 32, max_window: int = 5000,
                 min_window_length: int = 5, grace_period: int = 10, direction: str = "up") -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if direction not in ("up", "both"):
            raise ValueError(f"direction must be 'up' or 'both', got {direction!r}")
        if clock < 1 or max_window < 2 * min_window_length or min_window_length < 1:
            raise ValueError("ADWIN needs clock >= 1, min_window_length >= 1, max_window >= 2*min_window_length")
        super().__init__()
        self.delta = delta
        self.clock = clock
        self.max_window = max_window
        self.min_window_length = min_window_length
        self.grace_period = grace_period
        self.direction = direction
        self.reset()

    def reset(self) -> None:
        self._values: deque[float] = deque(maxlen=self.max_window)
        self._ticks = 0
        self._drift = self._warning = False
        self.detections = 0

    @property
    def width(self) -> int:
        return len(self._values)

    @property
    def estimation(self) -> float:
        return float(np.mean(self._values)) if self._values else 0.0

    def _after_drift(self) -> None:
        """Nothing to forget: the cut already dropped the data from before the change."""

    def _update(self, x: float) -> None:
        self._values.append(x)
        self._ticks += 1
        if self._ticks % self.clock or len(self._values) < max(self.grace_period, 2 * self.min_window_length):
            return
        self._drift = self._cut()

    def _cut(self) -> bool:
        """Drop the oldest part while some split shows a change; True for an upward change."""
        drift = False
        while True:
            values = np.fromiter(self._values, dtype=np.float64, count=len(self._values))
            n = len(values)
            lo = self.min_window_length
            if n < 2 * lo:
                return drift
            # split points counted from the newest end, every `clock` values (river tests
            # bucket boundaries, which are also coarser towards the old end)
            n1 = np.arange(lo, n - lo + 1, self.clock, dtype=np.int64)
            if n1.size == 0:
                return drift
            n0 = n - n1
            csum = np.concatenate(([0.0], np.cumsum(values)))
            total = csum[-1]
            mean1 = (total - csum[n0]) / n1
            mean0 = csum[n0] / n0
            var = float(values.var())
            m = 1.0 / (n0 - lo + 1) + 1.0 / (n1 - lo + 1)
            dd = math.log(2.0 * math.log(n) / self.delta)
            eps = np.sqrt(2.0 * m * var * dd) + (2.0 / 3.0) * dd * m
            diff = mean1 - mean0
            cuts = np.flatnonzero(np.abs(diff) > eps)
            if cuts.size == 0:
                return drift
            # the largest cut point: drop as much old data as the test allows
            i = cuts[np.argmin(n1[cuts])]
            keep = int(n1[i])
            if diff[i] > 0 or self.direction == "both":
                drift = True
                self.detections += 1
            for _ in range(n - keep):
                self._values.popleft()

    def _state(self) -> dict[str, Any]:
        bits = all(v in (0.0, 1.0) for v in self._values)
        values: bytes | list[float] = bytes(int(v) for v in self._values) if bits else list(self._values)
        return {"delta": self.delta, "clock": self.clock, "max_window": self.max_window,
                "min_window_length": self.min_window_length, "grace_period": self.grace_period,
                "direction": self.direction, "values": values, "ticks": self._ticks,
                "detections": self.detections}

    def _load(self, state: dict[str, Any]) -> None:
        self.__init__(float(state["delta"]), int(state["clock"]), int(state["max_window"]),  # type: ignore[misc]
                      int(state["min_window_length"]), int(state["grace_period"]), str(state["direction"]))
        raw = state["values"]
        self._values.extend(float(v) for v in (raw if not isinstance(raw, bytes) else list(raw)))
        self._ticks = int(state["ticks"])
        self.detections = int(state["detections"])


class DDM(DriftDetector):
    """Drift Detection Method (Gama et al. 2004) on the error bits, as river defines it.

    p = the error rate since the last reset, s = sqrt(p (1 - p) / n). After `warm_start`
    bits the smallest p + s seen is kept as (p_min, s_min); warning when
    p + s > p_min + `warning_threshold` s_min, drift when p + s > p_min + `drift_threshold`
    s_min; after a drift it starts afresh. It is here as the proof that a new detector is
    small on the base class: its mean over everything since the last reset reacts slowly
    after a long quiet stream (the agent resets it at each model install, which keeps
    streams short).
    """

    kind = "ddm"
    binary = True

    def __init__(self, warm_start: int = 30, warning_threshold: float = 2.0, drift_threshold: float = 3.0) -> None:
        if warm_start < 1 or not 0 < warning_threshold <= drift_threshold:
            raise ValueError("DDM needs warm_start >= 1 and 0 < warning_threshold <= drift_threshold")
        super().__init__()
        self.warm_start = warm_start
        self.warning_threshold = warning_threshold
        self.drift_threshold = drift_threshold
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.errors = 0
        self.p_min = math.inf
        self.s_min = math.inf
        self._drift = self._warning = False

    def _update(self, x: float) -> None:
        self.n += 1
        self.errors += x >= 0.5
        p = self.errors / self.n
        s = math.sqrt(p * (1.0 - p) / self.n)
        if self.n <= self.warm_start:
            return
        if p + s <= self.p_min + self.s_min:
            self.p_min, self.s_min = p, s
        self._drift = p + s > self.p_min + self.drift_threshold * self.s_min
        self._warning = not self._drift and p + s > self.p_min + self.warning_threshold * self.s_min

    def _state(self) -> dict[str, Any]:
        finite = not math.isinf(self.p_min)
        return {"warm_start": self.warm_start, "warning_threshold": self.warning_threshold,
                "drift_threshold": self.drift_threshold, "n": self.n, "errors": self.errors,
                "p_min": self.p_min if finite else None, "s_min": self.s_min if finite else None}

    def _load(self, state: dict[str, Any]) -> None:
        self.__init__(int(state["warm_start"]), float(state["warning_threshold"]),  # type: ignore[misc]
                      float(state["drift_threshold"]))
        self.n, self.errors = int(state["n"]), int(state["errors"])
        if state["p_min"] is not None:
            self.p_min, self.s_min = float(state["p_min"]), float(state["s_min"])


DETECTORS: dict[str, type[DriftDetector]] = {cls.kind: cls for cls in (ThresholdDetector, PageHinkley, ADWIN, DDM)}
"""Every drift detector by name: the config, make_detector, saved states and the contract
tests (tests/test_drift.py) all read this."""


def make_detector(name: str, **kwargs: Any) -> DriftDetector:
    """A detector by name (a key of DETECTORS) with its knobs as kwargs."""
    try:
        cls = DETECTORS[name]
    except KeyError:
        raise ValueError(f"unknown drift detector {name!r}; known: {', '.join(DETECTORS)}") from None
    return cls(**kwargs)


def detector_from_state(state: dict[str, Any]) -> DriftDetector:
    """Rebuild a detector of the kind recorded in `state` and load it."""
    detector = make_detector(str(state.get("kind")))
    detector.load_state_dict(state)
    return detector


class DriftMonitor:
    """Decides when the agent trains and uploads: on drift or a manual trigger, rate-limited.

        monitor.observe(correct)            # every labelled sample, before learning from it
        if monitor.should_update(now): ... train, upload ...; monitor.update_started(now)
        monitor.model_installed(acc)        # after a new model arrives

    A detected drift stays pending until an update starts (drift seen while the last
    upload is younger than `min_interval_s` is not forgotten, only delayed). A new model
    clears pending drift, since the evidence was about the old model. `trigger()` (an
    operator's request) is honoured even inside `min_interval_s`. `now` is the caller's
    clock (time.time() on a device, simulated seconds in the simulator).
    """

    def __init__(self, detector: DriftDetector | None = None, min_interval_s: float = 60.0) -> None:
        self.detector: DriftDetector = detector if detector is not None else ThresholdDetector()
        self.min_interval_s = min_interval_s
        self.drift_pending = False
        self.trigger_pending = False
        self.last_update_at: float | None = None
        self.observed = 0
        self.correct = 0
        self.drifts = 0

    def observe(self, correct: bool) -> bool:
        """Feed one prediction outcome; True when this one made the detector fire."""
        self.observed += 1
        self.correct += bool(correct)
        self.detector.update(0.0 if correct else 1.0)
        if self.detector.drift_detected:
            self.drifts += 1
            self.drift_pending = True
            return True
        return False

    def trigger(self) -> None:
        """Manual trigger: update at the next `should_update`, whatever the interval."""
        self.trigger_pending = True

    def should_update(self, now: float) -> bool:
        if self.trigger_pending:
            return True
        if not self.drift_pending:
            return False
        return self.last_update_at is None or now - self.last_update_at >= self.min_interval_s

    def update_started(self, now: float) -> None:
        """The agent began training for an upload: clear what asked for it, start the interval."""
        self.drift_pending = False
        self.trigger_pending = False
        self.last_update_at = now

    def model_installed(self, reference_accuracy: float | None) -> None:
        """A new model is in use; `reference_accuracy` is its accuracy on local data (or None)."""
        self.detector.set_reference(reference_accuracy)
        self.drift_pending = False

    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "min_interval_s": self.min_interval_s,
                "drift_pending": self.drift_pending, "trigger_pending": self.trigger_pending,
                "last_update_at": self.last_update_at, "observed": self.observed,
                "correct": self.correct, "drifts": self.drifts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector = detector_from_state(state["detector"])
        self.min_interval_s = float(state["min_interval_s"])
        self.drift_pending = bool(state["drift_pending"])
        self.trigger_pending = bool(state["trigger_pending"])
        self.last_update_at = None if state["last_update_at"] is None else float(state["last_update_at"])
        self.observed = int(state["observed"])
        self.correct = int(state["correct"])
        self.drifts = int(state["drifts"])
