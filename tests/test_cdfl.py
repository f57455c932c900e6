"""CDFL, FedSoft-Async and FedAsync server rules against hand-computed values."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch

from aggregator.aggregation import hinge_staleness
from aggregator.cdfl import CDFL
from aggregator.estimators import ESTIMATORS, make_estimator
from aggregator.fedasync import FedAsync
from aggregator.fedsoft_async import FedSoftAsync
from aggregator.strategy import Reply, Upload
from fedmq.config import CDFLSettings
from fedmq.models import build_model, model_spec, to_vector

ARCH = "digits-cnn"
SPEC = model_spec(ARCH)


def clusters(k: int, seed: int = 0) -> torch.Tensor:
    return torch.stack([to_vector(build_model(ARCH, seed=seed + i)) for i in range(k)])


def proxies(k: int, n: int = 64, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(k)]


def vector(seed: int) -> torch.Tensor:
    return to_vector(build_model(ARCH, seed=100 + seed))


def make_cdfl(k: int = 2, **kw) -> CDFL:
    return CDFL(SPEC, clusters(k), proxies(k), device="cpu", **kw)


def test_hinge_staleness_by_hand():
    assert hinge_staleness(0, 10, 5) == 1.0
    assert hinge_staleness(5, 10, 5) == 1.0          # d <= b: full weight
    assert hinge_staleness(6, 10, 5) == pytest.approx(1 / 11)
    assert hinge_staleness(8, 10, 5) == pytest.approx(1 / 31)
    assert hinge_staleness(7, 2, 1) == pytest.approx(1 / 13)


def test_update_moves_each_cluster_by_beta_toward_v():
    s = make_cdfl(2, tau0=100)
    s.join("a")
    before = s.clusters.clone()
    v = vector(0)
    reply = s.apply(Upload("a", v, tau=0), alpha=[0.75, 0.25])
    assert reply.epoch == 1 and reply.info["staleness"] == 1 and reply.info["stale"] is False
    assert reply.info["betas"] == pytest.approx([0.025 * 0.75, 0.025 * 0.25])
    for k, beta in enumerate(reply.info["betas"]):
        expected = (1 - beta) * before[k] + beta * v
        torch.testing.assert_close(s.clusters[k], expected, rtol=0, atol=1e-6)
        # the move is exactly beta of the way toward v
        torch.testing.assert_close(s.clusters[k] - before[k], beta * (v - before[k]), rtol=0, atol=1e-6)
    # personalized reply = alpha-mixture of the clusters after the update
    torch.testing.assert_close(reply.vectors[0], 0.75 * s.clusters[0] + 0.25 * s.clusters[1], rtol=0, atol=1e-6)
    assert reply.kind == "personalized" and s.cluster_updated == [1, 1]


def test_beta_with_hinge_for_an_old_upload():
    s = make_cdfl(2, tau0=100, beta0=0.1, hinge_a=10, hinge_b=5, staleness_cap=0)  # the papers' d = t - tau
    for _ in range(7):
        s.apply(Upload("a", vector(1), tau=s.uploads_applied), alpha=[0.5, 0.5])
    reply = s.apply(Upload("b", vector(2), tau=0), alpha=[1.0, 0.0])  # t = 8, d = 8
    assert reply.info["staleness"] == 8
    assert reply.info["betas"] == pytest.approx([0.1 * 1.0 / (10 * 3 + 1), 0.0])
    assert s.cluster_updated == [8, 7]  # alpha_2 = 0: cluster 2 untouched


@pytest.mark.parametrize("cap, expected", [(0, 22), (1, 3), (2, 4)])
def test_one_agent_uploading_often_cannot_make_another_stale(cap, expected):
    """Between two of b's uploads, a floods 20 and c uploads once: with the default cap 1
    b's staleness is 1 + the agents that uploaded since (3, within tau0 = 3 agents); the
    papers' rule (cap 0) counts 22 and throws b's upload away. The ledger is durable state."""
    s = make_cdfl(2, staleness_cap=cap)
    for agent in "abc":
        s.join(agent)
    tau = s.uploads_applied
    for _ in range(20):
        s.apply(Upload("a", vector(1), tau=s.uploads_applied), alpha=[0.5, 0.5])
    s.apply(Upload("c", vector(3), tau=tau), alpha=[0.5, 0.5])
    restored = make_cdfl(2, staleness_cap=cap)
    restored.load_state_dict(s.state_dict())
    for strategy in (s, restored):
        reply = strategy.apply(Upload("b", vector(2), tau=tau), alpha=[0.5, 0.5])
        assert reply.info["staleness"] == expected and reply.info["uploads_since"] == 22
        assert reply.info["stale"] is (expected > 3)


def test_stale_upload_leaves_clusters_bit_identical_and_tau0_defaults_to_agents_seen():
    s = make_cdfl(2)  # tau0 = 0: number of agents seen
    s.join("a")
    s.join("b")
    assert s.staleness_threshold() == 2
    s.update(Upload("a", vector(0), tau=0))  # t=1, d=1
    s.update(Upload("b", vector(1), tau=0))  # t=2, d=2 (== tau0: still applied)
    assert s.counters["applied"] == 2
    before = s.clusters.clone()
    versions = list(s.versions)
    reply = s.update(Upload("a", vector(2), tau=0))  # t=3, d=3 > 2
    assert reply.info["stale"] is True and reply.info["betas"] == [0.0, 0.0]
    assert torch.equal(s.clusters, before) and s.versions == versions
    alpha = reply.alpha
    assert all(a >= 0 for a in alpha) and math.isclose(sum(alpha), 1.0, abs_tol=1e-9)
    torch.testing.assert_close(reply.vectors[0], alpha[0] * before[0] + alpha[1] * before[1], rtol=0, atol=1e-6)
    # a third agent raises the threshold: the same staleness now counts
    s.join("c")
    assert s.staleness_threshold() == 3
    reply = s.update(Upload("c", vector(3), tau=1))  # t=4, d=3
    assert reply.info["stale"] is False and not torch.equal(s.clusters, before)


def test_join_gets_the_uniform_mixture():
    s = make_cdfl(3)
    reply = s.join("a")
    assert reply.alpha == pytest.approx([1 / 3] * 3) and reply.epoch == 0
    torch.testing.assert_close(reply.vectors[0], s.clusters.mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_returns_a_distribution(name):
    s = make_cdfl(3, estimator=name)
    for a in "abc":
        s.join(a)
    replies = s.update_many([Upload(a, vector(i), tau=0) for i, a in enumerate("abc")])
    for r in replies:
        assert len(r.alpha) == 3 and all(x >= 0 for x in r.alpha)
        assert math.isclose(sum(r.alpha), 1.0, abs_tol=1e-9)
        assert r.info["estimator"] == name


def test_unknown_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown estimator 'nope'; known: direction, evidence, metrics"):
        make_estimator("nope")


def test_batched_update_equals_applying_its_alphas_in_order():
    a, b = make_cdfl(2, tau0=50), make_cdfl(2, tau0=50)
    uploads = [Upload(f"agent{i}", vector(i), tau=0) for i in range(4)]
    replies = a.update_many(uploads)
    for up, r in zip(uploads, replies, strict=True):
        rb = b.apply(up, alpha=r.alpha)
        assert torch.equal(rb.vectors[0], r.vectors[0]) and rb.epoch == r.epoch
    assert torch.equal(a.clusters, b.clusters)


def test_cluster_loss_cache_is_refreshed_after_an_update():
    s = make_cdfl(2, tau0=50, staleness_cap=0)  # the papers' count: tau=-100 below is stale
    s.update(Upload("a", vector(0), tau=0))
    misses = s.evaluator.cache_misses
    s.update(Upload("a", vector(1), tau=1))  # both clusters changed at the previous step
    assert s.evaluator.cache_misses == misses + 2
    s.update(Upload("a", vector(2), tau=-100))  # stale: nothing changes ...
    misses = s.evaluator.cache_misses
    s.update(Upload("a", vector(3), tau=3))    # ... so the next estimate hits the cache
    assert s.evaluator.cache_misses == misses


@pytest.mark.parametrize("name", ["metrics", "direction", "evidence"])
def test_state_round_trip_reproduces_the_next_reply_bit_exactly(name):
    a = make_cdfl(2, estimator=name)
    for i, agent in enumerate(["a", "b", "c"]):
        a.join(agent)
        a.update(Upload(agent, vector(i), tau=0))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = CDFL(SPEC, clusters(2, seed=50), proxies(2), device="cpu", estimator=name)
    b.load_state_dict(torch.load(buf))
    nxt = Upload("b", vector(9), tau=2)
    ra, rb = a.update(nxt), b.update(nxt)
    assert ra.alpha == rb.alpha and ra.epoch == rb.epoch == 4
    assert torch.equal(ra.vectors[0], rb.vectors[0])
    assert torch.equal(a.clusters, b.clusters)
    assert a.last_reply_version == b.last_reply_version and a.counters == b.counters


def test_from_settings_reads_every_knob():
    cfg = CDFLSettings(clusters=2, tau0=7, beta0=0.05, hinge_a=3, hinge_b=2, estimator="evidence")
    s = CDFL.from_settings(SPEC, clusters(2), proxies(2), cfg, device="cpu")
    assert (s.tau0, s.beta0, s.hinge_a, s.hinge_b, s.estimator.name) == (7, 0.05, 3.0, 2.0, "evidence")


@pytest.mark.parametrize("bad, reason", [
    ([0.5, 0.6], "sums to 1.1"),
    ([-0.1, 1.1], "negative"),
    ([float("nan"), 1.0], "non-finite"),
    ([1.0], "has 1 values, expected 2"),
    (None, "missing"),
    ("ab", "list of 2 numbers"),
])
def test_fedsoft_async_rejects_a_bad_alpha_and_changes_nothing(bad, reason):
    s = FedSoftAsync(SPEC, clusters(2))
    s.join("a")
    state = s.state_dict()
    with pytest.raises(ValueError, match=reason):
        s.apply(Upload("a", vector(0), tau=0, alpha=bad))
    after = s.state_dict()
    assert torch.equal(after.pop("clusters"), state.pop("clusters")) and after == state


def test_fedsoft_async_updates_with_the_agents_alpha_and_sends_all_clusters():
    s = FedSoftAsync(SPEC, clusters(2), tau0=10)
    join = s.join("a")
    assert join.kind == "clusters" and len(join.vectors) == 2 and torch.equal(join.vectors[1], s.clusters[1])
    before = s.clusters.clone()
    v = vector(0)
    reply = s.update(Upload("a", v, tau=0, alpha=[0.2, 0.8]))
    assert reply.info["betas"] == pytest.approx([0.025 * 0.2, 0.025 * 0.8])
    for k, beta in enumerate(reply.info["betas"]):
        torch.testing.assert_close(s.clusters[k], (1 - beta) * before[k] + beta * v, rtol=0, atol=1e-6)
    assert reply.kind == "clusters" and torch.equal(reply.vectors[0], s.clusters[0])


def test_fedasync_mixes_with_the_staleness_discounted_weight():
    w0, v = vector(0), vector(1)
    s = FedAsync(SPEC, w0, mixing=0.6, staleness_cap=0)  # the papers' d = t - tau
    assert torch.equal(s.join("a").vectors[0], w0)
    r = s.update(Upload("a", v, tau=0))  # d = 1
    assert r.info["mixing"] == pytest.approx(0.6)
    torch.testing.assert_close(s.model, 0.4 * w0 + 0.6 * v, rtol=0, atol=1e-6)
    for _ in range(6):
        s.update(Upload("b", v, tau=s.uploads_applied))
    w = s.model.clone()
    r = s.update(Upload("c", w0, tau=0))  # t = 8, d = 8 -> a = 0.6 / 31
    assert r.info["mixing"] == pytest.approx(0.6 / 31)
    torch.testing.assert_close(s.model, (1 - 0.6 / 31) * w + 0.6 / 31 * w0, rtol=0, atol=1e-6)
    assert r.kind == "global" and torch.equal(r.vectors[0], s.model)
    t = FedAsync(SPEC, vector(5))
    t.load_state_dict(s.state_dict())
    assert torch.equal(t.model, s.model) and t.uploads_applied == s.uploads_applied == 8


def test_bad_upload_vector_is_refused_before_any_change():
    s = make_cdfl(2)
    before = s.clusters.clone()
    bad = vector(0)
    bad[3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        s.update(Upload("a", bad, tau=0))
    with pytest.raises(ValueError, match="shape"):
        s.update(Upload("a", bad[:10], tau=0))
    assert torch.equal(s.clusters, before) and s.uploads_applied == 0


def test_base_given_by_the_service_equals_the_strategys_own_record():
    a, b = make_cdfl(2, estimator="direction"), make_cdfl(2, estimator="direction")
    sent = a.join("x").vectors[0]
    b.join("x")
    ra = a.update(Upload("x", vector(0), tau=0))
    rb = b.update(Upload("x", vector(0), tau=0, base=sent.clone()))
    assert ra.alpha == rb.alpha and torch.equal(ra.vectors[0], rb.vectors[0])
    # a different base changes the estimate: the base is really used
    rc = make_cdfl(2, estimator="direction").update(Upload("x", vector(0), tau=0, base=vector(7)))
    assert rc.alpha != ra.alpha


def test_metrics_estimator_keeps_no_per_agent_vectors():
    s = make_cdfl(2, estimator="metrics")
    s.join("a")
    s.update(Upload("a", vector(0), tau=0))
    assert s.last_sent == {} and s.state_dict()["last_sent"] == {}


def after_one_delta_step(**kw) -> tuple[CDFL, torch.Tensor, Reply]:
    """A mixture-reply CDFL with `kw` after one delta-rule upload of alpha [0.75, 0.25]: the
    server, its iterates before the upload, the reply."""
    s = make_cdfl(2, personalization="mixture", update_rule="delta", **kw)
    start = s.clusters.clone()
    s.join("a")
    base = s.mixture([0.5, 0.5])
    step = 0.05 * (vector(0) - base)
    r = s.apply(Upload("a", base + step, tau=0, base=base), alpha=[0.75, 0.25])
    for k, a in enumerate((0.75, 0.25)):  # server_lr 1: the iterate takes the agent's step in its share
        torch.testing.assert_close(s.clusters[k], start[k] + a * step)
    return s, start, r


def restarted(s: CDFL, **kw) -> CDFL:
    """A new mixture-reply CDFL with `kw`, loaded from s's saved state."""
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    b = make_cdfl(2, personalization="mixture", update_rule="delta", **kw)
    b.load_state_dict(torch.load(buf))
    return b


def test_cluster_average_is_served_while_the_iterates_learn_and_survives_a_restart():
    """cdfl.cluster_average: the reported cluster models are the average avg := d avg +
    (1 - d) w after each applied upload; the steps move, and the replies come from, the iterates w."""
    d = 0.9
    s, start, r = after_one_delta_step(average=d)
    want = d * start + (1 - d) * s.clusters
    torch.testing.assert_close(s.server_models(), want)
    torch.testing.assert_close(r.vectors[0], 0.75 * s.clusters[0] + 0.25 * s.clusters[1])  # the iterates' mixture
    assert not torch.allclose(r.vectors[0], 0.75 * want[0] + 0.25 * want[1])
    b = restarted(s, average=d)
    assert torch.equal(b.averaged, s.averaged) and torch.equal(b.clusters, s.clusters)
    off = make_cdfl(2, personalization="mixture", update_rule="delta")
    assert off.averaged is None and off.server_models() is off.clusters
    with pytest.raises(ValueError, match="cluster_average"):
        make_cdfl(2, average=1.0)
    assert CDFL.from_settings(SPEC, clusters(2), proxies(2), CDFLSettings(clusters=2, cluster_average=0.99),
                              device="cpu").average == 0.99


def test_reply_average_makes_replies_from_a_short_average_and_survives_a_restart():
    """cdfl.reply_average: replies (and joins) come from ravg := d ravg + (1 - d) w, while the
    steps still move the iterates w; a state saved without it starts it from the iterates."""
    d = 0.5
    s, start, r = after_one_delta_step(reply_average=d)
    want = d * start + (1 - d) * s.clusters
    torch.testing.assert_close(r.vectors[0], 0.75 * want[0] + 0.25 * want[1])
    torch.testing.assert_close(s.join("b").vectors[0], want.mean(0))
    assert s.server_models() is s.clusters  # reporting is cluster_average's, off here
    assert torch.equal(restarted(s, reply_average=d).reply_averaged, s.reply_averaged)
    fresh = restarted(make_cdfl(2, personalization="mixture", update_rule="delta"), reply_average=d)
    assert torch.equal(fresh.reply_averaged, fresh.clusters)
    with pytest.raises(ValueError, match="reply_average"):
        make_cdfl(2, reply_average=1.0)


def test_a_model_with_batch_norm_statistics_takes_no_proxy_refresh() -> None:
    """The refresh trains in eval mode against mixed running statistics: a ResNet-20 with batch
    norm blew up (a weight from 1 to 571 in two uploads). The GroupNorm variant and the zoo's
    statistics-free models keep the shipped refresh, and so does one built by reference (a folder
    dataset's default) that has no statistics."""
    shipped = CDFLSettings(clusters=2)
    assert shipped.cluster_refresh_steps > 0
    by_reference = "fedmq.models:ReferenceCNN?input=1x28x28&num_classes=5"
    assert model_spec(by_reference).statistics_numel == 0
    for arch, refreshed in (("resnet20", False), ("resnet20-gn", True), (ARCH, True), (by_reference, True)):
        spec = model_spec(arch)
        shape = (16, *spec.input_shape)
        data = [(torch.randn(shape), torch.randint(0, spec.num_classes, (16,))) for _ in range(2)]
        start = torch.stack([to_vector(build_model(arch, seed=i)) for i in range(2)])
        s = CDFL.from_settings(spec, start, data, shipped, device="cpu")
        assert (s.refresh_steps == shipped.cluster_refresh_steps) is refreshed, arch


def test_a_refresh_the_user_asked_for_on_batch_norm_is_refused_aloud(caplog) -> None:
    """The shipped refresh goes off quietly on a batch-norm model; one set by hand (it cannot
    apply) is a warning, so a `--set` that changes nothing says so at a sim's log level."""
    spec = model_spec("resnet20")
    data = [(torch.randn(16, *spec.input_shape), torch.randint(0, spec.num_classes, (16,))) for _ in range(2)]
    start = torch.stack([to_vector(build_model("resnet20", seed=i)) for i in range(2)])
    levels = {}
    for steps in (CDFLSettings.cluster_refresh_steps, 5):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedmq"):
            s = CDFL.from_settings(spec, start, data, CDFLSettings(clusters=2, cluster_refresh_steps=steps),
                                   device="cpu")
        assert s.refresh_steps == 0
        levels[steps] = [r.levelno for r in caplog.records if "cluster_refresh.off" in r.getMessage()]
    assert levels == {CDFLSettings.cluster_refresh_steps: [logging.INFO], 5: [logging.WARNING]}


def test_server_lr_ramp_grows_the_delta_step_to_one_and_resumes_after_a_restart():
    """cdfl.server_lr_ramp: after n applied uploads the delta step is server_lr + (1 - server_lr)
    min(1, n / ramp); a restarted server goes on from its own count, not from server_lr."""
    s = make_cdfl(2, personalization="mixture", update_rule="delta", server_lr=0.25, server_lr_ramp=4,
                  direction_guard=0.0)
    s.join("a")
    steps = []
    for t in range(1, 4):
        base = s.mixture([0.5, 0.5])
        before = s.clusters.clone()
        step = 0.05 * (vector(t) - base)
        r = s.apply(Upload("a", base + step, tau=t - 1, base=base), alpha=[1.0, 0.0])
        torch.testing.assert_close(s.clusters[0], before[0] + r.info["betas"][0] * step)
        steps.append(r.info["betas"][0] / r.info["s"])
    assert steps == pytest.approx([0.25 + 0.75 * t / 4 for t in (1, 2, 3)])
    b = restarted(s, server_lr=0.25, server_lr_ramp=4)
    assert b.delta_rate() == pytest.approx(0.25 + 0.75 * 3 / 4)
    b.uploads_applied = 9
    assert b.delta_rate() == 1.0
    assert make_cdfl(2, server_lr=0.25).delta_rate() == 0.25  # no ramp: the step stays server_lr
    with pytest.raises(ValueError, match="server_lr_ramp"):
        make_cdfl(2, server_lr_ramp=-1)
