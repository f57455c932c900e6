"""Data sketches: a few kilobytes that describe what a client's data looks like, not the data.

CDFL's server must estimate each upload's mixture over the K clusters. From the uploaded
model alone, the best server-side estimators reach a KL of 0.03-0.5 to the truth
(docs/results_cdfl.md); FedSoft's per-sample argmin does better but needs all K models on
the client. A sketch closes the gap at the cost of one small vector per upload: the mean of
random Fourier features of the client's inputs, an empirical kernel mean embedding. Mean
embeddings mix linearly, so a client whose data is the mixture alpha of the clusters has,
up to sampling noise, sketch = sum_k alpha_k * sketch(D_k), and the server recovers alpha by
non-negative least squares against the sketches of its K proxy sets. The least squares are
taken in the metric of the features' own noise (`whitener`): a sketch is a mean of n feature
vectors, so its error has the covariance of single inputs' features over n, and plain least
squares let the directions in which single inputs vary most outweigh those in which the
clusters differ.

What it reveals: the average of `dim` fixed random cosine features of the inputs (not
labels, not any single sample). Agents send it unless `agent.send_sketch` is off; without
one the aggregator falls back to its model-only estimator.

Both sides must compute the same features: `METHOD` names the feature map (feature count,
seed, bandwidth); a sketch made by another method is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

DIM = 1024
SEED = 0x5EED
METHOD = f"rff-{DIM}-{SEED:x}-v1"
"""The feature map's name, sent with every sketch."""


@lru_cache(maxsize=8)
def _features(input_numel: int) -> tuple[Tensor, Tensor]:
    """The fixed random projection for inputs of `input_numel` values (same on every machine:
    numpy's PCG64 stream for a given seed)."""
    rng = np.random.default_rng([SEED, input_numel])
    w = rng.standard_normal((input_numel, DIM)) / np.sqrt(input_numel)
    b = rng.uniform(0.0, 2.0 * np.pi, DIM)
    return torch.from_numpy(w.astype(np.float32)), torch.from_numpy(b.astype(np.float32))


def _feature_batches(x: Tensor, batch: int):
    """Each input's features ([<=batch, DIM] float32), a batch at a time."""
    if x.shape[0] == 0:
        raise ValueError("cannot sketch an empty data set")
    flat = x.reshape(x.shape[0], -1).to("cpu", torch.float32)
    w, b = _features(flat.shape[1])
    for start in range(0, flat.shape[0], batch):
        yield torch.cos(flat[start:start + batch] @ w + b)


def data_sketch(x: Tensor, batch: int = 2048) -> np.ndarray:
    """The sketch of inputs `x` ([N, ...], as the model sees them): float32 [DIM]."""
    total = torch.zeros(DIM, dtype=torch.float64)
    for f in _feature_batches(x, batch):
        total += f.sum(0, dtype=torch.float64)
    return (total / x.shape[0]).numpy().astype(np.float32)


def check_shrinkage(shrinkage: float, name: str = "sketch shrinkage") -> float:
    """`shrinkage` if it is in (0, 1]; else a ValueError naming it as `name`."""
    if not 0.0 < shrinkage <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {shrinkage:g}")
    return float(shrinkage)


def within_scatter(sets: Sequence[Tensor], batch: int = 2048,
                   means: np.ndarray | None = None) -> tuple[Tensor, int]:
    """(sum over every input of d^T d, the input count): d is an input's features minus its own
    set's sketch (`means`, if the caller has them already). Over (count - sets) it is the
    within-set covariance of single inputs' features."""
    scatter = torch.zeros(DIM, DIM, dtype=torch.float64)
    n = 0
    for i, x in enumerate(sets):
        mean = torch.from_numpy(data_sketch(x, batch) if means is None else means[i]).double()
        for f in _feature_batches(x, batch):
            d = f.double() - mean
            scatter += d.T @ d
        n += x.shape[0]
    return scatter, n


def whitener(sets: Sequence[Tensor], shrinkage: float, batch: int = 2048,
             means: np.ndarray | None = None, scatter: tuple[Tensor, int] | None = None) -> np.ndarray | None:
    """[DIM, DIM] W with ||W r||^2 = r^T C^-1 r: C is the covariance of single inputs' features
    within the sets (each about its own mean), shrunk toward its mean variance,
    (1 - shrinkage) C + shrinkage tr(C)/DIM I, since a few hundred inputs cannot pin 1024^2
    entries. shrinkage 1 is plain least squares: None. `means`: the sets' sketches, and
    `scatter`: `within_scatter` of the sets, if the caller has them already."""
    check_shrinkage(shrinkage)
    if shrinkage == 1.0:
        return None
    total, n = within_scatter(sets, batch, means) if scatter is None else scatter
    if n <= len(sets):
        raise ValueError(f"{n} inputs in {len(sets)} sets leave no spread to estimate")
    cov = total / (n - len(sets))
    eye = torch.eye(DIM, dtype=torch.float64)
    cov = (1.0 - shrinkage) * cov + shrinkage * torch.trace(cov) / DIM * eye
    lower = torch.linalg.cholesky(cov)  # cov = L L^T, so W = L^-1 (torch: 25x numpy's here)
    return torch.linalg.solve_triangular(lower, eye, upper=False).numpy()


SEPARATION_SAMPLES = 256
"""The sample count `SketchFit.blind_pairs` judges at: a typical device's training set."""
BLIND_RATIO = 2.0
"""Clusters whose input distributions lie closer than this many times the noise of a sketch of
SEPARATION_SAMPLES inputs cannot be told apart by it. Measured (`separation(256)`, closest
pair, proxy sets with or without the pre-training inputs): 2.5-9.4 where the fit pins the
mixture (rotated digits at K = 2 and 6, shapes at K = 3: KL 0.001-0.004), 0-1.5 where it does no
better than the uniform guess (shapes a quarter turn apart; docs/results_realsize.md)."""


class SketchFit:
    """Sketch -> mixture over the clusters whose reference inputs it was built on: NNLS in the
    metric of the features' noise (`whitener`). The clusters' side is sketched and whitened once,
    so an upload then costs one [DIM, DIM] matrix-vector product (~1 ms) and the NNLS."""

    def __init__(self, references: Sequence[Tensor], shrinkage: float, batch: int = 2048) -> None:
        self.sketches = np.stack([data_sketch(x, batch) for x in references])
        """[K, DIM] float32: each cluster's reference sketch."""
        scatter, count = within_scatter(references, batch, self.sketches)
        self.whiten = whitener(references, shrinkage, batch, means=self.sketches, scatter=(scatter, count))
        """W, or None for the plain fit (shrinkage 1)."""
        plain = self.sketches.astype(np.float64)
        self._design = plain if self.whiten is None else (self.whiten @ plain.T).T
        self.spread = float(torch.trace(scatter)) / max(count - len(references), 1)
        """E ||features(x) - its cluster's sketch||^2 over single reference inputs: a sketch of n
        inputs strays from its distribution's by about sqrt(spread / n)."""
        self.counts = np.array([x.shape[0] for x in references], dtype=np.float64)

    def separation(self, n: int) -> np.ndarray:
        """[K, K]: how far apart each pair of clusters' input distributions lie, in units of the
        noise of a sketch of `n` inputs (diagonal inf). Below ~1 a sketch cannot tell the pair
        apart. Judged in the plain metric, a property of the data: the whitened one is fitted on
        these very inputs and would flatter them. The references' own sampling noise is taken
        out: two sketches of one distribution from n_i and n_j inputs lie sqrt(spread (1/n_i +
        1/n_j)) apart on average."""
        plain = self.sketches.astype(np.float64)
        d2 = ((plain[:, None, :] - plain[None, :, :]) ** 2).sum(-1)
        signal = np.maximum(d2 - self.spread * (1.0 / self.counts[:, None] + 1.0 / self.counts[None, :]), 0.0)
        out = np.sqrt(signal / (self.spread / n))
        np.fill_diagonal(out, np.inf)
        return out

    def blind_pairs(self, n: int = SEPARATION_SAMPLES) -> list[tuple[int, int, float]]:
        """(i, j, separation) of every cluster pair closer than BLIND_RATIO at `n` inputs."""
        sep = self.separation(n)
        k = sep.shape[0]
        return [(i, j, float(sep[i, j])) for i in range(k) for j in range(i + 1, k) if sep[i, j] < BLIND_RATIO]

    def mixture(self, sketch: np.ndarray) -> np.ndarray:
        """Non-negative weights summing to 1 (`mixture_from_sketch`, in the whitened metric)."""
        if sketch.shape != (self.sketches.shape[1],):
            raise ValueError(f"sketch has shape {sketch.shape}, clusters' sketches {self.sketches.shape}")
        x = sketch.astype(np.float64)
        return mixture_from_sketch(x if self.whiten is None else self.whiten @ x, self._design)


def mixture_from_sketch(sketch: np.ndarray, cluster_sketches: np.ndarray) -> np.ndarray:
    """Non-negative weights c with sketch ~ cluster_sketches.T @ c, normalized to sum to 1
    (for the whitened fit, pass W @ sketch and the clusters' sketches times W.T: `whitener`).

    `cluster_sketches` is [K, DIM]. All zeros (no cluster explains the sketch at all) gives
    uniform weights."""
    if sketch.shape != (cluster_sketches.shape[1],):
        raise ValueError(f"sketch has shape {sketch.shape}, clusters' sketches {cluster_sketches.shape}")
    from scipy.optimize import nnls  # here: the agents that only make sketches skip 0.3 s of import

    c, _ = nnls(cluster_sketches.T.astype(np.float64), sketch.astype(np.float64))
    total = c.sum()
    k = cluster_sketches.shape[0]
    return c / total if total > 0 and np.isfinite(total) else np.full(k, 1.0 / k)
