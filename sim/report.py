"""Tables and plots from a simulator output dir, in the shape of the CDFL paper's.

    fedmq sim report DIR

reads DIR/runs/*/summary.json (and updates.csv) and writes DIR/report.md with
- Table 1: client and cluster accuracy, mean +- std over seeds, per method and K;
- a cost table: KL(true || estimated), bytes down and up per update, agent compute per update,
  uploads refused; where the aggregator refused any, how many by reason;
- client accuracy through the run, in fifths of its uploads, and the first method against each
  other one paired by seed (whole run and last fifth, 95 % t intervals): a method that starts
  behind and ends ahead shows as such, not as one mean;
and the figures DIR/figures/SCENARIO_accuracy_over_time.png (Figure 3), _kl.png (Figure 5)
and _relative_cost.png (Figure 6: download bytes and client compute relative to CDFL).
A split run's parts (DIR/parts/, see sim/split.py) are merged into DIR/runs/ first.

    fedmq sim report DIR --with DIR-frozen

adds another dir's runs as rows of their own, named by that dir (less what its name shares
with DIR's: `CDFL (frozen)`), paired by seed with DIR's first method: a control run with other `--set` values
into its own dir is compared in the same tables as the run it controls.

For a `fedmq sim rounds` dir (DIR/results.json) it writes sim.rounds' table (time to the
target accuracy, wasted work, finishers / stragglers / late / dropouts per round) and
figures/rounds_accuracy.png (sim.rounds' plot) and rounds_cost.png.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from fedmq.algorithms import ASYNC_SERVER, DISPLAY
from fedmq.errors import UsageError
from sim.figures import (
    add_caption,
    caption,
    figure_legend,
    label_bars,
    method_color,
    pyplot,
    save_figure,
)
from sim.stats import paired_interval

METHOD_ORDER = (*ASYNC_SERVER, "local")
METHOD_NAMES = DISPLAY
def load_runs(out: Path, variant: str = "") -> list[dict[str, Any]]:
    """DIR/runs/*/summary.json; `variant` names them apart from another dir's runs of the same
    method (`--with`)."""
    runs = []
    for p in sorted((out / "runs").glob("*/summary.json")):
        s = json.loads(p.read_text())
        s["dir"] = p.parent
        s["variant"] = variant
        runs.append(s)
    if not runs:
        raise FileNotFoundError(f"no runs under {out / 'runs'} (expected runs/*/summary.json)")
    return runs


def variant_name(out: Path, other: Path) -> str:
    """What `--with OTHER` calls its runs: OTHER's name less what it shares with OUT's, cut at a
    separator (x and x-frozen: frozen; x-server-lr and x-fedsoft: fedsoft), else OTHER's name."""
    base, name = out.resolve().name, other.resolve().name
    common = os.path.commonprefix([base, name])
    if common != base:
        common = common[:max(common.rfind(c) for c in "-_.") + 1]
    return name[len(common):].lstrip("-_.") or name


def load_with(out: Path, others: list[Path]) -> list[dict[str, Any]]:
    """OUT's runs and each other dir's, named by `variant_name`."""
    runs = load_runs(out)
    names: dict[str, Path] = {}
    for other in others:
        if other.resolve() == out.resolve():
            raise UsageError(f"--with {other}: that is the report's own dir")
        name = variant_name(out, other)
        if name in names:
            raise UsageError(f"--with {other} and --with {names[name]} would both be named {name!r}")
        names[name] = other
        runs += load_runs(other, name)
    return runs


def _key(run: dict[str, Any]) -> str:
    """A run's row: its method, and its dir's name where it came in by `--with`."""
    method = run["spec"]["method"]
    return f"{method} ({run['variant']})" if run.get("variant") else method


def _base(method: str) -> str:
    return method.split(" (", 1)[0]


def _name(method: str) -> str:
    """The row's display name: CDFL, or CDFL (frozen) for a `--with` dir's."""
    base = _base(method)
    return METHOD_NAMES.get(base, base) + method[len(base):]


VARIANT_LINES = (("--", "s", "//"), (":", "^", ".."), ("-.", "D", "xx"), ((0, (5, 1, 1, 1)), "v", "--"),
                 ((0, (1, 3)), "P", "++"), ((0, (8, 2)), "X", "oo"))
"""Line style, marker and bar hatch of a method's `--with` rows, in order: its own row is solid
with dots and plain bars, and each other dir's row of it looks different from the rest."""


def row_styles(methods: list[str]) -> dict[str, tuple[Any, str, str | None]]:
    """(linestyle, marker, hatch) per row, in the method's colour: CDFL and two `--with` dirs'
    CDFL rows are three distinct lines, not three identical dashed ones."""
    styles: dict[str, tuple[Any, str, str | None]] = {}
    seen: dict[str, int] = defaultdict(int)
    for m in methods:
        if m == _base(m):
            styles[m] = ("-", "o", None)
        else:
            styles[m] = VARIANT_LINES[seen[_base(m)] % len(VARIANT_LINES)]
            seen[_base(m)] += 1
    return styles


def _group(runs: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        sp = r["spec"]
        groups[(sp["scenario"], _key(r), sp["clusters"])].append(r)
    return groups


def _ms(values: list[float], digits: int = 3) -> str:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{np.mean(xs):.{digits}f} ± {np.std(xs):.{digits}f}"


def _methods(groups: dict[tuple[str, str, int], Any], scenario: str) -> list[str]:
    """The paper's order, each `--with` row right after its method's own."""
    present = {m for (s, m, _) in groups if s == scenario}
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(present, key=lambda m: (order.get(_base(m), len(order)), _base(m), m != _base(m), m))


def tables(runs: list[dict[str, Any]]) -> str:
    groups = _group(runs)
    out: list[str] = []
    for scenario in sorted({s for (s, _, _) in groups}):
        ks = sorted({k for (s, _, k) in groups if s == scenario})
        methods = _methods(groups, scenario)
        seeds = sorted({r["spec"]["seed"] for r in runs if r["spec"]["scenario"] == scenario})
        out.append(f"### {scenario}: Table 1 (client / cluster accuracy, mean ± std over seeds {seeds})\n")
        out.append("| method | " + " | ".join(f"K={k} client | K={k} cluster" for k in ks) + " |")
        out.append("|---|" + "---|---|" * len(ks))
        for m in methods:
            cells = []
            for k in ks:
                g = groups.get((scenario, m, k), [])
                cells.append(_ms([r["client_acc"] for r in g]))
                cells.append(_ms([r["cluster_acc"] for r in g]))
            out.append(f"| {_name(m)} | " + " | ".join(cells) + " |")
        out.append("")
        out.append("Client accuracy: the model an agent holds after its download (Local: after its "
                   "own training), on that cycle's test mixture, averaged over all updates. "
                   "Cluster accuracy: the final cluster models on their own clusters' test sets.\n")
        out.append(f"### {scenario}: the other metrics (mean ± std over seeds)\n")
        out.append("| method | K | trained model (before download) | held model on new data | "
                   "KL(true‖est) | bytes down / update | bytes up / update | compute s / update | "
                   "staleness | updates | refused |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for k in ks:
            for m in methods:
                g = groups.get((scenario, m, k), [])
                if not g:
                    continue
                out.append(
                    f"| {_name(m)} | {k} | {_ms([r['client_acc_before'] for r in g])} | "
                    f"{_ms([r['client_acc_held'] for r in g])} | {_ms([r['kl'] for r in g], 4)} | "
                    f"{_ms([r['bytes_down_per_update'] for r in g], 0)} | "
                    f"{_ms([r['bytes_up_per_update'] for r in g], 0)} | "
                    f"{_ms([r['compute_s_per_update'] for r in g], 4)} | "
                    f"{_ms([r['staleness_mean'] for r in g], 1)} | {sum(r['updates'] for r in g)} | "
                    f"{sum(sum(_refused(r).values()) for r in g)} |")
        out.append("")
        out += _refusal_table(groups, scenario, ks, methods)
        out += _stage_tables(groups, scenario, ks, methods)
    return "\n".join(out)


STAGES = 5
"""The run's uploads, in order, split into this many equal parts for the stage table."""


def stage_means(accuracies: list[float], stages: int = STAGES) -> list[float]:
    """Mean of each of `stages` consecutive, near-equal parts of a run's per-upload accuracies
    (nan for a part a short run leaves empty)."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    edges = [round(i * len(accuracies) / stages) for i in range(stages + 1)]
    return [float(np.mean(accuracies[a:b])) if b > a else math.nan for a, b in pairwise(edges)]


def _received(run: dict[str, Any]) -> list[float]:
    """The accuracy of the model each upload left the agent with, in upload order."""
    return [float(r["acc_after"]) for r in _updates(run)]


def _stage_tables(groups: dict[tuple[str, str, int], list[dict[str, Any]]], scenario: str,
                  ks: list[int], methods: list[str]) -> list[str]:
    """Client accuracy in fifths of the run, and the first method paired against the others."""
    out: list[str] = []
    for k in ks:
        present = [m for m in methods if groups.get((scenario, m, k))]
        stages: dict[str, dict[int, list[float]]] = {}
        for m in present:
            stages[m] = {r["spec"]["seed"]: stage_means(_received(r)) for r in groups[(scenario, m, k)]}
        out.append(f"### {scenario}, K={k}: client accuracy through the run (fifths of its uploads, "
                   "mean ± std over seeds)\n")
        out.append("| method | " + " | ".join(f"{i + 1}/{STAGES}" for i in range(STAGES)) + " |")
        out.append("|---|" + "---|" * STAGES)
        for m in present:
            cells = [_ms([v[i] for v in stages[m].values()]) for i in range(STAGES)]
            out.append(f"| {_name(m)} | " + " | ".join(cells) + " |")
        out.append("")
        rows = []
        reference, *others = present  # ks come from the groups: every K has a method
        for m in others:
            seeds = sorted(set(stages[reference]) & set(stages[m]))
            if not seeds:
                continue
            whole = {s: 100 * (_whole(groups, scenario, reference, k, s) - _whole(groups, scenario, m, k, s))
                     for s in seeds}
            last = {s: 100 * (stages[reference][s][-1] - stages[m][s][-1]) for s in seeds}
            rows.append(f"| {_name(reference)} - {_name(m)} | "
                        f"{', '.join(map(str, seeds))} | {_paired(whole)} | {_paired(last)} |")
        if rows:
            out += [f"### {scenario}, K={k}: paired by seed (the same fleet), client accuracy in pp\n",
                    "| comparison | seeds | whole run: per seed (mean ± 95 % t) | last fifth: per seed "
                    "(mean ± 95 % t) |", "|---|---|---|---|", *rows, ""]
    return out


def _whole(groups: dict[tuple[str, str, int], list[dict[str, Any]]], scenario: str, method: str, k: int,
           seed: int) -> float:
    return next(float(r["client_acc"]) for r in groups[(scenario, method, k)] if r["spec"]["seed"] == seed)


def _paired(diffs: dict[int, float]) -> str:
    mean, half = paired_interval(list(diffs.values()))
    each = " / ".join(f"{d:+.1f}" for d in diffs.values())
    return f"{each} ({mean:+.1f} ± {half:.1f})" if len(diffs) > 1 else each


def _refused(run: dict[str, Any]) -> dict[str, int]:
    """A run's refused uploads by reason (a summary.json from before they were counted: none)."""
    return run.get("refused") or {}


def _refusal_table(groups: dict[tuple[str, str, int], list[dict[str, Any]]], scenario: str,
                   ks: list[int], methods: list[str]) -> list[str]:
    """Uploads the aggregator refused, by reason, summed over seeds; nothing when none was.

    A refused cycle stays in the run (the agent kept its model), so the accuracy columns
    above include it; this says how many there were and why."""
    rows = []
    for k in ks:
        for m in methods:
            total: dict[str, int] = defaultdict(int)
            for r in groups.get((scenario, m, k), []):
                for reason, n in _refused(r).items():
                    total[reason] += int(n)
            if total:
                reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(total.items()))
                rows.append(f"| {_name(m)} | {k} | {sum(total.values())} | {reasons} |")
    if not rows:
        return []
    return [f"### {scenario}: refused uploads (summed over seeds)\n",
            "| method | K | refused | by reason |", "|---|---|---|---|", *rows,
            "", "A refused upload is an outcome, not a failure: the agent kept the model it held "
            "(joining again first where the aggregator no longer knew its base) and the run went on.\n"]


def _updates(run: dict[str, Any]) -> list[dict[str, str]]:
    """A run's updates.csv rows, read once (the stage table and the figures both take them)."""
    if "updates_rows" not in run:
        with open(Path(run["dir"]) / "updates.csv", newline="") as f:
            run["updates_rows"] = list(csv.DictReader(f))
    return run["updates_rows"]


def figures(runs: list[dict[str, Any]], fig_dir: Path) -> list[Path]:
    plt = pyplot()
    fig_dir.mkdir(parents=True, exist_ok=True)
    groups = _group(runs)
    paths: list[Path] = []
    for scenario in sorted({s for (s, _, _) in groups}):
        ks = sorted({k for (s, _, k) in groups if s == scenario})
        methods = _methods(groups, scenario)
        styles = row_styles(methods)
        tag = scenario

        # Figure 3: client accuracy over time (binned by schedule position), mean over seeds.
        fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.4), squeeze=False)
        for ax, k in zip(axes[0], ks, strict=True):
            for m in methods:
                curves = []
                for r in groups.get((scenario, m, k), []):
                    rows = _updates(r)
                    if not rows:
                        continue
                    acc = np.array([float(x["acc_after"]) for x in rows])
                    bins = np.array_split(acc, min(10, len(acc)))
                    curves.append([b.mean() for b in bins])
                if curves:
                    n = min(len(c) for c in curves)
                    y = np.mean([c[:n] for c in curves], axis=0)
                    ax.plot(np.linspace(0, 1, n), y, marker=styles[m][1], ms=3.5, label=_name(m),
                            color=method_color(_base(m)), linestyle=styles[m][0])
            ax.set_title(f"K = {k}")
            ax.set_xlabel("fraction of the run's updates")
            ax.set_ylabel("client accuracy")
            ax.grid(alpha=0.3)
        figure_legend(fig, axes)
        fig.suptitle(f"{scenario}: client accuracy over time")
        path = fig_dir / f"{tag}_accuracy_over_time.png"
        add_caption(fig, caption(path))
        paths.append(save_figure(fig, path))

        # Figure 5: KL(true || estimated) per method and K.
        kl_methods = [m for m in methods if m != "local" and any(
            not math.isnan(r["kl"]) for k in ks for r in groups.get((scenario, m, k), []))]
        if kl_methods:
            fig, ax = plt.subplots(figsize=(1.5 + 1.3 * len(ks) * len(kl_methods), 3.4))
            width = 0.8 / len(kl_methods)
            for j, m in enumerate(kl_methods):
                means = [np.mean([r["kl"] for r in groups.get((scenario, m, k), [])] or [np.nan]) for k in ks]
                stds = [np.std([r["kl"] for r in groups.get((scenario, m, k), [])] or [np.nan]) for k in ks]
                # Log scale: estimates differ by orders of magnitude (CDFL's KL can be 1e-4 where
                # FedSoft-Async's is 0.1), so on a linear axis the better one has no visible bar.
                bars = ax.bar(np.arange(len(ks)) + j * width, means, width, label=_name(m),
                              color=method_color(_base(m)), hatch=styles[m][2], edgecolor="white")
                ax.errorbar(np.arange(len(ks)) + j * width, means,
                            yerr=[np.minimum(stds, np.array(means) * 0.99), stds], fmt="none", ecolor="black",
                            elinewidth=0.8)
                label_bars(ax, bars, means)
            ax.set_yscale("log")
            ax.margins(y=0.15)
            ax.set_xticks(np.arange(len(ks)) + width * (len(kl_methods) - 1) / 2, [f"K={k}" for k in ks])
            ax.set_ylabel("mean KL(true ‖ estimated)")
            figure_legend(fig, ax)
            ax.set_title(f"{scenario}: mixture estimation")
            path = fig_dir / f"{tag}_kl.png"
            add_caption(fig, caption(path))
            paths.append(save_figure(fig, path))

        # Figure 6: download bytes and client compute per update, relative to CDFL.
        if "cdfl" in methods:
            fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
            others = [m for m in methods if m not in ("cdfl", "local")]
            for ax, key, title in ((axes[0], "bytes_down_per_update", "download bytes per update"),
                                   (axes[1], "compute_s_per_update", "client compute per update")):
                series = others + (["local"] if key == "compute_s_per_update" and "local" in methods else [])
                width = 0.8 / max(1, len(series))
                for j, m in enumerate(series):
                    ratios = []
                    for k in ks:
                        base = np.mean([r[key] for r in groups.get((scenario, "cdfl", k), [])] or [np.nan])
                        val = np.mean([r[key] for r in groups.get((scenario, m, k), [])] or [np.nan])
                        ratios.append(val / base if base else np.nan)
                    bars = ax.bar(np.arange(len(ks)) + j * width, ratios, width, label=_name(m),
                                  color=method_color(_base(m)), hatch=styles[m][2], edgecolor="white")
                    label_bars(ax, bars, ratios)
                ax.axhline(1.0, color=method_color("cdfl"), lw=1.0, ls="--", label="CDFL (= 1)")
                ax.margins(y=0.12)  # room for the values above the bars
                ax.set_xticks(np.arange(len(ks)) + width * (len(series) - 1) / 2, [f"K={k}" for k in ks])
                ax.set_title(title + (" (Local: none)" if key == "bytes_down_per_update" and "local" in methods
                                      else ""))
                ax.set_ylabel("relative to CDFL (x)")
                ax.grid(alpha=0.3, axis="y")
            figure_legend(fig, axes)
            fig.suptitle(f"{scenario}: cost relative to CDFL")
            path = fig_dir / f"{tag}_relative_cost.png"
            add_caption(fig, caption(path))
            paths.append(save_figure(fig, path))
    return paths


ROUNDS_RESULTS = "results.json"
"""What `fedmq sim rounds --out DIR` writes (with table.md and accuracy.png)."""


def is_rounds_dir(out: Path) -> bool:
    """A `fedmq sim rounds` output dir: results.json with the fleet, settings and runs."""
    p = out / ROUNDS_RESULTS
    if not p.is_file():
        return False
    try:
        data = json.loads(p.read_text())
    except ValueError:
        return False
    return isinstance(data, dict) and {"fleet", "settings", "runs"} <= data.keys()


def rounds_report(out: Path, fig_dir: Path) -> tuple[str, list[Path]]:
    """CATA-Fed / FedAvg / FedProx / TiFL deadline rounds: sim.rounds' own tables and plot, plus costs."""
    from sim.rounds import load_results, markdown_table, paired_table, plot, summary_rows

    runs, target, data = load_results(out / ROUNDS_RESULTS)
    rows = summary_rows(runs)
    fleet, settings = data["fleet"], data["settings"]
    seeds = sorted({r.seed for r in runs})
    text = "\n".join([
        f"### Deadline rounds: time to {target:.2f} test accuracy (seeds {seeds})", "",
        f"{fleet['agents']} agents, {100 * fleet['slow_share']:.0f} % slow at {fleet['slow_factor']}x, "
        f"dropout p = {fleet['dropout_p']}, return p = {fleet['return_p']}; deadline T = "
        f"{settings['deadline_s']} s + grace {settings['grace_s']} s, P = {settings['groups']} groups "
        f"of N = {settings['per_group']}, {settings['epochs']} local epochs, at most "
        f"{settings['rounds']} rounds (simulated clock), dataset {data.get('dataset', 'digits')}.", "",
        markdown_table(rows, target), paired_table(data.get("paired", []))])
    fig_dir.mkdir(parents=True, exist_ok=True)
    accuracy = fig_dir / "rounds_accuracy.png"
    plot(runs, accuracy, target)
    cost = fig_dir / "rounds_cost.png"
    _rounds_cost_figure(rows, target, cost)
    return text, [accuracy, cost]


def _rounds_cost_figure(rows: list[dict[str, Any]], target: float, path: Path) -> None:
    """Simulated time to the target per seed (dots) and mean (bar); share of wasted training."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(9, 3.4))
    names = [r["algorithm"] for r in rows]
    x = np.arange(len(rows))
    means = [r["time_to_target_s"] if r["time_to_target_s"] is not None else np.nan for r in rows]
    colors = [method_color(n) for n in names]
    ax1.bar(x, means, 0.6, alpha=0.6, color=colors)
    for j, r in enumerate(rows):
        each = [v for v in r["time_to_target_each"] if v is not None]
        ax1.plot([j] * len(each), each, "k.", ms=5)
    ax1.set_xticks(x, names)
    ax1.set_ylabel(f"simulated s to {target:.2f}")
    ax1.set_title("time to target (dots: seeds that reached it)")
    ax2.bar(x, [100 * r["wasted_share"] for r in rows], 0.6, color=colors, alpha=0.7)
    ax2.set_xticks(x, names)
    ax2.set_ylabel("% of training time")
    ax2.set_title("wasted work")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def made_by(report: Path) -> str | None:
    """The command an existing report.md says made it, so that a report made again keeps it."""
    if not report.is_file():
        return None
    lines = report.read_text(errors="replace").splitlines()
    if "Made by:" not in lines:
        return None
    start = lines.index("Made by:") + 2
    if start >= len(lines) or lines[start] != "```sh" or "```" not in lines[start + 1:]:
        return None
    return "\n".join(lines[start + 1:lines.index("```", start + 1)]) or None


def write_report(out: Path, command: str | None = None,
                 with_dirs: list[Path] | None = None) -> tuple[Path, list[Path], str]:
    """report.md and the figures; returns (report path, figure paths, the tables' markdown).

    Reads a `fedmq sim run` dir (runs/; a split run's parts/ are merged into runs/ first) and
    a `fedmq sim rounds` dir (results.json); a dir may hold both. `with_dirs`: other `sim run`
    dirs whose runs join the fleet tables as rows of their own (`load_with`).
    """
    sections: list[str] = []
    paths: list[Path] = []
    if (out / "parts").is_dir():
        from sim.split import merge_parts

        merge_parts(out)
    fleet_runs = (out / "runs").is_dir()
    rounds = is_rounds_dir(out)
    if not fleet_runs and not rounds:
        raise FileNotFoundError(f"{out}: neither runs/*/summary.json (fedmq sim run), parts/ (a split "
                                f"run) nor {ROUNDS_RESULTS} (fedmq sim rounds)")
    if with_dirs and not fleet_runs:
        raise UsageError(f"--with needs {out} to hold a `fedmq sim run` (runs/*/summary.json)")
    if fleet_runs:
        runs = load_with(out, list(with_dirs or []))
        sections.append(tables(runs))
        paths += figures(runs, out / "figures")
    if rounds:
        text, figs = rounds_report(out, out / "figures")
        sections.append(text)
        paths += figs
    text = "\n".join(sections)
    lines = ["# Simulator report", ""]
    report = out / "report.md"
    command = command or made_by(report)
    if command:
        lines += ["Made by:", "", "```sh", command, "```", ""]
    lines += [text, "## Figures", ""]
    for p in paths:
        lines += [f"![{p.stem}](figures/{p.name})", ""] + ([caption(p), ""] if caption(p) else [])
    report.write_text("\n".join(lines) + "\n")
    return report, paths, text
