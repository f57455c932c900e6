"""What every simulator figure shares: one colour per method, the Agg backend, one legend
below the plots, the same file settings (sim report, sim rounds and the demo draw with these)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

METHOD_COLORS = {"cdfl": "tab:blue", "fedsoft-async": "tab:orange", "fedasync": "tab:purple", "fedbuff": "tab:olive", "local": "tab:gray",
                 "catafed": "tab:green", "fedavg": "tab:red", "fedprox": "tab:brown", "tifl": "tab:pink",
                 "catafed+": "darkgreen"}
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


def figure_legend(fig: Any, axes: Any) -> None:
    """One legend for the whole figure, below the plots, so it never covers data."""
    seen: dict[str, Any] = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(len(seen), 4), fontsize=8, frameon=False)
