"""Make what the production broker (broker_config/prod.conf) needs: a CA, a server certificate,
one random password per agent (plus each fleet's aggregator, monitors and reply workers),
Mosquitto's password file and the ACL that gives each login its role's topics and no more.

    fedmq creds --out deploy/creds --agents car-1,car-2 --hostname broker.example.org
    fedmq creds --out deploy/creds --agents garage/car-1,garage/car-2,depot/van-1 \
                --fleet garage --fleet depot \
                --monitor-user ops,dashboard   # logins aggregator-garage, aggregator-depot

An agent listed as FLEET/AGENT belongs to that fleet only (list it once per fleet it is in);
a bare AGENT belongs to every --fleet (any fleet without --fleet).

prod.conf makes the user name the MQTT client id, so one login is one session: two processes
sharing a login take the session from each other. So every fleet's aggregator and every
monitor gets a login of its own. Without --fleet, or with one, the aggregator's login is
`aggregator` (--aggregator-user); with several, `aggregator-FLEET` each (a fleet keeps the
login an earlier run gave it, so adding a fleet renames nothing). Each aggregator login also
has derived ones (fedmq/service_logins.py): USER-probe, read-only, with which an aggregator
checks that no other one serves its fleet before it takes its session, and with reply
workers USER-replies and USER-worker-I.
    fedmq creds --out deploy/creds --workers 2 --worker gpu-box-1   # reply workers (docs/scaling.md)
    fedmq creds --out deploy/creds --rotate car-1      # then: kill -HUP <mosquitto pid>

Layout of OUT (mount OUT/mosquitto as /mosquitto/config, read-only; nothing secret to the
broker lives outside it, nothing the broker must not hold lives inside it):

    OUT/mosquitto/passwd             user:$7$ PBKDF2-SHA512 hashes   0640 (0600 without --group)
    OUT/mosquitto/acl                per-user ACL: each login its role's topics 0644
    OUT/mosquitto/certs/ca.crt       the CA clients must trust (give it to agents) 0644
    OUT/mosquitto/certs/server.crt   server cert, SANs: hostnames, localhost, 127.0.0.1, ::1
    OUT/mosquitto/certs/server.key   0640 (0600 without --group)
    OUT/private/ca.key               CA key, never on the broker                   0600
    OUT/private/credentials.json     plaintext passwords for provisioning          0600

Mosquitto started as root drops to user `mosquitto` before it reads these files (and re-reads
passwd/acl on SIGHUP as that user), so `--group` (default: the local `mosquitto` group when
it exists; 1883 for the eclipse-mosquitto image) makes the secret ones group-readable.
Re-running keeps the CA, the server cert (unless its names change) and every password of a
user still listed; `--force` makes everything new. See docs/broker.md.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import grp
import hashlib
import ipaddress
import json
import os
import re
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedmq.atomic_file import atomic_write
from fedmq.service_logins import PROBE, REPLIES, derived_password, derived_user, local_worker_users

# mosquitto_passwd 2.0's defaults for its `$7$` (sha512-pbkdf2) format. The passwords made here
# are 192 random bits, so key stretching adds nothing against a stolen passwd file, while every
# CONNECT pays for it on the broker: keep Mosquitto's own count.
PBKDF2_ITERATIONS = 101
SALT_BYTES = 12
PASSWORD_BYTES = 24  # token_urlsafe -> 32 characters

DEFAULT_AGGREGATOR_USER = "aggregator"
CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_BEFORE_DAYS = 30

# A username becomes one topic level through %u: no '/', '+', '#', '%', ':' (passwd field
# separator) or spaces; a letter or digit first so it never looks like an option or $SYS.
_USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class CredentialsError(ValueError):
    """Bad input (a name, a missing file) or a file that could not be written as asked."""


@dataclass
class Credentials:
    """Where `make_credentials` put everything, and the passwords it holds."""

    out_dir: Path
    agents: dict[str, str]  # agent -> password
    aggregator_user: str
    """The first aggregator login (the only one without --fleet or with one fleet)."""
    aggregator_password: str
    monitor_user: str | None = None
    """The first monitor login, if any (`monitors` holds them all)."""
    monitor_password: str | None = None
    aggregators: dict[str, str] = field(default_factory=dict)
    """Every aggregator login: user -> password (aggregator_user's included)."""
    fleet_aggregators: dict[str, str] = field(default_factory=dict)
    """Fleet -> the user of its aggregator; empty: aggregator_user serves any fleet."""
    monitors: dict[str, str] = field(default_factory=dict)
    """Every read-only status login: user -> password."""
    hostnames: list[str] = field(default_factory=list)
    fleets: list[str] = field(default_factory=list)
    """Fleets the ACL grants (empty: any fleet, `+`)."""
    workers: dict[str, str] = field(default_factory=dict)
    """Reply workers on other machines (`fedmq worker`): name -> password; the name is the worker's id."""
    agent_fleets: dict[str, list[str]] = field(default_factory=dict)
    """Agent -> the fleets it belongs to (listed as FLEET/AGENT); an agent not here belongs to
    every fleet the ACL grants."""
    local_workers: int = 0
    """Reply workers the aggregator starts itself (`fedmq aggregator --workers N`); their logins
    are derived from the aggregator's (fedmq/service_logins.py)."""
    revoked: list[str] = field(default_factory=list)  # users dropped by this run
    ca_created: bool = False
    server_cert_created: bool = False

    @property
    def config_dir(self) -> Path:
        """What the broker mounts as /mosquitto/config."""
        return self.out_dir / "mosquitto"

    @property
    def private_dir(self) -> Path:
        return self.out_dir / "private"

    @property
    def passwd(self) -> Path:
        return self.config_dir / "passwd"

    @property
    def acl(self) -> Path:
        return self.config_dir / "acl"

    @property
    def ca_cert(self) -> Path:
        return self.config_dir / "certs" / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.config_dir / "certs" / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.config_dir / "certs" / "server.key"

    @property
    def ca_key(self) -> Path:
        return self.private_dir / "ca.key"

    @property
    def credentials_json(self) -> Path:
        return self.private_dir / "credentials.json"

    def fleets_of(self, agent: str) -> list[str]:
        """The fleets `agent` may work in; ["+"] for any fleet."""
        return self.agent_fleets.get(agent) or list(self.fleets) or ["+"]

    def aggregator_logins(self) -> dict[str, str]:
        """Every aggregator login: user -> password."""
        return {self.aggregator_user: self.aggregator_password, **self.aggregators}

    def all_monitors(self) -> dict[str, str]:
        """Every monitor login: user -> password."""
        first = {self.monitor_user: self.monitor_password} if self.monitor_user and self.monitor_password else {}
        return {**first, **self.monitors}

    def aggregator_for(self, fleet: str) -> tuple[str, str]:
        """(user, password) of `fleet`'s aggregator."""
        if not self.fleet_aggregators:
            return self.aggregator_user, self.aggregator_password
        try:
            user = self.fleet_aggregators[fleet]
        except KeyError:
            raise CredentialsError(f"no aggregator login for fleet {fleet!r}; fleets: "
                                   f"{', '.join(self.fleet_aggregators)}") from None
        return user, self.aggregator_logins()[user]

    def derived_users(self) -> dict[str, str]:
        """Each aggregator's extra logins: its probe's, and with workers its reply pool's and
        one per local worker; passwords derived from the aggregator's, so rotating it rotates
        them."""
        out = {}
        for user, password in self.aggregator_logins().items():
            names = [derived_user(user, PROBE)]
            if self.workers or self.local_workers:
                names += [derived_user(user, REPLIES), *local_worker_users(user, self.local_workers)]
            out.update({n: derived_password(password, n) for n in names})
        return out

    def worker_users(self) -> list[str]:
        """Every user that serves as a reply worker (its name is its worker id)."""
        return sorted(self.workers) + [w for user in self.aggregator_logins()
                                       for w in local_worker_users(user, self.local_workers)]

    def users(self) -> dict[str, str]:
        """Every username -> password the passwd file holds."""
        users = dict(self.agents)
        users.update(self.aggregator_logins())
        users.update(self.all_monitors())
        users.update(self.workers)
        users.update(self.derived_users())
        return users

    def path_map(self) -> dict[str, str]:
        """For `MosquittoBroker(path_map=...)`: prod.conf's container paths -> this dir."""
        return {"/mosquitto/config/": f"{self.config_dir}/"}


# --------------------------------------------------------------------------- passwords


def validate_username(name: str) -> str:
    if not _USERNAME.match(name):
        raise CredentialsError(
            f"bad username {name!r}: use 1-64 of A-Z a-z 0-9 _ . - starting with a letter or "
            "digit (it becomes a topic level, so no '/', '+', '#', '%', ':' or spaces)"
        )
    return name


def validate_fleet(fleet: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fleet) or fleet in (".", ".."):
        raise CredentialsError(f"bad fleet id {fleet!r}: use [A-Za-z0-9_.-], 1-64 characters")
    return fleet


def parse_agents(entries: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`--agents` entries (AGENT or FLEET/AGENT) -> (agents in order, agent -> its named fleets).

    An agent listed only as FLEET/AGENT belongs to the fleets it is listed with; a bare AGENT
    to every fleet, so an agent listed both ways is refused as ambiguous."""
    agents: list[str] = []
    named: dict[str, list[str]] = {}
    bare: set[str] = set()
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        fleet, sep, agent = entry.rpartition("/")
        validate_username(agent)
        if sep:
            named.setdefault(agent, [])
            if validate_fleet(fleet) not in named[agent]:
                named[agent].append(fleet)
        else:
            bare.add(agent)
        if agent not in agents:
            agents.append(agent)
    both = sorted(bare & set(named))
    if both:
        raise CredentialsError(f"agent {both[0]!r} is listed both bare (every fleet) and as FLEET/{both[0]}; "
                               "list it one way")
    return agents, named


def generate_password() -> str:
    return secrets.token_urlsafe(PASSWORD_BYTES)


def mosquitto_hash(
    password: str, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS
) -> str:
    """Mosquitto 2.0's `$7$` password hash: `$7$<iterations>$<b64 salt>$<b64 PBKDF2-SHA512>`,
    the format `mosquitto_passwd -H sha512-pbkdf2` writes (checked against it in the tests)."""
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_mosquitto_hash(password: str, hashed: str) -> bool:
    """Check a password against a `$7$` line as Mosquitto does (for tests and `--check`)."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[1] != "7":
        raise CredentialsError(f"not a Mosquitto $7$ hash: {hashed[:12]}...")
    salt = base64.b64decode(parts[3])
    return secrets.compare_digest(mosquitto_hash(password, salt, int(parts[2])), hashed)


def render_passwd(users: dict[str, str]) -> str:
    return "".join(f"{u}:{mosquitto_hash(p)}\n" for u, p in sorted(users.items()))


# --------------------------------------------------------------------------- ACL


def model_topics(fleet: str) -> list[str]:
    """What the aggregator publishes, retained, for devices to join with: the model graph and the
    device spec (with its pieces)."""
    return [f"fedmq/{fleet}/model/onnx", f"fedmq/{fleet}/model/device", f"fedmq/{fleet}/model/device/+"]


def agent_topics(fleet: str, agent: str) -> list[str]:
    """An agent's ACL lines in one fleet: its own uplink and status, its own downlink, and what
    every member reads (the aggregator's status, the model graph and the device spec)."""
    return [f"topic write fedmq/{fleet}/agents/{agent}/up", f"topic write fedmq/{fleet}/agents/{agent}/status",
            f"topic read fedmq/{fleet}/agents/{agent}/down", f"topic read fedmq/{fleet}/aggregator/status",
            *(f"topic read {t}" for t in model_topics(fleet))]


def render_acl(creds: Credentials) -> str:
    """The ACL for wire protocol v1: a `user` block per login, no `pattern` lines.

    Mosquitto applies a pattern line to every authenticated user, monitors and aggregators
    included, so a pattern for agents would let a monitor upload as agent `monitor`. Here each
    login gets exactly its role's topics (docs/security.md has the table):
    - an agent: its own subtree in each of its fleets (`Credentials.fleets_of`);
    - a fleet's aggregator: that fleet's uplinks and statuses, every downlink, its own status
      and the graph; it writes uplinks and agents' statuses only to delete what an agent left
      retained there, and subscribes with no-local, so what its own login publishes on an
      uplink never reaches it as an upload. Its probe (USER-probe) reads the aggregator status;
    - a reply worker (its user is its worker id): its own jobs, status and done topics; each
      aggregator's reply pool (USER-replies) every worker's in its fleets;
    - a monitor: agents' and aggregator's status, read only.
    Without `creds.fleets` a fleet level is `+` (any fleet).
    """
    scopes = list(creds.fleets) or ["+"]
    served: dict[str, list[str]] = {}  # aggregator user -> its fleets
    for f in scopes:
        served.setdefault(creds.fleet_aggregators.get(f, creds.aggregator_user), []).append(f)
    lines = [
        "# fedmq wire protocol v1 ACL, written by `fedmq creds`: one block per login, each its",
        "# role's topics only. Anonymous clients get nothing (prod.conf refuses them anyway), and",
        "# anything not granted here is denied. No pattern lines: Mosquitto applies those to",
        "# every user, monitors and aggregators included.",
        "",
        "# Agents: each its own subtree in its own fleets.",
    ]
    for agent in sorted(creds.agents):
        lines.append(f"user {agent}")
        for f in creds.fleets_of(agent):
            lines += agent_topics(f, agent)
    lines += ["", "# A fleet's aggregator reads every uplink and status, writes every downlink and its",
              "# status, and may write (empty, to delete) what an agent left retained on its up or",
              "# status topic. Its probe login only reads the aggregator status, before it serves."]
    for user, own in served.items():
        lines.append(f"user {user}")
        for f in own:
            lines += [f"topic readwrite fedmq/{f}/agents/+/up", f"topic readwrite fedmq/{f}/agents/+/status",
                      f"topic write fedmq/{f}/agents/+/down", f"topic readwrite fedmq/{f}/aggregator/status",
                      *(f"topic readwrite {t}" for t in model_topics(f))]
        lines.append(f"user {derived_user(user, PROBE)}")
        lines += [f"topic read fedmq/{f}/aggregator/status" for f in own]
    workers = creds.worker_users()
    if workers:
        lines += ["", "# Reply workers (docs/scaling.md): each reads its own jobs and announces itself and",
                  "# its results on its own topics; its user name is its worker id."]
        for w in workers:
            lines.append(f"user {w}")
            for f in scopes:
                lines += [f"topic read fedmq/{f}/workers/{w}/jobs", f"topic write fedmq/{f}/workers/{w}/status",
                          f"topic write fedmq/{f}/workers/{w}/done"]
        lines += ["", "# Each aggregator's reply pool (its second connection): jobs to every worker, their",
                  "# statuses and results back."]
        for user, own in served.items():
            lines.append(f"user {derived_user(user, REPLIES)}")
            for f in own:
                lines += [f"topic write fedmq/{f}/workers/+/jobs", f"topic read fedmq/{f}/workers/+/status",
                          f"topic read fedmq/{f}/workers/+/done"]
    viewers = list(creds.all_monitors())
    if viewers:
        lines += ["", "# Dashboards (each its own login, so that two run at once): status topics only, read only."]
        for user in viewers:
            lines.append(f"user {user}")
            for f in scopes:
                lines += [f"topic read fedmq/{f}/agents/+/status", f"topic read fedmq/{f}/aggregator/status"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- certificates


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def make_ca(common_name: str = "fedmq broker CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san_entries(hostnames: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for h in hostnames:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            entries.append(x509.DNSName(h))
    return entries


def all_server_names(hostnames: Iterable[str]) -> list[str]:
    """The asked hostnames first, then the loopback names every broker cert carries."""
    names: list[str] = []
    for h in [*hostnames, "localhost", "127.0.0.1", "::1"]:
        h = h.strip()
        if h and h not in names:
            names.append(h)
    return names


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hostnames: Sequence[str]
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_san_entries(hostnames)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _cert_names(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in san]


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted: Mosquitto cannot prompt for a passphrase when it starts unattended.
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# --------------------------------------------------------------------------- files


def resolve_group(group: str | int | None) -> int | None:
    """The gid that gets read access to the broker's secret files, or None.

    None asks for the local `mosquitto` group when it exists and this process may use it."""
    if group is None:
        try:
            gid = grp.getgrnam("mosquitto").gr_gid
        except KeyError:
            return None
        return gid if os.geteuid() == 0 or gid in os.getgroups() else None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise CredentialsError(f"no group named {group!r}; pass a numeric gid (1883 for the eclipse-mosquitto image)") from None


def _write(path: Path, data: bytes | str, mode: int, gid: int | None = None) -> None:
    """Write atomically (a broker reloading on SIGHUP never sees half a file) with `mode`
    from the first byte on, so a secret is never briefly world-readable."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        atomic_write(path, raw, mode=mode, gid=gid)
    except PermissionError:
        if gid is None:
            raise
        raise CredentialsError(
            f"cannot give group {gid} read access to {path}: run as root or as a member "
            "of that group, or pass --group to choose another"
        ) from None


def _mkdir(path: Path, mode: int, gid: int | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if gid is not None:
        try:
            os.chown(path, -1, gid)
        except PermissionError:
            raise CredentialsError(f"cannot give group {gid} access to {path}") from None


def _write_broker_files(creds: Credentials, gid: int | None) -> None:
    secret_mode = 0o640 if gid is not None else 0o600
    _write(creds.passwd, render_passwd(creds.users()), secret_mode, gid)
    _write(creds.acl, render_acl(creds), 0o644, gid)


def _write_credentials_json(creds: Credentials) -> None:
    doc = {
        "version": 1,
        "ca_cert": str(creds.ca_cert.relative_to(creds.out_dir)),
        "hostnames": creds.hostnames,
        "fleets": creds.fleets,
        "aggregator": {"username": creds.aggregator_user, "password": creds.aggregator_password},
        "aggregators": {fleet: {"username": user, "password": creds.aggregator_logins()[user]}
                        for fleet, user in creds.fleet_aggregators.items()},
        "monitor": (
            {"username": creds.monitor_user, "password": creds.monitor_password}
            if creds.monitor_user else None
        ),
        "monitors": creds.all_monitors(),
        "agents": dict(sorted(creds.agents.items())),
        "agent_fleets": dict(sorted(creds.agent_fleets.items())),
        "workers": dict(sorted(creds.workers.items())),
        "local_workers": creds.local_workers,
    }
    _write(creds.credentials_json, json.dumps(doc, indent=2) + "\n", 0o600)


def load_credentials(out_dir: str | os.PathLike[str]) -> Credentials:
    """Read back what `make_credentials` wrote (credentials.json is the source of truth)."""
    out = Path(out_dir)
    path = out / "private" / "credentials.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CredentialsError(f"{path} not found: run `fedmq creds --out {out} --agents ...` first") from None
    monitor = doc.get("monitor") or {}
    per_fleet = doc.get("aggregators") or {}
    return Credentials(
        out_dir=out,
        agents=dict(doc["agents"]),
        aggregator_user=doc["aggregator"]["username"],
        aggregator_password=doc["aggregator"]["password"],
        monitor_user=monitor.get("username"),
        monitor_password=monitor.get("password"),
        aggregators={v["username"]: v["password"] for v in per_fleet.values()},
        fleet_aggregators={f: v["username"] for f, v in per_fleet.items()},
        monitors=dict(doc.get("monitors") or {}),
        hostnames=list(doc.get("hostnames", [])),
        fleets=list(doc.get("fleets", [])),
        workers=dict(doc.get("workers") or {}),
        agent_fleets={a: list(fs) for a, fs in (doc.get("agent_fleets") or {}).items()},
        local_workers=int(doc.get("local_workers") or 0),
    )


# --------------------------------------------------------------------------- API


def make_credentials(
    out_dir: str | os.PathLike[str],
    agents: Iterable[str],
    *,
    aggregator_user: str = DEFAULT_AGGREGATOR_USER,
    monitor_user: str | Sequence[str] | None = None,
    hostnames: Sequence[str] = ("localhost",),
    group: str | int | None = None,
    force: bool = False,
    fleets: Sequence[str] | None = None,
    workers: Iterable[str] | None = None,
    local_workers: int | None = None,
) -> Credentials:
    """Create or update the CA, server cert, passwd, acl and credentials.json under `out_dir`.

    Existing CA, server cert (while its names match and it is not near expiry) and passwords
    of users still listed are kept unless `force`; users no longer listed lose access.
    `fleets` scopes the ACL to those fleet ids and gives each its own aggregator login (module
    docstring), `monitor_user` is one or several monitor logins, `workers` names the reply
    workers on other machines and `local_workers` counts each aggregator's own (None, for
    fleets, workers and local_workers: as the previous run, else any fleet / none).
    """
    out = Path(out_dir)
    agent_list, named_fleets = parse_agents(agents)
    if not agent_list:
        raise CredentialsError("no agents given")
    validate_username(aggregator_user)
    monitor_list = [monitor_user] if isinstance(monitor_user, str) else list(monitor_user or ())
    monitor_list = list(dict.fromkeys(validate_username(m.strip()) for m in monitor_list if m.strip()))
    if local_workers is not None and local_workers < 0:
        raise CredentialsError(f"--workers must be >= 0, got {local_workers}")
    previous: Credentials | None = None
    if not force and (out / "private" / "credentials.json").exists():
        previous = load_credentials(out)
    old_users = previous.users() if previous else {}
    if workers is None:
        worker_list = list(previous.workers) if previous else []
    else:
        worker_list = list(dict.fromkeys(validate_username(w.strip()) for w in workers if w.strip()))
    if local_workers is None:
        local_workers = previous.local_workers if previous else 0
    for f in fleets or ():
        validate_fleet(f)
    fleet_list = list(dict.fromkeys(fleets)) if fleets is not None else (previous.fleets if previous else [])
    if not fleet_list:  # FLEET/AGENT entries name the fleets when --fleet does not
        fleet_list = list(dict.fromkeys(f for fs in named_fleets.values() for f in fs))
    strays = sorted({f for fs in named_fleets.values() for f in fs} - set(fleet_list))
    if strays:
        raise CredentialsError(f"agents name fleet(s) {', '.join(strays)} that no --fleet grants "
                               f"({', '.join(fleet_list)}); add --fleet or fix the agent list")
    fleet_users = _fleet_aggregator_users(aggregator_user, fleet_list, previous)
    aggregator_users = list(dict.fromkeys(fleet_users.values())) or [aggregator_user]
    if set(monitor_list) & set(aggregator_users):
        raise CredentialsError("the monitor and aggregator users must differ")
    derived = {derived_user(u, role) for u in aggregator_users for role in (PROBE, REPLIES)}
    derived |= {w for u in aggregator_users for w in local_worker_users(u, local_workers)}
    reserved = {*aggregator_users, *monitor_list}
    clash = reserved.intersection(agent_list)
    if clash:
        raise CredentialsError(f"agent name(s) {sorted(clash)} are taken by the service users")
    clash = (reserved | set(agent_list)).intersection(worker_list)
    if clash:
        raise CredentialsError(f"worker name(s) {sorted(clash)} are taken by agents or service users")
    clash = derived.intersection(agent_list + worker_list + sorted(reserved))
    if clash:
        raise CredentialsError(f"name(s) {sorted(clash)} are the aggregator's own logins "
                               f"(fedmq/service_logins.py); choose others")
    gid = resolve_group(group)

    logins = {u: old_users.get(u) or generate_password() for u in aggregator_users}
    monitors = {m: old_users.get(m) or generate_password() for m in monitor_list}
    first = aggregator_users[0]
    creds = Credentials(
        out_dir=out,
        agents={a: old_users.get(a) or generate_password() for a in agent_list},
        aggregator_user=first,
        aggregator_password=logins[first],
        monitor_user=monitor_list[0] if monitor_list else None,
        monitor_password=monitors[monitor_list[0]] if monitor_list else None,
        aggregators=logins,
        fleet_aggregators=fleet_users,
        monitors=monitors,
        hostnames=all_server_names(hostnames),
        fleets=fleet_list,
        workers={w: old_users.get(w) or generate_password() for w in worker_list},
        agent_fleets=named_fleets,
        local_workers=local_workers,
    )
    creds.revoked = sorted(set(old_users) - set(creds.users()))

    out.mkdir(parents=True, exist_ok=True)
    _mkdir(creds.private_dir, 0o700)
    _mkdir(creds.config_dir, 0o750 if gid is not None else 0o755, gid)
    _mkdir(creds.config_dir / "certs", 0o750 if gid is not None else 0o755, gid)

    # CA: kept across runs, so agents provisioned with ca.crt keep trusting the broker.
    if not force and creds.ca_key.exists() and creds.ca_cert.exists():
        ca_key = serialization.load_pem_private_key(creds.ca_key.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise CredentialsError(f"{creds.ca_key} is not an EC key made by fedmq creds")
    else:
        ca_key, ca_cert = make_ca()
        _write(creds.ca_key, _key_pem(ca_key), 0o600)
        _write(creds.ca_cert, _cert_pem(ca_cert), 0o644, gid)
        creds.ca_created = True

    server_ok = False
    if not creds.ca_created and creds.server_cert.exists() and creds.server_key.exists():
        current = x509.load_pem_x509_certificate(creds.server_cert.read_bytes())
        server_ok = (
            sorted(_cert_names(current)) == sorted(creds.hostnames)
            and current.issuer == ca_cert.subject
            and current.not_valid_after_utc - _now() > dt.timedelta(days=RENEW_BEFORE_DAYS)
        )
    if not server_ok:
        server_key, server_cert = make_server_cert(ca_key, ca_cert, creds.hostnames)
        _write(creds.server_key, _key_pem(server_key), 0o640 if gid is not None else 0o600, gid)
        _write(creds.server_cert, _cert_pem(server_cert), 0o644, gid)
        creds.server_cert_created = True

    _write_broker_files(creds, gid)
    _write_credentials_json(creds)
    return creds


def _fleet_aggregator_users(base: str, fleets: Sequence[str], previous: Credentials | None) -> dict[str, str]:
    """Fleet -> its aggregator's user: `base` for a lone fleet, `base-FLEET` for each of several,
    except that a fleet keeps the user an earlier run gave it (adding a fleet renames nothing).
    Empty for any fleet (`base` serves them all)."""
    if not fleets:
        return {}
    before = dict(previous.fleet_aggregators) if previous else {}
    if previous and not before and len(previous.fleets) == 1:
        before = {previous.fleets[0]: previous.aggregator_user}  # written before per-fleet logins
    if previous and previous.aggregator_user != base and not previous.fleet_aggregators:
        before = {}
    users = {}
    for f in fleets:
        kept = before.get(f)
        users[f] = kept if kept and (kept == base or kept.startswith(f"{base}-")) else (
            base if len(fleets) == 1 else validate_username(f"{base}-{f}"))
    clash = [u for u in users.values() if list(users.values()).count(u) > 1]
    if clash:
        raise CredentialsError(f"fleets would share the aggregator login {clash[0]!r}; "
                               f"one login is one MQTT session under prod.conf")
    return users


def rotate_password(
    out_dir: str | os.PathLike[str], user: str, *, group: str | int | None = None
) -> str:
    """Give `user` (an agent, or a service user) a new random password; return it.

    Rewrites passwd and credentials.json. The broker still accepts the old password until it
    re-reads passwd (SIGHUP or restart); connections made before that stay up (see docs)."""
    creds = load_credentials(out_dir)
    new = generate_password()
    if user in creds.agents:
        creds.agents[user] = new
    elif user in creds.aggregator_logins():
        creds.aggregators[user] = new
        if user == creds.aggregator_user:
            creds.aggregator_password = new
    elif user in creds.all_monitors():
        creds.monitors[user] = new
        if user == creds.monitor_user:
            creds.monitor_password = new
    elif user in creds.workers:
        creds.workers[user] = new
    elif user in creds.derived_users():
        owner = max((u for u in creds.aggregator_logins() if user.startswith(f"{u}-")), key=len)
        raise CredentialsError(f"{user}'s password is derived from {owner}'s: "
                               f"rotate {owner} (both change together)")
    else:
        raise CredentialsError(f"unknown user {user!r}; known: {sorted(creds.users())}")
    gid = resolve_group(group)
    if gid is None and group is None and creds.passwd.exists():
        # keep whatever group the first run chose
        st = creds.passwd.stat()
        gid = st.st_gid if st.st_mode & 0o040 else None
    _write(creds.passwd, render_passwd(creds.users()), 0o640 if gid is not None else 0o600, gid)
    _write_credentials_json(creds)
    return new


# --------------------------------------------------------------------------- CLI


def read_agents_file(path: str | os.PathLike[str]) -> list[str]:
    """One AGENT or FLEET/AGENT per line; blank lines and '#' comments are skipped."""
    names = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory to write (see layout above)")
    parser.add_argument("--agents", default="",
                        help="comma-separated agents, each AGENT (a member of every --fleet) or FLEET/AGENT "
                             "(a member of that fleet; list it once per fleet); the name is its MQTT user")
    parser.add_argument("--agents-file", type=Path, help="file with one AGENT or FLEET/AGENT per line")
    parser.add_argument("--aggregator-user", default=DEFAULT_AGGREGATOR_USER,
                        help="the aggregator's login; with several --fleet, each fleet's is USER-FLEET")
    parser.add_argument("--monitor-user", action="append", default=None, metavar="USER",
                        help="also make a read-only login for status topics (e.g. monitor); repeatable or "
                             "comma-separated: one per dashboard or `fedmq fleet status` that runs at once")
    parser.add_argument("--hostname", action="append", default=[],
                        help="broker name for the server cert (repeatable or comma-separated); "
                             "localhost, 127.0.0.1 and ::1 are always added")
    parser.add_argument("--group", default=None,
                        help="group (name or gid) that may read passwd and server.key; default: "
                             "the local 'mosquitto' group if any; 1883 for the eclipse-mosquitto image")
    parser.add_argument("--fleet", action="append", default=None, metavar="FLEET",
                        help="grant topics of this fleet only (repeatable; default: any fleet id). "
                             "Bounds what an agent can keep retained on the broker to its own two "
                             "topics per fleet; several fleets get an aggregator login each "
                             "(USER-FLEET); a re-run without it keeps the previous choice")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="users for the N reply workers `fedmq aggregator --workers N` starts, and for "
                             "its reply pool; their passwords derive from the aggregator's (default: as "
                             "the previous run, else 0)")
    parser.add_argument("--worker", action="append", default=None, metavar="NAME",
                        help="a reply worker on another machine (`fedmq worker`), its own user and "
                             "password; NAME is its worker id (repeatable or comma-separated; default: "
                             "as the previous run)")
    parser.add_argument("--rotate", metavar="USER", help="only give USER a new password")
    parser.add_argument("--force", action="store_true", help="new CA, server cert and passwords")


def run(args: argparse.Namespace) -> int:
    try:
        if args.rotate:
            rotate_password(args.out, args.rotate, group=args.group)
            print(f"new password for {args.rotate} in {args.out / 'private' / 'credentials.json'}")
            print("the broker accepts it after a reload: kill -HUP <mosquitto pid> "
                  "(or docker compose kill -s HUP mosquitto)")
            return 0
        agents = [a for a in args.agents.split(",") if a.strip()]
        if args.agents_file:
            agents += read_agents_file(args.agents_file)
        if not agents and (args.out / "private" / "credentials.json").exists() and not args.force:
            before = load_credentials(args.out)  # re-run: e.g. new hostnames; memberships kept
            agents = [f"{f}/{a}" for a in before.agents for f in before.agent_fleets.get(a, [])] + \
                     [a for a in before.agents if a not in before.agent_fleets]
        hostnames = [h for arg in args.hostname for h in arg.split(",") if h.strip()] or ["localhost"]
        creds = make_credentials(
            args.out, agents, aggregator_user=args.aggregator_user,
            monitor_user=[m for arg in args.monitor_user or () for m in arg.split(",")],
            hostnames=hostnames, group=args.group, force=args.force,
            fleets=args.fleet,
            workers=None if args.worker is None else [w for arg in args.worker for w in arg.split(",")],
            local_workers=args.workers,
        )
    except (CredentialsError, OSError) as e:
        print(f"fedmq creds: {e}", file=sys.stderr)
        return 2
    aggregators = ", ".join(f"{u} ({f})" for f, u in creds.fleet_aggregators.items()) or creds.aggregator_user
    scoped = len(creds.agent_fleets)
    print(f"{len(creds.agents)} agents" + (f" ({scoped} in named fleets only)" if scoped else "")
          + f", users {aggregators}"
          + "".join(f", {m}" for m in creds.all_monitors())
          + (f", reply workers {', '.join(creds.worker_users())}" if creds.worker_users() else "")
          + f"; fleets: {', '.join(creds.fleets) or 'any'}")
    print(f"CA: {'new' if creds.ca_created else 'kept'} ({creds.ca_cert}); server cert: "
          f"{'new' if creds.server_cert_created else 'kept'} for {', '.join(creds.hostnames)}")
    if creds.revoked:
        print(f"removed users (reload the broker to lock them out): {', '.join(creds.revoked)}")
    print(f"mount {creds.config_dir} as /mosquitto/config; passwords: {creds.credentials_json}")
    return 0
