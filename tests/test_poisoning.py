"""Model-poisoning guards of the aggregator's engine (policy: docs/reliability.md).

Each guard is shown to refuse with its reason code and to leave the cluster models, the
epoch and the journal untouched: NaN/Inf values, a wrong model spec or shape, a step above
the absolute `norm_bound`, a step far above the fleet's (`norm_factor` x the median of the
latest applied steps, after `norm_warmup`; on by default), and an update that makes the
model worse on the proxy data (`loss_margin`). The fleet-relative window survives a restart.
soak/poisoning.py measures what they buy against a fleet with 10 % attackers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.engine import Engine
from fedmq import codecs, protocol
from fedmq.config import load_config
from fedmq.models import model_spec
from tests.engine_client import EngineClient

SPEC = model_spec("digits-cnn")
# Speed only: small server sets; the defaults start the aggregator in test_documented_commands.
SMALL = {"fleet": "p", "cdfl.clusters": 2, "data.dataset": "digits", "data.proxy_per_cluster": 100,
         "data.pretrain_per_cluster": 200, "aggregator.pretrain_epochs": 1, "device": "cpu",
         "aggregator.accuracy_every": 0}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    state = tmp_path_factory.mktemp("poison") / "state"
    engine = build_engine(load_config(None, {**SMALL, "aggregator.state_dir": str(state)}))
    engine.recover()
    engine.journal.close()
    return state


def make_engine(pretrained: Path, tmp_path: Path, **extra) -> Engine:
    state = tmp_path / "state"
    if not state.exists():
        shutil.copytree(pretrained, state)
    engine = build_engine(load_config(None, {**SMALL, "aggregator.state_dir": str(state), **extra}))
    engine.recover()
    return engine


class Client(EngineClient):
    """An agent of `engine` whose every reply must be a model (a refusal fails the test)."""

    def __init__(self, engine: Engine, agent: str) -> None:
        super().__init__(engine, agent, SPEC)

    def install(self, reply: protocol.Envelope) -> bool:
        assert super().install(reply), reply
        return True

    def step(self, size: float, seed: int) -> protocol.Update:
        """An update `size` away from the held model (a random direction)."""
        d = np.random.default_rng(seed).normal(size=SPEC.numel).astype(np.float32)
        v = self.base + size * d / np.linalg.norm(d)
        return self.update(codecs.encode(v, "fp32", base=self.base))


def fingerprint(engine: Engine) -> tuple:
    clusters = [c.clone() for c in engine.strategy.state_dict()["clusters"]]
    return clusters, engine.strategy.uploads_applied, engine.journal.records_since_snapshot


def assert_unchanged(before: tuple, engine: Engine) -> None:
    clusters, epoch, records = fingerprint(engine)
    assert all(torch.equal(a, b) for a, b in zip(before[0], clusters, strict=True))
    assert (epoch, records) == before[1:]


def refused(reply: protocol.Envelope, reason: str) -> bool:
    return isinstance(reply, protocol.Error) and reply.reason == reason


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(pretrained, tmp_path, value) -> None:
    engine = make_engine(pretrained, tmp_path)
    c = Client(engine, "car-1")
    before = fingerprint(engine)
    vec = c.base.copy()
    vec[123] = value
    wire = codecs.encode(np.zeros(SPEC.numel, np.float32), "fp32", zstd=False)
    wire["data"] = vec.tobytes()  # no codec emits a non-finite value; a hostile sender can
    reply = c.send(c.update(wire))
    assert refused(reply, "codec_not_finite"), reply
    assert_unchanged(before, engine)
    assert engine.counters["rejected.codec_not_finite"] == 1


def test_wrong_spec_and_shape_are_refused(pretrained, tmp_path) -> None:
    engine = make_engine(pretrained, tmp_path)
    c = Client(engine, "car-2")
    before = fingerprint(engine)
    ok = codecs.encode(c.base, "fp32")
    assert refused(c.send(c.update(ok, model="f" * 16)), "wrong_model")
    assert refused(c.send(c.update(codecs.encode(np.zeros(SPEC.numel + 1, np.float32), "fp32"))),
                   "wrong_shape")
    assert refused(c.send(c.update(ok, tau=c.epoch + 5)), "bad_tau")
    assert_unchanged(before, engine)
    assert isinstance(c.send(c.update(ok)), protocol.Model)  # the probe itself is acceptable


def test_absolute_norm_bound(pretrained, tmp_path) -> None:
    engine = make_engine(pretrained, tmp_path, **{"aggregator.norm_bound": 5.0})
    c = Client(engine, "car-3")
    before = fingerprint(engine)
    reply = c.send(c.step(50.0, seed=1))
    assert refused(reply, "norm_bound") and "above the bound 5" in reply.detail
    assert_unchanged(before, engine)
    c.install(c.send(c.step(1.0, seed=2)))
    assert engine.counters["applied.update"] == 1


def test_fleet_relative_norm_guard_after_warmup_and_across_restart(pretrained, tmp_path) -> None:
    knobs = {"aggregator.norm_factor": 10.0, "aggregator.norm_warmup": 6, "aggregator.norm_window": 50}
    engine = make_engine(pretrained, tmp_path, **knobs)
    fleet = [Client(engine, f"car-{i}") for i in range(3)]
    # Before the warm-up the fleet has no scale yet: a large step is applied (documented).
    fleet[0].install(fleet[0].send(fleet[0].step(3.0, seed=99)))
    for i in range(6):  # the fleet's normal steps: about 1.0
        c = fleet[i % 3]
        c.install(c.send(c.step(1.0 + 0.05 * i, seed=i)))
    assert len(engine.accepted_norms) == 7
    median = engine.accepted_norms.median()
    assert median == pytest.approx(1.15, abs=0.05)

    attacker = fleet[1]
    before = fingerprint(engine)
    reply = attacker.send(attacker.step(100.0 * median, seed=7))
    assert refused(reply, "norm_outlier"), reply
    assert "median step" in reply.detail
    assert refused(attacker.send(attacker.step(10.5 * median, seed=8)), "norm_outlier")
    assert_unchanged(before, engine)
    assert engine.counters["rejected.norm_outlier"] == 2
    # Within the factor is applied, and enters the window.
    attacker.install(attacker.send(attacker.step(5.0 * median, seed=9)))
    assert len(engine.accepted_norms) == 8

    # A restart (journal replay) rebuilds the same window, so the guard holds the same line.
    window = engine.accepted_norms.state()
    engine.journal.close()
    again = make_engine(pretrained, tmp_path, **knobs)
    assert again.accepted_norms.state() == window
    attacker.engine = again
    assert refused(attacker.send(attacker.step(100.0 * median, seed=10)), "norm_outlier")


def test_one_agents_flood_of_large_allowed_steps_does_not_raise_the_bar_for_it(pretrained, tmp_path) -> None:
    """The attacker first uploads many steps just under the factor (each allowed), which would
    drag a plain median of the window up to its own size; counting at most 3 of any agent's
    steps, the honest agents' steps still set the median and its boosted step is refused."""
    knobs = {"aggregator.norm_factor": 4.0, "aggregator.norm_warmup": 6, "aggregator.norm_window": 50}
    engine = make_engine(pretrained, tmp_path, **knobs)
    honest = [Client(engine, f"car-{i}") for i in range(3)]
    for i in range(6):
        c = honest[i % 3]
        c.install(c.send(c.step(1.0, seed=i)))
    attacker = Client(engine, "car-9")
    for i in range(12):
        attacker.install(attacker.send(attacker.step(3.5, seed=100 + i)))
    plain = float(np.median([d for _, d in engine.accepted_norms.recent]))
    assert plain > 3.0  # what the guard would have used before the per-agent cap
    assert engine.accepted_norms.median() < 2.0
    assert refused(attacker.send(attacker.step(10.0, seed=200)), "norm_outlier")


def test_fleet_relative_guard_is_on_by_default(pretrained, tmp_path) -> None:
    """As shipped (norm_factor 4, warm-up 10): ten normal steps, then a 500x one is refused."""
    engine = make_engine(pretrained, tmp_path)
    assert (engine.cfg.aggregator.norm_factor, engine.cfg.aggregator.norm_warmup) == (4.0, 10)
    c = Client(engine, "car-9")
    for i in range(10):
        c.install(c.send(c.step(1.0, seed=i)))
    before = fingerprint(engine)
    assert refused(c.send(c.step(500.0, seed=10)), "norm_outlier")
    assert_unchanged(before, engine)
    c.install(c.send(c.step(3.0, seed=11)))  # within 4x the median: applied
    assert engine.counters["applied.update"] == 11


def test_descent_guard_refuses_a_flipped_trained_update_and_keeps_the_honest_one(pretrained, tmp_path) -> None:
    """aggregator.loss_margin: an update that raises the best proxy loss by more than the
    margin is refused (`loss_outlier`), nothing changes; the honest update it came from is
    applied. Sign flips keep the norm, so only this guard sees them."""
    from fedmq.data import load_dataset
    from fedmq.training import fit

    engine = make_engine(pretrained, tmp_path, **{"aggregator.loss_margin": 1.0})
    c = Client(engine, "car-8")
    ds = load_dataset("digits")
    base = torch.from_numpy(c.base.copy())
    v = fit("digits-cnn", base, ds.x[:200], ds.y[:200], epochs=1, lr=0.05, seed=0).vector.numpy()
    flipped = c.base - 20.0 * (v - c.base)  # this barely trained fixture needs a big flip to hurt
    before = fingerprint(engine)
    reply = c.send(c.update(codecs.encode(flipped.astype(np.float32), "fp32", base=c.base)))
    assert refused(reply, "loss_outlier") and "best proxy loss" in reply.detail, reply
    assert_unchanged(before, engine)
    c.install(c.send(c.update(codecs.encode(v, "fp32", base=c.base))))
    assert engine.counters["applied.update"] == 1


def test_a_replayed_msg_id_is_never_applied_twice_however_much_has_passed(pretrained, tmp_path) -> None:
    """docs/protocol.md: a msg_id is applied at most once for the life of the state. An update,
    then more messages than the recent window remembers, then the same update again: refused
    `duplicate`, nothing applied; the high-water mark survives a restart."""
    from aggregator.engine import RECENT_MSG_IDS

    engine = make_engine(pretrained, tmp_path)
    c = Client(engine, "car-9")
    up = c.step(0.01, seed=1)
    c.install(c.send(up))
    for _ in range(RECENT_MSG_IDS + 1):  # each join is applied: `up` leaves the recent window
        c.install(c.send(protocol.Join(agent="car-9", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                       model=SPEC.hash, algorithm="cdfl")))
    before = fingerprint(engine)
    assert refused(c.send(up), "duplicate")
    assert_unchanged(before, engine)
    engine.snapshot_if_due(force=True)
    engine.journal.close()
    restarted = make_engine(pretrained, tmp_path)
    before = fingerprint(restarted)
    assert refused(_as(restarted, "car-9").send(up), "duplicate")
    assert_unchanged(before, restarted)
    assert restarted.counters["applied.update"] == 1


def _as(engine: Engine, agent: str) -> Client:
    """A Client of `engine` for `agent` that has not joined (its state is the engine's)."""
    c = Client.__new__(Client)
    c.engine, c.agent, c.spec, c.base, c.epoch = engine, agent, SPEC, None, 0
    return c
