"""Every numeric config key has a range, checked at load and written in its docstring, so a value
that would crash minutes into a run is refused, with one line, by `--dry-run` and at start."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest

from fedmq.config import RANGES, Config, ConfigError, in_range, load_config
from fedmq.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gen_config_docs import attribute_docs  # noqa: E402

UNBOUNDED = {"seed": "any integer", "cdfl.trunk_share": "[0, 1] or -1, checked by resolve_trunk_share"}
"""Numeric keys without a RANGES entry, and why."""

PARTNERS = {"data.max_samples": {"data.min_samples": 1}, "data.primary_max": {"data.primary_min": 0},
            "broker.reconnect_max_s": {"broker.reconnect_min_s": 1e-6}}
"""Keys that must stay ordered with another: set the other low when testing this one's bound."""


def numeric_keys() -> dict[str, type]:
    root = Config()
    out: dict[str, type] = {}
    for f in dataclasses.fields(root):
        value = getattr(root, f.name)
        if dataclasses.is_dataclass(value):
            hints = typing.get_type_hints(type(value))
            out.update({f"{f.name}.{g.name}": hints[g.name] for g in dataclasses.fields(value)
                        if hints[g.name] in (int, float)})
        elif typing.get_type_hints(Config)[f.name] in (int, float):
            out[f.name] = typing.get_type_hints(Config)[f.name]
    return out


def inside_and_outside(need: str, typ: type) -> tuple[float, float]:
    """A value on the edge of the range `need` and one just past it."""
    step = 1 if typ is int else 1e-6
    if need.startswith(">="):
        x = float(need[2:])
        return x, x - step
    if need.startswith(">"):
        x = float(need[1:])
        return x + step, x
    lo, hi = (float(v) for v in need[4:-1].split(","))
    inside = lo if need[3] == "[" else (hi if need[-1] == "]" else (lo + hi) / 2)
    outside = lo - step if need[3] == "[" else lo
    return inside, outside


def test_every_numeric_key_has_a_range_or_a_reason() -> None:
    keys = numeric_keys()
    assert set(RANGES) <= set(keys), set(RANGES) - set(keys)
    assert set(keys) - set(RANGES) == set(UNBOUNDED)


def test_every_range_is_in_its_keys_docstring() -> None:
    docs = attribute_docs((ROOT / "fedmq" / "config.py").read_text())
    root = Config()
    for key, need in RANGES.items():
        section, name = key.split(".")
        text = docs[(type(getattr(root, section)).__name__, name)]
        assert need in text, (key, text)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_the_edge_of_a_range_loads_and_past_it_is_refused(key: str) -> None:
    typ = numeric_keys()[key]
    inside, outside = inside_and_outside(RANGES[key], typ)
    assert in_range(inside, RANGES[key]) and not in_range(outside, RANGES[key])
    partners = PARTNERS.get(key, {})
    as_typed = (lambda v: int(v)) if typ is int else float
    cfg = load_config(None, {**partners, key: as_typed(inside)})
    assert getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) == as_typed(inside)
    with pytest.raises(ConfigError, match=rf"^{key} must be {re.escape(RANGES[key])}, got"):
        load_config(None, {**partners, key: as_typed(outside)})


@pytest.mark.parametrize("pair", [("data.max_samples=100", "data.min_samples=200"),
                                  ("data.primary_max=0.3", "data.primary_min=0.5"),
                                  ("broker.reconnect_max_s=1", "broker.reconnect_min_s=2")])
def test_ordered_pairs_are_checked(pair: tuple[str, str]) -> None:
    overrides = dict(item.split("=") for item in pair)
    with pytest.raises(ConfigError, match=pair[0].split("=")[0]):
        load_config(None, overrides)


def test_a_toml_file_out_of_range_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("[catafed]\nrounds = 0\n")
    with pytest.raises(ConfigError, match="catafed.rounds must be >= 1, got 0"):
        load_config(path)


def test_an_unknown_dataset_is_refused_at_load_naming_the_known_ones() -> None:
    with pytest.raises(UsageError, match="unknown dataset 'nosuchdata'.*digits.*mnist"):
        load_config(None, {"data.dataset": "nosuchdata"})


@pytest.mark.parametrize("path", sorted((ROOT / "deploy").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_and_the_defaults_load(path: Path) -> None:
    load_config(None)
    load_config(path)


def far_inside(need: str, typ: type) -> float:
    """A value well inside `need`, away from the edge that `inside_and_outside` tries: the top of a
    closed interval, or 10 above a lower bound."""
    if need.startswith(">"):
        return float(need.lstrip(">=")) + 10
    lo, hi = (float(v) for v in need[4:-1].split(","))
    return hi if need[-1] == "]" else (lo + hi) / 2


STRATEGY_SECTIONS = ("cdfl", "fedasync", "fedbuff")
"""The sections the asynchronous strategies read their knobs from (aggregator/bootstrap.py)."""


@pytest.mark.parametrize("key", sorted(k for k in RANGES if k.split(".")[0] in STRATEGY_SECTIONS))
def test_a_value_a_range_allows_builds_every_strategy(key: str) -> None:
    """A value the documented range allows must not be refused later by the strategy that uses
    it: that would be a traceback minutes into a run (cdfl.beta0 = 5 once was)."""
    import torch

    from aggregator.bootstrap import ASYNC_STRATEGIES
    from fedmq.models import model_spec

    typ = numeric_keys()[key]
    spec = model_spec("digits-cnn")
    for value in {inside_and_outside(RANGES[key], typ)[0], far_inside(RANGES[key], typ)}:
        cfg = load_config(None, {key: int(value) if typ is int else float(value)})
        k = cfg.cdfl.clusters
        clusters = [torch.zeros(spec.numel) for _ in range(k)]
        proxies = [(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)) for _ in range(k)]
        for name, build in ASYNC_STRATEGIES.items():
            try:
                build(cfg, spec, clusters, proxies, "cpu")
            except ValueError as e:
                pytest.fail(f"{key}={value} is within {RANGES[key]} but {name} refuses it: {e}")
