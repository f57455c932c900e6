"""Models: the zoo, models by reference, and ModelSpec (a model travels as a flat float32 vector).

A ModelSpec names the architecture and lists the state's names, shapes and dtype; its hash
identifies it on the wire, so an update for another architecture is refused before any
tensor is touched.

A model is a zoo name (plain conv nets, state = parameters) or a reference
(`torchvision:mobilenet_v3_small?num_classes=10`, `mypkg.nets:make_model?width=16`,
docs/models.md). A referenced model's vector is its parameters followed by its floating-point
buffers (batch-norm running statistics): the statistics travel with the weights and are
averaged with them, as FedAvg over a state dict does, but no server-side gradient step
moves them (`ModelSpec.unflatten` detaches them); the server runs its models in eval mode,
so every proxy loss uses the statistics the devices measured.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fedmq.backbone import digest
from fedmq.dataset_names import canonical_dataset
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
    trainable: int | None = None
    """How many of `names` are parameters; the rest are running statistics (None: all)."""
    frozen: str | None = None
    """The frozen backbone's content digest (fedmq/backbone.py), None without one: the hash
    covers the backbone's weights, not the path of the file they came from."""

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def param_numel(self) -> int:
        """Values of the vector that are parameters: they come first, statistics after them."""
        return sum(math.prod(s) for s in self.shapes[:self.trainable])  # [:None]: all

    @property
    def statistics_numel(self) -> int:
        """Values of the vector that are running statistics (its tail): what a lossy codec
        sends as float32 (codec.exact_statistics)."""
        return self.numel - self.param_numel

    @property
    def head(self) -> tuple[int, int]:
        """[start, end) of the output layer (the last two parameters: its weight and bias)."""
        end = self.param_numel
        return end - sum(math.prod(s) for s in self.shapes[:self.trainable][-2:]), end

    @property
    def public_name(self) -> str:
        """`arch` as others see it: without the path of a backbone file (the hash covers its
        content), which is this machine's business."""
        return self.arch if self.frozen is None else str(replace(parse_reference(self.arch), backbone=""))

    @property
    def canonical_json(self) -> str:
        """The spec as JSON with sorted keys and no spaces: what `hash` digests, and what the
        aggregator's status advertises (docs/protocol.md), so a device can check the hash."""
        doc: dict[str, Any] = {
            "arch": self.public_name,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "dtype": self.dtype,
        }
        if self.trainable is not None:  # zoo specs (no statistics) keep their published hashes
            doc["trainable"] = self.trainable
        if self.frozen is not None:
            doc["frozen"] = self.frozen
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON of the spec."""
        return hashlib.sha256(self.canonical_json.encode()).hexdigest()[:16]

    def unflatten(self, vector: torch.Tensor, channels_last: bool = False) -> dict[str, torch.Tensor]:
        """Views of `vector` shaped as the named parameters (for torch.func.functional_call).

        Running statistics come detached: no gradient step moves them (batch norm in eval
        mode is not differentiable in them), so their entries of any gradient are 0; running
        variances come clamped at 0. `channels_last` (one vector, not a stack) gives 4-D
        weights as channels-last copies instead of views (`trains_channels_last`); gradients
        still reach `vector`."""
        if vector.shape[-1] != self.numel:
            raise ValueError(f"{self.arch}: vector has {vector.shape[-1]} values, spec has {self.numel}")
        out: dict[str, torch.Tensor] = {}
        offset = 0
        lead = vector.shape[:-1]
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            view = vector[..., offset : offset + n].reshape(*lead, *shape)
            if self.trainable is not None and len(out) >= self.trainable:
                view = view.detach()
                if name.endswith("running_var"):  # a lossy codec or a step may leave one below 0
                    view = view.clamp(min=0.0)
            if channels_last and not lead and len(shape) == 4:
                view = view.to(memory_format=torch.channels_last)
            out[name] = view
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
    """CNN for 32x32 colour images (CIFAR-100, SVHN): conv32-conv64-conv128-fc256.

    `width` and `hidden` shrink it for a device that trains in a browser:
    `fedmq.models:ColorCNN?width=16&hidden=64&num_classes=10` (90 k parameters, 64 head
    features) runs a 32x32 colour fleet's web page in seconds (docs/browser.md)."""

    def __init__(self, num_classes: int = 100, width: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 4 * width, 3, padding=1)
        self.fc1 = nn.Linear(4 * width * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv3(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut; a strided block's shortcut subsamples and pads
    channels with zeros (He et al.'s option A: the CIFAR ResNets' shortcuts hold no weights)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = norm(cout)
        self.stride, self.pad = stride, cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.stride != 1 or self.pad:
            shortcut = nn.functional.pad(x[:, :, ::self.stride, ::self.stride],
                                         (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return torch.relu(out + shortcut)


GROUPNORM_GROUPS = 4
"""Groups of resnet20-gn's GroupNorm layers: 4, 8 and 16 channels a group in the three stages."""


class ResNet20(nn.Module):
    """He et al.'s ResNet-20 for 32x32 colour images: a 3x3 stem, 3 stages of 3 basic blocks
    (16, 32, 64 channels), global average pooling and one linear layer (about 0.27 M
    parameters). `norm="group"` swaps batch norm for GroupNorm, which keeps no running
    statistics: nothing per device to average or keep local (Hsieh et al., 2020)."""

    def __init__(self, num_classes: int = 10, norm: str = "batch", in_channels: int = 3) -> None:
        super().__init__()
        if norm == "batch":
            make_norm: Callable[[int], nn.Module] = nn.BatchNorm2d
        elif norm == "group":
            make_norm = lambda c: nn.GroupNorm(GROUPNORM_GROUPS, c)  # noqa: E731
        else:
            raise ValueError(f"norm must be batch or group, got {norm!r}")
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn1 = make_norm(16)
        blocks: list[nn.Module] = []
        cin = 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(BasicBlock(cin, cout, stride if i == 0 else 1, make_norm))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)  # last: ModelSpec.head is its weight and bias
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(x.mean(dim=(2, 3)))


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
    "resnet20": ZooEntry(ResNet20, (3, 32, 32), 10),
    "resnet20-gn": ZooEntry(lambda n: ResNet20(n, norm="group"), (3, 32, 32), 10),
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
    "shapes": "cnn32-10",
    "shapeslit": "cnn32-10",
}


MODEL_HELP = ("a zoo name (" + ", ".join(ZOO) + "), auto, torchvision:NAME[?key=value&...] or "
              "module.path:factory[?key=value&...] (docs/models.md)")


@dataclass(frozen=True)
class ModelReference:
    """A model outside the zoo: a torchvision builder or a factory by import path, with its
    keyword arguments and the input shape it is fed (`input=CxHxW`)."""

    source: str
    """`torchvision` or the factory's import path `module.path:attr`."""
    name: str
    """The torchvision model name, or the factory's import path again."""
    kwargs: tuple[tuple[str, bool | int | float | str], ...]
    input_shape: tuple[int, ...] | None
    train: str = ""
    """`train=`: the layers the fleet trains and sends, "head" or module prefixes joined by
    "+"; the rest is a frozen backbone (fedmq/backbone.py). Empty: every layer."""
    backbone: str = ""
    """`backbone=FILE`: the whole model's weights (a state dict or a .f32 vector) the frozen
    layers take; empty: the architecture's seed-0 initialization."""
    bn_momentum: float | None = None
    """`bn_momentum=M`, in (0, 1]: every batch-norm layer's running-statistics momentum. None:
    the model's own (torchvision's MobileNetV3: 0.01; docs/models.md#batch-norm-what-travels-what-is-averaged-what-stays-local)."""

    def __str__(self) -> str:
        """The canonical form (keys sorted): what state files, specs and logs carry."""
        args = [(k, _format_value(v)) for k, v in self.kwargs]
        if self.input_shape is not None:
            args.append(("input", "x".join(map(str, self.input_shape))))
        args += [(k, v) for k, v in (("train", self.train), ("backbone", self.backbone)) if v]
        if self.bn_momentum is not None:
            args.append(("bn_momentum", _format_value(self.bn_momentum)))
        query = "&".join(f"{k}={v}" for k, v in sorted(args))
        head = f"torchvision:{self.name}" if self.source == "torchvision" else self.name
        return head + (f"?{query}" if query else "")

    def with_defaults(self, input_shape: tuple[int, ...], num_classes: int) -> ModelReference:
        """Fill what the dataset decides: the input shape, and torchvision's num_classes."""
        kwargs = dict(self.kwargs)
        if self.source == "torchvision":
            kwargs.setdefault("num_classes", num_classes)
        return ModelReference(self.source, self.name, tuple(sorted(kwargs.items())),
                              self.input_shape or tuple(input_shape), self.train, self.backbone,
                              self.bn_momentum)

    def whole(self) -> ModelReference:
        """The same model with every layer trained: what a backbone file holds weights for."""
        return ModelReference(self.source, self.name, self.kwargs, self.input_shape,
                              bn_momentum=self.bn_momentum)

    def build(self) -> nn.Module:
        if not self.train:
            return self._build_whole()
        from fedmq.backbone import freeze

        if self.backbone:
            model = load_vector(self._build_whole(), _backbone_vector(self.backbone, str(self.whole())))
        else:  # the same random features on every machine, whatever seed the caller forked
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = self._build_whole()
        try:
            freeze(model, self.train, f"model {self}")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return model

    def _build_whole(self) -> nn.Module:
        if self.source == "torchvision":
            from torchvision import models as tvm

            if self.name not in tvm.list_models():
                raise UsageError(f"torchvision has no model {self.name!r}; see torchvision.models.list_models()")
            try:  # weights=None: nothing is downloaded; the fleet trains from scratch
                model = tvm.get_model(self.name, weights=None, **dict(self.kwargs))
            except (TypeError, ValueError) as exc:
                raise UsageError(f"model {self}: torchvision refused its arguments: {exc}") from None
            if self.input_shape:
                _fit_stem(model, self.input_shape[0])
        else:
            factory = import_factory(self.name)
            try:
                model = factory(**dict(self.kwargs))
            except TypeError as exc:
                raise UsageError(f"model {self}: the factory refused its arguments: {exc}") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"model {self}: the factory returned {type(model).__name__}, not a torch nn.Module")
        if self.bn_momentum is not None:
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.momentum = self.bn_momentum
        return model


def _fit_stem(model: nn.Module, channels: int) -> None:
    """Give a torchvision model's first convolution the dataset's channel count (MNIST's one,
    where torchvision builds for RGB), as it would be written for such data: the model trains
    from scratch, so the stem has no weights to keep. Seeded by the caller's fork."""
    for name, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d):
            if conv.in_channels == channels or conv.in_channels != 3 or conv.groups != 1:
                return
            parent, _, attr = name.rpartition(".")
            stem = nn.Conv2d(channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                             conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode)
            setattr(model.get_submodule(parent) if parent else model, attr, stem)
            return


def _parse_value(text: str) -> bool | int | float | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _format_value(value: bool | int | float | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def is_reference(model: str) -> bool:
    """Whether `model` names a model outside the zoo (`torchvision:...` or `module:factory`)."""
    return ":" in model


def parse_reference(text: str) -> ModelReference:
    """`torchvision:NAME?k=v&...` or `module.path:factory?k=v&...`; UsageError if malformed."""
    head, _, query = text.strip().partition("?")
    kwargs: dict[str, bool | int | float | str] = {}
    frozen: dict[str, str] = {}
    input_shape = None
    bn_momentum: float | None = None
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise UsageError(f"model {text!r}: {item!r} is not key=value")
        if key in ("train", "backbone"):
            if not value:
                raise UsageError(f"model {text!r}: {key}= needs a value")
            frozen[key] = value
        elif key == "bn_momentum":
            try:
                momentum = float(value)
            except ValueError:
                momentum = -1.0
            if not 0.0 < momentum <= 1.0:
                raise UsageError(f"model {text!r}: bn_momentum must be in (0, 1], e.g. bn_momentum=0.1; got {value!r}")
            bn_momentum = momentum
        elif key == "input":
            try:
                input_shape = tuple(int(d) for d in value.lower().split("x"))
            except ValueError:
                input_shape = ()
            if not input_shape or min(input_shape) < 1:
                raise UsageError(f"model {text!r}: input must be CxHxW, e.g. input=3x32x32; got {value!r}")
        else:
            kwargs[key] = _parse_value(value)
    if "backbone" in frozen and "train" not in frozen:
        raise UsageError(f"model {text!r}: backbone= goes with train= (head, or the layers to train)")
    source, _, name = head.partition(":")
    if source == "torchvision":
        if not name.isidentifier():
            raise UsageError(f"model {text!r}: torchvision:NAME needs a model name, e.g. torchvision:resnet18")
        return ModelReference("torchvision", name, tuple(sorted(kwargs.items())), input_shape,
                              bn_momentum=bn_momentum, **frozen)
    if not all(part.isidentifier() for part in source.split(".")) or not name.isidentifier():
        raise UsageError(f"unknown model {text!r}; use {MODEL_HELP}")
    return ModelReference(head, head, tuple(sorted(kwargs.items())), input_shape,
                          bn_momentum=bn_momentum, **frozen)


def import_factory(path: str, what: str = "model") -> Callable[..., Any]:
    """`module.path:attr`, imported; the working directory is searched too (as uvicorn does),
    so a project's own `mypkg/nets.py` works from the console scripts."""
    module_name, _, attr = path.partition(":")
    top = module_name.split(".")[0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != top:  # the top-level package exists, maybe another one of that name
            where = getattr(sys.modules.get(top), "__path__", None)
            raise UsageError(f"{what} {path}: cannot import {module_name!r}: {exc}"
                             + (f" (the package {top!r} found is {list(where)[0]}: another package's?)"
                                if where else "")) from None
        if os.getcwd() in sys.path:
            raise UsageError(f"{what} {path}: cannot import {module_name!r}: {exc}") from None
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc2:
            raise UsageError(f"{what} {path}: cannot import {module_name!r} (searched the working directory "
                             f"too): {exc2}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{what} {path}: {module_name} has no callable {attr!r}")
    return factory


def resolve_model_name(model: str, dataset: str) -> str:
    """The model's canonical name: `auto` picks the zoo entry that fits the dataset, a
    reference gets the dataset's input shape (and torchvision its class count) unless it
    names them, and is built once to check it; an unknown name is a clear error."""
    if model == "auto" or is_reference(model):
        default = DEFAULT_MODEL_FOR_DATASET.get(_dataset_key(dataset))
        if model == "auto":
            if default is None:
                canonical_dataset(dataset)  # an unknown dataset is named as such, with the known ones
                # The commands that get here take the model by different flags (--model, --set
                # model=...), so the setting is named, not a flag one of them would refuse.
                raise UsageError(f"dataset {dataset!r} has no default model until its images are read "
                                 f"(fedmq sim run reads them, docs/data.md); name the model: {MODEL_HELP}")
            return default
        ref = parse_reference(model)
        if default is not None:
            ref = ref.with_defaults(ZOO[default].input_shape, ZOO[default].num_classes)
        elif ref.input_shape is None:
            raise UsageError(f"model {model!r}: dataset {dataset!r} has no known image shape; add "
                             f"input=CxHxW to the model, e.g. {model}{'&' if '?' in model else '?'}input=3x32x32")
        name = str(ref)
        from fedmq.protocol import MAX_MODEL_NAME

        if len(name) > MAX_MODEL_NAME:  # the aggregator's status carries it
            raise UsageError(f"model {model!r}: its canonical name {name[:40]}... has {len(name)} "
                             f"characters, more than the {MAX_MODEL_NAME} the protocol carries")
        model_spec(name)  # builds it once: a bad reference stops here, with one line
        return name
    if model not in ZOO:
        raise UsageError(f"unknown model {model!r}; use {MODEL_HELP}")
    return _zoo_for_dataset(model, dataset)


def has_default_model(dataset: str) -> bool:
    """Whether `auto` knows the dataset's model by its name; a folder's or a factory's needs its
    images (`model_for_images`)."""
    return _dataset_key(dataset) in DEFAULT_MODEL_FOR_DATASET


def _dataset_key(dataset: str) -> str:
    return dataset if dataset in DEFAULT_MODEL_FOR_DATASET else dataset.lower().replace("-", "").replace("_", "")


RESHAPEABLE = {"resnet20": "batch", "resnet20-gn": "group"}
"""Zoo models that any image shape fits (convolutions and a global pool): on a dataset of other
channels or classes they are built for it, by reference (`fedmq.models:ResNet20?...`)."""


def _zoo_for_dataset(model: str, dataset: str) -> str:
    """A zoo name on a dataset of its shape and class count, as it is; a ResNet-20 on another
    (MNIST's 1x28x28) as the same network built for it; another zoo model there is one clear
    error, not a failed first training step. A dataset of unknown shape (a folder) is the user's
    here; `model_for_images` fits it once its images are read."""
    default = DEFAULT_MODEL_FOR_DATASET.get(_dataset_key(dataset))
    if default is None:
        return model
    return _zoo_fitted(model, ZOO[default].input_shape, ZOO[default].num_classes, dataset, default)


def _zoo_fitted(model: str, shape: tuple[int, ...], classes: int, dataset: str, default: str,
                spare_outputs: bool = False) -> str:
    """Zoo model `model` for images of `shape` in `classes` classes: itself where it takes that
    shape and class count (or, with `spare_outputs`, more classes: a folder's 5 classes train
    under cnn28's 10 outputs, whose spare ones are never a label), a ResNet-20 built for them,
    else one line naming `default`, the model auto picks there."""
    entry = ZOO[model]
    if (entry.input_shape, entry.num_classes) == (tuple(shape), classes):
        return model
    if model in RESHAPEABLE:
        name = _resnet20_for(shape, classes, RESHAPEABLE[model])
        model_spec(name)
        return name
    if spare_outputs and entry.input_shape == tuple(shape) and entry.num_classes > classes:
        return model  # outputs no label asks for are trained down, never predicted
    raise UsageError(f"model {model} takes {'x'.join(map(str, entry.input_shape))} inputs of "
                     f"{entry.num_classes} classes; {dataset} has {'x'.join(map(str, shape))} of {classes}: "
                     f"model auto ({default}), resnet20-gn or a torchvision model fits it")


def _resnet20_for(shape: tuple[int, ...], classes: int, norm: str) -> str:
    return str(ModelReference("fedmq.models:ResNet20", "fedmq.models:ResNet20",
                              (("in_channels", shape[0]), ("norm", norm), ("num_classes", classes)), tuple(shape)))


def default_model_for_images(shape: tuple[int, ...], classes: int) -> str:
    """What `auto` picks for images of `shape` (C, H, W) in `classes` classes, where the dataset
    is known only by its files (folder:NAME, a factory): the zoo's default of that shape and
    class count (cnn28 for 1x28x28 in 10); the zoo's small CNN written for that shape, built
    for the class count (`fedmq.models:ReferenceCNN?input=1x28x28&num_classes=5`); else
    ResNet-20 with GroupNorm built for them, which fits any size (convolutions and a global
    pool) and keeps no statistics to average."""
    shape = tuple(int(d) for d in shape)
    for name in dict.fromkeys(DEFAULT_MODEL_FOR_DATASET.values()):  # the zoo's small CNNs, in order
        entry = ZOO[name]
        if entry.input_shape == shape and entry.num_classes == classes:
            return name
    for name in dict.fromkeys(DEFAULT_MODEL_FOR_DATASET.values()):
        entry = ZOO[name]
        if entry.input_shape == shape and isinstance(entry.factory, type):
            return str(ModelReference(f"fedmq.models:{entry.factory.__name__}", f"fedmq.models:{entry.factory.__name__}",
                                      (("num_classes", classes),), shape))
    return _resnet20_for(shape, classes, "group")


def model_for_images(model: str, dataset: str, shape: tuple[int, ...], classes: int) -> str:
    """`model` on a dataset whose images were read: `auto` is `default_model_for_images` where
    the dataset has no default of its own, a zoo model is fitted to the images as on a named
    dataset, a reference gets their shape (and torchvision the class count) unless it names
    them. What `resolve_model_name(result, dataset)` gives back unchanged."""
    if has_default_model(dataset):
        return resolve_model_name(model, dataset)
    if model == "auto":
        return default_model_for_images(shape, classes)
    if model in ZOO:
        return _zoo_fitted(model, shape, classes, dataset, default_model_for_images(shape, classes), spare_outputs=True)
    if is_reference(model):
        return resolve_model_name(str(parse_reference(model).with_defaults(tuple(shape), classes)), dataset)
    return resolve_model_name(model, dataset)  # an unknown name: its error


def resolve_dataset_and_model(dataset: str, model: str) -> dict[str, str | int]:
    """What `--dry-run` checks and shows: the dataset's key, the model and its parameter count.

    Raises UsageError for an unknown dataset or model, as a real start would (without
    loading any data; a referenced model is built once)."""
    key = canonical_dataset(dataset)
    name = resolve_model_name(model, dataset)
    spec = model_spec(name)
    out: dict[str, str | int] = {"dataset": key, "model": name, "parameters": spec.param_numel}
    if spec.param_numel < spec.numel:
        out["statistics"] = spec.numel - spec.param_numel
    return out


def build_model(name: str, seed: int | None = None) -> nn.Module:
    """A fresh model (zoo name or canonical reference); `seed` makes its initial weights reproducible."""
    if name in ZOO:
        entry = ZOO[name]
        make: Callable[[], nn.Module] = lambda: entry.factory(entry.num_classes)  # noqa: E731
    elif is_reference(name):
        make = parse_reference(name).build
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(ZOO))} or a reference")
    if seed is None:
        return make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) of what a vector holds: the parameters, then the
    floating-point buffers the state dict keeps (batch-norm running means and variances;
    an integer `num_batches_tracked` stays local: it only matters with momentum=None)."""
    out = [(n, p, True) for n, p in model.named_parameters()]
    persistent = model.state_dict(keep_vars=True).keys()
    out += [(n, b, False) for n, b in model.named_buffers() if n in persistent and b.is_floating_point()]
    return out


def spec_of(model: nn.Module, arch: str) -> ModelSpec:
    """The spec of `model` (built as `arch`): the zoo's shapes, or for a reference the input
    shape it names and the class count one forward pass shows."""
    tensors = state_tensors(model)
    names = tuple(n for n, _, _ in tensors)
    shapes = tuple(tuple(t.shape) for _, t, _ in tensors)
    params = sum(1 for _, _, is_param in tensors if is_param)
    if arch in ZOO:
        entry = ZOO[arch]
        return ModelSpec(arch, names, shapes, entry.input_shape, entry.num_classes,
                         trainable=None if params == len(names) else params)
    ref = parse_reference(arch)
    if ref.input_shape is None:
        raise UsageError(f"model {arch!r} names no input shape; add input=CxHxW")
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(2, *ref.input_shape))
    except Exception as exc:  # any failure of a user's forward is that model's problem, said in one line
        raise UsageError(f"model {arch}: a forward pass on inputs (N, {', '.join(map(str, ref.input_shape))}) "
                         f"failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise UsageError(f"model {arch}: forward must return logits (N, classes), got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    return ModelSpec(arch, names, shapes, ref.input_shape, int(out.shape[1]), trainable=params, frozen=digest(model))


_SPEC_CACHE: dict[str, ModelSpec] = {}


def model_spec(name: str) -> ModelSpec:
    """The spec of a model by name (cached; built once)."""
    if name not in _SPEC_CACHE:
        _SPEC_CACHE[name] = spec_of(build_model(name, seed=0), name)
    return _SPEC_CACHE[name]


def trains_channels_last(device: torch.device | str) -> bool:
    """Whether training and scoring on `device` lay 4-D weights out channels-last (NHWC).

    On a CPU, oneDNN's convolutions and max pooling run faster that way. One thread, 2-core
    AMD EPYC (`python -m bench layout`, docs/models.md#memory-layout-of-training-and-scoring):
    an SGD step of cnn28 1.6-1.7x faster, digits-cnn 1.2-1.4x, cnn32 and ResNet-20 1.1-1.3x,
    ResNet-20-GN and MobileNetV3-small level; a forward pass 1.2x (ResNet-20-GN) to 5.4x
    (MobileNetV3-small). Other devices keep torch's default layout (not measured here). The
    result is the same either way: only the arithmetic's order, so the last bits, differ."""
    return torch.device(device).type == "cpu"


def to_vector(model: nn.Module) -> torch.Tensor:
    """The model's state (parameters, then running statistics) as one detached float32 CPU vector."""
    return torch.cat([t.detach().reshape(-1).float().cpu() for _, t, _ in state_tensors(model)])


def load_vector(model: nn.Module, vector: torch.Tensor) -> nn.Module:
    """Copy a flat vector into the model's state in place; shape-checked."""
    named = state_tensors(model)
    total = sum(t.numel() for _, t, _ in named)
    if vector.ndim != 1 or vector.numel() != total:
        raise ValueError(f"vector of shape {tuple(vector.shape)} does not fit a model of {total} values")
    offset = 0
    with torch.no_grad():
        for name, t, is_param in named:
            n = t.numel()
            t.copy_(vector[offset : offset + n].view_as(t).to(t.dtype))
            if not is_param and name.endswith("running_var"):
                t.clamp_(min=0.0)  # as ModelSpec.unflatten: a lossy codec may leave one below 0
            offset += n
    return model


_BACKBONES: dict[tuple[str, str, int, int], torch.Tensor] = {}


def _backbone_vector(path: str, whole: str) -> torch.Tensor:
    """The backbone file as the whole model's vector, read and checked once per file version
    (every build of the model reads it)."""
    try:
        st = os.stat(path)
    except OSError:
        return load_init_vector(path, whole, "backbone")  # says what is wrong with the path
    key = (os.path.abspath(path), whole, st.st_mtime_ns, st.st_size)
    if key not in _BACKBONES:
        _BACKBONES[key] = load_init_vector(path, whole, "backbone")
    return _BACKBONES[key]


INIT_VECTOR_SUFFIX = ".f32"
"""A starting checkpoint with this suffix is the model's vector itself: its values as raw
little-endian float32, parameters then statistics (`to_vector(model).numpy().tofile(path)`)."""


def load_init_vector(path: str | os.PathLike[str], name: str, role: str = "init weights") -> torch.Tensor:
    """A user's pre-trained weights for model `name`, as its vector: a torch state dict
    (`torch.save(model.state_dict(), "w.pt")`; a checkpoint holding one under "state_dict"
    too) or the raw vector (INIT_VECTOR_SUFFIX). Read with `weights_only=True`: a file
    runs no code. UsageError naming the file and the first key that does not fit: a
    missing, unexpected or misshapen tensor, or one holding NaN or inf."""
    import numpy as np

    spec = model_spec(name)
    where = f"{role} {os.fspath(path)}"
    if not os.path.isfile(path):
        raise UsageError(f"{where}: no such file")
    if os.fspath(path).endswith(INIT_VECTOR_SUFFIX):
        size = os.path.getsize(path)
        if size != 4 * spec.numel:
            raise UsageError(f"{where}: {size} bytes, not the {spec.numel} float32 values of model {name}")
        vector = torch.from_numpy(np.fromfile(path, dtype="<f4").astype(np.float32))
        if not torch.isfinite(vector).all():
            raise UsageError(f"{where}: value {int((~torch.isfinite(vector)).nonzero()[0])} is NaN or inf")
        return vector
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file is the user's to fix, said in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{where}: not a torch state dict ({first}); save one with "
                         f"torch.save(model.state_dict(), PATH), or the vector as {INIT_VECTOR_SUFFIX}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise UsageError(f"{where}: holds a {type(state).__name__}, not a state dict (name -> tensor)")
    model = build_model(name)  # its other tensors: integer buffers (num_batches_tracked), a frozen backbone
    local = (set(model.state_dict()) | {n for n, _ in model.named_buffers()}) - set(spec.names)
    for key in state:
        if key not in spec.names and key not in local:
            raise UsageError(f"{where}: unexpected key {key!r}: model {name} has no such tensor")
    parts = []
    for key, shape in zip(spec.names, spec.shapes, strict=True):
        if key not in state:
            raise UsageError(f"{where}: missing key {key!r} of model {name}")
        value = state[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UsageError(f"{where}: key {key!r} is {got}, model {name} needs {shape}")
        if not torch.isfinite(value).all():
            raise UsageError(f"{where}: key {key!r} holds NaN or inf")
        parts.append(value.detach().reshape(-1).float())
    return torch.cat(parts)


def batch_norm_index(name: str) -> torch.Tensor:
    """Positions in model `name`'s vector of its batch-norm layers' weights, biases and
    running statistics: what a FedBN device keeps as its own (agent.keep_local_bn). Empty
    for a model without batch norm (GroupNorm keeps nothing per device)."""
    if name not in _BN_INDEX:
        spec = model_spec(name)
        own = {f"{module}.{field}" for module, m in build_model(name).named_modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm)
               for field in ("weight", "bias", "running_mean", "running_var")}
        positions: list[torch.Tensor] = []
        offset = 0
        for key, shape in zip(spec.names, spec.shapes, strict=True):
            n = math.prod(shape)
            if key in own:
                positions.append(torch.arange(offset, offset + n))
            offset += n
        _BN_INDEX[name] = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    return _BN_INDEX[name]


_BN_INDEX: dict[str, torch.Tensor] = {}
