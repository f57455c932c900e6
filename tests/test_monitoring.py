"""The monitoring profile for real: Prometheus (Debian's) runs the shipped
deploy/monitoring/prometheus.yml against two fleets' aggregators, and every query of the
provisioned Grafana dashboard runs on it.

Grafana itself is not run (no package here); what it would send to Prometheus is: each panel's
PromQL with the `$fleet` variable set to All, and the variable's own label_values query.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from aggregator.bootstrap import build_engine
from aggregator.prometheus import AggregatorMetrics
from aggregator.service import AggregatorService
from fedmq import protocol
from fedmq.broker import free_port
from fedmq.config import load_config
from fedmq.models import model_spec
from tests.raw_agent import RawAgent

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "monitoring"
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed "
                                "(scripts/ensure_test_tools.py installs Debian's, as root)")
SPEC = model_spec("digits-cnn")
# Speed only: small server sets (the defaults start aggregators in test_documented_commands).
SMALL = {"cdfl.clusters": 2, "data.dataset": "digits", "data.proxy_per_cluster": 100,
         "data.pretrain_per_cluster": 200, "aggregator.pretrain_epochs": 1, "device": "cpu"}


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result vector; raises on a query Prometheus refuses."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = json.loads(urllib.request.urlopen(url, timeout=30).read())
    except urllib.error.HTTPError as e:  # 400: a PromQL error, with Prometheus's reason
        raise AssertionError(f"{promql}: {e.read().decode()[:500]}") from None
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


def wait_until(condition: Any, what: str, tmp_path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (OSError, AssertionError):  # Prometheus not listening or not ready yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never showed {what}:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}")


def fleets_of(result: list[dict[str, Any]]) -> set[str]:
    return {r["metric"].get("fleet", "") for r in result}


@pytest.mark.slow
def test_prometheus_scrapes_every_fleet_and_every_dashboard_query_runs(mosquitto, tmp_path) -> None:
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    fleets = {t: c["labels"]["fleet"] for c in job["static_configs"] for t in c["targets"]}
    assert sorted(fleets.values()) == ["garage", "phones"]
    services, metrics, agents = [], [], []
    try:
        ports = {}
        for target, fleet in fleets.items():
            cfg = load_config(None, {**SMALL, "fleet": fleet, "broker.url": mosquitto.url,
                                     "aggregator.state_dir": str(tmp_path / fleet)})
            services.append(AggregatorService(cfg, build_engine(cfg)).start())
            metrics.append(AggregatorMetrics(services[-1]))
            ports[target] = metrics[-1].serve(0)
        # The shipped file, its compose host names pointed at this machine's ports, and scraped
        # every second instead of 15 s (test time).
        for c in job["static_configs"]:
            c["targets"] = [f"127.0.0.1:{ports[t]}" for t in c["targets"]]
        scrape["global"]["scrape_interval"] = "1s"
        conf = tmp_path / "prometheus.yml"
        conf.write_text(yaml.safe_dump(scrape))
        check = subprocess.run(["promtool", "check", "config", str(conf)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        web = f"127.0.0.1:{free_port()}"
        log = (tmp_path / "prometheus.log").open("w")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address={web}"], stdout=log, stderr=subprocess.STDOUT)
        base = f"http://{web}"
        try:
            wait_until(lambda: {(r["metric"]["fleet"], r["value"][1]) for r in query(base, 'up{job="fedmq-aggregators"}')}
                       == {("garage", "1"), ("phones", "1")}, "both aggregators scraped", tmp_path)
            # Then traffic on both fleets, a join and an update each: a rate needs the counters to
            # move between two scrapes.
            for fleet in fleets.values():
                agents.append(RawAgent(mosquitto.port, fleet, "car-1"))
                agents[-1].join(SPEC.hash)
                up = agents[-1].update_envelope(agents[-1].base * 1.01, SPEC.hash)
                agents[-1].send(up)
                assert isinstance(agents[-1].expect(up.msg_id), protocol.Model)
            def moved() -> bool:
                epochs = {r["metric"]["fleet"]: r["value"][1] for r in query(base, "fedmq_aggregator_epoch")}
                rates = query(base, "sum by (fleet) (rate(fedmq_aggregator_uploads_total[1m]))")
                return epochs == {"garage": "1", "phones": "1"} and len(rates) == 2 and all(
                    float(r["value"][1]) > 0 for r in rates)

            wait_until(moved, "epoch 1 and a non-zero upload rate on both fleets", tmp_path)

            dash = json.loads((MONITORING / "grafana/dashboards/fedmq.json").read_text())
            (variable,) = dash["templating"]["list"]
            metric = variable["query"].removeprefix("label_values(").split(",")[0]
            values = json.loads(urllib.request.urlopen(
                f"{base}/api/v1/label/fleet/values?" + urllib.parse.urlencode({"match[]": metric}), timeout=30).read())
            assert sorted(values["data"]) == ["garage", "phones"]  # the $fleet drop-down
            seen: dict[str, set[str]] = {}
            for panel in dash["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace("$fleet", ".*")  # Grafana's All
                    seen[f"{panel['title']}: {target['expr']}"] = fleets_of(query(base, expr))
            # Per-fleet data where this traffic makes some: the rest (workers, stale, refused)
            # run and return nothing, as they should with no reply pool and no bad upload.
            both = {"garage", "phones"}
            with_data = [k for k in seen if any(m in k for m in (
                "uploads_total{fleet", "end_to_end_seconds_bucket", "cluster_accuracy", "connected_agents",
                "queue_depth", "reading_paused", "unacked_deliveries"))]
            assert len(with_data) == 8, with_data
            for key in with_data:
                assert seen[key] == both, (key, seen[key])
        finally:
            prom.terminate()
            prom.wait(60)
            log.close()
    finally:
        for a in agents:
            a.close()
        for m in metrics:
            m.close()
        for s in services:
            s.stop()


def test_the_scrape_config_is_valid_for_promtool() -> None:
    done = subprocess.run(["promtool", "check", "config", str(MONITORING / "prometheus.yml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
