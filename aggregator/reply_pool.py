"""The aggregator's side of the reply workers: trained replies fanned out over the broker.

`ReplyPool` is a `Personalizer` that wraps the aggregator's own (a fine-tune; its start is
fixed before the job leaves, aggregator/personalize.py `fix_start`). CDFL calls
`personalize_many` with every reply of a batch; the pool gives each job to a worker with a
free slot on that worker's own topic, and returns when every vector is back. The engine then
journals the batch and answers the agents exactly as without workers, so the cluster state
keeps its single writer and an acknowledged upload is in the journal (docs/reliability.md).

Why the aggregator assigns jobs itself instead of an MQTT 5 shared subscription: Mosquitto
deals shared messages round-robin whatever a subscriber is doing, so an 8-epoch job can wait
behind another on a busy worker while the next one idles; RabbitMQ 3.10 (MQTT 3.1.1) has no
shared subscriptions at all. Each worker says how many jobs it takes at once (`slots`), and
the pool never gives it more: a job waits only when every worker is busy.

A job is given to another worker when its worker goes offline (its will) or restarts, and
when it is not back within `aggregator.worker_timeout_s`; with no worker online that could
take it, the aggregator trains the reply itself (as without workers). A reply is never lost
to a worker: the upload it answers stays unacknowledged until the reply is made somewhere.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from aggregator import reply_jobs
from aggregator.personalize import Personalizer, PersonalizeRequest
from fedmq import protocol
from fedmq.config import BrokerSettings
from fedmq.logs import PROGRESS, event, get_logger
from fedmq.service_logins import REPLIES, derived_url
from fedmq.transport import Message, MqttTransport, NetworkLoop

log = get_logger("aggregator")


@dataclass
class _Worker:
    status: reply_jobs.WorkerStatus
    busy: set[str] = field(default_factory=set)
    suspect: bool = False
    """A job timed out on it: no new job until it announces itself again."""


@dataclass
class _Job:
    wire: reply_jobs.Job
    request: PersonalizeRequest
    worker: str = ""
    deadline: float = 0.0
    tries: int = 0


def pool_broker(broker: BrokerSettings, derived_logins: bool = True) -> BrokerSettings:
    """The pool's broker settings: logged in as USER-replies (fedmq/service_logins.py) when the
    aggregator's URL names USER, so that its second connection is a session of its own."""
    return dataclasses.replace(broker, url=derived_url(broker.url, REPLIES)) if derived_logins else broker


class ReplyPool(Personalizer):
    """Fan trained replies out to reply workers (module doc); the wrapped personalizer is the
    fallback and decides everything a reply is made of."""

    fan_out = True
    """CDFL hands the pool every reply of a batch at once (aggregator/cdfl.py)."""

    def __init__(self, local: Personalizer, digest: str, fleet: str, broker: BrokerSettings, *,
                 numel: int, k: int, timeout_s: float = 300.0, client_id: str | None = None,
                 network: NetworkLoop | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"aggregator.worker_timeout_s must be > 0, got {timeout_s}")
        self.local = local
        self.name = local.name
        self.digest = digest
        self.fleet = fleet
        self.numel, self.k = numel, k
        self.timeout_s = float(timeout_s)
        self.workers: dict[str, _Worker] = {}
        self.counters: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._results: dict[str, tuple[Tensor, dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._prefix = protocol.new_msg_id()
        self._mismatch_logged: set[str] = set()
        # Its own connection: the service's pauses reading under back-pressure, and results
        # must still arrive then (the batch they finish is what frees the inbox).
        self.transport = MqttTransport(client_id or f"fedmq-aggregator-{fleet}-replies", broker,
                                       clean_start=True, network=network)

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> ReplyPool:
        self.transport.connect(timeout=timeout)
        self.transport.subscribe(protocol.all_workers(self.fleet, "status"), self._on_status, qos=1)
        self.transport.subscribe(protocol.all_workers(self.fleet, "done"), self._on_done, qos=1)
        return self

    def close(self) -> None:
        self.transport.close()

    @property
    def online(self) -> int:
        """Workers that can take this aggregator's jobs now."""
        with self._cond:
            return sum(1 for w in self.workers.values() if self._eligible(w))

    def wait_for_workers(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for w in self.workers.values() if self._eligible(w)) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    # ------------------------------------------------------------------ network thread

    def _eligible(self, w: _Worker) -> bool:
        return w.status.state == "online" and w.status.digest == self.digest and not w.suspect

    def _read(self, message: Message, decode: Callable[[bytes], Any], topic_of: Callable[[str, str], str]) -> Any:
        """The decoded status or result, or None (logged) when it is malformed or its topic is
        not the worker it names."""
        try:
            got = decode(message.payload)
            if message.topic != topic_of(self.fleet, got.worker):
                raise reply_jobs.JobError(f"message of worker {got.worker!r} on {message.topic}")
        except (reply_jobs.JobError, protocol.ProtocolError) as e:
            event(log, "worker.refused", level=30, topic=message.topic, reason=str(e))
            return None
        return got

    def _on_status(self, message: Message) -> None:
        if not message.payload:
            return
        status = self._read(message, reply_jobs.decode_status, protocol.worker_status)
        if status is None:
            return
        with self._cond:
            known = self.workers.get(status.worker)
            restarted = known is not None and known.status.started_at != status.started_at
            if known is not None and (status.state == "offline" or restarted):
                self._requeue(known, "worker offline" if status.state == "offline" else "worker restarted")
            if status.state == "online" and status.digest != self.digest \
                    and status.worker not in self._mismatch_logged:
                self._mismatch_logged.add(status.worker)
                event(log, "worker.mismatch", level=30, worker=status.worker,
                      detail="trains with another model, personalizer setting or proxy data than this "
                             "aggregator; it gets no jobs (start it with the aggregator's config)")
            self.workers[status.worker] = _Worker(status, busy=known.busy if known and not restarted
                                                  and status.state == "online" else set())
            self._cond.notify_all()
        if status.state == "online" and status.digest == self.digest:
            event(log, "worker.online", level=PROGRESS, worker=status.worker, slots=status.slots,
                  device=status.device)
        elif status.state == "offline":
            event(log, "worker.offline", level=PROGRESS, worker=status.worker)

    def _on_done(self, message: Message) -> None:
        done = self._read(message, lambda payload: reply_jobs.decode_done(payload, self.numel), protocol.worker_done)
        if done is None:
            return
        with self._cond:
            w = self.workers.get(done.worker)
            if w is not None:
                w.busy.discard(done.job)
            job = self._jobs.get(done.job)
            if job is None or done.job in self._results:
                self._cond.notify_all()
                return  # late (given to another meanwhile) or unknown: its slot is free again
            if done.vector is None:
                event(log, "worker.job_refused", level=30, worker=done.worker, job=done.job, reason=done.error)
                self.counters["jobs.refused"] += 1
                if w is not None:
                    w.suspect = True
                job.worker = ""
            else:
                self._results[done.job] = (done.vector, {**done.diag, "worker": done.worker})
            self._cond.notify_all()

    def _requeue(self, w: _Worker, why: str) -> None:
        """Under the lock: the jobs on `w` go back to the queue."""
        for job_id in list(w.busy):
            job = self._jobs.get(job_id)
            if job is not None and job_id not in self._results and job.worker == w.status.worker:
                job.worker = ""
                self.counters["jobs.redispatched"] += 1
                event(log, "worker.job_redispatched", level=30, worker=w.status.worker, job=job_id, reason=why)
        w.busy.clear()

    # ------------------------------------------------------------------ Personalizer

    def trains_together(self) -> bool:
        return self.local.trains_together()

    def fix_start(self, request: PersonalizeRequest) -> None:
        self.local.fix_start(request)

    def reads_upload(self) -> bool:
        return self.local.reads_upload()

    def personalize(self, request: PersonalizeRequest) -> tuple[Tensor, dict[str, Any]]:
        return self.personalize_many([request])[0]

    def personalize_many(self, requests: Sequence[PersonalizeRequest]) -> list[tuple[Tensor, dict[str, Any]]]:
        """Every request's reply, trained by workers where one can take it (module doc)."""
        if not self.trains_together():  # a reply that reads the moving clusters (distillation)
            return self.local.personalize_many(requests)
        ids = []
        with self._cond:
            for r in requests:
                if r.start is None:
                    self.local.fix_start(r)
                job_id = f"{self._prefix}-{next(self._ids)}"
                assert r.start is not None
                self._jobs[job_id] = _Job(reply_jobs.Job(job_id, self.digest, int(r.seed), [float(a) for a in r.alpha],
                                                         r.start), r)
                ids.append(job_id)
        try:
            return self._collect(ids)
        finally:
            with self._cond:
                for job_id in ids:
                    self._jobs.pop(job_id, None)
                    self._results.pop(job_id, None)

    def _collect(self, ids: list[str]) -> list[tuple[Tensor, dict[str, Any]]]:
        while True:
            with self._cond:
                sends, local = self._assign(ids)
                if not sends and not local:
                    if all(j in self._results for j in ids):
                        break
                    now = time.monotonic()
                    deadlines = [self._jobs[j].deadline for j in ids
                                 if self._jobs[j].worker not in ("", "local") and j not in self._results]
                    self._cond.wait(max(0.01, min(min(deadlines, default=now + 1.0) - now, 1.0)))
                    continue
            for worker, job in sends:  # outside the lock: a full publish window waits for PUBACKs
                self.transport.publish(protocol.worker_jobs(self.fleet, worker), reply_jobs.encode_job(job), qos=1)
            for job_id in local:
                self.counters["replies.local"] += 1
                vector, diag = self.local.personalize(self._jobs[job_id].request)
                with self._cond:
                    self._results[job_id] = (vector, {**diag, "worker": "aggregator"})
        self.counters["replies.remote"] += sum(1 for j in ids if self._results[j][1].get("worker") != "aggregator")
        return [self._results[j] for j in ids]

    def _assign(self, ids: list[str]) -> tuple[list[tuple[str, reply_jobs.Job]], list[str]]:
        """Under the lock: time out overdue jobs, give waiting ones to free workers; the jobs
        to publish, and those the aggregator must train itself (no worker could take them)."""
        now = time.monotonic()
        for job_id in ids:
            job = self._jobs[job_id]
            if job_id in self._results or job.worker in ("", "local") or now < job.deadline:
                continue
            w = self.workers.get(job.worker)
            event(log, "worker.job_timeout", level=30, worker=job.worker, job=job_id, after_s=self.timeout_s,
                  action="given to another worker; this one gets no job until it announces itself again")
            if w is not None:
                w.suspect = True
                self._requeue(w, "timeout")
            job.worker = ""
        sends: list[tuple[str, reply_jobs.Job]] = []
        waiting = [j for j in ids if j not in self._results and not self._jobs[j].worker]
        for job_id in waiting:
            worker = self._free_worker()
            if worker is None:
                break
            job = self._jobs[job_id]
            job.worker, job.deadline, job.tries = worker, now + self.timeout_s, job.tries + 1
            self.workers[worker].busy.add(job_id)
            self.counters["jobs.sent"] += 1
            sends.append((worker, job.wire))
        local = [j for j in ids if j not in self._results and not self._jobs[j].worker]
        if local and any(self._eligible(w) for w in self.workers.values()):
            local = []  # every worker is busy: wait for a slot
        for job_id in local:
            self._jobs[job_id].worker = "local"
        return sends, local

    def _free_worker(self) -> str | None:
        """The eligible worker with the most free slots (ties: the least recently started job)."""
        best, free = None, 0
        for name, w in self.workers.items():
            left = w.status.slots - len(w.busy)
            if self._eligible(w) and left > free:
                best, free = name, left
        return best
