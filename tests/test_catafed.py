"""CATA-Fed's server side without a broker: k-means by size, PF priority and group choice
(hand-computed), psi normalization, the pool (dropouts out and back), baselines."""

from __future__ import annotations

import pytest
import torch

from aggregator.catafed import CataFed, RoundResult, aggregate, kmeans_1d
from aggregator.fedavg import FedAvgDeadline, FedProx
from aggregator.round_algorithms import make_round_strategy
from fedmq.config import CataFedSettings

W0 = torch.ones(4)


def settings(**kw) -> CataFedSettings:
    return CataFedSettings(**kw)


def test_kmeans_groups_by_size_and_numbers_groups_by_centre() -> None:
    sizes = [1000, 100, 110, 500, 520, 90, 990]
    assert kmeans_1d(sizes, 3) == [2, 0, 0, 1, 1, 0, 2]
    # The optimum, not a local one: {1, 2, 3} | {10, 11} | {50} for k = 3.
    assert kmeans_1d([3, 1, 2, 10, 11, 50], 3) == [0, 0, 0, 1, 1, 2]
    # Equal values never split; k above the number of distinct values is capped.
    assert kmeans_1d([5, 5, 5, 7], 3) == [0, 0, 0, 1]
    assert kmeans_1d([], 3) == []
    assert kmeans_1d([42], 4) == [0]
    # Deterministic: the same input gives the same labels, whatever the order of calls.
    assert kmeans_1d([40, 41, 42, 80, 81], 2) == kmeans_1d([40, 41, 42, 80, 81], 2) == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        kmeans_1d([1, 2], 0)


def four_agents(**kw) -> CataFed:
    s = CataFed(settings(groups=2, per_group=1, pf_window=4, pf_initial=1.0, **kw), W0)
    for agent, size in (("a", 100), ("b", 100), ("c", 400), ("d", 420)):
        s.register(agent, size)
    return s


def finish(s: CataFed, agents: list[str], vector: torch.Tensor = W0) -> None:
    for a in agents:
        assert s.accept(RoundResult(a, s.round, True, s.agents[a].size, s.agents[a].size, vector))
    s.close_round()


def test_pf_priority_and_group_selection_by_hand() -> None:
    s = four_agents()
    # Round 0: A = 1 for all, priority = size. Groups {a,b} and {c,d}; each group's best
    # member: a (ties by id) with 100, d with 420 -> group 1 wins, d is invited.
    plan = s.open_round()
    assert {a: s.agents[a].group for a in "abcd"} == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert plan.selected == ["d"] and plan.group == 1
    assert plan.priorities == {0: pytest.approx(100.0), 1: pytest.approx(420.0)}
    finish(s, ["d"])
    # A_d = 0.75 * 1 + 0.25 * 420 = 105.75; the others decay to 0.75.
    assert s.agents["d"].avg == pytest.approx(105.75)
    assert s.agents["a"].avg == pytest.approx(0.75)
    # Round 1: c = 400 / 0.75 = 533.33 beats d = 420 / 105.75 = 3.97; a = 133.33.
    plan = s.open_round()
    assert plan.selected == ["c"]
    assert plan.priorities[0] == pytest.approx(100 / 0.75)
    assert plan.priorities[1] == pytest.approx(400 / 0.75)
    finish(s, ["c"])
    assert s.agents["c"].avg == pytest.approx(0.75 * 0.75 + 0.25 * 400)
    assert s.agents["d"].avg == pytest.approx(0.75 * 105.75)
    # Round 2: group 1's best is now d (420 / 79.31 = 5.30 > c's 3.98), but group 0's a
    # (100 / 0.5625 = 177.8) wins.
    plan = s.open_round()
    assert plan.selected == ["a"]
    assert plan.priorities[1] == pytest.approx(420 / (0.75 * 105.75))
    assert plan.priorities[0] == pytest.approx(100 / 0.5625)


def test_candidate_group_is_best_n_members() -> None:
    s = CataFed(settings(groups=1, per_group=2, pf_initial=1.0), W0)
    for agent, size in (("a", 100), ("b", 120), ("c", 110)):
        s.register(agent, size)
    s.agents["b"].avg = 10.0  # b: 12, c: 110, a: 100 -> best two are c and a
    assert s.open_round().selected == ["c", "a"]


def test_psi_normalized_over_finishers_and_a_straggler_never_shrinks_the_model() -> None:
    w = torch.full((4,), 1.0)
    results = [RoundResult("a", 0, True, 100, 100, torch.full((4,), 2.0)),
               RoundResult("b", 0, True, 300, 300, torch.full((4,), 4.0)),
               RoundResult("c", 0, False, 0, 50)]
    new, psi = aggregate(w, results)
    assert psi == {"a": pytest.approx(0.25), "b": pytest.approx(0.75)}
    assert torch.allclose(new, torch.full((4,), 1 + 0.25 * 1 + 0.75 * 3))
    new_u, psi_u = aggregate(w, results, "uniform")
    assert psi_u == {"a": 0.5, "b": 0.5} and torch.allclose(new_u, torch.full((4,), 3.0))
    # One finisher that returns W_t, one straggler: W_t exactly (normalizing psi over all
    # invited agents would have given 0.5 W_t).
    same, _ = aggregate(w, [RoundResult("a", 0, True, 100, 100, w.clone()),
                            RoundResult("c", 0, False, 0, 50)])
    assert torch.equal(same, w)
    # No finisher: W_t is kept.
    kept, psi_none = aggregate(w, [RoundResult("c", 0, False, 0, 50)])
    assert torch.equal(kept, w) and psi_none == {}
    # The update is taken against the base the agent started from (its decoded W_t).
    moved, _ = aggregate(w, [RoundResult("a", 0, True, 10, 10, torch.full((4,), 1.5),
                                         base=torch.full((4,), 0.5))])
    assert torch.allclose(moved, torch.full((4,), 2.0))


def test_round_outcome_dropouts_leave_pool_and_come_back_online() -> None:
    s = CataFed(settings(groups=1, per_group=3), W0)
    for agent, size in (("fast", 100), ("slow", 100), ("gone", 100)):
        s.register(agent, size)
    plan = s.open_round()
    assert plan.selected == ["fast", "gone", "slow"]
    assert s.accept(RoundResult("fast", 0, True, 100, 100, torch.full((4,), 3.0)))
    assert s.accept(RoundResult("slow", 0, False, 0, 50))
    assert not s.accept(RoundResult("slow", 0, False, 0, 50))   # a second report
    assert not s.accept(RoundResult("other", 0, True, 1, 1, W0))  # not invited
    assert not s.accept(RoundResult("gone", 7, True, 1, 1, W0))   # another round
    out = s.close_round()
    assert (out.finished, out.stragglers, out.dropouts) == (["fast"], ["slow"], ["gone"])
    assert torch.allclose(s.vector, torch.full((4,), 3.0))
    # The dropout is out of the pool while it stays "online" ...
    assert s.pool() == ["fast", "slow"]
    s.set_online("gone", True)
    assert "gone" in s.pool()  # a fresh online status: it is back
    s.agents["gone"].in_pool = False
    s.set_online("gone", False)
    assert "gone" not in s.pool()
    s.set_online("gone", True)
    assert "gone" in s.pool()
    # The straggler's new shard size was recorded and re-clustering is due.
    assert s.agents["slow"].size == 50
    s2 = CataFed(settings(groups=2, per_group=1), W0)
    for agent, size in (("a", 100), ("b", 100), ("c", 400)):
        s2.register(agent, size)
    s2.open_round()
    before = s2.reclusterings
    s2.accept(RoundResult("c", 0, False, 0, 60))  # c (was in the 400 group) halves twice over
    s2.close_round()
    s2.open_round()
    assert s2.reclusterings == before + 1
    assert s2.agents["c"].group == 0 and s2.agents["a"].group == 1  # 60 | 100, 100


def test_an_empty_pool_opens_an_empty_round_and_keeps_the_model() -> None:
    s = CataFed(settings(), W0)
    plan = s.open_round()
    assert plan.selected == []
    out = s.close_round()
    assert not out.changed and torch.equal(s.vector, W0)


def test_fedavg_selects_n_at_random_and_keeps_silent_agents() -> None:
    s = FedAvgDeadline(settings(per_group=2), W0, seed=1)
    for i in range(6):
        s.register(f"a{i}", 100 + i)
    picks = []
    for _ in range(5):
        plan = s.open_round()
        assert len(plan.selected) == 2
        picks.append(tuple(plan.selected))
        out = s.close_round()  # nobody reports: all dropped, none leaves the pool
        assert out.dropouts == plan.selected
    assert len(set(picks)) > 1
    assert len(s.pool()) == 6
    # Same seed, same draws.
    s2 = FedAvgDeadline(settings(per_group=2), W0, seed=1)
    for i in range(6):
        s2.register(f"a{i}", 100 + i)
    assert tuple(s2.open_round().selected) == picks[0]
    assert isinstance(make_round_strategy("fedprox", settings(), W0), FedProx)
    with pytest.raises(ValueError):
        make_round_strategy("fedsgd", settings(), W0)


def test_state_round_trips() -> None:
    s = four_agents()
    s.open_round()
    finish(s, ["d"], torch.full((4,), 2.0))
    s2 = CataFed(settings(groups=2, per_group=1, pf_window=4), W0)
    s2.load_state(s.state())
    assert s2.round == 1 and torch.equal(s2.vector, s.vector)
    assert s2.agents["d"].avg == pytest.approx(105.75)
    assert s2.pool() == []  # presence is re-learned from retained statuses
    for a in "abcd":
        s2.set_online(a, True)
    assert s2.open_round().selected == ["c"]


def test_simulated_fleet_catafed_resizes_stragglers_fedavg_drops_late_work() -> None:
    """sim/rounds.py on a simulated clock: a 20 s deadline costs no 20 s of wall time."""
    from sim.rounds import FleetSpec, simulate_fleet

    spec = FleetSpec(agents=8, slow_share=0.5, slow_factor=0.05, dropout_p=0.0)
    s = settings(groups=2, per_group=4, deadline_s=20.0, grace_s=2.0, epochs=1)
    cata = simulate_fleet("catafed", spec, s, seed=0, rounds=4, target=0.0)
    avg = simulate_fleet("fedavg", spec, s, seed=0, rounds=4, target=0.0)
    assert len(cata.rounds) == len(avg.rounds) == 4
    assert all(r.round_s <= 22.0 for r in cata.rounds + avg.rounds)
    assert cata.rounds[-1].time_s == pytest.approx(sum(r.round_s for r in cata.rounds))
    assert cata.totals()["stragglers"] > 0 and cata.totals()["late"] == 0
    assert avg.totals()["late"] > 0 and avg.totals()["stragglers"] == 0
    assert avg.wasted_s > 0 and 0 <= cata.wasted_s < cata.compute_s
    assert 0.0 < cata.final_accuracy <= 1.0
