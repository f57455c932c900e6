"""Does the broker's in-flight window bound what a manual-ack subscriber holds unacknowledged?

The aggregator relies on it for back-pressure (docs/architecture.md). This measures it on the
real broker: one paho subscriber with manual acks (as the aggregator's transport) acks each
message 5 ms after it arrives; `publishers` clients publish `per_publisher` QoS 1 messages
each at once. Figure: the most messages delivered to the subscriber and not yet acknowledged,
against `max_inflight_messages` (64 in broker_config/dev.conf). A second phase never acks:
the broker then stops at the window.

    python -m soak.broker_window        # -> soak/results/broker_window.json
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from fedmq.errors import run_main
from soak.fleet_setup import write_figures


def measure(port: int, *, publishers: int, per_publisher: int, ack: bool, tag: str) -> dict[str, Any]:
    inbox: queue.Queue[mqtt.MQTTMessage | None] = queue.Queue()
    counts = {"delivered": 0, "acked": 0, "max_unacked": 0}
    lock = threading.Lock()

    def on_message(client: Any, userdata: Any, m: mqtt.MQTTMessage) -> None:
        with lock:
            counts["delivered"] += 1
            counts["max_unacked"] = max(counts["max_unacked"], counts["delivered"] - counts["acked"])
        inbox.put(m)

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"window-{tag}",
                      protocol=mqtt.MQTTv5, manual_ack=True)
    sub.on_message = on_message
    sub.connect("127.0.0.1", port)
    sub.loop_start()
    sub.subscribe(f"window/{tag}/+", qos=1)
    time.sleep(0.3)

    def work() -> None:
        while (m := inbox.get()) is not None:
            if ack:
                time.sleep(0.005)
                sub.ack(m.mid, m.qos)
                with lock:
                    counts["acked"] += 1

    worker = threading.Thread(target=work)
    worker.start()
    clients = []
    for i in range(publishers):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"window-{tag}-p{i}")
        c.connect("127.0.0.1", port)
        c.loop_start()
        clients.append(c)
    time.sleep(0.5)
    for _ in range(per_publisher):
        for i, c in enumerate(clients):
            c.publish(f"window/{tag}/{i}", b"x" * 1000, qos=1)
    total = publishers * per_publisher
    deadline = time.monotonic() + 60
    settle = time.monotonic() + 3  # without acks, 3 s is plenty to fill a window
    while time.monotonic() < (deadline if ack else settle) and (counts["acked"] < total or not ack):
        time.sleep(0.1)
    inbox.put(None)
    worker.join()
    for c in clients:
        c.disconnect()
        c.loop_stop()
    sub.loop_stop()
    sub.disconnect()
    return {"published": total, "acking": ack, **counts}


def main(argv: list[str] | None = None) -> int:
    from fedmq.broker import MosquittoBroker

    p = argparse.ArgumentParser(prog="python -m soak.broker_window", description=__doc__.splitlines()[0])
    p.add_argument("--publishers", type=int, default=200)
    p.add_argument("--per-publisher", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with MosquittoBroker.dev() as broker:
        acking = measure(broker.port, publishers=args.publishers,
                         per_publisher=args.per_publisher, ack=True, tag="ack")
        silent = measure(broker.port, publishers=args.publishers,
                         per_publisher=args.per_publisher, ack=False, tag="noack")
    figures = {"max_inflight_messages": 64, "subscriber_acks": acking, "subscriber_never_acks": silent}
    path = write_figures("broker_window", figures, args.out)
    print(f"unacked max: {acking['max_unacked']} while acking, {silent['max_unacked']} never acking "
          f"(window 64) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("python -m soak.broker_window", main))
