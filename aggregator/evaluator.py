"""Batched evaluation of many flat parameter vectors on the server's K proxy sets.

CDFL needs, for every upload, its loss on each proxy set D_k, and for every cluster model
its loss on its own D_k. All of these are one call here: every vector runs once over the
concatenation of the K proxy sets, and the per-sample results are averaged per set.

Two formulations compute the same numbers:
- "stacked" (default): one model at a time (`torch.func.functional_call` with views of the
  flat vector from `spec.unflatten`, no copies into an nn.Module) over the concatenated
  proxy samples, cut into chunks of `chunk` samples. On CPU the inputs and conv weights are
  channels_last and the chunks small (64): the activations of a chunk stay in cache, which
  measured 2-5x faster than one NCHW batch of 1000 on a 2-core EPYC (bench/bench_aggregator.py).
- "vmap": `torch.func.vmap` over the stacked vectors (convolutions become grouped
  convolutions). Slower on CPU here; kept selectable for accelerators.

`losses_naive` is the reference: one vector, one proxy set, a regular nn.Module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, vmap

from fedmq.models import ModelSpec, build_model, load_vector

Proxy = tuple[Tensor, Tensor]


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when available, else cpu; cuda when asked but missing is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def vector_digest(vector: Tensor) -> str:
    """Content hash of a vector (for caches keyed by what a model is, not where it lives)."""
    data = vector.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class ProxyEvaluator:
    """Losses, accuracies, per-sample results and gradients of flat vectors on K proxy sets."""

    def __init__(self, spec: ModelSpec, proxies: Sequence[Proxy], device: str = "auto",
                 batch: int = 1000, *, chunk: int | None = None,
                 formulation: str = "stacked", channels_last: bool | None = None,
                 compile: bool = False) -> None:
        if not proxies:
            raise ValueError("need at least one proxy set")
        if formulation not in ("stacked", "vmap"):
            raise ValueError(f"formulation must be 'stacked' or 'vmap', got {formulation!r}")
        self.spec = spec
        self.device = resolve_device(device)
        self.batch = int(batch)
        on_cpu = self.device.type == "cpu"
        self.chunk = int(chunk) if chunk else (64 if on_cpu else max(self.batch, 1) * len(proxies))
        self.formulation = formulation
        self.channels_last = on_cpu if channels_last is None else channels_last
        self.module = build_model(spec.arch).to(self.device).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self._forward = self._eager_forward
        if compile:
            # torch.compile (inductor) of the functional forward: ~20 s to compile once per
            # chunk shape on CPU, then ~1.6x the eager rate (bench_aggregator).
            self._forward = torch.compile(self._eager_forward, dynamic=False)
        xs, ys, sizes = [], [], []
        for k, (x, y) in enumerate(proxies):
            if tuple(x.shape[1:]) != tuple(spec.input_shape):
                raise ValueError(f"proxy set {k}: inputs {tuple(x.shape[1:])}, "
                                 f"{spec.arch} expects {tuple(spec.input_shape)}")
            if y.shape != (x.shape[0],) or x.shape[0] == 0:
                raise ValueError(f"proxy set {k}: {x.shape[0]} inputs and labels of shape {tuple(y.shape)}")
            xs.append(x.float())
            ys.append(y.long())
            sizes.append(int(x.shape[0]))
        self.num_sets = len(proxies)
        self.sizes = sizes
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.x = torch.cat(xs).to(self.device)
        if self.channels_last and self.x.ndim == 4:
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.cat(ys).to(self.device)
        self.set_of_sample = torch.repeat_interleave(
            torch.arange(self.num_sets, device=self.device), torch.tensor(sizes, device=self.device))
        self._proxies = [(x.to(self.device), y.to(self.device)) for x, y in zip(xs, ys, strict=True)]
        self.proxies = self._proxies
        """The proxy sets as given (NCHW, on the evaluator's device)."""
        self._cluster_cache: dict[int, tuple[object, float]] = {}
        self.cache_hits = 0
        self._naive_module: torch.nn.Module | None = None
        self.cache_misses = 0

    # ------------------------------------------------------------------ forward passes

    def _params(self, vector: Tensor) -> dict[str, Tensor]:
        params = self.spec.unflatten(vector.to(self.device, torch.float32))
        if self.channels_last:
            params = {n: (p.contiguous(memory_format=torch.channels_last) if p.ndim == 4 else p)
                      for n, p in params.items()}
        return params

    def _eager_forward(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(self.module, params, (x,))

    def _logits(self, vector: Tensor, x: Tensor) -> Tensor:
        params = self._params(vector)
        outs = [self._forward(params, x[i : i + self.chunk]) for i in range(0, x.shape[0], self.chunk)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _per_sample(self, vectors: Tensor, what: str, x: Tensor, y: Tensor) -> Tensor:
        """[M, N] per-sample cross-entropy ("loss"), correctness ("correct") or p(y|x) ("p")."""
        vectors = vectors.reshape(-1, self.spec.numel)
        out = torch.empty(vectors.shape[0], x.shape[0], device=self.device)
        with torch.inference_mode():
            if self.formulation == "vmap":
                params = self.spec.unflatten(vectors.to(self.device, torch.float32))
                fn = vmap(lambda p, xb: functional_call(self.module, p, (xb,)), in_dims=(0, None))
                for i in range(0, x.shape[0], self.chunk):
                    logits = fn(params, x[i : i + self.chunk])
                    out[:, i : i + logits.shape[1]] = _reduce(logits, y[i : i + logits.shape[1]], what)
            else:
                for m in range(vectors.shape[0]):
                    out[m] = _reduce(self._logits(vectors[m], x)[None], y, what)[0]
        return out

    # ------------------------------------------------------------------ public API

    def per_sample(self, vectors: Tensor, what: str = "loss") -> Tensor:
        """[M, N_total] per-sample results on the concatenated proxy sets (set k is
        columns offsets[k]:offsets[k+1]). what: loss, correct or p (probability of the label)."""
        return self._per_sample(vectors, what, self.x, self.y)

    def per_sample_on(self, vectors: Tensor, x: Tensor, y: Tensor, what: str = "loss") -> Tensor:
        """[M, n] per-sample results on other data (a client's own samples, in tests)."""
        x = x.to(self.device, torch.float32)
        if self.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self._per_sample(vectors, what, x, y.to(self.device))

    def per_set_mean(self, per_sample: Tensor) -> Tensor:
        """[M, N_total] -> [M, K] means over each proxy set."""
        sums = torch.zeros(per_sample.shape[0], self.num_sets, device=per_sample.device)
        sums.index_add_(1, self.set_of_sample.to(per_sample.device), per_sample)
        return sums / torch.tensor(self.sizes, device=per_sample.device, dtype=sums.dtype)

    def losses(self, vectors: Tensor) -> Tensor:
        """[M, P] -> [M, K] mean cross-entropy of every vector on every proxy set (CPU)."""
        return self.per_set_mean(self.per_sample(vectors, "loss")).cpu()

    def accuracies(self, vectors: Tensor) -> Tensor:
        """[M, P] -> [M, K] accuracy of every vector on every proxy set (CPU)."""
        return self.per_set_mean(self.per_sample(vectors, "correct")).cpu()

    def loss_on(self, vector: Tensor, k: int) -> float:
        """F(vector; D_k) alone (what the cluster cache stores)."""
        x, y = self._proxies[k]
        return float(self._per_sample(vector[None], "loss", x, y).mean())

    def cluster_losses(self, clusters: Tensor, versions: Sequence[object] | None = None) -> Tensor:
        """[K] F(w_k; D_k), cached per cluster; an entry is recomputed when w_k's version
        (or, without versions, its content hash) changes."""
        if clusters.shape[0] != self.num_sets:
            raise ValueError(f"{clusters.shape[0]} clusters for {self.num_sets} proxy sets")
        out = torch.empty(self.num_sets)
        for k in range(self.num_sets):
            key = versions[k] if versions is not None else vector_digest(clusters[k])
            cached = self._cluster_cache.get(k)
            if cached is not None and cached[0] == key:
                self.cache_hits += 1
                out[k] = cached[1]
            else:
                self.cache_misses += 1
                value = self.loss_on(clusters[k], k)
                self._cluster_cache[k] = (key, value)
                out[k] = value
        return out

    def invalidate(self) -> None:
        self._cluster_cache.clear()

    def gradients(self, vector: Tensor) -> Tensor:
        """[K, P] grad of F(vector; D_k) for every proxy set (float32, on CPU)."""
        grads = torch.empty(self.num_sets, self.spec.numel)
        base = vector.detach().to(self.device, torch.float32)
        for k, (x, y) in enumerate(self._proxies):
            w = base.clone().requires_grad_(True)
            total = torch.zeros((), device=self.device)
            with torch.enable_grad():
                params = self.spec.unflatten(w)
                for i in range(0, x.shape[0], self.batch):
                    logits = functional_call(self.module, params, (x[i : i + self.batch],))
                    total = total + F.cross_entropy(logits, y[i : i + self.batch], reduction="sum")
                (g,) = torch.autograd.grad(total / x.shape[0], w)
            grads[k] = g.detach().cpu()
        return grads

    def losses_naive(self, vector: Tensor, k: int) -> float:
        """Reference: one vector on one proxy set through a regular nn.Module, NCHW, one batch."""
        if self._naive_module is None:
            self._naive_module = build_model(self.spec.arch).to(self.device).eval()
        model = load_vector(self._naive_module, vector.detach().to(self.device, torch.float32))
        x, y = self._proxies[k]
        with torch.inference_mode():
            return float(F.cross_entropy(model(x.contiguous()), y))


def _reduce(logits: Tensor, y: Tensor, what: str) -> Tensor:
    """logits [M, n, C], labels [n] -> [M, n]."""
    m, n, c = logits.shape
    yy = y.expand(m, n)
    if what == "loss":
        return F.cross_entropy(logits.reshape(m * n, c), yy.reshape(-1), reduction="none").view(m, n)
    if what == "correct":
        return (logits.argmax(-1) == yy).float()
    if what == "p":
        return torch.softmax(logits, -1).gather(-1, yy[..., None])[..., 0]
    raise ValueError(f"unknown per-sample quantity {what!r}; use loss, correct or p")
