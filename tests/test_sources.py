"""Data sources: a folder of PNG/.npy files consumed once, a dataset stream that follows its mixture."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from edge_agent.sources import DatasetSource, DirectorySource, LocalBuffer

SHAPE = (1, 8, 8)


def write_png(path, pixels: np.ndarray, mode: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, mode=mode).save(path)


def test_directory_source_reads_png_and_npy_and_skips_bad(tmp_path, caplog) -> None:
    root = tmp_path / "inbox"
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)
    write_png(root / "3" / "a.png", gray, "L")
    good_npy = rng.standard_normal(SHAPE).astype(np.float32)
    (root / "7").mkdir(parents=True)
    np.save(root / "7" / "b.npy", good_npy)
    # bad ones, one per reason
    write_png(root / "1" / "big.png", np.zeros((28, 28), np.uint8), "L")                  # wrong_shape
    write_png(root / "1" / "rgb.png", np.zeros((8, 8, 3), np.uint8), "RGB")               # wrong_shape
    (root / "2").mkdir()
    np.save(root / "2" / "c.npy", np.zeros((8, 8), np.float32))                           # wrong_shape
    (root / "12").mkdir()
    np.save(root / "12" / "d.npy", good_npy)                                              # bad_label
    (root / "cat").mkdir()
    np.save(root / "cat" / "e.npy", good_npy)                                             # bad_label
    (root / "4").mkdir()
    (root / "4" / "f.png").write_bytes(b"not a png at all")                               # unreadable
    (root / "4" / "g.txt").write_text("hello")                                            # unknown_type
    np.save(root / "4" / "h.npy", np.full(SHAPE, np.nan, np.float32))                     # not_finite
    np.save(root / "4" / "i.npy", np.zeros(SHAPE, np.int32))                              # bad_dtype
    (root / "5").mkdir()
    (root / "5" / "j.npy.part").write_bytes(b"half written")                              # not ready: left alone
    np.save(root / "5" / ".k.npy", good_npy)                                              # hidden: left alone

    source = DirectorySource(root, SHAPE, 10, mean=[0.5], std=[0.25])
    with caplog.at_level(logging.WARNING, logger="fedmq"):
        samples = source.poll(100)
    got = {label: x for x, label in samples}
    assert sorted(got) == [3, 7]
    expected_png = (gray.astype(np.float32)[None] / 255.0 - 0.5) / 0.25
    np.testing.assert_allclose(got[3].numpy(), expected_png, atol=1e-6)
    np.testing.assert_array_equal(got[7].numpy(), good_npy)
    assert dict(source.skipped) == {"wrong_shape": 3, "bad_label": 2, "unreadable": 1,
                                    "unknown_type": 1, "not_finite": 1, "bad_dtype": 1}
    reasons = [r.fields["reason"] for r in caplog.records if r.getMessage() == "source.skipped"]
    assert sorted(reasons) == sorted(source.skipped.elements())
    assert (root / "done" / "3" / "a.png").exists() and (root / "rejected" / "cat" / "e.npy").exists()
    assert (root / "5" / "j.npy.part").exists() and (root / "5" / ".k.npy").exists()
    assert source.poll(100) == []


def test_directory_source_never_consumes_twice_across_restarts(tmp_path) -> None:
    root = tmp_path / "inbox"
    (root / "0").mkdir(parents=True)
    for i in range(5):
        np.save(root / "0" / f"s{i}.npy", np.full(SHAPE, float(i), np.float32))
    first = DirectorySource(root, SHAPE, 10)
    taken = first.poll(3)
    assert len(taken) == 3

    restarted = DirectorySource(root, SHAPE, 10)  # a new process on the same folder
    rest = restarted.poll(100)
    assert len(rest) == 2
    values = sorted(float(x[0, 0, 0]) for x, _ in taken + rest)
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0]

    np.save(root / "0" / "s0.npy", np.full(SHAPE, 9.0, np.float32))  # a new file reusing a name
    again = DirectorySource(root, SHAPE, 10).poll(100)
    assert [float(x[0, 0, 0]) for x, _ in again] == [9.0]
    assert len(list((root / "done" / "0").iterdir())) == 6
    assert DirectorySource(root, SHAPE, 10).poll(100) == []


def test_directory_source_can_delete_instead_of_archiving(tmp_path) -> None:
    root = tmp_path / "inbox"
    (root / "1").mkdir(parents=True)
    np.save(root / "1" / "a.npy", np.zeros(SHAPE, np.float32))
    source = DirectorySource(root, SHAPE, 10, keep_done=False)
    assert len(source.poll(10)) == 1
    assert not any((root / "done" / "1").iterdir())


def test_rgb_png_for_a_colour_model(tmp_path) -> None:
    root = tmp_path / "inbox"
    pixels = np.random.default_rng(1).integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    write_png(root / "2" / "a.png", pixels, "RGB")
    [(x, y)] = DirectorySource(root, (3, 4, 4), 10).poll(10)
    assert y == 2
    np.testing.assert_allclose(x.numpy(), pixels.transpose(2, 0, 1) / 255.0, atol=1e-6)


def test_dataset_source_follows_set_mixture() -> None:
    # pool k holds images filled with the value k, so a sample tells its cluster
    pools = [(torch.full((50, *SHAPE), float(k)), torch.full((50,), k, dtype=torch.int64)) for k in range(3)]
    source = DatasetSource(pools, mixture=[0.7, 0.3, 0.0], seed=0)

    def shares(n: int) -> np.ndarray:
        samples = source.poll(n)
        clusters = [int(x[0, 0, 0]) for x, _ in samples]
        assert clusters == source.last_clusters and all(y == k for (_, y), k in zip(samples, clusters, strict=True))
        return np.bincount(clusters, minlength=3) / n

    first = shares(4000)
    np.testing.assert_allclose(first, [0.7, 0.3, 0.0], atol=0.03)
    source.set_mixture([0, 1, 3])  # weights are normalized
    second = shares(4000)
    np.testing.assert_allclose(second, [0.0, 0.25, 0.75], atol=0.03)
    assert source.drawn.sum() == 8000

    again = DatasetSource(pools, mixture=[0.7, 0.3, 0.0], seed=0)
    assert [y for _, y in again.poll(100)] == [y for _, y in DatasetSource(pools, [0.7, 0.3, 0.0], seed=0).poll(100)]
    with pytest.raises(ValueError, match="mixture"):
        source.set_mixture([1.0, -1.0, 1.0])


def test_local_buffer_keeps_the_newest() -> None:
    buffer = LocalBuffer(capacity=3)
    buffer.extend([(torch.full(SHAPE, float(i)), i) for i in range(5)])
    x, y = buffer.tensors()
    assert y.tolist() == [2, 3, 4] and x.shape == (3, *SHAPE) and buffer.added == 5
    assert buffer.tensors(last=2)[1].tolist() == [3, 4]
    buffer.clear()
    with pytest.raises(ValueError, match="empty"):
        buffer.tensors()
