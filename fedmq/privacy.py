"""Differential privacy for what an agent sends: its trained model and its data sketch.

Both mechanisms run on the device before anything leaves it (the broker and the aggregator
are not trusted with the data). They are accounted per agent over its lifetime by Opacus' RDP
accountant, against the budget `privacy.epsilon` at `privacy.delta`, for record-level
adjacency: one sample of the device's data changed.

- **Model: DP-SGD.** Each mini-batch's per-sample gradients are clipped to L2 norm `clip`
  and summed, and N(0, (sigma clip)^2) is added before averaging (`DpSgd`, used by
  fedmq.training.fit). Per step this is the subsampled Gaussian mechanism at sample rate
  B / n. Clip-and-noise of the whole step would protect the device's data as a whole, but
  its noise is sigma 2 clip on every one of P values against a signal of at most clip in
  all; a single personalized reply cannot average that away (a digits fleet's first noisy
  upload gave a NaN reply, which the aggregator refused and rolled back).
- **Sketch: the Gaussian mechanism.** The sketch is the mean of n features, each in
  [-1, 1] (cosines, fedmq/sketch.py). One sample replaced moves it by at most
  2 sqrt(D) / n in L2, so N(0, (sigma_s 2 sqrt(D) / n)^2) is added to every feature. The
  result is clipped back to [-1, 1], which is post-processing.

With DP on, the accuracy figures and FedSoft's own mixture estimate are not sent: they are
computed from the data with no noise. A resent upload (after a restart or a lost reply)
is the same bytes, so nothing more is spent. Batch-norm models are refused: per-sample
gradients are not defined when batch norm mixes the samples of a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedmq.errors import RuntimeFailure

Step = tuple[float, float, int]
"""(noise multiplier, sample rate, steps): one entry of Opacus' accountant history."""


class BudgetSpent(RuntimeFailure):
    """One more upload would take the agent past its privacy budget."""


@dataclass(frozen=True)
class DpSgd:
    """DP-SGD's knobs for one training run: per-sample clip, noise multiplier, noise seed."""

    clip: float
    noise_multiplier: float
    seed: int


@dataclass
class UplinkPrivacy:
    """The agent's DP mechanisms and its lifetime accountant; `history` is what is saved."""

    epsilon: float
    """Budget; 0 = DP off."""
    delta: float = 1e-5
    clip: float = 1.0
    noise_multiplier: float = 1.0
    sketch_noise_multiplier: float = 1.0
    seed: int | None = None
    """Sketch noise seed (None: fresh entropy; tests fix it)."""
    history: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.epsilon < 0 or not 0 < self.delta < 1 or self.clip <= 0:
            raise ValueError(f"need epsilon >= 0, 0 < delta < 1, clip > 0; got {self.epsilon}, {self.delta}, {self.clip}")
        if self.enabled and (self.noise_multiplier <= 0 or self.sketch_noise_multiplier <= 0):
            raise ValueError("with DP on (privacy.epsilon > 0) both noise multipliers must be > 0")
        self._rng = np.random.default_rng(self.seed)

    @property
    def enabled(self) -> bool:
        return self.epsilon > 0

    def spent(self, extra: list[Step] | None = None) -> float:
        """Epsilon spent so far (with `extra`: as if those releases happened too)."""
        from opacus.accountants import RDPAccountant

        accountant = RDPAccountant()
        accountant.history = list(self.history) + list(extra or [])
        if not accountant.history:
            return 0.0
        return float(accountant.get_epsilon(self.delta))

    def training(self, n: int, batch_size: int, steps: int) -> list[Step]:
        """DP-SGD's releases: `steps` mini-batches of `batch_size` out of n samples."""
        return [(self.noise_multiplier, min(1.0, batch_size / n), steps)] if steps > 0 else []

    def sketch_release(self) -> list[Step]:
        return [(self.sketch_noise_multiplier, 1.0, 1)]

    def check(self, planned: list[Step]) -> None:
        """BudgetSpent if the `planned` releases would take epsilon past the budget."""
        after = self.spent(planned)
        if after > self.epsilon:
            raise BudgetSpent(f"privacy budget spent: epsilon {self.spent():.3g} of {self.epsilon:g} "
                              f"(delta {self.delta:g}); one more upload would make it {after:.3g}")

    def spend(self, releases: list[Step]) -> None:
        self.history.extend(releases)

    def sgd(self, seed: int) -> DpSgd:
        return DpSgd(self.clip, self.noise_multiplier, seed)

    def sketch(self, summary: np.ndarray, n: int) -> np.ndarray:
        """The sketch of n samples plus its noise, clipped to [-1, 1] as every sketch is."""
        if n < 1:
            raise ValueError("a sketch of no samples")
        scale = self.sketch_noise_multiplier * 2 * math.sqrt(summary.size) / n
        noisy = summary.astype(np.float64) + self._rng.normal(0.0, scale, summary.size)
        return np.clip(noisy, -1.0, 1.0).astype(np.float32)

    def state_dict(self) -> list[list[float]]:
        return [[m, q, s] for m, q, s in self.history]

    def load_state_dict(self, history: list[list[float]]) -> None:
        self.history = [(float(m), float(q), int(s)) for m, q, s in history]


def private_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dp: DpSgd,
                      generator: torch.Generator) -> torch.Tensor:
    """Mean cross-entropy of the batch, with each parameter's .grad set to DP-SGD's
    (sum of per-sample gradients clipped to dp.clip + N(0, (sigma clip)^2)) / batch size."""
    from torch.func import functional_call, grad_and_value, vmap

    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_of(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_sample, losses = vmap(grad_and_value(loss_of), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per_sample.values()], dim=1)
    scale = (dp.clip / (flat.norm(dim=1) + 1e-12)).clamp(max=1.0)
    total = (flat * scale[:, None]).sum(0)
    total += torch.randn(total.shape, generator=generator) * (dp.noise_multiplier * dp.clip)
    total /= len(x)
    offset = 0
    for _, p in model.named_parameters():
        p.grad = total[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return losses.mean().detach()
