"""bench device reads one update's cost from the process that trained it."""

from __future__ import annotations

from bench import bench_device


def test_one_update_reports_its_seconds_and_the_memory_training_added(monkeypatch) -> None:
    monkeypatch.setattr(bench_device, "MODELS", ("digits-cnn",))
    figures = bench_device.run(quick=True)  # a fresh process, as the benchmark runs it
    (row,) = figures["rows"]
    assert row["model"] == "digits-cnn" and row["samples"] == 64 and row["epochs"] == 2
    assert row["train_s"] > 0
    assert row["peak_rss_mb"] >= row["rss_before_training_mb"] > 100  # torch alone is more than that
