"""The impure half of the channel assignment: apply ``channels.plan`` for one clique through the API.

``ChannelAssigner.reconcile(clique_id)`` is the callback of the controller's second convergence loop (keyed by
clique ID, so one clique's channels are never planned twice at once in a process). It builds the clique's
``CliqueSpace`` from the caches, then loops plan -> apply the batch -> fold the answers -> plan, until nothing
is left, as the domain reconcile does. The writes, and what makes each safe:

* lock: a create; ``AlreadyExists`` is read back: our own lock (a retry whose answer was lost, or a cache that
  had not shown it) is used, anyone else's marks the channel taken and the plan picks the next one;
* the channel into a record: a merge patch with the record's UID as precondition, so it can only land on the
  record the lock names as owner; the CRD refuses to change a channel once set, so of two racing writers at
  most one value ever lands, and the loser reads it back;
* dropping our finalizer from a record being deleted: a merge patch with the resourceVersion at which the
  record listed no claim, so a node agent adding one in between makes it a ``Conflict`` (retried);
* marking entries ``verified``: a JSON patch that first tests each entry's claim UID and node at its index;
  an entry is verifiable when the claim cache shows its claim allocated there for the record's domain, or,
  for one it does not, a live list of the claims taken after the entry was first seen does (a claim no
  watch could read must not stay unverified: unverified entries are dropped once their claim is gone);
* retiring a live domain's record whose channel went unused (``IMEX_CHANNEL_IDLE_RELEASE`` since this process
  first saw it without a verified entry, or at once when its entries are all of nodes no longer labelled
  with its clique, and none of its unverified entries allocated there by a live list of the claims), or
  that stayed unbound without a channel for as long, listing no claim allocated there: a DELETE with its
  UID and resourceVersion as preconditions, so an entry a node agent added in between makes it a
  ``Conflict`` (planned again on the fresh state);
* dropping verified entries that hold nothing (``_vacated``: of a node not labelled with the record's clique,
  for a claim a live list no older than ``AWAY_RECHECK_S`` and taken after the entry was first seen no
  longer has), from records being deleted, and counting them as unused in live ones; a clique with such
  entries is looked at again every ``AWAY_RECHECK_S``, as a claim's deletion does not wake its loop;
* dropping claims of vanished nodes: only after a live GET of each such Node answered NotFound, and
  unverified claims of a record being deleted: only when a live list of every ResourceClaim, taken after this
  process first saw the entry, does not show it allocated there for the domain (at most one such list every
  ``CLAIM_LIST_S`` seconds, however many records wait for one); again with the record's resourceVersion.

A failure raises; the convergence loop retries with backoff, by which time the watches have caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any, Final

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, GPU_CLIQUE_NODE_LABEL, GROUP_VERSION
from computedomain.api.models import ComputeDomainClique
from computedomain.controller import channels
from computedomain.controller.caches import Caches
from computedomain.controller.channels import (
    Action,
    CheckHolders,
    CliqueSpace,
    CreateLock,
    DeleteLock,
    Gone,
    Lock,
    Record,
    RecordChannel,
    ReleaseRecord,
    Result,
    RetireRecord,
    Taken,
    Unchanged,
    VerifyClaims,
)
from computedomain.controller.executor import Writer, gather_all
from computedomain.controller.observed import ClaimView, decode_claim
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, LEASES, NODES, RESOURCE_CLAIMS
from computedomain.kube.converge import DONE, ReconcileResult, RequeueAfter
from computedomain.kube.errors import AlreadyExists, Conflict, Invalid, NotFound
from computedomain.kube.events import EventType
from computedomain.metrics import Counter
from computedomain.settings import ControllerSettings

log = logging.getLogger(__name__)

MAX_ROUNDS: Final = 16
NODE_MEMO_S: Final = 30.0
UNBOUND_RECHECK_S: Final = 5.0
#: the least time between two live lists of every ResourceClaim (unverified entries of records being deleted)
CLAIM_LIST_S: Final = 5.0
#: how old a claim list may be to tell that a verified entry of a node outside its record's clique holds nothing,
#: and how soon a clique with such entries is looked at again (claim events do not wake this loop)
AWAY_RECHECK_S: Final = 60.0

CHANNEL_WRITES = Counter(
    "computedomain_controller_imex_channel_writes_total",
    "Writes of the IMEX channel assignment (channel isolation), by what they did.",
    ["action"],
)


class ChannelAssigner:
    def __init__(self, writer: Writer, settings: ControllerSettings) -> None:
        self.writer = writer
        self.client = writer.client
        self.caches: Caches = writer.caches
        self.count = settings.imex_channel_count
        self.idle_release = settings.imex_channel_idle_release
        # Per clique, since when this process has seen each live domain's record (by UID, and whether it was
        # channel-less) with a channel and no verified entry, or without a channel and unbound.
        self._unused_since: dict[str, dict[tuple[str, bool], float]] = {}
        # Per clique, the unbound records (by UID) already named at INFO.
        self._told_unbound: dict[str, set[str]] = {}
        self._nodes: dict[str, tuple[str | None, float]] = {}
        # Per clique, when this process first saw each entry (record name, claim UID, node); and the last live
        # list of every claim (by UID) with when it was taken.
        self._first_seen: dict[str, dict[tuple[str, str, str], float]] = {}
        self._claims: tuple[dict[str, ClaimView], float] | None = None
        self._listing: tuple[asyncio.Future[dict[str, ClaimView]], float] | None = None  # in flight, since when
        # Set once the apiserver dropped the mark (a CRD older than the chart): verifying stops, not loops.
        self._no_mark = False

    async def reconcile(self, clique_id: str) -> ReconcileResult:
        space = self.caches.clique_space(clique_id)
        space = replace(space, unbound=await self._unbound(space))
        self._tell_unbound(space)
        self._note_entries(space)
        space, unlisted = await self._verifiable_live(space)
        idle, retire_in = await self._idle(space)
        space = replace(space, idle=idle)
        for _ in range(MAX_ROUNDS):
            if self._no_mark:
                space = replace(space, verifiable=frozenset())
            plan = channels.plan(space, self.count)
            if not plan:
                if plan.waiting:
                    log.debug("no free IMEX channel clique=%s waiting=%s", clique_id, ",".join(map(str, plan.waiting)))
                later = [retire_in] if retire_in is not None else []
                if space.unbound:
                    later.append(UNBOUND_RECHECK_S)
                if unlisted or self._awaiting_list(space):  # unverified entries wait for a live list
                    later.append(CLAIM_LIST_S)
                if await self._any_away(space):  # their claims' deletion wakes nothing here
                    later.append(AWAY_RECHECK_S)
                return RequeueAfter(min(later)) if later else DONE
            results = await gather_all(self._apply(action) for action in plan.actions)
            for action, result in zip(plan.actions, results, strict=True):
                space = channels.fold(space, action, result)
        log.warning("channel assignment did not converge clique=%s rounds=%d", clique_id, MAX_ROUNDS)
        return RequeueAfter(1.0)

    async def _apply(self, action: Action) -> Result:
        CHANNEL_WRITES.labels(type(action).__name__).inc()
        if isinstance(action, CreateLock):
            return await self._lock(action.record, action.channel)
        if isinstance(action, RecordChannel):
            return await self._record(action.record, action.channel)
        if isinstance(action, DeleteLock):
            log.info("deleting superseded IMEX channel lock lock=%s why=%s", action.lock, action.why)
            with contextlib.suppress(NotFound):
                await self.client.delete(LEASES, action.lock.name, namespace=action.lock.namespace, uid=action.lock.uid)
            return Gone()
        if isinstance(action, ReleaseRecord):
            return await self._release(action.record)
        if isinstance(action, CheckHolders):
            return await self._prune(action.record)
        if isinstance(action, VerifyClaims):
            return await self._verify(action.record, action.entries)
        if isinstance(action, RetireRecord):
            return await self._retire(action.record)
        raise TypeError(f"unknown action {action!r}")  # pragma: no cover

    async def _lock(self, record: Record, channel: int) -> Lock | Taken:
        body = channels.lock_body(record, channel, GROUP_VERSION)
        name = body["metadata"]["name"]
        try:
            raw = await self.client.create(LEASES, body, namespace=record.namespace)
        except AlreadyExists:
            raw = await self.client.get(LEASES, name, namespace=record.namespace)
            existing = channels.decode_lock(raw)
            assert existing is not None, f"lease {name} is not a channel lock"
            return existing if existing.owner_uid == record.uid else Taken(existing)
        lock = channels.decode_lock(raw)
        assert lock is not None
        return lock

    async def _record(self, record: Record, channel: int) -> Record | Gone:
        patch = {"metadata": {"uid": record.uid}, "channel": channel}
        try:
            raw = await self.client.merge_patch(
                COMPUTE_DOMAIN_CLIQUES, record.name, patch, namespace=record.namespace, drop_managed_fields=True
            )
        except NotFound:
            return Gone()
        except Invalid:
            # Another writer set a channel first (the CRD keeps it): read which; the plan drops our lock.
            raw = await self.client.get(COMPUTE_DOMAIN_CLIQUES, record.name, namespace=record.namespace)
        written = channels.record_of(ComputeDomainClique.model_validate(raw))
        if written.channel == channel:
            log.info(
                "assigned IMEX channel channel=%d clique=%s cd_uid=%s record=%s",
                channel,
                record.clique_id,
                record.domain_uid,
                record.name,
            )
            self._tell(
                record,
                "ChannelAssigned",
                f"IMEX channel {channel} in clique {record.clique_id}: every pod of this ComputeDomain there gets "
                "it, no other ComputeDomain does",
            )
        return written

    def _tell(self, record: Record, reason: str, message: str) -> None:
        """A Normal Event on the record's domain, when it is known."""
        cd = self.caches.cd(record.domain_uid)
        if cd is not None:
            self.writer.event(cd, EventType.NORMAL, reason, message)

    async def _release(self, record: Record) -> Record | Gone:
        rest = [f for f in record.finalizers if f != COMPUTE_DOMAIN_FINALIZER]
        patch: dict[str, Any] = {"metadata": {"resourceVersion": record.resource_version, "finalizers": rest or None}}
        try:
            raw = await self.client.merge_patch(
                COMPUTE_DOMAIN_CLIQUES, record.name, patch, namespace=record.namespace, drop_managed_fields=True
            )
        except NotFound:
            return Gone()
        log.info("released IMEX channel channel=%s clique=%s record=%s", record.channel, record.clique_id, record.name)
        released = channels.record_of(ComputeDomainClique.model_validate(raw))
        return Gone() if released.terminating and not released.finalizers else released

    async def _retire(self, record: Record) -> Record | Gone | Unchanged:
        try:
            raw = await self.client.delete(
                COMPUTE_DOMAIN_CLIQUES,
                record.name,
                namespace=record.namespace,
                uid=record.uid,
                resource_version=record.resource_version,
                drop_managed_fields=True,
            )
        except NotFound:
            return Gone()
        except Conflict:
            return Unchanged()  # an entry came (or went) meanwhile: planned again on what the watch shows
        if record.channel is None:
            log.info(
                "deleted %s: no node labelled with its clique listed a claim in it for %gs (a node agent asks only "
                "in its own clique)",
                record,
                self.idle_release,
            )
        else:
            log.info(
                "taking back an unused IMEX channel channel=%s clique=%s record=%s",
                record.channel,
                record.clique_id,
                record,
            )
            self._tell(
                record,
                "ChannelReleased",
                f"IMEX channel {record.channel} in clique {record.clique_id} taken back: no pod of this "
                f"ComputeDomain holds it there (IMEX_CHANNEL_IDLE_RELEASE {self.idle_release:g}s); its next pod "
                "there gets one anew",
            )
        if raw.get("kind") != "ComputeDomainClique":
            return Gone()
        return channels.record_of(ComputeDomainClique.model_validate(raw))

    async def _verify(self, record: Record, entries: tuple[tuple[str, str], ...]) -> Record | Gone:
        ops: list[dict[str, Any]] = []
        for index, entry in enumerate(record.claims):
            if entry in entries:
                ops += [
                    {"op": "test", "path": f"/preparedClaims/{index}/claimUID", "value": entry[0]},
                    {"op": "test", "path": f"/preparedClaims/{index}/nodeName", "value": entry[1]},
                    {"op": "add", "path": f"/preparedClaims/{index}/verified", "value": True},
                ]
        try:
            raw = await self.client.json_patch(
                COMPUTE_DOMAIN_CLIQUES, record.name, ops, namespace=record.namespace, drop_managed_fields=True
            )
        except NotFound:
            return Gone()
        except Invalid:
            # The list changed under us (a node agent added or took off an entry): read it again.
            try:
                raw = await self.client.get(COMPUTE_DOMAIN_CLIQUES, record.name, namespace=record.namespace)
            except NotFound:
                return Gone()
            return channels.record_of(ComputeDomainClique.model_validate(raw))
        written = channels.record_of(ComputeDomainClique.model_validate(raw))
        if not any(entry in written.verified for entry in entries):
            self._no_mark = True
            log.error(
                "the apiserver dropped preparedClaims[].verified from %s: its CRD is older than this controller; "
                "upgrade the chart's CRDs (entries stay unverified until then: a deleted domain's record keeps only "
                "claims a live list still shows allocated)",
                record,
            )
            return written
        log.debug("verified prepared claims of %s claims=%s", record, ",".join(f"{u}@{n}" for u, n in entries))
        return written

    async def _idle(self, space: CliqueSpace) -> tuple[frozenset[str], float | None]:
        """The live domains' records whose channel went unused for ``idle_release`` (module docstring), or that
        stayed unbound without a channel that long listing no claim allocated there; and in how many seconds
        the next one may be (None: none is timed)."""
        if not self.idle_release:
            return frozenset(), None
        now = time.monotonic()
        before = self._unused_since.pop(space.clique_id, {})
        since: dict[tuple[str, bool], float] = {}
        idle: set[str] = set()
        later: list[float] = []
        for record in space.records:
            if record.terminating or record.domain_uid not in space.live_domains:
                continue
            if record.channel is None:
                # A record no node of the clique lists (a stolen token asking in made-up cliques) holds no
                # channel, but would stay for as long as its domain lives. One that lists a claim allocated
                # there (a node whose label is missing for a while) stays: deleting it would leave that claim
                # in a record being deleted, and the domain's pods in the clique refused until it goes. A
                # verified entry holds it as it holds a channel (``_holds``).
                if record.name in space.unbound and not await self._holds(record, later):
                    key = (record.uid, True)
                    left = since.setdefault(key, before.get(key, now)) + self.idle_release - now
                    if left > 0:
                        later.append(left)
                    elif len(await self._unfounded(record)) < len(record.unverified):
                        later.append(CLAIM_LIST_S)  # an entry's claim may be allocated there, or no list yet
                    else:
                        idle.add(record.name)
                continue
            if await self._holds(record, later):
                continue
            key = (record.uid, False)
            start = since[key] = before.get(key, now)
            left = start + self.idle_release - now
            # Entries only of nodes no longer in the clique (a stolen token moving its Node's label from
            # clique to clique to ask in each) do not wait for the idle time.
            moved = bool(record.claims) and not await self._lists_a_member(record, space.clique_id)
            if left > 0 and not moved:
                later.append(left)
            elif len(await self._unfounded(record)) < len(record.unverified):
                later.append(CLAIM_LIST_S)  # an entry's claim may be allocated there (verified soon), or no list yet
            else:
                idle.add(record.name)
        if since:
            self._unused_since[space.clique_id] = since
        return frozenset(idle), min(later, default=None)

    async def _holds(self, record: Record, later: list[float]) -> bool:
        """Whether a verified entry of the record holds it (its claim exists, or its node is in the clique);
        adds to ``later`` when no live list can tell yet."""
        if not record.verified:
            return False
        vacated = await self._vacated(record)
        if vacated is None:
            later.append(CLAIM_LIST_S)  # no live list to tell yet
            return True
        return bool(record.verified - vacated)

    async def _verifiable_live(self, space: CliqueSpace) -> tuple[CliqueSpace, bool]:
        """``space`` with the unverified entries the claim cache does not vouch for looked up in a live list
        of the claims taken after they were first seen, those found allocated there verifiable too; and whether
        some entry still waits for such a list. The cache alone is not enough: a claim it never showed (a watch
        that could not read it, one not seen yet) would leave its entry unverified, and an unverified entry
        is dropped once its claim is gone, while its container may still run."""
        pending = [(r, e) for r in space.records for e in r.unverified if (r.name, *e) not in space.verifiable]
        if not pending or self._no_mark:
            return space, False
        now = time.monotonic()
        since = max(now if (seen := self._seen(r, e)) is None else seen for r, e in pending)
        claims = await self._claims_since(since)
        if claims is None:
            return space, True
        found = {(r.name, u, n) for r, (u, n) in pending if u in claims and claims[u].allocated(r.domain_uid, n)}
        return (replace(space, verifiable=space.verifiable | found) if found else space), False

    def _note_entries(self, space: CliqueSpace) -> None:
        now = time.monotonic()
        before = self._first_seen.pop(space.clique_id, {})
        seen = {(r.name, *entry): before.get((r.name, *entry), now) for r in space.records for entry in r.claims}
        if seen:
            self._first_seen[space.clique_id] = seen

    def _seen(self, record: Record, entry: tuple[str, str]) -> float | None:
        return self._first_seen.get(record.clique_id, {}).get((record.name, *entry))

    def _awaiting_list(self, space: CliqueSpace) -> bool:
        """Whether a record being deleted lists an unverified entry no live list has looked at yet."""
        listed_at = self._claims[1] if self._claims is not None else -1.0
        for record in space.records:
            if record.terminating and record.holds_finalizer:
                for entry in record.unverified:
                    seen = self._seen(record, entry)
                    if seen is None or seen >= listed_at:
                        return True
        return False

    async def _claims_since(self, since: float) -> dict[str, ClaimView] | None:
        """Every ResourceClaim by UID from a live list taken after ``since``; None when the last one was taken
        less than ``CLAIM_LIST_S`` ago and before ``since`` (asked again later)."""
        now = time.monotonic()
        if self._claims is not None and self._claims[1] > since:
            return self._claims[0]
        if self._claims is not None and now - self._claims[1] < CLAIM_LIST_S:
            return None
        # One list at a time, whichever cliques' loops ask for it (one per worker): a caller joins the list in
        # flight when it began after ``since``, else is asked again later.
        if self._listing is not None:
            listing, began = self._listing
            if began <= since:
                return None
        else:
            listing = asyncio.ensure_future(self._list_claims(now))
            self._listing = (listing, now)
            listing.add_done_callback(self._listed)
        return await asyncio.shield(listing)

    def _listed(self, listing: asyncio.Future[dict[str, ClaimView]]) -> None:
        if self._listing is not None and self._listing[0] is listing:
            self._listing = None

    async def _list_claims(self, now: float) -> dict[str, ClaimView]:
        # Stamped when asked: an entry seen before then was written after its claim's allocation, which a
        # consistent list begun later shows.
        listed = await self.client.list_all(RESOURCE_CLAIMS, namespace=self.caches.cd_namespace)
        # A claim that broke a decoding bound is read as far as it could be, never taken for absent: an entry
        # of a claim nobody could read must not be dropped as one that was never there.
        claims = {c.uid: c for c in map(decode_claim, listed.every)}
        self._claims = (claims, now)
        return claims

    async def _unfounded(self, record: Record) -> set[tuple[str, str]]:
        """The record's unverified entries whose claim a live list shows not allocated there for its domain."""
        if not record.unverified:
            return set()
        now = time.monotonic()
        since = max(now if (seen := self._seen(record, e)) is None else seen for e in record.unverified)
        claims = await self._claims_since(since)
        if claims is None:
            return set()
        return {(u, n) for u, n in record.unverified if not (u in claims and claims[u].allocated(record.domain_uid, n))}

    async def _prune(self, record: Record) -> Record | Gone | Unchanged:
        gone = {node for node in record.nodes if not await self._node_exists(node)}
        unfounded = await self._unfounded(record)
        vacated = await self._vacated(record) or set()
        if not gone and not unfounded and not vacated:
            return Unchanged()
        kept = [
            {"claimUID": c, "nodeName": n, **({"verified": True} if (c, n) in record.verified else {})}
            for c, n in record.claims
            if n not in gone and (c, n) not in unfounded and (c, n) not in vacated
        ]
        patch = {"metadata": {"resourceVersion": record.resource_version}, "preparedClaims": kept}
        try:
            raw = await self.client.merge_patch(
                COMPUTE_DOMAIN_CLIQUES, record.name, patch, namespace=record.namespace, drop_managed_fields=True
            )
        except NotFound:
            return Gone()
        if gone:
            log.info("dropped claims of deleted nodes from %s nodes=%s", record, ",".join(sorted(gone)))
        if unfounded:
            log.warning(
                "dropped claims that were never allocated there from %s (its domain is deleted; a node agent, or "
                "its stolen token, listed them) claims=%s",
                record,
                ",".join(f"{u}@{n}" for u, n in sorted(unfounded)),
            )
        if vacated:
            log.warning(
                "dropped claims that are gone, of nodes not in the record's clique, from %s claims=%s",
                record,
                ",".join(f"{u}@{n}" for u, n in sorted(vacated)),
            )
        return channels.record_of(ComputeDomainClique.model_validate(raw))

    async def _vacated(self, record: Record) -> set[tuple[str, str]] | None:
        """The record's verified entries that hold nothing any more: of a node not labelled with its clique,
        for a claim a live list taken after the entry was first seen no longer has (a claim exists from before
        its entry is written until it is deleted, and a UID never comes back). None: no such list yet.

        A stolen node agent token can list a real claim of its node in a record of every clique it moves its
        Node's label through, and each such entry gets verified; without this they held a channel in every
        clique for good. A real entry is kept while its claim exists, or while its node is in the clique
        (a pod force-deleted from an unreachable node may still run there), so a token moving a victim node's
        label frees no channel the victim's container uses while its claim exists."""
        away = await self._away(record)
        if not away:
            return set()
        now = time.monotonic()
        # Taken after every entry was first seen, and not long ago: a list that still showed the claim must not
        # answer for good that it exists.
        since = max(now - AWAY_RECHECK_S, *(now if (seen := self._seen(record, e)) is None else seen for e in away))
        claims = await self._claims_since(since)
        if claims is None:
            return None
        return {(u, n) for u, n in away if u not in claims}

    async def _away(self, record: Record) -> list[tuple[str, str]]:
        """The record's verified entries of nodes not labelled with its clique."""
        return [e for e in record.claims if e in record.verified and await self._node_clique(e[1]) != record.clique_id]

    async def _any_away(self, space: CliqueSpace) -> bool:
        for record in space.records:
            if await self._away(record):
                return True
        return False

    async def _node_exists(self, name: str) -> bool:
        return await self._node_clique(name) is not None

    async def _node_clique(self, name: str, *, max_age: float = NODE_MEMO_S) -> str | None:
        """The Node's ``nvidia.com/gpu.clique`` label ("" without one), None when the Node does not exist. Live
        (a cache could lag), remembered for ``max_age`` seconds: holders on lost nodes are rechecked
        periodically, and however many records list a node, it is read at most once per ``max_age``."""
        known = self._nodes.get(name)
        now = time.monotonic()
        if known is not None and now - known[1] < max_age:
            return known[0]
        try:
            raw = await self.client.get(NODES, name)
            clique: str | None = str(((raw.get("metadata") or {}).get("labels") or {}).get(GPU_CLIQUE_NODE_LABEL) or "")
        except NotFound:
            clique = None
        self._nodes[name] = (clique, now)
        return clique

    async def _unbound(self, space: CliqueSpace) -> frozenset[str]:
        """The records that would get a channel but list no claim of a node in the clique (by the label its
        node agent keeps): a node agent asks for channels only in its own clique. A node not seen in the clique
        is read again after ``UNBOUND_RECHECK_S``, so a label that arrived after the record counts soon."""
        unbound = set()
        for record in space.records:
            if record.channel is not None or record.terminating or record.domain_uid not in space.live_domains:
                continue
            if not await self._lists_a_member(record, space.clique_id):
                unbound.add(record.name)
        return frozenset(unbound)

    def _tell_unbound(self, space: CliqueSpace) -> None:
        """Name each unbound record at INFO once (then at DEBUG, each pass): a token may make many."""
        told = self._told_unbound.pop(space.clique_id, set())
        now = set()
        for record in sorted(space.records, key=lambda r: r.name):
            if record.name not in space.unbound:
                continue
            now.add(record.uid)
            level = logging.DEBUG if record.uid in told else logging.INFO
            log.log(
                level,
                "no IMEX channel for %s: it lists no claim of a node labelled %s=%s (a node agent asks only in its "
                "own clique); checked again shortly",
                record,
                GPU_CLIQUE_NODE_LABEL,
                space.clique_id,
            )
        if now:
            self._told_unbound[space.clique_id] = now

    async def _lists_a_member(self, record: Record, clique_id: str) -> bool:
        for max_age in (NODE_MEMO_S, UNBOUND_RECHECK_S):
            for node in sorted(record.nodes):
                if await self._node_clique(node, max_age=max_age) == clique_id:
                    return True
        return False
