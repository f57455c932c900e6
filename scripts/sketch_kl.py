"""The sketch estimator's KL over a fleet's own draws, for several `cdfl.sketch_shrinkage` values.

    python scripts/sketch_kl.py --clusters 2,4 --seeds 0,1,2 [--shrinkage 1,0.25] [sim.ablation's data flags]

Each (K, seed) fleet of `python -m sim.ablation` draws the same per-cycle data here
(`make_schedule` + `draw_cycle`, the ablation's defaults for agents and updates per agent), and
each draw's sketch is fitted to the clusters' reference sketches (`sketch_references`) with
every shrinkage given (1 = the plain least-squares fit). No model is trained, so this
takes minutes where the fleets take hours; it measures the estimator alone, not what its
alpha does to the replies. docs/results_cdfl.md#estimation reads it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.bootstrap import sketch_references  # noqa: E402
from aggregator.estimators import kl_divergence, normalize_simplex  # noqa: E402
from fedmq.config import add_config_arguments, config_from_args, dataset_named  # noqa: E402
from fedmq.errors import ArgumentParser, run_main  # noqa: E402
from fedmq.sketch import SketchFit, check_shrinkage, data_sketch  # noqa: E402
from sim.ablation import AblationSpec  # noqa: E402
from sim.fleet import configure, make_schedule  # noqa: E402
from sim.scenarios import build_clusters, draw_cycle, resolve_scenario  # noqa: E402
from sim.seeds import int_list, seed_list  # noqa: E402


def fleet_kl(spec: AblationSpec, base, shrinkages: list[float]) -> dict[str, float]:
    """Mean KL(true alpha || estimate) over the fleet's uploads, per shrinkage, and under
    "uniform" the KL of guessing the uniform mixture: a sketch that does no better than that
    carries nothing about the mixture (the clusters' inputs look alike)."""
    scenario, cfg = configure(spec.run_spec("cdfl", base), base)
    clusters = build_clusters(scenario, cfg, spec.clusters)
    proxies = [(p.x, p.y) for p in (clusters.proxy(k, cfg.data.proxy_per_cluster or None)
                                    for k in range(spec.clusters))]
    refs = sketch_references(cfg, clusters, proxies) or [x for x, _ in proxies]
    schedule = make_schedule(spec.seed, spec.run_spec("cdfl").resolved_agents(), spec.updates_per_agent)
    draws = [draw_cycle(scenario, clusters, cfg, spec.seed, a, c, spec.test_samples)[0] for a, c in schedule]
    uploads = [data_sketch(d.data.x) for d in draws]  # once, whatever the shrinkages
    out = {}
    for s in shrinkages:
        fit = SketchFit(refs, s)
        kls = []
        for d, x in zip(draws, uploads, strict=True):
            est = fit.mixture(x)
            kls.append(kl_divergence(d.alpha, normalize_simplex(est, cfg.cdfl.sketch_floor)[0]))
        out[f"{s:g}"] = float(np.mean(kls))
    uniform = normalize_simplex(np.full(spec.clusters, 1.0 / spec.clusters), cfg.cdfl.sketch_floor)[0]
    out["uniform"] = float(np.mean([kl_divergence(d.alpha, uniform) for d in draws]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python scripts/sketch_kl.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", help="as for sim.ablation (default rotated-digits, or the --data-dir's)")
    p.add_argument("--clusters", default="2,4", help="K or a comma list")
    p.add_argument("--seeds", default="1", help="N (seeds 0..N-1) or a comma list")
    p.add_argument("--agents", type=int, default=0, help="agents per fleet (default 20*K)")
    p.add_argument("--updates-per-agent", type=float, default=3.0)
    p.add_argument("--shrinkage", default="1,0.25", help="cdfl.sketch_shrinkage values, comma list")
    p.add_argument("--dry-run", action="store_true", help="print the plan, compute nothing")
    add_config_arguments(p, ("data_dir", "seed"))
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    scenario = resolve_scenario(args.scenario, cfg, args.data_dir, dataset_named(args)).name
    shrinkages = [float(s) for s in args.shrinkage.split(",") if s.strip()]
    try:
        shrinkages = [check_shrinkage(s, "--shrinkage") for s in shrinkages]
    except ValueError as e:
        p.error(str(e))
    ks, seeds = int_list(args.clusters, "--clusters", minimum=1), seed_list(args.seeds, cfg.seed)
    print(f"{scenario}, K {', '.join(map(str, ks))} x seeds {', '.join(map(str, seeds))}, "
          f"shrinkage {', '.join(f'{s:g}' for s in shrinkages)}"
          + (" (dry run: nothing computed)" if args.dry_run else ""), flush=True)
    if args.dry_run:
        return 0
    for k in ks:
        for seed in seeds:
            spec = AblationSpec(scenario=scenario, clusters=k, seed=seed, agents=args.agents,
                                updates_per_agent=args.updates_per_agent)
            print(json.dumps({"K": k, "seed": seed, "kl": fleet_kl(spec, cfg, shrinkages)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python scripts/sketch_kl.py", main))
