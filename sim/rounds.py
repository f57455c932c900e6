"""CATA-Fed vs FedAvg(deadline) vs FedProx on heterogeneous fleets, on a simulated clock.

    python -m sim.rounds --seeds 0,1,2,3,4 --rounds 100 --target 0.9 --out docs/results_catafed

The server strategies (aggregator/catafed.py, aggregator/fedavg.py) and the agents' deadline
logic (edge_agent/deadline.py: soft stop, watchdog, eps_i, shards) are the ones the MQTT
services run; only the wire and the clock are replaced. Training is real (torch, on
non-IID digits), time is simulated: an epoch of n samples takes n / speed_i seconds on
device i, a message of b bytes b / bandwidth_i seconds. So a 20 s deadline costs
milliseconds of wall time. Tensors still go through the codecs (int8 + zstd), so agents
train from what they would have decoded and bytes are counted as on the wire. The real-time
path (RoundService and RoundAgent over Mosquitto) is tests/test_rounds_mqtt.py.

Fleet model (`FleetSpec`): device speeds log-normal around a median; a share of devices is
slow (speed x slow_factor); bandwidth log-normal; per round an online device goes offline
with probability dropout_p (if it was invited, it goes silent mid-round) and an offline one
comes back with probability return_p. Data: n_i uniform in [min, max] samples with label
proportions ~ Dirichlet(label_alpha) (non-IID), drawn from the digits train split.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from aggregator.catafed import RoundResult
from aggregator.fedavg import STRATEGIES, make_strategy
from edge_agent.deadline import DeadlineLearner, EpochOutcome, TrainSettings, Watchdog
from fedmq import codecs
from fedmq.config import CataFedSettings, FedAvgSettings
from fedmq.data import load_dataset
from fedmq.errors import ArgumentParser, UsageError, run_main
from fedmq.models import build_model, to_vector
from fedmq.training import evaluate, fit
from sim.seeds import int_list

MODEL = "digits-cnn"


@dataclass
class FleetSpec:
    """A heterogeneous fleet; speeds in samples per simulated second."""

    agents: int = 30
    slow_share: float = 0.3
    slow_factor: float = 0.1
    speed_median: float = 60.0
    speed_sigma: float = 0.4
    bandwidth_median: float = 20_000.0
    """Bytes per simulated second, both directions."""
    bandwidth_sigma: float = 0.5
    dropout_p: float = 0.03
    return_p: float = 0.3
    min_samples: int = 80
    max_samples: int = 400
    label_alpha: float = 0.5


class SimClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += max(dt, 0.0)


@dataclass
class SimDevice:
    agent: str
    speed: float
    bandwidth: float
    slow: bool
    learner: DeadlineLearner
    online: bool = True


class SimEpochRunner:
    """An epoch of n samples takes n / speed on the device's clock; cut at the time left.

    A cut epoch trains nothing for CATA-Fed (its result is thrown away); for FedProx it
    trains on the share of the (shuffled) samples that fit, as the real one would.
    """

    def __init__(self, train: TrainSettings, x: torch.Tensor, y: torch.Tensor, speed: float,
                 clock: SimClock, anchor: torch.Tensor | None, partial: bool) -> None:
        self.train, self.x, self.y = train, x, y
        self.speed, self.clock, self.anchor, self.partial = speed, clock, anchor, partial

    def _fit(self, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor, epoch: int) -> torch.Tensor:
        anchors = [(self.anchor, self.train.prox_mu)] if self.anchor is not None \
            and self.train.prox_mu > 0 else []
        return fit(MODEL, start, x, y, anchors=anchors, epochs=1, batch_size=self.train.batch_size,
                   lr=self.train.lr, seed=self.train.seed * 1000 + epoch).vector

    def __call__(self, start: torch.Tensor, epoch: int, left: float) -> EpochOutcome:
        n = int(self.x.shape[0])
        need = n / self.speed
        if need <= left:
            self.clock.advance(need)
            return EpochOutcome(self._fit(start, self.x, self.y, epoch), need, True, n)
        left = max(left, 0.0)
        self.clock.advance(left)
        done = int(left * self.speed)
        if self.partial and done > 0:
            return EpochOutcome(self._fit(start, self.x[:done], self.y[:done], epoch), left,
                                False, done)
        return EpochOutcome(start, left, False, done)


def non_iid_fleet(spec: FleetSpec, settings: CataFedSettings, algorithm: str,
                  seed: int) -> list[SimDevice]:
    """The same devices and data for every algorithm given the seed."""
    rng = np.random.default_rng([seed, 0xF1EE7])
    train = load_dataset("digits")
    by_label = [np.flatnonzero(train.y.numpy() == c) for c in range(train.num_classes)]
    slow = np.zeros(spec.agents, dtype=bool)
    slow[rng.permutation(spec.agents)[: int(round(spec.slow_share * spec.agents))]] = True
    devices = []
    for i in range(spec.agents):
        n = int(rng.integers(spec.min_samples, spec.max_samples + 1))
        props = rng.dirichlet([spec.label_alpha] * train.num_classes)
        counts = rng.multinomial(n, props)
        idx = np.concatenate([rng.choice(by_label[c], size=k, replace=True)
                              for c, k in enumerate(counts) if k > 0])
        idx = idx[rng.permutation(len(idx))]
        speed = float(spec.speed_median * rng.lognormal(0.0, spec.speed_sigma))
        if slow[i]:
            speed *= spec.slow_factor
        bw = float(spec.bandwidth_median * rng.lognormal(0.0, spec.bandwidth_sigma))
        x, y = train.x[idx], train.y[idx]
        learner = DeadlineLearner(x, y, settings, algorithm=algorithm, seed=seed * 1000 + i)
        devices.append(SimDevice(f"dev-{i:03d}", speed, bw, bool(slow[i]), learner))
    return devices


@dataclass
class SimRound:
    round: int
    time_s: float
    """Simulated time at the end of the round."""
    accuracy: float
    selected: int
    finished: int
    stragglers: int
    dropouts: int
    late: int
    round_s: float


@dataclass
class SimRun:
    algorithm: str
    seed: int
    rounds: list[SimRound] = field(default_factory=list)
    compute_s: float = 0.0
    wasted_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    time_to_target_s: float | None = None
    rounds_to_target: int | None = None
    wall_s: float = 0.0

    @property
    def final_accuracy(self) -> float:
        return self.rounds[-1].accuracy if self.rounds else float("nan")

    def totals(self) -> dict[str, int]:
        return {k: sum(getattr(r, k) for r in self.rounds)
                for k in ("selected", "finished", "stragglers", "dropouts", "late")}


def run_fleet(algorithm: str, spec: FleetSpec, settings: CataFedSettings, *, seed: int = 0,
              rounds: int | None = None, target: float | None = None,
              codec: str = "int8") -> SimRun:
    """One algorithm on one seeded fleet, until `rounds` or the target accuracy."""
    t_wall = time.perf_counter()
    rounds = settings.rounds if rounds is None else rounds
    target = settings.target_accuracy if target is None else target
    rng = np.random.default_rng([seed, 0xD20F])  # presence events: same for every algorithm
    test = load_dataset("digits", train=False)
    devices = {d.agent: d for d in non_iid_fleet(spec, settings, algorithm, seed)}
    strategy = make_strategy(algorithm, settings, to_vector(build_model(MODEL, seed=seed)),
                             seed=seed)
    for d in devices.values():
        strategy.register(d.agent, d.learner.shard_size)
    train = TrainSettings(MODEL, settings.lr, settings.batch_size,
                          FedAvgSettings().prox_mu if algorithm == "fedprox" else 0.0, seed)
    clock = SimClock()
    run = SimRun(algorithm, seed)
    cutoff = settings.deadline_s + settings.grace_s
    for _ in range(rounds):
        # Presence changes between rounds; invited devices that drop go silent mid-round.
        going = {a for a, d in devices.items() if d.online and rng.random() < spec.dropout_p}
        for a, d in devices.items():
            if not d.online and rng.random() < spec.return_p:
                d.online = True
                strategy.set_online(a, True)
        plan = strategy.open_round()
        wire = codecs.encode(strategy.vector.numpy(), codec)
        base_np = codecs.decode(wire)
        base = torch.from_numpy(base_np.copy())
        down_bytes = codecs.encoded_size(wire)
        arrivals: list[float] = []
        late = 0
        for a in plan.selected:
            d = devices[a]
            run.bytes_down += down_bytes
            if a in going:
                continue  # silent: the server learns at the cut-off
            local = SimClock()
            dog = Watchdog(d.learner.budget_s(settings.deadline_s), local, 0.0)
            work = d.learner.run_round(
                base, lambda x, y, anchor, d=d, local=local: SimEpochRunner(
                    train, x, y, d.speed, local, anchor, partial=algorithm == "fedprox"),
                dog.left)
            run.compute_s += local()
            if work.finished and work.vector is not None:
                up = codecs.encode(work.vector.numpy(), codec, base=base_np)
                up_bytes = codecs.encoded_size(up)
                vector = torch.from_numpy(codecs.decode(up, base=base_np).copy())
            else:
                up_bytes, vector = 64, None
            run.bytes_up += up_bytes
            upload_s = up_bytes / d.bandwidth
            d.learner.uploads.record(upload_s)
            arrival = down_bytes / d.bandwidth + local() + upload_s
            if arrival > cutoff:
                late += 1
                run.wasted_s += local()  # trained for nothing: dropped at the server
                continue
            run.wasted_s += work.result.wasted_s
            arrivals.append(arrival)
            strategy.accept(RoundResult(a, plan.round, work.finished, work.n_samples,
                                        work.shard_size, vector, base, {}))
        if not plan.selected:
            round_s = settings.deadline_s  # nobody to invite: wait a deadline
        elif settings.close_early and strategy.all_reported():
            round_s = max(arrivals)
        else:
            round_s = cutoff
        outcome = strategy.close_round()
        for a in going:
            devices[a].online = False
            strategy.set_online(a, False)
        clock.advance(round_s)
        acc, _ = evaluate(MODEL, strategy.vector, test.x, test.y)
        run.rounds.append(SimRound(outcome.round, clock(), acc, len(plan.selected),
                                   len(outcome.finished), len(outcome.stragglers),
                                   len(outcome.dropouts) - late, late, round_s))
        if target and acc >= target and run.time_to_target_s is None:
            run.time_to_target_s, run.rounds_to_target = clock(), outcome.round + 1
            break
    run.wall_s = time.perf_counter() - t_wall
    return run


# ----------------------------------------------------------------------------- report


def summary_rows(runs: list[SimRun]) -> list[dict]:
    rows = []
    for alg in dict.fromkeys(r.algorithm for r in runs):
        mine = [r for r in runs if r.algorithm == alg]
        reached = [r.time_to_target_s for r in mine if r.time_to_target_s is not None]
        tot = [r.totals() for r in mine]
        rows.append({
            "algorithm": alg,
            "runs": len(mine),
            "reached": len(reached),
            "time_to_target_s": statistics.fmean(reached) if reached else None,
            "time_to_target_each": [r.time_to_target_s for r in mine],
            "rounds_to_target": [r.rounds_to_target for r in mine],
            "final_accuracy": statistics.fmean(r.final_accuracy for r in mine),
            "wasted_share": sum(r.wasted_s for r in mine) / max(sum(r.compute_s for r in mine), 1e-9),
            "stragglers_per_round": sum(t["stragglers"] for t in tot) / sum(len(r.rounds) for r in mine),
            "late_per_round": sum(t["late"] for t in tot) / sum(len(r.rounds) for r in mine),
            "dropouts_per_round": sum(t["dropouts"] for t in tot) / sum(len(r.rounds) for r in mine),
            "finished_per_round": sum(t["finished"] for t in tot) / sum(len(r.rounds) for r in mine),
            "mean_round_s": statistics.fmean(x.round_s for r in mine for x in r.rounds),
            "kB_up_per_round": sum(r.bytes_up for r in mine) / 1e3 / sum(len(r.rounds) for r in mine),
        })
    return rows


def markdown_table(rows: list[dict], target: float) -> str:
    head = (f"| algorithm | reached target | sim time to {target:.2f} (mean) | per seed | final acc | "
            "wasted work | finished / stragglers / late / dropouts per round | mean round |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        ttt = f"{r['time_to_target_s']:.0f} s" if r["time_to_target_s"] is not None else "-"
        each = ", ".join("-" if v is None else f"{v:.0f}" for v in r["time_to_target_each"])
        lines.append(f"| {r['algorithm']} | {r['reached']}/{r['runs']} | {ttt} | {each} | "
                     f"{r['final_accuracy']:.3f} | {100 * r['wasted_share']:.1f} % | "
                     f"{r['finished_per_round']:.2f} / {r['stragglers_per_round']:.2f} / "
                     f"{r['late_per_round']:.2f} / {r['dropouts_per_round']:.2f} | "
                     f"{r['mean_round_s']:.1f} s |")
    return head + "\n".join(lines) + "\n"


def load_results(path: Path) -> tuple[list[SimRun], float, dict]:
    """(runs, target accuracy, the whole file) from a results.json that `main` wrote."""
    data = json.loads(Path(path).read_text())
    runs = [SimRun(**{**{k: v for k, v in r.items() if k != "rounds"},
                      "rounds": [SimRound(**x) for x in r["rounds"]]}) for r in data["runs"]]
    return runs, float(data["settings"]["target_accuracy"]), data


def plot(runs: list[SimRun], path: Path) -> None:
    from sim.figures import figure_legend, method_color, pyplot, save_figure

    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4))
    for r in runs:
        c = method_color(r.algorithm)
        label = r.algorithm if r.seed == min(x.seed for x in runs if x.algorithm == r.algorithm) else None
        ax1.plot([x.round + 1 for x in r.rounds], [x.accuracy for x in r.rounds], color=c,
                 alpha=0.7, label=label)
        ax2.plot([x.time_s for x in r.rounds], [x.accuracy for x in r.rounds], color=c, alpha=0.7,
                 label=label)
    ax1.set(xlabel="round", ylabel="test accuracy", title="accuracy over rounds")
    ax2.set(xlabel="simulated time (s)", ylabel="test accuracy", title="accuracy over time")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    figure_legend(fig, (ax1, ax2))
    save_figure(fig, path)


def main(argv: list[str] | None = None, prog: str = "python -m sim.rounds") -> int:
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithms", default="catafed,fedavg,fedprox")
    p.add_argument("--seeds", default="0", help="comma-separated fleet seeds (default 0)")
    p.add_argument("--agents", type=int, default=FleetSpec.agents)
    p.add_argument("--slow-share", type=float, default=FleetSpec.slow_share)
    p.add_argument("--slow-factor", type=float, default=FleetSpec.slow_factor)
    p.add_argument("--dropout-p", type=float, default=FleetSpec.dropout_p)
    p.add_argument("--return-p", type=float, default=FleetSpec.return_p)
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--deadline", type=float, default=20.0, help="T in simulated seconds")
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--per-group", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", default="", help="directory for results.json, table.md, accuracy.png")
    p.add_argument("--dry-run", action="store_true", help="check the flags, print the plan and exit")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = FleetSpec(agents=a.agents, slow_share=a.slow_share, slow_factor=a.slow_factor,
                     dropout_p=a.dropout_p, return_p=a.return_p)
    settings = CataFedSettings(groups=a.groups, per_group=a.per_group, deadline_s=a.deadline,
                               grace_s=a.grace, epochs=a.epochs, rounds=a.rounds,
                               target_accuracy=a.target)
    if a.dry_run:
        print(f"{a.algorithms} x seeds {a.seeds}: {spec}, {settings}; output {a.out or '-'} "
              "(dry run: nothing run)")
        return 0
    runs = []
    seeds = int_list(a.seeds, "--seeds")
    algorithms = [x.strip() for x in a.algorithms.split(",") if x.strip()]
    for alg in algorithms:
        if alg not in STRATEGIES:
            raise UsageError(f"--algorithms: unknown algorithm {alg!r}; use one of {', '.join(STRATEGIES)}")
    for seed in seeds:
        for alg in algorithms:
            run = run_fleet(alg, spec, settings, seed=seed)
            runs.append(run)
            print(f"{alg:8s} seed {seed}: {len(run.rounds)} rounds, sim {run.rounds[-1].time_s:.0f} s, "
                  f"acc {run.final_accuracy:.3f}, target at "
                  f"{'-' if run.time_to_target_s is None else f'{run.time_to_target_s:.0f} s'} "
                  f"(wall {run.wall_s:.1f} s)", flush=True)
    rows = summary_rows(runs)
    table = markdown_table(rows, a.target)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(table)
        (out / "results.json").write_text(json.dumps(
            {"fleet": asdict(spec), "settings": asdict(settings), "summary": rows,
             "runs": [{**{k: v for k, v in asdict(r).items() if k != "rounds"},
                       "rounds": [asdict(x) for x in r.rounds]} for r in runs]}, indent=1))
        plot(runs, out / "accuracy.png")
        print(f"wrote {out}/table.md, results.json, accuracy.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m sim.rounds", main))
