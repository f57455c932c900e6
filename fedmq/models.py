"""The model zoo and ModelSpec: a model travels as a flat float32 vector plus its spec.

A ModelSpec names the architecture and lists parameter names, shapes and dtype; its hash
identifies it on the wire, so an update for another architecture is refused before any
tensor is touched. The zoo holds plain conv nets with no BatchNorm, so a model's state is
its parameters alone and a parameter-space mixture of models is well defined.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.errors import UsageError


@dataclass(frozen=True)
class ModelSpec:
    """What a flat vector means: architecture, parameter layout, input and output shape."""

    arch: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    input_shape: tuple[int, ...]
    num_classes: int
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def canonical_json(self) -> str:
        """The spec as JSON with sorted keys and no spaces: what `hash` digests, and what the
        aggregator's status advertises (docs/protocol.md), so a device can check the hash."""
        doc = {
            "arch": self.arch,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "dtype": self.dtype,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON of the spec."""
        return hashlib.sha256(self.canonical_json.encode()).hexdigest()[:16]

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `vector` shaped as the named parameters (for torch.func.functional_call)."""
        if vector.shape[-1] != self.numel:
            raise ValueError(f"{self.arch}: vector has {vector.shape[-1]} values, spec has {self.numel}")
        out: dict[str, torch.Tensor] = {}
        offset = 0
        lead = vector.shape[:-1]
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            out[name] = vector[..., offset : offset + n].reshape(*lead, *shape)
            offset += n
        return out


class DigitsNet(nn.Module):
    """Small CNN for scikit-learn's 8x8 digits (about 14 k parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class ReferenceCNN(nn.Module):
    """The reference CNN for 28x28 grayscale: conv16-conv32-fc64 (about 106 k parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class ColorCNN(nn.Module):
    """CNN for 32x32 colour images (CIFAR-100, SVHN): conv32-conv64-conv128-fc256."""

    def __init__(self, num_classes: int = 100) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.fc1 = nn.Linear(128 * 4 * 4, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv3(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@dataclass(frozen=True)
class ZooEntry:
    factory: Callable[[int], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int


ZOO: dict[str, ZooEntry] = {
    "digits-cnn": ZooEntry(DigitsNet, (1, 8, 8), 10),
    "cnn28": ZooEntry(ReferenceCNN, (1, 28, 28), 10),
    "cnn32": ZooEntry(ColorCNN, (3, 32, 32), 100),
    "cnn32-10": ZooEntry(ColorCNN, (3, 32, 32), 10),
}

DEFAULT_MODEL_FOR_DATASET = {
    "digits": "digits-cnn",
    "synthetic": "digits-cnn",
    "digits-domains": "cnn28",
    "mnist": "cnn28",
    "fashionmnist": "cnn28",
    "usps": "cnn28",
    "svhn": "cnn32-10",
    "cifar10": "cnn32-10",
    "cifar100": "cnn32",
}


def resolve_model_name(model: str, dataset: str) -> str:
    """`auto` picks the zoo entry that fits the dataset; an unknown name is a clear error."""
    if model == "auto":
        try:
            return DEFAULT_MODEL_FOR_DATASET[dataset.lower().replace("-", "").replace("_", "")
                                             if dataset not in DEFAULT_MODEL_FOR_DATASET else dataset]
        except KeyError:
            raise UsageError(f"no default model for dataset {dataset!r}; pass --model, one of "
                             f"{', '.join(sorted(ZOO))}") from None
    if model not in ZOO:
        raise UsageError(f"unknown model {model!r}; use one of {', '.join(sorted(ZOO))} (or auto)")
    return model


def resolve_dataset_and_model(dataset: str, model: str) -> dict[str, str | int]:
    """What `--dry-run` checks and shows: the dataset's key, the zoo model and its parameter count.

    Raises UsageError for an unknown dataset or model, as a real start would (without
    loading any data)."""
    from fedmq.data.sources import canonical_dataset

    key = canonical_dataset(dataset)
    name = resolve_model_name(model, dataset)
    return {"dataset": key, "model": name, "parameters": model_spec(name).numel}


def build_model(name: str, seed: int | None = None) -> nn.Module:
    """A fresh model from the zoo; `seed` makes its initial weights reproducible."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(ZOO))}")
    entry = ZOO[name]
    if seed is None:
        return entry.factory(entry.num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return entry.factory(entry.num_classes)


def spec_of(model: nn.Module, arch: str) -> ModelSpec:
    entry = ZOO[arch]
    names, shapes = [], []
    for name, p in model.named_parameters():
        names.append(name)
        shapes.append(tuple(p.shape))
    return ModelSpec(arch, tuple(names), tuple(shapes), entry.input_shape, entry.num_classes)


_SPEC_CACHE: dict[str, ModelSpec] = {}


def model_spec(name: str) -> ModelSpec:
    """The spec of a zoo model (cached; building the model once is cheap)."""
    if name not in _SPEC_CACHE:
        _SPEC_CACHE[name] = spec_of(build_model(name, seed=0), name)
    return _SPEC_CACHE[name]


def to_vector(model: nn.Module) -> torch.Tensor:
    """All parameters, in named_parameters order, as one detached float32 CPU vector."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def load_vector(model: nn.Module, vector: torch.Tensor) -> nn.Module:
    """Copy a flat vector into the model's parameters in place; shape-checked."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if vector.ndim != 1 or vector.numel() != total:
        raise ValueError(f"vector of shape {tuple(vector.shape)} does not fit a model of {total} values")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(vector[offset : offset + n].view_as(p).to(p.dtype))
            offset += n
    return model
