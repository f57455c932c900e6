"""Differential privacy for what an agent sends: its trained model, its data sketch and
FedSoft-Async's mixture estimate.

All mechanisms run on the device before anything leaves it (the broker and the aggregator
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
- **FedSoft-Async's alpha: the Gaussian mechanism on the argmin counts** (`release_alpha`).
  The agent trains from the released (noisy) mixture, so DP-SGD's start is data-independent
  given what was released.

`plan_noise` turns a budget into noise: the common multiplier with which U uploads fit
(privacy.uploads). With DP on, the accuracy figures are not sent: they are computed from
the data with no noise. A resent upload (after a restart or a lost reply)
is the same bytes, so nothing more is spent. Batch-norm models are refused: per-sample
gradients are not defined when batch norm mixes the samples of a batch.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from fedmq.errors import RuntimeFailure

if TYPE_CHECKING:  # torch is imported where gradients are made: `fedmq privacy plan` needs none of it
    import torch

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
    alpha_noise_multiplier: float = 1.0
    batch_size: int = 0
    """DP-SGD's batch (0: the agent's): its noise on the mean gradient is sigma clip / B."""
    seed: int | None = None
    """Sketch noise seed (None: fresh entropy; tests fix it)."""
    history: list[Step] = field(default_factory=list)
    released_alpha: list[float] | None = field(default=None, compare=False)
    """The last mixture estimate `release_alpha` noised: the only alpha an upload may carry with DP on."""

    def __post_init__(self) -> None:
        if self.epsilon < 0 or not 0 < self.delta < 1 or self.clip <= 0:
            raise ValueError(f"need epsilon >= 0, 0 < delta < 1, clip > 0; got {self.epsilon}, {self.delta}, {self.clip}")
        if self.enabled and min(self.noise_multiplier, self.sketch_noise_multiplier,
                                self.alpha_noise_multiplier) <= 0:
            raise ValueError("with DP on (privacy.epsilon > 0) every noise multiplier must be > 0")
        self._rng = np.random.default_rng(self.seed)

    @property
    def enabled(self) -> bool:
        return self.epsilon > 0

    def spent(self, extra: list[Step] | None = None) -> float:
        """Epsilon spent so far (with `extra`: as if those releases happened too)."""
        return epsilon_of(list(self.history) + list(extra or []), self.delta)

    def batch(self, agent_batch: int) -> int:
        """The batch DP-SGD trains with, given the agent's own (agent.batch_size)."""
        return self.batch_size or agent_batch

    def training(self, n: int, batch_size: int, steps: int) -> list[Step]:
        """DP-SGD's releases: `steps` mini-batches of `batch_size` out of n samples."""
        return [(self.noise_multiplier, min(1.0, batch_size / n), steps)] if steps > 0 else []

    def sketch_release(self) -> list[Step]:
        return [(self.sketch_noise_multiplier, 1.0, 1)]

    def alpha_release(self) -> list[Step]:
        return [(self.alpha_noise_multiplier, 1.0, 1)]

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

    def upload_releases(self, n: int, batch_size: int, epochs: int, *, sketch: bool, alpha: bool) -> list[Step]:
        """What one upload of n samples charges: DP-SGD's epochs x ceil(n / B) steps (B the
        batch it trains with), the sketch (CDFL) and the mixture estimate (FedSoft-Async)."""
        return (self.training(n, batch_size, epochs * max(1, math.ceil(n / batch_size)))
                + (self.sketch_release() if sketch else []) + (self.alpha_release() if alpha else []))

    def planned(self, *, n: int, uploads: int, batch_size: int, epochs: int, sketch: bool,
                alpha: bool) -> UplinkPrivacy:
        """A copy whose three noise multipliers are `plan_noise`'s: `uploads` uploads of at
        least n samples each fit in the budget (privacy.uploads)."""
        sigma = plan_noise(self.epsilon, self.delta, n=n, uploads=uploads, batch_size=self.batch(batch_size),
                           epochs=epochs, sketch=sketch, alpha=alpha)
        return replace(self, noise_multiplier=sigma, sketch_noise_multiplier=sigma,
                       alpha_noise_multiplier=sigma, history=list(self.history))

    def release_sketch(self, summary: np.ndarray, n: int) -> np.ndarray:
        """The sketch of n samples as it may leave the device: charged, then noised
        (BudgetSpent, and nothing charged, if that would take epsilon past the budget)."""
        self.check(self.sketch_release())
        noisy = self.sketch(summary, n)
        self.spend(self.sketch_release())
        return noisy

    def release_alpha(self, shares: list[float], n: int) -> list[float]:
        """FedSoft's mixture estimate (each cluster's share of the n samples on which its model
        has the lowest loss) as it may leave the device, charged like `release_sketch`.

        One sample replaced moves one count down and another up: sqrt(2) in L2. N(0,
        (sigma_a sqrt 2)^2) is added to each count, negatives are cut to 0 and the rest
        normalized (post-processing). The agent's training then starts from this released
        mixture, so its start depends on the data only through what DP released."""
        self.check(self.alpha_release())
        released = self.noisy_alpha(shares, n)
        self.spend(self.alpha_release())
        self.released_alpha = released
        return released

    def noisy_alpha(self, shares: list[float], n: int) -> list[float]:
        """`release_alpha`'s mechanism alone, uncharged."""
        counts = np.asarray(shares, dtype=np.float64) * n
        noise = self._rng.normal(0.0, self.alpha_noise_multiplier * math.sqrt(2.0), counts.size)
        noisy = np.clip(counts + noise, 0.0, None)
        total = noisy.sum()
        return [float(v) for v in (noisy / total if total > 0 else np.full(counts.size, 1.0 / counts.size))]

    def state_dict(self) -> list[list[float]]:
        return [[m, q, s] for m, q, s in self.history]

    def load_state_dict(self, history: list[list[float]]) -> None:
        self.history = [(float(m), float(q), int(s)) for m, q, s in history]


RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
"""The Renyi orders Opacus' RDPAccountant uses (its DEFAULT_ALPHAS; tests/test_privacy.py checks)."""


@lru_cache(maxsize=1)
def _opacus_rdp() -> ModuleType:
    """Opacus' RDP analysis (opacus/accountants/analysis/rdp.py, numpy and scipy only), loaded
    from its file: `import opacus` runs the package's __init__, which imports its optimizers
    and torch.distributed's tensors, 2-4 s of CPU here for two pure functions (in every agent
    with DP on, and in every `fedmq privacy plan`)."""
    found = importlib.util.find_spec("opacus")
    if found is None or not found.submodule_search_locations:
        raise RuntimeFailure("privacy accounting needs Opacus: pip install opacus")
    path = Path(list(found.submodule_search_locations)[0]) / "accountants" / "analysis" / "rdp.py"
    spec = importlib.util.spec_from_file_location("fedmq_opacus_rdp", path)
    if spec is None or spec.loader is None:
        raise RuntimeFailure(f"Opacus has no RDP analysis at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1024)
def _rdp_per_step(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    return tuple(_opacus_rdp().compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                           orders=RDP_ORDERS))


def epsilon_of(history: list[Step], delta: float) -> float:
    """What Opacus' RDPAccountant.get_epsilon says for this history, computed once per
    (multiplier, sample rate): RDP is linear in the steps, so entries that repeat one
    mechanism add up. The accountant recomputes each entry (a plan's bisection took 24 s)."""
    if not history:
        return 0.0
    steps: dict[tuple[float, float], int] = {}
    for multiplier, rate, n in history:
        steps[(float(multiplier), float(rate))] = steps.get((float(multiplier), float(rate)), 0) + int(n)
    total = sum(np.asarray(_rdp_per_step(rate, m)) * n for (m, rate), n in steps.items())
    eps, _ = _opacus_rdp().get_privacy_spent(orders=RDP_ORDERS, rdp=total, delta=delta)
    return float(eps)


def upload_releases(noise_multiplier: float, n: int, batch_size: int, epochs: int, *, sketch: bool = True,
                    alpha: bool = False) -> list[Step]:
    """One upload's releases with every mechanism at `noise_multiplier`."""
    sigma = noise_multiplier
    return UplinkPrivacy(1.0, noise_multiplier=sigma, sketch_noise_multiplier=sigma,
                         alpha_noise_multiplier=sigma).upload_releases(n, batch_size, epochs, sketch=sketch, alpha=alpha)


@lru_cache(maxsize=64)
def plan_noise(epsilon: float, delta: float, *, n: int, uploads: int, batch_size: int = 32, epochs: int = 2,
               sketch: bool = True, alpha: bool = False) -> float:
    """The smallest common noise multiplier with which `uploads` uploads of n samples each fit
    in (epsilon, delta): what to set privacy.noise_multiplier, sketch_noise_multiplier and
    alpha_noise_multiplier to (`fedmq privacy plan`). Fewer samples per upload cost more
    epsilon at a given multiplier, so plan with the smallest n an upload will have."""
    import warnings

    if epsilon <= 0 or uploads < 1 or n < 1:
        raise ValueError(f"need epsilon > 0, uploads >= 1, n >= 1; got {epsilon}, {uploads}, {n}")

    def spent(sigma: float) -> float:
        history = upload_releases(sigma, n, batch_size, epochs, sketch=sketch, alpha=alpha) * uploads
        with warnings.catch_warnings():  # "optimal order is the smallest alpha": only at sigma < 1
            warnings.simplefilter("ignore")
            return epsilon_of(history, delta)

    lo, hi = 0.05, 1.0
    while spent(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e5:
            raise ValueError(f"epsilon {epsilon:g} at delta {delta:g} is out of reach for {uploads} uploads")
    if spent(lo) <= epsilon:
        return lo
    while hi / lo > 1.005:  # bisection in log space to 0.5 %: spent() falls as sigma grows
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if spent(mid) <= epsilon else (mid, hi)
    return hi


def private_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dp: DpSgd,
                      generator: torch.Generator) -> torch.Tensor:
    """Mean cross-entropy of the batch, with each parameter's .grad set to DP-SGD's
    (sum of per-sample gradients clipped to dp.clip + N(0, (sigma clip)^2)) / batch size."""
    import torch
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
