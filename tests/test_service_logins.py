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


def test_a_url_with_a_user_and_no_password_takes_it_from_the_environment(monkeypatch):
    """FEDMQ_BROKER_PASSWORD keeps a password out of argv (`ps` shows argv to every user)."""
    from fedmq.service_logins import PASSWORD_ENV

    monkeypatch.setenv(PASSWORD_ENV, "p@ss")
    node = parse_broker_urls("mqtts://agg@h:8883")[0]
    assert (node.username, node.password) == ("agg", "p@ss")
    assert parse_broker_urls("mqtts://agg:own@h")[0].password == "own"  # the URL's wins
    assert parse_broker_urls("mqtt://h")[0].password is None  # anonymous stays anonymous
    worker = parse_broker_urls(derived_url("mqtts://agg@h", "worker-0"))[0]
    assert (worker.username, worker.password) == ("agg-worker-0", derived_password("p@ss", "agg-worker-0"))


def test_a_local_worker_gets_its_own_login_and_never_the_aggregators_password(monkeypatch):
    import json

    from aggregator.worker_cli import LocalWorkers
    from fedmq.config import load_config
    from fedmq.service_logins import PASSWORD_ENV

    monkeypatch.setenv(PASSWORD_ENV, "aggregator-secret")
    env = LocalWorkers(load_config(None, {"broker.url": "mqtts://agg@h:8883"}), 1)._env(0)
    assert PASSWORD_ENV not in env and "aggregator-secret" not in json.dumps(env)
    url = json.loads(env["FEDMQ_WORKER_CONFIG"])["broker"]["url"]
    monkeypatch.delenv(PASSWORD_ENV)
    node = parse_broker_urls(url)[0]
    assert (node.username, node.password) == ("agg-worker-0", derived_password("aggregator-secret", "agg-worker-0"))
