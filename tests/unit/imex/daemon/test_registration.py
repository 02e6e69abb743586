"""Index allocation, merging of our own entry, owner references, and many registries racing on one API."""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

import pytest

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ReadyStatus
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, KubeClient
from imex.daemon.registration import (
    CliqueBackend,
    DaemonEntry,
    Identity,
    IndexExhausted,
    RegistrationError,
    Registry,
    StatusBackend,
    allocate_index,
    desired_entry,
    merge_owner_reference,
    pod_owner_reference,
)
from tests.unit.imex.daemon.fakes import FakeApi

CD = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"
A = "cluster-a.0"
B = "cluster-b.1"
NS = "nvidia-dra"
R = ReadyStatus.READY
N = ReadyStatus.NOT_READY


def e(node: str, index: int, clique: str = A, ip: str | None = None, status: ReadyStatus = N) -> DaemonEntry:
    return DaemonEntry(node, ip or f"10.0.0.{index + 1}", clique, index, status)


ME = Identity("me", "10.9.9.9", A)

# (case, entries, max_nodes, expected index)
ALLOCATION_CASES: list[tuple[str, list[DaemonEntry], int, int]] = [
    ("empty object: slot 0", [], 18, 0),
    ("first free after 0,1", [e("n0", 0), e("n1", 1)], 18, 2),
    ("fills the lowest gap", [e("n0", 0), e("n2", 2), e("n3", 3)], 18, 1),
    ("keeps own index even above a gap", [e("n0", 0), e("me", 5, ip="10.0.0.99")], 18, 5),
    ("keeps own index after an IP change", [e("me", 3, ip="10.1.1.1"), e("n0", 0)], 18, 3),
    ("other cliques' indices do not count", [e("x0", 0, B), e("x1", 1, B)], 18, 0),
    ("own entry in another clique is not ours here", [e("me", 4, B), e("n0", 0)], 18, 1),
    ("own index out of range (max lowered) moves", [e("me", 20), e("n0", 0)], 18, 1),
    ("own negative index moves", [e("me", -1)], 18, 0),
    ("duplicate index, we sort first: keep", [e("me", 2), e("zz", 2), e("n0", 0)], 18, 2),
    ("duplicate index, other sorts first: move", [e("aa", 2), e("me", 2), e("n0", 0)], 18, 1),
    ("last free slot", [e(f"n{i}", i) for i in range(17)], 18, 17),
    ("peers above max are no obstacle", [e("n0", 0), e("big", 40)], 3, 1),
    ("max 1, empty", [], 1, 0),
]


@pytest.mark.parametrize(
    ("case", "entries", "max_nodes", "want"), ALLOCATION_CASES, ids=[c[0] for c in ALLOCATION_CASES]
)
def test_allocate_index(case: str, entries: list[DaemonEntry], max_nodes: int, want: int) -> None:
    got = allocate_index(entries, ME, max_nodes)
    assert got == want, case
    holders = {x.index for x in entries if x.clique_id == ME.clique_id and x.node_name != ME.node_name}
    # The invariant behind every row: never an index another entry of our clique... unless we win a tie.
    if got in holders:
        assert case.startswith("duplicate index, we sort first")


def test_full_clique_is_a_clear_error() -> None:
    entries = [e(f"n{i:02d}", i) for i in range(18)]
    with pytest.raises(IndexExhausted) as err:
        allocate_index(entries, ME, 18)
    message = str(err.value)
    assert "all 18 IMEX slots are held" in message
    assert "node me cannot join" in message
    assert "MAX_NODES_PER_IMEX_DOMAIN" in message
    assert "0=n00" in message and "17=n17" in message


def test_full_clique_still_keeps_our_own_slot() -> None:
    entries = [e(f"n{i:02d}", i) for i in range(17)] + [e("me", 17)]
    assert allocate_index(entries, ME, 18) == 17


def test_desired_entry_sets_our_ip_clique_and_status_and_keeps_the_index() -> None:
    entries = [e("n0", 0), e("me", 4, ip="10.0.0.50", status=R)]
    want = desired_entry(entries, ME, N, 18)
    assert want == DaemonEntry("me", "10.9.9.9", A, 4, N)


@pytest.mark.parametrize(
    ("refs", "expect_added"),
    [
        ([], True),
        ([{"apiVersion": "v1", "kind": "Pod", "name": "other", "uid": "u-other"}], True),
        ([{"apiVersion": "v1", "kind": "Pod", "name": "me", "uid": "u-me"}], False),
        ([{"apiVersion": "v1", "kind": "Pod", "name": "renamed", "uid": "u-me"}], False),
    ],
)
def test_merge_owner_reference_adds_ours_and_keeps_others(refs: list[dict[str, Any]], expect_added: bool) -> None:
    own = pod_owner_reference("me", "u-me")
    merged = merge_owner_reference(refs, own)
    if not expect_added:
        assert merged is None
        return
    assert merged is not None
    assert merged[: len(refs)] == refs
    assert merged[-1] == own


# --------------------------------------------------------------------------------------------------------
# The executor against the fake API


def clique_registry(api: FakeApi, node: str, clique: str, ip: str, **kw: Any) -> Registry:
    return Registry(
        cast(KubeClient, api),
        CliqueBackend(namespace=NS, cd_uid=CD, clique_id=clique),
        Identity(node, ip, clique),
        max_nodes=kw.pop("max_nodes", 18),
        owner=pod_owner_reference(f"pod-{node}", f"uid-{node}-{ip}"),
        rng=random.Random(node),
        **kw,
    )


async def test_first_registration_creates_the_clique_with_labels_owner_and_entry() -> None:
    api = FakeApi()
    reg = clique_registry(api, "gb-1", A, "10.0.0.7")
    entry = await reg.register()
    assert entry == DaemonEntry("gb-1", "10.0.0.7", A, 0, N)
    obj = api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{A}")
    assert obj is not None
    assert obj["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: CD, CLIQUE_LABEL: A}
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "pod-gb-1", "uid": "uid-gb-1-10.0.0.7"}
    ]
    assert obj["daemons"] == [
        {"nodeName": "gb-1", "ipAddress": "10.0.0.7", "cliqueID": A, "index": 0, "status": "NotReady"}
    ]


async def test_registration_touches_only_our_entry_and_keeps_unknown_fields() -> None:
    api = FakeApi()
    other = {
        "nodeName": "gb-0",
        "ipAddress": "10.0.0.1",
        "cliqueID": A,
        "index": 0,
        "status": "Ready",
        "future": {"x": 1},
    }
    mine_before = {
        "nodeName": "gb-1",
        "ipAddress": "10.0.0.2",
        "cliqueID": A,
        "index": 3,
        "status": "Ready",
        "extra": "kept",
    }
    api.put(
        COMPUTE_DOMAIN_CLIQUES,
        NS,
        {
            "metadata": {
                "name": f"{CD}.{A}",
                "namespace": NS,
                "ownerReferences": [{"uid": "someone", "name": "p0", "kind": "Pod", "apiVersion": "v1"}],
            },
            "daemons": [other, mine_before],
        },
    )
    reg = clique_registry(api, "gb-1", A, "10.0.0.99")  # restarted pod: new IP
    entry = await reg.register()
    assert entry.index == 3
    obj = api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{A}")
    assert obj is not None
    assert obj["daemons"][0] == other
    assert obj["daemons"][1] == {**mine_before, "ipAddress": "10.0.0.99", "status": "NotReady"}
    assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == ["someone", "uid-gb-1-10.0.0.99"]


async def test_no_write_when_nothing_changes() -> None:
    api = FakeApi()
    reg = clique_registry(api, "gb-1", A, "10.0.0.7")
    await reg.register()
    writes = api.writes
    await reg.register()
    assert api.writes == writes
    assert not reg.needs_write(api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{A}"))


async def test_set_status_and_unregister_only_with_our_ip() -> None:
    api = FakeApi()
    reg = clique_registry(api, "gb-1", A, "10.0.0.7")
    await reg.register()
    await reg.set_status(R)
    obj = api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{A}")
    assert obj is not None and obj["daemons"][0]["status"] == "Ready"
    # A replacement pod on the same node took the entry over with a new IP: the old pod must not remove it.
    old = clique_registry(api, "gb-1", A, "10.0.0.1")
    assert await old.unregister() is False
    assert await reg.unregister() is True
    obj = api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{A}")
    assert obj is not None and obj["daemons"] == []


async def test_refuses_a_clique_object_of_another_domain() -> None:
    api = FakeApi()
    api.put(
        COMPUTE_DOMAIN_CLIQUES,
        NS,
        {
            "metadata": {"name": f"{CD}.{A}", "namespace": NS, "labels": {COMPUTE_DOMAIN_LABEL: "someone-else"}},
            "daemons": [],
        },
    )
    with pytest.raises(RegistrationError, match="not our ComputeDomain"):
        await clique_registry(api, "gb-1", A, "10.0.0.7").register()


async def test_full_clique_raises_through_the_executor() -> None:
    api = FakeApi()
    for i in range(3):
        await clique_registry(api, f"gb-{i}", A, f"10.0.0.{i + 1}", max_nodes=3).register()
    with pytest.raises(IndexExhausted):
        await clique_registry(api, "gb-9", A, "10.0.0.9", max_nodes=3).register()


@pytest.mark.parametrize("seed", range(8))
async def test_many_daemons_racing_in_two_cliques_get_unique_stable_indices(seed: int) -> None:
    api = FakeApi(seed)
    nodes = [(f"a-{i:02d}", A) for i in range(12)] + [(f"b-{i:02d}", B) for i in range(9)]
    random.Random(seed).shuffle(nodes)
    regs = {
        node: clique_registry(api, node, clique, f"10.{ord(clique[8])}.0.{i}") for i, (node, clique) in enumerate(nodes)
    }
    await asyncio.gather(*(r.register() for r in regs.values()))
    assert api.conflicts > 0, "the race must have produced conflicts to be meaningful"

    def indices(clique: str) -> dict[str, int]:
        obj = api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{clique}")
        assert obj is not None
        return {d["nodeName"]: d["index"] for d in obj["daemons"]}

    first = {clique: indices(clique) for clique in (A, B)}
    for clique, count in ((A, 12), (B, 9)):
        assert len(first[clique]) == count
        assert sorted(first[clique].values()) == list(range(count))  # unique, dense, below the max

    # Restart a third of them (crash: entry kept; new pod IP) while the others flip their status.
    rng = random.Random(seed + 100)
    restarted = rng.sample(sorted(regs), 7)
    again = []
    for i, node in enumerate(restarted):
        clique = regs[node].me.clique_id
        regs[node] = clique_registry(api, node, clique, f"10.99.{i}.1")
        again.append(regs[node].register())
    others = [regs[n].set_status(R) for n in regs if n not in restarted]
    await asyncio.gather(*again, *others)
    assert {clique: indices(clique) for clique in (A, B)} == first

    # Graceful stops free slots; newcomers fill exactly those, survivors never move.
    leaving = [n for n in sorted(regs) if n.startswith("a-")][:3]
    await asyncio.gather(*(regs[n].unregister() for n in leaving))
    freed = sorted(first[A][n] for n in leaving)
    newcomers = [clique_registry(api, f"a-new-{i}", A, f"10.77.0.{i}") for i in range(4)]
    await asyncio.gather(*(r.register() for r in newcomers))
    after = indices(A)
    for node, index in first[A].items():
        if node not in leaving:
            assert after[node] == index
    new_indices = sorted(after[f"a-new-{i}"] for i in range(4))
    assert new_indices == [*freed, 12]


async def test_legacy_status_backend_writes_only_our_entry_in_status_nodes() -> None:
    api = FakeApi()
    api.put(
        COMPUTE_DOMAINS,
        "user-ns",
        {
            "metadata": {"name": "cd1", "namespace": "user-ns", "uid": CD},
            "spec": {"numNodes": 3, "channel": {"resourceClaimTemplate": {"name": "t"}}},
            "status": {
                "status": "NotReady",
                "nodes": [{"name": "x0", "ipAddress": "10.1.0.1", "cliqueID": B, "index": 0, "status": "Ready"}],
            },
        },
    )

    def reg(node: str, ip: str) -> Registry:
        return Registry(
            cast(KubeClient, api),
            StatusBackend(namespace="user-ns", name="cd1", cd_uid=CD),
            Identity(node, ip, A),
            max_nodes=18,
            owner=pod_owner_reference(node, node),
        )

    await asyncio.gather(reg("n1", "10.0.0.1").register(), reg("n2", "10.0.0.2").register())
    obj = api.read(COMPUTE_DOMAINS, "user-ns", "cd1")
    assert obj is not None
    nodes = {n["name"]: n for n in obj["status"]["nodes"]}
    assert nodes["x0"]["index"] == 0 and nodes["x0"]["status"] == "Ready"  # another clique's entry untouched
    assert sorted(nodes[n]["index"] for n in ("n1", "n2")) == [0, 1]  # own clique: 0 is free despite x0
    assert obj["status"]["status"] == "NotReady"
    assert "ownerReferences" not in obj["metadata"]


async def test_legacy_status_backend_refuses_a_recreated_domain_and_never_creates_one() -> None:
    api = FakeApi()
    backend = StatusBackend(namespace="user-ns", name="cd1", cd_uid=CD)
    reg = Registry(
        cast(KubeClient, api), backend, Identity("n1", "10.0.0.1", A), max_nodes=18, owner={}, max_attempts=2
    )
    with pytest.raises(RegistrationError, match="does not exist"):
        await reg.register()
    api.put(
        COMPUTE_DOMAINS,
        "user-ns",
        {"metadata": {"name": "cd1", "namespace": "user-ns", "uid": "other-uid"}, "spec": {}},
    )
    with pytest.raises(RegistrationError, match="was deleted"):
        await reg.register()
