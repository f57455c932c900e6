"""CDFL's cost per upload for each reply and cluster-update variant, side by side.

The accuracy of each variant is measured on rotated digits by `python -m sim.ablation`
(docs/results_cdfl.md); this is its price on a model the size of a real one: cnn28, K = 4,
1000 random 28x28 proxy samples per cluster (random inputs cost the same as real ones), the
sketch estimator (the default), on CUDA when available, else this CPU. Every variant handles
the same uploads, one at a time through `CDFL.update` (estimate + cluster update + reply),
and reports the median seconds per upload and where they went (estimate, reply training,
cluster refresh). The rows take turns: each round times one upload of every row, in an order
rotated per round, so a slow spell of a shared machine hits every row alike; `x_default` is
the median over rounds of each row's time over the default's in the same round, with the
range it spanned. The ratios within one run are the figures to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from aggregator.cdfl import CDFL
from aggregator.strategy import Upload
from bench.bench_aggregator import ARCH, K, random_world
from fedmq.config import CDFLSettings
from fedmq.models import model_spec
from fedmq.sketch import data_sketch

DEFAULT = "default (mixture start, finetune-ep8, rho 0.1, delta, refresh 1)"
VARIANTS: dict[str, dict] = {
    "paper (mixture, no refresh)": {"personalization": "mixture", "cluster_refresh_steps": 0,
                                    "update_rule": "alpha"},
    DEFAULT: {},
    "upload start, alpha rule": {"personalize_start": "upload", "update_rule": "alpha"},
    "no refresh": {"cluster_refresh_steps": 0},
    "no proximal term (rho 0, before)": {"personalize_rho": 0.0},
    "finetune-ep2": {"personalize_epochs": 2},
    "finetune-ep16": {"personalize_epochs": 16},
    "finetune-bs32": {"personalize_batch_size": 32},
    "samples512": {"personalize_samples": 512},
    "samples256": {"personalize_samples": 256},
    "distill-ep8": {"personalization": "distill"},
    "head (personalize_layers=head)": {"personalize_layers": "head"},
}
"""Name -> CDFLSettings fields that differ from the defaults."""
SMALL_SERVER = 100
"""Proxy samples per cluster of the realistic-budget rows (docs/results_cdfl.md#the-reply):
there a reply's epochs hold few SGD steps, and cdfl.personalize_min_steps sets its price."""
SMALL = {f"{SMALL_SERVER} proxy/cluster, min-steps 0, rho 0": {"personalize_min_steps": 0, "personalize_rho": 0.0},
         f"{SMALL_SERVER} proxy/cluster, min-steps 64, rho 0": {"personalize_min_steps": 64, "personalize_rho": 0.0},
         f"{SMALL_SERVER} proxy/cluster, min-steps 128, rho 0 (before)": {"personalize_rho": 0.0},
         f"{SMALL_SERVER} proxy/cluster, min-steps 128, rho 0.1 (default)": {},
         f"{SMALL_SERVER} proxy/cluster, head": {"personalize_layers": "head"},
         f"{SMALL_SERVER} proxy/cluster, head, min-steps 64": {"personalize_layers": "head",
                                                              "personalize_min_steps": 64}}
"""Name -> settings for replies over small proxy sets (the same cnn28, K and uploads)."""
QUEUED = {"default, 8 queued, one by one": ("cnn28", 1), "default, 8 queued, trained together": ("cnn28", 8),
          "digits-cnn, 8 queued, one by one": ("digits-cnn", 1),
          "digits-cnn, 8 queued, trained together": ("digits-cnn", 8)}
"""Name -> (model, cdfl.reply_batch) for 8 uploads handled by one `update_many`, as the engine
does with a queue: torch.func batched replies against the same queue one reply at a time, on
cnn28 (compute-bound on a CPU) and the 14 k-parameter digits model (overhead-bound)."""


def time_upload(strategy: CDFL, clusters: torch.Tensor, sketch: torch.Tensor, i: int, device: str,
                g: torch.Generator) -> tuple[float, dict[str, float]]:
    """Seconds for upload `i` through `CDFL.update`, and where they went."""
    k = clusters.shape[0]
    v = clusters[i % k] + 0.01 * torch.randn(clusters.shape[1], generator=g)
    t0 = time.perf_counter()
    reply = strategy.update(Upload(f"agent{i}", v, tau=strategy.uploads_applied, sketch=sketch,
                                   base=clusters[i % k]))  # the delta rule needs it
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    info = reply.info
    return seconds, {"estimate": info.get("estimate_seconds", 0.0),
                     "reply": info.get("personalize", {}).get("seconds", 0.0),
                     "refresh": info.get("refresh_seconds", 0.0)}


def interleaved(rows: dict[str, tuple[CDFL, torch.Tensor, torch.Tensor]], rounds: int, device: str,
                reference: str) -> dict[str, dict]:
    """Every row's median seconds per upload over `rounds` rounds of one upload per row (order
    rotated per round), and its time over `reference`'s in the same round: median and range."""
    names = list(rows)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, dict[str, list[float]]] = {n: {"estimate": [], "reply": [], "refresh": []} for n in names}
    g = torch.Generator().manual_seed(1)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            strategy, clusters, sketch = rows[name]
            t, where = time_upload(strategy, clusters, sketch, r, device, g)
            seconds[name].append(t)
            for part, x in where.items():
                parts[name][part].append(x)
        print(f"round {r + 1}/{rounds}: default {seconds[reference][-1]:.3f} s", flush=True)
    out = {}
    for name in names:
        ratios = [a / b for a, b in zip(seconds[name], seconds[reference], strict=True)]
        out[name] = {"s_per_upload": round(statistics.median(seconds[name]), 4),
                     **{f"{part}_s": round(statistics.median(x), 4) for part, x in parts[name].items()},
                     "x_default": round(statistics.median(ratios), 3),
                     "x_default_range": [round(min(ratios), 3), round(max(ratios), 3)]}
    return out


def run(quick: bool = False, rows: Sequence[str] | None = None) -> dict:
    """Every row (or only `rows`, with the default as their reference)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_proxy = 250 if quick else 1000
    rounds = 2 if quick else 8
    spec = model_spec(ARCH)
    proxies, clusters = random_world(n_proxy)
    g = torch.Generator().manual_seed(1)
    # an agent's data: mostly cluster 0, some cluster 1 (the sketch estimator fits that)
    agent_x = torch.cat([proxies[0][0][:300], proxies[1][0][:100]])
    sketch = data_sketch(agent_x)
    out: dict = {"device": device, "torch_threads": torch.get_num_threads(), "arch": ARCH, "K": K,
                 "proxy_per_cluster": n_proxy, "rounds": rounds, "variants": {}}
    runs = [(name, fields, 0, ARCH, n_proxy) for name, fields in VARIANTS.items()]
    runs += [(name, fields, 0, ARCH, SMALL_SERVER) for name, fields in SMALL.items()]
    runs += [(name, {"reply_batch": batch}, 8, arch, n_proxy) for name, (arch, batch) in QUEUED.items()]
    if rows is not None:
        unknown = sorted(set(rows) - {r[0] for r in runs})
        if unknown:
            raise ValueError(f"unknown rows {unknown}; known: {[r[0] for r in runs]}")
        runs = [r for r in runs if r[0] in rows or r[0] == DEFAULT]
    worlds = {(ARCH, n_proxy): (spec, proxies, clusters, sketch)}
    timed: dict[str, tuple[CDFL, torch.Tensor, torch.Tensor]] = {}
    for name, fields, queued, arch, size in runs:
        if (arch, size) not in worlds:
            arch_proxies, arch_clusters = random_world(size, arch=arch)
            worlds[arch, size] = (model_spec(arch), arch_proxies, arch_clusters,
                                  data_sketch(torch.cat([arch_proxies[0][0][:300], arch_proxies[1][0][:100]])))
        spec, proxies, clusters, sketch = worlds[arch, size]
        settings = CDFLSettings(clusters=K, tau0=1000, **fields)
        strategy = CDFL.from_settings(spec, clusters, proxies, settings, device=device)
        strategy.join("warm-up")
        strategy.update(Upload("warm-up", clusters[0] + 0.01, tau=0, sketch=sketch))
        if not queued:
            timed[name] = (strategy, clusters, sketch)
            out["variants"][name] = {"settings": fields, **({"proxy_per_cluster": size} if size != n_proxy else {})}
            continue
        ups = [Upload(f"agent{i}", clusters[i % K] + 0.01 * torch.randn(spec.numel, generator=g),
                      tau=strategy.uploads_applied, sketch=sketch, base=clusters[i % K]) for i in range(queued)]
        t0 = time.perf_counter()
        strategy.update_many(ups)
        if device == "cuda":
            torch.cuda.synchronize()
        s_per = (time.perf_counter() - t0) / queued
        out["variants"][name] = {"settings": fields, "arch": arch, "queued": queued, "s_per_upload": round(s_per, 4)}
        print(f"{name:28s} {s_per:8.3f} s/upload", flush=True)
    for name, figures in interleaved(timed, rounds, device, DEFAULT).items():
        out["variants"][name].update(figures)
        print(f"{name:28s} {figures['s_per_upload']:8.3f} s/upload  x{figures['x_default']:.3f} "
              f"{figures['x_default_range']}", flush=True)
    base = out["variants"][DEFAULT]["s_per_upload"]
    for row in out["variants"].values():
        row.setdefault("x_default", round(row["s_per_upload"] / base, 3))  # queued rows: one timing each
    v = out["variants"]
    for prefix in ("default", "digits-cnn"):
        if f"{prefix}, 8 queued, trained together" not in v or f"{prefix}, 8 queued, one by one" not in v:
            continue
        v[f"{prefix}, 8 queued, trained together"]["speedup_vs_one_by_one"] = round(
            v[f"{prefix}, 8 queued, one by one"]["s_per_upload"]
            / v[f"{prefix}, 8 queued, trained together"]["s_per_upload"], 2)
    return out


def merge_rows(rows: Sequence[str], path: Path, quick: bool = False) -> dict:
    """Time `rows` (and the default, their reference) and write them into `path` (the figures
    of `python -m bench replies`), each with when and how it was measured; the other rows stay."""
    from fedmq.host import describe_host

    t0 = time.perf_counter()
    figures = run(quick, rows)
    doc = json.loads(path.read_text()) if path.exists() else {"benchmark": "replies", "figures": {"variants": {}}}
    stamp = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(time.perf_counter() - t0, 1),
             "load_before": round(os.getloadavg()[0], 1), "rounds": figures["rounds"],
             "torch_threads": figures["torch_threads"], "machine": describe_host()}
    for name, row in figures["variants"].items():
        doc["figures"]["variants"][name] = {**row, "measured": stamp}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="time some rows of `python -m bench replies` against the "
                                                 "default, interleaved, and merge them into the results file")
    parser.add_argument("--rows", required=True, help="comma-separated row names")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "replies.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for name, row in merge_rows(args.rows.split(","), args.out, args.quick)["variants"].items():
        print(f"{name:60s} {row['s_per_upload']:8.3f} s/upload  x{row.get('x_default', 1.0):.3f}", flush=True)
