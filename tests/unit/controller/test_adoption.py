"""The adoption rule: a label alone makes nothing a domain's child. Spoofed objects suppress nothing, are never
deleted or waited for, and are reported; the reference driver's objects are adopted as they are, and its
DaemonSet gets this service's pod template without restarting a running daemon."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ReadyStatus
from computedomain.controller import adoption, guard
from computedomain.controller.daemonset import REFERENCE_PEER_PREFIX, taken_over
from computedomain.controller.observed import Child, ChildKind, Observed, decode_child
from computedomain.controller.reconcile import (
    CreateChild,
    DeleteChild,
    NameTaken,
    ReleaseChild,
    RemoveFinalizer,
    TakeOverDaemonSet,
    WriteStatus,
    desired,
    fold,
)
from computedomain.settings import ImexMode
from tests.testbed import reference
from tests.unit.controller.helpers import (
    DRIVER_NS,
    NOW,
    OTHER_UID,
    UID,
    all_children,
    child,
    compute_domain,
    host_settings,
    settings,
)

CFG = settings()


def _set(path: tuple[str | int, ...], value: Any) -> Any:
    def edit(raw: dict[str, Any]) -> None:
        target: Any = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


PARAMS = ("spec", "spec", "devices", "config", 0, "opaque", "parameters")


@pytest.mark.parametrize(
    ("kind", "changes", "why"),
    [
        (ChildKind.WORKLOAD_TEMPLATE, {"namespace": "tenant-b"}, "namespace is tenant-b, not team"),
        (ChildKind.WORKLOAD_TEMPLATE, {"name": "other"}, "name is other, not imex-channel-0"),
        (ChildKind.WORKLOAD_TEMPLATE, {"edit": _set((*PARAMS, "domainID"), OTHER_UID)}, "domainID"),
        (
            ChildKind.WORKLOAD_TEMPLATE,
            {"edit": _set(("spec", "spec", "devices", "requests", 0, "exactly", "deviceClassName"), "gpu.nvidia.com")},
            "device class is gpu.nvidia.com",
        ),
        (
            ChildKind.WORKLOAD_TEMPLATE,
            {"edit": _set(("metadata", "ownerReferences"), [{"uid": "x-1", "controller": True, "kind": "Job"}])},
            "controlled by x-1",
        ),
        (ChildKind.DAEMON_TEMPLATE, {"namespace": "tenant-b"}, "namespace tenant-b is not one this controller manages"),
        (
            ChildKind.DAEMON_TEMPLATE,
            {"edit": _set((*PARAMS, "kind"), "ComputeDomainChannelConfig")},
            "opaque config kind",
        ),
        (ChildKind.DAEMONSET, {"name": "old-x"}, "name is old-x"),
        (
            ChildKind.DAEMONSET,
            {"edit": _set(("spec", "template", "spec", "nodeSelector"), {"kubernetes.io/hostname": "gb-1"})},
            "node selector is missing",
        ),
        (ChildKind.NETWORK_POLICY, {"edit": _set(("spec", "podSelector"), {})}, "pod selector is missing"),
    ],
)
def test_what_a_label_does_not_make_a_child(kind: ChildKind, changes: dict[str, Any], why: str) -> None:
    cd = compute_domain()
    assert adoption.why_foreign(cd, child(kind), CFG) is None  # what the controller builds is adopted
    spoof = child(kind, **changes)
    reason = adoption.why_foreign(cd, spoof, CFG)
    assert reason is not None and why in reason, reason


def test_a_spoofed_template_suppresses_nothing_and_is_reported() -> None:
    """A tenant's template in its own namespace, labelled with another tenant's domain, used to count as that
    domain's workload template (never created) and got deleted and waited for at teardown."""
    spoof = child(ChildKind.WORKLOAD_TEMPLATE, namespace="tenant-b", finalizers=("tenant-b/keep",))
    spoof_daemon = child(ChildKind.DAEMON_TEMPLATE, namespace="tenant-b")
    ours = tuple(c for c in all_children() if c.kind is not ChildKind.WORKLOAD_TEMPLATE)
    observed = Observed(cd=compute_domain(), children=(*ours, spoof, spoof_daemon))
    (create,) = desired(observed, CFG, NOW).actions
    assert isinstance(create, CreateChild) and create.kind is ChildKind.WORKLOAD_TEMPLATE
    observed = fold(observed, create, decode_child(create.body, create.kind))
    (write,) = desired(observed, CFG, NOW).actions
    assert isinstance(write, WriteStatus) and write.status.status is ReadyStatus.READY
    foreign = next(c for c in write.status.conditions or () if c.type == "ForeignObjects")
    assert foreign.status == "True" and foreign.reason == "NotAdopted"
    assert "WorkloadTemplate tenant-b/imex-channel-0" in foreign.message and "2 object(s)" in foreign.message
    assert ("Warning", "ForeignObject") in [(e.type, e.reason) for e in write.events]
    reported = fold(observed, write, observed.cd.model_copy(update={"status": write.status}))
    assert not desired(reported, CFG, NOW), "reported once: no Event and no write while nothing changes"

    # Teardown: the spoofs are neither deleted nor released nor waited for.
    gone = replace(reported, cd=compute_domain(deleting=True), children=(*ours, spoof, spoof_daemon))
    touched: list[Child] = []
    for _ in range(10):
        plan = desired(gone, CFG, NOW)
        if isinstance(plan.actions[0], RemoveFinalizer):
            break
        for action in plan.actions:
            assert isinstance(action, DeleteChild | ReleaseChild), action
            touched.append(action.child)
            gone = replace(
                gone,
                children=tuple(c for c in gone.children if c.key != action.child.key)
                + ((replace(action.child, terminating=True),) if isinstance(action, DeleteChild) else ()),
            )
    else:
        raise AssertionError("teardown waited on the spoofed objects")
    assert spoof not in touched and spoof_daemon not in touched


def test_the_report_goes_when_the_spoof_goes() -> None:
    spoof = child(ChildKind.WORKLOAD_TEMPLATE, namespace="tenant-b")
    observed = Observed(cd=compute_domain(), children=(*all_children(), spoof))
    (write,) = desired(observed, CFG, NOW).actions
    assert isinstance(write, WriteStatus)
    reported = observed.cd.model_copy(update={"status": write.status})
    (cleared,) = desired(Observed(cd=reported, children=all_children()), CFG, NOW).actions
    assert isinstance(cleared, WriteStatus) and not cleared.events
    assert [c.type for c in cleared.status.conditions or ()] == ["Ready"]


def test_a_foreign_object_holding_the_daemonset_name_is_a_name_conflict() -> None:
    observed = Observed(cd=compute_domain(), children=(child(ChildKind.DAEMON_TEMPLATE),))
    creates = desired(observed, CFG, NOW).actions
    assert all(isinstance(c, CreateChild) for c in creates)
    by_kind = {c.kind: c for c in creates if isinstance(c, CreateChild)}
    assert set(by_kind) == {ChildKind.DAEMONSET, ChildKind.WORKLOAD_TEMPLATE}  # one batch
    create = by_kind[ChildKind.DAEMONSET]
    blocked = fold(observed, create, NameTaken(f"DaemonSet {DRIVER_NS}/computedomain-daemon-{UID} already exists"))
    (write,) = desired(blocked, CFG, NOW).actions
    assert isinstance(write, WriteStatus) and write.status.status is ReadyStatus.NOT_READY
    cond = (write.status.conditions or [])[0]
    assert cond.reason == "NameConflict" and "already exists" in cond.message
    assert [e.reason for e in write.events] == ["NotReady"]


def test_the_sweep_removes_only_what_belongs_to_the_label_domain() -> None:
    gone_uid = "7d0e28ba-2fa1-411d-8a1f-6ec5c1f3a8e4"
    ours = [child(k, uid=gone_uid) for k in ChildKind]
    assert all(adoption.belongs(c, CFG) for c in ours)
    spoofs = [
        child(ChildKind.WORKLOAD_TEMPLATE, uid=gone_uid, edit=_set((*PARAMS, "domainID"), OTHER_UID)),
        child(ChildKind.DAEMONSET, uid=gone_uid, namespace="tenant-b"),
        child(ChildKind.DAEMON_TEMPLATE, uid=gone_uid, name="anything"),
    ]
    assert not any(adoption.belongs(c, CFG) for c in spoofs)


def test_a_spoof_cannot_make_the_mode_guard_refuse_to_start() -> None:
    cd = compute_domain()
    spoof = child(ChildKind.DAEMON_TEMPLATE, namespace="tenant-b")
    workload = child(ChildKind.WORKLOAD_TEMPLATE)
    assert guard.check(ImexMode.HOST_MANAGED, [cd], [workload, spoof], [])  # what a label alone used to do
    children = adoption.children_of([cd], [workload, spoof], host_settings())
    assert children == [workload] and guard.check(ImexMode.HOST_MANAGED, [cd], children, []) == []


# --- the reference driver's objects of a running domain -----------------------------------------------------


def _reference_children(cd: dict[str, Any], scheduled: int = 2) -> tuple[Child, ...]:
    ds = reference.daemonset(
        cd, DRIVER_NS, image="nvcr.io/nvidia/k8s-dra-driver-gpu:v25.8.0", command=["compute-domain-daemon", "run"]
    )
    ds["status"] = {"currentNumberScheduled": scheduled, "numberMisscheduled": 0}
    return (
        decode_child(ds, ChildKind.DAEMONSET),
        decode_child(reference.daemon_template(cd, DRIVER_NS), ChildKind.DAEMON_TEMPLATE),
        decode_child(reference.workload_template(cd), ChildKind.WORKLOAD_TEMPLATE),
    )


def test_the_reference_objects_of_a_running_domain_are_adopted_and_its_daemonset_taken_over() -> None:
    cd = compute_domain()
    raw_cd = cd.model_dump(by_alias=True, mode="json")
    children = _reference_children(raw_cd)
    assert all(adoption.why_foreign(cd, c, CFG) is None for c in children)
    assert not adoption.is_ours(children[0])
    (take,) = desired(Observed(cd=cd, children=children), CFG, NOW).actions
    assert isinstance(take, TakeOverDaemonSet) and take.child.content.scheduled == 2

    current = reference.daemonset(raw_cd, DRIVER_NS, image="ref:1", command=["compute-domain-daemon", "run"])
    current["metadata"]["resourceVersion"] = "77"
    body = taken_over(current, cd, CFG)
    assert body["metadata"] == current["metadata"]  # same object, same resourceVersion: a conditional write
    assert body["spec"]["selector"] == current["spec"]["selector"]  # immutable, and the same anyway
    assert body["spec"]["updateStrategy"] == {"type": "OnDelete"}  # running daemons are never restarted
    container = body["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["IMEX_HOSTNAME_PREFIX"] == REFERENCE_PEER_PREFIX == "compute-domain-daemon"
    assert body["spec"]["template"]["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: UID}
    taken = decode_child(body, ChildKind.DAEMONSET)
    assert adoption.is_ours(taken) and adoption.why_foreign(cd, taken, CFG) is None

    # After the takeover the domain goes on like any other: status; nothing is recreated.
    after = fold(Observed(cd=cd, children=children), take, taken)
    batches = []
    for _ in range(5):
        plan = desired(after, CFG, NOW)
        if not plan:
            break
        batches.append([type(a).__name__ for a in plan.actions])
        for action in plan.actions:
            result: Any = (
                decode_child(action.body, action.kind)
                if isinstance(action, CreateChild)
                else after.cd.model_copy(update={"status": action.status})
            )
            after = fold(after, action, result)
    assert batches == [["WriteStatus"]]
    assert COMPUTE_DOMAIN_FINALIZER in after.cd.metadata.finalizers


# --- old CRDs: the apiserver prunes status.conditions ---------------------------------------------------------


def test_with_conditions_pruned_a_status_without_them_is_no_difference() -> None:
    from computedomain.controller.executor import StatusSchema

    observed = Observed(cd=compute_domain(), children=all_children())
    (write,) = desired(observed, CFG, NOW).actions
    assert isinstance(write, WriteStatus) and write.status.conditions
    pruned = write.status.model_copy(update={"conditions": None})  # what an old CRD keeps of it
    stored = observed.cd.model_copy(update={"status": pruned})
    again = desired(Observed(cd=stored, children=all_children()), CFG, NOW)
    assert again.actions, "without knowing, every reconcile writes again (and emits its Event)"
    assert not desired(Observed(cd=stored, children=all_children(), conditions_pruned=True), CFG, NOW)

    # A real change still gets written, with an Event only for a flip of status.status.
    flipped = compute_domain(num_nodes=2, status=pruned.to_api())
    (change,) = desired(Observed(cd=flipped, children=all_children(), conditions_pruned=True), CFG, NOW).actions
    assert isinstance(change, WriteStatus) and change.status.status is ReadyStatus.NOT_READY
    assert [e.reason for e in change.events] == ["NotReady"]

    now = [0.0]
    schema = StatusSchema(clock=lambda: now[0])
    written = observed.cd.model_copy(update={"status": pruned})
    assert schema.saw(write.status, written) == "pruned" and schema.pruned and schema.first_time()
    assert schema.saw(write.status, written) == "" and not schema.first_time()  # said once
    assert not schema.probe()
    now[0] = StatusSchema.PROBE_EVERY
    assert schema.probe() and not schema.probe()  # one probe write per period
    kept = observed.cd.model_copy(update={"status": write.status})
    assert schema.saw(write.status, kept) == "kept" and not schema.pruned and not schema.probe()
