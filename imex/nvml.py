"""The NVML fabric source: driver version and per-GPU fabric info from the driver root's ``libnvidia-ml``.

This module owns every use of ``pynvml`` in the project (import-linter enforces it) and where the library
comes from: ``libnvidia-ml.so.1`` under the driver root the process is given (``imex.driver_root``: the
root's ld cache, then the standard library directories), never the process' own library search path. So
the same code reads a host-installed driver (root ``/``), a GPU Operator driver container
(``/run/nvidia/driver``, mounted into the node agent's pod) and a test node's fake driver root.

pynvml keeps the loaded library in module globals; each library path gets a module instance of its own
(loaded from pynvml's source once per path), so one process can serve several driver roots without
mixing their answers. Importing ``imex.nvml`` needs neither the binding nor the library; a call without
them fails with ``NvmlUnavailableError`` naming the path.

Each call is a short NVML session: init with NO_GPUS (so a node with zero visible GPUs still answers the
driver version), query, shutdown. NVML keeps a process-wide reference count, so sessions nest safely with
other users of the library; a lock keeps our own init/query/shutdown sequences from interleaving.
Calls block for milliseconds; async callers use ``asyncio.to_thread``.

Fabric info is read with the versioned ``nvmlDeviceGetGpuFabricInfoV`` (v3 struct, falling back to v2 and
then to the deprecated unversioned call on drivers that lack it). NVML's NOT_SUPPORTED answer means "no
fabric on this GPU", exactly like fabric state NOT_SUPPORTED. The cluster UUID is taken as 16 raw bytes:
reading the ctypes array as a C string would stop at the first zero byte.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from imex.discovery import (
    Discovery,
    DriverVersion,
    FabricState,
    GpuFabricInfo,
    NvmlError,
    NvmlUnavailableError,
)
from imex.driver_root import DriverRootError, find_library
from imex.procfs import ProcFS

NVML_SONAME = "libnvidia-ml.so.1"

# go-nvlib skips these display-only devices on DGX stations; they have no fabric and must not vote.
_SKIPPED_DEVICE_NAMES = frozenset({"DGX Display", "NVIDIA DGX Display"})

# NVML return codes we treat specially (values are part of the stable NVML ABI).
_NVML_SUCCESS = 0
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

_lock = threading.Lock()
_bindings: dict[Path, ModuleType] = {}


def _binding(library: Path) -> ModuleType:
    """A pynvml module instance whose library is ``library`` (one instance per path, created once)."""
    with _lock:
        module = _bindings.get(library)
        if module is not None:
            return module
        found = importlib.util.find_spec("pynvml")
        if found is None or found.origin is None:  # pragma: no cover - the package is a pinned dependency
            raise NvmlUnavailableError("python package nvidia-ml-py is not installed")
        # A module of its own name per library; pynvml looks itself up in sys.modules while it loads.
        name = f"_pynvml_{len(_bindings)}"
        spec = importlib.util.spec_from_file_location(name, found.origin)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        try:
            # pynvml loads its library only while nvmlLib is None; setting it picks the file.
            module.nvmlLib = ctypes.CDLL(str(library))  # type: ignore[attr-defined]
        except OSError as exc:
            raise NvmlUnavailableError(f"cannot load NVML library {library}: {exc}") from None
        _bindings[library] = module
        return module


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _wrap(what: str, exc: BaseException, library: Path) -> NvmlError:
    code = _error_code(exc)
    if code in (_NVML_ERROR_LIBRARY_NOT_FOUND, _NVML_ERROR_DRIVER_NOT_LOADED):
        return NvmlUnavailableError(
            f"NVML ({library}) unavailable during {what}: {exc}: is the NVIDIA kernel driver loaded on this node?",
            code,
        )
    return NvmlError(f"NVML {what} failed: {exc} (code {code})", code)


def _as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlFabricSource:
    """``imex.discovery.FabricSource`` backed by the NVIDIA driver's NVML library in ``driver_root``."""

    def __init__(self, driver_root: Path = Path("/")) -> None:
        self.driver_root = driver_root
        self._library: Path | None = None

    def library(self) -> Path:
        """The library file this source loads (found on first use; ``NvmlUnavailableError`` if missing)."""
        if self._library is None:
            try:
                self._library = find_library(self.driver_root, NVML_SONAME).file
            except DriverRootError as exc:
                raise NvmlUnavailableError(str(exc)) from None
        return self._library

    @contextmanager
    def _session(self) -> Iterator[ModuleType]:
        library = self.library()
        nvml = _binding(library)
        with _lock:
            try:
                nvml.nvmlInitWithFlags(nvml.NVML_INIT_FLAG_NO_GPUS)
            except nvml.NVMLError as exc:
                raise _wrap("init", exc, library) from None
            try:
                yield nvml
            except nvml.NVMLError as exc:
                raise _wrap("query", exc, library) from None
            finally:
                # The answer is already in hand; a failed shutdown only leaks a reference count.
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlShutdown()

    def driver_version(self) -> DriverVersion:
        with self._session() as nvml:
            return DriverVersion.parse(_as_text(nvml.nvmlSystemGetDriverVersion()))

    def gpu_fabric_infos(self) -> list[GpuFabricInfo]:
        with self._session() as nvml:
            infos = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                if _as_text(nvml.nvmlDeviceGetName(handle)) in _SKIPPED_DEVICE_NAMES:
                    continue
                gpu = f"{index} ({_as_text(nvml.nvmlDeviceGetUUID(handle))})"
                infos.append(self._fabric_info(nvml, handle, gpu))
            return infos

    def _fabric_info(self, nvml: ModuleType, handle: Any, gpu: str) -> GpuFabricInfo:
        attempts: list[tuple[str, Any]] = []
        if hasattr(nvml, "c_nvmlGpuFabricInfo_v3_t"):
            attempts.append(("nvmlDeviceGetGpuFabricInfoV", nvml.c_nvmlGpuFabricInfo_v3_t))
        if hasattr(nvml, "c_nvmlGpuFabricInfo_v2_t"):
            attempts.append(("nvmlDeviceGetGpuFabricInfoV", nvml.c_nvmlGpuFabricInfo_v2_t))
        attempts.append(("nvmlDeviceGetGpuFabricInfo", nvml.c_nvmlGpuFabricInfo_t))
        last: BaseException | None = None
        for function, struct_type in attempts:
            info = struct_type()
            try:
                getattr(nvml, function)(handle, ctypes.byref(info))
            except nvml.NVMLError as exc:
                code = _error_code(exc)
                if code == _NVML_ERROR_NOT_SUPPORTED:
                    return GpuFabricInfo.not_supported(gpu)
                if code in (_NVML_ERROR_FUNCTION_NOT_FOUND, _NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                    # An older driver: try the next older struct version.
                    last = exc
                    continue
                raise _wrap(f"fabric info of GPU {gpu}", exc, self.library()) from None
            return self._decode(nvml, info, gpu)
        raise _wrap(f"fabric info of GPU {gpu}", last or RuntimeError("no fabric-info function"), self.library())

    @staticmethod
    def _decode(nvml: ModuleType, info: Any, gpu: str) -> GpuFabricInfo:
        status = int(info.status)
        status_text = ""
        if status != _NVML_SUCCESS:
            try:
                status_text = _as_text(nvml.nvmlErrorString(status))
            except Exception:  # the string is only decoration for the error message
                status_text = f"NVML status {status}"
        return GpuFabricInfo(
            gpu=gpu,
            state=FabricState.from_nvml(int(info.state)),
            cluster_uuid=uuid.UUID(bytes=bytes(info.clusterUuid)),
            clique_id=int(info.cliqueId),
            status_ok=status == _NVML_SUCCESS,
            status_text=status_text,
        )


def nvml_discovery(driver_root: Path = Path("/"), *, proc_root: Path = Path("/proc")) -> Discovery:
    """The production ``HardwareDiscovery``: NVML from ``driver_root``, the driver's ``/proc`` files from
    ``proc_root`` (the host's ``/proc``: not namespaced for these files, so a container's own works)."""
    return Discovery(NvmlFabricSource(driver_root), ProcFS(proc_root.parent, devices_path=proc_root / "devices"))
