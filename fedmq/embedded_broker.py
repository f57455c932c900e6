"""An in-process MQTT 3.1.1 broker (amqtt) for machines without Mosquitto.

The demo and the simulator prefer a real Mosquitto (`fedmq.broker.MosquittoBroker`); where
the binary is missing they fall back to this one so `fedmq demo` runs anywhere Python does.
It speaks MQTT 3.1.1 only (our envelope carries all metadata, so the wire protocol does not
need v5), accepts anonymous clients and binds to loopback only: it is for development,
never for a fleet. amqtt is asyncio; the broker runs on its own event loop in a daemon
thread so synchronous callers (paho clients, tests, the CLI) can use it like a subprocess.

    with EmbeddedBroker() as broker:   # a free loopback port
        client.connect(broker.host, broker.port)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import Future
from typing import Any

from fedmq.broker import BrokerError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class EmbeddedBroker:
    """amqtt's broker on its own thread and asyncio loop; a context manager.

    `port=0` binds a free port chosen by the OS (read it back from `.port` after `start()`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 10.0) -> None:
        if host not in LOOPBACK_HOSTS:
            raise BrokerError(
                f"the embedded broker is anonymous and binds to loopback only, not {host!r}; "
                "use Mosquitto with broker_config/prod.conf for anything reachable"
            )
        self.host = "127.0.0.1" if host == "localhost" else host
        self.port = port
        self.start_timeout = start_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None  # amqtt.broker.Broker, imported lazily (a heavy import)

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _config(self) -> dict[str, Any]:
        bind = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return {
            "listeners": {"default": {"type": "tcp", "bind": bind}},
            # Only anonymous auth: no $SYS publisher, no packet logging (both cost time).
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }

    def start(self) -> EmbeddedBroker:
        """Start the broker and return once it listens; raises BrokerError if it cannot."""
        if self.running:
            return self
        started: Future[int] = Future()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._serve, args=(self._loop, started), name="fedmq-embedded-broker", daemon=True
        )
        self._thread.start()
        try:
            self.port = started.result(timeout=self.start_timeout)
        except Exception as e:
            self.stop()
            raise BrokerError(f"embedded broker did not start on {self.host}:{self.port}: {e}") from e
        return self

    def _serve(self, loop: asyncio.AbstractEventLoop, started: Future[int]) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._boot(started))
            loop.run_forever()
        except BaseException as e:  # surface start-up failures to start()
            if not started.done():
                started.set_exception(e)
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _boot(self, started: Future[int]) -> None:
        from amqtt.broker import Broker

        # amqtt logs every connection at INFO; keep it for errors only unless asked.
        logging.getLogger("amqtt").setLevel(max(logging.WARNING, logging.getLogger("amqtt").level))
        self._broker = Broker(self._config())
        await self._broker.start()
        started.set_result(self._bound_port())

    def _bound_port(self) -> int:
        """The port the OS gave the listener (differs from the asked one when that was 0)."""
        servers = getattr(self._broker, "_servers", {})
        server = servers.get("default")
        sockets = getattr(getattr(server, "instance", None), "sockets", None) or []
        if not sockets:
            if self.port:
                return self.port
            raise BrokerError("amqtt did not expose its listening socket; pass an explicit port")
        return int(sockets[0].getsockname()[1])

    def stop(self, timeout: float = 10.0) -> None:
        """Close every session and the listener, then end the loop and join the thread."""
        loop, thread, broker = self._loop, self._thread, self._broker
        self._loop = self._thread = self._broker = None
        if loop is None or thread is None:
            return
        if broker is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
            with contextlib.suppress(Exception):
                fut.result(timeout)
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
