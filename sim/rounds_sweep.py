"""The deadline-round comparison over a grid of settings: non-IID level x share of slow devices.

    python -m sim.rounds_sweep --seeds 10 --target 0.9 --until 600 \\
        --out results/catafed/digits

Each setting (Dirichlet label_alpha, slow share) is one `python -m sim.rounds` run with the
same algorithms, seeds and flags, written to OUT/a{alpha}-s{slow%}/ (results.json, table.md,
accuracy.png). OUT/summary.md puts the paired comparisons of all settings in one table, and
OUT/summary.png draws time to target (mean and 95 % interval over fleets) per setting.
Flags after `--` go to every sim.rounds run unchanged (e.g. `-- --set catafed.epochs=1`).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from fedmq.data import dataset_for_data_dir
from fedmq.errors import ArgumentParser, UsageError, run_main
from sim.rounds import load_results, summary_rows
from sim.rounds import main as rounds_main


def setting_dir(alpha: float, slow: float) -> str:
    return f"a{alpha:g}-s{round(100 * slow)}"


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected numbers separated by commas, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: expected at least one number, got {text!r}")
    return values


def summary_table(out: Path, settings: list[tuple[float, float]]) -> str:
    """One row per setting and comparison: the reference against each other algorithm."""
    lines = ["| label alpha | slow | comparison | fleets (both reached) | time to target: ratio | "
             "paired diff (95 % CI) | faster on | final acc: paired diff (95 % CI) | reached |",
             "|---|---|---|---|---|---|---|---|---|"]
    for alpha, slow in settings:
        data = json.loads((out / setting_dir(alpha, slow) / "results.json").read_text())
        reached = {r["algorithm"]: f"{r['reached']}/{r['runs']}" for r in data["summary"]}
        for p in data["paired"]:
            if p["paired"]:
                lo, hi = p["dt_s"] - p["dt_ci"], p["dt_s"] + p["dt_ci"]
                sig = " **" if (hi < 0 or lo > 0) and p["paired"] >= 3 else ""  # no interval from 1-2 fleets
                dt = f"{p['dt_s']:+.0f} s ({lo:+.0f} to {hi:+.0f}){sig}"
                ratio = f"{p['ratio']:.2f}x"
            else:
                dt, ratio = "-", "-"
            acc = (f"{p['dacc_pp']:+.2f} pp ({p['dacc_pp'] - p['dacc_ci_pp']:+.2f} to "
                   f"{p['dacc_pp'] + p['dacc_ci_pp']:+.2f})")
            lines.append(f"| {alpha:g} | {100 * slow:.0f} % | {p['reference']} - {p['other']} | "
                         f"{p['seeds']} ({p['paired']}) | {ratio} | {dt} | {p['faster']}/{p['paired']} | "
                         f"{acc} | {reached[p['reference']]} vs {reached[p['other']]} |")
    return "\n".join(lines) + "\n"


def summary_plot(out: Path, settings: list[tuple[float, float]], path: Path) -> None:
    """Time to target per algorithm and setting: mean with its 95 % interval over fleets."""
    import numpy as np

    from sim.figures import figure_legend, method_color, pyplot, save_figure

    rows = {s: summary_rows(load_results(out / setting_dir(*s) / "results.json")[0])
            for s in settings}
    labels = list(dict.fromkeys(r["algorithm"] for rs in rows.values() for r in rs))
    fig, ax = pyplot().subplots(figsize=(max(6.0, 1.6 * len(settings)), 3.8))
    width = 0.8 / len(labels)
    spare = iter(["tab:olive", "tab:cyan", "tab:pink", "gold", "navy", "teal"])
    colors = {lab: method_color(lab) if method_color(lab) != "black" else next(spare, "black")
              for lab in labels}
    for j, lab in enumerate(labels):
        means, errs, reached = [], [], []
        for s in settings:
            r = next((x for x in rows[s] if x["algorithm"] == lab), None)
            means.append(np.nan if r is None or r["time_to_target_s"] is None else r["time_to_target_s"])
            errs.append(0.0 if r is None or not r.get("time_to_target_ci") else r["time_to_target_ci"])
            reached.append(None if r is None else (r["reached"], r["runs"]))
        x = np.arange(len(settings)) + (j - (len(labels) - 1) / 2) * width
        ax.bar(x, means, width, yerr=errs, capsize=2, color=colors[lab], alpha=0.8, label=lab)
        for xi, m, got in zip(x, means, reached, strict=True):
            if got is not None and got[0] < got[1]:  # say how many fleets a bar stands for
                ax.text(xi, 0 if np.isnan(m) else m, f"{got[0]}/{got[1]}", ha="center",
                        va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(settings)), [f"alpha {a:g}\n{100 * s:.0f} % slow" for a, s in settings])
    ax.set_ylabel("simulated s to target")
    ax.set_title("time to target: mean and 95 % interval over the fleets that reached it (k/n: how many did)")
    ax.grid(alpha=0.3, axis="y")
    figure_legend(fig, ax)
    save_figure(fig, path)


def main(argv: list[str] | None = None, prog: str = "python -m sim.rounds_sweep") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--alphas", default="0.3,1.0", help="Dirichlet label_alpha values (default 0.3,1.0)")
    p.add_argument("--slow-shares", default="0,0.3,0.5", help="shares of slow devices (default 0,0.3,0.5)")
    p.add_argument("--algorithms", default="catafed,fedavg,fedprox,tifl",
                   help="as sim.rounds --algorithms (variants LABEL=ALG:key=value allowed)")
    p.add_argument("--seeds", default="10", help="as sim.rounds --seeds (default 10 fleets)")
    p.add_argument("--dataset", help="as sim.rounds --dataset (default digits; with --data-dir: the dataset there)")
    p.add_argument("--data-dir", default=None, metavar="DIR")
    p.add_argument("--model", default="auto")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--until", type=float, default=600.0, metavar="S",
                   help="simulated seconds per run (default 600)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes per setting; 0: one per CPU core "
                   "(default 2)")
    p.add_argument("--out", required=True, help="directory for one sub-directory per setting and summary.md")
    p.add_argument("--dry-run", action="store_true",
                   help="print and check the sim.rounds command lines, run nothing")
    a = p.parse_args(argv)
    a.dataset = dataset_for_data_dir(a.dataset, a.data_dir)
    if "--dry-run" in extra:  # also after `--` (a wrapper that appends it must not run the grid)
        extra = [x for x in extra if x != "--dry-run"]
        a.dry_run = True
    settings = [(alpha, slow) for alpha in _floats(a.alphas, "--alphas")
                for slow in _floats(a.slow_shares, "--slow-shares")]
    out = Path(a.out)
    commands = []
    for alpha, slow in settings:
        args = ["--algorithms", a.algorithms, "--seeds", a.seeds, "--dataset", a.dataset,
                "--model", a.model, "--target", str(a.target), "--until", str(a.until),
                "--label-alpha", str(alpha), "--slow-share", str(slow), "--jobs", str(a.jobs),
                "--out", str(out / setting_dir(alpha, slow))]
        if a.data_dir:
            args += ["--data-dir", a.data_dir]
        commands.append(args + extra)
    for args in commands:
        print("python -m sim.rounds " + shlex.join(args), flush=True)
        rounds_main(args + (["--dry-run"] if a.dry_run else []))  # a dry run checks every flag
    if a.dry_run:
        return 0
    table = summary_table(out, settings)
    (out / "summary.md").write_text(
        f"# {a.dataset}: deadline rounds over non-IID level and slow share\n\n"
        f"Made by: `{prog} {shlex.join(argv + (['--', *extra] if extra else []))}`\n\n"
        f"Target {a.target:g}, {a.until:g} simulated s per run; ** marks a paired 95 % interval "
        "of the time difference that excludes 0 (over at least 3 fleets where both reached the target;\n"
        "\"reached\" says how many did).\n\n" + table + "\n![summary](summary.png)\n")
    summary_plot(out, settings, out / "summary.png")
    print(table)
    print(f"wrote {out}/summary.md, summary.png and {len(settings)} setting dirs")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m sim.rounds_sweep", main))
