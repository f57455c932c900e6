"""Make sure what the test suite runs exists: Mosquitto (every broker test), iproute2 (the
documented commands run in private network namespaces, where 127.0.0.1:1883 is theirs),
RabbitMQ (a real 2-node broker cluster, fedmq/rabbitmq_cluster.py), Prometheus (the
monitoring profile's scrape config and dashboard queries, tests/test_monitoring.py), and
Chromium, node and web/'s pinned npm dependencies (the browser agent, tests/test_browser.py).
Installs them with apt-get when root (npm ci for web/ wherever npm exists), else says how."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

MOSQUITTO = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
IP = ("ip", "/usr/sbin/ip", "/sbin/ip")
RABBITMQ = ("rabbitmq-server", "/usr/sbin/rabbitmq-server")
PROMETHEUS = ("prometheus", "/usr/bin/prometheus")
CHROMIUM = ("chromium", "/usr/bin/chromium")
NPM = ("npm", "/usr/bin/npm")
WEB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "web")


def find(candidates: tuple[str, ...] = MOSQUITTO) -> str | None:
    for c in candidates:
        path = shutil.which(c) or (c if os.path.isfile(c) and os.access(c, os.X_OK) else None)
        if path:
            return path
    return None


def apt_install(packages: list[str]) -> bool:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    print(f"installing {', '.join(packages)} with apt-get", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    # Debian starts a system broker on 1883; the tests start their own on free ports.
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], check=True, env=env)
    return True


def web_dependencies() -> None:
    """web/'s npm dependencies at the versions package-lock.json pins (npm ci), unless
    node_modules already matches the lock file (npm writes its own copy of the lock there)."""
    lock = os.path.join(WEB, "package-lock.json")
    installed = os.path.join(WEB, "node_modules", ".package-lock.json")
    if os.path.exists(installed) and os.path.getmtime(installed) >= os.path.getmtime(lock):
        return
    print("installing web/'s npm dependencies (npm ci)", file=sys.stderr)
    done = subprocess.run([find(NPM) or "npm", "ci", "--prefix", WEB, "--no-audit", "--no-fund", "--ignore-scripts"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"npm ci in web/ failed (the browser tests will be skipped):\n{done.stderr[-2000:]}", file=sys.stderr)


def main() -> int:
    missing = [pkg for pkg, names in (("mosquitto", MOSQUITTO), ("iproute2", IP), ("rabbitmq-server", RABBITMQ),
                                      ("prometheus", PROMETHEUS), ("chromium", CHROMIUM), ("npm", NPM))
               if not find(names)]
    if missing:
        apt_install(missing)
    if not find(MOSQUITTO):
        print("mosquitto is required for the test suite and was not found.\n"
              "  Debian/Ubuntu: sudo apt-get install -y mosquitto\n"
              "  macOS:         brew install mosquitto\n"
              "  Fedora:        sudo dnf install -y mosquitto", file=sys.stderr)
        return 1
    if not find(IP):
        print("iproute2 (`ip`) not found: the documented-commands tests that need a private network "
              "namespace will be skipped (apt-get install iproute2, as root)", file=sys.stderr)
    if not find(RABBITMQ):
        print("rabbitmq-server not found: the broker-cluster test (tests/test_broker_cluster.py) will be "
              "skipped (apt-get install rabbitmq-server, as root)", file=sys.stderr)
    if find(NPM):
        web_dependencies()
    else:
        print("npm not found: the browser tests (tests/test_browser.py) will be skipped "
              "(apt-get install nodejs npm, as root)", file=sys.stderr)
    if not find(CHROMIUM):
        print("chromium not found: the browser tests (tests/test_browser.py) will be skipped "
              "(apt-get install chromium, as root)", file=sys.stderr)
    if not find(PROMETHEUS):
        print("prometheus not found: the monitoring test (tests/test_monitoring.py) will be skipped "
              "(apt-get install prometheus, as root)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
