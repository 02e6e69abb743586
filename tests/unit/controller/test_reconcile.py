"""``desired``/``fold``: the order of the whole lifecycle, walked against a simulated apiserver."""

from __future__ import annotations

from dataclasses import replace

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER
from computedomain.api.models import ComputeDomain, ReadyStatus
from computedomain.controller.observed import Child, ChildKind, Observed, decode_child
from computedomain.controller.reconcile import (
    Action,
    AddFinalizer,
    CreateChild,
    DeleteChild,
    DeleteRecord,
    Gone,
    NameTaken,
    Pruned,
    PruneEntries,
    ReleaseChild,
    RemoveFinalizer,
    Result,
    UnlabelNode,
    WriteStatus,
    desired,
    fold,
    spec_problem,
)
from computedomain.settings import ControllerSettings
from tests.unit.controller.helpers import (
    NOW,
    all_children,
    child,
    clique,
    compute_domain,
    host_settings,
    node,
    pod,
    settings,
)


def apiserver(observed: Observed, action: Action) -> Result:
    """What the apiserver answers to each action (objects with finalizers linger while terminating)."""
    cd = observed.cd
    meta = cd.metadata
    if isinstance(action, DeleteRecord):
        return Gone()
    if isinstance(action, AddFinalizer):
        return cd.model_copy(update={"metadata": meta.model_copy(update={"finalizers": (COMPUTE_DOMAIN_FINALIZER,)})})
    if isinstance(action, RemoveFinalizer):
        return cd.model_copy(update={"metadata": meta.model_copy(update={"finalizers": ()})})
    if isinstance(action, CreateChild):
        return decode_child(action.body, action.kind)
    if isinstance(action, DeleteChild):
        return replace(action.child, terminating=True)
    if isinstance(action, ReleaseChild):
        return Gone()
    if isinstance(action, UnlabelNode):
        return Gone()
    assert isinstance(action, WriteStatus)
    return cd.model_copy(update={"status": action.status})


def walk(observed: Observed, cfg: ControllerSettings, limit: int = 20) -> tuple[list[list[str]], Observed]:
    """Apply plans until done; return the batches (as short action names) and the final snapshot."""
    batches: list[list[str]] = []
    for _ in range(limit):
        plan = desired(observed, cfg, NOW)
        if not plan:
            return batches, observed
        batches.append(sorted(_short(a) for a in plan.actions))
        for action in plan.actions:
            observed = fold(observed, action, apiserver(observed, action))
    raise AssertionError(f"no convergence: {batches}")


def _short(action: Action) -> str:
    if isinstance(action, CreateChild):
        return f"create {action.kind.value}"
    if isinstance(action, DeleteChild | ReleaseChild):
        return f"{type(action).__name__} {action.child.kind.value}"
    if isinstance(action, UnlabelNode):
        return f"unlabel {action.node.name}"
    return type(action).__name__


def test_driver_managed_create_order() -> None:
    batches, final = walk(Observed(cd=compute_domain(finalizers=())), settings())
    assert batches == [
        ["AddFinalizer"],
        ["create DaemonTemplate"],
        ["create DaemonSet", "create WorkloadTemplate"],  # the workload template never before the daemon one
        ["WriteStatus"],
    ]
    assert final.cd.status is not None and final.cd.status.status is ReadyStatus.READY
    assert final.cd.status.nodes is None


def test_host_managed_creates_only_the_workload_template() -> None:
    batches, final = walk(
        Observed(cd=compute_domain(finalizers=(), allocation_mode="All", num_nodes=8)), host_settings()
    )
    assert batches == [["AddFinalizer"], ["create WorkloadTemplate"], ["WriteStatus"]]
    assert final.cd.status is not None and final.cd.status.status is ReadyStatus.READY
    cond = final.cd.status.conditions[0] if final.cd.status.conditions else None
    assert cond is not None and cond.reason == "HostManaged" and "checked per claim" in cond.message
    assert final.cd.status.nodes is None


def test_teardown_order() -> None:
    observed = Observed(
        cd=compute_domain(deleting=True),
        children=all_children(),
        labelled_nodes=(node("gb-1"), node("gb-2")),
    )
    batches, final = walk(observed, settings())
    assert batches == [
        ["DeleteChild WorkloadTemplate"],
        ["DeleteChild DaemonSet", "DeleteChild DaemonTemplate", "DeleteChild NetworkPolicy"],
        ["unlabel gb-1", "unlabel gb-2"],
        [
            "ReleaseChild DaemonSet",
            "ReleaseChild DaemonTemplate",
            "ReleaseChild NetworkPolicy",
            "ReleaseChild WorkloadTemplate",
        ],
        ["RemoveFinalizer"],
    ]
    assert final.children == () and COMPUTE_DOMAIN_FINALIZER not in final.cd.metadata.finalizers


def test_teardown_waits_for_children_held_by_other_finalizers() -> None:
    held = child(ChildKind.DAEMONSET, terminating=True, finalizers=("someone.else/keep",))
    plan = desired(Observed(cd=compute_domain(deleting=True), children=(held,)), settings(), NOW)
    assert not plan.actions and "DaemonSet" in plan.waiting


def test_teardown_is_the_same_in_host_mode() -> None:
    """A domain set up in driverManaged mode is still torn down completely by a hostManaged controller."""
    batches, _ = walk(Observed(cd=compute_domain(deleting=True), children=all_children()), host_settings())
    assert batches[0] == ["DeleteChild WorkloadTemplate"]
    assert batches[1] == ["DeleteChild DaemonSet", "DeleteChild DaemonTemplate", "DeleteChild NetworkPolicy"]


def test_terminating_domain_without_our_finalizer_is_left_alone() -> None:
    assert not desired(Observed(cd=compute_domain(deleting=True, finalizers=("x/y",))), settings(), NOW)


@pytest.mark.parametrize(
    ("children", "expected"),
    [
        ((), "create DaemonTemplate"),
        ((child(ChildKind.DAEMON_TEMPLATE),), "create DaemonSet, create WorkloadTemplate"),
        ((child(ChildKind.DAEMON_TEMPLATE), child(ChildKind.DAEMONSET)), "create WorkloadTemplate"),
        # A label alone adopts nothing: objects under other names (the reference's generateName era, or anyone's)
        # are not the domain's, and its own are created.
        (
            (child(ChildKind.DAEMON_TEMPLATE, name="old-abcde"), child(ChildKind.DAEMONSET, name="old-x")),
            "create DaemonTemplate",
        ),
        ((child(ChildKind.DAEMONSET, terminating=True), child(ChildKind.DAEMON_TEMPLATE)), "ReleaseChild DaemonSet"),
    ],
)
def test_next_step(children: tuple[Child, ...], expected: str) -> None:
    plan = desired(Observed(cd=compute_domain(), children=children), settings(), NOW)
    assert ", ".join(_short(a) for a in plan.actions) == expected
    assert plan.waiting == ""


def test_a_deleted_child_is_recreated_once_gone() -> None:
    observed = Observed(
        cd=compute_domain(), children=(child(ChildKind.DAEMONSET, terminating=True), child(ChildKind.DAEMON_TEMPLATE))
    )
    batches, final = walk(observed, settings())
    assert batches[:2] == [["ReleaseChild DaemonSet"], ["create DaemonSet", "create WorkloadTemplate"]]
    assert not any(c.terminating for c in final.children)


def test_no_status_write_when_nothing_changed() -> None:
    _, final = walk(Observed(cd=compute_domain(finalizers=())), settings())
    assert not desired(final, settings(), NOW)
    later = replace(final, cd=final.cd)
    assert not desired(later, settings(), NOW.replace(hour=13))


def test_status_follows_cliques() -> None:
    _, ready = walk(Observed(cd=compute_domain(finalizers=(), num_nodes=2)), settings())
    assert ready.cd.status is not None and ready.cd.status.status is ReadyStatus.NOT_READY
    entries = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), ("gb-2", "10.0.0.2", 1, "Ready"))
    daemons = (pod("gb-1", clique_id="c.1"), pod("gb-2", clique_id="c.1"))
    plan = desired(replace(ready, cliques=(entries,), pods=daemons), settings(), NOW)
    (write,) = plan.actions
    assert isinstance(write, WriteStatus)
    assert write.status.status is ReadyStatus.READY
    assert [n.name for n in write.status.nodes or ()] == ["gb-1", "gb-2"]
    assert [e.reason for e in write.events] == ["Ready"]


def test_template_name_taken() -> None:
    observed = Observed(cd=compute_domain(), children=all_children()[:2])
    plan = desired(observed, settings(), NOW)
    (create,) = plan.actions
    conflicted = fold(observed, create, NameTaken("ResourceClaimTemplate team/imex-channel-0 already exists"))
    (write,) = desired(conflicted, settings(), NOW).actions
    assert isinstance(write, WriteStatus) and write.status.status is ReadyStatus.NOT_READY
    cond = (write.status.conditions or [])[0]
    assert cond.reason == "TemplateNameConflict" and "already exists" in cond.message
    assert [e.type for e in write.events] == ["Warning"]


def test_gate_off_keeps_daemon_written_nodes() -> None:
    status = {
        "status": "Ready",
        "nodes": [{"name": "gb-1", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 0, "status": "NotReady"}],
    }
    cfg = settings(FEATURE_GATES="ComputeDomainCliques=false")
    observed = Observed(cd=compute_domain(status=status), children=all_children())
    (write,) = desired(observed, cfg, NOW).actions
    assert isinstance(write, WriteStatus)
    assert write.status.status is ReadyStatus.NOT_READY
    assert [n.name for n in write.status.nodes or ()] == ["gb-1"]


def test_fold_unknown_cd_result_keeps_snapshot() -> None:
    observed = Observed(cd=compute_domain())
    assert fold(observed, AddFinalizer(), None) is observed
    assert isinstance(observed.cd, ComputeDomain)


def test_an_entry_whose_daemon_pod_is_gone_is_pruned_before_the_status_is_written() -> None:
    _, ready = walk(Observed(cd=compute_domain(finalizers=(), num_nodes=2)), settings())
    entries = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), ("gb-2", "10.0.0.2", 1, "Ready"))
    observed = replace(ready, cliques=(entries,), pods=(pod("gb-1", clique_id="c.1"),))
    (prune,) = desired(observed, settings(), NOW).actions
    assert isinstance(prune, PruneEntries) and prune.nodes == ("gb-2",)
    pruned = entries.model_copy(update={"daemons": (entries.daemons or [])[:1]})
    after = fold(observed, prune, Pruned(pruned, (pod("gb-1", clique_id="c.1"),)))
    (write,) = desired(after, settings(), NOW).actions
    assert isinstance(write, WriteStatus)
    assert [n.name for n in write.status.nodes or ()] == ["gb-1"]
    assert write.status.status is ReadyStatus.NOT_READY, "1 of numNodes=2"


def test_a_pod_the_cache_had_not_seen_stops_the_pruning() -> None:
    """The live list found the pod: nothing is removed, and the planner does not ask again."""
    _, ready = walk(Observed(cd=compute_domain(finalizers=())), settings())
    entries = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"))
    observed = replace(ready, cliques=(entries,))
    (prune,) = desired(observed, settings(), NOW).actions
    after = fold(observed, prune, Pruned(entries, (pod("gb-1", clique_id="c.1"),)))
    (write,) = desired(after, settings(), NOW).actions
    assert isinstance(write, WriteStatus) and [n.name for n in write.status.nodes or ()] == ["gb-1"]


def test_a_lost_node_is_named_in_the_condition() -> None:
    _, ready = walk(Observed(cd=compute_domain(finalizers=(), num_nodes=2)), settings())
    entries = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), ("gb-2", "10.0.0.2", 1, "Ready"))
    lost = replace(node("gb-2"), lost="Ready=Unknown since 2026-11-29T11:59:00Z: NodeStatusUnknown")
    observed = replace(
        ready,
        cliques=(entries,),
        pods=(pod("gb-1", clique_id="c.1"), pod("gb-2", clique_id="c.1")),
        labelled_nodes=(node("gb-1"), lost),
    )
    (write,) = desired(observed, settings(), NOW).actions
    assert isinstance(write, WriteStatus) and write.status.status is ReadyStatus.NOT_READY
    assert {n.name: n.status for n in write.status.nodes or ()} == {
        "gb-1": ReadyStatus.READY,
        "gb-2": ReadyStatus.NOT_READY,
    }
    cond = (write.status.conditions or [])[0]
    assert cond.message == (
        "1 of 2 daemons ready; node gb-2: node lost (Ready=Unknown since 2026-11-29T11:59:00Z: NodeStatusUnknown)"
    )


@pytest.mark.parametrize("name", ["Bad_Name", "UPPER", "-x", "x" * 254, "a..b"])
def test_an_invalid_template_name_is_stuck_before_anything_is_written(name: str) -> None:
    plan = desired(Observed(cd=compute_domain(finalizers=(), template=name)), settings(), NOW)
    assert not plan.actions, "nothing half-created, not even the finalizer"
    assert plan.stuck is not None
    reason, message = plan.stuck
    assert reason == "InvalidSpec"
    assert message.startswith(f"spec.channel.resourceClaimTemplate.name {name!r} is not a valid object name")
    assert "delete this ComputeDomain and create it with a valid name" in message


@pytest.mark.parametrize("name", ["imex-channel-0", "a", "a.b-c.d", "x" * 253])
def test_valid_template_names(name: str) -> None:
    assert spec_problem(compute_domain(template=name)) is None


def test_a_wait_is_written_to_the_status() -> None:
    observed = Observed(
        cd=compute_domain(), children=(child(ChildKind.DAEMON_TEMPLATE, terminating=True, finalizers=("x/y",)),)
    )
    plan = desired(observed, settings(), NOW)
    (write,) = plan.actions
    assert isinstance(write, WriteStatus)
    cond = (write.status.conditions or [])[0]
    assert (cond.reason, cond.message) == (
        "WaitingForDeletion",
        "waiting for the deleted daemon ResourceClaimTemplate to go away",
    )
    written = fold(observed, write, apiserver(observed, write))
    again = desired(written, settings(), NOW)
    assert not again.actions and again.waiting, "written once, then only waiting"
