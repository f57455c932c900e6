"""SGD and Adam as torch.optim computes them, without constructing a torch.optim.Optimizer.

Constructing any torch.optim.Optimizer imports torch._dynamo (its step and zero_grad are
wrapped to keep the compiler out): 2.0-2.4 s of CPU on this 2-core machine, paid by every
process that trains, at every start: an agent, an aggregator whose replies are fine-tuned, a
reply worker. That is more than a digits agent's whole local training. The update itself is
torch's own functional form (torch.optim.sgd.sgd, torch.optim.adam.adam) with torch's
defaults, so the trained vectors are the same bit for bit (tests/test_trainer.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim.adam import adam
from torch.optim.sgd import sgd


class _Optimizer:
    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = list(params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients to None, as torch.optim does by default (there is no zeroing in place)."""
        for p in self.params:
            p.grad = None


class SGD(_Optimizer):
    """torch.optim.SGD(params, lr, momentum, weight_decay): heavy ball, no dampening."""

    def __init__(self, params: Iterable[Tensor], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self._buffers: list[Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        buffers = [self._buffers[i] for i in live]
        sgd([self.params[i] for i in live], [self.params[i].grad for i in live], buffers,  # type: ignore[misc]
            weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0,
            nesterov=False, maximize=False)
        if self.momentum:
            for i, buf in zip(live, buffers, strict=True):
                self._buffers[i] = buf


class Adam(_Optimizer):
    """torch.optim.Adam(params, lr, weight_decay): betas (0.9, 0.999), eps 1e-8, no amsgrad."""

    def __init__(self, params: Iterable[Tensor], *, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self._state: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in live:
            if i not in self._state:
                p = self.params[i]
                self._state[i] = (torch.tensor(0.0, dtype=torch.float32),
                                  torch.zeros_like(p, memory_format=torch.preserve_format),
                                  torch.zeros_like(p, memory_format=torch.preserve_format))
        steps, avgs, sqs = (list(t) for t in zip(*(self._state[i] for i in live), strict=True)) if live else ([], [], [])
        adam([self.params[i] for i in live], [self.params[i].grad for i in live], avgs, sqs, [], steps,  # type: ignore[misc]
             has_complex=any(torch.is_complex(self.params[i]) for i in live), amsgrad=False, beta1=0.9,
             beta2=0.999, lr=self.lr, weight_decay=self.weight_decay, eps=1e-8, maximize=False)
