"""docker-compose.yml and its overrides, checked without a Docker engine.

Static: every service's image or build target exists, every mounted host path exists (the
secure override's after `make_credentials`), named volumes are declared, published ports and
health checks agree with the broker config and the commands. Dynamic: the very command lines
of the compose files run here, container paths mapped to the host paths their mounts name and
`mosquitto:PORT` to a real Mosquitto started from the same broker_config/ file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import yaml

from fedmq.broker import MosquittoBroker, free_port
from fedmq.cli import build_parser
from fedmq.config import config_from_args, load_config
from fedmq.creds import make_credentials
from fedmq.fleet_status import FleetWatcher
from tests.warm_python import client_argv

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# ----------------------------------------------------------------------------- loading


class ComposeLoader(yaml.SafeLoader):
    """PyYAML plus Compose's merge tags: `!override` replaces, `!reset` clears."""


ComposeLoader.add_constructor("!override", lambda loader, node: _Override(loader.construct_object(node, deep=True)
                                                                           if not isinstance(node, yaml.SequenceNode)
                                                                           else loader.construct_sequence(node, deep=True)))
ComposeLoader.add_constructor("!reset", lambda loader, node: _Override(None))


class _Override:
    def __init__(self, value: Any) -> None:
        self.value = value


def load(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)


def merge(base: Any, over: Any) -> Any:
    """Compose's merge rules, as far as these files use them: mappings merge key by key, a
    `command`/`test` list replaces, other lists append (volumes by container path),
    `!override` replaces whatever was there."""
    if isinstance(over, _Override):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if k in ("command", "test", "entrypoint", "profiles") or k not in out:
                out[k] = v.value if isinstance(v, _Override) else v
            else:
                out[k] = merge(out[k], v)
        return out
    if isinstance(base, list) and isinstance(over, list):
        if all(isinstance(x, str) and ":" in x for x in base + over):  # volumes: by target
            by_target = {x.split(":")[1]: x for x in base}
            by_target.update({x.split(":")[1]: x for x in over})
            return list(by_target.values())
        return base + [x for x in over if x not in base]
    return over


def compose(*files: str) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for f in files:
        doc = merge(doc, load(f))
    return doc


def dockerfile_targets() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I))


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, container path) for every volume entry."""
    out = []
    for entry in service.get("volumes", []):
        source, target, *_ = entry.split(":")
        out.append((source, target))
    return out


def listener_ports(conf: Path) -> list[int]:
    """Every listener's port, in order: MQTT first, then MQTT over WebSockets."""
    return [int(p) for p in re.findall(r"^\s*listener\s+(\d+)", conf.read_text(), re.M)]


# ---------------------------------------------------------------------------- running


class Mapping:
    """Turns a compose command into one that runs here: container paths -> host paths by the
    service's mounts (named volumes -> temp dirs), broker host -> the test broker."""

    def __init__(self, doc: dict[str, Any], name: str, tmp: Path, broker_port: int,
                 host_paths: dict[str, Path] | None = None, env: dict[str, str] | None = None) -> None:
        self.service = doc["services"][name]
        self.env = env or {}
        self.paths: dict[str, str] = {}
        for source, target in mounts(self.service):
            if source.startswith("./"):
                host = (host_paths or {}).get(source) or ROOT / source[2:]
            else:
                host = tmp / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            self.paths[target] = str(host)
        self.paths["/opt/fedmq/claim_agent.py"] = str(ROOT / "deploy" / "claim_agent.py")  # Dockerfile COPY
        self.broker_port = broker_port

    def text(self, s: str) -> str:
        s = re.sub(r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: self.env[m.group(1)], s)  # compose interpolation
        s = s.replace("$$", "$")
        s = re.sub(r"\bmosquitto:(1883|8883)\b", f"localhost:{self.broker_port}", s)
        for target in sorted(self.paths, key=len, reverse=True):
            s = s.replace(target, self.paths[target])
        return s

    def argv(self) -> list[str]:
        return [self.text(part) for part in self.service["command"]]

    def environ(self) -> dict[str, str]:
        """The service's `environment`, interpolated."""
        return {k: self.text(str(v)) for k, v in (self.service.get("environment") or {}).items()}


def run_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"  # `fedmq` and `python` of this venv
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def fedmq_argv(argv: list[str]) -> list[str]:
    """The fedmq part of a command (after claim_agent's `--`, or all of an exec-form one)."""
    if "--" in argv:
        argv = argv[argv.index("--") + 1:]
    assert argv[0] == "fedmq", argv
    return argv[1:]


def wait_line(proc: subprocess.Popen, prefix: str, timeout: float = 120) -> str:
    lines: list[str] = []
    found = threading.Event()
    result: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(prefix) and not found.is_set():
                result.append(line.strip())
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout):
        proc.kill()
        raise AssertionError(f"no {prefix!r} line; output:\n{''.join(lines)[-3000:]}")
    return result[0]


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


# ------------------------------------------------------------------------------ static


@pytest.mark.parametrize("files", [("docker-compose.yml",),
                                   ("docker-compose.yml", "docker-compose.gpu.yml"),
                                   ("docker-compose.yml", "docker-compose.secure.yml")])
def test_services_reference_what_exists(files: tuple[str, ...], tmp_path) -> None:
    doc = compose(*files)
    targets = dockerfile_targets()
    assert {"cpu", "cuda"} <= targets
    creds = make_credentials(tmp_path / "creds", ["agent-1"], monitor_user="monitor")
    host_paths = {"./deploy/creds/mosquitto": creds.config_dir,
                  "./deploy/creds/mosquitto/certs/ca.crt": creds.ca_cert,
                  "./deploy/creds/private/credentials.json": creds.credentials_json}
    declared = set(doc.get("volumes") or {})
    assert set(doc["services"]) == {"mosquitto", "aggregator", "agent", "sim"}
    for name, svc in doc["services"].items():
        if "build" in svc:
            assert svc["build"]["target"] in targets, (name, svc["build"])
            assert (ROOT / svc["build"].get("dockerfile", "Dockerfile")).is_file()
        else:
            assert re.fullmatch(r"eclipse-mosquitto:2(\.\d+)*", svc["image"]), svc["image"]
        for source, target in mounts(svc):
            assert target.startswith("/"), (name, target)
            if source.startswith("./"):
                host = host_paths.get(source, ROOT / source[2:])
                assert Path(host).exists(), f"{name}: {source} is mounted but does not exist"
            else:
                assert source in declared, f"{name}: volume {source} not declared"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in doc["services"], (name, dep)
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in doc["services"][dep], (name, dep)
    # A named volume nobody mounts is a leftover.
    used = {s for svc in doc["services"].values() for s, _ in mounts(svc) if not s.startswith("./")}
    assert declared == used


@pytest.mark.parametrize("files,conf", [(("docker-compose.yml",), "dev.conf"),
                                        (("docker-compose.yml", "docker-compose.secure.yml"), "prod.conf")])
def test_ports_and_health_checks_agree_with_configs(files: tuple[str, ...], conf: str) -> None:
    doc = compose(*files)
    mq = doc["services"]["mosquitto"]
    port, *others = listener_ports(ROOT / "broker_config" / conf)
    command = " ".join(mq["command"])
    assert f"/fedmq/broker_config/{conf}" in command
    assert any(t == "/fedmq/broker_config" and s == "./broker_config" for s, t in mounts(mq))
    published = [p.rsplit(":", 1)[-1] for p in mq["ports"]]
    assert published == [str(p) for p in (port, *others)], (published, port, others)
    health = " ".join(mq["healthcheck"]["test"])
    assert f"-p {port}" in health
    if conf == "prod.conf":
        assert "--cafile /mosquitto/config/certs/ca.crt" in health
        assert any(t == "/mosquitto/config" for _, t in mounts(mq))
    # Every client's broker URL names the listener's port, with TLS exactly when prod.
    scheme = "mqtts" if conf == "prod.conf" else "mqtt"
    for name in ("aggregator", "agent", "sim"):
        text = " ".join(doc["services"][name]["command"])
        urls = re.findall(r"(mqtts?)://(?:[^@]*?@)?mosquitto:(\d+)", text)
        # No password in a command line: `ps` on the host shows it (FEDMQ_BROKER_PASSWORD instead).
        assert not re.search(r"mqtts?://[^@/\s]*:[^@/\s]*@", text) and "{password}" not in text, (name, text)
        if name == "sim" and conf == "prod.conf":
            assert doc["services"]["sim"]["profiles"] != ["sim"]  # kept off the secure fleet
            continue
        assert urls == [(scheme, str(port))], (name, urls)
    agg = doc["services"]["aggregator"]
    argv = agg["command"]
    metrics_port = argv[argv.index("--metrics-port") + 1]
    assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0"
    assert [p.rsplit(":", 1)[-1] for p in agg["ports"]] == [metrics_port]
    assert f"127.0.0.1:{metrics_port}/metrics" in " ".join(agg["healthcheck"]["test"])


def test_every_command_is_a_valid_fedmq_invocation(tmp_path, warm_python) -> None:
    """Parsed by the real CLI parser; those with --dry-run also run it."""
    parser = build_parser()
    for files in (("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml"),
                  ("docker-compose.yml", "docker-compose.secure.yml")):
        doc = compose(*files)
        for name in ("aggregator", "agent", "sim"):
            m = Mapping(doc, name, tmp_path, 1883, env={"FEDMQ_AGGREGATOR_PASSWORD": "pw"})
            argv = [a.replace("{id}", "agent-1") for a in m.argv()]
            if argv[:2] == ["sh", "-c"]:
                # Let the real shell expand it, with `fedmq` printing its argv instead.
                shim = tmp_path / "shim"
                shim.mkdir(exist_ok=True)
                (shim / "fedmq").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
                (shim / "fedmq").chmod(0o755)
                out = subprocess.run(argv, env={**run_env(), "PATH": f"{shim}:{os.environ['PATH']}",
                                                "HOSTNAME": "c0ffee123456"},
                                     capture_output=True, text=True, check=True).stdout
                args = out.splitlines()
                assert "agent-c0ffee123456" in args
            else:
                args = fedmq_argv(argv)
            ns = parser.parse_args(args)  # SystemExit(2) on an unknown flag or bad choice
            assert ns.command == args[0]
            for i, a in enumerate(args):
                if a == "--config":
                    load_config(args[i + 1])  # every key of the mounted file exists
            if name in ("aggregator", "agent"):
                for i, a in enumerate(args):
                    if a in ("--ca-file", "--cert-file", "--key-file") and not Path(args[i + 1]).exists():
                        # The secure stack's files come from `fedmq creds` at deploy time; a dry run
                        # checks only that they are there, so a stand-in at the mapped path does.
                        Path(args[i + 1]).parent.mkdir(parents=True, exist_ok=True)
                        Path(args[i + 1]).write_text("stand-in\n")
                done = subprocess.run([*client_argv(warm_python, "python"), "-m", "fedmq.cli", *args, "--dry-run"], cwd=ROOT,
                                      env=run_env(), capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, (files, name, done.stderr[-2000:])


def test_dockerfile_copies_what_exists_and_runs_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", text, re.M):
        for part in src.split():
            matches = list(ROOT.glob(part))
            assert matches, f"Dockerfile copies {part}, which does not exist"
    for target in ("cpu", "cuda"):
        stage = re.search(rf"^FROM \S+ AS {target}$(.*?)(?=^FROM |\Z)", text, re.M | re.S).group(1)
        assert re.search(r"^USER fedmq$", stage, re.M), target
    ignore = (ROOT / ".dockerignore").read_text()
    assert "deploy/creds" in ignore  # secrets never enter an image


def test_deploy_configs_load() -> None:
    for role in ("aggregator", "agent", "sim"):
        cfg = load_config(ROOT / "deploy" / f"{role}.toml")
        assert cfg.fleet
    assert load_config(ROOT / "deploy" / "aggregator.toml").metrics.port == 9100


# ----------------------------------------------------------------------------- dynamic


@pytest.mark.slow
def test_dev_stack_runs_against_mosquitto_from_dev_conf(tmp_path) -> None:
    doc = compose("docker-compose.yml")
    # 1. The broker: the service's own shell line renders its config (a stub mosquitto keeps it).
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mosquitto").write_text(f'#!/bin/sh\ncp "$2" {tmp_path}/rendered.conf\n')
    (shim / "mosquitto").chmod(0o755)
    m = Mapping(doc, "mosquitto", tmp_path, 0)
    m.paths["/tmp/mosquitto.conf"] = str(tmp_path / "container-tmp.conf")
    subprocess.run(m.argv(), env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}, check=True)
    rendered = (tmp_path / "rendered.conf").read_text()
    dev = (ROOT / "broker_config" / "dev.conf").read_text()
    assert rendered == re.sub(r"^(listener \d+) 127\.0\.0\.1$", r"\1", dev, flags=re.M)
    with MosquittoBroker.from_file(tmp_path / "rendered.conf", workdir=tmp_path / "broker") as broker:
        # The health check's subscription: $SYS/broker/version arrives (retained).
        got = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="health")
        c.on_message = lambda *a: got.set()
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        c.subscribe("$SYS/broker/version", qos=0)
        assert got.wait(60), "health check topic never arrived"
        c.disconnect()
        c.loop_stop()

        # 2. The aggregator, with its metrics endpoint and health check.
        agg = Mapping(doc, "aggregator", tmp_path, broker.port)
        mport = free_port()
        argv = [a.replace("9100", str(mport)) for a in agg.argv()]
        proc = subprocess.Popen(argv, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        agent = None
        try:
            wait_line(proc, "aggregator ", timeout=300)
            health = [a.replace("9100", str(mport)) for a in doc["services"]["aggregator"]["healthcheck"]["test"][1:]]
            assert subprocess.run(health, env=run_env(), timeout=30).returncode == 0
            assert "fedmq_aggregator_broker_connected 1.0" in scrape(mport)
            assert any((tmp_path / "volumes" / "aggregator-state").iterdir())  # state on the volume

            # 3. One agent through the service's shell line (its id from $HOSTNAME).
            ag = Mapping(doc, "agent", tmp_path, broker.port)
            log = (tmp_path / "agent.log").open("w")
            agent = subprocess.Popen(ag.argv(), cwd=tmp_path, env=run_env(HOSTNAME="c0ffee"),
                                     stdout=log, stderr=subprocess.STDOUT)
            cfg = load_config(ROOT / "deploy" / "agent.toml", {"broker.url": broker.url})
            with FleetWatcher(cfg) as w:
                deadline = time.monotonic() + 120
                while (getattr(w.agents.get("agent-c0ffee"), "state", None) != "online"
                       and time.monotonic() < deadline and agent.poll() is None):
                    time.sleep(0.2)
                assert w.agents["agent-c0ffee"].state == "online", (tmp_path / "agent.log").read_text()[-2000:]
                assert w.aggregator is not None and w.aggregator.state == "online"
                # SIGTERM, as `docker compose stop` sends: the agent says offline and exits 0.
                assert stop(agent) == 0, (tmp_path / "agent.log").read_text()[-2000:]
                deadline = time.monotonic() + 30
                while w.agents["agent-c0ffee"].state != "offline" and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert w.agents["agent-c0ffee"].state == "offline"
            assert (tmp_path / "volumes" / "agent-state" / "agent-c0ffee").is_dir()
        finally:
            if agent is not None:
                stop(agent)
            assert stop(proc) == 0


@pytest.mark.slow
def test_secure_stack_runs_against_mosquitto_from_prod_conf(tmp_path) -> None:
    doc = compose("docker-compose.yml", "docker-compose.secure.yml")
    creds = make_credentials(tmp_path / "creds", ["agent-1", "agent-2"], monitor_user="monitor",
                             hostnames=("mosquitto",))
    host_paths = {"./deploy/creds/mosquitto": creds.config_dir,
                  "./deploy/creds/mosquitto/certs/ca.crt": creds.ca_cert,
                  "./deploy/creds/private/credentials.json": creds.credentials_json}
    conf = Mapping(doc, "mosquitto", tmp_path, 0, host_paths).argv()
    assert conf[:2] == ["mosquitto", "-c"] and Path(conf[2]) == ROOT / "broker_config" / "prod.conf"
    with MosquittoBroker.from_file(conf[2], path_map=creds.path_map(), workdir=tmp_path / "broker") as broker:
        # The health check's premise: TLS to `localhost` against our CA, anonymous CONNECT refused.
        ctx = ssl.create_default_context(cafile=str(creds.ca_cert))
        with socket.create_connection(("localhost", broker.port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost"):
            pass  # handshake and hostname verified
        refused = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="health")
        c.tls_set(ca_certs=str(creds.ca_cert))
        c.on_connect = lambda cl, u, f, rc, p: refused.set() if rc.is_failure and "authori" in str(rc).lower() else None
        c.connect("localhost", broker.port)
        c.loop_start()
        assert refused.wait(60), "anonymous CONNECT was not refused as not authorised"
        c.loop_stop()

        password = json.loads(creds.credentials_json.read_text())["aggregator"]["password"]
        agg = Mapping(doc, "aggregator", tmp_path, broker.port, host_paths,
                      env={"FEDMQ_AGGREGATOR_PASSWORD": password})
        mport = free_port()
        argv = [a.replace("9100", str(mport)) for a in agg.argv()]
        assert agg.environ() == {"FEDMQ_BROKER_PASSWORD": password}
        proc = subprocess.Popen(argv, cwd=tmp_path, env=run_env(**agg.environ()), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        agents: list[subprocess.Popen] = []
        try:
            wait_line(proc, "aggregator ", timeout=300)
            assert "fedmq_aggregator_broker_connected 1.0" in scrape(mport)
            ag = Mapping(doc, "agent", tmp_path, broker.port, host_paths)
            logs = [tmp_path / f"agent-{host}.log" for host in ("c1", "c2")]
            for host, log in zip(("c1", "c2"), logs, strict=True):  # two replicas, two identities
                agents.append(subprocess.Popen(ag.argv(), cwd=tmp_path, env=run_env(HOSTNAME=host),
                                               stdout=log.open("w"), stderr=subprocess.STDOUT))
            # The monitor user sees both online through the ACL (status topics only).
            monitor = json.loads(creds.credentials_json.read_text())["monitor"]
            cfg = load_config(ROOT / "deploy" / "agent.toml", {
                "broker.url": f"mqtts://monitor:{monitor['password']}@localhost:{broker.port}",
                "broker.ca_file": str(creds.ca_cert)})
            with FleetWatcher(cfg) as w:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not all(
                        getattr(w.agents.get(a), "state", None) == "online" for a in ("agent-1", "agent-2")):
                    assert all(p.poll() is None for p in agents), [log.read_text()[-1500:] for log in logs]
                    time.sleep(0.2)
                assert {a: p.state for a, p in w.agents.items()} == {"agent-1": "online", "agent-2": "online"}
                assert w.aggregator is not None and w.aggregator.state == "online"
            # Logged in with passwords no other user of the host can read in `ps`.
            secrets = [password, *json.loads(creds.credentials_json.read_text())["agents"].values()]
            for pid in (proc.pid, *(a.pid for a in agents)):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                assert not any(secret in cmdline for secret in secrets), cmdline
            # A restarted replica (same hostname) gets its own identity back.
            claim = ag.argv()[:ag.argv().index("--")]
            ids = [subprocess.run(claim + ["--hostname", h, "--print", "--", "true"], env=run_env(),
                                  capture_output=True, text=True, check=True).stdout.strip()
                   for h in ("c1", "c2")]
            assert sorted(ids) == ["agent-1", "agent-2"]
        finally:
            for a in agents:
                stop(a)
            assert stop(proc) == 0


def test_systemd_units_run_valid_fedmq_commands() -> None:
    parser = build_parser()
    for unit in ("fedmq-agent.service", "fedmq-aggregator.service"):
        text = (ROOT / "deploy" / unit).read_text()
        (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
        program, *args = exec_start.split()
        assert program == "/opt/fedmq/venv/bin/fedmq"
        ns = parser.parse_args(args)
        load_config(ROOT / "deploy" / Path(args[args.index("--config") + 1]).name)
        assert ns.state_dir.startswith("/var/lib/fedmq/")
        assert re.search(r"^User=fedmq$", text, re.M) and re.search(r"^KillSignal=SIGTERM$", text, re.M)


# ---------------------------------------------------------------------------- many fleets, watched

FLEETS = ("docker-compose.yml", "docker-compose.fleets.yml")
MONITORING = ROOT / "deploy" / "monitoring"


def test_fleets_file_runs_one_aggregator_per_fleet_and_prometheus_scrapes_each(tmp_path, warm_python) -> None:
    """docker-compose.fleets.yml: a second fleet's aggregator beside the first (own fleet, state
    volume and metrics port, the same broker), each a valid fedmq command that resolves with
    --dry-run; Prometheus scrapes exactly those aggregators, labelled with their fleets; Grafana
    and Prometheus mount what exists, and stay in the monitoring profile."""
    doc = compose(*FLEETS)
    parser = build_parser()
    aggregators = {name: svc for name, svc in doc["services"].items() if name.startswith("aggregator")}
    assert set(aggregators) == {"aggregator", "aggregator-phones"}
    fleets, states, targets = {}, set(), {}
    for name, svc in aggregators.items():
        args = fedmq_argv(Mapping(doc, name, tmp_path, 1883).argv())
        ns = parser.parse_args(args)
        cfg = config_from_args(ns, {"state_dir": "aggregator.state_dir"})
        fleets[name] = cfg.fleet
        states.update(s for s, t in mounts(svc) if t == "/var/lib/fedmq/aggregator")
        targets[f"{name}:{args[args.index('--metrics-port') + 1]}"] = cfg.fleet
        assert "mqtt://mosquitto:1883" in svc["command"], name
        done = subprocess.run([*client_argv(warm_python, "python"), "-m", "fedmq.cli", *args, "--dry-run"], cwd=ROOT, env=run_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (name, done.stderr[-2000:])
    assert len(set(fleets.values())) == len(fleets) == len(states), (fleets, states)  # one writer per fleet
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    scraped = {t: c["labels"]["fleet"] for c in job["static_configs"] for t in c["targets"]}
    assert scraped == targets
    for name in ("prometheus", "grafana"):
        svc = doc["services"][name]
        assert svc["profiles"] == ["monitoring"]
        for source, _ in mounts(svc):
            assert not source.startswith("./") or (ROOT / source[2:]).exists(), (name, source)
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_both_fleets_can_share_one_gpu(tmp_path, warm_python) -> None:
    """docker-compose.fleets-gpu.yml over the fleets and the GPU file: both aggregators run on
    CUDA and reserve the same device (GPU 0), with the rest of each fleet as before."""
    files = (*FLEETS, "docker-compose.gpu.yml", "docker-compose.fleets-gpu.yml")
    doc = compose(*files)
    parser = build_parser()
    reserved = {}
    for name in ("aggregator", "aggregator-phones"):
        svc = doc["services"][name]
        assert svc["build"]["target"] == "cuda" and svc["image"] == "fedmq:cuda", name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        reserved[name] = (device["driver"], tuple(device["device_ids"]), tuple(device["capabilities"]))
        args = fedmq_argv(Mapping(doc, name, tmp_path, 1883).argv())
        assert args[args.index("--device") + 1] == "cuda"
        parser.parse_args(args)
        done = subprocess.run([*client_argv(warm_python, "python"), "-m", "fedmq.cli", *args, "--dry-run"],
                              cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (name, done.stderr[-2000:])
    assert set(reserved.values()) == {("nvidia", ("0",), ("gpu",))}, reserved
    phones = fedmq_argv(Mapping(doc, "aggregator-phones", tmp_path, 1883).argv())
    assert phones[phones.index("--fleet") + 1] == "phones" and "--workers" in phones


def exported_metrics() -> set[str]:
    """Every metric family aggregator/prometheus.py exports (without _total/_bucket/... suffixes)."""
    text = (ROOT / "aggregator" / "prometheus.py").read_text()
    prefix = re.search(r'^PREFIX = "(\w+)"', text, re.M).group(1)
    return {f"{prefix}_{name}" for name in re.findall(r'f"\{PREFIX\}_(\w+)"', text)}


def test_dashboard_queries_only_metrics_the_aggregator_exports() -> None:
    """Every panel of the provisioned Grafana dashboard reads metrics that exist, per fleet, from
    the provisioned data source; it covers uploads/s, stale and refused, reply latency, cluster
    accuracy, agents online and the reply workers (docs/scaling.md)."""
    dash = json.loads((MONITORING / "grafana/dashboards/fedmq.json").read_text())
    uid = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"][0]["uid"]
    exported = exported_metrics()
    assert {"fedmq_aggregator_uploads", "fedmq_aggregator_workers_online"} <= exported
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        for target in panel["targets"]:
            assert 'fleet=~"$fleet"' in target["expr"], (panel["title"], target["expr"])
            for metric in re.findall(r"\bfedmq_\w+", target["expr"]):
                base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
                assert base in exported, (panel["title"], metric)
                used.add(base)
    assert {"fedmq_aggregator_uploads", "fedmq_aggregator_rejected", "fedmq_aggregator_end_to_end_seconds",
            "fedmq_aggregator_cluster_accuracy", "fedmq_aggregator_connected_agents",
            "fedmq_aggregator_workers_online"} <= used
    (variable,) = dash["templating"]["list"]
    assert re.search(r"label_values\((\w+), fleet\)", variable["query"]).group(1) in exported
