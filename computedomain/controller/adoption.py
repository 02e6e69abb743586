"""Which labelled objects are a ComputeDomain's children (adopted), and which are not (reported, left alone).

The controller finds a domain's DaemonSet, templates and NetworkPolicy through the CD label, but a label proves
nothing: whoever may write an object may label it. A tenant's ResourceClaimTemplate labelled with another
domain's UID used to count as that domain's template: the real one was never created, and the teardown
deleted the tenant's object and waited on its finalizers forever. So a labelled object is a child only when
it is where, and what, this controller would have made it (``why_foreign`` returns None):

| kind | namespace | name | content |
|---|---|---|---|
| DaemonSet | a managed namespace | ``computedomain-daemon-<uid>`` | selector and pod node selector on the CD label = uid; its pods claim from ``computedomain-daemon-<uid>`` |
| daemon template | a managed namespace | ``computedomain-daemon-<uid>`` | target ``Daemon``; one request of class ``compute-domain-daemon.nvidia.com``; one opaque config of our driver, kind ``ComputeDomainDaemonConfig``, ``domainID`` uid |
| NetworkPolicy | a managed namespace | ``computedomain-daemon-<uid>`` | pod selector on the CD label = uid |
| workload template | the domain's namespace | ``spec.channel.resourceClaimTemplate.name`` | target ``Workload``; one request of class ``compute-domain-default-channel.nvidia.com``; one opaque config of our driver, kind ``ComputeDomainChannelConfig``, ``domainID`` uid |

and for every kind: no controller ownerReference to anything but the domain. What proves ownership: in the
managed (driver) namespaces only the controller and cluster administrators may write these kinds (the chart
grants tenants nothing there, and an ownerReference from there to a ComputeDomain in another namespace would
be invalid: the garbage collector deletes such dependents), so namespace + deterministic name + label +
content is the proof. In the domain's own namespace anyone who may edit the domain may edit its template
anyway; the name the domain's spec chose, the namespace and the content decide. The reference driver's
objects for a domain fit the same rule (same names, labels and content), so they are adopted as they are:
that is how a running domain is taken over.

An object that is not a child is never counted, deleted, released or waited for. The domain reports it: a
condition ``ForeignObjects`` (True, reason ``NotAdopted``, naming each object and why) while any exists, and
a Warning Event ``ForeignObject`` when the set changes. When such an object holds a name the controller
needs, the create fails and the domain's Ready condition says which object to remove (``NameConflict``).

The orphan sweep applies the rule without the domain (``belongs``): the domain is gone, so for a workload
template only its content and owner can be checked.

The IMEX daemons of a taken-over domain: ``is_ours`` tells a DaemonSet whose pods run this project's daemon
from one the reference made. The planner adopts the latter and replaces its pod template (``reconcile``,
docs/design/0011-adoption-and-takeover.md): running daemons are never restarted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from computedomain.api.constants import (
    CHANNEL_DEVICE_CLASS,
    DAEMON_DEVICE_CLASS,
    DAEMON_TEMPLATE_PREFIX,
    DRIVER_NAME,
    ISOLATED_CHANNEL_DEVICE_CLASS,
    TEMPLATE_TARGET_DAEMON,
    TEMPLATE_TARGET_WORKLOAD,
)
from computedomain.api.limits import shown
from computedomain.api.models import ComputeDomain, Condition
from computedomain.controller.daemonset import DAEMON_COMMAND
from computedomain.controller.observed import Child, ChildKind
from computedomain.controller.status import true_condition
from computedomain.settings import ControllerSettings

FOREIGN_CONDITION = "ForeignObjects"
REASON_NOT_ADOPTED = "NotAdopted"
MAX_NAMED = 5


@dataclass(frozen=True, slots=True)
class Foreign:
    """A labelled object that is not the domain's child, and why."""

    child: Child
    why: str

    def __str__(self) -> str:
        return f"{self.child.kind.value} {shown(self.child.namespace)}/{shown(self.child.name)} ({self.why})"


def _expect(problems: list[str], what: str, got: str, want: str) -> None:
    if got != want:
        problems.append(f"{what} is {shown(got) if got else 'missing'}, not {want}")


def _template(problems: list[str], child: Child, uid: str, target: str, device_class: str, kind: str) -> None:
    c = child.content
    _expect(problems, "target", c.target, target)
    _expect(problems, "device class", c.device_class, device_class)
    _expect(problems, "opaque config driver", c.driver, DRIVER_NAME)
    _expect(problems, "opaque config kind", c.config_kind, kind)
    _expect(problems, "domainID", c.domain_id, uid)


def _content_problems(child: Child, uid: str) -> list[str]:
    """What of the child's content differs from what this controller writes for domain ``uid``."""
    problems: list[str] = []
    c = child.content
    if child.kind is ChildKind.DAEMONSET:
        _expect(problems, "selector", c.selector, uid)
        _expect(problems, "node selector", c.node_selector, uid)
        _expect(problems, "daemon claim template", c.claim_template, f"{DAEMON_TEMPLATE_PREFIX}{uid}")
    elif child.kind is ChildKind.NETWORK_POLICY:
        _expect(problems, "pod selector", c.selector, uid)
    elif child.kind is ChildKind.DAEMON_TEMPLATE:
        _template(problems, child, uid, TEMPLATE_TARGET_DAEMON, DAEMON_DEVICE_CLASS, "ComputeDomainDaemonConfig")
    else:
        # Either channel class is ours: a template made under the other IMEX_ISOLATION is still the domain's
        # child (the isolation guard refuses to start over it; the teardown removes it).
        wanted = c.device_class if c.device_class == ISOLATED_CHANNEL_DEVICE_CLASS else CHANNEL_DEVICE_CLASS
        _template(problems, child, uid, TEMPLATE_TARGET_WORKLOAD, wanted, "ComputeDomainChannelConfig")
    if c.controller_owner and c.controller_owner != uid:
        problems.append(f"controlled by {shown(c.controller_owner)}")
    return problems


def why_foreign(cd: ComputeDomain, child: Child, settings: ControllerSettings) -> str | None:
    """None when ``child`` is the domain's child, else why not (one short phrase)."""
    uid = cd.uid
    if child.cd_uid != uid:
        return "labelled for another domain"
    problems: list[str] = []
    if child.kind is ChildKind.WORKLOAD_TEMPLATE:
        _expect(problems, "namespace", child.namespace, cd.metadata.namespace)
        _expect(problems, "name", child.name, cd.spec.channel.resource_claim_template.name)
    else:
        if child.namespace not in settings.managed_namespaces:
            problems.append(f"namespace {shown(child.namespace)} is not one this controller manages")
        _expect(problems, "name", child.name, f"{DAEMON_TEMPLATE_PREFIX}{uid}")
    problems += _content_problems(child, uid)
    return "; ".join(problems[:3]) or None


def belongs(child: Child, settings: ControllerSettings) -> bool:
    """Whether ``child`` is what this controller makes for the domain its label names, as far as that can be
    told without the domain (for the orphan sweep)."""
    uid = child.cd_uid
    if not uid or _content_problems(child, uid):
        return False
    if child.kind is ChildKind.WORKLOAD_TEMPLATE:
        return True
    return child.namespace in settings.managed_namespaces and child.name == f"{DAEMON_TEMPLATE_PREFIX}{uid}"


def split(
    cd: ComputeDomain, children: Iterable[Child], settings: ControllerSettings
) -> tuple[tuple[Child, ...], tuple[Foreign, ...]]:
    """(the domain's children, the labelled objects that are not)."""
    adopted: list[Child] = []
    foreign: list[Foreign] = []
    for child in children:
        why = why_foreign(cd, child, settings)
        if why is None:
            adopted.append(child)
        else:
            foreign.append(Foreign(child, why))
    return tuple(adopted), tuple(foreign)


def children_of(cds: Iterable[ComputeDomain], children: Iterable[Child], settings: ControllerSettings) -> list[Child]:
    """The objects among ``children`` that are children of one of ``cds`` (for checks across domains)."""
    by_uid: dict[str, ComputeDomain] = {cd.uid: cd for cd in cds}
    return [c for c in children if c.cd_uid in by_uid and why_foreign(by_uid[c.cd_uid], c, settings) is None]


def is_ours(daemonset: Child) -> bool:
    """Whether the DaemonSet's pods run this project's IMEX daemon (else: made by the reference driver)."""
    return daemonset.content.command == DAEMON_COMMAND


def foreign_message(foreign: Sequence[Foreign]) -> str:
    named = "; ".join(str(f) for f in foreign[:MAX_NAMED])
    more = f"; and {len(foreign) - MAX_NAMED} more" if len(foreign) > MAX_NAMED else ""
    return (
        f"{len(foreign)} object(s) carry this domain's label but are not its children, so they are ignored (neither "
        f"used nor deleted): {named}{more}. Remove the label from them, or delete them"
    )


def foreign_condition(cd: ComputeDomain, foreign: Sequence[Foreign], now: datetime) -> Condition | None:
    """The ``ForeignObjects`` condition while labelled objects are not adopted; None when there are none."""
    if not foreign:
        return None
    return true_condition(cd, FOREIGN_CONDITION, reason=REASON_NOT_ADOPTED, message=foreign_message(foreign), now=now)
