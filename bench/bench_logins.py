"""Logins at fleet scale: the ACL file `fedmq creds` writes against Mosquitto's dynamic-security
plugin, both giving every agent its own topics only, on Mosquitto 2.0.11.

    .venv/bin/python -m bench logins            # 10,000 agents
    .venv/bin/python -m bench logins --quick    # 500

For each way, with N agents already provisioned:
- provision_s: making the N logins with `make_credentials`; for the plugin, its control API
  (batches of commands) timed for up to 1,000 agents (api_provision_s), since it saves its
  whole state after every command; the N are then written in the plugin's own format.
- start_s: a broker start (a restart) with those N logins, to "running".
- rss_mib: the broker's resident memory right after that start.
- add_agent_s: from deciding to add one agent to its first publish acknowledged with success
  (ACL file: `make_credentials` for N + 1, SIGHUP, connect and publish; plugin: createClient
  with its role, connect and publish). The new agent's publish on another agent's uplink must
  be refused (0x87) in both, or the figure is not reported.

Mosquitto 2.0.11's plugin does not substitute %u in a role's topics (measured here: such a
role grants nothing), so each agent needs a role of its own, as each needs a block in the file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt

from fedmq.broker import MosquittoBroker, find_mosquitto
from fedmq.creds import make_credentials, mosquitto_hash

FLEET = "garage"
DYNSEC_PLUGIN = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so"
BATCH = 500
"""Control-API commands per message."""
NOT_AUTHORIZED = 0x87


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Login:
    """An MQTT 5 client: publish() returns the PUBACK's reason code."""

    def __init__(self, port: int, user: str, password: str) -> None:
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5)
        self.client.username_pw_set(user, password)
        self._cond = threading.Condition()
        self.acks: dict[int, int] = {}
        self.responses: list[dict] = []
        self.connack: int | None = None
        self.subacks: set[int] = set()
        self.client.on_subscribe = self._on_subscribe
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        with self._cond:
            if not self._cond.wait_for(lambda: self.connack is not None, 60):
                raise TimeoutError(f"{user}: no CONNACK")

    def _on_connect(self, client, userdata, flags, reason, properties) -> None:
        with self._cond:
            self.connack = reason.value
            self._cond.notify_all()

    def _on_publish(self, client, userdata, mid, reason, properties) -> None:
        with self._cond:
            self.acks[mid] = reason.value
            self._cond.notify_all()

    def _on_message(self, client, userdata, msg) -> None:
        with self._cond:
            self.responses.append(json.loads(msg.payload))
            self._cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reasons, properties) -> None:
        with self._cond:
            self.subacks.add(mid)
            self._cond.notify_all()

    def wait_suback(self, mid: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: mid in self.subacks, 60):
                raise TimeoutError("no SUBACK")

    def publish(self, topic: str, payload: bytes) -> int:
        mid = self.client.publish(topic, payload, qos=1).mid
        with self._cond:
            if not self._cond.wait_for(lambda: mid in self.acks, 600):
                raise TimeoutError(f"no PUBACK on {topic} in 600 s")
            return self.acks[mid]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _first_publish(port: int, user: str, password: str, other: str) -> tuple[int, int]:
    """(reason code on its own uplink, on `other`'s), retrying the CONNECT until accepted."""
    deadline = time.monotonic() + 60
    while True:
        login = _Login(port, user, password)
        if login.connack == 0:
            break
        login.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{user} never accepted")
    try:
        return (login.publish(f"fedmq/{FLEET}/agents/{user}/up", b"x"),
                login.publish(f"fedmq/{FLEET}/agents/{other}/up", b"x"))
    finally:
        login.close()


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def acl_file(n: int, work: Path) -> dict:
    agents = [f"{FLEET}/car-{i}" for i in range(n)]
    provision_s, creds = _timed(lambda: make_credentials(work / "creds", agents, fleets=[FLEET]))
    conf = work / "acl.conf"
    conf.write_text(f"listener 1883\nallow_anonymous false\npassword_file {creds.passwd}\nacl_file {creds.acl}\n")
    broker = MosquittoBroker.from_file(conf, workdir=work / "acl-broker")
    start_s, _ = _timed(broker.start)
    try:
        assert broker.proc is not None
        rss = _rss_mib(broker.proc.pid)
        t0 = time.perf_counter()
        more = make_credentials(work / "creds", [*agents, f"{FLEET}/car-new"], fleets=[FLEET])
        broker.proc.send_signal(signal.SIGHUP)
        own, other = _first_publish(broker.port, "car-new", more.agents["car-new"], "car-0")
        add_s = time.perf_counter() - t0
    finally:
        broker.stop()
    return {"provision_s": round(provision_s, 2), "start_s": round(start_s, 3), "rss_mib": round(rss, 1),
            "add_agent_s": round(add_s, 3) if own < 0x80 and other == NOT_AUTHORIZED else None,
            "acl_bytes": creds.acl.stat().st_size, "passwd_bytes": creds.passwd.stat().st_size}


def _agent_commands(name: str, password: str) -> list[dict]:
    topic = f"fedmq/{FLEET}/agents/{name}"
    acls = [("publishClientSend", f"{topic}/up"), ("publishClientSend", f"{topic}/status"),
            ("subscribeLiteral", f"{topic}/down"), ("publishClientReceive", f"{topic}/down"),
            ("subscribeLiteral", f"fedmq/{FLEET}/aggregator/status"),
            ("publishClientReceive", f"fedmq/{FLEET}/aggregator/status")]
    return [{"command": "createRole", "rolename": f"agent-{name}",
             "acls": [{"acltype": t, "topic": tp, "allow": True} for t, tp in acls]},
            {"command": "createClient", "username": name, "password": password,
             "roles": [{"rolename": f"agent-{name}"}]}]


def _control(admin: _Login, commands: list[dict]) -> None:
    """Send the commands in batches and wait for every answer; raise on the first error."""
    for i in range(0, len(commands), BATCH):
        with admin._cond:
            before = len(admin.responses)
        admin.publish("$CONTROL/dynamic-security/v1", json.dumps({"commands": commands[i:i + BATCH]}).encode())
        with admin._cond:
            if not admin._cond.wait_for(lambda b=before: len(admin.responses) > b, 3600):
                raise TimeoutError("no answer from the dynamic-security plugin")
            errors = [r for r in admin.responses[-1]["responses"] if r.get("error")]
        if errors:
            raise RuntimeError(f"dynamic-security: {errors[0]}")


def _percent_u_grants_nothing(port: int, admin: _Login) -> bool:
    """A role whose topic says %u: does an agent holding it get its own uplink?"""
    _control(admin, [{"command": "createRole", "rolename": "agents-by-pattern",
                      "acls": [{"acltype": "publishClientSend", "topic": f"fedmq/{FLEET}/agents/%u/up",
                                "allow": True}]},
                     {"command": "createClient", "username": "pattern-probe", "password": "probe-pw",
                      "roles": [{"rolename": "agents-by-pattern"}]}])
    own, _ = _first_publish(port, "pattern-probe", "probe-pw", "car-0")  # 0x10: accepted, no subscriber
    return own == NOT_AUTHORIZED


def _dynsec_client(name: str, password: str) -> tuple[dict, dict]:
    """(client, role) as the plugin itself saves them (same hash as passwd's `$7$`)."""
    parts = mosquitto_hash(password).split("$")  # $7$iterations$salt$hash
    role = _agent_commands(name, password)[0]
    return ({"username": name, "roles": [{"rolename": role["rolename"]}], "password": parts[4],
             "salt": parts[3], "iterations": int(parts[2])},
            {"rolename": role["rolename"], "acls": [{**acl, "priority": 0} for acl in role["acls"]]})


def _dynsec_broker(work: Path, state: Path) -> MosquittoBroker:
    conf = work / "dynsec.conf"
    conf.write_text(f"listener 1883\nallow_anonymous false\nplugin {DYNSEC_PLUGIN}\n"
                    f"plugin_opt_config_file {state}\n")
    return MosquittoBroker.from_file(conf, workdir=work / "dynsec-broker")


def _admin(port: int, password: str) -> _Login:
    admin = _Login(port, "admin", password)
    _, mid = admin.client.subscribe("$CONTROL/dynamic-security/v1/response", qos=1)
    admin.wait_suback(mid)
    return admin


def dynamic_security(n: int, n_api: int, work: Path) -> dict:
    """Provisioning through the control API is timed for `n_api` agents (the plugin saves its
    whole state file after every command, so it grows with the square of the fleet); the
    broker start and the added agent with `n` agents written in the plugin's own format."""
    state = work / "dynsec.json"
    admin_pw = uuid.uuid4().hex
    subprocess.run(["mosquitto_ctrl", "dynsec", "init", str(state), "admin", admin_pw], check=True,
                   capture_output=True)
    broker = _dynsec_broker(work, state)
    broker.start()
    try:
        admin = _admin(broker.port, admin_pw)
        pattern_fails = _percent_u_grants_nothing(broker.port, admin)
        commands = [c for i in range(n_api) for c in _agent_commands(f"api-{i}", f"pw-{i}")]
        api_s, _ = _timed(lambda: _control(admin, commands))
        admin.close()
    finally:
        broker.stop()
    doc = json.loads(state.read_text())
    made = [_dynsec_client(f"car-{i}", f"pw-{i}") for i in range(n)]
    doc["clients"] = [c for c in doc["clients"] if not c["username"].startswith("api-")] + [c for c, _ in made]
    doc["roles"] = [r for r in doc["roles"] if not r["rolename"].startswith("agent-api-")] + [r for _, r in made]
    state.write_text(json.dumps(doc))
    broker = _dynsec_broker(work, state)
    start_s, _ = _timed(broker.start)
    try:
        assert broker.proc is not None
        rss = _rss_mib(broker.proc.pid)
        admin = _admin(broker.port, admin_pw)
        t0 = time.perf_counter()
        _control(admin, _agent_commands("car-new", "new-pw"))
        own, other = _first_publish(broker.port, "car-new", "new-pw", "car-0")
        add_s = time.perf_counter() - t0
        admin.close()
    finally:
        broker.stop()
    return {"api_provision_agents": n_api, "api_provision_s": round(api_s, 2), "start_s": round(start_s, 3),
            "rss_mib": round(rss, 1),
            "add_agent_s": round(add_s, 3) if own < 0x80 and other == NOT_AUTHORIZED else None,
            "state_bytes": state.stat().st_size, "percent_u_in_a_role_grants_nothing": pattern_fails}


def run(quick: bool = False) -> dict:
    if find_mosquitto() is None or not shutil.which("mosquitto_ctrl") or not os.path.exists(DYNSEC_PLUGIN):
        return {"skipped": "needs mosquitto, mosquitto_ctrl and the dynamic-security plugin"}
    n = 500 if quick else 10_000
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = {"agents": n, "acl_file": acl_file(n, work),
               "dynamic_security": dynamic_security(n, min(n, 1000), work)}
    return out
