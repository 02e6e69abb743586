"""Hardware lane: the driver root of a real NVIDIA host ("/"), as the node agent reads it.

What the fake driver roots of the test bed imitate: ``libnvidia-ml.so.1`` found through the host's ld
cache, the installed version's driver libraries, the device nodes, and the base CDI spec built from them.
Skips, with the reason, without an NVIDIA driver.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from computedomain.plugin.cdi_base import base_edits
from imex.discovery import NvmlUnavailableError
from imex.driver_root import driver_libraries, find_library, read_ld_cache
from imex.nvml import NvmlFabricSource

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def version() -> str:
    try:
        return str(NvmlFabricSource(Path("/")).driver_version())
    except NvmlUnavailableError as exc:
        pytest.skip(f"no NVIDIA driver/NVML on this machine: {exc}")


def test_nvml_comes_from_the_hosts_ld_cache(version: str) -> None:
    library = find_library(Path("/"), "libnvidia-ml.so.1")
    print(f"libnvidia-ml.so.1: {library.path} -> {library.file}")
    assert any(e.name == "libnvidia-ml.so.1" and e.path == str(library.path) for e in read_ld_cache(Path("/")))
    assert library.file.name.endswith(f".so.{version}")
    assert NvmlFabricSource(Path("/")).library() == library.file


def test_driver_libraries_and_base_spec(version: str) -> None:
    libraries = driver_libraries(Path("/"), version)
    print("\n".join(f"{lib.path} -> {lib.file}" for lib in libraries))
    names = {lib.path.name for lib in libraries}
    assert {"libnvidia-ml.so.1", f"libnvidia-ml.so.{version}"} <= names
    edits = base_edits(driver_root=Path("/"), host_driver_root="/", driver_version=version, require_imex=False)
    nodes = {node.path: (node.major, node.minor) for node in edits.device_nodes}
    print(f"device nodes {nodes}, {len(edits.mounts)} mounts")
    assert "/dev/nvidiactl" in nodes and "/dev/nvidia0" in nodes
    assert nodes["/dev/nvidiactl"][0] == nodes["/dev/nvidia0"][0] == 195
    assert edits.env == ("NVIDIA_VISIBLE_DEVICES=void",)
