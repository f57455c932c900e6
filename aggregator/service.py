"""The aggregator as an MQTT service: uplinks in, durable state, replies out.

Threads: paho's network thread only enqueues raw messages (per sender, aggregator/inbox.py;
an agent over its queue quota is refused there and then); one worker thread owns the engine
(no locks around algorithm state). The worker takes one waiting message per sender, senders
in turn, turns them into envelopes (`Channel`), lets the engine apply them (journal fsynced),
publishes the replies and only then acknowledges the raw messages to the broker (manual ack).
So one agent's flood delays another's next message by one of its own at most, and:
- an acknowledged upload is in the journal (kill -9 loses nothing);
- an upload applied but not yet acknowledged is redelivered after a crash and recognized by
  its msg_id (applied once, its reply re-sent);
- back-pressure is ours: above `inbox_max_messages` / `inbox_max_bytes` received but
  unprocessed, the transport stops reading its socket (resuming at half), so TCP flow
  control makes the broker hold the rest. The broker's in-flight window alone does not
  bound the queue: Mosquitto 2.0.11 keeps sending to a subscriber that acks as it goes
  (docs/reliability.md). The transport runs on a `NetworkLoop`, which can pause reads.
If the state dir cannot be written, nothing is acknowledged: the worker reloads the durable
state, logs why, and retries the batch with backoff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aggregator.engine import Engine, Inbound, Rejected
from aggregator.inbox import FairInbox
from aggregator.journal import JournalError
from aggregator.receipts import ReplyClock
from fedmq import device_spec, protocol
from fedmq.atomic_file import atomic_write
from fedmq.channel import Channel, Received, Refused
from fedmq.config import BrokerSettings, Config, LogSettings
from fedmq.fleet_status import STALE_HEARTBEATS
from fedmq.logs import PROGRESS, event, get_logger
from fedmq.onnx_export import INPUT_NAME, OUTPUT_NAME, fleet_graph
from fedmq.service_logins import PROBE, derived_url
from fedmq.transport import (
    BrokerUnreachable,
    Message,
    MqttTransport,
    NetworkLoop,
    TransportError,
    Will,
    default_network,
)

log = get_logger("aggregator")

EXPIRE_EVERY_S = 0.5
"""How often partial (chunked) messages past their timeout are dropped and answered."""

RENEW_EVERY_S = 0.5
"""How often receipts whose expected reply time ran out are sent again (aggregator/receipts.py)."""

MAX_TRACKED_CHUNKED = 1024
"""Chunked messages whose pieces the network thread counts (to send the receipt once whole)."""


def _sender_of(topic: str) -> str:
    """The agent a topic names (`fedmq/FLEET/agents/AGENT/...`), else the topic itself."""
    parts = topic.split("/")
    return parts[3] if len(parts) >= 5 and parts[2] == "agents" else topic


def serve_fleet(transport: MqttTransport, fleet: str, online_status: Callable[[], bytes],
                handler: Callable[[Message], None]) -> None:
    """Connect as the fleet's aggregator: retained online status after every (re)connect (the
    broker may have published our will meanwhile), then every uplink and agent status to
    `handler`. Shared by the asynchronous and the round service."""
    transport.on_connect_hooks.append(
        lambda t, _: t.publish(protocol.aggregator_status(fleet), online_status(), qos=1, retain=True))
    transport.connect()
    guarded = retained_guard(transport, handler)
    # no_local: the aggregator writes these topics only to delete retained messages, so nothing
    # its own login (its client id under prod.conf) publishes there may reach it as an upload.
    transport.subscribe(protocol.all_uplinks(fleet), guarded, qos=1, retain_as_published=True, no_local=True)
    transport.subscribe(protocol.all_agent_status(fleet), guarded, qos=1, retain_as_published=True, no_local=True)


MAX_AGENT_STATUS_BYTES = 64 * 1024
"""An agent's status is a few hundred bytes; 64 counters of 256 characters stay below this."""


def retained_guard(transport: MqttTransport, handler: Callable[[Message], None]) -> Callable[[Message], None]:
    """What the broker keeps on an agent's topics is its small status, nothing else.

    Mosquitto 2.0.11 has no per-client quota for retained messages, so an authenticated agent
    could make it store up to max_packet_size on its up topic and on its status topic. The
    aggregator (subscribed with retain-as-published, MQTT 5) deletes, by publishing an empty
    retained message, any retained uplink and any retained status that is not a readable
    status of at most MAX_AGENT_STATUS_BYTES; the message itself is still handled (answered)
    as usual. Empty retained messages are such deletions (ours coming back, or an agent's
    own): they are acknowledged and dropped. A live empty message is garbage like any other
    and is answered `malformed`. On MQTT 3.1.1 brokers live messages carry no retain flag, so
    the cleaning happens at each (re)subscribe and every empty message is taken for a deletion."""

    def guarded(message: Message) -> None:
        if not message.payload and (message.retain or transport.protocol_version != "5"):
            transport.ack(message)
            return
        if message.retain and not _keep_retained(message):
            transport.publish(message.topic, b"", qos=1, retain=True)
            event(log, "retained.cleared", topic=message.topic, bytes=len(message.payload))
        handler(message)

    return guarded


def _keep_retained(message: Message) -> bool:
    try:
        topic = protocol.parse_topic(message.topic)
        if topic.kind != "status" or len(message.payload) > MAX_AGENT_STATUS_BYTES:
            return False
        return isinstance(protocol.decode(message.payload, max_bytes=MAX_AGENT_STATUS_BYTES), protocol.Status)
    except protocol.ProtocolError:
        return False


class ProgressLines:
    """What the aggregator says at the default (progress) level, sized for a fleet of hundreds.

    Each applied upload gets a line of its own (`update.applied`: agent, epoch, staleness,
    stale) until `log.upload_lines` of them were printed in the current window of
    `log.summary_every_s`; later uploads in that window are only counted (their lines go out
    at info). A window in which an upload went without a line, or an upload was refused,
    ends with one `uploads.summary` line: uploads, uploads/s, stale, refused, epoch.

    Why both: a pilot of a few devices (or a test, or a demo) sees every upload as it happens,
    and a quiet fleet prints nothing; a fleet of hundreds uploading several times a second
    gets at most upload_lines + 1 lines per window, whatever its rate, and its rates too.
    Refusals (a misconfigured or hostile client can send many) are counted, never one line
    each at this level.
    """

    def __init__(self, settings: LogSettings, state: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not settings.summary_every_s > 0:
            raise ValueError(f"log.summary_every_s must be > 0, got {settings.summary_every_s}")
        if settings.upload_lines < 0:
            raise ValueError(f"log.upload_lines must be >= 0, got {settings.upload_lines}")
        self.every_s = settings.summary_every_s
        self.upload_lines = settings.upload_lines
        self.state = state
        """-> {"epoch": int, "refused": total refusals so far, **fields for the summary}."""
        self.clock = clock
        self.window_start = clock()
        self.refused_at_start = int(state()["refused"])
        self.uploads = self.stale = self.lines = 0

    def applied(self, uploads: list[dict[str, Any]]) -> None:
        """Uploads just applied durably (`Engine.applied`)."""
        self.tick()
        for u in uploads:
            self.uploads += 1
            self.stale += bool(u.get("stale"))
            level = PROGRESS if self.lines < self.upload_lines else 20
            self.lines += level == PROGRESS
            event(log, "update.applied", level=level, **u)

    def tick(self, force: bool = False) -> None:
        """Close the window once it is `summary_every_s` old (the worker calls this often)."""
        now = self.clock()
        if not force and now - self.window_start < self.every_s:
            return
        state = self.state()
        refused = int(state.pop("refused")) - self.refused_at_start
        if self.uploads > self.lines or refused > 0:
            seconds = max(now - self.window_start, 1e-9)
            event(log, "uploads.summary", level=PROGRESS, uploads=self.uploads,
                  per_s=round(self.uploads / seconds, 2), stale=self.stale, refused=refused,
                  unlisted=self.uploads - self.lines, window_s=round(seconds, 1), **state)
        self.window_start = now
        self.refused_at_start += refused
        self.uploads = self.stale = self.lines = 0


INSTANCE_FILE = "aggregator.instance"
"""In the state dir: who last served from it (started_at, pid, host), so that its successor
knows that fleet status "online" is its own dead predecessor's, not another aggregator's."""

MAX_HEARTBEAT_S = 60.0
"""The longest heartbeat a probe waits on (aggregator.heartbeat_s's upper bound): a status
advertising more still bounds the wait at 2 * MAX_HEARTBEAT_S + 1 s."""


def heartbeat_window(heartbeat_s: float) -> float:
    """How long a probe waits for a live status from an aggregator advertising `heartbeat_s`:
    a whole missed beat and a second of delivery delay before silence means it is gone."""
    return 2.0 * min(heartbeat_s, MAX_HEARTBEAT_S) + 1.0


@dataclasses.dataclass(frozen=True)
class Predecessor:
    """The aggregator that last served from our state dir, per its INSTANCE_FILE."""

    started_at: float
    gone: bool
    """Known dead: it ran on this host under another pid, now not alive. False where that cannot
    be checked: another host (a state dir restored from a copy), or this very process."""


class SoleAggregator:
    """One aggregator per fleet, asynchronous or rounds.

    Before serving (`clear_to_serve`), an aggregator reads its fleet's retained status through
    a login of its own (USER-probe, fedmq/service_logins.py), not through its session: under
    prod.conf's use_username_as_clientid any connection as the aggregator's user IS the
    session the uplinks are queued in, so a newcomer that connected there would take (and
    answer) uploads before it could tell that another one serves. It serves when the status is
    absent or offline, or "online" from its own predecessor on this state dir that is known
    dead (this host, its pid gone).

    A retained "online" alone proves nothing: a kill -9 leaves it behind, and a state dir
    restored from a copy of a serving aggregator's carries that one's identity. So an
    aggregator that advertises `heartbeat_s` (the asynchronous service re-publishes its status
    that often) is judged by its heartbeat: the probe waits up to `heartbeat_window` for a
    live (non-retained) delivery and stops at once, never having connected, when one comes;
    silence means a dead predecessor (serve) or, for a foreign status, a wait for the will as
    below. A status without `heartbeat_s` (rounds, an older aggregator): our predecessor's
    counts as gone; another's makes us wait up to about 1.5 keepalives for the broker to fire
    its will, stopping when it shows that it is alive or the wait ends.

    Once serving, each watches the status topic (`watch`), and of two that see each other
    announce themselves online, the one that started later stops (each status carries its
    `started_at`; both compare the same two times, so exactly one stops even when they
    started a second apart or their clocks differ): the fallback for two that passed the
    check at the same moment, or an old-style deployment without a probe login. A status sent
    before our start does not count: it is a predecessor's last word (retained, or queued in
    our persistent session). A status without `started_at` (an older aggregator) counts as
    earlier while we are within `grace_s` of our start."""

    def __init__(self, fleet: str, client_id: str, grace_s: float, state_dir: Path | None = None) -> None:
        self.fleet, self.client_id, self.grace_s = fleet, client_id, grace_s
        self.state_dir = state_dir
        """Where INSTANCE_FILE lives (None: no state dir, every earlier "online" is foreign)."""
        self.cleared = False
        """`clear_to_serve` said yes (the CLI asks before its reply pool connects)."""
        self.probe_refused: str | None = None
        """Why the broker refused the probe login, when it did (reported once connected)."""
        self.own_ids: deque[str] = deque(maxlen=64)
        """msg_ids of the statuses this aggregator published (its will included)."""
        self.started()
        self.failure: str | None = None
        """Why this aggregator stopped by itself, else None."""
        self.failed = threading.Event()

    def started(self) -> None:
        self.started_at, self.started_wall = time.monotonic(), time.time()

    def status_id(self) -> str:
        """A msg_id for a status of ours (so that we do not take it for another's)."""
        msg_id = protocol.new_msg_id()
        self.own_ids.append(msg_id)
        return msg_id

    def predecessor(self) -> Predecessor | None:
        """The aggregator that last served from our state dir (its INSTANCE_FILE); None when
        this process does not hold the state dir's lock (its pid in DIR/lock) or that one is a
        live process on this host (the state dir is a copy of a serving aggregator's)."""
        if self.state_dir is None:
            return None
        try:
            holder = int((self.state_dir / "lock").read_text().split()[0])
            record = json.loads((self.state_dir / INSTANCE_FILE).read_text())
            started_at, pid = float(record["started_at"]), int(record["pid"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
        if holder != os.getpid():
            return None  # we do not hold the state dir (library use): cannot vouch for it
        here = record.get("host") == socket.gethostname() and pid != os.getpid()
        if here and _alive(pid):
            return None
        return Predecessor(started_at, gone=here)

    def record_instance(self) -> None:
        """Written before we take the session: after a kill -9 our successor recognizes the
        "online" status we leave behind as ours."""
        if self.state_dir is None:
            return
        record = {"started_at": self.started_wall, "pid": os.getpid(), "host": socket.gethostname()}
        try:
            atomic_write(self.state_dir / INSTANCE_FILE, json.dumps(record).encode() + b"\n")
        except OSError as e:  # only costs the successor a wait for our will
            event(log, "aggregator.instance_unwritten", level=30, error=str(e))

    def clear_to_serve(self, broker: BrokerSettings, *, derived_logins: bool = True,
                       network: NetworkLoop | None = None) -> bool:
        """Before connecting as the aggregator: False (with `failure` set) when another
        aggregator serves the fleet. Reads the status as USER-probe (clean session, nothing
        kept); without such a login (credentials made before it existed) it says so and
        leaves it to `watch`."""
        if self.cleared:
            return True
        url = derived_url(broker.url, PROBE) if derived_logins else broker.url
        settings = dataclasses.replace(broker, url=url, session_expiry_s=0)
        seen: list[tuple[protocol.Status, bool]] = []
        """Each status delivered to the probe, and whether it came retained (not live)."""
        cond = threading.Condition()

        def on_status(message: Message) -> None:
            try:
                env = protocol.decode(message.payload, max_bytes=64 * 1024)
            except protocol.ProtocolError:
                return
            if isinstance(env, protocol.Status):
                with cond:
                    seen.append((env, message.retain))
                    cond.notify_all()

        probe = MqttTransport(f"{self.client_id}-{PROBE}", settings, clean_start=True, network=network)
        topic = protocol.aggregator_status(self.fleet)
        t0 = time.monotonic()
        try:
            probe.connect()
            probe.subscribe(topic, on_status, qos=1)
            # A second SUBACK comes after the retained status the first SUBSCRIBE was sent.
            probe.subscribe(topic, on_status, qos=1)
        except BrokerUnreachable as e:
            probe.close()
            if not e.login_refused:
                raise  # no broker there: the one line the aggregator's own connect would give
            # The probe's password derives from the aggregator's, so a wrong password fails here
            # first, and the aggregator's own connect then says so in one line; credentials made
            # before probe logins existed fail the same way, which `watch` reports once connected.
            self.probe_refused = str(e)
            self.cleared = True
            return True
        except TransportError as e:
            probe.close()
            event(log, "aggregator.probe_failed", level=30, fleet=self.fleet, error=str(e)[:300],
                  action="serving without the check")
            self.cleared = True
            return True
        try:
            self.cleared = self._decide(seen, cond, broker.keepalive_s * 1.5 + 5.0, t0)
            return self.cleared
        finally:
            probe.close()

    def _decide(self, seen: list[tuple[protocol.Status, bool]], cond: threading.Condition,
                will_s: float, t0: float) -> bool:
        """Serve (True) or not, from what the probe got after its two SUBACKs and, for an
        "online" status, what comes next: a live online status (a heartbeat, or a status sent
        as the epoch moved) proves a serving aggregator, an offline one a gone one."""

        def clear(status: str | None, reason: str = "") -> bool:
            event(log, "aggregator.clear", fleet=self.fleet, status=status, seconds=round(time.monotonic() - t0, 2),
                  **({"reason": reason} if reason else {}))
            return True

        def news(n: int) -> protocol.Status | None:
            """The first status after seen[n] that settles it: offline, or delivered live."""
            return next((env for env, retain in seen[n:] if env.state != "online" or not retain), None)

        with cond:
            last = seen[-1][0] if seen else None
            if last is None or last.state != "online":
                return clear(last.state if last else None)
            before = self.predecessor()
            ours = before is not None and bool(last.started_at) and last.started_at == before.started_at
            if ours and before is not None and (before.gone or not last.heartbeat_s):
                return clear("online", "our predecessor on this state dir, gone")
            n, settled = len(seen), None
            if last.heartbeat_s:
                window = heartbeat_window(last.heartbeat_s)
                event(log, "aggregator.heartbeat_wait", fleet=self.fleet, epoch=last.epoch, wait_s=window,
                      heartbeat_s=last.heartbeat_s, reason="the retained status says online; a live one "
                      "tells a serving aggregator from a gone one")
                cond.wait_for(lambda: news(n) is not None, window)
                settled = news(n)
                if settled is None and ours:
                    return clear("online", f"our predecessor on this state dir: no heartbeat within {window:.1f} s")
            if settled is None:
                event(log, "aggregator.waiting", level=30, fleet=self.fleet, epoch=last.epoch, wait_s=will_s,
                      reason="another aggregator's status says online: serving only once the broker "
                             "publishes its will")
                cond.wait_for(lambda: news(n) is not None, max(0.0, t0 + will_s - time.monotonic()))
                settled = news(n)
        if settled is not None and settled.state != "online":
            return clear(settled.state, "the other aggregator went offline")
        if settled is not None:
            ago = max(0.0, protocol.now() - settled.sent_at)
            self.failure = (f"another aggregator is live for fleet {self.fleet!r} (heartbeat {ago:.1f} s ago, "
                            f"epoch {settled.epoch}); not serving: this one stops before taking the MQTT "
                            f"session ({self.client_id}). Stop the other one, or give this one another --fleet")
        else:
            self.failure = (f"another aggregator is online for fleet {self.fleet!r} (epoch {last.epoch}): its will "
                            f"did not come within {will_s:.0f} s; this one stops before taking the MQTT session "
                            f"({self.client_id}). Stop the other one, or give this one another --fleet")
        self.failed.set()  # no line here: whoever started us says `failure` (the CLI's one error line)
        return False

    def watch(self, transport: MqttTransport, handler: Callable[[Message], None]) -> None:
        """Subscribe `handler` to the fleet's aggregator status, and subscribe again after every
        reconnect, before our own status goes out (call this before `serve_fleet`). Sharing one
        client id, we never see the other's live statuses: they reach whoever holds the session
        when they are published, which is the other one. A fresh SUBSCRIBE makes the broker
        send the retained status, and that is the other's when it held the session meanwhile."""
        topic = protocol.aggregator_status(self.fleet)
        transport.subscribe(topic, handler, qos=1)
        transport.on_connect_hooks.append(lambda t, _: t.subscribe(topic, handler, qos=1))
        if self.probe_refused:
            said: list[bool] = []

            def report(t: MqttTransport, _: object) -> None:
                if not said:
                    said.append(True)
                    event(log, "aggregator.probe_refused", level=30, fleet=self.fleet,
                          error=(self.probe_refused or "")[:300],
                          action="served without the check; the credentials have no probe login: "
                                 "run `fedmq creds` again")
            transport.on_connect_hooks.append(report)

    def must_stop(self, message: Message) -> bool:
        """Network thread: True (once) when `message` shows an earlier aggregator on the fleet."""
        try:
            env = protocol.decode(message.payload, max_bytes=64 * 1024)
        except protocol.ProtocolError:
            return False
        if not isinstance(env, protocol.Status) or env.state != "online" or env.msg_id in self.own_ids:
            return False
        if env.sent_at < self.started_wall:
            return False  # queued in our persistent session before we started: a predecessor's word
        if env.started_at:
            newcomer = env.started_at < self.started_wall
        else:
            newcomer = time.monotonic() - self.started_at <= self.grace_s
        event(log, "aggregator.another_online", level=30, fleet=self.fleet, epoch=env.epoch,
              action="stopping" if newcomer else "serving on; the newcomer stops")
        if not newcomer or self.failed.is_set():
            return False
        self.failure = (f"another aggregator is online for fleet {self.fleet!r} (epoch {env.epoch}, "
                        f"started before this one); with one client id the two would take the MQTT session "
                        f"({self.client_id}) in turns, so this one stops. Stop the other one, or give this "
                        f"one another --fleet")
        self.failed.set()
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


class AggregatorService:
    """Run an `Engine` against a broker. Use as a context manager or start()/stop()."""

    def __init__(self, cfg: Config, engine: Engine, *, client_id: str | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.fleet = cfg.fleet
        self.client_id = client_id or f"fedmq-aggregator-{cfg.fleet}"
        journal = getattr(engine, "journal", None)
        self.sole = SoleAggregator(self.fleet, self.client_id, cfg.aggregator.takeover_grace_s,
                                   Path(journal.dir) if journal is not None else None)
        self._inbox = FairInbox(cfg.aggregator.max_queued_per_agent)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self.counters: Counter[str] = Counter()
        self._heard: dict[str, tuple[str, float, float]] = {}
        """agent -> (online/offline, its heartbeat_s, when we heard it: time.monotonic())."""
        self.batch_observers: list[Callable[[list[protocol.Envelope], float], None]] = []
        """Called with each finished batch's envelopes and seconds (metrics; aggregator/prometheus.py
        adds itself, so the service knows nothing of Prometheus)."""
        self._inbox_lock = threading.Lock()
        self.graph: bytes | None = None
        """The fleet's ONNX graph (no weights), made at start; None if the export failed."""
        self.device: device_spec.DeviceSpec | None = None
        """What a device needs beside the graph (fedmq/device_spec.py), made at start; None if
        the dataset could not say."""
        shared = default_network()
        self._own_network = None if shared is not None else NetworkLoop(f"fedmq-aggregator-{cfg.fleet}")
        self.transport = MqttTransport(
            self.client_id, cfg.broker, clean_start=False, manual_ack=True,
            will=Will(protocol.aggregator_status(self.fleet), self._status("offline")),
            network=shared or self._own_network,
        )
        self.channel = Channel(self.transport, cfg.protocol)
        self.progress = ProgressLines(cfg.log, self._progress_state)
        self.receipts = ReplyClock()
        """Messages taken and not yet answered, and what a reply costs: the `receipt`s' estimates."""
        self._pieces_seen: OrderedDict[tuple[str, str], set[int]] = OrderedDict()
        self._renewer: threading.Thread | None = None
        self._heart: threading.Thread | None = None
        self._online: protocol.Status | None = None
        """The online status last published, which the heartbeat re-sends (`_beat`)."""
        self._status_epoch = -1
        self._status_at = time.monotonic()

    @property
    def presence(self) -> dict[str, str]:
        """agent -> online/offline, from the agents' retained status and last wills; an agent
        online by its status but STALE_HEARTBEATS of its heartbeats overdue counts as offline
        (Mosquitto publishes no will for a session a reload cuts)."""
        now = time.monotonic()
        return {agent: "offline" if state == "online" and beat > 0 and now - heard > STALE_HEARTBEATS * beat
                else state for agent, (state, beat, heard) in self._heard.items()}

    def _progress_state(self) -> dict[str, Any]:
        refused = sum(v for k, v in self.counters.items() if k.startswith("refused."))
        refused += sum(v for k, v in self.engine.counters.items() if k.startswith("rejected."))
        acc = self.engine.cluster_accuracy
        return {"refused": refused, "epoch": self.engine.strategy.uploads_applied,
                **({"accuracy": [round(a, 4) for a in acc]} if acc else {}),
                "online": sum(1 for s in self.presence.values() if s == "online")}

    def _aggregator_status(self, message: Message) -> None:
        """Network thread: another aggregator on our fleet that started first stops this one.
        Acknowledged whatever it says: our own statuses come back here too, and each unacked one
        would hold a slot of the broker's in-flight window for good."""
        self.transport.ack(message)
        if self.sole.must_stop(message):
            self.transport.give_up()
            self._stop.set()

    def _refresh_status(self) -> None:
        """Re-publish the retained online status when the epoch moved, at most every
        `aggregator.status_every_s`: a device reading it learns the current epoch, not the
        one at connect time."""
        now = time.monotonic()
        epoch = self.engine.strategy.uploads_applied
        every = self.cfg.aggregator.status_every_s
        if epoch == self._status_epoch or now - self._status_at < every or not every or not self.transport.connected:
            return
        self.transport.publish(protocol.aggregator_status(self.fleet), self._status("online"), qos=1, retain=True)

    def _beat(self) -> None:
        """Heartbeat thread: the last online status again, with a fresh msg_id and sent_at,
        every `aggregator.heartbeat_s`, whatever the worker is doing (one batch may train
        replies for a minute): a standby's probe takes silence for a dead aggregator
        (SoleAggregator). A copy of what the worker built: the engine is the worker's alone."""
        every = self.cfg.aggregator.heartbeat_s
        topic = protocol.aggregator_status(self.fleet)
        while not self._stop.wait(every):
            online = self._online
            if online is None or not self.transport.connected:
                continue
            beat = dataclasses.replace(online, msg_id=self.sole.status_id(), sent_at=protocol.now())
            try:
                self.transport.publish(topic, protocol.encode(beat), qos=1, retain=True, timeout=every)
            except TransportError as e:  # the next beat tries again; the will covers a dead link
                event(log, "heartbeat.unsent", level=30, fleet=self.fleet, error=str(e)[:300])

    def _status(self, state: str) -> bytes:
        """The retained status; it also advertises what a device needs to join (protocol.Status)."""
        if state == "online":
            self._status_epoch, self._status_at = self.engine.strategy.uploads_applied, time.monotonic()
        spec, c = self.engine.spec, self.cfg.codec
        graph: dict[str, bool | int | float | str] = {}
        if self.graph is not None:
            graph = {"topic": protocol.model_graph(self.fleet), "format": "onnx",
                     "bytes": len(self.graph), "sha256": hashlib.sha256(self.graph).hexdigest(),
                     "input": INPUT_NAME, "output": OUTPUT_NAME}
            if self.device is not None:
                graph.update(device_topic=protocol.device_spec(self.fleet), device_spec=self.device.hash)
        env = protocol.Status(agent="aggregator", msg_id=self.sole.status_id(),
                              sent_at=protocol.now(), state=state, role="aggregator",
                              algorithm=self.cfg.aggregator.algorithm,
                              epoch=self.engine.strategy.uploads_applied,
                              counters={k: v for k, v in self.engine.counters.items()},
                              model=spec.hash, model_name=spec.public_name,
                              model_spec=spec.canonical_json,
                              clusters=len(self.engine.strategy.server_models()),
                              codec={"name": c.name, "zstd": c.zstd, "delta": c.delta,
                                     "int8_block": c.int8_block, "topk_ratio": c.topk_ratio},
                              graph=graph, started_at=self.sole.started_wall,
                              heartbeat_s=self.cfg.aggregator.heartbeat_s if state == "online" else 0.0)
        if state == "online":
            self._online = env
        return protocol.encode(env)

    def _export_graph(self) -> None:
        """Export the model graph devices fetch (docs/protocol.md, "Model graph"); a failure
        is logged and only leaves the graph unpublished (`graph` empty in the status)."""
        try:
            self.graph, info = fleet_graph(self.engine.spec.arch)
        except Exception as e:  # no onnx, or an exporter failure: Python agents need no graph
            event(log, "graph.unavailable", level=30, model=self.engine.spec.arch,
                  error=f"{type(e).__name__}: {e}"[:300])
            return
        # cached: the export came from the disk cache (fedmq/disk_cache.py), not the exporter
        # (a MobileNetV3's dynamo export takes 7-30 s here, the cached graph 0.3 s).
        event(log, "graph.exported", model=self.engine.spec.arch, bytes=info.bytes,
              exporter=info.exporter, seconds=round(info.seconds, 2), cached=info.reused_graph)

    def _make_device_spec(self) -> None:
        """The device spec published beside the graph (docs/protocol.md, "Device spec"); a
        failure is logged and only leaves it unpublished (no `graph.device_spec` in the status)."""
        data = self.cfg.data
        try:
            self.device = device_spec.for_dataset(self.engine.spec, self.engine.spec.public_name, data.dataset,
                                                  data.data_dir)
        except Exception as e:  # a dataset the loader cannot read here: Python agents need no spec
            event(log, "device_spec.unavailable", level=30, dataset=data.dataset, error=f"{type(e).__name__}: {e}"[:300])
            return
        event(log, "device_spec.made", hash=self.device.hash, pieces=len(self.device.pieces()),
              feature_map_bytes=len(self.device.feature_map or b""))

    def _publish_device_spec(self, transport: MqttTransport, _: object) -> None:
        """Connect hook: the feature map's pieces, the piece topics beyond them emptied (a larger
        map published earlier leaves nothing stale), then the spec that counts them."""
        assert self.device is not None
        pieces = self.device.pieces()
        for i, piece in enumerate(pieces):
            transport.publish(protocol.device_spec_piece(self.fleet, i), piece, qos=1, retain=True)
        for i in range(len(pieces), device_spec.MAX_PIECES):
            transport.publish(protocol.device_spec_piece(self.fleet, i), b"", qos=0, retain=True)
        transport.publish(protocol.device_spec(self.fleet), self.device.payload(), qos=1, retain=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> AggregatorService:
        self.sole.started()
        replayed = self.engine.recover()
        self.counters["replayed"] += replayed
        # The clusters' accuracy as they start (pre-trained or recovered), not only after the
        # first accuracy_every uploads: a dashboard's panel is not empty for a new fleet.
        self.engine.refresh_cluster_accuracy(self.cfg.aggregator.accuracy_every)
        self._export_graph()
        if self.graph is not None:  # retained before the online status, which points at it
            self.transport.on_connect_hooks.append(lambda t, _: t.publish(
                protocol.model_graph(self.fleet), self.graph or b"", qos=1, retain=True))
            self._make_device_spec()
        if self.device is not None:  # beside the graph, before the status that names its hash
            self.transport.on_connect_hooks.append(self._publish_device_spec)
        if not self.sole.clear_to_serve(self.cfg.broker, derived_logins=self.cfg.aggregator.derived_logins,
                                        network=self.transport.network):
            return self  # never connected: `sole.failure` says why
        self.sole.record_instance()
        # Registered before connecting: the SUBSCRIBE goes out with the others at connect.
        self.sole.watch(self.transport, self._aggregator_status)
        serve_fleet(self.transport, self.fleet, lambda: self._status("online"), self._receive)
        self._worker = threading.Thread(target=self._run, name="fedmq-aggregator", daemon=True)
        self._worker.start()
        self._renewer = threading.Thread(target=self._renew_receipts, name="fedmq-aggregator-receipts",
                                         daemon=True)
        self._renewer.start()
        self._heart = threading.Thread(target=self._beat, name="fedmq-aggregator-heartbeat", daemon=True)
        self._heart.start()
        event(log, "aggregator.started", fleet=self.fleet, epoch=self.engine.strategy.uploads_applied,
              replayed=replayed, broker=self.cfg.broker.url)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=30)
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if self._heart is not None:  # before the offline status, which no late beat may overwrite
            self._heart.join(timeout=self.cfg.aggregator.heartbeat_s + 10)
        try:
            self.progress.tick(force=True)
            try:
                self.engine.snapshot_if_due(force=True)
            except JournalError as e:
                event(log, "snapshot.failed", level=40, error=str(e))
            if self.transport.connected and not self.sole.failed.is_set():  # the other one is online
                h = self.transport.publish(protocol.aggregator_status(self.fleet),
                                           self._status("offline"), qos=1, retain=True)
                h.wait(5)
        finally:  # a transport left open reconnects and takes the session from the next aggregator
            self.transport.close()
            if self._own_network is not None:
                self._own_network.close()

    def __enter__(self) -> AggregatorService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ back-pressure

    @property
    def inbox_bytes(self) -> int:
        """Payload bytes received and not yet taken by the worker."""
        return self._inbox.bytes

    @property
    def inbox_peak(self) -> tuple[int, int]:
        """Most (messages, bytes) ever waiting in the inbox: what back-pressure bounds."""
        return self._inbox.peak

    def _receive(self, message: Message) -> None:
        """Network thread: queue the message; stop reading once the inbox is full."""
        a = self.cfg.aggregator
        sender = _sender_of(message.topic)
        if self._inbox.over_quota(sender) and self._refuse_over_quota(message):
            return
        self._take(message)
        with self._inbox_lock:
            n, size = self._inbox.put(sender, message)
            if (n >= a.inbox_max_messages or size >= a.inbox_max_bytes) and not self.transport.reading_paused:
                self.transport.pause_reading()
                self.counters["backpressure.paused"] += 1
                event(log, "backpressure.paused", messages=n, bytes=size)

    def _take(self, message: Message) -> None:
        """Network thread: a join or update taken (a chunked one once its last piece is here)
        gets a `receipt` saying when to expect its reply, before the worker can answer it, so
        an agent waiting behind a long batch does not re-send it (aggregator/receipts.py)."""
        try:
            topic = protocol.parse_topic(message.topic)
            if topic.kind != "up" or topic.agent is None or not message.payload:
                return
            env = protocol.decode(message.payload, max_bytes=self.cfg.protocol.max_message_bytes)
        except protocol.ProtocolError:
            return  # the worker refuses it with its reason
        if env.agent != topic.agent:
            return
        if isinstance(env, protocol.Chunk):
            key = (topic.agent, env.of)
            seen = self._pieces_seen.pop(key, set())
            seen.add(env.index)
            if len(seen) < env.count:
                self._pieces_seen[key] = seen
                while len(self._pieces_seen) > MAX_TRACKED_CHUNKED:
                    self._pieces_seen.popitem(last=False)
                return
            msg_id, kind = env.of, "update"  # a join is never chunked
        elif isinstance(env, (protocol.Join, protocol.Update)):
            msg_id, kind = env.msg_id, env.TYPE
        else:
            return
        expect_s, ahead = self.receipts.taken(topic.agent, msg_id, kind)
        self._send_receipt(topic.agent, msg_id, expect_s, ahead)

    def _send_receipt(self, agent: str, msg_id: str, expect_s: float, ahead: int) -> None:
        if not self.transport.connected:
            return
        receipt = protocol.Receipt(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                   of=msg_id, expect_s=round(expect_s, 3), ahead=ahead)
        self.channel.send(protocol.downlink(self.fleet, agent), receipt)
        self.counters["sent.receipt"] += 1

    def _renew_receipts(self) -> None:
        """Receipt thread: a message whose expected reply time ran out (a batch slower than its
        estimate, a long queue) gets another receipt; an agent re-sends only when they stop."""
        while not self._stop.wait(RENEW_EVERY_S):
            for agent, msg_id, expect_s, ahead in self.receipts.overdue():
                try:
                    self._send_receipt(agent, msg_id, expect_s, ahead)
                except Exception as e:  # never end the thread: the worker answers regardless
                    event(log, "receipt.unsent", level=30, agent=agent, of=msg_id, error=str(e)[:300])

    def _refuse_over_quota(self, message: Message) -> bool:
        """Network thread: refuse (answer and ack) an uplink envelope from an agent that has
        its quota waiting; chunk pieces and status messages are queued as usual (False)."""
        try:
            topic = protocol.parse_topic(message.topic)
            env = protocol.decode(message.payload, max_bytes=self.cfg.protocol.max_message_bytes)
        except protocol.ProtocolError:
            return False  # the worker refuses it with its real reason
        if topic.kind != "up" or topic.agent is None or isinstance(env, protocol.Chunk):
            return False
        limit = self.cfg.protocol.max_message_bytes
        waiting = {protocol.readable_msg_id(m.payload, limit) for m in self._inbox.waiting(_sender_of(message.topic))}
        if env.msg_id in waiting:
            return False  # another copy of a waiting message (re-sent while we were down): no new work
        if len(waiting) < self._inbox.max_per_sender:
            # The quota counts messages, not copies: copies of a join re-sent while we were
            # down, still queued after the first was answered, must not refuse the update
            # that followed that answer.
            return False
        detail = (f"{self._inbox.max_per_sender} messages from {topic.agent} are already waiting; "
                  f"send the next one after a reply")
        # The worker's refusal path (count, log, Error reply, ack); only this thread counts
        # refused.rate_limited, so sharing the counter with the worker is safe.
        self._refuse(Refused(protocol.ProtocolError("rate_limited", detail), topic, env.msg_id, [message]))
        return True

    def _taken(self) -> None:
        """Worker: messages left the inbox; read again once it is down to half."""
        a = self.cfg.aggregator
        with self._inbox_lock:
            n, size = self._inbox.messages, self._inbox.bytes
            if (self.transport.reading_paused and n <= a.inbox_max_messages // 2
                    and size <= a.inbox_max_bytes // 2):
                self.transport.resume_reading()
                event(log, "backpressure.resumed", messages=n, bytes=size)

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        while not self._stop.is_set():
            if time.monotonic() >= next_expiry:  # also under steady traffic, not only when idle
                self._expire()
                next_expiry = time.monotonic() + EXPIRE_EVERY_S
            self.progress.tick()
            self._refresh_status()
            # One message per sender per batch, senders in turn (aggregator/inbox.py).
            raw = self._inbox.take(self.cfg.aggregator.max_batch * 4, timeout=0.2)
            if not raw:
                continue
            self._taken()
            try:
                self._process(raw)
            except Exception:  # a bug must not kill the service silently
                log.exception("batch failed; its messages stay unacknowledged")
                self.counters["batch_failures"] += 1
                time.sleep(1.0)

    def _process(self, raw: list[Message]) -> None:
        batch: list[Received] = []
        for msg in raw:
            try:
                got = self.channel.receive(msg)
            except Refused as r:
                self._refuse(r)
                continue
            if got is None:
                continue  # a chunk of an incomplete message: acked when it completes
            if got.topic.kind == "status":
                self._presence(got)
                continue
            batch.append(got)
        if self.channel.reassembler.evictions_pending:
            self._expire()  # partial messages dropped to make room: answer and ack them now
        if not batch:
            return
        self._process_received(batch)

    def _process_received(self, batch: list[Received]) -> None:
        started = time.perf_counter()
        keys = [(b.envelope.agent, b.envelope.msg_id) for b in batch]
        self.receipts.batch_started(keys)
        try:
            replies = self._handle_durably(batch)
        except Exception as e:  # a bug or an input no check foresaw: never wedge the queue
            self.engine.recover()  # drop whatever the failed batch did in memory
            if len(batch) > 1:
                for b in batch:  # isolate the message that fails
                    self._process_received([b])
                return
            self._poison(batch[0], e)
            return
        if replies is None:
            return
        # Before the replies go out: an agent's next message may be taken the moment it has
        # its reply, and its receipt must not count this batch as still ahead.
        joins = sum(isinstance(b.envelope, protocol.Join) for b in batch)
        self.receipts.batch_done(keys, time.perf_counter() - started,
                                 {"update": len(self.engine.applied), "join": joins})
        for env in replies:
            self.channel.send(protocol.downlink(self.fleet, env.agent), env)
            self.counters[f"sent.{env.TYPE}"] += 1
        for b in batch:
            for m in b.messages:
                self.transport.ack(m)
        self.progress.applied(self.engine.applied)
        if self.batch_observers:
            envelopes, seconds = [b.envelope for b in batch], time.perf_counter() - started
            for observe in self.batch_observers:
                observe(envelopes, seconds)
        try:
            self.engine.snapshot_if_due()
        except JournalError as e:
            event(log, "snapshot.failed", level=40, error=str(e))
        self.engine.refresh_cluster_accuracy(self.cfg.aggregator.accuracy_every)

    def _handle_durably(self, batch: list[Received]) -> list[protocol.Envelope] | None:
        """The engine's replies once durable; None if stopped while the disk refused."""
        inbound = [Inbound(b.topic.agent or "", b.envelope) for b in batch]
        delay = 0.5
        while True:
            try:
                return self.engine.handle(inbound)
            except JournalError as e:
                # Not durable: acknowledge nothing, drop what the failed batch did in memory.
                self.counters["journal_errors"] += 1
                event(log, "state.unwritable", level=40, error=str(e),
                      action="not acknowledging; retrying", retry_in_s=delay)
                self.engine.recover()
                if self._stop.wait(delay):
                    return None
                delay = min(delay * 2, 30.0)

    def _poison(self, got: Received, error: Exception) -> None:
        """A message that makes the engine fail: refuse it with a reason and ack it. A refusal
        the engine could only make after applying (NotFinite) is an outcome, logged as one; any
        other exception is a bug, logged with its traceback as internal_error."""
        if isinstance(error, Rejected):
            reason, detail = error.reason, error.detail
            event(log, "uplink.rejected", level=30, agent=got.envelope.agent,
                  msg_id=got.envelope.msg_id, reason=reason, detail=detail)
        else:
            reason, detail = "internal_error", f"{type(error).__name__}: {error}"
            log.exception("message %s from %s failed the engine; refused", got.envelope.msg_id,
                          got.envelope.agent, exc_info=error)
        self.counters[f"refused.{reason}"] += 1
        err = protocol.Error(agent=got.envelope.agent, msg_id=protocol.new_msg_id(),
                             sent_at=protocol.now(), reason=reason, detail=detail[:4096],
                             in_reply_to=got.envelope.msg_id)
        self.channel.send(protocol.downlink(self.fleet, got.envelope.agent), err)
        self.receipts.answered(got.envelope.agent, got.envelope.msg_id)
        for m in got.messages:
            self.transport.ack(m)

    def _presence(self, got: Received) -> None:
        env = got.envelope
        if isinstance(env, protocol.Status):
            self._heard[env.agent] = (env.state, env.heartbeat_s, time.monotonic())
        for m in got.messages:
            self.transport.ack(m)

    def _refuse(self, r: Refused) -> None:
        self.counters[f"refused.{r.reason}"] += 1
        agent = r.topic.agent if r.topic is not None else None
        event(log, "uplink.refused", agent=agent, reason=r.reason, detail=r.detail)
        if agent and r.topic is not None and r.topic.kind == "up":
            err = protocol.Error(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                 reason=r.reason, detail=r.detail[:4096], in_reply_to=r.msg_id)
            self.channel.send(protocol.downlink(self.fleet, agent), err)
            self.receipts.answered(agent, r.msg_id)
        for m in r.messages:
            self.transport.ack(m)

    def _expire(self) -> None:
        for r in self.channel.expire():
            self._refuse(r)
