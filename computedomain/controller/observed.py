"""What the controller reads: small frozen projections of foreign objects and the per-domain snapshot.

Projections are decoded from raw JSON (never through generated client models) and keep only what the
reconcile needs. ``Observed`` is everything one reconcile of one ComputeDomain looks at; it is built from the
synced caches by the executor and handed to the pure planner in ``reconcile``. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from computedomain.api.constants import (
    CLIQUE_LABEL,
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    DRIVER_NAME,
    TEMPLATE_TARGET_DAEMON,
    TEMPLATE_TARGET_LABEL,
    TEMPLATE_TARGET_WORKLOAD,
)
from computedomain.api.models import ComputeDomain, ComputeDomainClique
from computedomain.controller.channels import Lingering

Raw = Mapping[str, Any]


class ChildKind(StrEnum):
    """The kinds of object the controller creates per domain."""

    DAEMONSET = "DaemonSet"
    DAEMON_TEMPLATE = "DaemonTemplate"
    WORKLOAD_TEMPLATE = "WorkloadTemplate"
    NETWORK_POLICY = "NetworkPolicy"


def _meta(raw: Raw) -> Mapping[str, Any]:
    meta = raw.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _labels(meta: Mapping[str, Any]) -> Mapping[str, str]:
    labels = meta.get("labels")
    return dict(labels) if isinstance(labels, Mapping) else {}


@dataclass(frozen=True, slots=True)
class Content:
    """What ``adoption`` compares to decide whether a labelled object is the domain's child; a fact the
    object does not state (or states more than once) is ""."""

    target: str = ""  # templates: the target label
    device_class: str = ""  # templates: the one request's device class
    driver: str = ""  # templates: the one opaque config's driver
    config_kind: str = ""  # templates: its parameters' kind
    domain_id: str = ""  # templates: its parameters' domainID
    controller_owner: str = ""  # the UID of a controller ownerReference
    selector: str = ""  # DaemonSet: selector; NetworkPolicy: podSelector (the CD label's value)
    node_selector: str = ""  # DaemonSet: the pod template's nodeSelector (the CD label's value)
    claim_template: str = ""  # DaemonSet: the template its pods claim the daemon device from
    command: tuple[str, ...] = ()  # DaemonSet: the first container's command
    scheduled: int = 0  # DaemonSet: daemon pods it runs (status.currentNumberScheduled + numberMisscheduled)


@dataclass(frozen=True, slots=True)
class Child:
    """A DaemonSet, ResourceClaimTemplate or NetworkPolicy that carries the CD label: the domain's child when
    ``adoption`` says so, someone else's object otherwise."""

    kind: ChildKind
    namespace: str
    name: str
    uid: str
    resource_version: str
    cd_uid: str
    finalizers: tuple[str, ...] = ()
    terminating: bool = False
    content: Content = field(default_factory=Content, compare=False)

    @property
    def key(self) -> tuple[ChildKind, str, str]:
        return (self.kind, self.namespace, self.name)

    @property
    def has_our_finalizer(self) -> bool:
        return COMPUTE_DOMAIN_FINALIZER in self.finalizers

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


def child_kind(raw: Raw) -> ChildKind | None:
    """Which child kind a raw DaemonSet/ResourceClaimTemplate is; None for a template of neither target."""
    if raw.get("kind") == "DaemonSet":
        return ChildKind.DAEMONSET
    if raw.get("kind") == "NetworkPolicy":
        return ChildKind.NETWORK_POLICY
    target = _labels(_meta(raw)).get(TEMPLATE_TARGET_LABEL)
    if target == TEMPLATE_TARGET_DAEMON:
        return ChildKind.DAEMON_TEMPLATE
    if target == TEMPLATE_TARGET_WORKLOAD:
        return ChildKind.WORKLOAD_TEMPLATE
    return None


def decode_child(raw: Raw, kind: ChildKind | None = None) -> Child:
    meta = _meta(raw)
    resolved = kind or child_kind(raw) or ChildKind.WORKLOAD_TEMPLATE
    return Child(
        kind=resolved,
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        cd_uid=_labels(meta).get(COMPUTE_DOMAIN_LABEL, ""),
        finalizers=tuple(meta.get("finalizers") or ()),
        terminating=bool(meta.get("deletionTimestamp")),
        content=_content(raw, resolved),
    )


def _at(value: Any, *path: str | int) -> Any:
    """``value[path[0]][path[1]]...``, or None where the shape does not fit (foreign objects may be anything)."""
    for key in path:
        if isinstance(key, int):
            if not isinstance(value, list) or len(value) != 1:  # exactly one item, or no fact
                return None
            value = value[0]
        elif isinstance(value, Mapping):
            value = value.get(key)
        else:
            return None
    return value


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _content(raw: Raw, kind: ChildKind) -> Content:
    meta = _meta(raw)
    owners = meta.get("ownerReferences")
    controller = (
        next((o for o in owners if isinstance(o, Mapping) and o.get("controller")), None)
        if isinstance(owners, list)
        else None
    )
    owner = _str(controller.get("uid")) if controller else ""
    spec = raw.get("spec")
    if kind is ChildKind.DAEMONSET:
        pod = _at(spec, "template", "spec")
        command = _at(pod, "containers", 0, "command")
        counts = [_at(raw, "status", k) for k in ("currentNumberScheduled", "numberMisscheduled")]
        return Content(
            controller_owner=owner,
            selector=_str(_at(spec, "selector", "matchLabels", COMPUTE_DOMAIN_LABEL)),
            node_selector=_str(_at(pod, "nodeSelector", COMPUTE_DOMAIN_LABEL)),
            claim_template=_str(_at(pod, "resourceClaims", 0, "resourceClaimTemplateName")),
            command=tuple(c for c in command if isinstance(c, str)) if isinstance(command, list) else (),
            scheduled=sum(c for c in counts if isinstance(c, int) and not isinstance(c, bool)),
        )
    if kind is ChildKind.NETWORK_POLICY:
        return Content(
            controller_owner=owner, selector=_str(_at(spec, "podSelector", "matchLabels", COMPUTE_DOMAIN_LABEL))
        )
    devices = _at(spec, "spec", "devices")
    request = _at(devices, "requests", 0)
    params = _at(devices, "config", 0, "opaque", "parameters")
    return Content(
        target=_labels(meta).get(TEMPLATE_TARGET_LABEL, ""),
        device_class=_str(_at(request, "exactly", "deviceClassName") or _at(request, "deviceClassName")),
        driver=_str(_at(devices, "config", 0, "opaque", "driver")),
        config_kind=_str(_at(params, "kind")),
        domain_id=_str(_at(params, "domainID")),
        controller_owner=owner,
    )


def decode_daemonset(raw: Raw) -> Child:
    return decode_child(raw, ChildKind.DAEMONSET)


def decode_network_policy(raw: Raw) -> Child:
    return decode_child(raw, ChildKind.NETWORK_POLICY)


def decode_template(raw: Raw) -> Child:
    """ResourceClaimTemplates: the target label decides; an unlabelled one counts as a workload template."""
    return decode_child(raw)


@dataclass(frozen=True, slots=True)
class PodView:
    """A daemon pod, as far as status aggregation cares."""

    namespace: str
    name: str
    cd_uid: str
    node_name: str
    pod_ip: str
    ready: bool
    # None: the daemon has not labelled its pod yet (counts as a fabric pod); "": explicitly no clique.
    clique_id: str | None
    terminating: bool = False

    @property
    def non_fabric(self) -> bool:
        return self.clique_id == ""


def decode_pod(raw: Raw) -> PodView:
    meta = _meta(raw)
    labels = _labels(meta)
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or () if c)
    return PodView(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        cd_uid=labels.get(COMPUTE_DOMAIN_LABEL, ""),
        node_name=str(spec.get("nodeName") or ""),
        pod_ip=str(status.get("podIP") or ""),
        ready=ready,
        clique_id=labels.get(CLIQUE_LABEL),
        terminating=bool(meta.get("deletionTimestamp")),
    )


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    resource_version: str
    cd_uid: str  # value of the CD label; "" if absent
    # Why the node is not Ready ("Ready=Unknown since ...: NodeStatusUnknown"); "" while it is, or unknown.
    lost: str = ""


@dataclass(frozen=True, slots=True)
class ClaimView:
    """A ResourceClaim as the node labeller and the channel assignment read it: the domain of its channel
    config and the nodes whose channel devices of ours are allocated to it. ``cd_uid`` is "" for any other
    claim (another driver's, a daemon claim, a channel claim not allocated yet, or one whose configs name
    several domains, which Prepare refuses anyway): such a claim brings no domain to a node."""

    namespace: str
    name: str
    cd_uid: str
    nodes: frozenset[str]
    uid: str = ""

    def allocated(self, cd_uid: str, node: str) -> bool:
        """Whether this claim has a channel of domain ``cd_uid`` allocated on ``node``."""
        return bool(cd_uid) and self.cd_uid == cd_uid and node in self.nodes


def decode_claim(raw: Raw) -> ClaimView:
    meta = _meta(raw)
    allocation = (raw.get("status") or {}).get("allocation") or {}
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    devices = devices if isinstance(devices, Mapping) else {}
    # A pool of ours is named after its node (the node agent's admission policy binds the two).
    nodes = frozenset(
        str(r["pool"])
        for r in devices.get("results") or ()
        if isinstance(r, Mapping)
        and r.get("pool")
        and r.get("driver") == DRIVER_NAME
        and str(r.get("device") or "").startswith("channel-")
    )
    domains: set[str] = set()
    for config in devices.get("config") or ():
        opaque = config.get("opaque") if isinstance(config, Mapping) else None
        params = (
            opaque.get("parameters") if isinstance(opaque, Mapping) and opaque.get("driver") == DRIVER_NAME else None
        )
        if isinstance(params, Mapping) and params.get("kind") == "ComputeDomainChannelConfig":
            domains.add(str(params.get("domainID") or ""))
    if len(domains) != 1 or not nodes:
        domains, nodes = {""}, frozenset()
    return ClaimView(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        cd_uid=domains.pop(),
        nodes=nodes,
        uid=str(meta.get("uid") or ""),
    )


def decode_node(raw: Raw) -> NodeView:
    meta = _meta(raw)
    status = raw.get("status") or {}
    ready = next(
        (c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == "Ready"), None
    )
    lost = ""
    if ready is not None and ready.get("status") != "True":
        since = f" since {ready['lastTransitionTime']}" if ready.get("lastTransitionTime") else ""
        why = f": {ready['reason']}" if ready.get("reason") else ""
        lost = f"Ready={ready.get('status')}{since}{why}"
    return NodeView(
        name=str(meta.get("name") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        cd_uid=_labels(meta).get(COMPUTE_DOMAIN_LABEL, ""),
        lost=lost,
    )


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile of one ComputeDomain looks at (from synced caches plus own writes)."""

    cd: ComputeDomain
    children: tuple[Child, ...] = ()
    labelled_nodes: tuple[NodeView, ...] = ()
    cliques: tuple[ComputeDomainClique, ...] = ()
    pods: tuple[PodView, ...] = ()
    # Creates that failed because an object that is not the domain's child holds the name: (kind, why).
    name_conflicts: tuple[tuple[ChildKind, str], ...] = ()
    # The apiserver drops status.conditions (an old CRD): status writes are needed only for the rest.
    conditions_pruned: bool = False
    # Channel isolation: cliques where one of the domain's records waits for a channel and none is free, and
    # what of those cliques' channels deleted domains still hold.
    exhausted_cliques: frozenset[str] = frozenset()
    lingering: Lingering = field(default_factory=Lingering)

    def of_kind(self, kind: ChildKind) -> tuple[Child, ...]:
        return tuple(c for c in self.children if c.kind is kind)

    def conflict(self, kind: ChildKind) -> str:
        return next((detail for k, detail in self.name_conflicts if k is kind), "")

    def with_child(self, child: Child) -> Observed:
        rest = tuple(c for c in self.children if c.key != child.key)
        return replace(self, children=(*rest, child))

    def without_child(self, key: tuple[ChildKind, str, str]) -> Observed:
        return replace(self, children=tuple(c for c in self.children if c.key != key))

    def with_clique(self, clique: ComputeDomainClique) -> Observed:
        key = (clique.metadata.namespace, clique.metadata.name)
        rest = tuple(c for c in self.cliques if (c.metadata.namespace, c.metadata.name) != key)
        return replace(self, cliques=(*rest, clique))

    def with_pods(self, pods: tuple[PodView, ...]) -> Observed:
        """Pods read live (they win over cached ones of the same name)."""
        names = {(p.namespace, p.name) for p in pods}
        return replace(self, pods=(*(p for p in self.pods if (p.namespace, p.name) not in names), *pods))
