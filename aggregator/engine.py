"""The aggregator's state machine, free of MQTT: uplink envelopes in, downlink envelopes out.

One `handle(batch)` call takes the decoded uplinks of a batch and
1. refuses what cannot be honest for this fleet (wrong model spec, shape, codec, NaN, a tau from
   the future, an unknown agent or base) with an `Error` reply and no change, and scales a
   step longer than the poisoning bound down to it (applied, counted `bounded.*`);
2. answers a replay of an applied msg_id with the reply it already sent, applying nothing;
3. runs joins, then all valid updates through the strategy in one batched call;
4. appends one journal record per applied message and makes them durable;
and only then returns the replies. The service publishes them and acknowledges the batch to
the broker afterwards, so an acknowledged upload is always in the journal. If the journal
cannot be written, `handle` raises `JournalError` and the caller must `recover()` (reload the
durable state) before retrying: in-memory effects of the failed batch are discarded.

Replay applies the journal's records through `Strategy.apply` with the alpha that was used,
then re-derives each agent's base (the model it holds) the way the live path did. A record
keeps everything an `Upload` carries (vector, tau, samples, the agent's alpha, its data
sketch as sent; the base is re-derived), so a strategy reading any of it replays exactly.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aggregator.aggregation import latest_per_agent
from aggregator.evaluator import ProxyEvaluator
from aggregator.journal import Journal, JournalCorrupt
from aggregator.strategy import Reply, Strategy, Upload
from fedmq import codecs, protocol, sketch
from fedmq.config import Config
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec

log = get_logger("aggregator")

KEPT_BASES = 2
"""Models remembered per agent, keyed by the epoch of the reply that carried them: the latest,
and the one before while the agent may not have installed the latest (its reply lost, or
answered by a process that had no right to). An upload's tau names the model it trained from;
older ones are dropped once an upload names a later one."""

RECENT_MSG_IDS = 32
"""Applied msg_ids remembered per agent, each answered again with its reply (or `duplicate`
once superseded). Older ones are caught by the agent's high-water mark: an agent's msg_ids
increase (protocol.md), so an id at or below the highest applied one is never applied again."""


class Rejected(Exception):
    """An uplink refused with a stable reason code and a human detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class NotFinite(Rejected):
    """Finite uploads whose batch, applied, left a reply or a server model NaN or Inf (a value
    of 1e20 passes every codec check and still overflows a forward pass). Raised out of
    `Engine.handle` before anything is journaled: the strategy's memory is spoiled, so the
    caller recovers (`Engine.recover`) and, for a batch of several, retries each alone to find
    the one to refuse."""

    def __init__(self, agents: list[str]) -> None:
        super().__init__("not_finite", f"applying the upload of {', '.join(sorted(set(agents)))} left "
                                       f"a model with NaN or Inf values; nothing of it was kept")


@dataclass
class AgentRecord:
    """What the aggregator remembers of one agent."""

    base: torch.Tensor | None = None
    """The model the agent holds (what it reconstructed from our last reply), for deltas."""
    base_epoch: int = -1
    """The epoch our last reply carried: the tau of an upload trained from `base`."""
    earlier: dict[int, torch.Tensor] = field(default_factory=dict)
    """Earlier replies' models by epoch (at most KEPT_BASES - 1), for an upload whose tau names
    one: the agent did not install our latest reply."""
    last_reply: bytes = b""
    """The encoded reply to the agent's last applied message, re-sent on a replay."""
    last_msg_id: str = ""
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_MSG_IDS))
    high_water: str = ""
    """The highest msg_id applied from this agent: bounded memory that never forgets one."""

    def to_state(self) -> dict[str, Any]:
        return {"base": self.base, "last_reply": self.last_reply, "last_msg_id": self.last_msg_id,
                "recent": list(self.recent), "high_water": self.high_water,
                "base_epoch": self.base_epoch, "earlier": dict(self.earlier)}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> AgentRecord:
        rec = cls(base=d["base"], last_reply=d["last_reply"], last_msg_id=d["last_msg_id"],
                  high_water=d.get("high_water", max(d["recent"], default="")),
                  base_epoch=d.get("base_epoch", -1), earlier=dict(d.get("earlier", {})))
        rec.recent.extend(d["recent"])
        return rec

    def hold(self, model: torch.Tensor | None, epoch: int) -> None:
        """Our reply carries `model` at `epoch`: it becomes the base, the previous one is kept."""
        if self.base is not None and self.base_epoch != epoch and model is not None:
            self.earlier[self.base_epoch] = self.base
            for old in sorted(self.earlier)[:-(KEPT_BASES - 1) or None]:
                del self.earlier[old]
        else:
            self.earlier.clear()
        self.base, self.base_epoch = model, epoch

    def trained_from(self, tau: int) -> tuple[torch.Tensor | None, bool]:
        """(the model an upload with this tau started from, whether its tau names it): `base`,
        or an earlier reply's model (then the agent did not install the later ones). An unknown
        tau gives `base`, unnamed."""
        if tau in self.earlier:
            return self.earlier[tau], True
        return self.base, tau == self.base_epoch

    def moved_past(self, tau: int) -> None:
        """An upload trained from epoch `tau` was applied: earlier bases are no longer needed."""
        for old in [e for e in self.earlier if e < tau]:
            del self.earlier[old]


@dataclass(frozen=True)
class Step:
    """An upload's step ||v - base||: as sent, as applied, and the rule that bounded it."""

    sent: float
    length: float
    bounded_by: str | None = None


@dataclass
class Inbound:
    """One decoded uplink; `agent` comes from the topic (the broker's ACL vouches for it)."""

    agent: str
    envelope: protocol.Envelope


class FleetSteps:
    """The fleet's typical step for the poisoning bound (`aggregator.norm_factor`).

    The median of the latest `window` applied steps ||v - base||, counting at most `per_agent`
    (the latest) of any one agent's: one agent's many uploads (a flood of large steps) cannot
    raise the bound for its own boosted ones. Under it lies a `floor`, the largest median seen
    (`peak`), which falls by half over `window` applied uploads and then holds at `HOLD` x
    `peak`. A burst of tiny steps (agents whose data did not change, or an attacker lowering the
    bar) is no evidence that honest steps got shorter: an agent whose data drifts after any
    quiet period steps as the fleet did when it was busy, so a step up to `norm_factor` x the
    peak keeps at least half its length. The floor starts once `warmup` steps are in (before,
    the median of a few is no fleet's)."""

    HOLD = 0.5
    """The floor's share of the peak it never falls below, whatever the fleet sends after it."""

    def __init__(self, window: int, warmup: int = 1, per_agent: int = 3) -> None:
        self.window = max(1, window)
        self.warmup = max(1, warmup)
        self.recent: deque[tuple[str, float]] = deque(maxlen=self.window)
        self.per_agent = per_agent
        self.peak = 0.0
        """The largest median seen once `warmup` steps were in."""
        self.floor = 0.0
        """The peak, halving over every `window` applied uploads since, to `HOLD` x `peak`."""

    def add(self, agent: str, dist: float) -> None:
        self.recent.append((agent, float(dist)))
        if len(self.recent) >= self.warmup:
            median = self.median()
            self.peak = max(self.peak, median)
            self.floor = max(median, self.floor * 0.5 ** (1.0 / self.window), self.HOLD * self.peak)

    def __len__(self) -> int:
        return len(self.recent)

    def median(self) -> float:
        return float(np.median(latest_per_agent(self.recent, self.per_agent)))

    def scale(self) -> float:
        """The typical step that `norm_factor` multiplies: the median, or the floor above it."""
        return max(self.median(), self.floor)

    def state(self) -> dict[str, Any]:
        return {"recent": [[agent, dist] for agent, dist in self.recent], "floor": self.floor,
                "peak": self.peak}

    def load(self, state: dict[str, Any] | list[Any]) -> None:
        """Also a snapshot without a peak (its floor stands for it), without a floor (a plain
        list) or without the per-agent cap (plain distances, agents unknown); the floor is then
        the median of what was kept."""
        self.recent.clear()
        items = state["recent"] if isinstance(state, dict) else state
        for item in items:
            agent, dist = ("", item) if isinstance(item, (int, float)) else item
            self.recent.append((str(agent), float(dist)))
        self.floor = float(state["floor"]) if isinstance(state, dict) else (self.median() if self.recent else 0.0)
        self.peak = float(state.get("peak", self.floor)) if isinstance(state, dict) else self.floor


class Engine:
    def __init__(self, strategy: Strategy, spec: ModelSpec, cfg: Config,
                 journal: Journal | None = None, evaluator: ProxyEvaluator | None = None) -> None:
        self.strategy = strategy
        self.evaluator = evaluator or getattr(strategy, "evaluator", None)
        """Proxy sets for the per-cluster accuracy metric (None: no such metric)."""
        self.cluster_accuracy: list[float] = []
        """Accuracy of cluster model k on proxy set k (the global model on each set for
        FedAsync), refreshed by the worker between batches; read by metrics."""
        self._accuracy_epoch: int | None = None  # never computed: due at the first refresh
        self.spec = spec
        self.cfg = cfg
        self.journal = journal
        self.agents: dict[str, AgentRecord] = {}
        self.counters: Counter[str] = Counter()
        self.snapshot_every = max(1, cfg.aggregator.snapshot_every)
        self.snapshot_journal_ratio = cfg.aggregator.snapshot_journal_ratio
        self.snapshot_journal_min_bytes = cfg.aggregator.snapshot_journal_min_mb * 1e6
        cfg.codec.downlink_codec()  # an unknown downlink codec stops the start, not the first reply
        self.accepted_norms = FleetSteps(cfg.aggregator.norm_window, cfg.aggregator.norm_warmup)
        """||v - base|| of the latest applied updates: the fleet's scale for `norm_factor`."""
        self.applied: list[dict[str, Any]] = []
        """The uploads the last `handle()` applied durably (agent, epoch, staleness, ...): the
        service logs them (aggregator/service.py `ProgressLines`)."""

    # ------------------------------------------------------------------ durable state

    def state_dict(self) -> dict[str, Any]:
        d = {"strategy": self.strategy.state_dict(),
             "agents": {a: r.to_state() for a, r in self.agents.items()},
             "counters": dict(self.counters), "accepted_norms": self.accepted_norms.state()}
        if self._accuracy_epoch is not None:
            # A restart restores the metric instead of evaluating every cluster before it serves
            # (5 s for MobileNetV3-small at K = 2 on a loaded 2-core machine).
            d["cluster_accuracy"] = {"epoch": self._accuracy_epoch, "values": list(self.cluster_accuracy)}
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.strategy.load_state_dict(d["strategy"])
        self.agents = {a: AgentRecord.from_state(r) for a, r in d["agents"].items()}
        self.counters = Counter(d["counters"])
        self.accepted_norms.load(d.get("accepted_norms", []))
        acc = d.get("cluster_accuracy")
        if acc is not None:
            self.cluster_accuracy = [float(a) for a in acc["values"]]
            self._accuracy_epoch = int(acc["epoch"])

    def recover(self) -> int:
        """Load the newest snapshot and replay the journal after it; returns records replayed.

        A fresh state dir gets a first snapshot of the initial state, so that the cluster
        models a run started from are on disk before any update is acknowledged. State that
        does not fit this aggregator (another algorithm, K or model) raises JournalCorrupt
        naming the file; after a load that read past damage, a new snapshot is written at
        once so nothing is appended after it.
        """
        if self.journal is None:
            return 0
        self.journal.close()
        snapshot, records = self.journal.load()
        if snapshot is None:
            self.journal.snapshot(self.state_dict())
            return 0
        where = self.journal.snapshot_file
        try:
            self.load_state_dict(snapshot)
            for where_index, rec in enumerate(records):
                where = f"journal record {where_index} after {self.journal.snapshot_file}"
                self._replay(rec)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
            raise JournalCorrupt(f"{where} in {self.journal.dir} does not fit this aggregator "
                                 f"({type(e).__name__}: {e}); was it written with another algorithm, "
                                 f"--clusters or model? Nothing was changed: point --state-dir elsewhere "
                                 f"or move the directory away") from e
        if self.journal.needs_snapshot:
            self.journal.snapshot(self.state_dict())
            self.journal.set_aside_damaged()
        event(log, "state.recovered", records=len(records), epoch=self.strategy.uploads_applied,
              agents=len(self.agents))
        return len(records)

    def _replay(self, rec: dict[str, Any]) -> None:
        agent = rec["agent"]
        if rec["op"] == "join":
            self._reply_envelope(self.strategy.join(agent, rec.get("n_samples", 0)), rec["msg_id"], whole=True)
        else:
            known = self.agents.get(agent)  # the model it trained from, as when it was live
            start = known.trained_from(rec["tau"])[0] if known is not None else None
            sketch_bytes = rec.get("sketch")  # journaled as on the wire: the live Upload's exactly
            upload = Upload(agent=agent, vector=rec["vector"], tau=rec["tau"],
                            n_samples=rec["n_samples"], alpha=rec.get("upload_alpha"),
                            msg_id=rec["msg_id"], base=start,
                            noised=rec.get("noised", False),
                            sketch=None if sketch_bytes is None else
                            np.frombuffer(sketch_bytes, dtype="<f2").astype(np.float32))
            shared = {"replied_at": rec["replied_at"]} if "replied_at" in rec else {}  # cdfl.reply_share
            reply = self.strategy.apply(upload, rec.get("alpha"), sent=rec.get("sent"), **shared)
            if rec.get("dist") is not None:
                self.accepted_norms.add(agent, rec["dist"])
            if known is not None:
                known.moved_past(rec["tau"])
            self._reply_envelope(reply, rec["msg_id"], holds=start)
            self._count_bounds(rec)
        self.counters[f"applied.{rec['op']}"] += 1

    def _count_bounds(self, rec: dict[str, Any]) -> None:
        """`bounded.<rule>` for an applied update whose step was cut: by the step bound
        (norm_bound, norm_outlier) or by the strategy's direction guard (its trust < 1)."""
        if rec.get("bounded"):
            self.counters[f"bounded.{rec['bounded']}"] += 1
        if "trust" in rec:
            self.counters["bounded.direction"] += 1

    def refresh_cluster_accuracy(self, every_epochs: int = 1) -> None:
        """Recompute `cluster_accuracy` when the models moved by `every_epochs` since (0: after
        every batch that applied an upload; a batch of refused or duplicate messages moves no
        model, and a fuzzed or flooded aggregator would otherwise evaluate after each one)."""
        if self.evaluator is None or (self._accuracy_epoch is not None
                                      and self.strategy.uploads_applied - self._accuracy_epoch < max(1, every_epochs)):
            return
        models = self.strategy.server_models()
        if len(models) == 1:  # one global model (FedAsync, FedBuff): its accuracy on each proxy set
            self.cluster_accuracy = [float(a) for a in self.evaluator.accuracies(models)[0]]
        else:  # each cluster on its own proxy set only (the rest of the K x K matrix is unused)
            self.cluster_accuracy = [self.evaluator.accuracy_on(w, k) for k, w in enumerate(models)]
        self._accuracy_epoch = self.strategy.uploads_applied

    def snapshot_if_due(self, force: bool = False) -> bool:
        if self.journal is None:
            return False
        j = self.journal
        # Records bound replay time; bytes bound the state dir when a record is large (a
        # real-size model's upload and reply), the rule of Redis's auto-aof-rewrite.
        grown = self.snapshot_journal_ratio > 0 and j.bytes_since_snapshot >= max(
            self.snapshot_journal_ratio * j.snapshot_size, self.snapshot_journal_min_bytes)
        if force or j.records_since_snapshot >= self.snapshot_every or grown:
            j.snapshot(self.state_dict())
            return True
        return False

    # ------------------------------------------------------------------ the batch path

    def handle(self, batch: list[Inbound]) -> list[protocol.Envelope]:
        """Replies for a batch, after its applied records are durable (see module doc)."""
        out: list[protocol.Envelope] = []
        self.applied = []
        applied: list[dict[str, Any]] = []
        joins: list[protocol.Join] = []
        updates: list[tuple[protocol.Update, Upload]] = []
        steps: dict[tuple[str, str], Step | None] = {}  # -> ||v - base||, for accepted_norms
        seen_in_batch: set[tuple[str, str]] = set()
        for item in batch:
            env = item.envelope
            try:
                if env.agent != item.agent:
                    raise Rejected("agent_mismatch", f"{env.agent!r} on the topic of {item.agent!r}")
                key = (env.agent, env.msg_id)
                if key in seen_in_batch:
                    # A second copy in the same batch (a broker redelivery plus the agent's own
                    # re-send): the first copy's reply answers both.
                    self.counters["duplicates"] += 1
                    continue
                if self._is_replay(env):
                    out.append(self._answer_replay(env))
                    continue
                self._check_newer(env)
                if isinstance(env, protocol.Join):
                    self._check_spec(env.model)
                    joins.append(env)
                elif isinstance(env, protocol.Update):
                    upload, steps[key] = self._validate_update(env)
                    updates.append((env, upload))
                else:
                    raise Rejected("unexpected_type", f"{env.TYPE} is not for this aggregator")
                seen_in_batch.add(key)
            except Rejected as r:
                self.counters[f"rejected.{r.reason}"] += 1
                event(log, "uplink.rejected", agent=item.agent, msg_id=env.msg_id,
                      reason=r.reason, detail=r.detail)
                out.append(self._error(item.agent, env.msg_id, r.reason, r.detail))

        records: list[dict[str, Any]] = []
        for env in joins:
            reply = self.strategy.join(env.agent, env.n_samples)
            out.append(self._reply_envelope(reply, env.msg_id, whole=True))
            records.append({"op": "join", "agent": env.agent, "msg_id": env.msg_id,
                            "n_samples": env.n_samples})
        if updates:
            t0 = time.perf_counter()
            replies = self.strategy.update_many([u for _, u in updates])
            seconds = time.perf_counter() - t0
            _require_finite(updates, replies, self.strategy.server_models())
            # A trained reply (CDFL finetune) is journaled too: replay then re-encodes it
            # instead of training every reply again (restart time, docs/reliability.md).
            keep_sent = getattr(self.strategy, "reply_is_trained", False)
            for (env, upload), reply in zip(updates, replies, strict=True):
                self.agents[env.agent].moved_past(env.tau)
                out.append(self._reply_envelope(reply, env.msg_id, holds=upload.base))
                step = steps.get((env.agent, env.msg_id))
                records.append({"op": "update", "agent": env.agent, "msg_id": env.msg_id,
                                "tau": env.tau, "n_samples": env.n_samples,
                                "vector": upload.vector, "alpha": reply.alpha,
                                "upload_alpha": upload.alpha,
                                "dist": None if step is None else step.length,
                                **({"bounded": step.bounded_by} if step is not None and step.bounded_by else {}),
                                **({"trust": reply.info["trust"]} if "trust" in reply.info else {}),
                                "sketch": env.sketch, "noised": env.noised,
                                **({"sent": reply.vectors[0]} if keep_sent and len(reply.vectors) == 1 else {}),
                                **({"replied_at": reply.epoch} if "replied_at" in reply.info else {})})
                info = reply.info
                applied.append({"agent": env.agent, "epoch": reply.epoch, "tau": env.tau,
                                "staleness": info.get("staleness"), "stale": bool(info.get("stale")),
                                "samples": env.n_samples, "alpha": reply.alpha,
                                "betas": info.get("betas"), "batch": len(updates), "apply_s": seconds,
                                **({"reply_by": info["personalize"]["worker"]}
                                   if "worker" in info.get("personalize", {}) else {})})
        if self.journal is not None and records:
            self.journal.append(records)  # the durability point: raises JournalError
        self.applied = applied
        for rec in records:
            self.counters[f"applied.{rec['op']}"] += 1
            if rec.get("dist") is not None:
                self.accepted_norms.add(rec["agent"], rec["dist"])
            self._count_bounds(rec)
        for (agent, msg_id), step in steps.items():
            if step is not None and step.bounded_by:
                event(log, "uplink.bounded", level=logging.WARNING, agent=agent, msg_id=msg_id, rule=step.bounded_by,
                      step=round(step.sent, 4), applied_step=round(step.length, 4))
        return out

    # ------------------------------------------------------------------ validation

    def _check_spec(self, spec_hash: str) -> None:
        if spec_hash != self.spec.hash:
            raise Rejected("wrong_model", f"model spec {spec_hash} is not this fleet's "
                                          f"{self.spec.arch} ({self.spec.hash})")

    def _validate_update(self, env: protocol.Update) -> tuple[Upload, Step | None]:
        """The upload to apply (its step bounded) and the step's length (None without a base)."""
        self._check_spec(env.model)
        record = self.agents.get(env.agent)
        if record is None:
            raise Rejected("unknown_agent", f"{env.agent} has not joined; send a join first")
        if env.tensor.get("n") != self.spec.numel:
            raise Rejected("wrong_shape", f"tensor has {env.tensor.get('n')} values, "
                                          f"{self.spec.arch} has {self.spec.numel}")
        start, named = record.trained_from(env.tau)
        if env.tensor.get("delta") and start is None:
            raise Rejected("no_base", "a delta update needs a model this agent received")
        if env.tensor.get("delta") and not named:
            self._check_tau(env.tau)  # a tau from the future names no model: say that first
            raise Rejected("no_base", f"tau {env.tau} names no model this aggregator keeps for "
                                      f"{env.agent} (it holds epoch {record.base_epoch}); join again")
        base = start.numpy() if start is not None else None
        try:
            vector = codecs.decode(env.tensor, base=base if env.tensor.get("delta") else None,
                                   max_n=self.spec.numel)
        except codecs.CodecError as e:
            raise Rejected(f"codec_{e.reason}", str(e)) from None
        self._check_tau(env.tau)
        v = torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float32))
        step = None
        if start is not None:
            v, step = self._bound(start, v)
        self._check_descent(start, v)
        upload = Upload(agent=env.agent, vector=v, tau=env.tau, n_samples=env.n_samples,
                        alpha=env.alpha, msg_id=env.msg_id, base=start,
                        sketch=_decode_sketch(env), noised=env.noised)
        try:
            self.strategy.check(upload)
        except ValueError as e:
            reason = "bad_alpha" if "alpha" in str(e) else "refused"
            raise Rejected(reason, str(e)) from None
        return upload, step

    def _check_tau(self, tau: int) -> None:
        if tau > self.strategy.uploads_applied:
            raise Rejected("bad_tau", f"tau {tau} is ahead of the aggregator's epoch "
                                      f"{self.strategy.uploads_applied}")

    def step_bound(self) -> tuple[float, str | None]:
        """The longest step applied as sent and the rule that sets it (docs/reliability.md): the
        absolute `norm_bound`, or `norm_factor` x the fleet's typical step once `norm_warmup`
        uploads were applied; (inf, None) when neither is on yet."""
        a = self.cfg.aggregator
        limits = [(math.inf, None)]
        if a.norm_bound > 0:
            limits.append((a.norm_bound, "norm_bound"))
        if a.norm_factor > 0 and len(self.accepted_norms) >= self.accepted_norms.warmup:
            limits.append((a.norm_factor * self.accepted_norms.scale(), "norm_outlier"))
        return min(limits, key=lambda lim: lim[0])

    def _bound(self, start: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Step]:
        """The upload as applied and its step: a step longer than the bound is scaled down to it,
        not refused, so an honest outlier (a drifting or new agent) still contributes and a
        boosted one contributes no more than the bound. A zero bound (a fleet of zero steps)
        leaves it. In float64: the step between two finite float32 vectors can overflow float32
        (3e38 from -3e38), and a length of inf would scale it to nothing yet enter the fleet's
        window at the bound."""
        step = v.double() - start.double()
        sent = float(torch.linalg.vector_norm(step))
        bound, rule = self.step_bound()
        if rule is None or not 0 < bound < sent:
            return v, Step(sent, sent)
        return (start.double() + step * (bound / sent)).float(), Step(sent, bound, rule)

    def _check_descent(self, base: torch.Tensor | None, vector: torch.Tensor) -> None:
        """`loss_margin`: the upload must not raise the best proxy loss by more than the margin
        over the model it started from (no base, FedSoft-Async: not applied)."""
        margin = self.cfg.aggregator.loss_margin
        if margin <= 0 or base is None or self.evaluator is None:
            return
        losses = self.evaluator.losses(torch.stack([base, vector]))
        before, after = float(losses[0].min()), float(losses[1].min())
        if after > before + margin:
            raise Rejected("loss_outlier", f"update raises the best proxy loss from {before:.3f} "
                                           f"to {after:.3f}, more than the margin {margin:g}")

    # ------------------------------------------------------------------ replies

    def _is_replay(self, env: protocol.Envelope) -> bool:
        record = self.agents.get(env.agent)
        return record is not None and env.msg_id in record.recent

    def _check_newer(self, env: protocol.Envelope) -> None:
        """Refuse an id at or below the agent's high-water mark: applied once already (and out
        of the recent window), or sent out of order; either way it must not be applied."""
        record = self.agents.get(env.agent)
        if record is not None and env.msg_id <= record.high_water:
            raise Rejected("duplicate", f"msg_id {env.msg_id} is not newer than {record.high_water}, the "
                                        f"newest applied from {env.agent}: applied already or out of order "
                                        f"(an agent's msg_ids must increase)")

    def _answer_replay(self, env: protocol.Envelope) -> protocol.Envelope:
        self.counters["duplicates"] += 1
        record = self.agents.get(env.agent)
        if record is not None and record.last_msg_id == env.msg_id and record.last_reply:
            return protocol.decode(record.last_reply, max_bytes=len(record.last_reply))
        return self._error(env.agent, env.msg_id, "duplicate",
                           "this message was already applied; its reply was superseded")

    def _error(self, agent: str, msg_id: str, reason: str, detail: str) -> protocol.Error:
        return protocol.Error(agent=agent, msg_id=protocol.new_msg_id(), sent_at=protocol.now(),
                              reason=reason, detail=detail[:4096], in_reply_to=msg_id)

    def _reply_envelope(self, reply: Reply, in_reply_to: str, whole: bool = False,
                        holds: torch.Tensor | None = None) -> protocol.Model:
        """Encode the reply against what the agent holds and remember what it will hold.

        `whole` (joins) sends the whole model: an agent that joins may hold nothing, or a model
        out of step with ours, so a join is how it gets back in sync. `holds`: the model the
        answered upload was trained from (our latest reply's unless its tau named an earlier)."""
        record = self.agents.setdefault(reply.agent, AgentRecord())
        c = self.cfg.codec
        name, params = c.downlink_codec(self.spec.statistics_numel)
        tensors = []
        if reply.kind == "clusters":
            # All K models, each whole: the agent's next upload is a whole vector too.
            for vec in reply.vectors:
                tensors.append(codecs.encode(vec, name, zstd=c.zstd, **params))
            record.hold(None, reply.epoch)
        else:
            (vec,) = reply.vectors
            held = holds if holds is not None else record.base
            base = held.numpy() if (c.delta and held is not None and not whole) else None
            wire = codecs.encode(vec, name, base=base, zstd=c.zstd, **params)
            tensors.append(wire)
            # The agent will hold exactly what it decodes, lossy codec or not.
            record.hold(torch.from_numpy(codecs.decode(wire, base=base).copy()), reply.epoch)
        env = protocol.Model(agent=reply.agent, msg_id=protocol.new_msg_id(),
                             sent_at=protocol.now(), epoch=reply.epoch, model=self.spec.hash,
                             tensors=tensors, in_reply_to=in_reply_to, alpha=reply.alpha,
                             kind=reply.kind)
        record.last_reply = protocol.encode(env)
        record.last_msg_id = in_reply_to
        record.recent.append(in_reply_to)
        record.high_water = max(record.high_water, in_reply_to)
        return env


def _require_finite(updates: list[tuple[protocol.Update, Upload]], replies: list[Reply],
                    models: torch.Tensor) -> None:
    """NotFinite when a reply or a server model holds NaN or Inf after the batch was applied."""
    bad = [env.agent for (env, _), reply in zip(updates, replies, strict=True)
           if not all(bool(torch.isfinite(v).all()) for v in reply.vectors)]
    if bad or not bool(torch.isfinite(models).all()):
        raise NotFinite(bad or [env.agent for env, _ in updates])


def _decode_sketch(env: protocol.Update) -> np.ndarray | None:
    """The upload's data sketch as float32, checked: this server's method, length, finite,
    within [-1, 1] (a mean of cosines)."""
    if env.sketch is None:
        return None
    if env.sketch_method != sketch.METHOD:
        raise Rejected("bad_sketch", f"sketch made by {env.sketch_method!r}; this aggregator "
                                     f"reads {sketch.METHOD!r}")
    values = np.frombuffer(env.sketch, dtype="<f2").astype(np.float32)
    if values.shape != (sketch.DIM,):
        raise Rejected("bad_sketch", f"sketch has {values.size} values, {sketch.METHOD} has {sketch.DIM}")
    if not np.isfinite(values).all() or np.abs(values).max() > 1.0:
        raise Rejected("bad_sketch", "sketch values must be finite and within [-1, 1]")
    return values
