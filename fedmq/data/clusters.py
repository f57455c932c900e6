"""Rotation clusters: cluster k is the dataset rotated by k * 360 / K degrees.

One train split feeds three purposes that never share a base image: the server's proxy
sets (CDFL estimates mixtures on them), the server's pre-training sets, and the pool that
agents draw their local data from. The test split feeds cluster test sets and agents' test
mixtures. See docs/data.md for the rule that decides whether clusters also get disjoint
base images.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import numpy as np
import torch

from fedmq.config import DataSettings
from fedmq.data.sources import Dataset, load_dataset
from fedmq.errors import UsageError

PURPOSES: tuple[str, ...] = ("proxy", "pretrain", "agents", "test")

# The paper's server sets per cluster: what an auto size (None or 0) asks for before it is
# shrunk to what the dataset can give.
PAPER_PROXY_PER_CLUSTER = 1000
PAPER_PRETRAIN_PER_CLUSTER = 2000

MIN_POOL_PER_CLASS = 1

AUTO_PUBLIC = -1
AUTO_PUBLIC_IMAGES = 10_000
"""data.public_images = -1 (auto): this many public images, or a fifth of the train split where
that is less (shapes' 6,000: 1,200)."""

PUBLIC_STREAM = (0x505542, 0x4C4943)
"""Seed of the public images' draw: fixed, not the run's seed."""
"""Each cluster's proxy set, pre-training set and agents' pool hold at least this many images per
class: a smaller one cannot hold every class, and a 6-image folder split into sets of 1, 2 and 3
pre-trained for minutes at a loss of 0."""


class DatasetTooSmall(UsageError):
    """A train split too small to lay out the server's sets and the agents' pools (exit status 2)."""


def rotate(x: torch.Tensor, angle_deg: float, fill: Sequence[float] | None = None) -> torch.Tensor:
    """Rotate a batch (N, C, H, W) counter-clockwise by any angle about the image centre.

    Bilinear interpolation; the corners the rotation uncovers get `fill` (one value per
    channel, default 0), so pass a Dataset's `background` to keep them black after
    normalization. Multiples of 90 degrees on square images are exact (torch.rot90); the
    interpolated path agrees with them to float rounding. Returns a new tensor.
    """
    if x.ndim != 4:
        raise ValueError(f"rotate expects (N, C, H, W), got shape {tuple(x.shape)}")
    angle = float(angle_deg) % 360.0
    if math.isclose(angle, 0.0, abs_tol=1e-9) or math.isclose(angle, 360.0, abs_tol=1e-9):
        return x.clone()
    quarter = angle / 90.0
    if x.shape[-1] == x.shape[-2] and math.isclose(quarter, round(quarter), abs_tol=1e-9):
        return torch.rot90(x, int(round(quarter)), dims=(-2, -1)).contiguous()
    fill_values = [float(v) for v in fill] if fill is not None else [0.0] * x.shape[1]
    if len(fill_values) != x.shape[1]:
        raise ValueError(f"fill needs one value per channel ({x.shape[1]}), got {len(fill_values)}")
    return _rotate_bilinear(x, angle, fill_values)


def _rotate_bilinear(x: torch.Tensor, angle: float, fill: list[float]) -> torch.Tensor:
    """torchvision's tensor `rotate` (bilinear, about the centre, with fill), op for op.

    Written out so that a process rotating data does not import torchvision, which pulls in
    torch._dynamo (~1.8 s of every agent's and aggregator's start); tests/test_data.py checks
    that the result is bit-identical to torchvision's.
    """
    n, c, h, w = x.shape
    dtype = x.dtype if torch.is_floating_point(x) else torch.float32
    rot = math.radians(-angle)
    # The inverse of the rotation about the origin (the centre, in these coordinates).
    theta = torch.tensor([math.cos(rot), math.sin(rot), 0.0, -math.sin(rot), math.cos(rot), 0.0],
                         dtype=dtype, device=x.device).reshape(1, 2, 3)
    base = torch.empty(1, h, w, 3, dtype=dtype, device=x.device)
    base[..., 0].copy_(torch.linspace(-w * 0.5 + 0.5, w * 0.5 - 0.5, steps=w, device=x.device))
    base[..., 1].copy_(torch.linspace(-h * 0.5 + 0.5, h * 0.5 - 0.5, steps=h, device=x.device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    scaled = theta.transpose(1, 2) / torch.tensor([0.5 * w, 0.5 * h], dtype=dtype, device=x.device)
    grid = base.view(1, h * w, 3).bmm(scaled).view(1, h, w, 2).expand(n, h, w, 2)
    img = x.to(dtype)
    # One extra all-ones channel tells, after sampling, how much of each pixel was inside.
    img = torch.cat((img, torch.ones((n, 1, h, w), dtype=dtype, device=x.device)), dim=1)
    img = torch.nn.functional.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    mask = img[:, -1:].expand(n, c, h, w)
    fill_img = torch.tensor(fill, dtype=dtype, device=x.device).view(1, c, 1, 1).expand(n, c, h, w)
    out = img[:, :-1] * mask + (1.0 - mask) * fill_img
    return out if out.dtype == x.dtype else out.round().to(x.dtype)


def cluster_angles(num_clusters: int) -> tuple[float, ...]:
    """i * 360 / K for i in 0..K-1."""
    if num_clusters < 1:
        raise ValueError(f"need at least one cluster, got {num_clusters}")
    return tuple(i * 360.0 / num_clusters for i in range(num_clusters))


def draw_from_pool(pool: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n base indices from `pool`: without replacement while the pool lasts.

    Beyond the pool's size, whole shuffled copies of the pool are used, then a partial one,
    so every base image appears floor(n/|pool|) or ceil(n/|pool|) times.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if len(pool) == 0:
        raise ValueError("cannot draw from an empty pool")
    full, rest = divmod(n, len(pool))
    parts = [rng.permutation(pool) for _ in range(full)]
    if rest:
        parts.append(rng.choice(pool, size=rest, replace=False))
    return np.concatenate(parts).astype(np.int64)


class RotatedClusters:
    """K clusters of one dataset, each a rotation, with deterministic per-purpose pools.

    Pools are base-image indices fixed by `seed` at construction: `pool(purpose, k)`.
    Purposes (proxy, pretrain, agents) never share a base image, and all come from the
    train split; the test pools come from the test split. The server's sets (proxy and
    pretrain, all clusters) get at most half the train split; the agents get the rest.
    Clusters get disjoint base images (`disjoint_clusters`) when K * (proxy + pretrain) fits
    in that half; otherwise every cluster uses the same proxy, pretrain and agent base images
    under its own rotation. Test pools are the whole test split for every cluster.

    A size of None (or 0) is auto: the paper's 1000 proxy / 2000 pretrain per cluster, or,
    where the dataset is too small for them, what fits in the server's half (the auto sizes
    share what the explicit ones leave, in the paper's ratio 1 : 2). So every dataset works
    with no size given, and a size given explicitly is either honoured exactly or refused
    with the largest value that fits.
    """

    def __init__(self, train: Dataset, test: Dataset, num_clusters: int, *, seed: int = 0,
                 angles: Sequence[float] | None = None, proxy_per_cluster: int | None = None,
                 pretrain_per_cluster: int | None = None, public: int = 0) -> None:
        if train.image_shape != test.image_shape or train.num_classes != test.num_classes:
            raise ValueError(f"train {train.image_shape}/{train.num_classes} classes and test "
                             f"{test.image_shape}/{test.num_classes} classes differ")
        if (proxy_per_cluster or 0) < 0 or (pretrain_per_cluster or 0) < 0 or public < AUTO_PUBLIC:
            raise ValueError("proxy_per_cluster and pretrain_per_cluster must be >= 0 (0 = auto), public >= -1")
        self.angles: tuple[float, ...] = (tuple(float(a) for a in angles) if angles is not None
                                          else cluster_angles(num_clusters))
        if len(self.angles) != num_clusters:
            raise ValueError(f"{len(self.angles)} angles for {num_clusters} clusters")
        self.num_clusters = num_clusters
        self.train_data = train
        self.test_data = test
        self.seed = seed
        self.name = train.name
        self._cache: dict[tuple[str, int, int | None], Dataset] = {}
        self._public = self._public_pool(len(train), public)
        self._pools = self._make_pools(len(train), len(test), proxy_per_cluster, pretrain_per_cluster)

    @property
    def num_classes(self) -> int:
        return self.train_data.num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.train_data.image_shape

    def _server_sizes(self, n_train: int, proxy: int | None, pretrain: int | None) -> tuple[int, int]:
        """Per-cluster proxy and pretrain sizes (see the class docstring), or a ValueError that
        names the config key, the dataset and the largest value that fits."""
        k, budget = self.num_clusters, n_train // 2
        want = {"proxy": proxy or PAPER_PROXY_PER_CLUSTER, "pretrain": pretrain or PAPER_PRETRAIN_PER_CLUSTER}
        self.disjoint_clusters = k * sum(want.values()) <= budget
        if self.disjoint_clusters:
            return want["proxy"], want["pretrain"]
        # Shared base images: each cluster's sets are the same images under its own rotation,
        # so the sizes per cluster must fit the server's half together.
        explicit = {name: n for name, n in (("proxy", proxy), ("pretrain", pretrain)) if n}
        auto = [name for name in want if name not in explicit]
        left = budget - sum(explicit.values())
        if left < 0 or (auto and left <= 0):
            keys = " + ".join(f"data.{name}_per_cluster={n}" for name, n in explicit.items())
            raise ValueError(f"{keys} does not fit {self.name}: its {n_train} train images leave "
                             f"{budget} for the server's sets (each cluster shares them under its "
                             f"own rotation); lower it to {budget} in all, or set 0 for auto")
        sizes = dict(explicit)
        auto_total = sum(want[name] for name in auto)
        for name in auto:
            sizes[name] = min(want[name], left * want[name] // auto_total)
        return sizes["proxy"], sizes["pretrain"]

    def _public_pool(self, n_train: int, public: int) -> np.ndarray:
        """The server's public images: drawn from a stream of their own, so that they are the
        same for every seed and K (a server's public data does not change with the fleet)."""
        if not public:
            return np.arange(0)
        if public == AUTO_PUBLIC:
            public = min(AUTO_PUBLIC_IMAGES, n_train // 5)
        if public > n_train // 2:
            raise DatasetTooSmall(f"data.public_images={public} does not fit {self.name}: at most half its "
                                  f"{n_train} train images ({n_train // 2}) may be public; lower it")
        return np.sort(np.random.default_rng(PUBLIC_STREAM).permutation(n_train)[:public])

    def _make_pools(self, n_train: int, n_test: int, proxy: int | None,
                    pretrain: int | None) -> dict[str, list[np.ndarray]]:
        k = self.num_clusters
        rng = np.random.default_rng([self.seed, 0x524F54])  # fixed stream for the pools
        rest = np.setdiff1d(np.arange(n_train), self._public) if len(self._public) else np.arange(n_train)
        n_train = len(rest)  # the public images are no one else's
        order = rest[rng.permutation(n_train)]
        self.proxy_size, self.pretrain_size = self._server_sizes(n_train, proxy, pretrain)
        if self.disjoint_clusters:
            proxy_block, pretrain_block = k * self.proxy_size, k * self.pretrain_size
        else:
            proxy_block, pretrain_block = self.proxy_size, self.pretrain_size
        blocks = np.split(order, [proxy_block, proxy_block + pretrain_block])
        pools: dict[str, list[np.ndarray]] = {}
        for purpose, block in zip(("proxy", "pretrain", "agents"), blocks, strict=True):
            if self.disjoint_clusters:
                pools[purpose] = [np.sort(p) for p in np.array_split(block, k)]
            else:
                pools[purpose] = [np.sort(block)] * k
        test_order = rng.permutation(n_test)
        pools["test"] = [rng.permutation(test_order) for _ in range(k)]  # own order per cluster
        self._check_sizes(n_train, {purpose: min(len(p) for p in pools[purpose])
                                    for purpose in ("proxy", "pretrain", "agents")}, proxy, pretrain)
        return pools

    def _check_sizes(self, n_train: int, smallest: dict[str, int], proxy: int | None, pretrain: int | None) -> None:
        """DatasetTooSmall where a cluster's proxy set, pre-training set or agents' pool is
        smaller than MIN_POOL_PER_CLASS images per class, saying how many train images it takes."""
        need = max(1, MIN_POOL_PER_CLASS * self.num_classes)
        if min(smallest.values()) >= need:
            return
        sets = (f"each cluster's proxy set, pre-training set and agents' pool needs {need} images "
                f"({MIN_POOL_PER_CLASS} per class), and these would get "
                + ", ".join(f"{n}" for n in smallest.values()))
        explicit = [f"data.{name}_per_cluster={n}" for name, n in (("proxy", proxy), ("pretrain", pretrain))
                    if n and n < need]
        if explicit:
            raise DatasetTooSmall(f"{self.name}: {' and '.join(explicit)} is too small: {sets}; set {need} or "
                                  f"more, or 0 for auto")
        needed = next((n for n in range(n_train + 1, 100 * n_train + 1000 * need)
                       if self._fits(n, need, proxy, pretrain)), None)
        has = f"needs at least {needed} train images and has {n_train}" if needed else f"has {n_train} train images"
        raise DatasetTooSmall(f"{self.name} is too small for {self.num_clusters} clusters: {sets}; it {has}: "
                              f"add images (docs/data.md)")

    def _fits(self, n_train: int, need: int, proxy: int | None, pretrain: int | None) -> bool:
        """Whether a train split of n_train images gives every pool `need` images (same sizes)."""
        probe = copy.copy(self)  # _server_sizes sets disjoint_clusters: keep ours
        try:
            p, q = probe._server_sizes(n_train, proxy, pretrain)
        except ValueError:
            return False
        k = self.num_clusters
        if probe.disjoint_clusters:
            return min(p, q, (n_train - k * (p + q)) // k) >= need
        return min(p, q, n_train - p - q) >= need

    def pool(self, purpose: str, cluster: int) -> np.ndarray:
        """Base-image indices (into the train split, or the test split for 'test')."""
        if purpose not in PURPOSES:
            raise ValueError(f"unknown purpose {purpose!r}; one of {', '.join(PURPOSES)}")
        self._check_cluster(cluster)
        return self._pools[purpose][cluster].copy()

    def rotated(self, base: Dataset, cluster: int, idx: np.ndarray, label: str) -> Dataset:
        """`base[idx]` rotated by cluster `cluster`'s angle, corners black."""
        self._check_cluster(cluster)
        part = base.subset(idx)
        x = rotate(part.x, self.angles[cluster], fill=base.background)
        return part.with_x(x, name=f"{self.name}/rot{self.angles[cluster]:g}/{label}")

    @property
    def public_size(self) -> int:
        """Public images (data.public_images, auto resolved); 0: none."""
        return len(self._public)

    def public(self) -> Dataset:
        """The server's public images (data.public_images), unrotated: the start model's data."""
        if not len(self._public):
            raise ValueError("no public images: set data.public_images")
        return self.train_data.subset(self._public, name=f"{self.name}/public")

    def proxy(self, cluster: int, n: int | None = None) -> Dataset:
        """The server's proxy set of a cluster: its whole proxy pool, or its first n."""
        return self._fixed("proxy", cluster, n)

    def pretrain(self, cluster: int, n: int | None = None) -> Dataset:
        """The server's pre-training set of a cluster: its pretrain pool, or its first n."""
        return self._fixed("pretrain", cluster, n)

    def test(self, cluster: int, n: int | None = None) -> Dataset:
        """Cluster test set from the test split (first n of a fixed per-cluster order)."""
        return self._fixed("test", cluster, n)

    def _fixed(self, purpose: str, cluster: int, n: int | None) -> Dataset:
        key = (purpose, cluster, n)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        pool = self.pool(purpose, cluster)
        if n is not None:
            if n > len(pool):
                raise ValueError(f"data.{purpose}_per_cluster={n} does not fit {self.name} with "
                                 f"K={self.num_clusters}: the {purpose} pool of a cluster has "
                                 f"{len(pool)} images; set {len(pool)} or less, or 0 for auto")
            pool = pool[:n]
        base = self.test_data if purpose == "test" else self.train_data
        data = self.rotated(base, cluster, pool, purpose)
        self._cache[key] = data
        return data

    def take(self, cluster: int, n: int, rng: np.random.Generator, split: str = "train") -> Dataset:
        """n fresh samples of one cluster for an agent: from the agents' pool (train) or the
        test pool (test), without replacement while the pool lasts (see draw_from_pool)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self._check_cluster(cluster)
        purpose, base = ("agents", self.train_data) if split == "train" else ("test", self.test_data)
        idx = draw_from_pool(self._pools[purpose][cluster], n, rng)
        return self.rotated(base, cluster, idx, split)

    def _check_cluster(self, cluster: int) -> None:
        if not 0 <= cluster < self.num_clusters:
            raise IndexError(f"cluster {cluster} out of range 0..{self.num_clusters - 1}")

    def __repr__(self) -> str:
        sizes = {p: len(self._pools[p][0]) for p in PURPOSES}
        return (f"RotatedClusters({self.name!r}, K={self.num_clusters}, angles={list(self.angles)}, "
                f"disjoint_clusters={self.disjoint_clusters}, pool sizes per cluster={sizes})")


def clusters_from_settings(settings: DataSettings, num_clusters: int, *, seed: int = 0,
                           angles: Sequence[float] | None = None) -> RotatedClusters:
    """Load `settings.dataset` (train and test) and build its rotation clusters."""
    train = load_dataset(settings.dataset, data_dir=settings.data_dir, train=True, download=settings.download)
    test = load_dataset(settings.dataset, data_dir=settings.data_dir, train=False, download=settings.download)
    return RotatedClusters(train, test, num_clusters, seed=seed, angles=angles,
                           proxy_per_cluster=settings.proxy_per_cluster or None,
                           pretrain_per_cluster=settings.pretrain_per_cluster or None,
                           public=settings.public_images)
