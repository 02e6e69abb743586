"""A channel claim allocated by hand, for cluster tests with no scheduler allocation to wait for (no node
agent publishes devices there): what makes the controller label a node for a domain (controller/nodes.py)."""

from __future__ import annotations

import json

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, DRIVER_NAME, GROUP_VERSION
from tests.conftest import Cluster

CLAIM_CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"


def allocated_claim(cluster: Cluster, namespace: str, cd_uid: str, node: str, *, name: str | None = None) -> str:
    """A claim of the domain's channel class in ``namespace`` with ``channel-0`` of ``node`` allocated, its
    status written as the scheduler writes it. Returns its name."""
    name = name or f"channel-{node}"
    config = {
        "driver": DRIVER_NAME,
        "parameters": {"apiVersion": GROUP_VERSION, "kind": "ComputeDomainChannelConfig", "domainID": cd_uid},
    }
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
             "spec": {"devices": {
                 "requests": [{"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}],
                 "config": [{"requests": ["channel"], "opaque": config}]}}}  # fmt: skip
    # As the resourceclaim controller, which alone may create claims of a channel class where the chart's
    # admission policy is installed.
    cluster.kubectl("create", "-n", namespace, "-f", "-", f"--as={CLAIM_CONTROLLER}", input=json.dumps(claim))
    allocation = {"status": {"allocation": {"devices": {
        "results": [{"request": "channel", "driver": DRIVER_NAME, "pool": node, "device": "channel-0"}],
        "config": [{"source": "FromClaim", "requests": ["channel"], "opaque": config}]}}}}  # fmt: skip
    cluster.kubectl("patch", "resourceclaim", name, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps(allocation))  # fmt: skip
    return name
