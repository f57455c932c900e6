"""Shared replies (cdfl.reply_share): queued uploads with close alphas take one trained reply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregator.cdfl import CDFL, share_groups
from aggregator.personalize import PersonalizeRequest
from aggregator.strategy import Upload
from fedmq.config import CDFLSettings, ConfigError, load_config
from fedmq.models import model_spec

SPEC = model_spec("digits-cnn")
K = 2
SMALL = {"clusters": K, "tau0": 100, "estimator": "metrics", "personalize_epochs": 1, "personalize_min_steps": 0}
"""A one-epoch reply, not the 128-step floor: the tests compare replies, not their quality."""


@pytest.fixture(scope="module")
def world(world_of_two_rotations):
    return world_of_two_rotations


@pytest.mark.parametrize("tolerance", [0.0, 0.05, 0.2, 1.0])
def test_groups_hold_close_alphas_only_and_every_member_is_near_the_mean(tolerance):
    alphas = np.random.default_rng(0).dirichlet([1.0, 1.0, 1.0], size=40).tolist()
    alphas += [alphas[3]]  # an exact repeat shares even at tolerance 0
    groups = share_groups(alphas, tolerance)
    assert sorted(i for g in groups for i in g) == list(range(len(alphas)))
    assert all(g == sorted(g) for g in groups)  # queue order kept within a group
    for g in groups:
        a = np.array([alphas[i] for i in g])
        assert np.abs(a[:, None] - a[None]).max() <= tolerance + 1e-12
        assert np.abs(a - a.mean(0)).max() <= tolerance + 1e-12
    assert any(len(g) > 1 for g in groups)
    if tolerance == 1.0:
        assert len(groups) == 1


def _uploads(w: torch.Tensor, n: int) -> list[Upload]:
    """n uploads near the two specialists in turn (their alphas lean to one cluster or the other)."""
    g = torch.Generator().manual_seed(0)
    return [Upload(f"a{i}", w[i % K] + 0.01 * torch.randn(SPEC.numel, generator=g), tau=0, base=w[i % K])
            for i in range(n)]


def _strategy(world, **settings) -> CDFL:
    _, w, proxies = world
    s = CDFL.from_settings(SPEC, w, proxies, CDFLSettings(**SMALL, **settings), device="cpu")
    for i in range(6):
        s.join(f"a{i}")
    return s


def test_a_group_takes_one_reply_trained_for_its_mean_alpha_after_the_whole_batch(world):
    _, w, _ = world
    shared = _strategy(world, reply_share=1.0)
    trained = []
    personalize = shared.personalizer.personalize
    shared.personalizer.personalize = lambda req: trained.append(req) or personalize(req)
    replies = shared.update_many(_uploads(w, 6))
    assert len(trained) == 1 and shared.counters["replies_shared"] == 5
    assert all(torch.equal(r.vectors[0], replies[0].vectors[0]) for r in replies)
    assert [r.epoch for r in replies] == [6] * 6 and [r.info["shared"] for r in replies] == [6] * 6
    assert len({tuple(r.alpha) for r in replies}) > 1  # each agent still hears its own alpha
    mean = [sum(r.alpha[k] for r in replies) / 6 for k in range(K)]
    assert trained[0].alpha == pytest.approx(mean)
    # the reply is the one trained for that mean from the clusters after all six uploads
    again, _ = shared.personalizer.personalize(
        PersonalizeRequest(shared.clusters.clone(), trained[0].alpha, None, seed=trained[0].seed))
    assert torch.equal(again, replies[0].vectors[0])


def test_tolerance_zero_is_todays_reply_and_far_alphas_keep_their_own(world):
    _, w, _ = world
    ups = _uploads(w, 4)
    today = _strategy(world).update_many(ups)
    off = _strategy(world, reply_share=0.0).update_many(ups)
    assert all(torch.equal(a.vectors[0], b.vectors[0]) and a.epoch == b.epoch for a, b in zip(today, off, strict=True))
    assert not torch.equal(today[0].vectors[0], today[1].vectors[0])
    alphas = [r.alpha for r in today]
    gap = max(abs(x - y) for x, y in zip(alphas[0], alphas[1], strict=True))
    assert gap > 0.02  # the two specialists' uploads do lean apart
    tight = _strategy(world, reply_share=gap / 2)
    replies = tight.update_many(ups)
    assert not torch.equal(replies[0].vectors[0], replies[1].vectors[0])
    assert tight.counters["replies_shared"] == sum(len(g) - 1 for g in share_groups(alphas, gap / 2))


def test_a_reply_that_reads_the_upload_cannot_be_shared_and_the_range_is_checked(world):
    _, w, proxies = world
    for start in ("blend", "upload"):
        with pytest.raises(ValueError, match="reply_share .*personalize_start = mixture or dominant"):
            CDFL.from_settings(SPEC, w, proxies, CDFLSettings(**SMALL, reply_share=0.1, personalize_start=start))
    assert CDFL.from_settings(SPEC, w, proxies, CDFLSettings(**SMALL, reply_share=0.1, personalize_start="blend",
                                                             reply_uses_upload=False)).reply_share == 0.1
    with pytest.raises(ConfigError, match=r"cdfl.reply_share .*in \[0, 1\]"):
        load_config(None, {"cdfl.reply_share": 1.5})


def test_shared_replies_are_journaled_and_recovered_exactly(tmp_path):
    """Replay applies one upload at a time; the journal holds each shared reply and the version it
    was made at, so a restarted aggregator answers a re-sent upload as the live one did."""
    from aggregator.bootstrap import build_engine
    from aggregator.engine import Inbound
    from fedmq import codecs, protocol

    # Speed only: small server sets and one pre-training epoch (the defaults run elsewhere).
    cfg = load_config(None, {"fleet": "s", "cdfl.clusters": K, "data.dataset": "digits",
                             "data.proxy_per_cluster": 100, "data.pretrain_per_cluster": 200,
                             "aggregator.pretrain_epochs": 1, "device": "cpu",
                             "aggregator.state_dir": str(tmp_path / "state"),
                             "cdfl.personalize_epochs": 1, "cdfl.personalize_min_steps": 0,
                             "cdfl.reply_share": 1.0})
    live = build_engine(cfg)
    live.recover()
    agents = [f"car-{i}" for i in range(4)]
    bases = {}
    for a in agents:
        join = protocol.Join(agent=a, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                             model=SPEC.hash, algorithm="cdfl")
        (reply,) = live.handle([Inbound(a, join)])
        bases[a] = (codecs.decode(reply.tensors[0]), reply.epoch)
    rng = np.random.default_rng(0)
    batch = [Inbound(a, protocol.Update(
        agent=a, msg_id=protocol.new_msg_id(), sent_at=protocol.now(), model=SPEC.hash, tau=bases[a][1],
        n_samples=100, tensor=codecs.encode(bases[a][0] + rng.normal(0, 0.01, SPEC.numel).astype(np.float32),
                                            "fp32"))) for a in agents]
    out = live.handle(batch)
    assert live.strategy.counters["replies_shared"] == 3
    # what an operator sees: the metric counts the uploads beyond one per group
    from aggregator.prometheus import ServiceCollector
    from aggregator.service import AggregatorService

    families = {f.name: f for f in ServiceCollector(AggregatorService(cfg, live)).collect()}
    assert families["fedmq_aggregator_shared_replies"].samples[0].value == 3
    assert [r.epoch for r in out] == [len(agents)] * len(agents)  # each reply made after the whole batch
    live.journal.close()

    restarted = build_engine(cfg)
    assert restarted.recover() == 8
    for a in agents:
        ra = protocol.decode(live.agents[a].last_reply, 1 << 24)
        rb = protocol.decode(restarted.agents[a].last_reply, 1 << 24)
        assert (ra.tensors, ra.alpha, ra.epoch) == (rb.tensors, rb.alpha, rb.epoch)
    assert restarted.strategy.last_reply_version == live.strategy.last_reply_version
    assert torch.equal(live.strategy.clusters, restarted.strategy.clusters)
