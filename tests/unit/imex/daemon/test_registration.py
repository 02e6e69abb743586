"""Index allocation and slot locks (pure), and the executor on the in-memory API: our entry only, owner
references, the lock in the same write, unregistering, and many registries racing for slots."""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ReadyStatus
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, KubeClient
from computedomain.kube.errors import Conflict
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
    field_manager,
    lock_key,
    locks_of,
    plan_claim,
    pod_owner_reference,
    slot_preference,
)
from tests.unit.imex.daemon.fakes import FakeApi
from tests.unit.jump_clock import JumpClock

CD = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"
A = "cluster-a.0"
B = "cluster-b.1"
NS = "nvidia-dra"
R = ReadyStatus.READY
N = ReadyStatus.NOT_READY


def e(node: str, index: int, clique: str = A, ip: str | None = None, status: ReadyStatus = N) -> DaemonEntry:
    return DaemonEntry(node, ip or f"10.0.0.{index + 1}", clique, index, status)


ME = Identity("me", "10.9.9.9", A)
P = slot_preference("me", 18)  # our order of preference over 18 slots

# (case, entries, locks, max_nodes, expected index)
ALLOCATION_CASES: list[tuple[str, list[DaemonEntry], dict[int, str], int, int]] = [
    ("empty object: our first preference", [], {}, 18, P[0]),
    ("first free in our order", [e("n0", P[0]), e("n1", P[1])], {}, 18, P[2]),
    ("keeps own index even where it is not our preference", [e("n0", P[0]), e("me", P[5], ip="x")], {}, 18, P[5]),
    ("keeps own index after an IP change", [e("me", 3, ip="10.1.1.1"), e("n0", P[0])], {}, 18, 3),
    ("other cliques' indices do not count", [e("x0", P[0], B), e("x1", P[1], B)], {}, 18, P[0]),
    ("own entry in another clique is not ours here", [e("me", 4, B), e("n0", P[0])], {}, 18, P[1]),
    ("own index out of range (max lowered) moves", [e("me", 20), e("n0", P[0])], {}, 18, P[1]),
    ("own negative index moves", [e("me", -1)], {}, 18, P[0]),
    ("duplicate index, we sort first: keep", [e("me", 2), e("zz", 2), e("n0", 0)], {}, 18, 2),
    ("duplicate index, other sorts first: move", [e("aa", P[0]), e("me", P[0])], {}, 18, P[1]),
    ("last free slot", [e(f"n{i}", i) for i in range(18) if i != 11], {}, 18, 11),
    ("peers above max are no obstacle", [e("n0", 0), e("big", 40)], {}, 3, next(i for i in slot_preference("me", 3) if i)),
    ("max 1, empty", [], {}, 1, 0),
    ("our own lock on a free slot: back to it", [], {P[7]: "me"}, 18, P[7]),
    ("a stale lock comes after every unlocked slot", [], {P[0]: "gone"}, 18, P[1]),
    ("only stale-locked slots left: the preferred one", [e(f"n{i}", i) for i in range(16)], {16: "g1", 17: "g2"}, 18,
     next(i for i in P if i >= 16)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "entries", "locks", "max_nodes", "want"), ALLOCATION_CASES, ids=[c[0] for c in ALLOCATION_CASES]
)
def test_allocate_index(
    case: str, entries: list[DaemonEntry], locks: dict[int, str], max_nodes: int, want: int
) -> None:
    got = allocate_index(entries, ME, max_nodes, locks)
    assert got == want, case
    holders = {x.index for x in entries if x.clique_id == ME.clique_id and x.node_name != ME.node_name}
    # The invariant behind every row: never an index another entry of our clique... unless we win a tie.
    if got in holders:
        assert case.startswith("duplicate index, we sort first")


def test_slot_preference_is_a_stable_permutation_that_differs_between_nodes() -> None:
    assert sorted(P) == list(range(18))
    assert slot_preference("me", 18) == P
    firsts = {slot_preference(f"gb-{i:02d}", 18)[0] for i in range(18)}
    # 18 nodes starting together mostly want different slots (all wanting slot 0 is what made them collide)
    assert len(firsts) >= 8


@given(
    st.lists(st.tuples(st.integers(-2, 20), st.sampled_from([A, B])), max_size=20),
    st.dictionaries(st.integers(0, 17), st.sampled_from(["me", "a", "b", "zz"]), max_size=6),
    st.integers(1, 18),
)
@settings(max_examples=300, deadline=None)
def test_allocation_never_takes_a_slot_another_entry_holds(
    raw: list[tuple[int, str]], locks: dict[int, str], max_nodes: int
) -> None:
    entries = [DaemonEntry(f"n{i:02d}", "10.0.0.1", clique, index) for i, (index, clique) in enumerate(raw)]
    held = {x.index for x in entries if x.clique_id == A}
    try:
        got = allocate_index(entries, ME, max_nodes, locks)
    except IndexExhausted:
        assert set(range(max_nodes)) <= held
        return
    assert 0 <= got < max_nodes
    assert got not in held
    claim = plan_claim(entries, locks, ME, N, max_nodes)
    assert claim.entry.index == got
    assert claim.takeover == (locks.get(got) not in (None, "me"))


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


def test_locks_of_reads_only_lock_annotations() -> None:
    obj = {"metadata": {"annotations": {lock_key(3): "a", lock_key(17): "b", "other/x": "y", f"{lock_key(0)}x": "z"}}}
    assert locks_of(obj) == {3: "a", 17: "b"}
    assert locks_of(None) == {}


def test_field_manager_fits_the_api_limit() -> None:
    assert field_manager("gb-7") == "compute-domain-daemon.gb-7"
    long = field_manager("n" * 253)
    assert len(long) <= 128 and long != field_manager("m" * 253)


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


def clique(api: FakeApi, clique_id: str = A) -> dict[str, Any]:
    obj = api.read(COMPUTE_DOMAIN_CLIQUES, NS, f"{CD}.{clique_id}")
    assert obj is not None
    return obj


async def test_first_registration_creates_the_clique_with_labels_owner_lock_and_entry() -> None:
    api = FakeApi()
    reg = clique_registry(api, "gb-1", A, "10.0.0.7")
    entry = await reg.register()
    first = slot_preference("gb-1", 18)[0]
    assert entry == DaemonEntry("gb-1", "10.0.0.7", A, first, N)
    obj = clique(api)
    assert obj["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: CD, CLIQUE_LABEL: A}
    assert obj["metadata"]["annotations"] == {lock_key(first): "gb-1"}
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "pod-gb-1", "uid": "uid-gb-1-10.0.0.7"}
    ]
    assert obj["daemons"] == [
        {"nodeName": "gb-1", "ipAddress": "10.0.0.7", "cliqueID": A, "index": first, "status": "NotReady"}
    ]
    assert api.requests == 2, "one read (nothing there yet), one apply"


async def test_registration_touches_only_our_entry_and_keeps_unknown_fields() -> None:
    api = FakeApi()
    other = {"nodeName": "gb-0", "ipAddress": "10.0.0.1", "cliqueID": A, "index": 0, "status": "Ready", "future": 1}
    mine_before = {"nodeName": "gb-1", "ipAddress": "10.0.0.2", "cliqueID": A, "index": 3, "status": "Ready"}
    api.put(
        COMPUTE_DOMAIN_CLIQUES,
        NS,
        {
            "metadata": {
                "name": f"{CD}.{A}",
                "namespace": NS,
                "ownerReferences": [{"uid": "someone", "name": "p0", "kind": "Pod", "apiVersion": "v1"}],
            },
            "daemons": [other, {**mine_before, "extra": "kept"}],
        },
    )
    reg = clique_registry(api, "gb-1", A, "10.0.0.99")  # restarted pod: new IP
    entry = await reg.register()
    assert entry.index == 3
    obj = clique(api)
    assert obj["daemons"][0] == other
    assert obj["daemons"][1] == {**mine_before, "extra": "kept", "ipAddress": "10.0.0.99", "status": "NotReady"}
    assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == ["someone", "uid-gb-1-10.0.0.99"]
    assert locks_of(obj) == {3: "gb-1"}, "an entry from before the locks gets its lock with the next write"


async def test_no_write_when_nothing_changes() -> None:
    api = FakeApi()
    reg = clique_registry(api, "gb-1", A, "10.0.0.7")
    await reg.register()
    writes = api.writes
    await reg.register()
    assert api.writes == writes
    assert not reg.needs_write(clique(api))


async def test_set_status_and_unregister_only_with_our_ip() -> None:
    api = FakeApi()
    reg = clique_registry(api, "gb-1", A, "10.0.0.7")
    await reg.register()
    await reg.set_status(R)
    assert clique(api)["daemons"][0]["status"] == "Ready"
    # A replacement pod on the same node took the entry over with a new IP: the old pod must not remove it.
    old = clique_registry(api, "gb-1", A, "10.0.0.1")
    assert await old.unregister() is False
    assert await reg.unregister() is True
    obj = clique(api)
    assert obj["daemons"] == []
    assert locks_of(obj) == {}, "the lock goes with the entry"


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


async def test_a_lock_that_outlived_its_entry_is_taken_over_with_a_guarded_write() -> None:
    api = FakeApi()
    a = clique_registry(api, "a", A, "10.0.0.1", max_nodes=2)
    b = clique_registry(api, "b", A, "10.0.0.2", max_nodes=2)
    await a.register()
    held_b = (await b.register()).index
    # b was SIGKILLed and the controller pruned its entry (a plain update): its lock stays behind.
    obj = clique(api)
    obj["daemons"] = [d for d in obj["daemons"] if d["nodeName"] != "b"]
    await api.replace(COMPUTE_DOMAIN_CLIQUES, obj, namespace=NS)
    c = clique_registry(api, "c", A, "10.0.0.3", max_nodes=2)
    assert (await c.register()).index == held_b
    assert locks_of(clique(api))[held_b] == "c"
    # b comes back: its slot is c's now, and the clique is full.
    with pytest.raises(IndexExhausted):
        await clique_registry(api, "b", A, "10.0.0.22", max_nodes=2).register()


async def test_fields_held_by_a_writer_from_before_the_locks_are_taken_with_a_guarded_write() -> None:
    api = FakeApi()
    # An older daemon (or the reference driver) wrote our entry under its own manager.
    old = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainClique",
           "metadata": {"name": f"{CD}.{A}", "namespace": NS},
           "daemons": [{"nodeName": "gb-1", "ipAddress": "10.0.0.2", "cliqueID": A, "index": 5, "status": "Ready"}]}  # fmt: skip
    await api.apply(COMPUTE_DOMAIN_CLIQUES, old, namespace=NS, field_manager="compute-domain-daemon")
    reg = clique_registry(api, "gb-1", A, "10.0.0.9")
    assert (await reg.register()).index == 5
    obj = clique(api)
    assert obj["daemons"][0]["ipAddress"] == "10.0.0.9" and locks_of(obj) == {5: "gb-1"}
    assert reg.lock_conflicts == 0


@pytest.mark.parametrize("seed", range(8))
async def test_many_daemons_racing_in_two_cliques_get_unique_stable_indices(seed: int) -> None:
    api = FakeApi(seed)
    nodes = [(f"a-{i:02d}", A) for i in range(12)] + [(f"b-{i:02d}", B) for i in range(9)]
    random.Random(seed).shuffle(nodes)
    regs = {
        node: clique_registry(api, node, clique, f"10.{ord(clique[8])}.0.{i}") for i, (node, clique) in enumerate(nodes)
    }
    await asyncio.gather(*(r.register() for r in regs.values()))

    def indices(clique_id: str) -> dict[str, int]:
        return {d["nodeName"]: d["index"] for d in clique(api, clique_id)["daemons"]}

    first = {clique_id: indices(clique_id) for clique_id in (A, B)}
    for clique_id, count in ((A, 12), (B, 9)):
        assert len(first[clique_id]) == count
        assert len(set(first[clique_id].values())) == count  # unique
        assert all(0 <= i < 18 for i in first[clique_id].values())
        assert locks_of(clique(api, clique_id)) == {i: n for n, i in first[clique_id].items()}
    # Conflict-free writes: a refusal only where two daemons wanted the same slot at once.
    refused = sum(r.lock_conflicts for r in regs.values())
    assert api.conflicts == refused, "no write was refused for anything but a slot someone else took first"
    assert refused <= len(regs), f"{refused} refusals for {len(regs)} daemons"

    # Restart a third of them (crash: entry kept; new pod IP) while the others flip their status.
    rng = random.Random(seed + 100)
    restarted = rng.sample(sorted(regs), 7)
    again = []
    for i, node in enumerate(restarted):
        clique_id = regs[node].me.clique_id
        regs[node] = clique_registry(api, node, clique_id, f"10.99.{i}.1")
        again.append(regs[node].register())
    others = [regs[n].set_status(R) for n in regs if n not in restarted]
    await asyncio.gather(*again, *others)
    assert {clique_id: indices(clique_id) for clique_id in (A, B)} == first

    # Graceful stops free slots while newcomers join; survivors never move, every index stays unique.
    leaving = [n for n in sorted(regs) if n.startswith("a-")][:3]
    newcomers = [clique_registry(api, f"a-new-{i}", A, f"10.77.0.{i}") for i in range(4)]
    await asyncio.gather(*(regs[n].unregister() for n in leaving), *(r.register() for r in newcomers))
    after = indices(A)
    for node, index in first[A].items():
        if node not in leaving:
            assert after[node] == index
    assert len(after) == 12 - 3 + 4 and len(set(after.values())) == len(after)
    assert locks_of(clique(api)) == {i: n for n, i in after.items()}


async def test_legacy_status_backend_writes_only_our_entry_in_status_nodes() -> None:
    api = FakeApi()
    api.put(
        COMPUTE_DOMAINS,
        "user-ns",
        {
            "kind": "ComputeDomain",
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
            max_nodes=2,
            owner=pod_owner_reference(node, node),
            rng=random.Random(node),
        )

    await asyncio.gather(reg("n1", "10.0.0.1").register(), reg("n2", "10.0.0.2").register())
    obj = api.read(COMPUTE_DOMAINS, "user-ns", "cd1")
    assert obj is not None
    nodes = {n["name"]: n for n in obj["status"]["nodes"]}
    assert nodes["x0"]["index"] == 0 and nodes["x0"]["status"] == "Ready"  # another clique's entry untouched
    assert sorted(nodes[n]["index"] for n in ("n1", "n2")) == [0, 1]  # own clique: 0 is free despite x0
    assert obj["status"]["status"] == "NotReady"
    assert "ownerReferences" not in obj["metadata"] and "annotations" not in obj["metadata"]
    assert await reg("n1", "10.0.0.1").unregister() is True
    obj = api.read(COMPUTE_DOMAINS, "user-ns", "cd1")
    assert obj is not None and sorted(n["name"] for n in obj["status"]["nodes"]) == ["n2", "x0"]


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


class AlwaysConflicting(FakeApi):
    """Every write is refused with a 409, as when another writer keeps changing the object."""

    async def apply(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.conflicts += 1
        raise Conflict("the object has been modified; please apply your changes to the latest version")


async def test_a_write_that_keeps_conflicting_ends_after_max_attempts_with_growing_jittered_pauses() -> None:
    """The first write is an unguarded apply (no pause after its conflict); the guarded, forced writes that
    follow pause 10 ms doubling to 0.5 s, jittered 0.5x..1.5x; after max_attempts the error names the cause."""
    seed = 7
    print(f"seed={seed}")
    api = AlwaysConflicting()
    clock = JumpClock()
    backend = CliqueBackend(namespace=NS, cd_uid=CD, clique_id=A)
    reg = Registry(
        cast(KubeClient, api),
        backend,
        Identity("n1", "10.0.0.1", A),
        max_nodes=18,
        owner=pod_owner_reference("pod-n1", "uid-n1"),
        clock=clock,
        rng=random.Random(seed),
        max_attempts=10,
    )
    with pytest.raises(RegistrationError, match="after 10 attempts: the object has been modified"):
        await reg.register()
    assert api.conflicts == 10
    assert clock.sleeps[0] == 0.0  # the unguarded apply is retried at once, as a forced one
    bases = [min(0.5, 0.01 * 2 ** (n - 1)) for n in range(2, 10)]
    assert len(clock.sleeps) == 9
    assert all(0.5 * b <= s < 1.5 * b for s, b in zip(clock.sleeps[1:], bases, strict=True)), clock.sleeps
