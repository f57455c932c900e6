"""One warm interpreter that forks a child per short command line the suite runs.

The docs' experiment blocks are checked line by line with --dry-run and every CLI error case is
a command line of its own: a few hundred processes per suite, each of which spent 2-3 s
importing torch to print a plan or one line of error. Here torch and numpy are imported once;
each command line still runs in a process of its own, with its own argv, working directory,
environment and standard streams (passed as file descriptors), through the same entry points
(`python -m MODULE`, `python SCRIPT.py`, `fedmq`) a user runs. Anything else goes to the real
interpreter. What a warm start cannot show (a warning at import, start-up time) the
fresh-process tests do: the documented fleets, `fedmq demo`, tests/test_process_lines.py.

    python -m tests.warm_python SOCKET      # serve until killed
    python -I -S tests/warm_python.py --client SOCKET fedmq|python ARGS...
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
from pathlib import Path

_HEADER = struct.Struct("!I")


def _send_msg(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data))], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def client(path: str, program: str, args: list[str]) -> int:
    """The shim's side: hand our argv, cwd, environment and stdio to the zygote; its exit code."""
    import json

    request = json.dumps({"program": program, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        _send_msg(sock, request.encode(), [0, 1, 2])
        (code,) = struct.unpack("!i", _recv_exact(sock, 4))
    return code


def _child(request: dict, fds: list[int]) -> int:
    """In the forked child: become the requested command and run it."""
    import runpy

    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    try:
        if request["program"] == "fedmq":
            from fedmq.cli import main

            sys.argv = ["fedmq", *args]
            return int(main() or 0)
        if args[0] == "-m":
            sys.argv = ["python", *args[2:]]
            sys.path.insert(0, request["cwd"])  # what `python -m` puts first
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            return 0
        # As `python SCRIPT` runs it: its folder first on the path, its __file__ absolute.
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.realpath(args[0])))
        runpy.run_path(os.path.abspath(args[0]), run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


def serve(path: str) -> None:
    """Accept requests forever; fork from this (main) thread, reap in another."""
    import json

    import numpy  # noqa: F401  the imports every dry run pays for
    import torch  # noqa: F401

    import fedmq.config  # noqa: F401
    import fedmq.data  # noqa: F401

    waiting: dict[int, socket.socket] = {}
    lock = threading.Lock()

    def reap() -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                threading.Event().wait(0.05)
                continue
            with lock:
                conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                finally:
                    conn.close()

    threading.Thread(target=reap, daemon=True).start()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        try:
            head, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
            request = json.loads(_recv_exact(conn, _HEADER.unpack(head)[0]))
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        with lock:
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                code = _child(request, fds)
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code & 0xFF)
            waiting[pid] = conn
        for fd in fds:
            os.close(fd)


def client_argv(sock: Path, program: str, *args: str) -> list[str]:
    """The command line that runs `program args` (`fedmq ...`, `python -m ...`, `python SCRIPT.py
    ...`) warm."""
    return [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--client", str(sock), program, *args]


def _shim_main(argv: list[str]) -> int:
    path, program, args = argv[1], argv[2], argv[3:]
    warm = (len(args) >= 2 and args[0] == "-m") or (bool(args) and args[0].endswith(".py"))
    if program == "python" and not warm:
        real = os.path.join(os.path.dirname(sys.executable), "python")
        os.execv(real, [real, *args])  # argv[0] a bare "python" would find a python on PATH, not the venv's
    return client(path, program, args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        raise SystemExit(_shim_main(sys.argv[1:]))
    serve(sys.argv[1])
