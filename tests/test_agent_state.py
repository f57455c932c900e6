"""Durable agent state: exact round trip, atomic saves, corrupt files handled; device profiles."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest
import torch

from edge_agent.drift import DriftMonitor, make_detector
from edge_agent.profiles import CarProfile, PhoneProfile, get_profile
from edge_agent.state import PREVIOUS_FILE, STATE_FILE, AgentState, PendingUpload, StateCorrupt
from fedmq.models import build_model, model_spec, to_vector


def sample_state(tau: int = 7) -> AgentState:
    monitor = DriftMonitor(make_detector("adwin"), min_interval_s=30.0)
    for i in range(300):
        monitor.observe(i % 5 != 0)
    vector = to_vector(build_model("digits-cnn", seed=tau))
    return AgentState(agent_id="car-7", model_name="digits-cnn", spec_hash=model_spec("digits-cnn").hash,
                      vector=vector, tau=tau,
                      pending=PendingUpload("car-7-000042", b"\x00\x01envelope\xff" * 100, 12.5),
                      monitor=monitor.state_dict(), counters={"uploads": 3, "drifts": 2},
                      reference_accuracy=0.91)


def test_round_trip(tmp_path) -> None:
    state = sample_state()
    state.save(tmp_path)
    loaded = AgentState.load(tmp_path)
    assert loaded is not None
    assert torch.equal(loaded.vector, state.vector) and loaded.vector.dtype == torch.float32
    assert (loaded.agent_id, loaded.model_name, loaded.spec_hash, loaded.tau) == ("car-7", "digits-cnn", state.spec_hash, 7)
    assert loaded.pending == state.pending
    assert loaded.counters == state.counters and loaded.reference_accuracy == 0.91
    assert loaded.saved_at == state.saved_at > 0
    assert loaded.matches_zoo()
    restored = DriftMonitor()
    restored.load_state_dict(loaded.monitor)
    assert restored.state_dict() == state.monitor


def test_empty_state_round_trip(tmp_path) -> None:
    assert AgentState.load(tmp_path) is None
    AgentState("phone-1", "cnn28", model_spec("cnn28").hash).save(tmp_path)
    loaded = AgentState.load(tmp_path)
    assert loaded is not None and loaded.vector is None and loaded.pending is None and loaded.tau == -1


def test_spec_mismatch_is_reported() -> None:
    state = sample_state()
    state.spec_hash = "0" * 16
    assert not state.matches_zoo()
    state.model_name = "no-such-model"
    assert not state.matches_zoo()


def test_leftover_tmp_is_ignored_and_previous_copy_kept(tmp_path) -> None:
    sample_state(tau=1).save(tmp_path)
    sample_state(tau=2).save(tmp_path)
    # a save that died after writing its temporary file, before the rename
    (tmp_path / f".{STATE_FILE}.abc123.tmp").write_bytes(sample_state(tau=3).to_bytes()[:500])
    loaded = AgentState.load(tmp_path)
    assert loaded is not None and loaded.tau == 2
    previous = AgentState.from_bytes((tmp_path / PREVIOUS_FILE).read_bytes())
    assert previous.tau == 1
    sample_state(tau=4).save(tmp_path)  # saving again works with the leftover around
    assert AgentState.load(tmp_path).tau == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "other_format"])
def test_corrupt_current_falls_back_to_previous(tmp_path, caplog, damage: str) -> None:
    sample_state(tau=1).save(tmp_path)
    sample_state(tau=2).save(tmp_path)
    path = tmp_path / STATE_FILE
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "flip":
        blob[len(blob) // 2] ^= 0x40  # inside the vector: still unpacks, checksum catches it
    elif damage == "garbage":
        blob = bytearray(b"\xc1" * 64)
    else:
        blob = bytearray(msgpack.packb({"format": "something-else"}))
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        loaded = AgentState.load(tmp_path)
    assert loaded is not None and loaded.tau == 1
    messages = [r.getMessage() for r in caplog.records]
    assert "state.unreadable" in messages and "state.fallback_to_previous" in messages


def test_both_copies_corrupt_is_a_clear_error(tmp_path) -> None:
    sample_state(tau=1).save(tmp_path)
    sample_state(tau=2).save(tmp_path)
    (tmp_path / STATE_FILE).write_bytes(b"junk")
    (tmp_path / PREVIOUS_FILE).write_bytes(b"")
    with pytest.raises(StateCorrupt) as info:
        AgentState.load(tmp_path)
    assert STATE_FILE in str(info.value) and PREVIOUS_FILE in str(info.value)


def test_checksum_mismatch_names_the_reason() -> None:
    outer = msgpack.unpackb(sample_state().to_bytes(), raw=False)
    outer["body"] = outer["body"][:-1] + bytes([outer["body"][-1] ^ 0x01])
    with pytest.raises(ValueError, match="checksum"):
        AgentState.from_bytes(msgpack.packb(outer, use_bin_type=True))


# --- device profiles (pure, seeded) --------------------------------------------------------

def test_profiles_are_pure_and_seeded() -> None:
    times = np.linspace(0, 2 * 86400, 400)
    for name in ("car", "phone"):
        a, b, other = get_profile(name, seed=3), get_profile(name, seed=3), get_profile(name, seed=4)
        forward = [(a.online(t), a.can_update(t), tuple(a.next_mixture(t, 4))) for t in times]
        backward = [(b.online(t), b.can_update(t), tuple(b.next_mixture(t, 4))) for t in times[::-1]][::-1]
        assert forward == backward, f"{name}: answers depend on the order of questions"
        assert forward != [(other.online(t), other.can_update(t), tuple(other.next_mixture(t, 4))) for t in times]


def test_car_connectivity_and_route() -> None:
    car = CarProfile(seed=1, mean_online_s=600.0, mean_offline_s=60.0, area_mean_s=900.0)
    times = np.arange(0, 5 * 86400, 15.0)
    online = np.array([car.online(t) for t in times])
    assert abs(online.mean() - 600 / 660) < 0.03
    primaries = [car.primary_cluster(t, 4) for t in times]
    areas = [car.area(t) for t in times]
    steps = list(zip(areas, areas[1:], primaries, primaries[1:], strict=False))
    next_area = [(p, q) for a, b, p, q in steps if b == a + 1]
    assert next_area and all(p != q for p, q in next_area), "each new area has another primary cluster"
    assert abs(areas[-1] - 5 * 86400 / 900) < 0.15 * 5 * 86400 / 900
    alpha = car.next_mixture(1000.0, 4)
    assert alpha.sum() == pytest.approx(1.0) and alpha.max() == pytest.approx(car.primary_share)
    assert car.train_seconds(1000, 2) == pytest.approx(car.overhead_s + 2000 / car.samples_per_s)


def test_phone_updates_only_charging_on_wifi() -> None:
    phone = PhoneProfile(seed=2, start_hour=0.0)
    times = np.arange(0, 7 * 86400, 60.0)
    allowed = [t for t in times if phone.can_update(t)]
    assert allowed, "a phone must get some update windows in a week"
    assert all(phone.charging(t) and phone.on_wifi(t) and phone.online(t) for t in allowed)
    hours = {int(phone.hour_of_day(t)) for t in allowed}
    assert hours <= {21, 22, 23, 0, 1, 2, 3, 4, 5, 6, 7}
    assert not phone.can_update(14 * 3600.0)  # mid-afternoon: at work, not charging
    assert phone.place(3 * 3600) == "home" and phone.place(12 * 3600) == "work"
    assert phone.primary_cluster(3 * 3600, 4) != phone.primary_cluster(12 * 3600, 4)


def test_unknown_profile() -> None:
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("tractor")
