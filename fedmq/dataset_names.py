"""Dataset names and where their files lie under a data root, without torch.

A config names its dataset, and loading it checks the name (`canonical_dataset`) and picks the
dataset a `--data-dir` holds (`dataset_for_data_dir`): both happen for every command that
loads a config, so they live here, apart from the loaders (fedmq/data/sources.py), which need
torch. This module imports nothing of fedmq but its errors.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedmq.errors import UsageError


class UnknownDataset(UsageError):
    """A dataset name that is none of DATASETS, folder:NAME or module.path:factory."""


DATASETS: tuple[str, ...] = ("digits", "synthetic", "shapes", "shapeslit", "mnist", "fashionmnist", "cifar10", "cifar100",
                             "svhn", "usps")
"""Names `load_dataset` accepts, besides `folder:NAME` (a directory of PNG/JPEG images) and
`module.path:factory` (a dataset factory by import path, docs/models.md)."""

OFFLINE: tuple[str, ...] = ("digits", "synthetic", "shapes", "shapeslit")
"""Datasets made in the process (no data root): scikit-learn's digits and our generated tasks."""

EXPECTED_FILES: dict[str, list[str]] = {
    "mnist": [f"MNIST/raw/{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")],
    "fashionmnist": [f"FashionMNIST/raw/{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")],
    "cifar10": ["cifar-10-batches-py/data_batch_1 .. data_batch_5", "cifar-10-batches-py/test_batch",
                "cifar-10-batches-py/batches.meta"],
    "cifar100": ["cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"],
    "svhn": ["train_32x32.mat", "test_32x32.mat"],
    "usps": ["usps.bz2", "usps.t.bz2"],
}
"""What torchvision expects under the data root, for the error message."""

MARKERS: dict[str, str] = {name: os.path.dirname(files[0]) or files[0] for name, files in EXPECTED_FILES.items()}
"""Dataset -> the path under a data root that says its files are there: the folder of its first
expected file, or that file where it lies in the root (the loader then checks every file and
names what is missing)."""


def is_factory(name: str) -> bool:
    """Whether `name` is a dataset factory by import path (`module.path:attr`)."""
    return ":" in name and not name.lower().startswith("folder:")


def canonical_dataset(name: str) -> str:
    """The dataset's key (`Fashion-MNIST` -> fashionmnist, `folder:NAME`, `module.path:factory`);
    UnknownDataset if none."""
    if is_factory(name):
        module, _, attr = name.strip().partition(":")
        if not all(p.isidentifier() for p in module.split(".")) or not attr.isidentifier():
            raise UnknownDataset(f"dataset {name!r}: a factory is module.path:function, e.g. mypkg.data:load")
        return name.strip()
    if name.lower().startswith("folder:"):
        sub = name.split(":", 1)[1].strip()
        if not sub or Path(sub).is_absolute() or ".." in Path(sub).parts:
            raise UnknownDataset(f"folder:NAME needs a directory name under the data root, got {name!r}")
        return f"folder:{sub}"
    key = name.lower().replace("-", "").replace("_", "")
    if key not in DATASETS:
        raise UnknownDataset(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}, folder:NAME "
                             f"or module.path:factory")
    return key


def datasets_in(root: str | os.PathLike[str]) -> list[str]:
    """The datasets whose torchvision files lie under `root` (mnist, cifar100, ...)."""
    base = Path(root).expanduser()
    return [name for name, marker in MARKERS.items() if (base / marker).exists()]


def dataset_for_data_dir(named: str | None, data_dir: str | None, *, default: str = "digits") -> str:
    """The dataset a command runs on, given the dataset it names (None: not named) and the
    `--data-dir` it was given (None: not given). An unnamed dataset under a given `--data-dir` is
    the one found there, so a documented command runs unchanged on other data by adding
    `--data-dir`; an offline dataset named beside `--data-dir` is refused, since the files there
    would be silently ignored."""
    if not data_dir:
        return named or default
    if named:
        if canonical_dataset(named) in OFFLINE:
            raise UsageError(offline_with_data_dir(f"dataset {named!r}", data_dir))
        return named
    found = datasets_in(data_dir)
    if len(found) == 1:
        return found[0]
    if found:
        raise UsageError(f"--data-dir {data_dir} holds {', '.join(found)}: name one (--dataset NAME or "
                         f"--set data.dataset=NAME; in fedmq sim, --scenario rotated-NAME)")
    raise UsageError(f"--data-dir {data_dir} holds {_none_here()}: put one there, or drop --data-dir to run on "
                     f"{default} (offline)")


def offline_with_data_dir(what: str, data_dir: str) -> str:
    """One line for a command that names an offline dataset (or scenario) beside `--data-dir`,
    whose files it would silently ignore."""
    found = datasets_in(data_dir)
    holds = ", ".join(found) if found else _none_here()
    return (f"{what} is made offline and reads nothing from --data-dir {data_dir}, which holds {holds}: "
            "name the dataset there (--dataset NAME or --set data.dataset=NAME; in fedmq sim, "
            "--scenario rotated-NAME), or drop --data-dir")


def _none_here() -> str:
    return ("none of the datasets fedmq reads (" + ", ".join(MARKERS.values())
            + " in torchvision's layout, docs/data.md)")
