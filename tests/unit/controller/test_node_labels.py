"""The CD label on Nodes follows the channel claims allocated there: what a claim says (``decode_claim``),
which domains want a node (``wanted``), and what one pass of ``NodeLabeller`` writes, never on a cache's word
alone when it takes a label away."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from computedomain.api.constants import DRIVER_NAME
from computedomain.api.models import ComputeDomain
from computedomain.controller.executor import Writer
from computedomain.controller.nodes import NodeLabeller, decide, wanted
from computedomain.controller.observed import ClaimView, NodeView, decode_claim
from computedomain.kube.client import ObjectList
from computedomain.kube.converge import DONE
from computedomain.kube.workqueue import RequeueAfter
from tests.unit.controller.helpers import OTHER_UID, UID, compute_domain

NODE = "tray-1"


def claim(
    uid: str = UID,
    *,
    namespace: str = "team",
    name: str = "w-0",
    pool: str = NODE,
    device: str = "channel-0",
    kind: str = "ComputeDomainChannelConfig",
    driver: str = DRIVER_NAME,
    allocated: bool = True,
    extra_domain: str | None = None,
) -> dict[str, Any]:
    configs = [{"source": "FromClaim", "requests": ["channel"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "domainID": uid}}}]  # fmt: skip
    if extra_domain:
        configs.append({"source": "FromClaim", "opaque": {"driver": DRIVER_NAME, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "domainID": extra_domain}}})  # fmt: skip
    raw: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace, "uid": f"claim-{name}"}}
    if allocated:
        raw["status"] = {"allocation": {"devices": {
            "results": [{"request": "channel", "driver": driver, "pool": pool, "device": device}],
            "config": configs,
        }}}  # fmt: skip
    return raw


def test_a_claim_names_its_domain_and_nodes_only_when_its_channel_is_allocated() -> None:
    assert decode_claim(claim()) == ClaimView("team", "w-0", UID, frozenset({NODE}), uid="claim-w-0")
    assert decode_claim(claim()).allocated(UID, NODE)
    assert not decode_claim(claim()).allocated(OTHER_UID, NODE)
    assert not decode_claim(claim()).allocated(UID, "elsewhere")
    assert decode_claim(claim(device="channel-0-3")).nodes == {NODE}
    for other in (
        claim(allocated=False),
        claim(device="daemon-0", kind="ComputeDomainDaemonConfig"),
        claim(driver="gpu.nvidia.com"),
        claim(extra_domain=OTHER_UID),  # two domains: Prepare refuses it, it brings neither
        {"metadata": {"name": "x"}, "status": {"allocation": "not a mapping"}},
    ):
        view = decode_claim(other)
        assert (view.cd_uid, view.nodes) == ("", frozenset()), other


def test_only_live_domains_with_claims_in_their_own_namespace_want_a_node() -> None:
    cds = {UID: compute_domain(), OTHER_UID: compute_domain(uid=OTHER_UID, name="cd2", deleting=True)}
    views = [decode_claim(c) for c in (claim(), claim(OTHER_UID, name="w-1"), claim(namespace="tenant", name="w-2"))]
    assert wanted(views, cds.get) == {UID}
    assert wanted([decode_claim(claim(namespace="tenant"))], cds.get) == set(), "another namespace's claim"
    assert wanted([decode_claim(claim("0" * 8 + "-0000-4000-8000-" + "0" * 12))], cds.get) == set(), "unknown domain"
    assert decide(UID, {UID, OTHER_UID}) == UID, "the label stays with the domain it names"
    assert decide("", {UID, OTHER_UID}) == min(UID, OTHER_UID)
    assert decide(UID, set()) is None


@dataclass
class _Nodes:
    views: dict[str, NodeView]

    def get(self, name: str) -> NodeView | None:
        return self.views.get(name)


@dataclass
class _Caches:
    cds: dict[str, ComputeDomain]
    labels: dict[str, str]
    claims: list[dict[str, Any]]

    @property
    def nodes(self) -> _Nodes:
        return _Nodes({n: NodeView(n, "1", uid) for n, uid in self.labels.items()})

    def claims_on(self, node: str) -> list[ClaimView]:
        return [v for v in map(decode_claim, self.claims) if node in v.nodes]

    def cd(self, uid: str) -> ComputeDomain | None:
        return self.cds.get(uid)


@dataclass
class _Writer:
    caches: _Caches
    live: list[dict[str, Any]] = field(default_factory=list)
    writes: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    lists: int = 0
    changed_under_us: bool = False

    @property
    def client(self) -> _Writer:
        return self

    async def list_all(self, _resource: Any, *, namespace: str) -> ObjectList:
        self.lists += 1
        return ObjectList(items=[c for c in self.live if c["metadata"]["namespace"] == namespace], resource_version="1")

    async def label_node(self, name: str, *, expect: str | None, value: str | None) -> bool:
        if self.changed_under_us:
            return False
        self.writes.append((name, expect, value))
        return True


def labeller(
    *, labels: dict[str, str], claims: list[dict[str, Any]], live: list[dict[str, Any]] | None = None
) -> tuple[NodeLabeller, _Writer, list[int]]:
    cds = {UID: compute_domain(), OTHER_UID: compute_domain(uid=OTHER_UID, name="cd2")}
    writer = _Writer(_Caches(cds, labels, claims), live=claims if live is None else live)
    sweeps: list[int] = []
    return NodeLabeller(cast(Writer, writer), request_sweep=lambda: sweeps.append(1)), writer, sweeps


async def test_a_claim_allocated_on_an_unlabelled_node_labels_it_at_once() -> None:
    nl, writer, _ = labeller(labels={}, claims=[claim()])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [(NODE, None, UID)] and writer.lists == 0


async def test_nothing_is_written_while_the_label_matches_the_claims() -> None:
    nl, writer, _ = labeller(labels={NODE: UID}, claims=[claim(), claim(name="w-1", device="channel-0-1")])
    assert await nl.reconcile(NODE) == DONE
    nl, writer2, _ = labeller(labels={}, claims=[])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == writer2.writes == [] and writer.lists == writer2.lists == 0


async def test_a_label_without_claims_goes_only_when_a_live_list_agrees() -> None:
    nl, writer, _ = labeller(labels={NODE: UID}, claims=[], live=[claim()])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [] and writer.lists == 1, "the cache lags: the live list still has the claim"
    nl, writer, _ = labeller(labels={NODE: UID}, claims=[], live=[claim(pool="tray-2")])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [(NODE, UID, None)]


async def test_a_label_of_a_domain_without_claims_moves_to_the_domain_that_has_them() -> None:
    nl, writer, _ = labeller(labels={NODE: UID}, claims=[claim(OTHER_UID)])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [(NODE, UID, OTHER_UID)] and writer.lists == 1


async def test_a_label_set_by_hand_on_a_node_without_claims_is_removed() -> None:
    """What a stolen node agent token could have done before the label was the controller's."""
    nl, writer, _ = labeller(labels={NODE: OTHER_UID}, claims=[])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [(NODE, OTHER_UID, None)]


async def test_unknown_or_deleting_domains_are_left_to_the_sweep_and_the_teardown() -> None:
    unknown = "0" * 8 + "-0000-4000-8000-" + "0" * 12
    nl, writer, sweeps = labeller(labels={NODE: unknown}, claims=[claim()])
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [] and sweeps == [1], "another scope's domain, or a gone one: the sweep confirms"
    nl, writer, sweeps = labeller(labels={NODE: UID}, claims=[])
    writer.caches.cds[UID] = compute_domain(deleting=True)
    assert await nl.reconcile(NODE) == DONE
    assert writer.writes == [] and writer.lists == 0 and sweeps == []


async def test_a_label_that_changed_under_the_write_is_decided_again() -> None:
    nl, writer, _ = labeller(labels={}, claims=[claim()])
    writer.changed_under_us = True
    assert isinstance(await nl.reconcile(NODE), RequeueAfter)
