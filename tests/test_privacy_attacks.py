"""Privacy attacks on one upload (sim/attacks.py): they work where nothing protects
the client, and under DP they gain no more than the accountant's epsilon allows.

Real digits, the real pre-trained cluster models, uploads trained by the agent's own
train_local and sketched by fedmq.sketch, DP by fedmq.privacy: nothing is mocked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmq.config import Config
from sim.attacks import (
    DELTA,
    DP_BATCH_SIZE,
    ServerView,
    distinct_images,
    dp_ceiling,
    draw_client,
    herd,
    make_upload,
    membership_scores,
    pooled_membership,
    quality,
    server_view,
    sketch_preimage,
    ssim_matrix,
)
from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def view() -> ServerView:
    torch.set_num_threads(1)
    return server_view("rotated-digits", 2, Config())


def attack_clients(view: ServerView, n: int, clients: int, epsilon: float | None = None,
                   sigma: float | None = None) -> tuple[dict[str, list], list[tuple[float, float]]]:
    """Membership scores of every client, and (herding, control) SSIM coverage per client."""
    scored: dict[str, list] = {"sketch": [], "sketch_preimage": [], "update": [], "update_unsure": []}
    coverage = []
    for c in range(clients):
        client = draw_client(view, n, np.random.default_rng([7, n, c]))
        upload = make_upload(view, client, epsilon, sigma, seed=c, noise_seed=1000 + c)
        members, member_y = distinct_images(client.x, client.y, 500)
        picks = view.public_x[herd(view.public_embedding, upload.sketch, n)]
        preimage = sketch_preimage(view, upload.sketch, picks, steps=150)
        for name, pair in membership_scores(view, client, upload, members, member_y, preimage).items():
            scored[name].append(pair)
        control = view.public_x[torch.from_numpy(np.random.default_rng(c).choice(len(view.public_x), n,
                                                                                  replace=False))]
        coverage.append((quality(view, picks, members, client.out_x).coverage,
                         quality(view, control, members, client.out_x).coverage))
    return scored, coverage


def test_ssim_is_one_on_itself_and_lower_for_other_images() -> None:
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    s = ssim_matrix(x, x)
    assert torch.allclose(s.diag(), torch.ones(4), atol=1e-5)
    assert (s - torch.eye(4)).max() < 0.5


@pytest.mark.slow
def test_without_dp_every_attack_beats_chance_at_ten_samples(view) -> None:
    scored, coverage = attack_clients(view, 10, 20)
    rng = np.random.default_rng(0)
    sketch = pooled_membership(scored["sketch"], rng, 300)
    preimage = pooled_membership(scored["sketch_preimage"], rng, 300)
    update = pooled_membership(scored["update"], rng, 300)
    unsure = pooled_membership(scored["update_unsure"], rng, 300)
    assert sketch["auc"] > 0.75 and sketch["auc_ci"][0] > 0.6, sketch
    assert preimage["auc"] > 0.9, preimage
    # u is sure of most images (loss 0 in float32): their gradients, hence the update, carry
    # nothing of them; the images it is unsure of are told apart, and they lift the whole.
    assert unsure["auc"] > 0.8 and unsure["members"] >= 5 and unsure["non_members"] >= 5, unsure
    assert update["auc"] > 0.52, update
    herding, control = np.mean(coverage, axis=0)
    assert herding > control + 0.05, (herding, control)


@pytest.mark.slow
def test_with_dp_at_epsilon_1_no_attack_gains_more_than_the_ceiling(view) -> None:
    from fedmq.privacy import UplinkPrivacy, plan_noise, upload_releases

    n, clients, beta = 10, 40, 1e-3
    sigma = plan_noise(1.0, DELTA, n=n, uploads=12, batch_size=DP_BATCH_SIZE)
    spent = UplinkPrivacy(1.0, DELTA).spent(upload_releases(sigma, n, DP_BATCH_SIZE, 2, sketch=True))
    assert 0 < spent < 1.0
    ceiling = dp_ceiling(spent)
    private, _ = attack_clients(view, n, clients, 1.0, sigma)
    exposed, _ = attack_clients(view, n, clients)
    rng = np.random.default_rng(0)
    for name in ("sketch", "sketch_preimage", "update"):
        measured = pooled_membership(private[name], rng, 0)
        m = min(measured["members"], measured["non_members"])
        # DKW: each empirical CDF is within sqrt(ln(2/beta)/(2m)) of its truth w.p. 1 - beta, so the
        # measured max TPR - FPR exceeds the true advantage by at most twice that.
        slack = 2 * math.sqrt(math.log(2 / beta) / (2 * m))
        assert measured["advantage"] <= ceiling + slack, (name, measured, ceiling, slack)
    # the bound has teeth: the same clients' sketch without DP is beyond it
    open_sketch = pooled_membership(exposed["sketch"], rng, 0)
    assert open_sketch["advantage"] > ceiling + slack, (open_sketch, ceiling, slack)


def run_cli(*argv: str, timeout: float = 120, warm: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m sim.attacks ARGV`, forked from the warm interpreter if given (tests/warm_python.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    python = client_argv(warm, "python") if warm else [sys.executable]
    return subprocess.run([*python, "-m", "sim.attacks", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_run_writes_the_json_the_tables_and_the_figure(tmp_path, warm_python) -> None:
    done = run_cli("--quick", "--out", str(tmp_path), warm=warm_python)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("n=10 epsilon=") == 2, done.stdout
    doc = json.loads((tmp_path / "attacks.json").read_text())
    assert doc["command"].startswith("python -m sim.attacks --quick")
    assert [(c["n"], c["epsilon"]) for c in doc["cells"]] == [(10, None), (10, 4.0)]
    assert doc["cells"][1]["ceiling_upload"] < doc["cells"][1]["ceiling_lifetime"] <= 1
    table = (tmp_path / "attacks.md").read_text()
    assert "| 10 | none |" in table and "| 10 | 4 |" in table
    assert (tmp_path / "reconstructions.png").read_bytes()[:4] == b"\x89PNG"


def test_dry_run_prints_the_plan_and_bad_values_are_one_line(warm_python) -> None:
    done = run_cli("--dry-run", warm=warm_python)
    assert done.returncode == 0, done.stderr
    assert "rotated-digits" in done.stdout and "20 of n=10" in done.stdout and "dry run" in done.stdout
    for argv, name in ((("--epsilons", "0", "--dry-run"), "--epsilons"), (("--sizes", "ten"), "--sizes"),
                       (("--uploads", "x"), "--uploads"), (("--scenario", "nope", "--dry-run"), "nope")):
        done = run_cli(*argv, warm=warm_python)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1 and name in lines[0], (argv, done.stderr[-2000:])
        assert lines[0].startswith("python -m sim.attacks"), lines
