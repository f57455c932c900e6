"""Start and stop a real Mosquitto for development, the demo, the simulator and the tests.

`MosquittoBroker` runs the `mosquitto` binary on a loopback port with a config derived from
one of the files in broker_config/: listeners (MQTT and MQTT over WebSockets alike) are moved
to the chosen ports, persistence and
logs go to the broker's own work dir, and container paths (`/mosquitto/config/...`) are
mapped to local ones. The broker is stopped by pid, never by name, so tests can run many.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MOSQUITTO_CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
REPO_BROKER_CONFIG = Path(__file__).resolve().parent.parent / "broker_config"


class BrokerError(RuntimeError):
    """The broker could not be found, started or stopped."""


def find_mosquitto() -> str | None:
    for c in MOSQUITTO_CANDIDATES:
        path = shutil.which(c)
        if path:
            return path
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"broker exited with code {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2) as sock:
            # On loopback a connect to a free port in the ephemeral range can meet itself (TCP
            # simultaneous open) before the broker binds, and then holds the port it wants.
            if sock.getsockname() != sock.getpeername():
                return
        time.sleep(0.02)
    raise BrokerError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


_LISTENER = re.compile(r"^(\s*listener\s+)(\d+)(.*)$")
_PROTOCOL = re.compile(r"^\s*protocol\s+(\S+)")
_CERTFILE = re.compile(r"^\s*certfile\s")


def listener_kinds(text: str) -> list[tuple[str, bool]]:
    """(protocol, tls) of each listener of a Mosquitto config, in order: protocol is `mqtt` or
    `websockets` (a `protocol` line below the listener), tls whether a `certfile` follows it
    before the next listener. The browser agent needs the WebSocket one's port and scheme."""
    kinds: list[list] = []
    for line in text.splitlines():
        if _LISTENER.match(line):
            kinds.append(["mqtt", False])
        elif kinds and (m := _PROTOCOL.match(line)):
            kinds[-1][0] = m.group(1)
        elif kinds and _CERTFILE.match(line):
            kinds[-1][1] = True
    return [(k, tls) for k, tls in kinds]


_RUNNING = re.compile(rb"mosquitto version \S+ running")
"""What Mosquitto logs once every listener is bound (at log_type information, which
`rewrite_config` turns on)."""
_DROPPED = ("persistence_location", "log_dest", "pid_file", "user", "log_type")


def rewrite_config(
    text: str,
    ports: list[int],
    workdir: Path,
    path_map: dict[str, str] | None = None,
    bind: str = "127.0.0.1",
) -> str:
    """Move the config's listeners onto `ports` (in order) bound to `bind`, persistence and
    logs into `workdir`, and container paths to local paths.

    Lines that would make the broker escape the test (pid files, dropping to another user that
    cannot read the test's files, logging elsewhere) are replaced.
    """
    out: list[str] = []
    listener_no = 0
    for line in text.splitlines():
        stripped = line.strip()
        m = _LISTENER.match(line)
        if m:
            if listener_no >= len(ports):
                raise BrokerError(f"config has more listeners than the {len(ports)} ports given")
            out.append(f"listener {ports[listener_no]} {bind}")
            listener_no += 1
            continue
        if stripped and stripped.split()[0] in _DROPPED:
            continue
        for src, dst in (path_map or {}).items():
            line = line.replace(src, dst)
        out.append(line)
    if listener_no == 0:
        out.insert(0, f"listener {ports[0]} {bind}")
    out += [
        f"persistence_location {workdir}/",
        f"log_dest file {workdir / 'mosquitto.log'}",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
    ]
    if os.geteuid() == 0:
        # Mosquitto started as root drops to user `mosquitto`, who cannot read a test's files.
        out.append("user root")
    return "\n".join(out) + "\n"


class MosquittoBroker:
    """A Mosquitto process on free loopback ports; a context manager.

        with MosquittoBroker.from_file("broker_config/dev.conf") as broker:
            url = broker.url            # mqtt://127.0.0.1:PORT
    """

    def __init__(
        self,
        config_text: str,
        *,
        listeners: int | None = None,
        path_map: dict[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        ports: list[int] | None = None,
    ) -> None:
        self.binary = find_mosquitto()
        if self.binary is None:
            raise BrokerError(
                "mosquitto not found; install it (apt-get install mosquitto) or run `make test`"
            )
        n = listeners or max(1, sum(1 for ln in config_text.splitlines() if _LISTENER.match(ln)))
        self.ports = ports or [free_port() for _ in range(n)]
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedmq-mosquitto-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "mosquitto.conf"
        self.config_path.write_text(rewrite_config(config_text, self.ports, self.workdir, path_map))
        self.kinds = listener_kinds(config_text)
        self.proc: subprocess.Popen | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kw) -> MosquittoBroker:
        return cls(Path(path).read_text(), **kw)

    @classmethod
    def dev(cls, **kw) -> MosquittoBroker:
        return cls.from_file(REPO_BROKER_CONFIG / "dev.conf", **kw)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def ws_port(self) -> int | None:
        """The port of the first MQTT-over-WebSockets listener, None if the config has none."""
        for port, (proto, _) in zip(self.ports, self.kinds, strict=False):
            if proto == "websockets":
                return port
        return None

    @property
    def ws_url(self) -> str | None:
        """ws://127.0.0.1:PORT (wss:// when that listener has TLS), None without one."""
        for port, (proto, tls) in zip(self.ports, self.kinds, strict=False):
            if proto == "websockets":
                return f"{'wss' if tls else 'ws'}://{self.host}:{port}"
        return None

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        if self.proc is not None and self.proc.poll() is None:
            return self
        try:
            logged = self.log_path.stat().st_size  # a restart appends to the same log
        except OSError:
            logged = 0
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            self._wait_running(logged, deadline)
            for port in self.ports:
                wait_for_port(self.host, port, max(0.0, deadline - time.monotonic()), self.proc)
        except BrokerError as e:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            self.stop()
            raise BrokerError(f"{e}\nstderr: {err}\nlog:\n{self.log_tail()}") from None
        except BaseException:  # a signal while it starts: __exit__ will not run, so stop it here
            self.stop()
            raise
        return self

    def _wait_running(self, logged: int, deadline: float) -> None:
        """Until this process logs that it runs, i.e. it has bound every listener. A port that
        accepts connections is not proof: between `free_port` and the broker's bind another
        process may take a port, and if it listens there, a broker that then failed to bind
        (and exits) would look up to a connect."""
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise BrokerError(f"broker exited with code {code} before listening")
            try:
                with self.log_path.open("rb") as f:
                    f.seek(logged)
                    if _RUNNING.search(f.read()):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise BrokerError(f"the broker did not say it was running within its deadline (ports {self.ports})")

    def stop(self, kill: bool = False, timeout: float = 5.0) -> None:
        """SIGTERM (or SIGKILL with `kill`) by pid; persistence is written on SIGTERM."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        if proc.stderr:
            proc.stderr.close()

    def restart(self, kill: bool = False) -> None:
        """Stop and start on the same ports with the same persistence store."""
        self.stop(kill=kill)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the old socket may linger briefly
            try:
                self.start()
                return
            except BrokerError:
                time.sleep(0.2)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
