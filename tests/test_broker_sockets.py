"""Where Mosquitto listens and whom it runs as, read from the system rather than its config.

Mosquitto 2.0.11 opens a WebSockets listener on an IPv6 socket that ignores an IPv4 bind
address: `listener 9001 127.0.0.1` with `protocol websockets` listens on `*:9001` unless the
listener also says `socket_domain ipv4`. So every shipped config, the launcher's configs and
`fedmq broker` are started here and their listening sockets taken from `ss`; `fedmq broker`
started by root must run Mosquitto as user mosquitto, with files that user can reach.
"""

from __future__ import annotations

import itertools
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from fedmq.broker import (
    REPO_BROKER_CONFIG,
    BrokerError,
    MosquittoBroker,
    find_mosquitto,
    listening_sockets,
)
from fedmq.creds import load_credentials, make_credentials
from tests.cli_process import BIN, ROOT, CliProcess, cli_env

pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read listening sockets"),
]

ROOT_USER = os.geteuid() == 0
NAMESPACES = itertools.count()
RUNNING = r"mosquitto version \S+ running"

SHIPPED = {
    "dev.conf": {"127.0.0.1:1883", "127.0.0.1:9001"},
    # No address on purpose: every interface of the container (docker-compose.secure.yml).
    "prod.conf": {"0.0.0.0:8883", "[::]:8883", "*:9883"},
}
"""What `ss -ltn` shows for each file of broker_config/ started as written."""


def listening(pid: int | None = None, prefix: tuple[str, ...] = ()) -> set[str]:
    """Local addresses (`ss` notation) of the TCP sockets listening in this network namespace
    (or the one `prefix` enters), only process `pid`'s when given."""
    out = subprocess.run([*prefix, "ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=60).stdout
    return {line.split()[3] for line in out.splitlines() if pid is None or f"pid={pid}," in line}


def uids(pid: int) -> set[int]:
    """Real, effective, saved and filesystem uid of process `pid`."""
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(ln for ln in status.splitlines() if ln.startswith("Uid:"))
    return {int(u) for u in line.split()[1:]}


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A scratch dir user mosquitto can enter (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="fedmq-sockets-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def netns() -> Iterator[tuple[str, ...]]:
    """A private network namespace (only loopback): the shipped configs' own ports are free there."""
    if not ROOT_USER or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a private network namespace")
    name = f"fedmq-sock-{os.getpid()}-{next(NAMESPACES)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield ("ip", "netns", "exec", name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _as_shipped(text: str, root: Path) -> str:
    """The config as written, but for the container paths, which point into `root`, and the
    log on stderr (Mosquitto does not flush stdout into a pipe)."""
    creds = make_credentials(root / "creds", ["a1"])
    data = root / "data"
    data.mkdir()
    if ROOT_USER:
        account = pwd.getpwnam("mosquitto")  # a config without `user` drops to it under root
        os.chown(data, account.pw_uid, account.pw_gid)
    text = text.replace("/mosquitto/config/", f"{creds.config_dir}/").replace("/mosquitto/data/", f"{data}/")
    return re.sub(r"^log_dest stdout$", "log_dest stderr", text, flags=re.M)


def test_every_shipped_config_has_an_expectation() -> None:
    assert sorted(p.name for p in REPO_BROKER_CONFIG.glob("*.conf")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_listens_where_it_says(name: str, open_dir: Path, netns: tuple[str, ...]) -> None:
    text = (REPO_BROKER_CONFIG / name).read_text()
    conf = open_dir / name
    conf.write_text(_as_shipped(text, open_dir))
    assert re.findall(r"^listener.*$", conf.read_text(), re.M) == re.findall(r"^listener.*$", text, re.M)
    with CliProcess([find_mosquitto() or "mosquitto", "-c", str(conf)], cwd=open_dir, prefix=netns) as proc:
        proc.wait_for(RUNNING, timeout=60)
        # The namespace is private: whatever listens there is this broker.
        assert listening(prefix=netns) == SHIPPED[name], proc.output[-2000:]


def test_dev_conf_in_compose_listens_on_every_interface_of_the_container(open_dir: Path,
                                                                         netns: tuple[str, ...]) -> None:
    """docker-compose.yml drops the loopback address (the host publishes on its loopback)."""
    rendered = re.sub(r"^(listener \d+) 127\.0\.0\.1$", r"\1", (REPO_BROKER_CONFIG / "dev.conf").read_text(),
                      flags=re.M)
    conf = open_dir / "compose-dev.conf"
    conf.write_text(_as_shipped(rendered, open_dir))
    with CliProcess([find_mosquitto() or "mosquitto", "-c", str(conf)], cwd=open_dir, prefix=netns) as proc:
        proc.wait_for(RUNNING, timeout=60)
        assert listening(prefix=netns) == {"0.0.0.0:1883", "[::]:1883", "0.0.0.0:9001"}, proc.output[-2000:]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_launcher_listens_on_loopback_only(name: str, tmp_path: Path) -> None:
    creds = make_credentials(tmp_path / "creds", ["a1"])
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / name, path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        assert broker.proc is not None and broker.ws_port is not None
        assert listening(broker.proc.pid) == {f"127.0.0.1:{port}" for port in broker.ports}


def test_launcher_stops_a_broker_listening_beyond_its_config(tmp_path: Path) -> None:
    broker = MosquittoBroker.dev(workdir=tmp_path / "broker")
    ws = broker.ws_port
    text = broker.config_path.read_text()
    assert f"listener {ws} 127.0.0.1\n" in text
    broker.config_path.write_text(text.replace(f"listener {ws} 127.0.0.1\n", f"listener {ws}\n"))
    try:
        with pytest.raises(BrokerError, match=rf"listens on .*:{ws}.* not exactly on .*127\.0\.0\.1:{ws}"):
            broker.start()
        assert broker.proc is None
        assert not any(a.endswith(f":{ws}") for a in listening())
    finally:
        broker.close()


def test_sockets_are_found_by_uid_and_port_where_the_fds_are_closed(mosquitto: MosquittoBroker,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Root without CAP_SYS_PTRACE (a container) cannot read the fds of a Mosquitto that
    dropped to its own user; the check still sees where it listens."""
    assert mosquitto.proc is not None
    pid = mosquitto.proc.pid
    wanted = {("127.0.0.1", port) for port in mosquitto.ports}
    assert listening_sockets(pid, mosquitto.ports) == wanted
    real = os.listdir

    def closed(path):
        if str(path) == f"/proc/{pid}/fd":
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(os, "listdir", closed)
    assert listening_sockets(pid, mosquitto.ports) == wanted


# --------------------------------------------------------------------------- `fedmq broker`


def _connects(port: int, *, websockets: bool, ca: Path | None = None, user: str | None = None,
              password: str | None = None) -> bool:
    """Whether an MQTT client gets a successful CONNACK from 127.0.0.1:`port`."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user or "sockets-check",
                    transport="websockets" if websockets else "tcp")
    if ca is not None:
        c.tls_set(ca_certs=str(ca))
    if user is not None:
        c.username_pw_set(user, password)
    answered = threading.Event()
    ok: list[bool] = []
    c.on_connect = lambda client, userdata, flags, rc, props: (ok.append(not rc.is_failure), answered.set())
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        assert answered.wait(60), f"no CONNACK from 127.0.0.1:{port}"
    finally:
        c.disconnect()
        c.loop_stop()
    return ok[0]


def _mosquitto_uid() -> int:
    if not ROOT_USER:
        return os.getuid()  # Mosquitto started by another user keeps running as that user
    try:
        return pwd.getpwnam("mosquitto").pw_uid
    except KeyError:
        pytest.skip("no mosquitto user on this machine (`fedmq broker` refuses under root: tested below)")


@pytest.mark.parametrize("config", ["dev.conf", "prod.conf"])
def test_fedmq_broker_listens_on_loopback_only_as_user_mosquitto(config: str, open_dir: Path) -> None:
    uid = _mosquitto_uid()
    argv = ["fedmq", "broker", "--port", "0"]
    creds = None
    if config == "prod.conf":  # as docs/security.md runs it, with `fedmq creds`' files
        made = subprocess.run(["fedmq", "creds", "--out", str(open_dir / "creds"), "--agents", "car-1"],
                              env=cli_env(), capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr
        creds = load_credentials(open_dir / "creds")
        argv += ["--config", "broker_config/prod.conf", "--creds", str(open_dir / "creds"),
                 "--workdir", str(open_dir / "broker")]
    with CliProcess(argv, cwd=ROOT, env=cli_env()) as proc:
        url = proc.wait_for(r"^url: mqtts?://127\.0\.0\.1:(\d+)$", timeout=60)
        ws = proc.wait_for(r"^ws_url: wss?://127\.0\.0\.1:(\d+)$", timeout=60)
        pid = int(proc.wait_for(r"^mosquitto pid (\d+),", timeout=60).group(1))
        port, ws_port = int(url.group(1)), int(ws.group(1))
        assert listening(pid) == {f"127.0.0.1:{port}", f"127.0.0.1:{ws_port}"}
        assert uids(pid) == {uid}
        if creds is None:
            assert _connects(port, websockets=False) and _connects(ws_port, websockets=True)
        else:  # it read passwd, the ACL and the key as that user
            login = {"ca": creds.ca_cert, "user": "car-1", "password": creds.agents["car-1"]}
            assert _connects(port, websockets=False, **login)
            assert _connects(ws_port, websockets=True, **login)
            assert not _connects(port, websockets=False, **{**login, "password": "wrong"})
        assert proc.stop(signal.SIGTERM) == 0, proc.output[-2000:]
    if creds is not None:  # persistence saved on SIGTERM, by that user
        store = open_dir / "broker" / "mosquitto.db"
        assert store.exists(), (open_dir / "broker" / "mosquitto.log").read_text()[-2000:]
        assert store.stat().st_uid == uid


def _refusal(*args: str) -> str:
    done = subprocess.run([str(BIN / "fedmq"), "broker", "--port", "0", *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not done.stdout.startswith("url:"), done.stdout
    return done.stderr


@pytest.mark.skipif(not ROOT_USER, reason="Mosquitto switches users only when started by root")
def test_fedmq_broker_refuses_a_work_dir_user_mosquitto_cannot_write(tmp_path: Path) -> None:
    _mosquitto_uid()
    err = _refusal("--workdir", str(tmp_path / "broker"))  # below pytest's 0700 tmp dir
    assert err.startswith("fedmq broker: user mosquitto") and f"cannot write the broker's work dir {tmp_path}" in err


@pytest.mark.skipif(not ROOT_USER, reason="Mosquitto switches users only when started by root")
def test_fedmq_broker_refuses_creds_user_mosquitto_cannot_read(tmp_path: Path) -> None:
    _mosquitto_uid()
    make_credentials(tmp_path / "creds", ["car-1"])  # below pytest's 0700 tmp dir
    err = _refusal("--config", "broker_config/prod.conf", "--creds", str(tmp_path / "creds"))
    assert err.startswith("fedmq broker: user mosquitto") and f"cannot read {tmp_path}/creds/mosquitto/" in err


@pytest.mark.skipif(not ROOT_USER, reason="Mosquitto switches users only when started by root")
def test_launcher_refuses_a_user_that_does_not_exist() -> None:
    with pytest.raises(BrokerError, match=r"^started as root, Mosquitto runs as user fedmq-nobody-here, which "
                                          r"does not exist") as e:
        MosquittoBroker.dev(user="fedmq-nobody-here")
    assert "\n" not in str(e.value)
