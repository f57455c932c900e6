"""Aggregator durability: snapshots, the write-ahead journal, torn tails, unwritable dirs."""

from __future__ import annotations

import io
import os
import shutil
import tracemalloc

import numpy as np
import pytest
import torch

from aggregator.journal import (
    JOURNAL_MAGIC,
    Journal,
    JournalCorrupt,
    JournalError,
    _frame,
    dumps,
    loads,
    read_snapshot,
    scan_journal,
    snapshot_bytes,
    snapshot_writer,
)


def test_values_round_trip_without_pickle() -> None:
    state = {"t": 7, "w": [torch.arange(6, dtype=torch.float32).reshape(2, 3)], "a": {"x": [0.5, 0.5]}}
    back = loads(dumps(state))
    assert back["t"] == 7 and back["a"] == {"x": [0.5, 0.5]}
    assert torch.equal(back["w"][0], state["w"][0]) and back["w"][0].dtype == torch.float32


def test_a_streamed_snapshot_is_the_same_file_and_never_holds_the_state_twice(tmp_path) -> None:
    """The journal streams a snapshot into its file and reads it back tensor by tensor: the
    bytes are `snapshot_bytes`'s (files written either way read either way), and neither way
    holds a second copy of a large state (a real-size fleet's is hundreds of MB)."""
    bases = {f"agent-{i}": torch.randn(500_000) for i in range(20)}  # 2 MB each, 40 MB in all
    state = {"strategy": {"bases": bases, "empty": torch.zeros(0), "step": torch.tensor(3),
                          "flags": torch.tensor([True, False]), "half": torch.ones(3, dtype=torch.float16)},
             "agents": {"a": {"last_reply": b"\x01" * 300, "recent": ["m1", "m2"], "epoch": 7}},
             "counters": {"applied.update": 2}, 3: (None, 0.5, "x")}
    into = io.BytesIO()
    snapshot_writer(state)(into)
    assert into.getvalue() == snapshot_bytes(state)
    j = Journal(tmp_path, fsync=False)
    j.load()
    tracemalloc.start()
    try:
        j.snapshot(state)
        _, wrote_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        back = read_snapshot(tmp_path / "snapshot-1.msgpack")
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert wrote_peak < 4e6, wrote_peak  # built in memory, it was three copies of the 40 MB
    # The state itself, and the largest tensor twice while it is read (the whole file read,
    # parsed, then converted was 3.7 copies).
    assert read_peak < 1.5 * 40e6, read_peak
    assert all(torch.equal(back["strategy"]["bases"][a], v) for a, v in bases.items()) and back["strategy"]["half"].dtype == torch.float16
    assert back["agents"] == state["agents"] and back[3] == [None, 0.5, "x"]


def test_records_stream_into_the_journal_as_framed_before_and_an_unwritable_one_writes_nothing(tmp_path) -> None:
    """An upload's record (a real-size model's vector and reply: 12 MB for MobileNetV3-small) goes
    to the file without being built as bytes, in the frames `_frame(dumps(...))` makes; a record
    that cannot be serialized fails the append before any byte is written."""
    records = [{"op": "update", "vector": torch.randn(2_500_000), "alpha": [0.5, 0.5]},  # 10 MB
               {"op": "update", "vector": torch.randn(2_500_000), "sent": torch.randn(10), "note": None}]
    j = Journal(tmp_path, fsync=False)
    j.load()
    j.snapshot({"t": 0})
    tracemalloc.start()
    try:
        j.append(records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4e6, peak  # framed as bytes first, the two records were 4 copies of 20 MB
    log = tmp_path / "journal-1.log"
    assert log.read_bytes() == JOURNAL_MAGIC + b"".join(_frame(dumps(r)) for r in records)
    size = log.stat().st_size
    with pytest.raises(TypeError):
        j.append([{"op": "join", "agent": "a"}, {"op": "update", "vector": object()}])
    assert log.stat().st_size == size
    j.close()
    assert [r["op"] for r in Journal(tmp_path).load()[1]] == ["update", "update"]


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


def test_torn_tail_is_dropped_and_appends_continue(tmp_path, caplog) -> None:
    j = Journal(tmp_path)
    j.load()
    j.snapshot({"t": 0})
    j.append([{"i": 1}, {"i": 2}])
    j.close()
    log = next(tmp_path.glob("journal-*.log"))
    frame = _frame(dumps({"i": 99, "pad": b"x" * 40}))
    for cut in (5, 12, len(frame) - 1):  # mid-header, header only, all but the last byte
        data = log.read_bytes()
        log.write_bytes(data + frame[:cut])  # a crash mid-write (never acknowledged)
        j2 = Journal(tmp_path)
        _, recs = j2.load()
        assert [r["i"] for r in recs] == [1, 2] and not j2.needs_snapshot
        assert log.read_bytes() == data and "journal.torn_tail" in caplog.text
    log.write_bytes(log.read_bytes() + bytes(300))  # zeros a crash left in an allocated block
    assert [r["i"] for r in Journal(tmp_path).load()[1]] == [1, 2]
    j2 = Journal(tmp_path)
    j2.load()
    j2.append([{"i": 3}])
    j2.close()
    assert [r["i"] for r in Journal(tmp_path).load()[1]] == [1, 2, 3]


def _two_generations(folder) -> int:
    """snapshot-1 {sum 0} + journal-1 (1, 2, 3); snapshot-2 {sum 6} + journal-2 (4, 5, 6)."""
    j = Journal(folder)
    j.load()
    total = 0
    for gen in range(2):
        j.snapshot({"sum": total})
        for i in range(1 + 3 * gen, 4 + 3 * gen):
            j.append([{"i": i, "v": torch.full((3,), float(i))}])
            total += i
    j.close()
    return total


def _state_sum(snapshot, records) -> int:
    return snapshot["sum"] + sum(r["i"] for r in records)


def test_a_flipped_bit_anywhere_is_recovered_exactly_or_refused_by_name(tmp_path) -> None:
    """Every byte of every file of a small state dir, one bit flipped at a time: the load
    either gives the state it had (a damaged snapshot falls back to the one before plus the
    later journals) or stops with JournalCorrupt naming the file, and changes nothing."""
    pristine = tmp_path / "pristine"
    expected = _two_generations(pristine)
    files = {p.name: p.read_bytes() for p in sorted(pristine.iterdir())}
    assert sorted(files) == ["journal-1.log", "journal-2.log", "snapshot-1.msgpack", "snapshot-2.msgpack"]
    outcomes = {"exact": 0, "refused": 0}
    work = tmp_path / "work"
    for name, blob in files.items():
        for pos in range(len(blob)):
            if work.exists():
                shutil.rmtree(work)
            shutil.copytree(pristine, work)
            damaged = bytearray(blob)
            damaged[pos] ^= 1 << (pos % 8)
            (work / name).write_bytes(bytes(damaged))
            before = {p.name: p.read_bytes() for p in work.iterdir()}
            try:
                snap, recs = Journal(work).load()
            except JournalCorrupt as e:
                assert name in str(e) and "nothing was changed" in str(e), (name, pos, str(e))
                assert {p.name: p.read_bytes() for p in work.iterdir()} == before, (name, pos)
                outcomes["refused"] += 1
                continue
            assert _state_sum(snap, recs) == expected, (name, pos)  # never a silent loss
            outcomes["exact"] += 1
    # Damage the newest generation does not read (snapshot-1, journal-1) or a damaged newest
    # snapshot (fallback) recovers exactly; damage in the journal it replays is refused.
    assert outcomes["refused"] == len(files["journal-2.log"])
    assert outcomes["exact"] == sum(len(b) for n, b in files.items() if n != "journal-2.log")


def test_damage_is_refused_unless_accepted_then_only_the_damaged_record_is_lost(tmp_path, caplog) -> None:
    expected = _two_generations(tmp_path)
    log = tmp_path / "journal-2.log"
    data = bytearray(log.read_bytes())
    record = scan_journal(log)
    assert [r["i"] for r in record.records] == [4, 5, 6]
    second = len(data) // 2  # inside record 5
    data[second] ^= 0x10
    log.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=r"journal-2\.log is damaged at byte \d+ \(record 1;.*--accept-journal-loss"):
        Journal(tmp_path).load()
    assert log.read_bytes() == bytes(data)

    j = Journal(tmp_path, accept_loss=True)
    snap, recs = j.load()
    assert [r["i"] for r in recs] == [4, 6] and _state_sum(snap, recs) == expected - 5
    (lost,) = [r for r in caplog.records if r.getMessage() == "journal.records_lost"]
    assert j.needs_snapshot and lost.fields["file"] == str(log) and "before record 1" in lost.fields["damaged"]
    j.snapshot({"sum": _state_sum(snap, recs)})  # what Engine.recover does next
    j.set_aside_damaged()
    j.close()
    assert (tmp_path / "journal-2.log.damaged").read_bytes() == bytes(data)  # kept aside, as it was
    assert Journal(tmp_path).load() == ({"sum": expected - 5}, [])  # no flag needed any more


def test_garbage_journal_and_journal_without_snapshot_are_refused(tmp_path) -> None:
    _two_generations(tmp_path)
    (tmp_path / "journal-2.log").write_bytes(b"garbage from the first byte on" * 10)
    with pytest.raises(JournalCorrupt, match="journal-2.log is damaged at byte 0"):
        Journal(tmp_path).load()
    for snap in tmp_path.glob("snapshot-*"):
        snap.unlink()
    with pytest.raises(JournalCorrupt, match="has journals but no snapshot"):
        Journal(tmp_path).load()


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
    j2 = Journal(tmp_path)
    snap, recs = j2.load()
    assert snap == {"t": 0}
    assert [r["i"] for r in recs] == [1, 2]
    assert j2.needs_snapshot  # the caller snapshots at once; the damaged file is kept aside
    j2.snapshot({"t": 2})
    j2.set_aside_damaged()
    assert (tmp_path / f"{newest.name}.damaged").read_bytes() == b"\xc1garbage"
    assert Journal(tmp_path).load() == ({"t": 2}, [])


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


@pytest.mark.parametrize("rule", ["alpha", "delta"])
def test_replay_reuses_the_journaled_reply_instead_of_training_it_again(tmp_path, rule) -> None:
    """A trained reply (CDFL finetune) is journaled with its record: recovery re-encodes it
    and trains nothing, and the agent's base and cached reply come out identical. The delta
    rule moves the clusters by v - base: replay must see the same base as the live engine."""
    from aggregator.bootstrap import build_engine
    from aggregator.engine import Inbound
    from fedmq import codecs, protocol, sketch
    from fedmq.config import load_config
    from fedmq.data import load_dataset
    from fedmq.models import model_spec
    from fedmq.sketch import data_sketch

    spec = model_spec("digits-cnn")
    # Speed only: small server sets; the defaults start the aggregator in test_documented_commands.
    cfg = load_config(None, {"fleet": "j", "cdfl.clusters": 2, "data.dataset": "digits",
                             "data.proxy_per_cluster": 100, "data.pretrain_per_cluster": 200,
                             "aggregator.pretrain_epochs": 1, "device": "cpu",
                             "aggregator.state_dir": str(tmp_path / "state"),
                             "cdfl.personalization": "finetune", "cdfl.personalize_epochs": 2,
                             "cdfl.update_rule": rule})
    live = build_engine(cfg)
    live.recover()
    base = None
    join = protocol.Join(agent="car-1", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                         model=spec.hash, algorithm="cdfl")
    (reply,) = live.handle([Inbound("car-1", join)])
    base = codecs.decode(reply.tensors[0])
    rng = np.random.default_rng(0)
    sketches = []
    for i in range(3):
        v = base + rng.normal(0, 0.01, spec.numel).astype(np.float32)
        sk = data_sketch(load_dataset("digits").x[i * 50:(i + 1) * 50]).astype("<f2").tobytes()
        sketches.append(sk)
        up = protocol.Update(agent="car-1", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             model=spec.hash, tau=reply.epoch, n_samples=100,
                             tensor=codecs.encode(v, "int8", base=base), sketch=sk,
                             sketch_method=sketch.METHOD)
        (reply,) = live.handle([Inbound("car-1", up)])
        base = codecs.decode(reply.tensors[0], base=base)
    live.journal.close()

    restarted = build_engine(cfg)
    calls, replayed = [], []
    personalize = restarted.strategy.personalizer.personalize
    restarted.strategy.personalizer.personalize = lambda req: calls.append(1) or personalize(req)
    apply = restarted.strategy.apply
    restarted.strategy.apply = lambda u, *a, **k: replayed.append(u) or apply(u, *a, **k)
    assert restarted.recover() == 4
    assert calls == []  # nothing trained again
    # every field of the live Upload comes back, the data sketch included (a strategy that
    # read it would otherwise compute something else after a crash)
    assert [u.sketch.astype("<f2").tobytes() for u in replayed] == sketches
    a, b = live.agents["car-1"], restarted.agents["car-1"]
    assert torch.equal(a.base, b.base) and np.array_equal(b.base.numpy(), base)
    ra, rb = protocol.decode(a.last_reply, 1 << 24), protocol.decode(b.last_reply, 1 << 24)
    assert (ra.tensors, ra.alpha, ra.epoch, ra.in_reply_to) == (rb.tensors, rb.alpha, rb.epoch, rb.in_reply_to)
    assert all(torch.equal(x, y) for x, y in zip(live.strategy.clusters, restarted.strategy.clusters, strict=True))


def test_the_journal_counts_its_bytes_as_they_lie_on_disk_across_restarts(tmp_path) -> None:
    j = Journal(tmp_path)
    j.load()
    j.snapshot({"t": torch.zeros(1000)})
    assert (j.bytes_since_snapshot, j.snapshot_size) == (0, (tmp_path / "snapshot-1.msgpack").stat().st_size)
    j.append([{"i": 1, "v": torch.ones(500)}])
    j.append([{"i": 2}, {"i": 3, "v": torch.ones(10)}])
    on_disk = (tmp_path / "journal-1.log").stat().st_size
    assert j.bytes_since_snapshot == on_disk > 2000
    j.close()
    again = Journal(tmp_path)
    again.load()
    assert (again.bytes_since_snapshot, again.snapshot_size) == (on_disk, j.snapshot_size)
    again.snapshot({"t": 1})
    assert again.bytes_since_snapshot == 0 and again.snapshot_size == (tmp_path / "snapshot-2.msgpack").stat().st_size


@pytest.mark.parametrize("ratio", [1.0, 0.0])
def test_a_journal_grown_to_the_snapshots_size_is_snapshotted_and_recovers_exactly(tmp_path, ratio) -> None:
    """Large records (a real-size model's upload and reply) would otherwise fill the state dir
    for snapshot_every uploads; at ratio 0 only the record count snapshots."""
    from aggregator.bootstrap import build_engine
    from aggregator.engine import Inbound
    from fedmq import codecs, protocol
    from fedmq.config import load_config
    from fedmq.models import model_spec

    spec = model_spec("digits-cnn")
    state = tmp_path / "state"
    # Speed only: small server sets. The 64 MB floor is lowered: a digits model's journal would
    # need thousands of uploads to reach it (the ratio itself keeps its default, 1.0).
    cfg = load_config(None, {"fleet": "j", "cdfl.clusters": 2, "data.dataset": "digits",
                             "data.proxy_per_cluster": 100, "data.pretrain_per_cluster": 200,
                             "aggregator.pretrain_epochs": 1, "device": "cpu",
                             "aggregator.state_dir": str(state), "aggregator.snapshot_journal_min_mb": 0,
                             **({} if ratio else {"aggregator.snapshot_journal_ratio": 0})})
    assert cfg.aggregator.snapshot_every == 200  # the default: never reached below
    live = build_engine(cfg)
    live.recover()
    join = protocol.Join(agent="car-1", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                         model=spec.hash, algorithm="cdfl")
    (reply,) = live.handle([Inbound("car-1", join)])
    base = codecs.decode(reply.tensors[0])
    rng = np.random.default_rng(0)
    largest = record = seen = 0
    for _ in range(12):
        v = base + rng.normal(0, 0.01, spec.numel).astype(np.float32)
        up = protocol.Update(agent="car-1", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             model=spec.hash, tau=reply.epoch, n_samples=100,
                             tensor=codecs.encode(v, "int8", base=base))
        (reply,) = live.handle([Inbound("car-1", up)])
        base = codecs.decode(reply.tensors[0], base=base)
        j = live.journal
        record = max(record, j.bytes_since_snapshot - seen)
        live.snapshot_if_due()
        seen = j.bytes_since_snapshot
        if ratio:
            assert j.bytes_since_snapshot < j.snapshot_size  # else it would have snapshotted
        largest = max(largest, sum(p.stat().st_size for p in state.iterdir()))
    generations = live.journal.generation
    live.journal.close()
    peak = live.journal.peak_bytes
    assert peak >= largest  # it measures while a snapshot is written, as well as after appends
    if ratio:  # two generations kept (the older a fallback), each a snapshot and its journal,
        # and a third snapshot while it is written
        assert generations >= 3 and peak <= 5 * live.journal.snapshot_size + 2 * record
    else:
        assert generations == 1 and live.journal.bytes_since_snapshot > 2 * live.journal.snapshot_size
    restarted = build_engine(cfg)
    restarted.recover()
    assert all(torch.equal(a, b) for a, b in zip(live.strategy.server_models(), restarted.strategy.server_models(),
                                                  strict=True))
    assert torch.equal(live.agents["car-1"].base, restarted.agents["car-1"].base)
