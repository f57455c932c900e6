"""Privacy attacks on one upload, as tests of ourselves: what a server learns.

Threat model. The adversary is the aggregator (or whoever holds its credentials): it sees
every upload exactly as sent, and knows everything fedmq's server knows. For one client it
holds the model it sent the client (u: the uniform mixture of its pre-trained cluster
models, what a joining CDFL agent receives), the client's upload (v, trained by
`edge_agent.trainer.train_local` with the agent's defaults) and its data sketch
(`fedmq.sketch.data_sketch`: the mean of 1,024 random cosine features), the client's sample
count n, the training hyper-parameters, the feature map, and the server's labelled proxy
and pre-training images of every cluster, a public pool that never holds a client's image.
It never sees the client's images. It sees v as exact float32 (no codec quantization), so
what is measured is an upper bound on what the wire leaks.

What is measured, for clients of n samples (default 10, 100 and 1,000) and uploads without
DP and with the device's DP at lifetime epsilon 16, 4 and 1 (noise planned by
`fedmq.privacy.plan_noise` for `--uploads` uploads; the attacker sees one of them):

- (a) Sketch pre-image. (i) Kernel herding: greedily pick m = min(n, 64) public images
  whose feature mean best matches the sketch. (ii) Gradient pre-image: m free images, started
  at the herding picks, moved by Adam to make their feature mean match the sketch (plus a
  small total-variation prior), clamped to the pixel range.
- (b) Update inversion ("inverting gradients", Geiping et al. 2020): m = min(n, 32) dummy
  images whose loss gradient at u points along -(v - u) (cosine), labels inferred from the
  output bias's step, total-variation prior, pixel clamp.
- (c) Membership inference over the client's members and as many non-members (drawn from
  the same mixture and pool, disjoint by content): sketch score <s - s_pool, phi(z)>, the
  distance from z to the nearest image of the sketch pre-image, and update score
  loss(u; z) - loss(v; z) (also on the images u was unsure of alone: the update holds almost
  nothing of an image u already classifies with certainty, as its gradient is near zero),
  each calibrated per client against the proxy images (which neither u nor the client
  trained on). AUC and advantage max_t (TPR - FPR) over the
  pooled clients, 95 % intervals by a two-level bootstrap (clients, then samples); beside
  each DP row the ceiling (e^eps - 1 + 2 delta) / (e^eps + 1) that (eps, delta)-DP puts on
  any test of one record's membership, for the epsilon the attacked upload alone spends and
  for the lifetime budget.

Reconstruction quality is SSIM on pixels in [0, 1]: coverage (mean over client images of the
best SSIM to any reconstruction) and precision (mean over reconstructions of the best SSIM
to any client image), each beside a control (m random public images: an attacker without
the upload), and the nearest-neighbour identification rate (the share of reconstructions
whose L2-nearest image among members and as many non-members is a member; chance 0.5).

    python -m sim.attacks --out results/privacy/attacks
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedmq.config import (
    Config,
    PrivacySettings,
    add_config_arguments,
    config_from_args,
    dataset_named,
)
from fedmq.errors import ArgumentParser, UsageError, run_main
from fedmq.logs import setup_logging

DELTA = 1e-5
BATCH_SIZE, EPOCHS, LR, MOMENTUM, RHO, CLIP = 32, 2, 0.01, 0.9, 0.1, 1.0
DP_BATCH_SIZE = PrivacySettings().batch_size
"""With DP on the agent trains at privacy.batch_size (128), as in the trade-off's fleets."""
"""The agent's training defaults (edge_agent/trainer.py) and DP-SGD's clip (privacy.clip)."""


# ---------------------------------------------------------------------------------------------
# Image quality


def ssim_matrix(a: Tensor, b: Tensor, chunk: int = 64) -> Tensor:
    """SSIM of every image of `a` against every image of `b`: [len(a), len(b)].

    Images are (N, C, H, W) in [0, 1]. Wang et al.'s SSIM with a uniform window of
    min(7, side) pixels (odd), sample covariances, C1 = 0.01^2, C2 = 0.03^2 (scikit-image's
    defaults), averaged over the valid windows and the channels."""
    side = min(a.shape[-1], a.shape[-2])
    window = min(7, side if side % 2 else side - 1)
    pool = lambda t: torch.nn.functional.avg_pool2d(t, window, stride=1)  # noqa: E731
    a, b = a.double(), b.double()
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    cov_norm = window * window / (window * window - 1)
    mu_a, mu_b = pool(a), pool(b)
    var_a = (pool(a * a) - mu_a * mu_a) * cov_norm
    var_b = (pool(b * b) - mu_b * mu_b) * cov_norm
    rows = []
    for i in range(0, len(a), chunk):
        ai, mai, vai = a[i:i + chunk, None], mu_a[i:i + chunk, None], var_a[i:i + chunk, None]
        n_a, n_b = ai.shape[0], len(b)
        prod = pool((ai * b[None]).reshape(n_a * n_b, *a.shape[1:])).reshape(n_a, n_b, *mu_a.shape[1:])
        cov = (prod - mai * mu_b[None]) * cov_norm
        num = (2 * mai * mu_b[None] + c1) * (2 * cov + c2)
        den = (mai ** 2 + mu_b[None] ** 2 + c1) * (vai + var_b[None] + c2)
        rows.append((num / den).mean(dim=(2, 3, 4)))
    return torch.cat(rows).float()


def model_at(model_name: str, vector: Tensor) -> torch.nn.Module:
    """The zoo model `model_name` holding the flat vector, in eval mode."""
    from fedmq.models import build_model, load_vector

    return load_vector(build_model(model_name), vector.detach().float().cpu()).eval()


def total_variation(x: Tensor) -> Tensor:
    """Mean absolute difference of neighbouring pixels (per image, summed over the batch)."""
    return ((x[..., 1:, :] - x[..., :-1, :]).abs().mean(dim=(1, 2, 3))
            + (x[..., :, 1:] - x[..., :, :-1]).abs().mean(dim=(1, 2, 3))).sum()


def _row_keys(x: Tensor) -> list[bytes]:
    """One digest per image: equal images (by content) have equal keys."""
    flat = x.reshape(len(x), -1).contiguous().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in flat]


# ---------------------------------------------------------------------------------------------
# What the server holds


@dataclass
class ServerView:
    """What the adversary knows before any upload: the scenario's clusters, the model it sends
    a joining client (u), the public pool and the sketch's feature map."""

    scenario: str
    clusters: Any
    """fedmq.data.RotatedClusters: the client's data comes from its agents' pool."""
    model_name: str
    received: Tensor
    """u: the uniform mixture of the pre-trained cluster models."""
    public_x: Tensor
    """The proxy and pre-training images of every cluster (normalized, as the model sees them)."""
    calibration_x: Tensor
    """The proxy images of every cluster: neither u nor any client trained on them."""
    calibration_y: Tensor
    mean: Tensor
    """Per-channel normalization, (1, C, 1, 1): pixels in [0, 1] are x * std + mean."""
    std: Tensor
    features: tuple[Tensor, Tensor]
    """fedmq.sketch._features(C*H*W): phi(x) = cos(x_flat @ w + b)."""
    public_embedding: Tensor
    """phi of every public image, [N_public, D]."""
    pretrain_seconds: float
    public_keys: frozenset[bytes] = frozenset()
    """Content digests of the public images: a client's image is never one of them."""

    @property
    def low(self) -> Tensor:
        return (0.0 - self.mean) / self.std

    @property
    def high(self) -> Tensor:
        return (1.0 - self.mean) / self.std

    def pixels(self, x: Tensor) -> Tensor:
        """Normalized inputs -> pixels in [0, 1]."""
        return (x * self.std + self.mean).clamp(0.0, 1.0)

    def embed(self, x: Tensor) -> Tensor:
        """phi(x) per image, [N, D] (differentiable)."""
        w, b = self.features
        return torch.cos(x.reshape(len(x), -1) @ w + b)


def server_view(scenario_name: str, num_clusters: int, base: Config) -> ServerView:
    """Build the scenario's clusters and pre-train the cluster models once (aggregator.bootstrap)."""
    from aggregator.bootstrap import pretrain_clusters
    from fedmq.models import resolve_model_name
    from fedmq.sketch import _features
    from sim.scenarios import apply_defaults, build_clusters, get_scenario

    scenario = get_scenario(scenario_name)
    cfg = copy.deepcopy(base)
    apply_defaults(scenario, cfg)
    clusters = build_clusters(scenario, cfg, num_clusters)
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    t0 = time.perf_counter()
    received = torch.stack(pretrain_clusters(cfg, clusters, model_name)).mean(0)
    seconds = time.perf_counter() - t0
    k_range = range(clusters.num_clusters)
    proxies = [clusters.proxy(k, cfg.data.proxy_per_cluster or None) for k in k_range]
    pretrains = [clusters.pretrain(k, cfg.data.pretrain_per_cluster or None) for k in k_range]
    public_x = torch.cat([d.x for d in proxies + pretrains])
    base_data = clusters.train_data
    channels = len(base_data.mean)
    mean = torch.tensor(base_data.mean, dtype=torch.float32).view(1, channels, 1, 1)
    std = torch.tensor(base_data.std, dtype=torch.float32).view(1, channels, 1, 1)
    features = _features(int(np.prod(public_x.shape[1:])))
    view = ServerView(scenario=scenario.name, clusters=clusters, model_name=model_name, received=received,
                      public_x=public_x, calibration_x=torch.cat([d.x for d in proxies]),
                      calibration_y=torch.cat([d.y for d in proxies]), mean=mean, std=std,
                      features=features, public_embedding=torch.empty(0), pretrain_seconds=seconds)
    with torch.no_grad():
        view.public_embedding = view.embed(public_x)
    view.public_keys = frozenset(_row_keys(public_x))
    return view


@dataclass
class ClientData:
    """One client: its n training images (members) and images of the same mixture it does not
    hold (non-members, disjoint from the members by content, same share of each cluster)."""

    alpha: np.ndarray
    x: Tensor
    y: Tensor
    out_x: Tensor
    out_y: Tensor
    distinct: int
    """Distinct member images (fewer than n where the pool is smaller than the client's share)."""
    public_copies: int = 0
    """Distinct member images equal to a public one: the pools never share a base image, but a
    dataset may hold the same image twice (0 on digits)."""


def draw_client(view: ServerView, n: int, rng: np.random.Generator, primary_share: float = 0.7,
                cap: int = 500) -> ClientData:
    """A mixture with `primary_share` on a random cluster and 3n samples drawn by it
    (fedmq.data.mixtures.sample_agent_data, shuffled): the first n are the client's. Of the
    other 2n, those equal to no member, no public image and no other are the non-members, as many as fit
    the members' share of each cluster, at most min(n, `cap`). (A 2n draw split in two would
    leave each side a different mix of clusters, which the sketch would tell apart.)"""
    from fedmq.data.mixtures import draw_mixture, sample_agent_data, split_counts

    k = view.clusters.num_clusters
    alpha = draw_mixture(rng, k, primary_share, primary_share)
    drawn = sample_agent_data(view.clusters, alpha, 3 * n, rng, split="train")
    x, y, cluster = drawn.data.x, drawn.data.y, drawn.cluster.numpy()
    member_keys = set(_row_keys(x[:n]))
    seen: set[bytes] = set(view.public_keys)
    by_cluster: list[list[int]] = [[] for _ in range(k)]
    for i, key in enumerate(_row_keys(x[n:]), start=n):
        if key not in member_keys and key not in seen:
            seen.add(key)
            by_cluster[int(cluster[i])].append(i)
    share = np.bincount(cluster[:n], minlength=k) / n
    most = min(len(by_cluster[c]) / share[c] for c in range(k) if share[c] > 0)
    take = split_counts(share, min(int(most), n, cap))
    chosen = sorted(i for c in range(k) for i in by_cluster[c][:int(take[c])])
    if len(chosen) < 2:
        raise UsageError(f"{view.clusters.name}: too few images left outside a client of {n} samples "
                         "to serve as non-members; use smaller --sizes")
    index = torch.tensor(chosen)
    return ClientData(alpha=alpha, x=x[:n], y=y[:n], out_x=x[index], out_y=y[index],
                      distinct=len(member_keys), public_copies=len(member_keys & view.public_keys))


@dataclass
class Upload:
    """What the client sends: its trained model v and its (noisy) sketch."""

    vector: Tensor
    sketch: Tensor
    noise_multiplier: float | None


def make_upload(view: ServerView, client: ClientData, epsilon: float | None, noise_multiplier: float | None,
                seed: int, noise_seed: int = 0) -> Upload:
    """Train as the agent does (2 epochs, batch 32, SGD 0.01, momentum 0.9, rho 0.1) from u, batch
    order by `seed`, with DP-SGD (at batch privacy.batch_size) and the sketch's Gaussian mechanism
    at `noise_multiplier` (noise drawn by `noise_seed`) when `epsilon` is set."""
    from edge_agent.trainer import train_local
    from fedmq.privacy import DpSgd, UplinkPrivacy
    from fedmq.sketch import data_sketch

    sketch = data_sketch(client.x)
    dp, batch = None, BATCH_SIZE
    if epsilon is not None:
        batch = DP_BATCH_SIZE
        assert noise_multiplier is not None
        dp = DpSgd(clip=CLIP, noise_multiplier=noise_multiplier, seed=noise_seed)
        mechanisms = UplinkPrivacy(epsilon, DELTA, clip=CLIP, noise_multiplier=noise_multiplier,
                                   sketch_noise_multiplier=noise_multiplier, seed=noise_seed)
        sketch = mechanisms.sketch(sketch, len(client.x))
    trained = train_local(view.model_name, view.received, client.x, client.y, epochs=EPOCHS,
                          batch_size=batch, lr=LR, momentum=MOMENTUM, rho=RHO, seed=seed, dp=dp)
    return Upload(trained.vector, torch.from_numpy(np.asarray(sketch, dtype=np.float32)), noise_multiplier)


# ---------------------------------------------------------------------------------------------
# (a) Sketch pre-image


def herd(public_embedding: Tensor, sketch: Tensor, m: int) -> Tensor:
    """Kernel herding: indices of m distinct public images, each chosen to bring the mean
    embedding of those chosen so far closest (L2) to the sketch."""
    emb = public_embedding.double()
    norms = (emb * emb).sum(1)
    target = sketch.double()
    total = torch.zeros_like(target)
    taken = torch.zeros(len(emb), dtype=torch.bool)
    chosen: list[int] = []
    for t in range(1, min(m, len(emb)) + 1):
        # ||target - (total + e) / t||^2 = ||a||^2 - 2/t <a, e> + ||e||^2 / t^2, a = target - total / t
        gap = -2 / t * (emb @ (target - total / t)) + norms / t ** 2
        gap[taken] = math.inf
        j = int(gap.argmin())
        chosen.append(j)
        taken[j] = True
        total += emb[j]
    return torch.tensor(chosen, dtype=torch.int64)


def sketch_preimage(view: ServerView, sketch: Tensor, start: Tensor, steps: int = 300, lr: float = 0.05,
                    tv_weight: float = 1e-4) -> Tensor:
    """Images whose mean embedding matches the sketch: Adam on the pixels of `start` (normalized
    inputs), minimizing ||sketch - mean phi(x)||^2 + tv_weight * TV(x), clamped to the pixel range."""
    x = start.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    target = sketch.float()
    low, high = view.low, view.high
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ((target - view.embed(x).mean(0)) ** 2).sum() + tv_weight * total_variation(x)
        loss.backward()
        opt.step()
        with torch.no_grad():
            x.copy_(torch.max(torch.min(x, high), low))
    return x.detach()


# ---------------------------------------------------------------------------------------------
# (b) Update inversion


def step_weight(n: int) -> float:
    """sum over SGD steps of what each step's gradient adds to v - u through momentum: with S
    steps, sum_t sum_{j < S - t + 1} momentum^j. The client's mean gradient is about
    -(v - u) / (lr * this)."""
    steps = EPOCHS * max(1, math.ceil(n / BATCH_SIZE))
    return sum((1 - MOMENTUM ** (steps - t)) / (1 - MOMENTUM) for t in range(steps))


def infer_labels(view: ServerView, received: Tensor, uploaded: Tensor, n: int, m: int) -> Tensor:
    """m labels from the output bias's step: its mean gradient is mean softmax - label shares,
    so shares ~ (u's mean softmax on the public pool) - (bias gradient), cut at 0; the m
    labels follow those shares (largest remainders)."""
    from fedmq.data.mixtures import split_counts
    from fedmq.models import model_spec

    spec = model_spec(view.model_name)
    end = spec.head[1]
    bias = slice(end - spec.num_classes, end)
    gradient = -(uploaded[bias] - received[bias]).double() / (LR * step_weight(n))
    with torch.no_grad():
        softmax = torch.softmax(model_at(view.model_name, received)(view.calibration_x), 1).mean(0).double()
    shares = (softmax - gradient).clamp(min=0)
    shares = shares / shares.sum() if shares.sum() > 0 else torch.full_like(shares, 1 / len(shares))
    counts = split_counts(shares.numpy(), m)
    return torch.repeat_interleave(torch.arange(spec.num_classes), torch.from_numpy(counts))


def invert_update(view: ServerView, received: Tensor, uploaded: Tensor, n: int, m: int, seed: int,
                  steps: int = 300, lr: float = 0.1, tv_weight: float = 1e-2) -> tuple[Tensor, Tensor]:
    """Inverting gradients: m dummy images (from noise) whose mean loss gradient at u has the
    largest cosine with -(v - u), plus a TV prior, clamped to the pixel range. Returns
    (images, inferred labels)."""
    from torch.func import functional_call

    from fedmq.models import model_spec

    spec = model_spec(view.model_name)
    model = model_at(view.model_name, received)
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    target = -(uploaded[:spec.param_numel] - received[:spec.param_numel]).float()
    target = target / (target.norm() + 1e-12)
    labels = infer_labels(view, received, uploaded, n, m)
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn((m, *view.public_x.shape[1:]), generator=generator) * 0.5
    x = torch.max(torch.min(start, view.high), view.low).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    schedule = torch.optim.lr_scheduler.MultiStepLR(opt, [int(steps * 0.6), int(steps * 0.85)], gamma=0.2)
    weights = tuple(params[name].requires_grad_(True) for name in names)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = functional_call(model, ({**dict(zip(names, weights, strict=True)), **buffers}), (x,))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        grads = torch.autograd.grad(loss, weights, create_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        objective = 1 - (flat @ target) / (flat.norm() + 1e-12) + tv_weight * total_variation(x)
        objective.backward(inputs=[x])
        opt.step()
        schedule.step()
        with torch.no_grad():
            x.copy_(torch.max(torch.min(x, view.high), view.low))
    return x.detach(), labels


# ---------------------------------------------------------------------------------------------
# (c) Membership inference and the scores


def sketch_scores(view: ServerView, sketch: Tensor, x: Tensor) -> Tensor:
    """<s - s_pool, phi(z)> per image: how much the sketch leans toward z beyond the public pool."""
    with torch.no_grad():
        return view.embed(x) @ (sketch - view.public_embedding.mean(0))


def update_scores(view: ServerView, uploaded: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """(loss(u; z) - loss(v; z), loss(u; z)) per labelled image: how much training lowered z's
    loss, and how unsure u was of z to begin with."""
    from fedmq.training import per_sample_losses

    before = per_sample_losses(view.model_name, view.received, x, y)
    return before - per_sample_losses(view.model_name, uploaded, x, y), before


UNSURE_LOSS = 0.1
"""loss(u; z) at or above which u was unsure of z (its probability of z's label under 0.905):
the samples whose gradient is not near zero, so the only ones an update can reveal."""


def calibrated(scores: Tensor, reference: Tensor) -> np.ndarray:
    """Scores as z-scores against the same attack's scores on the proxy images (non-members
    the attacker holds), so one threshold serves every client."""
    return ((scores - reference.mean()) / (reference.std() + 1e-12)).double().numpy()


def nearest_scores(reconstructions: Tensor, x: Tensor) -> Tensor:
    """-(L2 distance from each image of x to the nearest reconstruction): a reconstruction close
    to z says z was there."""
    flat = reconstructions.reshape(len(reconstructions), -1)
    return -torch.cdist(x.reshape(len(x), -1), flat).min(1).values


def membership_scores(view: ServerView, client: ClientData, upload: Upload, members: Tensor, member_y: Tensor,
                      preimage: Tensor | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Calibrated scores of `members` (the client's distinct images) and of its non-members:
    sketch (kernel score), update, the update's on the images u was unsure of (loss >=
    UNSURE_LOSS), and with `preimage` (the sketch pre-image's images) the distance to them."""
    reference = sketch_scores(view, upload.sketch, view.calibration_x)
    out = {"sketch": (calibrated(sketch_scores(view, upload.sketch, members), reference),
                      calibrated(sketch_scores(view, upload.sketch, client.out_x), reference))}
    if preimage is not None:
        reference = nearest_scores(preimage, view.calibration_x)
        out["sketch_preimage"] = (calibrated(nearest_scores(preimage, members), reference),
                                  calibrated(nearest_scores(preimage, client.out_x), reference))
    reference, _ = update_scores(view, upload.vector, view.calibration_x, view.calibration_y)
    member_drop, member_loss = update_scores(view, upload.vector, members, member_y)
    other_drop, other_loss = update_scores(view, upload.vector, client.out_x, client.out_y)
    update = calibrated(member_drop, reference), calibrated(other_drop, reference)
    out["update"] = update
    out["update_unsure"] = (update[0][(member_loss >= UNSURE_LOSS).numpy()],
                            update[1][(other_loss >= UNSURE_LOSS).numpy()])
    return out


def auc(members: np.ndarray, others: np.ndarray) -> float:
    """P(member score > non-member score), ties counting half (Mann-Whitney)."""
    from scipy.stats import rankdata

    ranks = rankdata(np.concatenate([members, others]))
    n1, n0 = len(members), len(others)
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def advantage(members: np.ndarray, others: np.ndarray) -> float:
    """max over thresholds t of TPR - FPR for the rule `score >= t` (member)."""
    scores = np.concatenate([members, others])
    is_member = np.concatenate([np.ones(len(members)), np.zeros(len(others))])
    order = np.argsort(-scores, kind="stable")
    scores, is_member = scores[order], is_member[order]
    tpr = np.cumsum(is_member) / len(members)
    fpr = np.cumsum(1 - is_member) / len(others)
    last = np.r_[scores[1:] != scores[:-1], True]  # thresholds between distinct scores only
    return float(max(0.0, (tpr - fpr)[last].max()))


def pooled_membership(per_client: Sequence[tuple[np.ndarray, np.ndarray]], rng: np.random.Generator,
                      resamples: int = 1000) -> dict[str, Any]:
    """AUC and advantage of the scores pooled over clients, with 95 % percentile intervals from
    a two-level bootstrap (clients with replacement, then each one's members and non-members)."""
    members = np.concatenate([m for m, _ in per_client])
    others = np.concatenate([o for _, o in per_client])
    out: dict[str, Any] = {"members": int(len(members)), "non_members": int(len(others))}
    if not len(members) or not len(others):
        return {**out, "auc": math.nan, "auc_ci": [math.nan, math.nan], "advantage": math.nan,
                "advantage_ci": [math.nan, math.nan]}
    aucs, advs = [], []
    for _ in range(resamples):
        picks = rng.integers(len(per_client), size=len(per_client))
        m = np.concatenate([rng.choice(per_client[i][0], len(per_client[i][0])) for i in picks])
        o = np.concatenate([rng.choice(per_client[i][1], len(per_client[i][1])) for i in picks])
        if len(m) and len(o):
            aucs.append(auc(m, o))
            advs.append(advantage(m, o))
    def interval(values: list[float]) -> list[float]:
        return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if values else [math.nan] * 2

    return {**out, "auc": auc(members, others), "auc_ci": interval(aucs),
            "advantage": advantage(members, others), "advantage_ci": interval(advs)}


def dp_ceiling(epsilon: float, delta: float = DELTA) -> float:
    """The most any test can gain (TPR - FPR) on one record's membership under (eps, delta)-DP:
    from TPR <= e^eps FPR + delta and 1 - FPR <= e^eps (1 - TPR) + delta."""
    return min(1.0, (math.exp(epsilon) - 1 + 2 * delta) / (math.exp(epsilon) + 1))


@dataclass
class Quality:
    """How well reconstructions match one client's images (SSIM on pixels in [0, 1])."""

    coverage: float
    """Mean over the client's images of the best SSIM to any reconstruction."""
    precision: float
    """Mean over reconstructions of the best SSIM to any client image."""
    recovered: float
    """Share of the client's images with a reconstruction at SSIM >= RECOVERED."""
    nn_member: float
    """Share of reconstructions whose L2-nearest image among members and as many non-members
    is a member (chance 0.5)."""


RECOVERED = 0.95


def quality(view: ServerView, reconstructions: Tensor, members: Tensor, non_members: Tensor) -> Quality:
    """Score normalized reconstructions against a client's distinct members (and, for the
    nearest-neighbour rate, as many of them as there are non-members, and the non-members)."""
    ssim = ssim_matrix(view.pixels(members), view.pixels(reconstructions))
    k = min(len(members), len(non_members))
    candidates = view.pixels(torch.cat([members[:k], non_members[:k]])).reshape(2 * k, -1)
    nearest = torch.cdist(view.pixels(reconstructions).reshape(len(reconstructions), -1), candidates).argmin(1)
    return Quality(coverage=float(ssim.max(1).values.mean()), precision=float(ssim.max(0).values.mean()),
                   recovered=float((ssim.max(1).values >= RECOVERED).float().mean()),
                   nn_member=float((nearest < k).float().mean()))


# ---------------------------------------------------------------------------------------------
# The experiment


def default_clients(n: int) -> int:
    """Clients per size when --clients is not given: 20 at n = 10, 5 at 100, 2 at 1,000
    (about as many scored members per cell, at a cost that grows with n)."""
    return max(2, min(20, round(20 * (10 / n) ** 0.6)))


@dataclass(frozen=True)
class AttackPlan:
    """One run: the scenario, the client sizes, the privacy settings and the attacks' effort."""

    scenario: str = "rotated-digits"
    clusters: int = 2
    sizes: tuple[int, ...] = (10, 100, 1000)
    epsilons: tuple[float | None, ...] = (None, 16.0, 4.0, 1.0)
    """Lifetime budgets; None: no DP."""
    uploads: int = 12
    """Uploads the budget is planned for (fedmq.privacy.plan_noise); the attacker sees one. 12:
    as the trade-off's fleets, whose busiest agent uploads 12 times (docs/privacy.md)."""
    clients: int = 0
    """Clients per size; 0: default_clients(n)."""
    seed: int = 0
    primary_share: float = 0.7
    score_cap: int = 500
    """At most this many distinct members and non-members of a client are scored."""
    herding_images: int = 64
    inversion_images: int = 32
    preimage_steps: int = 300
    inversion_steps: int = 300
    resamples: int = 1000

    def clients_for(self, n: int) -> int:
        return self.clients or default_clients(n)


def epsilon_label(epsilon: float | None) -> str:
    return "none" if epsilon is None else f"{epsilon:g}"


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def distinct_images(x: Tensor, y: Tensor, cap: int) -> tuple[Tensor, Tensor]:
    """The first `cap` distinct images (by content) and their labels, in order."""
    keys, keep = set(), []
    for i, key in enumerate(_row_keys(x)):
        if key not in keys:
            keys.add(key)
            keep.append(i)
    index = torch.tensor(keep[:cap])
    return x[index], y[index]


def _summary(values: Sequence[float]) -> dict[str, Any]:
    """Mean over clients, 95 % t half-width, and the clients' own values."""
    from sim.stats import t_half_width

    return {"mean": float(np.mean(values)), "ci": t_half_width(list(values)), "clients": [float(v) for v in values]}


@dataclass
class CellResult:
    """Every number of one (n, epsilon) cell."""

    n: int
    epsilon: float | None
    noise_multiplier: float | None
    epsilon_upload: float | None
    """What the attacked upload alone spends (Opacus' RDP accountant, delta 1e-5)."""
    epsilon_lifetime: float | None
    """What all `uploads` uploads spend (<= the budget)."""
    ceiling_upload: float | None
    ceiling_lifetime: float | None
    clients: int
    distinct_members: float
    non_members: float
    public_copies: int
    """Members, over all clients, that equal a public image (see ClientData)."""
    reconstruction: dict[str, dict[str, dict[str, Any]]]
    """attack -> metric (Quality's fields) -> mean over clients, 95 % t half-width, per client."""
    gain: dict[str, dict[str, list[float]]]
    """attack -> coverage / precision -> [mean over clients of attack minus its control, 95 % t
    half-width] (herding and pre-image against m random public images, inversion against its m)."""
    membership: dict[str, dict[str, Any]]
    """sketch (kernel score) / sketch_preimage (distance to the pre-image) / update /
    update_unsure (the update score on the images u was unsure of) -> pooled AUC, advantage and
    their intervals."""
    label_error: float
    """Update inversion's inferred labels: total-variation distance to the client's label shares."""
    seconds: float
    examples: dict[str, list[list[float]]] = field(default_factory=dict, repr=False)
    """Client 0's images and their reconstructions, pixels (for the figure; not in the JSON)."""


def _assign(members: Tensor, reconstructions: Tensor) -> list[int]:
    """For each of the first members, the reconstruction most like it (one each: Hungarian on SSIM)."""
    from scipy.optimize import linear_sum_assignment

    ssim = ssim_matrix(members, reconstructions).numpy()
    rows, cols = linear_sum_assignment(-ssim)
    order = dict(zip(rows.tolist(), cols.tolist(), strict=True))
    return [order[i] for i in range(len(members)) if i in order]


def run_cell(view: ServerView, plan: AttackPlan, n: int, epsilon: float | None,
             clients: Sequence[ClientData]) -> CellResult:
    """Every attack on every client's upload at one (n, epsilon)."""
    from fedmq.privacy import UplinkPrivacy, plan_noise, upload_releases
    from sim.stats import paired_interval

    t0 = time.perf_counter()
    sigma = eps_one = eps_all = None
    if epsilon is not None:
        sigma = plan_noise(epsilon, DELTA, n=n, uploads=plan.uploads, batch_size=DP_BATCH_SIZE, epochs=EPOCHS,
                           sketch=True)
        releases = upload_releases(sigma, n, DP_BATCH_SIZE, EPOCHS, sketch=True)
        accountant = UplinkPrivacy(epsilon, DELTA, noise_multiplier=sigma, sketch_noise_multiplier=sigma)
        eps_one, eps_all = accountant.spent(releases), accountant.spent(releases * plan.uploads)
    qualities: dict[str, list[Quality]] = {k: [] for k in ("herding", "preimage", "herding_control",
                                                           "inversion", "inversion_control")}
    scored: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {
        "sketch": [], "sketch_preimage": [], "update": [], "update_unsure": []}
    label_errors, distinct, outside = [], [], []
    examples: dict[str, list[list[float]]] = {}
    e_index = plan.epsilons.index(epsilon)
    for c, client in enumerate(clients):
        members, member_y = distinct_images(client.x, client.y, plan.score_cap)
        distinct.append(len(members))
        outside.append(len(client.out_x))
        train_seed = _seed(plan.seed, n, c)
        upload = make_upload(view, client, epsilon, sigma, seed=train_seed, noise_seed=_seed(plan.seed, n, c, e_index))
        # (a) the sketch
        m = min(n, plan.herding_images)
        herded = view.public_x[herd(view.public_embedding, upload.sketch, m)]
        preimage = sketch_preimage(view, upload.sketch, herded, steps=plan.preimage_steps)
        control_rng = np.random.default_rng([plan.seed, n, c, 0xC0])
        control = view.public_x[torch.from_numpy(control_rng.choice(len(view.public_x), m, replace=False))]
        # (b) the update
        m_inv = min(n, plan.inversion_images)
        inverted, labels = invert_update(view, view.received, upload.vector, n, m_inv, seed=train_seed,
                                         steps=plan.inversion_steps)
        classes = view.clusters.num_classes
        true_share = np.bincount(client.y.numpy(), minlength=classes) / n
        label_errors.append(0.5 * float(np.abs(true_share - np.bincount(labels.numpy(), minlength=classes) / m_inv).sum()))
        for name, images in (("herding", herded), ("preimage", preimage), ("herding_control", control),
                             ("inversion", inverted), ("inversion_control", control[:m_inv])):
            qualities[name].append(quality(view, images, members, client.out_x))
        # (c) membership
        for name, pair in membership_scores(view, client, upload, members, member_y, preimage).items():
            scored[name].append(pair)
        if c == 0:
            shown = members[:10]
            examples = {"client": view.pixels(shown).tolist()}
            for name, images in (("herding", herded), ("preimage", preimage), ("inversion", inverted)):
                examples[name] = view.pixels(images[_assign(view.pixels(shown), view.pixels(images))]).tolist()
    rng = np.random.default_rng([plan.seed, n, e_index, 0xB007])
    reconstruction = {name: {metric: _summary([getattr(q, metric) for q in qs])
                             for metric in ("coverage", "precision", "recovered", "nn_member")}
                      for name, qs in qualities.items()}
    membership = {name: pooled_membership(pairs, rng, plan.resamples) for name, pairs in scored.items()}
    gain = {name: {metric: list(paired_interval([getattr(a, metric) - getattr(b, metric)
                                                 for a, b in zip(qualities[name], qualities[control], strict=True)]))
                   for metric in ("coverage", "precision")}
            for name, control in (("herding", "herding_control"), ("preimage", "herding_control"),
                                  ("inversion", "inversion_control"))}
    return CellResult(n=n, epsilon=epsilon, noise_multiplier=sigma, epsilon_upload=eps_one, epsilon_lifetime=eps_all,
                      ceiling_upload=None if eps_one is None else dp_ceiling(eps_one),
                      ceiling_lifetime=None if eps_all is None else dp_ceiling(eps_all),
                      clients=len(clients), distinct_members=float(np.mean(distinct)),
                      non_members=float(np.mean(outside)), public_copies=sum(c.public_copies for c in clients),
                      reconstruction=reconstruction, gain=gain, membership=membership,
                      label_error=float(np.mean(label_errors)), seconds=time.perf_counter() - t0, examples=examples)


def run_attacks(plan: AttackPlan, base: Config, on_cell: Callable[[CellResult], None] | None = None,
                view: ServerView | None = None) -> tuple[ServerView, list[CellResult]]:
    """Build what the server holds once, then every (size, epsilon) cell; the same clients (and
    the same batch order) at every epsilon of a size."""
    view = view or server_view(plan.scenario, plan.clusters, base)
    cells = []
    for n in plan.sizes:
        clients = [draw_client(view, n, np.random.default_rng([plan.seed, n, c]), plan.primary_share, plan.score_cap)
                   for c in range(plan.clients_for(n))]
        for epsilon in plan.epsilons:
            cell = run_cell(view, plan, n, epsilon, clients)
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return view, cells


# ---------------------------------------------------------------------------------------------
# Results


def _finite(value: Any) -> Any:
    """NaN and infinities as null, recursively: the JSON stays standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _f(value: float | None, digits: int = 2) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _interval(stat: dict[str, Any], key: str) -> str:
    low, high = stat[f"{key}_ci"]
    return f"{_f(stat[key])} [{_f(low)}, {_f(high)}]"


def markdown_tables(cells: Sequence[CellResult]) -> str:
    """The reconstruction table and the membership table, one row per (n, epsilon)."""
    def lead(c: CellResult) -> str:
        return (f"| {c.n} | {epsilon_label(c.epsilon)} | {_f(c.noise_multiplier)} | {_f(c.epsilon_upload)} |")

    def pair(r: dict[str, dict[str, Any]]) -> str:
        return f"{_f(r['coverage']['mean'])} / {_f(r['precision']['mean'])}"

    def versus(c: CellResult, name: str) -> str:
        coverage, half = c.gain[name]["coverage"]
        return f"{pair(c.reconstruction[name])} ({coverage:+.2f} ± {_f(half)})"

    lines = ["Reconstruction: SSIM coverage / precision (mean over clients); control = as many random "
             "public images (no upload); in parentheses the coverage minus the control's, paired by "
             "client, with its 95 % t half-width. Recovered: share of the client's images with a "
             f"reconstruction at SSIM >= {RECOVERED}. NN: share of reconstructions whose nearest image "
             "is a member (chance 0.50).", "",
             "| n | epsilon | sigma | eps (this upload) | herding | control (m <= 64) | sketch pre-image "
             "| update inversion | control (m <= 32) | recovered: pre-image / inversion "
             "| NN: herding / pre-image / inversion / control |",
             "|---:|---:|---:|---:|---|---|---|---|---|---|---|"]
    for c in cells:
        r = c.reconstruction
        lines.append(
            lead(c) + f" {versus(c, 'herding')} | {pair(r['herding_control'])} | {versus(c, 'preimage')} | "
            f"{versus(c, 'inversion')} | {pair(r['inversion_control'])} | "
            f"{_f(r['preimage']['recovered']['mean'])} / {_f(r['inversion']['recovered']['mean'])} | "
            f"{_f(r['herding']['nn_member']['mean'])} / {_f(r['preimage']['nn_member']['mean'])} / "
            f"{_f(r['inversion']['nn_member']['mean'])} / {_f(r['herding_control']['nn_member']['mean'])} |")
    lines += ["", "Membership inference: AUC and advantage max_t (TPR - FPR) pooled over clients, 95 % "
              "two-level bootstrap intervals. Sketch: the kernel score <s - s_pool, phi(z)>; pre-image: "
              "minus the distance from z to the nearest sketch pre-image image; update: loss(u; z) - "
              "loss(v; z). Unsure: the update score on the images u gave under "
              f"{math.exp(-UNSURE_LOSS):.3f} to their label (loss >= {UNSURE_LOSS:g}; members / non-members "
              "counted). Ceiling: the most any test can gain under the upload's own epsilon, and under "
              "the lifetime budget.", "",
              "| n | epsilon | sigma | eps (this upload) | clients | sketch AUC | sketch advantage "
              "| pre-image AUC | pre-image advantage | update AUC | update advantage "
              "| update AUC, unsure images | ceiling: upload / lifetime |",
              "|---:|---:|---:|---:|---:|---|---|---|---|---|---|---|---|"]
    for c in cells:
        mi = c.membership
        unsure = mi["update_unsure"]
        lines.append(
            lead(c) + f" {c.clients} | {_interval(mi['sketch'], 'auc')} | {_interval(mi['sketch'], 'advantage')} | "
            f"{_interval(mi['sketch_preimage'], 'auc')} | {_interval(mi['sketch_preimage'], 'advantage')} | "
            f"{_interval(mi['update'], 'auc')} | {_interval(mi['update'], 'advantage')} | "
            f"{_f(unsure['auc'])} ({unsure['members']} / {unsure['non_members']}) | "
            f"{_f(c.ceiling_upload)} / {_f(c.ceiling_lifetime)} |")
    return "\n".join(lines)


def describe_setting(view: ServerView, plan: AttackPlan) -> str:
    from fedmq.models import model_spec

    low, high = float(view.low.min()), float(view.high.max())
    return (f"Scenario {view.scenario}, K = {view.clusters.num_clusters} ({view.clusters.name}, "
            f"{tuple(view.public_x.shape[1:])} images), model {view.model_name} "
            f"({model_spec(view.model_name).param_numel:,} parameters). u = the uniform mixture of the "
            f"pre-trained cluster models ({view.pretrain_seconds:.1f} s to pre-train). Public pool: "
            f"{len(view.public_x)} proxy and pre-training images; calibration: {len(view.calibration_x)} "
            f"proxy images; normalized pixel range [{low:.2f}, {high:.2f}]. Clients: "
            f"{plan.primary_share:.0%} from one random cluster; the upload is 2 epochs of SGD (batch 32, "
            f"lr 0.01, momentum 0.9, rho 0.1) from u; with DP, DP-SGD (batch {DP_BATCH_SIZE}, clip 1) and the sketch's "
            f"Gaussian mechanism at one noise multiplier planned for {plan.uploads} uploads at delta "
            f"{DELTA:g}.")


NOTES = """Notes.
- The attacker sees v and the sketch as exact float32 (no codec quantization): an upper bound
  on what the wire carries.
- Herding and the random control pick public images, which are never a client's; the sketch
  pre-image and the update inversion make new images.
- The ceiling (e^eps - 1 + 2 delta) / (e^eps + 1) uses Opacus' RDP accountant, which analyses
  DP-SGD for adding or removing one record with Poisson sampling; the agent draws shuffled
  fixed-size batches, and this experiment compares members with fresh images (a replacement).
  It is the bound the accountant promises, not a proof about this exact experiment.
- Membership scores are z-scores against the same score on the proxy images (which neither u
  nor the client trained on), so one threshold serves every client; the pooled advantage is
  that of one threshold for all clients.
- Where a cluster's share of the client is larger than the agents' pool of that cluster (digits
  at n = 1,000: 657 base images per cluster), a client holds some images twice; members are
  scored once each (distinct_members in attacks.json)."""


def write_results(view: ServerView, plan: AttackPlan, cells: Sequence[CellResult], out: Path,
                  command: str) -> str:
    """OUT/attacks.json (every number and the command), OUT/attacks.md, OUT/reconstructions.png."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "plan": asdict(plan), "setting": describe_setting(view, plan),
           "recovered_ssim": RECOVERED, "unsure_loss": UNSURE_LOSS,
           "cells": [{k: v for k, v in asdict(c).items() if k != "examples"} for c in cells]}
    (out / "attacks.json").write_text(json.dumps(_finite(doc), indent=1) + "\n")
    tables = markdown_tables(cells)
    (out / "attacks.md").write_text(f"# Privacy attacks on one upload\n\n`{command}`\n\n"
                                    f"{describe_setting(view, plan)}\n\n{tables}\n\n{NOTES}\n")
    draw_reconstructions(cells, out / "reconstructions.png")
    return tables


def draw_reconstructions(cells: Sequence[CellResult], path: Path) -> Path:
    """Client 0's images and the three reconstructions (each matched to one image), at the
    smallest n, without DP and at epsilon 4 (or the run's first two settings)."""
    from sim.figures import pyplot

    n = min(c.n for c in cells)
    at_n = [c for c in cells if c.n == n]
    shown = [c for c in at_n if c.epsilon in (None, 4.0)] or at_n[:2]
    rows = ("client", "herding", "preimage", "inversion")
    titles = {"client": "client's images", "herding": "kernel herding (public images)",
              "preimage": "sketch pre-image", "inversion": "update inversion"}
    columns = max(len(c.examples["client"]) for c in shown)
    gap = 0.5  # an empty column between panels, in image widths
    ratios = [r for p in range(len(shown)) for r in ([gap] if p else []) + [1.0] * columns]
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), len(ratios), squeeze=False, gridspec_kw={
        "width_ratios": ratios, "wspace": 0.08, "hspace": 0.12},
        figsize=(0.62 * sum(ratios) + 1.8, 0.7 * len(rows) + 0.4))
    for ax in axes.flat:
        ax.axis("off")
    for p, cell in enumerate(shown):
        first = p * (columns + 1)
        axes[0][first].set_title(f"n = {n}, epsilon {epsilon_label(cell.epsilon)}", loc="left", fontsize=9)
        for r, row in enumerate(rows):
            for j, pixels in enumerate(cell.examples[row]):
                image = np.asarray(pixels).transpose(1, 2, 0)
                axes[r][first + j].imshow(image[..., 0] if image.shape[-1] == 1 else image, cmap="gray",
                                          vmin=0, vmax=1)
            if p == 0:
                axes[r][0].text(-0.15, 0.5, titles[row], transform=axes[r][0].transAxes, ha="right",
                                va="center", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # not save_figure: tight_layout refuses subfigures
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Command line


def parse_epsilons(text: str) -> tuple[float | None, ...]:
    """`none,16,4,1` -> (None, 16.0, 4.0, 1.0)."""
    values: list[float | None] = []
    for item in (v.strip() for v in str(text).split(",")):
        if not item:
            continue
        if item.lower() == "none":
            values.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise UsageError(f"--epsilons: {item!r} is neither a number nor none (e.g. none,16,4,1)") from None
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"--epsilons: budgets must be > 0 and finite (none: no DP), got {item!r}")
        values.append(value)
    if not values:
        raise UsageError(f"--epsilons: expected at least one of none or a budget > 0, got {text!r}")
    if len(set(values)) != len(values):
        raise UsageError(f"--epsilons: {text!r} repeats a setting")
    return tuple(values)


QUICK = {"sizes": "10", "epsilons": "none,4", "clients": 4}
"""--quick's defaults (flags given explicitly win), with 100 optimization steps and 200 resamples."""


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim.attacks") -> int:
    from sim.scenarios import resolve_scenario
    from sim.seeds import int_list

    p = ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_config_arguments(p, ("log_level", "data_dir", "seed"))
    p.add_argument("--scenario", help="a scenario of sim/scenarios.py (default: rotated-digits, or the rotated "
                   "scenario of the dataset under --data-dir)")
    p.add_argument("--clusters", type=int, default=2, help="K (default: %(default)s)")
    p.add_argument("--sizes", default=None, help="client sample counts, comma list (default: 10,100,1000)")
    p.add_argument("--epsilons", default=None,
                   help="lifetime budgets, comma list; none: no DP (default: none,16,4,1)")
    p.add_argument("--uploads", type=int, default=12,
                   help="uploads each budget is planned for; the attacker sees one (default: %(default)s)")
    p.add_argument("--clients", type=int, default=None,
                   help="clients per size (default: 20 at n=10, 5 at 100, 2 at 1000)")
    p.add_argument("--out", type=Path, default=Path("results/privacy/attacks"),
                   help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a small run for tests: n=10, no DP and epsilon 4, 4 clients, fewer steps")
    p.add_argument("--dry-run", action="store_true", help="check the scenario and the flags, print the plan and exit")
    args = p.parse_args(argv)
    command = " ".join(["python -m sim.attacks", *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))])
    cfg = config_from_args(args)
    setup_logging(cfg.log.level, cfg.log.json)
    args.scenario = resolve_scenario(args.scenario, cfg, args.data_dir, dataset_named(args)).name
    sizes = tuple(int_list(args.sizes or (QUICK["sizes"] if args.quick else "10,100,1000"), "--sizes", minimum=1))
    epsilons = parse_epsilons(args.epsilons or (QUICK["epsilons"] if args.quick else "none,16,4,1"))
    clients = args.clients if args.clients is not None else (QUICK["clients"] if args.quick else 0)
    if args.uploads < 1:
        raise UsageError(f"--uploads: must be >= 1, got {args.uploads}")
    if clients < 0 or args.clusters < 1:
        raise UsageError("--clients must be >= 0 (0: the default per size) and --clusters >= 1")
    if len(set(sizes)) != len(sizes):
        raise UsageError(f"--sizes: {args.sizes!r} repeats a size")
    steps = {"preimage_steps": 100, "inversion_steps": 100, "resamples": 200} if args.quick else {}
    plan = AttackPlan(scenario=args.scenario, clusters=args.clusters, sizes=sizes, epsilons=epsilons,
                      uploads=args.uploads, clients=clients, seed=cfg.seed, **steps)
    if args.dry_run:
        from sim.scenarios import describe_plan

        try:
            print(describe_plan(plan.scenario, cfg, [plan.clusters]))
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(f"clients: {', '.join(f'{plan.clients_for(n)} of n={n}' for n in sizes)}; epsilon "
              f"{', '.join(map(epsilon_label, epsilons))} (noise planned for {plan.uploads} uploads at delta "
              f"{DELTA:g}); seed {plan.seed}; output {args.out}/attacks.{{json,md}}, reconstructions.png "
              "(dry run: nothing run)")
        return 0
    torch.set_num_threads(1)
    try:
        view = server_view(plan.scenario, plan.clusters, cfg)
    except ValueError as e:  # K the scenario cannot have, server sets that do not fit
        raise UsageError(str(e)) from None
    print(describe_setting(view, plan), flush=True)

    def progress(c: CellResult) -> None:
        r, mi = c.reconstruction, c.membership
        print(f"n={c.n} epsilon={epsilon_label(c.epsilon)}: SSIM herding {_f(r['herding']['coverage']['mean'])} "
              f"(control {_f(r['herding_control']['coverage']['mean'])}), pre-image "
              f"{_f(r['preimage']['coverage']['mean'])}, inversion {_f(r['inversion']['coverage']['mean'])}; "
              f"MI AUC sketch {_f(mi['sketch']['auc'])} update {_f(mi['update']['auc'])}, advantage "
              f"{_f(mi['sketch']['advantage'])} / {_f(mi['update']['advantage'])} (ceiling "
              f"{_f(c.ceiling_upload)}); {c.seconds:.0f} s", flush=True)

    _, cells = run_attacks(plan, cfg, progress, view=view)
    print(write_results(view, plan, cells, args.out, command))
    print(f"wrote {args.out}/attacks.json, attacks.md, reconstructions.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m sim.attacks", main))
