"""Every method is visible in every figure of a report, and each figure says in one line what
it shows: a method whose KL is a thousandth of another's still has a bar that shows, with its
value; Local, which downloads nothing, is said to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sim import report
from sim.figures import FIGURE_CAPTIONS


def run(method: str, kl: float, down: float) -> dict[str, Any]:
    return {"spec": {"scenario": "rotated-digits", "method": method, "clusters": 3, "seed": 0},
            "variant": "", "dir": Path("."), "kl": kl, "bytes_down_per_update": down,
            "compute_s_per_update": 0.03, "updates_rows": [{"acc_after": str(0.9 + i / 100)} for i in range(10)]}


def test_each_method_shows_in_each_figure_with_a_caption(tmp_path, monkeypatch) -> None:
    drawn: dict[str, Any] = {}
    real_save = report.save_figure

    def keep(fig, path):
        drawn[Path(path).stem] = {"axes": [(ax.get_yscale(), ax.get_title(), [t.get_text() for t in ax.texts],
                                            [p.get_height() for p in ax.patches]) for ax in fig.axes],
                                  "texts": [t.get_text() for t in fig.texts]}
        return real_save(fig, path)

    monkeypatch.setattr(report, "save_figure", keep)
    runs = [run("cdfl", 0.0003, 11641), run("fedsoft-async", 0.209, 38142), run("local", float("nan"), 0)]
    paths = report.figures(runs, tmp_path)
    assert len(paths) == 3
    for name, seen in drawn.items():
        key = name.split("_", 1)[1]
        assert FIGURE_CAPTIONS[key] in " ".join(seen["texts"]).replace("\n", " ")
    (scale, _, values, heights), = drawn["rotated-digits_kl"]["axes"]
    assert scale == "log" and all(h > 0 for h in heights)  # on a log axis any positive bar shows
    assert values == ["0.0003", "0.209"]
    down, compute = drawn["rotated-digits_relative_cost"]["axes"]
    assert down[1].endswith("(Local: none)") and down[2] == ["3.28"]
    assert len(compute[3]) == 2  # FedSoft-Async and Local


@pytest.mark.parametrize("name", ["x_accuracy_over_time.png", "x_kl.png", "x_relative_cost.png"])
def test_report_md_carries_each_figures_line(name) -> None:
    from sim.figures import caption

    assert caption(Path(name)) in FIGURE_CAPTIONS.values()
