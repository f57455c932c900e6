"""Poisoning: 10 % of agents send scaled or sign-flipped updates; does a newcomer still get a good model?

A real aggregator engine (small digits config, K = 2, journal on disk) and `--agents` agents
with non-IID rotated-digits data that really train: each round every agent trains one epoch
from the model it holds and uploads. The first 10 % of agents (at least one) are attackers:
they train honestly, then send, with d = v - base,

- `scaled`: base + 5 d (a boosted update),
- `signflip`: base - d (the same size, the wrong way),
- `signflip-scaled`: base - 5 d (the report's attack: all ten were accepted),
- `silent`: base (no step at all): the control for what a perfect filter would leave, since
  even a fleet whose attacker's work is dropped entirely differs from the no-attack fleet.

After `--rounds` rounds, `--joiners` fresh agents join and score the model they receive on
their own test data, and the honest agents score theirs. Each attack is run with the default
guards (the step bound, aggregator.norm_factor and norm_warmup, and the direction guard,
cdfl.direction_guard, as shipped), with the bound alone, and with both off (`--guards` adds
`descent`: the opt-in test `aggregator.loss_margin` 1.0), each against the
no-attack fleet under the same guard; seeds give the same data, order and newcomers for
every setting. A row's `worst_seed_pp` is its worst seed against that seed's no-attack fleet;
`per_seed_vs_silent_pp` compares with the `silent` fleet, the best any filter could leave.

    python -m soak.poisoning                 # -> soak/results/poisoning.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aggregator.bootstrap import build_engine
from aggregator.engine import Engine
from fedmq import codecs
from fedmq.config import AggregatorSettings, load_config
from fedmq.data import clusters_from_settings, draw_agent
from fedmq.errors import run_main
from fedmq.models import model_spec
from fedmq.training import evaluate, fit
from soak.fleet_setup import SMALL, write_figures
from tests.engine_client import EngineClient

SPEC = model_spec("digits-cnn")
ATTACKS: dict[str, float] = {"none": 1.0, "scaled": 5.0, "signflip": -1.0, "signflip-scaled": -5.0,
                             "silent": 0.0}
"""Attack -> the factor on the attacker's own step d = v - base."""
GUARDS: dict[str, dict[str, Any]] = {
    "default": {},
    "bound-only": {"cdfl.direction_guard": 0.0},
    "off": {"aggregator.norm_factor": 0.0, "cdfl.direction_guard": 0.0},
    "descent": {"aggregator.loss_margin": 1.0},
}


class Agent(EngineClient):
    """A fleet member with its own data: trains from the model it holds, uploads, scores it."""

    def __init__(self, engine: Engine, name: str, data: Any, test: Any) -> None:
        self.data, self.test = data.data, test.data
        super().__init__(engine, name, SPEC)

    def score(self) -> float:
        return evaluate(SPEC.arch, torch.from_numpy(self.base.copy()), self.test.x, self.test.y)[0]

    def round(self, factor: float, seed: int) -> str:
        start = torch.from_numpy(self.base.copy())
        v = fit(SPEC.arch, start, self.data.x, self.data.y, epochs=1, lr=0.05, seed=seed).vector.numpy()
        sent = self.base + factor * (v - self.base)
        env = self.update(codecs.encode(sent.astype(np.float32), "fp32", base=self.base),
                          n_samples=int(self.data.x.shape[0]))
        reply = self.send(env)
        return "applied" if self.install(reply) else getattr(reply, "reason", "?")


def run(attack: str, guard: str, seed: int, pretrained: Path, work: Path, *, agents: int,
        rounds: int, joiners: int) -> dict[str, Any]:
    state = work / f"{attack}-{guard}-{seed}"
    shutil.copytree(pretrained, state)
    cfg = load_config(None, {**SMALL, "fleet": "poison", "aggregator.state_dir": str(state),
                             **GUARDS[guard]})
    engine = build_engine(cfg)
    engine.recover()
    clusters = clusters_from_settings(cfg.data, cfg.cdfl.clusters, seed=cfg.seed)
    rng = np.random.default_rng([seed, 0xBAD])
    fleet = []
    for i in range(agents):
        data, test = draw_agent(clusters, rng, min_samples=100, max_samples=300, test_samples=200)
        fleet.append(Agent(engine, f"car-{i}", data, test))
    bad = max(1, round(0.1 * agents))
    outcomes: dict[str, int] = {}
    for r in range(rounds):
        for i in rng.permutation(agents):
            factor = ATTACKS[attack] if i < bad else 1.0
            what = fleet[i].round(factor, seed=seed * 1000 + r * 100 + int(i))
            key = ("attacker." if i < bad else "honest.") + what
            outcomes[key] = outcomes.get(key, 0) + 1
    newcomers = []
    for j in range(joiners):
        data, test = draw_agent(clusters, rng, min_samples=100, max_samples=300, test_samples=300)
        newcomers.append(Agent(engine, f"new-{j}", data, test).score())
    engine.journal.close()
    shutil.rmtree(state)
    bounded = {k: v for k, v in engine.counters.items() if k.startswith("bounded.")}
    return {"attack": attack, "guard": guard, "seed": seed, "outcomes": outcomes, "bounded": bounded,
            "joined_accuracy": statistics.fmean(newcomers),
            "honest_accuracy": statistics.fmean(a.score() for a in fleet[bad:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak.poisoning", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--joiners", type=int, default=5)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--guards", default="default,bound-only,off",
                   help=f"comma list of {', '.join(GUARDS)} (default: default,bound-only,off)")
    p.add_argument("--out", type=Path, default=None, help="default soak/results/poisoning.json")
    a = p.parse_args(argv)
    attacks = [x for x in a.attacks.split(",") if x]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attack {sorted(unknown)[0]!r}; use {', '.join(ATTACKS)}")
    if "none" not in attacks:
        p.error("--attacks must include none: every row is compared with the no-attack fleet of its seed")
    for flag in ("agents", "rounds", "joiners", "seeds"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    guards = [x for x in a.guards.split(",") if x]
    if set(guards) - set(GUARDS) or not guards:
        p.error(f"--guards: use a comma list of {', '.join(GUARDS)}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for seed in range(a.seeds):
            pretrained = work / f"pretrained-{seed}"
            engine = build_engine(load_config(None, {**SMALL, "seed": seed,
                                                     "aggregator.state_dir": str(pretrained)}))
            engine.recover()
            engine.journal.close()
            for attack in attacks:
                for guard in guards:
                    r = run(attack, guard, seed, pretrained, work, agents=a.agents, rounds=a.rounds,
                            joiners=a.joiners)
                    runs.append(r)
                    print(f"seed {seed} {attack:16s} guard {guard:8s}: joined {r['joined_accuracy']:.3f}, "
                          f"honest {r['honest_accuracy']:.3f}, {r['outcomes']}", flush=True)
    rows = []
    for attack in attacks:
        for guard in guards:
            mine = [r for r in runs if r["attack"] == attack and r["guard"] == guard]
            ref = {r["seed"]: r for r in runs if r["attack"] == "none" and r["guard"] == guard}
            if not mine:
                continue
            diffs = [100 * (r["joined_accuracy"] - ref[r["seed"]]["joined_accuracy"]) for r in mine]
            # Against the perfect filter's fleet (the attacker's work dropped), where it was run.
            ceiling = {r["seed"]: r for r in runs if r["attack"] == "silent" and r["guard"] == guard}
            vs_silent = [100 * (r["joined_accuracy"] - ceiling[r["seed"]]["joined_accuracy"])
                         for r in mine if r["seed"] in ceiling]
            rows.append({"attack": attack, "guard": guard, "seeds": len(mine),
                         "joined_accuracy": statistics.fmean(r["joined_accuracy"] for r in mine),
                         "honest_accuracy": statistics.fmean(r["honest_accuracy"] for r in mine),
                         "joined_vs_no_attack_pp": statistics.fmean(diffs),
                         "worst_seed_pp": min(diffs),
                         "per_seed_pp": [round(x, 2) for x in diffs],
                         "per_seed_vs_silent_pp": [round(x, 2) for x in vs_silent],
                         "attacker_applied": sum(r["outcomes"].get("attacker.applied", 0) for r in mine),
                         "attacker_refused": sum(v for r in mine for k, v in r["outcomes"].items()
                                                 if k.startswith("attacker.") and k != "attacker.applied"),
                         "honest_refused": sum(v for r in mine for k, v in r["outcomes"].items()
                                               if k.startswith("honest.") and k != "honest.applied"),
                         "bounded": sum(sum(r["bounded"].values()) for r in mine)})
    for row in rows:
        print(f"{row['attack']:16s} {row['guard']:8s} joined {row['joined_accuracy']:.3f} "
              f"({row['joined_vs_no_attack_pp']:+.2f} pp, worst {row['worst_seed_pp']:+.2f}"
              + (f"; vs silent worst {min(row['per_seed_vs_silent_pp']):+.2f}" if row["per_seed_vs_silent_pp"] else "")
              + "), "
              f"attacker applied/refused {row['attacker_applied']}/{row['attacker_refused']}, "
              f"honest refused {row['honest_refused']}, steps bounded {row['bounded']}")
    defaults = AggregatorSettings()
    path = write_figures("poisoning", {
        "agents": a.agents, "rounds": a.rounds, "joiners": a.joiners, "seeds": a.seeds,
        "default_guard": {"norm_factor": defaults.norm_factor, "norm_warmup": defaults.norm_warmup,
                          "norm_window": defaults.norm_window},
        "rows": rows, "runs": runs, "wall_s": round(time.perf_counter() - t0, 1)}, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.poisoning", main))
