"""What every simulator figure shares: one colour per method, the Agg backend, one legend
below the plots, the same file settings (sim report, sim rounds and the demo draw with these)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

METHOD_COLORS = {"cdfl": "tab:blue", "fedsoft-async": "tab:orange", "fedasync": "tab:purple", "fedbuff": "tab:olive", "local": "tab:gray",
                 "catafed": "tab:green", "fedavg": "tab:red", "fedprox": "tab:brown", "tifl": "tab:pink",
                 "catafed+": "darkgreen", "alone": "tab:gray"}
"""One colour per method in every figure (sim report, sim rounds, the demo)."""


def method_color(method: str) -> str:
    return METHOD_COLORS.get(method, "black")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: figures are files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (110 dpi, trimmed to what is drawn, legends included) and close one figure."""
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():  # a crowded one-setting figure: savefig's tight bbox still fits it
        warnings.filterwarnings("ignore", "Tight layout not applied", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


FIGURE_CAPTIONS = {
    "accuracy_over_time": "Each agent's accuracy right after its update, averaged over agents and seeds in "
                          "tenths of the run's updates: higher is better.",
    "kl": "How far each method's estimate of an agent's cluster mixture is from the true one "
          "(KL divergence, log scale, value on each bar): lower is better.",
    "relative_cost": "Download bytes and client compute per update, each method's divided by CDFL's "
                     "(dashed line = CDFL); Local downloads nothing, so it has no download bar.",
}
"""One line under each figure of `sim report` (and in report.md), keyed by the file's suffix."""


def caption(path: Path) -> str:
    """The one-line explanation of a figure file, or "" when it has none."""
    return next((text for key, text in FIGURE_CAPTIONS.items() if path.stem.endswith(key)), "")


def add_caption(fig: Any, text: str) -> None:
    """`text` under the figure's legend, wrapped to its width."""
    import textwrap

    width = int(fig.get_figwidth() * 14)
    fig.text(0.5, -0.12 if fig.legends else -0.04, "\n".join(textwrap.wrap(text, width)), ha="center",
             va="top", fontsize=7.5, color="dimgray")


def label_bars(ax: Any, bars: Any, values: list[float]) -> None:
    """Write each bar's value above it (3 significant figures), so a bar too small to see still
    shows what it is."""
    for bar, value in zip(bars, values, strict=True):
        if value == value:  # not NaN
            ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)


def figure_legend(fig: Any, axes: Any) -> None:
    """One legend for the whole figure, below the plots, so it never covers data."""
    seen: dict[str, Any] = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(len(seen), 4), fontsize=8, frameon=False)


def epsilon_figure(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """Received and cluster accuracy against the DP budget, one line per method and its other
    settings (runs are sim.ablation's VariantResult dicts; seeds averaged, 95 % t intervals).
    No DP is drawn at the right as "none"; Local, which sends nothing, as a flat line. None when
    no run has privacy.epsilon."""
    from sim.stats import t_half_width

    def budget(run: dict[str, Any]) -> float:
        return float(run["settings"].get("privacy.epsilon", 0) or 0)

    if not any(budget(r) > 0 for r in runs):
        return None
    groups: dict[tuple[str, ...], dict[float, list[dict[str, Any]]]] = {}
    for r in runs:
        rest = tuple(f"{k}={v}" for k, v in sorted(r["settings"].items()) if not k.startswith("privacy.epsilon")
                     and k != "privacy.uploads")
        groups.setdefault((r["method"], *rest), {}).setdefault(budget(r), []).append(r)
    epsilons = sorted({e for g in groups.values() for e in g if e > 0})
    none_x = epsilons[-1] * 4
    extra_colors = iter(["tab:cyan", "tab:green", "tab:purple", "tab:olive", "tab:brown", "black"] * 4)
    colors: dict[tuple[str, ...], str] = {}
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in zip(axes, ("acc_received", "cluster_acc"), ("received accuracy", "cluster accuracy"),
                              strict=True):
        for (method, *rest), by_eps in groups.items():
            frozen = "cdfl.beta0=0" in rest and "cdfl.server_lr=0" in rest  # sim.ablation's frozen control
            others = [s for s in rest if s not in ("cdfl.beta0=0", "cdfl.server_lr=0")]
            label = method + (" frozen" if frozen else "") + (f" ({', '.join(others)})" if others else "")
            if (method, *others) not in colors:
                colors[(method, *others)] = next(extra_colors) if others else method_color(method)
            xs = sorted(by_eps, key=lambda e: e if e > 0 else none_x)
            values = [[float(r[key]) for r in by_eps[e]] for e in xs]
            if any(np.isnan(v).all() for v in values):
                continue
            means = [float(np.nanmean(v)) for v in values]
            if method == "local":
                ax.axhline(means[0], color=method_color(method), linestyle=":", label=label)
                continue
            positions = [e if e > 0 else none_x for e in xs]
            ax.errorbar(positions, means, yerr=[t_half_width(v) for v in values], marker="o", capsize=3,
                        linestyle="--" if frozen else "-", color=colors[(method, *others)], label=label)
        ax.set_xscale("log")
        ticks = [*epsilons, none_x]
        ax.set_xticks(ticks, [f"{e:g}" for e in epsilons] + ["none"])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (privacy budget per agent)")
        ax.set_title(title)
    figure_legend(fig, axes)
    return save_figure(fig, path)
