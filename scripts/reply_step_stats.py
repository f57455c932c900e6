"""How an agent's step relates to the reply it trained from: a measuring aid for CDFL replies.

    python scripts/reply_step_stats.py ARGS...   # ARGS as for `python -m sim.ablation`, one CDFL variant, --controls none

For every upload whose base is the last trained reply that agent was sent (the delta rule's
step v - u; a join's untrained mixture has no fit and is left out), it records the step's
norm, the norm of the reply's fit on the proxy sets (u minus the start its training took,
the alpha-mixture by default) and the cosine between the two, over the model's
parameters (running statistics left out). A negative cosine is a step that partly undoes the
reply's fit; the clusters, which never held that fit, take it all the same. Prints one
`step-stats` JSON line (means and medians) and writes it to OUT/step_stats.json.
docs/results_cdfl.md#the-reply reads it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.cdfl import CDFL  # noqa: E402
from sim.ablation import main as ablation_main  # noqa: E402


class StepStats:
    """Wraps CDFL's reply and cluster step to record (reply, fit) per agent and the stats."""

    def __init__(self) -> None:
        self.fits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: list[dict[str, float]] = []

    def install(self) -> None:
        personalized, step = CDFL._personalized, CDFL._step
        stats = self

        def _personalized(self: CDFL, agent: str, alpha: list[float], info: dict[str, Any],
                          upload: torch.Tensor | None = None, sent: torch.Tensor | None = None) -> Any:
            start_of = getattr(self.personalizer, "start_vector", None)
            if upload is None or start_of is None:  # a join's mixture, or an untrained reply: no fit
                stats.fits.pop(agent, None)
                return personalized(self, agent, alpha, info, upload, sent)
            start, _ = start_of(self._request(alpha, upload))  # where the reply's own training starts
            reply = personalized(self, agent, alpha, info, upload, sent)
            u = reply.vectors[0]
            stats.fits[agent] = (u.clone(), u - start)
            return reply

        def _step(self: CDFL, upload: Any, vector: torch.Tensor, alpha: list[float]) -> dict[str, Any]:
            kept = stats.fits.get(upload.agent)
            if upload.base is not None and kept is not None and torch.equal(kept[0], upload.base):
                n = self.spec.param_numel
                s, f = (vector - kept[0])[:n], kept[1][:n]
                stats.rows.append({"step_norm": float(s.norm()), "fit_norm": float(f.norm()),
                                   "cosine": float(torch.nn.functional.cosine_similarity(s, f, dim=0))})
            return step(self, upload, vector, alpha)

        CDFL._personalized = _personalized  # type: ignore[method-assign]
        CDFL._step = _step  # type: ignore[method-assign]

    def summary(self) -> dict[str, Any]:
        if not self.rows:
            return {"uploads": 0}
        cols = {k: np.array([r[k] for r in self.rows]) for k in self.rows[0]}
        out: dict[str, Any] = {"uploads": len(self.rows)}
        for k, v in cols.items():
            out[k] = {"mean": round(float(v.mean()), 4), "median": round(float(np.median(v)), 4)}
        out["negative_cosine_share"] = round(float((cols["cosine"] < 0).mean()), 3)
        return out


def main(argv: list[str]) -> int:
    stats = StepStats()
    stats.install()
    rc = ablation_main(argv)
    if "--dry-run" in argv:  # planned, nothing measured
        return rc
    summary = stats.summary()
    print("step-stats", json.dumps(summary), flush=True)
    if "--out" in argv:
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_stats.json").write_text(json.dumps(summary, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
