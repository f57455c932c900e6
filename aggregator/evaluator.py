"""Batched evaluation of many flat parameter vectors on the server's K proxy sets.

CDFL needs, for every upload, its loss on each proxy set D_k, and for every cluster model
its loss on its own D_k. All of these are one call here: every vector runs once over the
concatenation of the K proxy sets, and the per-sample results are averaged per set.

Three formulations compute the same numbers (float32 throughout):
- "fused" (the default on CPU when the architecture fits, see `FusedPlan`): the forward pass
  rewritten for conv3x3 -> ReLU -> 2x2 max-pool blocks followed by an MLP. The first conv
  (few input channels) and its pool become 4 GEMMs over the 4x4 input windows under every
  pooled position (the 3x3 kernel placed at each offset of the 2x2 pool window), max-
  accumulated; later convs are oneDNN channels_last convolutions; every pool is taken before
  its ReLU (they commute) with strided elementwise maxima instead of
  max_pool2d; fc1's weight is permuted to NHWC order instead of permuting activations. The
  proxy windows are computed once and cached. Work is split over one single-threaded worker
  per torch thread, by (model, chunk of samples): on a shared 2-core machine the many small
  ops of a 2-thread OpenMP team spend their time in barriers. 3-5x "stacked" here; the
  `compile` flag does not apply to it.
- "stacked": one model at a time (`torch.func.functional_call` with views of the
  flat vector from `spec.unflatten`, no copies into an nn.Module) over the concatenated
  proxy samples, cut into chunks of `chunk` samples. On CPU the inputs and conv weights are
  channels_last and the chunks small (64): the activations of a chunk stay in cache, which
  measured 2-5x faster than one NCHW batch of 1000 on a 2-core EPYC (bench/bench_aggregator.py).
- "vmap": `torch.func.vmap` over the stacked vectors (convolutions become grouped
  convolutions). Slower on CPU here; kept selectable for accelerators.
"auto" (the default) is "fused" on CPU when the model fits the plan and the plan reproduces
the module's logits at construction, else "stacked".

`losses_naive` is the reference: one vector, one proxy set, a regular nn.Module.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedmq.models import ModelSpec, build_model, load_vector, state_tensors

Proxy = tuple[Tensor, Tensor]
FORMULATIONS = ("auto", "fused", "stacked", "vmap")
WINDOW_CACHE_BYTES = 512 * 2**20
"""Largest cache of first-layer input windows (cnn28, K = 4 x 1000 samples: 50 MB)."""
FEATURE_CACHE_ENTRIES = 2
"""Lower-part features kept (`ProxyEvaluator.lower_features`): MobileNetV3-small, 2 x 1000
samples: 4.6 MB an entry; cnn28, 4 x 1000: 25 MB."""
FEATURE_CHUNK = 256
"""Samples per forward pass of the lower part (no gradient, so larger chunks pay)."""


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
                 formulation: str = "auto", channels_last: bool | None = None,
                 compile: bool = False, workers: int | None = None) -> None:
        if not proxies:
            raise ValueError("need at least one proxy set")
        if formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {', '.join(FORMULATIONS)}, got {formulation!r}")
        self.spec = spec
        self.device = resolve_device(device)
        self.batch = int(batch)
        on_cpu = self.device.type == "cpu"
        self.module = build_model(spec.arch).to(self.device).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.plan: FusedPlan | None = None
        if formulation == "fused" or (formulation == "auto" and on_cpu):
            try:
                self.plan = self._checked_plan()
            except NotFusable:
                if formulation == "fused":
                    raise
        self.formulation = "fused" if self.plan is not None else ("stacked" if formulation == "auto" else formulation)
        """The formulation in use ("auto" resolved)."""
        default_chunk = 64 if on_cpu else max(self.batch, 1) * len(proxies)
        self.chunk = int(chunk) if chunk else default_chunk
        self.channels_last = on_cpu if channels_last is None else channels_last
        self.workers: _Workers | None = None
        """Single-threaded worker threads of the fused formulation (None: run inline)."""
        count = torch.get_num_threads() if workers is None else int(workers)
        if self.plan is not None and on_cpu and count > 1:
            self.workers = _Workers(count)
        self._windows: Tensor | None = None
        self._forward = self._eager_forward
        if compile:
            # torch.compile (inductor) of the stacked/vmap functional forward: 4-20 s to
            # compile once per chunk shape on CPU, then ~1.5x the eager stacked rate, still
            # well below "fused", which does not use it (bench_aggregator).
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
        self._split: LayerSplit | None = None
        self._features: OrderedDict[tuple[str, str], Tensor] = OrderedDict()
        self.feature_hits = 0
        self.feature_misses = 0

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

    def _checked_plan(self) -> FusedPlan:
        """The fused plan, if it reproduces the module's logits (a new architecture whose
        forward does something the plan does not know is refused, not mis-evaluated)."""
        plan = FusedPlan(self.module, self.spec)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, *self.spec.input_shape, generator=g).to(self.device)
        vector = torch.cat([p.reshape(-1) for p in self.module.parameters()])
        vector = vector + 0.1 * torch.randn(vector.shape, generator=g).to(self.device)
        with torch.inference_mode():
            expected = functional_call(self.module, self.spec.unflatten(vector), (x,))
            win = plan.windows(x) if plan.window else None
            xin = x.contiguous(memory_format=torch.channels_last)
            got = plan.forward(plan.prepare(self.spec.unflatten(vector)), xin, win, x.shape[0])
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            raise NotFusable(f"{self.spec.arch}: the fused forward differs from the module's "
                             f"by {float((got - expected).abs().max()):.3g}")
        return plan

    def _fused_logits(self, vectors: Tensor, x: Tensor, rows: tuple[int, int] | None) -> Tensor:
        """[M, n, classes]; `rows`: x is self.x[rows[0]:rows[1]], whose windows are cached."""
        plan = self.plan
        assert plan is not None
        n = x.shape[0]
        windows = None
        if plan.window:
            if rows is not None:
                if self._windows is None:
                    self._windows = self._cached_windows()
                windows = self._windows
            per_sample = (x.shape[2] // 2) * (x.shape[3] // 2)
        else:
            x = x.contiguous(memory_format=torch.channels_last)
        weights = [plan.prepare(self.spec.unflatten(v)) for v in vectors.to(self.device, torch.float32)]
        logits = torch.empty(len(weights), n, self.spec.num_classes, device=self.device)
        units = [(m, i) for m in range(len(weights)) for i in range(0, n, self.chunk)]

        def run(span: Sequence[tuple[int, int]]) -> None:
            with torch.inference_mode():
                for m, i in span:
                    k = min(self.chunk, n - i)
                    win = None
                    if plan.window:
                        if windows is not None and rows is not None:
                            win = windows[(rows[0] + i) * per_sample : (rows[0] + i + k) * per_sample]
                        else:
                            win = plan.windows(x[i : i + k])
                    logits[m, i : i + k] = plan.forward(weights[m], x[i : i + k], win, k)

        if self.workers is None:
            run(units)
        else:
            parts = min(self.workers.count, len(units))
            bounds = [len(units) * p // parts for p in range(parts + 1)]
            self.workers.run([lambda s=units[a:b]: run(s) for a, b in zip(bounds, bounds[1:], strict=False)])
        return logits

    def _cached_windows(self) -> Tensor | None:
        assert self.plan is not None
        c, h, w = self.spec.input_shape
        size = self.x.shape[0] * (h // 2) * (w // 2) * c * 16 * 4
        return self.plan.windows(self.x) if size <= WINDOW_CACHE_BYTES else None

    def _per_sample(self, vectors: Tensor, what: str, x: Tensor, y: Tensor,
                    rows: tuple[int, int] | None = None) -> Tensor:
        """[M, N] per-sample cross-entropy ("loss"), correctness ("correct") or p(y|x) ("p")."""
        vectors = vectors.reshape(-1, self.spec.numel)
        out = torch.empty(vectors.shape[0], x.shape[0], device=self.device)
        with torch.inference_mode():
            if self.formulation == "fused":
                out = _reduce(self._fused_logits(vectors, x, rows), y, what)
            elif self.formulation == "vmap":
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
        return self._per_sample(vectors, what, self.x, self.y, rows=(0, self.x.shape[0]))

    def per_sample_on(self, vectors: Tensor, x: Tensor, y: Tensor, what: str = "loss") -> Tensor:
        """[M, n] per-sample results on other data (a subset of the proxy samples, a client's own)."""
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
        return self._mean_on(vector, k, "loss")

    def accuracy_on(self, vector: Tensor, k: int) -> float:
        """Accuracy of `vector` on proxy set k alone: a cluster's own accuracy costs 1/K of
        `accuracies` on every set."""
        return self._mean_on(vector, k, "correct")

    def _mean_on(self, vector: Tensor, k: int, what: str) -> float:
        rows = (self.offsets[k], self.offsets[k + 1])
        x, y = self.x[rows[0] : rows[1]], self.y[rows[0] : rows[1]]
        return float(self._per_sample(vector[None], what, x, y, rows=rows).mean())

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
        self._features.clear()

    def layer_split(self) -> LayerSplit:
        """The model cut below its head (built once; NotSplittable when it cannot be)."""
        if self._split is None:
            self._split = LayerSplit(self.module, self.spec, self.device)
        return self._split

    def lower_features(self, vector: Tensor, rows: Tensor) -> Tensor:
        """[N_total, ...] the lower part of `vector` (layer_split) on the proxy samples `rows`
        (the other rows are zero), kept for the last FEATURE_CACHE_ENTRIES (vector, rows): a
        reply whose start recurs (joins before any upload, a replayed or re-sent reply) skips
        the lower forward pass. Under a frozen backbone the features of every proxy sample are
        computed once and serve every reply."""
        split = self.layer_split()
        if split.fixed_lower:  # a frozen backbone: every proxy sample once, for every reply after
            rows = torch.arange(self.x.shape[0])
        rows_cpu = rows.detach().to("cpu", torch.int64).contiguous()
        key = ("fixed" if split.fixed_lower else vector_digest(vector),
               hashlib.blake2b(rows_cpu.numpy().tobytes(), digest_size=16).hexdigest())
        cached = self._features.get(key)
        if cached is not None:
            self._features.move_to_end(key)
            self.feature_hits += 1
            return cached
        self.feature_misses += 1
        index = rows_cpu.to(self.device)
        chunk = max(self.chunk, FEATURE_CHUNK)
        got = split.features(vector, self.x[index], chunk)
        out = torch.zeros(self.x.shape[0], *got.shape[1:], device=self.device)
        out[index] = got
        self._features[key] = out
        while len(self._features) > FEATURE_CACHE_ENTRIES:
            self._features.popitem(last=False)
        return out

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


class NotSplittable(ValueError):
    """The model cannot be cut below its classifier (not fx-traceable, no trailing linear layers,
    or a connection crossing the cut)."""


def _owns_tensors(module: nn.Module) -> bool:
    """Whether `module` itself holds a parameter or a buffer: a layer (a frozen backbone's layers
    hold buffers only, fedmq/backbone.py)."""
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


class LayerSplit:
    """The model cut below its classifier head: a frozen lower part and a trained upper part.

    The head is the trailing run of `nn.Linear` layers in forward order (cnn28: fc1, fc2;
    MobileNetV3: classifier.0, classifier.3), cut at the input of its first layer. Both parts
    are torch.fx graphs of the module itself, so the parameter names are the spec's, and the
    cut is refused (NotSplittable) when a value other than the cut crosses it or when
    upper(lower(x)) does not reproduce the module's logits. A reply that trains only the head
    runs the lower part once per reply (`ProxyEvaluator.lower_features`) and then steps the
    head alone over those features: for a 1.5 M-parameter model ~10x less work per step.
    """

    def __init__(self, module: nn.Module, spec: ModelSpec, device: torch.device) -> None:
        from torch import fx

        try:
            traced = fx.symbolic_trace(module)
        except Exception as e:  # any tracing failure means: no cut, train every layer
            raise NotSplittable(f"{spec.arch}: not traceable by torch.fx ({type(e).__name__})") from None
        modules = dict(traced.named_modules())
        nodes = list(traced.graph.nodes)
        layers = [n for n in nodes if n.op == "call_module" and _owns_tensors(modules[str(n.target)])]
        first = len(layers)
        while first > 0 and isinstance(modules[str(layers[first - 1].target)], nn.Linear):
            first -= 1
        if first == len(layers) or first == 0:
            raise NotSplittable(f"{spec.arch}: no linear head above other layers")
        cut = layers[first].args[0]
        if not isinstance(cut, fx.Node):
            raise NotSplittable(f"{spec.arch}: the head's input is not a graph value")
        at = nodes.index(cut)
        lower_graph, env = fx.Graph(), {}
        for n in nodes[: at + 1]:
            env[n] = lower_graph.node_copy(n, lambda a: env[a])
        lower_graph.output(env[cut])
        upper_graph = fx.Graph()
        env = {cut: upper_graph.placeholder("features")}
        for n in nodes[at + 1:]:
            if n.op == "placeholder":
                raise NotSplittable(f"{spec.arch}: an input enters above the cut")
            try:
                env[n] = upper_graph.node_copy(n, lambda a: env[a])
            except KeyError:
                raise NotSplittable(f"{spec.arch}: {n.name} reads a value below the cut besides "
                                    f"{cut.name}") from None
        self.lower = fx.GraphModule(traced, lower_graph).to(device).eval()
        self.lower.graph.eliminate_dead_code()
        self.lower.recompile()
        self.upper = fx.GraphModule(traced, upper_graph).to(device).eval()
        upper_state = set(self.upper.state_dict())
        trainable = spec.trainable if spec.trainable is not None else len(spec.names)
        self.names = [n for n in spec.names[:trainable] if n in upper_state]
        """The head's parameters (trained by a head reply), in the vector's order."""
        self.buffers = [n for n in spec.names[trainable:] if n in upper_state]
        self.shapes = [spec.shapes[spec.names.index(n)] for n in self.names]
        offsets, position = {}, 0
        for name, shape in zip(spec.names, spec.shapes, strict=True):
            offsets[name] = position
            position += math.prod(shape)
        lower_state = set(self.lower.state_dict())
        self._lower_names = [n for n in spec.names if n in lower_state]
        self.fixed_lower = not self._lower_names
        """No value of the vector reaches the lower part (a frozen backbone, fedmq/backbone.py):
        its features are the same for every vector."""
        self.index = torch.cat([torch.arange(offsets[n], offsets[n] + math.prod(s))
                                for n, s in zip(self.names, self.shapes, strict=True)])
        """Positions of the head's parameters in the flat vector."""
        self.numel = int(self.index.numel())
        self.spec = spec
        self.device = device
        self._verify(module)

    def _verify(self, module: nn.Module) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, *self.spec.input_shape, generator=g).to(self.device)
        vector = torch.cat([t.detach().reshape(-1).float() for _, t, _ in state_tensors(module)]).to(self.device)
        if vector.numel() != self.spec.numel:
            raise NotSplittable(f"{self.spec.arch}: the module's state is not the spec's")
        with torch.inference_mode():
            expected = functional_call(module, self.spec.unflatten(vector), (x,))
            got = self.logits(vector[self.index.to(self.device)], vector, self.features(vector, x, 64))
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            raise NotSplittable(f"{self.spec.arch}: the cut model differs from the module's by "
                                f"{float((got - expected).abs().max()):.3g}")

    def features(self, vector: Tensor, x: Tensor, chunk: int) -> Tensor:
        """The lower part of `vector` on `x` (no gradient), `chunk` samples at a time."""
        full = self.spec.unflatten(vector.to(self.device, torch.float32))
        params = {n: full[n] for n in self._lower_names}
        with torch.inference_mode():
            outs = [functional_call(self.lower, params, (x[i:i + chunk],))
                    for i in range(0, x.shape[0], chunk)]
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).clone()

    def logits(self, head: Tensor, vector: Tensor, features: Tensor) -> Tensor:
        """The upper part with the head's parameters from `head` ([numel], differentiable) and
        any statistics it holds from `vector`."""
        params: dict[str, Tensor] = {}
        offset = 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            params[name] = head[offset:offset + n].view(shape)
            offset += n
        if self.buffers:
            full = self.spec.unflatten(vector)
            params.update({n: full[n] for n in self.buffers})
        return functional_call(self.upper, params, (features,))


class NotFusable(ValueError):
    """The model is not a stack of conv3x3/ReLU/max-pool blocks followed by an MLP."""


class FusedPlan:
    """The forward pass of conv3x3(pad 1) -> ReLU -> max-pool 2 blocks and an MLP, rewritten
    for speed on CPU with the same float32 arithmetic (sums in another order: ~1e-7).

    Read off the module's children (Conv2d then Linear, registered in forward order, the
    zoo's layout); the evaluator checks the result against the module itself before use.
    """

    WINDOW_MAX_IN_CHANNELS = 4
    """A first conv with at most this many input channels runs as window GEMMs (oneDNN is
    slow with 1-3 input channels: cnn28's conv1 ran at ~13 GFLOP/s against ~180 for conv2)."""

    def __init__(self, module: nn.Module, spec: ModelSpec) -> None:
        convs: list[str] = []
        linears: list[str] = []
        names: list[str] = []
        for name, child in module.named_children():
            if isinstance(child, nn.Conv2d):
                if linears:
                    raise NotFusable(f"{spec.arch}: conv {name} after a linear layer")
                if (child.kernel_size != (3, 3) or child.padding != (1, 1) or child.stride != (1, 1)
                        or child.dilation != (1, 1) or child.groups != 1 or child.bias is None
                        or child.padding_mode != "zeros"):
                    raise NotFusable(f"{spec.arch}: conv {name} is not a biased 3x3, padding 1, stride 1 conv")
                convs.append(name)
            elif isinstance(child, nn.Linear) and child.bias is not None:
                linears.append(name)
            else:
                raise NotFusable(f"{spec.arch}: layer {name} ({type(child).__name__}) has no fused form")
            names += [f"{name}.weight", f"{name}.bias"]
        if not convs or not linears or tuple(names) != spec.names:
            raise NotFusable(f"{spec.arch}: parameters {spec.names} are not convs then linears")
        channels, height, width = spec.input_shape
        self.shapes: list[tuple[int, int, int]] = []  # (C, H, W) after each block
        for name in convs:
            conv = getattr(module, name)
            if conv.in_channels != channels:
                raise NotFusable(f"{spec.arch}: {name} takes {conv.in_channels} channels, gets {channels}")
            channels, height, width = conv.out_channels, height // 2, width // 2
            self.shapes.append((channels, height, width))
        if getattr(module, linears[0]).in_features != channels * height * width:
            raise NotFusable(f"{spec.arch}: {linears[0]} does not take the flattened last block")
        self.convs, self.linears = convs, linears
        self.window = spec.input_shape[0] <= self.WINDOW_MAX_IN_CHANNELS
        """First conv as window GEMMs; else all convs are oneDNN convs."""

    def windows(self, x: Tensor) -> Tensor:
        """[n, C, H, W] -> [n * H/2 * W/2, C * 16]: the 4x4 (zero-padded) input window under
        every 2x2 pool window of the first conv's output, ordered (c, dy, dx)."""
        n, c, h, w = x.shape
        xp = F.pad(x.contiguous(), (1, 1, 1, 1))
        s = xp.stride()
        view = xp.as_strided((n, h // 2, w // 2, c, 4, 4), (s[0], 2 * s[2], 2 * s[3], s[1], s[2], s[3]))
        return view.reshape(n * (h // 2) * (w // 2), c * 16)

    def prepare(self, params: dict[str, Tensor]) -> list[Tensor]:
        """One model's weights in the layouts `forward` wants (once per model per call)."""
        out: list[Tensor] = []
        for i, name in enumerate(self.convs):
            weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
            if i == 0 and self.window:
                co, ci = weight.shape[:2]
                # the 3x3 kernel at each of the 4 offsets of a 2x2 pool window inside a 4x4
                # window: one [ci * 16, co] matrix per pool position
                for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
                    w4 = weight.new_zeros(co, ci, 4, 4)
                    w4[:, :, dy : dy + 3, dx : dx + 3] = weight
                    out.append(w4.reshape(co, ci * 16).t().contiguous())
                out.append(bias)
            else:
                out += [weight.contiguous(memory_format=torch.channels_last), bias]
        c, h, w = self.shapes[-1]
        for i, name in enumerate(self.linears):
            weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
            if i == 0:  # the features come NHWC-flattened: permute the weight, not the data
                weight = weight.reshape(-1, c, h, w).permute(0, 2, 3, 1).reshape(weight.shape[0], -1)
            out += [weight.contiguous(), bias]
        return out

    def forward(self, weights: list[Tensor], x: Tensor | None, windows: Tensor | None, n: int) -> Tensor:
        """Logits [n, classes] of one model on n samples: `windows` (from `windows()`) when the
        first conv is window GEMMs, else `x` (channels_last)."""
        if self.window:
            a, i = self.window_block(weights, windows, n), 5
        else:
            a, i = x.permute(0, 2, 3, 1), 0  # NHWC view of channels_last
        end = 2 * len(self.convs) + (3 if self.window else 0)
        while i < end:
            a = pool_relu(self.conv(a, weights[i], weights[i + 1]))
            i += 2
        return self.mlp(weights[i:], a.reshape(n, -1))

    def window_block(self, weights: list[Tensor], windows: Tensor, n: int) -> Tensor:
        """relu(maxpool(conv1)) as NHWC [n, h, w, c]: conv1 at each pool position by a GEMM
        over the windows, max-accumulated (4 small GEMMs on contiguous tensors; one GEMM of
        4c columns and maxima of its column blocks was ~2x slower)."""
        c, h, w = self.shapes[0]
        a = torch.mm(windows, weights[0])
        z = torch.empty_like(a)
        for pos in (1, 2, 3):
            a = torch.maximum(a, torch.mm(windows, weights[pos], out=z), out=a)
        return a.add_(weights[4]).relu_().view(n, h, w, c)  # max(z) + b == max(z + b)

    @staticmethod
    def conv(a: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """3x3 conv of NHWC `a` (oneDNN, channels_last) -> NHWC view of the output."""
        return F.conv2d(a.permute(0, 3, 1, 2), weight, bias, padding=1).permute(0, 2, 3, 1)

    @staticmethod
    def mlp(weights: list[Tensor], h: Tensor) -> Tensor:
        """Linear layers with ReLU between them (weights, biases alternating)."""
        for i in range(0, len(weights), 2):
            h = F.linear(h, weights[i], weights[i + 1])
            if i + 2 < len(weights):
                h = h.relu_()
        return h


def pool_relu(a: Tensor) -> Tensor:
    """relu(max_pool2d(., 2)) of an NHWC tensor (channels innermost) -> contiguous NHWC: three
    elementwise maxima of strided views (vectorized along channels; ATen's channels_last
    max_pool2d was ~3x slower here), the ReLU on the 4x smaller result."""
    n, h, w, c = a.shape
    v = a[:, : h // 2 * 2, : w // 2 * 2].unflatten(1, (h // 2, 2)).unflatten(3, (w // 2, 2))
    out = torch.maximum(v[:, :, 0, :, 0], v[:, :, 0, :, 1])
    out = torch.maximum(out, v[:, :, 1, :, 0], out=out)
    out = torch.maximum(out, v[:, :, 1, :, 1], out=out)
    return out.relu_()


class _Workers:
    """`count` threads, each with ONE intra-op torch thread, for coarse-grained parallelism
    (whole (model, chunk) runs instead of one OpenMP team per small op)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pool = ThreadPoolExecutor(count, thread_name_prefix="proxy-eval")
        ready = threading.Barrier(count)
        restore = torch.get_num_threads()

        def single_threaded() -> None:
            torch.ones(1 << 16).sum()  # first op: torch's lazy per-thread init happens now
            torch.set_num_threads(1)  # this thread's OpenMP/MKL setting...
            ready.wait()  # (every task holds its own thread: `count` distinct threads)

        for f in [self.pool.submit(single_threaded) for _ in range(count)]:
            f.result()
        torch.set_num_threads(restore)  # ...but also the default of threads started later

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        for f in [self.pool.submit(t) for t in tasks]:
            f.result()


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
