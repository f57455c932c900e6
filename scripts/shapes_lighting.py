"""How a light on `shapes` trades learnability against what the sketch can see of a rotation.

    python scripts/shapes_lighting.py [--variants none,x0.5,x0.75,+0.1,+0.2,+0.3] [--clusters 4]

For each lighting (none; `xF`: each row's light falls from 1 at the top to F at the bottom;
`+R`: light added from +R at the top to -R at the bottom, what `shapes-lit` ships with R = 0.2),
the same images are drawn (fedmq.data.sources.shape_images), normalized by their own
statistics, and measured twice: cnn32-10 trained centrally (3 epochs of 2,000 train images,
seed 0) on the test split, and the sketch estimator's KL at K clusters over the real-size
fleet's draws (scripts/sketch_kl.py's `fleet_kl`, 20 agents x 5 updates, shrinkage 1). A light
the sketch sees but the model cannot learn through is no stand-in. About 15 s per variant.
docs/results_realsize.md reads it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from fedmq.config import Config  # noqa: E402
from fedmq.data.sources import clear_cache, light_from_above, shape_images  # noqa: E402
from fedmq.errors import ArgumentParser, UsageError, run_main  # noqa: E402
from fedmq.models import build_model, to_vector  # noqa: E402
from fedmq.training import evaluate, fit  # noqa: E402
from sim.ablation import AblationSpec  # noqa: E402

VARIANT: dict[str, str] = {}
"""The variant the `lit_factory` dataset draws (a factory is called by name, without arguments)."""


def lighting(variant: str):
    """`none`, `xF` or `+R` as a function of the clean images (None for none)."""
    try:
        if variant == "none":
            return None
        if variant.startswith("x"):
            falloff = float(variant[1:])
            return lambda im: im * np.linspace(1.0, falloff, im.shape[-2], dtype=np.float32)[:, None]
        if variant.startswith("+"):
            ramp = float(variant[1:])
            return lambda im: light_from_above(im, ramp)
    except ValueError:
        pass
    raise UsageError(f"--variants: {variant!r} is not none, xF (a falloff) or +R (a ramp)")


def lit_factory(train: bool, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The dataset factory (`data.dataset = __main__:lit_factory`) of the variant measured."""
    return shape_images(train, lighting(VARIANT["now"]))


def central_accuracy(variant: str) -> float:
    """cnn32-10 after 3 epochs of 2,000 images, each split normalized by the train split's statistics."""
    light = lighting(variant)
    (xtr, ytr), (xte, yte) = shape_images(True, light), shape_images(False, light)
    x, xt = torch.from_numpy(xtr), torch.from_numpy(xte)
    mean, std = x.mean(dim=(0, 2, 3), keepdim=True), x.std(dim=(0, 2, 3), keepdim=True)
    x, xt = (x - mean) / std, (xt - mean) / std
    y, yt = torch.from_numpy(ytr.astype(np.int64)), torch.from_numpy(yte.astype(np.int64))
    v = fit("cnn32-10", to_vector(build_model("cnn32-10", seed=0)), x[:2000], y[:2000], epochs=3,
            lr=0.01, momentum=0.9, seed=0).vector
    return float(evaluate("cnn32-10", v, xt, yt)[0])


def main(argv: list[str] | None = None) -> int:
    from sketch_kl import fleet_kl

    p = ArgumentParser(prog="python scripts/shapes_lighting.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="none,x0.5,x0.75,+0.1,+0.2,+0.3",
                   help="comma list of none, xF (falloff to F at the bottom), +R (ramp +R..-R)")
    p.add_argument("--clusters", type=int, default=4, help="K for the sketch's KL (default 4)")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        lighting(v)  # every name checked before any work
    torch.set_num_threads(1)
    for v in variants:
        VARIANT["now"] = v
        cfg = Config()
        cfg.data.dataset = "__main__:lit_factory"
        clear_cache()  # the factory's name is the same for every variant
        spec = AblationSpec(scenario="realsize", clusters=args.clusters, seed=0, agents=20, updates_per_agent=5)
        kl = fleet_kl(spec, cfg, [1.0])
        print(json.dumps({"lighting": v, "central_accuracy": round(central_accuracy(v), 3),
                          "sketch_kl": round(kl["1"], 4), "uniform_kl": round(kl["uniform"], 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python scripts/shapes_lighting.py", main))
