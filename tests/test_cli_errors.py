"""Errors a person can read: each expected failure of the real CLI is one line on stderr that
names the bad thing, exit status 2 (usage) or 1 (runtime), and no traceback.

Every case runs `python -m fedmq.cli ...` (or a `python -m` entry point) as a process of its own
from the repo root, as a user would; brokers are real Mosquitto processes. Most are forked from a
warm interpreter (tests/warm_python.py: torch imported once, 2 s less a case); those marked
`fresh=True` start cold, so an import that prints would break a one-line check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto, free_port
from fedmq.creds import make_credentials
from sim.seeds import int_list, seed_list
from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")


_WARM: list[Path] = []


@pytest.fixture(autouse=True)
def _warm(warm_python: Path) -> None:
    _WARM[:] = [warm_python]


def run(*argv: str, module: str = "fedmq.cli", timeout: float = 180, fresh: bool = False
        ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = ([sys.executable] if fresh or not _WARM else client_argv(_WARM[0], "python")) + ["-m", module, *argv]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line(done: subprocess.CompletedProcess, status: int, *names: str) -> str:
    """Exit status `status`, exactly one non-empty stderr line naming every one of `names`."""
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1, done.stderr[-3000:]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- usage: exit 2

@pytest.mark.parametrize("argv, names", [
    (("aggregator", "--clusters", "x"), ("fedmq aggregator", "--clusters", "'x'")),
    (("agent", "--no-such-flag"), ("fedmq agent", "--no-such-flag")),
    (("aggregator", "--workers", "2", "--algorithm", "fedsoft-async", "--dry-run"), ("--workers", "fedsoft-async")),
    (("aggregator", "--workers", "2", "--set", "cdfl.personalization=mixture", "--dry-run"), ("--workers", "mixture")),
    (("aggregator", "--workers", "-1", "--dry-run"), ("--workers", "-1")),
    (("agent", "--profile", "boat"), ("fedmq agent", "--profile", "boat")),
    (("aggregator", "--dataset", "nosuch", "--dry-run"), ("unknown dataset 'nosuch'", "digits")),
    (("agent", "--id", "a", "--model", "nosuch", "--dry-run"), ("unknown model 'nosuch'", "cnn28")),
    (("aggregator", "--set", "cdfl.clusterz=3", "--dry-run"), ("cdfl.clusterz", "did you mean cdfl.clusters")),
    (("aggregator", "--set", "cdfl.clusters=three", "--dry-run"), ("cdfl.clusters", "three")),
    (("aggregator", "--set", "cdfl.personalize_batch_size=0", "--dry-run"), ("cdfl.personalize_batch_size", ">= 1")),
    (("aggregator", "--set", "cdfl.trunk_share=2", "--dry-run"), ("cdfl.trunk_share", "-1 (auto)")),
    (("aggregator", "--set", "cdfl.reply_average=1", "--dry-run"), ("cdfl.reply_average", "in [0, 1)")),
    (("aggregator", "--set", "cdfl.personalize_min_steps=-5", "--dry-run"), ("cdfl.personalize_min_steps", ">= 0")),
    (("aggregator", "--set", "cdfl.personalize_tail_average=2", "--dry-run"),
     ("cdfl.personalize_tail_average", "in [0, 1]")),
    (("aggregator", "--set", "cdfl.personalize_rho=-1", "--dry-run"), ("cdfl.personalize_rho", ">= 0")),
    (("sim", "run", "--set", "cdfl.personalize_epochs=-1", "--out", "OUT"), ("fedmq sim run", "cdfl.personalize_epochs")),
    (("agent", "--id", "a", "--set", "agent.epochs", "--dry-run"), ("--set", "key=value", "agent.epochs")),
    (("agent", "--id", "a", "--broker", "mqtt://u:secret@host:99999", "--dry-run"), ("broker URL", "port")),
    (("agent", "--algorithm", "local"), ("fedmq agent", "--id")),
    (("agent", "--id", "a", "--log-level", "loud", "--dry-run"), ("log level 'loud'", "debug")),
    (("sim", "run", "--scenario", "nope", "--out", "OUT"), ("fedmq sim run", "unknown scenario 'nope'")),
    (("sim", "run", "--seeds", "1,x", "--out", "OUT"), ("fedmq sim run", "--seeds", "1,x")),
    (("sim", "run", "--clusters", "two", "--out", "OUT"), ("--clusters", "two")),
    (("sim", "run", "--methods", "cdfl,nope", "--out", "OUT"), ("unknown method 'nope'",)),
    (("sim", "run", "--agents", "-1", "--out", "OUT"), ("fedmq sim run", "--agents must be >= 1, got -1")),
    (("sim", "run", "--set", "cdfl.beta0=5", "--out", "OUT"), ("fedmq sim run", "cdfl.beta0 must be in [0, 1]")),
    (("sim", "ablation", "--seeds", "1,"), ("fedmq sim ablation", "--out")),
    (("sim", "rounds", "--seeds", "x"), ("fedmq sim rounds", "--seeds", "'x'")),
    (("fleet", "status", "--watch", "soon"), ("fedmq fleet status", "--watch", "soon")),
    (("creds", "--out", "OUT", "--agents", "bad+name"), ("bad+name",)),
    (("broker", "--port", "nope"), ("fedmq broker", "--port")),
    # Every config value is checked at load: `--dry-run` fails where a start would.
    (("aggregator", "--clusters", "0", "--dry-run"), ("fedmq aggregator", "--clusters (cdfl.clusters) must be >= 1, got 0")),
    (("agent", "--id", "a", "--clusters", "0", "--dry-run"), ("fedmq agent", "--clusters (cdfl.clusters) must be >= 1")),
    (("aggregator", "--set", "cdfl.clusters=0", "--dry-run"), ("cdfl.clusters must be >= 1",)),
    (("aggregator", "--algorithm", "catafed", "--set", "catafed.rounds=0", "--dry-run"), ("catafed.rounds", ">= 1")),
    (("aggregator", "--set", "catafed.pf_window=0.5", "--dry-run"), ("catafed.pf_window", ">= 1")),
    (("aggregator", "--set", "codec.topk_ratio=1.5", "--dry-run"), ("codec.topk_ratio", "in (0, 1]")),
    (("agent", "--id", "a", "--set", "agent.lr=0", "--dry-run"), ("agent.lr must be > 0",)),
    (("agent", "--id", "a", "--set", "agent.reply_timeout_s=-1", "--dry-run"), ("agent.reply_timeout_s", "> 0")),
    (("agent", "--id", "a", "--set", "data.max_samples=10", "--dry-run"), ("data.max_samples", "data.min_samples")),
    (("agent", "--id", "a/b", "--dry-run"), ("fedmq agent", "--id (agent.id) must match", "a/b")),
    # An unknown dataset is named as such, with the known ones, wherever it is given.
    (("aggregator", "--dataset", "nosuchdata", "--state-dir", "OUT"), ("unknown dataset 'nosuchdata'", "digits, ")),
    (("agent", "--id", "a", "--dataset", "nosuchdata", "--state-dir", "OUT"), ("unknown dataset 'nosuchdata'", "digits, ")),
    (("sim", "run", "--set", "data.dataset=nosuchdata", "--out", "OUT"), ("fedmq sim run", "unknown dataset 'nosuchdata'")),
    (("sim", "rounds", "--dataset", "nosuchdata", "--out", "OUT"), ("fedmq sim rounds", "unknown dataset 'nosuchdata'")),
])
def test_usage_errors_are_one_line_and_exit_2(argv, names, tmp_path) -> None:
    argv = tuple(str(tmp_path / "out") if a == "OUT" else a for a in argv)
    line = assert_one_line(run(*argv), 2, *names)
    assert "secret" not in line  # a password in a broker URL is never echoed
    assert not (tmp_path / "out").exists()  # a refused command leaves nothing behind


@pytest.mark.parametrize("argv", [
    ("aggregator", "--clusters", "0"),
    ("aggregator", "--algorithm", "catafed", "--set", "catafed.deadline_s=0"),
    ("agent", "--id", "a", "--clusters", "0"),
    ("agent", "--id", "a", "--algorithm", "catafed", "--set", "catafed.epochs=0"),
])
def test_an_out_of_range_start_is_refused_before_it_touches_anything(argv, tmp_path) -> None:
    """Without --dry-run the same one line and exit 2, and the state dir is never made."""
    state = tmp_path / "state"
    done = run(*argv, "--state-dir", str(state), "--broker", f"mqtt://127.0.0.1:{free_port()}")
    assert_one_line(done, 2, "must be")
    assert not state.exists()


def test_config_file_with_a_typo_is_one_line_and_exit_2(tmp_path) -> None:
    conf = tmp_path / "agg.toml"
    conf.write_text("[cdfl]\nbeta_0 = 0.1\n")
    assert_one_line(run("aggregator", "--config", str(conf), "--dry-run"), 2, "cdfl.beta_0", "beta0")
    assert_one_line(run("aggregator", "--config", str(tmp_path / "missing.toml"), "--dry-run"), 2,
                    "missing.toml")


@pytest.mark.parametrize("module, argv, names", [
    ("sim.ablation", ("--seeds", "1,x", "--out", "OUT"), ("python -m sim.ablation", "--seeds", "1,x")),
    ("sim.ablation", ("--seeds", "0", "--out", "OUT"), ("--seeds", ">= 1")),
    ("sim.ablation", ("--variant", "x=nope", "--out", "OUT"), ("variant", "nope")),
    ("sim.ablation", ("--jobs", "-1", "--out", "OUT"), ("--jobs", "negative")),
    ("sim.ablation", ("--jobs", "2", "--wire", "--out", "OUT"), ("--jobs", "--wire", "one fleet at a time")),
    ("sim.ablation", ("--variant", "x=cdfl:cdfl.personalize_lr=0", "--out", "OUT", "--dry-run"),
     ("cdfl.personalize_lr", "> 0")),
    ("sim.rounds", ("--seeds", ","), ("python -m sim.rounds", "--seeds")),
    ("sim.rounds", ("--algorithms", "fedavg,fedsgd"), ("fedsgd", "catafed")),
    ("sim.rounds", ("--jobs", "-2"), ("--jobs", "0 for one per CPU core", "-2")),
    ("sim.rounds", ("--set", "catafed.resize=quarter"), ("catafed.resize", "quarter")),
    ("sim.rounds_sweep", ("--slow-shares", "0,x", "--out", "OUT"), ("--slow-shares", "'0,x'")),
    ("bench", ("nosuch",), ("python -m bench", "nosuch", "codecs")),
])
def test_python_m_entry_points_are_one_line_and_exit_2(module, argv, names, tmp_path) -> None:
    argv = tuple(str(tmp_path / "out") if a == "OUT" else a for a in argv)
    assert_one_line(run(*argv, module=module), 2, *names)


def test_experiment_without_its_dataset_is_one_line_and_exit_1(tmp_path) -> None:
    done = run("--dataset", "mnist", "--data-dir", str(tmp_path), "--dry-run", module="sim.rounds")
    assert_one_line(done, 1, "python -m sim.rounds", "mnist", "not found", str(tmp_path))


@pytest.mark.parametrize("module, argv, plan", [
    ("sim.ablation", ("--clusters", "2", "--seeds", "1", "--out", "OUT"), "scenario rotated-mnist"),
    ("fedmq.cli", ("sim", "run", "--clusters", "2", "--out", "OUT"), "scenario rotated-mnist"),
    ("sim.rounds", (), "on mnist ("),
    # a scenario made offline runs its fleet on the data there
    ("sim.ablation", ("--scenario", "rotated-digits", "--clusters", "2", "--seeds", "1", "--out", "OUT"),
     "scenario rotated-mnist"),
])
def test_data_dir_alone_runs_a_documented_command_on_the_data_there(module, argv, plan, tmp_path) -> None:
    """What acceptance does: a command as documented, plus --data-dir at an MNIST root."""
    from tests.test_data import write_mnist_like

    write_mnist_like(tmp_path / "data", "MNIST", n_train=1200, n_test=60)
    argv = tuple(str(tmp_path / "out") if a == "OUT" else a for a in argv)
    done = run(*argv, "--data-dir", str(tmp_path / "data"), "--dry-run", module=module)
    assert done.returncode == 0, done.stderr[-2000:]
    assert plan in done.stdout


@pytest.mark.parametrize("module, argv, names", [
    ("sim.ablation", ("--scenario", "rotated", "--set", "data.dataset=digits", "--out", "OUT"),
     ("'digits'", "offline", "holds mnist")),
    ("sim.rounds", ("--dataset", "synthetic"), ("'synthetic'", "offline", "holds mnist")),
    ("fedmq.cli", ("agent", "--id", "a1", "--dataset", "digits"), ("fedmq agent", "'digits'", "holds mnist")),
])
def test_an_offline_dataset_named_beside_data_dir_is_refused(module, argv, names, tmp_path) -> None:
    from tests.test_data import write_mnist_like

    write_mnist_like(tmp_path / "data", "MNIST", n_train=20, n_test=20)
    argv = tuple(str(tmp_path / "out") if a == "OUT" else a for a in argv)
    assert_one_line(run(*argv, "--data-dir", str(tmp_path / "data"), "--dry-run", module=module), 2, *names)


def test_seed_lists_parse_the_same_everywhere() -> None:
    assert seed_list("1,", 0) == [1]  # `python -m sim.ablation --seeds 1,` used to be int('')
    assert seed_list(" 2 , 3 ", 0) == [2, 3]
    assert seed_list("3", 5) == [5, 6, 7]
    assert int_list("0,1,2", "--seeds") == [0, 1, 2]


def test_dry_run_names_the_model_and_its_size() -> None:
    import json

    done = run("aggregator", "--dry-run", fresh=True)
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)["resolved"]
    assert resolved["model"] == "digits-cnn" and resolved["dataset"] == "digits"
    assert resolved["parameters"] > 1000


# --------------------------------------------------------------------------- runtime: exit 1

def test_unreachable_broker_fails_fast_with_one_line(tmp_path) -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
    for argv in (("agent", "--id", "a1", "--state-dir", str(tmp_path / "a1")),
                 ("aggregator", "--state-dir", str(tmp_path / "agg")),
                 ("fleet", "status")):
        # cold for the agent: what a device's first failed start prints
        assert_one_line(run(*argv, "--broker", url, fresh=argv[0] == "agent"), 1, "refused", url, "fedmq broker")


@pytest.fixture(scope="module")
def prod_broker(tmp_path_factory):
    if find_mosquitto() is None:
        pytest.skip("mosquitto not installed")
    creds = make_credentials(tmp_path_factory.mktemp("creds"), ["a1"], monitor_user="monitor")
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path_factory.mktemp("prod-broker")) as broker:
        yield broker, creds


@needs_mosquitto
def test_refused_credentials_are_one_line(prod_broker, tmp_path) -> None:
    broker, creds = prod_broker
    wrong = creds.agents["a1"] + "x"
    url = f"mqtts://a1:{wrong}@127.0.0.1:{broker.port}"
    for argv in (("fleet", "status"),
                 ("agent", "--id", "a1", "--fleet", "f1", "--state-dir", str(tmp_path / "a1"))):
        line = assert_one_line(run(*argv, "--broker", url, "--ca-file", str(creds.ca_cert)), 1,
                               "refused user 'a1'", "password")
        assert wrong not in line


def test_corrupt_agent_state_is_one_line_and_debug_shows_the_traceback(tmp_path) -> None:
    state = tmp_path / "a1"
    state.mkdir()
    (state / "agent_state.msgpack").write_bytes(b"\x93garbage that is not a state")
    (state / "agent_state.prev.msgpack").write_bytes(b"")
    argv = ("agent", "--id", "a1", "--state-dir", str(state), "--broker", f"mqtt://127.0.0.1:{free_port()}")
    assert_one_line(run(*argv), 1, "agent_state.msgpack", "Move")
    assert (state / "agent_state.msgpack").read_bytes() == b"\x93garbage that is not a state"  # left alone
    debug = run(*argv, "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "StateCorrupt" in debug.stderr


def test_corrupt_aggregator_state_is_one_line_and_kept(tmp_path, mosquitto) -> None:
    state = tmp_path / "agg"
    state.mkdir()
    (state / "snapshot-3.msgpack").write_bytes(b"\xc1 not a snapshot")
    # A broker that answers: the start gets as far as the state (an absent one is refused first).
    argv = ("aggregator", "--state-dir", str(state), "--broker", mosquitto.url)
    assert_one_line(run(*argv), 1, "snapshot-3.msgpack", str(state))
    assert (state / "snapshot-3.msgpack").read_bytes() == b"\xc1 not a snapshot"  # nothing overwritten


def test_snapshot_of_another_shape_and_a_damaged_journal_are_one_line_and_kept(tmp_path, mosquitto) -> None:
    """A snapshot with a valid checksum but another structure (another algorithm, K or model),
    and a journal with a flipped bit: each stops the start naming the file, changing nothing."""
    from aggregator.journal import JOURNAL_MAGIC, _frame, dumps, snapshot_bytes

    state = tmp_path / "agg"
    state.mkdir()
    (state / "snapshot-1.msgpack").write_bytes(snapshot_bytes({"strategy": {"not": "cdfl"}, "agents": {}}))
    argv = ("aggregator", "--state-dir", str(state), "--broker", mosquitto.url)  # gets as far as the state
    assert_one_line(run(*argv), 1, "snapshot-1.msgpack", "does not fit", "--clusters")

    journal = bytearray(JOURNAL_MAGIC + _frame(dumps({"op": "join", "agent": "a", "msg_id": "m"})) * 2)
    journal[-3] ^= 4  # one flipped bit in the second record
    (state / "journal-1.log").write_bytes(bytes(journal))
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.name != "lock"}  # lock: the pid
    assert_one_line(run(*argv), 1, "journal-1.log", "damaged at byte", "--accept-journal-loss")
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.name != "lock"} == before


def test_second_aggregator_on_one_state_dir_is_one_line(tmp_path) -> None:
    """Two aggregators on one state dir would interleave their journals: the second stops."""
    from fedmq.state_dir import StateDirLock

    state = tmp_path / "agg"
    state.mkdir()
    held = StateDirLock(state)  # as a running aggregator holds it
    try:
        argv = ("aggregator", "--state-dir", str(state), "--broker", f"mqtt://127.0.0.1:{free_port()}")
        assert_one_line(run(*argv), 1, str(state), "in use by another aggregator", str(os.getpid()))
    finally:
        held.release()


def test_unwritable_state_dir_is_one_line(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ("aggregator", "--state-dir", str(blocker / "agg"), "--broker", f"mqtt://127.0.0.1:{free_port()}",)
    assert_one_line(run(*argv), 1, str(blocker / "agg"), "--state-dir")
    # The agent too: it used to print two tracebacks and hang.
    argv = ("agent", "--id", "a1", "--state-dir", str(blocker / "a1"), "--broker", f"mqtt://127.0.0.1:{free_port()}")
    assert_one_line(run(*argv), 1, str(blocker / "a1"))


def test_agent_state_dir_that_is_a_file_is_one_line_at_start(tmp_path) -> None:
    """Said at start, not at the first save or at SIGTERM minutes later; the file is kept."""
    blocker = tmp_path / "state"
    blocker.write_text("keep")
    argv = ("agent", "--id", "a1", "--state-dir", str(blocker), "--broker", f"mqtt://127.0.0.1:{free_port()}")
    assert_one_line(run(*argv), 1, "fedmq agent", str(blocker), "not a directory", "--state-dir")
    assert blocker.read_text() == "keep"


def test_missing_dataset_files_are_one_line(tmp_path) -> None:
    argv = ("agent", "--id", "a1", "--dataset", "mnist", "--data-dir", str(tmp_path / "empty"),
            "--state-dir", str(tmp_path / "a1"), "--broker", f"mqtt://127.0.0.1:{free_port()}")
    assert_one_line(run(*argv), 1, "'mnist' not found", str(tmp_path / "empty"), "--download")


def test_report_or_merge_of_a_dir_without_results_is_one_line(tmp_path) -> None:
    assert_one_line(run("sim", "report", str(tmp_path)), 1, "fedmq sim report", str(tmp_path))
    assert_one_line(run("sim", "merge", str(tmp_path)), 1, "fedmq sim merge", str(tmp_path / "parts"))
