"""Per-agent data: a mixture over rotation clusters, drawn afresh after every cycle.

The rule (docs/data.md): an agent holds 500-2000 samples, 40-90 % from
one primary cluster chosen at random; the rest is split over the other clusters by a
symmetric Dirichlet. Every draw takes a numpy Generator, so the same seed gives the same
mixture and the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedmq.data.clusters import RotatedClusters
from fedmq.data.sources import Dataset


def draw_mixture(rng: np.random.Generator, num_clusters: int, primary_min: float = 0.4,
                 primary_max: float = 0.9, *, primary: int | None = None,
                 concentration: float = 1.0) -> np.ndarray:
    """A mixture alpha over K clusters (float64, sums to 1).

    The primary cluster (random unless given) gets a share uniform in [primary_min,
    primary_max]; the remainder is split over the other K-1 clusters by Dirichlet(concentration).
    With K = 1 the mixture is [1.0]. The primary share is not always the largest for K = 2
    and a share below 0.5: that is the rule as stated, kept as is.
    """
    if num_clusters < 1:
        raise ValueError(f"need at least one cluster, got {num_clusters}")
    if not 0.0 <= primary_min <= primary_max <= 1.0:
        raise ValueError(f"need 0 <= primary_min <= primary_max <= 1, got {primary_min}, {primary_max}")
    if num_clusters == 1:
        return np.ones(1)
    if primary is None:
        primary = int(rng.integers(num_clusters))
    elif not 0 <= primary < num_clusters:
        raise IndexError(f"primary cluster {primary} out of range 0..{num_clusters - 1}")
    share = float(rng.uniform(primary_min, primary_max))
    rest = rng.dirichlet(np.full(num_clusters - 1, concentration)) * (1.0 - share)
    alpha = np.insert(rest, primary, share)
    return alpha / alpha.sum()


def split_counts(alpha: np.ndarray, n: int) -> np.ndarray:
    """Integer counts summing to n with |count_k - alpha_k n| < 1 (largest remainder)."""
    a = np.asarray(alpha, dtype=np.float64)
    if a.ndim != 1 or np.any(a < 0) or not np.isclose(a.sum(), 1.0):
        raise ValueError(f"alpha must be a non-negative vector summing to 1, got {alpha}")
    exact = a * n
    counts = np.floor(exact).astype(np.int64)
    short = n - int(counts.sum())
    if short:
        # Stable order: the largest remainders first, ties to the lower cluster index.
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


@dataclass
class AgentData:
    """One agent's samples and where they came from.

    `alpha` is the realized mixture (counts / n): the ground truth that CDFL's estimate is
    scored against (KL). `target` is the drawn mixture before rounding. `cluster[i]` is
    the cluster of sample i (per-sample truth for FedSoft-style estimates and metrics).
    """

    data: Dataset
    alpha: np.ndarray
    target: np.ndarray
    counts: np.ndarray
    cluster: torch.Tensor

    def __len__(self) -> int:
        return len(self.data)

    @property
    def primary(self) -> int:
        return int(np.argmax(self.target))


def sample_agent_data(clusters: RotatedClusters, alpha: np.ndarray, n: int, rng: np.random.Generator,
                      split: str = "train") -> AgentData:
    """n samples drawn by mixture `alpha`, shuffled: counts by split_counts, each cluster's
    share from its agent pool (train) or test pool (test) under its rotation."""
    alpha = np.asarray(alpha, dtype=np.float64)
    if alpha.shape != (clusters.num_clusters,):
        raise ValueError(f"alpha has {alpha.shape} entries for {clusters.num_clusters} clusters")
    if n < 1:
        raise ValueError(f"an agent needs at least one sample, got n={n}")
    counts = split_counts(alpha, n)
    parts = [clusters.take(k, int(c), rng, split) for k, c in enumerate(counts) if c > 0]
    which = torch.cat([torch.full((int(c),), k, dtype=torch.int64) for k, c in enumerate(counts) if c > 0])
    order = torch.from_numpy(rng.permutation(n))
    x = torch.cat([p.x for p in parts])[order]
    y = torch.cat([p.y for p in parts])[order]
    base = clusters.train_data
    data = Dataset(x, y, base.num_classes, f"{clusters.name}/agent-{split}", base.mean, base.std)
    return AgentData(data=data, alpha=counts / n, target=alpha, counts=counts, cluster=which[order])


def draw_agent(clusters: RotatedClusters, rng: np.random.Generator, *, min_samples: int = 500,
               max_samples: int = 2000, primary_min: float = 0.4, primary_max: float = 0.9,
               test_samples: int = 500, primary: int | None = None) -> tuple[AgentData, AgentData]:
    """A fresh mixture, n ~ U{min_samples..max_samples} training samples drawn by it, and a
    test set of `test_samples` from the test split drawn by the same mixture."""
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"need 1 <= min_samples <= max_samples, got {min_samples}, {max_samples}")
    alpha = draw_mixture(rng, clusters.num_clusters, primary_min, primary_max, primary=primary)
    n = int(rng.integers(min_samples, max_samples + 1))
    train = sample_agent_data(clusters, alpha, n, rng, split="train")
    test = sample_agent_data(clusters, alpha, test_samples, rng, split="test")
    return train, test
