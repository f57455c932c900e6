"""CDFL aggregator throughput: naive vs batched evaluation, and the evaluation's GFLOP/s.

cnn28, K = 4 clusters, 1000 random 28x28 proxy samples per cluster (random inputs cost the
same as real ones). Side by side in one run, on CUDA when available, else this CPU:

- updates/s of CDFL with the naive evaluator (one upload, one proxy set at a time through a
  regular nn.Module, NCHW, one batch of 1000) against `update_many` on queued batches of
  8/16/32 uploads through ProxyEvaluator. Both keep the same F(w_k; D_k) cache, so the ratio
  is the evaluation alone;
- GFLOP/s of the evaluation (forward FLOPs of cnn28 counted per layer, 2 x MACs of the
  model's convs and linears as written, whatever a formulation actually computes) for each
  formulation (fused, the CPU default; stacked NCHW big batch and channels_last small chunks;
  vmap; torch.compile), against a dense float32 2048 x 2048 matmul with all torch threads,
  measured before and after the evaluations (the higher of the two is the reference: the
  machine is shared, and a slow matmul would flatter the ratio);
- where the time goes, per layer, for the old stacked path and the fused one.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from aggregator.cdfl import CDFL
from aggregator.evaluator import FusedPlan, ProxyEvaluator, pool_relu
from aggregator.strategy import Upload
from fedmq.models import build_model, model_spec, to_vector

ARCH = "cnn28"
K = 4


def forward_flops(arch: str) -> int:
    """Forward FLOPs per sample (2 x multiply-accumulates of convs and linears)."""
    model = build_model(arch, seed=0).eval()
    total = 0

    def conv_hook(mod: nn.Conv2d, _inp, out) -> None:
        nonlocal total
        kh, kw = mod.kernel_size
        total += 2 * out[0].numel() * (mod.in_channels // mod.groups) * kh * kw

    def linear_hook(mod: nn.Linear, _inp, out) -> None:
        nonlocal total
        total += 2 * mod.in_features * mod.out_features

    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(conv_hook)
        elif isinstance(m, nn.Linear):
            m.register_forward_hook(linear_hook)
    with torch.no_grad():
        model(torch.zeros(1, *model_spec(arch).input_shape))
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def best_seconds(fn, device: torch.device, repeats: int, warmup: bool = True) -> float:
    """Best of `repeats` (at least one) after one warm-up: the machine is shared, the minimum
    is the signal."""
    if warmup:
        fn()
        _sync(device)
    best = float("inf")
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return 2 * n**3 / best_seconds(lambda: a @ b, device, repeats) / 1e9


def layer_breakdown(device: torch.device, n: int, repeats: int) -> dict:
    """Where the forward time of cnn28 goes (chunks of 64, channels_last on CPU): ms and GFLOP/s
    per stage over n samples. Explains the gap to the matmul rate."""
    model = build_model(ARCH, seed=0).to(device).eval()
    chunk = 64 if device.type == "cpu" else n
    fmt = torch.channels_last if device.type == "cpu" else torch.contiguous_format
    model = model.to(memory_format=fmt)
    x = torch.randn(n, 1, 28, 28, device=device).contiguous(memory_format=fmt)
    with torch.inference_mode():
        a1 = model.conv1(x)
        p1 = torch.max_pool2d(torch.relu(a1), 2)
        a2 = model.conv2(p1)
        p2 = torch.max_pool2d(torch.relu(a2), 2).flatten(1)
        stages = {
            "conv1": (lambda t: model.conv1(t), x, 2 * 28 * 28 * 16 * 9),
            "relu_pool1": (lambda t: torch.max_pool2d(torch.relu(t), 2), a1, 0),
            "conv2": (lambda t: model.conv2(t), p1, 2 * 14 * 14 * 32 * 16 * 9),
            "relu_pool2": (lambda t: torch.max_pool2d(torch.relu(t), 2), a2, 0),
            "fc1_fc2": (lambda t: model.fc2(torch.relu(model.fc1(t))), p2, 2 * (1568 * 64 + 640)),
        }
        out = {}
        for name, (fn, inp, flops) in stages.items():
            dt = best_seconds(lambda fn=fn, inp=inp: [fn(inp[i : i + chunk]) for i in range(0, n, chunk)],
                              device, repeats)
            out[name] = {"ms": round(dt * 1e3, 1), "gflops": round(n * flops / dt / 1e9, 1) if flops else None}
    return out


def layer_breakdown_fused(ev: ProxyEvaluator, vector: torch.Tensor, repeats: int) -> dict:
    """The fused formulation's stages over all proxy samples, in its chunks, split over its
    workers as in a real call: ms and GFLOP/s (true FLOPs of the layers each stage covers)."""
    plan = ev.plan
    assert isinstance(plan, FusedPlan) and plan.window and len(plan.convs) == 2
    n_total, chunk = ev.x.shape[0], ev.chunk
    weights = plan.prepare(ev.spec.unflatten(vector))
    windows = plan.windows(ev.x)
    (c1, h1, w1), (c2, _, _) = plan.shapes
    c0 = ev.spec.input_shape[0]
    starts = list(range(0, n_total, chunk))

    def size(i: int) -> int:
        return min(chunk, n_total - i)

    def win(i: int) -> torch.Tensor:
        return windows[i * h1 * w1 : (i + size(i)) * h1 * w1]

    with torch.inference_mode():
        p1 = {i: plan.window_block(weights, win(i), size(i)) for i in starts}
        a2 = {i: plan.conv(p1[i], weights[5], weights[6]) for i in starts}
        p2 = {i: pool_relu(a2[i]).reshape(size(i), -1) for i in starts}
    shape_of = dict(zip(ev.spec.names, ev.spec.shapes, strict=True))
    fc_flops = 2 * sum(math.prod(shape_of[f"{name}.weight"]) for name in plan.linears)
    stages = {
        "conv1_pool1_relu": (lambda i: plan.window_block(weights, win(i), size(i)), 2 * 4 * h1 * w1 * c1 * c0 * 9),
        "conv2": (lambda i: plan.conv(p1[i], weights[5], weights[6]), 2 * h1 * w1 * c2 * c1 * 9),
        "pool2_relu": (lambda i: pool_relu(a2[i]), 0),
        "fc1_fc2": (lambda i: plan.mlp(weights[7:], p2[i]), fc_flops),
    }
    count = ev.workers.count if ev.workers is not None else 1
    spans = [starts[k::count] for k in range(count)]
    out = {}
    for name, (fn, flops) in stages.items():
        def part(span: list[int], fn=fn) -> None:
            with torch.inference_mode():
                for i in span:
                    fn(i)

        def stage(part=part) -> None:
            if ev.workers is None:
                part(spans[0])
            else:
                ev.workers.run([lambda s=s: part(s) for s in spans])

        dt = best_seconds(stage, torch.device("cpu"), repeats)
        out[name] = {"ms": round(dt * 1e3, 1), "gflops": round(n_total * flops / dt / 1e9, 1) if flops else None}
    return out


class NaiveEvaluator(ProxyEvaluator):
    """losses() and cluster losses one vector and one proxy set at a time through a regular
    nn.Module."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, formulation="stacked", **kwargs)

    def losses(self, vectors: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[self.losses_naive(v, k) for k in range(self.num_sets)] for v in vectors])

    def loss_on(self, vector: torch.Tensor, k: int) -> float:
        return self.losses_naive(vector, k)


def make_uploads(clusters: torch.Tensor, n: int, seed: int) -> list[Upload]:
    g = torch.Generator().manual_seed(seed)
    return [Upload(f"agent{i % 50}", clusters[i % K] + 0.01 * torch.randn(clusters.shape[1], generator=g), tau=0)
            for i in range(n)]


def random_world(n_proxy: int, seed: int = 0, arch: str = ARCH,
                 k: int = K) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """K proxy sets of random inputs and labels of the model's shape (28x28 for cnn28), and K
    freshly initialized vectors (random inputs cost the same as real ones)."""
    g = torch.Generator().manual_seed(seed)
    spec = model_spec(arch)
    proxies = [(torch.randn(n_proxy, *spec.input_shape, generator=g),
                torch.randint(0, spec.num_classes, (n_proxy,), generator=g)) for _ in range(k)]
    return proxies, torch.stack([to_vector(build_model(arch, seed=i)) for i in range(k)])


def run(quick: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_proxy = 250 if quick else 1000
    repeats = 2 if quick else 4
    spec = model_spec(ARCH)
    proxies, clusters = random_world(n_proxy)
    flops_per_sample = forward_flops(ARCH)
    out: dict = {"device": str(device), "torch_threads": torch.get_num_threads(), "arch": ARCH, "K": K,
                 "proxy_per_cluster": n_proxy, "forward_mflop_per_sample": round(flops_per_sample / 1e6, 3)}
    matmul_runs = [round(matmul_gflops(device), 1)]

    # -- evaluation rate per formulation: M vectors on all K proxy sets
    m = 4 if quick else 8
    vectors = torch.stack([clusters[i % K] + 0.01 * i for i in range(m)])
    work = m * K * n_proxy * flops_per_sample
    on_cpu = device.type == "cpu"
    variants = {
        "naive_nchw_per_set": dict(cls=NaiveEvaluator),
        "stacked_nchw_batch1000": dict(formulation="stacked", chunk=1000, channels_last=False),
        "stacked_channels_last_chunk16": dict(formulation="stacked", chunk=16, channels_last=True),
        "stacked_channels_last_chunk32": dict(formulation="stacked", chunk=32, channels_last=True),
        "stacked_channels_last_chunk64": dict(formulation="stacked", chunk=64, channels_last=True),
        "stacked_channels_last_chunk128": dict(formulation="stacked", chunk=128, channels_last=True),
        "vmap_chunk250": dict(formulation="vmap", chunk=250, channels_last=False),
        "fused_chunk32": dict(formulation="fused", chunk=32),
        "fused_chunk64": dict(formulation="fused", chunk=64),
        "fused_chunk128": dict(formulation="fused", chunk=128),
        # the same ops run by one caller with a torch.get_num_threads() OpenMP team per op
        "fused_chunk64_one_thread_team": dict(formulation="fused", chunk=64, workers=1),
    }
    if not on_cpu:
        variants = {"naive_nchw_per_set": dict(cls=NaiveEvaluator),
                    "stacked_batch4000": dict(chunk=K * n_proxy),
                    "stacked_batch1000": dict(chunk=1000),
                    "vmap_chunk1000": dict(formulation="vmap", chunk=1000)}
    default = ProxyEvaluator(spec, proxies, device=str(device))
    default_name = f"fused_chunk{default.chunk}" if default.formulation == "fused" else "stacked_batch4000"
    out["eval_default_formulation"] = default.formulation
    evaluators: dict[str, ProxyEvaluator] = {}
    for name, opts in variants.items():
        opts = dict(opts)
        cls = opts.pop("cls", ProxyEvaluator)
        evaluators[name] = cls(spec, proxies, device=str(device), **opts)
    try:
        t0 = time.perf_counter()
        ev = ProxyEvaluator(spec, proxies, device=str(device), formulation="stacked", compile=True)
        ev.losses(vectors[:1])
        out["compile_seconds"] = round(time.perf_counter() - t0, 1)
        evaluators["compiled_stacked" + ("_channels_last_chunk64" if on_cpu else "")] = ev
    except Exception as e:  # compile needs a working C++ toolchain; report, don't fail
        out["compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    # Interleaved rounds, best per variant: on a shared machine every variant (and the
    # matmul) gets its chances at the quiet moments, instead of one variant getting all.
    seconds = {name: float("inf") for name in evaluators}
    for e in evaluators.values():
        e.losses(vectors)  # warm-up
    for _ in range(repeats):
        for name, e in evaluators.items():
            seconds[name] = min(seconds[name], best_seconds(lambda e=e: e.losses(vectors), device, 0, warmup=False))
        matmul_runs.append(round(matmul_gflops(device), 1))
    rates = {name: round(work / dt / 1e9, 2) for name, dt in seconds.items()}
    out["matmul_gflops_runs"] = matmul_runs
    out["matmul_gflops"] = max(matmul_runs)
    out["eval_gflops"] = rates
    out["layer_breakdown"] = layer_breakdown(device, K * n_proxy, repeats)
    if on_cpu and "fused_chunk64" in evaluators:
        out["layer_breakdown_fused_chunk64"] = layer_breakdown_fused(evaluators["fused_chunk64"], vectors[0], repeats)
    best_name = max(rates, key=rates.get)
    out["eval_best"] = best_name
    out["eval_best_fraction_of_matmul"] = round(rates[best_name] / out["matmul_gflops"], 3)
    out["eval_default"] = default_name
    out["eval_default_fraction_of_matmul"] = round(rates[default_name] / out["matmul_gflops"], 3)
    if on_cpu:
        out["eval_old_default_fraction_of_matmul"] = round(rates["stacked_channels_last_chunk64"]
                                                           / out["matmul_gflops"], 3)

    # -- CDFL updates per second: naive vs batched update_many (best of `repeats` passes
    # over the same queue; the clusters move between passes but the work is the same)
    n_naive = 4 if quick else 8
    naive = CDFL(spec, clusters, proxies, evaluator=NaiveEvaluator(spec, proxies, device=str(device)), tau0=10**6)
    queue = make_uploads(clusters, n_naive, seed=1)
    dt = best_seconds(lambda: [naive.update(u) for u in queue], device, repeats - 1)
    ups = {"naive": round(n_naive / dt, 3)}
    batched = {f"batched_{b}": (b, None) for b in ([8] if quick else [8, 16, 32])}
    if on_cpu:  # the old default, for comparison
        batched[f"batched_{8 if quick else 32}_stacked"] = (8 if quick else 32, evaluators["stacked_channels_last_chunk64"])
    if "compile_seconds" in out:
        batched[f"batched_{8 if quick else 32}_compiled_stacked"] = (8 if quick else 32, ev)
    for name, (batch, evaluator) in batched.items():
        s = CDFL(spec, clusters, proxies, device=str(device), tau0=10**6, evaluator=evaluator)
        queue = make_uploads(clusters, batch, seed=3)
        dt = best_seconds(lambda s=s, queue=queue: s.update_many(queue), device, repeats - 1)
        ups[name] = round(batch / dt, 3)
    out["updates_per_s"] = ups
    out["batched_speedup_over_naive"] = {k: round(v / ups["naive"], 2) for k, v in ups.items() if k != "naive"}
    return out
