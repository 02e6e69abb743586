"""The simulated machines: NVL72 racks of compute trays plus non-fabric nodes, and each node's disk and network.

A rack is one NVLink clique (`<clusterUUID>.<rack+1>`, as one Fabric Manager domain partitioned per rack
reports it). Every node gets

- a kwok Node (annotation `kwok.x-k8s.io/node=<kwok value>`, so only this simulation's kwok drives it) with
  the labels of a GPU node, this simulation's selector label, `spec.podCIDR` and an InternalIP;
- a network of its own on the loopback interface: pods get `127.A.B.1-127` from kwok's pool for the node's
  podCIDR `127.A.B.0/25`, the node itself is `127.A.B.200`. All of 127/8 is local on Linux, so the IMEX
  simulator can bind every pod IP, and a pod IP that kwok recycles is really reused;
- a directory `<root>/n<i>` (short: unix socket paths below it are limited to 107 bytes) that stands in for its root filesystem: hostPath volumes map below it
  (`/var/lib/kubelet/plugins_registry` -> `<root>/<node>/var/lib/kubelet/plugins_registry`), the host IMEX
  of hostManaged mode keeps its config and socket in `<root>/<node>/etc/nvidia-imex`;
- the NVIDIA driver at the root of that tree (the chart's default `nvidiaDriverRoot: /`), written by
  `tests.testbed.fake_driver_root`: the mock `libnvidia-ml.so.1` answering the node's fabric, the driver's
  `/proc` files at `<root>/<node>/proc`, and the IMEX simulator as `nvidia-imex`/`nvidia-imex-ctl`. The node
  agents find it exactly as on a real node (the chart mounts the driver root at `/driver-root`).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from computedomain.api.constants import GPU_CLIQUE_NODE_LABEL
from tests.testbed.cluster import KWOK_NODE_ANNOTATION
from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, write_fake_driver_root

TRAYS_PER_RACK: Final = 18
GPUS_PER_TRAY: Final = 4
# Driver >= 570.158.01, so IMEXDaemonsWithDNSNames (on by default) is allowed.
DRIVER_VERSION: Final = "570.172.08"
CLUSTER_UUID: Final = uuid.UUID("6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40")
SELECTOR_LABEL: Final = "sim.testbed.computedomain/cluster"
RACK_LABEL: Final = "sim.testbed.computedomain/rack"
HOST_OCTET: Final = 200

KUBELET_REGISTRAR: Final = "/var/lib/kubelet/plugins_registry"
KUBELET_PLUGINS: Final = "/var/lib/kubelet/plugins"
CDI_ROOT: Final = "/var/run/cdi"


@dataclass(frozen=True)
class SimNode:
    name: str
    rack: int | None  # None: no NVLink fabric
    tray: int
    net: str  # "127.A.B"
    root: Path
    clique: str = ""

    @property
    def host_ip(self) -> str:
        return f"{self.net}.{HOST_OCTET}"

    @property
    def pod_cidr(self) -> str:
        return f"{self.net}.0/25"

    def host_path(self, path: str) -> Path:
        """Where a path of this node's root filesystem lives on the machine running the simulation."""
        return self.root / path.lstrip("/")

    def machine_path(self, path: str) -> Path:
        """A host path some process of this node wrote (a CDI spec's `hostPath`): node paths map into the
        node's tree; a path already there (written by a process that saw machine paths) stays."""
        return Path(path) if Path(path).is_relative_to(self.root) else self.host_path(path)

    @property
    def registrar_dir(self) -> Path:
        return self.host_path(KUBELET_REGISTRAR)

    @property
    def cdi_dir(self) -> Path:
        return self.host_path(CDI_ROOT)

    def cdi_spec_files(self) -> list[Path]:
        """The node's CDI specs (`*.json` and `*.yaml`, as a runtime loads them)."""
        if not self.cdi_dir.is_dir():
            return []
        return sorted(p for p in self.cdi_dir.iterdir() if p.suffix in (".json", ".yaml"))

    def manifest(self, cluster_id: str, kwok_value: str) -> dict[str, Any]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "arm64",
            "type": "kwok",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-GB200" if self.clique else "NVIDIA-H200",
            SELECTOR_LABEL: cluster_id,
        }
        if self.rack is not None:
            labels[RACK_LABEL] = str(self.rack)
            # What gpu-feature-discovery (or the node agent with gpuCliqueLabelEnabled) puts on an NVL72 tray.
            labels[GPU_CLIQUE_NODE_LABEL] = self.clique
        resources = {"cpu": "144", "memory": "960Gi", "pods": "110", "nvidia.com/gpu": str(GPUS_PER_TRAY)}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {KWOK_NODE_ANNOTATION: kwok_value, "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr]},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": self.name},
                ],
                "allocatable": resources,
                "capacity": resources,
            },
        }


@dataclass
class SimTopology:
    root: Path
    nodes: list[SimNode]
    cluster_uuid: uuid.UUID = CLUSTER_UUID
    by_name: dict[str, SimNode] = field(init=False)

    def __post_init__(self) -> None:
        self.by_name = {n.name: n for n in self.nodes}

    def cliques(self) -> dict[str, list[SimNode]]:
        out: dict[str, list[SimNode]] = {}
        for node in self.nodes:
            if node.clique:
                out.setdefault(node.clique, []).append(node)
        return out

    def rack(self, index: int) -> list[SimNode]:
        return [n for n in self.nodes if n.rack == index]

    def non_fabric(self) -> list[SimNode]:
        return [n for n in self.nodes if n.rack is None]

    def node_for_ip(self, ip: str) -> SimNode | None:
        net = ip.rpartition(".")[0]
        return next((n for n in self.nodes if n.net == net), None)

    def hardware(self, node: SimNode) -> SimulatedNode:
        """What the node's NVML reports: an NVL72 tray of its rack's clique, or a GPU node without one."""
        clique = None
        if node.rack is not None:
            clique = SimulatedClique(cluster_uuid=self.cluster_uuid, clique_id=node.rack + 1)
        return SimulatedNode(name=node.name, driver_version=DRIVER_VERSION, gpu_count=GPUS_PER_TRAY, clique=clique)

    def write(self) -> None:
        """Lay out every node's tree and driver root (idempotent)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            for path in (KUBELET_REGISTRAR, KUBELET_PLUGINS, CDI_ROOT, "/etc", "/var/log/pods"):
                node.host_path(path).mkdir(parents=True, exist_ok=True)
            # Non-fabric nodes have the IMEX channel major too (an H200 driver exposes it), not the capability.
            write_fake_driver_root(node.root, self.hardware(node), fabric_imex_mgmt_minor=4323 if node.clique else None)
            hosts = node.host_path("/etc/hosts")
            if not hosts.exists():
                hosts.write_text(f"127.0.0.1 localhost\n{node.host_ip} {node.name}\n")

    def __iter__(self) -> Iterator[SimNode]:
        return iter(self.nodes)


def random_first_octet() -> int:
    """Second octet of the simulation's 127.A.x networks; random so concurrent simulations rarely meet."""
    return random.randint(30, 230)


def build_topology(
    root: Path,
    *,
    racks: int = 2,
    trays_per_rack: int = TRAYS_PER_RACK,
    non_fabric: int = 2,
    prefix: str = "",
    octet: int | None = None,
    cluster_uuid: uuid.UUID = CLUSTER_UUID,
) -> SimTopology:
    """Nodes `<prefix>gb-r<rack>-t<tray>` (racks) and `<prefix>cpu-<n>` (no fabric), networks 127.A.<i>."""
    first = octet if octet is not None else random_first_octet()
    nodes: list[SimNode] = []

    def net(index: int) -> str:
        return f"127.{first + index // 250}.{index % 250 + 1}"

    for rack in range(racks):
        clique = f"{cluster_uuid}.{rack + 1}"
        for tray in range(trays_per_rack):
            name = f"{prefix}gb-r{rack}-t{tray:02d}"
            nodes.append(SimNode(name, rack, tray, net(len(nodes)), root / f"n{len(nodes)}", clique))
    for n in range(non_fabric):
        name = f"{prefix}cpu-{n}"
        nodes.append(SimNode(name, None, n, net(len(nodes)), root / f"n{len(nodes)}"))
    return SimTopology(root, nodes, cluster_uuid)
