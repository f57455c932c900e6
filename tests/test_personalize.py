"""Personalization variants and specialist-keeping update rules, on real rotated digits."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from aggregator.cdfl import (
    CDFL,
    GPU_REPLY_BATCH,
    cdfl_personalizer,
    resolve_reply_batch,
    resolve_trunk_share,
    update_weights,
)
from aggregator.cluster_refresh import refresh_cluster
from aggregator.evaluator import ProxyEvaluator
from aggregator.personalize import (
    PERSONALIZATIONS,
    PERSONALIZERS,
    DistillPersonalizer,
    PersonalizeRequest,
    alpha_mixture,
    make_personalizer,
)
from aggregator.strategy import Upload
from fedmq.config import CDFLSettings
from fedmq.data import sample_agent_data
from fedmq.models import build_model, model_spec, to_vector
from fedmq.training import evaluate, fit

ARCH = "digits-cnn"
SPEC = model_spec(ARCH)
K = 2


@pytest.fixture(scope="module")
def world(world_of_two_rotations):
    return world_of_two_rotations


def client(clusters, alpha, seed):
    rng = np.random.default_rng(seed)
    return (sample_agent_data(clusters, np.asarray(alpha), 400, rng, split="train"),
            sample_agent_data(clusters, np.asarray(alpha), 300, rng, split="test"))


def test_mixture_is_the_alpha_weighted_sum_and_cdfl_default():
    w = torch.randn(3, 50)
    out, _ = make_personalizer("mixture", None).personalize(PersonalizeRequest(w, [0.5, 0.3, 0.2], torch.zeros(50)))
    torch.testing.assert_close(out, 0.5 * w[0] + 0.3 * w[1] + 0.2 * w[2])
    assert CDFLSettings().personalization in PERSONALIZATIONS


@pytest.mark.parametrize("name", list(PERSONALIZERS))
def test_every_registered_personalizer_returns_a_finite_model_deterministically(world, name):
    """The registry's contract: any entry gives a finite vector of the model's size, and the
    same request gives the same bits (replay re-derives replies only where the journal does not
    hold them, but a reply must never depend on hidden state)."""
    _, specialists, proxies = world
    evaluator = ProxyEvaluator(SPEC, proxies)
    upload = specialists.mean(0)
    options = {"epochs": 1} if name.startswith(("distill", "finetune")) else {}  # one epoch: speed
    outs = []
    for _ in range(2):
        out, info = make_personalizer(name, evaluator, **options).personalize(PersonalizeRequest(specialists, [0.7, 0.3], upload))
        assert out.shape == (SPEC.numel,) and torch.isfinite(out).all() and isinstance(info, dict)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_unknown_or_unsupported_personalization_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown personalization 'blend'"):
        make_personalizer("blend", None)
    with pytest.raises(ValueError, match="needs the proxy evaluator"):
        make_personalizer("distill", None)


def test_distilled_model_beats_the_parameter_mixture_on_a_mixed_client(world):
    """The issue's diagnosis: a weight-space mixture of specialists is a poor model for a
    client whose data mixes clusters; one student taught by both is much better."""
    clusters, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    alpha = [0.6, 0.4]
    train, test = client(clusters, alpha, 1)
    upload = fit(ARCH, alpha_mixture(w, alpha), train.data.x, train.data.y, epochs=2, lr=0.01,
                 momentum=0.9, anchors=[(alpha_mixture(w, alpha), 0.1)], seed=3).vector
    req = PersonalizeRequest(w, alpha, upload, seed=5)
    acc = {name: evaluate(ARCH, make_personalizer(name, ev, epochs=3).personalize(req)[0],
                          test.data.x, test.data.y)[0]
           for name in ("mixture", "upload", "distill")}
    print(acc)
    assert acc["distill"] >= acc["mixture"] + 0.10


def test_distillation_is_deterministic_and_kd_weight_zero_is_finetune(world):
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    req = PersonalizeRequest(w, [0.7, 0.3], w.mean(0), seed=11)
    a, diag = make_personalizer("distill", ev).personalize(req)
    b, _ = make_personalizer("distill", ev).personalize(req)
    assert torch.equal(a, b) and diag["steps"] > 0
    ft, _ = make_personalizer("finetune", ev).personalize(req)
    ft0, _ = DistillPersonalizer(ev, kd_weight=0.0).personalize(req)
    assert torch.equal(ft, ft0) and not torch.equal(ft, a)
    other, _ = make_personalizer("distill", ev).personalize(PersonalizeRequest(w, [0.7, 0.3], w.mean(0), seed=12))
    assert not torch.equal(a, other)


def test_distill_weights_the_proxy_sets_by_alpha(world):
    """A student for a pure cluster-0 client learns cluster 0 better than cluster 1."""
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    uniform = w.mean(0)
    out, _ = make_personalizer("finetune", ev, epochs=3).personalize(PersonalizeRequest(w, [1.0, 0.0], uniform))
    before = ev.accuracies(uniform[None])[0]
    after = ev.accuracies(out[None])[0]
    assert after[0] - before[0] > after[1] - before[1]


def test_sample_capped_finetune_draws_by_alpha_and_costs_what_it_is_told(world):
    """`samples` per epoch, drawn in proportion to alpha: a pure cluster-0 client's reply
    still learns cluster 0 more than cluster 1, in epochs * ceil(samples / 64) steps."""
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    uniform = w.mean(0)
    capped = make_personalizer("finetune", ev, epochs=3, samples=100)
    out, diag = capped.personalize(PersonalizeRequest(w, [1.0, 0.0], uniform, seed=2))
    assert diag["steps"] == 3 * 2
    before, after = ev.accuracies(uniform[None])[0], ev.accuracies(out[None])[0]
    assert after[0] - before[0] > after[1] - before[1]
    again, _ = capped.personalize(PersonalizeRequest(w, [1.0, 0.0], uniform, seed=2))
    assert torch.equal(out, again)
    with pytest.raises(ValueError, match="samples >= 0"):
        make_personalizer("finetune", ev, samples=-1)


def test_update_rules_by_hand():
    assert update_weights([0.6, 0.4], "alpha") == [0.6, 0.4]
    assert update_weights([0.6, 0.4], "sharpen", 2.0) == pytest.approx([0.36 / 0.52, 0.16 / 0.52])
    h = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    assert update_weights([0.6, 0.4], "confidence") == pytest.approx([0.6 * (1 - h / math.log(2)),
                                                                      0.4 * (1 - h / math.log(2))])
    assert update_weights([0.5, 0.5], "confidence") == pytest.approx([0.0, 0.0])
    assert update_weights([1.0, 0.0], "confidence") == pytest.approx([1.0, 0.0])


def test_cdfl_applies_the_sharpened_shares_and_replays_distillation_exactly(world):
    _, w, proxies = world
    settings = CDFLSettings(clusters=K, tau0=100, personalization="distill", update_rule="sharpen",
                            update_power=2.0, personalize_epochs=1)
    s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
    s.join("a")
    state = s.state_dict()
    v = w.mean(0) + 0.01
    reply = s.apply(Upload("a", v, tau=0), alpha=[0.75, 0.25])
    assert reply.info["betas"] == pytest.approx([0.025 * 0.9, 0.025 * 0.1])
    assert reply.info["personalization"] == "distill"
    # journal replay: the same record on the same state rebuilds the same model, bit for bit
    replay = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
    replay.load_state_dict(state)
    again = replay.apply(Upload("a", v, tau=0), alpha=[0.75, 0.25])
    assert torch.equal(reply.vectors[0], again.vectors[0])
    assert not torch.equal(reply.vectors[0], replay.mixture([0.75, 0.25]))


def test_joins_still_get_the_uniform_mixture(world):
    _, w, proxies = world
    s = CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, personalization="distill"), device="cpu")
    torch.testing.assert_close(s.join("a").vectors[0], w.mean(0))


def test_cluster_refresh_pulls_a_blurred_cluster_back_and_replays_exactly(world):
    """After the update, a moved cluster trains on its own proxy set; an unmoved one is untouched."""
    clusters, w, proxies = world
    settings = CDFLSettings(clusters=K, tau0=100, beta0=0.5, personalization="mixture",
                            cluster_refresh_steps=20, cluster_refresh_lr=0.05)
    plain = CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, tau0=100, beta0=0.5,
                                                              personalization="mixture",
                                                              cluster_refresh_steps=0), device="cpu")
    s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
    for strategy in (plain, s):
        strategy.join("a")
    state = s.state_dict()
    blur = w.mean(0)  # an upload between the specialists: the paper's rule pulls w_0 halfway to it
    up = Upload("a", blur, tau=0)
    plain.apply(up, alpha=[1.0, 0.0])
    reply = s.apply(up, alpha=[1.0, 0.0])
    assert reply.info["refresh_seconds"] >= 0
    torch.testing.assert_close(s.clusters[1], w[1], rtol=0, atol=0)  # beta_1 = 0: not refreshed
    test0 = clusters.test(0)
    acc_plain = evaluate(ARCH, plain.clusters[0], test0.x, test0.y)[0]
    acc_refreshed = evaluate(ARCH, s.clusters[0], test0.x, test0.y)[0]
    assert acc_refreshed > acc_plain + 0.02, (acc_plain, acc_refreshed)
    replay = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
    replay.load_state_dict(state)
    replay.apply(up, alpha=[1.0, 0.0])
    assert torch.equal(replay.clusters, s.clusters)


def test_cluster_refresh_refuses_bad_settings(world):
    _, w, proxies = world
    with pytest.raises(ValueError, match="cluster_refresh_steps"):
        CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, cluster_refresh_steps=-1), device="cpu")
    with pytest.raises(ValueError, match="cluster_refresh_lr"):
        CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, cluster_refresh_steps=1,
                                                          cluster_refresh_lr=0.0), device="cpu")


def test_cluster_refresh_never_climbs_its_batch_loss_at_a_rate_too_high_for_the_model(world):
    """A rate far above the specialist's stable one: a plain step wrecks the cluster (the
    ResNet-20 collapse); the refresh halves it until its batch loss falls, or skips the step."""
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    loss = lambda v: float(ev.losses(v[None])[0, 0])  # noqa: E731
    before = loss(w[0])
    plain = w[0] - 50.0 * ev.gradients(w[0])[0]
    assert loss(plain) > 2 * before + 1.0, (before, loss(plain))
    counts: Counter[str] = Counter()
    guarded = refresh_cluster(ev, w[0], 0, steps=3, lr=50.0, seed=1, counters=counts)
    assert counts["refresh_halved"] >= 3, counts  # every step needed a smaller rate
    assert loss(guarded) < before * 1.5, (before, loss(guarded), counts)
    sane: Counter[str] = Counter()
    refreshed = refresh_cluster(ev, w[0], 0, steps=3, lr=0.05, seed=1, counters=sane)
    assert not torch.equal(refreshed, w[0]) and sane["refresh_skipped"] == 0, sane
    with pytest.raises(ValueError, match="backtracks"):
        refresh_cluster(ev, w[0], 0, steps=1, lr=0.05, backtracks=-1)


def test_reply_starts_from_the_upload_the_mixture_the_dominant_cluster_or_the_best_blend(world):
    """Only the non-upload starts put the cluster models (the fleet) into the reply."""
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    noise = torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(0)) * 0.5
    alpha = [0.3, 0.7]
    req = PersonalizeRequest(w, alpha, noise, seed=1)

    def start(name: str, **kw):
        return DistillPersonalizer(ev, start=name, **kw).start_vector(req)

    assert torch.equal(start("upload")[0], noise)
    torch.testing.assert_close(start("mixture")[0], alpha_mixture(w, alpha))
    v, info = start("dominant")
    assert torch.equal(v, w[1]) and info["cluster"] == 1
    grid = [0.0, 0.25, 0.5, 0.75, 1.0]
    v, info = start("blend", blend_grid=grid)
    losses = [float(ev.losses(((1 - g) * noise + g * alpha_mixture(w, alpha))[None])[0] @ torch.tensor(alpha))
              for g in grid]
    assert info["lam"] == grid[int(np.argmin(losses))] and info["lam"] > 0  # a random upload loses
    # a join (no upload) starts from the mixture whatever the start
    join = PersonalizeRequest(w, alpha, None)
    assert DistillPersonalizer(ev, start="blend").start_vector(join)[1] == {"start": "mixture"}
    with pytest.raises(ValueError, match="personalize_start must be one of"):
        DistillPersonalizer(ev, start="average")
    with pytest.raises(ValueError, match="personalize_blend_grid"):
        DistillPersonalizer(ev, start="blend", blend_grid=[1.5])


def test_mixture_guard_starts_the_reply_from_the_best_cluster_once_the_clusters_average_to_no_model(world):
    """Two good models trained from different inits share no basin: their weight average is no
    model. The guard then starts the reply from the cluster that fits the reply's data best;
    specialists from one init keep the paper's mixture."""
    clusters, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    both = [clusters.pretrain(k, 300) for k in range(K)]
    x, y = torch.cat([d.x for d in both]), torch.cat([d.y for d in both])
    apart = torch.stack([fit(ARCH, to_vector(build_model(ARCH, seed=s)), x, y, epochs=10, lr=0.05, momentum=0.9,
                             seed=s).vector for s in (0, 7)])
    alpha = [0.3, 0.7]
    full = ev.losses(torch.stack([alpha_mixture(apart, alpha), *apart])) @ torch.tensor(alpha)
    assert full[0] > min(full[1:]) + 0.5, full  # the average really is no model
    req = PersonalizeRequest(apart, alpha, torch.zeros(SPEC.numel), seed=3)
    v, info = DistillPersonalizer(ev, start="mixture", mixture_guard=0.1).start_vector(req)
    assert info["start"] == "cluster" and torch.equal(v, apart[info["cluster"]])
    assert info["mixture_loss"] > info["cluster_loss"] + 0.1
    off, info = DistillPersonalizer(ev, start="mixture", mixture_guard=0.0).start_vector(req)
    assert info == {"start": "mixture"}
    torch.testing.assert_close(off, alpha_mixture(apart, alpha))
    one_basin = PersonalizeRequest(w, alpha, torch.zeros(SPEC.numel), seed=3)
    assert DistillPersonalizer(ev, start="mixture", mixture_guard=0.1).start_vector(one_basin)[1] == {"start": "mixture"}
    # The shipped default turns it on for the trained reply, and CDFL counts the guarded starts.
    settings = CDFLSettings(clusters=K, personalize_epochs=1)
    assert settings.personalize_mixture_guard == 0.1
    assert cdfl_personalizer(settings, ev).mixture_guard == 0.1
    s = CDFL.from_settings(SPEC, apart, proxies, settings, device="cpu")
    s.join("a")
    base = apart.mean(0)
    reply = s.apply(Upload("a", base, tau=0, base=base), alpha=alpha)
    assert reply.info["personalize"]["start"] == "cluster" and s.counters["mixture_guarded"] == 1
    with pytest.raises(ValueError, match="mixture_guard"):
        DistillPersonalizer(ev, mixture_guard=-1)


def test_frozen_control_refreshes_like_the_variant_and_proxy_only_ignores_the_upload(world):
    """beta0 = 0: uploads never move the clusters, yet the proxy refresh runs as in the variant
    (same clusters whatever was uploaded); reply_uses_upload = false: the reply is the same
    whatever the agent uploaded."""
    _, w, proxies = world
    base = dict(clusters=K, tau0=100, personalization="finetune", personalize_epochs=1, personalize_start="upload",
                cluster_refresh_steps=2, cluster_refresh_lr=0.05)
    ups = [Upload("a", w[0] + 0.1 * torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(s)), tau=0)
           for s in (1, 2)]

    def after(settings: CDFLSettings, up: Upload):
        s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
        s.join("a")
        versions = list(s.versions)
        reply = s.apply(up, alpha=[0.8, 0.2])
        return s, reply.vectors[0], versions

    frozen = CDFLSettings(**base, beta0=0.0)
    (s1, r1, v0), (s2, r2, _) = after(frozen, ups[0]), after(frozen, ups[1])
    assert torch.equal(s1.clusters, s2.clusters) and not torch.equal(s1.clusters, w)  # refreshed
    assert all(a > b for a, b in zip(s1.versions, v0, strict=True))  # the loss cache sees the refresh
    assert not torch.equal(r1, r2)  # the reply still starts from the upload
    proxy_only = CDFLSettings(**base, beta0=0.0, reply_uses_upload=False)
    (_, p1, _), (_, p2, _) = after(proxy_only, ups[0]), after(proxy_only, ups[1])
    assert torch.equal(p1, p2)
    moving = CDFLSettings(**base, beta0=0.5)
    m1, _, _ = after(moving, ups[0])
    m2, _, _ = after(moving, ups[1])
    assert not torch.equal(m1.clusters, m2.clusters)  # with beta0 > 0 the upload moves them


def test_delta_rule_adds_the_agents_step_to_each_cluster_in_its_share(world):
    """w_k += beta0 alpha_k s (v - base): the specialist keeps its place and gains the agent's
    learning; without a base (an older aggregator state) the paper's pull is used."""
    _, w, proxies = world
    s = CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, tau0=100, beta0=0.5, server_lr=0.5, update_rule="delta",
                                                          personalization="mixture", cluster_refresh_steps=0,
                                                          delta_moves_head=True),
                           device="cpu")
    s.join("a")
    base = w.mean(0)
    step = 0.01 * torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(3))
    reply = s.apply(Upload("a", base + step, tau=0, base=base), alpha=[0.8, 0.2])
    assert reply.info["rule"] == "delta"
    torch.testing.assert_close(s.clusters[0], w[0] + 0.5 * 0.8 * step)
    torch.testing.assert_close(s.clusters[1], w[1] + 0.5 * 0.2 * step)
    s.apply(Upload("a", base, tau=1), alpha=[1.0, 0.0])  # no base: pull toward v
    torch.testing.assert_close(s.clusters[0], 0.5 * (w[0] + 0.5 * 0.8 * step) + 0.5 * base)


def test_delta_rule_without_the_head_moves_only_the_layers_below_it(world):
    """cdfl.delta_moves_head = false: the agent's step reaches every parameter but the output
    layer's weight and bias, which stay where the cluster's own proxy refresh puts them."""
    _, w, proxies = world
    settings = CDFLSettings(clusters=K, tau0=100, server_lr=0.5, update_rule="delta", personalization="mixture",
                            cluster_refresh_steps=0, delta_moves_head=False)
    s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
    s.join("a")
    base = w.mean(0)
    step = 0.01 * torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(3))
    s.apply(Upload("a", base + step, tau=0, base=base), alpha=[0.8, 0.2])
    head = sum(math.prod(shape) for shape in SPEC.shapes[-2:])
    assert SPEC.names[-2:] == ("fc2.weight", "fc2.bias")
    torch.testing.assert_close(s.clusters[0, :-head], w[0, :-head] + 0.5 * 0.8 * step[:-head])
    assert torch.equal(s.clusters[:, -head:], w[:, -head:])


@pytest.mark.parametrize("moves_head", [False, True])
def test_trunk_share_gives_every_cluster_the_step_below_the_head(world, moves_head):
    """cdfl.trunk_share = 1: every cluster's layers below the output layer take the agent's whole
    step (a cluster of alpha 0 too); the output layer keeps its alpha share (or stays, with the
    heads kept). 0.5 is halfway between that and the alpha share."""
    _, w, proxies = world
    head = sum(math.prod(shape) for shape in SPEC.shapes[-2:])
    base = w.mean(0)
    step = 0.01 * torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(3))
    for share in (1.0, 0.5):
        settings = CDFLSettings(clusters=K, tau0=100, server_lr=0.5, update_rule="delta", personalization="mixture",
                                cluster_refresh_steps=0, delta_moves_head=moves_head, trunk_share=share)
        s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
        s.join("a")
        s.apply(Upload("a", base + step, tau=0, base=base), alpha=[1.0, 0.0])
        for k, a in enumerate((1.0, 0.0)):
            trunk = 0.5 * ((1 - share) * a + share)
            torch.testing.assert_close(s.clusters[k, :-head], w[k, :-head] + trunk * step[:-head])
            expected_head = w[k, -head:] + (0.5 * a * step[-head:] if moves_head else 0.0)
            torch.testing.assert_close(s.clusters[k, -head:], expected_head)
    with pytest.raises(ValueError, match="trunk_share"):
        CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, trunk_share=1.5), device="cpu")


def test_the_default_trunk_share_is_half_from_three_clusters_and_none_at_two(world):
    """cdfl.trunk_share = -1 (the default): 0.5 at K >= 3, 0 at K = 2 (docs/results_cdfl.md
    #cluster-updates); an explicit share is kept whatever K."""
    assert CDFLSettings().trunk_share == -1.0
    assert resolve_trunk_share(-1.0, 2) == 0.0
    assert resolve_trunk_share(-1.0, 3) == resolve_trunk_share(-1.0, 6) == 0.5
    assert resolve_trunk_share(0.25, 2) == 0.25 and resolve_trunk_share(0.0, 6) == 0.0
    with pytest.raises(ValueError, match="trunk_share"):
        resolve_trunk_share(-0.5, 3)
    _, w, proxies = world
    assert CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=2), device="cpu").trunk_share == 0.0
    three = CDFL.from_settings(SPEC, torch.cat([w, w[:1]]), [*proxies, proxies[0]], CDFLSettings(clusters=3),
                               device="cpu")
    assert three.trunk_share == 0.5


def test_trunk_guard_keeps_a_shared_step_only_where_it_does_not_hurt_the_clusters_proxy_loss(world):
    """cdfl.trunk_guard: cluster 1 (alpha 0) takes the shared trunk step when it lowers its own
    proxy loss (a descent step for it) and refuses it, staying put, when it raises it."""
    _, w, proxies = world
    settings = CDFLSettings(clusters=K, tau0=100, server_lr=0.5, update_rule="delta", personalization="mixture",
                            cluster_refresh_steps=0, delta_moves_head=False, trunk_share=1.0, trunk_guard=True)
    head = sum(math.prod(shape) for shape in SPEC.shapes[-2:])
    for sign, kept in ((-1.0, True), (1.0, False)):
        s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
        s.join("a")
        base = w[0].clone()  # the agent starts from cluster 0 and steps along cluster 1's gradient
        step = sign * 0.05 * s.evaluator.gradients(w[1])[1]
        step[-head:] = 0.0
        reply = s.apply(Upload("a", base + step, tau=0, base=base), alpha=[1.0, 0.0])
        expected = w[1] + 0.5 * step if kept else w[1]
        torch.testing.assert_close(s.clusters[1], expected)
        assert (reply.info.get("trunk_refused") == [1]) is not kept
        assert s.counters["trunk_refused"] == (0 if kept else 1)


def test_refresh_all_refreshes_a_cluster_the_upload_had_no_share_of(world):
    """cdfl.cluster_refresh_all: the proxy refresh also runs on clusters of alpha 0 (which a
    trunk_share step moves), in the frozen control too (beta0 = server_lr = 0)."""
    _, w, proxies = world
    base = w.mean(0)
    for refresh_all in (False, True):
        settings = CDFLSettings(clusters=K, tau0=100, beta0=0.0, server_lr=0.0, personalization="mixture",
                                cluster_refresh_steps=1, cluster_refresh_all=refresh_all)
        s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
        s.join("a")
        s.apply(Upload("a", base + 0.01, tau=0, base=base), alpha=[1.0, 0.0])
        assert not torch.equal(s.clusters[0], w[0])  # refreshed: its share was 1
        assert torch.equal(s.clusters[1], w[1]) is not refresh_all


def test_default_reply_carries_another_agents_upload_and_the_frozen_control_does_not(world):
    """The federating reply with the defaults (mixture start, delta rule): agent b's reply depends on what
    agent a uploaded before it, and does not once the clusters are frozen (beta0 = server_lr =
    0, the experiments' control)."""
    _, w, proxies = world
    defaults = CDFLSettings()
    assert (defaults.personalize_start, defaults.update_rule) == ("mixture", "delta")
    base = w.mean(0)
    steps = [0.05 * torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]

    def reply_to_b(settings: CDFLSettings, a_step: torch.Tensor) -> torch.Tensor:
        s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
        s.join("a")
        s.join("b")
        s.apply(Upload("a", base + a_step, tau=0, base=base), alpha=[0.7, 0.3])
        return s.apply(Upload("b", base, tau=1, base=base), alpha=[0.6, 0.4]).vectors[0]

    small = {"clusters": K, "personalize_epochs": 1}  # defaults otherwise; one epoch for speed
    assert not torch.equal(reply_to_b(CDFLSettings(**small), steps[0]), reply_to_b(CDFLSettings(**small), steps[1]))
    frozen = CDFLSettings(**small, beta0=0.0, server_lr=0.0)
    assert torch.equal(reply_to_b(frozen, steps[0]), reply_to_b(frozen, steps[1]))
    # cdfl.personalize_batch_size reaches the reply's training: half the batch, twice the steps
    halves = CDFLSettings(**small, personalize_batch_size=32)
    assert CDFL.from_settings(SPEC, w, proxies, halves, device="cpu").personalizer.batch_size == 32
    assert not torch.equal(reply_to_b(halves, steps[0]), reply_to_b(CDFLSettings(**small), steps[0]))


@pytest.mark.parametrize("samples", [0, 96])
def test_replies_trained_together_match_replies_trained_one_by_one(world, samples):
    """cdfl.reply_batch: queued uploads' replies trained in one vmapped pass are the replies made
    one at a time, each from the clusters after its own upload, up to float rounding."""
    _, w, proxies = world
    base = w.mean(0)
    uploads = [Upload(f"a{i}", base + 0.02 * torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(i)),
                      tau=0, base=base) for i in range(4)]

    def replies(reply_batch: int) -> list:
        # 10 steps, not the 128-step floor: float rounding between the two paths grows with steps
        settings = CDFLSettings(clusters=K, tau0=100, estimator="metrics", personalize_epochs=2,
                                personalize_min_steps=0, personalize_samples=samples, reply_batch=reply_batch)
        s = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu")
        for u in uploads:
            s.join(u.agent)
        return s.update_many(uploads)

    one, together = replies(1), replies(4)
    assert [r.info["personalize"].get("batched") for r in together] == [4] * 4
    for a, b in zip(one, together, strict=True):
        assert a.epoch == b.epoch and a.alpha == b.alpha
        torch.testing.assert_close(a.vectors[0], b.vectors[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(one[0].vectors[0], one[3].vectors[0])  # the replies do differ


def test_reply_batch_defaults_to_one_on_a_cpu_and_to_the_measured_batch_on_a_gpu(world):
    """cdfl.reply_batch = 0 (the default) resolves by device: batching paid on an H200 for both
    models and lost for cnn28 on a 2-core CPU (docs/results_cdfl.md#cost)."""
    _, w, proxies = world
    assert CDFLSettings().reply_batch == 0
    assert CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K), device="cpu").reply_batch == 1
    assert CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, reply_batch=4), device="cpu").reply_batch == 4
    assert resolve_reply_batch(0, torch.device("cuda")) == GPU_REPLY_BATCH == 8
    assert resolve_reply_batch(3, torch.device("cuda")) == 3
    with pytest.raises(ValueError, match="reply_batch (must be )?>= 0"):
        CDFL.from_settings(SPEC, w, proxies, CDFLSettings(clusters=K, reply_batch=-1), device="cpu")


def test_personalize_many_groups_replies_whose_epochs_differ(world):
    """alpha = [1, 0] leaves cluster 1's samples out of the draw: a shorter epoch, its own group."""
    _, w, proxies = world
    p = make_personalizer("finetune", ProxyEvaluator(SPEC, proxies, device="cpu"), epochs=1, start="mixture")
    requests = [PersonalizeRequest(w, alpha, None, seed=i) for i, alpha in enumerate([[0.6, 0.4], [1.0, 0.0], [0.3, 0.7]])]
    for r in requests:
        p.fix_start(r)
    made = p.personalize_many(requests)
    assert [d["batched"] for _, d in made] == [2, 1, 2]
    for r, (v, _) in zip(requests, made, strict=True):
        torch.testing.assert_close(v, p.personalize(r)[0], atol=1e-5, rtol=1e-4)


def test_min_steps_stretch_the_epochs_of_a_reply_over_few_samples(world):
    """cdfl.personalize_min_steps: epochs grow until the reply takes at least that many SGD
    steps; where the epochs already give them, the reply is the same model; trained together
    the replies take the same steps as one by one."""
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    one_set = PersonalizeRequest(w, [1.0, 0.0], None, seed=3)  # 150 samples: 3 batches of 64 per epoch
    both = PersonalizeRequest(w, [0.5, 0.5], None, seed=3)  # 300 samples: 5 per epoch
    plain = make_personalizer("finetune", ev, epochs=2, start="mixture")
    floor = make_personalizer("finetune", ev, epochs=2, start="mixture", min_steps=10)
    assert plain.personalize(one_set)[1]["steps"] == 6
    assert floor.personalize(one_set)[1]["steps"] == 12  # 4 epochs of 3: the first count >= 10
    v, diag = floor.personalize(both)
    assert diag["steps"] == 10  # 2 epochs of 5 already make 10
    torch.testing.assert_close(v, plain.personalize(both)[0], atol=0, rtol=0)
    requests = [PersonalizeRequest(w, a, None, seed=i) for i, a in enumerate([[1.0, 0.0], [1.0, 0.0]])]
    for r in requests:
        floor.fix_start(r)
    assert [d["steps"] for _, d in floor.personalize_many(requests)] == [12, 12]
    capped = make_personalizer("finetune", ev, epochs=2, start="mixture", min_steps=10, samples=64)
    assert capped.personalize(one_set)[1]["steps"] == 2  # personalize_samples caps the cost: no floor
    with pytest.raises(ValueError, match="min_steps"):
        make_personalizer("finetune", ev, min_steps=-1)
    settings = CDFLSettings(clusters=K, estimator="metrics", personalize_min_steps=64)
    assert CDFL.from_settings(SPEC, w, proxies, settings, device="cpu").personalizer.min_steps == 64


def test_tail_average_is_the_mean_of_the_last_iterates_one_by_one_and_together(world):
    """cdfl.personalize_tail_average: the reply is the mean of the iterates of its last
    steps. With one 64-sample draw per epoch, a run of j epochs stops at the j-th iterate of
    a longer run with the same seed, so the mean can be rebuilt from shorter runs."""
    _, w, proxies = world
    ev = ProxyEvaluator(SPEC, proxies, device="cpu")
    request = PersonalizeRequest(w, [0.7, 0.3], None, seed=5)
    iterate = {j: make_personalizer("finetune", ev, epochs=j, start="mixture", samples=64).personalize(request)[0]
               for j in (4, 5, 6)}
    tail = make_personalizer("finetune", ev, epochs=6, start="mixture", samples=64, tail_average=0.5)
    v, diag = tail.personalize(request)
    assert diag["steps"] == 6
    torch.testing.assert_close(v, (iterate[4] + iterate[5] + iterate[6]) / 3, atol=1e-6, rtol=1e-5)
    assert not torch.equal(v, iterate[6])
    last_only = make_personalizer("finetune", ev, epochs=6, start="mixture", samples=64, tail_average=0.01)
    torch.testing.assert_close(last_only.personalize(request)[0], iterate[6], atol=0, rtol=0)
    requests = [PersonalizeRequest(w, a, None, seed=i) for i, a in enumerate([[0.7, 0.3], [0.2, 0.8]])]
    for r in requests:
        tail.fix_start(r)
    for r, (u, _) in zip(requests, tail.personalize_many(requests), strict=True):
        torch.testing.assert_close(u, tail.personalize(r)[0], atol=1e-5, rtol=1e-4)
    for bad in ({"tail_average": 1.5}, {"tail_average": -0.1}, {"rho": -1.0}):
        with pytest.raises(ValueError, match="tail_average|rho"):
            make_personalizer("finetune", ev, **bad)


def test_personalize_rho_holds_the_reply_near_its_start(world):
    """cdfl.personalize_rho: the proximal term toward the start shortens the reply's move."""
    _, w, proxies = world
    request = PersonalizeRequest(w, [0.5, 0.5], None, seed=1)
    start = alpha_mixture(w, [0.5, 0.5])
    moves = []
    for rho in (0.0, 10.0):
        settings = CDFLSettings(clusters=K, estimator="metrics", personalize_rho=rho, personalize_epochs=2,
                                personalize_min_steps=0)
        personalizer = CDFL.from_settings(SPEC, w, proxies, settings, device="cpu").personalizer
        moves.append(float((personalizer.personalize(request)[0] - start).norm()))
    assert moves[1] < 0.8 * moves[0]
