"""TiFL's server side without a broker (profiling, latency tiers, credits, accuracy-ranked
probabilities, state), CATA-Fed's ablation switches on the agent and the server, and the
simulated-clock comparison with all four algorithms on both offline datasets."""

from __future__ import annotations

import math

import pytest
import torch

from aggregator.catafed import CataFed, RoundResult
from aggregator.round_algorithms import STRATEGIES, make_round_strategy
from aggregator.tifl import TiFL, rank_probabilities
from edge_agent.deadline import DeadlineLearner, EpochOutcome
from fedmq.algorithms import ROUNDS
from fedmq.config import CataFedSettings, FedAvgSettings, TiflSettings
from fedmq.data import load_dataset
from fedmq.errors import UsageError

W0 = torch.zeros(4)


def tifl(agents: int = 6, n: int = 2, **kw) -> TiFL:
    s = TiFL(CataFedSettings(rounds=20), W0, fedavg=FedAvgSettings(clients_per_round=n),
             tifl=TiflSettings(**kw))
    for i in range(agents):
        s.register(f"a{i}", 100)
    return s


def play(s: TiFL, latency: dict[str, float | None], accuracy: dict[str, float] | None = None):
    """One round: each invited agent reports with its latency (None: silent at the cut-off)."""
    plan = s.open_round()
    for a in plan.selected:
        if latency.get(a) is not None:
            metrics = {"accuracy": accuracy[a]} if accuracy and a in accuracy else {}
            assert s.accept(RoundResult(a, plan.round, True, 100, 100, W0 + 1, None, metrics,
                                        latency[a]))
    s.close_round()
    return plan


def test_the_registry_and_the_kernel_names_agree() -> None:
    assert tuple(STRATEGIES) == ROUNDS
    assert isinstance(make_round_strategy("tifl", CataFedSettings(), W0), TiFL)


def test_rank_probabilities_favour_the_least_accurate_tier() -> None:
    p = rank_probabilities({0: 0.9, 1: 0.5, 2: 0.7})
    assert p == pytest.approx({1: 3 / 6, 2: 2 / 6, 0: 1 / 6})
    assert sum(p.values()) == pytest.approx(1.0)
    assert rank_probabilities({4: 0.3}) == {4: 1.0}


def test_profiling_first_then_one_tier_per_round_and_silent_agents_leave() -> None:
    s = tifl(agents=6, n=2, tiers=2)
    lat = {"a0": 1.0, "a1": 1.2, "a2": 1.1, "a3": 9.0, "a4": 8.5, "a5": None}
    seen: set[str] = set()
    for _ in range(3):  # 6 unprofiled agents, 2 per round: three profiling rounds
        plan = play(s, lat)
        assert plan.group is None and not (set(plan.selected) & seen)
        seen |= set(plan.selected)
    assert seen == set(lat) and s.profiling_rounds == 3
    assert math.isinf(s.latency["a5"])  # silent at the cut-off: beyond T_max
    fast, slow = {"a0", "a1", "a2"}, {"a3", "a4"}
    for _ in range(8):
        plan = play(s, lat)
        assert set(plan.selected) <= fast or set(plan.selected) <= slow  # one tier per round
        assert "a5" not in plan.selected
    assert s.tier_of["a0"] == 0 and s.tier_of["a3"] == 1  # tiers numbered fastest first
    assert sum(s.credits.values()) == 2 * s.full_credits() - 8
    # a5 comes back after being away: it is profiled again before anything else
    s.set_online("a5", False)
    s.set_online("a5", True)
    assert "a5" in s.open_round().selected


def test_adaptive_probabilities_follow_the_tiers_accuracy_and_credits_run_out() -> None:
    s = tifl(agents=4, n=2, tiers=2, interval=2, credits=3)
    lat = {"a0": 1.0, "a1": 1.0, "a2": 5.0, "a3": 5.0}
    acc = {"a0": 0.9, "a1": 0.9, "a2": 0.2, "a3": 0.2}
    picks = [play(s, lat, acc).group for _ in range(8)]
    assert picks[:2] == [None, None]  # profiling
    assert s.probs == pytest.approx({1: 2 / 3, 0: 1 / 3})  # the slow tier scores worse
    # 3 credits each: after 6 tiered rounds both are spent and renewed, never more than 3 in a row
    assert picks[2:].count(0) <= 3 and picks[2:].count(1) <= 3
    static = tifl(agents=4, n=2, tiers=2, interval=2, adaptive=False)
    for _ in range(4):
        play(static, lat, acc)
    assert static.probs == {0: 0.5, 1: 0.5}


def test_state_round_trip_keeps_latencies_tiers_and_credits() -> None:
    s = tifl(agents=4, n=2, tiers=2)
    lat = {"a0": 1.0, "a1": 2.0, "a2": 9.0, "a3": None}
    for _ in range(4):
        play(s, lat, {"a0": 0.5})
    t = tifl(agents=0, n=2, tiers=2)
    t.load_state(s.state())
    assert t.latency == s.latency and t.credits == s.credits and t.score == s.score
    assert math.isinf(t.latency["a3"]) and t.round == s.round
    for a in ("a0", "a1", "a2", "a3"):
        t.set_online(a, True)
    assert "a3" in t.open_round().selected  # back online after the restart: profiled again


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="tifl.tiers"):
        TiFL(CataFedSettings(), W0, tifl=TiflSettings(tiers=0))
    with pytest.raises(ValueError, match="catafed.selection"):
        CataFed(CataFedSettings(selection="best"), W0)


def test_catafed_random_selection_invites_one_group_at_random() -> None:
    s = CataFed(CataFedSettings(groups=2, per_group=2, selection="random"), W0, seed=3)
    for a, n in (("a", 100), ("b", 100), ("c", 110), ("d", 400), ("e", 410)):
        s.register(a, n)
    groups = set()
    for _ in range(12):
        plan = s.open_round()
        assert set(plan.selected) <= {"a", "b", "c"} or set(plan.selected) <= {"d", "e"}
        assert len(plan.selected) == 2
        groups.add(plan.group)
        for a in plan.selected:  # everyone reports: nobody leaves the pool
            s.accept(RoundResult(a, plan.round, True, 100, s.agents[a].size, W0 + 1))
        s.close_round()
    assert groups == {0, 1}


# ----------------------------------------------------------------------------- the agent side


def speed_runner(samples_per_s: float):
    """A device doing `samples_per_s` on a shared clock: an epoch is cut at the time left."""
    def make(x, y, anchor):
        def run(start, epoch, left):
            need = x.shape[0] / samples_per_s
            if need <= left:
                clock[0] += need
                return EpochOutcome(start + 1, need, True, int(x.shape[0]))
            clock[0] += max(left, 0.0)
            return EpochOutcome(start, left, False, int(left * samples_per_s))
        return run
    clock = [0.0]
    return make, clock


def data(n: int = 256):
    ds = load_dataset("digits")
    return ds.x[:n], ds.y[:n]


@pytest.mark.parametrize("resize,expected", [("halve", 128), ("fit", 16)])
def test_a_straggler_halves_or_fits_its_shard_to_its_measured_speed(resize, expected) -> None:
    # budget 10 - 0.2 s at 4 samples/s: 39 samples fit, 80 % of that is 31: 256 -> 16 at once
    s = CataFedSettings(deadline_s=10.0, epochs=1, min_shard=8, resize=resize)
    learner = DeadlineLearner(*data(), s)
    make, clock = speed_runner(4.0)
    w = learner.run_round(W0, make, lambda: s.deadline_s - 0.2 - clock[0])
    assert not w.finished and w.shard_size == expected
    clock[0] = 0.0
    assert learner.run_round(W0, make, lambda: 9.8 - clock[0]).finished == (resize == "fit")


def test_ablation_switches_on_the_agent() -> None:
    make, clock = speed_runner(4.0)
    # no partitioning: a straggler keeps all its data
    keep = DeadlineLearner(*data(), CataFedSettings(epochs=1, partition=False))
    assert not keep.run_round(W0, make, lambda: 9.8 - clock[0]).finished
    assert keep.shard_size == 256
    # not deadline-aware: trains the whole epoch (64 s), notices it was late, still halves
    clock[0] = 0.0
    blind = DeadlineLearner(*data(), CataFedSettings(epochs=1, deadline_aware=False))
    w = blind.run_round(W0, make, lambda: 9.8 - clock[0])
    assert w.finished and clock[0] == pytest.approx(64.0) and blind.shard_size == 128
    with pytest.raises(ValueError, match="catafed.resize"):
        DeadlineLearner(*data(), CataFedSettings(resize="quarter"))


def test_a_tifl_agent_trains_like_fedavg_and_scores_the_model_it_received() -> None:
    from fedmq.models import build_model, to_vector
    from fedmq.training import evaluate

    x, y = data()
    w0 = to_vector(build_model("digits-cnn", seed=0))
    learner = DeadlineLearner(x, y, CataFedSettings(epochs=2), algorithm="tifl",
                              model_name="digits-cnn")
    make, clock = speed_runner(4.0)
    w = learner.run_round(w0, make, lambda: 9.8 - clock[0])
    assert w.finished and w.result.epochs_done == 2 and learner.mode == "fedavg"
    assert w.local_accuracy == pytest.approx(evaluate("digits-cnn", w0, x, y)[0])


# ----------------------------------------------------------------------------- the simulator


def test_simulated_fleet_runs_tifl_and_catafed_variants_on_synthetic_data() -> None:
    from sim.rounds import FleetSpec, Task, parse_variants, run_task

    spec = FleetSpec(agents=8, slow_share=0.25, dropout_p=0.0)
    base = {"catafed.groups": "2", "catafed.per_group": "3", "catafed.epochs": "1"}
    runs = {}
    for v in parse_variants("tifl,fit=catafed:catafed.resize=fit"):
        runs[v.label] = run_task(Task(v, spec, base, seed=0, rounds=6, until_s=math.inf,
                                      target=0.0, dataset="synthetic"))
    t = runs["tifl"]
    assert t.strategy == "tifl" and len(t.rounds) == 6
    assert t.rounds[0].selected == 3 and t.totals()["late"] >= 1  # profiling meets the slow
    assert runs["fit"].strategy == "catafed" and runs["fit"].algorithm == "fit"
    assert 0.0 < runs["fit"].final_accuracy <= 1.0


def test_variants_parse_and_refuse_clearly() -> None:
    from sim.rounds import parse_variants

    v = parse_variants("catafed, no-pf=catafed:catafed.selection=random:catafed.groups=1")
    assert [(x.label, x.algorithm) for x in v] == [("catafed", "catafed"), ("no-pf", "catafed")]
    assert v[1].overrides == {"catafed.selection": "random", "catafed.groups": "1"}
    cata, fedavg, tifl_s = v[1].settings({"catafed.per_group": "4"})
    assert (cata.selection, cata.groups, fedavg.clients_per_round) == ("random", 1, 4)
    for bad, msg in (("fedsgd", "unknown algorithm"), ("x=catafed:groups", "section.key=value"),
                     ("catafed,catafed", "given twice"), (",", "at least one")):
        with pytest.raises(UsageError, match=msg):
            parse_variants(bad)


def test_synthetic_dataset_is_deterministic_and_offline() -> None:
    from fedmq.data import clear_cache

    a = load_dataset("synthetic")
    clear_cache()
    b = load_dataset("synthetic")
    assert len(a) == 6000 and len(load_dataset("synthetic", train=False)) == 1500
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert set(a.y.tolist()) == set(range(10))


def test_regrow_doubles_a_shard_back_when_a_round_used_little_of_the_budget() -> None:
    # budget 9.8 s: 256 samples at 10/s (25.6 s) miss it and halve to 128 (12.8 s, still
    # missing: 64); then the device speeds up to 400/s and rounds take 0.16 s: it regrows
    s = CataFedSettings(deadline_s=10.0, epochs=1, min_shard=8, regrow=True)
    learner = DeadlineLearner(*data(), s)
    slow, clock = speed_runner(10.0)
    for _ in range(2):
        clock[0] = 0.0
        learner.run_round(W0, slow, lambda: 9.8 - clock[0])
    assert learner.shard_size == 64
    fast, clock = speed_runner(400.0)
    sizes = []
    for _ in range(3):
        clock[0] = 0.0
        learner.run_round(W0, fast, lambda: 9.8 - clock[0])
        sizes.append(learner.shard_size)
    assert sizes == [128, 256, 256] and learner.regrowths == 2
    never = DeadlineLearner(*data(), CataFedSettings(deadline_s=10.0, epochs=1, min_shard=8))
    clock[0] = 0.0
    never.run_round(W0, slow, lambda: 9.8 - clock[0])
    never.run_round(W0, fast, lambda: 9.8 - clock[0])
    assert never.shard_size == 128  # the paper's reading: shards never grow back


def test_recluster_every_waits_for_its_round() -> None:
    s = CataFed(CataFedSettings(groups=2, per_group=1, recluster_every=3), W0)
    for a, n in (("a", 100), ("b", 400)):
        s.register(a, n)
    plan = s.open_round()
    s.close_round()
    assert s.reclusterings == 1
    s.set_size("b", 50)  # would re-cluster at once in the paper's reading
    for _ in range(2):
        s.open_round()
        s.close_round()
    assert s.reclusterings == 1
    s.open_round()  # round 3
    assert s.reclusterings == 2 and plan.round == 0
