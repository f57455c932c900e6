"""Data sketches (fedmq/sketch.py) and CDFL's sketch estimator, end to end.

The sketch is what lets the server's mixture estimate beat FedSoft's client-side argmin
(tests/test_estimation.py measures that); here: it is deterministic and mixes linearly, NNLS
recovers exact mixtures, the engine refuses bad sketches and changes nothing, and an agent
sends one over a real Mosquitto that the aggregator uses.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from aggregator.bootstrap import build_engine
from aggregator.service import AggregatorService
from edge_agent.protocol_client import EdgeAgent
from fedmq import codecs, protocol, sketch
from fedmq.config import load_config
from fedmq.data import RotatedClusters, load_dataset
from tests.test_aggregator_service import make_cfg, pretrained  # noqa: F401
from tests.test_poisoning import SMALL, Client, assert_unchanged, fingerprint, refused
from tests.test_poisoning import pretrained as poison_pretrained  # noqa: F401


@pytest.fixture(scope="module")
def rotated() -> RotatedClusters:
    return RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), 3, seed=0,
                           proxy_per_cluster=150, pretrain_per_cluster=10)


def test_sketch_is_deterministic_and_mixes_linearly(rotated) -> None:
    a, b = rotated.proxy(0).x[:120], rotated.proxy(1).x[:80]
    sa, sb = sketch.data_sketch(a), sketch.data_sketch(b)
    assert sa.shape == (sketch.DIM,) and sa.dtype == np.float32
    assert np.array_equal(sa, sketch.data_sketch(a.clone()))
    assert np.abs(sa).max() <= 1.0
    both = sketch.data_sketch(torch.cat([a, b]))
    np.testing.assert_allclose(both, 0.6 * sa + 0.4 * sb, atol=1e-5)
    assert not np.allclose(sa, sb, atol=0.05)  # rotations look different to it
    with pytest.raises(ValueError, match="empty"):
        sketch.data_sketch(a[:0])


def test_nnls_recovers_an_exact_mixture_of_the_proxy_sets(rotated) -> None:
    proxies = [rotated.proxy(k).x for k in range(3)]
    clusters = np.stack([sketch.data_sketch(x) for x in proxies])
    mixed = torch.cat([proxies[0][:100], proxies[1][:30], proxies[2][:20]])
    # the client's data is a subset, not the whole proxy sets: sampling noise remains
    alpha = sketch.mixture_from_sketch(sketch.data_sketch(mixed), clusters)
    np.testing.assert_allclose(alpha, [100 / 150, 30 / 150, 20 / 150], atol=0.08)
    exact = (2 * clusters[0] + clusters[2]) / 3
    np.testing.assert_allclose(sketch.mixture_from_sketch(exact, clusters), [2 / 3, 0, 1 / 3], atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        sketch.mixture_from_sketch(exact[:10], clusters)


def test_sketch_fit_plain_is_nnls_and_whitened_recovers_an_exact_mixture_too(rotated) -> None:
    """SketchFit: shrinkage 1 is `mixture_from_sketch` on the references' sketches, bit for bit;
    whitened, an exact mixture of the reference sketches is still recovered exactly (W is
    invertible); a sketch of another length and a shrinkage outside (0, 1] are refused."""
    proxies = [rotated.proxy(k).x for k in range(3)]
    plain, whitened = sketch.SketchFit(proxies, 1.0), sketch.SketchFit(proxies, 0.25)
    assert plain.whiten is None and whitened.whiten.shape == (sketch.DIM, sketch.DIM)
    mixed = sketch.data_sketch(torch.cat([proxies[0][:100], proxies[1][:30]]))
    assert np.array_equal(plain.mixture(mixed), sketch.mixture_from_sketch(mixed, plain.sketches))
    exact = (2 * plain.sketches[0] + plain.sketches[2]) / 3
    np.testing.assert_allclose(whitened.mixture(exact), [2 / 3, 0, 1 / 3], atol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        whitened.mixture(exact[:10])
    with pytest.raises(ValueError, match="shrinkage"):
        sketch.SketchFit(proxies, 0.0)


def _with_sketch(c: Client, values: np.ndarray, method: str = sketch.METHOD) -> protocol.Update:
    up = c.update(codecs.encode(c.base, "fp32", base=c.base))
    return protocol.Update(**{**up.__dict__, "sketch": values.astype("<f2").tobytes(),
                              "sketch_method": method})


def test_engine_refuses_bad_sketches_and_uses_a_good_one(poison_pretrained, tmp_path, rotated) -> None:  # noqa: F811
    state = tmp_path / "state"
    shutil.copytree(poison_pretrained, state)
    cfg = load_config(None, {**SMALL, "aggregator.state_dir": str(state), "cdfl.estimator": "sketch",
                             "cdfl.personalization": "mixture"})
    engine = build_engine(cfg)
    engine.recover()
    c = Client(engine, "car-1")
    before = fingerprint(engine)
    good = sketch.data_sketch(engine.strategy.evaluator.proxies[1][0])
    bad = {
        "other method": _with_sketch(c, good, method="rff-8-v0"),
        "short": _with_sketch(c, good[:100]),
        "nan": _with_sketch(c, np.where(np.arange(sketch.DIM) == 5, np.nan, good)),
        "out of range": _with_sketch(c, good * 3),
    }
    for what, env in bad.items():
        assert refused(c.send(env), "bad_sketch"), what
    assert_unchanged(before, engine)
    assert engine.counters["rejected.bad_sketch"] == 4
    reply = c.send(_with_sketch(c, good))  # the sketch of proxy set 1 itself
    assert isinstance(reply, protocol.Model), reply
    assert reply.alpha is not None and reply.alpha[1] > 0.95, reply.alpha
    c.install(reply)
    plain = c.send(c.update(codecs.encode(c.base, "fp32", base=c.base)))  # no sketch: fallback
    assert isinstance(plain, protocol.Model) and plain.alpha is not None


def test_agent_sends_its_sketch_and_the_aggregator_fits_it(mosquitto, pretrained, tmp_path, rotated) -> None:  # noqa: F811
    state = tmp_path / "state"
    shutil.copytree(pretrained, state)
    cfg = make_cfg(mosquitto.url, state, **{"cdfl.estimator": "sketch", "cdfl.personalization": "mixture",
                                             "agent.state_dir": str(tmp_path / "agent")})
    with AggregatorService(cfg, build_engine(cfg)) as svc:
        agent = EdgeAgent(cfg, "car-7").start()
        try:
            agent.join()
            x = svc.engine.strategy.evaluator.proxies[0][0]  # data that is all cluster 0
            env = agent.update_envelope(agent.installed.vector, len(x), inputs=x)
            assert env.sketch_method == sketch.METHOD
            sent = np.frombuffer(env.sketch, dtype="<f2").astype(np.float32)
            np.testing.assert_allclose(sent, sketch.data_sketch(x), atol=1e-3)  # float16 on the wire
            installed, _ = agent.upload(env)
            assert installed.alpha is not None and installed.alpha[0] > 0.95, installed.alpha
            assert svc.engine.counters["applied.update"] == 1
            cfg.agent.send_sketch = False
            assert agent.update_envelope(agent.installed.vector, len(x), inputs=x).sketch is None
        finally:
            agent.stop()


def _shapes_clusters(k: int) -> RotatedClusters:
    return RotatedClusters(load_dataset("shapes"), load_dataset("shapes", train=False), k, seed=0,
                           proxy_per_cluster=100, pretrain_per_cluster=300)


def _shapes_fit(clusters: RotatedClusters) -> sketch.SketchFit:
    k = clusters.num_clusters
    return sketch.SketchFit([torch.cat([clusters.proxy(i, 100).x, clusters.pretrain(i, 300).x]) for i in range(k)],
                            0.25)


def test_the_fit_knows_which_clusters_its_sketches_cannot_tell_apart(rotated, caplog) -> None:
    """Shapes a quarter turn apart look alike (docs/results_realsize.md): at K = 4 every pair is
    blind and the estimator says so once, in a warning; at K = 3, and on rotated digits, none is."""
    from aggregator.estimators import SketchEstimator
    from aggregator.evaluator import ProxyEvaluator
    from fedmq.models import model_spec

    clusters = _shapes_clusters(4)
    four = _shapes_fit(clusters)
    assert {(i, j) for i, j, _ in four.blind_pairs()} == {(i, j) for i in range(4) for j in range(i + 1, 4)}
    assert not _shapes_fit(_shapes_clusters(3)).blind_pairs()
    digits = sketch.SketchFit([rotated.proxy(k, 100).x for k in range(rotated.num_clusters)], 0.25)
    assert not digits.blind_pairs() and np.isinf(np.diag(digits.separation(256))).all()
    np.testing.assert_allclose(four.separation(1024)[0, 1], 2 * four.separation(256)[0, 1])  # noise ~ 1/sqrt(n)

    estimator = SketchEstimator()
    ev = ProxyEvaluator(model_spec("cnn32-10"), [(p.x, p.y) for p in (clusters.proxy(k, 100) for k in range(4))],
                        device="cpu")
    with caplog.at_level("WARNING", logger="fedmq"):
        estimator.sketch_fit(ev)
        estimator.sketch_fit(ev)
    blind = [r for r in caplog.records if r.getMessage() == "sketch.blind"]
    assert len(blind) == 1 and blind[0].fields["pairs"] == "0-1 0-2 0-3 1-2 1-3 2-3", caplog.text
