"""The ComputeDomain's status: one pure aggregation, one writer (the reconcile of that domain).

Where the entries come from (driverManaged):

* with ``ComputeDomainCliques`` on (the default): every daemon entry of the domain's ComputeDomainClique
  objects, plus one entry per **non-fabric** daemon pod (clique label present and empty; such daemons run no
  IMEX and may not register in a clique) with ``index -1`` and the pod's readiness. A pod without the clique
  label has not labelled itself yet and counts as a fabric pod (upstream ca48d876);
* with the gate off the daemons write ``status.nodes`` themselves; the controller keeps their entries as they
  are and only derives the global status and the condition from them.

An entry whose Node is not Ready (lost: the node lifecycle controller set Ready to Unknown or False) is
reported NotReady, whatever its daemon wrote last: a dead node's daemon cannot say so itself. Entries whose
daemon pod is gone altogether (``stale_entries``) are pruned from the clique by the reconcile (confirmed
against a live list of pods first), as the reference's controller does.

Global status (SPEC section 4): ``NotReady`` while fewer entries than ``spec.numNodes`` or any entry is
``NotReady``, else ``Ready`` (so ``numNodes: 0`` with no daemons is Ready). hostManaged: ``Ready`` once the
workload template exists, ``nodes`` never filled. With channel isolation the domain's IMEX channels are
copied from its records into ``channels`` and named in the message, and a clique without a free channel for
it makes it ``NotReady`` (reason ``ChannelsExhausted``, naming the limit) until one is freed. The ``Ready`` condition carries a reason and a message
that says why, e.g. "2 of 4 daemons ready; node gb-7: NotReady", "node gb-3: node lost (Ready=Unknown
...)". Before any of that, from the first reconcile on, it says what the controller is waiting for, and a
failure the controller cannot get past (``failure_verdict``) replaces it: e.g. reason ``Forbidden`` with the
missing permission, ``InvalidSpec`` with the field.

``status_differs`` decides whether a write is needed: node lists compare as maps keyed by name, the
condition by everything but its timestamp; conditions are left out while the apiserver prunes them (a
ComputeDomain CRD older than this controller: ``executor.StatusSchema``). ``transition_events`` says which Events
a change deserves. ``is_progress`` says whether a write only tells more progress of a waiting domain, which the
executor spaces ``PROGRESS_INTERVAL`` apart so that consecutive changes coalesce.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from computedomain.api.models import (
    ComputeDomain,
    ComputeDomainChannel,
    ComputeDomainClique,
    ComputeDomainNode,
    ComputeDomainStatus,
    Condition,
    ConditionStatus,
    ReadyStatus,
)
from computedomain.controller.channels import Lingering
from computedomain.controller.observed import NodeView, PodView

READY_CONDITION = "Ready"
MAX_LISTED_NODES = 5

# Reasons of the Ready condition.
REASON_READY = "DaemonsReady"
REASON_NO_DAEMONS = "NoDaemonsExpected"
REASON_WAITING = "WaitingForDaemons"
REASON_NOT_READY = "DaemonsNotReady"
REASON_HOST_MANAGED = "HostManaged"
REASON_CREATING = "CreatingObjects"
REASON_TEMPLATE_CONFLICT = "TemplateNameConflict"
REASON_NAME_CONFLICT = "NameConflict"
REASON_WAITING_FOR_DELETION = "WaitingForDeletion"
REASON_CHANNELS_EXHAUSTED = "ChannelsExhausted"


@dataclass(frozen=True, slots=True)
class Verdict:
    status: ReadyStatus
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class EventSpec:
    """An Event to record on the ComputeDomain."""

    type: str  # Normal | Warning
    reason: str
    message: str


def lost_nodes(nodes: Iterable[NodeView]) -> dict[str, str]:
    """Node name -> why it is lost, for the domain's labelled nodes that are not Ready."""
    return {n.name: n.lost for n in nodes if n.lost}


def hosts_entry(pod: PodView, clique: ComputeDomainClique, node: str) -> bool:
    """Whether ``pod`` is (or may yet become) the daemon behind ``node``'s entry in ``clique``: a pod of the
    same domain (by UID) on that node, in that clique or not labelled with one yet (upstream ca48d876: an
    unlabelled pod is a fabric pod). A pod of the domain in another clique, or without one, on that node
    does not keep the entry: the node's daemon registers elsewhere, or nowhere."""
    return (
        pod.cd_uid == clique.domain_uid
        and pod.node_name == node
        and (pod.clique_id is None or pod.clique_id == clique.clique_id)
    )


def stale_entries(cliques: Iterable[ComputeDomainClique], pods: Iterable[PodView]) -> dict[str, tuple[str, ...]]:
    """Clique name -> nodes whose entry has no daemon pod of the domain behind it any more (``hosts_entry``:
    the daemon died without removing its entry, and its pod is gone: node deleted, pod force-deleted).
    From the caches this only proposes a prune; ``Writer.prune`` decides on a live list."""
    pods = tuple(p for p in pods if p.node_name)
    out: dict[str, tuple[str, ...]] = {}
    for clique in cliques:
        gone = tuple(
            sorted(
                d.node_name for d in clique.daemons or () if not any(hosts_entry(p, clique, d.node_name) for p in pods)
            )
        )
        if gone:
            out[clique.metadata.name] = gone
    return out


def node_entries(
    cliques: Iterable[ComputeDomainClique], pods: Iterable[PodView], lost: Mapping[str, str] | None = None
) -> list[ComputeDomainNode]:
    """The ``status.nodes`` list from clique entries and non-fabric daemon pods, sorted for stable output.
    Entries on ``lost`` nodes are NotReady."""
    lost = lost or {}
    entries: dict[str, ComputeDomainNode] = {}
    for clique in sorted(cliques, key=lambda c: c.metadata.name):
        for d in clique.daemons or ():
            entries[d.node_name] = ComputeDomainNode(
                name=d.node_name,
                ip_address=d.ip_address,
                clique_id=d.clique_id,
                index=d.index,
                status=ReadyStatus.NOT_READY if d.node_name in lost else d.status,
            )
    for pod in pods:
        if not pod.non_fabric or pod.terminating or not pod.node_name or not pod.pod_ip:
            continue
        if pod.node_name in entries:
            continue  # the daemon registered itself; its own entry wins
        entries[pod.node_name] = ComputeDomainNode(
            name=pod.node_name,
            ip_address=pod.pod_ip,
            clique_id="",
            index=-1,
            status=ReadyStatus.READY if pod.ready and pod.node_name not in lost else ReadyStatus.NOT_READY,
        )
    return sorted(entries.values(), key=lambda n: (n.clique_id, n.index, n.name))


def _listed(names: Sequence[str], lost: Mapping[str, str]) -> str:
    def why(name: str) -> str:
        return f"node lost ({lost[name]})" if name in lost else "NotReady"

    # Lost nodes first: they are what an operator has to act on.
    ordered = sorted(names, key=lambda n: n not in lost)
    shown = [f"node {n}: {why(n)}" for n in ordered[:MAX_LISTED_NODES]]
    if len(names) > MAX_LISTED_NODES:
        shown.append(f"and {len(names) - MAX_LISTED_NODES} more")
    return ", ".join(shown)


def assess(nodes: Sequence[ComputeDomainNode], num_nodes: int, lost: Mapping[str, str] | None = None) -> Verdict:
    """The global status of a driverManaged domain and the words that explain it."""
    lost = lost or {}
    total = len(nodes)
    ready = sum(1 for n in nodes if n.status is ReadyStatus.READY)
    not_ready = [n.name for n in nodes if n.status is not ReadyStatus.READY]
    detail = f"; {_listed(not_ready, lost)}" if not_ready else ""
    if total < num_nodes:
        return Verdict(
            ReadyStatus.NOT_READY,
            REASON_WAITING,
            f"{total} of {num_nodes} expected daemons registered (spec.numNodes), {ready} ready{detail}",
        )
    if not_ready:
        return Verdict(ReadyStatus.NOT_READY, REASON_NOT_READY, f"{ready} of {total} daemons ready{detail}")
    if total == 0:
        return Verdict(
            ReadyStatus.READY,
            REASON_NO_DAEMONS,
            "no daemons registered yet and spec.numNodes is 0; daemons start on the nodes where workload "
            "pods get their channel, and each pod waits for its local daemon",
        )
    return Verdict(ReadyStatus.READY, REASON_READY, f"{ready} of {total} daemons ready")


def host_managed_verdict(template_name: str, isolation: str | None = None) -> Verdict:
    """``isolation``: with channel isolation, what ``channel_text`` says about the domain's channels."""
    message = (
        f"ResourceClaimTemplate {template_name} exists; IMEX runs on the hosts (hostManaged), and the host "
        "daemon's readiness is checked per claim when a pod's channel is prepared"
    )
    return Verdict(ReadyStatus.READY, REASON_HOST_MANAGED, f"{message}; {isolation}" if isolation else message)


def channel_entries(cliques: Iterable[ComputeDomainClique]) -> list[ComputeDomainChannel]:
    """``status.channels`` from the domain's channel records (those being deleted no longer count)."""
    return sorted(
        (
            ComputeDomainChannel(clique_id=c.clique_id, channel=c.channel)
            for c in cliques
            if c.channel is not None and c.metadata.deletion_timestamp is None
        ),
        key=lambda c: c.clique_id,
    )


def channel_text(channels: Sequence[ComputeDomainChannel]) -> str:
    if not channels:
        return (
            "channel isolation: no pod has asked for an IMEX channel yet; each clique the domain's pods run in "
            "gets one that no other ComputeDomain has there"
        )
    shown = ", ".join(f"{c.channel} in clique {c.clique_id}" for c in channels[:MAX_LISTED_NODES])
    more = f" and {len(channels) - MAX_LISTED_NODES} more" if len(channels) > MAX_LISTED_NODES else ""
    return f"channel isolation: IMEX channel {shown}{more}"


def _some(names: Iterable[str]) -> str:
    ordered = sorted(names)
    more = f" and {len(ordered) - MAX_LISTED_NODES} more" if len(ordered) > MAX_LISTED_NODES else ""
    return ", ".join(ordered[:MAX_LISTED_NODES]) + more


def exhausted_verdict(cliques: Iterable[str], count: int, lingering: Lingering) -> Verdict:
    nodes = "node" if len(lingering.nodes) == 1 else "nodes"
    held = (
        f" {lingering.channels} of them {'is' if lingering.channels == 1 else 'are'} held by deleted ComputeDomains "
        f"whose claims {nodes} "
        f"{_some(lingering.nodes)} still list as prepared: each is freed once those node agents unprepare them (if "
        "they do not, check their pods and logs; for a node that is gone, delete its Node object)."
        if lingering.channels
        else ""
    )
    return Verdict(
        ReadyStatus.NOT_READY,
        REASON_CHANNELS_EXHAUSTED,
        f"no free IMEX channel for this domain in clique {_some(cliques)}: channels 1 to {count - 1} "
        f"(IMEX_CHANNEL_COUNT {count}, the nodes' NVreg_ImexChannelCount; channel 0 is shared and never assigned) "
        f"are all held by other ComputeDomains or still prepared on a node; its pods there wait.{held} Delete "
        "ComputeDomains that are no longer used, or raise NVreg_ImexChannelCount on the nodes and "
        "resources.computeDomains.imex.channelCount",
    )


def conflict_verdict(detail: str, reason: str = REASON_TEMPLATE_CONFLICT) -> Verdict:
    return Verdict(ReadyStatus.NOT_READY, reason, detail)


def waiting_verdict(waiting: str) -> Verdict:
    return Verdict(ReadyStatus.NOT_READY, REASON_WAITING_FOR_DELETION, waiting)


def failure_verdict(reason: str, message: str) -> Verdict:
    """A failure the controller cannot get past on its own: the reason and the one line that says the fix."""
    return Verdict(ReadyStatus.NOT_READY, reason, message)


def build_status(
    cd: ComputeDomain,
    verdict: Verdict,
    nodes: Sequence[ComputeDomainNode],
    now: datetime,
    channels: Sequence[ComputeDomainChannel] | None = None,
) -> ComputeDomainStatus:
    """The status to write; the condition keeps its transition time while its status does not change.
    ``channels`` None keeps the ones the status has."""
    old = current_condition(cd)
    cond_status = ConditionStatus.TRUE if verdict.status is ReadyStatus.READY else ConditionStatus.FALSE
    since = old.last_transition_time if old is not None and old.status is cond_status else now
    condition = Condition(
        type=READY_CONDITION,
        status=cond_status,
        observed_generation=cd.metadata.generation or None,
        last_transition_time=since,
        reason=verdict.reason,
        message=verdict.message,
    )
    others = [c for c in (cd.status.conditions or ()) if c.type != READY_CONDITION] if cd.status else []
    if channels is None:
        channels = list(cd.status.channels or ()) if cd.status else []
    return ComputeDomainStatus(
        status=verdict.status,
        nodes=list(nodes) or None,
        conditions=[*others, condition],
        channels=list(channels) or None,
    )


def find_condition(status: ComputeDomainStatus | None, type_: str) -> Condition | None:
    """The condition of ``type_`` in ``status``, if any."""
    return next((c for c in status.conditions or () if c.type == type_), None) if status is not None else None


def current_condition(cd: ComputeDomain) -> Condition | None:
    return find_condition(cd.status, READY_CONDITION)


def true_condition(cd: ComputeDomain, type_: str, *, reason: str, message: str, now: datetime) -> Condition:
    """A True condition of ``type_`` for ``cd``, keeping the transition time of the one it has already."""
    old = find_condition(cd.status, type_)
    return Condition(
        type=type_,
        status=ConditionStatus.TRUE,
        observed_generation=cd.metadata.generation or None,
        last_transition_time=old.last_transition_time if old is not None else now,
        reason=reason,
        message=message,
    )


def _cond_key(c: Condition | None) -> tuple[object, ...] | None:
    if c is None:
        return None
    return (c.status, c.reason, c.message, c.observed_generation)


def status_differs(
    current: ComputeDomainStatus | None, desired: ComputeDomainStatus, *, conditions: bool = True
) -> bool:
    """Whether a write is needed; ``conditions`` False leaves them out (the apiserver prunes them: old CRDs)."""
    if current is None:
        return True
    if current.status is not desired.status:
        return True
    cur_nodes = {n.name: n for n in current.nodes or ()}
    new_nodes = {n.name: n for n in desired.nodes or ()}
    if cur_nodes != new_nodes:
        return True
    if {c.clique_id: c.channel for c in current.channels or ()} != {
        c.clique_id: c.channel for c in desired.channels or ()
    }:
        return True
    if not conditions:
        return False
    cur = {c.type: _cond_key(c) for c in current.conditions or ()}
    new = {c.type: _cond_key(c) for c in desired.conditions or ()}
    return cur != new


_CONFLICTS = (REASON_TEMPLATE_CONFLICT, REASON_NAME_CONFLICT)


def transition_events(cd: ComputeDomain, desired: ComputeDomainStatus) -> list[EventSpec]:
    """Events a user should see for this change: readiness flips and newly appearing problems."""
    old = current_condition(cd)
    new = next((c for c in desired.conditions or () if c.type == READY_CONDITION), None)
    if new is None:
        return []
    events: list[EventSpec] = []
    if old is None or old.status is not new.status:
        if new.status is ConditionStatus.TRUE:
            events.append(EventSpec("Normal", "Ready", new.message))
        elif old is not None or new.reason in _CONFLICTS:
            events.append(EventSpec("Warning", "NotReady", new.message))
    elif new.reason != old.reason and new.reason in _CONFLICTS:
        events.append(EventSpec("Warning", "NotReady", new.message))
    return events


# Progress of a domain that stays NotReady (one more daemon registered or ready) is written at most once per
# this many seconds; the changes in between coalesce into the next write. What someone waits for is written
# at once: the flip to Ready (or back), a failure, the first status, a new generation. The reference writes
# every status on a 2 s timer; this keeps its write count without its latency.
PROGRESS_INTERVAL = 1.0
_PROGRESS_REASONS = frozenset({REASON_WAITING, REASON_NOT_READY})


def is_progress(current: ComputeDomainStatus | None, desired: ComputeDomainStatus) -> bool:
    """Whether ``desired`` only tells more progress than ``current`` (the domain NotReady before and after,
    waiting for daemons both times, on the same generation): such a write may wait and coalesce."""
    if current is None or current.status is not ReadyStatus.NOT_READY or desired.status is not ReadyStatus.NOT_READY:
        return False
    old = next((c for c in current.conditions or () if c.type == READY_CONDITION), None)
    new = next((c for c in desired.conditions or () if c.type == READY_CONDITION), None)
    return (
        old is not None
        and new is not None
        and old.reason in _PROGRESS_REASONS
        and new.reason in _PROGRESS_REASONS
        and old.observed_generation == new.observed_generation
    )
