"""Logins for an aggregator's extra connections: its reply pool and its local reply workers.

broker_config/prod.conf sets `use_username_as_clientid`, so one user is one MQTT session: a
second connection under the aggregator's user would take over the first. The aggregator's
reply pool (its own connection, aggregator/reply_pool.py) and each worker it starts
(`fedmq aggregator --workers N`) therefore log in as users of their own, named after the
aggregator's: `USER-replies`, `USER-worker-0` ... `USER-worker-<N-1>`. Before it takes its
session at all, an aggregator looks at its fleet's status as `USER-probe` (read only): a second
aggregator must decide not to serve before it becomes the session that uplinks are queued in.

Their passwords are derived from the aggregator's (HMAC-SHA256, keyed by its password, of the
derived user's name), so the aggregator needs no second secret, and `fedmq creds --workers N`
writes the matching broker entries without storing anything new. A worker process is given
only its own derived login, never the aggregator's password: a leaked worker environment
exposes a user that can train replies, not one that can answer agents.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from urllib.parse import quote, unquote, urlsplit, urlunsplit

REPLIES = "replies"
PROBE = "probe"

PASSWORD_ENV = "FEDMQ_BROKER_PASSWORD"
"""The broker password of a URL that names a user and no password (`mqtts://car-1@host`): a
password on the command line is visible to every user of the machine (`ps`), one in the
environment only to the process's owner."""


def url_password(raw: str | None) -> str | None:
    """A URL's password (`urlsplit(url).password`, percent-decoded here), else
    FEDMQ_BROKER_PASSWORD, else None."""
    if raw is not None:
        return unquote(raw)
    return os.environ.get(PASSWORD_ENV) or None


def worker_role(i: int) -> str:
    """The role (user suffix) of the aggregator's i-th local reply worker."""
    return f"worker-{i}"


def derived_user(user: str, role: str) -> str:
    return f"{user}-{role}"


def local_worker_users(user: str, n: int) -> list[str]:
    """The logins of the n reply workers `fedmq aggregator --workers n` starts as `user`."""
    return [derived_user(user, worker_role(i)) for i in range(n)]


def derived_password(password: str, user: str) -> str:
    """The password of derived `user`, from its aggregator's password: 43 URL-safe characters."""
    mac = hmac.new(password.encode(), f"fedmq derived login:{user}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def derived_url(url: str, role: str) -> str:
    """`url` (one node, or a comma list) logged in as the derived user for `role`.

    A URL without a user name (an anonymous development broker) is returned as it is: there is
    no session to collide with when the broker does not key sessions by user.
    """
    nodes = []
    for node in str(url).split(","):
        if not node.strip():
            continue
        parts = urlsplit(node.strip())
        if parts.username is None:
            nodes.append(node.strip())
            continue
        user = derived_user(unquote(parts.username), role)
        login = quote(user, safe="")
        password = url_password(parts.password)  # the URL's, else FEDMQ_BROKER_PASSWORD
        if password is not None:
            login += ":" + quote(derived_password(password, user), safe="")
        host = parts.netloc.rsplit("@", 1)[1]
        nodes.append(urlunsplit((parts.scheme, f"{login}@{host}", parts.path, parts.query, parts.fragment)))
    return ",".join(nodes)


def url_user(url: str) -> str | None:
    """The user name of a broker URL's first node, or None."""
    first = str(url).split(",", 1)[0].strip()
    name = urlsplit(first).username
    return unquote(name) if name is not None else None
