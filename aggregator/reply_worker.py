"""A reply worker: trains CDFL's personalized replies for an aggregator (docs/scaling.md).

It holds what a reply reads, the proxy sets and the personalizer's settings, built from the
same config as the aggregator's (so the same `reply_digest`), and nothing of the cluster
state. It announces itself on its retained status topic (offline is its last will), takes
jobs on its own jobs topic, `slots` at a time, and publishes each trained vector on its done
topic. It keeps no state: a worker killed mid-job only makes the aggregator give the job to
another one (aggregator/reply_pool.py).
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from typing import Any

import torch

from aggregator import reply_jobs
from aggregator.evaluator import ProxyEvaluator
from aggregator.personalize import Personalizer, PersonalizeRequest
from fedmq import protocol
from fedmq.config import Config
from fedmq.logs import event, get_logger
from fedmq.models import ModelSpec
from fedmq.transport import Message, MqttTransport, NetworkLoop, Will

log = get_logger("worker")


def build_reply_parts(cfg: Config) -> tuple[ModelSpec, ProxyEvaluator, Personalizer]:
    """The spec, proxy evaluator and personalizer a CDFL aggregator with `cfg` replies with:
    the proxy sets drawn as aggregator/bootstrap.py draws them, no cluster pre-training."""
    from aggregator.bootstrap import resolve_device
    from aggregator.cdfl import cdfl_evaluator, cdfl_personalizer
    from fedmq.data import clusters_from_settings
    from fedmq.models import model_spec, resolve_model_name

    spec = model_spec(resolve_model_name(cfg.model, cfg.data.dataset))
    k = cfg.cdfl.clusters
    clusters = clusters_from_settings(cfg.data, k, seed=cfg.seed)
    proxies = [clusters.proxy(i, cfg.data.proxy_per_cluster or None) for i in range(k)]
    evaluator = cdfl_evaluator(spec, [(p.x, p.y) for p in proxies], cfg.cdfl, resolve_device(cfg.device))
    return spec, evaluator, cdfl_personalizer(cfg.cdfl, evaluator)


class ReplyWorker:
    """Serve one fleet's reply jobs until `stop()` (module doc)."""

    def __init__(self, cfg: Config, worker_id: str, spec: ModelSpec, evaluator: ProxyEvaluator,
                 personalizer: Personalizer, *, slots: int = 1, network: NetworkLoop | None = None) -> None:
        protocol.validate_id(worker_id, "worker id")
        if slots < 1:
            raise ValueError(f"--slots must be >= 1, got {slots}")
        if not personalizer.trains_together():
            raise ValueError(f"cdfl.personalization = {personalizer.name!r} reads the moving cluster models; "
                             f"only fine-tune replies (finetune, or distill with personalize_kd_weight = 0) "
                             f"run on reply workers")
        self.cfg, self.worker_id, self.spec = cfg, worker_id, spec
        self.evaluator, self.personalizer = evaluator, personalizer
        self.slots = slots
        # One personalizer per slot: a training swaps the parameters of its evaluator's module in
        # place (torch.func.functional_call), so two trainings must not share one.
        self._slot_personalizers = [personalizer] + [copy.deepcopy(personalizer) for _ in range(slots - 1)]
        self.digest = reply_jobs.reply_digest(personalizer, evaluator)
        self.started_at = time.time()
        self.done = 0
        self._jobs: queue.Queue[Message | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.transport = MqttTransport(
            f"fedmq-worker-{cfg.fleet}-{worker_id}", cfg.broker, clean_start=True,
            will=Will(protocol.worker_status(cfg.fleet, worker_id), self._status("offline")), network=network)

    def _status(self, state: str) -> bytes:
        return reply_jobs.encode_status(reply_jobs.WorkerStatus(
            worker=self.worker_id, state=state, slots=self.slots if state == "online" else 0,
            digest=self.digest, started_at=self.started_at, device=str(self.evaluator.device)))

    def start(self, timeout: float = 30.0) -> ReplyWorker:
        fleet = self.cfg.fleet
        self.transport.subscribe(protocol.worker_jobs(fleet, self.worker_id), self._jobs.put, qos=1)
        self.transport.on_connect_hooks.append(lambda t, _: t.publish(
            protocol.worker_status(fleet, self.worker_id), self._status("online"), qos=1, retain=True))
        self.transport.connect(timeout=timeout)
        for i in range(self.slots):
            t = threading.Thread(target=self._serve, args=(self._slot_personalizers[i],),
                                 name=f"fedmq-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        event(log, "worker.started", worker=self.worker_id, fleet=fleet, slots=self.slots,
              device=str(self.evaluator.device), threads=torch.get_num_threads(), digest=self.digest[:12])
        return self

    def stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=60)
        if self.transport.connected:
            self.transport.publish(protocol.worker_status(self.cfg.fleet, self.worker_id),
                                   self._status("offline"), qos=1, retain=True).wait(5)
        self.transport.close()

    def __enter__(self) -> ReplyWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self, personalizer: Personalizer) -> None:
        while True:
            message = self._jobs.get()
            if message is None:
                return
            try:
                done = self.train(message.payload, personalizer)
            except Exception as e:  # a bug must not kill the worker; the aggregator re-dispatches
                log.exception("job failed")
                done = reply_jobs.Done(job="unknown", worker=self.worker_id, error=f"{type(e).__name__}: {e}"[:300])
            self.transport.publish(protocol.worker_done(self.cfg.fleet, self.worker_id),
                                   reply_jobs.encode_done(done), qos=1)

    def train(self, payload: bytes, personalizer: Personalizer | None = None) -> reply_jobs.Done:
        """One job's reply (or why it is refused), with this slot's `personalizer`."""
        try:
            job = reply_jobs.decode_job(payload, self.spec.numel, self.evaluator.num_sets)
        except reply_jobs.JobError as e:
            event(log, "job.refused", level=30, reason=str(e))
            return reply_jobs.Done(job="unreadable", worker=self.worker_id, error=str(e))
        if job.digest != self.digest:
            return reply_jobs.Done(job=job.job, worker=self.worker_id,
                                   error="digest differs: this worker trains with another config or data")
        t0 = time.perf_counter()
        request = PersonalizeRequest(torch.empty(0), job.alpha, None, seed=job.seed, start=job.start, start_info={})
        vector, diag = (personalizer or self.personalizer).personalize(request)
        self.done += 1
        info: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 4), "steps": diag.get("steps", 0)}
        event(log, "job.done", level=20, worker=self.worker_id, job=job.job, **info)
        return reply_jobs.Done(job=job.job, worker=self.worker_id, vector=vector, diag=info)


def worker_config_from_env(cfg: Config) -> Config:
    """A worker started by `fedmq aggregator --workers N` gets the aggregator's resolved config
    in FEDMQ_WORKER_CONFIG (JSON; the environment, so the broker password is never on a
    command line or in a file)."""
    text = os.environ.get("FEDMQ_WORKER_CONFIG")
    if not text:
        return cfg
    import json

    from fedmq.config import config_from_dict

    return config_from_dict(json.loads(text))
