"""The attack suite's quick cases (soak/attacks.py) against a real Mosquitto with prod.conf.

Cases whose verdict is a latency ratio (update_flood, chunk_flood) run only in `make soak`:
speed is measured there, not asserted in tests. So do the two that start an aggregator
process per damaged copy or of their own (storage, poisoning, guard_lockout; about ten more process starts
that would crowd whatever test runs beside them): tests/test_journal.py,
tests/test_cli_errors.py and tests/test_poisoning.py cover those defences in-process.
chunk_stall runs here although its verdict is a latency: the stall it guards against is the
chunk timeout (30 s) against a join of well under a second, and its bound allows a second of
load beyond the idle join (soak/attacks.py STALL_SLACK_S). The rest run in two groups, each with its own broker and credentials.
"""

from __future__ import annotations

import json

import pytest

from fedmq.broker import find_mosquitto

GROUPS = {
    "network": ["takeover", "roles", "replay", "refusal", "status_epoch", "chunk_stall", "retained", "second_aggregator",
                "split_brain_start", "secrets"],
    "cli": ["state_dir_is_file", "agent_state", "secrets"],
}
SOAK_ONLY = {"update_flood", "chunk_flood", "storage", "poisoning", "guard_lockout"}
# Speed only: no case is about the reply's training or the status's period, so replies of a few
# steps (trained still) and a status re-published within 1 s of an epoch's move, not 10.
CHEAP = ["--set", "cdfl.personalize_epochs=1", "--set", "cdfl.personalize_min_steps=0",
         "--set", "aggregator.status_every_s=1"]


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_fast_attack_is_held_against_prod_conf(tmp_path, group) -> None:
    from soak import attacks

    cases = GROUPS[group]
    out = tmp_path / "attacks.json"
    code = attacks.main(["--cases", ",".join(cases), "--out", str(out), *CHEAP])
    figures = json.loads(out.read_text())
    assert sorted(figures) == sorted(cases)
    failed = {name: f for name, f in figures.items() if not f["held"]}
    assert not failed and code == 0, json.dumps(failed, indent=1)[:4000]


def test_the_groups_cover_every_case_but_the_soak_only_ones() -> None:
    from soak import attacks

    covered = {c for cases in GROUPS.values() for c in cases}
    assert covered == set(attacks.CASES) - SOAK_ONLY
