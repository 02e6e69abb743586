"""Simulated hardware: the stand-in for NVML and the driver's ``/proc`` files on GB200/GB300 NVL72 nodes.

This module owns
- the topology file format (JSON or YAML): which nodes exist, their driver version, GPU count, and NVLink
  fabric registration (state, cluster UUID + clique ID, or none);
- ``SimulatedFabricSource``, the ``FabricSource`` the node agent uses instead of NVML in the test bed and
  the demo, since no GB200 hardware is available there;
- ``write_fake_driver_root``, which lays out ``proc/devices``, ``proc/driver/nvidia/params`` and the
  ``fabric-imex-mgmt`` capability file for one node, so the real ``imex.procfs`` code runs unchanged;
- ``nvl72_topology``, a generator for racks of 18 compute trays plus non-fabric nodes.

Example topology (YAML)::

    nodes:
      - name: gb-a-00
        driverVersion: "580.82.07"
        gpuCount: 4
        fabricState: COMPLETED          # default: COMPLETED with a clique, NOT_SUPPORTED without
        clique: {clusterUUID: 2b3c...-...., cliqueId: 1}
      - name: cpu-0                     # no clique: a non-MNNVL node
        gpuCount: 0
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from imex.discovery import (
    DEFAULT_IMEX_CHANNEL_COUNT,
    Discovery,
    DriverVersion,
    FabricState,
    GpuFabricInfo,
    HardwareError,
)
from imex.procfs import (
    FABRIC_IMEX_MGMT,
    IMEX_CHANNELS_DEVICE,
    NVIDIA_CAPS_DEVICE,
    PROC_CAPABILITIES,
    PROC_DEVICES,
    PROC_PARAMS,
    ProcFS,
)

# What a real H200 node with driver 580.159.04 reports (SPEC section 6); fake roots default to it.
REAL_IMEX_CHANNELS_MAJOR = 242
REAL_NVIDIA_CAPS_MAJOR = 241
REAL_FABRIC_IMEX_MGMT_MINOR = 4323
DEFAULT_DRIVER_VERSION = "580.159.04"


class TopologyError(HardwareError):
    """The topology file is missing, unreadable, or does not match the schema."""


class SimulatedClique(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    cluster_uuid: uuid.UUID = Field(alias="clusterUUID")
    clique_id: int = Field(alias="cliqueId", ge=0, lt=2**32)


class SimulatedNode(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1)
    driver_version: str = Field(default=DEFAULT_DRIVER_VERSION, alias="driverVersion")
    gpu_count: int = Field(default=4, alias="gpuCount", ge=0)
    clique: SimulatedClique | None = None
    fabric_state: FabricState | None = Field(default=None, alias="fabricState")
    # A failed registration (COMPLETED with a non-success status), to exercise the strict gate.
    fabric_status_ok: bool = Field(default=True, alias="fabricStatusOK")

    @model_validator(mode="after")
    def _check(self) -> SimulatedNode:
        DriverVersion.parse(self.driver_version)
        if self.fabric_state is FabricState.COMPLETED and self.clique is None:
            raise ValueError(f"node {self.name}: fabricState COMPLETED needs a clique")
        return self

    @property
    def effective_fabric_state(self) -> FabricState:
        if self.fabric_state is not None:
            return self.fabric_state
        return FabricState.COMPLETED if self.clique else FabricState.NOT_SUPPORTED


class Topology(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: list[SimulatedNode]

    @model_validator(mode="after")
    def _unique(self) -> Topology:
        names = [node.name for node in self.nodes]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate node names: {', '.join(duplicates)}")
        return self

    def node(self, name: str) -> SimulatedNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise TopologyError(f"node {name!r} is not in the simulated topology")

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True, indent=2)


def parse_topology(text: str, *, source: str = "<topology>") -> Topology:
    try:
        # YAML is a superset of JSON, so one loader reads both.
        data: Any = yaml.safe_load(text)
        return Topology.model_validate(data)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{source}: not valid YAML/JSON: {' '.join(str(exc).split())}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise TopologyError(f"{source}: {where}: {first['msg']} ({exc.error_count()} error(s))") from None


def load_topology(path: Path) -> Topology:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {path}: {exc.strerror}") from None
    return parse_topology(text, source=str(path))


class SimulatedFabricSource:
    """``FabricSource`` answering from a topology entry, the way NVML would on that node.

    Reading the file on every call (when built from a path) lets a test flip a node's fabric state while
    the node agent runs, as Fabric Manager would on real hardware.
    """

    def __init__(self, node_name: str, *, topology: Topology | None = None, path: Path | None = None) -> None:
        if (topology is None) == (path is None):
            raise ValueError("give exactly one of topology and path")
        self._node_name = node_name
        self._topology = topology
        self._path = path

    def _node(self) -> SimulatedNode:
        topology = self._topology if self._topology is not None else load_topology(self._path)  # type: ignore[arg-type]
        return topology.node(self._node_name)

    def driver_version(self) -> DriverVersion:
        return DriverVersion.parse(self._node().driver_version)

    def gpu_fabric_infos(self) -> list[GpuFabricInfo]:
        node = self._node()
        state = node.effective_fabric_state
        infos = []
        for index in range(node.gpu_count):
            if state is FabricState.NOT_SUPPORTED or node.clique is None:
                infos.append(GpuFabricInfo(gpu=str(index), state=state))
                continue
            infos.append(
                GpuFabricInfo(
                    gpu=str(index),
                    state=state,
                    cluster_uuid=node.clique.cluster_uuid,
                    clique_id=node.clique.clique_id,
                    status_ok=node.fabric_status_ok,
                    status_text="" if node.fabric_status_ok else "simulated registration failure",
                )
            )
        return infos


def simulated_discovery(node_name: str, topology_path: Path, driver_root: Path) -> Discovery:
    """``HardwareDiscovery`` for one simulated node: topology for fabric, the fake root for ``/proc``."""
    return Discovery(SimulatedFabricSource(node_name, path=topology_path), ProcFS(driver_root))


def write_fake_driver_root(
    root: Path,
    *,
    channels_major: int | None = REAL_IMEX_CHANNELS_MAJOR,
    caps_major: int | None = REAL_NVIDIA_CAPS_MAJOR,
    imex_channel_count: int | None = DEFAULT_IMEX_CHANNEL_COUNT,
    create_imex_channel0: bool = False,
    fabric_imex_mgmt_minor: int | None = REAL_FABRIC_IMEX_MGMT_MINOR,
) -> Path:
    """Lay out the driver's ``/proc`` files for one node under ``root`` and return ``root``.

    Defaults reproduce the real H200 of SPEC section 6. ``None`` leaves a piece out (no channels major:
    a driver without IMEX; no channel count: a driver predating the parameter; no capability: non-fabric).
    A ``dev/`` directory is created too: upstream treats a driver root without ``dev/`` as "not a root".
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


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def nvl72_topology(
    *,
    racks: int = 2,
    trays_per_rack: int = 18,
    non_fabric_nodes: int = 1,
    driver_version: str = "570.172.08",
    gpus_per_tray: int = 4,
    cluster_uuid: uuid.UUID | None = None,
) -> Topology:
    """``racks`` NVL72 racks (one clique each, ``trays_per_rack`` compute trays) plus non-fabric nodes.

    Node names are ``gb-r<rack>-t<tray>`` and ``cpu-<n>``. One cluster UUID for all racks, clique IDs
    1..racks, as a single Fabric Manager domain partitioned per rack would report.
    """
    cluster = cluster_uuid or uuid.UUID("6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40")
    nodes: list[SimulatedNode] = []
    for rack in range(racks):
        clique = SimulatedClique(cluster_uuid=cluster, clique_id=rack + 1)
        nodes.extend(
            SimulatedNode(
                name=f"gb-r{rack}-t{tray:02d}",
                driver_version=driver_version,
                gpu_count=gpus_per_tray,
                clique=clique,
            )
            for tray in range(trays_per_rack)
        )
    nodes.extend(
        SimulatedNode(name=f"cpu-{n}", driver_version=driver_version, gpu_count=0) for n in range(non_fabric_nodes)
    )
    return Topology(nodes=nodes)


def topology_from_dicts(nodes: Iterable[dict[str, Any]]) -> Topology:
    """Convenience for tests: build a topology from camelCase dicts, with the file's validation."""
    return parse_topology(json.dumps({"nodes": list(nodes)}, default=str))
