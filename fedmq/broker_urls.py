"""Broker URLs (`mqtt://[user[:pass]@]host[:port]`, a cluster's nodes comma-separated) as
addresses, without paho: config checks and `--dry-run` parse them, and fedmq/transport.py
connects to them. This module imports nothing of fedmq but errors, redaction and logins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from fedmq.errors import UsageError
from fedmq.redact import mask_secrets
from fedmq.service_logins import url_password

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


class TransportError(RuntimeError):
    """The broker could not be reached, refused us, or did not answer in time."""


class BadBrokerURL(TransportError, UsageError):
    """A broker URL that cannot be parsed (exit status 2)."""


@dataclass(frozen=True)
class BrokerAddress:
    """One broker node to connect to; its password stays out of repr (and so out of logs)."""

    host: str
    port: int
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def parse_broker_urls(text: str) -> list[BrokerAddress]:
    """One broker URL, or the nodes of a broker cluster separated by commas: a client connects
    to the first that answers and, when its connection drops and the same node refuses the
    reconnect, moves on to the next (docs/scaling.md). All nodes use one scheme."""
    urls = [u.strip() for u in str(text).split(",") if u.strip()]
    if not urls:
        raise BadBrokerURL("the broker URL is empty (expected mqtt://host[:port])")
    addrs = [parse_broker_url(u) for u in urls]
    if len({a.tls for a in addrs}) > 1:
        raise BadBrokerURL(f"broker URLs {mask_secrets(text)!r} mix mqtt:// and mqtts://; use one for every node")
    return addrs


def parse_broker_url(url: str) -> BrokerAddress:
    """`mqtt://[user[:pass]@]host[:port]` (1883) or `mqtts://...` (8883, TLS).

    User and password are percent-decoded, so a password may hold `@` or `:` as %40 / %3A.
    A URL with a user and no password takes the password from FEDMQ_BROKER_PASSWORD.
    """
    shown = mask_secrets(url)
    try:
        parts = urlsplit(url.strip())
    except ValueError as e:
        raise BadBrokerURL(f"broker URL {shown!r} is not a valid URL: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise BadBrokerURL(
            f"broker URL {shown!r}: scheme must be mqtt:// or mqtts://, not {parts.scheme or 'none'!r}"
        )
    if not parts.hostname:
        raise BadBrokerURL(f"broker URL {shown!r} has no host (expected {scheme}://host[:port])")
    try:
        port = parts.port
    except ValueError:
        raise BadBrokerURL(f"broker URL {shown!r}: port must be a number in 1-65535") from None
    if port == 0:
        raise BadBrokerURL(f"broker URL {shown!r}: port must be a number in 1-65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadBrokerURL(f"broker URL {shown!r}: unexpected path, query or fragment after the port")
    username = unquote(parts.username) if parts.username is not None else None
    if parts.password is not None and not username:
        raise BadBrokerURL(f"broker URL {shown!r}: a password needs a user name (user:pass@host)")
    return BrokerAddress(parts.hostname, port or DEFAULT_PORTS[scheme], scheme == "mqtts",
                         username or None, url_password(parts.password) if username else None)
