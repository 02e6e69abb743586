"""The whole system on simulated NVL72 racks (tests/testbed/sim): chart installed by helm, every pod of it a
real process. One simulated cluster per module (installing takes tens of seconds on two cores); tests in a
module share it and clean their ComputeDomains up."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.conftest import Cluster
from tests.testbed.sim.cluster import SimCluster, SimConfig, eventually
from tests.testbed.sim.pods import Hosting

__all__ = ["cd_ready", "clique_entries", "eventually", "start_sim"]


async def start_sim(cluster: Cluster, config: SimConfig) -> AsyncIterator[SimCluster]:
    async with SimCluster(cluster.local, config) as sim:
        await sim.wait_installed(within=300)
        yield sim


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def racks(cluster: Cluster) -> AsyncIterator[SimCluster]:
    """2 racks x 10 trays (2 cliques) + 1 non-fabric node = 21 nodes; node agents seven to a process, IMEX
    daemons one process each (scenarios SIGKILL single daemons), their simulators started by the fork server
    (as the 72-node benchmark starts them)."""
    config = SimConfig(
        racks=2,
        trays_per_rack=10,
        non_fabric=1,
        hosting=Hosting(plugins_per_host=7, imex_fork_server=True),
        restart_backoff_s=1.0,
    )
    async for sim in start_sim(cluster, config):
        yield sim


def cd_ready(sim: SimCluster, name: str) -> dict[str, Any] | None:
    cd = sim.get("computedomain", name, sim.workload_ns)
    return cd if cd and (cd.get("status") or {}).get("status") == "Ready" else None


def clique_entries(sim: SimCluster, cd_uid: str) -> dict[str, dict[str, dict[str, Any]]]:
    """clique ID -> node -> entry."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for clique in sim.items("computedomaincliques", sim.driver_ns):
        name = clique["metadata"]["name"]
        if name.startswith(f"{cd_uid}."):
            out[name.partition(".")[2]] = {d["nodeName"]: d for d in clique.get("daemons") or ()}
    return out


def daemon_pods(sim: SimCluster, cd_uid: str) -> dict[str, dict[str, Any]]:
    """node -> the (scheduled, not terminating) daemon pod of the CD there."""
    pods = sim.items("pods", sim.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={cd_uid}")
    return {
        p["spec"]["nodeName"]: p
        for p in pods
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    }


def pod_events(sim: SimCluster, name: str) -> list[str]:
    out = sim.kubectl(
        "get", "events", "-n", sim.workload_ns, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    )
    return [f"{e.get('reason')}: {e.get('message')}" for e in json.loads(out)["items"]]
