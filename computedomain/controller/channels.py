"""The IMEX channel of each ComputeDomain in each clique: the pure half (hostManaged, ``IMEX_ISOLATION=channel``).

With channel isolation every domain gets, in every clique (IMEX domain) its pods run in, an IMEX channel that
no other domain holds there. The protocol and why it is safe: docs/design/0012-channel-isolation.md. The
objects, all in the driver namespace:

* the **record** of domain D in clique C: ``ComputeDomainClique <D>.<C>``. A node agent creates it (with our
  finalizer and its claim in ``preparedClaims``) the first time it prepares a claim of D in C: that is the
  request. The controller writes ``channel`` into it, once (the CRD refuses any change); node agents add and
  remove their own claims in ``preparedClaims``. While the record exists, its channel is D's in C;
* the **lock** of channel k in C: a Lease ``cd-imex-channel-<k>.<C>`` whose holder is D and whose owner is
  the record. Creating it is the claim on k: the apiserver lets exactly one create of a name succeed, so two
  records can never hold the same k, whatever caches lag and however many controllers run (a failover in the
  middle of an assignment included). The garbage collector deletes it once its record is gone.

``plan(space, count)`` looks at one clique's records and locks (``CliqueSpace``) and returns the next batch of
writes (``Plan``), like ``reconcile.desired``: the executor (``assigner``) applies a batch, folds the answers
back in (``fold``) and asks again until nothing is left. Per clique, in order of need:

* a record with a channel keeps it; a lock of that record for another channel (a lost race) is deleted;
* a record without a channel whose domain lives, named after that domain and the clique, that lists a claim
  of a node of the clique (``CliqueSpace.unbound``: the executor reads the nodes' ``nvidia.com/gpu.clique``
  label live): if a lock of its own exists (a previous run, or a previous
  leader, created it and stopped before recording it), that channel is recorded; otherwise the lowest free
  channel (1 up to ``count - 1``; 0 is the shared channel and never assigned) is locked, then recorded.
  With none free, the record waits (``Plan.waiting``); the domain's reconcile reports it (``exhausted``);
* an entry of ``preparedClaims`` whose claim the claim cache shows allocated on that node for the record's
  domain is marked ``verified`` (``VerifyClaims``), in any record; a node agent may not set the mark;
* a live domain's record whose channel no claim of the domain has used for a while (``CliqueSpace.idle``:
  the executor times it, and a live list of the claims shows none of its unverified entries allocated there)
  is deleted (``RetireRecord``, with its resourceVersion as precondition, so an entry added meanwhile makes
  it a ``Conflict``): otherwise a tenant's idle domains, or records a stolen node agent token made in every
  clique by moving its Node's label, would keep their channels for good. The domain's next claim in that
  clique asks for a channel anew. So is a channel-less record that stayed unbound as long listing no claim
  allocated there (records a token made in cliques its node passed through hold no channel, but would stay
  while their domain lives);
* a record that is being deleted keeps our finalizer while ``preparedClaims`` lists a claim; when none is left
  the finalizer goes, the record with it, and then its lock: only then is the channel free again. First
  dropped (``CheckHolders``, each confirmed live by the executor): entries of nodes that no longer exist, and
  unverified entries whose claim a live list does not show allocated on that node for the domain (what a
  stolen node agent token lists to keep a deleted domain's channel taken). A verified entry stays until its
  node's agent takes it off or its node is gone, even when its claim is gone (a pod force-deleted from an
  unreachable node may still run there), unless its node is not labelled with the record's clique either
  (the executor's ``_vacated``).

Nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeAlias

from computedomain.api.constants import (
    CLIQUE_LABEL,
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    SHARED_IMEX_CHANNEL,
)
from computedomain.api.models import ComputeDomainClique

LOCK_PREFIX: Final = "cd-imex-channel-"
_LOCK_NAME = re.compile(rf"{LOCK_PREFIX}([1-9][0-9]{{0,6}})\.(.+)", re.ASCII)

Raw = Mapping[str, Any]


def lock_name(clique_id: str, channel: int) -> str:
    return f"{LOCK_PREFIX}{channel}.{clique_id}"


# --- views ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """A ``ComputeDomainClique`` as the channel assignment sees it."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    domain_uid: str
    clique_id: str
    channel: int | None = None
    claims: tuple[tuple[str, str], ...] = ()  # (claim UID, node name)
    verified: frozenset[tuple[str, str]] = frozenset()  # the entries of ``claims`` the controller verified
    finalizers: tuple[str, ...] = ()
    terminating: bool = False
    created: str = ""  # creationTimestamp, for first-come-first-served order
    # Set within one pass once the nodes of ``claims`` were confirmed to exist (not from the API).
    holders_checked: bool = False

    @property
    def holds_finalizer(self) -> bool:
        return COMPUTE_DOMAIN_FINALIZER in self.finalizers

    @property
    def named_right(self) -> bool:
        """Whether the name is ``<domain UID>.<clique ID>`` of the domain it is labelled with: a record under
        another domain's name (made with a stolen node agent's token) must not take or block that name."""
        return self.name == f"{self.domain_uid}.{self.clique_id}"

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(node for _, node in self.claims)

    @property
    def unverified(self) -> tuple[tuple[str, str], ...]:
        return tuple(entry for entry in self.claims if entry not in self.verified)

    def __str__(self) -> str:
        return f"ComputeDomainClique {self.namespace}/{self.name}"


def record_of(clique: ComputeDomainClique) -> Record:
    meta = clique.metadata
    return Record(
        name=meta.name,
        namespace=meta.namespace,
        uid=meta.uid,
        resource_version=meta.resource_version,
        domain_uid=clique.domain_uid,
        clique_id=clique.clique_id,
        channel=clique.channel,
        claims=tuple((c.claim_uid, c.node_name) for c in clique.prepared_claims or ()),
        verified=frozenset((c.claim_uid, c.node_name) for c in clique.prepared_claims or () if c.verified),
        finalizers=meta.finalizers,
        terminating=meta.deletion_timestamp is not None,
        created=meta.creation_timestamp.isoformat() if meta.creation_timestamp else "",
    )


@dataclass(frozen=True, slots=True)
class Lock:
    """A Lease that reserves ``channel`` in ``clique_id`` for the record ``owner_uid`` of ``domain_uid``."""

    name: str
    namespace: str
    uid: str
    clique_id: str
    channel: int
    domain_uid: str
    owner_uid: str
    terminating: bool = False

    def __str__(self) -> str:
        return f"Lease {self.namespace}/{self.name}"


def decode_lock(raw: Raw) -> Lock | None:
    """A lock Lease, or None for a Lease that is not one (it is then ignored, never written)."""
    meta = raw.get("metadata") or {}
    match = _LOCK_NAME.fullmatch(str(meta.get("name") or ""))
    labels = meta.get("labels") or {}
    if match is None or labels.get(CLIQUE_LABEL) != match.group(2):
        return None
    owners = [o for o in meta.get("ownerReferences") or () if isinstance(o, Mapping)]
    return Lock(
        name=str(meta["name"]),
        namespace=str(meta.get("namespace") or ""),
        uid=str(meta.get("uid") or ""),
        clique_id=match.group(2),
        channel=int(match.group(1)),
        domain_uid=str((raw.get("spec") or {}).get("holderIdentity") or ""),
        owner_uid=str(owners[0].get("uid") or "") if owners else "",
        terminating=bool(meta.get("deletionTimestamp")),
    )


def lock_body(record: Record, channel: int, group_version: str) -> dict[str, Any]:
    """The Lease that reserves ``channel`` of the record's clique for its domain."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lock_name(record.clique_id, channel),
            "namespace": record.namespace,
            "labels": {COMPUTE_DOMAIN_LABEL: record.domain_uid, CLIQUE_LABEL: record.clique_id},
            # The garbage collector deletes the lock once the record is gone (checked live, by UID).
            "ownerReferences": [
                {"apiVersion": group_version, "kind": "ComputeDomainClique", "name": record.name, "uid": record.uid}
            ],
        },
        "spec": {"holderIdentity": record.domain_uid},
    }


# --- one clique's state ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CliqueSpace:
    """Everything the assignment looks at for one clique."""

    clique_id: str
    records: tuple[Record, ...] = ()
    locks: tuple[Lock, ...] = ()
    # Domains that exist and are not being deleted (from the CD cache): only they get a channel.
    live_domains: frozenset[str] = frozenset()
    # Records that list no claim of a node of this clique (the executor checks the Nodes live): no channel.
    unbound: frozenset[str] = frozenset()
    # (record name, claim UID, node) of unverified entries whose claim is allocated there for its domain.
    verifiable: frozenset[tuple[str, str, str]] = frozenset()
    # Records of live domains whose channel no claim has held for the idle time (the executor decides, verified
    # entries included), or that stayed unbound without a channel as long: retired.
    idle: frozenset[str] = frozenset()

    def with_record(self, record: Record) -> CliqueSpace:
        rest = tuple(r for r in self.records if r.name != record.name)
        return replace(self, records=(*rest, record))

    def without_record(self, name: str) -> CliqueSpace:
        return replace(self, records=tuple(r for r in self.records if r.name != name))

    def with_lock(self, lock: Lock) -> CliqueSpace:
        rest = tuple(lk for lk in self.locks if lk.name != lock.name)
        return replace(self, locks=(*rest, lock))

    def without_lock(self, name: str) -> CliqueSpace:
        return replace(self, locks=tuple(lk for lk in self.locks if lk.name != name))

    def taken(self) -> set[int]:
        """Channels nobody else may get: the shared one, every locked one, every recorded one."""
        return {
            SHARED_IMEX_CHANNEL,
            *(lk.channel for lk in self.locks),
            *(r.channel for r in self.records if r.channel),
        }


def free_channels(space: CliqueSpace, count: int) -> Iterator[int]:
    """The channels of ``1 .. count - 1`` nobody holds, lowest first."""
    taken = space.taken()
    return (k for k in range(1, count) if k not in taken)


def exhausted(space: CliqueSpace, count: int) -> bool:
    return next(free_channels(space, count), None) is None


@dataclass(frozen=True)
class Lingering:
    """Channels still held by records of domains that are gone or being deleted: the claims prepared with
    them are still listed, by ``nodes``, and each channel is free once those nodes' agents unprepare them."""

    channels: int = 0
    nodes: frozenset[str] = frozenset()

    def __add__(self, other: Lingering) -> Lingering:
        return Lingering(self.channels + other.channels, self.nodes | other.nodes)


def lingering(space: CliqueSpace) -> Lingering:
    held = [
        r for r in space.records if r.channel is not None and (r.terminating or r.domain_uid not in space.live_domains)
    ]
    return Lingering(len(held), frozenset(node for r in held for node in r.nodes))


def recorded_channels(records: Iterable[Record]) -> dict[str, int]:
    """Clique ID -> channel, for one domain's records that have one (and are not being deleted)."""
    return {r.clique_id: r.channel for r in records if r.channel is not None and not r.terminating}


# --- actions --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateLock:
    record: Record
    channel: int


@dataclass(frozen=True)
class RecordChannel:
    record: Record
    channel: int


@dataclass(frozen=True)
class DeleteLock:
    lock: Lock
    why: str


@dataclass(frozen=True)
class ReleaseRecord:
    """Drop our finalizer from a record being deleted: no claim holds its channel any more."""

    record: Record


@dataclass(frozen=True)
class RetireRecord:
    """Delete a live domain's record whose channel went unused for the idle time (its uid and resourceVersion as
    preconditions); it then goes as any record being deleted does."""

    record: Record


@dataclass(frozen=True)
class CheckHolders:
    """A record being deleted still lists claims: drop those of nodes that no longer exist and the unverified
    ones whose claim is not allocated there (both checked live)."""

    record: Record


@dataclass(frozen=True)
class VerifyClaims:
    """Mark these entries of the record ``verified``: their claims are allocated there for its domain."""

    record: Record
    entries: tuple[tuple[str, str], ...]


Action: TypeAlias = CreateLock | RecordChannel | DeleteLock | ReleaseRecord | CheckHolders | VerifyClaims | RetireRecord


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Records that need a channel while none is free.
    waiting: tuple[Record, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.actions)


def plan(space: CliqueSpace, count: int) -> Plan:
    """The next batch of independent writes for one clique (see the module docstring)."""
    locks_of: dict[str, list[Lock]] = {}
    for lock in space.locks:
        locks_of.setdefault(lock.owner_uid, []).append(lock)
    actions: list[Action] = []
    pending: list[Record] = []
    for record in sorted(space.records, key=lambda r: (r.created, r.name)):
        verify = tuple(e for e in record.unverified if (record.name, *e) in space.verifiable)
        if verify:
            actions.append(VerifyClaims(record, verify))
            # Verified or not, the rest of the record waits for the answer (one write per record a batch).
            continue
        own = sorted((lk for lk in locks_of.get(record.uid, ()) if not lk.terminating), key=lambda lk: lk.channel)
        if record.channel is not None:
            actions += [
                DeleteLock(lk, f"{record} holds channel {record.channel}") for lk in own if lk.channel != record.channel
            ]
        if record.name in space.idle and not record.terminating:
            actions.append(RetireRecord(record))
            continue
        if record.channel is not None:
            if not record.terminating and not any(lk.channel == record.channel for lk in space.locks):
                # Its lock was deleted (by hand): take it again, so no other record can get the channel.
                actions.append(CreateLock(record, record.channel))
        elif (
            not record.terminating
            and record.domain_uid in space.live_domains
            and record.named_right
            and record.name not in space.unbound
        ):
            if own:
                # Locked earlier, not recorded yet (a run or a leader stopped in between): record that one.
                actions.append(RecordChannel(record, own[0].channel))
            else:
                pending.append(record)
        if record.terminating and record.holds_finalizer:
            if not record.claims:
                actions.append(ReleaseRecord(record))
            elif not record.holders_checked:
                actions.append(CheckHolders(record))
    free = free_channels(space, count)
    waiting: list[Record] = []
    for record in pending:
        channel = next(free, None)
        if channel is None:
            waiting.append(record)
        else:
            actions.append(CreateLock(record, channel))
    return Plan(tuple(actions), tuple(waiting))


# --- folding results back -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gone:
    """The target no longer exists."""


@dataclass(frozen=True)
class Taken:
    """Creating the lock failed: the channel is held by another lock (which the cache had not shown)."""

    lock: Lock


@dataclass(frozen=True)
class Unchanged:
    """Nothing was written (e.g. every listed node still exists)."""


Result: TypeAlias = Record | Lock | Gone | Taken | Unchanged


def fold(space: CliqueSpace, action: Action, result: Result) -> CliqueSpace:
    """The clique's state after ``action`` produced ``result``."""
    if isinstance(action, RetireRecord):  # asked once a pass, whatever the answer (a Conflict: it changed)
        space = replace(space, idle=space.idle - {action.record.name})
    if isinstance(result, Unchanged):
        if isinstance(action, CheckHolders):
            # Nothing to prune: the record waits for its claims; not asked again in this pass.
            return space.with_record(replace(action.record, holders_checked=True))
        return space
    if isinstance(action, CreateLock):
        if isinstance(result, Taken | Lock):
            return space.with_lock(result.lock if isinstance(result, Taken) else result)
        return space
    if isinstance(action, DeleteLock):
        return space.without_lock(action.lock.name) if isinstance(result, Gone) else space.with_lock(_lock(result))
    if isinstance(action, RecordChannel | ReleaseRecord | CheckHolders | VerifyClaims | RetireRecord):
        if isinstance(result, Gone):
            return space.without_record(action.record.name)
        checked = isinstance(action, CheckHolders)
        return space.with_record(replace(_rec(result), holders_checked=checked))
    raise TypeError(f"unknown action {action!r}")  # pragma: no cover


def _lock(result: Result) -> Lock:
    assert isinstance(result, Lock)
    return result


def _rec(result: Result) -> Record:
    assert isinstance(result, Record)
    return result
