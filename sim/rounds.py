"""CATA-Fed vs FedAvg(deadline) vs FedProx vs TiFL on heterogeneous fleets, on a simulated clock.

    python -m sim.rounds --seeds 10 --until 600 --target 0.9 --out results/catafed/digits-a0.3-s30

The server strategies (aggregator/round_algorithms.py) and the agents' deadline logic
(edge_agent/deadline.py: soft stop, watchdog, eps_i, shards) are the ones the MQTT services
run; only the wire and the clock are replaced. Training is real (torch, on non-IID splits of
`--dataset`), time is simulated: an epoch of n samples takes n / speed_i seconds on device i,
a message of b bytes b / bandwidth_i seconds. So a 20 s deadline costs milliseconds of wall
time. Tensors still go through the codecs (int8 + zstd), so agents train from what they
would have decoded and bytes are counted as on the wire. sim/rounds_live.py runs the same
fleets as RoundService and RoundAgents over Mosquitto on the wall clock.

Runs go on until `--until` simulated seconds (or `--rounds`); the time to the target is read
off each run's accuracy trajectory, and the final accuracy is the mean of the last five
rounds' test accuracy at the same simulated time for every algorithm. Every comparison is
paired by seed: seed s is the same fleet (devices, data, presence draws) for all algorithms.

Fleet model (`FleetSpec`): device speeds log-normal around a median; a share of devices is
slow (speed x slow_factor); bandwidth log-normal; per round an online device goes offline
with probability dropout_p (if it was invited, it goes silent mid-round) and an offline one
comes back with probability return_p. Data: n_i uniform in [min, max] samples with label
proportions ~ Dirichlet(label_alpha) (non-IID), drawn from the dataset's train split.

`--algorithms ...,alone` adds the control that shows whether federation pays at all: the
same agents, each training only on its own data (`simulate_alone`); its accuracy is the mean
over agents of each one's own model on the same test set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from aggregator.catafed import RoundResult
from aggregator.round_algorithms import STRATEGIES, make_round_strategy
from edge_agent.deadline import DeadlineLearner, EpochOutcome, TrainSettings, Watchdog, epoch_seed
from fedmq import codecs
from fedmq.config import (
    CataFedSettings,
    ConfigError,
    FedAvgSettings,
    TiflSettings,
    load_config,
)
from fedmq.data import Dataset, dataset_for_data_dir, load_dataset
from fedmq.errors import ArgumentParser, UsageError, run_main
from fedmq.models import (
    build_model,
    has_default_model,
    load_init_vector,
    model_for_images,
    model_spec,
    resolve_model_name,
    to_vector,
)
from fedmq.training import evaluate, fit
from sim.seeds import seed_list
from sim.stats import paired_interval, t_half_width

FINAL_ROUNDS = 5
"""The final accuracy is the mean test accuracy of this many last rounds (one is noisy)."""
ALONE = "alone"
"""The no-federation control (`simulate_alone`): a variant base beside the round algorithms."""


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
    label_alpha: float = 0.3


@dataclass
class Variant:
    """One column of a comparison: a round algorithm with config overrides, under a label."""

    label: str
    algorithm: str
    overrides: dict[str, str] = field(default_factory=dict)

    def settings(self, base: dict[str, str]) -> tuple[CataFedSettings, FedAvgSettings, TiflSettings]:
        """[catafed], [fedavg] (like CATA-Fed's N, E, batch, lr unless set) and [tifl]."""
        keys = {**base, **self.overrides}
        cfg = load_config(overrides={k: v for k, v in keys.items() if not k.startswith("fedavg.")})
        cfg.fedavg = FedAvgSettings.like(cfg.catafed)
        cfg = load_config(overrides={k: v for k, v in keys.items() if k.startswith("fedavg.")},
                          base=cfg)
        return cfg.catafed, cfg.fedavg, cfg.tifl


def parse_variants(text: str, *, alone: bool = False) -> list[Variant]:
    """`catafed,fedavg,nopf=catafed:catafed.selection=random` -> variants (labels unique).

    With `alone`, `alone` (agents training alone, `simulate_alone`) is a base too; only the
    simulator has it, the live twin has no such service."""
    out: list[Variant] = []
    known = (*STRATEGIES, ALONE) if alone else tuple(STRATEGIES)
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        label, eq, rest = item.partition("=")
        if not eq:
            label, rest = item, item
        alg, *keys = rest.split(":")
        if alg not in known:
            raise UsageError(f"--algorithms: unknown algorithm {alg!r} in {item!r}; use one of "
                             f"{', '.join(known)} (or LABEL=ALG:section.key=value:...)")
        overrides = {}
        for kv in keys:
            k, sep, v = kv.partition("=")
            if not sep or "." not in k:
                raise UsageError(f"--algorithms: {kv!r} in {item!r} is not section.key=value")
            overrides[k] = v
        if any(v.label == label for v in out):
            raise UsageError(f"--algorithms: label {label!r} given twice")
        out.append(Variant(label, alg, overrides))
    if not out:
        raise UsageError("--algorithms: give at least one algorithm")
    return out


class SimClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += max(dt, 0.0)


class SimEpochRunner:
    """An epoch of n samples takes n / speed on the device's clock; cut at the time left.

    A cut epoch trains nothing for CATA-Fed (its result is thrown away); for FedProx it
    trains on the share of the (shuffled) samples that fit, as the real one would. Batches
    are shuffled anew per round and epoch, as on a real agent.
    """

    def __init__(self, train: TrainSettings, x: torch.Tensor, y: torch.Tensor, speed: float,
                 clock: SimClock, anchor: torch.Tensor | None, partial: bool,
                 round_id: int = 0) -> None:
        self.train, self.x, self.y = train, x, y
        self.speed, self.clock, self.anchor, self.partial = speed, clock, anchor, partial
        self.round_id = round_id

    def _fit(self, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor, epoch: int) -> torch.Tensor:
        anchors = [(self.anchor, self.train.prox_mu)] if self.anchor is not None \
            and self.train.prox_mu > 0 else []
        return fit(self.train.model_name, start, x, y, anchors=anchors, epochs=1,
                   batch_size=self.train.batch_size, lr=self.train.lr,
                   momentum=self.train.momentum,
                   seed=epoch_seed(self.train.seed, self.round_id, epoch)).vector

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


@dataclass
class SimDevice:
    agent: str
    speed: float
    bandwidth: float
    slow: bool
    x: torch.Tensor
    y: torch.Tensor
    online: bool = True


def non_iid_fleet(spec: FleetSpec, train: Dataset, seed: int, held_out: int = 0) -> list[SimDevice]:
    """The same devices and data for every algorithm given the seed; the `held_out` images of
    `start_pool` are never an agent's."""
    rng = np.random.default_rng([seed, 0xF1EE7])
    labels = train.y.numpy()
    pool = np.ones(len(labels), dtype=bool)
    pool[start_pool(len(labels), seed, held_out)] = False
    by_label = [np.flatnonzero((labels == c) & pool) for c in range(train.num_classes)]
    slow = np.zeros(spec.agents, dtype=bool)
    slow[rng.permutation(spec.agents)[: int(round(spec.slow_share * spec.agents))]] = True
    devices = []
    for i in range(spec.agents):
        n = int(rng.integers(spec.min_samples, spec.max_samples + 1))
        props = rng.dirichlet([spec.label_alpha] * train.num_classes)
        counts = rng.multinomial(n, props)
        idx = np.concatenate([rng.choice(by_label[c], size=k, replace=True)
                              for c, k in enumerate(counts) if k > 0 and len(by_label[c])])
        idx = idx[rng.permutation(len(idx))]
        speed = float(spec.speed_median * rng.lognormal(0.0, spec.speed_sigma))
        if slow[i]:
            speed *= spec.slow_factor
        bw = float(spec.bandwidth_median * rng.lognormal(0.0, spec.bandwidth_sigma))
        t = torch.from_numpy(idx)
        devices.append(SimDevice(f"dev-{i:03d}", speed, bw, bool(slow[i]), train.x[t], train.y[t]))
    return devices


def start_pool(n: int, seed: int, held_out: int) -> np.ndarray:
    """Indices of the `held_out` training images the shared start is trained on (`--pretrain`):
    a seeded draw over the whole training set, so every label is in it."""
    if not 0 <= held_out < n:
        raise UsageError(f"--pretrain must be in [0, {n - 1}] (the training set has {n} images), got {held_out}")
    return np.random.default_rng([seed, 0x5747]).permutation(n)[:held_out]


def start_vector(model_name: str, train: Dataset, seed: int, held_out: int = 0, epochs: int = 20,
                 lr: float = 0.01) -> torch.Tensor:
    """The model every algorithm and the alone control start from: the seeded random init, or
    (held_out > 0) that init trained centrally on the held-out images, as a team starts a fleet
    from its own pre-trained weights. SGD, momentum 0.9, batches of 32."""
    init = to_vector(build_model(model_name, seed=seed))
    if held_out == 0:
        return init
    idx = torch.from_numpy(start_pool(len(train.y), seed, held_out))
    return fit(model_name, init, train.x[idx], train.y[idx], epochs=epochs, lr=lr, momentum=0.9,
               batch_size=32, seed=seed).vector


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
    invited: list[str] = field(default_factory=list)
    """Who was invited (the live twin compares its invitees with these)."""
    agent_accuracy: list[float] = field(default_factory=list)
    """`alone`: each agent's own model's test accuracy, in fleet order (`accuracy` is their
    mean); empty for the federated runs, which have one model."""


@dataclass
class SimRun:
    algorithm: str
    """The variant's label (the algorithm's name unless the variant has one)."""
    seed: int
    rounds: list[SimRound] = field(default_factory=list)
    compute_s: float = 0.0
    wasted_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    time_to_target_s: float | None = None
    rounds_to_target: int | None = None
    wall_s: float = 0.0
    strategy: str = ""
    """The round algorithm that ran (catafed, fedavg, fedprox, tifl; or alone)."""

    @property
    def final_accuracy(self) -> float:
        """Mean test accuracy of the last FINAL_ROUNDS rounds."""
        if not self.rounds:
            return float("nan")
        return statistics.fmean(r.accuracy for r in self.rounds[-FINAL_ROUNDS:])

    def agents_final(self) -> list[float]:
        """`alone`: each agent's final accuracy (mean of its last FINAL_ROUNDS rounds, as
        final_accuracy); empty for a federated run."""
        last = [r.agent_accuracy for r in self.rounds[-FINAL_ROUNDS:] if r.agent_accuracy]
        return [statistics.fmean(col) for col in zip(*last, strict=True)] if last else []

    def totals(self) -> dict[str, int]:
        return {k: sum(getattr(r, k) for r in self.rounds)
                for k in ("selected", "finished", "stragglers", "dropouts", "late")}


@dataclass
class Task:
    """What a simulated run needs: everything picklable, for worker processes."""

    variant: Variant
    spec: FleetSpec
    base: dict[str, str]
    seed: int
    rounds: int
    until_s: float
    target: float
    dataset: str = "digits"
    data_dir: str | None = None
    model: str = "auto"
    codec: str = "int8"
    start: torch.Tensor | None = None
    """The shared start (`start_vector`); None: the seeded random init."""
    held_out: int = 0
    """Training images the start was trained on, which no agent holds."""


def simulate_fleet(algorithm: str, spec: FleetSpec, settings: CataFedSettings, *, seed: int = 0,
              rounds: int | None = None, target: float | None = None, until_s: float = math.inf,
              codec: str = "int8", dataset: str = "digits", data_dir: str | None = None,
              model: str = "auto", fedavg: FedAvgSettings | None = None,
              tifl: TiflSettings | None = None, label: str | None = None,
              start: torch.Tensor | None = None, held_out: int = 0) -> SimRun:
    """One algorithm on one seeded fleet, for `rounds` rounds or until `until_s` simulated s.

    The time to `target` is when the test accuracy first reaches it; the run goes on. `start`
    (default the seeded init) and `held_out` as in Task."""
    t_wall = time.perf_counter()
    rounds = settings.rounds if rounds is None else rounds
    target = settings.target_accuracy if target is None else target
    fedavg = fedavg or FedAvgSettings.like(settings)
    model_name = resolve_model_name(model, dataset)
    exact = model_spec(model_name).statistics_numel  # float32 under a lossy codec (fp32 sends all exact)
    rng = np.random.default_rng([seed, 0xD20F])  # presence events: same for every algorithm
    train_set = load_dataset(dataset, data_dir=data_dir)
    test = load_dataset(dataset, data_dir=data_dir, train=False)
    fleet = non_iid_fleet(spec, train_set, seed, held_out)
    devices = {d.agent: d for d in fleet}
    learners = {d.agent: DeadlineLearner(
        d.x, d.y, settings, algorithm=algorithm, seed=seed * 1000 + i,
        epochs=None if algorithm == "catafed" else fedavg.epochs, model_name=model_name)
        for i, d in enumerate(fleet)}
    if start is None:
        start = start_vector(model_name, train_set, seed)
    strategy = make_round_strategy(algorithm, settings, start.clone(), seed=seed, fedavg=fedavg, tifl=tifl)
    for a, learner in learners.items():
        strategy.register(a, learner.shard_size)
    if algorithm == "catafed":
        train = TrainSettings(model_name, settings.lr, settings.batch_size, 0.0, seed)
    else:
        train = TrainSettings(model_name, fedavg.lr, fedavg.batch_size,
                              fedavg.prox_mu if algorithm == "fedprox" else 0.0, seed,
                              fedavg.momentum)
    partial = learners[fleet[0].agent].mode == "fedprox"
    clock = SimClock()
    run = SimRun(label or algorithm, seed, strategy=algorithm)
    cutoff = settings.deadline_s + settings.grace_s
    for _ in range(rounds):
        if clock() >= until_s:
            break
        # Presence changes between rounds; invited devices that drop go silent mid-round.
        going = {a for a, d in devices.items() if d.online and rng.random() < spec.dropout_p}
        for a, d in devices.items():
            if not d.online and rng.random() < spec.return_p:
                d.online = True
                strategy.set_online(a, True)
        plan = strategy.open_round()
        wire = codecs.encode(strategy.vector.numpy(), codec, exact=exact)
        base_np = codecs.decode(wire)
        base = torch.from_numpy(base_np.copy())
        down_bytes = codecs.encoded_size(wire)
        arrivals: list[float] = []
        late = 0
        for a in plan.selected:
            d, learner = devices[a], learners[a]
            run.bytes_down += down_bytes
            if a in going:
                continue  # silent: the server learns at the cut-off
            local = SimClock()
            dog = Watchdog(learner.budget_s(settings.deadline_s), local, 0.0)
            work = learner.run_round(
                base, lambda x, y, anchor, d=d, local=local, r=plan.round: SimEpochRunner(
                    train, x, y, d.speed, local, anchor, partial=partial, round_id=r),
                dog.left)
            run.compute_s += local()
            if work.finished and work.vector is not None:
                up = codecs.encode(work.vector.numpy(), codec, base=base_np, exact=exact)
                up_bytes = codecs.encoded_size(up)
                vector = torch.from_numpy(codecs.decode(up, base=base_np).copy())
            else:
                up_bytes, vector = 64, None
            run.bytes_up += up_bytes
            upload_s = up_bytes / d.bandwidth
            learner.uploads.record(upload_s)
            arrival = down_bytes / d.bandwidth + local() + upload_s
            if arrival > cutoff:
                late += 1
                run.wasted_s += local()  # trained for nothing: dropped at the server
                continue
            run.wasted_s += work.result.wasted_s
            arrivals.append(arrival)
            metrics = {} if work.local_accuracy is None else {"accuracy": work.local_accuracy}
            strategy.accept(RoundResult(a, plan.round, work.finished, work.n_samples,
                                        work.shard_size, vector, base, metrics, arrival))
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
        acc, _ = evaluate(model_name, strategy.vector, test.x, test.y)
        run.rounds.append(SimRound(outcome.round, clock(), acc, len(plan.selected),
                                   len(outcome.finished), len(outcome.stragglers),
                                   len(outcome.dropouts) - late, late, round_s,
                                   list(plan.selected)))
        if target and acc >= target and run.time_to_target_s is None:
            run.time_to_target_s, run.rounds_to_target = clock(), outcome.round + 1
    run.wall_s = time.perf_counter() - t_wall
    return run


def simulate_alone(spec: FleetSpec, settings: CataFedSettings, *, seed: int = 0,
                   rounds: int | None = None, target: float | None = None,
                   until_s: float = math.inf, dataset: str = "digits", data_dir: str | None = None,
                   model: str = "auto", fedavg: FedAvgSettings | None = None,
                   label: str | None = None, start: torch.Tensor | None = None,
                   held_out: int = 0) -> SimRun:
    """The control for "does federation help": every agent of the seeded fleet trains alone.

    Each agent starts from the model the federated runs start from (`build_model(seed)`; no
    codec, nothing crosses a wire) and trains only on its own data exactly as a FedAvg agent
    does (DeadlineLearner in fedavg mode: fedavg.epochs epochs of fedavg's lr, batch size and
    momentum, the same batch orders), every round for `rounds` rounds. There is no server, so
    no averaging, no selection and no deadline cut; nor presence draws: an agent alone trains
    even in rounds it would be offline, which can only favour the control. A round takes
    deadline + grace on the clock (the federated runs' cut-off), so that curves share a time
    axis. A round's accuracy is the mean over agents of each one's own model on the test set
    the federated runs are scored on; SimRound.agent_accuracy keeps each agent's. Cost:
    agents x rounds x epochs local epochs and agents x rounds test-set evaluations.
    """
    t_wall = time.perf_counter()
    rounds = settings.rounds if rounds is None else rounds
    target = settings.target_accuracy if target is None else target
    fedavg = fedavg or FedAvgSettings.like(settings)
    model_name = resolve_model_name(model, dataset)
    train_set = load_dataset(dataset, data_dir=data_dir)
    test = load_dataset(dataset, data_dir=data_dir, train=False)
    fleet = non_iid_fleet(spec, train_set, seed, held_out)
    learners = [DeadlineLearner(d.x, d.y, settings, algorithm="fedavg", seed=seed * 1000 + i,
                                epochs=fedavg.epochs, model_name=model_name)
                for i, d in enumerate(fleet)]
    train = TrainSettings(model_name, fedavg.lr, fedavg.batch_size, 0.0, seed, fedavg.momentum)
    if start is None:
        start = start_vector(model_name, train_set, seed)
    vectors = [start.clone() for _ in fleet]
    clock = SimClock()
    run = SimRun(label or ALONE, seed, strategy=ALONE)
    cutoff = settings.deadline_s + settings.grace_s
    for r in range(rounds):
        if clock() >= until_s:
            break
        for i, (d, learner) in enumerate(zip(fleet, learners, strict=True)):
            local = SimClock()
            work = learner.run_round(
                vectors[i], lambda x, y, anchor, d=d, local=local, r=r: SimEpochRunner(
                    train, x, y, d.speed, local, anchor, partial=False, round_id=r),
                lambda: math.inf)
            run.compute_s += local()
            vectors[i] = work.vector
        clock.advance(cutoff)
        accs = [evaluate(model_name, v, test.x, test.y)[0] for v in vectors]
        acc = statistics.fmean(accs)
        run.rounds.append(SimRound(r, clock(), acc, len(fleet), len(fleet), 0, 0, 0, cutoff,
                                   agent_accuracy=accs))
        if target and acc >= target and run.time_to_target_s is None:
            run.time_to_target_s, run.rounds_to_target = clock(), r + 1
    run.wall_s = time.perf_counter() - t_wall
    return run


def run_task(task: Task) -> SimRun:
    torch.set_num_threads(1)
    catafed, fedavg, tifl = task.variant.settings(task.base)
    if task.variant.algorithm == ALONE:
        return simulate_alone(task.spec, catafed, seed=task.seed, rounds=task.rounds,
                              target=task.target, until_s=task.until_s, dataset=task.dataset,
                              data_dir=task.data_dir, model=task.model, fedavg=fedavg,
                              label=task.variant.label, start=task.start, held_out=task.held_out)
    return simulate_fleet(task.variant.algorithm, task.spec, catafed, seed=task.seed,
                     rounds=task.rounds, target=task.target, until_s=task.until_s,
                     codec=task.codec, dataset=task.dataset, data_dir=task.data_dir,
                     model=task.model, fedavg=fedavg, tifl=tifl, label=task.variant.label,
                     start=task.start, held_out=task.held_out)


# ----------------------------------------------------------------------------- report


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summary_rows(runs: list[SimRun]) -> list[dict]:
    rows = []
    for alg in dict.fromkeys(r.algorithm for r in runs):
        mine = [r for r in runs if r.algorithm == alg]
        reached = [r.time_to_target_s for r in mine if r.time_to_target_s is not None]
        tot = [r.totals() for r in mine]
        n_rounds = max(sum(len(r.rounds) for r in mine), 1)
        finals = [r.final_accuracy for r in mine]
        agents = [r.agents_final() for r in mine if r.agents_final()]
        rows.append({
            "algorithm": alg,
            "runs": len(mine),
            "reached": len(reached),
            "time_to_target_s": _mean(reached),
            "time_to_target_ci": t_half_width(reached) if reached else None,
            "time_to_target_each": [r.time_to_target_s for r in mine],
            "rounds_to_target": [r.rounds_to_target for r in mine],
            "final_accuracy": statistics.fmean(finals),
            "final_accuracy_ci": t_half_width(finals),
            "wasted_share": sum(r.wasted_s for r in mine) / max(sum(r.compute_s for r in mine), 1e-9),
            "stragglers_per_round": sum(t["stragglers"] for t in tot) / n_rounds,
            "late_per_round": sum(t["late"] for t in tot) / n_rounds,
            "dropouts_per_round": sum(t["dropouts"] for t in tot) / n_rounds,
            "finished_per_round": sum(t["finished"] for t in tot) / n_rounds,
            "mean_round_s": statistics.fmean(x.round_s for r in mine for x in r.rounds),
            "kB_up_per_round": sum(r.bytes_up for r in mine) / 1e3 / n_rounds,
            "agents_final_range": [statistics.fmean(min(a) for a in agents),
                                   statistics.fmean(max(a) for a in agents)] if agents else None,
        })
    return rows


def paired_rows(runs: list[SimRun], reference: str) -> list[dict]:
    """`reference` against every other variant, paired by seed (the same fleet).

    Time to target: over the seeds where both reached it (n); ratio = mean of the reference's
    times / mean of the other's over those seeds. Final accuracy: over all common seeds."""
    by = {(r.algorithm, r.seed): r for r in runs}
    ref_seeds = sorted(s for (a, s) in by if a == reference)
    out = []
    for other in dict.fromkeys(r.algorithm for r in runs):
        if other == reference:
            continue
        common = [s for s in ref_seeds if (other, s) in by]
        both = [s for s in common if by[(reference, s)].time_to_target_s is not None
                and by[(other, s)].time_to_target_s is not None]
        dt = [by[(reference, s)].time_to_target_s - by[(other, s)].time_to_target_s for s in both]
        mt, ht = paired_interval(dt)
        ratio = (statistics.fmean(by[(reference, s)].time_to_target_s for s in both)
                 / statistics.fmean(by[(other, s)].time_to_target_s for s in both)) if both else None
        da = [by[(reference, s)].final_accuracy - by[(other, s)].final_accuracy for s in common]
        ma, ha = paired_interval(da)
        out.append({"reference": reference, "other": other, "seeds": len(common), "paired": len(both),
                    "dt_s": mt, "dt_ci": ht, "ratio": ratio,
                    "faster": sum(1 for d in dt if d < 0),
                    "only_reference_reached": sum(1 for s in common if by[(reference, s)].time_to_target_s
                                                  is not None and by[(other, s)].time_to_target_s is None),
                    "only_other_reached": sum(1 for s in common if by[(reference, s)].time_to_target_s
                                              is None and by[(other, s)].time_to_target_s is not None),
                    "dacc_pp": 100 * ma, "dacc_ci_pp": 100 * ha})
    return out


def _pm(mean: float | None, half: float | None, fmt: str) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "-"
    if half is None or math.isnan(half):
        return format(mean, fmt)
    return f"{format(mean, fmt)} ± {format(half, fmt)}"


def markdown_table(rows: list[dict], target: float) -> str:
    head = (f"| algorithm | reached target | sim time to {target:.2f} (mean ± 95 % CI) | per seed | "
            "final acc (mean ± 95 % CI) | wasted work | finished / stragglers / late / dropouts "
            "per round | mean round |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        ttt = _pm(r["time_to_target_s"], r.get("time_to_target_ci"), ".0f")
        ttt = ttt + " s" if ttt != "-" else ttt
        each = ", ".join("-" if v is None else f"{v:.0f}" for v in r["time_to_target_each"])
        lines.append(f"| {r['algorithm']} | {r['reached']}/{r['runs']} | {ttt} | {each} | "
                     f"{_pm(r['final_accuracy'], r.get('final_accuracy_ci'), '.3f')} | "
                     f"{100 * r['wasted_share']:.1f} % | "
                     f"{r['finished_per_round']:.2f} / {r['stragglers_per_round']:.2f} / "
                     f"{r['late_per_round']:.2f} / {r['dropouts_per_round']:.2f} | "
                     f"{r['mean_round_s']:.1f} s |")
    notes = [f"\n{r['algorithm']}: the mean over agents of each one's own model, trained alone; "
             f"the worst agent ends at {r['agents_final_range'][0]:.3f}, the best at "
             f"{r['agents_final_range'][1]:.3f} (mean over fleets).\n"
             for r in rows if r.get("agents_final_range")]
    return head + "\n".join(lines) + "\n" + "".join(notes)


def paired_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    head = ("| comparison | fleets (both reached) | time to target: paired diff (95 % CI) | ratio | "
            "faster on | final acc: paired diff (95 % CI) |\n|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        dt = "-" if r["paired"] == 0 else f"{r['dt_s']:+.1f} s ({r['dt_s'] - r['dt_ci']:+.1f} to {r['dt_s'] + r['dt_ci']:+.1f})"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        extra = ""
        if r["only_reference_reached"] or r["only_other_reached"]:
            extra = f"; only one reached: {r['reference']} {r['only_reference_reached']}, {r['other']} {r['only_other_reached']}"
        lines.append(f"| {r['reference']} - {r['other']} | {r['seeds']} ({r['paired']}) | {dt} | {ratio} | "
                     f"{r['faster']}/{r['paired']}{extra} | {r['dacc_pp']:+.2f} pp "
                     f"({r['dacc_pp'] - r['dacc_ci_pp']:+.2f} to {r['dacc_pp'] + r['dacc_ci_pp']:+.2f}) |")
    return head + "\n".join(lines) + "\n"


def load_results(path: Path) -> tuple[list[SimRun], float, dict]:
    """(runs, target accuracy, the whole file) from a results.json that `main` wrote."""
    data = json.loads(Path(path).read_text())
    runs = [SimRun(**{**{k: v for k, v in r.items() if k != "rounds"},
                      "rounds": [SimRound(**x) for x in r["rounds"]]}) for r in data["runs"]]
    return runs, float(data["settings"]["target_accuracy"]), data


def curve(run: SimRun, grid: np.ndarray) -> np.ndarray:
    """The run's test accuracy at each grid time (the last evaluation before it; nan before the
    first round closed and after the run ended)."""
    if not run.rounds:
        return np.full(len(grid), np.nan)
    times = np.array([r.time_s for r in run.rounds])
    accs = np.array([r.accuracy for r in run.rounds])
    idx = np.searchsorted(times, grid, side="right") - 1
    out = np.where(idx >= 0, accs[np.clip(idx, 0, None)], np.nan)
    out[grid > times[-1]] = np.nan
    return out


def plot(runs: list[SimRun], path: Path, target: float | None = None) -> None:
    """Mean test accuracy over simulated time per variant with its 95 % band over seeds, and
    each seed's time to the target."""
    from sim.figures import figure_legend, method_color, pyplot, save_figure

    labels = list(dict.fromkeys(r.algorithm for r in runs))
    colors = {lab: method_color(lab) for lab in labels}
    spare = iter(["tab:olive", "tab:cyan", "tab:pink", "tab:gray", "gold", "navy", "teal", "black"])
    for lab in labels:
        if colors[lab] == "black":
            colors[lab] = next(spare, "black")
    end = min(x.rounds[-1].time_s for x in runs if x.rounds)  # where every run still has data
    grid = np.linspace(0.0, end, 200)
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for j, lab in enumerate(labels):
        mine = [r for r in runs if r.algorithm == lab]
        ys = np.array([curve(r, grid) for r in mine])
        with warnings.catch_warnings():  # grid points before any fleet's first round: nan
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(ys, axis=0)
            half = np.array([t_half_width([v for v in col if not np.isnan(v)]) for col in ys.T])
        ax1.plot(grid, mean, color=colors[lab], label=lab)
        if len(mine) >= 3:  # with two fleets a t interval is wider than the axis
            ax1.fill_between(grid, np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1),
                             color=colors[lab], alpha=0.2, lw=0)
        each = [r.time_to_target_s for r in mine if r.time_to_target_s is not None]
        ax2.plot(each, [j] * len(each), ".", color=colors[lab], ms=6)
        if each:
            ax2.plot([statistics.fmean(each)], [j], "|", color="k", ms=14)
    if target:
        ax1.axhline(target, color="k", lw=0.8, ls=":")
    ax1.set(xlabel="simulated time (s)", ylabel="test accuracy",
            title="accuracy over time (mean, 95 % band over fleets)")
    ax2.set_yticks(range(len(labels)), labels)
    ax2.set(xlabel="simulated s to target", title="time to target per fleet (|: mean)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    figure_legend(fig, (ax1,))
    save_figure(fig, path)


def round_overrides(a: argparse.Namespace) -> dict[str, str]:
    """The config keys every variant shares: the round's flags, then each --set."""
    base = {"catafed.groups": str(a.groups), "catafed.per_group": str(a.per_group),
            "catafed.deadline_s": str(a.deadline), "catafed.grace_s": str(a.grace),
            "catafed.epochs": str(a.epochs), "catafed.rounds": str(a.rounds),
            "catafed.target_accuracy": str(a.target)}
    for item in a.set:
        k, sep, v = item.partition("=")
        if not sep or "." not in k:
            raise UsageError(f"--set expects section.key=value, got {item!r}")
        base[k.strip()] = v.strip()
    return base


def checked_settings(variants: list[Variant], base: dict[str, str]
                     ) -> dict[str, tuple[CataFedSettings, FedAvgSettings, TiflSettings]]:
    """Each variant's settings, built once on both sides (server strategy, agent learner) so
    that a bad value is a one-line usage error before anything runs."""
    try:
        out = {v.label: v.settings(base) for v in variants}
        for v in variants:
            catafed, fedavg, tifl = out[v.label]
            algorithm = "fedavg" if v.algorithm == ALONE else v.algorithm  # alone trains as FedAvg
            make_round_strategy(algorithm, catafed, torch.zeros(1), fedavg=fedavg, tifl=tifl)
            DeadlineLearner(torch.zeros(1, 1, 1, 1), torch.zeros(1, dtype=torch.int64), catafed,
                            algorithm=algorithm)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    return out


def add_round_arguments(p: argparse.ArgumentParser, *, agents: int, slow_share: float,
                        rounds: int, target: float, groups: int, per_group: int,
                        alone: bool = False) -> None:
    """The flags sim.rounds and sim.rounds_live share (round_overrides reads them); each
    passes the defaults of its own fleet (`alone`: whether --algorithms takes the control)."""
    control = ", alone (each agent trains only on its own data: the no-federation control)" \
        if alone else ""
    p.add_argument("--algorithms", default="catafed,fedavg,fedprox,tifl",
                   help=f"comma list of catafed, fedavg, fedprox, tifl{control}, or "
                        "LABEL=ALG:section.key=value:... variants (e.g. "
                        "no-pf=catafed:catafed.selection=random); default the four algorithms")
    p.add_argument("--seeds", default="1",
                   help="fleet seeds: a comma list (0,1,2) or a count N (seeds 0..N-1); default 1 (seed 0)")
    p.add_argument("--dataset",
                   help="digits (default, offline; with --data-dir: the dataset there), synthetic, or any fedmq "
                        "dataset (mnist, ... with --data-dir)")
    p.add_argument("--data-dir", default=None, metavar="DIR", help="dataset root (torchvision layout)")
    p.add_argument("--model", default="auto", help="zoo name, auto (default: fits the dataset), torchvision:NAME[?k=v&...] or "
                   "module.path:factory[?k=v&...] (docs/models.md)")
    p.add_argument("--agents", type=int, default=agents)
    p.add_argument("--slow-share", type=float, default=slow_share)
    p.add_argument("--slow-factor", type=float, default=FleetSpec.slow_factor)
    p.add_argument("--label-alpha", type=float, default=FleetSpec.label_alpha,
                   help="Dirichlet concentration of each agent's label mix (smaller: more non-IID)")
    p.add_argument("--rounds", type=int, default=rounds, help=f"most rounds per run (default {rounds})")
    p.add_argument("--target", type=float, default=target,
                   help=f"test accuracy whose first reaching is timed (default {target}; runs go on)")
    p.add_argument("--deadline", type=float, default=20.0, help="T in simulated seconds")
    p.add_argument("--grace", type=float, default=2.0, help="cut-off T + grace, simulated seconds")
    p.add_argument("--groups", type=int, default=groups)
    p.add_argument("--per-group", type=int, default=per_group,
                   help="N, agents per round (CATA-Fed's per group; the baselines' clients per round)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for every variant, e.g. --set catafed.pf_initial=100 (repeatable)")
    p.add_argument("--out", default="", help="directory for results.json, table.md, accuracy.png")
    p.add_argument("--dry-run", action="store_true", help="check the flags, print the plan and exit")


def main(argv: list[str] | None = None, prog: str = "python -m sim.rounds") -> int:
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_round_arguments(p, agents=FleetSpec.agents, slow_share=FleetSpec.slow_share, rounds=80,
                        target=0.85, groups=3, per_group=5, alone=True)
    p.add_argument("--reference", default="",
                   help="comma list of the variants every other one is paired against (default: the first)")
    p.add_argument("--dropout-p", type=float, default=FleetSpec.dropout_p)
    p.add_argument("--return-p", type=float, default=FleetSpec.return_p)
    p.add_argument("--until", type=float, default=math.inf, metavar="S",
                   help="stop each run at this simulated time (same for every algorithm)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes, one run each; 0: one per CPU core (default 1)")
    p.add_argument("--pretrain", type=int, default=0, metavar="N",
                   help="start every algorithm and the alone control from the seeded init trained "
                        "centrally on N training images that no agent holds (as a team starts from its "
                        "own pre-trained weights); default 0: the random init")
    p.add_argument("--init", metavar="FILE",
                   help="start every algorithm and the alone control from this file (a torch state dict "
                        "or .f32 vector, e.g. `fedmq start-model`'s; docs/models.md)")
    p.add_argument("--pretrain-epochs", type=int, default=20, metavar="E",
                   help="epochs of that training (SGD at 0.01, momentum 0.9, batches of 32; default 20)")
    a = p.parse_args(argv)
    a.dataset = dataset_for_data_dir(a.dataset, a.data_dir)
    torch.set_num_threads(1)
    spec = FleetSpec(agents=a.agents, slow_share=a.slow_share, slow_factor=a.slow_factor,
                     dropout_p=a.dropout_p, return_p=a.return_p, label_alpha=a.label_alpha)
    base = round_overrides(a)
    variants = parse_variants(a.algorithms, alone=True)
    seeds = seed_list(a.seeds, 0)
    references = [x.strip() for x in (a.reference or variants[0].label).split(",") if x.strip()]
    for reference in references:
        if reference not in {v.label for v in variants}:
            raise UsageError(f"--reference {reference!r} is not one of the variants")
    settings = checked_settings(variants, base)  # not a traceback in a worker later
    train = load_dataset(a.dataset, data_dir=a.data_dir)
    if not has_default_model(a.dataset):  # a folder's model from its images, as every role picks it
        a.model = model_for_images(a.model, a.dataset, train.image_shape, train.num_classes)
    model_name = resolve_model_name(a.model, a.dataset)
    start_pool(len(train.y), 0, a.pretrain)  # a bad --pretrain is a usage error before anything runs
    if a.init and a.pretrain:
        raise UsageError("--init and --pretrain both name the start: give one")
    init = load_init_vector(a.init, model_name) if a.init else None  # one line for a file that does not fit
    if a.pretrain_epochs < 1:
        raise UsageError(f"--pretrain-epochs must be >= 1, got {a.pretrain_epochs}")
    if a.dry_run:
        print(f"{', '.join(v.label for v in variants)} x seeds {seeds} on {a.dataset} ({train!r}, "
              f"{model_name}): {spec}, until {a.until} s / {a.rounds} rounds; output {a.out or '-'} "
              "(dry run: nothing run)")
        return 0
    if a.jobs < 0:
        raise UsageError(f"--jobs must be >= 1, or 0 for one per CPU core, got {a.jobs}")
    a.jobs = a.jobs or os.cpu_count() or 1
    starts = {}
    test = load_dataset(a.dataset, data_dir=a.data_dir, train=False) if a.pretrain else None
    for seed in seeds:
        if a.pretrain:
            print(f"seed {seed}: training the shared start on {a.pretrain} held-out images, "
                  f"{a.pretrain_epochs} epochs", flush=True)
            starts[seed] = start_vector(model_name, train, seed, a.pretrain, a.pretrain_epochs)
            acc, _ = evaluate(model_name, starts[seed], test.x, test.y)
            print(f"seed {seed}: start accuracy {acc:.3f} on the test set", flush=True)
        else:
            starts[seed] = init
    tasks = [Task(v, spec, base, seed, a.rounds, a.until, a.target, a.dataset, a.data_dir, a.model,
                  start=starts[seed], held_out=a.pretrain)
             for seed in seeds for v in variants]
    runs: list[SimRun] = []
    done = 0

    def show(run: SimRun) -> None:
        nonlocal done
        done += 1
        ttt = "-" if run.time_to_target_s is None else f"{run.time_to_target_s:.0f} s"
        print(f"[{done}/{len(tasks)}] {run.algorithm:10s} seed {run.seed}: {len(run.rounds)} rounds, "
              f"sim {run.rounds[-1].time_s:.0f} s, final acc {run.final_accuracy:.3f}, target at {ttt} "
              f"(wall {run.wall_s:.1f} s)", flush=True)

    if a.jobs == 1:
        for t in tasks:
            runs.append(run_task(t))
            show(runs[-1])
    else:
        import multiprocessing

        with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for run in pool.map(run_task, tasks):
                runs.append(run)
                show(run)
    order = {v.label: i for i, v in enumerate(variants)}
    runs.sort(key=lambda r: (order[r.algorithm], r.seed))
    rows = summary_rows(runs)
    pairs = [p for ref in references for p in paired_rows(runs, ref)
             if not (p["other"] in references and references.index(p["other"]) < references.index(ref))]
    table = markdown_table(rows, a.target) + "\n" + paired_table(pairs)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(table)
        settings_json = asdict(settings[variants[0].label][0])
        (out / "results.json").write_text(json.dumps(
            {"fleet": asdict(spec), "settings": settings_json, "dataset": a.dataset,
             "model": model_name, "until_s": None if math.isinf(a.until) else a.until,
             "pretrain": {"images": a.pretrain, "epochs": a.pretrain_epochs} if a.pretrain else None,
             "reference": references,
             "variants": [asdict(v) for v in variants], "summary": rows, "paired": pairs,
             "runs": [{**{k: v for k, v in asdict(r).items() if k != "rounds"},
                       "rounds": [asdict(x) for x in r.rounds]} for r in runs]}, indent=1))
        plot(runs, out / "accuracy.png", a.target)
        print(f"wrote {out}/table.md, results.json, accuracy.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m sim.rounds", main))
