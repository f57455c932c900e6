"""Model-poisoning guards of the aggregator's engine (policy: docs/reliability.md).

What cannot be honest is refused with its reason code, leaving the cluster models, the epoch
and the journal untouched: NaN/Inf values, a wrong model spec or shape, a delta against a
model the aggregator does not keep, and (opt-in) an update that makes the model worse on the
proxy data (`loss_margin`). A long step is not refused but scaled down to the bound and
applied: the absolute `norm_bound`, and `norm_factor` x the fleet's typical step (on by
default, after `norm_warmup`), whose scale survives a restart and cannot collapse under a
burst of tiny steps. soak/poisoning.py measures what they buy against a fleet with 10 %
attackers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.engine import Engine, NotFinite
from fedmq import codecs, protocol
from fedmq.config import CDFLSettings, load_config
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


@pytest.mark.parametrize("size", [1e20, 3e38])
def test_finite_values_that_overflow_a_model_raise_not_finite_before_the_journal(pretrained, tmp_path, size) -> None:
    """No codec check can refuse 1e20 (it is finite); the models it makes are not. The engine
    raises NotFinite before journaling, and a recovery leaves the state as it was."""
    engine = make_engine(pretrained, tmp_path)
    c = Client(engine, "car-9")
    before = fingerprint(engine)
    vec = c.base.copy()
    vec[::2] = size
    with pytest.raises(NotFinite) as caught:
        c.send(c.update(codecs.encode(vec, "fp32", base=c.base)))
    assert caught.value.reason == "not_finite" and "car-9" in caught.value.detail
    engine.recover()
    assert_unchanged(before, engine)
    c.install(c.send(c.step(1.0, seed=3)))  # the agent carries on
    assert engine.counters["applied.update"] == 1


def test_a_step_float32_cannot_measure_is_bounded_along_its_direction(pretrained, tmp_path) -> None:
    """A step of 3e38 has a float32 norm of inf: measured in float64 it is scaled to the
    absolute bound along its own direction (not to nothing) and applied."""
    engine = make_engine(pretrained, tmp_path, **{"aggregator.norm_bound": 5.0})
    c = Client(engine, "car-10")
    before = fingerprint(engine)[0]
    vec = c.base.copy()
    vec[7] = 3e38
    c.install(c.send(c.update(codecs.encode(vec, "fp32", base=c.base))))
    assert applied_step(engine) == pytest.approx(5.0, rel=1e-4)
    assert engine.counters["bounded.norm_bound"] == 1
    moved = max(float(abs(b[7] - a[7])) for a, b in zip(before, fingerprint(engine)[0], strict=True))
    assert moved > 1.0  # cluster updates take the step's share; a zeroed step moves ~1e-2


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


def applied_step(engine: Engine) -> float:
    """The length of the step the engine applied last (what entered the fleet's window)."""
    return engine.accepted_norms.recent[-1][1]


def test_absolute_norm_bound_scales_a_long_step_down(pretrained, tmp_path) -> None:
    engine = make_engine(pretrained, tmp_path, **{"aggregator.norm_bound": 5.0})
    c = Client(engine, "car-3")
    c.install(c.send(c.step(50.0, seed=1)))
    assert applied_step(engine) == pytest.approx(5.0, rel=1e-4)
    assert engine.counters["bounded.norm_bound"] == 1
    c.install(c.send(c.step(1.0, seed=2)))  # within the bound: applied as sent
    assert applied_step(engine) == pytest.approx(1.0, rel=1e-4)
    assert engine.counters["applied.update"] == 2 and engine.counters["bounded.norm_bound"] == 1


def test_fleet_relative_bound_after_warmup_and_across_restart(pretrained, tmp_path) -> None:
    knobs = {"aggregator.norm_factor": 10.0, "aggregator.norm_warmup": 6, "aggregator.norm_window": 50}
    engine = make_engine(pretrained, tmp_path, **knobs)
    fleet = [Client(engine, f"car-{i}") for i in range(3)]
    # Before the warm-up the fleet has no scale yet: a large step is applied as sent (documented).
    fleet[0].install(fleet[0].send(fleet[0].step(3.0, seed=99)))
    for i in range(6):  # the fleet's normal steps: about 1.0
        c = fleet[i % 3]
        c.install(c.send(c.step(1.0 + 0.05 * i, seed=i)))
    assert len(engine.accepted_norms) == 7
    scale = engine.accepted_norms.scale()
    assert scale == pytest.approx(1.15, abs=0.05)

    attacker = fleet[1]
    epoch = engine.strategy.uploads_applied
    attacker.install(attacker.send(attacker.step(100.0 * scale, seed=7)))
    assert applied_step(engine) == pytest.approx(10.0 * scale, rel=1e-3)
    assert engine.counters["bounded.norm_outlier"] == 1
    assert engine.strategy.uploads_applied == epoch + 1
    attacker.install(attacker.send(attacker.step(5.0 * scale, seed=9)))  # within the factor: as sent
    assert applied_step(engine) == pytest.approx(5.0 * scale, rel=1e-3)
    assert engine.counters["bounded.norm_outlier"] == 1

    # A restart (journal replay) rebuilds the same window and floor: the same bound.
    window, bound = engine.accepted_norms.state(), engine.step_bound()
    engine.journal.close()
    again = make_engine(pretrained, tmp_path, **knobs)
    assert again.accepted_norms.state() == window and again.step_bound() == bound
    attacker.engine = again
    attacker.install(attacker.send(attacker.step(100.0 * scale, seed=10)))
    assert applied_step(again) == pytest.approx(bound[0], rel=1e-3)


def test_one_agents_flood_of_large_steps_does_not_raise_the_bound_for_it(pretrained, tmp_path) -> None:
    """The attacker first uploads many steps just under the factor (each applied as sent),
    which would drag a plain median of the window up to its own size; counting at most 3 of
    any agent's steps, the honest agents' steps still set the scale and its boosted step is
    cut to 4x theirs."""
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
    assert plain > 3.0  # what the bound would have used without the per-agent cap
    assert engine.accepted_norms.scale() < 2.0
    attacker.install(attacker.send(attacker.step(10.0, seed=200)))
    assert applied_step(engine) < 8.0 and engine.counters["bounded.norm_outlier"] == 1


def test_fleet_relative_bound_is_on_by_default(pretrained, tmp_path) -> None:
    """As shipped (norm_factor 4, warm-up 10): ten normal steps, then a 500x one is applied cut
    to 4x the fleet's step; a 3x one is applied as sent."""
    engine = make_engine(pretrained, tmp_path)
    assert (engine.cfg.aggregator.norm_factor, engine.cfg.aggregator.norm_warmup) == (4.0, 10)
    c = Client(engine, "car-9")
    for i in range(10):
        c.install(c.send(c.step(1.0, seed=i)))
    c.install(c.send(c.step(500.0, seed=10)))
    assert applied_step(engine) == pytest.approx(4.0, rel=1e-3)
    c.install(c.send(c.step(3.0, seed=11)))
    assert applied_step(engine) == pytest.approx(3.0, rel=1e-3)
    assert engine.counters["applied.update"] == 12 and engine.counters["bounded.norm_outlier"] == 1


def test_a_burst_of_tiny_steps_does_not_lock_a_drifting_agent_out(pretrained, tmp_path) -> None:
    """A fleet steps about 1.0, then three agents send tiny steps for a while (their data did
    not change): the median falls 100x, yet the bound's floor keeps to the fleet's busy
    scale, so a drifting agent's 3.0 step is applied as sent, every time."""
    knobs = {"aggregator.norm_factor": 4.0, "aggregator.norm_warmup": 6, "aggregator.norm_window": 30}
    engine = make_engine(pretrained, tmp_path, **knobs)
    quiet = [Client(engine, f"car-{i}") for i in range(3)]
    for i in range(9):
        quiet[i % 3].install(quiet[i % 3].send(quiet[i % 3].step(1.0, seed=i)))
    for i in range(9):
        quiet[i % 3].install(quiet[i % 3].send(quiet[i % 3].step(0.01, seed=50 + i)))
    assert engine.accepted_norms.median() == pytest.approx(0.01, rel=1e-3)
    drifting = Client(engine, "car-7")
    for i in range(4):
        drifting.install(drifting.send(drifting.step(3.0, seed=80 + i)))
        assert applied_step(engine) == pytest.approx(3.0, rel=1e-3)
    assert "bounded.norm_outlier" not in engine.counters


NORMAL = [1.0, 0.5, 2.0, 0.7, 1.4, 1.0, 2.0, 0.6, 1.2, 0.8, 1.5, 1.0]
"""Honest step lengths of a busy fleet: a 4x spread, as the poisoning soak's trained steps."""


def test_a_long_quiet_spell_leaves_honest_steps_at_least_half_their_length(pretrained, tmp_path) -> None:
    """As shipped (norm_factor 4, window 100): three agents step normally, then send 600 tiny
    steps between them (their data did not change: six windows of applied uploads). Neither
    one of them whose data drifts nor a newcomer has its normal steps cut below half, also
    after a restart; a boosted step is still cut to a few times the busy fleet's step. Replies
    are the cheap mixture and the clusters take no proxy refresh: the test is about the step
    bound (an agent's step is measured from its base), not the reply or the cluster models."""
    fast = {"cdfl.personalization": "mixture", "cdfl.cluster_refresh_steps": 0}
    engine = make_engine(pretrained, tmp_path, **fast)
    fleet = [Client(engine, f"car-{i}") for i in range(3)]
    for i, size in enumerate(NORMAL):
        fleet[i % 3].install(fleet[i % 3].send(fleet[i % 3].step(size, seed=i)))
    busy = engine.accepted_norms.median()
    for i in range(600):
        fleet[i % 3].install(fleet[i % 3].send(fleet[i % 3].step(0.01, seed=1000 + i)))
    assert engine.accepted_norms.median() == pytest.approx(0.01, rel=1e-3)
    engine.journal.close()
    engine = make_engine(pretrained, tmp_path, **fast)  # the floor is state: a restart keeps it
    drifting, newcomer = fleet[1], Client(engine, "car-7")
    drifting.engine = engine
    kept = []
    for i, size in enumerate(NORMAL[:6]):
        for c in (drifting, newcomer):
            c.install(c.send(c.step(size, seed=5000 + 10 * i + len(kept))))
            kept.append(applied_step(engine) / size)
    assert min(kept) >= 0.5, kept
    attacker = Client(engine, "car-9")
    attacker.install(attacker.send(attacker.step(100.0 * busy, seed=9000)))
    assert applied_step(engine) <= 4.0 * busy


def test_one_agent_can_neither_lower_the_bound_nor_raise_it_for_itself() -> None:
    """The fleet's typical step against one agent's flood, as the engine applies it (a step
    cut to 4x the scale enters at that length): 600 tiny steps from it leave the bound at half
    the busy fleet's at least; 600 boosted ones from it, while the honest agents are busy or
    quiet, move it within the honest steps' own spread (a fifth here), never by its boost."""
    from aggregator.engine import FleetSteps

    def send(fleet: FleetSteps, agent: str, sent: float) -> None:
        fleet.add(agent, min(sent, 4.0 * fleet.scale()) if len(fleet) >= fleet.warmup else sent)

    def busy_fleet() -> FleetSteps:
        fleet = FleetSteps(window=100, warmup=10)
        for i, size in enumerate(NORMAL):
            send(fleet, f"car-{i % 3}", size)
        return fleet

    lowered = busy_fleet()
    peak = lowered.scale()
    for _ in range(600):
        send(lowered, "car-9", 0.001)
    assert lowered.median() == pytest.approx(0.001) and lowered.scale() >= 0.5 * peak

    for quiet in (False, True):
        raised = busy_fleet()
        for i in range(600):
            send(raised, "car-9", 1e6)
            send(raised, f"car-{i % 3}", 0.01 if quiet else NORMAL[i % len(NORMAL)])
        assert raised.scale() <= 1.5 * peak, (quiet, raised.scale(), peak)


def test_a_delta_from_the_model_before_our_last_reply_is_decoded_against_it(pretrained, tmp_path) -> None:
    """An agent that did not install our latest reply (lost on the way) uploads a delta
    trained from the model before it: its tau names that model, so the upload is decoded and
    measured against it, applied, and answered against it. A delta whose tau names no kept
    model is refused `no_base` (join again), and nothing changes."""
    engine = make_engine(pretrained, tmp_path)
    c = Client(engine, "car-4")
    joined_epoch = c.epoch
    c.install(c.send(c.step(1.0, seed=1)))
    assert isinstance(c.send(c.step(1.0, seed=2)), protocol.Model)  # applied; never installed
    c.install(c.send(c.step(0.5, seed=3)))  # from the model before: decoded against it
    assert applied_step(engine) == pytest.approx(0.5, rel=1e-3)
    assert engine.counters["applied.update"] == 3
    stale = c.update(codecs.encode(c.base + 0.01, "fp32", base=c.base), tau=joined_epoch)
    before = fingerprint(engine)
    reply = c.send(stale)
    assert refused(reply, "no_base") and "join again" in reply.detail, reply
    assert_unchanged(before, engine)
    c.install(c.send(c.step(0.5, seed=4)))  # the model it holds is still known


def test_the_direction_guard_scales_a_step_against_its_clusters_and_keeps_an_honest_tenth() -> None:
    """cdfl.direction_guard: per cluster, the alpha-weighted average direction of the steps it
    took; a step at cosine >= 0 with its clusters' mix is taken whole, below it is scaled by
    1 + cos / guard, never under MIN_TRUST; nothing is judged before WARMUP steps per cluster."""
    from aggregator.cdfl import ClusterAgreement

    g = ClusterAgreement(k=2, numel=4, guard=0.2)
    east, north = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 0, 0])
    assert g.trust(-east, [1.0, 0.0]) == 1.0  # no direction learned yet
    for _ in range(ClusterAgreement.WARMUP):
        g.add(east, [1.0, 0.0], 1.0)
    assert g.trust(-east, [0.0, 1.0]) == 1.0  # cluster 1 has not warmed up
    assert g.trust(east, [1.0, 0.0]) == 1.0
    assert g.trust(north, [1.0, 0.0]) == 1.0  # orthogonal: no disagreement
    assert g.trust(-east, [1.0, 0.0]) == ClusterAgreement.MIN_TRUST
    slightly = torch.tensor([-0.1, 0.995, 0, 0])  # cos -0.1
    assert g.trust(slightly, [1.0, 0.0]) == pytest.approx(0.5, abs=0.01)
    again = ClusterAgreement(k=2, numel=4, guard=0.2)
    again.load_state_dict(g.state_dict())
    assert again.trust(-east, [1.0, 0.0]) == ClusterAgreement.MIN_TRUST
    off = ClusterAgreement(k=2, numel=4, guard=0.0)
    off.add(east, [1.0, 0.0], 1.0)
    assert off.trust(-east, [1.0, 0.0]) == 1.0


def test_the_direction_guard_judges_against_the_fleets_own_spread_and_an_attacker_cannot_widen_it() -> None:
    """Where honest cosines spread wide (many agents, stale bases: docs/simulator.md's fleet had
    29 % below 0), the floor falls to median - 2 MAD and a step at -0.2 is taken whole; where
    they agree (the poisoning soak's fleet, all above 0) the floor is 0 and the same step is
    scaled. One agent's many flips count at most PER_AGENT times: they cannot lower it past
    themselves."""
    from aggregator.cdfl import ClusterAgreement

    east = torch.tensor([1.0, 0, 0, 0])

    def at(cos: float) -> torch.Tensor:
        return torch.tensor([cos, (1 - cos**2) ** 0.5, 0, 0])

    def warmed(cosines: list[float], agents: list[str]) -> ClusterAgreement:
        g = ClusterAgreement(k=1, numel=4, guard=0.1)
        for _ in range(ClusterAgreement.WARMUP):
            g.add(east, [1.0], 1.0)
        for c, agent in zip(cosines, agents, strict=True):
            g.trust(at(c), [1.0], agent)  # judged, not added: the directions stay east
        return g

    spread = [-0.28, -0.2, -0.1, 0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.75] * 2
    wide = warmed(spread, [f"car-{i}" for i in range(len(spread))])
    assert wide.floor() < -0.3
    assert wide.trust(at(-0.2), [1.0], "car-new") == 1.0
    agreeing = [0.15, 0.2, 0.25, 0.3, 0.32, 0.35, 0.4, 0.45, 0.5, 0.55] * 2
    coherent = warmed(agreeing, [f"car-{i}" for i in range(len(agreeing))])
    assert coherent.floor() == 0.0
    assert coherent.trust(at(-0.2), [1.0], "car-new") == ClusterAgreement.MIN_TRUST
    flooded = warmed(agreeing + [-0.6] * 30, [f"car-{i}" for i in range(len(agreeing))] + ["car-bad"] * 30)
    assert flooded.floor() > -0.1  # its 3 counted flips move the spread a little, not past them
    assert flooded.trust(at(-0.2), [1.0], "car-bad") == ClusterAgreement.MIN_TRUST
    again = ClusterAgreement(k=1, numel=4, guard=0.1)
    again.load_state_dict(wide.state_dict())  # the window is state: a restart judges alike
    assert again.floor() == wide.floor()


def test_a_sign_flipped_trained_update_moves_its_clusters_far_less(pretrained, tmp_path) -> None:
    """As shipped: honest trained steps teach the clusters their direction; the same agent's
    next step flipped is applied (not refused) and counted `bounded.direction`, and it moves
    the clusters along itself by under a third of what it does with the guard off (the
    tenth it keeps, plus the cluster refresh both runs share)."""
    from fedmq.data import load_dataset
    from fedmq.training import fit

    ds = load_dataset("digits")
    along = {}
    shipped = CDFLSettings().direction_guard
    for guard in (shipped, 0.0):
        engine = make_engine(pretrained, tmp_path / str(guard), **{"cdfl.direction_guard": guard})
        c = Client(engine, "car-5")

        def trained(seed: int, c: Client = c) -> np.ndarray:
            base = torch.from_numpy(c.base.copy())
            return fit("digits-cnn", base, ds.x[:200], ds.y[:200], epochs=1, lr=0.05, seed=seed).vector.numpy()

        for seed in range(6):
            c.install(c.send(c.update(codecs.encode(trained(seed), "fp32", base=c.base))))
        assert "bounded.direction" not in engine.counters
        flip = -(trained(6) - c.base)
        before = engine.strategy.state_dict()["clusters"].clone()
        c.install(c.send(c.update(codecs.encode((c.base + flip).astype(np.float32), "fp32", base=c.base))))
        moved = engine.strategy.state_dict()["clusters"] - before
        unit = torch.from_numpy(flip / np.linalg.norm(flip))
        along[guard] = float((moved @ unit).sum())
        assert engine.counters.get("bounded.direction", 0) == (1 if guard else 0)
        engine.journal.close()
    assert shipped > 0 and along[0.0] > 0 and along[shipped] < along[0.0] / 3, along


@pytest.mark.parametrize("argv, message", [
    (["--attacks", "signflip"], "--attacks must include none"),
    (["--attacks", "none,flip"], "unknown attack 'flip'"),
    (["--seeds", "0"], "--seeds must be at least 1"),
    (["--guards", "strict"], "--guards: use a comma list"),
])
def test_the_soak_refuses_a_run_it_could_not_report_before_it_starts(argv, message, capsys) -> None:
    from soak import poisoning

    with pytest.raises(SystemExit) as stop:
        poisoning.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
