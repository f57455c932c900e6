"""MQTT over WebSockets, and the browser agent and fleet page (web/) in a real browser.

The WebSocket listeners of broker_config/dev.conf and prod.conf carry the same broker, topics,
passwords and ACL as the MQTT ones: a paho client over ws (dev) or wss (prod) talks to one
over plain MQTT. The browser tests load web/agent.html and web/fleet.html from a local HTTP
server in headless Chromium (Debian's package, driven by playwright-core from web/'s npm
dependencies) against a real Mosquitto from prod.conf and a real `fedmq aggregator`.
"""

from __future__ import annotations

import queue
import ssl

import paho.mqtt.client as mqtt
import pytest

from fedmq.broker import REPO_BROKER_CONFIG, MosquittoBroker, find_mosquitto, listener_kinds
from fedmq.creds import make_credentials

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

WAIT_S = 60.0


class Client:
    """A paho client on `transport` ("tcp" or "websockets") that records what it receives."""

    def __init__(self, port: int, transport: str, *, user: str | None = None, password: str | None = None,
                 ca: str | None = None, client_id: str = "") -> None:
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connack: queue.Queue[mqtt.ReasonCode] = queue.Queue()
        self.suback: queue.Queue[list] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, transport=transport,
                             protocol=mqtt.MQTTv311)
        if ca is not None:
            self.c.tls_set(ca_certs=ca, cert_reqs=ssl.CERT_REQUIRED)
        if user is not None:
            self.c.username_pw_set(user, password)
        self.c.on_connect = lambda cl, u, f, rc, p: self.connack.put(rc)
        self.c.on_subscribe = lambda cl, u, mid, rcs, p: self.suback.put(rcs)
        self.c.on_message = lambda cl, u, msg: self.inbox.put((msg.topic, msg.payload))
        self.c.connect("localhost" if ca else "127.0.0.1", port)
        self.c.loop_start()

    def connected(self) -> mqtt.ReasonCode:
        return self.connack.get(timeout=WAIT_S)

    def subscribe(self, topic: str) -> list:
        self.c.subscribe(topic, qos=1)
        return self.suback.get(timeout=WAIT_S)

    def publish(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(WAIT_S)

    def receive(self, timeout: float = WAIT_S) -> tuple[str, bytes]:
        return self.inbox.get(timeout=timeout)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def test_both_configs_have_a_websocket_listener_after_the_mqtt_one() -> None:
    assert listener_kinds((REPO_BROKER_CONFIG / "dev.conf").read_text()) == [("mqtt", False), ("websockets", False)]
    assert listener_kinds((REPO_BROKER_CONFIG / "prod.conf").read_text()) == [("mqtt", True), ("websockets", True)]


def test_dev_conf_websockets_and_mqtt_clients_share_the_broker(tmp_path) -> None:
    with MosquittoBroker.dev(workdir=tmp_path / "broker") as broker:
        assert broker.ws_port is not None and broker.ws_url == f"ws://127.0.0.1:{broker.ws_port}"
        assert broker.ws_port != broker.port
        ws = Client(broker.ws_port, "websockets")
        tcp = Client(broker.port, "tcp")
        try:
            assert not ws.connected().is_failure and not tcp.connected().is_failure
            ws.subscribe("fedmq/w/agents/a/down")
            tcp.publish("fedmq/w/agents/a/down", b"to the browser")
            assert ws.receive() == ("fedmq/w/agents/a/down", b"to the browser")
            tcp.subscribe("fedmq/w/agents/a/up")
            ws.publish("fedmq/w/agents/a/up", b"from the browser")
            assert tcp.receive() == ("fedmq/w/agents/a/up", b"from the browser")
        finally:
            ws.close()
            tcp.close()


def test_prod_conf_wss_has_the_same_tls_passwords_and_acl(tmp_path) -> None:
    creds = make_credentials(tmp_path / "creds", ["phone-1", "phone-2"], monitor_user="monitor")
    users = creds.users()
    ca = str(creds.ca_cert)
    with MosquittoBroker.from_file(REPO_BROKER_CONFIG / "prod.conf", path_map=creds.path_map(),
                                   workdir=tmp_path / "broker") as broker:
        assert broker.ws_url == f"wss://127.0.0.1:{broker.ws_port}"
        clients: list[Client] = []
        try:
            # Anonymous and wrong passwords are refused over wss as over mqtts.
            anon = Client(broker.ws_port, "websockets", ca=ca)
            clients.append(anon)
            assert anon.connected().is_failure
            wrong = Client(broker.ws_port, "websockets", user="phone-1", password="not-it", ca=ca)
            clients.append(wrong)
            assert wrong.connected().is_failure

            phone = Client(broker.ws_port, "websockets", user="phone-1", password=users["phone-1"], ca=ca)
            agg = Client(broker.port, "tcp", user="aggregator", password=users["aggregator"], ca=ca)
            clients += [phone, agg]
            assert not phone.connected().is_failure and not agg.connected().is_failure
            # The ACL binds the browser's login to its own topics.
            phone.subscribe("fedmq/f/agents/phone-1/down")
            phone.subscribe("fedmq/f/agents/phone-2/down")  # granted by the broker, never delivered
            agg.subscribe("fedmq/f/agents/+/up")
            agg.publish("fedmq/f/agents/phone-2/down", b"not yours")
            agg.publish("fedmq/f/agents/phone-1/down", b"yours")
            assert phone.receive() == ("fedmq/f/agents/phone-1/down", b"yours")
            # (published first, "not yours" would have arrived first: one publisher, in order)
            phone.publish("fedmq/f/agents/phone-2/up", b"forged")
            phone.publish("fedmq/f/agents/phone-1/up", b"own")
            assert agg.receive() == ("fedmq/f/agents/phone-1/up", b"own")
        finally:
            for c in clients:
                c.close()
