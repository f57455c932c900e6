"""What `fedmq agent` and `fedmq aggregator` print at the default log level (docs/deploy.md#logs).

The real CLI as subprocesses against a real Mosquitto, no `--log-level`: the agent prints one
line per step of its cycle (update asked, trained n samples in s seconds, model installed
with the bytes up and down, epoch and accuracy) and nothing per poll; the aggregator one line
per applied upload. The windowing that keeps a busy aggregator quiet is checked on its own
with a fake clock.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aggregator.service import ProgressLines
from fedmq.config import LogSettings
from fedmq.logs import (
    PROGRESS,
    EventFormatter,
    get_logger,
    mask_secrets,
    resolve_level,
    setup_logging,
)
from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent
FLEET = "lines"
# Speed only: small pre-training and proxy sets so that the aggregator starts in seconds on digits
# (5 epochs: enough to learn, so it has no cluster.pretrain_stuck to say).
DATA = ["--set", "data.pretrain_per_cluster=100", "--set", "data.proxy_per_cluster=100",
        "--set", "aggregator.pretrain_epochs=5", "--set", "device=cpu"]
LINE = re.compile(r"^\d\d:\d\d:\d\d (\w+)\s+fedmq\.(\w+): (\S+)(.*)$")
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\[[^\]]*\]|\S+)')


def parse(text: str) -> list[tuple[str, str, str, dict[str, str]]]:
    """(level, logger, event, fields) per line; a line that is not an event fails the test."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = LINE.match(line)
        assert m, f"not a structured log line: {line!r}\n{text}"
        out.append((m[1], m[2], m[3], dict(FIELD.findall(m[4]))))
    return out


def wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}\n{log.read_text() if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.1)


def cli(*args: str, out: Path, err: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedmq.cli", *args], cwd=ROOT,
                            stdout=out.open("wb"), stderr=err.open("wb"))


@pytest.mark.slow
def test_agent_and_aggregator_print_one_line_per_step_at_the_default_level(mosquitto, tmp_path) -> None:
    common = ["--broker", mosquitto.url, "--fleet", FLEET, "--clusters", "2", *DATA]
    agg_out, agg_err = tmp_path / "aggregator.out", tmp_path / "aggregator.err"
    agg = cli("aggregator", *common, "--state-dir", str(tmp_path / "agg"), out=agg_out, err=agg_err)
    agent = None
    try:
        wait_for(lambda: agg_out.read_text().startswith("aggregator "), 180, "the aggregator", agg, agg_err)
        ag_out, ag_err = tmp_path / "agent.out", tmp_path / "agent.err"
        # 60 polls at 0.1 s (speed; default 1 s): the cycle needs 10 (200 samples), the other
        # 50 show that polling prints nothing. --max-steps makes the agent exit on its own.
        agent = cli("agent", *common, "--id", "car-1", "--state-dir", str(tmp_path / "car-1"),
                    "--update-now", "--max-steps", "60", "--set", "agent.poll_interval_s=0.1",
                    out=ag_out, err=ag_err)
        assert agent.wait(240) == 0, ag_err.read_text()
        wait_for(lambda: "update.applied" in agg_err.read_text(), 30, "the aggregator's line", agg, agg_err)
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        agg.terminate()
        assert agg.wait(60) == 0, agg_err.read_text()

    lines = parse(ag_err.read_text())
    text = ag_err.read_text()
    assert all(level == "progress" for level, *_ in lines), text
    events = [e for _, _, e, _ in lines]
    # join, then one manual cycle: asked, trained, installed; nothing per poll. The detector
    # may judge the 50 later polls against the new model once (the next cycle would wait for
    # agent.min_update_interval_s): at most one more line.
    assert events[:4] == ["model.installed", "update.asked", "train.done", "model.installed"], text
    assert events[4:] in ([], ["drift.detected"]), text
    joined, asked, trained, installed = (f for *_, f in lines[:4])
    assert joined["via"] == "join" and joined["epoch"] == "0" and int(joined["downloaded"]) > 1000
    assert asked["by"] == "manual" and asked["agent"] == "car-1"
    assert int(trained["samples"]) >= 200 and 0 < float(trained["seconds"]) < 120
    assert trained["trigger"] == "manual" and 0 <= float(trained["acc_trained"]) <= 1
    assert installed["via"] == "update" and installed["epoch"] == "1"
    assert 0 <= float(installed["accuracy"]) <= 1
    assert int(installed["uploaded"]) > 1000 and int(installed["downloaded"]) > 1000

    agg_lines = parse(agg_err.read_text())
    assert [(lv, e) for lv, _, e, _ in agg_lines] == [("progress", "update.applied")], agg_err.read_text()
    applied = agg_lines[0][3]
    assert applied["agent"] == "car-1" and applied["epoch"] == "1" and applied["tau"] == "0"
    assert applied["staleness"] == "1" and applied["stale"] == "False"  # epoch - tau, counted after the step
    assert applied["samples"] == trained["samples"]


class Records(logging.Handler):
    """Every record a logger emits at PROGRESS or above, whatever `setup_logging` did before."""

    def __init__(self, name: str) -> None:
        super().__init__(PROGRESS)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        self.old_level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(PROGRESS)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)


def test_a_busy_aggregator_prints_a_bounded_number_of_lines() -> None:
    with Records("fedmq.aggregator") as caplog:
        _busy_aggregator(caplog)


def _busy_aggregator(caplog: Records) -> None:
    now = [0.0]
    refused = [0]
    lines = ProgressLines(LogSettings(summary_every_s=10.0, upload_lines=3),
                          lambda: {"refused": refused[0], "epoch": 7}, clock=lambda: now[0])
    got = lambda: [(r.getMessage(), r.fields) for r in caplog.records]  # noqa: E731

    lines.applied([{"agent": "a", "stale": False}])  # a quiet fleet: its upload's own line, no summary
    now[0] = 10.5
    lines.tick()
    assert [m for m, _ in got()] == ["update.applied"]

    caplog.records.clear()  # a busy window: 3 lines of their own, the other 47 in one summary
    for i in range(50):
        now[0] = 11 + i * 0.1
        lines.applied([{"agent": f"a{i}", "stale": i % 5 == 0}])
    refused[0] = 4
    now[0] = 20.4
    lines.tick()
    assert [m for m, _ in got()] == ["update.applied"] * 3  # the window is not over yet
    now[0] = 20.6
    lines.tick()
    assert [m for m, _ in got()] == ["update.applied"] * 3 + ["uploads.summary"]
    summary = got()[-1][1]
    assert summary["uploads"] == 50 and summary["unlisted"] == 47 and summary["stale"] == 10
    assert summary["refused"] == 4 and summary["epoch"] == 7 and summary["per_s"] == pytest.approx(50 / 10.1, abs=0.01)

    caplog.records.clear()  # idle: nothing; refusals alone: one summary
    now[0] = 40.0
    lines.tick()
    assert got() == []
    refused[0] = 9
    now[0] = 50.1
    lines.tick()
    assert [(m, f["refused"], f["uploads"]) for m, f in got()] == [("uploads.summary", 5, 0)]

    with pytest.raises(ValueError, match="log.summary_every_s"):
        ProgressLines(LogSettings(summary_every_s=0), lambda: {"refused": 0})


def test_default_level_is_progress_for_one_process_and_quiet_for_the_simulator() -> None:
    assert LogSettings().level == "auto"
    assert resolve_level("auto", auto="progress") == "progress"
    assert resolve_level("auto") == "warning"  # sim, demo, ablation and tools: setup_logging's default
    assert resolve_level("INFO") == "info"
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        resolve_level("loud")
    setup_logging("auto")
    assert not get_logger("agent").isEnabledFor(PROGRESS)
    setup_logging("auto", auto="progress")
    assert get_logger("agent").isEnabledFor(PROGRESS) and not get_logger("agent").isEnabledFor(logging.INFO)


@pytest.mark.parametrize("as_json", [False, True])
def test_passwords_in_urls_never_reach_a_log_line(as_json: bool) -> None:
    assert mask_secrets("mqtts://agg:s3cr%40t@broker:8883") == "mqtts://agg:***@broker:8883"
    assert mask_secrets("mqtt://broker:1883") == "mqtt://broker:1883"
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EventFormatter(as_json))
    logger = logging.getLogger("fedmq.test_secrets")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        logger.info("aggregator.started", extra={"fields": {"broker": "mqtt://agg:hunter2@h:1883"}})
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "hunter2" not in out and "agg:***@h" in out
    if as_json:
        assert json.loads(out)["broker"] == "mqtt://agg:***@h:1883"


@pytest.mark.slow
def test_no_command_shows_the_broker_password(tmp_path, warm_python) -> None:
    """What a person sees on stdout and stderr: --dry-run's config, a bad-URL error, an
    unknown flag next to a URL, and a start that cannot reach its broker. The password holds
    an unencoded `@` on purpose (masked whole, not up to the first `@`). Each command line
    runs in a child of a warm interpreter (tests/warm_python.py: same entry point, argv,
    streams; torch already imported, 5 x ~3 s of CPU less)."""
    from fedmq.broker import free_port

    secret = "Hunter2@x"
    url = f"mqtts://car-1:{secret}@127.0.0.1:{free_port()}"
    runs = [
        ("aggregator", "--broker", url, "--dry-run"),
        ("agent", "--id", "car-1", "--broker", url, "--dry-run", "--state-dir", str(tmp_path / "a")),
        ("agent", "--id", "car-1", "--broker", url.replace("mqtts", "mqtx"), "--state-dir", str(tmp_path / "a")),
        ("aggregator", "--broker", url, "--no-such-flag"),
        ("agent", "--id", "car-1", "--broker", url, "--state-dir", str(tmp_path / "b")),  # refused
    ]
    for argv in runs:
        done = subprocess.run(client_argv(warm_python, "python", "-m", "fedmq.cli", *argv),
                              capture_output=True, text=True,
                              timeout=180, cwd=Path(__file__).resolve().parent.parent)
        shown = done.stdout + done.stderr
        assert "Hunter2" not in shown and "@x@" not in shown, (argv, shown[-2000:])
        assert "127.0.0.1" in shown or done.returncode == 2, (argv, shown[-2000:])  # it did speak of the URL
