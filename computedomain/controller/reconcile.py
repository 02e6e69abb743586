"""The pure half of the reconcile: ``plan = desired(observed, settings, now)`` and ``fold``.

``desired`` looks at one domain's ``Observed`` snapshot and returns the next batch of writes (a ``Plan``):
actions in one batch are independent and may run concurrently; anything that must wait for them is left to
the next plan. The executor applies a batch, folds each result back into the snapshot with ``fold`` (the
apiserver's answer is the freshest state there is), and asks again, until the plan is empty. So one pass
walks the whole SPEC order without waiting for watch events, and a crash at any point leaves a state from
which the next ``desired`` continues.

driverManaged, live domain: finalizer -> daemon template -> DaemonSet (-> the daemons' NetworkPolicy, when
enabled) -> workload template -> status.
hostManaged, live domain: finalizer -> workload template (allocationMode Single) -> status.
Terminating domain (either mode; a domain set up in the other mode is torn down completely too): delete the
workload template -> delete daemon template and DaemonSet -> remove the CD label from nodes -> drop our
finalizer from terminating children -> (wait until they are gone) -> drop the CD finalizer.

A child that is terminating while its domain lives (a user deleted it) is released and then recreated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeAlias

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER
from computedomain.api.models import ComputeDomain, ComputeDomainStatus
from computedomain.controller import claim_templates, daemonset, network_policy, status
from computedomain.controller.observed import Child, ChildKind, NodeView, Observed
from computedomain.controller.status import EventSpec
from computedomain.settings import ControllerSettings, FeatureGate

# --- actions -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddFinalizer:
    """Add our finalizer to the ComputeDomain."""


@dataclass(frozen=True)
class RemoveFinalizer:
    """Drop our finalizer from the ComputeDomain: the last step of its teardown."""


@dataclass(frozen=True)
class CreateChild:
    kind: ChildKind
    body: dict[str, Any] = field(hash=False)

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


@dataclass(frozen=True)
class DeleteChild:
    child: Child


@dataclass(frozen=True)
class ReleaseChild:
    """Drop our finalizer from a terminating child."""

    child: Child


@dataclass(frozen=True)
class UnlabelNode:
    node: NodeView


@dataclass(frozen=True)
class WriteStatus:
    status: ComputeDomainStatus = field(hash=False)
    events: tuple[EventSpec, ...] = ()


Action: TypeAlias = (
    AddFinalizer | RemoveFinalizer | CreateChild | DeleteChild | ReleaseChild | UnlabelNode | WriteStatus
)


@dataclass(frozen=True)
class Plan:
    """The next batch of writes; empty when the domain is where it should be (or must wait for events)."""

    actions: tuple[Action, ...] = ()
    # Why nothing more can happen now (for logs): "waiting for ..." or "".
    waiting: str = ""

    def __bool__(self) -> bool:
        return bool(self.actions)


DONE = Plan()


def _batch(*actions: Action) -> Plan:
    return Plan(tuple(actions))


# --- the planner ---------------------------------------------------------------------------------------


def desired(observed: Observed, settings: ControllerSettings, now: datetime) -> Plan:
    cd = observed.cd
    if cd.metadata.deletion_timestamp is not None:
        return _teardown(observed)
    if COMPUTE_DOMAIN_FINALIZER not in cd.metadata.finalizers:
        return _batch(AddFinalizer())
    # A child someone deleted while the domain lives: let it go, then it is recreated below.
    released = [ReleaseChild(c) for c in observed.children if c.terminating and c.has_our_finalizer]
    if released:
        return _batch(*released)
    if not settings.host_managed:
        if not _live(observed, ChildKind.DAEMON_TEMPLATE):
            if observed.of_kind(ChildKind.DAEMON_TEMPLATE):
                return Plan(waiting="waiting for the deleted daemon template to go away")
            return _batch(CreateChild(ChildKind.DAEMON_TEMPLATE, claim_templates.daemon_template(cd, settings)))
        if not _live(observed, ChildKind.DAEMONSET):
            if observed.of_kind(ChildKind.DAEMONSET):
                return Plan(waiting="waiting for the deleted DaemonSet to go away")
            return _batch(CreateChild(ChildKind.DAEMONSET, daemonset.daemonset(cd, settings)))
        if settings.daemon_network_policy and not observed.of_kind(ChildKind.NETWORK_POLICY):
            return _batch(CreateChild(ChildKind.NETWORK_POLICY, network_policy.network_policy(cd, settings)))
    workload = _live(observed, ChildKind.WORKLOAD_TEMPLATE)
    if not workload:
        if observed.of_kind(ChildKind.WORKLOAD_TEMPLATE):
            return Plan(waiting="waiting for the deleted workload template to go away")
        if not observed.template_name_conflict:
            return _batch(CreateChild(ChildKind.WORKLOAD_TEMPLATE, claim_templates.workload_template(cd, settings)))
    return _status_plan(observed, settings, now, workload)


def _live(observed: Observed, kind: ChildKind) -> tuple[Child, ...]:
    return tuple(c for c in observed.of_kind(kind) if not c.terminating)


def desired_status(
    observed: Observed, settings: ControllerSettings, now: datetime, workload: Sequence[Child]
) -> ComputeDomainStatus:
    cd = observed.cd
    nodes = []
    if observed.template_name_conflict and not workload:
        verdict = status.conflict_verdict(observed.template_name_conflict)
    elif settings.host_managed:
        verdict = status.host_managed_verdict(claim_templates.workload_template_name(cd))
    else:
        if settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES):
            nodes = status.node_entries(observed.cliques, observed.pods)
        else:
            # The daemons own status.nodes in this mode; derive the verdict from their entries only.
            nodes = list(cd.status.nodes or ()) if cd.status else []
        verdict = status.assess(nodes, cd.spec.num_nodes)
    return status.build_status(cd, verdict, nodes, now)


def _status_plan(observed: Observed, settings: ControllerSettings, now: datetime, workload: Sequence[Child]) -> Plan:
    new = desired_status(observed, settings, now, workload)
    if not status.status_differs(observed.cd.status, new):
        return DONE
    return _batch(WriteStatus(new, tuple(status.transition_events(observed.cd, new))))


def _teardown(observed: Observed) -> Plan:
    """SPEC section 4 deletion order; every step is idempotent and tolerates objects already gone."""
    cd = observed.cd
    for kinds in (
        (ChildKind.WORKLOAD_TEMPLATE,),
        (ChildKind.DAEMON_TEMPLATE, ChildKind.DAEMONSET, ChildKind.NETWORK_POLICY),
    ):
        doomed = [DeleteChild(c) for c in observed.children if c.kind in kinds and not c.terminating]
        if doomed:
            return _batch(*doomed)
    if observed.labelled_nodes:
        return _batch(*(UnlabelNode(n) for n in observed.labelled_nodes))
    released = [ReleaseChild(c) for c in observed.children if c.has_our_finalizer]
    if released:
        return _batch(*released)
    if observed.children:
        names = ", ".join(str(c) for c in observed.children)
        return Plan(waiting=f"waiting for {names} to go away")
    if COMPUTE_DOMAIN_FINALIZER in cd.metadata.finalizers:
        return _batch(RemoveFinalizer())
    return DONE


# --- folding results back ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gone:
    """An action's target no longer exists (NotFound, or deleted outright)."""


@dataclass(frozen=True)
class NameTaken:
    """Creating the workload template failed: a foreign object holds the name."""

    detail: str


Result: TypeAlias = ComputeDomain | Child | Gone | NameTaken | None


def fold(observed: Observed, action: Action, result: Result) -> Observed:
    """The snapshot after ``action`` produced ``result`` (the object the apiserver returned)."""
    if isinstance(action, AddFinalizer | RemoveFinalizer | WriteStatus):
        return replace(observed, cd=result) if isinstance(result, ComputeDomain) else observed
    if isinstance(action, CreateChild):
        if isinstance(result, NameTaken):
            return replace(observed, template_name_conflict=result.detail)
        return observed.with_child(result) if isinstance(result, Child) else observed
    if isinstance(action, DeleteChild | ReleaseChild):
        # The executor answers Gone when the object went away (no finalizer held it).
        return observed.with_child(result) if isinstance(result, Child) else observed.without_child(action.child.key)
    if isinstance(action, UnlabelNode):
        return replace(observed, labelled_nodes=tuple(n for n in observed.labelled_nodes if n != action.node))
    raise TypeError(f"unknown action {action!r}")  # pragma: no cover
