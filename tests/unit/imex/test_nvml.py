"""The NVML source against a fake ``pynvml`` module: struct decoding, fallbacks, error mapping."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import types
import uuid
from typing import Any

import pytest

from imex.discovery import DriverVersion, FabricState, NvmlError, NvmlUnavailableError, derive_clique_id
from imex.nvml import NvmlFabricSource

CLUSTER = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")  # first byte 0: a C-string read would see ""


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(
    gpus: list[dict[str, Any]], *, init_error: int | None = None, v_missing: bool = False
) -> tuple[types.SimpleNamespace, list[str]]:
    import pynvml  # the real structs; only the functions are faked

    calls: list[str] = []

    def init(flags: int) -> None:
        calls.append(f"init:{flags}")
        if init_error is not None:
            raise FakeNVMLError(init_error)

    def fill(handle: int, ref: Any, function: str) -> None:
        calls.append(function)
        spec = gpus[handle]
        if "error" in spec:
            raise FakeNVMLError(spec["error"])
        info = ref._obj
        info.state = spec.get("state", 3)
        info.status = spec.get("status", 0)
        info.cliqueId = spec.get("clique", 0)
        raw = spec.get("uuid", uuid.UUID(int=0)).bytes
        ctypes.memmove(ctypes.addressof(info.clusterUuid), raw, 16)

    def info_v(handle: int, ref: Any) -> None:
        if v_missing:
            calls.append("V-missing")
            raise FakeNVMLError(13)
        fill(handle, ref, f"V:{type(ref._obj).__name__}")

    module = types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        NVML_INIT_FLAG_NO_GPUS=1,
        nvmlInitWithFlags=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: "580.159.04",
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: gpus[handle].get("name", "NVIDIA GB200"),
        nvmlDeviceGetGpuFabricInfoV=info_v,
        nvmlDeviceGetGpuFabricInfo=lambda handle, ref: fill(handle, ref, "legacy"),
        nvmlErrorString=lambda code: f"error string {code}",
        c_nvmlGpuFabricInfo_v3_t=pynvml.c_nvmlGpuFabricInfo_v3_t,
        c_nvmlGpuFabricInfo_v2_t=pynvml.c_nvmlGpuFabricInfo_v2_t,
        c_nvmlGpuFabricInfo_t=pynvml.c_nvmlGpuFabricInfo_t,
    )
    return module, calls


def source(module: types.SimpleNamespace) -> NvmlFabricSource:
    return NvmlFabricSource(loader=lambda: module)


def test_driver_version_and_session_lifecycle() -> None:
    module, calls = fake_pynvml([])
    assert source(module).driver_version() == DriverVersion(580, 159, 4)
    assert calls == ["init:1", "shutdown"]


def test_h200_fabric_info_not_supported_state() -> None:
    module, calls = fake_pynvml([{"state": 0, "clique": 0}])
    infos = source(module).gpu_fabric_infos()
    assert [info.state for info in infos] == [FabricState.NOT_SUPPORTED]
    assert infos[0].cluster_uuid == uuid.UUID(int=0)
    assert derive_clique_id(infos, crash_on_fabric_errors=True) is None
    assert calls == ["init:1", "V:c_nvmlGpuFabricInfo_v3_t", "shutdown"]


def test_completed_fabric_uuid_read_as_raw_bytes() -> None:
    module, _ = fake_pynvml([{"uuid": CLUSTER, "clique": 5}, {"uuid": CLUSTER, "clique": 5}])
    infos = source(module).gpu_fabric_infos()
    assert derive_clique_id(infos, crash_on_fabric_errors=True) == f"{CLUSTER}.5"


def test_nvml_not_supported_return_means_no_fabric() -> None:
    module, _ = fake_pynvml([{"error": 3}])
    infos = source(module).gpu_fabric_infos()
    assert infos[0].state is FabricState.NOT_SUPPORTED


def test_failed_registration_status_is_reported() -> None:
    module, _ = fake_pynvml([{"uuid": CLUSTER, "clique": 1, "status": 999}])
    (info,) = source(module).gpu_fabric_infos()
    assert not info.status_ok
    assert info.status_text == "error string 999"


def test_display_devices_are_skipped() -> None:
    module, _ = fake_pynvml([{"name": "NVIDIA DGX Display", "error": 999}, {"uuid": CLUSTER, "clique": 2}])
    infos = source(module).gpu_fabric_infos()
    assert [info.gpu for info in infos] == ["1"]


def test_falls_back_to_legacy_call_on_old_driver() -> None:
    module, calls = fake_pynvml([{"uuid": CLUSTER, "clique": 2}], v_missing=True)
    (info,) = source(module).gpu_fabric_infos()
    assert info.clique_id == 2
    assert calls == ["init:1", "V-missing", "V-missing", "legacy", "shutdown"]


def test_other_nvml_errors_are_mapped_and_shutdown_still_runs() -> None:
    module, calls = fake_pynvml([{"error": 15}])
    with pytest.raises(NvmlError, match=r"fabric info of GPU 0 failed: .*code 15") as info:
        source(module).gpu_fabric_infos()
    assert info.value.code == 15
    assert calls[-1] == "shutdown"


@pytest.mark.parametrize("code", [9, 12])
def test_missing_library_or_driver_is_unavailable(code: int) -> None:
    module, _ = fake_pynvml([], init_error=code)
    with pytest.raises(NvmlUnavailableError, match="is the NVIDIA driver installed"):
        source(module).driver_version()


def test_import_works_without_the_library_and_a_call_fails_clearly() -> None:
    """Runs in a child whose loader cannot find libnvidia-ml (this machine may or may not have it)."""
    code = (
        "import ctypes, sys\n"
        "real = ctypes.CDLL\n"
        "def fake(name, *a, **k):\n"
        "    if 'nvidia-ml' in str(name): raise OSError('not here')\n"
        "    return real(name, *a, **k)\n"
        "ctypes.CDLL = fake\n"
        "import imex.nvml\n"
        "from imex.discovery import NvmlUnavailableError\n"
        "try:\n"
        "    imex.nvml.NvmlFabricSource().driver_version()\n"
        "except NvmlUnavailableError as exc:\n"
        "    print('UNAVAILABLE', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("UNAVAILABLE NVML unavailable during init"), out.stdout + out.stderr
