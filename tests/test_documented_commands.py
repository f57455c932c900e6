"""Every command line the docs tell a user to run, run as written.

Sources: the ```sh blocks of README.md and docs/*.md, and the example lines of every verb's
`--help`. A block that sets shell variables or loops is one script; otherwise each line
(continuations joined) is one command. Each is matched to one way of checking it (RULES,
first match wins):

- run: executed to completion in a scratch copy of the checkout, exit status 0; with
  `broker` it runs in a private network namespace where `fedmq broker` (as documented)
  serves 127.0.0.1:1883, the address the docs use, without touching the host's port.
- serve: a long-running process (broker, aggregator, agent, fleet watch), started in such a
  namespace, run until a line it prints proves it works, then stopped with SIGTERM: it must
  exit 0. A block that starts an aggregator and agents is a fleet: its lines run together
  until the fleet proves it works (an update cycle, a round).
- plan: experiments that take minutes to hours here, executed as written with `fedmq` and
  `python` on PATH adding `--dry-run`: the scenario, the dataset (through --data-dir), every
  variant and config key resolve, the plan is printed, and the scratch checkout (one per
  worker, shared by the plans) is left as it was.
- elsewhere: checked by the named test, or not runnable on a test machine (why is given).

A documented command that no rule matches fails `test_every_documented_command_has_a_rule`:
a new command in the docs must say here how it is checked. Only the placeholders in
PLACEHOLDERS are substituted (a path the docs leave to the reader), nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.cli_process import BIN, ROOT, CliProcess, cli_env
from tests.warm_python import client_argv

DOC_FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
HELP_VERBS = [("broker",), ("creds",), ("aggregator",), ("agent",), ("worker",), ("fleet", "status"), ("demo",),
              ("sim", "run"), ("sim", "report"), ("sim", "aggregator"), ("sim", "agents"), ("sim", "merge")]


@dataclass(frozen=True)
class Rule:
    pattern: str
    mode: str  # run | serve | plan | elsewhere
    why: str = ""
    proof: str = ""
    """serve: a regex one output line must match; run: one the output must contain."""
    broker: bool = False
    """Run inside a network namespace with the documented broker on 127.0.0.1:1883."""
    needs: tuple[str, ...] = ()
    """Fixtures the command reads: creds (fedmq creds output in deploy/creds), mnist, samples,
    backbone (mnv3-shapes.pt, a MobileNetV3-small state dict)."""
    timeout: float = 600.0


RULES: list[Rule] = [
    Rule(r"^make test\b", "elsewhere", "CI's own command (.ci/run), which runs this test"),
    Rule(r"^make demo\b", "elsewhere", "`make venv` (which `make test` runs first) then `fedmq demo`, run here"),
    Rule(r"^docker compose\b", "elsewhere", "no Docker engine on a test machine: tests/test_compose.py "
         "checks the compose files and runs their command lines against Mosquitto"),
    Rule(r"^curl -s 127\.0\.0\.1:9100/metrics", "elsewhere",
         "tests/test_compose.py scrapes the compose aggregator's metrics endpoint"),
    Rule(r"^export FEDMQ_(AGGREGATOR|BROKER)_PASSWORD", "elsewhere",
         "the secure compose stack's set-up: tests/test_compose.py runs it with these credentials"),
    Rule(r"^(sudo |journalctl )", "elsewhere", "administration of a device (users, systemd, ACLs); "
         "tests/test_compose.py checks the unit files' commands and tests/test_security.py the credentials"),
    Rule(r"^(python3? -m venv|pip install)", "elsewhere", "what `make venv` runs before every test run"),
    Rule(r"^fedmq sim (merge|report) runs-split", "elsewhere",
         "tests/test_sim_multiprocess.py splits a small run the same way, then merges and reports it"),
    Rule(r"^fedmq fleet status --broker mqtts://monitor@127", "elsewhere",
         "the secure compose stack's monitor: tests/test_compose.py runs it with real credentials"),
    Rule(r"^fedmq fleet status --broker mqtts://monitor:PASSWORD@broker\.example", "elsewhere",
         "a TLS broker at a placeholder host: tests/test_compose.py runs the secure stack's monitor "
         "with real credentials"),
    # Quick commands, to completion.
    Rule(r"^(\.venv/bin/)?fedmq --help$", "run", proof="usage: fedmq"),
    Rule(r"^fedmq sim ablation --help", "run", proof="usage:"),
    Rule(r"^fedmq broker --dry-run", "run", proof="mosquitto"),
    Rule(r"^fedmq privacy plan ", "run", proof="noise multiplier"),
    Rule(r"^fedmq (agent|aggregator) .*backbone=mnv3-shapes\.pt.*--dry-run$", "run", proof='"parameters": 601098',
         needs=("backbone",)),
    Rule(r"^fedmq (agent|aggregator) .*--ca-file deploy/creds/.*--dry-run$", "run", proof='"resolved"',
         needs=("creds",)),
    Rule(r"^fedmq (agent|aggregator) .*--dry-run$", "run", proof='"resolved"'),
    Rule(r"^fedmq creds ", "run", proof=""),
    Rule(r"^fedmq sim report ", "run", proof="report:", timeout=900),
    Rule(r"^fedmq demo$", "run", proof="Table 1", timeout=900),
    Rule(r"^fedmq sim run .*--out out/$", "elsewhere", "run first, as written, by the `fedmq sim report out/` "
         "test, which reads its output (exit 0 and no traceback checked there)"),
    Rule(r"^fedmq sim rounds --seeds 3 --until 300 --out out-rounds/", "run", proof="wrote", timeout=900),
    Rule(r"^fedmq fleet status --broker mqtt://127\.0\.0\.1:1883 --fleet garage$", "run",
         proof="fleet garage:", broker=True),
    Rule(r"^fedmq fleet status --fleet garage --json$", "run", proof='"fleet": "garage"', broker=True),
    Rule(r"(^|\n)python scripts/digits28_files\.py ", "elsewhere",
         "tests/test_ablation.py writes smaller files with the script (test time) and plans the block's "
         "sim.ablation and sketch_kl commands on them"),
    # Experiments: minutes to hours on this machine's CPU.
    Rule(r"(^|\n)(OMP_NUM_THREADS=1 )?(\.venv/bin/)?python (-m sim\.(ablation|attacks|rounds|rounds_sweep|rounds_live)"
         r"|scripts/(reply_step_stats|sketch_kl|batch_tail)\.py) ", "plan", "an experiment of minutes to hours"),
    Rule(r"(^|\n)fedmq sim (run|aggregator|agents) ", "plan", "an experiment of minutes to hours"),
    # Long-running processes.
    Rule(r"^fedmq broker --config broker_config/prod\.conf", "serve", proof=r"^url: mqtts://",
         needs=("creds",)),
    Rule(r"^fedmq broker\b", "serve", proof=r"^url: mqtt://"),
    Rule(r"^fedmq aggregator .*--algorithm (catafed|fedavg|fedprox)", "serve",
         proof=r"^aggregator \S+ \(rounds\) on", broker=True),
    Rule(r"^fedmq aggregator .*--dataset mnist", "serve", proof=r"^aggregator \S+ on", broker=True,
         needs=("mnist",)),
    Rule(r"^fedmq aggregator ", "serve", proof=r"^aggregator \S+ on", broker=True),
    Rule(r"^fedmq worker ", "serve", proof=r"^worker \S+ on", broker=True),
    Rule(r"^fedmq agent .*--source-dir /var/lib/cam/samples", "serve", proof=r"^agent \S+ ", broker=True,
         needs=("samples",)),
    Rule(r"^fedmq agent ", "serve", proof=r"^agent \S+ ", broker=True),
    Rule(r"^fedmq fleet status .*--watch", "serve", proof=r"^fleet \S+: ", broker=True),
    Rule(r"^fedmq fleet status ", "run", proof="fleet ", broker=True),
]

PLACEHOLDERS = {
    "~/data": "{mnist}",  # the reader's dataset root: a small MNIST the test writes
    "/var/lib/cam/samples": "{samples}",  # the reader's camera folder: PNGs the test writes
}


@dataclass(frozen=True)
class Command:
    source: str
    text: str
    block: tuple[str, ...] = ()
    """The other lines of its ```sh block (a fleet block is run together)."""

    @property
    def rule(self) -> Rule | None:
        return next((r for r in RULES if re.search(r.pattern, self.text)), None)

    def __str__(self) -> str:
        return f"{self.source}: {self.text}"


def _logical_lines(block: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        lines.append(re.sub(r"\s+", " ", (pending + line.strip())).strip())
        pending = ""
    return [_strip_comment(line) for line in lines]


def _strip_comment(line: str) -> str:
    """`cmd  # note` -> `cmd`; a # inside quotes or inside a word stays."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and line[i - 1].isspace():
            return line[:i].rstrip()
    return line


def doc_commands() -> list[Command]:
    out: list[Command] = []
    for name in DOC_FILES:
        text = (ROOT / name).read_text()
        for block in re.findall(r"```sh\n(.*?)```", text, re.S):
            lines = _logical_lines(block)
            if any(re.match(r"^[A-Z_]+=", line) or line.startswith("for ") for line in lines):
                out.append(Command(name, "\n".join(lines)))
            else:
                out.extend(Command(name, line, tuple(lines)) for line in lines)
    return out


def is_fleet_block(block: tuple[str, ...]) -> bool:
    """A block that starts an aggregator and its agents: the docs mean them to run together
    (a dry run starts nothing)."""
    starts = [line for line in block if not line.endswith("--dry-run")]
    return (any(line.startswith("fedmq aggregator ") for line in starts)
            and any(line.startswith("fedmq agent ") for line in starts))


def help_commands() -> list[Command]:
    from fedmq.cli import build_parser

    parser = build_parser()
    out: list[Command] = []
    for verb in HELP_VERBS:
        sub = parser
        for word in verb:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
        lines = _logical_lines("\n".join(line.strip() for line in sub.format_help().splitlines()
                                         if line.strip().startswith("fedmq ") or line.startswith("  ")))
        out.extend(Command(f"fedmq {' '.join(verb)} --help", line) for line in lines
                   if line.startswith("fedmq "))
    return out


ALL = doc_commands() + help_commands()


def _preceding(command: Command) -> list[str]:
    """Documented commands of the same source that produce what this one reads (run first)."""
    if command.text == "fedmq sim report out/":
        return [c.text for c in ALL if c.source == command.source and c.text.startswith("fedmq sim run ")
                and "--out out/" in c.text]
    if "--rotate" in command.text:
        return [c.text for c in ALL if c.source == command.source and c.text.startswith("fedmq creds ")
                and "--rotate" not in c.text]
    return []


FLEET_BLOCKS = sorted({c.block for c in ALL if is_fleet_block(c.block)})
IN_FLEETS = {line for block in FLEET_BLOCKS for line in block}
"""Run by test_fleet_blocks_as_written, all lines of a block together; not served one by one."""


def _by_mode(mode: str) -> list[Command]:
    seen: set[str] = set(IN_FLEETS) if mode == "serve" else set()
    if mode == "run":  # a command another one reads the output of runs in that one's test
        seen |= {step for c in ALL for step in _preceding(c)}
    picked = []
    for c in ALL:
        if c.rule is not None and c.rule.mode == mode and c.text not in seen:
            seen.add(c.text)
            picked.append(c)
    return picked


def summary() -> str:
    counts = Counter("fleet" if c.text in IN_FLEETS else c.rule.mode if c.rule else "no rule" for c in ALL)
    unique = {mode: len(_by_mode(mode)) for mode in ("run", "serve", "plan")}
    return (f"documented commands: {len(ALL)} found in {len(DOC_FILES)} docs and {len(HELP_VERBS)} --help "
            f"texts; run {counts['run']} ({unique['run']} distinct), run together as {len(FLEET_BLOCKS)} "
            f"fleets {counts['fleet']}, served {counts['serve']} "
            f"({unique['serve']} distinct), planned with --dry-run {counts['plan']} ({unique['plan']} "
            f"distinct), checked elsewhere {counts['elsewhere']}, without a rule {counts['no rule']}")


# --------------------------------------------------------------------------- environment


def scratch_checkout(dest: Path) -> Path:
    """The tracked files of this checkout (as a fresh clone has them) and its venv."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(BIN.parent)
    return dest


def write_needs(needs: tuple[str, ...], cwd: Path, env: dict[str, str]) -> dict[str, str]:
    values: dict[str, str] = {}
    if "creds" in needs:
        subprocess.run([str(BIN / "fedmq"), "creds", "--out", "deploy/creds", "--agents", "car-1,car-2"],
                       cwd=cwd, env=env, check=True, capture_output=True, timeout=300)
    if "mnist" in needs:
        from tests.test_data import write_mnist_like

        write_mnist_like(cwd / "mnist-data", "MNIST", n_train=600, n_test=100)
        values["mnist"] = str(cwd / "mnist-data")
    if "samples" in needs:
        values["samples"] = str(write_digit_pngs(cwd / "samples", 40))
    if "backbone" in needs:  # the reader's trained network: here MobileNetV3-small's random init, saved
        import torch
        from torchvision.models import mobilenet_v3_small

        torch.save(mobilenet_v3_small(num_classes=10).state_dict(), cwd / "mnv3-shapes.pt")
    return values


def write_digit_pngs(root: Path, n: int) -> Path:
    """`<root>/<label>/<name>.png`: n of scikit-learn's digits as 8-bit grayscale PNGs."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in range(n):
        folder = root / str(int(digits.target[i]))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[i] * (255.0 / 16.0)).round().astype("uint8")
        Image.fromarray(pixels, mode="L").save(folder / f"img-{i:04d}.png")
    return root


def aggregator_for(agent_command: str) -> str | None:
    """The aggregator an agent example needs to join: its fleet, its algorithm (none for local)."""
    words = agent_command.split()
    flags = {k: v for k, v in zip(words, words[1:], strict=False) if k.startswith("--")}
    algorithm = flags.get("--algorithm", "cdfl")
    if algorithm == "local":
        return None
    parts = ["fedmq aggregator", f"--algorithm {algorithm}"]
    if "--fleet" in flags:
        parts.append(f"--fleet {flags['--fleet']}")
    return " ".join(parts)


def substitute(text: str, values: dict[str, str]) -> str:
    for placeholder, template in PLACEHOLDERS.items():
        if placeholder in text:
            text = text.replace(placeholder, template.format(**values))
    return text


class NetNamespace:
    """A network namespace with only a loopback interface: 127.0.0.1:1883 is ours there."""

    count = 0

    def __init__(self) -> None:
        NetNamespace.count += 1
        self.name = f"fedmq-doc-{os.getpid()}-{NetNamespace.count}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"], check=True)
        self.prefix = ("ip", "netns", "exec", self.name)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and sys.platform == "linux"


needs_netns = pytest.mark.skipif(not netns_available(),
                                 reason="needs root and iproute2 for a private network namespace "
                                        "(CI has both); the docs' broker address is 127.0.0.1:1883")


@pytest.fixture
def scratch() -> Iterator[Path]:
    # Not in pytest's 0700 tmp dir: `fedmq broker` under root runs Mosquitto as user mosquitto,
    # which reads deploy/creds there.
    root = Path(tempfile.mkdtemp(prefix="fedmq-doc-"))
    root.chmod(0o755)
    try:
        yield scratch_checkout(root / "checkout")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` (links not followed) with its size and modification time, and
    every folder."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(folder, name), root)] = (-1, 0)
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


class DryRunCheckout:
    """One scratch checkout with the dry-run shims for every plan test of a worker. A dry run
    writes nothing, which each test checks against the tree as made, so they can share it
    (a copy of the checkout per test took longer than most plans); a test that finds a write
    gets the checkout made again for the next."""

    def __init__(self, warm: Path) -> None:
        self.warm = warm
        self.root = Path(tempfile.mkdtemp(prefix="fedmq-doc-plan-"))
        self._make()

    def _make(self) -> None:
        shutil.rmtree(self.root / "checkout", ignore_errors=True)
        self.path = scratch_checkout(self.root / "checkout")
        self.env = dry_run_shims(self.path, self.warm)
        self.made = tree_state(self.path)

    def written(self) -> list[str]:
        """What changed in the checkout since it was made (then it is made again)."""
        now = tree_state(self.path)
        changed = sorted(k for k in now.keys() | self.made.keys() if now.get(k) != self.made.get(k))
        if changed:
            self._make()
        return changed

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def dry_run_checkout(warm_python: Path) -> Iterator[DryRunCheckout]:
    checkout = DryRunCheckout(warm_python)
    try:
        yield checkout
    finally:
        checkout.close()


@pytest.fixture
def netns() -> Iterator[NetNamespace]:
    ns = NetNamespace()
    try:
        yield ns
    finally:
        ns.close()


def start_documented_broker(cwd: Path, ns: NetNamespace) -> CliProcess:
    broker = CliProcess("fedmq broker", cwd=cwd, prefix=ns.prefix)
    broker.wait_for(r"^url: mqtt://127\.0\.0\.1:1883")
    return broker


def dry_run_shims(cwd: Path, warm: Path) -> dict[str, str]:
    """`fedmq`, `python` and `.venv/bin/python` that add --dry-run: the docs' experiment
    scripts run as written and stop after checking everything. `fedmq ...` and `python -m ...`
    run forked from the warm interpreter at socket `warm`; anything else in the real one."""
    shims = cwd / ".dry-run-bin"
    shims.mkdir()
    (cwd / ".venv").unlink()
    (cwd / ".venv" / "bin").mkdir(parents=True)
    for name in ("fedmq", "python"):
        for where in (shims, cwd / ".venv" / "bin"):
            path = where / name
            path.write_text(f'#!/bin/sh\nexec {" ".join(client_argv(warm, name))} "$@" --dry-run\n')
            path.chmod(0o755)
    return cli_env(PATH=f"{shims}:{BIN}:{os.environ.get('PATH', '')}")


# --------------------------------------------------------------------------------- tests


def test_every_documented_command_has_a_rule() -> None:
    missing = [str(c) for c in ALL if c.rule is None]
    assert not missing, "documented commands with no way to check them (add a RULE):\n" + "\n".join(missing)
    assert len(ALL) > 60, summary()  # the extraction itself works
    print(summary())


def assert_no_honest_refusals(scratch: Path, steps: list[str]) -> None:
    """Every simulated agent is honest, so a documented sim run that refused an upload has
    thrown honest work away."""
    summaries = list(scratch.rglob("summary.json"))
    if any(s.startswith(("fedmq sim run ", "fedmq demo")) for s in steps):
        assert summaries, f"{steps[-1]!r} wrote no summary.json under {scratch}"
    for path in summaries:
        summary = json.loads(path.read_text())
        # "diverged" is no refusal: the agent's own training failed and it sent nothing (a collapsed
        # MobileNetV3 run that docs/results_realsize.md reports as such).
        refused = {k: n for k, n in (summary.get("refused") or {}).items() if k != "diverged"}
        assert not refused, f"{path.parent.name}: honest uploads refused {refused}"
        assert summary.get("updates", 1) > 0, f"{path.parent.name}: no update applied"


LONG_RUNS = {
    "fedmq sim report out/": "the README's first fleet as written (3 methods, 10 agents, 2 uploads each), then its report",
    "fedmq demo": "`fedmq demo` as written: a simulated fleet over a real broker, pre-training included, to its Table 1",
}
"""Documented commands that take over 30 s as written, and why (conftest.py starts them before
the other slow tests)."""


def _with_long_marks(commands: list[Command]) -> list[Any]:
    return [pytest.param(c, marks=pytest.mark.long(LONG_RUNS[c.text])) if c.text in LONG_RUNS else c
            for c in commands]


@pytest.mark.slow
@pytest.mark.parametrize("command", _with_long_marks(_by_mode("run")), ids=str)
def test_run_commands_as_written(command: Command, scratch: Path, request) -> None:
    rule = command.rule
    assert rule is not None
    # Its own TMPDIR: `fedmq demo` writes under it, where the refusal check below reads.
    (scratch / "tmp").mkdir(exist_ok=True)
    env = cli_env(TMPDIR=str(scratch / "tmp"))
    values = write_needs(rule.needs, scratch, env)
    text = substitute(command.text, values)
    steps = _preceding(command) + [text]
    ns = broker = None
    if rule.broker:
        if not netns_available():
            pytest.skip("needs a private network namespace (root, iproute2)")
        ns = NetNamespace()
        request.addfinalizer(ns.close)
        broker = start_documented_broker(scratch, ns)
    try:
        for step in steps:
            proc = CliProcess(step, cwd=scratch, env=env, prefix=ns.prefix if ns else ())
            code = proc.wait(rule.timeout)
            assert code == 0, f"{step!r} exited {code}:\n{proc.output[-4000:]}"
            assert "Traceback" not in proc.output, f"{step!r}:\n{proc.output[-4000:]}"
        assert rule.proof in proc.output, f"{text!r} printed no {rule.proof!r}:\n{proc.output[-4000:]}"
        assert "Traceback" not in proc.output, proc.output[-4000:]
        assert_no_honest_refusals(scratch, steps)
        made_again = committed_report(text)
        if made_again is not None:  # a committed report is what today's `fedmq sim report` writes
            assert (scratch / made_again).read_text() == (ROOT / made_again).read_text(), (
                f"{text!r} wrote another {made_again}; run it and commit the report it writes")
    finally:
        if broker is not None:
            broker.stop()


def committed_report(text: str) -> str | None:
    """The tracked report.md a `fedmq sim report DIR` command writes again, if DIR is tracked."""
    words = shlex.split(text)
    if words[:3] != ["fedmq", "sim", "report"] or len(words) != 4:
        return None
    report = f"{words[3].rstrip('/')}/report.md"
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", report], cwd=ROOT, capture_output=True)
    return report if tracked.returncode == 0 else None


# The data folder that a page's earlier block writes (`python scripts/digits28_files.py
# /tmp/rs/digits28`, planned elsewhere) and its later blocks read: those are planned on small
# files the script writes here, so that they do not pass or fail by what a machine's /tmp holds.
WRITTEN_BY_AN_EARLIER_BLOCK = "/tmp/rs/digits28"


@pytest.fixture(scope="session")
def digits28_files(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("digits28") / "d28"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "digits28_files.py"), str(path),
                           "--train", "1500", "--test", "400"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.slow
@pytest.mark.parametrize("command", _by_mode("plan"), ids=str)
def test_plan_commands_as_written(command: Command, dry_run_checkout: DryRunCheckout, request) -> None:
    scratch, env = dry_run_checkout.path, dry_run_checkout.env
    text = command.text
    if WRITTEN_BY_AN_EARLIER_BLOCK in text:
        page = (ROOT / command.source).read_text()
        assert page.index(f"python scripts/digits28_files.py {WRITTEN_BY_AN_EARLIER_BLOCK}\n") < page.index(
            command.text), f"{command.source} reads {WRITTEN_BY_AN_EARLIER_BLOCK} before writing it"
        text = text.replace(WRITTEN_BY_AN_EARLIER_BLOCK, str(request.getfixturevalue("digits28_files")))
    proc = CliProcess(["bash", "-euo", "pipefail", "-c", text + "\nwait"], cwd=scratch, env=env)
    code = proc.wait(600)
    assert code == 0, f"exited {code}:\n{proc.output[-4000:]}"
    assert "dry run" in proc.output or "merged" in proc.output or "|" in proc.output, proc.output[-4000:]
    assert "Traceback" not in proc.output, proc.output[-4000:]
    written = dry_run_checkout.written()
    assert not written, f"a dry run wrote into the checkout: {written[:20]}"


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("command", _by_mode("serve"), ids=str)
def test_serve_commands_as_written(command: Command, scratch: Path, netns: NetNamespace) -> None:
    rule = command.rule
    assert rule is not None
    env = cli_env()
    values = write_needs(rule.needs, scratch, env)
    text = substitute(command.text, values)
    helpers: list[CliProcess] = []
    try:
        if rule.broker:
            helpers.append(start_documented_broker(scratch, netns))
        server = aggregator_for(text) if text.startswith("fedmq agent ") else None
        if server:  # an agent joins before it says it runs: give it the aggregator it names
            helpers.append(CliProcess(server, cwd=scratch, env=env, prefix=netns.prefix))
            helpers[-1].wait_for(r"^aggregator \S+ (\(rounds\) )?on", timeout=300)
        with CliProcess(text, cwd=scratch, env=env, prefix=netns.prefix) as proc:
            proc.wait_for(rule.proof, timeout=300)
            code = proc.stop(signal.SIGTERM)
        assert code == 0, f"{text!r} exited {code} on SIGTERM:\n{proc.output[-4000:]}"
        assert "Traceback" not in proc.output, proc.output[-4000:]
    finally:
        for helper in reversed(helpers):
            helper.stop()


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("block", FLEET_BLOCKS, ids=lambda b: b[1] if len(b) > 1 else b[0])
def test_fleet_blocks_as_written(block: tuple[str, ...], scratch: Path, netns: NetNamespace) -> None:
    """A block that starts a broker, an aggregator and agents (README's 'Running a fleet', the
    round fleets), every line exactly as printed, in one network namespace. Each process proves
    it runs; then the fleet proves it works together: an asynchronous agent completes one update
    cycle (asked for with SIGUSR1, as `fedmq agent --help` documents) and `fleet status --watch`
    shows it with its upload and accuracy; a round aggregator closes a round with every agent."""
    procs: list[CliProcess] = []
    try:
        if not block[0].startswith("fedmq broker"):
            procs.append(start_documented_broker(scratch, netns))
        agents: list[CliProcess] = []
        watch = None
        for line in block:
            rule = next(r for r in RULES if re.search(r.pattern, line))
            proc = CliProcess(line, cwd=scratch, prefix=netns.prefix)
            procs.append(proc)
            if line.startswith("fedmq agent "):
                agents.append(proc)
            if line.startswith("fedmq fleet status"):
                watch = proc
            proc.wait_for(rule.proof, timeout=300)
        rounds = any("(rounds)" in line for p in procs for line in p.lines[:3])
        if rounds:
            aggregator = next(p for p in procs if "fedmq aggregator" in " ".join(p.argv))
            done = aggregator.wait_for(r"^round 1: invited (\d+), finished (\d+)", timeout=300)
            invited, finished = int(done.group(1)), int(done.group(2))
            assert 1 <= invited == finished <= len(agents), done.group(0)
            if "catafed" not in " ".join(aggregator.argv):  # FedAvg invites everyone it waited for
                assert invited == len(agents), done.group(0)
            state = re.search(r"--state-dir (\S+)", " ".join(aggregator.argv))
            if state:  # the closed round is in the snapshot a restart resumes from
                snapshot = scratch / state.group(1) / "rounds.msgpack"
                assert snapshot.exists() and msgpack.unpackb(snapshot.read_bytes(), raw=False), snapshot
        else:
            assert watch is not None and len(agents) == 1, block
            aggregator = next(p for p in procs if "fedmq aggregator" in " ".join(p.argv))
            workers = re.search(r"--workers (\d+)", " ".join(aggregator.argv))
            for i in range(int(workers.group(1)) if workers else 0):  # their lines join the aggregator's
                aggregator.wait_for(rf"^worker \S+-local-{i} on ", timeout=300)
            agents[0].proc.send_signal(signal.SIGUSR1)
            watch.wait_for(r"^aggregator: online cdfl", timeout=120)
            row = watch.wait_for(r"^car-1\s+online\s+(\d+)\s+([0-9.]+)\s+.*?\s(\d+)\s+\S+ ago$",
                                 timeout=600)
            assert int(row.group(1)) >= 1 and int(row.group(3)) >= 1, row.group(0)  # tau, uploads
            assert 0.0 < float(row.group(2)) <= 1.0, row.group(0)
            if workers:  # the reply was trained by one of the aggregator's workers
                aggregator.wait_for(r"update\.applied agent=car-1 .*reply_by=\S+-local-\d", timeout=60)
        for proc in reversed(procs):
            assert proc.stop() == 0, proc.output[-3000:]
            assert "Traceback" not in proc.output, proc.output[-3000:]
    finally:
        for proc in procs:
            proc.kill()


def test_readme_fleet_uses_the_defaults() -> None:
    """The fleet commands set no size or speed knob: what they show is what a user gets."""
    readme = [c.text for c in ALL if c.source == "README.md"]
    for text in readme:
        if text.startswith(("fedmq aggregator", "fedmq agent")):
            assert "--set" not in text and "--config" not in text, text
