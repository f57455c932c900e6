"""Fleet status for operators: which agents are online, their model's epoch, what they did last.

    fedmq fleet status --broker mqtt://127.0.0.1:1883 --fleet garage
    fedmq fleet status --broker mqtts://monitor:PASSWORD@broker.example:8883 --ca-file ca.crt \\
                       --fleet garage --watch 2
    fedmq fleet status --fleet garage --json         # one JSON document (per refresh with --watch)

It reads only the retained status topics (`fedmq/{fleet}/agents/+/status` and
`fedmq/{fleet}/aggregator/status`), so it needs no access to models or uplinks: the `monitor`
user of `fedmq creds` is enough. An agent that disconnects cleanly publishes `offline`
itself; one that dies (kill -9, power, network) is marked offline by the broker with its last
will about 1.5 keepalives (broker.keepalive_s) later. A will is written when the agent
connects, so for an agent seen offline only through it, epoch and counters are those of its
connect time; with --watch the last online values are kept and only the state changes.

A session can also end with no will: Mosquitto 2.0.11 publishes none when a reload (SIGHUP
after `fedmq creds --rotate`) cuts a login. A member that renews its online status every
`heartbeat_s` (advertised in it: `fedmq agent` every 2 keepalives, the aggregator every
aggregator.heartbeat_s) is shown offline ("stale" in --json) once STALE_HEARTBEATS of them
are missing.

Mosquitto grants a subscription the ACL denies and then delivers nothing, so a login that may
not read the fleet would see an empty one. It exits 1 with one line instead when what it reads
cannot be the whole fleet: nothing at all, with a login, or the aggregator's status telling of
joins and uploads but no agent's status (with --watch it says so in a warning and watches on:
a fleet may start later).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fedmq import protocol
from fedmq.config import Config, add_config_arguments, config_from_args
from fedmq.errors import RuntimeFailure
from fedmq.logs import event, get_logger, mask_secrets, setup_logging
from fedmq.transport import Message, MqttTransport, check_tls_files

log = get_logger("fleet")

ACCURACY_KEYS = ("last_accuracy", "accuracy", "acc")
"""Counter names an agent may report its latest accuracy under (first found is shown)."""
UPLOAD_TIME_KEYS = ("last_upload_at", "last_upload_time", "last_upload")
"""Counter names for the wall-clock time (seconds since the epoch) of the last upload."""
STALE_HEARTBEATS = 3
"""An online status whose sender announced `heartbeat_s` and has said nothing for this many
heartbeats is shown offline: its connection ended without a last will."""


@dataclass
class Presence:
    """What one retained status message (or the latest of several) says."""

    name: str
    state: str
    role: str
    algorithm: str = ""
    epoch: int = 0
    """The epoch of the model it holds: an agent's last tau, the aggregator's t."""
    sent_at: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)
    received_at: float = 0.0
    heartbeat_s: float = 0.0
    """How often its sender renews its online status (0: it does not say)."""
    heard_at: float = 0.0
    """When its sender last spoke: our clock for a live message, its `sent_at` for a retained one."""
    stale: bool = False
    """Online by its last status, but STALE_HEARTBEATS heartbeats overdue: shown offline."""

    def silent(self, now: float) -> bool:
        """Online by its status, yet STALE_HEARTBEATS heartbeats overdue."""
        beat = self.heartbeat_s
        return self.state == "online" and beat > 0 and now - self.heard_at > STALE_HEARTBEATS * beat

    @property
    def last_accuracy(self) -> float | None:
        return _first_number(self.counters, ACCURACY_KEYS)

    @property
    def last_upload_at(self) -> float | None:
        return _first_number(self.counters, UPLOAD_TIME_KEYS)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(last_accuracy=self.last_accuracy, last_upload_at=self.last_upload_at)
        return d


def _first_number(counters: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = counters.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


class FleetWatcher:
    """Subscribes to a fleet's status topics and keeps the latest presence of each member."""

    def __init__(self, cfg: Config, *, client_id: str | None = None) -> None:
        self.fleet = protocol.validate_id(cfg.fleet, "fleet")
        self.cfg = cfg
        self.agents: dict[str, Presence] = {}
        self.aggregator: Presence | None = None
        self.ignored = 0
        """Status messages that did not decode (counted, never fatal)."""
        self._lock = threading.Lock()
        self._last_message = 0.0
        self.transport = MqttTransport(
            client_id or f"fedmq-fleet-status-{protocol.new_msg_id()[:12]}", cfg.broker,
            clean_start=True)

    def start(self, timeout: float = 10.0) -> FleetWatcher:
        self.transport.connect(timeout)
        self.transport.subscribe(protocol.all_agent_status(self.fleet), self._on_status, qos=1)
        self.transport.subscribe(protocol.aggregator_status(self.fleet), self._on_status, qos=1)
        return self

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> FleetWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_status(self, message: Message) -> None:
        now = time.time()
        with self._lock:
            self._last_message = time.monotonic()
        if not message.payload:  # a cleared retained status: the member was removed
            try:
                topic = protocol.parse_topic(message.topic)
            except protocol.ProtocolError:
                return
            with self._lock:
                if topic.kind == "status" and topic.agent:
                    self.agents.pop(topic.agent, None)
            return
        try:
            topic = protocol.parse_topic(message.topic)
            env = protocol.decode(message.payload, max_bytes=64 * 1024)
            if not isinstance(env, protocol.Status):
                raise protocol.ProtocolError("wrong_topic", f"a {env.TYPE} on a status topic")
        except protocol.ProtocolError:
            with self._lock:
                self.ignored += 1
            return
        name = topic.agent if topic.kind == "status" else "aggregator"
        seen = Presence(name=name or env.agent, state=env.state, role=env.role,
                        algorithm=env.algorithm, epoch=env.epoch, sent_at=env.sent_at,
                        counters=dict(env.counters), received_at=now, heartbeat_s=env.heartbeat_s,
                        heard_at=env.sent_at if message.retain else now)
        with self._lock:
            previous = self.aggregator if topic.kind == "aggregator_status" else self.agents.get(seen.name)
            if (seen.state == "offline" and previous is not None and previous.state == "online"
                    and previous.sent_at > seen.sent_at):
                # A last will, written at connect time: keep what the agent said since.
                seen = Presence(**{**asdict(previous), "state": "offline", "received_at": now,
                                   "heard_at": seen.heard_at})
            if topic.kind == "aggregator_status":
                self.aggregator = seen
            else:
                self.agents[seen.name] = seen

    def settle(self, quiet_s: float = 0.5, max_s: float = 3.0) -> None:
        """Wait for the retained messages the broker sends after SUBACK: until none came for
        `quiet_s`, at most `max_s` (retained messages have no end marker)."""
        start = time.monotonic()
        while time.monotonic() - start < max_s:
            with self._lock:
                last = self._last_message
            if time.monotonic() - max(last, start) >= quiet_s:
                return
            time.sleep(0.05)

    def snapshot(self, now: float | None = None) -> tuple[Presence | None, list[Presence]]:
        """The aggregator and the agents as of `now`: a member whose heartbeats stopped is offline."""
        now = time.time() if now is None else now
        with self._lock:
            members = [self.aggregator, *sorted(self.agents.values(), key=lambda p: p.name)]
        shown = [None if p is None else
                 Presence(**{**asdict(p), "state": "offline", "stale": True}) if p.silent(now) else p
                 for p in members]
        return shown[0], [p for p in shown[1:] if p is not None]

    def unreadable(self) -> str | None:
        """Why what arrived cannot be the whole fleet (its login may not read it), or None.

        Mosquitto acknowledges an ACL-denied subscription like any other, so the sign is what
        did not arrive: an aggregator status telling of joins or uploads and no agent status
        (an agent's login reads the aggregator's status only), or, with a login, nothing at all
        (a login of another fleet)."""
        login = self.transport.address.username
        who = f"user {login!r}" if login else "an anonymous client"
        fix = (f"use a monitor login of the fleet (`fedmq creds --fleet {self.fleet} --monitor-user NAME`) "
               f"or check --fleet")
        with self._lock:
            aggregator, agents = self.aggregator, len(self.agents)
        if aggregator is not None and not agents:
            served = max(aggregator.epoch, int(sum(v for k, v in aggregator.counters.items()
                                                   if k.startswith("applied.") and isinstance(v, int | float))))
            if served > 0:
                return (f"{who} reads fleet {self.fleet!r}'s aggregator status ({served} joins and uploads "
                        f"applied) but no agent's status: the broker's ACL does not let this login read "
                        f"them (or the broker lost every retained status); {fix}")
        if login and aggregator is None and not agents:
            addr = self.transport.address
            where = f"{'mqtts' if addr.tls else 'mqtt'}://{addr.host}:{addr.port}"
            return (f"nothing of fleet {self.fleet!r} is readable by {who} on {where}: the "
                    f"broker's ACL does not let this login read the fleet, or no aggregator of it ever "
                    f"ran on this broker; {fix}")
        return None


# ------------------------------------------------------------------------------ rendering


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    s = max(0.0, now - ts)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    if s < 172800:
        return f"{s / 3600:.0f}h ago"
    return f"{s / 86400:.0f}d ago"


def render_table(fleet: str, aggregator: Presence | None, agents: list[Presence],
                 now: float | None = None) -> str:
    now = time.time() if now is None else now
    online = sum(1 for a in agents if a.state == "online")
    lines = [f"fleet {fleet}: {online} of {len(agents)} agents online"]
    if aggregator is None:
        lines.append("aggregator: no status (never started on this broker?)")
    else:
        extra = " ".join(f"{k}={v}" for k, v in sorted(aggregator.counters.items()))
        lines.append(f"aggregator: {aggregator.state} {aggregator.algorithm} epoch={aggregator.epoch} "
                     f"since {_ago(aggregator.sent_at, now)}" + (f" {extra}" if extra else ""))
    private = any("epsilon" in a.counters for a in agents)  # a column only where DP is on
    header = ("AGENT", "STATE", "TAU", "LAST ACC", "LAST UPLOAD", "UPLOADS", *(("EPSILON",) if private else ()),
              "STATUS SENT")
    rows = [header]
    for a in agents:
        acc = a.last_accuracy
        uploads = a.counters.get("uploads", "-")
        eps = a.counters.get("epsilon")
        privacy = (("-" if eps is None else f"{eps:.3g}" + (" spent" if a.counters.get("budget_spent") else ""),)
                   if private else ())
        rows.append((a.name, a.state, str(a.epoch), "-" if acc is None else f"{acc:.3f}",
                     _ago(a.last_upload_at, now), str(uploads), *privacy, _ago(a.sent_at, now)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def render_json(fleet: str, aggregator: Presence | None, agents: list[Presence]) -> str:
    return json.dumps({"fleet": fleet, "at": time.time(),
                       "aggregator": aggregator.to_json() if aggregator else None,
                       "agents": [a.to_json() for a in agents]}, sort_keys=True)


# ------------------------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    s = sub.add_parser("status", help="list a fleet's agents: online/offline, last tau, last "
                                      "accuracy, last upload (from retained status topics)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(s, ("broker", "fleet", "ca_file", "cert_file", "key_file", "log_level"))
    s.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="keep watching and redraw every SECONDS (default 2) until Ctrl-C")
    s.add_argument("--json", action="store_true",
                   help="one JSON document (a line per refresh with --watch) instead of a table")
    s.add_argument("--wait", type=float, default=3.0, metavar="SECONDS",
                   help="longest wait for the retained status messages (default 3)")
    s.add_argument("--dry-run", action="store_true",
                   help="check the settings (the TLS files exist), print them and exit")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    setup_logging(cfg.log.level, cfg.log.json)
    if args.dry_run:
        check_tls_files(cfg.broker)  # a missing --ca-file: one line, exit status 2
        broker = {**asdict(cfg.broker), "url": mask_secrets(cfg.broker.url)}
        print(json.dumps({"fleet": cfg.fleet, "broker": broker, "watch": args.watch, "json": args.json,
                          "wait": args.wait}, indent=2))
        return 0
    watcher = FleetWatcher(cfg)
    watcher.start()  # BrokerUnreachable: one line and exit status 1 (fedmq/cli.py)
    # Ctrl-C and SIGTERM end a watch cleanly, even when started with SIGINT ignored (a
    # background job of a non-interactive shell inherits that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        watcher.settle(max_s=args.wait)
        problem = watcher.unreadable()
        if problem and args.watch is None:
            raise RuntimeFailure(problem)
        if problem:
            event(log, "fleet.unreadable", logging.WARNING, fleet=cfg.fleet, reason=problem)
        clear = sys.stdout.isatty() and not args.json
        while True:
            aggregator, agents = watcher.snapshot()
            if args.json:
                print(render_json(cfg.fleet, aggregator, agents), flush=True)
            else:
                print(("\x1b[H\x1b[2J" if clear and args.watch else "")
                      + render_table(cfg.fleet, aggregator, agents), flush=True)
            if args.watch is None:
                return 0
            if not args.json and not clear:
                print(flush=True)
            time.sleep(max(0.1, args.watch))
    except KeyboardInterrupt:
        return 0
    finally:
        watcher.close()
