"""The attack suite's fast cases (soak/attacks.py) against a real Mosquitto with prod.conf.

Cases whose verdict is a latency ratio (update_flood, chunk_flood) run only in `make soak`:
speed is measured there, not asserted in tests.
"""

from __future__ import annotations

import json

import pytest

from fedmq.broker import find_mosquitto

FAST = ["takeover", "replay", "refusal", "status_epoch", "retained", "poisoning", "second_aggregator", "storage",
        "state_dir_is_file", "agent_state", "secrets"]


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_every_fast_attack_is_held_against_prod_conf(tmp_path) -> None:
    from soak import attacks

    out = tmp_path / "attacks.json"
    code = attacks.main(["--cases", ",".join(FAST), "--out", str(out)])
    figures = json.loads(out.read_text())
    assert sorted(figures) == sorted(FAST)
    failed = {name: f for name, f in figures.items() if not f["held"]}
    assert not failed and code == 0, json.dumps(failed, indent=1)[:4000]
