"""The simulated machines' hardware facts: which nodes exist, their driver version, GPUs and NVLink fabric.

This module owns the topology format (JSON or YAML), which ``write_fake_driver_root`` turns into each
node's fake driver root (the mock ``libnvidia-ml``'s answers and the ``/proc`` files), and ``nvl72_topology``,
a generator for racks of 18 compute trays plus non-fabric nodes.

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

from imex.discovery import DriverVersion, FabricState, HardwareError

# What a real H200 node reports (SPEC section 6); a node without a given version has this one.
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
    # Newest fabric-info struct the driver's NVML knows: 3 (580+), 2, or 1 (only the unversioned call).
    fabric_info_version: int = Field(default=3, alias="nvmlFabricInfoVersion", ge=1, le=3)

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
