"""How well the server-side estimators recover a client's mixture, on real rotated digits.

Cluster models are pre-trained briefly on rotated scikit-learn digits; clients start from
the uniform mixture the server sends at join, train a short proximal local run on a known
mixture, and upload with the sketch of its data. Every estimator sees the same uploads (all
but "sketch" ignore the sketch); FedSoft's per-sample argmin
(computed on the client's own data with the cluster models) is the reference. The
measured KL(true || estimate) of each is printed (pytest -s) and summarized in docs/cdfl.md.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregator.cdfl import CDFL
from aggregator.estimators import (
    ESTIMATORS,
    EstimationBatch,
    fedsoft_argmin_alpha,
    kl_divergence,
    make_estimator,
    normalize_simplex,
    uniform,
)
from aggregator.strategy import Upload
from fedmq.data import RotatedClusters, load_dataset, sample_agent_data
from fedmq.models import build_model, model_spec, to_vector
from fedmq.sketch import data_sketch, mixture_from_sketch, whitener
from fedmq.training import fit

ARCH = "digits-cnn"
MIXTURES = {
    2: [[0.8, 0.2], [0.5, 0.5], [0.2, 0.8], [0.9, 0.1]],
    3: [[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.34, 0.33, 0.33], [0.2, 0.2, 0.6]],
}


def measure(k: int) -> dict[str, float]:
    """Mean KL(true || estimate) per estimator and for the argmin baseline (and uniform)."""
    spec = model_spec(ARCH)
    rc = RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), k, seed=0,
                         proxy_per_cluster=150, pretrain_per_cluster=300)
    init = to_vector(build_model(ARCH, seed=0))
    clusters = torch.stack([fit(ARCH, init, rc.pretrain(j).x, rc.pretrain(j).y, epochs=10, lr=0.05, seed=j).vector
                            for j in range(k)])
    proxies = [(rc.proxy(j).x, rc.proxy(j).y) for j in range(k)]
    # beta0 = 0: the clusters stay fixed, so every client is estimated against the same models
    strategies = {name: CDFL(spec, clusters, proxies, device="cpu", beta0=0.0, estimator=make_estimator(name))
                  for name in sorted(ESTIMATORS)}
    kl: dict[str, list[float]] = {name: [] for name in [*strategies, "argmin", "uniform"]}
    rng = np.random.default_rng(1)
    for i, mixture in enumerate(MIXTURES[k]):
        agent = f"agent{i}"
        local = sample_agent_data(rc, np.array(mixture), 400, rng)
        true = local.alpha
        sent = [strategy.join(agent).vectors[0] for strategy in strategies.values()]
        u = sent[0]  # the uniform mixture every strategy sends at join
        assert all(torch.equal(s, u) for s in sent)
        torch.testing.assert_close(u, clusters.mean(0))
        v = fit(ARCH, u, local.data.x, local.data.y, epochs=2, lr=0.05, anchors=[(u, 0.1)], seed=i).vector
        summary = data_sketch(local.data.x)  # what the agent sends with its upload
        for name, strategy in strategies.items():
            reply = strategy.update(Upload(agent, v, tau=0, sketch=summary))
            kl[name].append(kl_divergence(true, reply.alpha))
            print(f"K={k} true={np.round(true, 2)} {name:10s} {np.round(reply.alpha, 3)}")
        argmin = fedsoft_argmin_alpha(strategies["metrics"].evaluator, clusters, local.data.x, local.data.y)
        kl["argmin"].append(kl_divergence(true, argmin))
        kl["uniform"].append(kl_divergence(true, uniform(k)))
        print(f"K={k} true={np.round(true, 2)} {'argmin':10s} {np.round(argmin, 3)}")
    means = {name: float(np.mean(v)) for name, v in kl.items()}
    print(f"K={k} mean KL(true || estimate): " + ", ".join(f"{n} {m:.4f}" for n, m in means.items()))
    return means


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, float]]:
    torch.manual_seed(0)
    return {k: measure(k) for k in MIXTURES}


@pytest.mark.slow
def test_best_server_estimator_is_informative(results):
    for k, means in results.items():
        ours = {n: m for n, m in means.items() if n in ESTIMATORS}
        best = min(ours, key=ours.get)
        # a sane bound: well under the KL of knowing nothing (the uniform estimate)
        assert ours[best] < 0.5 * means["uniform"], (k, means)
        assert ours[best] < 0.06, (k, means)


@pytest.mark.slow
def test_trajectory_fitting_beats_the_metric_softmax_baseline(results):
    traj = np.mean([results[k]["trajectory"] for k in results])
    metrics = np.mean([results[k]["metrics"] for k in results])
    assert traj < 0.7 * metrics, results


MODEL_ONLY = [n for n in ESTIMATORS if n != "sketch"]


@pytest.mark.slow
def test_fedsoft_argmin_beats_every_estimator_that_sees_only_the_model(results):
    """From the uploaded model alone, argmin (which sees the client's own samples) stays ~10x
    closer at K = 3. If this fails, a model-only estimator has overtaken it: update docs/cdfl.md."""
    ours = min(results[3][n] for n in MODEL_ONLY)
    assert results[3]["argmin"] < ours, results


@pytest.mark.slow
def test_data_sketch_estimate_beats_fedsoft_argmin(results):
    """The issue's target: the server's estimate closer than FedSoft's per-sample argmin on the
    same data, with no cluster model on the client. With the sketch (2 KB of mean random
    features of the client's inputs): at K = 3 about 2x closer; at K = 2 (180 degrees, 400
    samples, these 4 mixtures) level with argmin (0.030 vs 0.029); the 3-seed ablation in
    docs/results_cdfl.md has it below argmin at every K."""
    assert results[3]["sketch"] < results[3]["argmin"], results
    assert results[2]["sketch"] < 1.1 * results[2]["argmin"], results
    for k, means in results.items():
        assert means["sketch"] < min(means[n] for n in MODEL_ONLY), (k, means)


@pytest.mark.parametrize("pretrain", [True, False])
def test_sketch_references_hold_every_input_the_server_has_and_cut_the_kl(pretrain):
    """cdfl.sketch_pretrain: each cluster's sketch comes from its proxy and pre-training inputs.
    At the realistic budget (100 proxy + 200 pre-training samples per cluster) the reference's
    own sampling noise set most of the KL: over the same 40 draws it falls by more than half."""
    from aggregator.bootstrap import make_strategy
    from fedmq.config import load_config

    cfg = load_config(None, {"cdfl.clusters": 2, "data.proxy_per_cluster": 100, "data.pretrain_per_cluster": 200,
                             "cdfl.sketch_pretrain": str(pretrain).lower()})
    rc = RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), 2, seed=0,
                         proxy_per_cluster=100, pretrain_per_cluster=200)
    proxies = [(rc.proxy(k).x, rc.proxy(k).y) for k in range(2)]
    init = [to_vector(build_model(ARCH, seed=k)) for k in range(2)]
    strategy = make_strategy(cfg, model_spec(ARCH), init, proxies, data=rc)
    refs = strategy.estimator.references
    if not pretrain:
        assert refs is None  # the proxy sets alone, as before the key
        return
    assert [len(r) for r in refs] == [300, 300]
    torch.testing.assert_close(refs[1][:100], proxies[1][0])
    torch.testing.assert_close(refs[1][100:], rc.pretrain(1, 200).x)
    rng = np.random.default_rng(3)
    kl = {"proxy": [], "proxy+pretrain": []}
    for _ in range(40):
        local = sample_agent_data(rc, rng.dirichlet([1.0, 1.0]), int(rng.integers(100, 301)), rng)
        sketch = data_sketch(local.data.x)
        for name, sets in (("proxy", [x for x, _ in proxies]), ("proxy+pretrain", refs)):
            est = mixture_from_sketch(sketch, np.stack([data_sketch(x) for x in sets]))
            kl[name].append(kl_divergence(local.alpha, normalize_simplex(est, 0.01)[0]))
    means = {k: float(np.mean(v)) for k, v in kl.items()}
    assert means["proxy+pretrain"] < 0.5 * means["proxy"], means


def test_whitener_is_the_inverse_root_of_the_shrunk_within_cluster_covariance():
    """||W r||^2 = r^T C^-1 r, C the features' covariance within each set (about its own mean),
    shrunk toward its mean variance; shrinkage 1 is plain least squares, outside (0, 1] refused."""
    g = torch.Generator().manual_seed(0)
    sets = [torch.rand(40, 1, 8, 8, generator=g), torch.rand(50, 1, 8, 8, generator=g) + 0.3]
    feats = [np.stack([data_sketch(x[i:i + 1]).astype(np.float64) for i in range(len(x))]) for x in sets]
    dev = np.concatenate([f - f.mean(0) for f in feats])
    cov = dev.T @ dev / (len(dev) - 2)
    shrunk = 0.75 * cov + 0.25 * np.trace(cov) / cov.shape[0] * np.eye(cov.shape[0])
    w = whitener(sets, 0.25)
    np.testing.assert_allclose(w @ shrunk @ w.T, np.eye(cov.shape[0]), atol=1e-6)
    assert whitener(sets, 1.0) is None
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="shrinkage"):
            whitener(sets, bad)


def test_whitened_sketch_fit_cuts_the_kl_of_the_default_estimator():
    """cdfl.sketch_shrinkage: least squares in the metric of the features' own noise. Rotated
    digits, realistic budget, K = 4, the same 40 draws: KL at least a third lower than plain
    least squares (shrinkage 1; docs/results_cdfl.md#estimation: 0.044 -> 0.015 over a fleet's draws)."""
    from aggregator.bootstrap import make_strategy
    from fedmq.config import load_config

    k = 4
    rc = RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), k, seed=0,
                         proxy_per_cluster=100, pretrain_per_cluster=200)
    proxies = [(rc.proxy(c).x, rc.proxy(c).y) for c in range(k)]
    init = [to_vector(build_model(ARCH, seed=c)) for c in range(k)]
    strategies = {}
    for shrinkage in ("0.25", "1"):
        overrides = {"cdfl.clusters": k, "data.proxy_per_cluster": 100, "data.pretrain_per_cluster": 200}
        if shrinkage != "0.25":  # the default is the variant under test; 1 is its control
            overrides["cdfl.sketch_shrinkage"] = shrinkage
        strategies[shrinkage] = make_strategy(load_config(None, overrides), model_spec(ARCH), init, proxies, data=rc)
    whitened = {name: s.estimator.sketch_fit(s.evaluator).whiten for name, s in strategies.items()}
    assert whitened["1"] is None and whitened["0.25"].shape == (1024, 1024)
    rng = np.random.default_rng(5)
    kl = {name: [] for name in strategies}
    for _ in range(40):
        local = sample_agent_data(rc, rng.dirichlet([0.5] * k), int(rng.integers(100, 301)), rng)
        sketch = data_sketch(local.data.x)
        for name, s in strategies.items():
            batch = EstimationBatch(s.evaluator, s.clusters, list(s.versions), s.clusters[:1], [None], [sketch])
            (alpha, diag), = s.estimator.estimate(batch)
            assert diag["sketch"]
            kl[name].append(kl_divergence(local.alpha, alpha))
    means = {name: float(np.mean(v)) for name, v in kl.items()}
    assert means["0.25"] < (2 / 3) * means["1"], means
