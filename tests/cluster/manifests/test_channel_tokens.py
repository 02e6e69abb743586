"""Channel isolation against a stolen node agent token, on the real apiserver with the chart installed
(hostManaged, ``isolation: channel``): two node agents, each with a token bound to its own pod on its own node
(the apiserver adds the node name the admission policy reads), run the product's ``ChannelRecords``; one of them
is the attacker. What must hold (docs/security.md):

* an entry is the listing node's own (claim UID and node together) and an agent trusts only its own node's
  entries: a squatted entry of the victim's claim UID never stands in for the victim's, however the writes race;
* a record is created only under its domain's own name, by a node that lists one claim of its own;
* a record gets a channel only while it lists a claim of a node of its clique (the node's
  ``nvidia.com/gpu.clique`` label): one node's token cannot take channels in other cliques;
* a record being deleted takes no fresh entries (they would keep the deleted domain's channel taken for as
  long as the token keeps writing them), and the node's cleanup does not write one there either;
* a node lists one new claim per write and at most 128 in a record (one token cannot grow a record past what
  etcd stores).
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from computedomain.api.constants import (
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    GPU_CLIQUE_NODE_LABEL,
    GROUP_VERSION,
)
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, ClientConfig, KubeClient
from computedomain.kube.errors import KubeError
from computedomain.plugin.channels import ChannelRecords
from computedomain.plugin.collaborators import DomainInfo
from tests.cluster.manifests.release import (
    SELECT_LABEL,
    bound_kubeconfig,
    helm,
    install_args,
    run_controller,
    running_pod,
    wait_for,
)
from tests.conftest import Cluster
from tests.testbed.nodes import gb200_node
from tests.testbed.sim.cluster import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

RELEASE = "compute-domain"
AGENT_SA = "compute-domain-kubelet-plugin"
CLIQUE = "7d0c9e1a-4b2f-4c3d-9e8f-1a2b3c4d5e6f.1"
OTHER_CLIQUE = "7d0c9e1a-4b2f-4c3d-9e8f-1a2b3c4d5e6f.2"


@dataclass
class Bed:
    cluster: Cluster
    ns: str
    workload_ns: str
    nodes: tuple[str, str]  # (victim, attacker)
    agents: dict[str, KubeClient]  # node -> a client with that node's agent token
    tmp: Path


@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, tuple[str, str], Path]]:
    suffix = uuid.uuid4().hex[:8]
    ns, workload = f"chtok-{suffix}", f"chtokw-{suffix}"
    for name in (ns, workload):
        cluster.kubectl("create", "namespace", name)
    selector = f"t{suffix}"
    nodes = tuple(
        gb200_node(f"chtok-{role}-{suffix}", clique=CLIQUE, labels={SELECT_LABEL: selector})
        for role in ("victim", "attacker")
    )
    for node in nodes:
        cluster.apply(node)
    helm(
        cluster,
        *install_args(
            RELEASE, ns, selector, "controller.replicas=1",
            "featureGates.HostManagedIMEXDaemon=true", "featureGates.IMEXChannelIsolation=true",
            "resources.computeDomains.imex.mode=hostManaged", "resources.computeDomains.imex.isolation=channel",
        ),
    )  # fmt: skip
    names = (nodes[0]["metadata"]["name"], nodes[1]["metadata"]["name"])
    try:
        yield ns, workload, names, tmp_path_factory.mktemp("chtok")
    finally:
        helm(cluster, "uninstall", RELEASE, "--namespace", ns, "--no-hooks", "--wait", check=False)
        for name in cluster.kubectl("get", "computedomaincliques", "-n", ns, "-o", "name", check=False).split():
            cluster.kubectl(
                "patch", name, "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )
        for name in cluster.kubectl("get", "computedomains", "-n", workload, "-o", "name", check=False).split():
            cluster.kubectl(
                "patch", name, "-n", workload, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )
        cluster.kubectl("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", check=False)
        cluster.kubectl("delete", "namespace", ns, workload, "--wait=false", check=False)
        cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(cluster: Cluster, installed: tuple[str, str, tuple[str, str], Path]) -> AsyncIterator[Bed]:
    ns, workload, nodes, tmp = installed
    agents = {}
    try:
        for node in nodes:
            pod = wait_for(lambda n=node: _agent_pod(cluster, ns, n), f"the node agent pod of {node}", timeout=90)
            kubeconfig = bound_kubeconfig(cluster, ns, AGENT_SA, pod["metadata"]["name"], tmp / f"{node}.kubeconfig")
            agents[node] = await KubeClient.connect(
                kubeconfig=kubeconfig, config=ClientConfig(qps=100, burst=200, field_manager="node-agent")
            )
        bed = Bed(cluster, ns, workload, nodes, agents, tmp)
        await _policies_in_force(bed)
        yield bed
    finally:
        for client in agents.values():
            await client.close()


def _agent_pod(cluster: Cluster, ns: str, node: str) -> dict[str, Any] | None:
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=kubelet-plugin", "-o", "json")
    )["items"]
    return next((p for p in pods if p["spec"].get("nodeName") == node), None)


async def _policies_in_force(bed: Bed) -> None:
    """The chart's admission policies take effect a while after the install (the apiserver compiles them
    in the background): until one refuses the attacker a record under another domain's name, a write that
    goes through would say nothing about them."""
    attacker_node = bed.nodes[1]
    name = f"{uuid.uuid4()}.{CLIQUE}"
    probe = _record(bed, name, str(uuid.uuid4()), [("probe", attacker_node)])

    async def refused() -> bool:
        try:
            await bed.agents[attacker_node].create(COMPUTE_DOMAIN_CLIQUES, probe, namespace=bed.ns)
        except KubeError as exc:
            assert "may only create the record" in str(exc), exc
            return True
        unpin = '{"metadata":{"finalizers":null}}'
        bed.cluster.kubectl("patch", "computedomainclique", name, "-n", bed.ns, "--type=merge", "-p", unpin)
        bed.cluster.kubectl("delete", "computedomainclique", name, "-n", bed.ns)
        return False

    await eventually(refused, within=60, what="the admission policies in force")


def _record(bed: Bed, name: str, domain_label: str, claims: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "ComputeDomainClique",
        "metadata": {
            "name": name,
            "namespace": bed.ns,
            "labels": {COMPUTE_DOMAIN_LABEL: domain_label},
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
        },
        "preparedClaims": [{"claimUID": c, "nodeName": n} for c, n in claims],
    }


def _remove(bed: Bed, name: str) -> None:
    """A record of a test gone: its finalizer off (nobody here unprepares), then deleted."""
    unpin = '{"metadata":{"finalizers":null}}'
    bed.cluster.kubectl("patch", "computedomainclique", name, "-n", bed.ns, "--type=merge", "-p", unpin, check=False)
    bed.cluster.kubectl("delete", "computedomainclique", name, "-n", bed.ns, "--wait=false", check=False)


async def _refused(call: Any) -> str:
    try:
        await call
    except KubeError as exc:
        return str(exc)
    raise AssertionError("the write was accepted")


async def _entries(bed: Bed, name: str) -> list[tuple[str, str]]:
    raw = await bed.agents[bed.nodes[0]].get(COMPUTE_DOMAIN_CLIQUES, name, namespace=bed.ns)
    return [(c["claimUID"], c["nodeName"]) for c in raw.get("preparedClaims") or ()]


async def test_a_squatted_entry_never_stands_in_for_the_victims_own(bed: Bed) -> None:
    """The attacker lists the victim's claim UID under its own node, races the victim's Prepare, and takes its
    entry off again; every round the victim's own entry is there when its acquire returns, and stays."""
    victim_node, attacker_node = bed.nodes
    victim = ChannelRecords(bed.agents[victim_node], node_name=victim_node, namespace=bed.ns)
    attacker = bed.agents[attacker_node]
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    watching = asyncio.create_task(victim.informer.run())
    try:
        await victim.informer.has_synced()
        for _ in range(8):
            domain = DomainInfo(uid=str(uuid.uuid4()), name="victim", namespace=bed.workload_ns)
            claim = str(uuid.uuid4())
            name = f"{domain.uid}.{CLIQUE}"

            async def squat(claim: str = claim, name: str = name, uid: str = domain.uid) -> None:
                await asyncio.sleep(rng.random() * 0.05)
                try:
                    await attacker.create(
                        COMPUTE_DOMAIN_CLIQUES, _record(bed, name, uid, [(claim, attacker_node)]), namespace=bed.ns
                    )
                except KubeError:
                    op = {
                        "op": "add",
                        "path": "/preparedClaims/-",
                        "value": {"claimUID": claim, "nodeName": attacker_node},
                    }
                    await attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, [op], namespace=bed.ns)

            async def acquire(domain: DomainInfo = domain, claim: str = claim) -> None:
                await asyncio.sleep(rng.random() * 0.05)
                # No controller runs in this test: the record never gets a channel, the wait times out.
                with pytest.raises(Exception, match="IMEX channel"):
                    await victim.acquire(domain, CLIQUE, claim, channel_count=2048, timeout_s=0.2)

            await asyncio.gather(squat(), acquire())
            entries = await _entries(bed, name)
            assert (claim, victim_node) in entries and (claim, attacker_node) in entries, entries
            # The attacker takes its own entry off: the victim's stays, so does the record's hold on the channel.
            index = entries.index((claim, attacker_node))
            remove = [{"op": "remove", "path": f"/preparedClaims/{index}"}]
            await attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, remove, namespace=bed.ns)
            assert await _entries(bed, name) == [(claim, victim_node)]
            # ... and the victim's entry is not the attacker's to take off (the admission policy).
            victim_index = [{"op": "remove", "path": "/preparedClaims/0"}]
            why = await _refused(attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, victim_index, namespace=bed.ns))
            assert "may only add or remove its own node's claims" in why, why
            # The victim's release takes off only its own entry.
            assert await victim.release(domain.uid, CLIQUE, claim)
            assert await _entries(bed, name) == []
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)


async def test_a_record_is_created_only_under_its_domains_name_with_one_claim_of_the_node(bed: Bed) -> None:
    _, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    d, e = str(uuid.uuid4()), str(uuid.uuid4())
    cases = {
        "another domain's name": _record(bed, f"{d}.{CLIQUE}", e, [("x", attacker_node)]),
        "no domain label": {
            **_record(bed, f"{d}.{CLIQUE}", d, [("x", attacker_node)]),
            "metadata": {"name": f"{d}.{CLIQUE}", "finalizers": [COMPUTE_DOMAIN_FINALIZER]},
        },
        "no claim": _record(bed, f"{d}.{CLIQUE}", d, []),
        "two claims": _record(bed, f"{d}.{CLIQUE}", d, [("x", attacker_node), ("y", attacker_node)]),
    }
    for what, body in cases.items():
        why = await _refused(attacker.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=bed.ns))
        print(f"{what}: {why}")
        assert "may only create the record <ComputeDomain UID>.<clique ID>" in why, (what, why)


async def test_a_record_is_created_only_with_the_finalizer_that_keeps_its_channel_and_no_owner(bed: Bed) -> None:
    """Without the finalizer (or with an owner the token may delete), deleting the record would free its
    channel at once while the domain's containers still use it: the next domain would get the same one."""
    _, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    d = str(uuid.uuid4())
    body = _record(bed, f"{d}.{CLIQUE}", d, [("x", attacker_node)])
    owner = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "name": "s", "uid": str(uuid.uuid4())}
    cases = {
        "no finalizer": {**body, "metadata": {**body["metadata"], "finalizers": []}},
        "another finalizer too": {
            **body, "metadata": {**body["metadata"], "finalizers": [COMPUTE_DOMAIN_FINALIZER, "example.com/x"]}},
        "an owner": {**body, "metadata": {**body["metadata"], "ownerReferences": [owner]}},
    }  # fmt: skip
    for what, bad in cases.items():
        why = await _refused(attacker.create(COMPUTE_DOMAIN_CLIQUES, bad, namespace=bed.ns))
        print(f"{what}: {why}")
        assert "exactly the finalizer resource.nvidia.com/computeDomain" in why, (what, why)
    created = await attacker.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=bed.ns)  # the agent's own shape
    assert created["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]


async def test_a_record_carries_only_its_domains_label_and_no_annotations(bed: Bed) -> None:
    """The apiserver bounds neither how many labels an object has nor (but for 256 KiB) its annotations: a
    token could create a record of a live domain in any clique with 1.5 MB of labels, which nobody could
    write or delete afterwards (a delete stores the deletionTimestamp), so that domain got no channel there
    while it lived. Before, both were accepted."""
    _, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    d = str(uuid.uuid4())
    name = f"{d}.{CLIQUE}"
    body = _record(bed, name, d, [("x", attacker_node)])
    meta = body["metadata"]
    cases = {
        "another label": {**body, "metadata": {**meta, "labels": {**meta["labels"], "x": "y" * 63}}},
        "an annotation": {**body, "metadata": {**meta, "annotations": {"x": "y"}}},
    }
    for what, bad in cases.items():
        why = await _refused(attacker.create(COMPUTE_DOMAIN_CLIQUES, bad, namespace=bed.ns))
        assert "only the label resource.nvidia.com/computeDomain, no annotations" in why, (what, why)
    await attacker.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=bed.ns)
    try:
        note = {"metadata": {"annotations": {"x": "y" * 1000}}}
        why = await _refused(attacker.merge_patch(COMPUTE_DOMAIN_CLIQUES, name, note, namespace=bed.ns))
        assert "annotations, generateName, finalizers and owners must stay as they are" in why, why
    finally:
        _remove(bed, name)


async def test_a_record_being_deleted_takes_no_fresh_entries(bed: Bed) -> None:
    _, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    d = str(uuid.uuid4())
    name = f"{d}.{CLIQUE}"
    await attacker.create(COMPUTE_DOMAIN_CLIQUES, _record(bed, name, d, [("x", attacker_node)]), namespace=bed.ns)
    add = {"op": "add", "path": "/preparedClaims/-", "value": {"claimUID": "y", "nodeName": attacker_node}}
    await attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, [add], namespace=bed.ns)  # while it lives: accepted
    bed.cluster.kubectl("delete", "computedomainclique", name, "-n", bed.ns, "--wait=false")
    try:
        fresh = {**add, "value": {"claimUID": "z", "nodeName": attacker_node}}
        why = await _refused(attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, [fresh], namespace=bed.ns))
        assert f"ComputeDomainClique {name} is being deleted" in why and "not list new ones" in why, why
        # Nor any write that takes nothing off: each would change its resourceVersion, and the controller's
        # release of the record is conditional on it (a token writing in a loop delayed it for as long).
        churn = {"metadata": {"managedFields": [{}]}}
        why = await _refused(attacker.merge_patch(COMPUTE_DOMAIN_CLIQUES, name, churn, namespace=bed.ns))
        assert "may only take its claims off it" in why, why
        why = await _refused(
            attacker.merge_patch(COMPUTE_DOMAIN_CLIQUES, name, {"metadata": {"generateName": "x"}}, namespace=bed.ns)
        )
        assert "generateName" in why, why
        # The node's cleanup, for a claim it holds prepared whose entry is not there, writes none either.
        records = ChannelRecords(attacker, node_name=attacker_node, namespace=bed.ns)
        assert not await records.hold(d, CLIQUE, "z")
        assert await _entries(bed, name) == [("x", attacker_node), ("y", attacker_node)]
        # Taking its own claims off stays allowed: that is how the record goes.
        assert await records.release(d, CLIQUE, "y")
        assert await records.release(d, CLIQUE, "x")
        assert await _entries(bed, name) == []
    finally:
        _remove(bed, name)


async def test_a_node_lists_one_new_claim_per_write_and_at_most_128_in_a_record(bed: Bed) -> None:
    """Unbounded, one token's entries could grow a live domain's record past what etcd stores; every later
    write of it (the other nodes' appends, the controller's marks) would then fail."""
    _, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    d = str(uuid.uuid4())
    name = f"{d}.{CLIQUE}"
    await attacker.create(COMPUTE_DOMAIN_CLIQUES, _record(bed, name, d, [("c0", attacker_node)]), namespace=bed.ns)
    try:

        def add(claim: str) -> dict[str, Any]:
            return {"op": "add", "path": "/preparedClaims/-", "value": {"claimUID": claim, "nodeName": attacker_node}}

        two = [add("two-a"), add("two-b")]
        why = await _refused(attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, two, namespace=bed.ns))
        assert "may list one new claim of its own per write" in why, why
        for i in range(1, 128):
            await attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, [add(f"c{i}")], namespace=bed.ns)
        assert len(await _entries(bed, name)) == 128
        why = await _refused(attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, [add("c128")], namespace=bed.ns))
        assert "may list at most 128 claims of its own" in why, why
    finally:
        _remove(bed, name)


async def test_an_entry_is_bounded_and_managed_fields_a_token_stored_go_with_the_next_write(bed: Bed) -> None:
    """One write of a stolen token could grow a live domain's record to what etcd stores (an entry's claim UID
    of a million characters, or ``metadata.managedFields`` as large, which the apiserver stores as sent), so
    that every later write of it failed. The CRD bounds an entry; every write of a record by a node agent or
    the controller drops the managedFields stored before it."""
    victim_node, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    d = str(uuid.uuid4())
    name = f"{d}.{CLIQUE}"
    await attacker.create(COMPUTE_DOMAIN_CLIQUES, _record(bed, name, d, [("c0", attacker_node)]), namespace=bed.ns)
    try:
        long = {"op": "add", "path": "/preparedClaims/-", "value": {"claimUID": "u" * 65, "nodeName": attacker_node}}
        why = await _refused(attacker.json_patch(COMPUTE_DOMAIN_CLIQUES, name, [long], namespace=bed.ns))
        assert "claimUID" in why and "64" in why, why
        fields = {"f:preparedClaims": {f"f:x{i:06d}": {} for i in range(20_000)}}
        entry = {"manager": "attacker", "operation": "Update", "apiVersion": GROUP_VERSION,
                 "fieldsType": "FieldsV1", "fieldsV1": fields, "time": "2026-12-07T00:00:00Z"}  # fmt: skip
        bloat = {"metadata": {"managedFields": [entry]}}
        await attacker.merge_patch(COMPUTE_DOMAIN_CLIQUES, name, bloat, namespace=bed.ns)

        async def managed_bytes() -> int:
            raw = await bed.agents[victim_node].get(COMPUTE_DOMAIN_CLIQUES, name, namespace=bed.ns)
            return len(json.dumps(raw["metadata"].get("managedFields") or []))

        assert await managed_bytes() > 200_000, "the apiserver stored them"
        victim = ChannelRecords(bed.agents[victim_node], node_name=victim_node, namespace=bed.ns)
        domain = DomainInfo(uid=d, name="victim", namespace=bed.workload_ns)
        with pytest.raises(Exception, match="IMEX channel"):  # no controller here: no channel comes
            await victim.acquire(domain, CLIQUE, str(uuid.uuid4()), channel_count=2048, timeout_s=0.2)
        assert len(await _entries(bed, name)) == 2
        assert await managed_bytes() < 4096
    finally:
        _remove(bed, name)


async def test_a_record_gets_a_channel_only_from_a_node_of_its_clique(bed: Bed) -> None:
    """With the real controller: a record of a clique its listing node is not in waits, the same domain's
    record in the node's clique gets its channel; once the node's label names the clique, the other does too."""
    c = bed.cluster
    victim_node, attacker_node = bed.nodes
    attacker = bed.agents[attacker_node]
    pod = wait_for(lambda: running_pod(c, bed.ns, "app.kubernetes.io/component=controller"), "controller pod")
    controller = run_controller(c, pod, bed.tmp, bed.workload_ns)
    try:
        uids = []
        for name in ("team-a", "team-b"):
            c.apply(
                {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "ComputeDomain",
                    "metadata": {"name": name, "namespace": bed.workload_ns},
                    "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
                }
            )
            uids.append(str(c.get("computedomain", name, bed.workload_ns)["metadata"]["uid"]))
        a, b = uids
        # The attacker's node is in CLIQUE: it asks for team-a in OTHER_CLIQUE (a flood elsewhere), then for
        # team-b in its own clique. One controller pass sees both (one clique key, one watch, in order).
        elsewhere, own = f"{a}.{OTHER_CLIQUE}", f"{b}.{OTHER_CLIQUE}"
        await attacker.create(
            COMPUTE_DOMAIN_CLIQUES, _record(bed, elsewhere, a, [("x", attacker_node)]), namespace=bed.ns
        )
        c.kubectl("label", "node", victim_node, "--overwrite", f"{GPU_CLIQUE_NODE_LABEL}={OTHER_CLIQUE}")
        victim = bed.agents[victim_node]
        await victim.create(COMPUTE_DOMAIN_CLIQUES, _record(bed, own, b, [("y", victim_node)]), namespace=bed.ns)

        def channel(name: str) -> int | None:
            obj = c.get("computedomainclique", name, bed.ns)
            return None if obj is None else obj.get("channel")

        wait_for(lambda: channel(own), "the record of the victim's own clique gets a channel", timeout=60)
        assert channel(elsewhere) is None
        # The attacker's node really moves to OTHER_CLIQUE (its label says so): then its record counts.
        c.kubectl("label", "node", attacker_node, "--overwrite", f"{GPU_CLIQUE_NODE_LABEL}={OTHER_CLIQUE}")
        wait_for(lambda: channel(elsewhere), "the record gets a channel once its node is in the clique", timeout=60)
        assert channel(elsewhere) != channel(own)
    finally:
        c.kubectl("delete", "computedomains", "--all", "-n", bed.workload_ns, "--wait=false", check=False)
        wait_for(
            lambda: not c.kubectl("get", "computedomains", "-n", bed.workload_ns, "-o", "name", check=False).strip(),
            "the domains torn down",
            timeout=90,
        )
        controller.terminate()
        controller.wait(timeout=30)
