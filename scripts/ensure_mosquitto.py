"""Make sure a `mosquitto` binary exists: install it with apt-get when root, else say how."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def find() -> str | None:
    for c in CANDIDATES:
        path = shutil.which(c) or (c if os.path.isfile(c) and os.access(c, os.X_OK) else None)
        if path:
            return path
    return None


def main() -> int:
    if find():
        return 0
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("mosquitto not found: installing it with apt-get", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "mosquitto"], check=True, env=env)
        # Debian starts a system broker on 1883; the tests start their own on free ports.
        if find():
            return 0
    print(
        "mosquitto is required for the test suite and was not found.\n"
        "  Debian/Ubuntu: sudo apt-get install -y mosquitto\n"
        "  macOS:         brew install mosquitto\n"
        "  Fedora:        sudo dnf install -y mosquitto",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
