"""Give a scaled compose agent one identity from `fedmq creds`' list, then exec the agent.

With the prod broker every agent logs in as itself (username = agent id, its own password,
an ACL bound to its own topics), so `docker compose up --scale agent=N` replicas cannot
invent ids: each claims one of the agents in credentials.json. A claim is a directory made
with mkdir (atomic on a shared volume) holding the claimer's hostname; a restarted container
keeps its hostname and so gets its own id back. `{id}` in the command is replaced, the
identity's password goes into FEDMQ_BROKER_PASSWORD (which a broker URL with a user and no
password reads: a password in argv is visible to every user of the host in `ps`), then the
command replaces this process (signals reach the agent directly).

    python claim_agent.py --credentials creds.json --claims /var/lib/fedmq/agents \\
        -- fedmq agent --id {id} --broker mqtts://{id}@mosquitto:8883 ...

This is for a test fleet on one host (every container sees every password); a real device
gets only its own entry (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path


def claim(claims: Path, agents: list[str], me: str) -> str:
    """The agent id this host owns, claiming the first free one if it owns none."""
    claims.mkdir(parents=True, exist_ok=True)
    for agent in agents:
        owner = claims / f"{agent}.claim" / "owner"
        if owner.is_file() and owner.read_text().strip() == me:
            return agent
    for agent in agents:
        try:
            (claims / f"{agent}.claim").mkdir()
        except FileExistsError:
            continue
        (claims / f"{agent}.claim" / "owner").write_text(me + "\n")
        return agent
    raise SystemExit(f"claim_agent: all {len(agents)} agent identities are taken; run "
                     "`fedmq creds` with more --agents, or scale down")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--credentials", type=Path, required=True, help="credentials.json of `fedmq creds`")
    p.add_argument("--claims", type=Path, required=True, help="shared directory for the claims")
    p.add_argument("--hostname", default=None, help="claimer name (default: $HOSTNAME, else this host's name)")
    p.add_argument("--print", action="store_true", help="print the claimed agent id and exit")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- COMMAND with {id}; the password is in FEDMQ_BROKER_PASSWORD")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    agents_pw: dict[str, str] = json.loads(args.credentials.read_text())["agents"]
    me = args.hostname or os.environ.get("HOSTNAME") or socket.gethostname()
    agent = claim(args.claims, sorted(agents_pw), me)
    if any("{password}" in part for part in command):
        p.error("{password} in the command would put it in argv (visible in `ps`); use a broker URL "
                "without a password, mqtts://{id}@host: it reads FEDMQ_BROKER_PASSWORD, set here")
    final = [part.replace("{id}", agent) for part in command]
    if args.print:
        print(agent)
        return 0
    os.execvpe(final[0], final, {**os.environ, "FEDMQ_BROKER_PASSWORD": agents_pw[agent]})
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
