"""What the node agent knows about ComputeDomains: a cache of every CD (looked up by UID) and the readiness
of this node's IMEX daemon in each, both kept current by watches.

- `DomainCache` is an informer over ComputeDomains in all namespaces with a UID index; Prepare uses it for
  the namespace check and the daemon's CDI env. A UID missing from a synced cache is looked up live once
  before Prepare calls the CD absent, because a permanent error must not come from cache lag; a UID found
  absent that way is remembered (it cannot appear later), so retries of such a claim list nothing.
- `DaemonReadinessWatch` answers "is this node's daemon of domain D Ready?" from watch events, never by
  polling: with ComputeDomainCliques on, from the `ComputeDomainClique <cdUID>.<cliqueID>` objects in the
  driver namespace (this node's entry, by `nodeName`), falling back to `CD.status.nodes` for domains set up
  before the gate; with the gate off, from `CD.status.nodes`; and with IMEXDaemonsWithDNSNames off (legacy IP
  mode, where IMEX only starts once every peer is known) it also needs `numNodes` Ready entries.
  `wait_ready` re-evaluates whenever an event for that domain arrives and gives up at its timeout with a
  message that says what it saw.

Concurrency: the informers run as tasks of the agent (`run()`); their handlers only set per-domain events.
Readers are synchronous over the informer stores and run on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from computedomain.api.models import ComputeDomain, ComputeDomainClique, ReadyStatus, clique_name
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, KubeClient
from computedomain.kube.clock import Clock, MonotonicClock, run_within
from computedomain.kube.informer import Informer
from computedomain.plugin.collaborators import DomainInfo
from computedomain.plugin.failures import NotReadyError, RetryableError

log = logging.getLogger(__name__)

UID_INDEX: Final = "uid"
SYNC_TIMEOUT_S: Final = 10.0
ABSENT_MEMO: Final = 4096  # UIDs known not to exist (bounded: a tenant may make claims naming any number)


def _info(cd: ComputeDomain) -> DomainInfo:
    return DomainInfo(
        uid=cd.metadata.uid, name=cd.metadata.name, namespace=cd.metadata.namespace, num_nodes=cd.spec.num_nodes
    )


class DomainCache:
    """`collaborators.DomainLookup`: ComputeDomains of all namespaces by UID."""

    def __init__(self, client: KubeClient) -> None:
        self._client = client
        self.informer: Informer[ComputeDomain] = Informer(
            client,
            COMPUTE_DOMAINS,
            decode=ComputeDomain.model_validate,
            name="computedomains",
            indexers={UID_INDEX: lambda cd: (cd.metadata.uid,)},
        )
        self._absent: OrderedDict[str, None] = OrderedDict()

    async def run(self) -> None:
        await self.informer.run()

    def lookup(self, uid: str) -> ComputeDomain | None:
        found = self.informer.by_index(UID_INDEX, uid)
        return found[0] if found else None

    async def get_domain(self, uid: str) -> DomainInfo | None:
        if not await self.informer.has_synced(SYNC_TIMEOUT_S):
            # Without a synced cache "absent" would be a guess; make it a retryable error instead.
            raise RetryableError("the ComputeDomain cache has not synced yet")
        cd = self.lookup(uid)
        if cd is None:
            if uid in self._absent:
                return None
            listed = await self._client.list_all(COMPUTE_DOMAINS)
            cd = next(
                (ComputeDomain.model_validate(c) for c in listed.items if (c.get("metadata") or {}).get("uid") == uid),
                None,
            )
            if cd is None:
                self._remember_absent(uid)
        return _info(cd) if cd is not None and cd.metadata.deletion_timestamp is None else None

    def _remember_absent(self, uid: str) -> None:
        """A UID a live (quorum) list did not show never shows later: the apiserver gives every object a new
        one at create, and a claim can only name a UID that existed before it. So a claim of an unknown
        domain costs one list of every ComputeDomain, not one per Prepare attempt."""
        self._absent[uid] = None
        while len(self._absent) > ABSENT_MEMO:
            self._absent.popitem(last=False)

    def known_uids(self) -> set[str]:
        return set(self.informer.index_values(UID_INDEX))


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    why: str


def evaluate(
    node: str,
    domain: DomainInfo,
    clique_id: str,
    *,
    clique: ComputeDomainClique | None,
    cd: ComputeDomain | None,
    use_cliques: bool,
    dns_names: bool,
) -> Readiness:
    """Pure: is this node's daemon of the domain Ready, and if not, what was seen."""
    where = f"ComputeDomain {domain.namespace}/{domain.name}"
    if use_cliques and clique is not None:
        entry = next((d for d in clique.daemons or () if d.node_name == node), None)
        if entry is not None and entry.status is ReadyStatus.READY:
            return Readiness(True, "")
        seen = f"entry {entry.status}" if entry is not None else "no entry"
        clique_text = f"ComputeDomainClique {clique.metadata.name}: {seen}"
    else:
        clique_text = f"ComputeDomainClique {clique_name(domain.uid, clique_id)}: not found" if use_cliques else ""
    nodes = list((cd.status.nodes if cd is not None and cd.status is not None else None) or ())
    own = next((n for n in nodes if n.name == node), None)
    ready = [n for n in nodes if n.status is ReadyStatus.READY]
    if own is not None and own.status is ReadyStatus.READY:
        if dns_names:
            return Readiness(True, "")
        if len(ready) >= domain.num_nodes:
            return Readiness(True, "")
        return Readiness(
            False,
            f"node {node} not ready in {where}: {len(ready)} of {domain.num_nodes} daemons Ready "
            "(IMEXDaemonsWithDNSNames=false waits for numNodes)",
        )
    status_text = f"status.nodes entry {own.status}" if own is not None else "no status.nodes entry"
    detail = "; ".join(t for t in (clique_text, status_text) if t)
    return Readiness(False, f"node {node} not ready in {where}: IMEX daemon {detail}")


class DaemonReadinessWatch:
    """`collaborators.DaemonReadiness`, driven by ComputeDomainClique and ComputeDomain watch events."""

    def __init__(
        self,
        client: KubeClient,
        domains: DomainCache,
        *,
        node_name: str,
        driver_namespace: str,
        use_cliques: bool,
        dns_names: bool,
        clock: Clock | None = None,
    ) -> None:
        self.node_name = node_name
        self._clock: Clock = clock or MonotonicClock()
        self.use_cliques = use_cliques
        self.dns_names = dns_names
        self.domains = domains
        self.driver_namespace = driver_namespace
        self.cliques: Informer[ComputeDomainClique] | None = None
        if use_cliques:
            self.cliques = Informer(
                client,
                COMPUTE_DOMAIN_CLIQUES,
                decode=ComputeDomainClique.model_validate,
                namespace=driver_namespace,
                name="computedomaincliques",
            )
            self.cliques.add_handler(
                on_add=self._clique_changed,
                on_update=lambda _old, new: self._clique_changed(new),
                on_delete=self._clique_changed,
            )
        domains.informer.add_handler(
            on_add=self._cd_changed, on_update=lambda _old, new: self._cd_changed(new), on_delete=self._cd_changed
        )
        self._changed: dict[str, asyncio.Event] = {}

    async def run(self) -> None:
        if self.cliques is not None:
            await self.cliques.run()
        else:
            await asyncio.Event().wait()  # nothing to watch beyond the CD cache; live as long as the agent

    def informers(self) -> Iterable[Informer[ComputeDomainClique]]:
        return [self.cliques] if self.cliques is not None else []

    def _notify(self, uid: str) -> None:
        event = self._changed.pop(uid, None)
        if event is not None:
            event.set()

    def _clique_changed(self, clique: ComputeDomainClique) -> None:
        self._notify(clique.domain_uid)

    def _cd_changed(self, cd: ComputeDomain) -> None:
        self._notify(cd.metadata.uid)

    def check(self, domain: DomainInfo, clique_id: str) -> Readiness:
        clique = None
        if self.cliques is not None:
            clique = self.cliques.get(clique_name(domain.uid, clique_id), self.driver_namespace)
        return evaluate(
            self.node_name,
            domain,
            clique_id,
            clique=clique,
            cd=self.domains.lookup(domain.uid),
            use_cliques=self.use_cliques,
            dns_names=self.dns_names,
        )

    async def wait_ready(self, domain: DomainInfo, clique_id: str, timeout_s: float) -> None:
        try:
            await run_within(self._clock, max(timeout_s, 0.0), self._until_ready(domain, clique_id))
        except TimeoutError:
            if not all(i.synced for i in self.informers()):
                raise NotReadyError(f"node {self.node_name}: ComputeDomainClique cache not synced yet") from None
            raise NotReadyError(self.check(domain, clique_id).why) from None

    async def _until_ready(self, domain: DomainInfo, clique_id: str) -> None:
        for informer in self.informers():
            await informer.has_synced()
        logged = False
        while True:
            # Register interest before evaluating, so an event between the two is not lost.
            event = self._changed.setdefault(domain.uid, asyncio.Event())
            state = self.check(domain, clique_id)
            if state.ready:
                return
            if not logged:
                logged = True
                log.info("waiting for this node's IMEX daemon: %s", state.why)
            await event.wait()
