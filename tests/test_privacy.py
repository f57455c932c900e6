"""Differential privacy of the uplink (fedmq/privacy.py, docs/privacy.md): the accountant
against the library's Gaussian mechanism, DP-SGD and the sketch's noise, and an
agent whose budget is spent stopping its uploads over a real Mosquitto."""

from __future__ import annotations

import json
import math
import signal
import subprocess

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from edge_agent.protocol_client import EdgeAgent
from fedmq.config import ConfigError, load_config
from fedmq.data import load_dataset
from fedmq.models import build_model, to_vector
from fedmq.privacy import BudgetSpent, DpSgd, UplinkPrivacy, plan_noise, upload_releases
from fedmq.sketch import data_sketch
from fedmq.training import fit
from tests.cli_process import CliProcess, cli_env
from tests.warm_python import client_argv


def test_the_accountant_matches_the_librarys_mechanisms() -> None:
    """Five uploads of DP-SGD (60 batches of 32 of 1000 samples) and a sketch (the Gaussian
    mechanism at sample rate 1: RDP alpha / (2 sigma^2), in closed form), composed."""
    privacy = UplinkPrivacy(100.0, delta=1e-5, noise_multiplier=1.3, sketch_noise_multiplier=0.9)
    for _ in range(5):
        privacy.spend(privacy.training(1000, 32, 60) + privacy.sketch_release())
    orders = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
    rdp = 5 * orders / (2 * 0.9**2) + np.asarray(compute_rdp(q=0.032, noise_multiplier=1.3, steps=300, orders=orders))
    expected, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert math.isclose(privacy.spent(), expected, rel_tol=1e-9)
    again = UplinkPrivacy(100.0, noise_multiplier=1.3, sketch_noise_multiplier=0.9)
    again.load_state_dict(privacy.state_dict())  # what the agent's state file keeps
    assert again.spent() == privacy.spent()
    assert privacy.spent(privacy.sketch_release()) > privacy.spent() > UplinkPrivacy(1.0).spent() == 0.0


def test_bad_privacy_settings_are_one_line() -> None:
    with pytest.raises(ConfigError, match="every noise multiplier must be > 0"):
        load_config(None, {"privacy.epsilon": 4, "privacy.noise_multiplier": 0}).privacy.mechanisms()
    with pytest.raises(ConfigError, match=r"privacy.delta must be in \(0, 1\), got 2"):  # at load
        load_config(None, {"privacy.epsilon": 4, "privacy.delta": 2})


def test_dp_sgd_clips_each_sample_and_adds_the_noise_it_is_charged_for() -> None:
    """One batch of 64, plain SGD: the step is lr (sum of clipped per-sample gradients +
    N(0, (sigma C)^2)) / 64, so two runs that differ only in sigma differ by lr sigma C / 64 per value."""
    data = load_dataset("digits")
    x, y = data.x[:64], data.y[:64]
    start = to_vector(build_model("digits-cnn", seed=0))
    knobs = dict(epochs=1, batch_size=64, lr=0.5, momentum=0.0, seed=0)
    plain = fit("digits-cnn", start, x, y, **knobs).vector
    clipped = fit("digits-cnn", start, x, y, **knobs, dp=DpSgd(0.01, 1e-9, seed=1))
    noisy = fit("digits-cnn", start, x, y, **knobs, dp=DpSgd(0.01, 4.0, seed=1)).vector
    assert clipped.steps == 1
    assert float((clipped.vector - start).norm()) <= 0.5 * 0.01 * (1 + 1e-4) < float((plain - start).norm())
    assert abs(float((noisy - clipped.vector).std()) / (0.5 * 4.0 * 0.01 / 64) - 1) < 0.05
    with pytest.raises(ValueError, match="batch norm"):
        fit("recipes.my_fleet:make_model?input=1x16x16", torch.zeros(1604), torch.zeros(4, 1, 16, 16),
            torch.zeros(4, dtype=torch.long), dp=DpSgd(1.0, 1.0, 0))


def envelope(dp: bool, n: int = 1000):
    cfg = load_config(None, {"privacy.epsilon": 50.0 if dp else 0.0, "privacy.sketch_noise_multiplier": 2.0,
                             "privacy.uploads": 0})  # the multipliers as set: the noise scale under test is known
    agent = EdgeAgent(cfg, "car-1")
    received = to_vector(build_model("digits-cnn", seed=0))
    agent.restore(0, received)
    x = load_dataset("digits").x[:n]
    env = agent.update_envelope(received, n, alpha=[0.7, 0.3], metrics={"acc_trained": 0.9}, inputs=x)
    sketch = np.frombuffer(env.sketch, dtype="<f2").astype(np.float64)
    return agent, env, sketch - data_sketch(x)


def test_with_dp_on_the_sketch_never_leaves_without_noise_nor_the_figures_without_it() -> None:
    agent, env, sketch_noise = envelope(dp=True)
    assert abs(float(sketch_noise.std()) / (2.0 * 2 * 32 / 1000) - 1) < 0.1  # sigma_s x 2 sqrt(D) / n
    assert env.alpha is None and not env.metrics  # computed from the data with no noise: not sent
    assert agent.counters["epsilon"] == round(agent.privacy.spent(), 4) > 0
    _, plain, sketch_off = envelope(dp=False)  # the control: the exact sketch and the figures
    assert float(np.abs(sketch_off).max()) < 1e-3 and plain.alpha == [0.7, 0.3] and plain.metrics


@pytest.mark.slow
def test_an_agent_whose_budget_is_spent_stops_uploading_and_says_so(mosquitto, tmp_path, warm_python) -> None:
    """Budget 4 planned over two uploads of 200 samples (the defaults otherwise: batch 128, the
    sketch, the Gaussian mechanism at one multiplier): two uploads spend 4 (to 1 %), a third
    would not fit. It is refused on the device, and a restart remembers. (FedSoft-Async's agent
    takes the same path; what it plans for, its mixture estimate, is checked in
    test_the_planned_noise_spends_the_budget_over_exactly_the_planned_uploads.)"""
    algorithm = "cdfl"
    fleet = ["--broker", mosquitto.url, "--fleet", "dp"]
    common = [*fleet, "--algorithm", algorithm]
    aggregator = CliProcess(["fedmq", "aggregator", *common, "--state-dir", str(tmp_path / "agg")], cwd=tmp_path)
    agent_argv = ["fedmq", "agent", *common, "--id", "car-1", "--state-dir", str(tmp_path / "car-1"),
                  "--set", "privacy.epsilon=4",
                  "--set", "privacy.uploads=2",  # the budget runs out in two uploads, not the default ten
                  "--set", "agent.train_on_newest=200",  # a fixed n: the epsilon per upload is known
                  "--set", "agent.poll_interval_s=0.1"]  # its 200 samples in 1 s, not the default stream's 10 s
    agent = None
    try:
        aggregator.wait_for(rf"^aggregator {algorithm} on ", timeout=300)
        agent = CliProcess(agent_argv, cwd=tmp_path)
        agent.wait_for(r"model\.installed .*via=join", timeout=300)
        for n in (1, 2):
            agent.proc.send_signal(signal.SIGUSR1)
            agent.wait_for(rf"model\.installed .*via=update epoch={n} ", timeout=300)
        agent.proc.send_signal(signal.SIGUSR1)
        spent = agent.wait_for(r"privacy\.budget_spent .*epsilon=([0-9.]+) budget=4", timeout=120)
        assert 3.96 < float(spent.group(1)) <= 4.0, spent.group(0)
        status = subprocess.run(client_argv(warm_python, "fedmq", "fleet", "status", *fleet, "--json"), env=cli_env(),
                                capture_output=True, text=True, timeout=120)
        counters = json.loads(status.stdout)["agents"][0]["counters"]
        assert counters["uploads"] == 2 and counters["budget_spent"] == 1 and 3.96 < counters["epsilon"] <= 4.0
        assert agent.stop() == 0
        agent = CliProcess(agent_argv, cwd=tmp_path)  # the spent epsilon is in the state file
        agent.wait_for(r"^agent car-1 ", timeout=120)
        agent.proc.send_signal(signal.SIGUSR1)
        agent.wait_for(r"privacy\.budget_spent ", timeout=120)
        assert agent.stop() == 0 and "Traceback" not in agent.output, agent.output[-3000:]
        assert len([ln for ln in aggregator.output.splitlines() if "update.applied" in ln]) == 2
        assert aggregator.stop() == 0
    finally:
        for proc in (agent, aggregator):
            if proc is not None:
                proc.kill()



def test_budget_spent_is_a_runtime_failure_with_the_numbers() -> None:
    privacy = UplinkPrivacy(8.0)
    upload = privacy.training(200, 32, 14) + privacy.sketch_release()
    privacy.check(upload)
    privacy.spend(upload)
    with pytest.raises(BudgetSpent, match=r"epsilon 7.24 of 8 .* would make it 10.2"):
        privacy.check(upload)


def test_round_agents_refuse_a_privacy_budget_instead_of_sending_plain_updates() -> None:
    from edge_agent.round_agent import RoundAgent
    from fedmq.errors import UsageError

    cfg = load_config(None, {"privacy.epsilon": 4.0})
    data = load_dataset("digits")
    with pytest.raises(UsageError, match="not yet for catafed rounds"):
        RoundAgent(cfg, "van-1", data.x[:50], data.y[:50], algorithm="catafed")


def test_the_planned_noise_spends_the_budget_over_exactly_the_planned_uploads() -> None:
    """plan_noise's multiplier: 12 uploads of 200 samples fit in epsilon 4 (within 1 %), a 13th
    does not; an agent with privacy.uploads gets it for all three mechanisms, at DP's batch."""
    sigma = plan_noise(4.0, 1e-5, n=200, uploads=12, batch_size=128)  # privacy.batch_size's default
    one = upload_releases(sigma, 200, 128, 2, sketch=True)
    privacy = UplinkPrivacy(4.0)
    assert 3.96 < privacy.spent(one * 12) <= 4.0 < privacy.spent(one * 13)
    agent = EdgeAgent(load_config(None, {"privacy.epsilon": 4.0, "privacy.uploads": 12}), "car-1")
    p = agent.privacy
    assert p.noise_multiplier == p.sketch_noise_multiplier == p.alpha_noise_multiplier == sigma
    for _ in range(12):
        p.check(p.upload_releases(200, 128, 2, sketch=True, alpha=False))
        p.spend(p.upload_releases(200, 128, 2, sketch=True, alpha=False))
    with pytest.raises(BudgetSpent):
        p.check(p.upload_releases(200, 128, 2, sketch=True, alpha=False))
    # FedSoft-Async's agent plans for what it sends instead of the sketch: its mixture estimate.
    fedsoft = EdgeAgent(load_config(None, {"privacy.epsilon": 4.0, "privacy.uploads": 12}), "car-2",
                        algorithm="fedsoft-async")
    p = fedsoft.privacy
    one = p.upload_releases(200, 128, 2, sketch=False, alpha=True)
    assert 3.96 < p.spent(one * 12) <= 4.0 < p.spent(one * 13)


def test_fedsoft_async_sends_only_the_alpha_dp_noised_and_starts_from_it() -> None:
    """With DP on, FedSoft-Async's argmin counts get N(0, 2 sigma_a^2); a noiseless alpha given to
    the envelope is dropped; train_cycle trains from the released mixture and charges both."""
    from edge_agent.trainer import train_cycle

    cfg = load_config(None, {"privacy.epsilon": 1e6, "privacy.alpha_noise_multiplier": 3.0,
                             "privacy.uploads": 0})  # the multipliers as set: the noise scale under test is known
    agent = EdgeAgent(cfg, "car-1", algorithm="fedsoft-async")
    draws = np.array([agent.privacy.noisy_alpha([0.5, 0.5], 10_000) for _ in range(2000)])[:, 0] * 10_000
    # n x share0 = n (c0 + e0) / (n + e0 + e1) ~ c0 + (e0 - e1) / 2 for n >> sigma: std sigma_a sqrt(2) / sqrt(2)
    assert abs(float(draws.std()) / 3.0 - 1) < 0.1
    clusters = [to_vector(build_model("digits-cnn", seed=s)) for s in (0, 1)]
    agent.restore(0, clusters[0])
    data = load_dataset("digits")
    x, y = data.x[:200], data.y[:200]
    before = len(agent.privacy.history)
    result, alpha = train_cycle("digits-cnn", "fedsoft-async", clusters[0], clusters, x, y, privacy=agent.privacy,
                                dp_seed=1, epochs=1)
    assert alpha == agent.privacy.released_alpha and len(agent.privacy.history) == before + 2
    env = agent.update_envelope(result.vector, 200, alpha=alpha)
    assert env.alpha == alpha
    assert agent.update_envelope(result.vector, 200, alpha=[0.7, 0.3]).alpha is None  # never noiseless


@pytest.mark.slow
def test_the_simulator_runs_dp_fleets_reproducibly_and_the_noise_costs_accuracy(tmp_path) -> None:
    """The ablation runner (the trade-off in docs/privacy.md) with DP: the same seed gives the
    same row; at epsilon 1 the uploads are noisier than without DP; the results get the
    accuracy-against-epsilon figure."""
    from sim.ablation import AblationSpec, Fleet, Variant, run_variant, write_results

    # Speed only: small server sets and 1-epoch replies with no floor of steps (what DP changes is
    # on the agent's side).
    small = {"data.proxy_per_cluster": 50, "data.pretrain_per_cluster": 200, "cdfl.personalize_epochs": 1,
             "cdfl.personalize_min_steps": 0}
    fleet = Fleet(AblationSpec(clusters=2, agents=4, updates_per_agent=2, test_samples=100), load_config(None, small))
    rows = {}
    for method in ("fedsoft-async", "cdfl"):
        rows[method] = run_variant(fleet, Variant.parse(method))
        rows[f"{method}-eps1"] = run_variant(fleet, Variant.parse(f"{method}-eps1={method}:privacy.epsilon=1,"
                                                                   "privacy.uploads=8"))
        assert rows[f"{method}-eps1"].acc_trained < rows[method].acc_trained, rows
    again = run_variant(fleet, Variant.parse("cdfl-eps1=cdfl:privacy.epsilon=1,privacy.uploads=8"))
    assert again.acc_received == rows["cdfl-eps1"].acc_received and again.kl == rows["cdfl-eps1"].kl
    assert "figure:" in write_results(list(rows.values()), tmp_path) and (tmp_path / "epsilon.png").stat().st_size
    assert "figure:" not in write_results([rows["cdfl"]], tmp_path / "plain")  # no DP, no figure

    # A DP upload (`noised`) moves CDFL's clusters by the pull rule, w_k += beta0 alpha_k s (v - w_k):
    # the delta rule would add its noisy step whole (docs/privacy.md: clusters at 0.25 at epsilon 1).
    from aggregator.bootstrap import make_strategy
    from aggregator.strategy import Upload

    cfg = fleet.cfg
    moved = {}
    for noised in (False, True):
        strategy = make_strategy(cfg, fleet.model_spec, [v.clone() for v in fleet.starts(cfg)], fleet.proxies,
                                 device="cpu")
        base = strategy.join("car-1").vectors[0]
        before = strategy.clusters.clone()
        noisy = base + torch.randn(base.shape, generator=torch.Generator().manual_seed(0))
        reply = strategy.update(Upload("car-1", noisy, 0, n_samples=500, base=base, noised=noised))
        moved[noised] = float((strategy.clusters - before).norm())
        assert reply.info.get("rule") == (None if noised else "delta")
    assert moved[True] < 0.2 * moved[False], moved


def test_no_sketch_of_fewer_samples_than_sketch_min_samples() -> None:
    """From the sketch of 10 images a pre-image search rebuilds them (docs/privacy.md): an agent
    sends none of fewer than agent.sketch_min_samples (100); the aggregator then uses the model."""
    data = load_dataset("digits")
    agent = EdgeAgent(load_config(None, {}), "car-1")
    received = to_vector(build_model("digits-cnn", seed=0))
    agent.restore(0, received)
    assert agent.update_envelope(received, 99, inputs=data.x[:99]).sketch is None
    assert agent.update_envelope(received, 100, inputs=data.x[:100]).sketch is not None


def test_the_grouped_accountant_says_what_opacus_says() -> None:
    """epsilon_of adds repeated mechanisms' RDP once per (multiplier, rate): the same epsilon as
    Opacus' own accountant, which recomputes every entry (a plan's bisection took 24 s), and
    its orders are the accountant's (fedmq loads Opacus' RDP analysis without `import opacus`)."""
    from fedmq.privacy import RDP_ORDERS, epsilon_of, upload_releases

    assert RDP_ORDERS == RDPAccountant.DEFAULT_ALPHAS

    history = upload_releases(3.3, 200, 128, 2, sketch=True, alpha=True) * 7 + upload_releases(1.1, 500, 32, 1)
    accountant = RDPAccountant()
    accountant.history = list(history)
    for delta in (1e-5, 1e-3):
        assert epsilon_of(history, delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
    assert epsilon_of([], 1e-5) == 0.0
