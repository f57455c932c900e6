"""Config: defaults, TOML, CLI overrides with type checks, and the generated reference page."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from fedmq.config import (
    Config,
    ConfigError,
    add_config_arguments,
    config_from_args,
    load_config,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_match_the_papers() -> None:
    cfg = Config()
    assert cfg.cdfl.beta0 == 0.025 and cfg.cdfl.hinge_a == 10 and cfg.cdfl.hinge_b == 5
    assert cfg.broker.url == "mqtt://127.0.0.1:1883"
    assert cfg.log.level == "auto"


def test_toml_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('fleet = "garage"\n[cdfl]\nbeta0 = 0.1\nclusters = 4\n[codec]\nzstd = false\n')
    cfg = load_config(f, {"cdfl.beta0": "0.2", "cdfl.metric_weights": "1,0,0"})
    assert cfg.fleet == "garage" and cfg.cdfl.clusters == 4 and cfg.codec.zstd is False
    assert cfg.cdfl.beta0 == 0.2  # the override wins over the file
    assert cfg.cdfl.metric_weights == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"cdfl.beta00": "1"}, "unknown config key"),
        ({"cdfl.clusters": "three"}, "expected int"),
        ({"cdfl.clusters": "2.5"}, "expected int"),
        ({"codec.zstd": "maybe"}, "expected bool"),
        ({"cdfl": "1"}, "is a section"),
        ({"fleet.x": "1"}, "not a section"),
    ],
)
def test_bad_overrides_are_clear_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_toml_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("fleet = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    f.write_text("[cdfl]\nbeta0 = true\n")
    with pytest.raises(ConfigError, match="expected float"):
        load_config(f)


def test_cli_flags_and_set(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ("broker", "fleet", "log_level", "seed"))
    args = parser.parse_args(["--broker", "mqtt://h:1", "--seed", "5", "--set", "fleet=x", "--set", "seed=7"])
    cfg = config_from_args(args)
    assert cfg.broker.url == "mqtt://h:1" and cfg.fleet == "x" and cfg.seed == 7
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["novalue"])


def test_config_reference_page_is_current() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_key_is_documented() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    undocumented = [ln for ln in text.splitlines() if ln.startswith("| `") and ln.endswith("|  |")]
    assert not undocumented, "add a docstring under these keys in fedmq/config.py: " + str(undocumented)


def test_every_key_says_what_it_does_in_at_most_three_lines() -> None:
    """A key's entry says what it does, its unit and range, and points to a page for the rest:
    at most 300 characters, three lines of the reference page."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gen_config_docs import attribute_docs

    long = {f"{cls}.{key}": len(doc) for (cls, key), doc in
            attribute_docs((ROOT / "fedmq" / "config.py").read_text()).items() if len(doc) > 300}
    assert not long, f"shorten these docstrings in fedmq/config.py (characters): {long}"


@pytest.mark.parametrize("old, new", [("catafed.prox_mu", "fedavg.prox_mu"),
                                      ("cdfl.fedasync_alpha", "fedasync.mixing")])
def test_a_moved_key_is_an_error_naming_its_new_place(old, new) -> None:
    with pytest.raises(ConfigError, match=f"{old} moved: set {new} instead"):
        load_config(None, {old: "0.5"})
    assert load_config(None, {new: "0.5"}) is not None
