"""A simulated run split over processes that share one Mosquitto: aggregator + agent processes, merged."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedmq.config import Config
from sim.fleet import RunSpec, configure, make_schedule, run_fleet
from sim.report import write_report
from sim.scenarios import build_clusters, draw_cycle
from sim.split import SplitRunError, merge_parts, run_agents_part, run_aggregator_part
from tests.wire_counter import WireCounter

ROOT = Path(__file__).resolve().parent.parent
RUN_FLAGS = ["--clusters", "2", "--agents", "4", "--seed", "0", "--updates-per-agent", "2",
             "--min-samples", "60", "--max-samples", "120", "--test-samples", "60", "--log-level", "error"]


def _sim(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedmq.cli", "sim", *args], cwd=ROOT,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_aggregator_and_two_agent_processes_merge_into_one_run(mosquitto, tmp_path):
    out = tmp_path / "out"
    common = ["--broker", mosquitto.url, "--fleet", "split", *RUN_FLAGS, "--out", str(out)]
    counter = WireCounter(mosquitto.url)
    procs = {}
    try:
        procs["aggregator"] = _sim("aggregator", *common, "--set", "aggregator.pretrain_epochs=2",
                                   log=tmp_path / "aggregator.log")
        procs["agents-0"] = _sim("agents", *common, "--first-agent", "0", "--count", "2",
                                 log=tmp_path / "agents-0.log")
        procs["agents-2"] = _sim("agents", *common, "--first-agent", "2", log=tmp_path / "agents-2.log")
        for name, p in procs.items():
            assert p.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        counter.transport.close()

    label = "rotated-digits_K2_cdfl_s0"
    assert sorted(p.name for p in (out / "parts" / label).iterdir()) == \
        ["agents-00000-00001", "agents-00002-00003", "aggregator"]
    report, figures, text = write_report(out)  # merges the parts first
    run = out / "runs" / label
    rows = list(csv.DictReader((run / "updates.csv").read_text().splitlines()))
    summary = json.loads((run / "summary.json").read_text())

    # every scheduled (agent, cycle) exactly once, at its place in the schedule
    schedule = make_schedule(0, 4, 2)
    assert [(int(r["event"]), r["agent"], int(r["cycle"])) for r in rows] == \
        [(i, f"sim-{a:05d}", c) for i, (a, c) in enumerate(schedule)]
    # the same data draws as the in-process runner gives those agents
    spec = RunSpec(clusters=2, agents=4, seed=0, updates_per_agent=2, test_samples=60)
    base = Config()
    base.data.min_samples, base.data.max_samples = 60, 120
    scenario, cfg = configure(spec, base)
    clusters = build_clusters(scenario, cfg, 2)
    for r in rows:
        train, _ = draw_cycle(scenario, clusters, cfg, 0, int(r["agent"][-5:]), int(r["cycle"]), 60)
        assert int(r["n_samples"]) == len(train)
        assert json.loads(r["alpha_true"]) == pytest.approx(train.alpha.tolist())
    # the aggregator applied each upload once; arrival is the order it applied them
    assert sorted(int(r["epoch"]) for r in rows) == list(range(1, len(schedule) + 1))
    assert all(int(r["arrival"]) == int(r["epoch"]) - 1 for r in rows)
    assert summary["aggregator_counters"]["applied.update"] == len(schedule)
    assert summary["aggregator_counters"]["applied.join"] == 4
    assert summary["strategy_counters"]["joins"] == 4
    assert summary["state_dir_peak_bytes"] > 0  # carried from the aggregator's process
    assert summary["split"] is True and summary["agent_processes"] == 2 and summary["aggregator_complete"]
    # each process's command line, by part: what a control run differs by is on record
    assert sorted(summary["commands"]) == ["agents-00000-00001", "agents-00002-00003", "aggregator"]
    assert summary["commands"]["aggregator"].startswith("fedmq sim aggregator ")
    assert "aggregator.pretrain_epochs=2" in summary["commands"]["aggregator"]
    assert "--first-agent 2" in summary["commands"]["agents-00002-00003"]
    checkpoints = list(csv.DictReader((run / "clusters.csv").read_text().splitlines()))
    assert int(checkpoints[0]["events"]) == 0 and int(checkpoints[-1]["events"]) == len(schedule)
    # bytes: what the agents counted is what crossed the broker; per-update bytes + the joins
    agents = list(csv.DictReader((run / "agents.csv").read_text().splitlines()))
    assert [a["agent"] for a in agents] == [f"sim-{i:05d}" for i in range(4)]
    up = sum(int(a["bytes_up"]) for a in agents)
    down = sum(int(a["bytes_down"]) for a in agents)
    assert (up, down) == (counter.bytes["up"], counter.bytes["down"])
    for a in agents:
        mine = [r for r in rows if r["agent"] == a["agent"]]
        assert int(a["bytes_up"]) > sum(int(r["bytes_up"]) for r in mine)  # + its join
        assert int(a["bytes_down"]) > sum(int(r["bytes_down"]) for r in mine)  # + the whole model
    assert all(int(r["bytes_up"]) > 0 and int(r["bytes_down"]) > 0 for r in rows)
    assert summary["updates"] == len(schedule)
    cost = [line for line in text.splitlines() if line.startswith("| CDFL | 2 |")]  # the cost table's row
    assert len(cost) == 1 and cost[0].endswith(f"| {len(schedule)} | 0 |")  # updates, refused
    assert {p.name for p in figures} >= {"rotated-digits_accuracy_over_time.png", "rotated-digits_kl.png"}

    # a part missing, or a range run twice, is refused, not merged into a smaller run
    shutil.rmtree(out / "parts" / label / "agents-00002-00003")
    with pytest.raises(SplitRunError, match="missing 2-3"):
        merge_parts(out)
    shutil.copytree(out / "parts" / label / "agents-00000-00001", out / "parts" / label / "agents-again")
    with pytest.raises(SplitRunError, match="more than once 0-1"):
        merge_parts(out)


@pytest.mark.slow

def split_config(broker_url: str, fleet: str) -> Config:
    """Small draws and a short pre-training (speed only), quiet logs, on the test's broker."""
    cfg = Config()
    cfg.data.min_samples, cfg.data.max_samples = 60, 120
    cfg.aggregator.pretrain_epochs = 2
    cfg.log.level = "error"
    cfg.broker.url = broker_url
    cfg.fleet = fleet
    return cfg


def split_in_threads(spec: RunSpec, cfg: Config, out: Path) -> Path:
    """A split run's aggregator part (a thread) and its 4 agents, merged: the run dir."""
    ready = threading.Event()
    failures: list[BaseException] = []

    def aggregator() -> None:
        try:
            run_aggregator_part(spec, cfg, out, ready=ready)
        except BaseException as e:  # noqa: BLE001 (reported below)
            failures.append(e)
            ready.set()

    t = threading.Thread(target=aggregator)
    t.start()
    assert ready.wait(120) and not failures
    run_agents_part(spec, cfg, out, first=0, count=4, wait_s=30)
    t.join(120)
    assert not t.is_alive() and not failures
    (run,) = merge_parts(out)
    return run


def test_one_agents_process_reproduces_the_in_process_run(mosquitto, tmp_path):
    """Arrival order is all that differs: with one agents process and one worker, nothing does."""
    spec = RunSpec(clusters=2, agents=4, seed=3, updates_per_agent=2, test_samples=60, local_epochs=1)
    cfg = split_config(mosquitto.url, "whole")
    whole = run_fleet(spec, cfg, broker_url=mosquitto.url)

    cfg.fleet = "split"
    run = split_in_threads(spec, cfg, tmp_path)
    merged = json.loads((run / "summary.json").read_text())
    rows = list(csv.DictReader((run / "updates.csv").read_text().splitlines()))

    def key(agent: str, cycle, acc_held, acc_after, staleness, epoch) -> tuple:
        return agent, int(cycle), round(float(acc_held), 9), round(float(acc_after), 9), int(staleness), int(epoch)

    assert [key(r["agent"], r["cycle"], r["acc_held"], r["acc_after"], r["staleness"], r["epoch"]) for r in rows] \
        == [key(u.agent, u.cycle, u.acc_held, u.acc_after, u.staleness, u.epoch) for u in whole.updates]
    assert merged["cluster_acc"] == pytest.approx(whole.summary()["cluster_acc"])
    assert merged["client_acc"] == pytest.approx(whole.summary()["client_acc"])
    assert merged["kl"] == pytest.approx(whole.summary()["kl"])


def test_split_run_with_refused_uploads_completes_and_merges_their_counts(mosquitto, tmp_path):
    """The aggregator part stops once every scheduled upload is answered, refused ones included,
    and the merged run counts the refusals by reason."""
    spec = RunSpec(clusters=2, agents=4, seed=0, updates_per_agent=2, test_samples=60, local_epochs=1)
    cfg = split_config(mosquitto.url, "refusing")
    # A descent test with no margin: the aggregator refuses the honest uploads that raise its
    # best proxy loss at all, and applies the rest.
    cfg.aggregator.loss_margin = 1e-9
    run = split_in_threads(spec, cfg, tmp_path)
    merged = json.loads((run / "summary.json").read_text())
    counters = merged["aggregator_counters"]
    assert merged["aggregator_complete"] is True
    assert merged["refused"] == {"loss_outlier": counters["rejected.loss_outlier"]}
    assert counters["rejected.loss_outlier"] > 0
    assert counters["rejected.loss_outlier"] + counters["applied.update"] == merged["updates"] \
        == len(make_schedule(0, 4, 2))
