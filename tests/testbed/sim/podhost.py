"""`python -m tests.testbed.sim.podhost`: several simulated containers in one process (large topologies).

Why: 72 node agents and 72 IMEX daemons as 144 Python processes do not fit on two shared cores (each
process pays ~1 s of CPU for its imports alone). A pod host imports once and runs each container through the
entry point its command names, in the same event loop, with separate state:

  python -m computedomain kubelet-plugin ARGS   settings from ARGS over the container's env ->
                                                `computedomain.plugin.app.serve` (`main` minus its signals)
  python -m imex daemon run ARGS                settings from ARGS over the env -> `imex.daemon.run.run_daemon`

Each container has its own settings (so its own sockets, directories, pod IP, health port), its own
service account, Kubernetes client and stop event. The service account: one process cannot give each
container the in-pod path in a mount namespace of its own (`tests.testbed.serviceaccount`), so the pod host
puts the product's in-cluster loader (`computedomain.kube.config.in_cluster`) in front of a lookup: a
container's client reads the token and CA from that container's directory, with that container's env, and
nothing else of the loader changes (the only difference from a pod: the directory's name). What the
containers share is the process: the event loop, `os.environ` (nothing of theirs reads it but the loader's
"am I in a pod" test, which the first container's `KUBERNETES_SERVICE_HOST` answers for all: they talk to one
apiserver; settings take `environ=`, and the daemon's `nvidia-imex` is a per-pod wrapper named by
`IMEX_BINARY` that sets the simulator's env itself), the
prometheus registry, and the root logger and `sys.stderr`, whose records and lines are routed to each
container's log file by a context variable that every task of that container inherits (so a start-up
`error: ...` line lands in the container's log, as it would in a process of its own).

Protocol (JSON lines): stdin `{"op": "start", "id", "argv", "env", "log", "serviceaccount"}`, `{"op": "term", "id"}` (the
container's SIGTERM: its graceful path runs), `{"op": "kill", "id"}` (its task is cancelled: no graceful path,
but `finally` blocks still run -- the closest a shared process gets to SIGKILL; scenarios that need a real
SIGKILL run that container as a process of its own), `{"op": "exit"}`; stdout `{"op": "exited", "id", "code"}`.

`--one --scope NS -- ARGV...` runs a single controller (`python -m computedomain controller`) as its own
process, limited to the ComputeDomains of namespace NS (`computedomain.controller.app.main(...,
cd_namespace=NS)`), so a simulation's controller leaves other tests' domains in the shared cluster alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from computedomain.kube import config as kube_config
from computedomain.kube.config import Credentials
from computedomain.kube.config import in_cluster as _in_cluster

current: contextvars.ContextVar[str | None] = contextvars.ContextVar("sim_container", default=None)
log = logging.getLogger("podhost")
_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class _Router(logging.Handler):
    def __init__(self, fallback: IO[str]) -> None:
        super().__init__()
        self.files: dict[str, IO[str]] = {}
        self.fallback = fallback
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            target = self.files.get(current.get() or "", self.fallback)
            target.write(self.format(record) + "\n")
            target.flush()
        except Exception:
            self.handleError(record)


class _RoutedStderr(io.TextIOBase):
    """`sys.stderr` of the pod host: a hosted container's writes go to its log file."""

    def __init__(self, router: _Router) -> None:
        self.router = router

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        target = self.router.files.get(current.get() or "", self.router.fallback)
        target.write(text)
        target.flush()
        return len(text)


def _program(argv: Sequence[str]) -> tuple[str, ...]:
    return tuple(argv[1:]) if argv and argv[0] == sys.executable else tuple(argv)


async def run_container(argv: Sequence[str], env: dict[str, str], stop: asyncio.Event) -> int:
    from computedomain.settings import SettingsError, load_settings

    program = _program(argv)
    try:
        if program[:3] == ("-m", "computedomain", "kubelet-plugin"):
            from computedomain.plugin.app import serve
            from computedomain.settings import PluginSettings

            return await serve(load_settings(PluginSettings, program[3:], environ=env), stop)
        if program[:4] == ("-m", "imex", "daemon", "run"):
            from imex.daemon.run import run_daemon
            from imex.daemon.settings import DaemonSettings

            settings = load_settings(DaemonSettings, program[4:], environ=env)
            settings.validate_for_run()
            return await run_daemon(settings, stop=stop)
    except SettingsError as exc:
        log.error("error: %s", exc)
        return 2
    log.error("podhost cannot host %s", " ".join(argv))
    return 127


class Host:
    def __init__(self, out: IO[bytes], router: _Router) -> None:
        self.out = out
        self.router = router
        self.stops: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.accounts: dict[str, tuple[Path, dict[str, str]]] = {}  # container -> its service account, env

    def in_cluster(self) -> Credentials:
        """`config.in_cluster` for the container whose task asks (see the module docstring)."""
        directory, env = self.accounts[current.get() or ""]
        return _in_cluster(directory, env)

    def report(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message).encode() + b"\n")
        self.out.flush()

    def start(self, cid: str, argv: list[str], env: dict[str, str], log_path: str, service_account: str) -> None:
        self.router.files[cid] = Path(log_path).open("a", encoding="utf-8")  # noqa: SIM115 (closed when it exits)
        self.accounts[cid] = (Path(service_account), env)
        for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            if name in env:
                os.environ.setdefault(name, env[name])
        stop = asyncio.Event()
        self.stops[cid] = stop

        async def body() -> None:
            code = 1
            try:
                log.info("starting %s", " ".join(argv[1:]))
                code = await run_container(argv, env, stop)
            except asyncio.CancelledError:
                code = 137
            except Exception:
                log.exception("container failed")
                code = 1
            finally:
                log.info("exited code=%d", code)
                self.report({"op": "exited", "id": cid, "code": code})
                self.stops.pop(cid, None)
                self.tasks.pop(cid, None)
                self.accounts.pop(cid, None)
                handle = self.router.files.pop(cid, None)
                if handle is not None:
                    handle.close()

        ctx = contextvars.copy_context()
        ctx.run(current.set, cid)
        self.tasks[cid] = asyncio.get_running_loop().create_task(body(), name=f"container-{cid}", context=ctx)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 22)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            message = json.loads(line)
            op, cid = message.get("op"), message.get("id", "")
            if op == "start":
                self.start(cid, message["argv"], message["env"], message["log"], message["serviceaccount"])
            elif op == "term" and cid in self.stops:
                self.stops[cid].set()
            elif op == "kill" and cid in self.tasks:
                self.tasks[cid].cancel()
            elif op == "exit":
                break
        for stop in self.stops.values():
            stop.set()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=10)
        for task in list(self.tasks.values()):
            task.cancel()


def _one(argv: list[str]) -> int:
    scope = ""
    if argv and argv[0].startswith("--scope="):
        scope = argv.pop(0).partition("=")[2]
    if argv and argv[0] == "--":
        argv.pop(0)
    program = _program(argv)
    if program[:3] != ("-m", "computedomain", "controller"):
        print(f"podhost --one runs controllers only, not {' '.join(argv)}", file=sys.stderr)
        return 127
    from computedomain.controller.app import main
    from computedomain.logs import configure_logging
    from computedomain.settings import ControllerSettings, SettingsError, load_settings

    try:
        settings = load_settings(ControllerSettings, program[3:])
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    return asyncio.run(main(settings, cd_namespace=scope or None))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--one":
        return _one(argv[1:])
    # stdout is the protocol: keep every stray print of a hosted program off it.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    router = _Router(sys.stderr)
    sys.stderr = _RoutedStderr(router)
    root = logging.getLogger()
    root.handlers[:] = [router]
    root.setLevel(logging.INFO)
    host = Host(out, router)
    kube_config.in_cluster = host.in_cluster  # type: ignore[assignment]  # the lookup of the docstring
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(host.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
