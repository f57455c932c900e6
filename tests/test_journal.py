"""Aggregator durability: snapshots, the write-ahead journal, torn tails, unwritable dirs."""

from __future__ import annotations

import os

import numpy as np
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


@pytest.mark.parametrize("rule", ["alpha", "delta"])
def test_replay_reuses_the_journaled_reply_instead_of_training_it_again(tmp_path, rule) -> None:
    """A trained reply (CDFL finetune) is journaled with its record: recovery re-encodes it
    and trains nothing, and the agent's base and cached reply come out identical. The delta
    rule moves the clusters by v - base: replay must see the same base as the live engine."""
    from aggregator.bootstrap import build_engine
    from aggregator.engine import Inbound
    from fedmq import codecs, protocol
    from fedmq.config import load_config
    from fedmq.models import model_spec

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
    for _ in range(3):
        v = base + rng.normal(0, 0.01, spec.numel).astype(np.float32)
        up = protocol.Update(agent="car-1", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             model=spec.hash, tau=reply.epoch, n_samples=100,
                             tensor=codecs.encode(v, "int8", base=base))
        (reply,) = live.handle([Inbound("car-1", up)])
        base = codecs.decode(reply.tensors[0], base=base)
    live.journal.close()

    restarted = build_engine(cfg)
    calls = []
    personalize = restarted.strategy.personalizer.personalize
    restarted.strategy.personalizer.personalize = lambda req: calls.append(1) or personalize(req)
    assert restarted.recover() == 4
    assert calls == []  # nothing trained again
    a, b = live.agents["car-1"], restarted.agents["car-1"]
    assert torch.equal(a.base, b.base) and np.array_equal(b.base.numpy(), base)
    ra, rb = protocol.decode(a.last_reply, 1 << 24), protocol.decode(b.last_reply, 1 << 24)
    assert (ra.tensors, ra.alpha, ra.epoch, ra.in_reply_to) == (rb.tensors, rb.alpha, rb.epoch, rb.in_reply_to)
    assert all(torch.equal(x, y) for x, y in zip(live.strategy.clusters, restarted.strategy.clusters, strict=True))
