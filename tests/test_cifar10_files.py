"""scripts/cifar10_files.py on a small package the test writes in the same layout (PNG strips
of one 32x32 RGB image per row, labels as JSON): what it writes, and what it refuses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import cifar10_files as cf  # noqa: E402

PER_CLASS = {"train": 5, "test": 2}


def make_package(root: Path, labels_off_by: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    root.mkdir()
    images = {}
    for split, strips in (("train", cf.TRAIN_STRIPS), ("test", (cf.TEST_STRIP,))):
        labels = np.repeat(np.arange(10), PER_CLASS[split])
        rng.shuffle(labels)
        images[split] = rng.integers(0, 256, size=(len(labels), 32, 32, 3), dtype=np.uint8)
        for part, strip in zip(np.array_split(images[split], len(strips)), strips, strict=True):
            Image.fromarray(part.reshape(len(part), 32 * 32, 3)).save(root / strip)
        (root / cf.LABELS[split]).write_text(json.dumps(labels[: len(labels) - labels_off_by].tolist()))
        images[f"{split}_labels"] = labels
    return root, images


def test_writes_every_image_under_its_class_and_split(tmp_path) -> None:
    package, made = make_package(tmp_path / "package")
    out = cf.write_folder(cf.load_package(package, PER_CLASS, means=None), tmp_path / "data" / "cifar10")
    for split in ("train", "test"):
        assert sorted(p.name for p in (out / split).iterdir()) == sorted(cf.CLASSES)
        for i in (0, len(made[split]) - 1):
            label = made[f"{split}_labels"][i]
            written = np.asarray(Image.open(out / split / cf.CLASSES[label] / f"{i:05d}.png"))
            assert (written == made[split][i]).all()
        assert sum(1 for _ in (out / split).rglob("*.png")) == 10 * PER_CLASS[split]
    assert [p.name for p in out.parent.iterdir()] == ["cifar10"]  # no partial directory left


def test_a_package_that_fails_a_check_writes_nothing(tmp_path) -> None:
    package, _ = make_package(tmp_path / "package", labels_off_by=1)
    with pytest.raises(cf.PackageError, match="images but .* labels"):
        cf.load_package(package, PER_CLASS, means=None)
    good, _ = make_package(tmp_path / "good")
    with pytest.raises(cf.PackageError, match="channel means"):
        cf.load_package(good, PER_CLASS)  # random pixels are not CIFAR-10's means
    with pytest.raises(cf.PackageError, match="per class"):
        cf.load_package(good, {"train": 6, "test": 2}, means=None)


def test_an_existing_folder_is_never_replaced(tmp_path, capsys) -> None:
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "keep").write_text("x")
    assert cf.main([str(tmp_path), "--package", str(tmp_path / "nowhere.tgz")]) == 2
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "cifar10" / "keep").read_text() == "x"
