"""The ablation runner replays one fleet per variant: same data, schedule and start models."""

from __future__ import annotations

import json
import math
import re
import shlex
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.personalize import PERSONALIZATIONS
from fedmq.config import Config, load_config
from fedmq.data import clear_cache
from fedmq.host import describe_host
from sim.ablation import (
    DEFAULT_VARIANTS,
    AblationSpec,
    Fleet,
    Variant,
    main,
    paired_interval,
    queued_batches,
    run_ablation,
    run_variant,
    run_variant_wire,
    with_controls,
)
from tests.warm_python import client_argv

# Speed only: tiny agents and server sets so a replayed fleet takes seconds; the defaults
# run in test_documented_commands (the results commands, --dry-run) and test_data.
ROOT = Path(__file__).resolve().parent.parent
SMALL = {"data.min_samples": "60", "data.max_samples": "90", "data.proxy_per_cluster": "60",
         "data.pretrain_per_cluster": "120", "aggregator.pretrain_epochs": "3"}


MIXTURE = "mix=cdfl:cdfl.personalization=mixture"
"""The paper's reply, named: a bare `cdfl` follows the config default (finetune)."""


def small_config(**extra: str) -> Config:
    return load_config(None, {**SMALL, **extra})


def test_variant_parse():
    v = Variant.parse("cdfl-distill=cdfl:cdfl.personalization=distill, cdfl.beta0=0.25")
    assert v == Variant("cdfl-distill", "cdfl", (("cdfl.personalization", "distill"), ("cdfl.beta0", "0.25")))
    assert Variant.parse("local") == Variant("local", "local", ())
    cfg = v.config(Config())
    assert cfg.cdfl.personalization == "distill" and cfg.cdfl.beta0 == 0.25
    with pytest.raises(ValueError, match="method must be one of"):
        Variant.parse("x=fedavg")
    with pytest.raises(ValueError, match="is not key=value"):
        Variant.parse("x=cdfl:beta0")


def test_default_variants_are_todays_cdfl_the_upload_reply_and_the_paper():
    """A bare `cdfl` follows the config default; the others say what differs from it."""
    got = {v.name: v.config(Config()).cdfl for v in map(Variant.parse, DEFAULT_VARIANTS) if v.method == "cdfl"}
    assert got["cdfl"] == Config().cdfl
    assert got["cdfl"].personalize_start == "mixture" and got["cdfl"].update_rule == "delta"
    assert got["cdfl-upload"].personalize_start == "upload" and got["cdfl-upload"].update_rule == "alpha"
    assert got["cdfl-paper"].update_rule == "alpha"
    assert got["cdfl-paper"].personalization == "mixture" and got["cdfl-paper"].cluster_refresh_steps == 0
    assert all(p.personalization in PERSONALIZATIONS for p in got.values())


def test_every_variant_replays_the_same_fleet_and_a_rerun_is_identical():
    spec = AblationSpec(clusters=2, seed=3, agents=4, updates_per_agent=2, test_samples=40)
    fleet = Fleet(spec, small_config())
    variants = [Variant.parse("local"), Variant.parse(MIXTURE),
                Variant.parse("up=cdfl:cdfl.personalization=upload"), Variant.parse("fedsoft-async"),
                Variant.parse("local-ep1=local:agent.epochs=1")]
    results = {v.name: run_variant(fleet, v) for v in variants}
    # a variant's agent.* settings are its local training: one epoch is another model
    assert results["local-ep1"].acc_trained != results["local"].acc_trained
    # Local and CDFL-upload hold exactly what they trained, from the same start, data and seeds
    assert results["up"].acc_held == results["local"].acc_held
    assert results["up"].acc_trained == results["local"].acc_trained
    assert results["up"].acc_received == results["up"].acc_trained
    # the mixture reply is a different model from the same uploads
    assert results["mix"].acc_received != results["up"].acc_received
    assert results["mix"].models_down_per_update == 1 and results["fedsoft-async"].models_down_per_update == 2
    assert results["fedsoft-async"].bytes_down_per_update == 2 * results["mix"].bytes_down_per_update
    assert math.isnan(results["local"].kl) and results["mix"].kl >= 0
    again = run_variant(Fleet(spec, small_config()), Variant.parse(MIXTURE))
    assert again.acc_received == results["mix"].acc_received and again.kl == results["mix"].kl


def test_a_queue_batches_distinct_agents_in_schedule_order():
    schedule = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (3, 0), (0, 2)]
    assert queued_batches(schedule, 1) == [[e] for e in schedule]
    assert queued_batches(schedule, 3) == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (3, 0)], [(0, 2)]]
    with pytest.raises(ValueError, match="--queue"):
        queued_batches(schedule, 0)


def test_queued_uploads_share_replies_and_the_table_says_how_many(tmp_path, capsys):
    """--queue hands the strategy several uploads at once, as a loaded aggregator finds them:
    cdfl.reply_share then answers close alphas with one reply, and the table counts them."""
    base = ["--clusters", "2", "--seeds", "0,", "--agents", "6", "--updates-per-agent", "2",
            "--test-samples", "40", "--controls", "none", *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]]
    assert main([*base, "--queue", "4", "--variant", "own=cdfl", "--variant", "shared=cdfl:cdfl.reply_share=1",
                 "--out", str(tmp_path / "q")]) == 0
    runs = {r["variant"]: r for r in json.loads((tmp_path / "q" / "results.json").read_text())["runs"]}
    assert runs["own"]["replies_shared"] == 0 and runs["shared"]["replies_shared"] > 0.5
    assert runs["own"]["acc_trained"] != runs["shared"]["acc_trained"]  # later cycles train from other replies
    assert "uploads on a shared reply" in (tmp_path / "q" / "table.md").read_text()
    assert main([*base, "--queue", "2", "--wire", "--out", str(tmp_path / "w")]) == 2
    assert "--queue" in capsys.readouterr().err


def test_jobs_run_fleets_in_parallel_processes_with_the_serial_runs_figures(tmp_path, capsys, monkeypatch):
    small = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    argv = ["--clusters", "2,3", "--seeds", "1", "--agents", "4", "--updates-per-agent", "1",
            "--test-samples", "40", "--variant", "local=local", "--variant", MIXTURE, "--controls", "frozen", *small]
    assert main([*argv, "--out", str(tmp_path / "serial")]) == 0
    with monkeypatch.context() as m:  # the fleets run in spawned workers, never in this process
        m.setattr("sim.ablation.Fleet", lambda *a: pytest.fail("--jobs 2 built a fleet in the parent"))
        capsys.readouterr()
        assert main([*argv, "--jobs", "2", "--out", str(tmp_path / "jobs")]) == 0
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("K=")]
    assert len(progress) == 6  # a line per variant as it ends, from the workers
    figures = ("variant", "clusters", "seed", "acc_held", "acc_trained", "acc_received", "kl", "cluster_acc")
    serial, jobs = ([[r[k] for k in figures] for r in json.loads((tmp_path / d / "results.json").read_text())["runs"]]
                    for d in ("serial", "jobs"))
    assert len(serial) == 6 and jobs == serial  # same figures, in (K, seed, variant) order
    assert "--jobs 2" in json.loads((tmp_path / "jobs" / "results.json").read_text())["command"]
    assert main([*argv, "--jobs", "0", "--out", str(tmp_path / "plan"), "--dry-run"]) == 0
    assert "2 fleets at a time" in capsys.readouterr().out  # 0: one per core, at most one per fleet


def _proc_status(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie (gone)"


def test_sigterm_ends_the_jobs_workers_at_once_and_keeps_what_ended(tmp_path):
    """A SIGTERM (or Ctrl-C) mid-run ends the parent and its workers without waiting for the
    fleets in flight (on MNIST one takes an hour); the variants that ended stay in results.json
    for --resume. Each fleet here takes far longer than the deadline given to the exit."""
    small = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.ablation", "--clusters", "2,3", "--seeds", "1", "--agents", "4",
         "--updates-per-agent", "10", "--test-samples", "40", "--variant", "local=local:agent.epochs=1",
         "--variant", "slow=cdfl:cdfl.personalization=mixture,agent.epochs=40",  # ~40x the first variant
         "--controls", "none", "--jobs", "2", *small, "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # the first variant to end: both workers are mid-fleet now
            lines.append(line)
            if line.startswith("K="):
                break
        assert lines and lines[-1].startswith("K="), "".join(lines)
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) >= 2  # the workers (and the result queue's manager)
        proc.terminate()
        assert proc.wait(timeout=30) == 143
    finally:
        proc.kill()

    def alive() -> list[str]:
        return [k for k in kids if "zombie" not in _proc_status(k)]

    deadline = time.monotonic() + 30  # the resource tracker leaves when it sees the parent gone
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), alive()  # a worker left running would still be on its fleet
    kept = json.loads((out / "results.json").read_text())["runs"]
    assert 1 <= len(kept) < 4  # what ended before the signal, and not the fleets in flight


def test_resume_keeps_an_interrupted_runs_results_and_runs_only_the_rest(tmp_path, capsys):
    small = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    argv = ["--clusters", "2", "--seeds", "2", "--agents", "4", "--updates-per-agent", "1", "--test-samples", "40",
            "--variant", "local=local", "--variant", MIXTURE, "--controls", "none", *small]
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    # an interruption after the third variant leaves what progress wrote: the first three runs
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "results.json").write_text(json.dumps({**whole, "runs": whole["runs"][:3]}))
    capsys.readouterr()
    assert main([*argv, "--out", str(cut), "--resume", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "resuming: 3 runs kept" in out
    assert len([line for line in out.splitlines() if line.startswith("K=")]) == 1  # only the missing one ran
    figures = ("variant", "seed", "acc_held", "acc_trained", "acc_received", "kl", "cluster_acc")
    resumed = json.loads((cut / "results.json").read_text())
    assert [[r[k] for k in figures] for r in resumed["runs"]] == [[r[k] for k in figures] for r in whole["runs"]]
    # another command's results, or a damaged file, are refused by name and left as they were
    before = (cut / "results.json").read_bytes()
    assert main([*argv, "--updates-per-agent", "2", "--out", str(cut), "--resume"]) == 2
    assert "another command" in capsys.readouterr().err
    (cut / "results.json").write_bytes(before[:-40])
    assert main([*argv, "--out", str(cut), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(cut / "results.json") in err and "not a results file" in err
    assert (cut / "results.json").read_bytes() == before[:-40]


def test_wire_variant_hands_its_own_config_to_the_fleet_runner(monkeypatch):
    """--wire runs the variant's config (its cdfl.* and agent.* settings), not the base one."""
    import sim.fleet

    class Handed(Exception):
        pass

    def capture(spec, base=None, **kwargs):
        raise Handed(spec, base)

    monkeypatch.setattr(sim.fleet, "run_fleet", capture)
    spec = AblationSpec(clusters=2, seed=0, agents=2, updates_per_agent=1)
    variant = Variant.parse("v=cdfl:cdfl.personalization=mixture,agent.epochs=5")
    with pytest.raises(Handed) as handed:
        run_variant_wire(spec, variant, small_config())
    run_spec, cfg = handed.value.args
    assert cfg is not None and cfg.cdfl.personalization == "mixture" and cfg.agent.epochs == 5
    assert run_spec.local_epochs == 5


def test_extra_estimators_score_the_same_uploads():
    results = run_ablation([Variant.parse(MIXTURE)], clusters=[2], seeds=[0], base=small_config(),
                           agents=3, updates_per_agent=1, test_samples=30, estimators=["sketch", "evidence"])
    (r,) = results
    # the variant's own estimator is the default, sketch: scored on the same uploads (with the
    # same data sketches) it gives the same KL
    assert r.estimator_kl["sketch"] == pytest.approx(r.kl, abs=1e-9)
    assert r.estimator_kl["evidence"] >= 0


def write_idx(path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def test_the_same_command_runs_on_mnist_files_through_data_dir(tmp_path):
    """Small MNIST-format files written here; the CLI is the one the results page uses."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 1200), ("t10k", 300)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 60, size=(n, 28, 28), dtype=np.uint8)
        for i, lab in enumerate(labels):  # a learnable mark per class
            images[i, 4 + 2 * lab:6 + 2 * lab, 6:22] = 255
        write_idx(tmp_path / "data" / "MNIST" / "raw" / f"{split}-images-idx3-ubyte", images)
        write_idx(tmp_path / "data" / "MNIST" / "raw" / f"{split}-labels-idx1-ubyte", labels)
    clear_cache()
    out = tmp_path / "out"
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    rc = main(["--data-dir", str(tmp_path / "data"), "--clusters", "2",  # no --scenario: the files choose it
               "--seeds", "1", "--agents", "2", "--updates-per-agent", "1", "--test-samples", "30",
               "--variant", "local", "--variant", "cdfl-distill=cdfl:cdfl.personalization=distill",
               *sets, "--out", str(out)])
    clear_cache()
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in data["runs"]] == ["local", "cdfl-distill", "cdfl-distill/frozen",
                                                     "cdfl-distill/proxy-only"]
    assert "--data-dir" in data["command"]
    assert data["runs"][0]["bytes_down_per_update"] == 0  # Local; CDFL sends cnn28 (106 k floats), not digits-cnn
    assert data["runs"][1]["bytes_down_per_update"] > 4 * 100_000
    assert all(0.0 <= r["acc_trained"] <= 1.0 for r in data["runs"])
    assert "| 2 | cdfl-distill |" in (out / "table.md").read_text()


def test_digits28_files_stand_in_for_mnist_through_data_dir(tmp_path, capsys, warm_python):
    """scripts/digits28_files.py, as docs/results_cdfl.md#headline runs it (fewer images:
    test time), then that section's command planned on the files: rotated-mnist and cnn28."""
    script = client_argv(warm_python, "python", str(ROOT / "scripts" / "digits28_files.py"), str(tmp_path / "d28"),
                         "--train", "1500", "--test", "400")
    done = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "wrote 1500 train and 400 test images" in done.stdout, done.stderr
    images = (tmp_path / "d28" / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes()
    assert struct.unpack(">IIII", images[:16]) == (2051, 1500, 28, 28) and len(images) == 16 + 1500 * 784
    again = subprocess.run(script, capture_output=True, text=True, timeout=300)  # never overwrites
    assert again.returncode == 2 and "already holds IDX files" in again.stderr
    clear_cache()
    assert main(["--data-dir", str(tmp_path / "d28"), "--clusters", "2,4", "--seeds", "1", "--agents", "20",
                 "--updates-per-agent", "15", "--set", "data.proxy_per_cluster=100",
                 "--set", "data.pretrain_per_cluster=200", "--variant", "cdfl=cdfl", "--variant", "local=local",
                 "--variant", "fedsoft-async=fedsoft-async", "--jobs", "0", "--out", str(tmp_path / "o"),
                 "--dry-run"]) == 0
    assert "scenario rotated-mnist" in capsys.readouterr().out
    clear_cache()
    kl = subprocess.run(client_argv(warm_python, "python", str(ROOT / "scripts" / "sketch_kl.py"), "--data-dir",
                                    str(tmp_path / "d28"), "--clusters", "2,4,6", "--seeds", "0,1,2", "--dry-run"),
                        capture_output=True, text=True, timeout=300)  # the results page's sketch_kl command on the same files
    assert kl.returncode == 0 and kl.stdout.startswith("rotated-mnist, K 2, 4, 6"), kl.stderr
    # docs/results_realsize.md#shared-replies: its blocks' commands, planned on the same files
    section = re.search(r"## Shared replies\n(.*?)\n## ", (ROOT / "docs" / "results_realsize.md").read_text(),
                        re.S).group(1).replace("/tmp/rs/digits28", str(tmp_path / "d28"))
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        if "python -m sim.ablation" in block:
            common = shlex.split(re.search(r'^C="(.*)"$', block, re.M).group(1))
            commands += [(common, shlex.split(line)[4:]) for line in block.splitlines()
                         if line.startswith("OMP_NUM_THREADS=1 python -m sim.ablation")]
    assert len(commands) == 9
    for common, argv in commands:
        assert argv[0] == "$C"
        argv = [*common, *argv[1:-1], str(tmp_path / "shared"), "--dry-run"]
        capsys.readouterr()
        clear_cache()
        assert main(argv) == 0, argv
        queue = int(argv[argv.index("--queue") + 1])
        assert ("16 uploads at a time" in capsys.readouterr().out) == (queue == 16)


def test_merge_builds_one_table_from_separate_runs_and_counts_a_run_once(tmp_path, capsys):
    """A seed run later by its own command joins the table; the table names both commands."""
    for seed in (0, 1):
        rc = main(["--clusters", "2", "--seeds", "1", "--seed", str(seed), "--agents", "2",
                   "--updates-per-agent", "1", "--test-samples", "30", "--variant", MIXTURE,
                   "--controls", "none",  # one row per run keeps this test about merging
                   *[x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")], "--out", str(tmp_path / f"s{seed}")])
        assert rc == 0
    rc = main(["--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "s1"), "--out", str(tmp_path / "both")])
    assert rc == 0
    data = json.loads((tmp_path / "both" / "results.json").read_text())
    assert sorted(r["seed"] for r in data["runs"]) == [0, 1]
    (row,) = data["summary"]
    assert row["seeds"] == 2
    accs = [r["acc_received"] for r in data["runs"]]
    assert row["acc_received"] == pytest.approx(np.mean(accs))
    assert len(data["sources"]) == 2 and all("--seed" in c for c in data["sources"])
    # each run says where it ran (float rounding differs between CPUs); one machine made both
    s0 = json.loads((tmp_path / "s0" / "results.json").read_text())
    assert s0["hosts"] == [describe_host()] and s0["hosts"][0]["cpu_model"]
    assert data["hosts"] == s0["hosts"]
    table = (tmp_path / "both" / "table.md").read_text()
    assert table.count("from `python -m sim.ablation") == 2 and "--merge" in table
    assert f"{row['acc_received']:.3f} ± " in table
    assert "machines" not in table and "note" not in data
    # the same seed twice would count one run as two seeds
    assert main(["--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "s0"),
                 "--out", str(tmp_path / "twice")]) == 2
    assert "given twice" in capsys.readouterr().err and not (tmp_path / "twice").exists()
    # one run recorded in two places (e.g. beside two controls) is kept once; differing copies are refused
    s0 = json.loads((tmp_path / "s0" / "results.json").read_text())
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "results.json").write_text(json.dumps({**s0, "runs": [
        {**r, "aggregator_s_per_upload": 9.0} for r in s0["runs"]]}))  # another timing, the same run
    assert main(["--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "copy"), "--merge", str(tmp_path / "s1"),
                 "--out", str(tmp_path / "dedup")]) == 0
    assert json.loads((tmp_path / "dedup" / "results.json").read_text())["summary"][0]["seeds"] == 2
    (tmp_path / "copy" / "results.json").write_text(json.dumps({**s0, "runs": [
        {**r, "acc_received": r["acc_received"] + 0.01} for r in s0["runs"]]}))
    assert main(["--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "copy"), "--out", str(tmp_path / "no")]) == 2
    assert "different figures" in capsys.readouterr().err and not (tmp_path / "no").exists()
    # a run from another machine (or one that records none) merges with a note and a warning
    s1 = json.loads((tmp_path / "s1" / "results.json").read_text())
    s1["hosts"][0].update(cpu_model="Other CPU", torch_threads=7)
    (tmp_path / "s1" / "results.json").write_text(json.dumps(s1))
    rc = main(["--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "s1"), "--out", str(tmp_path / "mixed")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: Runs from 2 machines" in err and "Other CPU" in err and "7 threads" in err
    assert "compare a variant only with a control from the same machine" in (tmp_path / "mixed" / "table.md").read_text()
    del s1["hosts"]
    (tmp_path / "s1" / "results.json").write_text(json.dumps(s1))
    assert main(["--merge", str(tmp_path / "s0"), "--merge", str(tmp_path / "s1"), "--out", str(tmp_path / "old")]) == 0
    assert "a source that records no machine" in capsys.readouterr().err
    assert main(["--report", "--out", str(tmp_path / "old")]) == 0  # --report keeps the note
    assert "records no machine" in (tmp_path / "old" / "table.md").read_text()


def test_table_says_how_many_seeds_a_row_has_when_they_differ():
    from sim.ablation import VariantResult, markdown_table, summarize

    def run(variant: str, seed: int, acc: float) -> VariantResult:
        return VariantResult(variant, "cdfl", 2, seed, 10, acc, acc, acc, 0.1, 0.9, 1, 4, 0.1, 0.01)

    even = markdown_table(summarize([run("a", 0, 0.5), run("a", 1, 0.7)]))
    assert "seeds" not in even and "| 2 | a | 0.600 ± 0.100 |" in even
    uneven = markdown_table(summarize([run("a", 0, 0.5), run("b", 0, 0.8), run("a", 1, 0.7)]))
    assert "| K | variant | seeds |" in uneven
    assert "| 2 | a | 2 | 0.600 ± 0.100 |" in uneven and "| 2 | b | 1 | 0.800 |" in uneven


def test_every_cdfl_variant_gets_its_frozen_and_proxy_only_controls():
    got = with_controls([Variant.parse("local"), Variant.parse("b=cdfl:cdfl.personalize_start=blend")],
                        ["frozen", "proxy-only"])
    assert [v.name for v in got] == ["local", "b", "b/frozen", "b/proxy-only"]
    assert got[2].settings == (("cdfl.personalize_start", "blend"), ("cdfl.beta0", "0"), ("cdfl.server_lr", "0"))
    assert got[3].settings == (("cdfl.personalize_start", "blend"), ("cdfl.reply_uses_upload", "false"))
    assert main(["--controls", "thawed", "--out", "unused", "--dry-run"]) == 2


def test_gains_are_paired_over_seeds_with_a_t_interval():
    from sim.ablation import VariantResult, markdown_table, summarize

    def run(variant: str, seed: int, received: float, cluster: float) -> VariantResult:
        return VariantResult(variant, "cdfl", 4, seed, 10, 0.5, 0.5, received, 0.1, cluster, 1, 4, 0.1, 0.01)

    runs = [run("v", 0, 0.90, 0.95), run("v", 1, 0.80, 0.93), run("v", 2, 0.85, 0.94),
            run("v/frozen", 0, 0.86, 0.90), run("v/frozen", 1, 0.77, 0.90), run("v/frozen", 2, 0.80, 0.90),
            run("v/proxy-only", 0, 0.70, 0.95), run("v/proxy-only", 1, 0.70, 0.93), run("v/proxy-only", 2, 0.70, 0.94)]
    (row, *_) = summarize(runs)
    # paired: 0.04, 0.03, 0.05 -> mean 0.04, sd 0.01, t(0.975, 2 dof) 4.302653 / sqrt(3)
    assert row["fed_gain_received"] == pytest.approx(0.04)
    assert row["fed_gain_received_ci"] == pytest.approx(4.302653 * 0.01 / np.sqrt(3))
    assert row["fed_gain_cluster"] == pytest.approx(0.04)
    assert row["client_gain_received"] == pytest.approx(0.15)
    assert row["client_gain_cluster"] == pytest.approx(0.0)
    table = markdown_table(summarize(runs))
    assert "fed gain received (pp)" in table and "| +4.0 ± 2.5 |" in table
    assert paired_interval([0.02]) == (0.02, 0.0)


def test_targets_table_judges_each_target_per_k_against_the_same_fleets_baselines(tmp_path):
    from sim.ablation import VariantResult, rewrite_results, summarize, targets_table, write_results

    def run(variant: str, method: str, k: int, seed: int, trained: float, received: float, kl: float,
            cluster: float) -> VariantResult:
        return VariantResult(variant, method, k, seed, 10, 0.5, trained, received, kl, cluster, 1, 4, 0.1, 0.25)

    runs = []
    for seed, d in ((0, 0.0), (1, 0.01)):  # seed 1: every accuracy 1 pp up, so the gaps pair exactly
        for k, fed in ((2, 0.01), (4, 0.04)):
            runs += [run("cdfl", "cdfl", k, seed, 0.90 + d, 0.95 + d, 0.02, 0.93 + d),
                     run("cdfl/frozen", "cdfl", k, seed, 0.90 + d, 0.95 - fed + d, 0.02, 0.92 + d),
                     run("local", "local", k, seed, 0.89 + d, 0.89 + d if k == 4 else 0.93 + d, math.nan, math.nan),
                     run("fedsoft-async", "fedsoft-async", k, seed, 0.88 + d, 0.90 + d, 0.06, 0.94 + d)]
    rows = summarize(runs)
    text = targets_table(rows)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "Targets for `cdfl`" in text and "cdfl/frozen`" not in text and "local`" not in text
    assert lines["received >= Local + 3 pp"].endswith("| +2.0 ± 0.0 **missed** | +6.0 ± 0.0 met | **missed** at K = 2 |")
    assert "+1.0 ± 0.0 met | +4.0 ± 0.0 met | met |" in lines["federation gain, received: > 0, >= +3 pp at K >= 4"]
    assert "-1.0 ± 0.0 **missed**" in lines["cluster >= FedSoft-Async"]  # 0.93 against 0.94
    assert "0.020 vs 0.060 met" in lines["KL < FedSoft-Async's argmin"]
    assert lines["reply cost per upload (s)"] == "| reply cost per upload (s) | 0.25 | 0.25 | - |"
    assert targets_table(summarize([r for r in runs if r.method != "fedsoft-async"])) == ""  # no baseline: no verdict
    write_results(runs, tmp_path)
    assert "Targets for `cdfl`" in (tmp_path / "table.md").read_text()
    assert "Targets for `cdfl`" in rewrite_results(tmp_path)  # --report rebuilds it from results.json


def test_central_pools_every_cycle_and_rows_compare_with_local_by_seed(tmp_path, capsys):
    """The pooled-data ceiling sees every cycle's training set: more data than any agent, so on
    the same fleet it scores above Local; every row then gets its paired gap to Local."""
    from sim.ablation import VariantResult, markdown_table, summarize

    spec = AblationSpec(clusters=2, seed=1, agents=4, updates_per_agent=2, test_samples=40)
    fleet = Fleet(spec, small_config())
    central = run_variant(fleet, Variant.parse("central"))
    local = run_variant(fleet, Variant.parse("local"))
    assert central.method == "central" and central.acc_received == central.acc_trained
    assert central.acc_received > local.acc_received and 0.0 < central.cluster_acc <= 1.0
    assert math.isnan(central.kl) and central.models_down_per_update == 0
    # one model per cluster, every sample to its own cluster's: another ceiling, same pooled data
    routed = run_variant(fleet, Variant.parse("central-clusters"))
    assert routed.method == "central-clusters" and 0.0 < routed.acc_received <= 1.0
    assert (routed.acc_received, routed.cluster_acc) != (central.acc_received, central.cluster_acc)
    # one model per cycle's mixture, trained as `central` on the pool resampled by that mixture
    personal = run_variant(fleet, Variant.parse("central-personal"))
    assert personal.method == "central-personal" and 0.0 < personal.acc_received <= 1.0
    assert personal.acc_received != central.acc_received and math.isnan(personal.kl)
    scratch = run_variant(fleet, Variant.parse("central-personal-scratch"))  # the same, from Local's start
    assert scratch.method == "central-personal-scratch" and scratch.acc_received != personal.acc_received

    def run(variant: str, method: str, seed: int, received: float) -> VariantResult:
        return VariantResult(variant, method, 2, seed, 10, 0.5, 0.5, received, 0.1, 0.9, 1, 4, 0.1, 0.01)

    runs = [run("local", "local", 0, 0.90), run("local", "local", 1, 0.80),
            run("cdfl", "cdfl", 0, 0.93), run("cdfl", "cdfl", 1, 0.81)]
    rows = {r["variant"]: r for r in summarize(runs)}
    assert "local_gain_received" not in rows["local"]
    assert rows["cdfl"]["local_gain_received"] == pytest.approx(0.02)  # paired: 0.03, 0.01
    assert "received - Local (pp)" in markdown_table(list(rows.values()))
    # Not a fleet: refused over the wire, in one line, before anything runs.
    assert main(["--variant", "central", "--wire", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "central" in err and "--wire" in err and not (tmp_path / "o").exists()


def test_resample_by_mixture_gives_each_cluster_its_alpha_share_whatever_the_pool():
    """central-personal's draw: a pool 90 % cluster 0 resampled for alpha (0.2, 0.8) is ~80 %
    cluster 1; a cluster absent from alpha is never drawn."""
    from sim.ablation import resample_by_mixture

    owner = torch.cat([torch.zeros(9000, dtype=torch.long), torch.ones(1000, dtype=torch.long)])
    pick = resample_by_mixture(owner, [0.2, 0.8], torch.Generator().manual_seed(0))
    assert len(pick) == len(owner)
    assert float(owner[pick].double().mean()) == pytest.approx(0.8, abs=0.02)
    assert int(owner[resample_by_mixture(owner, [1.0, 0.0], torch.Generator().manual_seed(1))].sum()) == 0


def test_reply_step_stats_measures_each_agents_step_against_its_replys_fit(tmp_path, warm_python):
    """scripts/reply_step_stats.py, as docs/results_cdfl.md#the-reply runs it: every upload after an agent's first
    starts from the reply that agent was sent, so each is measured; a trained reply has a fit."""
    out = tmp_path / "out"
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    proc = subprocess.run(
        client_argv(warm_python, "python", str(ROOT / "scripts" / "reply_step_stats.py"), "--clusters", "2",
                    "--seeds", "1", "--agents", "3", "--updates-per-agent", "2", "--test-samples", "30",
                    "--controls", "none", "--variant", "cdfl", *sets, "--out", str(out)),
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads((out / "step_stats.json").read_text())
    assert stats["uploads"] >= 3  # of ~6 uploads, those from a trained reply (not the first after a join)
    assert stats["fit_norm"]["mean"] > 0 and stats["step_norm"]["mean"] > 0
    assert -1.0 <= stats["cosine"]["mean"] <= 1.0
    assert "step-stats" in proc.stdout


def test_sketch_kl_replays_a_fleets_draws_for_each_shrinkage(warm_python):
    """scripts/sketch_kl.py: one JSON line per (K, seed), a KL per shrinkage; the whitened fit
    beats the plain one over this fleet's 24 draws (the results page measured it over 300)."""
    done = subprocess.run(client_argv(warm_python, "python", str(ROOT / "scripts" / "sketch_kl.py"), "--clusters", "4",
                                      "--seeds", "1", "--agents", "8", "--updates-per-agent", "3"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert (line["K"], line["seed"]) == (4, 0) and set(line["kl"]) == {"1", "0.25", "uniform"}
    assert line["kl"]["0.25"] < line["kl"]["1"], line
    assert line["kl"]["0.25"] < line["kl"]["uniform"] / 10, line  # rotated digits: the sketch informs


def test_wire_run_counts_refused_uploads_and_finishes(mosquitto, tmp_path):
    """--wire: uploads the aggregator refuses end no run; results.json and table.md count them."""
    small = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    out = tmp_path / "wire"
    # A descent test with no margin: the aggregator refuses every honest upload that raises its
    # best proxy loss at all, and applies the rest.
    argv = ["--clusters", "2", "--seeds", "1,", "--agents", "4", "--updates-per-agent", "2",
            "--test-samples", "40", "--variant", "strict=cdfl:aggregator.loss_margin=1e-9",
            "--controls", "none", "--wire", "--broker", mosquitto.url, "--out", str(out), *small]
    assert main(argv) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert set(run["refused"]) == {"loss_outlier"} and 0 < run["refused"]["loss_outlier"] < run["updates"]
    table = (out / "table.md").read_text()
    assert "refused (all seeds)" in table and f"loss_outlier {run['refused']['loss_outlier']}" in table


def test_sketch_kl_shows_the_shapes_clusters_alike_at_a_quarter_turn(warm_python):
    """docs/results_realsize.md's finding, by its own script: on `shapes` the sketch pins the
    mixture at K = 3 but does no better than the uniform guess at K = 4 (most shapes look the
    same after a quarter turn). If the stand-in gains an orientation, this fails and the page's
    paragraph must be redone."""
    run = subprocess.run(client_argv(warm_python, "python", str(ROOT / "scripts" / "sketch_kl.py"), "--scenario",
                                     "realsize-shapes", "--clusters", "3,4", "--agents", "8", "--updates-per-agent", "2",
                                     "--shrinkage", "0.25"),
                         capture_output=True, text=True, timeout=600)  # fewer draws than the page: seconds
    assert run.returncode == 0, run.stderr
    rows = {r["K"]: r["kl"] for r in map(json.loads, run.stdout.splitlines()[1:])}
    assert rows[3]["0.25"] < rows[3]["uniform"] / 20
    assert rows[4]["0.25"] > rows[4]["uniform"] * 0.8


def test_the_lighting_script_refuses_an_unknown_light_before_any_work(warm_python):
    run = subprocess.run(client_argv(warm_python, "python", str(ROOT / "scripts" / "shapes_lighting.py"),
                                     "--variants", "+0.2,sunset"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "'sunset' is not none, xF" in run.stderr and not run.stdout.strip()


def test_shapes_lit_from_above_lets_the_sketch_see_a_quarter_turn(warm_python):
    """shapes-lit: the same images and labels as shapes, lit from above, so the sketch pins the
    mixture at K = 4 where on shapes it cannot (docs/results_realsize.md)."""
    from fedmq.data import load_dataset

    plain, lit = load_dataset("shapes"), load_dataset("shapes-lit")
    assert torch.equal(plain.y, lit.y) and lit.x.shape == plain.x.shape and not torch.equal(plain.x, lit.x)
    rows = lit.x.mean(dim=(0, 1, 3))  # brighter at the top than at the bottom, as lit
    assert rows[:4].mean() > rows[-4:].mean() + 0.5
    run = subprocess.run(client_argv(warm_python, "python", str(ROOT / "scripts" / "sketch_kl.py"), "--scenario",
                                     "realsize", "--set", "data.dataset=shapes-lit", "--clusters", "4", "--agents", "8",
                                     "--updates-per-agent", "2", "--shrinkage", "0.25"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    kl = json.loads(run.stdout.splitlines()[-1])["kl"]
    assert kl["0.25"] < kl["uniform"] / 10, kl
