"""The agent-side registry (edge_agent/agent_algorithms.py) is the one place an agent decides
per algorithm: it covers every algorithm an agent runs, its fields agree with the server side
and with how the agent code behaves, and no other agent module compares algorithm names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from edge_agent.agent_algorithms import AGENT_ALGORITHMS, agent_algorithm
from edge_agent.deadline import MODES, DeadlineLearner
from edge_agent.trainer import train_cycle
from fedmq.algorithms import ASYNC_AGENT, ASYNC_SERVER, ROUNDS
from fedmq.config import CataFedSettings
from fedmq.models import build_model, to_vector

ROOT = Path(__file__).resolve().parent.parent


def test_every_agent_algorithm_has_one_entry_and_rounds_match_the_server() -> None:
    assert list(AGENT_ALGORITHMS) == list(dict.fromkeys([*ASYNC_AGENT, *ASYNC_SERVER, *ROUNDS]))
    for name, kind in AGENT_ALGORITHMS.items():
        assert kind.name == name
        assert kind.rounds == (name in ROUNDS)
        assert (kind.deadline_mode in MODES) == kind.rounds
        assert (kind.trains_from == "invite") == kind.rounds
        assert kind.connects == (name in ASYNC_SERVER or name in ROUNDS)  # local has no server side
        if not kind.connects:  # sends nothing, so nothing to describe
            assert not (kind.sends_sketch or kind.sends_alpha or kind.private)
        if kind.sends_alpha:  # its alpha comes from the K cluster models it downloads
            assert kind.trains_from == "cluster_mixture"
    with pytest.raises(ValueError, match="cdfl, fedsoft-async, local"):
        agent_algorithm("fedsgd")


def test_no_agent_module_compares_algorithm_names() -> None:
    pattern = re.compile(r"""algorithm\s*(==|!=)\s*["']|algorithm\s+(not\s+)?in\s*\(""")
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in sorted((ROOT / "edge_agent").glob("*.py")) if path.name != "agent_algorithms.py"
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_training_starts_where_the_registry_says() -> None:
    torch.manual_seed(0)
    held = to_vector(build_model("digits-cnn", seed=0))
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    knobs = dict(epochs=1, batch_size=20, lr=0.01, seed=0)
    for name, kind in AGENT_ALGORITHMS.items():
        if kind.rounds:
            continue
        if kind.trains_from == "cluster_mixture":
            with pytest.raises(ValueError, match="cluster models"):
                train_cycle("digits-cnn", name, held, None, x, y, **knobs)
            _, alpha = train_cycle("digits-cnn", name, held, [held, held.clone()], x, y, **knobs)
            assert alpha is not None and len(alpha) == 2
        else:
            _, alpha = train_cycle("digits-cnn", name, held, None, x, y, **knobs)
            assert alpha is None


def test_round_data_is_a_shard_only_where_the_registry_says() -> None:
    x, y = torch.randn(200, 1, 8, 8), torch.randint(0, 10, (200,))
    for name, kind in AGENT_ALGORITHMS.items():
        if not kind.rounds:
            with pytest.raises(ValueError, match="not a deadline-round algorithm"):
                DeadlineLearner(x, y, CataFedSettings(), algorithm=name)
            continue
        learner = DeadlineLearner(x, y, CataFedSettings(min_shard=32), algorithm=name)
        assert learner.shards.halve()  # as a missed deadline halves a CATA-Fed agent's shard
        assert learner.mode == kind.deadline_mode
        assert learner.shard_size == (100 if kind.shards else 200), name
