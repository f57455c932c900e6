"""A real RabbitMQ cluster on this machine: N nodes with the MQTT plugin on loopback ports.

For development and tests (`fedmq broker --rabbitmq N`, tests/test_broker_cluster.py,
soak/cluster_failover.py); production clusters are set up with the broker's own tools
(docs/scaling.md). Each node has its own name, ports and directories (owned by user
rabbitmq, the Debian package's; so this needs root), and all share the package's Erlang
cookie, so they can cluster: node 1.. joins node 0. A policy mirrors the MQTT plugin's session queues (`mqtt-subscription-*`) to every
node: without it a persistent session lives on one node only, and a client that fails over
after that node died cannot resume it (RabbitMQ refuses a queue whose home node is down).
What else a cluster changes for fedmq is in docs/scaling.md.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fedmq.errors import RuntimeFailure

HOME = "/var/lib/rabbitmq"  # the package's home: its Erlang cookie


def installed() -> bool:
    return shutil.which("rabbitmq-server") is not None and shutil.which("runuser") is not None


def _may_raise_hard_limits() -> bool:
    """CAP_SYS_RESOURCE in this process's effective set (root in a container may lack it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 24))
    except (OSError, ValueError, IndexError):
        pass
    return False


class ClusterError(RuntimeFailure):
    """A node did not start, join or answer."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    dir: Path
    amqp_port: int
    dist_port: int
    mqtt_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "HOME": HOME, "RABBITMQ_NODENAME": self.name,
                "RABBITMQ_NODE_PORT": str(self.amqp_port), "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"), "RABBITMQ_LOG_BASE": str(self.dir / "log"),
                "RABBITMQ_FEATURE_FLAGS_FILE": str(self.dir / "feature_flags"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
                "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"), "ERL_EPMD_ADDRESS": "127.0.0.1"}


class RabbitCluster:
    """`with RabbitCluster(2) as cluster:` nodes up, clustered, session queues mirrored."""

    def __init__(self, nodes: int = 2, *, fd_limit: int = 0, first_mqtt_port: int = 0, mirrors: int = 0) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        if not 0 <= mirrors <= nodes:
            raise ValueError(f"mirrors must be 0 (every node) to {nodes}, got {mirrors}")
        self.mirrors = mirrors
        """Nodes holding each MQTT session queue: 0 = every node. With 2 of 4, a node holds half
        the sessions' queues instead of all of them (open files and memory per node)."""
        self.fd_limit = fd_limit
        """Open files per node (its connections), raised before it starts; 0 = inherited."""
        # Not under pytest's tmp_path: its parents are root's, mode 0700, closed to user rabbitmq.
        self.workdir = Path(tempfile.mkdtemp(prefix="fedmq-rabbit-"))
        tag = f"{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.nodes = [Node(f"fedmq{i}-{tag}@localhost", self.workdir / f"node{i}", _free_port(), _free_port(),
                           (first_mqtt_port if i == 0 and first_mqtt_port else _free_port())) for i in range(nodes)]

    @property
    def url(self) -> str:
        """Every node's MQTT URL, comma-separated: what clients take (each reorders to put its own first)."""
        return ",".join(node.url for node in self.nodes)

    def file_descriptors(self, node: Node) -> dict[str, int]:
        """The node's open-file and socket counts against its limits (`rabbitmqctl status`)."""
        import json

        fds = json.loads(self.ctl(node, "status", "--formatter", "json", timeout=60)).get("file_descriptors", {})
        return {k: int(v) for k, v in fds.items() if isinstance(v, (int, float))}

    def ctl(self, node: Node, *args: str, timeout: float = 120.0) -> str:
        try:
            r = subprocess.run(["runuser", "-u", "rabbitmq", "--", "rabbitmqctl", "-q", "-n", node.name, *args],
                               env=node.env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"rabbitmqctl {' '.join(args)} on {node.name}: no answer in {timeout:.0f} s") from None
        if r.returncode != 0:
            raise ClusterError(f"rabbitmqctl {' '.join(args)} on {node.name}: {r.stdout[-800:]}{r.stderr[-800:]}")
        return r.stdout

    def start(self, timeout: float = 180.0) -> RabbitCluster:
        for node in self.nodes:
            (node.dir / "mnesia").mkdir(parents=True, exist_ok=True)
            (node.dir / "log").mkdir(parents=True, exist_ok=True)
            (node.dir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
            (node.dir / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = {node.amqp_port}\nmqtt.listeners.tcp.default = {node.mqtt_port}\n"
                "mqtt.allow_anonymous = true\nloopback_users = none\n")
        subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", str(self.workdir)], check=True)
        for node in self.nodes:
            self.start_node(node)
        for node in self.nodes:
            self.await_startup(node, timeout)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", first.name)
            self.ctl(node, "start_app")
            self.await_startup(node, timeout)
        mode = (f'"ha-mode":"exactly","ha-params":{self.mirrors}' if self.mirrors and self.mirrors < len(self.nodes)
                else '"ha-mode":"all"')
        self.ctl(first, "set_policy", "--apply-to", "queues", "mqtt-sessions", "^mqtt-subscription-",
                 "{" + mode + ',"ha-sync-mode":"automatic"}')
        for node in self.nodes:
            self.wait_mqtt(node, timeout)
        return self

    def await_startup(self, node: Node, timeout: float) -> None:
        """Until the node has booted (rabbitmqctl fails at once while the VM is not yet registered)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ctl(node, "await_startup", "--timeout", "30", timeout=40)
                return
            except ClusterError:
                if time.monotonic() > deadline or (node.proc is not None and node.proc.poll() is not None):
                    out = (node.dir / "server.out").read_text(errors="replace")[-1500:]
                    raise ClusterError(f"{node.name} did not start within {timeout} s:\n{out}") from None
                time.sleep(0.5)

    def start_node(self, node: Node) -> None:
        log = open(node.dir / "server.out", "ab")  # noqa: SIM115 - the node's lifetime
        command = ["rabbitmq-server"]
        raise_hard = None
        if self.fd_limit:
            # runuser resets the soft limit to 1024, so the node raises it itself; the hard limit
            # (20000 for root here) is raised first where we may (CAP_SYS_RESOURCE, up to fs.nr_open): every
            # connection is a socket and every mirrored session queue keeps files open, and a
            # node out of handles stalls queue declarations without a word (seen at 10,000 agents).
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            n = self.fd_limit
            if hard != resource.RLIM_INFINITY and n > hard:
                if _may_raise_hard_limits():
                    n = min(n, int(Path("/proc/sys/fs/nr_open").read_text()))

                    def raise_hard() -> None:
                        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
                else:
                    n = hard
            command = ["sh", "-c", f"ulimit -n {n} && exec rabbitmq-server"]
        node.proc = subprocess.Popen(["runuser", "-u", "rabbitmq", "--", *command], env=node.env(),
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=raise_hard)

    def wait_mqtt(self, node: Node, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", node.mqtt_port), timeout=2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{node.name}: MQTT listener {node.mqtt_port} not up after {timeout} s") from None
                time.sleep(0.2)

    def restart(self, i: int, timeout: float = 180.0) -> None:
        """Start killed node i again: it rejoins the cluster from its own disk (mnesia)."""
        node = self.nodes[i]
        self.start_node(node)
        self.await_startup(node, timeout)
        self.wait_mqtt(node, timeout)

    def kill(self, i: int) -> None:
        """kill -9 node i (the Erlang VM and its helpers): a machine lost, no goodbye."""
        node = self.nodes[i]
        if node.proc is not None and node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(30)

    def stop(self) -> None:
        for i in range(len(self.nodes)):
            self.kill(i)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RabbitCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
