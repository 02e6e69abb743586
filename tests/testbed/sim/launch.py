"""Starting and stopping simulated containers: one OS process each, or several hosted in one `podhost` process.

`Launched` is what the pod runner holds for a running container: `terminate()` is the kubelet's SIGTERM
(the process' own shutdown path runs), `kill()` is SIGKILL (nothing runs), `wait()` the exit status.

- `start_process`: the container's argv as a process in its own session (so a SIGKILL takes its children,
  e.g. `nvidia-imex`, down with it, as a container's death does), output appended to the pod's log file.
- `HostPool`: `podhost` processes that each run several containers of one kind in one event loop, through
  the same entry points the command line uses (see `podhost`). Terminate = that container's stop event;
  kill = its task cancelled without the graceful path. A whole host can be SIGKILLed (a node crash for the
  containers it hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tests.testbed.sim.containers import REPO


class Launched(Protocol):
    pid: int | None

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ProcessContainer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid: int | None = proc.pid

    async def wait(self) -> int:
        return await self.proc.wait()

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


async def start_process(argv: list[str], env: dict[str, str], log_path: Path) -> ProcessContainer:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            cwd=REPO,
            start_new_session=True,
        )
    return ProcessContainer(proc)


@dataclass
class HostedContainer:
    host: PodHostProcess
    id: str
    pid: int | None = None
    exited: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def terminate(self) -> None:
        self.host.send({"op": "term", "id": self.id})

    def kill(self) -> None:
        self.host.send({"op": "kill", "id": self.id})


class PodHostProcess:
    """One `python -m tests.testbed.sim.podhost` and the containers it runs (JSON lines on stdin/stdout)."""

    def __init__(self, proc: asyncio.subprocess.Process, kind: str) -> None:
        self.proc = proc
        self.kind = kind
        self.pid = proc.pid
        self.containers: dict[str, HostedContainer] = {}
        self.assigned = 0
        self._reader = asyncio.create_task(self._read(), name=f"podhost-{proc.pid}")

    @classmethod
    async def start(cls, kind: str, env: dict[str, str], log_path: Path) -> PodHostProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.testbed.sim.podhost",
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                cwd=REPO,
                start_new_session=True,
                limit=1 << 20,
            )
        return cls(proc, kind)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        if self.proc.returncode is None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")

    def launch(
        self, container_id: str, argv: list[str], env: dict[str, str], log_path: Path, service_account: Path
    ) -> HostedContainer:
        hosted = HostedContainer(self, container_id)
        self.containers[container_id] = hosted
        self.assigned += 1
        self.send({"op": "start", "id": container_id, "argv": argv, "env": env, "log": str(log_path),
                   "serviceaccount": str(service_account)})  # fmt: skip
        return hosted

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                hosted = self.containers.get(message.get("id", ""))
                if hosted is not None and message.get("op") == "exited" and not hosted.exited.done():
                    hosted.exited.set_result(int(message.get("code", 1)))
                    self.containers.pop(hosted.id, None)
        code = await self.proc.wait()
        for hosted in self.containers.values():  # the host died: so did everything in it
            if not hosted.exited.done():
                hosted.exited.set_result(128 + signal.SIGKILL if code < 0 else code)
        self.containers.clear()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.send({"op": "exit"})
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.kill()
                await self.proc.wait()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class HostPool:
    """Assigns hosted containers of one kind to `podhost` processes of at most `per_host` containers each
    (counted over the host's life, so a long run starts fresh hosts rather than refilling old ones)."""

    def __init__(self, kind: str, per_host: int, env: dict[str, str], log_dir: Path) -> None:
        self.kind = kind
        self.per_host = per_host
        self.env = env
        self.log_dir = log_dir
        self.hosts: list[PodHostProcess] = []
        self._lock = asyncio.Lock()

    async def launch(
        self, container_id: str, argv: list[str], env: dict[str, str], log_path: Path, service_account: Path
    ) -> HostedContainer:
        async with self._lock:
            host = next(
                (h for h in self.hosts if h.assigned < self.per_host and h.proc.returncode is None),
                None,
            )
            if host is None:
                index = len(self.hosts)
                host = await PodHostProcess.start(
                    self.kind, self.env, self.log_dir / f"podhost-{self.kind}-{index}.log"
                )
                self.hosts.append(host)
        return host.launch(container_id, argv, env, log_path, service_account)

    async def close(self) -> None:
        await asyncio.gather(*(h.close() for h in self.hosts), return_exceptions=True)
