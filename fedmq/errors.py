"""Expected failures, typed by who can fix them, and the one place they become exit statuses.

A command line ends in one of three ways: it worked (0), the person asked for something that
cannot be (a bad flag or value, an unknown dataset, a typo'd config key: `UsageError`, 2), or
the world is not as needed (the broker is unreachable or refuses us, the state dir is
corrupt, dataset files are missing: `RuntimeFailure`, 1). Code raises these where the failure
happens, with a message that names the bad thing and the fix; `report_failure` (used by
`fedmq` and the `python -m` entry points) prints it as one line on stderr. Anything else is
a bug and keeps its traceback.

    raise UsageError(f"unknown model {name!r}; known: {', '.join(ZOO)}")
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import traceback
from typing import NoReturn

from fedmq.redact import mask_secrets

USAGE = 2
RUNTIME = 1
TERMINATED = 128 + signal.SIGTERM


class FedmqError(Exception):
    """An expected failure; `exit_status` says which kind."""

    exit_status = RUNTIME


class UsageError(FedmqError, ValueError):
    """What was asked for cannot be done: fix the command line or config (exit status 2)."""

    exit_status = USAGE


class RuntimeFailure(FedmqError, RuntimeError):
    """The command was fine, the world was not: broker, credentials, files (exit status 1)."""

    exit_status = RUNTIME


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `PROG: MESSAGE (see PROG --help)`, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(mask_secrets(f"{self.prog}: {message} (see {self.prog} --help)"), file=sys.stderr)
        sys.exit(USAGE)


def expected_failure(exc: BaseException) -> int | None:
    """The exit status for an expected failure, None for a bug (which keeps its traceback)."""
    if isinstance(exc, FedmqError):
        return exc.exit_status
    if isinstance(exc, OSError):  # a path that cannot be read or written: the world, not us
        return RUNTIME
    return None


def report_failure(prog: str, exc: BaseException, debug: bool = False) -> int:
    """Print `PROG: MESSAGE` on stderr (after the traceback with `debug` or fedmq logging at debug)."""
    if debug or logging.getLogger("fedmq").isEnabledFor(logging.DEBUG):
        traceback.print_exception(exc)
    message = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:  # not "[Errno 20] ..."
        message = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    print(mask_secrets(f"{prog}: {' '.join(message.split())}"), file=sys.stderr)
    return expected_failure(exc) or RUNTIME


def unwind_on_sigterm() -> None:
    """Make SIGTERM end the process the way Ctrl-C does: `finally` blocks and context managers
    run, so the brokers, worker processes and temporary directories a command started are
    stopped and removed (with the default action they outlive it), and the exit status is 143.

    Only where SIGTERM still has its default action and in the main thread: a command that
    stops gracefully on SIGTERM (fedmq/signals.py's `SignalRelay`) installs its own handler
    after this and keeps it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_terminated)


def _exit_terminated(_signum: int, _frame: object) -> None:
    raise SystemExit(TERMINATED)


def run_main(prog: str, main, argv=None) -> int:
    """Run `main(argv)` turning expected failures into one line and their exit status; SIGTERM
    unwinds like Ctrl-C (`unwind_on_sigterm`)."""
    unwind_on_sigterm()
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if expected_failure(e) is None:
            raise
        return report_failure(prog, e)
