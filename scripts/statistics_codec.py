"""What each codec does to a batch-norm model: a scenario's pre-trained clusters, their uniform
mixture sent through every codec, scored on each cluster's test set.

    python scripts/statistics_codec.py [--scenario realsize-shapes-mobilenet] [--seed 0] [--out FILE]

The mixture is what a CDFL join sends. Rows: exact; int8 with the running statistics sent as
float32 (the default, `codec.exact_statistics`); int8 on everything; the parameters int8 with
the statistics exact, and the other way round (which half does the damage); fp16. The
pre-training comes from the cache a fleet of the same scenario and seed wrote (else it runs:
5-8 minutes for MobileNetV3-small on 2 cores). docs/codecs.md reads it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.bootstrap import pretrain_clusters  # noqa: E402
from fedmq import codecs  # noqa: E402
from fedmq.errors import ArgumentParser, run_main  # noqa: E402
from fedmq.models import build_model, load_vector, model_spec, resolve_model_name  # noqa: E402
from sim.fleet import RunSpec, configure  # noqa: E402
from sim.scenarios import build_clusters, get_scenario  # noqa: E402

TEST_PER_CLUSTER = 500


def rows(mixture: np.ndarray, statistics: int) -> dict[str, np.ndarray]:
    """The mixture as each row's receiver decodes it."""
    cut = mixture.size - statistics

    def sent(codec: str, exact: int = 0) -> np.ndarray:
        return codecs.decode(codecs.encode(mixture, codec, exact=exact))

    blocks = sent("int8")
    return {
        "exact (fp32)": mixture,
        "int8, statistics as float32 (the default)": sent("int8", statistics),
        "int8 on everything": blocks,
        "parameters int8, statistics exact": np.concatenate([blocks[:cut], mixture[cut:]]),
        "parameters exact, statistics int8": np.concatenate([mixture[:cut], blocks[cut:]]),
        "fp16": sent("fp16"),
    }


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="realsize-shapes-mobilenet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the table as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the fleets' pre-training cache is keyed by the thread count
    scenario = get_scenario(args.scenario)
    _, cfg = configure(RunSpec(scenario=args.scenario, clusters=scenario.clusters, seed=args.seed))
    model = resolve_model_name(cfg.model, cfg.data.dataset)
    data = build_clusters(scenario, cfg, scenario.clusters)
    vectors = pretrain_clusters(cfg, data, model)
    spec = model_spec(model)
    mixture = torch.stack(vectors).mean(0).numpy()
    tests = [data.test(k, TEST_PER_CLUSTER) for k in range(scenario.clusters)]
    table = {}
    for name, vector in rows(mixture, spec.statistics_numel).items():
        net = load_vector(build_model(model), torch.from_numpy(vector.copy())).eval()
        with torch.inference_mode():
            table[name] = [round(float((net(t.x).argmax(1) == t.y).float().mean()), 3) for t in tests]
        print(f"{name:45s} " + " ".join(f"{a:.3f}" for a in table[name]))
    print(f"{spec.statistics_numel} of {spec.numel} values are running statistics")
    if args.out:
        Path(args.out).write_text(json.dumps({"scenario": args.scenario, "seed": args.seed, "model": model,
                                              "statistics": spec.statistics_numel, "values": spec.numel,
                                              "accuracy_per_cluster": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("statistics_codec", main))
