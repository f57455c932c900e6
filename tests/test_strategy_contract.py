"""The contract every registered asynchronous strategy keeps, run over the registry itself.

For each name in bootstrap.ASYNC_STRATEGIES (so a new algorithm is covered by adding its
registry line): a real Engine with a journal takes joins and updates one message per batch
from two agents; after every record the state directory is copied, as a crash there would
leave it, and a fresh engine recovers from the copy. The recovered state (strategy, agents'
bases and cached replies, counters) must equal the live one bit for bit, and
state_dict -> load_state_dict must round-trip. FedBuff's buffer math is checked by hand.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from aggregator.bootstrap import ASYNC_STRATEGIES, build_engine
from aggregator.engine import Inbound
from aggregator.fedbuff import FedBuff, polynomial_staleness
from aggregator.strategy import Upload
from fedmq import codecs, protocol
from fedmq.algorithms import ASYNC_SERVER
from fedmq.config import load_config
from fedmq.models import model_spec

SPEC = model_spec("digits-cnn")


def same(a, b, where: str = "state") -> None:
    """Bit-identical nested state: tensors by torch.equal, arrays by array_equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, bytes):
        assert a == b, f"{where}: {len(a)} bytes differ from {len(b)} bytes"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def without_replies(state: dict) -> dict:
    """The engine state minus each agent's cached reply (compared decoded: a replayed reply is
    re-encoded with a fresh msg_id and sent_at, everything else must be equal)."""
    return {**state, "agents": {a: {k: v for k, v in r.items() if k != "last_reply"}
                                for a, r in state["agents"].items()}}


def reply_fields(raw: bytes) -> tuple:
    m = protocol.decode(raw, 1 << 24)
    return m.tensors, m.alpha, m.epoch, m.in_reply_to, m.kind


def config(algorithm: str, state_dir) -> object:
    # Small server sets and one pre-training epoch for speed (the defaults start the real
    # aggregator in test_documented_commands); snapshots every 4 records, so recovery
    # exercises both a snapshot and the journal after it.
    return load_config(None, {"fleet": "c", "cdfl.clusters": 2, "data.dataset": "digits",
                              "data.proxy_per_cluster": 60, "data.pretrain_per_cluster": 120,
                              "aggregator.pretrain_epochs": 1, "device": "cpu",
                              "aggregator.algorithm": algorithm, "fedbuff.buffer_size": 3,
                              "aggregator.snapshot_every": 4, "aggregator.state_dir": str(state_dir)})


def join(agent: str, algorithm: str) -> protocol.Join:
    return protocol.Join(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                         model=SPEC.hash, algorithm=algorithm)


def update_for(engine, agent: str, rng: np.random.Generator, k: int) -> protocol.Update:
    rec = engine.agents[agent]
    start = rec.base.numpy() if rec.base is not None else \
        engine.strategy.state_dict()["clusters"][0].numpy()
    v = start + rng.normal(0, 0.02, SPEC.numel).astype(np.float32)
    delta = rec.base is not None
    alpha = None
    if engine.strategy.name == "fedsoft-async":
        alpha = list(np.full(k, 1.0 / k))
    return protocol.Update(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                           model=SPEC.hash, tau=rec.base_epoch, n_samples=50,
                           tensor=codecs.encode(v, "int8", base=start if delta else None),
                           alpha=alpha)


@pytest.mark.parametrize("algorithm", list(ASYNC_STRATEGIES))
def test_crash_after_every_record_recovers_the_live_state_bit_for_bit(algorithm, tmp_path) -> None:
    live = build_engine(config(algorithm, tmp_path / "live"))
    live.recover()
    rng = np.random.default_rng(0)
    plan = [("car-1", "join"), ("car-2", "join")] + [("car-1" if i % 3 else "car-2", "update")
                                                     for i in range(6)]
    crashes = []
    for i, (agent, kind) in enumerate(plan):
        env = join(agent, algorithm) if kind == "join" else update_for(live, agent, rng, 2)
        (reply,) = live.handle([Inbound(agent, env)])
        assert isinstance(reply, protocol.Model), f"{algorithm}: {reply}"
        live.snapshot_if_due()
        crash = tmp_path / f"crash-{i}"
        shutil.copytree(tmp_path / "live", crash)  # the disk as a kill -9 here leaves it
        crashes.append((crash, live.state_dict(), {a: r.last_reply for a, r in live.agents.items()}))
    for crash, state, replies in crashes:
        again = build_engine(config(algorithm, crash))
        again.recover()
        same(without_replies(state), without_replies(again.state_dict()), f"{algorithm} after {crash.name}")
        assert {a: reply_fields(r.last_reply) for a, r in again.agents.items()} == \
            {a: reply_fields(raw) for a, raw in replies.items()}, f"{algorithm} after {crash.name}: replies"
        again.journal.close()
    # state_dict round trip on the strategy alone
    fresh = build_engine(config(algorithm, tmp_path / "fresh"))
    fresh.strategy.load_state_dict(live.strategy.state_dict())
    same(live.strategy.state_dict(), fresh.strategy.state_dict(), f"{algorithm} round trip")


def test_the_registry_covers_the_kernel_names() -> None:
    assert tuple(ASYNC_STRATEGIES) == ASYNC_SERVER and "fedbuff" in ASYNC_SERVER


def test_fedbuff_buffers_k_weighted_deltas_then_steps_by_their_mean() -> None:
    w0 = torch.zeros(SPEC.numel)
    s = FedBuff(SPEC, w0, buffer_size=2, server_lr=0.5, staleness_exponent=0.5, staleness_cap=0)
    one, two = torch.full((SPEC.numel,), 1.0), torch.full((SPEC.numel,), 3.0)
    r = s.apply(Upload("a", one, tau=0, base=w0))
    assert r.info == {"staleness": 1, "uploads_since": 1, "stale": False, "s": 2 ** -0.5,
                      "flushed": False, "version": 0}
    assert torch.equal(r.vectors[0], w0)  # a partly filled buffer is not in the model yet
    r = s.apply(Upload("b", two, tau=0, base=w0))  # staleness 2: s = 3^-0.5
    expected = 0.5 * (2 ** -0.5 * 1.0 + 3 ** -0.5 * 3.0) / 2
    assert r.info["flushed"] and r.info["version"] == 1
    assert torch.allclose(r.vectors[0], torch.full((SPEC.numel,), expected))
    assert s.buffered == 0 and float(s.buffer.abs().sum()) == 0.0
    assert polynomial_staleness(0, 0.5) == 1.0 and polynomial_staleness(3, 1.0) == 0.25
    with pytest.raises(ValueError, match="fedbuff.buffer_size"):
        FedBuff(SPEC, w0, buffer_size=0)


@pytest.mark.parametrize("algorithm", ["catafed", "catafed-random", "fedavg", "fedprox", "tifl"])
def test_round_strategies_resume_from_their_snapshot_exactly(algorithm) -> None:
    """Every registered round strategy (RoundService snapshots its state() after each round):
    a strategy restored from the snapshot of round 3 selects, aggregates and snapshots exactly
    as the live one over the next rounds, random draws included."""
    from aggregator.catafed import RoundResult
    from aggregator.round_algorithms import STRATEGIES, make_round_strategy
    from fedmq.config import CataFedSettings, FedAvgSettings

    assert set(STRATEGIES) == {"catafed", "fedavg", "fedprox", "tifl"}
    name = algorithm.removesuffix("-random")
    settings = CataFedSettings(groups=2, per_group=2, selection="random" if "random" in algorithm else "pf")
    fedavg = FedAvgSettings(clients_per_round=2)
    w0 = torch.zeros(6)

    def strategy():
        s = make_round_strategy(name, settings, w0, seed=7, fedavg=fedavg)
        for i in range(6):
            s.register(f"a{i}", 50 + 40 * i)
        return s

    def play(s, rounds: int) -> list:
        out = []
        for _ in range(rounds):
            plan = s.open_round()
            for j, a in enumerate(plan.selected):  # everyone reports: a silent agent would
                # re-enter the pool on the restored side (presence is re-learned after a restart)
                s.accept(RoundResult(a, plan.round, True, 10 + j, 10, w0 + plan.round + j,
                                     None, {"accuracy": 0.5}, 1.0 + int(a[1:])))
            out.append((plan.selected, s.close_round().weights, s.vector.clone()))
        return out

    live = strategy()
    play(live, 3)
    snapshot = live.state()
    restored = strategy()
    restored.load_state(snapshot)
    for a in restored.agents:  # presence comes back from the retained statuses
        restored.set_online(a, True)
    ahead, again = play(live, 4), play(restored, 4)
    for (sel_a, w_a, v_a), (sel_b, w_b, v_b) in zip(ahead, again, strict=True):
        assert sel_a == sel_b and w_a == w_b and torch.equal(v_a, v_b)
    assert restored.state() == live.state()
