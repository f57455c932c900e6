"""Aggregator durability: snapshots, the write-ahead journal, torn tails, unwritable dirs."""

from __future__ import annotations

import os

import pytest
import torch

from aggregator.journal import Journal, JournalError, dumps, loads


def test_values_round_trip_without_pickle() -> None:
    state = {"t": 7, "w": [torch.arange(6, dtype=torch.float32).reshape(2, 3)], "a": {"x": [0.5, 0.5]}}
    back = loads(dumps(state))
    assert back["t"] == 7 and back["a"] == {"x": [0.5, 0.5]}
    assert torch.equal(back["w"][0], state["w"][0]) and back["w"][0].dtype == torch.float32


def test_snapshot_then_records_replay_in_order(tmp_path) -> None:
    j = Journal(tmp_path)
    assert j.load() == (None, [])
    j.snapshot({"t": 0})
    j.append([{"i": 1}, {"i": 2}])
    j.append([{"i": 3, "v": torch.ones(4)}])
    j.close()
    snap, recs = Journal(tmp_path).load()
    assert snap == {"t": 0}
    assert [r["i"] for r in recs] == [1, 2, 3]
    assert torch.equal(recs[2]["v"], torch.ones(4))


def test_new_snapshot_starts_empty_journal_and_drops_old_generations(tmp_path) -> None:
    j = Journal(tmp_path)
    j.load()
    for gen in range(4):
        j.snapshot({"t": gen})
        j.append([{"i": gen}])
    j.close()
    snap, recs = Journal(tmp_path).load()
    assert snap == {"t": 3} and recs == [{"i": 3}]
    assert len(list(tmp_path.glob("snapshot-*.msgpack"))) <= 2


def test_torn_tail_is_dropped_and_appends_continue(tmp_path) -> None:
    j = Journal(tmp_path)
    j.load()
    j.snapshot({"t": 0})
    j.append([{"i": 1}, {"i": 2}])
    j.close()
    log = next(tmp_path.glob("journal-*.log"))
    data = log.read_bytes()
    log.write_bytes(data + data[: len(data) // 3])  # half a record: a crash mid-write
    j2 = Journal(tmp_path)
    _, recs = j2.load()
    assert [r["i"] for r in recs] == [1, 2]
    j2.append([{"i": 3}])
    j2.close()
    assert [r["i"] for r in Journal(tmp_path).load()[1]] == [1, 2, 3]


def test_corrupt_newest_snapshot_falls_back_and_replays_later_journals(tmp_path) -> None:
    j = Journal(tmp_path)
    j.load()
    j.snapshot({"t": 0})
    j.append([{"i": 1}])
    j.snapshot({"t": 1})
    j.append([{"i": 2}])
    j.close()
    newest = sorted(tmp_path.glob("snapshot-*.msgpack"))[-1]
    newest.write_bytes(b"\xc1garbage")
    snap, recs = Journal(tmp_path).load()
    assert snap == {"t": 0}
    assert [r["i"] for r in recs] == [1, 2]


def test_state_dir_that_is_a_file_raises_journal_error(tmp_path) -> None:
    target = tmp_path / "state"
    target.write_text("not a directory")
    with pytest.raises(JournalError, match="cannot create state dir"):
        Journal(target).load()


def test_full_disk_raises_journal_error_and_keeps_snapshot(tmp_path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    j = Journal(tmp_path)
    j.load()
    j.snapshot({"t": 5})
    j.close()
    log = tmp_path / f"journal-{j.generation}.log"
    log.unlink(missing_ok=True)
    os.symlink("/dev/full", log)  # every write fails with ENOSPC
    with pytest.raises(JournalError, match="cannot append"):
        j.append([{"i": 1}])
    log.unlink()
    assert Journal(tmp_path).load() == ({"t": 5}, [])
