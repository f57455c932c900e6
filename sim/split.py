"""One simulated run split over processes (and machines) that share a broker, then merged.

    fedmq sim aggregator --broker URL --clusters 3 --agents 2000 --seed 0 --out DIR
    fedmq sim agents --broker URL --clusters 3 --agents 2000 --seed 0 --first-agent 0 --count 1000 --out DIR
    fedmq sim agents --broker URL --clusters 3 --agents 2000 --seed 0 --first-agent 1000 --count 1000 --out DIR
    fedmq sim merge DIR        # or fedmq sim report DIR, which merges first

Every process is given the same run flags (scenario, method, K, fleet size, seed, updates
per agent, data and codec settings), so each derives the same fleet name, clusters and
seeded schedule as `fedmq sim run` would. An agents process plays the schedule's events of
its agents (I..I+N-1) in schedule order, with the same data draws and training seeds those
agents get in an unsplit run, and writes DIR/parts/LABEL/agents-IIIII-JJJJJ/. The
aggregator process scores the cluster models every ~10 % of the schedule's updates, stops
once every update is answered (applied or refused) and every agent has joined and gone
offline, and writes
DIR/parts/LABEL/aggregator/. `merge_parts` checks that the parts are one run (same spec,
same data/codec/model settings, agent ranges that cover the fleet once, every scheduled
(agent, cycle) exactly once) and writes DIR/runs/LABEL/ as `fedmq sim run` does.

What differs from an unsplit run: processes run concurrently, so the order in which
uploads reach the aggregator is not deterministic, and with it staleness, the models
agents receive and every accuracy. `arrival` in the merged updates.csv is the order the
aggregator applied the updates (their reply epochs; Local: completion time), `t` is
seconds from the earliest first event over all parts (machine clocks assumed in sync).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fedmq import protocol
from fedmq.config import Config
from fedmq.logs import event, get_logger, mask_secrets
from fedmq.transport import Message, MqttTransport
from sim.fleet import (
    UPDATE_COLUMNS,
    CyclePlayer,
    RunResult,
    RunSpec,
    UpdateRecord,
    _Dispatcher,
    agent_name,
    aggregator_info,
    configure,
    fleet_name,
    make_schedule,
    play_events,
    server_models,
    start_agents,
    start_aggregator,
    write_run,
)
from sim.scenarios import build_clusters

log = get_logger("sim")

AGGREGATOR_PART = "aggregator"


class SplitRunError(RuntimeError):
    """The parts under DIR/parts/LABEL are not one complete run."""


def _fingerprint(cfg: Config) -> dict[str, Any]:
    """Settings every process of one run must share (they decide data draws and bytes)."""
    return {"data": asdict(cfg.data), "codec": asdict(cfg.codec), "model": cfg.model}


def _spec_key(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "workers"}


def parts_dir(out: Path, spec: RunSpec) -> Path:
    return out / "parts" / spec.label


def agents_part_name(first: int, count: int) -> str:
    return f"agents-{first:05d}-{first + count - 1:05d}"


def wait_for_aggregator(cfg: Config, timeout_s: float) -> None:
    """Block until the fleet's aggregator says it is online (its retained status)."""
    online = threading.Event()

    def on_status(m: Message) -> None:
        try:
            env = protocol.decode(m.payload, max_bytes=cfg.protocol.max_message_bytes)
        except protocol.ProtocolError as e:
            event(log, "sim.aggregator_status_unreadable", level=30, reason=e.reason)
            return
        if isinstance(env, protocol.Status) and env.state == "online":
            online.set()

    transport = MqttTransport(f"fedmq-sim-wait-{protocol.new_msg_id()[:12]}", cfg.broker,
                              clean_start=True).connect()
    try:
        transport.subscribe(protocol.aggregator_status(cfg.fleet), on_status, qos=1)
        if not online.wait(timeout_s):
            raise TimeoutError(f"no aggregator online for fleet {cfg.fleet!r} on {mask_secrets(cfg.broker.url)} "
                               f"after {timeout_s:.0f} s (start `fedmq sim aggregator` with the same "
                               f"run flags first)")
    finally:
        transport.close()


# ------------------------------------------------------------------------ the aggregator part


def run_aggregator_part(spec: RunSpec, base: Config, out: Path, *, stop: threading.Event | None = None,
                        ready: threading.Event | None = None, command: str | None = None) -> Path:
    """Serve one split run's aggregator until every update is answered and all agents left.

    `stop` ends it early (the part is then written with complete = false); `ready` is set
    once the aggregator is online; `command`, the process's command line, goes into the
    part and the merged run's `commands`. Returns the part's directory.
    """
    from fedmq.models import resolve_model_name
    from fedmq.training import evaluate

    if spec.method == "local":
        raise ValueError("local has no aggregator: run only `fedmq sim agents`")
    stop = stop or threading.Event()
    scenario, cfg = configure(spec, base)
    cfg.fleet = fleet_name(cfg.fleet, spec)
    n_agents = spec.resolved_agents()
    expected = {agent_name(i) for i in range(n_agents)}
    total = len(make_schedule(spec.seed, n_agents, spec.updates_per_agent))
    eval_every = spec.eval_every or max(1, math.ceil(total / 10))
    clusters = build_clusters(scenario, cfg, spec.clusters)
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    test_sets = [clusters.test(k) for k in range(spec.clusters)]
    cluster_acc: list[dict[str, Any]] = []
    busy = {"seconds": 0.0, "batches": 0}
    joined: set[str] = set()
    uploads: set[tuple[str, str]] = set()
    """Every upload answered, applied or refused: a refused one is a played event too."""
    holder: dict[str, Any] = {}
    next_checkpoint = [eval_every]

    def score(events: int) -> None:
        vectors = server_models(holder["engine"].strategy, len(test_sets))
        accs = [evaluate(model_name, w, t.x, t.y)[0] for w, t in zip(vectors, test_sets, strict=True)]
        cluster_acc.append({"events": events, "acc": accs})

    def after_batch(batch: list[Any]) -> None:
        # Runs on the aggregator's thread, between batches: the models are not moving.
        for item in batch:
            if isinstance(item.envelope, protocol.Join):
                joined.add(item.agent)
            elif isinstance(item.envelope, protocol.Update):
                uploads.add((item.agent, item.envelope.msg_id))
        answered = len(uploads)
        while next_checkpoint[0] < total and answered >= next_checkpoint[0]:
            score(next_checkpoint[0])
            next_checkpoint[0] += eval_every

    t_start = time.time()
    complete = False
    with contextlib.ExitStack() as stack:
        def before_start(engine: Any) -> None:
            holder["engine"] = engine
            score(0)

        service = start_aggregator(cfg, clusters, stack, busy, after_batch=after_batch,
                                   before_start=before_start)
        engine = service.engine
        event(log, "sim.aggregator_ready", fleet=cfg.fleet, updates=total, agents=n_agents)
        if ready is not None:
            ready.set()
        while not stop.wait(0.2):
            if len(uploads) >= total and expected <= joined and all(
                    service.presence.get(a) == "offline" for a in expected):
                complete = True
                break
    # The service has stopped: the models are still.
    score(total if complete else len(uploads))
    info = aggregator_info(engine, busy)
    d = parts_dir(out, spec) / AGGREGATOR_PART
    d.mkdir(parents=True, exist_ok=True)
    (d / "part.json").write_text(json.dumps({
        "role": "aggregator", "spec": asdict(spec), "fleet": cfg.fleet, "broker": mask_secrets(cfg.broker.url),
        "complete": complete, "settings": _fingerprint(cfg), "t_start_unix": t_start,
        "t_end_unix": time.time(), "cluster_acc": cluster_acc, "joined": len(joined), "command": command, **info,
    }, indent=1, default=float) + "\n")
    return d


# ------------------------------------------------------------------------ the agents part


def run_agents_part(spec: RunSpec, base: Config, out: Path, *, first: int, count: int,
                    wait_s: float = 300.0, progress: Any = None, command: str | None = None) -> Path:
    """Play agents first..first+count-1 of the seeded fleet against an external aggregator
    (`command`: as run_aggregator_part's)."""
    from aggregator.bootstrap import pretrain_clusters
    from fedmq.models import resolve_model_name

    n_agents = spec.resolved_agents()
    if count <= 0 or first < 0 or first + count > n_agents:
        raise ValueError(f"agents {first}..{first + count - 1} are not within the fleet's 0..{n_agents - 1}")
    scenario, cfg = configure(spec, base)
    cfg.fleet = fleet_name(cfg.fleet, spec)
    clusters = build_clusters(scenario, cfg, spec.clusters)
    model_name = resolve_model_name(cfg.model, cfg.data.dataset)
    mine = range(first, first + count)
    events = [(i, a, c) for i, (a, c) in enumerate(make_schedule(spec.seed, n_agents, spec.updates_per_agent))
              if a in mine]
    local = spec.method == "local"
    t_start = time.time()
    with contextlib.ExitStack() as stack:
        held: dict[int, torch.Tensor] | None = None
        if local:
            start = torch.stack(pretrain_clusters(cfg, clusters, model_name)).mean(0)
            held = dict.fromkeys(mine, start)
            agents: dict[int, Any] = {}
        else:
            wait_for_aggregator(cfg, wait_s)
            agents = dict(zip(mine, start_agents(cfg, spec, mine, stack), strict=True))
        dispatcher = _Dispatcher([(a, c) for _, a, c in events], 0, lambda i: None,
                                 positions=[i for i, _, _ in events])
        player = CyclePlayer(spec, scenario, clusters, cfg, model_name)
        records, t_first = play_events(dispatcher, player, agents, held, spec.workers, progress)
        agent_bytes = {a.agent_id: {"up": a.channel.bytes_sent, "down": a.channel.bytes_received}
                       for a in agents.values()}
    d = parts_dir(out, spec) / agents_part_name(first, count)
    d.mkdir(parents=True, exist_ok=True)
    _write_updates(d / "updates.csv", records)
    (d / "part.json").write_text(json.dumps({
        "role": "agents", "spec": asdict(spec), "fleet": cfg.fleet, "broker": mask_secrets(cfg.broker.url),
        "first": first, "count": count, "settings": _fingerprint(cfg), "t_start_unix": t_start,
        "t_first_unix": t_first, "t_end_unix": time.time(), "agent_bytes": agent_bytes, "command": command,
    }, indent=1, default=float) + "\n")
    return d


def _write_updates(path: Path, records: list[UpdateRecord]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(UPDATE_COLUMNS)
        for r in records:
            row = asdict(r)
            w.writerow([json.dumps(row[c]) if isinstance(row[c], list | type(None)) else row[c]
                        for c in UPDATE_COLUMNS])


def _read_updates(path: Path) -> list[UpdateRecord]:
    types = UpdateRecord.__annotations__
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values: dict[str, Any] = {}
            for c in UPDATE_COLUMNS:
                kind = types[c]
                text = row.get(c)
                if text is None:  # a column added since that part was written: its default
                    continue
                if kind == "int":
                    values[c] = int(text)
                elif kind == "float":
                    values[c] = float(text)
                elif kind == "str":
                    values[c] = text
                else:  # lists (JSON) or None
                    values[c] = json.loads(text)
            out.append(UpdateRecord(**values))
    return out


# ------------------------------------------------------------------------------ merging


def merge_parts(out: Path) -> list[Path]:
    """Merge every DIR/parts/LABEL into DIR/runs/LABEL; returns the run dirs written."""
    labels = sorted(p for p in (out / "parts").glob("*") if p.is_dir())
    return [merge_run(p, out) for p in labels]


def merge_run(part_root: Path, out: Path) -> Path:
    """One split run's parts -> runs/LABEL/{updates,clusters,agents}.csv and summary.json."""
    parts = {p.parent.name: json.loads(p.read_text()) for p in sorted(part_root.glob("*/part.json"))}
    agent_parts = {n: p for n, p in parts.items() if p["role"] == "agents"}
    if not agent_parts:
        raise SplitRunError(f"{part_root}: no agents parts (agents-*/part.json)")
    first = next(iter(agent_parts.values()))
    spec = RunSpec(**first["spec"])
    for name, p in parts.items():
        if _spec_key(p["spec"]) != _spec_key(first["spec"]):
            raise SplitRunError(f"{part_root}/{name} ran another spec: {p['spec']} vs {first['spec']}")
        if p["settings"] != first["settings"]:
            raise SplitRunError(f"{part_root}/{name} ran with other data/codec/model settings than "
                                f"{next(iter(agent_parts))}: give every process the same --set/--config")
    n_agents = spec.resolved_agents()
    covered = [0] * n_agents
    for p in agent_parts.values():
        for a in range(p["first"], p["first"] + p["count"]):
            covered[a] += 1
    twice = [a for a, n in enumerate(covered) if n > 1]
    missing = [a for a, n in enumerate(covered) if n == 0]
    if twice or missing:
        raise SplitRunError(f"{part_root}: agent parts must cover 0..{n_agents - 1} once; "
                            f"missing {_ranges(missing) or 'none'}, more than once {_ranges(twice) or 'none'}")

    t0 = min(p["t_first_unix"] for p in agent_parts.values())
    records: list[UpdateRecord] = []
    agent_bytes: dict[str, dict[str, int]] = {}
    for name, p in agent_parts.items():
        for r in _read_updates(part_root / name / "updates.csv"):
            r.t = round(r.t + p["t_first_unix"] - t0, 6)
            records.append(r)
        agent_bytes.update(p["agent_bytes"])
    schedule = make_schedule(spec.seed, n_agents, spec.updates_per_agent)
    got = sorted((r.event, int(r.agent.rsplit("-", 1)[1]), r.cycle) for r in records)
    want = [(i, a, c) for i, (a, c) in enumerate(schedule)]
    if got != want:
        extra = sorted(set(got) - set(want))[:5]
        lacking = sorted(set(want) - set(got))[:5]
        raise SplitRunError(f"{part_root}: records are not the schedule's {len(want)} events once each "
                            f"({len(got)} records; unexpected {extra}, missing {lacking} ...)")
    # The order the aggregator applied them (epochs are handed out in that order).
    local = spec.method == "local"
    for n, r in enumerate(sorted(records, key=lambda r: (r.t,) if local else (r.epoch, r.t))):
        r.arrival = n
    records.sort(key=lambda r: r.event)

    agg = parts.get(AGGREGATOR_PART)
    info: dict[str, Any] = {"events": len(schedule), "agents": n_agents, "split": True,
                            "agent_processes": len(agent_parts),
                            "workers_per_process": sorted({p["spec"]["workers"] for p in agent_parts.values()}),
                            # each process's command line, by part (an in-process run's `command`)
                            "commands": {n: p["command"] for n, p in parts.items() if p.get("command")}}
    cluster_acc: list[dict[str, Any]] = []
    starts = [p["t_start_unix"] for p in parts.values()]
    ends = [p["t_end_unix"] for p in parts.values()]
    if agg is not None:
        cluster_acc = agg["cluster_acc"]
        info.update({k: agg[k] for k in ("aggregator_counters", "strategy_counters", "stale_updates",
                                         "aggregator_busy_s", "aggregator_batches", "state_dir_peak_bytes")
                     if k in agg})
        info["aggregator_complete"] = agg["complete"]
    elif not local:
        info["aggregator"] = "external (no aggregator part: no cluster accuracy or counters)"
    result = RunResult(spec, records, cluster_acc, agent_bytes, max(ends) - min(starts),
                       first["broker"] or "none", info)
    return write_run(result, out)


def _ranges(xs: list[int]) -> str:
    spans: list[str] = []
    for x in xs:
        if spans and spans[-1].split("-")[-1] == str(x - 1):
            spans[-1] = f"{spans[-1].split('-')[0]}-{x}"
        else:
            spans.append(str(x))
    return ", ".join(spans)
