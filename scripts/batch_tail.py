"""What a short last batch does to a batch-norm model's local update: a scenario's pre-trained
mixture (what a joining agent holds) trained as an agent trains it, on n images whose last
batch holds 0, 2, 3, 4, 8 or 16, once with the tail kept and once as `fit` trains it now.

    python scripts/batch_tail.py [--scenario realsize-shapes-mobilenet] [--seed 1] [--out FILE]

The images are drawn evenly from the clusters' proxy pools (the rotations an agent's data
mixes); the settings are the agent's (`agent.epochs`, `agent.batch_size`, `agent.lr`,
`agent.momentum`). Each row: the step's length ||v - start|| and the mean accuracy over the
clusters' test sets, two draws each. The pre-training comes from the cache a fleet of the same
scenario and seed wrote (else it runs: 5-8 minutes for MobileNetV3-small on 2 cores).
docs/models.md reads it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.bootstrap import pretrain_clusters  # noqa: E402
from fedmq.errors import ArgumentParser, run_main  # noqa: E402
from fedmq.models import resolve_model_name  # noqa: E402
from fedmq.training import evaluate, fit  # noqa: E402
from sim.fleet import RunSpec, configure  # noqa: E402
from sim.scenarios import build_clusters, get_scenario  # noqa: E402

TAILS = (0, 2, 3, 4, 8, 16)
DRAWS = 2
TEST_PER_CLUSTER = 300


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="realsize-shapes-mobilenet")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batches", type=int, default=7, help="full batches before the tail (default 7)")
    p.add_argument("--out", help="also write the table as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the plan, compute nothing")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the fleets' pre-training cache is keyed by the thread count
    scenario = get_scenario(args.scenario)
    _, cfg = configure(RunSpec(scenario=args.scenario, clusters=scenario.clusters, seed=args.seed))
    model = resolve_model_name(cfg.model, cfg.data.dataset)
    a = cfg.agent
    print(f"{args.scenario} seed {args.seed}: {model}, tails {', '.join(map(str, TAILS))} after {args.batches} "
          f"batches of {a.batch_size}, {DRAWS} draws, {a.epochs} epochs at {a.lr}"
          + (" (dry run: nothing computed)" if args.dry_run else ""), flush=True)
    if args.dry_run:
        return 0
    data = build_clusters(scenario, cfg, scenario.clusters)
    start = torch.stack(pretrain_clusters(cfg, data, model)).mean(0)
    tests = [data.test(k, TEST_PER_CLUSTER) for k in range(scenario.clusters)]
    pools = [data.proxy(k) for k in range(scenario.clusters)]

    def accuracy(v: torch.Tensor) -> float:
        if not bool(torch.isfinite(v).all()):
            return 0.0
        return sum(evaluate(model, v, t.x, t.y)[0] for t in tests) / len(tests)

    rows = []
    print(f"start: accuracy {accuracy(start):.3f}")
    gen = torch.Generator().manual_seed(args.seed)
    for tail in TAILS:
        n = args.batches * a.batch_size + tail
        for draw in range(DRAWS):
            cluster = torch.arange(n) % len(pools)
            picks = [pools[k] for k in cluster.tolist()]
            idx = [int(torch.randint(0, len(q.y), (1,), generator=gen)) for q in picks]
            x = torch.stack([q.x[i] for q, i in zip(picks, idx, strict=True)])
            y = torch.stack([q.y[i] for q, i in zip(picks, idx, strict=True)])
            for rule, min_batch in (("tail kept", 2), ("fit", None)):
                r = fit(model, start, x, y, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr,
                        optimizer=a.optimizer, momentum=a.momentum, seed=draw, min_batch=min_batch)
                step = float(torch.linalg.vector_norm(r.vector.double() - start.double()))
                row = {"tail": tail, "n": n, "draw": draw, "rule": rule, "steps": r.steps,
                       "step_length": step if math.isfinite(step) else None,
                       "accuracy": round(accuracy(r.vector), 3)}
                rows.append(row)
                print(f"tail {tail:2d} (n={n}) draw {draw} {rule:9s}: step {step:9.3g}, accuracy {row['accuracy']:.3f}",
                      flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"scenario": args.scenario, "seed": args.seed, "model": model,
                                              "start_accuracy": round(accuracy(start), 3), "rows": rows},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("batch_tail", main))
