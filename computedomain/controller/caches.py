"""The controller's caches: one informer per (kind, scope), indexed by the CD UID they refer to.

| cache | scope | selector | index ``cd`` |
|---|---|---|---|
| ComputeDomains | all namespaces | none | (index ``uid``) |
| DaemonSets | each managed namespace | CD label exists | label value |
| NetworkPolicies (driverManaged) | each managed namespace | CD label exists | label value |
| ResourceClaimTemplates | all namespaces (workload templates live in the CDs' namespaces) | CD label exists | label value |
| Nodes | cluster | CD label exists | label value |
| daemon Pods (driverManaged) | each managed namespace | CD label exists | label value |
| ComputeDomainCliques (driverManaged, gate on) | each managed namespace | none | label, else name prefix |

``observe(uid)`` assembles one domain's ``Observed`` from them, plus the children this process created that
the caches have not shown yet (``note_created``): a domain deleted right after its children were created must
not lose them to cache lag. Such a note is dropped as soon as the cache shows the object, or after
``OVERLAY_TTL`` seconds. Reads are synchronous and only valid once ``wait_synced`` returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ComputeDomain, ComputeDomainClique
from computedomain.controller.observed import (
    Child,
    ChildKind,
    NodeView,
    Observed,
    PodView,
    decode_daemonset,
    decode_network_policy,
    decode_node,
    decode_pod,
    decode_template,
)
from computedomain.kube.client import (
    COMPUTE_DOMAIN_CLIQUES,
    COMPUTE_DOMAINS,
    DAEMONSETS,
    NETWORK_POLICIES,
    NODES,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    KubeClient,
    Raw,
    Resource,
)
from computedomain.kube.informer import Informer, wait_for_sync
from computedomain.settings import ControllerSettings, FeatureGate

T = TypeVar("T", Child, PodView)

OVERLAY_TTL = 60.0
CD_INDEX = "cd"


def _cd_label(obj: Child | NodeView | PodView) -> list[str]:
    return [obj.cd_uid] if obj.cd_uid else []


class Caches:
    def __init__(self, client: KubeClient, settings: ControllerSettings, *, cd_namespace: str | None = None) -> None:
        """``cd_namespace`` limits the domains this controller handles to one namespace (tests that share a
        cluster use it); the orphan sweep still confirms against every namespace."""
        self.settings = settings
        self.cds: Informer[ComputeDomain] = Informer(
            client,
            COMPUTE_DOMAINS,
            namespace=cd_namespace,
            decode=ComputeDomain.model_validate,
            name="computedomains",
            indexers={"uid": _uid},
        )
        self.daemonsets: list[Informer[Child]] = self._labelled(client, DAEMONSETS, decode_daemonset)
        # Watched also when DAEMON_NETWORK_POLICY is off, so the policies of an earlier setting are torn down
        # with their domains and swept with the orphans.
        self.network_policies: list[Informer[Child]] = []
        if not settings.host_managed:
            self.network_policies = self._labelled(client, NETWORK_POLICIES, decode_network_policy)
        self.templates: Informer[Child] = Informer(
            client,
            RESOURCE_CLAIM_TEMPLATES,
            label_selector=COMPUTE_DOMAIN_LABEL,
            decode=decode_template,
            name="resourceclaimtemplates",
            indexers={CD_INDEX: _cd_label},
        )
        self.nodes: Informer[NodeView] = Informer(
            client,
            NODES,
            label_selector=COMPUTE_DOMAIN_LABEL,
            decode=decode_node,
            name="nodes",
            indexers={CD_INDEX: _cd_label},
        )
        self.pods: list[Informer[PodView]] = []
        self.cliques: list[Informer[ComputeDomainClique]] = []
        if not settings.host_managed:
            self.pods = self._labelled(client, PODS, decode_pod)
            if settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES):
                self.cliques = [
                    Informer(
                        client,
                        COMPUTE_DOMAIN_CLIQUES,
                        namespace=ns,
                        decode=ComputeDomainClique.model_validate,
                        name=f"computedomaincliques/{ns}",
                        indexers={CD_INDEX: lambda c: [c.domain_uid]},
                    )
                    for ns in settings.managed_namespaces
                ]
        # Children created by this process and not yet seen by a cache: key -> (child, monotonic time).
        self._created: dict[tuple[ChildKind, str, str], tuple[Child, float]] = {}
        # ComputeDomains as this process last wrote them, until the cache shows that version: by UID.
        self._written: dict[str, ComputeDomain] = {}
        self.cds.add_handler(on_update=lambda _old, new: self._cd_seen(new), on_delete=self._cd_gone)
        for informer in (*self.daemonsets, *self.network_policies, self.templates):
            informer.add_handler(on_add=self._seen, on_update=lambda _old, new: self._seen(new), on_delete=self._seen)

    def _labelled(self, client: KubeClient, resource: Resource, decode: Callable[[Raw], T]) -> list[Informer[T]]:
        """One informer per managed namespace of the objects carrying the CD label, indexed by its value."""
        return [
            Informer(
                client,
                resource,
                namespace=ns,
                label_selector=COMPUTE_DOMAIN_LABEL,
                decode=decode,
                name=f"{resource.plural}/{ns}",
                indexers={CD_INDEX: _cd_label},
            )
            for ns in self.settings.managed_namespaces
        ]

    # ---- lifecycle -----------------------------------------------------------------------------------

    def informers(self) -> list[Informer[Any]]:
        return [
            self.cds,
            *self.daemonsets,
            *self.network_policies,
            self.templates,
            self.nodes,
            *self.pods,
            *self.cliques,
        ]

    async def wait_synced(self, within: float | None = None) -> None:
        await wait_for_sync(*self.informers(), within=within)

    @property
    def synced(self) -> bool:
        return all(i.synced for i in self.informers())

    # ---- own writes ----------------------------------------------------------------------------------

    def note_created(self, child: Child) -> None:
        self._created[child.key] = (child, time.monotonic())

    def note_written(self, cd: ComputeDomain) -> None:
        """Remember our own write of ``cd`` so the next reconcile does not act on the older cached copy."""
        self._written[cd.uid] = cd

    def _cd_seen(self, cd: ComputeDomain) -> None:
        written = self._written.get(cd.uid)
        if written is not None and not _newer(written.metadata.resource_version, cd.metadata.resource_version):
            del self._written[cd.uid]

    def _cd_gone(self, cd: ComputeDomain) -> None:
        self._written.pop(cd.uid, None)

    def _seen(self, child: Child) -> None:
        self._created.pop(child.key, None)

    def _pending(self, uid: str) -> Iterator[Child]:
        now = time.monotonic()
        for key, (child, at) in list(self._created.items()):
            if now - at > OVERLAY_TTL:
                del self._created[key]
            elif child.cd_uid == uid:
                yield child

    # ---- reads ---------------------------------------------------------------------------------------

    def cd(self, uid: str) -> ComputeDomain | None:
        """The domain from the cache, or our newer write of it; never a domain the cache does not have."""
        found = self.cds.by_index("uid", uid)
        if not found:
            return None
        written = self._written.get(uid)
        if written is not None and _newer(written.metadata.resource_version, found[0].metadata.resource_version):
            return written
        return found[0]

    def known_uids(self) -> set[str]:
        return set(self.cds.index_values("uid"))

    def children(self, uid: str | None = None) -> list[Child]:
        informers = [*self.daemonsets, *self.network_policies, self.templates]
        if uid is None:
            return [c for i in informers for c in i.list()]
        return [c for i in informers for c in i.by_index(CD_INDEX, uid)]

    def all_cliques(self) -> list[ComputeDomainClique]:
        return [c for i in self.cliques for c in i.list()]

    def observe(self, uid: str) -> Observed | None:
        """The snapshot for one domain; None when the CD cache does not have it (which proves nothing)."""
        cd = self.cd(uid)
        if cd is None:
            return None
        children = {c.key: c for c in self.children(uid)}
        for child in self._pending(uid):
            children.setdefault(child.key, child)
        return Observed(
            cd=cd,
            children=tuple(sorted(children.values(), key=lambda c: c.key)),
            labelled_nodes=tuple(sorted(self.nodes.by_index(CD_INDEX, uid), key=lambda n: n.name)),
            cliques=tuple(c for i in self.cliques for c in i.by_index(CD_INDEX, uid)),
            pods=tuple(p for i in self.pods for p in i.by_index(CD_INDEX, uid)),
        )

    def add_handlers(self, on_uid: Callable[[str], None]) -> None:
        """Route every event to ``on_uid(cd_uid)``: CD events by their UID, others by their CD label."""

        def cd_event(cd: ComputeDomain) -> None:
            on_uid(cd.uid)

        self.cds.add_handler(on_add=cd_event, on_update=lambda _o, n: cd_event(n))
        labelled: list[Informer[Child] | Informer[NodeView] | Informer[PodView]] = [
            *self.daemonsets,
            *self.network_policies,
            self.templates,
            self.nodes,
            *self.pods,
        ]
        for informer in labelled:
            informer.add_handler(
                on_add=lambda o: _route(o.cd_uid, on_uid),
                on_update=lambda old, new: _route_both(old.cd_uid, new.cd_uid, on_uid),
                on_delete=lambda o: _route(o.cd_uid, on_uid),
            )
        for informer_c in self.cliques:
            informer_c.add_handler(
                on_add=lambda c: _route(c.domain_uid, on_uid),
                on_update=lambda _o, n: _route(n.domain_uid, on_uid),
                on_delete=lambda c: _route(c.domain_uid, on_uid),
            )


def _newer(a: str, b: str) -> bool:
    """Whether resourceVersion ``a`` is newer than ``b``. They are opaque to clients, but every apiserver
    backed by etcd hands out increasing integers; anything else counts as not newer (trust the cache)."""
    try:
        return int(a) > int(b)
    except ValueError:
        return False


def _uid(cd: ComputeDomain) -> list[str]:
    return [cd.uid]


def _route(uid: str, on_uid: Callable[[str], None]) -> None:
    if uid:
        on_uid(uid)


def _route_both(old: str, new: str, on_uid: Callable[[str], None]) -> None:
    _route(new, on_uid)
    if old != new:
        _route(old, on_uid)
