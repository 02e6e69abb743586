"""Several pods of one ComputeDomain on one node (design note 0014), on one simulated NVL72 rack of 18 trays:
4 pods of one domain on every tray share channel 0 with one IMEX daemon per tray; a pod of another domain
pinned to a held tray stays Pending with the scheduler's reason, never ContainerCreating; once the first
domain's pods are gone the tray is free and the other domain's pod runs there."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import yaml

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.cluster.system.conftest import cd_ready, daemon_pods, eventually, pod_events, start_sim
from tests.conftest import Cluster
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.pods import CDI_ANNOTATION, Hosting

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),
]

PODS_PER_TRAY = 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rack(cluster: Cluster) -> AsyncIterator[SimCluster]:
    config = SimConfig(
        racks=1,
        trays_per_rack=18,
        non_fabric=0,
        hosting=Hosting(plugins_per_host=6, imex_fork_server=True),
        restart_backoff_s=1.0,
    )
    async for sim in start_sim(cluster, config):
        yield sim


def pods_of(sim: SimCluster, prefix: str) -> list[dict[str, Any]]:
    return [p for p in sim.items("pods", sim.workload_ns) if p["metadata"]["name"].startswith(prefix)]


def channel_nodes(sim: SimCluster, pod: dict[str, Any]) -> list[str]:
    node = sim.topology.by_name[pod["spec"]["nodeName"]]
    annotation = (pod["metadata"].get("annotations") or {}).get(CDI_ANNOTATION, "{}")
    ids = {i for ids in json.loads(annotation).values() for i in ids}
    paths = []
    for spec_file in node.cdi_spec_files():
        spec = yaml.safe_load(spec_file.read_text())
        for device in spec.get("devices") or ():
            if f"{spec['kind']}={device['name']}" in ids:
                paths += [d["path"] for d in (device.get("containerEdits") or {}).get("deviceNodes") or ()]
    return paths


def slice_devices(sim: SimCluster, node: str) -> list[tuple[str, str | None]]:
    listed = json.loads(sim.kubectl("get", "resourceslices", "--field-selector", f"spec.nodeName={node}", "-o", "json"))
    (item,) = listed["items"]
    return [(d["name"], (d.get("attributes") or {}).get("domain", {}).get("string")) for d in item["spec"]["devices"]]


async def test_four_pods_per_tray_then_another_domain_after_the_last(rack: SimCluster) -> None:
    sim = rack
    trays = [n.name for n in sim.topology.rack(0)]
    sim.apply(sim.compute_domain("quad", num_nodes=len(trays)))
    sim.apply([sim.workload_pod(f"quad-{t}-{i}", "quad", t) for t in trays for i in range(PODS_PER_TRAY)])

    async def all_running() -> dict[str, Any] | None:
        pods = pods_of(sim, "quad-")
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        cd = cd_ready(sim, "quad")
        return cd if cd and len(running) == len(trays) * PODS_PER_TRAY else None

    cd = await eventually(all_running, within=600, what=f"{len(trays) * PODS_PER_TRAY} pods of one domain Running")
    uid = cd["metadata"]["uid"]
    per_node = Counter(p["spec"]["nodeName"] for p in pods_of(sim, "quad-"))
    assert per_node == dict.fromkeys(trays, PODS_PER_TRAY)
    assert sorted(daemon_pods(sim, uid)) == sorted(trays), "one IMEX daemon per tray"
    first = trays[0]
    assert slice_devices(sim, first)[0] == ("channel-0", uid)
    assert {d for _, d in slice_devices(sim, first) if _.startswith("channel-")} == {uid}

    # Every pod of a tray got channel 0 (the CDI devices the simulated kubelet gave each container).
    for i in range(PODS_PER_TRAY):
        pod = sim.get("pod", f"quad-{first}-{i}", sim.workload_ns) or {}
        assert channel_nodes(sim, pod) == ["/dev/nvidia-caps-imex-channels/channel0"], pod["metadata"]["name"]

    # Another domain's pod pinned to a held tray: Pending, with the scheduler's reason; never on the node.
    sim.apply(sim.compute_domain("other", num_nodes=1))
    sim.apply([sim.workload_pod("other-0", "other", first)])

    async def unschedulable() -> list[str] | None:
        events = [e for e in pod_events(sim, "other-0") if e.startswith("FailedScheduling")]
        return events or None

    events = await eventually(unschedulable, within=60, what="other-0 FailedScheduling")
    assert any("claim" in e for e in events), events
    pod = sim.get("pod", "other-0", sim.workload_ns) or {}
    assert not pod["spec"].get("nodeName"), "never placed on a node another domain holds"

    # Deleting the tray's pods one by one unprepares each; after the last the tray is free for "other".
    for i in range(PODS_PER_TRAY):
        await sim.akubectl("delete", "pod", f"quad-{first}-{i}", "-n", sim.workload_ns, "--wait=true")
        node = sim.get("node", first) or {}
        labels = node["metadata"].get("labels") or {}
        if i < PODS_PER_TRAY - 1:
            assert labels.get(COMPUTE_DOMAIN_LABEL) == uid, f"label kept while {PODS_PER_TRAY - 1 - i} pods run"
            assert (sim.get("pod", "other-0", sim.workload_ns) or {})["spec"].get("nodeName") is None

    async def other_running() -> bool:
        pod = sim.get("pod", "other-0", sim.workload_ns) or {}
        return pod.get("spec", {}).get("nodeName") == first and pod.get("status", {}).get("phase") == "Running"

    await eventually(other_running, within=120, what="other-0 Running on the freed tray")
    node = sim.get("node", first) or {}
    other_uid = (sim.get("computedomain", "other", sim.workload_ns) or {})["metadata"]["uid"]
    assert node["metadata"]["labels"].get(COMPUTE_DOMAIN_LABEL) == other_uid
