"""The pure half of the reconcile: ``plan = desired(observed, settings, now)`` and ``fold``.

``desired`` looks at one domain's ``Observed`` snapshot and returns the next batch of writes (a ``Plan``):
actions in one batch are independent and may run concurrently; anything that must wait for them is left to
the next plan. The executor applies a batch, folds each result back into the snapshot with ``fold`` (the
apiserver's answer is the freshest state there is), and asks again, until the plan is empty. So one pass
walks the whole SPEC order without waiting for watch events, and a crash at any point leaves a state from
which the next ``desired`` continues.

A spec the controller cannot act on (``spec_problem``: a workload template name that is no valid object
name) is a ``Plan`` that is ``stuck``: nothing is written (no finalizer, no children: nothing half-created)
and the executor reports it through the convergence loop (condition and Event naming the field).

Children are the labelled objects ``adoption`` accepts; every other labelled object is left alone and reported
(condition ``ForeignObjects``, an Event when the set changes). A create that finds a foreign object holding the
name stops there and says so in the Ready condition (``TemplateNameConflict``, ``NameConflict``).

driverManaged, live domain: finalizer -> daemon template (+ the daemons' NetworkPolicy, when enabled, so it is in
place before the first daemon pod) -> DaemonSet (a DaemonSet the reference driver made gets this project's pod
template, with OnDelete updates: ``TakeOverDaemonSet``) + workload template, in one batch -> stale clique
entries pruned -> status. Three write round trips before the status rather than five: a burst of domains is
bounded by round trips per worker. The workload template is never written before the daemon template (the mode
guard reads a live domain with a workload template and no daemon objects as one set up hostManaged).
hostManaged, live domain: finalizer -> workload template (allocationMode Single) -> status. With channel
isolation (``IMEX_ISOLATION=channel``) ``allocationMode: All`` is refused (stuck), and the status carries the
domain's IMEX channels (``channels``, assigned elsewhere) and says when a clique has none left.
While a step waits for something (a child someone deleted going away), the status says so.
Terminating domain (either mode; a domain set up in the other mode is torn down completely too): delete the
workload template -> delete daemon template and DaemonSet (and, with channel isolation, the domain's channel
records, which then keep its channels until no claim holds them) -> remove the CD label from nodes -> drop
our finalizer from terminating children -> (wait until they are gone) -> drop the CD finalizer.

A child that is terminating while its domain lives (a user deleted it) is released and then recreated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeAlias

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER
from computedomain.api.models import (
    AllocationMode,
    ComputeDomain,
    ComputeDomainChannel,
    ComputeDomainClique,
    ComputeDomainNode,
    ComputeDomainStatus,
    ReadyStatus,
)
from computedomain.controller import adoption, claim_templates, daemonset, network_policy, spread, status
from computedomain.controller.adoption import Foreign
from computedomain.controller.observed import Child, ChildKind, NodeView, Observed, PodView
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
class TakeOverDaemonSet:
    """Give a DaemonSet the reference driver made this project's pod template (``daemonset.taken_over``)."""

    child: Child


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
class PruneEntries:
    """Remove the entries of ``nodes`` from a clique: their daemon pods are gone (confirmed live first)."""

    clique: ComputeDomainClique = field(hash=False)
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class DeleteRecord:
    """Channel isolation: delete a channel record of a domain being torn down (it stays, holding the channel,
    until no claim is prepared with it any more)."""

    clique: ComputeDomainClique = field(hash=False)
    name: str


@dataclass(frozen=True)
class WriteStatus:
    status: ComputeDomainStatus = field(hash=False)
    events: tuple[EventSpec, ...] = ()


Action: TypeAlias = (
    AddFinalizer
    | RemoveFinalizer
    | CreateChild
    | TakeOverDaemonSet
    | DeleteChild
    | ReleaseChild
    | UnlabelNode
    | PruneEntries
    | DeleteRecord
    | WriteStatus
)


@dataclass(frozen=True)
class Plan:
    """The next batch of writes; empty when the domain is where it should be (or must wait for events)."""

    actions: tuple[Action, ...] = ()
    # Why nothing more can happen now (for logs): "waiting for ..." or "".
    waiting: str = ""
    # A problem only a change of the domain (or its inputs) can solve: (reason, message naming the field).
    stuck: tuple[str, str] | None = None

    def __bool__(self) -> bool:
        return bool(self.actions)


DONE = Plan()


def _batch(*actions: Action) -> Plan:
    return Plan(tuple(actions))


# --- the planner ---------------------------------------------------------------------------------------


# A Kubernetes object name (DNS-1123 subdomain): what the workload template's name must be.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def spec_problem(cd: ComputeDomain) -> str | None:
    """Why the controller cannot act on this spec (one line naming the field and the fix), or None.

    The CRD keeps the reference's schema, which does not constrain the template name; an invalid one would
    only fail at its create, after the daemon objects exist.
    """
    name = cd.spec.channel.resource_claim_template.name
    if len(name) <= 253 and _SUBDOMAIN.fullmatch(name):
        return None
    return (
        f"spec.channel.resourceClaimTemplate.name {name!r} is not a valid object name (lower-case letters, digits,"
        " '-' and '.', starting and ending alphanumeric, at most 253 characters); the spec is immutable: "
        "delete this ComputeDomain and create it with a valid name"
    )


def isolation_problem(cd: ComputeDomain, settings: ControllerSettings) -> str | None:
    """Why this spec cannot run with channel isolation, or None."""
    if settings.channel_isolation and cd.spec.channel.allocation_mode is AllocationMode.ALL:
        return (
            "spec.channel.allocationMode All is refused with channel isolation (IMEX_ISOLATION=channel): it would "
            "give the domain's pods every IMEX channel of their nodes, other domains' channels included; the spec "
            "is immutable: delete this ComputeDomain and create it with allocationMode Single"
        )
    return None


def desired(observed: Observed, settings: ControllerSettings, now: datetime) -> Plan:
    cd = observed.cd
    children, foreign = adoption.split(cd, observed.children, settings)
    observed = replace(observed, children=children)
    if cd.metadata.deletion_timestamp is not None:
        return _teardown(observed, settings)
    problem = spec_problem(cd) or isolation_problem(cd, settings)
    if problem is not None:
        return Plan(stuck=("InvalidSpec", problem))
    if COMPUTE_DOMAIN_FINALIZER not in cd.metadata.finalizers:
        return _batch(AddFinalizer())
    # A child someone deleted while the domain lives: let it go, then it is recreated below.
    released = [ReleaseChild(c) for c in observed.children if c.terminating and c.has_our_finalizer]
    if released:
        return _batch(*released)
    if not settings.host_managed:
        # Two batches: what must exist before the first daemon pod (its claim template; the NetworkPolicy, so
        # the daemons' ports are closed to others from the start), then the DaemonSet with the workload
        # template. The workload template never comes before the daemon template: a live domain with a
        # workload template and no daemon objects is what the mode guard reads as set up hostManaged.
        daemon_template = _step(observed, ChildKind.DAEMON_TEMPLATE)
        if (held := _held(daemon_template, observed, settings, now, foreign)) is not None:
            return held
        first: list[Action] = []
        if daemon_template.create:
            first.append(CreateChild(ChildKind.DAEMON_TEMPLATE, claim_templates.daemon_template(cd, settings)))
        if settings.daemon_network_policy and _step(observed, ChildKind.NETWORK_POLICY).create:
            first.append(CreateChild(ChildKind.NETWORK_POLICY, network_policy.network_policy(cd, settings)))
        if first:
            return _batch(*first)
        ds = _step(observed, ChildKind.DAEMONSET)
        if (held := _held(ds, observed, settings, now, foreign)) is not None:
            return held
        second: list[Action] = []
        if ds.create:
            second.append(CreateChild(ChildKind.DAEMONSET, daemonset.daemonset(cd, settings)))
        elif not adoption.is_ours(live := _live(observed, ChildKind.DAEMONSET)[0]):
            second.append(TakeOverDaemonSet(live))
        if _step(observed, ChildKind.WORKLOAD_TEMPLATE).create:
            second.append(CreateChild(ChildKind.WORKLOAD_TEMPLATE, claim_templates.workload_template(cd, settings)))
        if second:
            return _batch(*second)
    workload = _step(observed, ChildKind.WORKLOAD_TEMPLATE)
    if workload.waiting:
        return _waiting(observed, now, workload.waiting, foreign)
    if workload.create:
        return _batch(CreateChild(ChildKind.WORKLOAD_TEMPLATE, claim_templates.workload_template(cd, settings)))
    if not settings.host_managed and settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES):
        stale = status.stale_entries(observed.cliques, observed.pods)
        prunes = [PruneEntries(c, stale[c.metadata.name]) for c in observed.cliques if c.metadata.name in stale]
        if prunes:
            return _batch(*prunes)
    return _status_plan(observed, settings, now, foreign)


_WHAT = {
    ChildKind.DAEMON_TEMPLATE: "daemon ResourceClaimTemplate",
    ChildKind.DAEMONSET: "DaemonSet",
    ChildKind.WORKLOAD_TEMPLATE: "workload ResourceClaimTemplate",
    ChildKind.NETWORK_POLICY: "NetworkPolicy",
}


@dataclass(frozen=True, slots=True)
class _Step:
    """What one child of a live domain needs: a create, a wait for a deleted one to go away, or nothing
    (it is live, or a foreign object holds its name: ``conflict``, which the status tells)."""

    create: bool = False
    waiting: str = ""
    conflict: bool = False


def _step(observed: Observed, kind: ChildKind) -> _Step:
    if _live(observed, kind):
        return _Step()
    if observed.of_kind(kind):
        return _Step(waiting=f"waiting for the deleted {_WHAT[kind]} to go away")
    if observed.conflict(kind):
        return _Step(conflict=True)
    return _Step(create=True)


def _held(
    step: _Step, observed: Observed, settings: ControllerSettings, now: datetime, foreign: Sequence[Foreign]
) -> Plan | None:
    """The plan while a child the next ones need cannot be created (a deleted one going away, a foreign object
    holding its name: the status tells which), else None."""
    if step.waiting:
        return _waiting(observed, now, step.waiting, foreign)
    if step.conflict:
        return _status_plan(observed, settings, now, foreign)
    return None


def _waiting(observed: Observed, now: datetime, waiting: str, foreign: Sequence[Foreign] = ()) -> Plan:
    """Nothing to write but the status, which says what the domain waits for."""
    cd = observed.cd
    new = _with_foreign(
        cd, status.build_status(cd, status.waiting_verdict(waiting), _current_nodes(cd), now), foreign, now
    )
    if not status.status_differs(cd.status, new):
        return Plan(waiting=waiting)
    return Plan((WriteStatus(new, tuple(_foreign_events(cd, new))),), waiting=waiting)


def _with_foreign(
    cd: ComputeDomain, new: ComputeDomainStatus, foreign: Sequence[Foreign], now: datetime
) -> ComputeDomainStatus:
    """``new`` with the ``ForeignObjects`` condition set while labelled objects are not adopted, else removed."""
    condition = adoption.foreign_condition(cd, foreign, now)
    kept = [c for c in new.conditions or () if c.type != adoption.FOREIGN_CONDITION]
    return new.model_copy(update={"conditions": [*kept, condition] if condition else kept})


def _foreign_events(cd: ComputeDomain, new: ComputeDomainStatus) -> list[EventSpec]:
    """A Warning when the set of labelled objects that are not adopted changes (appears or grows)."""

    def message(s: ComputeDomainStatus | None) -> str:
        found = next((c for c in (s.conditions or ()) if c.type == adoption.FOREIGN_CONDITION), None) if s else None
        return found.message if found else ""

    now_message = message(new)
    if now_message and now_message != message(cd.status):
        return [EventSpec("Warning", "ForeignObject", now_message)]
    return []


def _current_nodes(cd: ComputeDomain) -> list[ComputeDomainNode]:
    return list(cd.status.nodes or ()) if cd.status else []


def _live(observed: Observed, kind: ChildKind) -> tuple[Child, ...]:
    return tuple(c for c in observed.of_kind(kind) if not c.terminating)


def desired_status(
    observed: Observed, settings: ControllerSettings, now: datetime, foreign: Sequence[Foreign] = ()
) -> ComputeDomainStatus:
    cd = observed.cd
    nodes = []
    channels: list[ComputeDomainChannel] = []
    if settings.channel_isolation:
        channels = status.channel_entries(observed.cliques)
    blocked = next(((kind, detail) for kind, detail in observed.name_conflicts if not _live(observed, kind)), None)
    if blocked is not None:
        kind, detail = blocked
        reason = status.REASON_TEMPLATE_CONFLICT if kind is ChildKind.WORKLOAD_TEMPLATE else status.REASON_NAME_CONFLICT
        verdict = status.conflict_verdict(detail, reason)
    elif settings.channel_isolation and observed.exhausted_cliques:
        verdict = status.exhausted_verdict(observed.exhausted_cliques, settings.imex_channel_count, observed.lingering)
    elif settings.host_managed:
        isolation = status.channel_text(channels) if settings.channel_isolation else None
        verdict = status.host_managed_verdict(claim_templates.workload_template_name(cd), isolation)
    else:
        lost = status.lost_nodes(observed.labelled_nodes)
        if settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES):
            nodes = status.node_entries(observed.cliques, observed.pods, lost)
        else:
            # The daemons own status.nodes in this mode; derive the verdict from their entries only.
            nodes = _current_nodes(cd)
        verdict = status.assess(nodes, cd.spec.num_nodes, lost)
        built = spread.with_span(cd, status.build_status(cd, verdict, nodes, now, channels), now)
        return _with_foreign(cd, built, foreign, now)
    return _with_foreign(cd, status.build_status(cd, verdict, nodes, now, channels), foreign, now)


def _status_plan(
    observed: Observed, settings: ControllerSettings, now: datetime, foreign: Sequence[Foreign] = ()
) -> Plan:
    cd = observed.cd
    new = desired_status(observed, settings, now, foreign)
    if not status.status_differs(cd.status, new, conditions=not observed.conditions_pruned):
        return DONE
    if observed.conditions_pruned:
        # Without the stored condition there is no previous one to compare: an Event only for a flip.
        return _batch(WriteStatus(new, _flip_events(cd, new)))
    events = (*status.transition_events(cd, new), *_foreign_events(cd, new), *spread.span_events(cd, new))
    return _batch(WriteStatus(new, events))


def _flip_events(cd: ComputeDomain, new: ComputeDomainStatus) -> tuple[EventSpec, ...]:
    """The readiness Events from ``status.status`` alone (its conditions are pruned)."""
    if cd.status is not None and cd.status.status is new.status:
        return ()
    message = next((c.message for c in new.conditions or () if c.type == status.READY_CONDITION), "")
    if new.status is ReadyStatus.READY:
        return (EventSpec("Normal", "Ready", message),)
    return (EventSpec("Warning", "NotReady", message),) if cd.status is not None else ()


def _teardown(observed: Observed, settings: ControllerSettings) -> Plan:
    """SPEC section 4 deletion order; every step is idempotent and tolerates objects already gone."""
    cd = observed.cd
    for kinds in (
        (ChildKind.WORKLOAD_TEMPLATE,),
        (ChildKind.DAEMON_TEMPLATE, ChildKind.DAEMONSET, ChildKind.NETWORK_POLICY),
    ):
        doomed: list[Action] = [DeleteChild(c) for c in observed.children if c.kind in kinds and not c.terminating]
        if settings.channel_isolation and kinds[0] is ChildKind.DAEMON_TEMPLATE:
            # Not waited for: a record keeps its channel as long as a claim holds it, domain or not.
            doomed += [
                DeleteRecord(c, c.metadata.name) for c in observed.cliques if c.metadata.deletion_timestamp is None
            ]
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
    """Creating a child failed: an object that is not the domain's child holds the name."""

    detail: str


@dataclass(frozen=True)
class Pruned:
    """The clique after pruning (as the apiserver has it), and the domain's daemon pods read live."""

    clique: ComputeDomainClique | None
    pods: tuple[PodView, ...]


Result: TypeAlias = ComputeDomain | Child | Gone | NameTaken | Pruned | None


def fold(observed: Observed, action: Action, result: Result) -> Observed:
    """The snapshot after ``action`` produced ``result`` (the object the apiserver returned)."""
    if isinstance(action, AddFinalizer | RemoveFinalizer | WriteStatus):
        return replace(observed, cd=result) if isinstance(result, ComputeDomain) else observed
    if isinstance(action, CreateChild):
        if isinstance(result, NameTaken):
            return replace(observed, name_conflicts=(*observed.name_conflicts, (action.kind, result.detail)))
        return observed.with_child(result) if isinstance(result, Child) else observed
    if isinstance(action, TakeOverDaemonSet):
        return observed.with_child(result) if isinstance(result, Child) else observed.without_child(action.child.key)
    if isinstance(action, DeleteChild | ReleaseChild):
        # The executor answers Gone when the object went away (no finalizer held it).
        return observed.with_child(result) if isinstance(result, Child) else observed.without_child(action.child.key)
    if isinstance(action, UnlabelNode):
        return replace(observed, labelled_nodes=tuple(n for n in observed.labelled_nodes if n != action.node))
    if isinstance(action, DeleteRecord):
        return replace(observed, cliques=tuple(c for c in observed.cliques if c.metadata.name != action.name))
    if isinstance(action, PruneEntries):
        # The live pods make the planner stop asking, also when the cache simply had not seen a pod yet.
        assert isinstance(result, Pruned)
        folded = observed.with_pods(result.pods)
        if result.clique is None:
            name = action.clique.metadata.name
            return replace(folded, cliques=tuple(c for c in folded.cliques if c.metadata.name != name))
        return folded.with_clique(result.clique)
    raise TypeError(f"unknown action {action!r}")  # pragma: no cover
