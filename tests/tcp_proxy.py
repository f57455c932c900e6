"""A loopback TCP proxy between MQTT clients and the broker that a test controls.

Fault tests point an agent at the proxy instead of the broker and then break the link the
way a real network does, at a moment they choose, including in the middle of a payload:

    with TcpProxy(broker.port) as proxy:           # clients connect to proxy.port
        proxy.cut_after(20_000, "up")              # forward 20 kB more upstream, then cut
        ...                                        # link is down: new connections are reset
        proxy.restore()                            # link back

Modes: pass (forward both ways), stall (forward nothing, hold connections open: bytes pile
up in kernel buffers, as on a dead radio link), down (every connection reset, new ones
reset at once). `cut_after` / `stall_after` switch mode after a byte budget in one
direction, so a cut lands mid-packet. One thread, one selector; forwarding uses blocking
`sendall` (loopback peers read promptly).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped link looks to the peer on reconnect."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    held: dict[str, bytes] = field(default_factory=dict)
    """Bytes read past a stall's budget, sent on `restore()` so the stream stays whole."""


class TcpProxy:
    """Forward 127.0.0.1:`port` to 127.0.0.1:`upstream_port`, breakable on demand."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self.mode = "pass"
        self._budget: dict[str, int | None] = {"up": None, "down": None}
        self._after = "down"
        self.cut_done = threading.Event()
        """Set when an armed cut or stall has happened."""
        self.bytes = {"up": 0, "down": 0}
        self.connections = 0
        self.resets = 0
        self._stop = threading.Event()
        self._waker_r, self._waker_w = socket.socketpair()
        self._sel.register(self._waker_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)

    # ------------------------------------------------------------------ control

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._waker_w.send(b"x")

    def restore(self) -> None:
        """Link back: forward both ways again (stalled connections resume where they were)."""
        with self._lock:
            self.mode = "pass"
            self._budget = {"up": None, "down": None}
            for pair in list(self._pairs):
                for direction, data in pair.held.items():
                    dst = pair.upstream if direction == "up" else pair.client
                    try:
                        dst.sendall(data)
                    except OSError:
                        self._drop(pair)
                        break
                pair.held.clear()
        self._wake()

    def stall(self) -> None:
        with self._lock:
            self.mode = "stall"
        self._wake()

    def down(self) -> None:
        """Reset every connection now; new ones are reset at once until `restore()`."""
        with self._lock:
            self.mode = "down"
            self._reset_all()
        self._wake()

    def cut_after(self, n_bytes: int, direction: str = "up") -> None:
        """Forward `n_bytes` more in `direction` ("up": client -> broker), then go down."""
        self._arm(n_bytes, direction, "down")

    def stall_after(self, n_bytes: int, direction: str = "up") -> None:
        """Forward `n_bytes` more in `direction`, then stall (hold everything)."""
        self._arm(n_bytes, direction, "stall")

    def _arm(self, n_bytes: int, direction: str, then: str) -> None:
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be up or down, got {direction!r}")
        with self._lock:
            self.cut_done.clear()
            self.mode = "pass"
            self._budget = {"up": None, "down": None, direction: n_bytes}
            self._after = then
        self._wake()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._lock:
            self._reset_all()
        for s in (self._listener, self._waker_r, self._waker_w):
            with contextlib.suppress(OSError):
                s.close()
        self._sel.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _reset_all(self) -> None:
        for p in self._pairs:
            for s in (p.client, p.upstream):
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.unregister(s)
                _reset(s)
        self.resets += len(self._pairs)
        self._pairs.clear()

    def _drop(self, pair: _Pair) -> None:
        for s in (pair.client, pair.upstream):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(s)
            _reset(s)
        if pair in self._pairs:
            self._pairs.remove(pair)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if self.mode == "down":
            _reset(client)
            self.resets += 1
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)
            return
        for s in (client, upstream):
            s.setblocking(True)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, upstream)
        self._pairs.append(pair)
        self.connections += 1
        self._sel.register(client, selectors.EVENT_READ, (pair, "up"))
        self._sel.register(upstream, selectors.EVENT_READ, (pair, "down"))

    def _forward(self, pair: _Pair, direction: str) -> None:
        src, dst = (pair.client, pair.upstream) if direction == "up" else (pair.upstream, pair.client)
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(pair)
            return
        budget = self._budget[direction]
        cut = budget is not None and len(data) >= budget
        if cut:
            data, pair.held[direction] = data[:budget], data[budget:]
        try:
            if data:
                dst.sendall(data)
        except OSError:
            self._drop(pair)
            return
        self.bytes[direction] += len(data)
        if budget is not None:
            self._budget[direction] = budget - len(data)
        if cut:
            self._budget = {"up": None, "down": None}
            if self._after == "down":
                self.mode = "down"
                self._reset_all()
            else:
                self.mode = "stall"
            self.cut_done.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            # Stalled: watch only the listener and the waker (connections are left unread).
            for key, _ in self._sel.select(timeout=0.2):
                with self._lock:
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._waker_r.recv(4096)
                    elif key.data is None:
                        self._accept()
                    elif self.mode == "pass":
                        pair, direction = key.data
                        if pair in self._pairs:
                            self._forward(pair, direction)
            if self.mode == "stall":
                self._stop.wait(0.02)  # readable sockets would spin the selector
