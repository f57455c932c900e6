"""The real-time twin of sim/rounds.py: the same fleets as RoundService + RoundAgents over MQTT.

    python -m sim.rounds_live --twin --seeds 0,1 --out results/catafed/live

sim/rounds.py replaces the wire and the clock to compare CATA-Fed, FedAvg, FedProx and TiFL
cheaply; this runs what it stands for, so that the two can be checked against each other.
Seed s gives the same devices and data (`non_iid_fleet`), the same initial model and the same
strategy seed; the aggregator is the real `RoundService` (aggregator/round_service.py) with the test
split as its evaluator, as `fedmq aggregator` builds it; each device is a real `RoundAgent`
(edge_agent/round_agent.py, a thread of this process) on a real Mosquitto (its own on a free
loopback port unless `--broker URL`), on the wall clock.

Time: `--time-scale F` wall seconds stand for one simulated second. Deadline, grace and the
agents' eps_i settings are multiplied by F; a device of speed v (samples per simulated
second) waits F / v s per sample before each epoch's compute (`extra_s_per_sample`, the sleep
emulation of edge_agent/deadline.py), and its link sleeps F x bytes / bandwidth before
handling an invite and before publishing a report, with the byte counts sim/rounds.py uses.
Real compute (~0.1 ms per sample for the digits CNN, more on a busy machine) and MQTT
latency come on top, so live devices are a little slower than their profile. Times in the
output are simulated seconds: wall seconds / F.

What the live runner leaves out: presence churn (`dropout_p` is 0: nobody goes offline; the
twin runs with 0 too), so every invited agent silent at the cut-off counts as late. A device
stays busy with a late round's work after the cut-off (the simulator starts every round
fresh), and a FedProx epoch cut by the deadline trains nothing live (the sleep comes before
the compute) where the simulator trains on the part that fit; docs/results_catafed_live.md
discusses what that does to the comparison.

Output (`--out`): results.json in sim/rounds.py's format (live runs labelled like the
variant, twin runs "LABEL (sim)"; plus the invitees of every round), table.md (the summary and
a live-vs-sim table per algorithm), accuracy.png (sim.rounds' figure) and, with --twin,
live_vs_sim.png (each fleet's accuracy, live and simulated, per algorithm).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from aggregator.round_algorithms import make_round_strategy
from aggregator.round_service import RoundRecord, RoundService
from edge_agent.round_agent import RoundAgent
from fedmq import codecs, protocol
from fedmq.broker import BrokerError, MosquittoBroker, find_mosquitto
from fedmq.config import (
    CataFedSettings,
    Config,
    FedAvgSettings,
    TiflSettings,
    load_config,
)
from fedmq.data import Dataset, dataset_for_data_dir, load_dataset
from fedmq.errors import ArgumentParser, RuntimeFailure, UsageError, run_main
from fedmq.models import build_model, resolve_model_name, to_vector
from fedmq.redact import mask_secrets
from fedmq.training import evaluate, fit
from fedmq.transport import check_reachable
from sim.rounds import (
    FleetSpec,
    SimDevice,
    SimRound,
    SimRun,
    Variant,
    add_round_arguments,
    checked_settings,
    markdown_table,
    non_iid_fleet,
    paired_rows,
    parse_variants,
    plot,
    round_overrides,
    simulate_fleet,
    summary_rows,
)
from sim.seeds import seed_list

STRAGGLER_REPORT_BYTES = 64
"""What sim/rounds.py charges for a report without a model (a straggler's)."""
SIM_SUFFIX = " (sim)"
"""Twin runs are labelled with the variant's label and this."""
POOL_WAIT_S = 60.0
"""How long a run waits for all its agents to join (generous: a busy 2-core machine)."""


def sim_label(label: str) -> str:
    return label + SIM_SUFFIX


def scaled(settings: CataFedSettings, time_scale: float) -> CataFedSettings:
    """[catafed] in wall seconds: deadline, grace and the eps_i knobs times the scale."""
    f = time_scale
    return replace(settings, deadline_s=settings.deadline_s * f, grace_s=settings.grace_s * f,
                   eps_initial_s=settings.eps_initial_s * f, eps_min_s=settings.eps_min_s * f)


def report_bytes(report: protocol.Report) -> int:
    """The bytes sim/rounds.py charges a report's upload with."""
    return codecs.encoded_size(report.tensor) if report.tensor is not None else STRAGGLER_REPORT_BYTES


class EmulatedAgent(RoundAgent):
    """A RoundAgent as slow as a `SimDevice`: compute by `extra_s_per_sample`, the link by sleeps.

    The download of an invite starts when it arrives (also while the agent is busy with an
    older round) and the agent's deadline counts from its end, as in the simulator; the upload
    sleep happens inside the agent's measured send, so eps_i learns it. Batches are shuffled
    with the fleet seed, as sim/rounds.py does, so that both sides see the same batch order.
    """

    def __init__(self, cfg: Config, agent_id: str, device: SimDevice, *, algorithm: str,
                 seed: int, batch_seed: int, time_scale: float) -> None:
        super().__init__(cfg, agent_id, device.x, device.y, algorithm=algorithm,
                         extra_s_per_sample=time_scale / device.speed, seed=seed)
        self.train = replace(self.train, seed=batch_seed)
        self.s_per_byte = time_scale / device.bandwidth
        self.cut_short: list[tuple[int, float]] = []
        """(round, wall seconds) of work the end of the run interrupted (it was late anyway)."""
        send = self.channel.send

        def send_slowly(topic: str, envelope: protocol.Envelope, **kw: object) -> list:
            if isinstance(envelope, protocol.Report):
                self._stop.wait(self.s_per_byte * report_bytes(envelope))
            return send(topic, envelope, **kw)

        self.channel.send = send_slowly  # type: ignore[method-assign]

    def handle_invite(self, invite: protocol.RoundInvite, received_at: float) -> None:
        arrived = received_at + self.s_per_byte * codecs.encoded_size(invite.tensor)
        if self._stop.wait(max(arrived - time.monotonic(), 0.0)):
            return
        t0, logged = time.monotonic(), len(self.log)
        super().handle_invite(invite, arrived)
        if len(self.log) == logged and self._stop.is_set():  # the run ended: work for nothing
            self.cut_short.append((invite.round, time.monotonic() - t0))


@dataclass
class LiveRun:
    """A live run's per-round invitees and counters, beside its `SimRun`."""

    algorithm: str
    seed: int
    strategy: str
    time_scale: float
    rounds: list[dict] = field(default_factory=list)
    """Per round: selected, finished, stragglers, silent (agent ids), sizes as invited,
    sizes_after (the server's size of each invitee after the round), ended, wall_s."""
    skipped: int = 0
    """Invites agents skipped because they came to them after the deadline (busy)."""
    late_reports: int = 0
    """Reports the service got after their round had closed."""
    errors: list[str] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    """Error replies the agents got from the service (a refused join or report), by reason: each
    is counted and the agent answers the next invite as usual."""
    reports: list[dict] = field(default_factory=list)
    """Every report an agent sent (its RoundLog; seconds simulated), late ones included."""


@contextmanager
def broker_url(given: str | None) -> Iterator[str]:
    """The broker to use: `given` (checked reachable) or a fresh Mosquitto on a free port."""
    if given:
        check_reachable(given)
        yield given
        return
    if find_mosquitto() is None:
        raise RuntimeFailure("mosquitto is not installed (apt-get install mosquitto), or pass "
                             "--broker URL")
    with tempfile.TemporaryDirectory(prefix="fedmq-live-") as tmp:
        try:
            broker = MosquittoBroker.dev(workdir=Path(tmp) / "broker").start()
        except BrokerError as e:
            raise RuntimeFailure(f"could not start mosquitto: {e}") from None
        try:
            yield broker.url
        finally:
            broker.stop()


def run_live(variant: Variant, spec: FleetSpec,
             settings: tuple[CataFedSettings, FedAvgSettings, TiflSettings], *, seed: int,
             rounds: int, target: float, time_scale: float, url: str, train: Dataset,
             test: Dataset, model_name: str, dataset: str,
             on_round: Callable[[RoundRecord, SimRound], None] | None = None,
             ) -> tuple[SimRun, LiveRun]:
    """One variant on one seeded fleet over MQTT in real time; times in simulated seconds."""
    t_wall = time.perf_counter()
    catafed, fedavg, tifl = settings
    tag = uuid.uuid4().hex[:8]  # fresh fleet and client ids: nothing leaks between runs
    cfg = load_config(overrides={"fleet": f"live-{tag}", "broker.url": url,
                                 "data.dataset": dataset, "model": model_name,
                                 "broker.session_expiry_s": 600})
    cfg.catafed, cfg.fedavg, cfg.tifl = scaled(catafed, time_scale), fedavg, tifl
    fleet = non_iid_fleet(spec, train, seed)
    strategy = make_round_strategy(variant.algorithm, cfg.catafed,
                             to_vector(build_model(model_name, seed=seed)), seed=seed,
                             fedavg=fedavg, tifl=tifl)
    service = RoundService(cfg, strategy, model_name=model_name,
                           evaluate=lambda w: evaluate(model_name, w, test.x, test.y)[0])
    # The ids sort as the simulator's do (one prefix), so every sorted-pool choice is the same.
    agents = [EmulatedAgent(cfg, f"{tag}-{d.agent}", d, algorithm=variant.algorithm,
                            seed=seed * 1000 + i, batch_seed=seed, time_scale=time_scale)
              for i, d in enumerate(fleet)]

    def plain_id(agent: str) -> str:
        return agent.removeprefix(f"{tag}-")

    def plain(ids: list[str]) -> list[str]:
        return [plain_id(a) for a in ids]

    run = SimRun(variant.label, seed, strategy=variant.algorithm)
    live = LiveRun(variant.label, seed, variant.algorithm, time_scale)
    start = 0.0

    def closed(r: RoundRecord) -> None:
        now = time.monotonic()
        row = SimRound(r.round, (now - start) / time_scale, float(r.accuracy or 0.0),
                       len(r.selected), len(r.finished), len(r.stragglers), 0, len(r.dropouts),
                       r.seconds / time_scale)
        run.rounds.append(row)
        live.rounds.append({
            "round": r.round, "selected": plain(r.selected), "finished": plain(r.finished),
            "stragglers": plain(r.stragglers), "silent": plain(r.dropouts),
            "sizes": {plain_id(a): n for a, n in r.sizes.items()},
            "sizes_after": {plain_id(a): strategy.agents[a].size for a in r.selected},
            "ended": r.ended, "wall_s": r.seconds})
        if target and row.accuracy >= target and run.time_to_target_s is None:
            run.time_to_target_s, run.rounds_to_target = row.time_s, r.round + 1
        if on_round is not None:
            on_round(r, row)

    with ExitStack() as stack:
        stack.enter_context(service)
        for a in agents:
            stack.callback(a.stop)
            a.start()
        if not service.wait_for_pool(len(agents), POOL_WAIT_S):
            raise RuntimeFailure(f"only {len(strategy.pool())} of {len(agents)} agents joined "
                                 f"within {POOL_WAIT_S:.0f} s")
        start = time.monotonic()
        records = service.run(rounds, 0.0, min_agents=1, wait_s=POOL_WAIT_S, on_round=closed)
    accepted = {(a, r.round) for r in records for a in r.finished}
    for a in agents:
        live.skipped += a.counters["skipped"]
        live.errors += [f"{plain_id(a.agent_id)}: {e}" for e in a.errors]
        for key, n in a.counters.items():
            if key.startswith("refused.") and n:
                reason = key.removeprefix("refused.")
                live.refused[reason] = live.refused.get(reason, 0) + n
        for entry in a.log:
            live.reports.append({"agent": plain_id(a.agent_id), "round": entry.round,
                                 "finished": entry.finished, "epochs": entry.epochs,
                                 "n_samples": entry.n_samples, "shard_used": entry.shard_used,
                                 "train_s": entry.train_s / time_scale,
                                 "upload_s": entry.upload_s / time_scale})
            run.compute_s += entry.train_s / time_scale
            if (a.agent_id, entry.round) not in accepted:
                run.wasted_s += entry.train_s / time_scale
        for _, seconds in a.cut_short:
            run.compute_s += seconds / time_scale
            run.wasted_s += seconds / time_scale
    live.late_reports = service.counters["reports.late"]
    run.bytes_down = sum(r.bytes_down for r in records)
    run.bytes_up = sum(r.bytes_up for r in records)
    run.wall_s = time.perf_counter() - t_wall
    return run, live


# ----------------------------------------------------------------------------- report


def live_vs_sim_rows(runs: list[SimRun], live: list[LiveRun], twin: dict[tuple[str, int], list]
                     ) -> list[dict]:
    """Per variant with a twin: the live and the sim side of each summary figure, and in how
    many rounds both invited the same agents."""
    rows = {r["algorithm"]: r for r in summary_rows(runs)}
    out = []
    for label in dict.fromkeys(x.algorithm for x in live):
        if sim_label(label) not in rows:
            continue
        same = total = 0
        for lv in (x for x in live if x.algorithm == label):
            sim_sel = twin.get((label, lv.seed), [])
            for rec, sel in zip(lv.rounds, sim_sel, strict=False):
                total += 1
                same += sorted(rec["selected"]) == sorted(sel)
        sides = {}
        for side, key in (("live", label), ("sim", sim_label(label))):
            mine = [r for r in runs if r.algorithm == key]
            row = rows[key]
            sides[side] = {"rounds": statistics.fmean(len(r.rounds) for r in mine),
                           "reached": row["reached"], "runs": row["runs"],
                           "time_to_target_s": row["time_to_target_s"],
                           "final_accuracy": row["final_accuracy"],
                           "mean_round_s": row["mean_round_s"],
                           "stragglers_per_round": row["stragglers_per_round"],
                           "late_per_round": row["late_per_round"],
                           "wasted_share": row["wasted_share"]}
        out.append({"algorithm": label, **sides, "same_invitees": same, "rounds_compared": total})
    return out


def live_vs_sim_table(rows: list[dict], target: float) -> str:
    if not rows:
        return ""
    head = (f"| algorithm | rounds | reached {target:.2f} | time to target | final acc | "
            "mean round | stragglers / round | late / round | wasted work | same invitees |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    cells: list[tuple[str, Callable[[dict], str]]] = [
        ("rounds", lambda s: f"{s['rounds']:.0f}"),
        ("reached", lambda s: f"{s['reached']}/{s['runs']}"),
        ("time_to_target_s", lambda s: "-" if s["time_to_target_s"] is None
         else f"{s['time_to_target_s']:.0f} s"),
        ("final_accuracy", lambda s: f"{s['final_accuracy']:.3f}"),
        ("mean_round_s", lambda s: f"{s['mean_round_s']:.1f} s"),
        ("stragglers_per_round", lambda s: f"{s['stragglers_per_round']:.2f}"),
        ("late_per_round", lambda s: f"{s['late_per_round']:.2f}"),
        ("wasted_share", lambda s: f"{100 * s['wasted_share']:.0f} %"),
    ]
    lines = [f"| {r['algorithm']} | "
             + " | ".join(f"{fmt(r['live'])} / {fmt(r['sim'])}" for _, fmt in cells)
             + f" | {r['same_invitees']}/{r['rounds_compared']} |" for r in rows]
    return ("Live / sim (times in simulated seconds, means over seeds; same invitees: rounds in "
            "which the live service and the simulator invited the same agents):\n\n"
            + head + "\n".join(lines) + "\n")


def plot_live_vs_sim(runs: list[SimRun], path: Path, target: float | None = None) -> None:
    """One panel per variant: each seed's test accuracy over simulated time, live (solid)
    and simulated (dashed) in the seed's colour; where they overlap, the two agree."""
    from sim.figures import figure_legend, pyplot, save_figure

    labels = [x for x in dict.fromkeys(r.algorithm for r in runs) if not x.endswith(SIM_SUFFIX)]
    seeds = sorted({r.seed for r in runs})
    colors = dict(zip(seeds, [f"C{i % 10}" for i in range(len(seeds))], strict=True))
    fig, axes = pyplot().subplots(1, len(labels), figsize=(3.6 * len(labels), 3.4), sharey=True,
                                  squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        for r in runs:
            if r.algorithm.removesuffix(SIM_SUFFIX) != label or not r.rounds:
                continue
            sim = r.algorithm.endswith(SIM_SUFFIX)
            ax.step([x.time_s for x in r.rounds], [x.accuracy for x in r.rounds],
                    where="post", color=colors[r.seed],
                    ls="--" if sim else "-", lw=1.0 if sim else 1.6,
                    label=f"seed {r.seed} {'sim' if sim else 'live'}")
        if target:
            ax.axhline(target, color="k", lw=0.8, ls=":")
        ax.set(title=label, xlabel="simulated time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    figure_legend(fig, axes)
    save_figure(fig, path)


def _run_dict(r: SimRun) -> dict:
    return {**{k: v for k, v in asdict(r).items() if k != "rounds"},
            "rounds": [asdict(x) for x in r.rounds]}


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None, prog: str = "python -m sim.rounds_live") -> int:
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_round_arguments(p, agents=8, slow_share=0.25, rounds=10, target=0.6, groups=2, per_group=3)
    p.add_argument("--time-scale", type=float, default=0.25, metavar="F",
                   help="wall seconds per simulated second (default 0.25: a 20 s deadline is 5 s)")
    p.add_argument("--broker", default="", metavar="URL",
                   help="an MQTT broker to use (default: start a Mosquitto on a free loopback port)")
    p.add_argument("--twin", action="store_true",
                   help="also run sim.rounds' simulator on the same seeds and settings")
    a = p.parse_args(argv)
    a.dataset = dataset_for_data_dir(a.dataset, a.data_dir)
    torch.set_num_threads(1)
    if not (a.time_scale > 0 and math.isfinite(a.time_scale)):
        raise UsageError(f"--time-scale must be > 0, got {a.time_scale}")
    if a.agents < 1 or a.rounds < 1:
        raise UsageError("--agents and --rounds must be >= 1")
    spec = FleetSpec(agents=a.agents, slow_share=a.slow_share, slow_factor=a.slow_factor,
                     dropout_p=0.0, label_alpha=a.label_alpha)
    base = round_overrides(a)
    variants = parse_variants(a.algorithms)
    seeds = seed_list(a.seeds, 0)
    settings = checked_settings(variants, base)  # a bad value: one line now, not mid-run
    model_name = resolve_model_name(a.model, a.dataset)
    train = load_dataset(a.dataset, data_dir=a.data_dir)
    test = load_dataset(a.dataset, data_dir=a.data_dir, train=False)
    cutoff = (a.deadline + a.grace) * a.time_scale
    if a.dry_run:
        print(f"{', '.join(v.label for v in variants)} x seeds {seeds} live on "
              f"{mask_secrets(a.broker) if a.broker else 'an own Mosquitto'}"
              f"{' and simulated' if a.twin else ''}, {a.dataset} ({model_name}): {spec}; "
              f"{a.rounds} rounds, cut-off {cutoff:.2f} wall s (time scale {a.time_scale}), at most "
              f"~{len(variants) * len(seeds) * a.rounds * cutoff / 60:.1f} min; output "
              f"{a.out or '-'} (dry run: nothing run)")
        return 0
    # torch's first fit and evaluation take seconds: pay them here, not in round 1.
    w = to_vector(build_model(model_name, seed=0))
    fit(model_name, w, train.x[:32], train.y[:32])
    evaluate(model_name, w, test.x[:32], test.y[:32])

    runs: list[SimRun] = []
    live: list[LiveRun] = []
    twin: dict[tuple[str, int], list[list[str]]] = {}
    total = len(variants) * len(seeds)
    done = 0
    with broker_url(a.broker or None) as url:
        for seed in seeds:
            for v in variants:
                done += 1
                where = f"[{done}/{total}] {v.label} seed {seed}"

                def show(r: RoundRecord, row: SimRound, where: str = where) -> None:
                    print(f"{where} round {r.round + 1}/{a.rounds}: invited {len(r.selected)}, "
                          f"finished {len(r.finished)}, stragglers {len(r.stragglers)}, late "
                          f"{len(r.dropouts)}, {r.ended} after {r.seconds:.2f} s wall "
                          f"({row.round_s:.1f} sim s), accuracy {row.accuracy:.3f}", flush=True)

                run, lv = run_live(v, spec, settings[v.label], seed=seed, rounds=a.rounds,
                                   target=a.target, time_scale=a.time_scale, url=url, train=train,
                                   test=test, model_name=model_name, dataset=a.dataset,
                                   on_round=show)
                runs.append(run)
                live.append(lv)
                ttt = "-" if run.time_to_target_s is None else f"{run.time_to_target_s:.0f} s"
                print(f"{where} live: {len(run.rounds)} rounds, sim {run.rounds[-1].time_s:.0f} s, "
                      f"final acc {run.final_accuracy:.3f}, target at {ttt} (wall {run.wall_s:.1f} s)"
                      + (f"; agent errors: {', '.join(lv.errors)}" if lv.errors else "")
                      + (f"; refused: {', '.join(f'{k} {n}' for k, n in sorted(lv.refused.items()))}"
                         if lv.refused else ""), flush=True)
                if a.twin:
                    catafed, fedavg, tifl = settings[v.label]
                    sim = simulate_fleet(v.algorithm, spec, catafed, seed=seed, rounds=a.rounds,
                                    target=a.target, dataset=a.dataset, data_dir=a.data_dir,
                                    model=a.model, fedavg=fedavg, tifl=tifl,
                                    label=sim_label(v.label))
                    twin[(v.label, seed)] = [r.invited for r in sim.rounds]
                    runs.append(sim)
                    ttt = "-" if sim.time_to_target_s is None else f"{sim.time_to_target_s:.0f} s"
                    print(f"{where} sim:  {len(sim.rounds)} rounds, sim {sim.rounds[-1].time_s:.0f} s, "
                          f"final acc {sim.final_accuracy:.3f}, target at {ttt} "
                          f"(wall {sim.wall_s:.1f} s)", flush=True)
    order = {v.label: i for i, v in enumerate(variants)}
    runs.sort(key=lambda r: (order[r.algorithm.removesuffix(SIM_SUFFIX)],
                             r.algorithm.endswith(SIM_SUFFIX), r.seed))
    rows = summary_rows(runs)
    reference = variants[0].label
    pairs = paired_rows(runs, reference)
    versus = live_vs_sim_rows(runs, live, twin)
    table = markdown_table(rows, a.target) + "\n" + live_vs_sim_table(versus, a.target)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(table)
        (out / "results.json").write_text(json.dumps(
            {"fleet": asdict(spec), "settings": asdict(settings[reference][0]), "dataset": a.dataset,
             "model": model_name, "until_s": None, "reference": reference,
             "variants": [asdict(v) for v in variants], "summary": rows, "paired": pairs,
             "runs": [_run_dict(r) for r in runs],
             "time_scale": a.time_scale, "broker": "given" if a.broker else "own mosquitto",
             "live": [asdict(x) for x in live],
             "twin_invited": [{"algorithm": k[0], "seed": k[1], "rounds": sel}
                              for k, sel in twin.items()],
             "live_vs_sim": versus}, indent=1))
        plot(runs, out / "accuracy.png", a.target)
        written = "table.md, results.json, accuracy.png"
        if a.twin:
            plot_live_vs_sim(runs, out / "live_vs_sim.png", a.target)
            written += ", live_vs_sim.png"
        print(f"wrote {out}/{written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m sim.rounds_live", main))
