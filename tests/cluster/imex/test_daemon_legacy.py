"""Legacy gates (still supported): IMEXDaemonsWithDNSNames=false, ComputeDomainCliques=false.

Entries live in the ComputeDomain's ``status.nodes`` (each daemon writes only its own, conflict-safe);
``nodes.cfg`` lists the clique's peer IPs ordered by index; IMEX starts only once ``spec.numNodes`` daemons
registered, and a change of the peer list restarts it (a new pid), unlike DNS-names mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.imex.harness import Domain, ProbeKubelet, wait_until
from tests.conftest import Cluster

pytestmark = pytest.mark.cluster

CLIQUE = "5a1b2c3d-0000-4000-8000-0000000000d2.3"
LEGACY_ENV = {
    "FEATURE_GATES": "IMEXDaemonsWithDNSNames=false,ComputeDomainCliques=false",
    "IMEX_SIGUSR1_INTERVAL": "1",
    "IMEX_SIM_SIGUSR1_INTERVAL": "1",
    "IMEX_SIM_HEARTBEAT_INTERVAL": "0.2",
    "IMEX_SIM_RECONNECT_INTERVAL": "0.1",
    "IMEX_RESTART_BACKOFF_INITIAL": "0.5",
    "CHECK_TIMEOUT": "5",
}


@pytest.fixture
def domain(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Domain]:
    cd = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "cd", "namespace": namespace},
        "spec": {"numNodes": 3, "channel": {"resourceClaimTemplate": {"name": "cd-channel"}}},
    }
    cluster.apply(cd, namespace)
    uid = cluster.get("computedomain", "cd", namespace)["metadata"]["uid"]
    d = Domain(cluster, namespace, tmp_path, imex="simulator", env=LEGACY_ENV, cd_uid=uid)
    yield d
    d.cleanup()


def status_nodes(domain: Domain) -> dict[str, dict[str, Any]]:
    cd = domain.cluster.get("computedomain", "cd", domain.namespace)
    return {n["name"]: n for n in (cd.get("status") or {}).get("nodes") or []}


def test_legacy_ip_mode_waits_for_num_nodes_and_restarts_on_membership_change(domain: Domain) -> None:
    nodes = domain.add([(f"l{i}", CLIQUE) for i in range(3)])
    with ProbeKubelet(domain, nodes):
        for n in nodes[:2]:
            n.start()
        wait_until("two registered in status.nodes", lambda: len(status_nodes(domain)) == 2, on_fail=domain.logs)
        wait_until(
            "both saw the two entries and wait for numNodes",
            lambda: all("fewer daemons registered than spec.numNodes" in n.log() for n in nodes[:2]),
            on_fail=domain.logs,
        )
        for n in nodes[:2]:
            assert "started nvidia-imex" not in n.log()
            assert not (n.dir / "imexd" / "nodes.cfg").exists()

        nodes[2].start()

        def ready(group: list[Any]) -> bool:
            entries = status_nodes(domain)
            return all(
                (s := n.sim_status()) is not None
                and s["state"] == "READY"
                and entries.get(n.node, {}).get("status") == "Ready"
                and entries[n.node]["ipAddress"] == n.ip
                for n in group
            )

        wait_until("all three READY", lambda: ready(nodes), on_fail=domain.logs)
        entries = status_nodes(domain)
        assert sorted(e["index"] for e in entries.values()) == [0, 1, 2]
        by_index = [n.ip for n in sorted(nodes, key=lambda n: entries[n.node]["index"])]
        for n in nodes:
            assert (n.dir / "imexd" / "nodes.cfg").read_text().split() == by_index
            assert n.sim_status()["node_id"] == entries[n.node]["index"]  # type: ignore[index]
        pids = {n.node: n.sim_status()["pid"] for n in nodes}  # type: ignore[index]

        # A member leaves and comes back on a new pod IP: with three entries again, the list changed, so
        # every IMEX restarts with the new nodes.cfg (a new pid), keeping the same index.
        moved = nodes[0]
        moved.kill()
        domain.replace_pod(moved, domain.new_ip())
        moved.start()
        wait_until(
            "READY again with the moved member",
            lambda: ready(nodes) and all(n.sim_status()["pid"] != pids[n.node] for n in nodes[1:]),  # type: ignore[index]
            on_fail=domain.logs,
        )
        after = status_nodes(domain)
        assert {k: v["index"] for k, v in after.items()} == {k: v["index"] for k, v in entries.items()}
        for n in nodes[1:]:
            assert moved.ip in (n.dir / "imexd" / "nodes.cfg").read_text().split()
            assert "restarting nvidia-imex reason=peer list changed" in n.log()
        cd = domain.cluster.get("computedomain", "cd", domain.namespace)
        assert set(cd["status"]["nodes"][0]) == {"name", "ipAddress", "cliqueID", "index", "status"}
        assert cd["spec"]["numNodes"] == 3  # the status subresource write left the spec alone
