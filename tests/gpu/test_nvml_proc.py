"""Hardware lane: the real NVML and /proc code on a real NVIDIA GPU (SPEC section 6 records an H200).

Skips, with the reason, when there is no NVIDIA driver/GPU. Values that differ between GPU models (fabric
state on GB200, majors on another kernel) are checked for shape; the SPEC's H200 values are asserted
when the GPU is an H200 on a non-fabric host.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from imex.discovery import (
    DriverVersion,
    FabricState,
    NvmlUnavailableError,
    check_driver_for_dns_names,
    derive_clique_id,
    imex_channel_path,
)
from imex.nvml import NvmlFabricSource, nvml_discovery
from imex.procfs import ProcFS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvml() -> NvmlFabricSource:
    source = NvmlFabricSource()
    try:
        source.driver_version()
    except NvmlUnavailableError as exc:
        pytest.skip(f"no NVIDIA driver/NVML on this machine: {exc}")
    if not Path("/proc/driver/nvidia/params").exists():
        pytest.skip("no /proc/driver/nvidia: the NVIDIA kernel module is not loaded")
    return source


def _gpu_names() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def test_driver_version_parsed(nvml: NvmlFabricSource) -> None:
    version = nvml.driver_version()
    print(f"driver version {version}")
    assert version.major >= 500
    assert str(version).count(".") in (1, 2)
    # The version NVML reports is the one the kernel module reports.
    text = Path("/proc/driver/nvidia/version").read_text()
    assert str(version) in text
    if version >= DriverVersion.parse("570.158.01"):
        check_driver_for_dns_names(version)


def test_fabric_info_and_clique(nvml: NvmlFabricSource) -> None:
    infos = nvml.gpu_fabric_infos()
    print("fabric info:", infos)
    assert infos, "NVML lists no GPU"
    clique = derive_clique_id(infos, crash_on_fabric_errors=True)
    print(f"clique {clique!r}")
    if all(info.state is FabricState.NOT_SUPPORTED for info in infos):
        # SPEC section 6 (H200, driver 580.159.04): state 0, all-zero cluster UUID, clique 0 -> no clique.
        assert clique is None
        assert all(info.cluster_uuid.int == 0 and info.clique_id == 0 for info in infos)
    else:
        assert clique is None or clique.count(".") == 1


def test_proc_devices_majors_and_channel_count(nvml: NvmlFabricSource) -> None:
    proc = ProcFS()
    channels = proc.imex_channel_major()
    caps = proc.nvidia_caps_major()
    count = proc.imex_channel_count()
    params = proc.params()
    cap = proc.fabric_imex_mgmt()
    print(f"majors: channels {channels}, caps {caps}; ImexChannelCount {count}; params {params}; cap {cap}")
    assert 0 < channels < 4096 and 0 < caps < 4096 and channels != caps
    assert count == 2048  # the driver default, and what SPEC section 6 records
    assert params.create_imex_channel0 is False
    assert cap is not None and cap.device_path.startswith("/dev/nvidia-caps/nvidia-cap")
    if all("H200" in name for name in _gpu_names()):
        assert (channels, caps) == (242, 241)
        assert cap.minor == 4323


def test_discovery_composes_the_same_answers(nvml: NvmlFabricSource) -> None:
    discovery = nvml_discovery()
    assert discovery.driver_version() == nvml.driver_version()
    assert discovery.imex_channel_major() == ProcFS().imex_channel_major()


def test_channel_node_can_be_created_with_mknod(nvml: NvmlFabricSource, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    major = ProcFS().imex_channel_major()
    node = tmp_path / Path(imex_channel_path(0)).name
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, 0))
    info = node.stat()
    assert stat.S_ISCHR(info.st_mode)
    assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (major, 0)
