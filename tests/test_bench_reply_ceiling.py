"""The reply ceiling counts the steps the aggregator plans and the FLOPs one step costs."""

from __future__ import annotations

from bench.bench_reply_ceiling import reply_steps
from fedmq.config import CDFLSettings


def test_the_realistic_budget_is_stretched_to_the_step_floor() -> None:
    # 200 kept samples, batch 64: 4 steps an epoch; 8 epochs would be 32, the floor makes 128
    assert reply_steps(CDFLSettings(), 200) == 128
    assert reply_steps(CDFLSettings(personalize_min_steps=0), 200) == 32
    # a per-epoch sample cap leaves the floor: 2 epochs x ceil(128 / 64)
    assert reply_steps(CDFLSettings(personalize_epochs=2, personalize_samples=128), 200) == 4
