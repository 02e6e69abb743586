"""A fake NVIDIA driver root: what a GB200/H200 node's driver gives the service, for machines without one.

The service reads hardware only through its driver root (``NVIDIA_DRIVER_ROOT``, seen at
``CONTAINER_DRIVER_ROOT``) and ``PROC_ROOT``, exactly as on a real node, so a test node differs from a
GB200 node only in the files this package writes. Layout inside the root (``<triplet>``: this machine's,
e.g. ``x86_64-linux-gnu``):

- ``proc/devices``, ``proc/driver/nvidia/params``, ``proc/driver/nvidia/capabilities/fabric-imex-mgmt``:
  the driver's ``/proc`` files, by default those of the real H200 in SPEC section 6 (point ``PROC_ROOT``
  at ``<root>/proc``; on a real node ``/proc`` is the host's, not the driver root's);
- ``dev/``: empty (device nodes cannot be faked without root; the service needs none to start);
- ``usr/lib/<triplet>/libnvidia-ml.so.<driver version>`` with the link ``libnvidia-ml.so.1``: the mock NVML
  (``mock_nvml.c``), a copy per root so that one process can load several roots' libraries side by side;
- ``usr/lib/<triplet>/nvml-mock.conf``: what that library answers, from the node's topology entry;
  ``write_nvml_answers`` rewrites it (atomically) while the service runs, as Fabric Manager would change
  a GPU's registration;
- ``etc/ld.so.cache``: lists ``libnvidia-ml.so.1``, as a GPU Operator driver container's cache does;
- ``usr/bin/nvidia-imex``, ``usr/bin/nvidia-imex-ctl``: the IMEX simulator (``tests.testbed.imex_simulator``),
  which the node agent's base CDI spec hands to the IMEX daemon containers: ``nvidia-imex`` as a zip
  application, ``nvidia-imex-ctl`` native for the two queries the service runs (``build.native_imex_ctl``),
  with the simulator's ctl beside it as ``nvidia-imex-ctl.sim`` for every other command line.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Final

from imex.discovery import DEFAULT_IMEX_CHANNEL_COUNT, FabricState
from imex.driver_root import machine_triplet
from imex.procfs import (
    FABRIC_IMEX_MGMT,
    IMEX_CHANNELS_DEVICE,
    NVIDIA_CAPS_DEVICE,
    PROC_CAPABILITIES,
    PROC_DEVICES,
    PROC_PARAMS,
)
from tests.testbed.fake_driver_root.build import SIMULATED_CTL, imex_simulator_apps, mock_nvml_library, native_imex_ctl
from tests.testbed.fake_driver_root.ldcache import render_ld_cache
from tests.testbed.fake_driver_root.topology import (
    DEFAULT_DRIVER_VERSION,
    SimulatedClique,
    SimulatedNode,
    Topology,
    TopologyError,
    load_topology,
    nvl72_topology,
    parse_topology,
    topology_from_dicts,
)

# What a real H200 node with driver 580.159.04 reports (SPEC section 6); fake roots default to it.
REAL_IMEX_CHANNELS_MAJOR: Final = 242
REAL_NVIDIA_CAPS_MAJOR: Final = 241
REAL_FABRIC_IMEX_MGMT_MINOR: Final = 4323
NVML_CONF: Final = "nvml-mock.conf"
_FABRIC_STATE_NUMBER: Final = {
    FabricState.NOT_SUPPORTED: 0,
    FabricState.NOT_STARTED: 1,
    FabricState.IN_PROGRESS: 2,
    FabricState.COMPLETED: 3,
}
_NVML_ERROR_UNKNOWN: Final = 999
_GPU_UUIDS: Final = uuid.UUID("0c3b1ad5-6a53-4d57-8f0e-6b4f3f1b2a90")


def lib_dir() -> str:
    """Where the fake root keeps its libraries, relative to the root."""
    return f"usr/lib/{machine_triplet()}"


def write_proc_files(
    root: Path,
    *,
    channels_major: int | None = REAL_IMEX_CHANNELS_MAJOR,
    caps_major: int | None = REAL_NVIDIA_CAPS_MAJOR,
    imex_channel_count: int | None = DEFAULT_IMEX_CHANNEL_COUNT,
    create_imex_channel0: bool = False,
    fabric_imex_mgmt_minor: int | None = REAL_FABRIC_IMEX_MGMT_MINOR,
) -> Path:
    """Lay out the driver's ``/proc`` files (and an empty ``dev/``) under ``root``; returns ``root``.

    Defaults reproduce the real H200 of SPEC section 6. ``None`` leaves a piece out (no channels major:
    a driver without IMEX; no channel count: a driver predating the parameter; no capability: non-fabric).
    """
    (root / "dev").mkdir(parents=True, exist_ok=True)
    char_devices = [(1, "mem"), (4, "tty"), (5, "/dev/tty"), (10, "misc"), (195, "nvidia-frontend")]
    if caps_major is not None:
        char_devices.append((caps_major, NVIDIA_CAPS_DEVICE))
    if channels_major is not None:
        char_devices.append((channels_major, IMEX_CHANNELS_DEVICE))
    char_devices.sort()
    devices = "Character devices:\n"
    devices += "".join(f"{major:3d} {name}\n" for major, name in char_devices)
    devices += "\nBlock devices:\n  7 loop\n  8 sd\n259 blkext\n"
    _write(root / PROC_DEVICES, devices)

    params = ["ResmanDebugLevel: 4294967295", "ModifyDeviceFiles: 1", 'RegistryDwords: ""']
    if imex_channel_count is not None:
        params.append(f"ImexChannelCount: {imex_channel_count}")
        params.append(f"CreateImexChannel0: {int(create_imex_channel0)}")
    _write(root / PROC_PARAMS, "\n".join(params) + "\n")

    capability = root / PROC_CAPABILITIES / FABRIC_IMEX_MGMT
    if fabric_imex_mgmt_minor is not None:
        _write(capability, f"DeviceFileMinor: {fabric_imex_mgmt_minor}\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    else:
        capability.unlink(missing_ok=True)
    return root


def nvml_answers(node: SimulatedNode) -> str:
    """The mock library's ``nvml-mock.conf`` for one node (format in ``mock_nvml.c``)."""
    state = node.effective_fabric_state
    registered = state is FabricState.COMPLETED and node.clique is not None
    lines = [
        f"# mock NVML answers of node {node.name} (tests/testbed/fake_driver_root)",
        f"driver_version = {node.driver_version}",
        f"gpu_count = {node.gpu_count}",
        f"gpu_name = {'NVIDIA GB200' if node.clique else 'NVIDIA H200'}",
        f"fabric_state = {_FABRIC_STATE_NUMBER[state]}",
        f"fabric_status = {0 if node.fabric_status_ok else _NVML_ERROR_UNKNOWN}",
        # A registration still running has no cluster UUID yet (and a non-fabric GPU never has one).
        f"cluster_uuid = {node.clique.cluster_uuid if registered and node.clique else uuid.UUID(int=0)}",
        f"clique_id = {node.clique.clique_id if registered and node.clique else 0}",
        f"fabric_info_version = {node.fabric_info_version}",
    ]
    lines += [f"gpu{i}.uuid = GPU-{uuid.uuid5(_GPU_UUIDS, f'{node.name}/{i}')}" for i in range(node.gpu_count)]
    return "\n".join(lines) + "\n"


def write_nvml_answers(root: Path, node: SimulatedNode) -> None:
    """Replace what the root's mock NVML answers (atomically: the library re-reads it at every init)."""
    directory = root / lib_dir()
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{NVML_CONF}.", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(nvml_answers(node))
    Path(tmp).replace(directory / NVML_CONF)


def default_node(name: str = "h200") -> SimulatedNode:
    """The real H200 of SPEC section 6: driver 580.159.04, no NVLink fabric (state NOT_SUPPORTED)."""
    return SimulatedNode(name=name, driver_version=DEFAULT_DRIVER_VERSION, gpu_count=1)


def write_fake_driver_root(
    root: Path,
    node: SimulatedNode | None = None,
    *,
    imex: bool = True,
    interpreter: str = sys.executable,
    channels_major: int | None = REAL_IMEX_CHANNELS_MAJOR,
    caps_major: int | None = REAL_NVIDIA_CAPS_MAJOR,
    imex_channel_count: int | None = DEFAULT_IMEX_CHANNEL_COUNT,
    create_imex_channel0: bool = False,
    fabric_imex_mgmt_minor: int | None = REAL_FABRIC_IMEX_MGMT_MINOR,
) -> Path:
    """A complete fake driver root for ``node`` (default: the H200 of SPEC section 6) under ``root``.

    ``imex=False`` leaves out ``nvidia-imex``/``nvidia-imex-ctl`` (a node without the IMEX package);
    ``interpreter`` runs the IMEX simulator (``/usr/bin/env python3`` for roots used inside the service's
    image). The ``/proc`` arguments are those of ``write_proc_files``. Idempotent.
    """
    node = node or default_node()
    write_proc_files(
        root,
        channels_major=channels_major,
        caps_major=caps_major,
        imex_channel_count=imex_channel_count,
        create_imex_channel0=create_imex_channel0,
        fabric_imex_mgmt_minor=fabric_imex_mgmt_minor,
    )
    libs = root / lib_dir()
    libs.mkdir(parents=True, exist_ok=True)
    versioned = f"libnvidia-ml.so.{node.driver_version}"
    # A copy, not a link: the dynamic loader treats one inode as one library, and every root must keep
    # its own state (which nvml-mock.conf it reads) when one process loads several roots.
    if not (libs / versioned).exists():
        shutil.copyfile(mock_nvml_library(), libs / versioned)
    link = libs / "libnvidia-ml.so.1"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(versioned)
    write_nvml_answers(root, node)
    _write_bytes(root / "etc/ld.so.cache", render_ld_cache([("libnvidia-ml.so.1", f"/{lib_dir()}/libnvidia-ml.so.1")]))
    if imex:
        bin_dir = root / "usr/bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        apps = imex_simulator_apps(interpreter)
        shutil.copy2(apps["nvidia-imex"], bin_dir / "nvidia-imex")
        shutil.copy2(apps["nvidia-imex-ctl"], bin_dir / SIMULATED_CTL)  # what the native ctl hands on
        shutil.copy2(native_imex_ctl(), bin_dir / "nvidia-imex-ctl")
    return root


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


__all__ = [
    "DEFAULT_DRIVER_VERSION",
    "NVML_CONF",
    "REAL_FABRIC_IMEX_MGMT_MINOR",
    "REAL_IMEX_CHANNELS_MAJOR",
    "REAL_NVIDIA_CAPS_MAJOR",
    "SimulatedClique",
    "SimulatedNode",
    "Topology",
    "TopologyError",
    "default_node",
    "lib_dir",
    "load_topology",
    "nvl72_topology",
    "nvml_answers",
    "parse_topology",
    "topology_from_dicts",
    "write_fake_driver_root",
    "write_nvml_answers",
    "write_proc_files",
]
