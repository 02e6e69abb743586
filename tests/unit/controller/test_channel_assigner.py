"""The channel assignment's executor (``ChannelAssigner``) on one clique, with a stand-in for the caches and the
API that records the writes: what it looks up live when the caches cannot vouch for an entry. The plans
themselves: test_channels.py; the whole protocol on a real apiserver: tests/cluster/system/test_channel_isolation.py."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, DRIVER_NAME, GPU_CLIQUE_NODE_LABEL
from computedomain.controller.channel_assigner import AWAY_RECHECK_S, ChannelAssigner
from computedomain.controller.channels import CliqueSpace, Lock, Record, lock_name
from computedomain.kube.client import ObjectList
from computedomain.kube.converge import RequeueAfter
from tests.unit.controller.helpers import settings

C = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"
D = "00000000-0000-4000-8000-000000000001"
NS = "nvidia-dra"
RECORD = Record(
    name=f"{D}.{C}", namespace=NS, uid="rec-1", resource_version="7", domain_uid=D, clique_id=C, channel=3,
    claims=(("claim-1", "n1"),), finalizers=(COMPUTE_DOMAIN_FINALIZER,),
)  # fmt: skip
LOCK = Lock(lock_name(C, 3), NS, "lock-3", C, 3, D, "rec-1")


def allocated_claim(uid: str, node: str, domain: str) -> dict[str, Any]:
    params = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": domain}
    return {
        "metadata": {"name": uid, "namespace": "team-a", "uid": uid},
        "status": {"allocation": {"devices": {
            "results": [{"request": "channel", "driver": DRIVER_NAME, "pool": node, "device": "channel-0"}],
            "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER_NAME, "parameters": params}}],
        }}},
    }  # fmt: skip


class Caches:
    """The clique as the caches show it: the claim cache has not shown (or could not read) the claim."""

    cd_namespace = None

    def clique_space(self, clique_id: str) -> CliqueSpace:
        return CliqueSpace(clique_id, (RECORD,), (LOCK,), frozenset({D}))

    def cd(self, uid: str) -> None:
        return None


class Api:
    def __init__(self, claims: list[dict[str, Any]]) -> None:
        self.claims = claims
        self.patches: list[list[dict[str, Any]]] = []
        self.lists = 0

    async def list_all(self, resource: Any, **_: Any) -> ObjectList:
        self.lists += 1
        return ObjectList(items=self.claims, resource_version="9")

    async def get(self, resource: Any, name: str, **_: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {GPU_CLIQUE_NODE_LABEL: C}}}

    async def json_patch(self, resource: Any, name: str, ops: list[dict[str, Any]], **_: Any) -> dict[str, Any]:
        self.patches.append(ops)
        return {
            "metadata": {"name": name, "namespace": NS, "uid": "rec-1", "resourceVersion": "8",
                         "labels": {"resource.nvidia.com/computeDomain": D}, "finalizers": [COMPUTE_DOMAIN_FINALIZER]},
            "channel": 3,
            "preparedClaims": [{"claimUID": "claim-1", "nodeName": "n1", "verified": True}],
        }  # fmt: skip


class Writer:
    def __init__(self, api: Api) -> None:
        self.client = api
        self.caches = Caches()

    def event(self, *args: Any) -> None:
        pass


async def test_an_entry_the_claim_cache_does_not_show_is_verified_from_a_live_list() -> None:
    api = Api([allocated_claim("claim-1", "n1", D)])
    assigner = ChannelAssigner(Writer(api), settings(IMEX_ISOLATION="domain"))  # type: ignore[arg-type]
    await assigner.reconcile(C)
    assert api.lists == 1
    assert [op for ops in api.patches for op in ops if op["op"] == "add"] == [
        {"op": "add", "path": "/preparedClaims/0/verified", "value": True}
    ]


async def test_an_entry_whose_claim_a_live_list_does_not_show_stays_unverified() -> None:
    api = Api([allocated_claim("claim-1", "n2", D), allocated_claim("claim-2", "n1", D)])
    assigner = ChannelAssigner(Writer(api), settings(IMEX_ISOLATION="domain"))  # type: ignore[arg-type]
    await assigner.reconcile(C)
    assert api.lists == 1 and api.patches == []


class Moved(Api):
    """The record's node is labelled with another clique (a stolen token moved it there)."""

    def __init__(self, claims: list[dict[str, Any]], clique: str = "elsewhere.2") -> None:
        super().__init__(claims)
        self.clique = clique
        self.deleted: list[dict[str, Any]] = []

    async def get(self, resource: Any, name: str, **_: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {GPU_CLIQUE_NODE_LABEL: self.clique}}}

    async def delete(self, resource: Any, name: str, **kwargs: Any) -> dict[str, Any]:
        self.deleted.append({"name": name, **kwargs})
        return {"kind": "Status", "status": "Success"}

    async def create(self, resource: Any, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {**body, "metadata": {**body["metadata"], "namespace": NS, "uid": "lock-new"}}


class VerifiedCaches(Caches):
    def clique_space(self, clique_id: str) -> CliqueSpace:
        record = replace(RECORD, verified=frozenset(RECORD.claims))
        return CliqueSpace(clique_id, (record,), (LOCK,), frozenset({D}))


async def test_a_verified_entry_holds_only_while_its_claim_exists_or_its_node_is_in_the_clique() -> None:
    """A stolen node agent token may list a real claim of its node in a record of every clique it moves its
    Node's label through, and the entry gets verified: once the claim is gone and the node is not in the
    record's clique, the entry holds nothing and the record is retired (before: it kept the channel for good).
    A real entry of a node whose label a token moved stays while its claim exists; one of a node in the
    clique stays even when the claim is gone (a pod force-deleted from an unreachable node may still run)."""
    cases = {
        "claim gone, node elsewhere": (Moved([]), True),
        "claim still there, node elsewhere": (Moved([allocated_claim("claim-1", "n1", D)]), False),
        "claim gone, node in the clique": (Moved([], clique=C), False),
    }
    for what, (api, retired) in cases.items():
        writer = Writer(api)
        writer.caches = VerifiedCaches()
        assigner = ChannelAssigner(writer, settings(IMEX_ISOLATION="domain"))  # type: ignore[arg-type]
        await assigner.reconcile(C)
        assert bool(api.deleted) == retired, what
        if retired:
            assert api.deleted[0]["uid"] == "rec-1" and api.deleted[0]["resource_version"] == "7"


async def test_a_deleted_domains_record_drops_a_verified_entry_that_holds_nothing() -> None:
    class Deleting(VerifiedCaches):
        def clique_space(self, clique_id: str) -> CliqueSpace:
            record = replace(RECORD, verified=frozenset(RECORD.claims), terminating=True)
            return CliqueSpace(clique_id, (record,), (LOCK,), frozenset())

    class Patched(Moved):
        patched: list[dict[str, Any]] = []

        async def merge_patch(self, resource: Any, name: str, patch: dict[str, Any], **_: Any) -> dict[str, Any]:
            self.patched.append(patch)
            return {"metadata": {"name": name, "namespace": NS, "uid": "rec-1", "resourceVersion": "8",
                                 "deletionTimestamp": "2026-12-06T00:00:00Z"},
                    "channel": 3, "preparedClaims": patch.get("preparedClaims")}  # fmt: skip

    for claims, dropped in (([], True), ([allocated_claim("claim-1", "n1", D)], False)):
        api = Patched(claims)
        api.patched = []
        writer = Writer(api)
        writer.caches = Deleting()
        await ChannelAssigner(writer, settings(IMEX_ISOLATION="domain")).reconcile(C)  # type: ignore[arg-type]
        lists = [p["preparedClaims"] for p in api.patched if "preparedClaims" in p]
        assert (lists[:1] == [[]]) == dropped, (claims, api.patched)


async def test_a_claim_list_that_still_showed_the_claim_does_not_keep_the_entry_for_good() -> None:
    """The list that first answered "the claim exists" must not answer so for ever: once the claim is gone, a
    list no older than ``AWAY_RECHECK_S`` tells, and the clique is looked at again within that time (a claim's
    deletion wakes nothing there). Before, the first list kept the channel until a restart."""
    api = Moved([allocated_claim("claim-1", "n1", D)])
    writer = Writer(api)
    writer.caches = VerifiedCaches()
    assigner = ChannelAssigner(writer, settings(IMEX_ISOLATION="domain"))  # type: ignore[arg-type]
    first = await assigner.reconcile(C)
    assert not api.deleted and isinstance(first, RequeueAfter) and first.seconds <= AWAY_RECHECK_S
    api.claims = []
    await assigner.reconcile(C)
    assert not api.deleted, "a list younger than AWAY_RECHECK_S still answers"
    assert assigner._claims is not None
    assigner._claims = (assigner._claims[0], assigner._claims[1] - AWAY_RECHECK_S - 1)  # that list grew old
    await assigner.reconcile(C)
    assert [d["uid"] for d in api.deleted] == ["rec-1"]


async def test_a_channel_less_record_no_node_of_its_clique_lists_is_deleted_after_the_idle_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Records a stolen token makes under a live domain's name in cliques its node passes through get no
    channel, but stayed for as long as the domain lived: now they go after ``IMEX_CHANNEL_IDLE_RELEASE``, and
    each is named at INFO once, not on every pass. One listing a claim allocated there stays, verified or not
    (a node whose label is missing for a while): deleted, it would keep that claim in a record being deleted,
    and the domain's pods in the clique would be refused until that pod goes; a verified entry whose claim is
    gone holds it no more."""

    def unbound(verified: bool) -> type[Caches]:
        class Unbound(Caches):
            def clique_space(self, clique_id: str) -> CliqueSpace:
                record = replace(RECORD, channel=None, verified=frozenset(RECORD.claims) if verified else frozenset())
                return CliqueSpace(clique_id, (record,), (), frozenset({D}))

        return Unbound

    allocated = [allocated_claim("claim-1", "n1", D)]
    cases = [
        ("1ns", [], False, True),
        ("300s", [], False, False),
        ("1ns", allocated, True, False),
        ("1ns", allocated, False, False),
        ("1ns", [], True, True),  # verified, but its claim is gone and its node elsewhere: it holds nothing
    ]
    for idle, claims, verified, deleted in cases:
        api = Moved(claims)
        writer = Writer(api)
        writer.caches = unbound(verified)()
        assigner = ChannelAssigner(writer, settings(IMEX_ISOLATION="domain", IMEX_CHANNEL_IDLE_RELEASE=idle))  # type: ignore[arg-type]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="computedomain.controller.channel_assigner"):
            for _ in range(3):
                await assigner.reconcile(C)
        what = (idle, bool(claims), verified)
        assert bool(api.deleted) == deleted, what
        if deleted:
            assert api.deleted[0]["uid"] == "rec-1" and api.deleted[0]["resource_version"] == "7"
        told = [r for r in caplog.records if r.levelno == logging.INFO and "no IMEX channel for" in r.getMessage()]
        assert len(told) == 1, (what, [r.getMessage() for r in told])


async def test_cliques_that_ask_at_once_share_one_list_of_the_claims() -> None:
    """Each of the channel loop's workers could list every ResourceClaim at once; now one list is in flight at
    a time, joined by whoever asks for one taken after an earlier moment, while one who needs a later list is
    asked again later (a list begun before an entry was first seen may not show its claim)."""

    class Slow(Api):
        def __init__(self) -> None:
            super().__init__([allocated_claim("claim-1", "n1", D)])
            self.go = asyncio.Event()

        async def list_all(self, resource: Any, **kwargs: Any) -> ObjectList:
            await self.go.wait()
            return await super().list_all(resource, **kwargs)

    api = Slow()
    assigner = ChannelAssigner(Writer(api), settings(IMEX_ISOLATION="domain"))  # type: ignore[arg-type]
    began = time.monotonic()
    asking = [asyncio.create_task(assigner._claims_since(began - 1.0)) for _ in range(4)]
    await asyncio.sleep(0)
    assert await assigner._claims_since(time.monotonic() + 1.0) is None, "a list begun too early is not joined"
    api.go.set()
    answers = await asyncio.gather(*asking)
    assert api.lists == 1 and all(a is answers[0] for a in answers) and "claim-1" in answers[0]
