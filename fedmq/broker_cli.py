"""Run an MQTT broker in the foreground for development; Ctrl-C stops it.

Mosquitto (with broker_config/dev.conf unless --config says otherwise) when the binary is
installed, else the embedded pure-Python broker (amqtt, MQTT 3.1.1, anonymous, loopback).
The listener is moved to --port on 127.0.0.1 (0: a free port); the URL to give agents and
the aggregator is printed on the first line starting with `url: `. The config's MQTT over
WebSockets listener (for the browser agent, docs/browser.md) keeps its port (9001 in
dev.conf, 9883 in prod.conf) unless --ws-port says otherwise, or --port 0 asks for free
ports; its URL is printed on a line starting with `ws_url: `. Every listener is on 127.0.0.1
only, checked once Mosquitto runs.

Started as root, Mosquitto runs as user `mosquitto`, as a packaged one does: it must be able
to write the work dir (a temporary one is made its own) and read the config's files (`fedmq
creds` makes the secret ones readable by group mosquitto), or the command refuses in one line.

    fedmq broker                                  # mosquitto, dev.conf, mqtt://127.0.0.1:1883
    fedmq broker --embedded --port 0              # no mosquitto needed
    fedmq broker --config broker_config/prod.conf --creds deploy/creds --port 8883
    fedmq broker --dry-run                        # print the command and rendered config
    sudo fedmq broker --rabbitmq 2                # a 2-node RabbitMQ cluster (docs/scaling.md)

--rabbitmq N starts N RabbitMQ nodes with the MQTT plugin (MQTT 3.1.1, anonymous) as one
cluster, session queues mirrored to every node; `url:` lists every node, comma-separated,
the form every fedmq client takes; each node's line gives its process group, so that
`kill -9 -- -GROUP` drops it like a lost machine (a failover drill: the command reports it
and the other nodes keep serving until Ctrl-C). It needs root (the nodes run as user rabbitmq) and the
rabbitmq-server package; the nodes' files go to a temporary directory removed on exit.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fedmq.broker import (
    REPO_BROKER_CONFIG,
    BrokerError,
    MosquittoBroker,
    find_mosquitto,
    free_port,
    listener_kinds,
    rewrite_config,
)
from fedmq.signals import SignalRelay

if TYPE_CHECKING:
    from fedmq.rabbitmq_cluster import RabbitCluster

DEFAULT_CONFIG = REPO_BROKER_CONFIG / "dev.conf"
MOSQUITTO_USER = "mosquitto"
"""Whom Mosquitto runs as when `fedmq broker` is started by root: the user the package makes."""
CONTAINER_CONFIG_DIR = "/mosquitto/config/"
_LISTENER_LINE = re.compile(r"^\s*listener\s+\d+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="Mosquitto config (default: broker_config/dev.conf)")
    parser.add_argument("--port", type=int, default=1883,
                        help="port of the (first) listener on 127.0.0.1; 0 picks a free one")
    parser.add_argument("--ws-port", type=int, default=None,
                        help="port of the MQTT over WebSockets listener (default: the config's, or a free "
                             "one with --port 0; 0 picks a free one)")
    parser.add_argument("--embedded", action="store_true",
                        help="use the embedded amqtt broker even if mosquitto is installed")
    parser.add_argument("--creds", type=Path, default=None,
                        help="output dir of `fedmq creds`: maps /mosquitto/config/ (prod.conf)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where persistence and the log go (default: a temp dir, removed on exit); "
                             "started as root, user mosquitto must be able to write it")
    parser.add_argument("--rabbitmq", type=int, default=0, metavar="N",
                        help="start a RabbitMQ cluster of N nodes instead (MQTT 3.1.1, anonymous; needs root "
                             "and rabbitmq-server); --port is the first node's MQTT port")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run and the rendered config, then exit")


def _wants_auth(config_text: str) -> bool:
    """True when the config expects passwords or TLS, which the embedded broker cannot honour."""
    keys = {ln.split()[0] for ln in config_text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    anonymous = re.search(r"^\s*allow_anonymous\s+true\b", config_text, re.M) is not None
    return bool(keys & {"password_file", "acl_file", "certfile", "psk_file"}) or not anonymous


def _scheme(config_text: str) -> str:
    return "mqtts" if re.search(r"^\s*certfile\s", config_text, re.M) else "mqtt"


def _path_map(args: argparse.Namespace) -> dict[str, str] | None:
    if args.creds is None:
        return None
    return {CONTAINER_CONFIG_DIR: f"{args.creds.resolve() / 'mosquitto'}/"}


def _ports(config_text: str, first: int, ws: int | None = None) -> list[int]:
    """A port per listener: the first is `first`, a WebSockets one `ws` (None: the config's
    own port, or a free one when `first` is 0), any other a free one; 0 means a free one."""
    own = [int(ln.split()[1]) for ln in config_text.splitlines() if _LISTENER_LINE.match(ln)]
    kinds = listener_kinds(config_text)
    ports = [first or free_port()]
    for i in range(1, max(1, len(own))):
        if kinds[i][0] == "websockets":
            wanted = ws if ws is not None else (own[i] if first else 0)
            ports.append(wanted or free_port())
        else:
            ports.append(free_port())
    return ports


def _ws_url(config_text: str, ports: list[int]) -> str | None:
    for port, (proto, tls) in zip(ports, listener_kinds(config_text), strict=False):
        if proto == "websockets":
            return f"{'wss' if tls else 'ws'}://127.0.0.1:{port}"
    return None


def run(args: argparse.Namespace) -> int:
    if args.rabbitmq:
        return _run_rabbitmq(args)
    try:
        config_text = args.config.read_text()
    except OSError as e:
        print(f"fedmq broker: cannot read config {args.config}: {e}", file=sys.stderr)
        return 2
    binary = None if args.embedded else find_mosquitto()
    if binary is None:
        if _wants_auth(config_text):
            print(f"fedmq broker: {args.config} asks for TLS/passwords/ACL, which the embedded "
                  "broker cannot provide; install mosquitto or use broker_config/dev.conf",
                  file=sys.stderr)
            return 2
        return _run_embedded(args)
    return _run_mosquitto(args, binary, config_text)


def _run_embedded(args: argparse.Namespace) -> int:
    from fedmq.embedded_broker import EmbeddedBroker

    why = "--embedded" if args.embedded else "mosquitto not found"
    if args.dry_run:
        port = args.port if args.port else "<free port>"
        print(f"would run: embedded amqtt broker (MQTT 3.1.1, anonymous) on 127.0.0.1:{port} ({why})")
        print(f"url: mqtt://127.0.0.1:{port}")
        return 0
    broker = EmbeddedBroker(port=args.port)
    try:
        with _StopSignals() as stop:
            broker.start()
            print(f"url: {broker.url}", flush=True)
            print(f"embedded amqtt broker (MQTT 3.1.1, anonymous; {why}); Ctrl-C stops it", flush=True)
            if stop.wait_while(lambda: broker.running):
                return 0
        print("fedmq broker: the embedded broker's thread ended", file=sys.stderr)
        return 1
    except BrokerError as e:
        print(f"fedmq broker: {e}", file=sys.stderr)
        return 1
    finally:
        broker.stop()


def _run_mosquitto(args: argparse.Namespace, binary: str, config_text: str) -> int:
    ports = _ports(config_text, args.port, args.ws_port)
    scheme = _scheme(config_text)
    ws_url = _ws_url(config_text, ports)
    if args.dry_run:
        workdir = args.workdir or Path(tempfile.gettempdir()) / "fedmq-mosquitto-XXXXXX"
        rendered = rewrite_config(config_text, ports, Path(workdir), _path_map(args), user=MOSQUITTO_USER)
        print(f"would run: {shlex.join([binary, '-c', str(Path(workdir) / 'mosquitto.conf')])}")
        print(f"url: {scheme}://127.0.0.1:{ports[0]}")
        if ws_url:
            print(f"ws_url: {ws_url}")
        print(f"# --- rendered from {args.config} ---")
        print(rendered, end="")
        return 0
    try:
        broker = MosquittoBroker(config_text, path_map=_path_map(args), workdir=args.workdir, ports=ports,
                                 user=MOSQUITTO_USER)
    except BrokerError as e:
        print(f"fedmq broker: {e}", file=sys.stderr)
        return 1
    try:
        with _StopSignals() as stop:
            broker.start()
            print(f"url: {scheme}://{broker.host}:{broker.port}", flush=True)
            if broker.ws_url:
                print(f"ws_url: {broker.ws_url}", flush=True)
            print(f"mosquitto pid {broker.proc.pid if broker.proc else '?'}, config {broker.config_path}, "
                  f"log {broker.log_path}; Ctrl-C stops it", flush=True)
            assert broker.proc is not None
            proc = broker.proc
            # A Ctrl-C or a service manager's stop signals the whole group: mosquitto may end
            # from the same signal before we notice ours, and that is still a clean stop.
            if stop.wait_while(lambda: proc.poll() is None) or stop.requested_within(1.0):
                return 0
        print(f"fedmq broker: mosquitto exited with code {proc.returncode}\n"
              f"{broker.log_tail()}", file=sys.stderr)
        return 1
    except BrokerError as e:
        print(f"fedmq broker: {e}", file=sys.stderr)
        return 1
    finally:
        broker.close()


def _run_rabbitmq(args: argparse.Namespace) -> int:
    from fedmq.rabbitmq_cluster import ClusterError, RabbitCluster, installed

    if args.rabbitmq < 1:
        print(f"fedmq broker: --rabbitmq needs at least 1 node, got {args.rabbitmq}", file=sys.stderr)
        return 2
    if not installed():
        print("fedmq broker: --rabbitmq needs rabbitmq-server and runuser (apt-get install rabbitmq-server)",
              file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"would run: {args.rabbitmq} rabbitmq-server nodes as user rabbitmq, clustered, MQTT plugin, "
              f"first MQTT listener on 127.0.0.1:{args.port or '<free port>'}")
        return 0
    cluster = RabbitCluster(args.rabbitmq, fd_limit=65536, first_mqtt_port=args.port)
    try:
        with _StopSignals() as stop:
            print(f"starting {args.rabbitmq} RabbitMQ nodes (about 10-30 s each)...", flush=True)
            cluster.start()
            print(f"url: {cluster.url}", flush=True)
            for node in cluster.nodes:
                # Its process group: `kill -9 -- -GROUP` drops the node like a lost machine.
                group = node.proc.pid if node.proc else "?"
                print(f"node {node.name} mqtt://127.0.0.1:{node.mqtt_port} group {group} "
                      f"log {node.dir / 'server.out'}", flush=True)
            print("Ctrl-C stops every node", flush=True)
            # A node that dies (a failover drill: kill -9 its VM) is reported, and the others
            # keep serving until Ctrl-C; only when every node is gone does the command end.
            gone: set[str] = set()
            while not stop.wait_while(lambda: len(_alive(cluster)) + len(gone) == len(cluster.nodes)):
                for node in cluster.nodes:
                    if node.name not in gone and node.name not in _alive(cluster):
                        gone.add(node.name)
                        print(f"node {node.name} exited (code {node.proc.returncode if node.proc else '?'}); "
                              f"{len(cluster.nodes) - len(gone)} left", flush=True)
                if len(gone) == len(cluster.nodes):
                    print("fedmq broker: every node exited", file=sys.stderr)
                    return 1
        return 0
    except ClusterError as e:
        print(f"fedmq broker: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def _alive(cluster: RabbitCluster) -> set[str]:
    """Names of the nodes whose server process still runs."""
    return {n.name for n in cluster.nodes if n.proc is not None and n.proc.poll() is None}


class _StopSignals:
    """SIGINT and SIGTERM ask for a stop, whatever handlers (or SIG_IGN, as for background
    jobs of a non-interactive shell) this process inherited. Installed before the broker
    starts, so a stop that comes right after the `url:` line is a clean stop, not a kill.
    Relayed (fedmq/signals.py): a handler setting the event the main thread waits on could
    deadlock it, which once left mosquitto running after a SIGTERM."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def __enter__(self) -> _StopSignals:
        self._relay = SignalRelay({signal.SIGINT: self._stop.set, signal.SIGTERM: self._stop.set})
        return self

    def __exit__(self, *exc: object) -> None:
        self._relay.restore()

    def wait_while(self, still_running: Callable[[], bool]) -> bool:
        """Wait until a stop is asked for (True) or `still_running()` turns false (False)."""
        while still_running():
            if self._stop.wait(0.2):
                return True
        return self._stop.is_set()

    def requested_within(self, seconds: float) -> bool:
        return self._stop.wait(seconds)
