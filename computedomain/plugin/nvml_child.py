"""The node agent's NVML reads in a short-lived child process, so that pynvml never lives in the agent.

pynvml is some 8,000 lines of ctypes declarations: about 2.4 MiB of the agent's memory once loaded, and it
cannot be unloaded again (ctypes caches the array types of its structures where Python cannot clear them).
The agent reads NVML at start-up and once per `CLIQUE_REFRESH_INTERVAL`, so `ChildNvmlSource` (an
`imex.discovery.FabricSource`) runs each read as `python -m computedomain.plugin.nvml_child DRIVER_ROOT`: the
child asks `imex.nvml` for the driver version and every GPU's fabric info, and prints one JSON line; the
parent decodes it bounded (size, shape, types) and raises a failed query as the exception type and message
the child saw, so callers behave as with `imex.nvml.NvmlFabricSource` in process. A read costs a Python
start and the pynvml import (about 0.1 s of CPU); the driver version of the last read is reused for
`REUSE_S`, so start-up's clique read and its driver checks are one child. That first child is started
before the agent imports its own modules (`start`, from `computedomain.__main__`): it runs beside the
imports instead of after them, about 70 ms off the agent's start-up to serving (design note 0007).

The agent's own process uses it (`app.main`); agents hosted several to a process (the test bed's pod host)
read in process, where a child per agent and read would cost more than the module it keeps out.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from imex.discovery import (
    DriverVersion,
    DriverVersionError,
    FabricError,
    FabricState,
    GpuFabricInfo,
    HardwareError,
    NvmlError,
    NvmlUnavailableError,
)

__all__ = ["ChildNvmlSource"]

#: how long a child may take (NVML init on a loaded driver takes milliseconds; a wedged driver must not hang us)
TIMEOUT_S: Final = 30.0
#: how long the driver version of the last read answers `driver_version()` without a new child
REUSE_S: Final = 60.0
#: the most output read from a child (72 GPUs of fabric info are a few KiB)
MAX_OUTPUT: Final = 256 * 1024
#: the most GPUs accepted in one answer
MAX_GPUS: Final = 1024
#: the error types a child may report, by name; anything else arrives as an NvmlError
_ERRORS: Final[dict[str, type[HardwareError]]] = {
    cls.__name__: cls for cls in (NvmlUnavailableError, NvmlError, FabricError, DriverVersionError)
}

Run = Callable[[list[str], float], "subprocess.CompletedProcess[bytes]"]


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)


def _collect(child: subprocess.Popen[bytes], timeout_s: float) -> subprocess.CompletedProcess[bytes]:
    """What a child started earlier printed, as `_run` returns it (the same timeout: it is killed past it)."""
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


@dataclass(frozen=True, slots=True)
class _Answer:
    version: DriverVersion | HardwareError
    gpus: list[GpuFabricInfo] | HardwareError
    at: float


class ChildNvmlSource:
    """`FabricSource` whose every NVML read runs in a child process (see the module docstring)."""

    def __init__(
        self,
        driver_root: Path,
        *,
        python: str = sys.executable,
        timeout_s: float = TIMEOUT_S,
        reuse_s: float = REUSE_S,
        run: Run = _run,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.driver_root = driver_root
        self._argv = [python, "-m", __name__, str(driver_root)]
        self._timeout_s = timeout_s
        self._reuse_s = reuse_s
        self._run = run
        self._clock = clock
        self._last: _Answer | None = None
        self._early: subprocess.Popen[bytes] | None = None

    def start(self) -> ChildNvmlSource:
        """Start the first read now; the first query takes its answer. A child that cannot start is
        started again by that query, which reports the error."""
        with contextlib.suppress(OSError):
            self._early = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return self

    def driver_version(self) -> DriverVersion:
        last = self._last
        if last is None or self._clock() - last.at > self._reuse_s or isinstance(last.version, HardwareError):
            last = self._read()
        if isinstance(last.version, HardwareError):
            raise last.version
        return last.version

    def gpu_fabric_infos(self) -> list[GpuFabricInfo]:
        gpus = self._read().gpus
        if isinstance(gpus, HardwareError):
            raise gpus
        return gpus

    def _read(self) -> _Answer:
        early, self._early = self._early, None
        try:
            done = self._run(self._argv, self._timeout_s) if early is None else _collect(early, self._timeout_s)
        except subprocess.TimeoutExpired:
            raise NvmlError(f"NVML read of driver root {self.driver_root} took over {self._timeout_s:g}s") from None
        except OSError as exc:
            raise NvmlError(f"cannot start the NVML read of driver root {self.driver_root}: {exc}") from None
        out = done.stdout[:MAX_OUTPUT]
        if done.returncode != 0 or len(done.stdout) > MAX_OUTPUT:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise NvmlError(f"NVML read of driver root {self.driver_root} failed: {tail[0][:300]}")
        try:
            answer = decode(json.loads(out))
        except (ValueError, TypeError, KeyError) as exc:
            raise NvmlError(f"NVML read of driver root {self.driver_root} answered badly: {exc}") from None
        self._last = _Answer(answer[0], answer[1], self._clock())
        return self._last


# --- the answer on the wire (child -> parent) -------------------------------------------------------------


def _error(value: dict[str, Any]) -> HardwareError:
    kind = _ERRORS.get(str(value["error"]), NvmlError)
    message = str(value["message"])[:1000]
    code = value.get("code")
    if issubclass(kind, NvmlError):
        return kind(message, code if isinstance(code, int) else None)
    return kind(message)


def _info(value: dict[str, Any]) -> GpuFabricInfo:
    if not isinstance(value["clique_id"], int) or not isinstance(value["status_ok"], bool):
        raise ValueError("clique_id must be an integer and status_ok a boolean")
    return GpuFabricInfo(
        gpu=str(value["gpu"])[:200],
        state=FabricState(value["state"]),
        cluster_uuid=uuid.UUID(str(value["cluster_uuid"])),
        clique_id=value["clique_id"],
        status_ok=value["status_ok"],
        status_text=str(value["status_text"])[:1000],
    )


def decode(value: Any) -> tuple[DriverVersion | HardwareError, list[GpuFabricInfo] | HardwareError]:
    """The child's JSON answer; ValueError/TypeError/KeyError on anything else."""
    if not isinstance(value, dict):
        raise TypeError("the answer is not an object")
    version_part, gpus_part = value["driver_version"], value["gpus"]
    version: DriverVersion | HardwareError
    if isinstance(version_part, str):
        try:
            version = DriverVersion.parse(version_part[:100])
        except DriverVersionError as exc:
            version = exc
    else:
        version = _error(version_part)
    gpus: list[GpuFabricInfo] | HardwareError
    if isinstance(gpus_part, list):
        if len(gpus_part) > MAX_GPUS:
            raise ValueError(f"more than {MAX_GPUS} GPUs")
        gpus = [_info(item) for item in gpus_part]
    else:
        gpus = _error(gpus_part)
    return version, gpus


def _encode_error(exc: HardwareError) -> dict[str, Any]:
    kind = next((name for name, cls in _ERRORS.items() if type(exc) is cls), "NvmlError")
    return {"error": kind, "message": str(exc), "code": getattr(exc, "code", None)}


def main(argv: list[str]) -> int:
    """The child: one read of the driver root in argv[0], one JSON line on stdout."""
    from imex.nvml import NvmlFabricSource  # here only: the parent never imports pynvml

    source = NvmlFabricSource(Path(argv[0]))
    answer: dict[str, Any] = {}
    try:
        answer["driver_version"] = str(source.driver_version())
    except HardwareError as exc:
        answer["driver_version"] = _encode_error(exc)
    try:
        answer["gpus"] = [
            {
                "gpu": info.gpu,
                "state": str(info.state),
                "cluster_uuid": str(info.cluster_uuid),
                "clique_id": info.clique_id,
                "status_ok": info.status_ok,
                "status_text": info.status_text,
            }
            for info in source.gpu_fabric_infos()
        ]
    except HardwareError as exc:
        answer["gpus"] = _encode_error(exc)
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
