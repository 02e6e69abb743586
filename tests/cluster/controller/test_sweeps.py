"""Orphan sweeps, additional managed namespaces, and non-fabric daemon pods in the status."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.controller.claim_templates import workload_template
from computedomain.controller.daemonset import daemonset
from tests.cluster.controller.conftest import Harness, eventually
from tests.cluster.controller.test_lifecycle import children_of
from tests.conftest import MakeNode
from tests.unit.controller.helpers import compute_domain

pytestmark = pytest.mark.cluster


def _orphans(h: Harness, uid: str, extra_ns: str) -> list[dict[str, Any]]:
    """What the controller made for domain ``uid`` (DaemonSets in two managed namespaces and the workload
    template), as its own builders write them: the sweep removes only objects that are what it makes, never a
    foreign object that merely carries the label."""
    settings = h.settings(ADDITIONAL_NAMESPACES=extra_ns)
    cd = compute_domain(uid=uid, namespace=h.cd_ns, template="left-behind")
    in_extra = daemonset(cd, settings)
    in_extra["metadata"]["namespace"] = extra_ns
    template = workload_template(cd, settings)
    del template["metadata"]["ownerReferences"]  # the domain is gone: the sweep, not the GC, must remove it
    return [daemonset(cd, settings), in_extra, template]


async def test_orphans_of_a_vanished_domain_are_swept_at_start(harness: Harness, make_node: MakeNode) -> None:
    h = harness
    extra_ns = f"drv2-{uuid.uuid4().hex[:6]}"
    h.kubectl("create", "namespace", extra_ns)
    try:
        gone = str(uuid.uuid4())  # a domain that no longer exists
        for orphan in _orphans(h, gone, extra_ns):
            h.cluster.apply(orphan)
        node = make_node(clique="c0ffee.4")["metadata"]["name"]
        h.kubectl("label", "node", node, f"{COMPUTE_DOMAIN_LABEL}={gone}")
        assert len(children_of(h, gone)["daemonsets"]) == 2
        async with h.controller(ADDITIONAL_NAMESPACES=extra_ns):
            await eventually(
                lambda: children_of(h, gone) == {"daemonsets": [], "resourceclaimtemplates": [], "nodes": []} or None,
                what="orphans removed",
            )
            # A node labelled later for a domain that is gone (the node agent raced the teardown) is cleaned too.
            h.kubectl("label", "node", node, f"{COMPUTE_DOMAIN_LABEL}={gone}")
            await eventually(lambda: children_of(h, gone)["nodes"] == [] or None, what="late label removed")
    finally:
        h.kubectl("delete", "namespace", extra_ns, "--wait=false", check=False)


async def test_status_aggregates_namespaces_and_non_fabric_pods(harness: Harness, make_node: MakeNode) -> None:
    h = harness
    extra_ns = f"drv2-{uuid.uuid4().hex[:6]}"
    h.kubectl("create", "namespace", extra_ns)
    try:
        async with h.controller(ADDITIONAL_NAMESPACES=extra_ns):
            uid = h.create_cd("eps", num_nodes=3)["metadata"]["uid"]
            gb_x, gb_y = (make_node()["metadata"]["name"] for _ in range(2))
            for ns, clique_id, node_name in ((h.driver_ns, "c0ffee.5", gb_x), (extra_ns, "c0ffee.6", gb_y)):
                h.daemon_pod(uid, node_name, clique_id, namespace=ns)  # the daemon whose entry it is
                h.cluster.apply(
                    {
                        "apiVersion": "resource.nvidia.com/v1beta1",
                        "kind": "ComputeDomainClique",
                        "metadata": {
                            "name": f"{uid}.{clique_id}",
                            "namespace": ns,
                            "labels": {COMPUTE_DOMAIN_LABEL: uid, CLIQUE_LABEL: clique_id},
                        },
                        "daemons": [
                            {
                                "nodeName": node_name,
                                "ipAddress": "10.2.0.1",
                                "cliqueID": clique_id,
                                "index": 0,
                                "status": "Ready",
                            }
                        ],
                    }
                )
            # A daemon on a node without NVLink fabric labels its pod with an empty clique ID and registers nowhere.
            # (This stand-in has another controller, so the domain's DaemonSet does not adopt and delete it.)
            cpu = make_node()["metadata"]["name"]
            h.kubectl("wait", "--for=create", "--timeout=30s", "configmap/kube-root-ca.crt", "-n", h.driver_ns)
            cm = h.get_json("configmap", "kube-root-ca.crt", "-n", h.driver_ns)["metadata"]
            owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": cm["name"], "uid": cm["uid"], "controller": True}
            h.cluster.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": "daemon-cpu",
                        "namespace": h.driver_ns,
                        "labels": {COMPUTE_DOMAIN_LABEL: uid, CLIQUE_LABEL: ""},
                        "ownerReferences": [owner],
                    },
                    "spec": {
                        "nodeName": cpu,
                        "containers": [{"name": "d", "image": "x"}],
                        "tolerations": [{"operator": "Exists"}],
                    },
                }
            )

            def status() -> dict[str, Any]:
                got: dict[str, Any] = h.get_json("computedomain", "eps", "-n", h.cd_ns).get("status") or {}
                return got

            await eventually(lambda: len(status().get("nodes", [])) == 3 or None, within=30, what="3 entries")

            def pod_ready() -> str:
                conds = (h.get_json("pod", "daemon-cpu", "-n", h.driver_ns).get("status") or {}).get("conditions") or []
                return "Ready" if any(c["type"] == "Ready" and c["status"] == "True" for c in conds) else "NotReady"

            def mirrored() -> dict[str, Any] | None:
                nodes = {n["name"]: n for n in status().get("nodes", [])}
                return nodes if cpu in nodes and nodes[cpu]["status"] == pod_ready() else None

            nodes = await eventually(mirrored, what="the non-fabric entry mirrors its pod's readiness")
            assert set(nodes) == {gb_x, gb_y, cpu}
            assert (nodes[cpu]["cliqueID"], nodes[cpu]["index"], nodes[cpu]["ipAddress"] != "") == ("", -1, True)
            assert nodes[gb_y]["cliqueID"] == "c0ffee.6"
            expected = "Ready" if nodes[cpu]["status"] == "Ready" else "NotReady"
            assert status()["status"] == expected
    finally:
        h.kubectl("delete", "namespace", extra_ns, "--wait=false", check=False)
