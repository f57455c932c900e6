"""A frozen backbone: the layers a fleet does not train stay out of every vector.

A model reference with `train=head` (or `train=PREFIX+PREFIX...`) trains, sends and
aggregates only the chosen layers; everything else is the backbone, fixed on every device and
on the server alike: from a weights file (`backbone=FILE`, the usual case: a network
pre-trained elsewhere and shipped with the device software) or, without one, the
architecture's seed-0 initialization (random features: for tests and benchmarks).

Freezing turns each backbone parameter into a non-persistent buffer, so the model's vector,
spec, codecs, replies and journal see the trained layers alone (fewer bytes, cheaper replies
and device training), while the forward pass and ONNX export are unchanged. Batch norm in the
backbone is held in eval mode: its statistics are part of the fixed function. Both sides must
hold the same backbone, so the spec's hash covers its content (`digest`), not its path.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

FROZEN_ATTR = "_fedmq_frozen"
"""Set on a frozen model: the names of its backbone tensors, in state-dict order."""


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The trailing run of `nn.Linear` layers among the modules that own parameters, in
    registration order (MobileNetV3: classifier.0 and classifier.3; a Sequential's last
    Linear): the classifier head."""
    owners = [(name, m) for name, m in model.named_modules()
              if next(m.parameters(recurse=False), None) is not None]
    first = len(owners)
    while first > 0 and isinstance(owners[first - 1][1], nn.Linear):
        first -= 1
    return tuple(name for name, _ in owners[first:])


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _FixedMode:
    """`train()` of a frozen norm layer: always eval, whatever the model asks."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, mode: bool = True) -> nn.Module:
        return nn.Module.train(self.module, False)


def freeze(model: nn.Module, train: str, what: str) -> tuple[str, ...]:
    """Freeze every layer of `model` but those `train` names ("head", or module-name prefixes
    joined by "+"), in place; returns the frozen tensors' names. ValueError naming `what`
    when a prefix matches no parameter or when nothing would be left to train or to freeze."""
    prefixes = head_prefixes(model) if train == "head" else tuple(p for p in train.split("+") if p)
    if not prefixes:
        raise ValueError(f"{what}: train={train} names no layer" + (" (the model has no linear head)"
                                                                    if train == "head" else ""))
    params = [name for name, _ in model.named_parameters()]
    for p in prefixes:
        if not any(_under(n, (p,)) for n in params):
            raise ValueError(f"{what}: train={train}: no parameter under {p!r}; the model's layers: "
                             + ", ".join(sorted({n.rsplit('.', 1)[0] for n in params})[:12]))
    frozen_params = [n for n in params if not _under(n, prefixes)]
    if not frozen_params:
        raise ValueError(f"{what}: train={train} leaves nothing frozen; drop train= to train every layer")
    modules = dict(model.named_modules())
    names: list[str] = []
    for full in frozen_params:
        owner, _, leaf = full.rpartition(".")
        module = modules[owner]
        tensor = module._parameters.pop(leaf).detach()
        module.register_buffer(leaf, tensor, persistent=False)
        names.append(full)
    for owner, module in modules.items():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not _under(owner, prefixes):
            for leaf in ("running_mean", "running_var", "num_batches_tracked"):
                tensor = module._buffers.get(leaf)
                if tensor is not None:
                    del module._buffers[leaf]
                    module.register_buffer(leaf, tensor, persistent=False)
                    if tensor.is_floating_point():
                        names.append(f"{owner}.{leaf}")
            module.train = _FixedMode(module)  # type: ignore[method-assign]
            module.eval()
    setattr(model, FROZEN_ATTR, tuple(names))
    return tuple(names)


def digest(model: nn.Module) -> str | None:
    """16 hex digits of SHA-256 over the frozen tensors' names, shapes and float32 bytes; None
    for a model with nothing frozen."""
    names = getattr(model, FROZEN_ATTR, None)
    if not names:
        return None
    tensors = dict(model.named_buffers())
    h = hashlib.sha256()
    for name in names:
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]
