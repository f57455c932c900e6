"""Durable agent state: exact round trip, atomic saves, corrupt files handled."""

from __future__ import annotations

import logging

import msgpack
import pytest
import torch

from edge_agent.drift import DriftMonitor, make_detector
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
    # The damaged file is kept aside, and the next save neither overwrites it nor makes it
    # the previous copy in place of the good one.
    assert (tmp_path / f"{STATE_FILE}.damaged").read_bytes() == bytes(blob)
    loaded.tau = 3
    loaded.save(tmp_path)
    assert AgentState.from_bytes((tmp_path / PREVIOUS_FILE).read_bytes()).tau == 1
    assert AgentState.load(tmp_path).tau == 3 and (tmp_path / f"{STATE_FILE}.damaged").read_bytes() == bytes(blob)


def test_msg_ids_after_a_restart_sort_above_those_sent_before(tmp_path, monkeypatch) -> None:
    """The aggregator refuses an agent's msg_id at or below the highest it applied; a device
    whose clock goes back across a restart (no RTC, NTP not yet synced) must still rise."""
    from fedmq import protocol

    monkeypatch.setattr(protocol, "_last_micros", protocol._last_micros)  # restored afterwards
    sent = protocol.new_msg_id()
    sample_state(tau=1).save(tmp_path)
    monkeypatch.setattr(protocol, "_last_micros", 0)  # a new process...
    monkeypatch.setattr(protocol.time, "time_ns", lambda: 10**15)  # ...whose clock says 1970
    protocol.msg_ids_after(AgentState.load(tmp_path).msg_id_floor)  # what DeviceAgent.start does
    assert protocol.new_msg_id() > sent


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
