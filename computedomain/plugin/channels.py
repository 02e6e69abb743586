"""Which IMEX channel a claim gets under channel isolation (hostManaged, ``IMEX_ISOLATION=channel``): the node
agent's half of the protocol in docs/design/0012-channel-isolation.md.

The domain's channel in this node's clique is recorded in ``ComputeDomainClique <cdUID>.<cliqueID>`` (driver
namespace; the controller writes ``channel`` once, see ``controller.channels``). Before a claim may get that
channel, it must be listed in the record's ``preparedClaims``: while any claim is listed, the record (and
with it the channel) cannot go away, so no other domain can be given the channel while a container may still
use it. ``ChannelRecords`` (``collaborators.ChannelAssignments``) does this node's part:

* ``acquire``: list the claim in the record (creating the record, which is the request for a channel, when
  it does not exist yet), then wait, on watch events, until that record (the UID the API answered the
  write with: a lagging cache may still show an earlier record of the name, deleted since, whose channel
  is another domain's by now) has a channel; check it (below the node's ``ImexChannelCount``; no other
  domain's record in the clique names it) and return it. Without a
  channel in time: ``ChannelNotAssignedError`` (retryable), which says what it waits for, and the domain's
  condition when the controller found no channel free;
* ``release``: take the claim off the record again (Unprepare, and the cleanup for releases that failed);
* ``node_claims``: the claims this node has listed, for the cleanup to compare with the checkpoint;
* ``hold``: the cleanup's other direction: a claim the checkpoint holds prepared whose entry is gone from the
  record (whoever wrote that) is listed again, so the record, and the channel, stay. Not in a record being
  deleted: the admission policy lets a node agent only take claims off such a record (a stolen token could
  otherwise keep a deleted domain's channel taken with fresh entries), so a lost entry there is an error in
  the log, as a record gone is.

Only this node's entries count (claim UID and node together, as the CRD keys them): another node's entry of
the same claim UID is not a hold this node can rely on, since that node may take it off at any time.

Writes: the record is created with our finalizer and the claim; a claim is appended with a JSON patch (the
apiserver applies it to the current object, so concurrent appends of several nodes all land) and removed with
a JSON patch that first tests the entry at its index (so a list that changed meanwhile is read again, never
the wrong entry removed). A write that meets a changed record decides again on a fresh read, at most eight
times (``computedomain.retry.again_on``), then fails retryably. The node agent never writes ``channel``, other nodes' entries, or finalizers after
creation (an admission policy holds it to that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from computedomain.api.constants import (
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    GROUP_VERSION,
    SHARED_IMEX_CHANNEL,
)
from computedomain.api.models import ComputeDomain, ComputeDomainClique, PreparedClaim, clique_name, valid_clique_id
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient
from computedomain.kube.clock import Clock, MonotonicClock, run_within
from computedomain.kube.errors import AlreadyExists, Conflict, Forbidden, Invalid, NotFound
from computedomain.kube.informer import Informer
from computedomain.plugin.collaborators import DomainInfo
from computedomain.plugin.failures import ChannelNotAssignedError, ClaimRejected, RetryableError
from computedomain.retry import again_on

log = logging.getLogger(__name__)

CLIQUE_INDEX: Final = "clique"
EXHAUSTED_REASON: Final = "ChannelsExhausted"
_MAX_TRIES: Final = 8


class _Changed(Exception):  # noqa: N818 (the retry loop's signal, never seen outside this module)
    """The record changed under us (or was read again): decide once more on what was read."""


@dataclass(frozen=True, slots=True)
class Verdict:
    channel: int | None
    why: str


def evaluate(
    record: ComputeDomainClique | None,
    clique: Iterable[ComputeDomainClique],
    *,
    domain: DomainInfo,
    clique_id: str,
    channel_count: int,
    exhausted: str = "",
) -> Verdict:
    """Pure: the channel the domain's claims get here, or why not yet. Raises ``ClaimRejected`` for a channel
    this node cannot have, ``RetryableError`` for a record that contradicts another one."""
    where = f"ComputeDomain {domain.namespace}/{domain.name} in clique {clique_id}"
    if record is None:
        return Verdict(
            None, f"waiting for the record of {where} (ComputeDomainClique {clique_name(domain.uid, clique_id)})"
        )
    if record.metadata.deletion_timestamp is not None:
        raise RetryableError(
            f"ComputeDomainClique {record.metadata.name} is being deleted (its ComputeDomain is going away, or it "
            "was deleted by hand); its channel stays reserved until its claims are unprepared, then a new one "
            "is assigned"
        )
    channel = record.channel
    if channel is None:
        detail = f": {exhausted}" if exhausted else ""
        return Verdict(None, f"waiting for the controller to assign an IMEX channel to {where}{detail}")
    if channel == SHARED_IMEX_CHANNEL or channel >= channel_count:
        raise ClaimRejected(
            f"IMEX channel {channel} of {where} is not one this node has (ImexChannelCount {channel_count}, "
            "NVreg_ImexChannelCount): set resources.computeDomains.imex.channelCount to the nodes' "
            "NVreg_ImexChannelCount"
        )
    others = sorted(c.metadata.name for c in clique if c.channel == channel and c.metadata.name != record.metadata.name)
    if others:
        raise RetryableError(
            f"IMEX channel {channel} of {where} is recorded for {', '.join(others)} too; not handing it out "
            "until that is resolved (a lock Lease deleted by hand?)"
        )
    return Verdict(channel, "")


class CachedDomains(Protocol):
    def lookup(self, uid: str) -> ComputeDomain | None: ...


def _entry(claim_uid: str, node: str) -> dict[str, str]:
    return {"claimUID": claim_uid, "nodeName": node}


class ChannelRecords:
    """``collaborators.ChannelAssignments`` backed by the API: a watch of the driver namespace's records."""

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        namespace: str,
        domains: CachedDomains | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``domains``: the agent's ``DomainCache`` (its ``lookup(uid)``), to quote the domain's condition when
        the controller found no channel free."""
        self._client = client
        self.node_name = node_name
        self.namespace = namespace
        self._domains = domains
        self._clock: Clock = clock or MonotonicClock()
        self.informer: Informer[ComputeDomainClique] = Informer(
            client,
            COMPUTE_DOMAIN_CLIQUES,
            decode=ComputeDomainClique.model_validate,
            namespace=namespace,
            name="computedomaincliques",
            indexers={CLIQUE_INDEX: lambda c: [c.clique_id]},
        )
        self.informer.add_handler(
            on_add=self._changed, on_update=lambda _old, new: self._changed(new), on_delete=self._changed
        )
        self._waiters: dict[str, asyncio.Event] = {}

    async def run(self) -> None:
        await self.informer.run()

    def _changed(self, record: ComputeDomainClique) -> None:
        event = self._waiters.pop(record.metadata.name, None)
        if event is not None:
            event.set()

    # -- reads

    def known(self, domain_uid: str, clique_id: str) -> int | None:
        record = self.informer.get(clique_name(domain_uid, clique_id), self.namespace)
        if record is None or record.metadata.deletion_timestamp is not None:
            return None
        return record.channel

    def node_claims(self) -> list[tuple[str, str, str]]:
        """(domain UID, clique ID, claim UID) of every claim this node has listed in a record."""
        return [
            (record.domain_uid, record.clique_id, entry.claim_uid)
            for record in self.informer.list()
            for entry in record.prepared_claims or ()
            if entry.node_name == self.node_name
        ]

    def _exhausted(self, domain_uid: str) -> str:
        if self._domains is None:
            return ""
        cd = self._domains.lookup(domain_uid)
        for cond in (cd.status.conditions or ()) if cd is not None and cd.status is not None else ():
            if cond.type == "Ready" and cond.reason == EXHAUSTED_REASON:
                return cond.message
        return ""

    def _verdict(self, domain: DomainInfo, clique_id: str, count: int, record: ComputeDomainClique) -> Verdict:
        return evaluate(
            record,
            self.informer.by_index(CLIQUE_INDEX, clique_id),
            domain=domain,
            clique_id=clique_id,
            channel_count=count,
            exhausted=self._exhausted(domain.uid),
        )

    # -- acquire

    async def acquire(
        self, domain: DomainInfo, clique_id: str, claim_uid: str, *, channel_count: int, timeout_s: float
    ) -> int:
        if not valid_clique_id(clique_id):
            raise ClaimRejected(f"this node's clique ID {clique_id!r} cannot name a ComputeDomainClique")
        listed = await self._list_claim(domain, clique_id, claim_uid)
        try:
            return await run_within(
                self._clock, max(timeout_s, 0.0), self._until_assigned(domain, clique_id, listed, channel_count)
            )
        except TimeoutError:
            why = self._verdict(domain, clique_id, channel_count, self._latest(listed)).why
            raise ChannelNotAssignedError(why) from None

    def _latest(self, listed: ComputeDomainClique) -> ComputeDomainClique:
        """The newest known state of ``listed``, the record our claim is listed in (read from the API, not
        the cache). The cache counts only with the same UID: a cache that lags may still show an earlier
        record of that name, deleted since, whose channel may belong to another domain by now. ``listed``
        cannot have been deleted meanwhile: our claim in it holds its finalizer."""
        seen = self.informer.get(listed.metadata.name, self.namespace)
        if seen is None or seen.metadata.uid != listed.metadata.uid:
            return listed
        return listed if seen.channel is None and listed.channel is not None else seen

    async def _until_assigned(self, domain: DomainInfo, clique_id: str, listed: ComputeDomainClique, count: int) -> int:
        await self.informer.has_synced()
        logged = False
        while True:
            event = self._waiters.setdefault(listed.metadata.name, asyncio.Event())  # before the check: none lost
            verdict = self._verdict(domain, clique_id, count, self._latest(listed))
            if verdict.channel is not None:
                return verdict.channel
            if not logged:
                logged = True
                log.info("waiting for an IMEX channel: %s", verdict.why)
            await event.wait()

    async def _list_claim(self, domain: DomainInfo, clique_id: str, claim_uid: str) -> ComputeDomainClique:
        """Make sure the record lists the claim (this is what keeps the channel reserved); returns the record
        as the API answered. The cache only picks the first write: what it shows may lag (an earlier record of
        the same name that listed this claim before it was unprepared), so a claim it shows listed, or a record
        it shows being deleted, is read again live before it counts."""
        name = clique_name(domain.uid, clique_id)
        record = self.informer.get(name, self.namespace)
        fresh = False

        async def once() -> ComputeDomainClique:
            nonlocal record, fresh
            listed = _lists(record, claim_uid, self.node_name)
            if record is not None and not fresh and (listed or record.metadata.deletion_timestamp):
                record, fresh = await self._get(name), True
                raise _Changed
            if record is None:
                body = {
                    "apiVersion": GROUP_VERSION,
                    "kind": "ComputeDomainClique",
                    "metadata": {
                        "name": name,
                        "namespace": self.namespace,
                        "labels": {COMPUTE_DOMAIN_LABEL: domain.uid},
                        "finalizers": [COMPUTE_DOMAIN_FINALIZER],
                    },
                    "preparedClaims": [_entry(claim_uid, self.node_name)],
                }
                try:
                    raw = await self._client.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=self.namespace)
                except AlreadyExists:
                    record, fresh = await self._get(name), True
                    raise _Changed from None
                log.info("asked for an IMEX channel record=%s claim=%s", name, claim_uid)
                return ComputeDomainClique.model_validate(raw)
            if listed:
                return record
            if record.metadata.deletion_timestamp is not None:
                evaluate(record, (), domain=domain, clique_id=clique_id, channel_count=1)  # raises, saying why
            try:
                return await self._append(record, claim_uid)
            except NotFound:
                record = None  # gone meanwhile: ask again
                raise _Changed from None
            except (Invalid, Conflict):
                # Listed already (a retried answer got lost, or a lagging cache), or changed meanwhile.
                record, fresh = await self._get(name), True
                raise _Changed from None
            except Forbidden:
                # The records policy refuses fresh entries in a record being deleted: deleted meanwhile?
                record, fresh = await self._get(name), True
                if record is not None and record.metadata.deletion_timestamp is None:
                    raise
                raise _Changed from None

        try:
            return await again_on(_MAX_TRIES, _Changed)(once)
        except _Changed:
            raise RetryableError(f"ComputeDomainClique {name} kept changing while listing claim {claim_uid}") from None

    async def _append(self, record: ComputeDomainClique, claim_uid: str) -> ComputeDomainClique:
        name = record.metadata.name
        if record.prepared_claims is None:
            patch: dict[str, Any] = {
                "metadata": {"resourceVersion": record.metadata.resource_version},
                "preparedClaims": [_entry(claim_uid, self.node_name)],
            }
            raw = await self._client.merge_patch(
                COMPUTE_DOMAIN_CLIQUES, name, patch, namespace=self.namespace, drop_managed_fields=True
            )
        else:
            op = {"op": "add", "path": "/preparedClaims/-", "value": _entry(claim_uid, self.node_name)}
            raw = await self._client.json_patch(
                COMPUTE_DOMAIN_CLIQUES, name, [op], namespace=self.namespace, drop_managed_fields=True
            )
        return ComputeDomainClique.model_validate(raw)

    # -- hold

    async def hold(self, domain_uid: str, clique_id: str, claim_uid: str) -> bool:
        """A claim this node holds prepared stays listed whatever else was written to its record: an entry of
        ours that is gone (taken off by hand, or by anyone but this node) is listed again, except in a record
        being deleted (module docstring). True when it had to be. The cache decides whether to look; the API
        decides whether to write."""
        name = clique_name(domain_uid, clique_id)
        if _lists(self.informer.get(name, self.namespace), claim_uid, self.node_name):
            return False

        async def once() -> bool:
            record = await self._get(name)
            if _lists(record, claim_uid, self.node_name):
                return False
            if record is None or record.metadata.deletion_timestamp is not None:
                log.error(
                    "the channel record of a claim prepared here is %s without the claim: its channel may be "
                    "handed to another domain while the claim's containers use it record=%s claim=%s",
                    "gone" if record is None else "being deleted",
                    name,
                    claim_uid,
                )
                return False
            try:
                await self._append(record, claim_uid)
            except (NotFound, Invalid, Conflict, Forbidden):
                raise _Changed from None  # gone, changed, or deleted meanwhile (the policy): read it again
            log.warning("listed a prepared claim again in its channel record record=%s claim=%s", name, claim_uid)
            return True

        try:
            return await again_on(_MAX_TRIES, _Changed)(once)
        except _Changed:
            raise RetryableError(
                f"ComputeDomainClique {name} kept changing while listing claim {claim_uid} again"
            ) from None

    async def _get(self, name: str) -> ComputeDomainClique | None:
        try:
            return ComputeDomainClique.model_validate(
                await self._client.get(COMPUTE_DOMAIN_CLIQUES, name, namespace=self.namespace)
            )
        except NotFound:
            return None

    # -- release

    async def release(self, domain_uid: str, clique_id: str, claim_uid: str) -> bool:
        """Take the claim off the record; True when it was listed. Idempotent."""
        name = clique_name(domain_uid, clique_id)

        async def once() -> bool:
            record = await self._get(name)
            if record is None:
                return False
            claims = record.prepared_claims or []
            index = next((i for i, c in enumerate(claims) if _ours(c, claim_uid, self.node_name)), None)
            if index is None:
                return False
            ops: list[dict[str, Any]] = [
                # The entry's keys, not its whole value: the controller may have marked it verified.
                {"op": "test", "path": f"/preparedClaims/{index}/claimUID", "value": claim_uid},
                {"op": "test", "path": f"/preparedClaims/{index}/nodeName", "value": self.node_name},
                {"op": "remove", "path": f"/preparedClaims/{index}"},
            ]
            try:
                await self._client.json_patch(
                    COMPUTE_DOMAIN_CLIQUES, name, ops, namespace=self.namespace, drop_managed_fields=True
                )
            except NotFound:
                return False
            except Invalid:
                raise _Changed from None  # the list changed under us: read it again
            log.info("released IMEX channel claim=%s record=%s channel=%s", claim_uid, name, record.channel)
            return True

        try:
            return await again_on(_MAX_TRIES, _Changed)(once)
        except _Changed:
            raise RetryableError(
                f"ComputeDomainClique {name} kept changing while releasing claim {claim_uid}"
            ) from None


def _ours(entry: PreparedClaim, claim_uid: str, node: str) -> bool:
    return entry.claim_uid == claim_uid and entry.node_name == node


def _lists(record: ComputeDomainClique | None, claim_uid: str, node: str) -> bool:
    """Whether the record holds this node's entry of the claim. Only an entry of this node counts: another
    node's entry of the same claim UID (a stolen token of that node may write one) is not ours to trust, since
    that node may take it off again at any time."""
    return record is not None and any(_ours(c, claim_uid, node) for c in record.prepared_claims or ())
