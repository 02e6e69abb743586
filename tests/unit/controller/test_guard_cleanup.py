"""The mode-switch guard and the orphan/node-label sweeps (pure parts)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from computedomain.controller import cleanup, guard, nodes
from computedomain.controller.caches import child_changed
from computedomain.controller.executor import Reconciler
from computedomain.controller.observed import Child, ChildKind, NodeView
from computedomain.settings import ImexMode
from tests.unit.controller.helpers import OTHER_UID, UID, child, clique, compute_domain, node, settings

DRIVER = ImexMode.DRIVER_MANAGED
HOST = ImexMode.HOST_MANAGED


@pytest.mark.parametrize(
    ("mode", "children", "labelled", "deleting", "evidence"),
    [
        (
            HOST,
            (ChildKind.DAEMONSET, ChildKind.DAEMON_TEMPLATE, ChildKind.WORKLOAD_TEMPLATE),
            (),
            False,
            "DaemonSet, DaemonTemplate",
        ),
        (HOST, (ChildKind.DAEMON_TEMPLATE,), (), False, "DaemonTemplate"),
        (HOST, (ChildKind.WORKLOAD_TEMPLATE,), ("gb-1",), False, "node label on gb-1"),
        (HOST, (ChildKind.WORKLOAD_TEMPLATE,), (), False, ""),
        (HOST, (ChildKind.DAEMONSET,), (), True, ""),  # terminating: the teardown handles it in either mode
        (DRIVER, (ChildKind.WORKLOAD_TEMPLATE,), (), False, "workload template without daemon"),
        (DRIVER, (ChildKind.WORKLOAD_TEMPLATE, ChildKind.DAEMONSET), (), False, ""),
        (DRIVER, (ChildKind.DAEMON_TEMPLATE,), (), False, ""),  # a driverManaged create interrupted midway
        (DRIVER, (), (), False, ""),
        (DRIVER, (ChildKind.WORKLOAD_TEMPLATE,), (), True, ""),
    ],
)
def test_guard(
    mode: ImexMode, children: tuple[ChildKind, ...], labelled: tuple[str, ...], deleting: bool, evidence: str
) -> None:
    cds = [compute_domain(deleting=deleting), compute_domain(uid=OTHER_UID, name="clean")]
    findings = guard.check(mode, cds, [child(k) for k in children], [node(n) for n in labelled])
    assert len(findings) == (1 if evidence else 0)
    assert all(f.evidence.startswith(evidence) for f in findings)
    if findings:
        message = guard.refusal_message(mode, findings)
        assert "team/cd1" in message and "clean" not in message
        assert f"IMEX_MODE={mode.value}" in message and "delete them" in message


def test_guard_names_many_domains_briefly() -> None:
    cds = [compute_domain(uid=f"00000000-0000-4000-8000-{i:012d}", name=f"cd{i:02d}") for i in range(25)]
    kids = [child(ChildKind.DAEMONSET, uid=cd.uid) for cd in cds]
    message = guard.refusal_message(HOST, guard.check(HOST, cds, kids, []))
    assert "25 ComputeDomain(s)" in message and "and 5 more" in message


def test_orphan_candidates_and_confirmation() -> None:
    kids: list[Child] = [child(ChildKind.DAEMONSET, uid=UID), child(ChildKind.DAEMONSET, uid=OTHER_UID)]
    labelled: list[NodeView] = [node("gb-1", UID), node("gb-2", OTHER_UID), NodeView("plain", "1", "")]
    cliques = [clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), uid=OTHER_UID)]
    found = cleanup.candidates(kids, labelled, cliques, known_uids={UID})
    assert [c.cd_uid for c in found.children] == [OTHER_UID]
    assert [n.name for n in found.nodes] == ["gb-2"]
    assert len(found.cliques) == 1 and found.uids == {OTHER_UID}
    # The apiserver still has the domain: a lagging cache, not an orphan.
    assert not cleanup.confirm(found, live_uids={UID, OTHER_UID})
    assert cleanup.confirm(found, live_uids={UID}) == found
    assert "label on node gb-2" in found.describe()


def test_unlabel_patch_tests_the_value_first() -> None:
    ops = nodes.unlabel_patch(node("gb-1"))
    path = "/metadata/labels/resource.nvidia.com~1computeDomain"
    assert ops == [{"op": "test", "path": path, "value": UID}, {"op": "remove", "path": path}]
    assert nodes.stale_labels([node("b", OTHER_UID), node("a", OTHER_UID), node("c")], {UID}) == [
        node("a", OTHER_UID),
        node("b", OTHER_UID),
    ]


class _Caches:
    """Only what ``Reconciler.reconcile`` reads of the caches for a domain it has nothing to write for."""

    def __init__(self, cds: dict[str, object]) -> None:
        self.cds = cds

    def observe(self, uid: str) -> None:
        return None

    def cd(self, uid: str) -> object | None:
        return self.cds.get(uid)


@pytest.mark.parametrize(
    ("cached", "swept"),
    [("live", False), ("deleting", True), ("gone", True)],
)
async def test_only_a_domain_torn_down_or_gone_asks_for_a_sweep(cached: str, swept: bool) -> None:
    cds: dict[str, object] = {}
    if cached != "gone":
        cds[UID] = compute_domain(deleting=cached == "deleting")
    requests: list[str] = []
    writer = SimpleNamespace(client=None, caches=_Caches(cds))
    reconciler = Reconciler(writer, settings(), after_reconcile=lambda: requests.append(UID))  # type: ignore[arg-type]
    await reconciler.reconcile(UID)
    assert requests == ([UID] if swept else [])


def _status(**status: int) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["status"] = status
        raw["metadata"]["resourceVersion"] = str(6 + sum(status.values()))

    return edit


def test_a_childs_update_wakes_its_domain_only_when_its_view_changed() -> None:
    ds = child(ChildKind.DAEMONSET)
    # The DaemonSet controller's status write: a new resourceVersion, nothing a reconcile reads.
    assert not child_changed(ds, child(ChildKind.DAEMONSET, edit=_status(observedGeneration=1)))
    # The pods it schedules, a finalizer, a deletion: each one wakes the domain.
    assert child_changed(ds, child(ChildKind.DAEMONSET, edit=_status(currentNumberScheduled=2)))
    assert child_changed(ds, child(ChildKind.DAEMONSET, finalizers=()))
    assert child_changed(ds, child(ChildKind.DAEMONSET, terminating=True))
