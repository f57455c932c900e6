"""The MQTT transport both sides share: connect, subscribe, publish with a bounded window, ack.

It moves bytes and knows nothing of envelopes (fedmq/protocol.py) or chunking. It wraps one
paho-mqtt 2.x client whose network loop runs in paho's own thread, because the aggregator and
the agents are threaded programs:

    settings = BrokerSettings(url="mqtt://127.0.0.1:1883")
    with MqttTransport("agg-1", settings, will=Will(status_topic, b"offline")) as mqtt:
        mqtt.subscribe("fedmq/default/agents/+/up", on_update)      # handler on paho's thread
        mqtt.publish(topic, payload).wait(10)                        # True once PUBACKed

Delivery model (what the aggregator and agents rely on):

- Sessions are persistent by default (MQTT v5 `clean_start` off with a session expiry, or
  MQTT 3.1.1 `clean_session` off): QoS 1 messages published while a client is away are queued
  by the broker and delivered when it comes back with the same client id.
- Those queued messages arrive right after CONNACK, before any SUBSCRIBE could be answered.
  A message that finds no handler is parked and handed to the first handler later
  registered with a matching `subscribe()`; so subscribing before or after `connect()` both
  see the backlog, in order.
- At most `settings.max_inflight` QoS 1 publishes are unacknowledged at a time (clamped to
  the broker's MQTT v5 Receive Maximum); `publish()` blocks while the window is full. This is
  back-pressure, and it keeps paho far from its 65,535 message-id limit.
- With `manual_ack=True` a received QoS 1 message is acknowledged only by `ack(message)`.
  Until then the broker keeps it in flight for this client and redelivers it (dup flag set)
  after the next reconnect with the same session; it is never redelivered on a live
  connection. Unacked messages occupy the broker's per-client inflight window
  (`max_inflight_messages`, 64 in broker_config/dev.conf): once it is full the broker stops
  delivering, so ack promptly.
- `close()` sends DISCONNECT, so the broker does NOT publish the will: publish your own
  "offline" status before closing. `kill()` drops the socket without DISCONNECT (tests,
  crash drills), and the broker publishes the will.
- A publish or subscribe the broker refuses (MQTT 5 reason code >= 0x80, e.g. 0x87 Not
  authorized for an ACL-denied QoS 1 publish) is counted in `refused` and goes to
  `on_refused_hooks`; unless a hook reports it, one warning line names the login and the topic.
  Mosquitto 2.0.11 grants an ACL-denied SUBSCRIBE (0x01) and drops the messages instead.
- Another client that connects with this client id takes the session: the broker says so
  (DISCONNECT 0x8E) or, as Mosquitto 2.0.11 does, just closes the connection, and the two then
  take it from each other at every reconnect. `on_taken_over_hooks` hear of it
  (see `TAKEOVER_STRIKES`); a hook may `give_up()`.

Many connections in one process (the fleet simulator): paho's own loop is one thread per
client and uses select(), which fails once a file descriptor passes 1023 (about 340
clients, each holding a socket and a wake-up socket pair). A `NetworkLoop` serves any
number of transports from one thread with epoll, through paho's external-loop API
(loop_read / loop_write / loop_misc), and needs one descriptor per client:

    network = NetworkLoop()
    agents = [MqttTransport(f"a{i}", settings, network=network) for i in range(1000)]
    with use_network(network):          # or: transports made meanwhile (e.g. inside EdgeAgent)
        ...                             # that are given no network= use this one
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.client import topic_matches_sub
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fedmq.broker_urls import (  # noqa: F401 (parsed without paho for config checks; importable from here as before)
    DEFAULT_PORTS,
    BadBrokerURL,
    BrokerAddress,
    TransportError,
    parse_broker_url,
    parse_broker_urls,
)
from fedmq.config import BrokerSettings
from fedmq.errors import RuntimeFailure, UsageError
from fedmq.logs import event, get_logger

log = get_logger("transport")

PARKED_LIMIT = 10_000
"""Messages held for lack of a handler (see MqttTransport.subscribe); beyond it they are dropped."""
PROTOCOL_NAMES = {MQTTProtocolVersion.MQTTv5: "5", MQTTProtocolVersion.MQTTv311: "3.1.1"}
NOT_AUTHORIZED = 0x87
LOGIN_REFUSALS = ("Bad user name or password", "Not authorized")
"""CONNACK reasons that refuse the login itself (MQTT 5 and 3.1.1 names alike)."""
SESSION_TAKEN_OVER = 0x8E
TAKEOVER_STRIKES = 3
"""Connections in a row that the broker closed within TAKEOVER_WINDOW_S of their CONNACK, with
no DISCONNECT and while it went on answering (`broker_answers`, right after each): taken for
another client with our id. Mosquitto 2.0.11 closes a taken-over connection without saying
why, and two processes with one id then take the session from each other at every reconnect
(every reconnect_min_s). A broker that restarts closes connections the same way (even on
SIGTERM) and may be back before the reconnect, but it does not answer the probe while it goes
down; a reload that cuts a rotated login is followed by a refused reconnect, which starts the
count again. The first cut of a long-lived connection does not count, so of two such
processes the one that connected last reaches this first."""
TAKEOVER_WINDOW_S = 10.0
_TAKEOVER_PROBES = threading.BoundedSemaphore(4)
"""Probes under way in this process: many cuts at once are the broker's doing (a restart cuts
every client of a simulated fleet together), not takeovers, and go unprobed and uncounted."""
PROTOCOL_CHOICES = {
    "auto": (MQTTProtocolVersion.MQTTv5, MQTTProtocolVersion.MQTTv311),
    "5": (MQTTProtocolVersion.MQTTv5,),
    "3.1.1": (MQTTProtocolVersion.MQTTv311,),
}


class _GatedClient(paho.Client):
    """paho's client with a gate on reading new packets, so a pause takes effect at once.

    Without it, the read that delivered the message which filled the consumer's queue goes on
    reading: paho's loop_read reads as many packets as it has unacknowledged publishes (after
    a long pause, hundreds of queued replies), and a 256-message bound measured 447. Closed,
    the gate refuses the first byte of the next packet (paho takes it as EAGAIN); a packet
    already begun is always finished. `allow` lets that many packets through (keepalive)."""

    gate_closed = False
    allow = 0

    def _sock_recv(self, bufsize: int) -> bytes:
        packet = getattr(self, "_in_packet", None)  # paho 2.x internals; without them gate every read
        if self.gate_closed and (not isinstance(packet, dict) or packet.get("command", 0) == 0):
            if self.allow <= 0:
                raise BlockingIOError()
            self.allow -= 1
        return super()._sock_recv(bufsize)


class BrokerUnreachable(TransportError, RuntimeFailure):
    """connect() failed: no broker there, it refused us, or it did not answer (exit status 1).
    `login_refused`: the broker answered and refused the user or password."""

    def __init__(self, message: str, *, login_refused: bool = False) -> None:
        super().__init__(message)
        self.login_refused = login_refused


class NetworkLoop:
    """One network thread (epoll) for many paho clients, in place of one thread per client.

    Socket registration and write interest come from paho's socket callbacks (any thread);
    reads, writes, keepalive (`loop_misc`, once a second per client) and reconnects with
    backoff run on this loop's thread, so every transport handler runs there: a handler that
    blocks stalls every connection of the loop. Started on first use, stopped by `close()`.

    Reading can be paused per client (`MqttTransport.pause_reading`): its socket stays
    registered for writes only, so its publishes, acks and PINGREQs still go out while TCP
    flow control holds the broker's messages back. A paused client still reads once every
    half keepalive (a packet or so) so that paho, which closes a connection that has received
    nothing for a keepalive after a PINGREQ, keeps it open.
    """

    MISC_INTERVAL_S = 1.0

    def __init__(self, name: str = "fedmq-network") -> None:
        self.name = name
        self._sel = selectors.DefaultSelector()
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._clients: dict[paho.Client, MqttTransport] = {}
        self._reconnect: dict[paho.Client, tuple[float, float]] = {}
        """client -> (when, current delay)."""
        self._paused: dict[_GatedClient, float] = {}
        """client -> when it last read while paused."""
        self._writing: set[Any] = set()
        """Sockets with data waiting to be written."""
        self.keepalive_reads = 0
        """Reads made for keepalive's sake while a client was paused."""
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    # -- paho socket callbacks (any thread) ----------------------------------------------

    def _apply(self, sock: Any, client: paho.Client) -> None:
        """Register `sock` for what it needs now: reads unless paused, writes when pending."""
        events = (0 if client in self._paused else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if sock in self._writing else 0)
        with contextlib.suppress(KeyError, ValueError, OSError):
            if not events:
                self._sel.unregister(sock)
                return
            try:
                self._sel.modify(sock, events, client)
            except KeyError:
                self._sel.register(sock, events, client)

    def register(self, sock: Any, client: paho.Client) -> None:
        with self._lock:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            self._writing.discard(sock)
            self._apply(sock, client)
        self._ensure_started()
        self._wake()

    def forget(self, sock: Any) -> None:
        with self._lock, contextlib.suppress(KeyError, ValueError, OSError):
            self._writing.discard(sock)
            self._sel.unregister(sock)

    def _on_socket_close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self.forget(sock)

    def _on_register_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with self._lock:
            self._writing.add(sock)
            self._apply(sock, client)
        self._wake()

    def _on_unregister_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        """paho says its queue is empty, but another thread may have queued a packet since it
        looked: paho's `_registered_write` flag was still set then, so that thread did not
        register the write, and dropping write interest now would strand the packet for good
        (a SUBSCRIBE never sent: the 10,000-agent soak's lost SUBACKs). So write interest
        follows paho's queue itself, here and after every write."""
        self._match_write_interest(sock, client)

    def _match_write_interest(self, sock: Any, client: paho.Client) -> None:
        """Watch `sock` for writability exactly while paho has bytes queued (a no-op, on the
        write path, when that is already so)."""
        with self._lock:
            wants = client.want_write()
            if wants == (sock in self._writing):
                return
            if wants:
                self._writing.add(sock)
            else:
                self._writing.discard(sock)
            self._apply(sock, client)

    def pause(self, client: _GatedClient) -> None:
        """Stop reading `client`'s socket (writes go on) until `resume`: the socket leaves the
        read set, and the client's gate stops the read in progress at the next packet."""
        with self._lock:
            if client in self._paused:
                return
            client.gate_closed = True
            self._paused[client] = time.monotonic()
            sock = client.socket()
            if sock is not None:
                self._apply(sock, client)

    def resume(self, client: _GatedClient) -> None:
        with self._lock:
            if self._paused.pop(client, None) is None:
                return
            client.gate_closed = False
            sock = client.socket()
            if sock is not None:
                self._apply(sock, client)
        self._wake()

    def _keepalive_reads(self, now: float) -> None:
        with self._lock:
            due = [c for c, last in self._paused.items()
                   if c in self._clients and now - last >= self._clients[c].settings.keepalive_s / 2]
            for c in due:
                self._paused[c] = now
        for client in due:
            if client.socket() is not None:
                self.keepalive_reads += 1
                client.allow = 1
                client.loop_read()

    def install(self, client: paho.Client) -> None:
        """Route a new client's socket callbacks here (before its first connect)."""
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write

    # -- transports ------------------------------------------------------------------------

    def attach(self, client: paho.Client, transport: MqttTransport) -> None:
        with self._lock:
            self._clients[client] = transport
        self._ensure_started()

    def detach(self, client: paho.Client) -> None:
        with self._lock:
            self._clients.pop(client, None)
            self._reconnect.pop(client, None)
            self._paused.pop(client, None)
            sock = client.socket()
            if sock is not None:
                self.forget(sock)

    def reconnect_later(self, client: paho.Client, min_s: float, max_s: float) -> None:
        with self._lock:
            if client not in self._clients:
                return
            _, delay = self._reconnect.get(client, (0.0, 0.0))
            delay = min(max(min_s, delay * 2), max_s)
            self._reconnect[client] = (time.monotonic() + delay, delay)
        self._wake()

    # -- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_misc = time.monotonic() + self.MISC_INTERVAL_S
        while not self._stopping:
            try:
                events = self._sel.select(timeout=0.2)
            except OSError:  # a socket closed under us: its callback will unregister it
                time.sleep(0.001)
                continue
            for key, mask in events:
                client = key.data
                if client is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_r.recv(4096)
                    continue
                if client.socket() is not key.fileobj:
                    self.forget(key.fileobj)
                    continue
                if mask & selectors.EVENT_READ:
                    client.loop_read()
                if mask & selectors.EVENT_WRITE and client.socket() is not None:
                    client.loop_write()
                    self._match_write_interest(key.fileobj, client)
            now = time.monotonic()
            if now >= next_misc:
                next_misc = now + self.MISC_INTERVAL_S
                with self._lock:
                    clients = list(self._clients)
                for client in clients:
                    client.loop_misc()
                if self._paused:
                    self._keepalive_reads(now)
            self._reconnect_due(now)

    def _reconnect_due(self, now: float) -> None:
        with self._lock:
            due = [(c, d) for c, (when, d) in self._reconnect.items() if when <= now]
        for client, delay in due:
            with self._lock:
                transport = self._clients.get(client)
                self._reconnect.pop(client, None)
            if transport is None or transport._closed:
                continue
            try:
                client.reconnect()
            except (OSError, ssl.SSLError, ValueError) as e:
                transport._short_cuts = 0  # the broker is away (restarting, unreachable), not taken
                event(log, "transport.reconnect_failed", logging.DEBUG, client=transport.client_id,
                      error=str(e), retry_in_s=min(delay * 2, transport.settings.reconnect_max_s))
                transport._next_node(client)
                with self._lock:
                    self._reconnect[client] = (now + delay, delay)
                self.reconnect_later(client, transport.settings.reconnect_min_s,
                                     transport.settings.reconnect_max_s)

    def close(self) -> None:
        """Stop the thread (transports still attached lose their network)."""
        self._stopping = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


_default_network: NetworkLoop | None = None


def default_network() -> NetworkLoop | None:
    """The loop `use_network` set for this process, if any."""
    return _default_network


@contextlib.contextmanager
def use_network(network: NetworkLoop | None):
    """Transports created in this block without `network=` use `network` (process-wide)."""
    global _default_network
    previous, _default_network = _default_network, network
    try:
        yield network
    finally:
        _default_network = previous


def _connect_failure(e: OSError, where: str, host: str) -> str:
    """One line saying why a TCP/TLS connection to the broker failed and what to check."""
    if isinstance(e, ConnectionRefusedError):
        return (f"connection to {where} refused: no broker listens there; start one "
                f"(`fedmq broker`) or pass the right --broker URL")
    if isinstance(e, TimeoutError):
        return (f"no answer from {where} within the timeout; check the host and port "
                f"in --broker and that a firewall lets them through")
    if isinstance(e, socket.gaierror):
        return f"cannot resolve broker host {host!r}: {e.strerror or e}; check --broker"
    if isinstance(e, ssl.SSLError):
        return (f"TLS handshake with {where} failed: {e}; check --ca-file (the CA that "
                f"signed the broker's certificate)")
    return f"cannot connect to {where}: {e}; check --broker"


def broker_answers(addr: BrokerAddress, settings: BrokerSettings, protocol: MQTTProtocolVersion | None,
                   timeout_s: float = 5.0) -> bool:
    """Whether the broker at `addr` answers a CONNECT now, with any CONNACK (a refusal too).

    The probe is anonymous, with a client id of its own, a clean start and no session: it takes
    nobody's session (a login's would, where the broker makes the user name the client id)."""
    v5 = protocol == MQTTProtocolVersion.MQTTv5
    probe = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"fedmq-probe-{os.urandom(6).hex()}",
                        clean_session=None if v5 else True,
                        protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311)
    answered = threading.Event()
    probe.on_connect = lambda *_args: answered.set()
    kwargs: dict[str, Any] = {}
    if v5:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0
        kwargs = {"clean_start": True, "properties": props}
    try:
        if addr.tls:
            probe.tls_set(ca_certs=settings.ca_file or None, certfile=settings.cert_file or None,
                          keyfile=settings.key_file or None)
            probe.tls_insecure_set(settings.tls_insecure)
        probe.connect_timeout = timeout_s
        probe.connect(addr.host, addr.port, keepalive=max(5, int(timeout_s) * 2), **kwargs)
        deadline = time.monotonic() + timeout_s
        while not answered.is_set() and time.monotonic() < deadline:
            if probe.loop(timeout=0.05) != MQTTErrorCode.MQTT_ERR_SUCCESS:
                break
    except (OSError, ssl.SSLError, ValueError):
        return False
    finally:
        with contextlib.suppress(Exception):
            probe.disconnect()
            probe.loop(timeout=0.01)
        sock = probe.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        _close_wakeup_pair(probe)
    return answered.is_set()


def check_reachable(url: str, timeout_s: float = 10.0) -> None:
    """Raise BrokerUnreachable (the message a start would give) when nothing accepts a TCP
    connection at the broker URL: a service checks this before minutes of set-up, then
    connects for real (authentication and TLS are checked there)."""
    addrs = parse_broker_urls(url)
    failures = []
    for addr in addrs:  # one of a cluster's nodes is enough: clients fail over to the others
        where = f"{'mqtts' if addr.tls else 'mqtt'}://{addr.host}:{addr.port}"
        try:
            socket.create_connection((addr.host, addr.port), timeout=timeout_s / len(addrs)).close()
            return
        except OSError as e:
            failures.append(_connect_failure(e, where, addr.host))
    raise BrokerUnreachable("; ".join(failures))


TLS_FILES = (("ca_file", "--ca-file", "the CA certificate that signed the broker's (`fedmq creds` "
                                      "writes it to OUT/mosquitto/certs/ca.crt)"),
             ("cert_file", "--cert-file", "this client's certificate"),
             ("key_file", "--key-file", "the key of this client's certificate"))


def check_tls_files(settings: BrokerSettings) -> None:
    """Raise UsageError (exit status 2) naming the first TLS file the settings name that is not
    a readable file: `--dry-run` says so, rather than the first connect minutes later."""
    for attr, flag, what in TLS_FILES:
        path = getattr(settings, attr)
        if not path:
            continue
        problem = ("no such file" if not Path(path).exists() else "not a file" if not Path(path).is_file()
                   else "not readable" if not os.access(path, os.R_OK) else "")
        if problem:
            raise UsageError(f"{flag} (broker.{attr}) {path}: {problem}; pass {what}")


@dataclass(frozen=True)
class Will:
    """Published by the broker when this client vanishes without DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class Message:
    """One received PUBLISH. `mid` and `qos` are what `MqttTransport.ack` needs."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    mid: int
    dup: bool = False
    """Set by the broker on a redelivery; the application must dedupe (by msg_id)."""
    connection: int = 0
    """Which connection of this transport it arrived on; an ack on a later one is void."""


@dataclass(frozen=True)
class Refusal:
    """The broker said no to one publish (its PUBACK) or subscribe (its SUBACK): MQTT 5 only,
    since a 3.1.1 PUBACK has no reason code."""

    kind: str
    """publish or subscribe"""
    topic: str
    code: int
    reason: str
    """The reason code's name and value, e.g. `Not authorized (0x87)`."""
    login: str | None
    """The user name this transport logs in with (None: anonymous)."""

    @property
    def not_authorized(self) -> bool:
        """The ACL forbids it: the same request will be refused again."""
        return self.code == NOT_AUTHORIZED


Handler = Callable[[Message], None]
ConnectHook = Callable[["MqttTransport", bool], None]
DisconnectHook = Callable[["MqttTransport", str], None]
RefusedHook = Callable[["MqttTransport", Refusal], bool | None]
TakenOverHook = Callable[["MqttTransport", str], None]


class PublishHandle:
    """The fate of one publish: `wait()` for its PUBACK (QoS 1) or its write (QoS 0)."""

    def __init__(self, mid: int, topic: str, qos: int, on_done: Callable[[], None] | None,
                 on_refused: Callable[[str, ReasonCode], None] | None = None) -> None:
        self.mid = mid
        self.topic = topic
        self.qos = qos
        self._on_refused = on_refused
        self.reason: str | None = None
        """None while pending; the broker's reason code name once done; an error text on failure."""
        self._failed = False
        self._event = threading.Event()
        self._on_done = on_done

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once acknowledged, False on timeout.

        Raises TransportError when the broker refused the message (MQTT v5 reason code, e.g.
        not authorized) or the transport was closed before the acknowledgement came.
        """
        if not self._event.wait(timeout):
            return False
        if self._failed:
            raise TransportError(f"publish to {self.topic!r} (mid {self.mid}) failed: {self.reason}")
        return True

    def _resolve(self, outcome: ReasonCode | _Abandoned) -> None:
        """paho's PUBACK reason (or write, at QoS 0), or why it will never come."""
        if isinstance(outcome, ReasonCode):
            if (self._complete(_reason_text(outcome), outcome.is_failure) and outcome.is_failure
                    and self._on_refused is not None):
                self._on_refused(self.topic, outcome)
        else:
            self._complete(str(outcome), True)

    def _complete(self, reason: str, failed: bool) -> bool:
        if self._event.is_set():
            return False
        self.reason, self._failed = reason, failed
        self._event.set()  # before freeing the window slot: a waiter never sees a freed slot early
        if self._on_done is not None:
            self._on_done()
        return True


class _Abandoned(str):
    """Why an awaited acknowledgement will never come (the transport was closed)."""


class _MidBook:
    """Pairs a paho callback for message id `mid` with its waiter, in either order.

    paho may answer (on its thread) before `publish()`/`subscribe()` has returned the mid to
    us; the answer is then parked until the waiter is registered.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, Callable[[Any], None]] = {}
        self._early: dict[int, Any] = {}

    def expect(self, mid: int, complete: Callable[[Any], None]) -> None:
        with self._lock:
            if mid not in self._early:
                self._waiting[mid] = complete
                return
            value = self._early.pop(mid)
        complete(value)

    def resolve(self, mid: int, value: Any) -> None:
        with self._lock:
            complete = self._waiting.pop(mid, None)
            if complete is None:
                self._early[mid] = value
                return
        complete(value)

    def drain(self) -> list[Callable[[Any], None]]:
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
            self._early.clear()
        return waiting


class _Window:
    """A counting window whose limit can shrink to what the broker allows.

    While `open` is set (the transport's reads are paused), nobody waits: the PUBACKs that
    would free the window are not being read, so a full window lets messages through
    uncounted (paho queues them) instead of deadlocking the publisher.
    """

    def __init__(self, limit: int) -> None:
        self._cond = threading.Condition()
        self.limit = max(1, limit)
        self.outstanding = 0
        self.open = False

    def acquire(self, timeout: float | None) -> bool | None:
        """True: counted; None: let through uncounted (window open); False: timed out."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.outstanding < self.limit or self.open, timeout):
                return False
            if self.outstanding < self.limit:
                self.outstanding += 1
                return True
            return None

    def set_open(self, open_: bool) -> None:
        with self._cond:
            self.open = open_
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self.outstanding -= 1
            self._cond.notify()

    def set_limit(self, limit: int) -> None:
        with self._cond:
            self.limit = max(1, limit)
            self._cond.notify_all()

    def wait_empty(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.outstanding == 0, timeout)


@dataclass
class _Subscription:
    topic_filter: str
    qos: int
    handler: Handler
    retain_as_published: bool = False
    no_local: bool = False
    granted: bool = False


def _reason_text(reason: ReasonCode | int | None) -> str:
    if isinstance(reason, ReasonCode):
        return f"{reason} (0x{reason.value:02x})"
    return str(reason)


class MqttTransport:
    """One MQTT connection with persistent session, automatic reconnect and a publish window.

    Handlers and hooks run on paho's network thread: keep them short, hand heavy work to your
    own threads. A handler or hook may publish and subscribe; it then never waits for the
    window or a SUBACK (that would deadlock the thread that reads them): a publish beyond a
    full window goes uncounted and paho queues it within its own limit (settings.max_inflight).
    """

    def __init__(
        self,
        client_id: str,
        settings: BrokerSettings,
        *,
        clean_start: bool = False,
        will: Will | None = None,
        manual_ack: bool = False,
        tcp_nodelay: bool = True,
        network: NetworkLoop | None = None,
    ) -> None:
        if not client_id:
            raise TransportError("a client id is required: persistent sessions are keyed by it")
        if settings.protocol not in PROTOCOL_CHOICES:
            raise TransportError(
                f"broker.protocol must be one of {', '.join(PROTOCOL_CHOICES)}, not {settings.protocol!r}"
            )
        self.client_id = client_id
        self.settings = settings
        self.addresses = parse_broker_urls(settings.url)
        """The broker's nodes; `address` is the one in use (failover, `_next_node`)."""
        self._node = 0
        self.clean_start = clean_start
        self.will = will
        self.manual_ack = manual_ack
        self.tcp_nodelay = tcp_nodelay
        self.network = network if network is not None else _default_network
        """The shared network loop serving this connection, or None for paho's own thread."""
        self.on_connect_hooks: list[ConnectHook] = []
        """Called as hook(transport, session_present) after every successful CONNACK."""
        self.on_disconnect_hooks: list[DisconnectHook] = []
        """Called as hook(transport, reason) whenever an established connection ends."""
        self.yielded = False
        """Set by `give_up()`: the connection is not re-established after it ends."""
        self.on_refused_hooks: list[RefusedHook] = []
        """Called as hook(transport, refusal) when the broker refuses a publish or a subscribe
        (any thread). A hook that returns True reports it itself; else the transport logs it."""
        self.on_taken_over_hooks: list[TakenOverHook] = []
        """Called as hook(transport, why) (any thread) when another client with this client id
        holds the session (TAKEOVER_STRIKES); a hook may `give_up()`. Without a hook the
        transport says so in one line and goes on reconnecting."""
        self.refused: Counter[str] = Counter()
        """Refusals by the broker, by kind (publish, subscribe)."""

        self._client: _GatedClient | None = None
        self._protocol: MQTTProtocolVersion | None = None
        self._connected = threading.Event()
        self._connection = 0
        self._ever_connected = False
        self._closed = False
        self._first_connack: tuple[ReasonCode, bool] | None = None
        self._subs: dict[str, _Subscription] = {}
        self._subs_lock = threading.Lock()
        self._pubs = _MidBook()
        self._subacks = _MidBook()
        self._window = _Window(settings.max_inflight)
        self._in_callback = threading.local()
        self._dispatch_lock = threading.RLock()
        self._parked: deque[Message] = deque()
        self._read_paused = False
        self._unacked: set[int] = set()
        self._unacked_lock = threading.Lock()
        self._refusal_lock = threading.Lock()
        self._refusals_said: set[tuple[str, str, int]] = set()
        """(kind, topic, code) logged on this connection: repeats go to debug."""
        self._connected_at = 0.0
        self._takeover_lock = threading.Lock()
        self._short_cuts = 0
        """Connections in a row closed by the broker soon after their CONNACK (TAKEOVER_STRIKES)."""
        self._cut_times: list[float] = []

    # -- state ---------------------------------------------------------------------------

    @property
    def address(self) -> BrokerAddress:
        return self.addresses[self._node]

    def _next_node(self, client: paho.Client) -> None:
        """The reconnect to this node failed: the next one gets the next attempt (a cluster's
        node that went down; a lone broker just gets tried again)."""
        if len(self.addresses) < 2:
            return
        self._node = (self._node + 1) % len(self.addresses)
        addr = self.address
        # paho's host/port setters refuse while a reconnect is under way (state CONNECTING), which
        # is exactly when this runs; no socket is open, and its next reconnect reads these.
        client._host, client._port = addr.host, addr.port
        if addr.username is not None:
            client.username_pw_set(addr.username, addr.password)
        event(log, "transport.failover", logging.WARNING, client=self.client_id, to=self._where())

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def protocol_version(self) -> str | None:
        """"5" or "3.1.1" once connected, else None."""
        return PROTOCOL_NAMES.get(self._protocol) if self._protocol is not None else None

    @property
    def window(self) -> int:
        """The publish window in force: settings.max_inflight, clamped to the broker's limit."""
        return self._window.limit

    @property
    def outstanding(self) -> int:
        """QoS 1 publishes sent (or queued by paho) and not yet acknowledged."""
        return self._window.outstanding

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    # -- read pause (back-pressure) --------------------------------------------------------

    @property
    def unacked(self) -> int:
        """QoS 1 deliveries on this connection not yet acknowledged (manual_ack; else 0).

        A handler that never acks leaks one per message: the broker stops delivering once
        this reaches its in-flight window (RabbitMQ's prefetch, Mosquitto's
        max_inflight_messages), and the consumer stalls without an error. Watch it."""
        with self._unacked_lock:
            return len(self._unacked)

    @property
    def reading_paused(self) -> bool:
        return self._read_paused

    def pause_reading(self) -> None:
        """Stop taking messages from the broker; TCP flow control then holds them back there.

        For a consumer whose own queue is full (the aggregator's inbox): a bound that does
        not depend on the broker honouring an in-flight window. Needs a `NetworkLoop`
        (paho's own thread cannot pause). Publishes and acks still go out; meanwhile the
        publish window does not block (its PUBACKs are not read) and extra publishes queue
        in paho. Idempotent; safe from any thread, handlers included. Only once connected:
        connect() reads the CONNACK and SUBACKs through the same socket.
        """
        if self.network is None:
            raise TransportError("pause_reading needs a NetworkLoop (MqttTransport(..., network=))")
        if not self._ever_connected:
            raise TransportError("pause_reading before the first connect() has finished: connect "
                                 "reads its CONNACK and SUBACKs through the paused socket")
        self._read_paused = True
        self._window.set_open(True)
        if self._client is not None:
            self.network.pause(self._client)

    def resume_reading(self) -> None:
        if self.network is None or not self._read_paused:
            return
        self._read_paused = False
        if self._client is not None:
            self.network.resume(self._client)
        self._window.set_open(False)

    # -- connect -------------------------------------------------------------------------

    def connect(self, timeout: float = 10.0) -> MqttTransport:
        """Connect once (raising TransportError with the broker's reason), then keep connected.

        With broker.protocol "auto", MQTT v5 is tried first (for up to half of `timeout`) and
        3.1.1 when the broker refuses v5, hangs up on it, or does not answer it. After this returns, reconnects happen on paho's thread with
        exponential backoff between reconnect_min_s and reconnect_max_s.
        """
        if self._closed:
            raise TransportError("this transport was closed; make a new one")
        if self._client is not None:
            return self
        deadline = time.monotonic() + timeout
        failures = []
        for i in range(len(self.addresses)):  # the first node that answers
            self._node = i
            share = (deadline - time.monotonic()) / (len(self.addresses) - i)
            try:
                return self._connect_node(time.monotonic() + share)
            except BrokerUnreachable as e:
                if len(self.addresses) == 1:
                    raise
                failures.append(str(e))
        raise BrokerUnreachable("no node of the broker answered: " + "; ".join(failures))

    def _connect_node(self, deadline: float) -> MqttTransport:
        attempts = PROTOCOL_CHOICES[self.settings.protocol]
        for i, protocol in enumerate(attempts):
            client = self._make_client(protocol)
            # Set before the handshake so that on_connect hooks may already publish.
            self._client, self._protocol = client, protocol
            # A broker that does not speak v5 may refuse it, hang up, or (amqtt) say nothing:
            # give the first of several attempts half the time, then try the next version.
            left = deadline - time.monotonic()
            attempt_deadline = deadline if i + 1 == len(attempts) else time.monotonic() + left / 2
            failure = self._first_connect(client, attempt_deadline)
            if failure is None:
                break
            self._client = self._protocol = None
            error, version_refused = failure
            sock = client.socket()
            if sock is not None and self.network is not None:
                self.network.forget(sock)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            if version_refused and i + 1 < len(attempts) and time.monotonic() < deadline:
                event(log, "transport.fallback", client=self.client_id, reason=error)
                continue
            refusal = self._first_connack[0] if self._first_connack else None
            raise BrokerUnreachable(error, login_refused=refusal is not None and refusal.getName() in LOGIN_REFUSALS)
        if self.network is not None:
            self.network.attach(client, self)
        else:
            client.loop_start()
        self._send_pending_subscriptions(wait_deadline=deadline)
        event(log, "transport.connected", client=self.client_id, host=self.address.host,
              port=self.address.port, protocol=self.protocol_version, window=self.window)
        return self

    def _where(self) -> str:
        scheme = "mqtts" if self.address.tls else "mqtt"
        return f"{scheme}://{self.address.host}:{self.address.port}"

    def _make_client(self, protocol: MQTTProtocolVersion) -> _GatedClient:
        s, addr = self.settings, self.address
        v5 = protocol == MQTTProtocolVersion.MQTTv5
        client = _GatedClient(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=None if v5 else self.clean_start,
            protocol=protocol,
            manual_ack=self.manual_ack,
        )
        if addr.username is not None:
            client.username_pw_set(addr.username, addr.password)
        if addr.tls:
            try:
                client.tls_set(ca_certs=s.ca_file or None, certfile=s.cert_file or None,
                               keyfile=s.key_file or None)
            except (OSError, ValueError) as e:
                raise BrokerUnreachable(f"TLS setup for {self._where()} failed: {e}; check --ca-file, "
                                        f"--cert-file and --key-file") from None
            client.tls_insecure_set(s.tls_insecure)
        if self.will is not None:
            client.will_set(self.will.topic, self.will.payload, self.will.qos, self.will.retain)
        # paho holds at most this many on the wire and queues the rest (only publishes made
        # from the network thread can get past our window, see publish()).
        client.max_inflight_messages_set(self.settings.max_inflight)
        client.reconnect_delay_set(s.reconnect_min_s, s.reconnect_max_s)  # type: ignore[arg-type]
        client.on_socket_open = self._on_socket_open
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        if self.network is not None:
            self.network.install(client)
        return client

    def _first_connect(self, client: paho.Client, deadline: float) -> tuple[str, bool] | None:
        """Run the handshake in this thread: None on success, else (error, version_refused)."""
        addr, v5 = self.address, client.protocol == MQTTProtocolVersion.MQTTv5
        client.connect_timeout = max(0.1, deadline - time.monotonic())
        kwargs: dict[str, Any] = {}
        if v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.settings.session_expiry_s
            kwargs = {"clean_start": paho.MQTT_CLEAN_START_FIRST_ONLY if self.clean_start else False,
                      "properties": props}
        self._first_connack = None
        try:
            client.connect(addr.host, addr.port, self.settings.keepalive_s, **kwargs)
        except OSError as e:
            return _connect_failure(e, self._where(), addr.host), False
        closed_early = False
        while self.network is not None and self._first_connack is None and time.monotonic() < deadline:
            if client.socket() is None:  # the loop thread read EOF: the broker hung up
                closed_early = True
                break
            time.sleep(0.002)
        while self.network is None and self._first_connack is None and time.monotonic() < deadline:
            rc = client.loop(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS and self._first_connack is None:
                closed_early = True
                break
        if self._first_connack is None:
            version = PROTOCOL_NAMES[client.protocol]
            if closed_early:
                return (f"{self._where()} closed the connection before answering an MQTT {version} "
                        f"CONNECT (wrong protocol version, TLS expected, or not an MQTT broker?)", v5)
            return f"no CONNACK from {self._where()} within the timeout (MQTT {version})", v5
        reason, _session_present = self._first_connack
        if not reason.is_failure:
            return None
        version_refused = reason.getName() == "Unsupported protocol version" or (
            not v5 and reason.value == 0x84)
        if reason.getName() in LOGIN_REFUSALS:
            who = f"user {addr.username!r}" if addr.username else "anonymous client"
            return (f"{self._where()} refused {who} (client id {self.client_id!r}): {_reason_text(reason)}; "
                    f"check the user and password in --broker mqtts://USER:PASS@HOST:PORT against the "
                    f"broker's password file (`fedmq creds`)"), False
        return f"{self._where()} refused the connection: {_reason_text(reason)}", version_refused

    # -- paho callbacks (network thread, or the connecting thread during the handshake) -------

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        if self.tcp_nodelay:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.network is not None:
            self.network.register(sock, client)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode,
                    properties: Properties | None) -> None:
        session_present = bool(flags.session_present)
        if not self._ever_connected:
            self._first_connack = (reason, session_present)
        if reason.is_failure:
            self._short_cuts = 0  # refused, not taken: whoever holds the session, it is not us
            if self._ever_connected:
                event(log, "transport.refused", logging.WARNING, client=self.client_id,
                      reason=_reason_text(reason))
            return
        self._connected_at = time.monotonic()
        if not session_present:
            self._short_cuts = 0  # the broker lost our session (a restart without it): nobody took it
        with self._refusal_lock:
            self._refusals_said.clear()
        receive_maximum = getattr(properties, "ReceiveMaximum", None) if properties else None
        if receive_maximum:
            limit = min(self.settings.max_inflight, int(receive_maximum))
            # paho cannot change its own inflight limit once connected; our window is what
            # producers see. (Mosquitto 2.0 does not enforce this on QoS 1; other brokers do.)
            self._window.set_limit(limit)
        self._connection += 1
        with self._unacked_lock:  # the broker redelivers the old connection's, with new ids
            self._unacked.clear()
        first = not self._ever_connected
        self._ever_connected = True
        with self._subs_lock:
            if not session_present:
                for sub in self._subs.values():
                    sub.granted = False
            resend = [s for s in self._subs.values() if not s.granted]
        self._connected.set()
        if not first:
            event(log, "transport.reconnected", client=self.client_id, session_present=session_present,
                  resubscribed=len(resend))
            for sub in resend:  # no waiting here: this thread is the one that reads SUBACKs
                self._send_subscribe(client, sub)
        self._run_hooks(self.on_connect_hooks, session_present)

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        self._short_cuts = 0  # the broker is away (restarting, unreachable), not taken
        event(log, "transport.connect_failed", logging.DEBUG, client=self.client_id, broker=self._where())
        self._next_node(client)  # paho's own thread: its next reconnect goes to the next node

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode,
                       properties: Properties | None) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        if was_connected and not self._closed and not self.yielded:
            self._check_taken_over(flags, reason)
        if self.network is not None and self._ever_connected and not self._closed and not self.yielded:
            # paho's own thread reconnects by itself; the shared loop does it on request
            self.network.reconnect_later(client, self.settings.reconnect_min_s, self.settings.reconnect_max_s)
        if self.yielded and not self._closed:  # no reconnect will bring these acknowledgements
            self._fail_pending("the transport gave up its session")
        if not was_connected:
            return
        text = _reason_text(reason)
        if not self._closed:  # given up: the end we asked for, no news
            event(log, "transport.disconnected", logging.DEBUG if self.yielded else logging.WARNING,
                  client=self.client_id, reason=text)
        self._run_hooks(self.on_disconnect_hooks, text)

    def _check_taken_over(self, flags: Any, reason: ReasonCode) -> None:
        """A connection the broker ended soon after making it may have been taken by another
        client with our id: said at once on DISCONNECT 0x8E; a close with no reason counts once a
        probe shows the broker still up (TAKEOVER_STRIKES)."""
        lived = time.monotonic() - self._connected_at
        from_broker = bool(getattr(flags, "is_disconnect_packet_from_server", False))
        code = getattr(reason, "value", None)
        if lived < TAKEOVER_WINDOW_S and from_broker and code == SESSION_TAKEN_OVER:
            self._taken_over(f"the broker took this session for another client {lived:.1f} s after "
                             f"it was made: {_reason_text(reason)}")
        elif (lived < TAKEOVER_WINDOW_S and not from_broker and code == 0x80  # closed, no DISCONNECT
              and _TAKEOVER_PROBES.acquire(blocking=False)):
            threading.Thread(target=self._confirm_cut, name=f"takeover-probe-{self.client_id}",
                             daemon=True).start()
        else:  # a long-lived connection, the broker's own reason, our keepalive, or a mass cut
            with self._takeover_lock:
                self._short_cuts = 0
                self._cut_times.clear()

    def _confirm_cut(self) -> None:
        """Probe thread: count the cut if the broker answers a CONNECT right after it (another
        client took the session); a broker that does not answer was going down (a restart)."""
        cut_at = time.monotonic()
        try:
            up = broker_answers(self.address, self.settings, self._protocol)
        finally:
            _TAKEOVER_PROBES.release()
        with self._takeover_lock:
            if self.yielded or self._closed:
                return
            if not up:
                self._short_cuts = 0
                self._cut_times.clear()
                return
            self._short_cuts += 1
            self._cut_times.append(cut_at)
            if self._short_cuts != TAKEOVER_STRIKES:
                return
            span = cut_at - self._cut_times[0]
        self._taken_over(f"the broker closed this connection {TAKEOVER_STRIKES} times in {span:.1f} s, "
                         f"each within {TAKEOVER_WINDOW_S:.0f} s of connecting, with no reason given and "
                         f"while it went on answering: what it does when another client connects with "
                         f"the same client id")

    def _taken_over(self, why: str) -> None:
        event(log, "transport.taken_over", logging.DEBUG if self.on_taken_over_hooks else logging.WARNING,
              client=self.client_id, login=self.address.username, reason=why)
        for hook in list(self.on_taken_over_hooks):
            self._call_user(hook, self, why)

    def _broker_refused(self, kind: str, topic: str, reason: ReasonCode) -> None:
        """The broker refused a publish or a subscribe: count it, tell the hooks, log it once per
        (kind, topic, reason) and connection unless a hook reported it."""
        refusal = Refusal(kind, topic, reason.value, _reason_text(reason), self.address.username)
        with self._refusal_lock:
            self.refused[kind] += 1
            total = self.refused[kind]
            key = (kind, topic, reason.value)
            first = key not in self._refusals_said
            self._refusals_said.add(key)
        reported = False
        for hook in list(self.on_refused_hooks):
            try:
                reported = bool(hook(self, refusal)) or reported
            except Exception:
                log.exception("refusal hook %s raised", getattr(hook, "__qualname__", hook))
        if not reported:
            event(log, f"transport.{kind}_refused", logging.WARNING if first else logging.DEBUG,
                  client=self.client_id, login=refusal.login, topic=topic, reason=refusal.reason,
                  refused=total)

    def _publish_refused(self, topic: str, reason: ReasonCode) -> None:
        self._broker_refused("publish", topic, reason)

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode,
                    properties: Properties | None) -> None:
        self._pubs.resolve(mid, reason)

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int,
                      reasons: list[ReasonCode], properties: Properties | None) -> None:
        self._subacks.resolve(mid, reasons)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        message = Message(topic=msg.topic, payload=msg.payload, qos=msg.qos, retain=bool(msg.retain),
                          mid=msg.mid, dup=bool(msg.dup), connection=self._connection)
        if self.manual_ack and msg.qos > 0:
            with self._unacked_lock:
                self._unacked.add(msg.mid)
        with self._dispatch_lock:
            with self._subs_lock:
                handlers = [s.handler for s in self._subs.values()
                            if topic_matches_sub(s.topic_filter, msg.topic)]
            if handlers:
                for handler in handlers:
                    self._call_user(handler, message)
            elif len(self._parked) < PARKED_LIMIT:
                self._parked.append(message)
                event(log, "transport.parked", logging.DEBUG, client=self.client_id, topic=msg.topic)
            else:  # with manual_ack it stays unacked, so the broker redelivers it on reconnect
                event(log, "transport.dropped_unhandled", logging.WARNING, client=self.client_id,
                      topic=msg.topic, parked=len(self._parked))

    def _run_hooks(self, hooks: list[Any], arg: Any) -> None:
        for hook in list(hooks):
            self._call_user(hook, self, arg)

    def _call_user(self, fn: Callable[..., None], *args: Any) -> None:
        """User code must not kill paho's thread: log its exceptions instead."""
        outer = getattr(self._in_callback, "active", False)  # calls nest: subscribe() replays
        self._in_callback.active = True
        try:
            fn(*args)
        except Exception:
            log.exception("handler %s raised (message not acknowledged if manual_ack)",
                          getattr(fn, "__qualname__", fn))
        finally:
            self._in_callback.active = outer

    # -- subscribe -----------------------------------------------------------------------

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1,
                  timeout: float = 10.0, *, retain_as_published: bool = False, no_local: bool = False) -> None:
        """Route messages matching `topic_filter` to `handler` and subscribe at `qos`.

        Before connect(), this only registers: the SUBSCRIBE goes out at connect time. After
        connect(), it waits for the SUBACK and raises TransportError if the broker refused.
        Messages that arrived with no matching handler (a persistent session's backlog comes
        right after CONNACK) were parked, up to PARKED_LIMIT; they are handed to this handler
        first, on the calling thread, before it sees newer ones.
        Mosquitto grants even ACL-denied subscriptions, so a grant does not prove access.
        `retain_as_published` (MQTT 5; ignored on 3.1.1): live messages keep the retain flag
        their sender set, so a handler can tell what the broker is storing.
        `no_local` (MQTT 5; ignored on 3.1.1): what this client id publishes never comes back
        on this subscription, so a topic a client writes (e.g. to delete a retained message)
        is not one it can feed itself through.
        """
        if qos not in (0, 1, 2):
            raise TransportError(f"qos must be 0, 1 or 2, not {qos!r}")
        levels = topic_filter.split("/")
        if not topic_filter or any(
                ("#" in level and (level != "#" or i != len(levels) - 1)) or ("+" in level and level != "+")
                for i, level in enumerate(levels)):
            raise TransportError(f"invalid topic filter {topic_filter!r} (+ and # must fill a whole level, # last)")
        sub = _Subscription(topic_filter, qos, handler, retain_as_published, no_local)
        with self._dispatch_lock:  # parked messages reach the handler before newer ones
            with self._subs_lock:
                self._subs[topic_filter] = sub
            replay = [m for m in self._parked if topic_matches_sub(topic_filter, m.topic)]
            if replay:
                taken = {id(m) for m in replay}
                self._parked = deque(m for m in self._parked if id(m) not in taken)
                for message in replay:
                    self._call_user(handler, message)
        client = self._client
        if client is None or not self.connected:
            return  # sent by connect() or on the next CONNACK
        done = self._send_subscribe(client, sub)
        if done is not None and not getattr(self._in_callback, "active", False):
            done.wait(timeout)

    def unsubscribe(self, topic_filter: str) -> None:
        with self._subs_lock:
            self._subs.pop(topic_filter, None)
        if self._client is not None and self.connected:
            self._client.unsubscribe(topic_filter)

    def _send_subscribe(self, client: paho.Client, sub: _Subscription) -> _SubackWait | None:
        if self._protocol == MQTTProtocolVersion.MQTTv5:
            options = paho.SubscribeOptions(qos=sub.qos, retainAsPublished=sub.retain_as_published,
                                            noLocal=sub.no_local)
            rc, mid = client.subscribe(sub.topic_filter, options=options)
        else:
            rc, mid = client.subscribe(sub.topic_filter, sub.qos)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            return None  # not connected: the next CONNACK sends it
        waiter = _SubackWait(self, sub)
        self._subacks.expect(mid, waiter)
        return waiter

    def _send_pending_subscriptions(self, wait_deadline: float) -> None:
        assert self._client is not None
        with self._subs_lock:
            pending = [s for s in self._subs.values() if not s.granted]
        waits = [(s, self._send_subscribe(self._client, s)) for s in pending]
        for _sub, done in waits:
            if done is not None:
                done.wait(max(0.1, wait_deadline - time.monotonic()))

    # -- publish -------------------------------------------------------------------------

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                timeout: float | None = None) -> PublishHandle:
        """Send one message. QoS 1: blocks while `window` publishes await their PUBACK.

        `timeout` bounds that wait (None: as long as it takes, e.g. across a reconnect) and
        raises TransportError when it runs out. While disconnected, QoS 1 messages wait in
        paho and go out after the reconnect; QoS 0 ones are refused.
        """
        if self._closed:
            raise TransportError("publish on a closed transport")
        client = self._client
        if client is None:
            raise TransportError("publish before connect()")
        if qos not in (0, 1, 2):
            raise TransportError(f"qos must be 0, 1 or 2, not {qos!r}")
        in_callback = getattr(self._in_callback, "active", False)
        # On the network thread a full window is never waited for (the PUBACKs that would
        # free it are read by this very thread): the message goes uncounted, paho queues it.
        got = self._window.acquire(0 if in_callback else timeout) if qos > 0 else None
        counted = got is True
        if got is False and not in_callback:
            raise TransportError(
                f"publish to {topic!r}: {self._window.limit} messages still unacknowledged after "
                f"{timeout}s (broker slow or unreachable)")
        handle = PublishHandle(0, topic, qos, self._window.release if counted else None,
                               self._publish_refused)
        try:
            info = client.publish(topic, payload, qos, retain)
        except (ValueError, TypeError) as e:
            if counted:
                self._window.release()
            raise TransportError(f"publish to {topic!r} refused by the client: {e}") from None
        handle.mid = info.mid
        ok = info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (
            qos > 0 and info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN)
        if not ok:
            if counted:
                self._window.release()
            raise TransportError(f"publish to {topic!r} failed: {paho.error_string(info.rc)}")
        self._pubs.expect(info.mid, handle._resolve)
        return handle

    # -- ack -----------------------------------------------------------------------------

    def ack(self, message: Message) -> bool:
        """Acknowledge `message` (manual_ack): the broker forgets it. True if the PUBACK was sent.

        False when it cannot count: the message came on an earlier connection (the broker
        will redeliver it, and that copy is the one to ack) or the client is disconnected.
        A no-op returning True without manual_ack or at QoS 0.
        """
        if not self.manual_ack or message.qos == 0:
            return True
        client = self._client
        if client is None or not self.connected or message.connection != self._connection:
            return False
        sent = client.ack(message.mid, message.qos) == MQTTErrorCode.MQTT_ERR_SUCCESS
        if sent:
            with self._unacked_lock:
                self._unacked.discard(message.mid)
        return sent

    # -- shutdown ------------------------------------------------------------------------

    def give_up(self) -> None:
        """Stop reconnecting (any thread): the session belongs to someone else now. On a shared
        network loop the current connection, if any, is left to end; on paho's own thread
        (which reconnects by itself) it is closed now with a DISCONNECT, so no will goes out.
        close() still releases everything."""
        self.yielded = True
        client = self._client
        if self.network is None and client is not None:
            client.disconnect()

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to `timeout` for unacknowledged publishes, then DISCONNECT (no will)."""
        if self._closed:
            return
        client = self._client
        if client is not None and self.connected:
            self._window.wait_empty(timeout)
        self._closed = True
        if client is not None:
            client.disconnect()
            if self.network is not None:
                # the loop thread writes the DISCONNECT, then paho closes the socket
                end = time.monotonic() + min(timeout, 2.0)
                while client.socket() is not None and time.monotonic() < end:
                    time.sleep(0.002)
                self.network.detach(client)
            else:
                client.loop_stop()
                _close_wakeup_pair(client)
        self._connected.clear()
        self._fail_pending("transport closed before the broker acknowledged it")
        event(log, "transport.closed", client=self.client_id)

    def kill(self) -> None:
        """Drop the connection without DISCONNECT, as a crash would: the broker sends the will."""
        if self._closed:
            return
        self._closed = True
        client = self._client
        if client is not None and self.network is not None:
            self.network.detach(client)  # the loop no longer reads, writes or reconnects it
            sock = client.socket()
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
        elif client is not None:
            sock = client.socket()
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # FIN first, so DISCONNECT can't get out
            client.disconnect()  # stops paho's reconnect loop; nothing reaches the broker
            client.loop_stop()
            _close_wakeup_pair(client)
        self._connected.clear()
        self._fail_pending("transport killed before the broker acknowledged it")

    def _fail_pending(self, why: str) -> None:
        for complete in self._pubs.drain() + self._subacks.drain():
            complete(_Abandoned(why))

    def __enter__(self) -> MqttTransport:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self.connected else "disconnected"
        return f"MqttTransport({self.client_id!r}, {self._where()}, {state})"


def _close_wakeup_pair(client: paho.Client) -> None:
    """paho's loop_stop() leaves its wake-up socket pair open: two descriptors per client."""
    for name in ("_sockpairR", "_sockpairW"):
        sock = getattr(client, name, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
            setattr(client, name, None)


class _SubackWait:
    """Completion of one SUBSCRIBE: records whether the broker granted it."""

    def __init__(self, transport: MqttTransport, sub: _Subscription) -> None:
        self.transport, self.sub = transport, sub
        self.event = threading.Event()
        self.error: str | None = None

    def wait(self, timeout: float) -> None:
        if not self.event.wait(timeout):
            raise TransportError(f"no SUBACK for {self.sub.topic_filter!r} within {timeout:.1f}s")
        if self.error:
            raise TransportError(self.error)

    def __call__(self, reasons: list[ReasonCode] | _Abandoned) -> None:
        if isinstance(reasons, _Abandoned):
            self.error = f"subscription to {self.sub.topic_filter!r}: {reasons}"
        else:
            reason = reasons[0] if reasons else None
            if reason is None or (isinstance(reason, ReasonCode) and reason.is_failure):
                self.error = (f"broker refused the subscription to {self.sub.topic_filter!r}: "
                              f"{_reason_text(reason)}")
                with self.transport._subs_lock:
                    if self.transport._subs.get(self.sub.topic_filter) is self.sub:
                        del self.transport._subs[self.sub.topic_filter]
            else:
                self.sub.granted = True
        self.event.set()
        if isinstance(reasons, list) and reasons and isinstance(reasons[0], ReasonCode) and reasons[0].is_failure:
            self.transport._broker_refused("subscribe", self.sub.topic_filter, reasons[0])
