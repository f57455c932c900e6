"""Broker round trips through MqttTransport on loopback Mosquitto (broker_config/dev.conf).

    .venv/bin/python -m bench broker            # full
    .venv/bin/python -m bench broker --quick    # smoke

Measures what an update/reply costs on the wire, without the protocol or the model:
- rtt_500k: a 0.5 MB QoS 1 request on one topic, echoed by a second client on another
  (like an update and its personalized model), one at a time: p50/p99 latency and MB/s.
- stream_500k: one publisher pushes 0.5 MB QoS 1 messages through the publish window to one
  subscriber: MB/s, first publish to last delivery.
- small_qos1: 100 B QoS 1 messages, one publisher -> one subscriber: msgs/s.
- rtt_100b_nodelay_on / _off: the 100 B round trip with TCP_NODELAY on and off on both
  clients (the broker always has set_tcp_nodelay true): Nagle + delayed ACK cost.
"""

from __future__ import annotations

import statistics
import threading
import time

from fedmq.broker import MosquittoBroker
from fedmq.config import BrokerSettings
from fedmq.transport import Message, MqttTransport


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _round_trips(settings: BrokerSettings, payload: bytes, n: int, nodelay: bool, tag: str) -> list[float]:
    """n sequential request -> echo -> reply round trips; seconds each."""
    reply = threading.Event()
    with MqttTransport(f"echo-{tag}", settings, clean_start=True, tcp_nodelay=nodelay) as echo, \
            MqttTransport(f"req-{tag}", settings, clean_start=True, tcp_nodelay=nodelay) as req:
        echo.subscribe(f"bench/{tag}/req", lambda m: echo.publish(f"bench/{tag}/rep", m.payload))
        req.subscribe(f"bench/{tag}/rep", lambda m: reply.set())
        times: list[float] = []
        for i in range(n + 3):  # 3 warm-up round trips
            reply.clear()
            t0 = time.perf_counter()
            req.publish(f"bench/{tag}/req", payload)
            if not reply.wait(30):
                raise RuntimeError(f"no echo within 30 s ({tag}, round trip {i})")
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return times


def _stream(settings: BrokerSettings, payload: bytes, n: int, tag: str) -> float:
    """Seconds from the first publish until the subscriber has all n messages."""
    got = 0
    done = threading.Event()

    def count(_: Message) -> None:
        nonlocal got
        got += 1
        if got == n:
            done.set()

    with MqttTransport(f"sub-{tag}", settings, clean_start=True) as sub, \
            MqttTransport(f"pub-{tag}", settings, clean_start=True) as pub:
        sub.subscribe(f"bench/{tag}", count)
        t0 = time.perf_counter()
        for _ in range(n):
            pub.publish(f"bench/{tag}", payload)
        if not done.wait(120):
            raise RuntimeError(f"stream {tag}: {got}/{n} delivered within 120 s")
        return time.perf_counter() - t0


def _latency(times: list[float], payload_bytes: int) -> dict:
    return {
        "n": len(times),
        "p50_ms": round(statistics.median(times) * 1e3, 3),
        "p99_ms": round(_percentile(times, 0.99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(times) * 1e3, 3),
        "payload_bytes": payload_bytes,
        # payload MB requested per second of round trips (each also travels back)
        "mb_per_s": round(payload_bytes * len(times) / sum(times) / 1e6, 1),
    }


def run(quick: bool) -> dict:
    big = bytes(range(256)) * 2048  # 0.5 MiB
    small = b"x" * 100
    n_rtt, n_stream, n_small = (30, 60, 3000) if quick else (200, 400, 20000)
    n_nodelay_on, n_nodelay_off = (30, 15) if quick else (200, 60)
    with MosquittoBroker.dev() as broker:
        settings = BrokerSettings(url=broker.url)
        out: dict = {"broker": "mosquitto " + _mosquitto_version(broker), "config": "broker_config/dev.conf",
                     "window": settings.max_inflight}
        out["rtt_500k"] = _latency(_round_trips(settings, big, n_rtt, True, "big"), len(big))
        secs = _stream(settings, big, n_stream, "stream")
        out["stream_500k"] = {"n": n_stream, "payload_bytes": len(big),
                              "mb_per_s": round(len(big) * n_stream / secs / 1e6, 1),
                              "msgs_per_s": round(n_stream / secs, 1)}
        secs = _stream(settings, small, n_small, "small")
        out["small_qos1"] = {"n": n_small, "payload_bytes": len(small),
                             "msgs_per_s": round(n_small / secs)}
        out["rtt_100b_nodelay_on"] = _latency(_round_trips(settings, small, n_nodelay_on, True, "on"), 100)
        out["rtt_100b_nodelay_off"] = _latency(_round_trips(settings, small, n_nodelay_off, False, "off"), 100)
    return out


def _mosquitto_version(broker: MosquittoBroker) -> str:
    for line in broker.log_tail(50).splitlines():
        if "mosquitto version" in line:
            return line.split("mosquitto version", 1)[1].split()[0]
    return "?"
