"""hostManaged on simulated racks: the host's IMEX service is stopped on one node, a new Prepare there fails
with a retryable message that says why (visible in the pod's Events), and succeeds once the service is back;
the other nodes are not affected."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.cluster.system.conftest import cd_ready, eventually, pod_events, start_sim
from tests.conftest import Cluster
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.pods import Hosting

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def host_racks(cluster: Cluster) -> AsyncIterator[SimCluster]:
    config = SimConfig(mode="hostManaged", racks=2, trays_per_rack=2, non_fabric=1, hosting=Hosting(plugins_per_host=5))
    async for sim in start_sim(cluster, config):
        yield sim


def phase(sim: SimCluster, name: str) -> str:
    pod: dict[str, Any] = sim.get("pod", name, sim.workload_ns) or {}
    return str(pod.get("status", {}).get("phase", ""))


async def test_stopped_host_imex_fails_prepare_retryably_until_it_is_back(host_racks: SimCluster) -> None:
    sim = host_racks
    assert sim.host_imex is not None
    sim.apply(sim.compute_domain("host"))
    await eventually(lambda: _async(cd_ready(sim, "host")), within=60, what="hostManaged CD Ready")
    assert not sim.items("daemonsets", sim.driver_ns, COMPUTE_DOMAIN_LABEL)  # no per-domain daemons in this mode

    down, healthy = sim.topology.rack(0)[0], sim.topology.rack(1)[0]
    await sim.host_imex.stop(down)
    sim.apply([sim.workload_pod("on-down", "host", down.name), sim.workload_pod("on-healthy", "host", healthy.name)])
    await eventually(
        lambda: _async(phase(sim, "on-healthy") == "Running"), within=90, what="the pod on a healthy node Running"
    )

    async def failed_with_state() -> list[str]:
        return [
            e
            for e in pod_events(sim, "on-down")
            if e.startswith("FailedPrepareDynamicResources") and "state UNAVAILABLE" in e
        ]

    # The node agent answers with the retryable error once its budget is spent, and the daemon's state and
    # output reach the pod's Events (SPEC 6), not only the agent's log.
    (event, *_) = await eventually(failed_with_state, within=150, what="FailedPrepareDynamicResources with state")
    assert phase(sim, "on-down") == "Pending"
    assert "retryable error: host nvidia-imex daemon not ready: state UNAVAILABLE" in event, event
    assert "output: " in event and "the kubelet will call again" in event, event

    await sim.host_imex.start(down)
    await eventually(
        lambda: _async(phase(sim, "on-down") == "Running"), within=150, what="the pod Running once IMEX is back"
    )
    await sim.akubectl("delete", "pods", "on-down", "on-healthy", "-n", sim.workload_ns, "--wait=true")
    await sim.delete_compute_domains()


async def _async(value: Any) -> Any:
    return value
