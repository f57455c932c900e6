"""Server-side estimators of an upload's mixture alpha over the K clusters.

Each estimator sees a batch of uploads against the clusters as they were at the start of
the batch and returns, per upload, alpha (K non-negative values summing to 1) and a dict of
diagnostics. Select one by name (cfg.cdfl.estimator) from `ESTIMATORS`:

- "metrics": the paper's three signals (loss of v on D_k, loss gap |F(w_k;D_k) - F(v;D_k)|,
  distance ||v - w_k||), each turned into a distribution by a softmax of the negated,
  scale-normalized metric, combined with convex weights. Baseline.
- "direction": fits the client's step delta = v - u (u: the model it received) to the proxy
  gradients, delta ~ -sum_k c_k grad F(.; D_k), c >= 0 by NNLS; alpha = c / sum(c).
- "evidence": per-sample evidence of what v learned since u: the mean gain in the
  probability v gives the true label over u's, per proxy set; alpha ~ positive gains.
- "trajectory": simulates the client's local run from u on each proxy set and fits the
  step to those K steps by NNLS.
- "sketch": fits the client's data sketch (2 KB of mean random Fourier features of its
  inputs, sent with the upload) to the sketches of the K proxy sets by NNLS
  (fedmq/sketch.py). Uses the client's data statistics, not only its model: the only
  estimator that beats FedSoft's argmin on KL here. Uploads without a sketch go to a
  fallback estimator.

`fedsoft_argmin_alpha` is FedSoft's client-side estimate (share of the client's own
samples on which each cluster model has the lowest loss), the baseline the server-side
estimators are compared with; it needs the client's data, which the server never has.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from aggregator.evaluator import ProxyEvaluator, vector_digest
from fedmq.logs import event, get_logger
from fedmq.sketch import SEPARATION_SAMPLES, SketchFit, check_shrinkage

log = get_logger("aggregator")

Estimate = tuple[list[float], dict[str, Any]]


@dataclass
class EstimationBatch:
    """The uploads of one batch and the server state they are estimated against."""

    evaluator: ProxyEvaluator
    clusters: Tensor
    """[K, P] cluster models at the start of the batch."""
    versions: Sequence[int]
    """Per-cluster version counters (keys of the evaluator's cluster-loss cache)."""
    vectors: Tensor
    """[B, P] uploaded vectors."""
    bases: Sequence[Tensor | None]
    """The model each uploading agent received last (u_m), or None when unknown."""
    sketches: Sequence[np.ndarray | None] = ()
    """Each upload's data sketch (fedmq/sketch.py), or None; empty when none carry one."""


def uniform(k: int) -> list[float]:
    return [1.0 / k] * k


def normalize_simplex(weights: Tensor | np.ndarray | Sequence[float], floor: float = 0.0) -> tuple[list[float], bool]:
    """Clip at 0, divide by the sum, then mix with uniform: (1 - floor) p + floor / K.

    Returns (uniform, True) when nothing positive is left. The floor keeps every cluster
    possible: an estimate of exactly 0 makes KL(true || estimate) infinite and starves a
    cluster of an update the client did contribute to.
    """
    w = np.clip(np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=0.0), 0.0, None)
    total = float(w.sum())
    if total <= 0.0 or not np.isfinite(total):
        return uniform(len(w)), True
    p = (1.0 - floor) * (w / total) + floor / len(w)
    return [float(x) for x in p / p.sum()], False


def kl_divergence(p: Sequence[float], q: Sequence[float], eps: float = 1e-8) -> float:
    """KL(p || q) with q floored at eps (an estimate of exactly 0 would be infinite)."""
    pa = np.asarray(p, dtype=np.float64)
    qa = np.clip(np.asarray(q, dtype=np.float64), eps, None)
    qa = qa / qa.sum()
    mask = pa > 0
    return float(np.sum(pa[mask] * np.log(pa[mask] / qa[mask])))


class Estimator(ABC):
    name = "estimator"
    needs_base = True
    """Whether it uses the model each agent received (the strategy then remembers it)."""

    @abstractmethod
    def estimate(self, batch: EstimationBatch) -> list[Estimate]: ...


class MetricsEstimator(Estimator):
    """Softmax over k of each negated, scale-normalized metric, mixed with convex weights.

    Scale normalization (`normalize`): "mean" divides each metric row by its mean over k
    (the metrics are non-negative, so this makes them unit-free: a cluster twice as far as
    average gets -2 before the softmax); "std" standardizes the row (z-scores) instead.
    """

    name = "metrics"
    needs_base = False

    def __init__(self, metric_weights: Sequence[float] = (1.0, 1.0, 1.0), temperature: float = 1.0,
                 normalize: str = "mean", **_: Any) -> None:
        w = np.asarray(metric_weights, dtype=np.float64)
        if w.shape != (3,) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"metric_weights must be 3 non-negative values, not all 0; got {list(metric_weights)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if normalize not in ("mean", "std"):
            raise ValueError(f"normalize must be 'mean' or 'std', got {normalize!r}")
        self.weights = torch.tensor(w / w.sum(), dtype=torch.float64)
        self.temperature = float(temperature)
        self.normalize = normalize

    def _scale(self, m: Tensor) -> Tensor:
        if self.normalize == "mean":
            return m / m.mean(dim=1, keepdim=True).clamp_min(1e-12)
        return (m - m.mean(dim=1, keepdim=True)) / m.std(dim=1, keepdim=True, unbiased=False).clamp_min(1e-12)

    def estimate(self, batch: EstimationBatch) -> list[Estimate]:
        losses = batch.evaluator.losses(batch.vectors).double()  # [B, K]
        own = batch.evaluator.cluster_losses(batch.clusters, batch.versions).double()  # [K]
        gaps = (own[None, :] - losses).abs()
        dists = torch.cdist(batch.vectors.double(), batch.clusters.double())  # [B, K]
        dists_per = [torch.softmax(-self._scale(m) / self.temperature, dim=1) for m in (losses, gaps, dists)]
        mix = sum(w * d for w, d in zip(self.weights, dists_per, strict=True))
        out = []
        for b in range(losses.shape[0]):
            alpha, fallback = normalize_simplex(mix[b])
            out.append((alpha, {"losses": losses[b].tolist(), "gaps": gaps[b].tolist(),
                                "distances": dists[b].tolist(), "fallback": fallback}))
        return out


class _DigestCache:
    """A small LRU of per-model results keyed by content hash (many agents hold the same u)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.items: OrderedDict[str, Any] = OrderedDict()

    def get(self, vector: Tensor, compute: Any) -> Any:
        key = vector_digest(vector)
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = compute(vector)
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


def reference_vector(batch: EstimationBatch, b: int) -> Tensor:
    """The model upload b started from; the uniform mixture of the clusters when unknown."""
    base = batch.bases[b]
    return base if base is not None else batch.clusters.mean(dim=0)


class DirectionEstimator(Estimator):
    """Fit the update direction to the proxy gradients with non-negative least squares.

    Local training from u on a mixture alpha moves the model by roughly
    delta = v - u ~ -eta * sum_k alpha_k grad F(u; D_k). With c_k = eta * alpha_k free,
    min_{c >= 0} ||delta + G^T c|| is an NNLS problem (scipy.optimize.nnls on the P x K
    matrix -G^T), and alpha = c / sum(c) (uniform when c = 0: the step fits no cluster).
    `at` chooses where the gradients are taken: "base" (u, the linearization), "upload" (v)
    or "midpoint" (the mean of both: the trapezoid rule over the local path, 2x the cost).
    """

    name = "direction"

    def __init__(self, at: str = "base", floor: float = 0.05, cache_size: int = 8, **_: Any) -> None:
        if at not in ("base", "upload", "midpoint"):
            raise ValueError(f"at must be base, upload or midpoint, got {at!r}")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {floor}")
        self.at = at
        self.floor = float(floor)
        self.cache: _DigestCache | None = None
        self.cache_size = cache_size

    def estimate(self, batch: EstimationBatch) -> list[Estimate]:
        if self.cache is None:
            self.cache = _DigestCache(self.cache_size)
        out = []
        for b in range(batch.vectors.shape[0]):
            v = batch.vectors[b]
            u = reference_vector(batch, b)
            delta = (v - u).double()
            if self.at == "upload":
                grads = batch.evaluator.gradients(v)
            else:
                grads = self.cache.get(u, batch.evaluator.gradients)
                if self.at == "midpoint":
                    grads = 0.5 * (grads + batch.evaluator.gradients(v))
            a = -grads.double().T.numpy()  # [P, K]
            # Imported here: an aggregator on another estimator skips 0.3 s of import.
            from scipy.optimize import nnls

            c, resid = nnls(a, delta.numpy(), maxiter=50 * a.shape[1])
            alpha, fallback = normalize_simplex(c, self.floor)
            norm = float(delta.norm())
            out.append((alpha, {"coefficients": [float(x) for x in c],
                                "relative_residual": resid / norm if norm > 0 else 0.0,
                                "step_norm": norm, "fallback": fallback}))
        return out


class EvidenceEstimator(Estimator):
    """Per-sample evidence of what the upload learned, per proxy set, relative to its start.

    For each proxy sample, the gain p_v(y|x) - p_u(y|x) in the probability given to the true
    label (u: the model the agent received). Training on a mixture raises confidence most
    on the clusters it saw most; per-sample probabilities are bounded, so a few hopeless
    samples cannot dominate as they do in mean losses. mode "gain": alpha ~ max(mean gain
    on D_k, 0); mode "share": alpha ~ share of D_k on which v has a lower loss than u.
    """

    name = "evidence"

    def __init__(self, mode: str = "gain", floor: float = 0.05, cache_size: int = 8, **_: Any) -> None:
        if mode not in ("gain", "share"):
            raise ValueError(f"mode must be gain or share, got {mode!r}")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {floor}")
        self.mode = mode
        self.floor = float(floor)
        self.cache: _DigestCache | None = None
        self.cache_size = cache_size

    def estimate(self, batch: EstimationBatch) -> list[Estimate]:
        ev = batch.evaluator
        if self.cache is None:
            self.cache = _DigestCache(self.cache_size)
        what = "p" if self.mode == "gain" else "loss"
        mine = ev.per_sample(batch.vectors, what)  # [B, N]
        out = []
        for b in range(batch.vectors.shape[0]):
            ref = self.cache.get(reference_vector(batch, b), lambda u, w=what: ev.per_sample(u[None], w)[0])
            if self.mode == "gain":
                score = ev.per_set_mean((mine[b] - ref)[None])[0]
            else:
                score = ev.per_set_mean((mine[b] < ref).float()[None])[0]
            alpha, fallback = normalize_simplex(score.cpu(), self.floor)
            out.append((alpha, {"scores": score.cpu().tolist(), "fallback": fallback}))
        return out


class TrajectoryEstimator(Estimator):
    """Fit the update to local runs the server simulates itself, one per cluster.

    From the model u the agent received, the server trains briefly on each proxy set D_k
    alone (the same kind of local run an agent does: SGD with the proximal term toward u),
    giving a per-cluster displacement d_k = v_k - u. The upload's step delta = v - u is then
    fitted as delta ~ sum_k c_k d_k with c >= 0 (NNLS) and alpha = c / sum(c). Unlike the
    one-gradient linearization ("direction"), this follows the curved multi-step path of
    local training. Costs K short trainings per distinct u (cached by content).
    """

    name = "trajectory"

    def __init__(self, epochs: int = 2, lr: float = 0.05, momentum: float = 0.9, batch_size: int = 32,
                 rho: float = 0.1, floor: float = 0.05, seed: int = 0, cache_size: int = 8, **_: Any) -> None:
        if epochs < 1 or lr <= 0 or not 0.0 <= floor <= 1.0:
            raise ValueError(f"need epochs >= 1, lr > 0, 0 <= floor <= 1; got {epochs}, {lr}, {floor}")
        self.options = {"epochs": int(epochs), "lr": float(lr), "momentum": float(momentum),
                        "batch_size": int(batch_size)}
        self.rho = float(rho)
        self.floor = float(floor)
        self.seed = int(seed)
        self.cache: _DigestCache | None = None
        self.cache_size = cache_size

    def displacements(self, evaluator: ProxyEvaluator, u: Tensor) -> Tensor:
        """[K, P] v_k - u for a short proximal run from u on each proxy set."""
        from fedmq.training import fit

        u = u.detach().to("cpu", torch.float32)
        out = []
        for k, (x, y) in enumerate(evaluator.proxies):
            v = fit(evaluator.spec.arch, u, x.cpu(), y.cpu(), anchors=[(u, self.rho)] if self.rho > 0 else (),
                    seed=self.seed + k, **self.options).vector
            out.append(v - u)
        return torch.stack(out)

    def estimate(self, batch: EstimationBatch) -> list[Estimate]:
        if self.cache is None:
            self.cache = _DigestCache(self.cache_size)
        out = []
        for b in range(batch.vectors.shape[0]):
            u = reference_vector(batch, b)
            disp = self.cache.get(u, lambda ref: self.displacements(batch.evaluator, ref))
            delta = (batch.vectors[b] - u).double()
            # Imported here: an aggregator on another estimator skips 0.3 s of import.
            from scipy.optimize import nnls

            c, resid = nnls(disp.double().T.numpy(), delta.numpy(), maxiter=50 * disp.shape[0])
            alpha, fallback = normalize_simplex(c, self.floor)
            norm = float(delta.norm())
            out.append((alpha, {"coefficients": [float(x) for x in c],
                                "relative_residual": resid / norm if norm > 0 else 0.0,
                                "step_norm": norm, "fallback": fallback}))
        return out


class SketchEstimator(Estimator):
    """NNLS of the upload's data sketch on the proxy sets' sketches; `fallback` otherwise."""

    name = "sketch"

    def __init__(self, fallback: str = "metrics", sketch_floor: float = 0.01, sketch_shrinkage: float = 0.25,
                 **options: Any) -> None:
        if fallback == self.name:
            raise ValueError("the sketch estimator's fallback must be another estimator")
        self.fallback = make_estimator(fallback, **options)
        self.needs_base = self.fallback.needs_base
        self.floor = float(sketch_floor)
        self.shrinkage = check_shrinkage(sketch_shrinkage, "cdfl.sketch_shrinkage")
        self.references: list[Tensor] | None = None
        """Each cluster's inputs to sketch (`aggregator.bootstrap.sketch_references`); None: the
        evaluator's proxy sets."""
        self._fit: tuple[ProxyEvaluator, SketchFit] | None = None

    def sketch_fit(self, evaluator: ProxyEvaluator) -> SketchFit:
        """The fit on the clusters' reference inputs, built once per evaluator."""
        if self._fit is None or self._fit[0] is not evaluator:
            inputs = self.references if self.references is not None else [x for x, _ in evaluator.proxies]
            self._fit = (evaluator, SketchFit(inputs, self.shrinkage))
            blind = self._fit[1].blind_pairs()
            if blind:  # the data's doing, not the estimator's: say so once, where a user looks
                event(log, "sketch.blind", logging.WARNING, pairs=" ".join(f"{i}-{j}" for i, j, _ in blind),
                      separation=round(min(s for _, _, s in blind), 2), samples=SEPARATION_SAMPLES,
                      meaning="these clusters' inputs look alike: their share of an upload's mixture "
                              "comes out near an even split (docs/results_realsize.md)")
        return self._fit[1]

    def estimate(self, batch: EstimationBatch) -> list[Estimate]:
        sketches = list(batch.sketches) or [None] * batch.vectors.shape[0]
        out: list[Estimate | None] = [None] * len(sketches)
        missing = [i for i, s in enumerate(sketches) if s is None]
        if missing:
            sub = EstimationBatch(batch.evaluator, batch.clusters, batch.versions,
                                  batch.vectors[missing], [batch.bases[i] for i in missing])
            for i, (alpha, diag) in zip(missing, self.fallback.estimate(sub), strict=True):
                out[i] = (alpha, {**diag, "sketch": False, "fallback": self.fallback.name})
        if len(missing) < len(sketches):
            fit = self.sketch_fit(batch.evaluator)
            for i, s in enumerate(sketches):
                if s is not None:
                    weights = fit.mixture(s)
                    alpha, degenerate = normalize_simplex(weights, self.floor)
                    out[i] = (alpha, {"sketch": True, "weights": [float(w) for w in weights],
                                      "degenerate": degenerate})
        return [e for e in out if e is not None]


ESTIMATORS: dict[str, type[Estimator]] = {
    SketchEstimator.name: SketchEstimator,
    TrajectoryEstimator.name: TrajectoryEstimator,
    MetricsEstimator.name: MetricsEstimator,
    DirectionEstimator.name: DirectionEstimator,
    EvidenceEstimator.name: EvidenceEstimator,
}


def make_estimator(name: str, **options: Any) -> Estimator:
    try:
        cls = ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}") from None
    return cls(**options)


def fedsoft_argmin_alpha(evaluator: ProxyEvaluator, clusters: Tensor, x: Tensor, y: Tensor) -> list[float]:
    """FedSoft's estimate on a client's own data: share of samples where w_k has the lowest loss."""
    losses = evaluator.per_sample_on(clusters, x, y, "loss")
    winners = losses.argmin(dim=0)
    counts = torch.bincount(winners, minlength=clusters.shape[0]).double()
    return (counts / counts.sum()).tolist()
