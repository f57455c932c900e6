"""Integer lists from the command line (`--seeds`, `--clusters`), parsed the same everywhere.

`0,1,2`, `1,` and ` 2 , 3 ` are lists; `--seeds N` without a comma is a count (seeds
base..base+N-1) for `sim run` and `sim ablation`. Garbage is a `UsageError` naming the flag.
"""

from __future__ import annotations

from fedmq.errors import UsageError


def int_list(text: str, flag: str, minimum: int | None = None) -> list[int]:
    """`"0,1,2"` -> [0, 1, 2]; empty items (a trailing comma) are skipped, an empty list is an error."""
    items = [v.strip() for v in str(text).split(",") if v.strip()]
    try:
        values = [int(v) for v in items]
    except ValueError:
        raise UsageError(f"{flag}: expected integers separated by commas (e.g. 0,1,2), got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: expected at least one integer (e.g. 0,1,2), got {text!r}")
    if minimum is not None and min(values) < minimum:
        raise UsageError(f"{flag}: values must be >= {minimum}, got {text!r}")
    return values


def seed_list(text: str, base: int, flag: str = "--seeds") -> list[int]:
    """A comma list as given, or N (no comma): the N seeds base..base+N-1."""
    if "," in str(text):
        return int_list(text, flag)
    (count,) = int_list(text, flag)
    if count < 1:
        raise UsageError(f"{flag}: a number of seeds must be >= 1 (or give a list such as 0,1,2), got {text!r}")
    return list(range(base, base + count))
