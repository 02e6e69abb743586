"""Simulated GB200 nodes as kwok-managed Node objects.

A GB200 NVL72 rack is one NVLink clique of 18 compute trays (nodes) with 4 GPUs each. The clique ID the
node agent derives from NVML is `<clusterUUID>.<cliqueId>`; simulated nodes carry it as the
`nvidia.com/gpu.clique` label the way a real node agent would set it. Non-fabric nodes have none.
"""

from __future__ import annotations

from typing import Any

from computedomain.api.constants import GPU_CLIQUE_NODE_LABEL
from tests.testbed.cluster import KWOK_NODE_ANNOTATION

TRAYS_PER_RACK = 18
GPUS_PER_TRAY = 4


def clique_id(cluster_uuid: str, clique: int) -> str:
    return f"{cluster_uuid}.{clique}"


def gb200_node(
    name: str,
    *,
    clique: str | None = None,
    labels: dict[str, str] | None = None,
    gpus: int = GPUS_PER_TRAY,
) -> dict[str, Any]:
    """A Node that kwok keeps Ready. `clique=None` makes a node without NVLink fabric."""
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "arm64",
        "type": "kwok",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-GB200" if clique else "NVIDIA-H200",
        **(labels or {}),
    }
    if clique:
        node_labels[GPU_CLIQUE_NODE_LABEL] = clique
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": node_labels,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        "status": {
            "allocatable": {"cpu": "144", "memory": "960Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
            "capacity": {"cpu": "144", "memory": "960Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
        },
    }
