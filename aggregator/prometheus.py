"""Prometheus metrics of the aggregator (`fedmq aggregator --metrics-port PORT`).

Counts are not kept twice: a collector reads the counters the service, the engine and the
strategy already keep (and the engine persists in its snapshots) at scrape time, so a metric
cannot drift from what the logs and the journal say. Only latencies need observing as they
happen: two histograms fed once per batch by the service, and one around the strategy's
batched evaluation. Everything lives in the instance's own registry, so several aggregators
(tests) can run in one process.

Reads happen on the HTTP server's thread while the worker mutates: each counter dict is
copied in one C-level `dict()` call under the GIL, so a scrape sees a consistent-enough
snapshot of each dict and never an exception. docs/deploy.md lists the metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedmq import protocol

if TYPE_CHECKING:
    from aggregator.service import AggregatorService

PREFIX = "fedmq_aggregator"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
"""Seconds; from a 1 ms evaluation of a few uploads on a GPU to a minute of queueing."""


def _counts(counter: Any) -> dict[str, float]:
    return dict(counter) if counter is not None else {}


class ServiceCollector(Collector):
    """Turns the service's, engine's and strategy's live counters into Prometheus metrics."""

    def __init__(self, service: AggregatorService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        engine = svc.engine
        strategy = engine.strategy
        eng = _counts(engine.counters)
        own = _counts(svc.counters)
        strat = _counts(getattr(strategy, "counters", None))

        info = GaugeMetricFamily(f"{PREFIX}_info", "Which algorithm serves which fleet (always 1).",
                                 labels=["fleet", "algorithm"])
        info.add_metric([svc.fleet, svc.cfg.aggregator.algorithm], 1)
        yield info

        applied = eng.get("applied.update", 0)
        stale = strat.get("stale", 0)
        uploads = CounterMetricFamily(
            f"{PREFIX}_uploads", "Model uploads answered with a model: applied (clusters moved) or "
            "stale (t - tau above the threshold: answered, clusters unchanged).", labels=["result"])
        uploads.add_metric(["applied"], max(0, applied - stale))
        uploads.add_metric(["stale"], stale)
        yield uploads

        rejected = CounterMetricFamily(
            f"{PREFIX}_rejected", "Uplinks refused with an error reply, by reason (protocol-level "
            "refusals such as malformed or too_large, and engine checks such as wrong_shape).",
            labels=["reason"])
        reasons: dict[str, float] = {}
        for source, prefix in ((eng, "rejected."), (own, "refused.")):
            for key, value in source.items():
                if key.startswith(prefix):
                    reason = key[len(prefix):]
                    reasons[reason] = reasons.get(reason, 0) + value
        for reason, value in sorted(reasons.items()):
            rejected.add_metric([reason], value)
        yield rejected

        yield CounterMetricFamily(f"{PREFIX}_joins", "Joins answered with a model.",
                                  value=eng.get("applied.join", 0))
        yield CounterMetricFamily(f"{PREFIX}_shared_replies", "Uploads answered by a reply trained "
                                  "for a group of queued uploads with close alphas, beyond one per group "
                                  "(cdfl.reply_share).", value=strat.get("replies_shared", 0))
        yield CounterMetricFamily(f"{PREFIX}_duplicates", "Replays of an applied msg_id "
                                  "(answered again, applied once).", value=eng.get("duplicates", 0))
        replies = CounterMetricFamily(f"{PREFIX}_replies", "Downlink envelopes sent, by type.",
                                      labels=["type"])
        for key, value in sorted(own.items()):
            if key.startswith("sent."):
                replies.add_metric([key[len("sent."):]], value)
        yield replies
        yield CounterMetricFamily(f"{PREFIX}_journal_errors", "Batches not acknowledged because "
                                  "the state dir could not be written.", value=own.get("journal_errors", 0))
        yield CounterMetricFamily(f"{PREFIX}_batch_failures", "Batches that raised (a bug); their "
                                  "messages stay unacknowledged.", value=own.get("batch_failures", 0))

        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Raw messages received and waiting for "
                                "the worker (bounded by aggregator.inbox_max_messages).",
                                value=svc._inbox.qsize())
        yield GaugeMetricFamily(f"{PREFIX}_queue_bytes", "Payload bytes waiting for the worker "
                                "(bounded by aggregator.inbox_max_bytes).", value=svc.inbox_bytes)
        yield GaugeMetricFamily(f"{PREFIX}_reading_paused", "1 while back-pressure has stopped "
                                "reading from the broker.", value=int(svc.transport.reading_paused))
        yield GaugeMetricFamily(f"{PREFIX}_unacked_deliveries", "Deliveries taken from the broker "
                                "on this connection and not yet acknowledged; the broker stops "
                                "delivering when it reaches its in-flight window.", value=svc.transport.unacked)
        yield CounterMetricFamily(f"{PREFIX}_backpressure_pauses", "Times the inbox filled and "
                                  "reading from the broker stopped.",
                                  value=own.get("backpressure.paused", 0))
        yield GaugeMetricFamily(f"{PREFIX}_epoch", "The strategy's epoch t (applied uploads).",
                                value=strategy.uploads_applied)
        yield GaugeMetricFamily(f"{PREFIX}_known_agents", "Agents the engine holds a record of.",
                                value=len(engine.agents))
        if engine.journal is not None:
            disk = GaugeMetricFamily(f"{PREFIX}_state_bytes", "The state dir's newest snapshot and the "
                                     "journal since it, in bytes (the dir also keeps the generation before, and a third "
                                     "snapshot while one is written).",
                                     labels=["part"])
            disk.add_metric(["snapshot"], engine.journal.snapshot_size)
            disk.add_metric(["journal"], engine.journal.bytes_since_snapshot)
            yield disk
        presence = dict(svc.presence)
        online = sum(1 for state in presence.values() if state == "online")
        yield GaugeMetricFamily(f"{PREFIX}_connected_agents", "Agents whose retained status says "
                                "online (an agent that dies turns offline by its last will).",
                                value=online)
        agents = GaugeMetricFamily(f"{PREFIX}_agents", "Agents seen on the status topics, by state.",
                                   labels=["state"])
        agents.add_metric(["online"], online)
        agents.add_metric(["offline"], len(presence) - online)
        yield agents
        yield GaugeMetricFamily(f"{PREFIX}_broker_connected", "1 while the MQTT connection is up.",
                                value=1 if svc.transport.connected else 0)

        pool = getattr(strategy, "personalizer", None)
        if getattr(pool, "fan_out", False):  # reply workers (aggregator/reply_pool.py)
            yield GaugeMetricFamily(f"{PREFIX}_workers_online", "Reply workers online that can take "
                                    "this aggregator's jobs.", value=pool.online)
            made = CounterMetricFamily(f"{PREFIX}_worker_replies", "Trained replies, by where they "
                                       "were trained (a worker, or here while none could).", labels=["where"])
            made.add_metric(["worker"], pool.counters.get("replies.remote", 0))
            made.add_metric(["aggregator"], pool.counters.get("replies.local", 0))
            yield made
            yield CounterMetricFamily(f"{PREFIX}_worker_redispatched", "Reply jobs given to another "
                                      "worker (their worker went offline, restarted or timed out).",
                                      value=pool.counters.get("jobs.redispatched", 0))

        accuracy: Sequence[float] = list(getattr(engine, "cluster_accuracy", None) or [])
        if accuracy:
            acc = GaugeMetricFamily(f"{PREFIX}_cluster_accuracy", "Accuracy of cluster model k on "
                                    "proxy set k (FedAsync: the global model on each set), as of "
                                    "the last refresh (aggregator.accuracy_every).", labels=["cluster"])
            for k, value in enumerate(accuracy):
                acc.add_metric([str(k)], float(value))
            yield acc


class AggregatorMetrics:
    """The metrics of one `AggregatorService`; `serve(port)` starts the /metrics endpoint.

        metrics = AggregatorMetrics(service)   # observes each batch of the service
        port = metrics.serve(9100, "0.0.0.0")
    """

    def __init__(self, service: AggregatorService, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.evaluation_seconds = Histogram(
            f"{PREFIX}_evaluation_seconds", "Time of one batched strategy update (estimating "
            "alpha on the proxy sets and moving the clusters) for a batch of uploads.",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_seconds", "Time from handing a batch to the engine until its replies "
            "are published and its messages acknowledged (validation, evaluation, journal fsync).",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.end_to_end_seconds = Histogram(
            f"{PREFIX}_end_to_end_seconds", "Per upload, from the agent's sent_at to the reply "
            "being published: broker, queueing and processing (agent clock skew included; "
            "negative values count as 0).", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(ServiceCollector(service))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._time_strategy()
        service.batch_observers.append(self.observe_batch)

    def _time_strategy(self) -> None:
        """Wrap the strategy's `update_many` (the live path only; journal replay uses `apply`),
        so that the engine stays free of metrics code."""
        strategy = self.service.engine.strategy
        inner: Callable[[list[Any]], list[Any]] = strategy.update_many
        histogram = self.evaluation_seconds

        def timed_update_many(uploads: list[Any]) -> list[Any]:
            t0 = time.perf_counter()
            try:
                return inner(uploads)
            finally:
                if uploads:
                    histogram.observe(time.perf_counter() - t0)

        strategy.update_many = timed_update_many  # type: ignore[method-assign]

    def observe_batch(self, envelopes: Sequence[protocol.Envelope], seconds: float) -> None:
        """Called by the service once a batch is replied to and acknowledged."""
        self.batch_seconds.observe(seconds)
        now = protocol.now()
        for env in envelopes:
            if isinstance(env, protocol.Update):
                self.end_to_end_seconds.observe(max(0.0, now - env.sent_at))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port (0: a free port) in a daemon thread; returns the port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
