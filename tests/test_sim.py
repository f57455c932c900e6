"""The fleet simulator end to end over a real Mosquitto: records, files, report, bytes, seeds."""

from __future__ import annotations

import csv
import json
import math
import threading

import pytest

from fedmq import protocol
from fedmq.config import Config
from sim.fleet import WALL_PARTS, RunSpec, kl_divergence, make_schedule, run_fleet, write_run
from sim.report import write_report
from sim.scenarios import SCENARIOS, build_clusters, draw_cycle, route_mixture
from tests.wire_counter import WireCounter


def tiny_config() -> Config:
    cfg = Config()
    cfg.data.min_samples, cfg.data.max_samples = 60, 120
    cfg.aggregator.pretrain_epochs = 2
    cfg.log.level = "error"
    return cfg


def tiny_spec(method: str, seed: int = 0) -> RunSpec:
    return RunSpec(scenario="rotated-digits", method=method, clusters=2, agents=4, seed=seed,
                   updates_per_agent=2, test_samples=60, local_epochs=1)


def test_schedule_is_seeded_and_keeps_each_agents_cycles_in_order():
    a = make_schedule(3, agents=10, updates_per_agent=4)
    assert a == make_schedule(3, agents=10, updates_per_agent=4)
    assert a != make_schedule(4, agents=10, updates_per_agent=4)
    for agent in range(10):
        assert [c for x, c in a if x == agent] == list(range(sum(1 for x, _ in a if x == agent)))
    assert 20 <= len(a) <= 60  # Poisson(4) per agent, 10 agents


def test_a_checkpoint_waits_for_the_events_before_it_and_no_worker_runs_past_it():
    """Workers take events in order; at a checkpoint (every `eval_every` events) the clusters
    are scored after exactly the events before it. A worker that asks for the next event
    meanwhile waits: it used to take it, finish it first, and the checkpoint then saw another
    set of events, or none at all (`done` carried past the mark: the run hung)."""
    from sim.fleet import _Dispatcher

    finished: list[int] = []
    seen: list[list[int]] = []
    d = _Dispatcher([(0, 0), (1, 0), (2, 0), (3, 0)], 2, lambda i: seen.append(sorted(finished)))

    def finish(i: int, agent: int) -> None:
        finished.append(i)
        d.finish(agent)

    first, second = d.take(), d.take()
    assert (first, second) == ((0, 0, 0), (1, 1, 0))
    took: dict[str, tuple[int, int, int] | None] = {}
    marks = {name: threading.Event() for name in ("checkpoint", "after")}

    def taker(name: str) -> None:
        took[name] = d.take()
        marks[name].set()
        if took[name] is not None:
            finish(took[name][0], took[name][1])

    threads = [threading.Thread(target=taker, args=(n,)) for n in ("checkpoint", "after")]
    threads[0].start()
    assert not marks["checkpoint"].wait(0.5)  # draining: events 0 and 1 are still out
    threads[1].start()
    # the later taker is held too (before the fix it got event 3 at once and finished it)
    assert not marks["after"].wait(1.0)
    finish(0, 0)
    finish(1, 1)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert seen == [[0, 1]]
    assert sorted(v for v in took.values() if v is not None) == [(2, 2, 0), (3, 3, 0)]


def test_kl_divergence():
    assert kl_divergence([0.5, 0.5], [0.5, 0.5]) == pytest.approx(0.0)
    assert kl_divergence([1.0, 0.0], [0.5, 0.5]) == pytest.approx(math.log(2))
    assert math.isfinite(kl_divergence([0.5, 0.5], [1.0, 0.0]))  # an estimate of 0 is floored


def test_digits_domains_differ_and_follow_a_route():
    cfg = tiny_config()
    scenario = SCENARIOS["digits-domains"]
    from sim.scenarios import apply_defaults

    apply_defaults(scenario, cfg)
    clusters = build_clusters(scenario, cfg, 3)
    proxies = [clusters.proxy(k) for k in range(3)]
    assert not any(bool((proxies[0].x == p.x).all()) for p in proxies[1:])
    assert (proxies[0].y == proxies[1].y).all()  # same base images, another appearance
    train0, _ = draw_cycle(scenario, clusters, cfg, 0, agent=1, cycle=0, test_samples=20)
    train1, _ = draw_cycle(scenario, clusters, cfg, 0, agent=1, cycle=1, test_samples=20)
    assert abs(train0.alpha - train1.alpha).sum() < 1.0  # neighbouring stretches of road
    assert route_mixture(0.0, 3).argmax() == 0 and route_mixture(1 / 3, 3).argmax() == 1


def test_tiny_fleet_end_to_end_over_mosquitto(mosquitto, tmp_path):
    cfg = tiny_config()
    cfg.fleet = "simtest"
    counter = WireCounter(mosquitto.url)
    results = {}
    try:
        for method in ("cdfl", "fedsoft-async"):
            before = dict(counter.bytes)
            results[method] = r = run_fleet(tiny_spec(method), cfg, broker_url=mosquitto.url)
            write_run(r, tmp_path)
            # what the agents counted is what crossed the broker (the join included)
            deadline = threading.Event()
            for _ in range(50):
                seen = {k: counter.bytes[k] - before[k] for k in before}
                if seen["down"] == sum(b["down"] for b in r.agent_bytes.values()):
                    break
                deadline.wait(0.1)
            assert seen["up"] == sum(b["up"] for b in r.agent_bytes.values()) > 0
            assert seen["down"] == sum(b["down"] for b in r.agent_bytes.values()) > 0
    finally:
        counter.transport.close()
    local = run_fleet(tiny_spec("local"), cfg)
    write_run(local, tmp_path)

    schedule = make_schedule(0, 4, 2)
    for method, r in [*results.items(), ("local", local)]:
        assert [(int(u.agent[-5:]), u.cycle) for u in r.updates] == schedule
        assert sorted(u.arrival for u in r.updates) == list(range(len(schedule)))
        for u in r.updates:
            assert 0.0 <= u.acc_held <= 1 and 0.0 <= u.acc_before <= 1 and 0.0 <= u.acc_after <= 1
            assert u.compute_s > 0
            if method == "local":
                assert math.isnan(u.kl) and u.bytes_up == u.bytes_down == 0 and u.acc_after == u.acc_before
            else:
                assert u.kl >= 0 and len(u.alpha_est) == 2 and u.staleness >= 1
                assert u.epoch > u.tau and u.bytes_up > 0 and u.bytes_down > 0
    cdfl, fedsoft = results["cdfl"], results["fedsoft-async"]
    # the server applied every upload once, and each epoch was handed out once
    assert cdfl.info["aggregator_counters"]["applied.update"] == len(schedule)
    assert cdfl.info["strategy_counters"]["applied"] == len(schedule) - cdfl.info["stale_updates"]
    assert cdfl.info["state_dir_peak_bytes"] > 0  # the aggregator journaled to its state dir
    assert sorted(u.epoch for u in cdfl.updates) == list(range(1, len(schedule) + 1))
    # FedSoft-Async downloads all K = 2 models: about twice CDFL's one
    ratio = fedsoft.summary()["bytes_down_per_update"] / cdfl.summary()["bytes_down_per_update"]
    assert 1.6 < ratio < 2.6
    # CDFL's reply carries the server's estimate; FedSoft's is the agent's own argmin
    for u in fedsoft.updates:  # shares of samples (ties split in halves)
        assert all(abs(a * u.n_samples * 2 - round(a * u.n_samples * 2)) < 1e-6 for a in u.alpha_est)

    report, figures, text = write_report(tmp_path, "fedmq sim run ...")
    assert "| CDFL |" in text and "| FedSoft-Async |" in text and "| Local |" in text
    assert "| CDFL - FedSoft-Async | 0 |" in text and "| CDFL - Local | 0 |" in text  # paired by seed
    assert {p.name for p in figures} == {"rotated-digits_accuracy_over_time.png", "rotated-digits_kl.png",
                                         "rotated-digits_relative_cost.png"}
    assert all(p.stat().st_size > 5000 for p in figures)
    made = report.read_text()
    assert write_report(tmp_path)[0].read_text() == made  # made again, it keeps its command
    run_dir = tmp_path / "runs" / cdfl.spec.label
    rows = list(csv.DictReader((run_dir / "updates.csv").read_text().splitlines()))
    assert len(rows) == len(schedule)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] == len(schedule)
    assert summary["client_acc"] == pytest.approx(sum(float(r["acc_after"]) for r in rows) / len(rows))
    split = summary["wall_split"]  # where the wall went: its parts add up to it
    assert list(split) == list(WALL_PARTS) and min(split.values()) >= 0
    assert sum(split.values()) == pytest.approx(summary["wall_s"], abs=0.1)
    assert split["aggregator_s"] == pytest.approx(summary["aggregator_busy_s"], abs=0.01)
    assert split["agents_training_s"] > 0 and split["setup_s"] > 0
    agents = list(csv.DictReader((run_dir / "agents.csv").read_text().splitlines()))
    assert sum(int(a["bytes_down"]) for a in agents) == sum(b["down"] for b in cdfl.agent_bytes.values())
    assert protocol.validate_id(cfg.fleet)


@pytest.mark.slow
def test_same_seed_same_table_with_one_worker(mosquitto):
    cfg = tiny_config()
    cfg.fleet = "simseed"

    def table(seed: int):
        r = run_fleet(tiny_spec("cdfl", seed), cfg, broker_url=mosquitto.url)
        return [(u.agent, u.cycle, u.acc_held, u.acc_before, u.acc_after, round(u.kl, 9), u.staleness)
                for u in r.updates], r.cluster_acc

    first = table(0)
    assert table(0) == first
    assert table(1) != first


def test_a_fleet_whose_aggregator_may_not_serve_fails_with_the_reason_not_a_hang(mosquitto):
    """Another aggregator's retained "online" status, whose will never comes: the simulated
    fleet's aggregator waits for it, never connects, and the run ends with why; its agents
    would otherwise re-send their joins to nobody."""
    from fedmq.errors import RuntimeFailure
    from fedmq.transport import MqttTransport
    from sim.fleet import fleet_name

    cfg = tiny_config()
    cfg.fleet = "simbusy"
    cfg.broker.url = mosquitto.url
    cfg.broker.keepalive_s = 2  # the wait for the other's will is 1.5 keepalives: 8 s, not 50
    spec = tiny_spec("cdfl")
    other = MqttTransport("another-aggregator", cfg.broker, clean_start=True).connect()
    try:
        status = protocol.Status(agent="aggregator", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 state="online", role="aggregator", started_at=protocol.now())
        assert other.publish(protocol.aggregator_status(fleet_name(cfg.fleet, spec)), protocol.encode(status),
                             qos=1, retain=True).wait(30)
        with pytest.raises(RuntimeFailure, match="did not start: .*another aggregator"):
            run_fleet(spec, cfg, broker_url=mosquitto.url)
    finally:
        other.close()


def test_fedbuff_comes_from_its_registry_line_through_the_simulator_and_report(mosquitto, tmp_path):
    """FedBuff was added as one module, one registry line and its [fedbuff] section: the
    simulator runs it over the wire and the report names it, with nothing else changed."""
    from fedmq.cli import main

    cfg = tiny_config()
    cfg.fleet = "buff"
    cfg.fedbuff.buffer_size = 3  # 13 uploads: four flushes, one left in the buffer
    r = run_fleet(tiny_spec("fedbuff"), cfg, broker_url=mosquitto.url)
    write_run(r, tmp_path)
    schedule = make_schedule(0, 4, 2)
    assert r.info["aggregator_counters"]["applied.update"] == len(schedule) == 13
    assert all(u.bytes_up > 0 and u.bytes_down > 0 and u.epoch > u.tau for u in r.updates)
    # the global model moved only at flushes: the cluster scores change 4 times at most
    scores = {tuple(c["acc"]) for c in r.cluster_acc}
    assert 2 <= len(scores) <= 1 + 4
    _, _, text = write_report(tmp_path)
    assert "| FedBuff |" in text
    assert main(["aggregator", "--algorithm", "fedbuff", "--dry-run"]) == 0


def test_refused_uploads_are_outcomes_and_the_run_goes_on(mosquitto, tmp_path):
    """An aggregator that refuses honest uploads does not end the run: each refused cycle is a
    record with its reason, the agent keeps the model it held, and summary.json and the report
    count the refusals by reason."""
    cfg = tiny_config()
    cfg.fleet = "simrefuse"
    # A descent test with no margin refuses every honest upload that raises the best proxy loss
    # at all: a real aggregator refusing some of the fleet's uploads and applying the rest.
    cfg.aggregator.loss_margin = 1e-9
    r = run_fleet(tiny_spec("cdfl"), cfg, broker_url=mosquitto.url)
    schedule = make_schedule(0, 4, 2)
    assert [(int(u.agent[-5:]), u.cycle) for u in r.updates] == schedule
    refused = [u for u in r.updates if u.refused]
    applied = [u for u in r.updates if not u.refused]
    assert refused and applied
    counters = r.info["aggregator_counters"]
    assert {u.refused for u in refused} == {"loss_outlier"}
    assert len(refused) == counters["rejected.loss_outlier"]
    assert len(applied) == counters["applied.update"]
    for u in refused:  # the trained model was dropped: the agent holds what it held
        assert u.acc_after == u.acc_held and u.epoch == u.tau and u.staleness == 0
        assert u.bytes_up > 0 and u.bytes_down > 0
    # every agent still holds the model the aggregator tracks for it: later uploads were applied
    assert sorted(u.epoch for u in applied) == list(range(1, len(applied) + 1))

    run_dir = write_run(r, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["refused"] == {"loss_outlier": len(refused)}
    assert summary["updates"] == len(schedule)
    rows = list(csv.DictReader((run_dir / "updates.csv").read_text().splitlines()))
    assert sum(row["refused"] == "loss_outlier" for row in rows) == len(refused)
    _, _, text = write_report(tmp_path)
    assert f"| CDFL | 2 | {len(refused)} | loss_outlier {len(refused)} |" in text


def test_a_cycle_whose_training_diverges_is_an_outcome_and_the_run_goes_on(mosquitto):
    """CDFL agents whose rate blows their models up to NaN send nothing and join again (the model
    they held would diverge again); the run ends with every cycle counted as `diverged` instead of
    stopping at the first."""
    from dataclasses import replace

    cfg = tiny_config()
    cfg.fleet = "simdiverge"
    spec = replace(tiny_spec("cdfl"), local_lr=1e30, rho=0.0)  # why: an absurd rate diverges at once
    run = run_fleet(spec, cfg, broker_url=mosquitto.url)
    assert len(run.updates) == len(make_schedule(0, 4, 2)) > 0
    assert all(r.refused == "diverged" and r.bytes_down > 0 for r in run.updates)  # each joined again
    assert run.summary()["refused"] == {"diverged": len(run.updates)}


def test_a_recorded_command_line_masks_the_broker_password(monkeypatch):
    from sim.cli import invoked_command

    monkeypatch.setattr("sys.argv", ["fedmq", "sim", "run", "--broker", "mqtts://agg:s3cret@host:8883",
                                     "--set", "cdfl.server_lr=0.5", "--out", "out dir/"])
    assert invoked_command() == ("fedmq sim run --broker mqtts://agg:***@host:8883 --set cdfl.server_lr=0.5 "
                                 "--out 'out dir/'")
    monkeypatch.setattr("sys.argv", ["python", "-c"])
    assert invoked_command() is None


def test_every_agent_knob_set_on_the_command_line_reaches_the_simulated_agents():
    """`fedmq sim run --set agent.lr=...` (and batch size, momentum, ...) train the simulated agents
    as they train a device; the run's spec records epochs, lr and rho."""
    from sim.fleet import local_training

    cfg = tiny_config()
    base = [(u.agent, u.cycle, u.acc_before) for u in run_fleet(tiny_spec("local"), cfg).updates]
    for key, value in (("lr", 0.003), ("batch_size", 8), ("momentum", 0.0)):
        changed = tiny_config()
        setattr(changed.agent, key, value)
        spec = RunSpec(**{**tiny_spec("local").__dict__, **local_training(changed.agent), "local_epochs": 1})
        got = [(u.agent, u.cycle, u.acc_before) for u in run_fleet(spec, changed).updates]
        assert got != base, key
    cfg.agent.lr, cfg.agent.rho = 0.003, 0.5
    assert local_training(cfg.agent) == {"local_epochs": 2, "local_lr": 0.003, "rho": 0.5}
