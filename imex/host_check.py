"""Readiness check of a host-managed IMEX daemon, run by the node agent before it hands out channel 0.

This module owns
- validating ``IMEX_HOST_SOCKET_PATH`` (absolute, normalised, no ``..``: SPEC section 3 rule 7);
- finding ``nvidia-imex-ctl`` under the driver root (the root itself, ``/opt/bin``, ``/usr/bin``,
  ``/usr/sbin``, ``/bin``, ``/sbin``; regular files only, symlinks resolved inside the root);
- running ``nvidia-imex-ctl -q -u <socket>`` chrooted into the driver root through the ``chroot``
  program (no shell; the binary is named by its absolute path inside the root, so no PATH lookup can
  pick another one), with a deadline: on timeout the whole process group is SIGKILLed, so a hung ctl
  can never hold a Prepare (and the node-wide lock behind it) forever, as upstream's can;
- reading at most ``MAX_CTL_OUTPUT_BYTES`` of its combined stdout+stderr (a ctl that writes more is killed);
- interpreting that output: ready only when it is exactly ``READY`` after stripping
  whitespace and the exit status is 0 (upstream accepts any output containing READY).

Error classes and what the node agent does with them:
- ``SocketPathError``: permanent. The setting is wrong and no retry can fix it; the controller and the
  agent already refuse to start with it, this is the last line of defence.
- ``ImexCtlNotFoundError``: retryable. On GPU-operator nodes the driver root is populated by a driver
  container that can finish after the node agent starts, so the binary may appear later.
- ``HostImexNotReadyError`` (and its ``HostImexTimeoutError``): retryable; carries the reported state
  and the ctl's output so the pod's Events say what the daemon said.

The subprocess is started with ``asyncio.create_subprocess_exec``; the caller awaits the check.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import shutil
import signal
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Protocol

from imex.discovery import HardwareError
from imex.driver_root import find_binary, searched_bin_dirs

DEFAULT_HOST_SOCKET_PATH = "/etc/nvidia-imex/imex_ctrl.sock"
IMEX_CTL = "nvidia-imex-ctl"
DEFAULT_TIMEOUT_S = 10.0
_MAX_OUTPUT_IN_MESSAGE = 300
# nvidia-imex-ctl -q prints one state name; anything near this much is broken or hostile.
MAX_CTL_OUTPUT_BYTES = 64 * 1024


class ImexState(StrEnum):
    """What ``nvidia-imex-ctl -q`` prints (DCGM_FI_IMEX_DAEMON_STATUS names), plus UNKNOWN for anything else."""

    INITIALIZING = "INITIALIZING"
    STARTING_AUTH_SERVER = "STARTING_AUTH_SERVER"
    WAITING_FOR_PEERS = "WAITING_FOR_PEERS"
    WAITING_FOR_RECOVERY = "WAITING_FOR_RECOVERY"
    INIT_GPU = "INIT_GPU"
    READY = "READY"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNAVAILABLE = "UNAVAILABLE"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def from_output(cls, output: str) -> ImexState:
        text = output.strip()
        try:
            return cls(text)
        except ValueError:
            # Known name on the first line with diagnostics after it still tells the user the state.
            first = text.splitlines()[0].strip() if text else ""
            return cls.__members__.get(first, cls.UNKNOWN)


class HostCheckError(HardwareError):
    """Base of the host-managed readiness check errors. ``retryable`` tells Prepare what to do."""

    retryable = True


class SocketPathError(HostCheckError):
    retryable = False


class ImexCtlNotFoundError(HostCheckError):
    retryable = True


class HostImexNotReadyError(HostCheckError):
    retryable = True

    def __init__(self, message: str, *, state: ImexState, output: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.state = state
        self.output = output
        self.exit_code = exit_code


class HostImexTimeoutError(HostImexNotReadyError):
    pass


def validate_socket_path(path: str) -> PurePosixPath:
    """``IMEX_HOST_SOCKET_PATH`` as a path inside the driver root, or ``SocketPathError``."""
    fix = f"set IMEX_HOST_SOCKET_PATH to an absolute, normalised path such as {DEFAULT_HOST_SOCKET_PATH}"
    if not path:
        raise SocketPathError(f"IMEX_HOST_SOCKET_PATH is empty: {fix}")
    if "\x00" in path or any(ch in path for ch in "\n\r"):
        raise SocketPathError(f"IMEX_HOST_SOCKET_PATH {path!r} contains control characters: {fix}")
    if not path.startswith("/"):
        raise SocketPathError(f"IMEX_HOST_SOCKET_PATH {path!r} is not absolute: {fix}")
    if ".." in path.split("/"):
        raise SocketPathError(f"IMEX_HOST_SOCKET_PATH {path!r} contains '..': {fix}")
    if posixpath.normpath(path) != path or path.startswith("//"):
        raise SocketPathError(f"IMEX_HOST_SOCKET_PATH {path!r} is not normalised: {fix}")
    return PurePosixPath(path)


def find_imex_ctl(driver_root: Path) -> PurePosixPath:
    """Path of ``nvidia-imex-ctl`` as seen inside ``driver_root`` (e.g. ``/usr/bin/nvidia-imex-ctl``).

    Symlinks are resolved relative to the root, because an absolute link inside a host driver root
    points into the host, not into the container that looks at it.
    """
    found = find_binary(driver_root, IMEX_CTL)
    if found is None:
        raise ImexCtlNotFoundError(
            f"{IMEX_CTL} not found under driver root {driver_root} (searched {searched_bin_dirs()}): "
            "is nvidia-imex installed on this node, and is NVIDIA_DRIVER_ROOT right?"
        )
    return found


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    output: str


class CommandRunner(Protocol):
    """Runs argv with combined stdout+stderr and a deadline; raises TimeoutError after killing it."""

    async def __call__(self, argv: list[str], *, timeout_s: float) -> CommandResult: ...


async def _read_bounded(stream: asyncio.StreamReader) -> tuple[bytes, bool]:
    """Up to ``MAX_CTL_OUTPUT_BYTES`` of ``stream`` until EOF; True when there was more."""
    data = bytearray()
    while len(data) <= MAX_CTL_OUTPUT_BYTES:
        chunk = await stream.read(MAX_CTL_OUTPUT_BYTES + 1 - len(data))
        if not chunk:
            return bytes(data), False
        data += chunk
    return bytes(data[:MAX_CTL_OUTPUT_BYTES]), True


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_command(argv: list[str], *, timeout_s: float) -> CommandResult:
    """The real ``CommandRunner``: own process group, SIGKILL of the group on timeout. At most
    ``MAX_CTL_OUTPUT_BYTES`` of output are read: a command that writes more is killed, its exit code is -1
    and its output ends with a note saying it was cut."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # A group of its own, so a timeout also kills anything the ctl (or a wrapper script) forked.
        start_new_session=True,
    )
    assert proc.stdout is not None
    stream = proc.stdout

    async def collect() -> tuple[bytes, bool]:
        stdout, cut = await _read_bounded(stream)
        if cut:
            _kill_group(proc)
            # Drain to EOF, discarding, so the pipe closes with the process (the deadline still applies).
            while await stream.read(MAX_CTL_OUTPUT_BYTES):
                pass
        await proc.wait()
        return stdout, cut

    try:
        stdout, cut = await asyncio.wait_for(collect(), timeout_s)
    except BaseException:
        # Timeout or cancellation (the Prepare deadline): never leave the child behind.
        _kill_group(proc)
        with contextlib.suppress(Exception):
            await asyncio.shield(proc.wait())
        raise
    output = stdout.decode(errors="replace")
    if cut:
        return CommandResult(-1, f"{output}\n[output cut after {MAX_CTL_OUTPUT_BYTES} bytes; the command was killed]")
    return CommandResult(exit_code=proc.returncode if proc.returncode is not None else -1, output=output)


def chroot_program() -> str:
    """The ``chroot`` executable: from PATH (busybox images), else coreutils' usual place."""
    return shutil.which("chroot") or "/usr/sbin/chroot"


def ctl_argv(driver_root: Path, ctl: PurePosixPath, socket: PurePosixPath, *, chroot: str | None = None) -> list[str]:
    """``[chroot <root>] <ctl> -q -u <socket>``; no chroot when the driver root is ``/``."""
    argv = [str(ctl), "-q", "-u", str(socket)]
    if driver_root.resolve() == Path("/"):
        return argv
    return [chroot or chroot_program(), str(driver_root), *argv]


async def check_host_imex_ready(
    *,
    driver_root: Path,
    socket_path: str = DEFAULT_HOST_SOCKET_PATH,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    runner: CommandRunner = run_command,
    chroot: str | None = None,
) -> None:
    """Return when the host IMEX daemon reports exactly READY; raise a ``HostCheckError`` otherwise."""
    socket = validate_socket_path(socket_path)
    ctl = find_imex_ctl(driver_root)
    argv = ctl_argv(driver_root, ctl, socket, chroot=chroot)
    try:
        result = await runner(argv, timeout_s=timeout_s)
    except TimeoutError:
        raise HostImexTimeoutError(
            f"host nvidia-imex daemon readiness check timed out after {timeout_s:g}s "
            f"({IMEX_CTL} -q -u {socket} under {driver_root}); killed it",
            state=ImexState.UNKNOWN,
            output="",
            exit_code=None,
        ) from None
    except OSError as exc:
        raise HostImexNotReadyError(
            f"cannot run {IMEX_CTL} under driver root {driver_root}: {exc.strerror or exc}",
            state=ImexState.UNKNOWN,
            output="",
            exit_code=None,
        ) from None
    output = result.output
    if result.exit_code == 0 and output.strip() == ImexState.READY:
        return
    state = ImexState.from_output(output)
    shown = " ".join(output.split())[:_MAX_OUTPUT_IN_MESSAGE] or "(no output)"
    raise HostImexNotReadyError(
        f"host nvidia-imex daemon not ready: state {state}, exit code {result.exit_code}, "
        f"socket {socket} under {driver_root}; output: {shown}",
        state=state,
        output=output,
        exit_code=result.exit_code,
    )
