"""The local control plane is the real thing: real version, DRA served, our CRDs enforced server-side,
and the real scheduler allocating a compute-domain.nvidia.com device to a pod on a kwok node."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, DRIVER_NAME
from computedomain.kube.client import KubeClient
from computedomain.plugin.grpc_server import PluginServer, SocketPaths
from computedomain.plugin.preparer import ClaimRef, ClaimUid, PrepareResult, UnprepareResult
from tests.conftest import Cluster, MakeNode
from tests.testbed.kubelet import KubeletStandIn

pytestmark = pytest.mark.cluster


def compute_domain(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}}
    body.update(spec)
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": body,
    }


def test_server_reports_its_real_version_and_serves_dra(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == "v1.36.3"
    assert "resource.k8s.io/v1" in cluster.kubectl("api-versions").split()


def test_crds_are_installed_with_short_names(cluster: Cluster) -> None:
    resources = cluster.kubectl("api-resources", "--api-group=resource.nvidia.com", "-o", "wide")
    assert "computedomains" in resources and " cd " in resources
    assert "computedomaincliques" in resources


def test_defaults_are_applied_server_side(cluster: Cluster, namespace: str) -> None:
    code, out = cluster.create(compute_domain("defaults"), namespace)
    assert code == 0, out
    spec = json.loads(out)["spec"]
    assert spec["numNodes"] == 0
    assert spec["channel"]["allocationMode"] == "Single"
    table = cluster.kubectl("get", "cd", "defaults", "-n", namespace)
    assert table.split()[:4] == ["NAME", "STATUS", "NODES", "AGE"]


@pytest.mark.parametrize(
    ("spec", "field", "detail"),
    [
        ({"numNodes": -1}, "spec.numNodes", "greater than or equal to 0"),
        ({"channel": {"resourceClaimTemplate": {"name": "x"}, "allocationMode": "Some"}},
         "spec.channel.allocationMode", 'supported values: "Single", "All"'),
        ({"channel": {"resourceClaimTemplate": {}}}, "spec.channel.resourceClaimTemplate.name", "Required value"),
        ({"channel": {}}, "spec.channel.resourceClaimTemplate", "Required value"),
    ],
)  # fmt: skip
def test_invalid_objects_are_rejected_naming_the_field(
    cluster: Cluster, namespace: str, spec: dict[str, Any], field: str, detail: str
) -> None:
    code, out = cluster.create(compute_domain("bad", **spec), namespace)
    assert code != 0
    assert field in out and detail in out, out
    assert cluster.try_kubectl("get", "cd", "bad", "-n", namespace)[0] != 0, "nothing may be half-created"


@pytest.mark.parametrize(
    "patch",
    [
        {"spec": {"numNodes": 3}},
        {"spec": {"channel": {"allocationMode": "All"}}},
        {"spec": {"channel": {"resourceClaimTemplate": {"name": "other"}}}},
    ],
)
def test_spec_is_immutable(cluster: Cluster, namespace: str, patch: dict[str, Any]) -> None:
    code, out = cluster.create(compute_domain("frozen", numNodes=2), namespace)
    assert code == 0, out
    code, out = cluster.try_kubectl("patch", "cd", "frozen", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    assert code != 0
    assert "spec: Invalid value" in out and "spec is immutable" in out, out
    assert cluster.get("cd", "frozen", namespace)["spec"]["numNodes"] == 2


def test_status_is_a_subresource_with_its_own_validation(cluster: Cluster, namespace: str) -> None:
    cluster.create(compute_domain("st"), namespace)
    # A status write through the main resource is ignored ...
    cluster.kubectl("patch", "cd", "st", "-n", namespace, "--type=merge", "-p", '{"status":{"status":"Ready"}}')
    assert "status" not in cluster.get("cd", "st", namespace) or cluster.get("cd", "st", namespace)["status"] == {}
    # ... through the subresource it lands, and the enum is enforced.
    code, out = cluster.try_kubectl(
        "patch",
        "cd",
        "st",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"status":"Done"}}',
    )
    assert code != 0 and "status.status" in out
    cluster.kubectl(
        "patch", "cd", "st", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", '{"status":{"status":"Ready","nodes":[{"name":"n1","ipAddress":"10.0.0.2","cliqueID":""}]}}',
    )  # fmt: skip
    status = cluster.get("cd", "st", namespace)["status"]
    assert status["status"] == "Ready"
    assert status["nodes"] == [
        {"name": "n1", "ipAddress": "10.0.0.2", "cliqueID": "", "index": 0, "status": "NotReady"}
    ]


def _resource_slice(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER_NAME}"},
        "spec": {
            "driver": DRIVER_NAME,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": "channel-0", "attributes": {"type": {"string": "channel"}, "id": {"int": 0}}},
                {"name": "daemon-0", "attributes": {"type": {"string": "daemon"}, "id": {"int": 0}}},
            ],
        },
    }


def _wait(predicate: Any, timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class _AcceptingPreparer:
    """Prepares every claim with no devices: the test is about scheduling, not about the node agent."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        return {c.uid: PrepareResult() for c in claims}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        return {c.uid: UnprepareResult() for c in claims}


async def test_scheduler_allocates_a_channel_on_a_kwok_node(
    cluster: Cluster, namespace: str, make_node: MakeNode
) -> None:
    node = make_node(clique=f"{uuid.uuid4()}.1")["metadata"]["name"]
    cluster.apply(_resource_slice(node))
    # kwok runs a pod with claims only once the kubelet stand-in has prepared them (kwok-stages.yaml).
    sockets = Path(tempfile.mkdtemp(prefix="cp-", dir="/tmp"))
    server = PluginServer(
        _AcceptingPreparer(), SocketPaths.for_driver(sockets / "reg", sockets / "plugins"), health_port=None
    )
    await server.start()
    client = await KubeClient.connect(kubeconfig=cluster.kubeconfig)
    standin = KubeletStandIn(client, node, sockets / "reg", backoff_s=1.0)
    standin_task = asyncio.create_task(standin.run())
    try:
        cluster.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "channel"},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}
                ]}}},
            },
            namespace,
        )  # fmt: skip
        cluster.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "worker"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [
                        {
                            "name": "c",
                            "image": "example.invalid/worker:1",
                            "resources": {"claims": [{"name": "channel"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": "channel"}],
                },
            },
            namespace,
        )

        def claim_name() -> str | None:
            statuses = cluster.get("pod", "worker", namespace).get("status", {}).get("resourceClaimStatuses", [])
            return statuses[0].get("resourceClaimName") if statuses else None

        name = await asyncio.to_thread(_wait, claim_name, what="the controller-manager to create the ResourceClaim")
        claim = await asyncio.to_thread(
            _wait,
            lambda: (c := cluster.get("resourceclaim", name, namespace)).get("status", {}).get("allocation") and c,
            what="the scheduler to allocate the claim",
        )
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER_NAME, node, "channel-0")
        pod = await asyncio.to_thread(
            _wait,
            lambda: (p := cluster.get("pod", "worker", namespace)).get("status", {}).get("phase") == "Running" and p,
            what="kwok to run the pod",
        )
        assert pod["spec"]["nodeName"] == node
        cluster.kubectl("delete", "pod", "worker", "-n", namespace, "--wait=false")
        await asyncio.to_thread(
            _wait, lambda: cluster.try_kubectl("get", "pod", "worker", "-n", namespace)[0] != 0, what="the pod to go"
        )
    finally:
        standin_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await standin_task
        await client.close()
        await server.stop(0)
        shutil.rmtree(sockets, ignore_errors=True)
        cluster.kubectl("delete", "resourceslice", f"{node}-{DRIVER_NAME}", "--wait=false", check=False)
