"""fedmq.data: real files in torchvision's layout, real rotations, seeded mixtures.

The torchvision path is exercised on tiny files this module writes itself (IDX for
MNIST/FashionMNIST, bz2 libsvm for USPS, PNG directories for folder:NAME); nothing downloads.
"""

from __future__ import annotations

import bz2
import math
import socket
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedmq.config import DataSettings
from fedmq.data import (
    Dataset,
    DatasetNotFound,
    RotatedClusters,
    clear_cache,
    cluster_angles,
    clusters_from_settings,
    dataset_for_data_dir,
    draw_agent,
    draw_from_pool,
    draw_mixture,
    load_dataset,
    rotate,
    sample_agent_data,
    split_counts,
)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a non-loopback connection fails the test (no downloads)."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and "/" not in host:
            raise AssertionError(f"network access attempted: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
    clear_cache()


# ---------------------------------------------------------------- file writers


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX (SN3 'Pascal Vincent') uint8 file: magic 0x0000 08 <ndim>, big-endian dims."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist_like(root: Path, folder: str, n_train: int = 50, n_test: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(root / folder / "raw" / f"{split}-images-idx3-ubyte", images)
        write_idx(root / folder / "raw" / f"{split}-labels-idx1-ubyte", labels)
        out[split] = (images, labels)
    return out


def write_usps(root: Path, n_train: int = 30, n_test: int = 12, seed: int = 0):
    """torchvision's USPS format: bz2 text, `label(1..10) 1:v ... 256:v`, v in [-1, 1]."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n in (("usps.bz2", n_train), ("usps.t.bz2", n_test)):
        pixels = rng.integers(0, 256, size=(n, 256)).astype(np.float64)
        values = pixels / 255 * 2 - 1
        labels = np.arange(n) % 10
        text = [[f"{v:.6f}" for v in row] for row in values]
        lines = [" ".join([str(lab + 1)] + [f"{j + 1}:{v}" for j, v in enumerate(row)])
                 for lab, row in zip(labels, text, strict=True)]
        root.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
        # torchvision parses float32 and truncates with astype(uint8): mirror that
        parsed = np.asarray(text, dtype=np.float32)
        expected = ((parsed + 1) / 2 * 255).astype(np.uint8).reshape(n, 16, 16)
        out[name] = (expected, labels)
    return out


def write_png_folder(root: Path, name: str, classes=("circle", "cross", "square"), per_class=(6, 3), size=12):
    rng = np.random.default_rng(1)
    out = {}
    for split, n in zip(("train", "test"), per_class, strict=True):
        images, labels = [], []
        for ci, cls in enumerate(classes):
            d = root / name / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
                Image.fromarray(arr, mode="RGB").save(d / f"{i:03d}.png")
                images.append(arr.transpose(2, 0, 1))
                labels.append(ci)
        out[split] = (np.stack(images), np.array(labels))
    return out


def pixels(data: Dataset) -> np.ndarray:
    """Undo the normalization: pixel values in [0, 255]."""
    m = torch.tensor(data.mean).view(1, -1, 1, 1)
    s = torch.tensor(data.std).view(1, -1, 1, 1)
    return (data.x * s + m).mul(255).round().numpy()


# ---------------------------------------------------------------- digits


def test_digits_load_offline_with_fixed_disjoint_split():
    from sklearn.datasets import load_digits

    train = load_dataset("digits")
    test = load_dataset("digits", train=False)
    assert train.x.shape == (1257, 1, 8, 8) and test.x.shape == (540, 1, 8, 8)
    assert train.x.dtype == torch.float32 and train.y.dtype == torch.int64
    assert train.num_classes == test.num_classes == 10
    assert set(train.y.tolist()) == set(test.y.tolist()) == set(range(10))
    # Normalized with the train split's own statistics.
    assert abs(train.x.mean().item()) < 1e-4 and abs(train.x.std().item() - 1) < 1e-3
    # Stratified: every class is about 30 % test.
    for c in range(10):
        share = (test.y == c).sum().item() / ((test.y == c).sum().item() + (train.y == c).sum().item())
        assert 0.27 < share < 0.33
    # A partition of the 1797 images: train + test is exactly the full multiset.
    full = load_digits()
    rows = lambda x, y: sorted(map(bytes, np.concatenate([x.reshape(len(y), -1), y[:, None]], 1).astype(np.int16)))  # noqa: E731
    ours = np.concatenate([pixels(train) * 16 / 255, pixels(test) * 16 / 255]).round()
    labels = np.concatenate([train.y.numpy(), test.y.numpy()])
    assert rows(ours, labels) == rows(full.images, full.target)
    # Deterministic: a fresh load (no cache) gives the same tensors.
    clear_cache()
    again = load_dataset("digits")
    assert again is not train and torch.equal(again.x, train.x) and torch.equal(again.y, train.y)


# ---------------------------------------------------------------- torchvision layouts


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashionmnist", "FashionMNIST")])
def test_idx_datasets_load_from_torchvision_layout(tmp_path, name, folder):
    written = write_mnist_like(tmp_path, folder, seed=3)
    train = load_dataset(name, data_dir=tmp_path)
    test = load_dataset(name.upper() if name == "mnist" else "Fashion-MNIST", data_dir=tmp_path, train=False)
    assert train.x.shape == (50, 1, 28, 28) and test.x.shape == (20, 1, 28, 28)
    assert train.num_classes == 10 and train.name == name
    np.testing.assert_array_equal(pixels(train)[:, 0], written["train"][0])
    np.testing.assert_array_equal(pixels(test)[:, 0], written["t10k"][0])
    np.testing.assert_array_equal(train.y.numpy(), written["train"][1])
    assert load_dataset(name, data_dir=tmp_path) is train  # cached per process
    assert not (tmp_path / folder / "processed").exists()  # torchvision 0.29 reads raw/ directly


def test_data_dir_defaults_to_env(tmp_path, monkeypatch):
    write_mnist_like(tmp_path / "envroot", "MNIST", n_train=10, n_test=10)
    monkeypatch.setenv("FEDMQ_DATA_DIR", str(tmp_path / "envroot"))
    assert len(load_dataset("mnist")) == 10


def test_usps_bz2_loads_with_its_own_statistics(tmp_path):
    written = write_usps(tmp_path)
    train = load_dataset("usps", data_dir=tmp_path)
    test = load_dataset("usps", data_dir=tmp_path, train=False)
    assert train.x.shape == (30, 1, 16, 16) and test.x.shape == (12, 1, 16, 16)
    np.testing.assert_array_equal(pixels(train)[:, 0], written["usps.bz2"][0])
    np.testing.assert_array_equal(test.y.numpy(), written["usps.t.bz2"][1])  # labels 1..10 -> 0..9
    assert abs(train.x.mean().item()) < 1e-4  # normalized by the train split
    assert test.mean == train.mean and test.std == train.std  # test uses train's statistics


def test_png_folder_dataset(tmp_path):
    written = write_png_folder(tmp_path, "shapes")
    train = load_dataset("folder:shapes", data_dir=tmp_path)
    test = load_dataset("folder:shapes", data_dir=tmp_path, train=False)
    assert train.x.shape == (18, 3, 12, 12) and test.x.shape == (9, 3, 12, 12)
    assert train.num_classes == 3
    np.testing.assert_array_equal(pixels(train), written["train"][0])
    np.testing.assert_array_equal(test.y.numpy(), written["test"][1])
    assert test.mean == train.mean


@pytest.mark.parametrize("name, hint", [
    ("mnist", "MNIST/raw/train-images-idx3-ubyte"),
    ("fashionmnist", "FashionMNIST/raw/"),
    ("cifar10", "cifar-10-batches-py"),
    ("cifar100", "cifar-100-python"),
    ("svhn", "train_32x32.mat"),
    ("usps", "usps.bz2"),
    ("folder:mine", "mine/train/<class>/*.png"),
])
def test_missing_dataset_is_a_clear_error_and_downloads_nothing(tmp_path, name, hint):
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(DatasetNotFound) as info:
        load_dataset(name, data_dir=root)
    msg = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert repr(name) in msg and str(root.resolve()) in msg and hint in msg
    if not name.startswith("folder:"):
        assert "--download" in msg
    assert list(root.iterdir()) == []  # nothing fetched, nothing created


def test_mnist_files_do_not_stand_in_for_fashionmnist(tmp_path):
    write_mnist_like(tmp_path, "MNIST", n_train=5, n_test=5)
    (tmp_path / "FashionMNIST" / "raw").mkdir(parents=True)
    write_idx(tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(DatasetNotFound, match="t10k-labels-idx1-ubyte"):
        load_dataset("fashionmnist", data_dir=tmp_path)


def test_data_dir_alone_chooses_the_dataset_found_there(tmp_path):
    """Acceptance adds --data-dir to a documented command: the files there decide the dataset,
    never a silent fall-back to offline digits."""
    empty, one, two = tmp_path / "empty", tmp_path / "one", tmp_path / "two"
    empty.mkdir()
    write_mnist_like(one, "MNIST", n_train=5, n_test=5)
    write_mnist_like(two, "MNIST", n_train=5, n_test=5)
    write_mnist_like(two, "FashionMNIST", n_train=5, n_test=5)
    assert dataset_for_data_dir(None, None) == "digits"  # no --data-dir: the default
    assert dataset_for_data_dir("shapes", None) == "shapes"
    assert dataset_for_data_dir(None, str(one)) == "mnist"
    assert dataset_for_data_dir("fashionmnist", str(two)) == "fashionmnist"  # named: kept
    with pytest.raises(ValueError, match="holds mnist, fashionmnist: name one"):
        dataset_for_data_dir(None, str(two))
    with pytest.raises(ValueError, match=r"holds none of the datasets fedmq reads \(MNIST/raw"):
        dataset_for_data_dir(None, str(empty))
    with pytest.raises(ValueError, match="'digits' is made offline and reads nothing from --data-dir .*holds mnist"):
        dataset_for_data_dir("digits", str(one))


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="folder:NAME"):
        load_dataset("folder:../etc")


# ---------------------------------------------------------------- rotation


def blob(size: int = 29, dx: float = 8.0, dy: float = 0.0) -> torch.Tensor:
    """A Gaussian spot at (dx, dy) from the centre (y down), as (1, 1, H, W)."""
    c = (size - 1) / 2
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    return torch.exp(-((xx - c - dx) ** 2 + (yy - c - dy) ** 2) / 4.0)[None, None]


def centre_of_mass(img: torch.Tensor) -> tuple[float, float]:
    size = img.shape[-1]
    c = (size - 1) / 2
    w = img[0, 0].clamp(min=0)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    return float((w * (xx - c)).sum() / w.sum()), float((w * (yy - c)).sum() / w.sum())


def test_rotate_zero_is_identity_and_quarter_turns_match_rot90():
    x = torch.rand(5, 1, 28, 28)
    assert torch.equal(rotate(x, 0.0), x) and torch.equal(rotate(x, 360.0), x)
    for k in (1, 2, 3):
        expected = torch.rot90(x, k, dims=(-2, -1))
        assert torch.equal(rotate(x, 90.0 * k), expected)
        # The interpolating path (an angle just off the quarter turn) agrees within tolerance.
        near = rotate(x, 90.0 * k + 1e-6)
        assert (near - expected).abs().max().item() < 1e-3
    assert torch.equal(rotate(x, -90.0), torch.rot90(x, 3, dims=(-2, -1)))


@pytest.mark.parametrize("num_clusters", [3, 5, 7])
def test_rotate_moves_a_spot_by_any_angle(num_clusters):
    angles = cluster_angles(num_clusters)
    assert angles == tuple(i * 360 / num_clusters for i in range(num_clusters))
    img = blob()
    for angle in (*angles, 17.0, -33.3):
        x, y = centre_of_mass(rotate(img, angle))
        t = math.radians(angle)
        # Counter-clockwise on screen: right of centre moves up (y is down).
        assert abs(x - 8 * math.cos(t)) < 0.15 and abs(y + 8 * math.sin(t)) < 0.15, angle


def test_rotate_fills_uncovered_corners_with_background():
    x = torch.full((2, 3, 16, 16), 5.0)
    out = rotate(x, 45.0, fill=[-1.0, -2.0, -3.0])
    assert out.shape == x.shape
    assert out[:, :, 0, 0].tolist() == [[-1.0, -2.0, -3.0]] * 2  # corner: pure background
    assert torch.allclose(out[:, :, 8, 8], torch.tensor(5.0))  # centre: the image


# ---------------------------------------------------------------- clusters


def synthetic(n: int, name: str = "synthetic", seed: int = 0) -> Dataset:
    """n distinct 1x8x8 images (pixel 0 encodes the index) for pool bookkeeping tests."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g)
    x[:, 0, 0, 0] = torch.arange(n, dtype=torch.float32)
    return Dataset(x, torch.arange(n) % 10, 10, name)


def test_clusters_are_disjoint_in_base_images_when_data_allows():
    train, test = synthetic(4000), synthetic(500, seed=1)
    clusters = RotatedClusters(train, test, 3, seed=5, proxy_per_cluster=100, pretrain_per_cluster=200)
    assert clusters.disjoint_clusters
    pools = {(p, k): set(clusters.pool(p, k).tolist()) for p in ("proxy", "pretrain", "agents") for k in range(3)}
    assert all(len(pools["proxy", k]) == 100 and len(pools["pretrain", k]) == 200 for k in range(3))
    keys = list(pools)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not pools[a] & pools[b], (a, b)
    assert set().union(*pools.values()) == set(range(4000))  # every image used once
    # Test pools: the whole test split for every cluster, in a per-cluster order.
    assert sorted(clusters.pool("test", 0).tolist()) == list(range(500))
    assert clusters.test(1).x.shape == (500, 1, 8, 8) and len(clusters.test(1, 50)) == 50


def test_small_datasets_share_base_images_across_clusters_but_not_purposes():
    train, test = load_dataset("digits"), load_dataset("digits", train=False)
    clusters = RotatedClusters(train, test, 4, seed=0)  # 1000 proxy + 2000 pretrain do not fit
    assert not clusters.disjoint_clusters
    proxy, pretrain, agents = (set(clusters.pool(p, 0).tolist()) for p in ("proxy", "pretrain", "agents"))
    assert not (proxy & pretrain or proxy & agents or pretrain & agents)
    assert len(proxy) + len(pretrain) <= len(train) // 2 and len(pretrain) == 2 * len(proxy)
    for k in range(4):
        assert set(clusters.pool("proxy", k).tolist()) == proxy
        assert set(clusters.pool("agents", k).tolist()) == agents
        # Cluster k's proxy set is those base images under cluster k's rotation.
        expected = rotate(train.x[clusters.pool("proxy", k)], 90.0 * k)
        assert torch.equal(clusters.proxy(k).x, expected)
        assert torch.equal(clusters.proxy(k).y, train.y[clusters.pool("proxy", k)])


def test_cluster_pools_are_fixed_by_the_seed():
    train, test = synthetic(3000), synthetic(300, seed=1)
    a = RotatedClusters(train, test, 2, seed=1, proxy_per_cluster=50, pretrain_per_cluster=50)
    b = RotatedClusters(train, test, 2, seed=1, proxy_per_cluster=50, pretrain_per_cluster=50)
    c = RotatedClusters(train, test, 2, seed=2, proxy_per_cluster=50, pretrain_per_cluster=50)
    for p in ("proxy", "pretrain", "agents", "test"):
        assert np.array_equal(a.pool(p, 1), b.pool(p, 1))
    assert not np.array_equal(a.pool("proxy", 0), c.pool("proxy", 0))
    assert torch.equal(a.pretrain(1).x, b.pretrain(1).x)


def test_custom_angles():
    train, test = synthetic(400), synthetic(50, seed=1)
    clusters = RotatedClusters(train, test, 2, angles=[0.0, 30.0], proxy_per_cluster=10, pretrain_per_cluster=10)
    assert clusters.angles == (0.0, 30.0)
    idx = clusters.pool("test", 1)
    assert torch.equal(clusters.test(1).x, rotate(test.x[idx], 30.0, fill=test.background))
    with pytest.raises(ValueError, match="3 angles for 2 clusters"):
        RotatedClusters(train, test, 2, angles=[0, 1, 2])


# ---------------------------------------------------------------- mixtures


def test_draw_mixture_rule():
    rng = np.random.default_rng(0)
    seen_primary = set()
    for _ in range(300):
        k = int(rng.integers(2, 7))
        primary = int(rng.integers(k))
        alpha = draw_mixture(rng, k, primary=primary)
        assert alpha.shape == (k,) and np.all(alpha >= 0) and math.isclose(alpha.sum(), 1.0)
        assert 0.4 <= alpha[primary] <= 0.9
        free = draw_mixture(rng, 5)
        inside = np.flatnonzero((free >= 0.4) & (free <= 0.9))
        assert inside.size >= 1
        seen_primary.update(inside.tolist())
    assert seen_primary == set(range(5))  # the random primary reaches every cluster
    assert draw_mixture(rng, 1).tolist() == [1.0]
    narrow = draw_mixture(np.random.default_rng(3), 4, 0.7, 0.7, primary=2)
    assert math.isclose(narrow[2], 0.7)


def test_split_counts_follow_alpha_within_rounding():
    rng = np.random.default_rng(1)
    for _ in range(200):
        alpha = rng.dirichlet(np.ones(int(rng.integers(1, 8))))
        n = int(rng.integers(1, 2500))
        counts = split_counts(alpha, n)
        assert counts.sum() == n and np.all(np.abs(counts - alpha * n) < 1)


def test_draw_from_pool_repeats_evenly_beyond_the_pool():
    pool = np.arange(100, 110)
    rng = np.random.default_rng(0)
    assert len(set(draw_from_pool(pool, 10, rng).tolist())) == 10  # no repeats while it lasts
    many = draw_from_pool(pool, 25, rng)
    counts = np.bincount(many - 100, minlength=10)
    assert set(counts.tolist()) <= {2, 3} and counts.sum() == 25


@pytest.fixture(scope="module")
def digit_clusters() -> RotatedClusters:
    return RotatedClusters(load_dataset("digits"), load_dataset("digits", train=False), 4, seed=0,
                           proxy_per_cluster=100, pretrain_per_cluster=100)


def test_agent_samples_come_from_their_clusters_in_their_proportions(digit_clusters):
    clusters = digit_clusters
    alpha = np.array([0.6, 0.25, 0.15, 0.0])
    agent = sample_agent_data(clusters, alpha, 1000, np.random.default_rng(9))
    assert len(agent) == 1000 and agent.counts.tolist() == [600, 250, 150, 0]
    assert np.allclose(agent.alpha, alpha) and agent.primary == 0
    assert torch.bincount(agent.cluster, minlength=4).tolist() == [600, 250, 150, 0]
    # Each sample, turned back by its cluster's angle, is a base image of that agent pool.
    base = clusters.train_data
    pool_rows = {bytes(base.x[i].numpy().tobytes()) + bytes([base.y[i].item()])
                 for i in clusters.pool("agents", 0)}
    server_rows = {bytes(base.x[i].numpy().tobytes()) + bytes([base.y[i].item()])
                   for p in ("proxy", "pretrain") for i in clusters.pool(p, 0)}
    for i in range(len(agent)):
        k = int(agent.cluster[i])
        back = torch.rot90(agent.data.x[i], -k, dims=(-2, -1))
        row = bytes(back.numpy().tobytes()) + bytes([agent.data.y[i].item()])
        assert row in pool_rows and row not in server_rows
    # Samples are shuffled, not grouped by cluster.
    assert agent.cluster[:600].tolist() != [0] * 600


def test_agent_draws_reproduce_with_the_seed(digit_clusters):
    a_train, a_test = draw_agent(digit_clusters, np.random.default_rng(42))
    b_train, b_test = draw_agent(digit_clusters, np.random.default_rng(42))
    c_train, _ = draw_agent(digit_clusters, np.random.default_rng(43))
    assert 500 <= len(a_train) <= 2000 and len(a_test) == 500
    assert torch.equal(a_train.data.x, b_train.data.x) and torch.equal(a_train.data.y, b_train.data.y)
    assert torch.equal(a_test.data.x, b_test.data.x) and np.array_equal(a_train.alpha, b_train.alpha)
    assert not np.array_equal(a_train.target, c_train.target)
    # Train and test follow the same drawn mixture; test samples come from the test split.
    assert np.array_equal(a_train.target, a_test.target)
    assert np.all(np.abs(a_test.counts - a_test.target * 500) < 1)
    assert 0.4 <= a_train.target[a_train.primary] <= 0.9


def test_many_agents_have_sizes_and_shares_in_range(digit_clusters):
    rng = np.random.default_rng(7)
    sizes = []
    for _ in range(40):
        train, _ = draw_agent(digit_clusters, rng, test_samples=10)
        sizes.append(len(train))
        assert np.all(np.abs(train.counts - train.target * len(train)) < 1)
        assert train.data.x.shape[1:] == (1, 8, 8)
    assert min(sizes) >= 500 and max(sizes) <= 2000 and len(set(sizes)) > 30


def test_clusters_from_settings():
    clusters = clusters_from_settings(DataSettings(dataset="digits", proxy_per_cluster=20,
                                                   pretrain_per_cluster=30), 2, seed=3)
    assert clusters.disjoint_clusters and clusters.angles == (0.0, 180.0)
    assert len(clusters.proxy(1)) == 20 and len(clusters.pretrain(0)) == 30
    assert clusters.image_shape == (1, 8, 8) and clusters.num_classes == 10


@pytest.mark.parametrize("clusters", [2, 3, 6])
@pytest.mark.parametrize("dataset", ["digits", "mnist", "fashionmnist", "usps", "folder:mine"])
def test_default_server_sets_fit_every_dataset(tmp_path, dataset, clusters):
    """No size flags: every dataset the CLI accepts lays out proxy, pretrain and agent pools."""
    if dataset in ("mnist", "fashionmnist"):
        write_mnist_like(tmp_path, {"mnist": "MNIST", "fashionmnist": "FashionMNIST"}[dataset], 900, 60)
    elif dataset == "usps":
        write_usps(tmp_path, 300, 40)
    elif dataset.startswith("folder:"):
        write_png_folder(tmp_path, "mine", per_class=(40, 5))
    settings = DataSettings(dataset=dataset, data_dir=str(tmp_path))
    assert settings.proxy_per_cluster == 0 and settings.pretrain_per_cluster == 0  # auto
    c = clusters_from_settings(settings, clusters, seed=0)
    n_train = len(c.train_data)
    assert 0 < c.proxy_size <= 1000 and 0 < c.pretrain_size <= 2000
    server = (clusters if c.disjoint_clusters else 1) * (c.proxy_size + c.pretrain_size)
    assert server <= n_train // 2 <= n_train - server  # the agents keep at least half
    for k in range(clusters):
        assert len(c.proxy(k)) == c.proxy_size and len(c.pretrain(k)) == c.pretrain_size
        assert len(c.pool("agents", k)) > 0


def test_auto_sizes_are_the_papers_where_they_fit():
    train, test = synthetic(20_000), synthetic(100, seed=1)
    c = RotatedClusters(train, test, 3)
    assert c.disjoint_clusters and (c.proxy_size, c.pretrain_size) == (1000, 2000)
    digits = clusters_from_settings(DataSettings(dataset="digits"), 3)
    assert (digits.proxy_size, digits.pretrain_size) == (209, 418)  # 1257 // 2 = 628, in 1 : 2


def test_explicit_sizes_that_do_not_fit_are_refused_with_the_largest_that_does():
    with pytest.raises(ValueError, match=r"data\.pretrain_per_cluster=2000 .* digits.* 628"):
        clusters_from_settings(DataSettings(dataset="digits", pretrain_per_cluster=2000), 3)
    # An explicit size is honoured exactly; the auto one takes what is left.
    c = clusters_from_settings(DataSettings(dataset="digits", proxy_per_cluster=100), 3)
    assert (c.proxy_size, c.pretrain_size) == (100, 528)


@pytest.mark.parametrize("shape", [(3, 1, 28, 28), (2, 3, 16, 12), (1, 1, 8, 8)])
def test_rotate_is_torchvisions_rotate_bit_for_bit(shape):
    """rotate() avoids importing torchvision at run time; it must still give exactly what it gave."""
    import torchvision.transforms.functional as tvf
    from torchvision.transforms import InterpolationMode

    x = torch.rand(*shape, generator=torch.Generator().manual_seed(3)) * 2 - 0.5
    fill = [-0.42 * (i + 1) for i in range(shape[1])]
    for angle in (17.0, 45.0, 72.0, 120.0, 144.0, 216.0, 240.0, 300.0, -33.3, 90.0 + 1e-6):
        expected = tvf.rotate(x, angle, interpolation=InterpolationMode.BILINEAR, fill=fill)
        assert torch.equal(rotate(x, angle, fill=fill), expected), angle


def test_digits_from_the_disk_cache_are_the_split_scikit_learn_makes(tmp_path, monkeypatch):
    """The split is kept on disk after the first load (scikit-learn's import is 0.6 s of every start)."""
    from fedmq import disk_cache
    from fedmq.data import sources

    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sources, "_cache", {})  # the per-process cache would answer without the disk
    made = [load_dataset("digits", train=t) for t in (True, False)]
    assert list((tmp_path / "data").iterdir()), "the first load keeps the split"
    monkeypatch.setattr(disk_cache, "write", lambda *a: pytest.fail("a kept split is not made again"))
    monkeypatch.setattr(sources, "_cache", {})
    kept = [load_dataset("digits", train=t) for t in (True, False)]
    for a, b in zip(made, kept, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
        # Strides too: convolutions round differently for the same values laid out otherwise,
        # and a journal replayed elsewhere must rebuild the live clusters bit for bit.
        assert a.x.stride() == b.x.stride() == (64, 1, 8, 1)
    assert (len(made[0].y), len(made[1].y)) == (1257, 540)
    _, labels, train, test = sources._digits_split()
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(1797))
    # Stratified: every class keeps its 70/30 share in both splits.
    assert all(abs((labels[train] == c).sum() - 0.7 * (labels == c).sum()) <= 1 for c in range(10))
