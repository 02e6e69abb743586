"""The chart's keys for the IMEX daemons on simulated racks, installed by helm: `controller.priorityClassName`
gives the daemon pods the class (resolved by the apiserver's priority admission to its value),
`controller.daemonResources` makes them Guaranteed, and `resources.computeDomains.imex.config` reaches the
imexd.cfg each daemon writes (and its nvidia-imex, the simulator, starts from). The domain spans two cliques
and a node without one, so it also carries the SpansCliques condition and Event naming them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from computedomain.api.constants import DRIVER_NAME
from imex.config import parse_cfg
from tests.cluster.system.conftest import cd_ready, daemon_pods, eventually, start_sim
from tests.conftest import Cluster
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.topology import KUBELET_PLUGINS

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.asyncio(loop_scope="module"),
]

CONFIG = "resources.computeDomains.imex.config"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rack(cluster: Cluster) -> AsyncIterator[SimCluster]:
    config = SimConfig(
        racks=2,
        trays_per_rack=1,
        non_fabric=1,
        helm_set=[
            f"{CONFIG}.IMEX_NODE_DISCONNECTED_GRACE_TIME=60",
            f"{CONFIG}.IMEX_ADDED_BY_TEST=yes",
            "controller.daemonResources.cpu=100m",
            "controller.daemonResources.memory=128Mi",
        ],
    )
    async for sim in start_sim(cluster, config):
        yield sim


async def test_daemon_pods_get_the_priority_class_guaranteed_qos_and_the_imex_config(rack: SimCluster) -> None:
    sim = rack
    nodes = list(sim.topology)
    sim.apply(sim.compute_domain("tuned", num_nodes=len(nodes)))
    sim.apply([sim.workload_pod(f"tuned-{n.name}", "tuned", n.name) for n in nodes])

    async def ready() -> dict[str, object] | None:
        return cd_ready(sim, "tuned")

    cd = await eventually(ready, within=300, what="ComputeDomain tuned Ready")
    uid = str(cd["metadata"]["uid"])  # type: ignore[index]
    pods = daemon_pods(sim, uid)
    assert set(pods) == {n.name for n in nodes}
    for node, pod in pods.items():
        assert pod["spec"]["priorityClassName"] == "system-node-critical", node
        assert pod["spec"]["priority"] == 2000001000, node  # the apiserver resolved the class
        assert pod["status"]["qosClass"] == "Guaranteed", node
        (daemon,) = pod["spec"]["containers"]
        assert daemon["resources"]["limits"] == daemon["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}

    for node in [n for n in nodes if n.rack is not None]:
        cfg = node.host_path(f"{KUBELET_PLUGINS}/{DRIVER_NAME}/domains/{uid}/imexd.cfg")
        values = parse_cfg(cfg.read_text(), source=str(cfg))
        assert values["IMEX_NODE_DISCONNECTED_GRACE_TIME"] == "60", node.name
        assert values["IMEX_ADDED_BY_TEST"] == "yes", node.name
        assert values["IMEX_CMD_BIND_INTERFACE_IP"] == pods[node.name]["status"]["podIP"], node.name

    # Two cliques and a node without one: the condition names every node, and an Event says so.
    (span,) = [c for c in cd["status"]["conditions"] if c["type"] == "SpansCliques"]  # type: ignore[index]
    assert span["status"] == "True" and span["reason"] == "MultipleCliques", span
    assert all(n.name in span["message"] for n in nodes), span
    events = sim.kubectl("get", "events", "-n", sim.workload_ns, "--field-selector", "involvedObject.name=tuned",
                         "-o", "jsonpath={range .items[*]}{.reason}: {.message}{'\\n'}{end}")  # fmt: skip
    assert any(line.startswith("SpansCliques: ") and "no clique: " in line for line in events.splitlines()), events

    await sim.akubectl("delete", "pods", "-n", sim.workload_ns, "--wait=true", "--timeout=120s",
                       *[f"tuned-{n.name}" for n in nodes])  # fmt: skip
    await sim.akubectl("delete", "computedomain", "tuned", "-n", sim.workload_ns, "--wait=true", "--timeout=120s")
