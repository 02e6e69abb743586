"""The mode-switch guard: refuse to start in a mode that contradicts the ComputeDomains already there.

Switching ``IMEX_MODE`` while domains exist is unsupported (upstream documents it and enforces nothing; the
result is stuck DaemonSets or workloads that expect daemons which never come). After the caches have synced
and before any write, the controller checks every **live** (not terminating) domain:

* starting **hostManaged**, a domain contradicts if it shows driverManaged setup: a daemon DaemonSet or a
  daemon ResourceClaimTemplate labelled with its UID, or a Node carrying its CD label (daemons were
  scheduled for it);
* starting **driverManaged**, a domain contradicts if it was set up hostManaged: our finalizer and a
  workload template labelled with its UID, but neither a daemon DaemonSet nor a daemon template. A
  driverManaged controller never leaves that state behind: it creates the daemon template before the workload
  template and tears the workload template down first.

The same holds for ``IMEX_ISOLATION`` (hostManaged): a pod that gets the shared channel 0 cannot talk to one of
the same domain that got the domain's own channel, so a domain must keep the isolation it was set up with. Its
workload template says which: starting with ``channel``, a live domain whose template requests the default
channel class (``compute-domain-default-channel.nvidia.com``) was set up with ``domain``; starting with
``domain``, a live domain whose template requests ``compute-domain-channel.nvidia.com`` was set up with
``channel`` (its channel records are torn down only by a controller with channel isolation).

Terminating domains never contradict: the teardown in ``reconcile`` is the same in both modes and removes
whatever children exist. Objects of domains that are gone are orphans for the sweep, not for the guard.
If anything contradicts, the process exits with a message naming each domain and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, COMPUTE_DOMAIN_FINALIZER, ISOLATED_CHANNEL_DEVICE_CLASS
from computedomain.api.models import ComputeDomain
from computedomain.controller.observed import Child, ChildKind, NodeView
from computedomain.settings import ImexIsolation, ImexMode

MAX_NAMED = 20


@dataclass(frozen=True, slots=True)
class Finding:
    namespace: str
    name: str
    uid: str
    evidence: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.evidence})"


class ModeConflictError(RuntimeError):
    """Raised at startup when existing ComputeDomains were set up under the other IMEX mode (or isolation)."""

    def __init__(self, mode: ImexMode, findings: list[Finding], message: str | None = None) -> None:
        self.mode = mode
        self.findings = findings
        super().__init__(message or refusal_message(mode, findings))


def isolation_conflict(isolation: ImexIsolation, findings: list[Finding]) -> ModeConflictError:
    return ModeConflictError(ImexMode.HOST_MANAGED, findings, isolation_refusal_message(isolation, findings))


def check(
    mode: ImexMode, cds: Iterable[ComputeDomain], children: Iterable[Child], nodes: Iterable[NodeView]
) -> list[Finding]:
    by_uid: dict[str, set[ChildKind]] = {}
    for child in children:
        by_uid.setdefault(child.cd_uid, set()).add(child.kind)
    labelled: dict[str, list[str]] = {}
    for node in nodes:
        if node.cd_uid:
            labelled.setdefault(node.cd_uid, []).append(node.name)
    findings: list[Finding] = []
    for cd in sorted(cds, key=lambda c: (c.metadata.namespace, c.metadata.name)):
        if cd.metadata.deletion_timestamp is not None:
            continue
        kinds = by_uid.get(cd.uid, set())
        evidence = ""
        if mode is ImexMode.HOST_MANAGED:
            found = sorted(k.value for k in kinds & {ChildKind.DAEMONSET, ChildKind.DAEMON_TEMPLATE})
            if cd.uid in labelled:
                found.append(f"node label on {', '.join(sorted(labelled[cd.uid]))}")
            evidence = ", ".join(found)
        elif (
            ChildKind.WORKLOAD_TEMPLATE in kinds
            and not kinds & {ChildKind.DAEMONSET, ChildKind.DAEMON_TEMPLATE}
            and COMPUTE_DOMAIN_FINALIZER in cd.metadata.finalizers
        ):
            evidence = "workload template without daemon DaemonSet or daemon template"
        if evidence:
            findings.append(Finding(cd.metadata.namespace, cd.metadata.name, cd.uid, evidence))
    return findings


def check_isolation(isolation: ImexIsolation, cds: Iterable[ComputeDomain], children: Iterable[Child]) -> list[Finding]:
    """hostManaged: live domains whose workload template was made for the other ``IMEX_ISOLATION``."""
    other_class = CHANNEL_DEVICE_CLASS if isolation is ImexIsolation.CHANNEL else ISOLATED_CHANNEL_DEVICE_CLASS
    other = ImexIsolation.DOMAIN if isolation is ImexIsolation.CHANNEL else ImexIsolation.CHANNEL
    templates: dict[str, list[Child]] = {}
    for child in children:
        if child.kind is ChildKind.WORKLOAD_TEMPLATE and child.content.device_class == other_class:
            templates.setdefault(child.cd_uid, []).append(child)
    return [
        Finding(
            cd.metadata.namespace,
            cd.metadata.name,
            cd.uid,
            f"workload template of class {other_class}, made with IMEX_ISOLATION={other.value}",
        )
        for cd in sorted(cds, key=lambda c: (c.metadata.namespace, c.metadata.name))
        if cd.metadata.deletion_timestamp is None and cd.uid in templates
    ]


def _named(findings: list[Finding]) -> str:
    """The first ``MAX_NAMED`` findings, and how many more there are."""
    named = "; ".join(str(f) for f in findings[:MAX_NAMED])
    if len(findings) > MAX_NAMED:
        named += f"; and {len(findings) - MAX_NAMED} more"
    return named


def isolation_refusal_message(isolation: ImexIsolation, findings: list[Finding]) -> str:
    other = ImexIsolation.DOMAIN if isolation is ImexIsolation.CHANNEL else ImexIsolation.CHANNEL
    named = _named(findings)
    return (
        f"refusing to start with IMEX_ISOLATION={isolation.value}: {len(findings)} ComputeDomain(s) were set up with "
        f"IMEX_ISOLATION={other.value}: {named}. Switching the isolation while ComputeDomains exist is unsupported "
        "(pods of one domain would get different channels and could not talk): drain their workloads and delete "
        f"them (a controller with IMEX_ISOLATION={other.value} tears them down), or start with "
        f"IMEX_ISOLATION={other.value}"
    )


def refusal_message(mode: ImexMode, findings: list[Finding]) -> str:
    other = ImexMode.DRIVER_MANAGED if mode is ImexMode.HOST_MANAGED else ImexMode.HOST_MANAGED
    named = _named(findings)
    return (
        f"refusing to start with IMEX_MODE={mode.value}: {len(findings)} ComputeDomain(s) were set up in "
        f"{other.value} mode: {named}. Switching modes while ComputeDomains exist is unsupported: drain their "
        f"workloads and delete them (a controller in {other.value} mode tears them down), or start in "
        f"{other.value} mode"
    )
