"""A daemon that dies without SIGTERM (OOM kill, node lost) cannot remove its own entry. Once its pod is gone
too, the controller prunes the entry (after checking the pods live), the domain's status drops the node, and
the surviving daemons map the freed slot to the sentinel address: nobody keeps talking to a dead peer's IP,
which a new pod elsewhere may reuse.

Real daemon processes (``harness.Domain``, do-nothing IMEX), a real ComputeDomain, the controller in-process.
The daemons live in a namespace the controller manages through ADDITIONAL_NAMESPACES, so the domain's
DaemonSet (in the driver namespace) neither adopts nor replaces the stand-in pods.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from imex.hosts_file import SENTINEL_ADDRESS, read_block
from tests.cluster.controller.conftest import Harness, compute_domain, eventually
from tests.cluster.controller.conftest import harness as harness  # the controller tests' fixture
from tests.cluster.imex.harness import Domain, wait_until
from tests.conftest import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CLIQUE = "8f2c1d9e-0000-4000-8000-0000000000c1.3"


async def test_the_entry_of_a_daemon_killed_without_sigterm_is_pruned(
    harness: Harness, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    h = harness
    code, out = cluster.create(compute_domain("killed", num_nodes=3), namespace)
    assert code == 0, out
    uid = json.loads(out)["metadata"]["uid"]
    domain = Domain(cluster, namespace, tmp_path, imex="fake", cd_uid=uid)
    try:
        a, b, c = domain.add([("a", CLIQUE), ("b", CLIQUE), ("c", CLIQUE)])
        for n in (a, b, c):
            n.start()
        wait_until("3 registered", lambda: len(domain.entries(CLIQUE)) == 3, on_fail=domain.logs)
        slot = domain.entries(CLIQUE)[b.node]["index"]
        prefix = a.settings().hostname_prefix

        def mapped(node_hosts: Path) -> dict[str, str]:
            return {e.name: e.address for e in read_block(node_hosts, uid)}

        wait_until("a maps b", lambda: mapped(a.hosts).get(f"{prefix}-{slot:04d}") == b.ip, on_fail=domain.logs)

        async with h.controller(ADDITIONAL_NAMESPACES=namespace):

            def status_nodes() -> list[str]:
                status = h.get_json("computedomain", "killed", "-n", namespace).get("status") or {}
                return sorted(n["name"] for n in status.get("nodes") or [])

            await eventually(lambda: status_nodes() == sorted([a.node, b.node, c.node]) or None, what="3 in status")

            # b dies without any cleanup, and its pod goes (the kubelet of a lost node, a force delete).
            b.kill()
            cluster.kubectl("delete", "pod", b.pod, "-n", namespace, "--grace-period=0", "--force")
            await eventually(
                lambda: sorted(domain.entries(CLIQUE)) == sorted([a.node, c.node]) or None,
                what="b's entry pruned by the controller",
            )
            await eventually(lambda: status_nodes() == sorted([a.node, c.node]) or None, what="b gone from status")
            events = h.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=killed")["items"]
            assert any(e["reason"] == "DaemonGone" and b.node in e["message"] for e in events), events
        for survivor in (a, c):
            wait_until(
                f"{survivor.node} maps the freed slot to the sentinel",
                lambda s=survivor: mapped(s.hosts).get(f"{prefix}-{slot:04d}") == SENTINEL_ADDRESS,  # type: ignore[misc]
                on_fail=domain.logs,
            )
    finally:
        domain.cleanup()
