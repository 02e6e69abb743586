"""The controller's caches: one informer per (kind, scope), indexed by the CD UID they refer to.

| cache | scope | selector | index ``cd`` |
|---|---|---|---|
| ComputeDomains | all namespaces | none | (index ``uid``) |
| DaemonSets | each managed namespace | CD label exists | label value |
| NetworkPolicies (driverManaged) | each managed namespace | CD label exists | label value |
| ResourceClaimTemplates | all namespaces (workload templates live in the CDs' namespaces) | CD label exists | label value |
| Nodes | cluster | CD label exists | label value |
| daemon Pods (driverManaged) | each managed namespace | CD label exists | label value |
| ResourceClaims (driverManaged; hostManaged with channel isolation) | all namespaces (a domain's pods' claims live in its namespace) | none | domain of the channel config; ``node``: nodes of the channel devices allocated; ``claim``: UID (channel isolation) |
| ComputeDomainCliques (driverManaged with the gate; hostManaged with channel isolation) | each managed namespace | none | label, else name prefix; ``clique``: name suffix; ``claim``: UIDs in ``preparedClaims`` |
| channel locks: Leases (channel isolation) | the driver namespace | clique label exists | ``clique``: label value |

``observe(uid)`` assembles one domain's ``Observed`` from them, plus the children this process created that
the caches have not shown yet (``note_created``): a domain deleted right after its children were created must
not lose them to cache lag. Such a note is dropped as soon as the cache shows the object, or after
``OVERLAY_TTL`` seconds. Reads are synchronous and only valid once ``wait_synced`` returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ComputeDomain, ComputeDomainClique, valid_clique_id
from computedomain.controller import channels
from computedomain.controller.channels import CliqueSpace, Lingering, Lock
from computedomain.controller.observed import (
    Child,
    ChildKind,
    ClaimView,
    NodeView,
    Observed,
    PodView,
    decode_claim,
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
    LEASES,
    NETWORK_POLICIES,
    NODES,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_CLAIMS,
    KubeClient,
    Raw,
    Resource,
)
from computedomain.kube.informer import Informer, wait_for_sync
from computedomain.settings import ControllerSettings, FeatureGate

T = TypeVar("T", Child, PodView)

OVERLAY_TTL = 60.0
CD_INDEX = "cd"
CLIQUE_INDEX = "clique"
NODE_INDEX = "node"
CLAIM_INDEX = "claim"


def _cd_label(obj: Child | NodeView | PodView | ClaimView) -> list[str]:
    return [obj.cd_uid] if obj.cd_uid else []


class Caches:
    def __init__(self, client: KubeClient, settings: ControllerSettings, *, cd_namespace: str | None = None) -> None:
        """``cd_namespace`` limits the domains this controller handles to one namespace (tests that share a
        cluster use it); the orphan sweep still confirms against every namespace."""
        self.settings = settings
        self.cd_namespace = cd_namespace
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
        self.locks: Informer[Lock] | None = None
        self.claims: Informer[ClaimView] | None = None
        if not settings.host_managed:
            self.pods = self._labelled(client, PODS, decode_pod)
        if not settings.host_managed or settings.channel_isolation:
            # Every claim, projected to a few strings: which domain's channel is allocated on which nodes
            # (the node labeller, ``nodes``; the channel assignment, which verifies the entries of its
            # records by claim UID). Another driver's claims cost a key and an empty view each.
            by_uid: dict[str, Callable[[ClaimView], list[str]]] = (
                {CLAIM_INDEX: lambda c: [c.uid]} if settings.channel_isolation else {}
            )
            self.claims = Informer(
                client,
                RESOURCE_CLAIMS,
                namespace=cd_namespace,
                decode=decode_claim,
                name="resourceclaims",
                indexers={CD_INDEX: _cd_label, NODE_INDEX: lambda c: sorted(c.nodes), **by_uid},
            )
        if settings.channel_isolation or (
            not settings.host_managed and settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES)
        ):
            self.cliques = [
                Informer(
                    client,
                    COMPUTE_DOMAIN_CLIQUES,
                    namespace=ns,
                    decode=ComputeDomainClique.model_validate,
                    name=f"computedomaincliques/{ns}",
                    indexers={
                        CD_INDEX: lambda c: [c.domain_uid],
                        CLIQUE_INDEX: lambda c: [c.clique_id],
                        CLAIM_INDEX: lambda c: sorted({e.claim_uid for e in c.prepared_claims or ()}),
                    },
                )
                for ns in settings.managed_namespaces
            ]
        if settings.channel_isolation:
            self.locks = Informer(
                client,
                LEASES,
                namespace=settings.namespace,
                label_selector=CLIQUE_LABEL,
                decode=_decode_lock,
                name=f"leases/{settings.namespace}",
                indexers={CLIQUE_INDEX: lambda lk: [lk.clique_id]},
            )
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
            *([self.locks] if self.locks is not None else []),
            *([self.claims] if self.claims is not None else []),
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
        """Remember our own write of ``cd`` so the next reconcile does not act on the older cached copy. Not
        for a domain the cache no longer has: the write that took its last finalizer off may answer after
        the delete event, and nothing would drop the note then (a domain's copy kept for good)."""
        if not self.cds.by_index("uid", cd.uid):
            self._written.pop(cd.uid, None)
            return
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

    def claims_on(self, node: str) -> list[ClaimView]:
        """Channel claims of any domain with a device allocated on ``node`` (driverManaged)."""
        return self.claims.by_index(NODE_INDEX, node) if self.claims is not None else []

    def all_cliques(self) -> list[ComputeDomainClique]:
        return [c for i in self.cliques for c in i.list()]

    def clique_space(self, clique_id: str) -> CliqueSpace:
        """One clique's channel records and locks, and which of their domains live (channel isolation). A
        record named with an invalid clique ID (made by hand) belongs to no clique: it never gets a channel."""
        if not valid_clique_id(clique_id):
            return CliqueSpace(clique_id)
        records = tuple(channels.record_of(c) for i in self.cliques for c in i.by_index(CLIQUE_INDEX, clique_id))
        locks = tuple(self.locks.by_index(CLIQUE_INDEX, clique_id)) if self.locks is not None else ()
        live = frozenset(r.domain_uid for r in records if _lives(self.cd(r.domain_uid)))
        return CliqueSpace(clique_id, records, locks, live, verifiable=self._verifiable(records))

    def _verifiable(self, records: tuple[channels.Record, ...]) -> frozenset[tuple[str, str, str]]:
        """(record name, claim UID, node) of the unverified entries whose claim the cache shows allocated on
        that node for the record's domain."""
        if self.claims is None:
            return frozenset()
        return frozenset(
            (r.name, uid, node)
            for r in records
            for uid, node in r.unverified
            if any(c.allocated(r.domain_uid, node) for c in self.claims.by_index(CLAIM_INDEX, uid))
        )

    def exhausted_cliques(self, cliques: tuple[ComputeDomainClique, ...]) -> tuple[frozenset[str], Lingering]:
        """Of one domain's records still waiting for a channel, the cliques that have none free, and what of
        their channels deleted domains still hold."""
        if not self.settings.channel_isolation:
            return frozenset(), Lingering()
        waiting = {c.clique_id for c in cliques if c.channel is None and c.metadata.deletion_timestamp is None}
        count = self.settings.imex_channel_count
        spaces = [space for space in map(self.clique_space, sorted(waiting)) if channels.exhausted(space, count)]
        return frozenset(s.clique_id for s in spaces), sum(map(channels.lingering, spaces), Lingering())

    def observe(self, uid: str) -> Observed | None:
        """The snapshot for one domain; None when the CD cache does not have it (which proves nothing)."""
        cd = self.cd(uid)
        if cd is None:
            return None
        children = {c.key: c for c in self.children(uid)}
        for child in self._pending(uid):
            children.setdefault(child.key, child)
        cliques = tuple(c for i in self.cliques for c in i.by_index(CD_INDEX, uid))
        exhausted, lingering = self.exhausted_cliques(cliques)
        return Observed(
            cd=cd,
            children=tuple(sorted(children.values(), key=lambda c: c.key)),
            labelled_nodes=tuple(sorted(self.nodes.by_index(CD_INDEX, uid), key=lambda n: n.name)),
            cliques=cliques,
            pods=tuple(p for i in self.pods for p in i.by_index(CD_INDEX, uid)),
            exhausted_cliques=exhausted,
            lingering=lingering,
        )

    def add_handlers(self, on_uid: Callable[[str], None]) -> None:
        """Route every event to ``on_uid(cd_uid)``: CD events by their UID, others by their CD label."""

        def cd_event(cd: ComputeDomain) -> None:
            on_uid(cd.uid)

        self.cds.add_handler(on_add=cd_event, on_update=lambda _o, n: cd_event(n))
        for informer_child in (*self.daemonsets, *self.network_policies, self.templates):
            informer_child.add_handler(
                on_add=lambda o: _route(o.cd_uid, on_uid),
                on_update=lambda old, new: (
                    _route_both(old.cd_uid, new.cd_uid, on_uid) if child_changed(old, new) else None
                ),
                on_delete=lambda o: _route(o.cd_uid, on_uid),
            )
        labelled: list[Informer[NodeView] | Informer[PodView]] = [self.nodes, *self.pods]
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

    def add_node_handlers(self, on_node: Callable[[str], None]) -> None:
        """Route what changes a node's CD label to ``on_node(name)``: the channel claims allocated there, the
        node's label, and the domains of both (a domain that appears or begins its teardown)."""

        def nodes_of(*claims: ClaimView) -> None:
            for name in sorted({n for c in claims for n in c.nodes}):
                on_node(name)

        def cd_event(cd: ComputeDomain) -> None:
            if self.claims is not None:
                nodes_of(*self.claims.by_index(CD_INDEX, cd.uid))
            for node in self.nodes.by_index(CD_INDEX, cd.uid):
                on_node(node.name)

        if self.claims is not None:
            self.claims.add_handler(
                on_add=nodes_of,
                on_update=lambda old, new: nodes_of(old, new) if old != new else None,
                on_delete=nodes_of,
            )

        def teardown_began(old: ComputeDomain, new: ComputeDomain) -> None:
            if (old.metadata.deletion_timestamp is None) != (new.metadata.deletion_timestamp is None):
                cd_event(new)

        self.cds.add_handler(on_add=cd_event, on_update=teardown_began, on_delete=cd_event)
        self.nodes.add_handler(
            on_add=lambda n: on_node(n.name),
            on_update=lambda old, new: on_node(new.name) if old.cd_uid != new.cd_uid else None,
            on_delete=lambda n: on_node(n.name),
        )

    def add_channel_handlers(self, on_clique: Callable[[str], None]) -> None:
        """Route what changes a clique's channels to ``on_clique(cliqueID)``: its records and locks, and the
        domains of its records (a domain that appears or goes changes who may get a channel)."""

        def route(clique_id: str) -> None:
            if clique_id:
                on_clique(clique_id)

        def cd_event(cd: ComputeDomain) -> None:
            for informer in self.cliques:
                for record in informer.by_index(CD_INDEX, cd.uid):
                    route(record.clique_id)

        self.cds.add_handler(on_add=cd_event, on_update=lambda _o, n: cd_event(n), on_delete=cd_event)
        for informer in self.cliques:
            informer.add_handler(
                on_add=lambda c: route(c.clique_id),
                on_update=lambda _o, n: route(n.clique_id),
                on_delete=lambda c: route(c.clique_id),
            )
        if self.locks is not None:
            self.locks.add_handler(
                on_add=lambda lk: route(lk.clique_id),
                on_update=lambda _o, n: route(n.clique_id),
                on_delete=lambda lk: route(lk.clique_id),
            )

        def claim_event(claim: ClaimView) -> None:
            # An entry is verified once its claim is seen allocated (the record may have come first).
            for informer in self.cliques:
                for record in informer.by_index(CLAIM_INDEX, claim.uid):
                    route(record.clique_id)

        if self.claims is not None and self.settings.channel_isolation:
            self.claims.add_handler(on_add=claim_event, on_update=lambda _o, n: claim_event(n))


def _lives(cd: ComputeDomain | None) -> bool:
    return cd is not None and cd.metadata.deletion_timestamp is None


def _decode_lock(raw: Raw) -> Lock:
    """A Lease with the clique label that is no channel lock (made by hand) counts as holding nothing."""
    lock = channels.decode_lock(raw)
    if lock is not None:
        return lock
    meta = raw.get("metadata") or {}
    return Lock(
        str(meta.get("name") or ""), str(meta.get("namespace") or ""), str(meta.get("uid") or ""), "", 0, "", ""
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


def child_changed(old: Child, new: Child) -> bool:
    """Whether an update changed what a reconcile reads of a child (its ``Child`` view, which holds of a
    DaemonSet's status only the pods it schedules). The DaemonSet controller's other status writes (a few per
    DaemonSet: for 1,000 new domains ~1,000 reconciles with nothing to do, ~2 % of a core for half a minute
    after all were Ready) wake no reconcile; the cache has the new object either way."""
    return replace(old, resource_version=new.resource_version) != new or old.content != new.content


def _route_both(old: str, new: str, on_uid: Callable[[str], None]) -> None:
    _route(new, on_uid)
    if old != new:
        _route(old, on_uid)
