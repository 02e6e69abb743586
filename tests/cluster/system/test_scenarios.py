"""Scenarios on 21 simulated nodes in 2 cliques (SPEC sections 5 and 7): a domain across both cliques with
unique, stable indices that every peer agrees on, a SIGKILLed daemon that restarts and converges, and two
domains at once on disjoint nodes that do not interfere even when a pod IP is reused; and what operators watch:
the chart's dashboard and alerts query only series a live scrape of the service shows."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from imex.hosts_file import SENTINEL_ADDRESS
from tests.cluster.system.conftest import cd_ready, clique_entries, daemon_pods, eventually
from tests.testbed.sim.cluster import SimCluster
from tests.testbed.sim.topology import SimNode
from tests.unit.manifests.monitoring import SYNTHESIZED, dashboard_queries, exported_series, rules, series_names

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),
]

DAEMON = "compute-domain-daemon"


async def run_domain(sim: SimCluster, name: str, nodes: list[SimNode], *, within: float = 400) -> dict[str, Any]:
    """A CD and one workload pod per node; returns the CD once it is Ready and every pod Running."""
    sim.apply(sim.compute_domain(name, num_nodes=len(nodes)))
    sim.apply([sim.workload_pod(f"{name}-{n.name}", name, n.name) for n in nodes])

    async def ready() -> dict[str, Any] | None:
        cd = cd_ready(sim, name)
        pods = [p for p in sim.items("pods", sim.workload_ns) if p["metadata"]["name"].startswith(f"{name}-")]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return cd if cd and len(running) == len(nodes) else None

    return await eventually(ready, within=within, what=f"ComputeDomain {name} Ready with {len(nodes)} pods Running")


async def remove_domain(sim: SimCluster, name: str) -> None:
    pods = [
        p["metadata"]["name"]
        for p in sim.items("pods", sim.workload_ns)
        if p["metadata"]["name"].startswith(f"{name}-")
    ]
    if pods:
        await sim.akubectl("delete", "pods", "-n", sim.workload_ns, "--wait=true", "--timeout=120s", *pods)
    await sim.akubectl("delete", "computedomain", name, "-n", sim.workload_ns, "--wait=true", "--timeout=120s")


def hosts_mapping(sim: SimCluster, pod: dict[str, Any], prefix: str) -> dict[str, str]:
    """What a daemon's /etc/hosts (its pod's, as the simulated kubelet keeps it) maps its domain's names to."""
    assert sim.runner is not None
    worker = sim.runner.worker(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert worker is not None
    out = {}
    for line in (worker.dir / "etc-hosts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].startswith(prefix):
            out[parts[1]] = parts[0]
    return out


def indices(entries: dict[str, dict[str, dict[str, Any]]]) -> dict[str, int]:
    return {node: int(e["index"]) for clique in entries.values() for node, e in clique.items()}


async def test_domain_over_two_cliques_indices_unique_stable_and_agreed_through_a_sigkill(racks: SimCluster) -> None:
    sim = racks
    nodes = list(sim.topology)  # 20 trays in 2 cliques + 1 node without NVLink
    cd = await run_domain(sim, "wide", nodes)
    uid = cd["metadata"]["uid"]
    entries = clique_entries(sim, uid)
    assert set(entries) == set(sim.topology.cliques())
    for clique, members in entries.items():
        assert set(members) == {n.name for n in sim.topology.cliques()[clique]}
        got = sorted(int(e["index"]) for e in members.values())
        assert got == sorted(set(got)) and all(0 <= i < 18 for i in got), f"clique {clique}: indices {got}"
        assert {e["status"] for e in members.values()} == {"Ready"}
    pods = daemon_pods(sim, uid)
    assert len(pods) == len(nodes)
    cpu = sim.topology.non_fabric()[0].name
    assert pods[cpu]["metadata"]["labels"]["resource.nvidia.com/computeDomain.cliqueID"] == ""

    # Every daemon of a clique maps every slot name to the same IP (the index -> IP agreement IMEX needs).
    prefix = f"compute-domain-daemon-{uid.replace('-', '')}"
    for clique, members in entries.items():
        maps = {node: hosts_mapping(sim, pods[node], prefix) for node in members}
        first = next(iter(maps.values()))
        assert all(m == first for m in maps.values()), f"clique {clique}: hosts files disagree"
        for node, entry in members.items():
            assert first[f"{prefix}-{int(entry['index']):04d}"] == entry["ipAddress"] == pods[node]["status"]["podIP"]

    # Each daemon runs the nvidia-imex of its node's driver root, mounted by the base CDI spec.
    assert sim.runner is not None
    for node in sim.topology.rack(0)[:2]:
        worker = sim.runner.worker(sim.driver_ns, pods[node.name]["metadata"]["name"])
        assert worker is not None
        assert f" {node.root / 'usr/bin/nvidia-imex'} " in (worker.dir / "bin" / "nvidia-imex").read_text()

    # The node lifecycle controller marks a node's pods NotReady while the node's lease lags (kwok's does on
    # loaded machines); the kubelet puts its own verdict back, and with it the daemon's entry and the domain.
    marked = pods[sim.topology.rack(0)[1].name]["metadata"]["name"]
    await sim.akubectl("patch", "pod", marked, "-n", sim.driver_ns, "--subresource=status", "--type=strategic",
                       "-p", '{"status":{"conditions":[{"type":"Ready","status":"False"}]}}')  # fmt: skip

    async def ready_again() -> bool:
        pod = sim.get("pod", marked, sim.driver_ns) or {}
        ready = [c["status"] for c in pod.get("status", {}).get("conditions", []) if c["type"] == "Ready"]
        now = clique_entries(sim, uid)
        return (
            ready == ["True"]
            and bool(cd_ready(sim, "wide"))
            and all(e["status"] == "Ready" for c in now.values() for e in c.values())
        )

    await eventually(ready_again, within=60, what=f"pod {marked} Ready again after the node controller's mark")

    before = indices(entries)
    victim = sim.topology.rack(1)[3]
    pod = pods[victim.name]
    assert sim.runner is not None
    process = sim.runner.processes[(f"{sim.driver_ns}/{pod['metadata']['name']}", DAEMON)]
    process.kill()  # SIGKILL to the daemon and its nvidia-imex: no cleanup runs

    async def restarted_and_converged() -> bool:
        current = sim.get("pod", pod["metadata"]["name"], sim.driver_ns)
        restarts = (current or {}).get("status", {}).get("containerStatuses", [{}])[0].get("restartCount", 0)
        now = clique_entries(sim, uid)
        ready = all(e["status"] == "Ready" for c in now.values() for e in c.values())
        return bool(restarts >= 1 and cd_ready(sim, "wide") and ready and len(indices(now)) == len(before))

    await eventually(restarted_and_converged, within=240, what="the killed daemon restarted and the domain Ready again")
    assert indices(clique_entries(sim, uid)) == before, "an index moved through a daemon restart"
    assert daemon_pods(sim, uid)[victim.name]["metadata"]["uid"] == pod["metadata"]["uid"]  # restarted in place

    await remove_domain(sim, "wide")
    await eventually(
        lambda: _nothing_left(sim, uid), within=120, what="no daemon set, clique, template, pod or node label left"
    )


async def _nothing_left(sim: SimCluster, uid: str) -> bool:
    left = [
        *sim.items("daemonsets", sim.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}"),
        *sim.items("pods", sim.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}"),
        *[c for c in sim.items("computedomaincliques", sim.driver_ns) if c["metadata"]["name"].startswith(uid)],
        *sim.items("resourceclaimtemplates", None, f"{COMPUTE_DOMAIN_LABEL}={uid}"),
        *sim.items("nodes", None, f"{COMPUTE_DOMAIN_LABEL}={uid}"),
    ]
    return not left


async def test_two_domains_on_disjoint_nodes_do_not_interfere_when_a_pod_ip_is_reused(racks: SimCluster) -> None:
    sim = racks
    r0, r1 = sim.topology.rack(0), sim.topology.rack(1)
    a_nodes, b_nodes = r0[0:2], [*r0[2:4], *r1[0:2]]
    a = await run_domain(sim, "alpha", a_nodes)
    b = await run_domain(sim, "beta", b_nodes)
    b_uid = b["metadata"]["uid"]
    b_entries = clique_entries(sim, b_uid)
    b_pods = {n: p["metadata"]["uid"] for n, p in daemon_pods(sim, b_uid).items()}
    a_ips = {
        p["status"]["podIP"]
        for p in [*sim.items("pods", sim.driver_ns), *sim.items("pods", sim.workload_ns)]
        if p["spec"].get("nodeName") in {n.name for n in a_nodes} and p["status"].get("podIP")
        and (p["metadata"].get("labels", {}).get(COMPUTE_DOMAIN_LABEL) == a["metadata"]["uid"]
             or p["metadata"]["name"].startswith("alpha-"))
    }  # fmt: skip

    await remove_domain(sim, "alpha")
    gamma = await run_domain(sim, "gamma", a_nodes)  # the same nodes: kwok hands out alpha's freed pod IPs
    g_uid = gamma["metadata"]["uid"]
    g_pods = daemon_pods(sim, g_uid)
    reused = {p["status"]["podIP"] for p in g_pods.values()} & a_ips
    assert reused, f"no pod IP was reused (alpha had {sorted(a_ips)})"

    # beta never noticed: same daemon pods (no restart), same entries, its IMEX domain intact.
    assert cd_ready(sim, "beta")
    assert {n: p["metadata"]["uid"] for n, p in daemon_pods(sim, b_uid).items()} == b_pods
    assert clique_entries(sim, b_uid) == b_entries
    for pod in daemon_pods(sim, b_uid).values():
        assert all(s.get("restartCount", 0) == 0 for s in pod["status"]["containerStatuses"])
    # gamma's daemons know only gamma's names: per-domain hostname prefixes keep the domains apart.
    g_prefix = f"compute-domain-daemon-{g_uid.replace('-', '')}"
    b_prefix = f"compute-domain-daemon-{b_uid.replace('-', '')}"
    for pod in g_pods.values():
        assert hosts_mapping(sim, pod, b_prefix) == {}
        assert set(hosts_mapping(sim, pod, g_prefix).values()) <= {p["status"]["podIP"] for p in g_pods.values()} | {
            SENTINEL_ADDRESS
        }

    await remove_domain(sim, "gamma")
    await remove_domain(sim, "beta")


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _samples(text: str, name: str, **labels: str) -> list[float]:
    return [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


async def test_dashboard_and_alerts_query_what_the_service_exports(racks: SimCluster) -> None:
    """The chart's dashboard and alert rules, against a live scrape of the controller and a node agent as the
    chart runs them (metrics on by default): every series they query is one the service exports, and the
    reference's series count what happened."""
    sim = racks
    nodes = sim.topology.rack(0)[4:6]
    await run_domain(sim, "watched", nodes)
    running = [p for p in sim.items("pods", sim.driver_ns) if p["status"].get("phase") == "Running"]
    (controller, *_) = [
        p for p in running if p["metadata"]["labels"].get("dra-driver-nvidia-gpu-component") == "controller"
    ]
    (agent,) = [
        p
        for p in running
        if p["metadata"]["labels"].get("dra-driver-nvidia-gpu-component") == "kubelet-plugin"
        and p["spec"]["nodeName"] == nodes[0].name
    ]
    scraped = {
        "controller": await asyncio.to_thread(_scrape, f"{controller['status']['podIP']}:8080"),
        "node agent": await asyncio.to_thread(_scrape, f"{agent['status']['podIP']}:8081"),
    }
    exported = set().union(*(exported_series(text) for text in scraped.values()))
    queries = dashboard_queries() + [r["expr"] for r in rules()]
    unknown = {q: sorted(series_names(q) - exported - SYNTHESIZED) for q in queries}
    assert {q: names for q, names in unknown.items() if names} == {}

    node, driver = nodes[0].name, "compute-domain.nvidia.com"
    text = scraped["node agent"]
    assert _samples(text, "nvidia_dra_requests_total", driver=driver, operation="prepare")[0] >= 2  # workload + daemon
    assert _samples(text, "nvidia_dra_request_duration_seconds_count", driver=driver, operation="prepare")[0] >= 2
    assert _samples(text, "nvidia_dra_requests_inflight", driver=driver, operation="prepare") == [0]
    assert _samples(text, "nvidia_dra_prepared_devices", node=node, driver=driver, device_type="channel") == [1]
    assert _samples(text, "nvidia_dra_prepared_devices", node=node, driver=driver, device_type="daemon") == [1]
    assert _samples(text, "computedomain_plugin_registered", node=node, driver=driver) == [1]
    text = scraped["controller"]
    assert _samples(text, "nvidia_dra_compute_domain_info", status="Ready")[0] >= 1
    assert _samples(text, "computedomain_compute_domain_ready", cd_namespace=sim.workload_ns, cd_name="watched") == [1]
    assert _samples(text, "computedomain_imex_daemons", cd_name="watched", status="Ready") == [2]
    await remove_domain(sim, "watched")
