"""The NVML source against the mock ``libnvidia-ml.so.1`` in fake driver roots: loading from the driver
root, struct versions and fallbacks, error mapping, and the H200 / NVL72 facts end to end.

The library is real C behind the real pynvml (ctypes, struct layouts, return codes); only its answers are
made up (tests/testbed/fake_driver_root/mock_nvml.c says where it differs from NVIDIA's). The real library
runs in the gpu lane (tests/gpu).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from imex.discovery import (
    CliqueID,
    DriverVersion,
    FabricError,
    FabricInconsistentError,
    FabricNotReadyError,
    FabricState,
    NvmlError,
    NvmlUnavailableError,
    check_driver_for_dns_names,
    derive_clique_id,
)
from imex.nvml import NvmlFabricSource, nvml_discovery
from tests.testbed.fake_driver_root import (
    NVML_CONF,
    SimulatedNode,
    lib_dir,
    nvl72_topology,
    write_fake_driver_root,
    write_nvml_answers,
)
from tests.testbed.fake_driver_root.ldcache import render_ld_cache

CLUSTER = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")  # first byte 0: a C-string read would see ""


def tray(name: str = "tray", clique_id: int = 5, **extra: object) -> SimulatedNode:
    return SimulatedNode.model_validate(
        {"name": name, "clique": {"clusterUUID": str(CLUSTER), "cliqueId": clique_id}, **extra}
    )


def root_for(tmp_path: Path, node: SimulatedNode | None = None, name: str = "root") -> Path:
    return write_fake_driver_root(tmp_path / name, node, imex=False)


def append_answers(root: Path, text: str) -> None:
    with (root / lib_dir() / NVML_CONF).open("a") as f:
        f.write(text)


def test_h200_facts_end_to_end(tmp_path: Path) -> None:
    """SPEC section 6: what driver 580.159.04 on an H200 reports, through NVML and the /proc readers."""
    root = root_for(tmp_path)
    discovery = nvml_discovery(root, proc_root=root / "proc")
    assert discovery.driver_version() == DriverVersion(580, 159, 4)
    check_driver_for_dns_names(discovery.driver_version())
    (info,) = NvmlFabricSource(root).gpu_fabric_infos()
    assert (info.state, info.cluster_uuid, info.clique_id) == (FabricState.NOT_SUPPORTED, uuid.UUID(int=0), 0)
    assert info.gpu.startswith("0 (GPU-"), "GPUs are named by index and NVML UUID"
    assert discovery.clique_id(crash_on_fabric_errors=True) is None
    assert (discovery.imex_channel_major(), discovery.nvidia_caps_major(), discovery.imex_channel_count()) == (
        242,
        241,
        2048,
    )
    cap = discovery.fabric_imex_mgmt()
    assert cap is not None and cap.device_path == "/dev/nvidia-caps/nvidia-cap4323"


def test_nvl72_tray_and_non_fabric_node(tmp_path: Path) -> None:
    topology = nvl72_topology(racks=2, trays_per_rack=18, non_fabric_nodes=1)
    tray_root = root_for(tmp_path, topology.node("gb-r1-t17"), "tray")
    cpu_root = root_for(tmp_path, topology.node("cpu-0"), "cpu")
    tray_source = NvmlFabricSource(tray_root)
    assert len(tray_source.gpu_fabric_infos()) == 4
    assert derive_clique_id(tray_source.gpu_fabric_infos(), crash_on_fabric_errors=True) == CliqueID(
        "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.2"
    )
    cpu = nvml_discovery(cpu_root, proc_root=cpu_root / "proc")
    assert cpu.clique_id(crash_on_fabric_errors=True) is None


def test_cluster_uuid_is_read_as_raw_bytes(tmp_path: Path) -> None:
    infos = NvmlFabricSource(root_for(tmp_path, tray())).gpu_fabric_infos()
    assert {info.cluster_uuid for info in infos} == {CLUSTER}
    assert derive_clique_id(infos, crash_on_fabric_errors=True) == f"{CLUSTER}.5"


def test_a_registration_finishing_is_seen_by_the_next_call(tmp_path: Path) -> None:
    """Fabric Manager completes registration while the agent runs: every call is a fresh NVML session."""
    root = root_for(tmp_path, tray(fabricState="IN_PROGRESS"))
    source = NvmlFabricSource(root)
    infos = source.gpu_fabric_infos()
    assert {i.state for i in infos} == {FabricState.IN_PROGRESS}
    assert {i.cluster_uuid for i in infos} == {uuid.UUID(int=0)}, "no cluster UUID before registration completes"
    with pytest.raises(FabricNotReadyError, match=r"GPU 0 \(GPU-.*IN_PROGRESS"):
        derive_clique_id(infos, crash_on_fabric_errors=True)
    write_nvml_answers(root, tray())
    assert derive_clique_id(source.gpu_fabric_infos(), crash_on_fabric_errors=True) == f"{CLUSTER}.5"


def test_failed_registration_status_is_reported_with_nvml_text(tmp_path: Path) -> None:
    source = NvmlFabricSource(root_for(tmp_path, tray(fabricStatusOK=False)))
    info = source.gpu_fabric_infos()[0]
    assert not info.status_ok and info.status_text == "Unknown Error"
    with pytest.raises(FabricError, match=r"registration failed \(Unknown Error\)"):
        derive_clique_id(source.gpu_fabric_infos(), crash_on_fabric_errors=True)


@pytest.mark.parametrize("version", [3, 2, 1])
def test_older_drivers_fall_back_to_older_fabric_info_structs(tmp_path: Path, version: int) -> None:
    """v3 struct (580+), v2 (ARGUMENT_VERSION_MISMATCH for v3), or only the unversioned call."""
    source = NvmlFabricSource(root_for(tmp_path, tray(nvmlFabricInfoVersion=version)))
    assert derive_clique_id(source.gpu_fabric_infos(), crash_on_fabric_errors=True) == f"{CLUSTER}.5"


def test_nvml_not_supported_answer_means_no_fabric(tmp_path: Path) -> None:
    root = root_for(tmp_path, tray())
    append_answers(root, "fabric_supported = 0\n")
    infos = NvmlFabricSource(root).gpu_fabric_infos()
    assert {i.state for i in infos} == {FabricState.NOT_SUPPORTED}


def test_display_devices_are_skipped(tmp_path: Path) -> None:
    root = root_for(tmp_path, tray(gpuCount=2))
    append_answers(root, "gpu0.name = NVIDIA DGX Display\n")
    infos = NvmlFabricSource(root).gpu_fabric_infos()
    assert [info.gpu.split()[0] for info in infos] == ["1"]


def test_gpus_in_two_cliques_are_an_error(tmp_path: Path) -> None:
    root = root_for(tmp_path, tray(gpuCount=2))
    append_answers(root, "gpu1.clique_id = 6\n")
    with pytest.raises(FabricInconsistentError, match=rf"{CLUSTER}\.5 on GPU 0 .*{CLUSTER}\.6 on GPU 1"):
        derive_clique_id(NvmlFabricSource(root).gpu_fabric_infos(), crash_on_fabric_errors=True)


def test_two_driver_roots_in_one_process_answer_independently(tmp_path: Path) -> None:
    """One process serving several nodes (the simulated cluster's pod host) never mixes their libraries."""
    a = NvmlFabricSource(root_for(tmp_path, tray("a", 1, driverVersion="570.172.08"), "a"))
    b = NvmlFabricSource(root_for(tmp_path, tray("b", 2), "b"))
    for _ in range(2):
        assert str(a.driver_version()) == "570.172.08" and str(b.driver_version()) == "580.159.04"
        assert derive_clique_id(a.gpu_fabric_infos(), crash_on_fabric_errors=True) == f"{CLUSTER}.1"
        assert derive_clique_id(b.gpu_fabric_infos(), crash_on_fabric_errors=True) == f"{CLUSTER}.2"


def test_missing_library_names_the_driver_root_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "empty" / "etc").mkdir(parents=True)
    with pytest.raises(NvmlUnavailableError) as info:
        NvmlFabricSource(tmp_path / "empty").driver_version()
    message = str(info.value)
    assert f"libnvidia-ml.so.1 not found under driver root {tmp_path / 'empty'}" in message
    assert "/usr/lib64" in message and "nvidiaDriverRoot" in message and "\n" not in message


def test_no_kernel_driver_is_unavailable_with_the_library_path(tmp_path: Path) -> None:
    """The mock without its answers behaves like the real library without nvidia.ko: Driver Not Loaded."""
    root = root_for(tmp_path)
    (root / lib_dir() / NVML_CONF).unlink()
    source = NvmlFabricSource(root)
    with pytest.raises(NvmlUnavailableError, match=r"NVML \(.*libnvidia-ml.so.580.159.04\) unavailable during init: "):
        source.driver_version()
    with pytest.raises(NvmlUnavailableError, match="Driver Not Loaded: is the NVIDIA kernel driver loaded"):
        source.driver_version()


def test_other_nvml_errors_are_mapped(tmp_path: Path) -> None:
    root = root_for(tmp_path)
    append_answers(root, "no_such_key = 1\n")
    with pytest.raises(NvmlError, match=r"NVML init failed: Unknown Error \(code 999\)") as info:
        NvmlFabricSource(root).driver_version()
    assert info.value.code == 999 and not isinstance(info.value, NvmlUnavailableError)


def test_library_found_through_the_ld_cache_in_a_non_standard_directory(tmp_path: Path) -> None:
    root = root_for(tmp_path, tray())
    moved = root / "opt/nvidia/lib"
    shutil.move(root / lib_dir(), moved)
    source = NvmlFabricSource(root)
    with pytest.raises(NvmlUnavailableError, match="not found"):
        source.library()
    (root / "etc/ld.so.cache").write_bytes(
        render_ld_cache([("libnvidia-ml.so.1", "/opt/nvidia/lib/libnvidia-ml.so.1")])
    )
    assert NvmlFabricSource(root).library() == moved / "libnvidia-ml.so.580.159.04"
    assert derive_clique_id(NvmlFabricSource(root).gpu_fabric_infos(), crash_on_fabric_errors=True) == f"{CLUSTER}.5"


def test_library_found_in_standard_directories_without_an_ld_cache(tmp_path: Path) -> None:
    root = root_for(tmp_path)
    (root / "etc/ld.so.cache").unlink()
    assert NvmlFabricSource(root).library() == root / lib_dir() / "libnvidia-ml.so.580.159.04"


def test_absolute_links_resolve_inside_the_driver_root(tmp_path: Path) -> None:
    """/run/nvidia/driver/usr/lib/.../libnvidia-ml.so.1 -> /usr/lib/... means the driver root's file."""
    root = root_for(tmp_path)
    link = root / lib_dir() / "libnvidia-ml.so.1"
    link.unlink()
    link.symlink_to(f"/{lib_dir()}/libnvidia-ml.so.580.159.04")
    assert NvmlFabricSource(root).library() == root / lib_dir() / "libnvidia-ml.so.580.159.04"
    assert str(NvmlFabricSource(root).driver_version()) == "580.159.04"
