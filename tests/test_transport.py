"""MqttTransport against a real Mosquitto (and amqtt for the 3.1.1 fallback).

Waits are generous and only bound how long a broken build takes to fail; no assertion is
about speed. Absence is shown by ordering, never by sleeping: a marker message published
after the one that must not come arrives, and nothing came before it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, free_port
from fedmq.config import BrokerSettings
from fedmq.creds import Credentials, make_credentials
from fedmq.transport import (
    BrokerAddress,
    Message,
    MqttTransport,
    NetworkLoop,
    TransportError,
    Will,
    parse_broker_url,
)

WAIT = 30.0  # generous: CI shares the machine


class Inbox:
    """Collects messages from a handler and lets the test wait for a count."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._cond = threading.Condition()

    def __call__(self, message: Message) -> None:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = WAIT) -> list[Message]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.messages) >= n, timeout):
                got = [(m.topic, m.payload[:20]) for m in self.messages]
                raise AssertionError(f"expected {n} messages within {timeout}s, got {got}")
            return list(self.messages)

    @property
    def payloads(self) -> list[bytes]:
        with self._cond:
            return [m.payload for m in self.messages]


class Counter:
    """Counts hook calls and lets the test wait for a count."""

    def __init__(self) -> None:
        self.calls: list[object] = []
        self._cond = threading.Condition()

    def __call__(self, transport: MqttTransport, arg: object) -> None:
        with self._cond:
            self.calls.append(arg)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = WAIT) -> list[object]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= n, timeout), self.calls
            return list(self.calls)


def settings_for(broker: MosquittoBroker, **kw) -> BrokerSettings:
    return BrokerSettings(url=broker.url, reconnect_min_s=0.1, reconnect_max_s=0.5, **kw)


@pytest.fixture
def transports() -> Iterator:
    """make(client_id, settings, **kw) -> a connected-on-demand transport, closed at the end."""
    made: list[MqttTransport] = []

    def make(client_id: str, settings: BrokerSettings, **kw) -> MqttTransport:
        t = MqttTransport(client_id, settings, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=1)


@pytest.fixture(params=["own-thread", "shared-loop"])
def any_transports(request) -> Iterator:
    """`transports`, once with paho's thread per client and once all on one NetworkLoop."""
    network = NetworkLoop() if request.param == "shared-loop" else None
    made: list[MqttTransport] = []

    def make(client_id: str, settings: BrokerSettings, **kw) -> MqttTransport:
        t = MqttTransport(client_id, settings, network=network, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=1)
    if network is not None:
        assert network.clients == 0  # close() detached every client
        network.close()


# -- URLs ------------------------------------------------------------------------------


@pytest.mark.parametrize("url, expected", [
    ("mqtt://broker", BrokerAddress("broker", 1883, False, None, None)),
    ("mqtts://broker", BrokerAddress("broker", 8883, True, None, None)),
    ("mqtt://10.0.0.2:1884", BrokerAddress("10.0.0.2", 1884, False, None, None)),
    ("MQTTS://car-7@broker.example:9000", BrokerAddress("broker.example", 9000, True, "car-7", None)),
    ("mqtt://agg:p%40ss%3Aw%2Frd@h:1", BrokerAddress("h", 1, False, "agg", "p@ss:w/rd")),
    ("mqtt://[::1]:1883/", BrokerAddress("::1", 1883, False, None, None)),
])
def test_parse_broker_url(url, expected):
    assert parse_broker_url(url) == expected


@pytest.mark.parametrize("url, words", [
    ("http://broker:1883", "scheme"),
    ("broker:1883", "scheme"),
    ("mqtt://", "no host"),
    ("mqtt://:1883", "no host"),
    ("mqtt://broker:port", "port"),
    ("mqtt://broker:70000", "port"),
    ("mqtt://broker:0", "port"),
    ("mqtt://broker:1883/fedmq", "path"),
    ("mqtt://broker?x=1", "query"),
    ("mqtt://:secret@broker", "user name"),
])
def test_parse_broker_url_rejects(url, words):
    with pytest.raises(TransportError, match=words):
        parse_broker_url(url)


def test_password_is_not_in_repr():
    assert "hunter2" not in repr(parse_broker_url("mqtt://u:hunter2@h"))


# -- basic traffic -----------------------------------------------------------------------


def test_round_trip_qos1(mosquitto, any_transports):
    s = settings_for(mosquitto)
    inbox = Inbox()
    sub = any_transports("sub", s).connect()
    sub.subscribe("fedmq/t/agents/+/up", inbox)
    pub = any_transports("pub", s).connect()
    assert sub.protocol_version == pub.protocol_version == "5"
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    handle = pub.publish("fedmq/t/agents/a1/up", payload, qos=1)
    assert handle.wait(WAIT) and handle.done
    pub.publish("fedmq/t/agents/a2/down", b"not for sub").wait(WAIT)
    pub.publish("fedmq/t/agents/a2/up", b"small").wait(WAIT)
    got = inbox.wait_for(2)
    assert [(m.topic, m.payload, m.qos, m.dup) for m in got] == [
        ("fedmq/t/agents/a1/up", payload, 1, False), ("fedmq/t/agents/a2/up", b"small", 1, False)]


def test_window_bounds_unacknowledged_publishes(mosquitto, transports):
    window = 8
    s = settings_for(mosquitto, max_inflight=window)
    inbox = Inbox()
    sub = transports("sub", s).connect()
    sub.subscribe("load/#", inbox)
    pub = transports("pub", s).connect()
    assert pub.window == window
    pending: list = []
    most = 0
    for i in range(2000):
        handle = pub.publish("load/x", i.to_bytes(4, "big"))
        pending = [h for h in pending if not h.done]  # counted from the handles, not the window
        pending.append(handle)
        most = max(most, len(pending), pub.outstanding)
    assert most == window  # the window filled up, and never more than that was outstanding
    got = inbox.wait_for(2000)
    assert [int.from_bytes(m.payload, "big") for m in got] == list(range(2000))


def test_window_is_clamped_to_brokers_receive_maximum(mosquitto, transports):
    # broker_config/dev.conf: max_inflight_messages 64, sent as Receive Maximum in CONNACK.
    t = transports("big", settings_for(mosquitto, max_inflight=500)).connect()
    assert t.window == 64


def test_publish_blocks_on_full_window_until_timeout(mosquitto, transports):
    s = settings_for(mosquitto, max_inflight=2)
    t = transports("pub", s).connect()
    mosquitto.stop()  # no PUBACKs from now on; paho keeps QoS 1 messages for the reconnect
    first, second = t.publish("w/1", b"1"), t.publish("w/2", b"2")
    assert t.outstanding == 2 and not first.done and not second.done
    with pytest.raises(TransportError, match="2 messages still unacknowledged"):
        t.publish("w/3", b"3", timeout=0.2)


def test_handler_exception_does_not_stop_delivery(mosquitto, transports):
    s = settings_for(mosquitto)
    inbox = Inbox()

    def fragile(message: Message) -> None:
        if message.payload == b"boom":
            raise ValueError("handler bug")
        inbox(message)

    sub = transports("sub", s).connect()
    sub.subscribe("h/#", fragile)
    pub = transports("pub", s).connect()
    pub.publish("h/1", b"boom")
    pub.publish("h/1", b"fine")
    assert [m.payload for m in inbox.wait_for(1)] == [b"fine"]


def test_invalid_filter_and_publish_before_connect(mosquitto):
    t = MqttTransport("x", settings_for(mosquitto))
    for bad in ("a/#/b", "a/b+", "", "a#"):
        with pytest.raises(TransportError, match="invalid topic filter"):
            t.subscribe(bad, print)
    with pytest.raises(TransportError, match="before connect"):
        t.publish("a", b"x")


# -- sessions ----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.parametrize("subscribe_first", [True, False], ids=["subscribe-then-connect",
                                                                 "connect-then-subscribe"])
def test_persistent_session_keeps_messages_while_away(mosquitto, transports, protocol,
                                                      subscribe_first):
    s = settings_for(mosquitto, protocol=protocol)
    away = transports("agg", s).connect()
    away.subscribe("fedmq/t/agents/+/up", Inbox())
    away.close()

    pub = transports("pub", s).connect()
    for i in range(5):
        assert pub.publish(f"fedmq/t/agents/a{i}/up", b"u%d" % i).wait(WAIT)

    back = transports("agg", s)
    sessions = Counter()
    back.on_connect_hooks.append(sessions)
    inbox = Inbox()
    if subscribe_first:
        back.subscribe("fedmq/t/agents/+/up", inbox)
        back.connect()
    else:  # the backlog arrives before this subscribe; it is parked, then handed over in order
        back.connect()
        back.subscribe("fedmq/t/agents/+/up", inbox)
    assert back.protocol_version == protocol
    assert sessions.calls == [True]  # session present
    assert [m.payload for m in inbox.wait_for(5)] == [b"u0", b"u1", b"u2", b"u3", b"u4"]


def test_clean_start_drops_the_backlog(mosquitto, transports):
    s = settings_for(mosquitto)
    away = transports("agg", s).connect()
    away.subscribe("cs/#", Inbox())
    away.close()
    pub = transports("pub", s).connect()
    pub.publish("cs/1", b"old").wait(WAIT)

    fresh = transports("agg", s, clean_start=True)
    sessions = Counter()
    fresh.on_connect_hooks.append(sessions)
    inbox = Inbox()
    fresh.subscribe("cs/#", inbox)
    fresh.connect()
    pub.publish("cs/1", b"new").wait(WAIT)
    assert [m.payload for m in inbox.wait_for(1)] == [b"new"]
    assert sessions.calls == [False]


# -- manual ack ------------------------------------------------------------------------


def test_manual_ack_redelivers_until_acked(mosquitto, any_transports):
    s = settings_for(mosquitto)
    first = Inbox()
    agg = any_transports("agg", s, manual_ack=True).connect()
    agg.subscribe("fedmq/t/agents/+/up", first)
    pub = any_transports("pub", s).connect()
    pub.publish("fedmq/t/agents/a1/up", b"update-1").wait(WAIT)
    (m,) = first.wait_for(1)
    assert not m.dup
    agg.close()  # crash-equivalent for the message: never acked

    second = Inbox()
    agg = any_transports("agg", s, manual_ack=True)
    agg.subscribe("fedmq/t/agents/+/up", second)
    agg.connect()
    (again,) = second.wait_for(1)
    assert (again.payload, again.dup) == (b"update-1", True)  # the broker redelivered it
    assert agg.ack(again)
    agg.close()

    pub.publish("fedmq/t/agents/a1/up", b"marker").wait(WAIT)
    third = Inbox()
    agg = any_transports("agg", s, manual_ack=True)
    agg.subscribe("fedmq/t/agents/+/up", third)
    agg.connect()
    third.wait_for(1)
    assert third.payloads == [b"marker"]  # acked: not redelivered before the marker


def test_ack_from_an_earlier_connection_is_void(mosquitto, transports):
    s = settings_for(mosquitto)
    inbox = Inbox()
    agg = transports("agg", s, manual_ack=True).connect()
    reconnects = Counter()
    agg.on_connect_hooks.append(reconnects)
    agg.subscribe("up/#", inbox)
    transports("pub", s).connect().publish("up/a1", b"u1").wait(WAIT)
    (old,) = inbox.wait_for(1)
    mosquitto.restart()  # persistence keeps the session and its unacked message
    reconnects.wait_for(1)
    (_, redelivered) = inbox.wait_for(2)
    assert (redelivered.payload, redelivered.dup) == (b"u1", True)
    assert agg.ack(old) is False  # that PUBACK would name a packet id of a dead connection
    assert agg.ack(redelivered) is True


# -- will, close, kill -------------------------------------------------------------------


def test_will_is_sent_on_kill_not_on_close(mosquitto, any_transports):
    s = settings_for(mosquitto)
    watcher = Inbox()
    w = any_transports("watcher", s).connect()
    w.subscribe("fedmq/t/agents/+/status", watcher)

    crashed = any_transports("a1", s, will=Will("fedmq/t/agents/a1/status", b"offline"))
    crashed.connect().publish("fedmq/t/agents/a1/status", b"online", retain=True).wait(WAIT)
    watcher.wait_for(1)
    crashed.kill()
    assert watcher.wait_for(2)[1].payload == b"offline"
    assert not crashed.connected

    polite = any_transports("a2", s, will=Will("fedmq/t/agents/a2/status", b"offline"))
    polite.connect().publish("fedmq/t/agents/a2/status", b"online", retain=True).wait(WAIT)
    watcher.wait_for(3)
    polite.close()
    # The same client id comes back: the broker handled the old connection's DISCONNECT first.
    again = any_transports("a2", s).connect()
    again.publish("fedmq/t/agents/a2/status", b"back", retain=True).wait(WAIT)
    got = watcher.wait_for(4)
    assert [m.payload for m in got if m.topic.endswith("a2/status")] == [b"online", b"back"]


def test_will_is_retained(mosquitto, transports):
    s = settings_for(mosquitto)
    live = Inbox()
    transports("watcher", s).connect().subscribe("st/#", live)
    transports("a1", s, will=Will("st/a1", b"offline")).connect().kill()
    live.wait_for(1)  # the broker has published (and stored) the will
    late = Inbox()
    transports("late", s).connect().subscribe("st/#", late)
    assert [(m.payload, m.retain) for m in late.wait_for(1)] == [(b"offline", True)]


# -- protocols ---------------------------------------------------------------------------


def test_forced_mqtt_311(mosquitto, transports):
    s = settings_for(mosquitto, protocol="3.1.1")
    inbox = Inbox()
    sub = transports("sub", s)
    sub.subscribe("v3/#", inbox)
    sub.connect()
    pub = transports("pub", s).connect()
    assert sub.protocol_version == pub.protocol_version == "3.1.1"
    assert pub.publish("v3/x", b"hello 3.1.1").wait(WAIT)
    assert inbox.wait_for(1)[0].payload == b"hello 3.1.1"


def test_auto_falls_back_to_311_on_a_broker_without_v5(transports):
    from fedmq.embedded_broker import EmbeddedBroker  # amqtt: MQTT 3.1.1 only

    with EmbeddedBroker() as broker:
        s = BrokerSettings(url=broker.url, protocol="auto")
        inbox = Inbox()
        sub = transports("sub", s).connect(timeout=2.0)
        sub.subscribe("fb/#", inbox)
        assert sub.protocol_version == "3.1.1"
        pub = transports("pub", s).connect(timeout=2.0)
        pub.publish("fb/x", b"via 3.1.1").wait(WAIT)
        assert inbox.wait_for(1)[0].payload == b"via 3.1.1"
        with pytest.raises(TransportError, match=r"no CONNACK .*MQTT 5"):
            MqttTransport("v5only", dataclasses.replace(s, protocol="5")).connect(timeout=0.5)


# -- reconnect and errors ----------------------------------------------------------------


def test_reconnects_after_broker_restart(mosquitto, any_transports):
    s = settings_for(mosquitto)
    inbox = Inbox()
    sub = any_transports("sub", s).connect()
    sub.subscribe("rs/#", inbox)
    pub = any_transports("pub", s).connect()
    ups, downs = Counter(), Counter()
    pub.on_connect_hooks.append(ups)
    pub.on_disconnect_hooks.append(downs)
    sub_ups = Counter()
    sub.on_connect_hooks.append(sub_ups)

    mosquitto.restart()
    downs.wait_for(1)
    ups.wait_for(1)
    sub_ups.wait_for(1)
    assert pub.connected and sub.connected
    assert pub.publish("rs/x", b"after restart").wait(WAIT)
    assert inbox.wait_for(1)[0].payload == b"after restart"


def test_resubscribes_when_the_session_is_gone(tmp_path, transports):
    # Without persistence a restarted broker forgets sessions: subscriptions must be redone.
    conf = (REPO_BROKER_CONFIG / "dev.conf").read_text().replace("persistence true", "persistence false")
    with MosquittoBroker(conf, workdir=tmp_path / "b") as broker:
        s = settings_for(broker)
        inbox = Inbox()
        sub = transports("sub", s).connect()
        sub.subscribe("gone/#", inbox)
        sessions = Counter()
        sub.on_connect_hooks.append(sessions)
        broker.restart()
        assert sessions.wait_for(1) == [False]
        pub = transports("pub", s).connect()
        # The re-SUBSCRIBE goes out from the connect callback without waiting for its SUBACK,
        # so a message published before the broker processed it reaches no one: publish until
        # one arrives (each attempt waits on the inbox).
        deadline = time.monotonic() + 120
        while True:
            assert pub.publish("gone/x", b"still subscribed").wait(WAIT)
            try:
                assert inbox.wait_for(1, timeout=2)[0].payload == b"still subscribed"
                break
            except AssertionError:
                assert time.monotonic() < deadline, "never resubscribed"


def test_publish_while_broker_is_down_goes_out_after_reconnect(mosquitto, any_transports):
    s = settings_for(mosquitto)
    inbox = Inbox()
    sub = any_transports("sub", s).connect()
    sub.subscribe("down/#", inbox)
    pub = any_transports("pub", s).connect()
    downs, ups = Counter(), Counter()
    pub.on_disconnect_hooks.append(downs)
    pub.on_connect_hooks.append(ups)
    mosquitto.stop()
    downs.wait_for(1)
    handle = pub.publish("down/x", b"queued in the client")
    mosquitto.start()
    ups.wait_for(1)
    assert handle.wait(WAIT)
    assert inbox.wait_for(1)[0].payload == b"queued in the client"


def test_closed_port_fails_fast_with_a_clear_error():
    s = BrokerSettings(url=f"mqtt://127.0.0.1:{free_port()}")
    with pytest.raises(TransportError, match="refused: no broker listens there"):
        MqttTransport("nobody", s).connect(timeout=5)


def test_unknown_host_fails_with_a_clear_error():
    s = BrokerSettings(url="mqtt://no-such-host.invalid:1883")
    with pytest.raises(TransportError, match="cannot resolve broker host 'no-such-host.invalid'"):
        MqttTransport("nobody", s).connect(timeout=5)


def test_bad_protocol_setting_is_refused():
    with pytest.raises(TransportError, match="broker.protocol"):
        MqttTransport("x", BrokerSettings(protocol="4"))


# -- production broker: TLS and passwords (broker_config/prod.conf, `fedmq creds`) ------


@pytest.fixture(scope="module")
def prod(tmp_path_factory) -> Iterator[tuple[MosquittoBroker, Credentials]]:
    creds = make_credentials(tmp_path_factory.mktemp("creds"), ["a1"])
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path_factory.mktemp("prod")) as broker:
        yield broker, creds


def prod_settings(broker: MosquittoBroker, user: str, password: str, ca: Path) -> BrokerSettings:
    return BrokerSettings(url=f"mqtts://{user}:{password}@localhost:{broker.port}", ca_file=str(ca))


def test_tls_and_password(prod, transports):
    broker, creds = prod
    agg = transports("agg", prod_settings(broker, creds.aggregator_user, creds.aggregator_password,
                                          creds.ca_cert)).connect()
    inbox = Inbox()
    agg.subscribe("fedmq/f1/agents/+/up", inbox)
    a1 = transports("a1", prod_settings(broker, "a1", creds.agents["a1"], creds.ca_cert)).connect()
    assert a1.publish("fedmq/f1/agents/a1/up", b"over tls").wait(WAIT)
    assert inbox.wait_for(1)[0].payload == b"over tls"


def test_wrong_password_names_the_user_and_reason(prod):
    broker, creds = prod
    s = prod_settings(broker, "a1", creds.agents["a1"] + "x", creds.ca_cert)
    with pytest.raises(TransportError, match=r"refused user 'a1'.*(Not authorized|Bad user name)"):
        MqttTransport("a1", s).connect(timeout=5)


def test_untrusted_server_certificate_is_a_tls_error(prod, tmp_path):
    broker, creds = prod
    other = make_credentials(tmp_path / "other", ["a1"])  # a different CA
    s = prod_settings(broker, "a1", creds.agents["a1"], other.ca_cert)
    with pytest.raises(TransportError, match="TLS handshake .* failed: .*certificate verify failed"):
        MqttTransport("a1", s).connect(timeout=5)


def test_plain_mqtt_to_a_tls_port_is_explained(prod):
    broker, creds = prod
    s = BrokerSettings(url=f"mqtt://a1:{creds.agents['a1']}@127.0.0.1:{broker.port}")
    with pytest.raises(TransportError, match="TLS expected"):
        MqttTransport("a1", s).connect(timeout=4)


def test_acl_denied_publish_fails_its_handle_on_v5(prod, transports):
    # MQTT v5 PUBACKs carry a reason code: Mosquitto answers a denied publish with 0x87.
    # (On 3.1.1 the PUBACK cannot say no; only the missing delivery shows the denial.)
    broker, creds = prod
    a1 = transports("a1", prod_settings(broker, "a1", creds.agents["a1"], creds.ca_cert)).connect()
    with pytest.raises(TransportError, match="Not authorized"):
        a1.publish("fedmq/f1/agents/someone-else/up", b"x").wait(WAIT)
    assert a1.publish("fedmq/f1/agents/a1/up", b"mine").wait(WAIT)


def test_one_network_loop_serves_more_clients_than_select_can(mosquitto):
    # paho's own loop uses select(), which fails past descriptor 1023 (~340 clients of 3
    # descriptors each); one NetworkLoop (epoll) carries them all on one thread.
    s = settings_for(mosquitto)
    network = NetworkLoop()
    inbox = Inbox()
    clients = []
    try:
        for i in range(400):
            t = MqttTransport(f"many-{i}", s, network=network).connect()
            t.subscribe(f"many/{i}", inbox)
            clients.append(t)
        assert network.clients == 400
        assert threading.active_count() < 20  # not one thread per client
        for i, t in enumerate(clients):
            t.publish(f"many/{(i + 1) % 400}", str(i).encode())
        got = inbox.wait_for(400, timeout=60)
        assert sorted(int(m.payload) for m in got) == list(range(400))
    finally:
        for t in clients:
            t.close(timeout=1)
        network.close()
    assert network.clients == 0


def test_a_packet_queued_while_the_loop_finds_the_queue_empty_is_still_sent(mosquitto):
    """The interleaving that stranded SUBSCRIBEs in the 10,000-agent soak, played in order: the
    loop thread finds paho's queue empty while its write flag is still set; another thread queues
    a packet (paho sees the flag, so it does not register the write); then the loop thread
    unregisters the write. The packet must still go out."""
    s = settings_for(mosquitto)
    network = NetworkLoop()
    inbox = Inbox()
    sender = receiver = None
    try:
        receiver = MqttTransport("race-rx", s, network=network).connect()
        receiver.subscribe("race/t", inbox)
        sender = MqttTransport("race-tx", s, network=network).connect()
        client = sender._client
        assert client is not None
        with network._lock:  # hold the loop off the queue while the interleaving is set up
            client._registered_write = True  # the loop thread registered a write and is finishing it
            client.publish("race/t", b"stranded?", qos=0)  # another thread: flag set, so no register
        client._call_socket_unregister_write()  # the loop thread, having seen an empty queue
        got = inbox.wait_for(1, timeout=30)
        assert [m.payload for m in got] == [b"stranded?"]
        deadline = time.monotonic() + 30  # and write interest is dropped once the queue is empty
        while client.socket() in network._writing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.socket() not in network._writing
    finally:
        for t in (sender, receiver):
            if t is not None:
                t.close(timeout=1)
        network.close()


_FD_PROBE = """
import os, sys
from fedmq.config import BrokerSettings
from fedmq.transport import MqttTransport, NetworkLoop
network = NetworkLoop() if sys.argv[2] == "shared" else None
s = BrokerSettings(url=sys.argv[1], reconnect_min_s=0.1, reconnect_max_s=0.5)
MqttTransport("warm-up", s, network=network).connect().close()
before = sorted(os.listdir("/proc/self/fd"))
for i in range(5):
    MqttTransport(f"fd-{i}", s, network=network).connect().close()
    MqttTransport(f"fd-kill-{i}", s, network=network).connect().kill()
after = sorted(os.listdir("/proc/self/fd"))
print(len(before), len(after), [os.readlink(f"/proc/self/fd/{fd}") for fd in set(after) - set(before)])
"""


@pytest.mark.parametrize("shared", [False, True], ids=["own-thread", "shared-loop"])
def test_close_and_kill_leave_no_descriptor_open(mosquitto, shared):
    # In a process of its own: in the test worker, threads left by other tests open and close
    # descriptors of their own while this one counts (a loaded CI run saw 24 for 25).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FD_PROBE, mosquitto.url, "shared" if shared else "own"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, new = out.stdout.split(" ", 2)
    assert before == after and new.strip() == "[]", out.stdout
