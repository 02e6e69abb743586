"""The NVML fabric source: driver version and per-GPU fabric info from ``libnvidia-ml`` via ``pynvml``.

This module owns every use of ``pynvml`` in the project (import-linter enforces it). It imports the
binding only when a method runs, so importing ``imex.nvml`` works on machines without the NVIDIA library
and only a call fails, with ``NvmlUnavailableError``.

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
import importlib
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
from imex.procfs import ProcFS

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


def _load_pynvml() -> ModuleType:
    """The binding, imported on first use. Tests replace this function to inject a fake module."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:  # pragma: no cover - the package is a pinned dependency
        raise NvmlUnavailableError(f"python package nvidia-ml-py is not installed: {exc}") from None


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _wrap(what: str, exc: BaseException) -> NvmlError:
    code = _error_code(exc)
    if code in (_NVML_ERROR_LIBRARY_NOT_FOUND, _NVML_ERROR_DRIVER_NOT_LOADED):
        return NvmlUnavailableError(f"NVML unavailable during {what}: {exc} (is the NVIDIA driver installed?)", code)
    return NvmlError(f"NVML {what} failed: {exc} (code {code})", code)


def _as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlFabricSource:
    """``imex.discovery.FabricSource`` backed by the real NVML library."""

    def __init__(self, loader: Any = None) -> None:
        self._loader = loader or _load_pynvml

    @contextmanager
    def _session(self) -> Iterator[ModuleType]:
        nvml = self._loader()
        with _lock:
            try:
                nvml.nvmlInitWithFlags(nvml.NVML_INIT_FLAG_NO_GPUS)
            except nvml.NVMLError as exc:
                raise _wrap("init", exc) from None
            try:
                yield nvml
            except nvml.NVMLError as exc:
                raise _wrap("query", exc) from None
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
                infos.append(self._fabric_info(nvml, handle, f"{index}"))
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
                raise _wrap(f"fabric info of GPU {gpu}", exc) from None
            return self._decode(nvml, info, gpu)
        raise _wrap(f"fabric info of GPU {gpu}", last or RuntimeError("no fabric-info function"))

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


def nvml_discovery(root: Path = Path("/"), *, devices_path: Path | None = None) -> Discovery:
    """The production ``HardwareDiscovery``: NVML for fabric facts, ``/proc`` under ``root`` for the rest."""
    return Discovery(NvmlFabricSource(), ProcFS(root, devices_path=devices_path))
