"""``python -m tests.testbed.imex_simulator.forkserver``: start simulated ``nvidia-imex`` processes by fork.

Why: a real node execs a native ``nvidia-imex`` in milliseconds; the simulator is Python, and each start
paid ~0.1 CPU s of imports (asyncio, logging, the simulator), ~7 CPU s for the 72 daemons of a rack, all at
the moment the daemons start IMEX. This server imports the simulator once and forks a started one per request.

Protocol (TCP on 127.0.0.1, port printed as the first line of stdout): the client -- ``client_script``, a
bash stand-in for the binary -- connects and sends its own PID. The server reads what an exec would have
given the process from ``/proc/<pid>``: the arguments (``cmdline`` after ``bash <script> <binary>``), the
environment, the working directory and the open stdin/stdout/stderr (reopened through ``/proc/<pid>/fd``,
which works for files and pipes). The forked child becomes that ``nvidia-imex``; the server answers the
child's PID and, when it exits, its exit status (``128 + signal`` when killed by one).

Where it differs from an exec: the daemon's child is the bash client, not the simulator. The client
forwards SIGTERM, SIGINT and SIGUSR1 to the simulator and exits with its status, so the daemon sees what it
would see of a real child. A SIGKILL of the client (a container's death) closes the connection, and the
server SIGKILLs the simulator at once. When the server cannot be reached or cannot start one (a descriptor
that is neither file nor pipe), the client execs the binary itself.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.testbed.imex_simulator import imexd

CLIENT = r"""#!/bin/bash
# nvidia-imex started by the IMEX simulator's fork server (tests.testbed.imex_simulator.forkserver); the server
# unreachable, the binary in $1 itself. Usage: <this> <nvidia-imex> ARGS...
if ! exec 3<>/dev/tcp/127.0.0.1/@PORT@; then exec "$@"; fi 2>/dev/null
# A subshell writes the PID: a redirection in this shell would point its stdout at the socket for a moment,
# and the server reopens this shell's stdout and stderr as soon as the PID arrives.
( echo "$$" ) >&3
IFS= read -r child <&3
case "$child" in ''|*[!0-9]*) exec 3>&-; exec "$@";; esac
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
trap 'kill -USR1 "$child" 2>/dev/null' USR1
IFS= read -r code <&3 || code=1
exit "$code"
"""


def client_script(port: int) -> str:
    return CLIENT.replace("@PORT@", str(port))


@dataclass
class Request:
    """What an exec would have given the client's simulator: arguments, environment, directory, stdio."""

    args: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]

    @classmethod
    def of(cls, pid: int) -> Request:
        proc = Path(f"/proc/{pid}")
        cmdline = proc.joinpath("cmdline").read_bytes().split(b"\0")[:-1]
        environ = proc.joinpath("environ").read_bytes().split(b"\0")
        fds: list[int] = []
        try:
            # stdin: the simulator reads none; a descriptor /proc cannot reopen (a socket) becomes /dev/null.
            try:
                fds.append(os.open(proc / "fd" / "0", os.O_RDONLY))
            except OSError:
                fds.append(os.open(os.devnull, os.O_RDONLY))
            fds += [os.open(proc / "fd" / str(fd), os.O_WRONLY | os.O_APPEND) for fd in (1, 2)]
        except OSError:
            cls.close(fds)
            raise
        return cls(
            args=[a.decode() for a in cmdline[3:]],  # bash, this script, the binary it would exec
            env=dict(item.decode().partition("=")[::2] for item in environ if item),
            cwd=str((proc / "cwd").readlink()),
            fds=fds,
        )

    @staticmethod
    def close(fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)


def _become(request: Request) -> int:
    """In the forked child: take the client's descriptors and environment, run the simulator."""
    args, env, cwd = request.args, request.env, request.cwd
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["nvidia-imex", *args]
    return imexd.main(args)


def serve() -> int:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}  # simulator PID -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "stdin" and not os.read(sys.stdin.fileno(), 4096):
                signal.set_wakeup_fd(-1)
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return 0
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request = Request.of(int(conn.recv(64).split(b"\n")[0]))
                except (OSError, ValueError) as exc:
                    print(f"forkserver: cannot start one for that client ({exc}); it execs the binary", file=sys.stderr)
                    conn.sendall(b"no\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        for s in (listener, wake_r, wake_w, conn, *by_conn):
                            s.close()
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        code = _become(request)
                    except SystemExit as exc:  # argparse's refusal of the arguments
                        code = exc.code if isinstance(exc.code, int) else 1
                    except BaseException as exc:  # the child must never return into the server's loop
                        with contextlib.suppress(Exception):
                            print(f"nvidia-imex (simulated, forked): {exc!r}", file=sys.stderr)
                    finally:
                        with contextlib.suppress(Exception):
                            sys.stdout.flush()
                            sys.stderr.flush()
                        os._exit(code if isinstance(code, int) else 1)
                Request.close(request.fds)
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
                by_conn[conn] = pid
                sel.register(conn, selectors.EVENT_READ, "conn")
            elif key.data == "conn":
                conn = key.fileobj  # type: ignore[assignment]
                assert isinstance(conn, socket.socket)
                with contextlib.suppress(OSError):
                    if conn.recv(64):
                        continue
                # The client is gone (a container's SIGKILL): so is its nvidia-imex (reaped below).
                sel.unregister(conn)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(by_conn[conn], signal.SIGKILL)
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    wake_r.recv(4096)
                _reap(children, by_conn, sel)


def _reap(children: dict[int, socket.socket], by_conn: dict[socket.socket, int], sel: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
        by_conn.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()


if __name__ == "__main__":
    sys.exit(serve())
