"""The `fedmq` command: one entry point, one subcommand per role.

Each subcommand lives in the package that owns the role and exposes two functions,
`add_arguments(parser)` and `run(args) -> int`. They are imported by name, so this kernel
package keeps no static import of `aggregator`, `edge_agent` or `sim`; and only the one a
command line names is imported (every other role would pull torch in: ~2 s of each start).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection

from fedmq import __version__
from fedmq.algorithms import ASYNC_SERVER, DISPLAY, ROUNDS
from fedmq.errors import ArgumentParser, expected_failure, report_failure, unwind_on_sigterm


def _names(algorithms: tuple[str, ...]) -> str:
    """Algorithms as `--help` names them, from the registry (fedmq/algorithms.py): one added
    there shows here without an edit."""
    return ", ".join(DISPLAY.get(a, a) for a in algorithms)


# name -> (module, one-line help). Order is the order shown in --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("sim.demo", "run a small fleet end to end over a real broker"),
    "aggregator": ("aggregator.cli", f"run the aggregator ({_names(ASYNC_SERVER)}; {_names(ROUNDS)} rounds)"),
    "start-model": ("aggregator.start_model", "train a start model on public data and write it for --init"),
    "worker": ("aggregator.worker_cli", "run a CDFL reply worker for an aggregator (docs/scaling.md)"),
    "agent": ("edge_agent.cli", "run an edge agent"),
    "sim": ("sim.cli", "simulated fleets: run experiments and report"),
    "broker": ("fedmq.broker_cli", "start a broker for development (Mosquitto or embedded)"),
    "creds": ("fedmq.creds", "make CA, server cert, per-agent passwords and ACL for the prod broker"),
    "privacy": ("fedmq.privacy_cli", "plan differential privacy: the noise with which N uploads fit a budget"),
    "fleet": ("fedmq.fleet_status", "operator view of a fleet: `fleet status` lists agents online/offline, last tau, accuracy, upload"),
}


def build_parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole `fedmq` parser; `load` names the subcommands whose arguments are added (None: all).

    A subcommand not loaded is still listed in `fedmq --help`, with its one-line help.
    """
    parser = ArgumentParser(
        prog="fedmq",
        description=f"Federated learning for edge fleets over MQTT ({_names(ASYNC_SERVER)}; {_names(ROUNDS)}).",
    )
    parser.add_argument("--version", action="version", version=f"fedmq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if load is not None and name not in load:
            sub.add_parser(name, help=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # a role not built yet
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
        _remember_parsers(p)
    return parser


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Each (sub)parser records itself, so that a stray flag is reported by `fedmq sim run`, not `fedmq`."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _remember_parsers(child)


def requested_command(argv: list[str]) -> str | None:
    """The subcommand a command line names: its first word that is not an option."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    unwind_on_sigterm()  # commands that stop gracefully install their own handler over this
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(load={requested_command(argv)} & SUBCOMMANDS.keys())
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if expected_failure(e) is None:
            raise  # a bug: keep the traceback
        return report_failure(_verb(args), e, debug=getattr(args, "log_level", None) == "debug")


def _verb(args: argparse.Namespace) -> str:
    """`fedmq sim run`, `fedmq fleet status`: the words a person typed, for the error line."""
    words = ["fedmq", args.command]
    for attr in ("sim_command", "fleet_command", "privacy_command"):
        if getattr(args, attr, None):
            words.append(getattr(args, attr))
    return " ".join(words)


if __name__ == "__main__":
    sys.exit(main())
