"""Attacks and accidents found by outside attacks on the TLS deployment, rerun against a real Mosquitto running broker_config/prod.conf.

Set-up as a deployment has it: credentials from `fedmq creds` (ACL scoped to the fleet), TLS,
the real `fedmq aggregator` process logging in as its fleet's aggregator user. car-1 is an honest agent and
car-2 an attacker with its own valid password, both raw MQTT clients speaking the protocol
(tests/raw_agent.py), so they can send what no real agent would. Every case checks what
actually arrived or what is on disk, and says whether the defence `held`.

    python -m soak.attacks                          # every case -> soak/results/attacks.json
    python -m soak.attacks --cases replay,takeover  # some (tests/test_attacks.py runs a subset)

Not here: what poisoning costs in accuracy needs agents that really train (soak/poisoning.py,
`make soak`; the `poisoning` case here checks that boosted sign flips are refused);
a read-only state dir cannot be made for root, who writes anyway (tests/test_cli_errors.py
covers a state dir that is a file); the Mosquitto data-dir ownership is documentation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from aggregator.journal import scan_journal
from fedmq import protocol
from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker
from fedmq.creds import make_credentials
from fedmq.errors import run_main
from fedmq.models import model_spec
from soak.fleet_setup import SMALL, pretrained_state, rss_mib, write_figures
from soak.flood_fairness import flooding_agent
from tests.cli_process import ROOT, CliProcess, cli_env
from tests.raw_agent import RawAgent

SPEC = model_spec("digits-cnn")
FLEET = "garage"
SECOND_FLEET = "depot"
"""Cases that run their own aggregator use this fleet: two on one fleet is itself a case."""
AGENTS = ("car-1", "car-2", "car-3")
"""Members of both fleets (listed bare)."""
GARAGE_ONLY = "car-4"
"""Listed as garage/car-4: a member of FLEET only."""
NOT_AUTHORIZED = 0x87
"""The PUBACK reason code Mosquitto gives an MQTT 5 client for a publish its ACL denies."""
WAIT_S = 300.0
"""Generous deadline for anything the suite waits on: CI may share the machine."""


def one_line_refusal(proc: CliProcess, code: int) -> dict[str, Any]:
    """A refused start: non-zero exit, no traceback, and the line that said why."""
    said = [line for line in proc.lines if line.strip()]
    return {"exit": code, "traceback": any("Traceback" in line for line in said),
            "said": said[-1][-300:] if said else ""}


def file_hashes(folder: Path) -> dict[str, str]:
    """Content hashes of the files in `folder` (not `lock`, which holds the pid of its user)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and p.name != "lock"}


class Watcher:
    """A paho client of user `user` that keeps every message on `filters`, retained ones too."""

    def __init__(self, arena: Arena, user: str, *filters: str) -> None:
        self.messages: list[tuple[str, bytes, bool]] = []
        self._cond = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{user}")
        self.client.tls_set(ca_certs=str(arena.ca))
        self.client.username_pw_set(user, arena.users[user])
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", arena.broker.port)
        self.client.loop_start()
        self.client.subscribe([(f, 1) for f in filters])
        if not subscribed.wait(60):
            raise TimeoutError(f"{user}: no SUBACK for {filters}")

    def _on_message(self, client, userdata, msg) -> None:
        with self._cond:
            self.messages.append((msg.topic, msg.payload, bool(msg.retain)))
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[list[tuple[str, bytes, bool]]], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.messages), timeout)

    def quiet(self, seconds: float = 2.0, timeout: float = 60.0) -> None:
        """Wait until nothing new arrived for `seconds` (retained messages come right after SUBACK)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while time.monotonic() < deadline:
                n = len(self.messages)
                self._cond.wait(seconds)
                if len(self.messages) == n:
                    return

    def close(self) -> None:
        self.client.disconnect()  # first: it wakes paho's loop, which then ends at once
        self.client.loop_stop()


class Arena:
    """One prod.conf Mosquitto with `fedmq creds` files, a pre-trained state, and every process
    the cases start (their output is scanned for passwords at the end)."""

    def __init__(self, root: Path, settings: dict[str, str] | None = None) -> None:
        self.root = root
        self.settings = dict(settings or {})
        """For every aggregator the cases start, over SMALL (`--set`)."""
        self.creds = make_credentials(root / "creds", [*AGENTS, f"{FLEET}/{GARAGE_ONLY}"], monitor_user="monitor",
                                       fleets=[FLEET, SECOND_FLEET])
        self.users: dict[str, str] = self.creds.users()
        self.ca = self.creds.ca_cert
        self.pristine = pretrained_state(root / "pristine", **self.settings)
        self.processes: list[CliProcess] = []
        self._stack = contextlib.ExitStack()
        self.broker = self._stack.enter_context(MosquittoBroker.from_file(
            REPO_BROKER_CONFIG / "prod.conf", path_map=self.creds.path_map(), workdir=root / "broker"))
        self._main: CliProcess | None = None

    def close(self) -> None:
        for proc in self.processes:
            proc.stop()
        self._stack.close()

    def url(self, user: str) -> str:
        return f"mqtts://{user}:{self.users[user]}@127.0.0.1:{self.broker.port}"

    def state(self, name: str) -> Path:
        path = self.root / name
        shutil.copytree(self.pristine, path)
        return path

    def aggregator(self, state: Path, *extra: str, settings: dict[str, Any] | None = None,
                   fleet: str = FLEET) -> CliProcess:
        argv = ["fedmq", "aggregator", "--broker", self.url(self.creds.aggregator_for(fleet)[0]),
                "--ca-file", str(self.ca),
                "--fleet", fleet, "--state-dir", str(state), "--log-level", "info", *extra]
        for key, value in {**SMALL, **self.settings, **(settings or {})}.items():
            argv += ["--set", f"{key}={value}"]
        proc = CliProcess(argv, cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1"))
        self.processes.append(proc)
        return proc

    def main_aggregator(self) -> CliProcess:
        """The aggregator most network cases share (started when first needed, on the same
        state dir if it was stopped)."""
        if self._main is None:
            state = self.root / "main"
            self._main = self.aggregator(state if state.exists() else self.state("main"))
            self._main.wait_for(r"aggregator\.started", WAIT_S)
        return self._main

    def stop_main(self) -> None:
        """Before a case runs an aggregator of its own on SECOND_FLEET: each fleet's aggregator
        has its own login (and so its own MQTT session), but both would share the machine."""
        if self._main is not None:
            self._main.stop()
            self._main = None

    def agent(self, name: str, fleet: str = FLEET, **kw: Any) -> RawAgent:
        return RawAgent(self.broker.port, fleet, name, ca_file=str(self.ca), password=self.users[name], **kw)

    @contextlib.contextmanager
    def joined(self, name: str, **kw: Any) -> Iterator[RawAgent]:
        agent = self.agent(name, **kw)
        try:
            agent.join(SPEC.hash, timeout=WAIT_S)
            yield agent
        finally:
            agent.close()


HONEST_STEP = 0.07
"""How far an honest upload moves the model here: about what the flooding agent's uploads
move it by (whole vectors from a model a few replies old), so the norm guard refuses neither."""


def step_vector(size: int, seed: int, length: float = HONEST_STEP) -> np.ndarray:
    d = np.random.default_rng(seed).normal(size=size).astype(np.float32)
    return length * d / np.linalg.norm(d)


def round_trip(agent: RawAgent, step: int, timeout: float = WAIT_S,
               length: float = HONEST_STEP) -> tuple[float, protocol.Envelope]:
    """One update and its reply (installed when it is a model); seconds and the reply. Its step
    is `length` long (negative: flipped) in a random direction seeded by `step`; HONEST_STEP
    every time by default, so the fleet-relative bound never cuts the honest ones."""
    up = agent.update_envelope(agent.base + step_vector(agent.base.size, step, length), SPEC.hash, codec="fp32")
    t0 = time.perf_counter()
    agent.send(up)
    reply = agent.expect(up.msg_id, timeout=timeout)
    if isinstance(reply, protocol.Model):
        agent.install(reply)
    return time.perf_counter() - t0, reply


def kind(reply: protocol.Envelope) -> str:
    """"Model", or the refusal's reason."""
    return getattr(reply, "reason", type(reply).__name__)


def disconnects(proc: CliProcess) -> int:
    return sum("transport.disconnected" in line for line in proc.lines)


def journaled(state: Path, op: str = "update") -> set[str]:
    """msg_ids of the `op` records in a state dir's journals."""
    return {r.get("msg_id") for j in sorted(state.glob("journal-*.log")) for r in scan_journal(j).records
            if isinstance(r, dict) and r.get("op") == op}


@contextlib.contextmanager
def v5_login(arena: Arena, user: str, *, resume: bool = False) -> Iterator[Callable[[str, bytes], int]]:
    """An MQTT 5 connection as `user` (resuming the broker's session for it with `resume`);
    yields publish(topic, payload) -> the PUBACK's reason code. It acknowledges nothing it
    receives, so whatever a resumed session routed to it stays queued for that session."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5,
                         manual_ack=True)
    client.tls_set(ca_certs=str(arena.ca))
    client.username_pw_set(user, arena.users[user])
    acks: dict[int, int] = {}
    cond = threading.Condition()

    def on_publish(c, userdata, mid, reason, properties) -> None:
        with cond:
            acks[mid] = reason.value
            cond.notify_all()

    connected = threading.Event()
    client.on_connect = lambda *a: connected.set()
    client.on_disconnect = lambda *a: connected.clear()
    client.on_publish = on_publish
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600  # what it leaves in a session outlives it
    client.connect("127.0.0.1", arena.broker.port, clean_start=not resume, properties=props)
    client.loop_start()
    try:
        def publish(topic: str, payload: bytes) -> int:
            """Sent again on the next connection while the session's owner takes it back."""
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                if not connected.wait(WAIT_S):
                    break
                info = client.publish(topic, payload, qos=1)
                mid = info.mid
                with cond:
                    if info.rc == mqtt.MQTT_ERR_SUCCESS and cond.wait_for(
                            lambda: mid in acks or not connected.is_set(), WAIT_S) and mid in acks:  # noqa: B023
                        return acks[mid]
            raise TimeoutError(f"{user}: no PUBACK on {topic}")

        yield publish
    finally:
        client.disconnect()
        client.loop_stop()


# ----------------------------------------------------------------------------------- cases


def case_takeover(arena: Arena) -> dict[str, Any]:
    """car-2 connects five times each under car-1's and the aggregator's client ids."""
    agg = arena.main_aggregator()
    before = disconnects(agg)
    car1_id = protocol.agent_client_id(FLEET, "car-1")
    with arena.joined("car-1", client_id=car1_id, clean_start=False) as car1:
        for victim in (car1_id, f"fedmq-aggregator-{FLEET}"):
            for _ in range(5):
                arena.agent("car-2", client_id=victim).close()
        _, reply = round_trip(car1, 1)
        car1_kicked = car1.disconnects
    agg_kicked = disconnects(agg) - before
    return {"held": car1_kicked == 0 and agg_kicked == 0 and isinstance(reply, protocol.Model),
            "car1_disconnected": car1_kicked, "aggregator_disconnected": agg_kicked,
            "car1_round_trip_after": type(reply).__name__}


def case_roles(arena: Arena) -> dict[str, Any]:
    """Logins outside their role, against both fleets' real aggregators: the monitor uploads as
    agent `monitor` into both fleets; garage-only car-4 uploads into depot (three updates made
    from its garage model); depot's aggregator login resumes its own session and uploads there
    as car-1. Held when each forbidden publish is refused (PUBACK 0x87, or for the aggregator's
    own login, never delivered to it), none is in either journal, and car-4 in garage and car-1
    in depot still get answers afterwards, the aggregators not restarted."""
    garage_state = arena.root / "main"
    garage = arena.main_aggregator()
    depot_state = arena.state("roles-depot")
    depot = arena.aggregator(depot_state, fleet=SECOND_FLEET)
    forbidden: dict[str, str] = {}  # msg_id -> what it was
    codes: dict[str, int] = {}
    try:
        depot.wait_for(r"aggregator\.started", WAIT_S)
        with arena.joined(GARAGE_ONLY) as car4:  # closed before its login connects again below
            ups = [car4.update_envelope(car4.base + step_vector(car4.base.size, i), SPEC.hash, codec="fp32")
                   for i in range(3)]
        with v5_login(arena, GARAGE_ONLY) as publish:
            for i, up in enumerate(ups):
                forbidden[up.msg_id] = f"{GARAGE_ONLY} into {SECOND_FLEET}"
                codes[f"{GARAGE_ONLY}_into_{SECOND_FLEET}_{i}"] = publish(
                    protocol.uplink(SECOND_FLEET, GARAGE_ONLY), protocol.encode(up))
        with v5_login(arena, "monitor") as publish:
            for fleet in (FLEET, SECOND_FLEET):
                up = dataclasses.replace(ups[0], agent="monitor", msg_id=f"monitor-{fleet}")
                forbidden[up.msg_id] = f"monitor into {fleet}"
                codes[f"monitor_into_{fleet}"] = publish(protocol.uplink(fleet, "monitor"), protocol.encode(up))
        with arena.joined(GARAGE_ONLY) as car4:
            _, garage_reply = round_trip(car4, 1)
        with arena.joined("car-1", fleet=SECOND_FLEET) as car1:
            up = car1.update_envelope(car1.base + step_vector(car1.base.size, 7), SPEC.hash, codec="fp32")
            forbidden[up.msg_id] = "depot's aggregator login as car-1"
            with v5_login(arena, arena.creds.aggregator_for(SECOND_FLEET)[0], resume=True) as publish:
                codes["aggregator_as_car-1"] = publish(protocol.uplink(SECOND_FLEET, "car-1"), protocol.encode(up))
            # Its session was taken and ended with the attacker's: until the aggregator has
            # subscribed again an upload finds no subscriber, so car-1 re-sends it, as agents do.
            depot.wait_for(r"transport\.reconnected client=fedmq-aggregator-depot\b", WAIT_S)
            again = car1.update_envelope(car1.base + step_vector(car1.base.size, 2), SPEC.hash, codec="fp32")
            deadline = time.monotonic() + WAIT_S
            while True:
                car1.send(again)
                try:
                    depot_reply = car1.expect(again.msg_id, timeout=5.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        in_journals = journaled(garage_state) | journaled(depot_state)
        applied = sorted(what for m, what in forbidden.items() if m in in_journals)
    except Exception:
        print("".join(depot.lines[-40:]))
        raise
    finally:
        depot.stop()
    refused = all(code == NOT_AUTHORIZED for name, code in codes.items() if not name.startswith("aggregator"))
    answered = isinstance(garage_reply, protocol.Model) and isinstance(depot_reply, protocol.Model)
    return {"held": refused and not applied and answered and garage.proc.poll() is None,
            "puback_reason_codes": codes, "applied": applied,
            "after": {"car-4_in_garage": kind(garage_reply), "car-1_in_depot": kind(depot_reply)}}


def case_replay(arena: Arena) -> dict[str, Any]:
    """An applied update re-sent after 33 other messages of the same agent. The aggregator's
    clock (the reply's epoch) counts applied uploads and only car-1 uploads meanwhile, so the
    next update's reply tells whether the replay was applied again."""
    arena.main_aggregator()
    with arena.joined("car-1") as car1:
        up = car1.update_envelope(car1.base * 1.001, SPEC.hash)
        car1.send(up)
        first = car1.expect(up.msg_id, timeout=WAIT_S)
        for _ in range(33):
            car1.join(SPEC.hash)
        car1.send(up)
        again = car1.expect(up.msg_id, timeout=WAIT_S)
        _, after = round_trip(car1, 2)
    moved = after.epoch - first.epoch if isinstance(first, protocol.Model) and isinstance(after, protocol.Model) else None
    replayed = isinstance(again, protocol.Error) and again.reason == "duplicate"
    return {"held": replayed and moved == 1, "first_reply": type(first).__name__,
            "replay_reply": kind(again),
            "clock_moved_by_replay_and_next_update": moved}


def case_refusal(arena: Arena) -> dict[str, Any]:
    """A readable update the aggregator must refuse (another model's hash) names its msg_id."""
    arena.main_aggregator()
    with arena.joined("car-1") as car1:
        up = car1.update_envelope(car1.base, "0" * 16)
        car1.send(up)
        got = car1.expect(up.msg_id, timeout=WAIT_S)
    return {"held": isinstance(got, protocol.Error) and got.in_reply_to == up.msg_id,
            "reply": type(got).__name__, "reason": getattr(got, "reason", None)}


def case_status_epoch(arena: Arena) -> dict[str, Any]:
    """The retained aggregator status follows the epoch (re-published within status_every_s)."""
    arena.main_aggregator()
    with arena.joined("car-1") as car1:
        _, reply = round_trip(car1, 3)
    epoch = reply.epoch
    watcher = Watcher(arena, "monitor", protocol.aggregator_status(FLEET))
    try:
        def caught_up(msgs: list[tuple[str, bytes, bool]]) -> bool:
            return any(getattr(protocol.decode(p, max_bytes=1 << 20), "epoch", -1) >= epoch for _, p, _ in msgs)
        ok = watcher.wait_until(caught_up, 60)
        shown = [getattr(protocol.decode(p, max_bytes=1 << 20), "epoch", None) for _, p, _ in watcher.messages]
    finally:
        watcher.close()
    return {"held": ok, "epoch_after_update": epoch, "status_epochs_seen": shown[-3:]}


def case_update_flood(arena: Arena, rounds: int = 15) -> dict[str, Any]:
    """car-2, in its own process, sends valid updates at 20x car-1's rate (one a second)."""
    agg = arena.main_aggregator()
    ctx = multiprocessing.get_context("spawn")
    replies: list[str] = []

    def paced(car1: RawAgent, first: int) -> list[float]:
        out = []
        for i in range(rounds):
            seconds, reply = round_trip(car1, first + i)
            replies.append(kind(reply))
            out.append(seconds)
            time.sleep(max(0.0, 1.0 - seconds))  # car-1's pace: one upload a second
        return out

    with arena.joined("car-1") as car1:
        quiet = paced(car1, 0)
        start_line = len(agg.lines)
        stop, joined, sent = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
        auth = {"ca_file": str(arena.ca), "password": arena.users["car-2"]}
        flooder = ctx.Process(target=flooding_agent, args=(arena.broker.port, FLEET, 1 / 20, stop, joined, sent),
                              kwargs={"auth": auth}, daemon=True)
        flooder.start()
        try:
            if not joined.wait(WAIT_S):
                raise RuntimeError("the flooding agent did not join")
            flooded = paced(car1, 100)
        finally:
            stop.set()
            flooder.join(60)
    mine = [line for line in agg.lines[start_line:] if "update.applied" in line and "agent=car-1 " in line]

    def p90(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=10)[-1]
    ratio_median = statistics.median(flooded) / statistics.median(quiet)
    ratio_p90 = p90(flooded) / p90(quiet)
    stale = sum("stale=True" in line for line in mine)
    refused = [r for r in replies if r != "Model"]
    return {"held": ratio_median <= 2.0 and ratio_p90 <= 2.0 and stale == 0 and not refused,
            "car1_refused": refused,
            "car1_median_s": [round(statistics.median(quiet), 3), round(statistics.median(flooded), 3)],
            "car1_p90_s": [round(p90(quiet), 3), round(p90(flooded), 3)],
            "ratio_median": round(ratio_median, 2), "ratio_p90": round(ratio_p90, 2),
            "car1_stale": stale, "car2_sent": sent.value,
            "car2_applied": sum("agent=car-2 " in line for line in agg.lines[start_line:] if "update.applied" in line)}


def chunk(of: str, index: int, count: int, total: int) -> bytes:
    return protocol.encode(protocol.Chunk(agent="car-2", msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                                          of=of, index=index, count=count, total_bytes=total,
                                          sha256=hashlib.sha256(bytes(total)).digest(),
                                          data=bytes(1 if index < count - 1 else total - count + 1)))


def case_chunk_flood(arena: Arena) -> dict[str, Any]:
    """A message declaring 640 one-byte pieces, then one of 64 pieces that never completes,
    while car-1 keeps uploading."""
    arena.main_aggregator()
    with arena.joined("car-1") as car1, arena.joined("car-2") as car2:
        quiet = [round_trip(car1, i)[0] for i in range(5)]
        big = protocol.new_msg_id()
        car2.publish_raw(chunk(big, 0, 640, 640))
        refused = car2.expect(big, timeout=WAIT_S)
        stuck = protocol.new_msg_id()
        for i in range(63):  # every piece but the last
            car2.publish_raw(chunk(stuck, i, 64, 64))
        during = [round_trip(car1, 10 + i)[0] for i in range(5)]
    reason = getattr(refused, "reason", None)
    ratio = statistics.median(during) / statistics.median(quiet)
    return {"held": reason == "too_large" and ratio <= 2.0, "640_pieces": reason,
            "car1_median_s": [round(statistics.median(quiet), 3), round(statistics.median(during), 3)],
            "ratio_median": round(ratio, 2)}


def timed_join(agent: RawAgent) -> float:
    t0 = time.perf_counter()
    agent.join(SPEC.hash, timeout=WAIT_S)
    return time.perf_counter() - t0


STALL_SLACK_S = 1.0
"""chunk_stall: what a join behind held pieces may take beyond its idle time before it counts as
stalled (the stall is the 30 s chunk timeout; a loaded 2-core machine measured 0.19 s against an
idle 0.05 s)."""


def case_chunk_stall(arena: Arena, joins: int = 5) -> dict[str, Any]:
    """car-2 sends every piece but the last of two 64-piece messages (2 x 63 pieces, more than
    the broker's in-flight window of 64 toward the aggregator), then car-3 joins; then the same
    with two 32-piece messages (2 x 31 pieces: within what may be held, together not). Held:
    car-3's first join behind the pieces is answered within 2x its idle round trip (the median
    of `joins` joins just before) or STALL_SLACK_S more than it, whichever is longer, both
    times: a stall waits for the chunk timeout (30 s), a busy machine adds tenths of a second
    to one 50 ms join."""
    arena.main_aggregator()
    with arena.joined("car-2") as car2, contextlib.closing(arena.agent("car-3")) as car3:
        idle = [timed_join(car3) for _ in range(joins)]
        behind: dict[int, list[float]] = {}
        for count in (64, 32):
            for of in (protocol.new_msg_id(), protocol.new_msg_id()):
                for i in range(count - 1):  # every piece but the last; publish_raw waits for the PUBACK
                    car2.publish_raw(chunk(of, i, count, count))
            behind[count] = [timed_join(car3) for _ in range(joins)]
    idle_s = statistics.median(idle)
    firsts = {count: times[0] for count, times in behind.items()}
    bound = max(2.0 * idle_s, idle_s + STALL_SLACK_S)
    return {"held": all(t <= bound for t in firsts.values()), "idle_join_median_s": round(idle_s, 3),
            "first_join_behind_2x63_s": round(firsts[64], 3), "first_join_behind_2x31_s": round(firsts[32], 3),
            "joins_behind_pieces_s": {f"2x{c - 1}": [round(t, 3) for t in ts] for c, ts in behind.items()},
            "ratio": round(max(firsts.values()) / idle_s, 2)}


def case_retained(arena: Arena, mib: int = 8, copies: int = 3) -> dict[str, Any]:
    """car-2 stores large retained messages on its own topics and on another fleet's."""
    arena.main_aggregator()
    assert arena.broker.proc is not None
    rss = [rss_mib(arena.broker.proc.pid)]
    blob = os.urandom(mib << 20)
    car2 = arena.agent("car-2")
    try:
        targets = [protocol.uplink(FLEET, "car-2"), protocol.agent_status(FLEET, "car-2"),
                   protocol.agent_status("elsewhere", "car-2")]
        for target in targets:
            for _ in range(copies):
                info = car2.client.publish(target, blob, qos=1, retain=True)
                info.wait_for_publish(WAIT_S)
        # The aggregator deletes as it reads, on its network thread, before it answers car-1's
        # later update: after that reply every deletion is done.
        with arena.joined("car-1") as car1:
            round_trip(car1, 1)
            # What an agent may keep there: its status (the aggregator must leave it).
            status = protocol.encode(protocol.Status(agent="car-2", msg_id=protocol.new_msg_id(),
                                                     sent_at=protocol.now(), state="online", role="agent"))
            car2.client.publish(protocol.agent_status(FLEET, "car-2"), status, qos=1,
                                retain=True).wait_for_publish(WAIT_S)
            round_trip(car1, 2)
    finally:
        car2.close()
    watcher = Watcher(arena, arena.creds.aggregator_for(FLEET)[0], f"fedmq/{FLEET}/agents/car-2/#")
    try:
        watcher.quiet(3.0)
        kept = {t: p for t, p, retained in watcher.messages if retained}
    finally:
        watcher.close()
    rss.append(rss_mib(arena.broker.proc.pid))
    stored = sum(len(p) for p in kept.values())
    status_kept = kept.get(protocol.agent_status(FLEET, "car-2")) == status
    return {"held": status_kept and stored == len(status), "retained_bytes_on_car2_topics": stored,
            "status_kept": status_kept, "topics": sorted(kept),
            "sent_bytes": len(targets) * copies * len(blob), "broker_rss_mib": [round(r) for r in rss]}


def case_poisoning(arena: Arena, warm: int = 6, attacks: int = 10) -> dict[str, Any]:
    """car-2 sends sign-flipped updates boosted x5 (the report's case: all were accepted as
    sent) after car-1's and car-3's honest ones, on an aggregator of its own (the flood case's
    steps would otherwise be in the window). Each must be applied cut to the bound, 4x the
    fleet's step, as its `uplink.bounded` line says. What poisoning costs in accuracy needs
    agents that really train: soak/poisoning.py measures it."""
    arena.stop_main()
    state = arena.state("poisoning")
    agg = arena.aggregator(state, fleet=SECOND_FLEET)
    agg.wait_for(r"aggregator\.started", WAIT_S)
    try:
        with arena.joined("car-1", fleet=SECOND_FLEET) as car1, arena.joined("car-3", fleet=SECOND_FLEET) as car3, \
                arena.joined("car-2", fleet=SECOND_FLEET) as car2:
            for i in range(warm):  # the fleet-relative bound starts after 10 applied uploads
                round_trip(car1, i)
                round_trip(car3, i)
            # Honest steps flipped and boosted x5.
            replies = [kind(round_trip(car2, 1000 + i, length=-5 * HONEST_STEP)[1]) for i in range(attacks)]
            _, after = round_trip(car1, warm)
            agg.wait_for(r"uplink\.bounded.*car-2", WAIT_S)
    finally:
        agg.stop()
    applied = [float(m.group(1)) for line in agg.lines if "uplink.bounded" in line and "car-2" in line
               for m in [re.search(r"applied_step\W+([0-9.]+)", line)] if m]
    cut = sum(a <= 4.0 * HONEST_STEP * 1.01 for a in applied)
    return {"held": cut == attacks and replies.count("Model") == attacks and isinstance(after, protocol.Model),
            "sign_flipped_x5_cut_to_the_bound": f"{cut} of {attacks}", "replies": replies,
            "applied_steps": [round(a, 4) for a in applied], "sent_step": 5 * HONEST_STEP,
            "car1_after": type(after).__name__}


def case_guard_lockout(arena: Arena, warm: int = 6, quiet: int = 10, drifts: int = 5) -> dict[str, Any]:
    """The report's lock-out: the fleet steps normally, then car-2 and car-3 send tiny steps for
    a while (their data did not change), then car-1's data drifts and it sends 3x its usual
    step, again and again. Before, the median fell with the tiny steps and each of car-1's
    uploads was refused, never moving its base; now each must be applied as sent (no
    `uplink.bounded` line of car-1's), on an aggregator of its own."""
    arena.stop_main()
    agg = arena.aggregator(arena.state("lockout"), fleet=SECOND_FLEET)
    agg.wait_for(r"aggregator\.started", WAIT_S)
    try:
        with arena.joined("car-1", fleet=SECOND_FLEET) as car1, arena.joined("car-3", fleet=SECOND_FLEET) as car3, \
                arena.joined("car-2", fleet=SECOND_FLEET) as car2:
            for i in range(warm):
                round_trip(car1, i)
                round_trip(car3, i)
            for i in range(quiet):
                round_trip(car2, 500 + i, length=HONEST_STEP / 100)
                round_trip(car3, 500 + i, length=HONEST_STEP / 100)
            replies = [kind(round_trip(car1, 900 + i, length=3 * HONEST_STEP)[1]) for i in range(drifts)]
    finally:
        agg.stop()
    bounded = sum("uplink.bounded" in line and "car-1" in line for line in agg.lines)
    return {"held": replies.count("Model") == drifts and bounded == 0,
            "drifting_uploads_applied": f"{replies.count('Model')} of {drifts}", "replies": replies,
            "drifting_uploads_cut": bounded}


def case_second_aggregator(arena: Arena) -> dict[str, Any]:
    """A second `fedmq aggregator` for the same fleet, elsewhere (its own state dir)."""
    agg = arena.main_aggregator()
    before = disconnects(agg)
    second = arena.aggregator(arena.state("second"))
    code = second.wait(WAIT_S + 120)
    with arena.joined("car-1") as car1:
        _, reply = round_trip(car1, 1)
    refusal = one_line_refusal(second, code)
    # Same user, so same client id under prod.conf: the newcomer looks through its probe login
    # and stops before it connects as the aggregator (case split_brain_start counts uploads).
    return {"held": code != 0 and not refusal["traceback"] and "another aggregator" in refusal["said"]
            and agg.proc.poll() is None and isinstance(reply, protocol.Model),
            "second": refusal, "first_disconnected": disconnects(agg) - before,
            "first_serves_after": type(reply).__name__}


def aggregator_sessions(arena: Arena, fleet: str = FLEET) -> int:
    """How often the broker logged a connection as `fleet`'s aggregator user (its session)."""
    user = arena.creds.aggregator_for(fleet)[0]
    return arena.broker.log_tail(10_000_000).count(f" as {user} (")


def case_split_brain_start(arena: Arena, after: int = 3) -> dict[str, Any]:
    """Three honest agents upload in turn while a second `fedmq aggregator` for their fleet
    (same login, its own state dir) starts, until it has exited and `after` uploads more each.
    Held: the newcomer exits with one line, never having connected as the aggregator; every
    upload is answered exactly once, with a model, by the serving aggregator (it is in that
    one's journal); the serving one is never disconnected."""
    agg = arena.main_aggregator()
    state = arena.root / "main"
    before, sessions = disconnects(agg), aggregator_sessions(arena)
    heard: dict[str, list[protocol.Envelope]] = {name: [] for name in AGENTS}
    sent: dict[str, list[str]] = {name: [] for name in AGENTS}
    agents = [arena.agent(name) for name in AGENTS]
    for a in agents:  # every downlink recorded, so that a second answer cannot hide
        def on_message(client, userdata, msg, a: RawAgent = a) -> None:
            env = protocol.decode(msg.payload, max_bytes=1 << 27)
            heard[a.agent].append(env)
            a.inbox.put(env)
        a.client.on_message = on_message
    failures: list[str] = []
    second_gone = threading.Event()

    def upload(a: RawAgent, seed: int) -> None:
        extra = 0
        try:
            a.join(SPEC.hash, timeout=WAIT_S)
            while extra < after:
                extra += second_gone.is_set()
                second_gone.wait(0.5)  # about two uploads a second each while the newcomer starts
                seed += 1
                up = a.update_envelope(a.base + step_vector(a.base.size, seed), SPEC.hash, codec="fp32")
                sent[a.agent].append(up.msg_id)
                a.send(up)
                reply = a.expect(up.msg_id, timeout=WAIT_S)
                if isinstance(reply, protocol.Model):
                    a.install(reply)
        except Exception as e:  # reported: the case fails
            failures.append(f"{a.agent}: {type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=upload, args=(a, 1000 * i), daemon=True) for i, a in enumerate(agents)]
    try:
        for t in threads:
            t.start()
        second = arena.aggregator(arena.state("split-second"))
        code = second.wait(WAIT_S + 120)
        second_gone.set()
        for t in threads:
            t.join(WAIT_S)
        for a in agents:  # a barrier: an answer sent before this join's reached the agent before it
            a.join(SPEC.hash, timeout=WAIT_S)
    finally:
        second_gone.set()
        for a in agents:
            a.close()
    answers = {name: [e for e in heard[name] if getattr(e, "in_reply_to", None) in set(sent[name])]
               for name in AGENTS}
    counts = [sum(getattr(e, "in_reply_to", None) == m for e in answers[name])
              for name in AGENTS for m in sent[name]]
    kinds = Counter(type(e).__name__ if isinstance(e, protocol.Model) else f"Error:{getattr(e, 'reason', '?')}"
                    for name in AGENTS for e in answers[name])
    journaled = {r.get("msg_id") for j in sorted(state.glob("journal-*.log")) for r in scan_journal(j).records
                 if isinstance(r, dict) and r.get("op") == "update"}
    uploads = [m for name in AGENTS for m in sent[name]]
    refusal = one_line_refusal(second, code)
    newcomer_sessions = aggregator_sessions(arena) - sessions
    figures = {"uploads": len(uploads), "answered_once": sum(c == 1 for c in counts),
               "answered_twice_or_more": sum(c > 1 for c in counts), "unanswered": counts.count(0),
               "answers": dict(kinds), "in_serving_journal": sum(m in journaled for m in uploads),
               "newcomer_connected_as_aggregator": newcomer_sessions,
               "serving_disconnected": disconnects(agg) - before, "second": refusal,
               "second_connected_as_aggregator_line": any(
                   f"client=fedmq-aggregator-{FLEET} " in line for line in second.lines),
               "failures": failures}
    figures["held"] = bool(
        uploads and not failures and figures["answered_once"] == len(uploads)
        and kinds == Counter({"Model": len(uploads)}) and figures["in_serving_journal"] == len(uploads)
        and newcomer_sessions == 0 and figures["serving_disconnected"] == 0
        and not figures["second_connected_as_aggregator_line"]
        and code != 0 and not refusal["traceback"] and "another aggregator" in refusal["said"])
    return figures


def damaged_start(arena: Arena, state: Path, *extra: str, fleet: str = FLEET) -> dict[str, Any]:
    hashes = file_hashes(state)
    proc = arena.aggregator(state, *extra, fleet=fleet)
    code = proc.wait(WAIT_S)
    out = one_line_refusal(proc, code)
    out["files_unchanged"] = file_hashes(state) == hashes
    return out


def case_storage(arena: Arena, updates: int = 6) -> dict[str, Any]:
    """The aggregator is killed -9 after `updates` acknowledged updates; copies of its state dir
    are damaged one way each and restarted: exact recovery or a refusal naming the file."""
    arena.stop_main()
    state = arena.state("storage")
    agg = arena.aggregator(state, fleet=SECOND_FLEET)
    agg.wait_for(r"aggregator\.started", WAIT_S)
    with arena.joined("car-1", fleet=SECOND_FLEET) as car1:
        acknowledged = sum(isinstance(round_trip(car1, i)[1], protocol.Model) for i in range(updates))
    agg.kill()
    journal = max(state.glob("journal-*.log"))
    snapshot = max(state.glob("snapshot-*.msgpack"))
    results: dict[str, Any] = {}

    intact = arena.root / "storage-intact"
    shutil.copytree(state, intact)
    proc = arena.aggregator(intact, fleet=SECOND_FLEET)
    match = proc.wait_for(r"aggregator\.started.*epoch=(\d+)", WAIT_S)
    proc.stop()
    results["intact_copy_epoch"] = int(match.group(1))

    def damage(name: str, how: Callable[[Path], None], *extra: str) -> dict[str, Any]:
        copy = arena.root / f"storage-{name}"
        shutil.copytree(state, copy)
        how(copy)
        got = damaged_start(arena, copy, *extra, fleet=SECOND_FLEET)
        return got

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))

    results["journal_bit_flip"] = damage("flip", lambda d: flip(d / journal.name))
    results["garbage_snapshot"] = damage("snap", lambda d: (d / snapshot.name).write_bytes(
        os.urandom(snapshot.stat().st_size)))
    results["garbage_journal"] = damage("jrnl", lambda d: (d / journal.name).write_bytes(
        os.urandom(journal.stat().st_size)))
    results["other_algorithm_snapshot"] = damage("shape", lambda d: None, "--algorithm", "fedasync")
    names = {"journal_bit_flip": journal.name, "garbage_snapshot": snapshot.name,
             "garbage_journal": journal.name, "other_algorithm_snapshot": "fedasync"}
    results["acknowledged"] = acknowledged
    held = results["intact_copy_epoch"] == acknowledged == updates
    for key, name in names.items():
        r = results[key]
        r["names_it"] = name in r["said"] or (key == "other_algorithm_snapshot" and "does not fit" in r["said"])
        held &= r["exit"] != 0 and not r["traceback"] and r["files_unchanged"] and r["names_it"]
    return {"held": bool(held), **results}


def case_state_dir_is_file(arena: Arena) -> dict[str, Any]:
    path = arena.root / "not-a-dir"
    path.write_text("x")
    t0 = time.monotonic()
    proc = arena.aggregator(path)
    code = proc.wait(WAIT_S)
    out = one_line_refusal(proc, code)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return {"held": code != 0 and not out["traceback"], **out}


def case_agent_state(arena: Arena) -> dict[str, Any]:
    """`fedmq agent` with an unreadable state file, started twice: refused both times, file kept."""
    folder = arena.root / "agent-state"
    folder.mkdir()
    (folder / "agent_state.msgpack").write_bytes(os.urandom(4096))
    hashes = file_hashes(folder)
    runs = []
    for _ in range(2):
        proc = CliProcess(["fedmq", "agent", "--id", "car-1", "--broker", arena.url("car-1"), "--ca-file",
                           str(arena.ca), "--fleet", FLEET, "--state-dir", str(folder)],
                          cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1"))
        arena.processes.append(proc)
        runs.append(one_line_refusal(proc, proc.wait(WAIT_S)))
    kept = file_hashes(folder)
    unchanged = all(h in kept.values() for h in hashes.values())
    return {"held": all(r["exit"] != 0 and not r["traceback"] for r in runs) and unchanged,
            "runs": runs, "damaged_bytes_kept": unchanged, "files": sorted(kept)}


def case_secrets(arena: Arena) -> dict[str, Any]:
    """No password of any user in anything a process printed or the broker logged (run last)."""
    texts = [p.output for p in arena.processes] + [arena.broker.log_tail(100_000)]
    found = {user: sum(pw in t for t in texts) for user, pw in arena.users.items()}
    return {"held": not any(found.values()), "outputs_scanned": len(texts), "passwords_found": found}


CASES: dict[str, Callable[[Arena], dict[str, Any]]] = {
    "takeover": case_takeover,
    "roles": case_roles,
    "replay": case_replay,
    "refusal": case_refusal,
    "status_epoch": case_status_epoch,
    "update_flood": case_update_flood,
    "chunk_flood": case_chunk_flood,
    "chunk_stall": case_chunk_stall,
    "retained": case_retained,
    "second_aggregator": case_second_aggregator,
    "split_brain_start": case_split_brain_start,
    "poisoning": case_poisoning,
    "guard_lockout": case_guard_lockout,
    "storage": case_storage,
    "state_dir_is_file": case_state_dir_is_file,
    "agent_state": case_agent_state,
    "secrets": case_secrets,
}


def run(cases: list[str], root: Path, settings: dict[str, str] | None = None) -> dict[str, Any]:
    arena = Arena(root, settings)
    figures: dict[str, Any] = {}
    try:
        for name in cases:
            t0 = time.monotonic()
            try:
                got = CASES[name](arena)
            except Exception as e:  # a case that breaks is reported, and the rest still run
                got = {"held": False, "error": f"{type(e).__name__}: {e}"[:500]}
            got["seconds"] = round(time.monotonic() - t0, 1)
            figures[name] = got
            print(f"{name:18s} {'held' if got['held'] else 'FAILED'}  "
                  f"{ {k: v for k, v in got.items() if k not in ('held',)} }", flush=True)
    finally:
        arena.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak.attacks", description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (default all)")
    p.add_argument("--out", type=Path, default=None, help="figures file (default soak/results/attacks.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every aggregator the cases start, over the small fleet's")
    args = p.parse_args(argv)
    if bad := [item for item in args.set if "=" not in item]:
        p.error(f"--set takes KEY=VALUE, not {bad[0]!r}")
    settings = dict(item.split("=", 1) for item in args.set)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if "secrets" in cases:  # it reads what the others printed
        cases = [c for c in cases if c != "secrets"] + ["secrets"]
    with tempfile.TemporaryDirectory() as tmp:
        figures = run(cases, Path(tmp), settings)
    print(f"wrote {write_figures('attacks', figures, args.out)}")
    return 0 if all(f["held"] for f in figures.values()) else 1


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.attacks", main))
