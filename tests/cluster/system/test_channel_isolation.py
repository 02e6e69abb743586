"""Channel isolation (hostManaged, ``IMEX_ISOLATION=channel``) on one simulated rack: the chart installed with
the gate, a small channel count (24: channels 1 to 23) and 16 channel places per node; four trays of one
clique, each node agent a process of its own.

What a container "sees" here is what its runtime would create from CDI: the device nodes of the CDI devices
the kubelet stand-in recorded for the pod, looked up in the node's CDI specs (``seen``). A monitor runs through
the whole module and checks, twice a second, the promise the protocol makes: a channel prepared on a node
(its claim's CDI spec present) belongs to the record that lists that claim, and no other domain's record in
the clique holds it at the same time.

The tests build on each other (one cluster for the module): 20 domains at once, then a controller SIGKILL
and a node agent restart, then exhaustion and delete/re-create churn, then a live domain whose pod went
giving its channel back after the (shortened) idle time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, LEASES, PODS
from computedomain.plugin.cdi import IMEX_CHANNEL_DIR
from tests.cluster.system.conftest import eventually, start_sim
from tests.conftest import Cluster
from tests.testbed.kubelet import CDI_ANNOTATION, PREPARED_ANNOTATION
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.containers import cdi_edits
from tests.testbed.sim.pods import Hosting

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),
]

CHANNEL_COUNT = 24
DOMAINS = 20
LOCK_PREFIX = "cd-imex-channel-"
# Short, so that a live domain without pods gives its channel back within the test; every other domain of the
# module keeps a pod running while its channel is checked, and its verified entries keep the channel.
IDLE_RELEASE_S = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rack(cluster: Cluster) -> AsyncIterator[SimCluster]:
    config = SimConfig(
        mode="hostManaged",
        racks=1,
        trays_per_rack=4,
        non_fabric=0,
        hosting=Hosting(plugins_per_host=1),
        restart_backoff_s=1.0,
        helm_set=[
            "featureGates.IMEXChannelIsolation=true",
            "resources.computeDomains.imex.isolation=channel",
            f"resources.computeDomains.imex.channelCount={CHANNEL_COUNT}",
            "resources.computeDomains.imex.channelClaimsPerNode=16",
            f"resources.computeDomains.imex.channelIdleRelease={IDLE_RELEASE_S}s",
        ],
    )
    async for sim in start_sim(cluster, config):
        yield sim


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def monitor(rack: SimCluster) -> AsyncIterator[Monitor]:
    mon = Monitor(rack)
    task = asyncio.create_task(mon.run(), name="channel-monitor")
    yield mon
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# --- what the cluster shows ------------------------------------------------------------------------------


def spec_channels(text: str) -> set[int]:
    """Channel numbers of the device nodes of one CDI spec document (JSON)."""
    spec = json.loads(text)
    nodes = [n for d in spec.get("devices") or () for n in (d.get("containerEdits") or {}).get("deviceNodes") or ()]
    return {int(n["path"].rpartition("channel")[2]) for n in nodes if n["path"].startswith(IMEX_CHANNEL_DIR + "/")}


def seen(sim: SimCluster, pod: dict[str, Any]) -> set[int]:
    """The IMEX channels the pod's container gets: its CDI devices' device nodes under the channel dir."""
    by_claim: dict[str, list[str]] = json.loads(pod["metadata"].get("annotations", {}).get(CDI_ANNOTATION) or "{}")
    ids = [i for claim in by_claim.values() for i in claim]
    node = sim.topology.by_name[pod["spec"]["nodeName"]]
    specs = [json.loads(p.read_text()) for p in node.cdi_spec_files() if p.suffix == ".json"]
    nodes = cdi_edits(specs, ids)["deviceNodes"]
    return {int(n["path"].rpartition("channel")[2]) for n in nodes if n["path"].startswith(IMEX_CHANNEL_DIR + "/")}


async def records(sim: SimCluster) -> list[dict[str, Any]]:
    assert sim.client is not None
    return list((await sim.client.list(COMPUTE_DOMAIN_CLIQUES, namespace=sim.driver_ns)).items)


async def channel_of(sim: SimCluster) -> dict[str, int | None]:
    """domain UID -> its channel in the rack's clique (live records only)."""
    return {
        r["metadata"]["name"].partition(".")[0]: r.get("channel")
        for r in await records(sim)
        if not r["metadata"].get("deletionTimestamp")
    }


async def prepared_pods(sim: SimCluster, names: list[str]) -> list[dict[str, Any]] | None:
    assert sim.client is not None
    pods = {p["metadata"]["name"]: p for p in (await sim.client.list(PODS, namespace=sim.workload_ns)).items}
    got = [pods.get(n) for n in names]
    if not all(p and (p["metadata"].get("annotations") or {}).get(PREPARED_ANNOTATION) == "true" for p in got):
        return None
    return [p for p in got if p is not None]


def uid_of(sim: SimCluster, name: str) -> str:
    cd = sim.get("computedomain", name, sim.workload_ns)
    assert cd is not None, name
    return str(cd["metadata"]["uid"])


def ready_condition(sim: SimCluster, name: str) -> dict[str, Any]:
    cd = sim.get("computedomain", name, sim.workload_ns) or {}
    return next((c for c in (cd.get("status") or {}).get("conditions") or () if c["type"] == "Ready"), {})


@dataclass
class Monitor:
    """Checks the protocol's promise while the tests run (see the module docstring)."""

    sim: SimCluster
    samples: int = 0
    checked: int = 0  # prepared channels checked, over all samples
    violations: list[str] = field(default_factory=list)

    def _specs(self) -> dict[tuple[str, str], str]:
        """(node, claim UID) -> the claim's CDI spec text, on every node."""
        out = {}
        for node in self.sim.topology:
            for path in node.cdi_spec_files():
                if path.name.startswith("k8s.compute-domain.nvidia.com-claim_") and path.suffix == ".json":
                    with contextlib.suppress(OSError):
                        out[(node.name, path.stem.partition("_")[2])] = path.read_text()
        return out

    async def check_once(self) -> None:
        before = await asyncio.to_thread(self._specs)
        recs = await records(self.sim)
        after = await asyncio.to_thread(self._specs)
        # A spec present, unchanged, before and after the read of the records was prepared throughout it: its
        # claim was listed in a record (listed before the spec is written, released after it is removed).
        steady = {key: text for key, text in before.items() if after.get(key) == text}
        holders: dict[int, set[str]] = {}
        for r in recs:
            if r.get("channel") is not None:
                holders.setdefault(int(r["channel"]), set()).add(r["metadata"]["name"])
        for (node, claim), text in steady.items():
            for channel in spec_channels(text):
                self.checked += 1
                listing = [
                    r["metadata"]["name"]
                    for r in recs
                    if claim in {c["claimUID"] for c in r.get("preparedClaims") or ()}
                ]
                if len(listing) != 1:
                    self.violations.append(
                        f"claim {claim} on {node} has channel {channel} prepared, listed in {listing}"
                    )
                elif holders.get(channel, set()) != set(listing):
                    self.violations.append(
                        f"channel {channel} prepared on {node} for claim {claim} ({listing[0]}) is recorded for "
                        f"{sorted(holders.get(channel, set()))}"
                    )
        self.samples += 1

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a failed read is a missed sample, not a violation
                await self.check_once()
            await asyncio.sleep(0.5)

    async def assert_clean(self) -> None:
        await self.check_once()
        assert not self.violations, self.violations[:10]
        assert self.checked > 0, "the monitor found no prepared channel to check"
        print(
            f"monitor: {self.samples} samples, {self.checked} prepared channels checked, none prepared for one "
            "domain while held by another"
        )


# --- the tests -------------------------------------------------------------------------------------------


def pod_name(i: int, j: int) -> str:
    return f"d{i:02d}-w{j}"


def agent_kubectl(sim: SimCluster, node: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """kubectl in the driver namespace with the token and CA of the node agent pod on ``node``, as its kubelet
    mounts them (what a stolen token can do)."""
    assert sim.runner is not None
    agent = next(
        p
        for p in sim.items("pods", sim.driver_ns, "app.kubernetes.io/component=kubelet-plugin")
        if p["spec"]["nodeName"] == node
    )
    worker = sim.runner.worker(sim.driver_ns, agent["metadata"]["name"])
    assert worker is not None
    account = worker.dir / "serviceaccount"
    credentials = [
        f"--server={sim.local.server}", f"--certificate-authority={account / 'ca.crt'}",
        f"--token={(account / 'token').read_text()}",
    ]  # fmt: skip

    def run(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(sim.local.root / "bin" / "kubectl"), "--kubeconfig=/dev/null", *credentials, "-n", sim.driver_ns,
             *args],
            capture_output=True, text=True, input=input, timeout=60,
        )  # fmt: skip

    return run


async def test_twenty_domains_at_once_get_distinct_channels_and_each_pod_sees_only_its_own(
    rack: SimCluster, monitor: Monitor
) -> None:
    sim = rack
    nodes = [n.name for n in sim.topology]
    # Domain i runs one pod on node i % 4 and one on (i + 1) % 4: domains i and i + 4 share both their nodes.
    objects: list[dict[str, Any]] = [sim.compute_domain(f"d{i:02d}") for i in range(DOMAINS)]
    for i in range(DOMAINS):
        objects += [sim.workload_pod(pod_name(i, j), f"d{i:02d}", nodes[(i + j) % len(nodes)]) for j in range(2)]
    start = time.monotonic()
    await sim.akubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    names = [pod_name(i, j) for i in range(DOMAINS) for j in range(2)]
    pods = await eventually(lambda: prepared_pods(sim, names), within=300, what="40 pods of 20 domains prepared")
    print(f"20 domains, 40 pods prepared in {time.monotonic() - start:.1f}s")

    channels = await channel_of(sim)
    uids = {f"d{i:02d}": uid_of(sim, f"d{i:02d}") for i in range(DOMAINS)}
    got = {name: channels.get(uid) for name, uid in uids.items()}
    print("channel per domain:", json.dumps(got, sort_keys=True))
    assert len(set(got.values())) == DOMAINS, f"channels not distinct: {got}"
    assert all(isinstance(c, int) and 1 <= c < CHANNEL_COUNT for c in got.values()), got

    by_node: dict[str, dict[str, set[int]]] = {}
    for pod in pods:
        domain = pod["metadata"]["name"][:3]
        view = seen(sim, pod)
        assert view == {got[domain]}, f"pod {pod['metadata']['name']} of {domain} sees {view}, not {got[domain]}"
        by_node.setdefault(pod["spec"]["nodeName"], {})[pod["metadata"]["name"]] = view
    for node, views in sorted(by_node.items()):
        print(f"{node}: " + ", ".join(f"{pod}={sorted(v)}" for pod, v in sorted(views.items())))
    # Two domains on the same two nodes: d00 and d04 (nodes 0 and 1) see different channels on both.
    for j in range(2):
        a, b = (next(p for p in pods if p["metadata"]["name"] == pod_name(i, j)) for i in (0, 4))
        assert a["spec"]["nodeName"] == b["spec"]["nodeName"]
        assert seen(sim, a).isdisjoint(seen(sim, b))

    # The assignment is visible on the domain (status.channels, the Ready message) and the record.
    for name in ("d00", "d19"):
        cd = sim.get("computedomain", name, sim.workload_ns) or {}
        assert [c["channel"] for c in cd["status"].get("channels") or ()] == [got[name]], cd.get("status")
        assert f"IMEX channel {got[name]} in clique" in ready_condition(sim, name)["message"]
    wide = sim.kubectl("get", "computedomains", "-n", sim.workload_ns, "-o", "wide")
    assert "CHANNELS" in wide.splitlines()[0]
    await monitor.assert_clean()


async def test_a_node_agent_may_only_ask_for_a_channel_and_list_its_own_nodes_claims(
    rack: SimCluster, monitor: Monitor
) -> None:
    """The admission policy on channel records, with a node agent's own pod-bound token."""
    sim = rack
    node0, node1 = (n.name for n in sim.topology.nodes[:2])
    as_agent = agent_kubectl(sim, node0)
    d00 = f"{uid_of(sim, 'd00')}.{next(iter(sim.topology.cliques()))}"
    before = sim.get("computedomaincliques", d00, sim.driver_ns)
    assert before is not None
    own = [{"op": "add", "path": "/preparedClaims/-", "value": {"claimUID": "probe", "nodeName": node0}}]
    other = [{"op": "add", "path": "/preparedClaims/-", "value": {"claimUID": "probe2", "nodeName": node1}}]
    marked = [{"op": "add", "path": "/preparedClaims/-",
               "value": {"claimUID": "probe4", "nodeName": node0, "verified": True}}]  # fmt: skip
    # What refuses each: the CRD's write-once rule (it runs before admission), RBAC (no delete), the policy.
    why = {
        "a new channel": "channel is assigned once and never changes",
        "a delete": "cannot delete resource",
        "another node's claim": "denied request",
        "a record with a channel": "denied request",
        "an entry marked verified": "may not mark a claim verified",
    }
    refused = {
        "a new channel": as_agent("patch", "computedomainclique", d00, "--type=merge", "-p", '{"channel": 99}'),
        "another node's claim": as_agent("patch", "computedomainclique", d00, "--type=json", "-p", json.dumps(other)),
        "a delete": as_agent("delete", "computedomainclique", d00, "--wait=false"),
        "an entry marked verified": as_agent(
            "patch", "computedomainclique", d00, "--type=json", "-p", json.dumps(marked)
        ),
        "a record with a channel": as_agent("create", "-f", "-", input=json.dumps({
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainClique",
            "metadata": {"name": f"{uuid.uuid4()}.{next(iter(sim.topology.cliques()))}"},
            "channel": 5, "preparedClaims": [{"claimUID": "probe3", "nodeName": node0}],
        })),
    }  # fmt: skip
    for what, result in refused.items():
        print(f"node agent of {node0} writing {what}: {result.stderr.strip()[:240]}")
        assert result.returncode != 0 and why[what] in result.stderr, (what, result.stdout, result.stderr)
    allowed = as_agent("patch", "computedomainclique", d00, "--type=json", "-p", json.dumps(own))
    assert allowed.returncode == 0, allowed.stderr
    after = sim.get("computedomaincliques", d00, sim.driver_ns) or {}
    assert after["channel"] == before["channel"]
    assert {"claimUID": "probe", "nodeName": node0} in after["preparedClaims"]
    index = next(i for i, c in enumerate(after["preparedClaims"]) if c["claimUID"] == "probe")
    removed = as_agent("patch", "computedomainclique", d00, "--type=json", "-p",
                       json.dumps([{"op": "remove", "path": f"/preparedClaims/{index}"}]))  # fmt: skip
    assert removed.returncode == 0, removed.stderr
    await monitor.assert_clean()


async def test_assignments_unchanged_after_a_controller_sigkill_and_a_node_agent_restart(
    rack: SimCluster, monitor: Monitor
) -> None:
    sim = rack
    assert sim.runner is not None and sim.client is not None
    before = await channel_of(sim)
    seen_before = {p["metadata"]["name"]: seen(sim, p) for p in await prepared_pods(sim, [pod_name(0, 0)]) or ()}
    controller = sim.items("pods", sim.driver_ns, "app.kubernetes.io/component=controller")[0]
    node0 = sim.topology.nodes[0].name
    agent = next(
        p
        for p in sim.items("pods", sim.driver_ns, "app.kubernetes.io/component=kubelet-plugin")
        if p["spec"]["nodeName"] == node0
    )
    for pod, container in ((controller, "compute-domain"), (agent, "compute-domains")):
        sim.runner.processes[(f"{sim.driver_ns}/{pod['metadata']['name']}", container)].kill()  # SIGKILL

    async def restarted() -> bool:
        for pod in (controller, agent):
            now = sim.get("pod", pod["metadata"]["name"], sim.driver_ns) or {}
            statuses = now.get("status", {}).get("containerStatuses") or [{}]
            if statuses[0].get("restartCount", 0) < 1 or not statuses[0].get("ready"):
                return False
        return True

    await eventually(restarted, within=180, what="the SIGKILLed controller and node agent restarted and Ready")
    # A new domain after the restart gets a channel no other domain has, and a new pod of an old domain on
    # the restarted agent's node gets the domain's channel as before.
    sim.apply([sim.compute_domain("late"), sim.workload_pod("late-w0", "late", node0)])
    sim.apply(sim.workload_pod("d00-w2", "d00", node0))
    pods = await eventually(
        lambda: prepared_pods(sim, ["late-w0", "d00-w2"]), within=180, what="new pods prepared after the restarts"
    )
    after = await channel_of(sim)
    late = after.pop(uid_of(sim, "late"))
    assert after == before, "an assignment changed through the restarts"
    assert late is not None and late not in before.values(), (late, before)
    assert seen(sim, pods[0]) == {late}
    assert seen(sim, pods[1]) == {before[uid_of(sim, "d00")]} == seen_before[pod_name(0, 0)]
    print(f"after SIGKILL of the controller and a node agent: 20 assignments unchanged; new domain got {late}")
    await monitor.assert_clean()


async def test_exhaustion_names_the_limit_and_churn_never_hands_out_a_channel_still_prepared(
    rack: SimCluster, monitor: Monitor
) -> None:
    sim = rack
    # 21 domains hold a channel; two more take the last of channels 1..23.
    sim.apply([o for name in ("e1", "e2") for o in (sim.compute_domain(name), sim.workload_pod(f"{name}-w0", name))])
    await eventually(lambda: prepared_pods(sim, ["e1-w0", "e2-w0"]), within=180, what="the last two channels taken")
    held = await channel_of(sim)
    assert sorted(c for c in held.values() if c is not None) == list(range(1, CHANNEL_COUNT)), held

    sim.apply([sim.compute_domain("starved"), sim.workload_pod("starved-w0", "starved")])

    async def exhausted() -> dict[str, Any] | None:
        cond = ready_condition(sim, "starved")
        return cond if cond.get("reason") == "ChannelsExhausted" else None

    cond = await eventually(exhausted, within=120, what="the starved domain's ChannelsExhausted condition")
    print(f"exhausted: {cond['message']}")
    assert cond["status"] == "False"
    assert f"IMEX_CHANNEL_COUNT {CHANNEL_COUNT}" in cond["message"] and "NVreg_ImexChannelCount" in cond["message"]
    assert f"channels 1 to {CHANNEL_COUNT - 1}" in cond["message"]
    starved = uid_of(sim, "starved")
    assert (await channel_of(sim)).get(starved) is None

    # Delete d01 while its two pods still hold its channel: the domain goes, its record stays (terminating)
    # and keeps the channel until the last claim is unprepared; only then may the starved domain get it.
    d01 = uid_of(sim, "d01")
    freed = held[d01]
    await sim.akubectl("delete", "computedomain", "d01", "-n", sim.workload_ns, "--wait=true", "--timeout=120s")
    recs = [r for r in await records(sim) if r["metadata"]["name"].startswith(f"{d01}.")]
    assert recs, "d01's record went while its pods still hold the channel"
    rec = recs[0]
    assert rec["metadata"].get("deletionTimestamp") and rec["channel"] == freed and len(rec["preparedClaims"]) == 2
    # The controller saw both claims allocated there: their entries keep the channel, whatever becomes of them.
    assert all(c.get("verified") for c in rec["preparedClaims"]), rec["preparedClaims"]
    # The starved domain, reconciled again (an annotation), names the nodes whose claims keep d01's channel.
    holders = sorted({c["nodeName"] for c in rec["preparedClaims"]})
    await sim.akubectl("annotate", "computedomain", "starved", "-n", sim.workload_ns, "example.com/poke=1")

    async def names_the_holders() -> str | None:
        message = str(ready_condition(sim, "starved").get("message") or "")
        said = "1 of them is held by deleted ComputeDomains whose claims" in message
        return message if said and all(node in message for node in holders) else None

    print(await eventually(names_the_holders, within=60, what="the starved domain naming the nodes holding d01's"))
    await sim.akubectl("delete", "pod", pod_name(1, 0), "-n", sim.workload_ns, "--wait=true")

    async def one_claim_left() -> bool:
        recs = [r for r in await records(sim) if r["metadata"]["name"].startswith(f"{d01}.")]
        return bool(recs) and len(recs[0].get("preparedClaims") or ()) == 1

    await eventually(one_claim_left, within=60, what="one of d01's claims released")
    assert (await channel_of(sim)).get(starved) is None, "a channel still prepared was handed out"
    await sim.akubectl("delete", "pod", pod_name(1, 1), "-n", sim.workload_ns, "--wait=true")

    got = await eventually(
        lambda: channel_for(sim, starved), within=120, what="the starved domain served once d01's channel is free"
    )
    assert got == freed
    await eventually(lambda: prepared_pods(sim, ["starved-w0"]), within=120, what="the starved pod prepared")
    pods = await prepared_pods(sim, ["starved-w0"])
    assert pods is not None and seen(sim, pods[0]) == {freed}

    # Re-create d01 under the same name (a new UID): nothing is free, so it waits, and says so.
    sim.apply([sim.compute_domain("d01"), sim.workload_pod("d01-again", "d01")])
    await eventually(
        lambda: _async(ready_condition(sim, "d01").get("reason") == "ChannelsExhausted"),
        within=120,
        what="the re-created domain waiting for a channel",
    )
    # Churn: delete and re-create e1 and e2 (pods first); the waiting domain gets the lowest freed channel.
    e_channels = {held[uid_of(sim, n)] for n in ("e1", "e2")}
    await sim.akubectl("delete", "pod", "e1-w0", "e2-w0", "-n", sim.workload_ns, "--wait=true")
    await sim.akubectl("delete", "computedomain", "e1", "e2", "-n", sim.workload_ns, "--wait=true")
    new_d01 = uid_of(sim, "d01")
    got = await eventually(lambda: channel_for(sim, new_d01), within=120, what="the re-created domain served")
    assert got in e_channels, (got, e_channels)
    await monitor.assert_clean()


async def channel_for(sim: SimCluster, uid: str) -> int | None:
    return (await channel_of(sim)).get(uid)


async def _async(value: Any) -> Any:
    return value


async def test_entries_a_stolen_token_lists_never_keep_a_deleted_domains_channel(
    rack: SimCluster, monitor: Monitor
) -> None:
    """A node agent's token lists, in a live domain's record, an entry of its own node for a claim that was
    never allocated there. The controller verifies the domain's real entries and not that one, so once the
    domain and its pods are gone the record goes and its channel is free (before, such an entry kept it taken
    for as long as the token's holder liked). Marking an entry verified is not the token's to do."""
    sim = rack
    node0 = sim.topology.nodes[0].name
    as_agent = agent_kubectl(sim, node0)
    name = f"{uid_of(sim, 'd03')}.{next(iter(sim.topology.cliques()))}"
    forged = {"claimUID": str(uuid.uuid4()), "nodeName": node0}
    add = [{"op": "add", "path": "/preparedClaims/-", "value": forged}]
    added = as_agent("patch", "computedomainclique", name, "--type=json", "-p", json.dumps(add))
    assert added.returncode == 0, added.stderr

    async def verified() -> list[dict[str, Any]] | None:
        entries = (sim.get("computedomaincliques", name, sim.driver_ns) or {}).get("preparedClaims") or []
        real = [c for c in entries if c["claimUID"] != forged["claimUID"]]
        return entries if len(real) == 2 and all(c.get("verified") for c in real) else None

    entries = await eventually(verified, within=60, what="d03's two real entries verified by the controller")
    assert next(c for c in entries if c["claimUID"] == forged["claimUID"]).get("verified") is None, entries
    await sim.akubectl("delete", "pod", pod_name(3, 0), pod_name(3, 1), "-n", sim.workload_ns, "--wait=true")
    await sim.akubectl("delete", "computedomain", "d03", "-n", sim.workload_ns, "--wait=true", "--timeout=120s")

    async def gone() -> bool:
        return sim.get("computedomaincliques", name, sim.driver_ns) is None

    await eventually(gone, within=60, what="d03's record gone, the forged entry dropped, its channel free")
    await monitor.assert_clean()


async def test_a_live_domain_without_pods_gives_its_channel_back_and_gets_one_anew(
    rack: SimCluster, monitor: Monitor
) -> None:
    """Idle domains must not keep channels for good (a tenant's many idle ComputeDomains, or records a stolen
    node agent token asks for in every clique): once no claim of the domain holds its channel in a clique for
    the idle time, the controller takes it back and says so; the domain's next pod there gets one anew."""
    sim = rack
    node0 = sim.topology.nodes[0].name
    sim.apply([sim.compute_domain("idle"), sim.workload_pod("idle-w0", "idle", node0)])
    await eventually(lambda: prepared_pods(sim, ["idle-w0"]), within=120, what="the idle domain's first pod")
    uid = uid_of(sim, "idle")
    first = await channel_for(sim, uid)
    assert first is not None
    started = time.monotonic()
    await sim.akubectl("delete", "pod", "idle-w0", "-n", sim.workload_ns, "--wait=true")

    async def taken_back() -> bool:
        return not [r for r in await records(sim) if r["metadata"]["name"].startswith(f"{uid}.")]

    await eventually(taken_back, within=IDLE_RELEASE_S + 60, what="the idle domain's record retired")
    waited = time.monotonic() - started
    print(f"channel {first} taken back {waited:.1f}s after the last pod went (idle time {IDLE_RELEASE_S}s)")
    assert waited >= IDLE_RELEASE_S, "taken back before the idle time"
    events = json.loads(
        await sim.akubectl(
            "get", "events", "-n", sim.workload_ns, "--field-selector", "reason=ChannelReleased", "-o", "json"
        )
    )["items"]
    assert any(e["involvedObject"]["name"] == "idle" and f"IMEX channel {first}" in e["message"] for e in events)
    assert uid_of(sim, "idle") == uid, "the domain itself stays"
    sim.apply(sim.workload_pod("idle-w1", "idle", node0))
    pods = await eventually(lambda: prepared_pods(sim, ["idle-w1"]), within=120, what="the idle domain's next pod")
    again = await channel_for(sim, uid)
    assert again is not None and seen(sim, pods[0]) == {again}
    await monitor.assert_clean()


async def test_every_record_and_lock_goes_once_the_pods_and_domains_are_gone(
    rack: SimCluster, monitor: Monitor
) -> None:
    sim = rack
    await sim.akubectl("delete", "pods", "--all", "-n", sim.workload_ns, "--wait=true", "--timeout=180s")
    await sim.delete_compute_domains(within=180)

    async def nothing_left() -> bool:
        assert sim.client is not None
        leases = (await sim.client.list(LEASES, namespace=sim.driver_ns)).items
        locks = [x for x in leases if x["metadata"]["name"].startswith(LOCK_PREFIX)]
        return not await records(sim) and not locks

    await eventually(nothing_left, within=180, what="no channel record and no channel lock left")
    await monitor.assert_clean()
