"""Intervals for experiment tables: every comparison is paired by seed (the same fleet)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def t_half_width(values: Sequence[float]) -> float:
    """Half-width of the 95 % Student-t interval of the mean (0 for one value, nan for none)."""
    v = [x for x in values if not math.isnan(x)]
    if not v:
        return math.nan
    if len(v) == 1:
        return 0.0
    from scipy.special import stdtrit  # Student t's quantile; scipy.stats costs ~1 s more to import

    return float(stdtrit(len(v) - 1, 0.975)) * float(np.std(v, ddof=1)) / math.sqrt(len(v))


def paired_interval(diffs: Sequence[float]) -> tuple[float, float]:
    """Mean of per-seed paired differences and the half-width of its 95 % t interval (0 for one seed)."""
    d = [x for x in diffs if not math.isnan(x)]
    if not d:
        return math.nan, math.nan
    return float(np.mean(d)), t_half_width(d)
