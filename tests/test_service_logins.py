"""Derived logins for an aggregator's second connection and local workers (fedmq/service_logins.py)."""

from __future__ import annotations

from urllib.parse import quote

from fedmq.service_logins import derived_password, derived_url, url_user
from fedmq.transport import parse_broker_urls


def test_a_derived_url_logs_in_as_the_derived_user_on_every_node():
    password = "p@ss:w/rd"  # percent-encoded in the URL, as parse_broker_url expects
    url = f"mqtts://agg:{quote(password, safe='')}@node-a:8883,mqtts://agg:{quote(password, safe='')}@node-b"
    nodes = parse_broker_urls(derived_url(url, "worker-3"))
    assert [(n.host, n.port, n.username) for n in nodes] == [("node-a", 8883, "agg-worker-3"),
                                                             ("node-b", 8883, "agg-worker-3")]
    assert {n.password for n in nodes} == {derived_password(password, "agg-worker-3")}
    assert derived_password(password, "agg-worker-3") != derived_password(password, "agg-replies")
    assert derived_password(password + "x", "agg-worker-3") != derived_password(password, "agg-worker-3")
    assert url_user(url) == "agg"


def test_an_anonymous_url_is_left_as_it_is():
    assert derived_url("mqtt://127.0.0.1:1883", "replies") == "mqtt://127.0.0.1:1883"
    assert url_user("mqtt://127.0.0.1:1883") is None
    only_user = parse_broker_urls(derived_url("mqtt://agg@h", "replies"))[0]
    assert (only_user.username, only_user.password) == ("agg-replies", None)
