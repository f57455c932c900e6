"""How CDFL turns the cluster models and an estimate alpha into the one model an agent gets.

The straightforward reading (docs/cdfl.md, step 4) replies u = sum_k alpha_k w_k. A
parameter-space mixture of rotation specialists is a poor model for a client whose data
mixes rotations: averaging weights of differently specialized networks is not averaging
their predictions. The variants here keep the single-model download (CDFL's point) and
differ in how that one model is made. Select one by name (cfg.cdfl.personalization):

- "mixture": sum_k alpha_k w_k (the baseline; what joins always get).
- "upload": the agent's own upload, unchanged (an ablation reference: what Local would keep,
  while the clusters still learn from it).
- "finetune": start from the alpha-mixture (by default; or the agent's upload, see below) and
  train a few steps on the server's proxy sets, sample i of D_k weighted by alpha_k, on the
  true labels.
- "distill": as finetune, plus knowledge distillation: on a sample of D_k the teacher is the
  specialist w_k (its tempered softmax), so the student learns each cluster from the model
  that knows it best, in the proportions the client needs; loss =
  kd_weight * T^2 KL(teacher_T || student_T) + (1 - kd_weight) * CE(labels).
- "distill-mixture": distill, starting from the alpha-mixture instead of the upload.

finetune and distill start from `start` (cfg.cdfl.personalize_start): the alpha-mixture (the
default), the upload, the dominant cluster, or a blend (1 - lam) upload + lam mixture with lam
picked per reply from a grid by the alpha-weighted proxy loss. A proximal term (rho,
cfg.cdfl.personalize_rho) holds the training near its start, so the agent's next step is not
spent undoing the reply's proxy fit, which the clusters never held (docs/results_cdfl.md#the-reply). Starting from the upload alone, the reply never contains the cluster models, so
it is the same whether the fleet's uploads move the clusters or not (the frozen control,
docs/results_cdfl.md#the-reply).

What the training moves is cfg.cdfl.personalize_layers: every layer, or for a large model
(auto: above cfg.cdfl.personalize_head_above parameters) the head alone (the trailing linear
layers, aggregator/evaluator.py `LayerSplit`): the lower part of the reply is then the plain
start (the alpha-mixture), its features on the proxy samples are computed once per reply, and
the SGD steps run the head only. For MobileNetV3-small that is 0.6 M of 1.5 M parameters and
a step ~20x cheaper (docs/results_realsize.md).

The server-side training runs on the evaluator's device (the GPU when there is one) and is
deterministic for a given seed on CPU, so journal replay rebuilds the same reply.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad, vmap

from aggregator.evaluator import LayerSplit, NotSplittable, ProxyEvaluator, vector_digest
from fedmq.config import CDFLSettings
from fedmq.models import trains_channels_last
from fedmq.optimizers import SGD


@dataclass
class PersonalizeRequest:
    """What one personalized reply is made from."""

    clusters: Tensor
    """[K, P] cluster models after this upload's update."""
    alpha: Sequence[float]
    upload: Tensor | None
    """The agent's uploaded vector (None for a join)."""
    seed: int = 0
    start: Tensor | None = None
    """Where training starts, chosen when the clusters were as this reply must see them (set
    by fix_start before replies queued behind later cluster updates are trained together)."""
    start_info: dict[str, Any] | None = None


class Personalizer(ABC):
    name = "personalizer"

    @abstractmethod
    def personalize(self, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        """The vector to send and diagnostics (seconds, steps)."""

    def trains_together(self) -> bool:
        """Whether personalize_many trains several replies in one batched pass."""
        return False

    def reads_upload(self) -> bool:
        """Whether a reply depends on the agent's upload; if not, it depends on the clusters
        and alpha alone, and queued uploads with close alphas can share it (cdfl.reply_share)."""
        return True

    def fix_start(self, request: PersonalizeRequest) -> None:
        """Record in `request` what the reply takes from the clusters now (before they move on);
        only personalizers that train together need it."""
        return None

    def personalize_many(self, requests: Sequence[PersonalizeRequest]) -> list[tuple[Tensor, dict[str, Any]]]:
        return [self.personalize(r) for r in requests]


STARTS = ("upload", "mixture", "dominant", "blend")
"""Where a trained reply starts (cfg.cdfl.personalize_start)."""
BLEND_GRID = tuple(CDFLSettings().personalize_blend_grid)
LAYERS = ("all", "head", "auto")
"""What a trained reply moves (cfg.cdfl.personalize_layers)."""
GUARD_SAMPLES = 64
"""Proxy samples the mixture guard compares the mixture and each cluster on (one batch)."""
HEAD_ABOVE = CDFLSettings().personalize_head_above
"""personalize_layers = auto trains the head alone above this many parameters."""


def alpha_mixture(clusters: Tensor, alpha: Sequence[float]) -> Tensor:
    return torch.tensor([float(a) for a in alpha], dtype=torch.float32) @ clusters


class MixturePersonalizer(Personalizer):
    name = "mixture"

    def personalize(self, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        return alpha_mixture(request.clusters, request.alpha), {}

    def reads_upload(self) -> bool:
        return False


class UploadPersonalizer(Personalizer):
    """Send back what the agent uploaded (the mixture for a join)."""

    name = "upload"

    def personalize(self, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        if request.upload is None:
            return alpha_mixture(request.clusters, request.alpha), {}
        return request.upload.detach().to("cpu", torch.float32).clone(), {}


def reply_schedule(epochs: int, samples: int, batch_size: int, min_steps: int, kept: int) -> tuple[int, int]:
    """(epochs, SGD steps per epoch) of a reply over `kept` proxy samples: `samples` draws per
    epoch when set, else every kept sample; epochs stretched to at least `min_steps` steps
    unless `samples` caps the reply."""
    per_epoch = -(-(samples or kept) // batch_size)
    if min_steps and not samples and per_epoch:
        epochs = max(epochs, -(-min_steps // per_epoch))
    return epochs, per_epoch


class DistillPersonalizer(Personalizer):
    """Train one student on alpha-weighted proxy data, taught by each cluster's specialist.

    Per-sample weights: a sample of D_k weighs alpha_k / |D_k| (normalized per batch), so each
    epoch sees the client's mixture. With `samples` > 0 an epoch instead draws that many
    samples with replacement, with probability proportional to those weights, and weighs them
    equally (the same expected loss), so the cost no longer grows with K and |D_k|.
    kd_weight = 0 is plain fine-tuning on the labels.
    Teacher logits of w_k on D_k are cached by the cluster's content hash.
    """

    name = "distill"

    def __init__(self, evaluator: ProxyEvaluator, *, epochs: int = 2, lr: float = 0.01,
                 momentum: float = 0.9, batch_size: int = 64, kd_weight: float = 0.5,
                 temperature: float = 2.0, start: str = "upload", rho: float = 0.0, samples: int = 0,
                 blend_grid: Sequence[float] = BLEND_GRID, min_steps: int = 0,
                 tail_average: float = 0.0, layers: str = "all", head_above: int = HEAD_ABOVE,
                 mixture_guard: float = 0.0) -> None:
        if (epochs < 0 or lr <= 0 or batch_size < 1 or not 0.0 <= kd_weight <= 1.0 or temperature <= 0
                or samples < 0 or min_steps < 0 or rho < 0 or not 0.0 <= tail_average <= 1.0
                or mixture_guard < 0):
            raise ValueError(f"need epochs >= 0, lr > 0, batch_size >= 1, 0 <= kd_weight <= 1, temperature > 0, "
                             f"samples >= 0, min_steps >= 0, rho >= 0, 0 <= tail_average <= 1, mixture_guard "
                             f">= 0; got {epochs}, {lr}, {batch_size}, {kd_weight}, {temperature}, {samples}, "
                             f"{min_steps}, {rho}, {tail_average}, {mixture_guard}")
        if start not in STARTS:
            raise ValueError(f"personalize_start must be one of {', '.join(STARTS)}, got {start!r}")
        grid = [float(g) for g in blend_grid]
        if not grid or any(not 0.0 <= g <= 1.0 for g in grid):
            raise ValueError(f"personalize_blend_grid needs values in [0, 1], got {list(blend_grid)}")
        self.blend_grid = grid
        self.evaluator = evaluator
        self.epochs = int(epochs)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.batch_size = int(batch_size)
        self.kd_weight = float(kd_weight)
        self.temperature = float(temperature)
        self.start = start
        self.rho = float(rho)
        self.samples = int(samples)
        self.min_steps = int(min_steps)
        self.tail_average = float(tail_average)
        self.mixture_guard = float(mixture_guard)
        """nats (cdfl.personalize_mixture_guard; 0 = off): how much worse than the best single
        cluster the mixture may fit the reply's data before the reply starts from that cluster."""
        self._teacher: dict[int, tuple[str, Tensor]] = {}
        self.split, self.layers, self.layers_why = resolve_layers(evaluator, layers, head_above)
        """The cut below the head when only the head trains (layers "head"), else None."""

    def _teacher_logits(self, clusters: Tensor) -> Tensor:
        """[N_total, C] logits of w_k on the samples of D_k, for every k (cached per cluster)."""
        ev = self.evaluator
        parts = []
        for k in range(ev.num_sets):
            key = vector_digest(clusters[k])
            cached = self._teacher.get(k)
            if cached is None or cached[0] != key:
                x = ev.x[ev.offsets[k]:ev.offsets[k + 1]]
                with torch.inference_mode():
                    logits = ev._logits(clusters[k], x).float()
                cached = (key, logits.clone())
                self._teacher[k] = cached
            parts.append(cached[1])
        return torch.cat(parts)

    def start_vector(self, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        """Where the reply's training starts (CPU float32), and what was chosen."""
        if request.start is not None:
            return request.start, dict(request.start_info or {})
        if self.start == "dominant":
            k = max(range(len(request.alpha)), key=lambda i: float(request.alpha[i]))
            return request.clusters[k].clone(), {"start": "dominant", "cluster": k}
        if request.upload is not None and self.start == "upload":
            return request.upload.detach().to("cpu", torch.float32).clone(), {"start": "upload"}
        mixture = alpha_mixture(request.clusters, request.alpha)
        if request.upload is None or self.start == "mixture":
            return self._guarded(mixture, request)
        upload = request.upload.detach().to("cpu", torch.float32)
        grid = self.blend_grid
        candidates = torch.stack([(1.0 - g) * upload + g * mixture for g in grid])
        weights = torch.tensor([float(a) for a in request.alpha], dtype=torch.float32)
        with torch.inference_mode():
            losses = self.evaluator.losses(candidates) @ weights  # alpha-weighted proxy loss
        best = int(torch.argmin(losses))
        return candidates[best].clone(), {"start": "blend", "lam": grid[best]}

    def _guarded(self, mixture: Tensor, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        """The mixture, or the cluster that fits the reply's data best where the mixture is
        worse than it by more than `mixture_guard`. A weight average is a model only while the
        clusters share a basin; each cluster's own proxy steps can take them apart until their
        average scores at chance (docs/results_realsize.md), and a reply's few steps cannot
        repair that. Judged on 64 proxy samples drawn with the reply's own weights."""
        k = request.clusters.shape[0]
        if self.mixture_guard <= 0 or k < 2:
            return mixture, {"start": "mixture"}
        ev = self.evaluator
        gen = torch.Generator().manual_seed(int(request.seed) * 2 + 1)
        idx = torch.multinomial(self._sample_weights(request).cpu(), GUARD_SAMPLES, replacement=True,
                                generator=gen).to(ev.device)
        candidates = torch.cat([mixture[None], request.clusters])
        losses = ev.per_sample_on(candidates, ev.x[idx], ev.y[idx]).mean(1).tolist()
        best = min(range(k), key=lambda j: losses[1 + j])
        if losses[0] <= losses[1 + best] + self.mixture_guard:
            return mixture, {"start": "mixture"}
        return request.clusters[best].clone(), {"start": "cluster", "cluster": best,
                                                 "mixture_loss": round(losses[0], 4),
                                                 "cluster_loss": round(losses[1 + best], 4)}

    def personalize(self, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        t0 = time.perf_counter()
        ev = self.evaluator
        device = ev.device
        start, chosen = self.start_vector(request)
        if self.epochs == 0:  # the start is the reply (e.g. a blend of upload and clusters, untrained)
            return start, {"steps": 0, "seconds": time.perf_counter() - t0, **chosen}
        start = start.to(device)
        weights = self._sample_weights(request)  # [N_total]
        teacher = self._teacher_logits(request.clusters) if self.kd_weight > 0 else None
        y = ev.y
        gen = torch.Generator().manual_seed(int(request.seed))
        steps = 0
        T = self.temperature
        keep = self._kept(weights)
        draw_weights = weights.cpu()  # the CPU generator draws from CPU weights
        epochs, tail = self._plan(len(keep))
        trained, logits_of, lower_s = self._trained(start, keep)
        w = trained.clone().requires_grad_(True)
        opt = SGD([w], lr=self.lr, momentum=self.momentum)
        with torch.enable_grad():
            for _ in range(epochs):
                order = self._epoch_order(draw_weights, keep, gen).to(device)
                for i in range(0, len(order), self.batch_size):
                    idx = order[i:i + self.batch_size]
                    logits = logits_of(w, idx)
                    bw = (torch.full((len(idx),), 1.0 / len(idx), device=device) if self.samples
                          else weights[idx] / weights[idx].sum())
                    loss = (1.0 - self.kd_weight) * (F.cross_entropy(logits, y[idx], reduction="none") * bw).sum()
                    if teacher is not None:
                        t = F.log_softmax(teacher[idx] / T, dim=1)
                        s = F.log_softmax(logits / T, dim=1)
                        kd = (t.exp() * (t - s)).sum(dim=1)
                        loss = loss + self.kd_weight * T * T * (kd * bw).sum()
                    if self.rho > 0:
                        loss = loss + 0.5 * self.rho * (w - trained).pow(2).sum()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    steps += 1
                    tail.see(steps, w.detach())
        out = tail.result(w.detach())
        if self.split is not None:
            out = start.detach().clone().index_copy_(0, self.split.index.to(device), out)
            chosen = {**chosen, "layers": "head", "lower_s": round(lower_s, 4)}
        return out.to("cpu", torch.float32), {"steps": steps, "seconds": time.perf_counter() - t0, **chosen}

    def _trained(self, start: Tensor, keep: Tensor) -> tuple[Tensor, Callable[[Tensor, Tensor], Tensor], float]:
        """What the reply's SGD moves (the whole vector, or the head's parameters alone), the
        logits of proxy samples `idx` as a function of it, and the seconds the lower part's
        features took (head only: one forward pass over the kept samples, frozen after)."""
        ev = self.evaluator
        if self.split is None:
            x = ev.x.contiguous() if ev.x.ndim != 4 else ev.x
            module, spec, nhwc = ev.module, ev.spec, trains_channels_last(ev.device)
            return start, lambda w, idx: functional_call(module, spec.unflatten(w, nhwc), (x[idx],)), 0.0
        t0 = time.perf_counter()
        split = self.split
        features = ev.lower_features(start, keep)
        head = start[split.index.to(start.device)]
        return head, lambda h, idx: split.logits(h, start, features[idx]), time.perf_counter() - t0

    def fix_start(self, request: PersonalizeRequest) -> None:
        request.start, request.start_info = self.start_vector(request)

    def reads_upload(self) -> bool:
        return self.start in ("upload", "blend")

    def trains_together(self) -> bool:
        # Teachers read the clusters, which later uploads of a batch have moved by then.
        return self.kd_weight == 0 and self.epochs > 0

    def personalize_many(self, requests: Sequence[PersonalizeRequest]) -> list[tuple[Tensor, dict[str, Any]]]:
        """Train the replies together: one vmapped gradient per mini-batch over all replicas.

        The same draws, batch weights and SGD-with-momentum as `personalize`, per request (so
        the same vectors up to float rounding); replicas whose epochs have different lengths
        (a cluster with alpha ~0 drops out of the draw) are trained in separate groups.
        """
        if not self.trains_together() or len(requests) < 2 or self.split is not None:
            # A head reply's features come from its own start: one by one (each is cheap).
            return [self.personalize(r) for r in requests]
        ev = self.evaluator
        weights = [self._sample_weights(r) for r in requests]
        keeps = [self._kept(w) for w in weights]
        groups: dict[int, list[int]] = {}
        for i, keep in enumerate(keeps):
            groups.setdefault(self.samples or len(keep), []).append(i)
        out: list[tuple[Tensor, dict[str, Any]] | None] = [None] * len(requests)
        for members in groups.values():
            t0 = time.perf_counter()
            starts = [self.start_vector(requests[i]) for i in members]
            vectors, steps = self._train_together(
                torch.stack([v for v, _ in starts]).to(ev.device), [weights[i] for i in members],
                [keeps[i] for i in members], [int(requests[i].seed) for i in members])
            seconds = (time.perf_counter() - t0) / len(members)
            for j, i in enumerate(members):
                out[i] = (vectors[j], {"steps": steps, "seconds": seconds, "batched": len(members), **starts[j][1]})
        return [o for o in out if o is not None]

    def _plan(self, kept: int) -> tuple[int, TailAverage]:
        """The reply's epochs over `kept` samples, and the average of its last iterates.

        personalize_epochs is stretched to at least min_steps SGD steps: a reply over few proxy
        samples (small K, small sets) otherwise takes few steps (docs/results_cdfl.md#the-reply).
        An explicit `samples` per epoch is a cap on the reply's cost, and the floor leaves it.
        The tail average starts past the last step when tail_average is 0 (the last iterate)."""
        epochs, per_epoch = reply_schedule(self.epochs, self.samples, self.batch_size, self.min_steps, kept)
        total = epochs * per_epoch
        return epochs, TailAverage(total - math.ceil(self.tail_average * total) + 1)

    @staticmethod
    def _kept(weights: Tensor) -> Tensor:
        """Only samples that matter (CPU indices): a cluster with weight ~0 only costs time."""
        return torch.nonzero(weights > 1e-6 * weights.max()).flatten().cpu()

    def _epoch_order(self, draw_weights: Tensor, keep: Tensor, gen: torch.Generator) -> Tensor:
        """One epoch's sample indices (CPU): `samples` draws in proportion to the weights, or
        every kept sample once, shuffled."""
        if self.samples:
            return torch.multinomial(draw_weights, self.samples, replacement=True, generator=gen)
        return keep[torch.randperm(len(keep), generator=gen)]

    def _sample_weights(self, request: PersonalizeRequest) -> Tensor:
        """Sample i of D_k weighs alpha_k / |D_k| ([N_total], on the evaluator's device)."""
        ev = self.evaluator
        alpha = torch.tensor([float(a) for a in request.alpha], dtype=torch.float32, device=ev.device)
        sizes = torch.tensor(ev.sizes, dtype=torch.float32, device=ev.device)
        return (alpha / sizes)[ev.set_of_sample]

    def _train_together(self, starts: Tensor, weights: list[Tensor], keeps: list[Tensor],
                        seeds: list[int]) -> tuple[Tensor, int]:
        ev = self.evaluator
        device = ev.device
        x = ev.x.contiguous() if ev.x.ndim != 4 else ev.x
        y = ev.y
        module, unflatten, rho = ev.module, ev.spec.unflatten, self.rho

        def loss_fn(w: Tensor, start: Tensor, xb: Tensor, yb: Tensor, bw: Tensor) -> Tensor:
            logits = functional_call(module, unflatten(w), (xb,))
            loss = (F.cross_entropy(logits, yb, reduction="none") * bw).sum()
            if rho > 0:
                loss = loss + 0.5 * rho * (w - start).pow(2).sum()
            return loss

        step_fn = vmap(grad(loss_fn))
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        draw_weights = [w.cpu() for w in weights]
        W = starts.clone()
        buf: Tensor | None = None
        steps = 0
        epochs, tail = self._plan(len(keeps[0]))
        with torch.enable_grad():
            for _ in range(epochs):
                orders = torch.stack([self._epoch_order(w, k, g) for w, k, g
                                      in zip(draw_weights, keeps, gens, strict=True)]).to(device)
                for i in range(0, orders.shape[1], self.batch_size):
                    idx = orders[:, i:i + self.batch_size]  # [B, b]
                    if self.samples:
                        bw = torch.full(idx.shape, 1.0 / idx.shape[1], device=device)
                    else:
                        bw = torch.stack([w[row] for w, row in zip(weights, idx, strict=True)])
                        bw = bw / bw.sum(dim=1, keepdim=True)
                    g = step_fn(W, starts, x[idx], y[idx], bw)
                    # torch.optim.SGD with momentum: buf = g at the first step, then m buf + g
                    buf = g if buf is None else buf.mul_(self.momentum).add_(g)
                    W = W - self.lr * buf
                    steps += 1
                    tail.see(steps, W.detach())
        return tail.result(W.detach()).to("cpu", torch.float32), steps


def resolve_layers(evaluator: ProxyEvaluator, layers: str, head_above: int) -> tuple[LayerSplit | None, str, str]:
    """(the cut, "all" or "head", why) for personalize_layers: head trains the layers above the
    cut (ValueError when the model has none); auto does so above `head_above` parameters or
    over a frozen backbone, when the model can be cut, and otherwise trains every layer."""
    if layers not in LAYERS:
        raise ValueError(f"personalize_layers must be one of {', '.join(LAYERS)}, got {layers!r}")
    if head_above < 0:
        raise ValueError(f"personalize_head_above must be >= 0, got {head_above}")
    params = evaluator.spec.param_numel
    frozen = evaluator.spec.frozen is not None  # the backbone's features serve every reply
    if layers == "all" or (layers == "auto" and params <= head_above and not frozen):
        return None, "all", "set" if layers == "all" else f"{params} parameters <= {head_above}"
    try:
        split = evaluator.layer_split()
    except NotSplittable as e:
        if layers == "head":
            raise ValueError(f"personalize_layers = head: {e}") from None
        return None, "all", str(e)
    return split, "head", ("set" if layers == "head" else "a frozen backbone" if frozen
                           else f"{params} parameters > {head_above}")


class TailAverage:
    """The running mean of the iterates from step `first` on (cdfl.personalize_tail_average,
    Polyak-Ruppert / stochastic weight averaging). Measured no help for CDFL's replies on
    rotated digits (docs/results_cdfl.md#the-reply); kept as an option, off."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.mean: Tensor | None = None
        self.n = 0

    def see(self, step: int, w: Tensor) -> None:
        if step < self.first:
            return
        self.n += 1
        if self.mean is None:
            self.mean = w.clone()
        else:
            self.mean.add_(w - self.mean, alpha=1.0 / self.n)

    def result(self, last: Tensor) -> Tensor:
        return last if self.mean is None else self.mean


def _proxy(evaluator: ProxyEvaluator | None, name: str) -> ProxyEvaluator:
    if evaluator is None:
        raise ValueError(f"personalization {name!r} needs the proxy evaluator")
    return evaluator


PERSONALIZERS: dict[str, Callable[[ProxyEvaluator | None, dict[str, Any]], Personalizer]] = {
    "mixture": lambda ev, o: MixturePersonalizer(),
    "upload": lambda ev, o: UploadPersonalizer(),
    "finetune": lambda ev, o: DistillPersonalizer(_proxy(ev, "finetune"), **{**o, "kd_weight": 0.0}),
    "distill": lambda ev, o: DistillPersonalizer(_proxy(ev, "distill"), **o),
    "distill-mixture": lambda ev, o: DistillPersonalizer(_proxy(ev, "distill-mixture"),
                                                         **{**o, "start": "mixture"}),
}
"""Name (cdfl.personalization) -> builder(evaluator, options): adding one is one line."""
PERSONALIZATIONS = tuple(PERSONALIZERS)


def make_personalizer(name: str, evaluator: ProxyEvaluator | None, **options: Any) -> Personalizer:
    """The personalizer `name` (cfg.cdfl.personalization); options: epochs, lr, kd_weight, ..."""
    try:
        build = PERSONALIZERS[name]
    except KeyError:
        raise ValueError(f"unknown personalization {name!r}; known: {', '.join(PERSONALIZATIONS)}") from None
    return build(evaluator, options)
