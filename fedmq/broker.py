"""Start and stop a real Mosquitto for development, the demo, the simulator and the tests.

`MosquittoBroker` runs the `mosquitto` binary on a loopback port with a config derived from
one of the files in broker_config/: listeners (MQTT and MQTT over WebSockets alike) are moved
to the chosen ports, persistence and
logs go to the broker's own work dir, and container paths (`/mosquitto/config/...`) are
mapped to local ones. The broker is stopped by pid, never by name, so tests can run many.

Where it listens is checked, not assumed: once it runs, the sockets the process listens on
(read from /proc) must be exactly its loopback ports, or it is stopped. Mosquitto 2.0.11
binds a WebSockets listener's IPv4 address only with `socket_domain ipv4`; without it
`listener 9001 127.0.0.1` listens on every interface, IPv4 and IPv6.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

MOSQUITTO_CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
REPO_BROKER_CONFIG = Path(__file__).resolve().parent.parent / "broker_config"


class BrokerError(RuntimeError):
    """The broker could not be found, started or stopped. `detail`: its stderr and log, when it
    died starting (the message itself is one line)."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def _startup_failure(log: str, ports: list[int]) -> str:
    """One line for why Mosquitto exited while it started, from its log's error lines."""
    errors = [ln.split("Error:", 1)[1].strip() for ln in log.splitlines() if "Error:" in ln]
    if any("Address already in use" in e for e in errors):
        opened = re.findall(r"listen socket on port (\d+)", log)  # the last one tried is taken
        busy = opened[-1] if opened else ", ".join(map(str, ports))
        return (f"port {busy} is already in use by another process; stop it, or pass --port 0 "
                "(and --ws-port 0) for free ports")
    if errors:
        return f"mosquitto stopped while starting: {errors[-1]}"
    return "mosquitto stopped while starting; its log has no error line (see the log for more)"


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
_DROPPED = ("persistence_location", "log_dest", "pid_file", "user", "log_type",
            "socket_domain", "bind_interface")
"""Keys the launcher sets itself: where the broker writes, whom it runs as, where it listens."""
_DEFAULT_LISTENER = ("port", "bind_address")
_READ_AS_USER = re.compile(
    r"^\s*(password_file|acl_file|cafile|certfile|keyfile|crlfile|psk_file|dhparamfile|capath)\s+(\S.*?)\s*$")
"""Files Mosquitto reads after it has dropped to its user (and re-reads on SIGHUP)."""


def _listener_lines(port: int, bind: str) -> list[str]:
    """A listener on exactly `bind`: with `socket_domain` of the address's family, because
    Mosquitto 2.0.11's WebSockets listeners open an IPv6 socket and ignore an IPv4 address
    unless the listener is IPv4-only (measured with `ss -ltnp`: `*:9001` without it)."""
    family = "ipv6" if ipaddress.ip_address(bind).version == 6 else "ipv4"
    return [f"listener {port} {bind}", f"socket_domain {family}"]


def rewrite_config(
    text: str,
    ports: list[int],
    workdir: Path,
    path_map: dict[str, str] | None = None,
    bind: str = "127.0.0.1",
    user: str | None = None,
) -> str:
    """Move the config's listeners onto `ports` (in order) bound to `bind`, persistence and
    logs into `workdir`, and container paths to local paths.

    Lines that would make the broker escape the launcher (pid files, logging elsewhere, its
    own bind interface or address family) are replaced. Started as root, Mosquitto runs as
    `user`; without one it stays root.
    """
    out: list[str] = []
    listener_no = 0
    for line in text.splitlines():
        stripped = line.strip()
        m = _LISTENER.match(line)
        if m:
            if listener_no >= len(ports):
                raise BrokerError(f"config has more listeners than the {len(ports)} ports given")
            out += _listener_lines(ports[listener_no], bind)
            listener_no += 1
            continue
        key = stripped.split()[0] if stripped else ""
        if key in _DEFAULT_LISTENER:
            raise BrokerError(f"the config's `{stripped}` opens a listener the launcher cannot place; "
                              "write it as a `listener PORT` line")
        if key in _DROPPED:
            continue
        for src, dst in (path_map or {}).items():
            line = line.replace(src, dst)
        out.append(line)
    if listener_no == 0:
        out[:0] = _listener_lines(ports[0], bind)
    out += [
        f"persistence_location {workdir}/",
        f"log_dest file {workdir / 'mosquitto.log'}",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
    ]
    if os.geteuid() == 0:
        # No user: root, since the test harness keeps work dirs and creds in pytest's 0700 tmp dirs.
        out.append(f"user {user or 'root'}")
    return "\n".join(out) + "\n"


def listening_sockets(pid: int, ports: Iterable[int] = ()) -> set[tuple[str, int]] | None:
    """(address, port) of every TCP socket process `pid` listens on, from /proc (its own
    network namespace); None where /proc cannot tell (not Linux, or not allowed).

    Sockets are the process's by inode; where its fds cannot be read (root without
    CAP_SYS_PTRACE, as in a container, once Mosquitto has dropped to its user), those of its
    uid on one of `ports`."""
    inodes: set[str] | None = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
    except OSError:
        inodes = None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        uid = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:"))
        tables = [Path(f"/proc/{pid}/net/{t}").read_text().splitlines()[1:] for t in ("tcp", "tcp6")]
    except (OSError, StopIteration):
        return None
    wanted = set(ports)
    found: set[tuple[str, int]] = set()
    for row in (r.split() for rows in tables for r in rows):
        if len(row) < 10 or row[3] != "0A":  # 0A: LISTEN
            continue
        addr, port = row[1].split(":")
        if not (row[9] in inodes if inodes is not None else row[7] == uid and int(port, 16) in wanted):
            continue
        raw = bytes.fromhex(addr)
        # The kernel prints each 32-bit word of the address in host (little-endian) order.
        packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        found.add((str(ipaddress.ip_address(packed)), int(port, 16)))
    return found


def _show(sockets: set[tuple[str, int]]) -> str:
    return ", ".join(f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in sorted(sockets)) or "nothing"


def _account(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        raise BrokerError(f"started as root, Mosquitto runs as user {user}, which does not exist on this "
                          f"machine; create it (the mosquitto package does) or start as another user") from None


_CHECK_ACCESS = 'i=0; for a; do p=${a#?:}; case $a in r:*) test -r "$p" ;; *) test -w "$p" -a -x "$p" ;; esac || { echo $i; exit 1; }; i=$((i+1)); done'
"""Prints the index of the first path the shell's user may not read (r:) or write into (w:)."""


def _denied(account: pwd.struct_passwd, needs: list[tuple[str, Path]]) -> int | None:
    """Index of the first of `needs` that `account` is denied, asked of the kernel as that user
    (its groups, ACLs and every directory above count); None if it may do them all."""
    groups = os.getgrouplist(account.pw_name, account.pw_gid)
    done = subprocess.run(["/bin/sh", "-c", _CHECK_ACCESS, "sh", *(f"{m}:{p}" for m, p in needs)],
                          user=account.pw_uid, group=account.pw_gid, extra_groups=groups,
                          capture_output=True, text=True, timeout=30)
    if done.returncode == 0:
        return None
    try:
        return int(done.stdout.strip())
    except ValueError:
        raise BrokerError(f"cannot check file access as user {account.pw_name}: {done.stderr.strip()}") from None


class MosquittoBroker:
    """A Mosquitto process on free loopback ports; a context manager.

        with MosquittoBroker.from_file("broker_config/dev.conf") as broker:
            url = broker.url            # mqtt://127.0.0.1:PORT

    Started as root it runs as root unless `user` names the account Mosquitto should drop to
    (`fedmq broker` names `mosquitto`); that user must be able to use the work dir and files.
    """

    def __init__(
        self,
        config_text: str,
        *,
        listeners: int | None = None,
        path_map: dict[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        ports: list[int] | None = None,
        user: str | None = None,
    ) -> None:
        self.binary = find_mosquitto()
        if self.binary is None:
            raise BrokerError(
                "mosquitto not found; install it (apt-get install mosquitto) or run `make test`"
            )
        n = listeners or max(1, sum(1 for ln in config_text.splitlines() if _LISTENER.match(ln)))
        self.ports = ports or [free_port() for _ in range(n)]
        self._own_workdir = workdir is None
        self.user = user if os.geteuid() == 0 else None  # a non-root Mosquitto does not switch
        account = _account(self.user) if self.user else None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedmq-mosquitto-"))
        made = self._own_workdir or not self.workdir.exists()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "mosquitto.conf"
        self.config_path.write_text(rewrite_config(config_text, self.ports, self.workdir, path_map, user=self.user))
        self.kinds = listener_kinds(config_text)
        self.proc: subprocess.Popen | None = None
        if account is not None:
            try:
                self._prepare_for(account, made)
            except BrokerError:
                self.close()
                raise

    def _prepare_for(self, account: pwd.struct_passwd, made: bool) -> None:
        """Let Mosquitto work as `account` after it drops root: it writes the log and
        persistence into the work dir and reads the config (again on SIGHUP) and the files it
        names as that user. A work dir this launcher made becomes the user's; anything else
        it cannot reach is refused here, in one line, rather than found by Mosquitto failing
        to start or, for persistence, only logging that every save fails."""
        if made:
            os.chown(self.workdir, account.pw_uid, account.pw_gid)
        self.config_path.chmod(0o644)  # paths and settings only: the secrets are in files it names
        name = account.pw_name
        needs = [("w", self.workdir, f"cannot write the broker's work dir {self.workdir}: give it to {name} "
                                     f"(chown {name}: DIR) and make every directory above it searchable (o+x)")]
        if self.log_path.exists():
            needs.append(("w", self.log_path, f"cannot append to {self.log_path}: chown {name}: it"))
        for line in self.config_path.read_text().splitlines():
            if m := _READ_AS_USER.match(line):
                needs.append(("r", Path(m.group(2)), f"cannot read {m.group(2)} ({m.group(1)}): make it readable "
                              f"by group {name} (`fedmq creds` does) and the directories above it searchable (o+x)"))
        denied = _denied(account, [(mode, path) for mode, path, _ in needs])
        if denied is not None:
            raise BrokerError(f"user {name}, whom Mosquitto runs as when started by root, {needs[denied][2]}")

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
            wrong = self._misplaced()  # inside: a signal while /proc is read must stop it too
        except BrokerError as e:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            self.stop()
            log_text = self.log_tail()
            raise BrokerError(f"{e}: {_startup_failure(log_text + err, self.ports)}",
                              detail=f"stderr: {err}\nlog:\n{log_text}") from None
        except BaseException:  # a signal while it starts: __exit__ will not run, so stop it here
            self.stop()
            raise
        if wrong:
            self.stop()
            raise BrokerError(wrong)
        return self

    def _misplaced(self) -> str | None:
        """Why the running broker listens somewhere its config does not say, if it does."""
        assert self.proc is not None
        found = listening_sockets(self.proc.pid, self.ports)
        wanted = {(self.host, port) for port in self.ports}
        if found is None or found == wanted:
            return None
        return (f"mosquitto listens on {_show(found)}, not exactly on {_show(wanted)} as its config says; "
                "stopped it rather than serve there")

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
