"""Create and delete against the real control plane: the three children, the status, the teardown."""

from __future__ import annotations

import json
from typing import Any

import pytest

from computedomain.api.constants import (
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    TEMPLATE_TARGET_LABEL,
)
from tests.cluster.controller.conftest import IMAGE, Harness, eventually
from tests.conftest import MakeNode

pytestmark = pytest.mark.cluster


def children_of(h: Harness, uid: str) -> dict[str, list[str]]:
    sel = f"{COMPUTE_DOMAIN_LABEL}={uid}"
    out: dict[str, list[str]] = {}
    for kind in ("daemonsets", "resourceclaimtemplates"):
        items = h.get_json(kind, "-A", "-l", sel)["items"]
        out[kind] = sorted(f"{i['metadata']['namespace']}/{i['metadata']['name']}" for i in items)
    out["nodes"] = sorted(i["metadata"]["name"] for i in h.get_json("nodes", "-l", sel)["items"])
    return out


def events_for(h: Harness, name: str) -> list[tuple[str, str, str]]:
    items = h.get_json("events", "-n", h.cd_ns, "--field-selector", f"involvedObject.name={name}")["items"]
    return [(e["type"], e["reason"], e["message"]) for e in items]


async def test_create_then_delete(harness: Harness, make_node: MakeNode) -> None:
    h = harness
    async with h.controller():
        cd = h.create_cd("alpha", num_nodes=0, mode="All")
        uid = cd["metadata"]["uid"]
        name = f"computedomain-daemon-{uid}"

        def ready() -> dict[str, Any] | None:
            obj = h.get_json("computedomain", "alpha", "-n", h.cd_ns)
            return obj if obj.get("status", {}).get("status") == "Ready" else None

        obj = await eventually(ready, what="CD Ready")
        assert obj["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
        assert "nodes" not in obj["status"]
        (cond,) = obj["status"]["conditions"]
        assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "True", "NoDaemonsExpected")

        ds = h.get_json("daemonset", name, "-n", h.driver_ns)
        assert ds["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: uid}
        assert ds["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
        pod = ds["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {COMPUTE_DOMAIN_LABEL: uid}
        assert pod["resourceClaims"] == [{"name": "compute-domain-daemon", "resourceClaimTemplateName": name}]
        assert pod["containers"][0]["image"] == IMAGE
        assert {t["effect"] for t in pod["tolerations"]} == {"NoSchedule", "NoExecute", "PreferNoSchedule"}

        daemon_t = h.get_json("resourceclaimtemplate", name, "-n", h.driver_ns)
        assert daemon_t["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: uid, TEMPLATE_TARGET_LABEL: "Daemon"}
        assert daemon_t["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
        work_t = h.get_json("resourceclaimtemplate", "alpha-channel", "-n", h.cd_ns)
        assert work_t["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: uid, TEMPLATE_TARGET_LABEL: "Workload"}
        assert work_t["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
        params = work_t["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        assert params == {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig",
            "domainID": uid,
            "allocationMode": "All",
        }
        # What a user reads in `kubectl describe`: that it became Ready (no Event per object created).
        reasons = await eventually(lambda: [r for _, r, _ in events_for(h, "alpha")] or None, what="Events")
        assert reasons == ["Ready"]

        # The node agent labels nodes where the domain's workload runs; teardown must take the labels off.
        nodes = [make_node(clique="c0ffee.1")["metadata"]["name"] for _ in range(2)]
        for n in nodes:
            h.kubectl("label", "node", n, f"{COMPUTE_DOMAIN_LABEL}={uid}")
        await eventually(
            lambda: (
                len(
                    h.get_json("daemonset", name, "-n", h.driver_ns).get("status", {}).get("desiredNumberScheduled", 0)
                    and [1]
                )
                or None
            ),
            within=20,
            what="DS scheduling on labelled nodes",
        )

        h.kubectl("delete", "computedomain", "alpha", "-n", h.cd_ns, "--wait=false")
        await eventually(lambda: h.try_get("computedomain", "alpha", "-n", h.cd_ns) is None or None, what="CD gone")
        assert children_of(h, uid) == {"daemonsets": [], "resourceclaimtemplates": [], "nodes": []}


async def test_numnodes_and_status_from_cliques(harness: Harness, make_node: MakeNode) -> None:
    """Daemons write their entries into ComputeDomainClique objects; the controller aggregates them."""
    h = harness
    gb_a, gb_b = (make_node(clique="c0ffee.1")["metadata"]["name"] for _ in range(2))
    async with h.controller():
        uid = h.create_cd("beta", num_nodes=2)["metadata"]["uid"]

        def status() -> dict[str, Any]:
            got: dict[str, Any] = h.get_json("computedomain", "beta", "-n", h.cd_ns).get("status") or {}
            return got

        def cond() -> dict[str, Any]:
            return next(c for c in status().get("conditions", []) if c["type"] == "Ready")

        await eventually(lambda: status().get("status") == "NotReady" or None, what="NotReady while 0 of 2")
        assert "0 of 2 expected daemons" in cond()["message"]
        assert "nodes" not in status()

        clique = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainClique",
            "metadata": {
                "name": f"{uid}.c0ffee.1",
                "namespace": h.driver_ns,
                "labels": {COMPUTE_DOMAIN_LABEL: uid, "resource.nvidia.com/computeDomain.cliqueID": "c0ffee.1"},
            },
            "daemons": [
                {"nodeName": gb_a, "ipAddress": "10.1.0.1", "cliqueID": "c0ffee.1", "index": 0, "status": "Ready"}
            ],
        }
        for node in (gb_a, gb_b):
            h.daemon_pod(uid, node, "c0ffee.1")
        h.cluster.apply(clique)
        await eventually(lambda: len(status().get("nodes", [])) == 1 or None, what="one entry")
        assert status()["status"] == "NotReady" and "1 of 2 expected daemons registered" in cond()["message"]

        def set_daemons(*entries: tuple[str, str, int, str]) -> None:
            body = [
                {"nodeName": n, "ipAddress": ip, "cliqueID": "c0ffee.1", "index": i, "status": s}
                for n, ip, i, s in entries
            ]
            patch = json.dumps({"daemons": body})
            h.kubectl("patch", "computedomainclique", f"{uid}.c0ffee.1", "-n", h.driver_ns, "--type=merge", "-p", patch)

        set_daemons((gb_a, "10.1.0.1", 0, "Ready"), (gb_b, "10.1.0.2", 1, "Ready"))
        await eventually(lambda: status().get("status") == "Ready" or None, what="Ready")
        assert [(n["name"], n["index"], n["status"]) for n in status()["nodes"]] == [
            (gb_a, 0, "Ready"),
            (gb_b, 1, "Ready"),
        ]
        assert cond()["reason"] == "DaemonsReady" and cond()["message"] == "2 of 2 daemons ready"

        set_daemons((gb_a, "10.1.0.1", 0, "Ready"), (gb_b, "10.1.0.2", 1, "NotReady"))
        await eventually(lambda: status().get("status") == "NotReady" or None, what="NotReady again")
        assert cond()["message"] == f"1 of 2 daemons ready; node {gb_b}: NotReady"
        warnings = await eventually(
            lambda: [m for t, r, m in events_for(h, "beta") if t == "Warning" and r == "NotReady"] or None,
            what="Warning event",
        )
        assert f"node {gb_b}: NotReady" in warnings[0]

        set_daemons()
        await eventually(lambda: "nodes" not in status() or None, what="nodes omitted when empty")
        assert status()["status"] == "NotReady"
        # index 0 is serialized (checked above: (gb_a, 0, ...)), and the list is omitted when empty.
