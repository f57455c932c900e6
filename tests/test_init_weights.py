"""A user's own weights as the fleet's start (`--init FILE`, aggregator.init): the files a
test writes with torch.save, read back as the model's vector or refused with one line, and
an aggregator over a real Mosquitto whose joining agent gets a model grown from them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from aggregator.bootstrap import pretrain_clusters
from edge_agent.state import AgentState
from fedmq.config import Config
from fedmq.data import clusters_from_settings, load_dataset
from fedmq.errors import UsageError
from fedmq.models import build_model, load_init_vector, load_vector, model_spec, to_vector
from fedmq.training import fit
from tests.cli_process import BIN, ROOT, CliProcess, cli_env
from tests.test_models import run_cli


def trained(name: str, seed: int = 3) -> torch.nn.Module:
    """A model whose batch-norm statistics are not their initial values (a forward in train mode)."""
    model = build_model(name, seed=seed)
    with torch.no_grad():
        model.train()(load_dataset("shapes", train=False).x[:64])
    return model


def test_a_state_dict_and_a_raw_vector_are_read_as_the_models_vector(tmp_path) -> None:
    model = trained("resnet20")
    torch.save(model.state_dict(), tmp_path / "w.pt")  # num_batches_tracked too: an integer, left out
    expected = to_vector(model)
    assert expected[model_spec("resnet20").param_numel:].abs().sum() > 0
    assert torch.equal(load_init_vector(tmp_path / "w.pt", "resnet20"), expected)
    torch.save({"epoch": 7, "state_dict": model.state_dict()}, tmp_path / "checkpoint.pth")
    assert torch.equal(load_init_vector(tmp_path / "checkpoint.pth", "resnet20"), expected)
    expected.numpy().tofile(tmp_path / "w.f32")
    assert torch.equal(load_init_vector(tmp_path / "w.f32", "resnet20"), expected)


def _bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    good = trained("resnet20").state_dict()
    out = []

    def save(name: str, state) -> Path:
        torch.save(state, tmp_path / name)
        return tmp_path / name

    out.append((save("cifar100.pt", build_model("cnn32").state_dict()), "unexpected key 'conv1.bias'"))
    out.append((save("classes.pt", {**good, "fc.weight": torch.zeros(100, 64), "fc.bias": torch.zeros(100)}),
                "key 'fc.weight' is (100, 64), model resnet20 needs (10, 64)"))
    out.append((save("missing.pt", {k: v for k, v in good.items() if k != "layers.4.bn1.running_var"}),
                "missing key 'layers.4.bn1.running_var'"))
    nan = dict(good)
    nan["layers.0.conv1.weight"] = torch.full_like(good["layers.0.conv1.weight"], float("nan"))
    out.append((save("nan.pt", nan), "key 'layers.0.conv1.weight' holds NaN or inf"))
    out.append((save("list.pt", [good["fc.bias"]]), "holds a list, not a state dict"))
    (tmp_path / "text.pt").write_text("not weights\n")
    out.append((tmp_path / "text.pt", "not a torch state dict"))
    torch.zeros(10).numpy().tofile(tmp_path / "short.f32")
    out.append((tmp_path / "short.f32", "40 bytes, not the 271098 float32 values of model resnet20"))
    out.append((tmp_path / "absent.pt", "no such file"))
    return out


def test_a_file_that_does_not_fit_is_refused_with_one_line_naming_it_and_its_first_bad_key(tmp_path) -> None:
    for path, says in _bad_files(tmp_path):
        with pytest.raises(UsageError) as err:
            load_init_vector(path, "resnet20")
        message = str(err.value)
        assert message.startswith(f"init weights {path}: ") and says in message and "\n" not in message, message


def test_the_clusters_specialize_from_the_users_weights_instead_of_the_shared_pretraining(tmp_path) -> None:
    cfg = Config(model="digits-cnn")
    cfg.data.proxy_per_cluster, cfg.data.pretrain_per_cluster = 50, 60
    cfg.aggregator.pretrain_epochs = 1
    clusters = clusters_from_settings(cfg.data, 2, seed=cfg.seed)
    pool = clusters.pretrain(0, 60)
    own = fit("digits-cnn", to_vector(build_model("digits-cnn", seed=9)), pool.x, pool.y, epochs=2, lr=0.05).vector
    own.numpy().tofile(tmp_path / "own.f32")
    cfg.aggregator.init = str(tmp_path / "own.f32")
    started = pretrain_clusters(cfg, clusters, "digits-cnn")
    # cluster k: its pool, from the user's weights, at the specializing rate; no shared model first
    for k, vector in enumerate(started):
        d = clusters.pretrain(k, 60)
        alone = fit("digits-cnn", own, d.x, d.y, epochs=1, batch_size=32, lr=0.01, momentum=0.9, seed=cfg.seed + k)
        torch.testing.assert_close(vector, alone.vector)
    cfg.aggregator.init = ""
    assert not torch.allclose(pretrain_clusters(cfg, clusters, "digits-cnn")[0], started[0])


def test_the_aggregator_refuses_a_mismatched_file_before_it_touches_anything(tmp_path, warm_python) -> None:
    torch.save(build_model("cnn32-10").state_dict(), tmp_path / "cnn.pt")
    done = run_cli("aggregator", "--dataset", "shapes", "--model", "resnet20", "--init", "cnn.pt",
                   "--state-dir", "st", cwd=tmp_path, env=cli_env(), warm=warm_python)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "init weights cnn.pt: unexpected key 'conv1.bias'" in lines[0], lines[0]
    assert not (tmp_path / "st").exists()  # no state dir made, no broker reached


def test_the_documented_dry_run_checks_a_saved_state_dict(tmp_path, warm_python) -> None:
    """docs/models.md's `fedmq aggregator ... --init resnet20-pretrained.pt --dry-run`, as written."""
    text = (ROOT / "docs" / "models.md").read_text()
    command = re.search(r"`(fedmq aggregator [^`]*--init resnet20-pretrained\.pt[^`]*--dry-run)`", text)
    assert command, "docs/models.md shows the --init dry run"
    torch.save(trained("resnet20").state_dict(), tmp_path / "resnet20-pretrained.pt")
    done = run_cli(*command.group(1).split()[1:], cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0 and '"init": "resnet20-pretrained.pt"' in done.stdout, done.stderr


@pytest.mark.slow
def test_an_agent_joins_a_fleet_that_started_from_the_users_weights(mosquitto, tmp_path) -> None:
    """`fedmq aggregator --init` and `fedmq agent` over Mosquitto: the model the agent installs
    at its join is the users' weights specialized for an epoch, far nearer to them than to
    where a random start would have put the fleet."""
    cfg = Config()
    cfg.data.proxy_per_cluster, cfg.data.pretrain_per_cluster = 100, 200
    clusters = clusters_from_settings(cfg.data, 2, seed=0)
    d = clusters.pretrain(0, 200)
    own = fit("digits-cnn", to_vector(build_model("digits-cnn", seed=5)), d.x, d.y, epochs=3, lr=0.05).vector
    torch.save(load_vector(build_model("digits-cnn"), own).state_dict(), tmp_path / "own.pt")
    common = ["--broker", mosquitto.url, "--fleet", "own", "--dataset", "digits", "--model", "digits-cnn"]
    aggregator = CliProcess([str(BIN / "fedmq"), "aggregator", *common, "--clusters", "2", "--init", "own.pt",
                             "--state-dir", str(tmp_path / "agg"), "--log-level", "info",
                             "--set", "data.proxy_per_cluster=100", "--set", "data.pretrain_per_cluster=200",
                             "--set", "aggregator.pretrain_epochs=1"], cwd=tmp_path)
    agent = None
    try:
        aggregator.wait_for(r"cluster\.init .*path=own\.pt", timeout=120)
        aggregator.wait_for(r"^aggregator cdfl on ", timeout=300)
        agent = CliProcess([str(BIN / "fedmq"), "agent", *common, "--id", "car-1",
                            "--state-dir", str(tmp_path / "car-1")], cwd=tmp_path)
        agent.wait_for(r"model\.installed .*via=join", timeout=300)
        for proc in (agent, aggregator):
            assert proc.stop() == 0, proc.output[-3000:]
    finally:
        for proc in (agent, aggregator):
            if proc is not None:
                proc.kill()
    state = AgentState.load(tmp_path / "car-1")
    assert state is not None and state.vector is not None
    random_start = to_vector(build_model("digits-cnn", seed=0))
    assert (state.vector - own).norm() < 0.25 * (state.vector - random_start).norm()


def test_sim_run_checks_the_file_against_the_scenarios_model(tmp_path, warm_python) -> None:
    torch.save(build_model("digits-cnn").state_dict(), tmp_path / "digits.pt")
    torch.save(build_model("cnn28").state_dict(), tmp_path / "cnn28.pt")
    args = ["sim", "run", "--scenario", "rotated-digits", "--methods", "cdfl,local", "--out", "out", "--dry-run"]
    done = run_cli(*args, "--init", "digits.pt", cwd=tmp_path, env=cli_env(), warm=warm_python)
    assert done.returncode == 0 and "dry run: nothing started" in done.stdout, done.stderr
    done = run_cli(*args, "--init", "cnn28.pt", cwd=tmp_path, env=cli_env(), warm=warm_python)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "init weights cnn28.pt: key 'fc1.weight' is (64, 1568), model digits-cnn needs (64, 128)" in lines[0]
