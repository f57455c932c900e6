"""Drift detectors on correctness streams: quiet when stationary, quick after a drop, durable."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from edge_agent.drift import (
    ADWIN,
    DETECTORS,
    DriftMonitor,
    PageHinkley,
    ThresholdDetector,
    detector_from_state,
    make_detector,
)

QUIET_AND_QUICK = [name for name in DETECTORS if name != "ddm"]
"""Detectors fit to be the agent's: no false alarm in 10,000 stationary bits, a drop caught
within DELAY_BOUND. DDM is not (its mean over everything since the reset reacts slowly and
its early minimum makes false alarms: measured below); it is the small-detector example."""
DELAY_BOUND = 300


def errors(rng: np.random.Generator, accuracy: float, n: int) -> np.ndarray:
    """A Bernoulli stream of errors (1 = wrong) for a model of the given accuracy."""
    return (rng.random(n) >= accuracy).astype(np.float64)


def fresh(name: str):
    detector = make_detector(name)
    detector.set_reference(0.9)  # what the agent does right after installing a model
    return detector


@pytest.mark.parametrize("name", QUIET_AND_QUICK)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_false_alarm_then_bounded_delay(name: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    detector = fresh(name)
    alarms = 0
    for x in errors(rng, 0.9, 10_000):
        detector.update(x)
        alarms += detector.drift_detected
    assert alarms == 0, f"{name}: {alarms} false alarms on a stationary accuracy-0.9 stream"

    delay = None
    for i, x in enumerate(errors(rng, 0.6, 2 * DELAY_BOUND)):
        detector.update(x)
        if detector.drift_detected:
            delay = i + 1
            break
    print(f"{name} seed={seed}: detection delay after 0.9 -> 0.6 = {delay} samples")
    assert delay is not None and delay < DELAY_BOUND, f"{name}: delay {delay}"


@pytest.mark.parametrize("name", DETECTORS)
def test_state_dict_round_trip_continues_identically(name: str) -> None:
    rng = np.random.default_rng(5)
    stream = np.concatenate([errors(rng, 0.9, 1500), errors(rng, 0.6, 500)])
    original = fresh(name)
    for x in stream[:1200]:
        original.update(x)
    # through msgpack, as the agent's state file does
    state = msgpack.unpackb(msgpack.packb(original.state_dict()), raw=False)
    restored = detector_from_state(state)
    a, b = [], []
    for x in stream[1200:]:
        original.update(x)
        restored.update(x)
        a.append(original.drift_detected)
        b.append(restored.drift_detected)
    assert a == b
    assert any(a), "the drop should be detected in the continued stream"


def test_state_of_another_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot load"):
        PageHinkley().load_state_dict(ADWIN().state_dict())


@pytest.mark.parametrize("name", list(DETECTORS))
def test_every_registered_detector_keeps_the_contract(name: str) -> None:
    """The base class's promises, for each detector in the registry: named by its kind, flags
    off at the start, drift raised on a drop and dropped at the next update, warning never
    together with drift, reset and set_reference clear the flags, and the saved state names
    the kind and comes back through detector_from_state."""
    detector = make_detector(name)
    assert detector.kind == name and isinstance(detector.binary, bool)
    assert not detector.drift_detected and not detector.warning_detected
    rng = np.random.default_rng(11)
    fired_at = None
    for i, x in enumerate(np.concatenate([errors(rng, 0.95, 400), errors(rng, 0.3, 600)])):
        detector.update(x)
        assert not (detector.drift_detected and detector.warning_detected)
        if detector.drift_detected and i >= 400:
            fired_at = i
            break
    assert fired_at is not None, f"{name} never saw 0.95 -> 0.3"
    detector.update(0.0)
    assert not detector.drift_detected  # one alarm per drift
    state = detector.state_dict()
    assert state["kind"] == name and detector_from_state(state).state_dict() == state
    for clear in (detector.reset, lambda: detector.set_reference(0.9)):
        detector.update(1.0)
        clear()
        assert not detector.drift_detected and not detector.warning_detected


def test_ddm_warns_before_it_drifts_on_a_short_stream() -> None:
    """1,000 bits at 0.9 (the agent resets at each install, so streams are this short) then
    0.6: caught within DELAY_BOUND, the warning zone first. Measured with seeds 0-5: first
    warning after 1-54 bits, drift after 52-95; false alarms in the 1,000 quiet bits for 3
    of 6 seeds (why it is not in QUIET_AND_QUICK)."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        detector = make_detector("ddm")
        for x in errors(rng, 0.9, 1000):
            detector.update(x)
        warned = drifted = None
        for i, x in enumerate(errors(rng, 0.6, 2 * DELAY_BOUND)):
            detector.update(x)
            if detector.warning_detected and warned is None:
                warned = i
            if detector.drift_detected:
                drifted = i
                break
        assert drifted is not None and drifted < DELAY_BOUND, (seed, drifted)
        assert warned is not None and warned < drifted, (seed, warned, drifted)


def test_threshold_self_calibrates_without_reference() -> None:
    detector = ThresholdDetector(window=50, delta=0.1)
    for _ in range(50):
        detector.update(0.0)
    assert detector.reference == 1.0
    for _ in range(6):
        detector.update(1.0)
    assert detector.drift_detected  # 44/50 = 0.88 < 1.0 - 0.1


def test_adwin_ignores_improvement_unless_asked() -> None:
    rng = np.random.default_rng(3)
    stream = np.concatenate([errors(rng, 0.6, 2000), errors(rng, 0.95, 1000)])
    up, both = ADWIN(), ADWIN(direction="both")
    fired_up = fired_both = False
    for x in stream:
        up.update(x)
        both.update(x)
        fired_up |= up.drift_detected
        fired_both |= both.drift_detected
    assert not fired_up and fired_both
    assert up.width < 1200, "the window still shrinks to the recent, better data"


def test_unknown_detector_name() -> None:
    with pytest.raises(ValueError, match="unknown drift detector"):
        make_detector("cusum")


def test_monitor_min_interval_and_manual_trigger() -> None:
    monitor = DriftMonitor(ThresholdDetector(window=20, delta=0.1), min_interval_s=100.0)
    monitor.model_installed(1.0)
    assert not monitor.should_update(0.0)

    for _ in range(20):
        monitor.observe(False)
    assert monitor.drift_pending and monitor.should_update(0.0)
    monitor.update_started(0.0)
    assert not monitor.should_update(0.0)

    for _ in range(20):  # drift again, within the interval: delayed, not forgotten
        monitor.observe(False)
    assert monitor.drift_pending
    assert not monitor.should_update(50.0)
    assert monitor.should_update(100.0)

    monitor.trigger()  # an operator's request ignores the interval
    monitor.update_started(100.0)
    assert not monitor.should_update(101.0)
    monitor.trigger()
    assert monitor.should_update(101.0)
    monitor.update_started(101.0)

    for _ in range(20):
        monitor.observe(False)
    monitor.model_installed(0.9)  # a new model clears drift judged on the old one
    assert not monitor.should_update(1000.0)


def test_monitor_state_round_trip() -> None:
    monitor = DriftMonitor(make_detector("page_hinkley"), min_interval_s=30.0)
    for i in range(100):
        monitor.observe(i % 7 != 0)
    monitor.trigger()
    monitor.update_started(12.5)
    state = msgpack.unpackb(msgpack.packb(monitor.state_dict()), raw=False)
    restored = DriftMonitor()
    restored.load_state_dict(state)
    assert isinstance(restored.detector, PageHinkley)
    assert restored.state_dict() == monitor.state_dict()
