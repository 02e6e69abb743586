"""The base CDI spec for IMEX daemon containers, built from fake driver roots."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import yaml

from computedomain.plugin import cdi
from computedomain.plugin.cdi_base import (
    BASE_SPEC_FILE,
    BaseSpecError,
    base_edits,
    device_nodes,
    write_base_spec,
)
from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, lib_dir, write_fake_driver_root

VERSION = "570.172.08"
HOST = "/run/nvidia/driver"


def fabric_root(path: Path, *, imex: bool = True) -> Path:
    clique = SimulatedClique(cluster_uuid=uuid.uuid4(), clique_id=1)
    return write_fake_driver_root(path, SimulatedNode(name="n", driver_version=VERSION, clique=clique), imex=imex)


def dev_dir(path: Path, names: list[str]) -> Path:
    """Device nodes stand-in: links to /dev/null (a character device, 1:3) under the given names."""
    path.mkdir()
    for name in names:
        (path / name).symlink_to("/dev/null")
    return path


def test_daemon_gets_imex_binaries_libraries_devices_and_void(tmp_path: Path) -> None:
    root = fabric_root(tmp_path / "driver-root")
    devs = dev_dir(
        tmp_path / "dev", ["nvidia10", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "nvidia-caps"]
    )
    edits = base_edits(
        driver_root=root, host_driver_root=HOST, driver_version=VERSION, require_imex=True, dev_root=devs
    )
    mounts = {m.container_path: m for m in edits.mounts}
    assert mounts["/usr/bin/nvidia-imex"].host_path == f"{HOST}/usr/bin/nvidia-imex"
    assert mounts["/usr/bin/nvidia-imex-ctl"].host_path == f"{HOST}/usr/bin/nvidia-imex-ctl"
    libs = f"/{lib_dir()}"
    # The link keeps its name; the host path is the file behind it, as the host sees it.
    assert mounts[f"{libs}/libnvidia-ml.so.1"].host_path == f"{HOST}{libs}/libnvidia-ml.so.{VERSION}"
    assert mounts[f"{libs}/libnvidia-ml.so.{VERSION}"].host_path == f"{HOST}{libs}/libnvidia-ml.so.{VERSION}"
    assert len(mounts) == 4
    assert all(m.options == ("ro", "nosuid", "nodev", "bind") for m in edits.mounts)
    assert edits.env == ("NVIDIA_VISIBLE_DEVICES=void",)
    null = Path("/dev/null").stat()
    assert [(d.path, d.major, d.minor) for d in edits.device_nodes] == [
        (f"/dev/{name}", os.major(null.st_rdev), os.minor(null.st_rdev))
        for name in ("nvidia2", "nvidia10", "nvidia-uvm", "nvidiactl")
    ]


def test_host_path_is_the_root_itself_for_a_host_installed_driver(tmp_path: Path) -> None:
    root = fabric_root(tmp_path / "r")
    edits = base_edits(driver_root=root, host_driver_root="/", driver_version=VERSION, require_imex=True, dev_root=root)
    assert "/usr/bin/nvidia-imex" in {m.host_path for m in edits.mounts}


def test_missing_imex_on_a_fabric_node_is_a_startup_error_naming_the_paths(tmp_path: Path) -> None:
    root = fabric_root(tmp_path / "driver-root", imex=False)
    with pytest.raises(BaseSpecError) as info:
        base_edits(driver_root=root, host_driver_root=HOST, driver_version=VERSION, require_imex=True, dev_root=root)
    message = str(info.value)
    assert message.startswith(f"nvidia-imex not found under driver root {HOST} (in this container {root}; ")
    assert "/usr/bin" in message and "nvidiaDriverRoot" in message and "\n" not in message


def test_without_a_clique_the_binaries_are_optional(tmp_path: Path) -> None:
    root = fabric_root(tmp_path / "driver-root", imex=False)
    edits = base_edits(
        driver_root=root, host_driver_root=HOST, driver_version=VERSION, require_imex=False, dev_root=root
    )
    assert not any(m.container_path.startswith("/usr/bin/") for m in edits.mounts)
    assert edits.mounts, "the driver's libraries are still there"


def test_device_nodes_from_the_driver_root_when_it_has_them(tmp_path: Path) -> None:
    root = fabric_root(tmp_path / "driver-root")
    (root / "dev/nvidiactl").symlink_to("/dev/null")
    edits = base_edits(driver_root=root, host_driver_root=HOST, driver_version=VERSION, require_imex=True)
    assert [d.path for d in edits.device_nodes] == ["/dev/nvidiactl"]
    assert device_nodes(tmp_path / "missing") == ()


def test_spec_file_is_the_references_and_defines_device_all(tmp_path: Path) -> None:
    root = fabric_root(tmp_path / "driver-root")
    edits = base_edits(
        driver_root=root, host_driver_root=HOST, driver_version=VERSION, require_imex=True, dev_root=root
    )
    cdi_root = tmp_path / "cdi"
    cdi_root.mkdir()
    path = write_base_spec(cdi_root, edits)
    assert path == cdi_root / "k8s.compute-domain.nvidia.com-device_base.yaml" == cdi_root / BASE_SPEC_FILE
    spec = yaml.safe_load(path.read_text())
    assert spec["kind"] == cdi.BASE_DEVICE_ID.partition("=")[0] and spec["cdiVersion"] == cdi.CDI_VERSION
    (device,) = spec["devices"]
    assert device["name"] == cdi.BASE_DEVICE_ID.partition("=")[2]
    assert device["containerEdits"] == edits.to_cdi()
    write_base_spec(cdi_root, edits)
    assert [p.name for p in cdi_root.iterdir()] == [BASE_SPEC_FILE], "replaced in place, no temp files left"
    assert cdi.CdiSpecDir(cdi_root).list_claims() == {}, "claim cleanup never touches the base spec"
