"""The daemon's own entry in the domain: which DNS slot (index) it holds, at which IP, and its readiness.

What it owns:

* the index rules, as pure functions (``allocate_index``, ``desired_entry``) that the unit tests table-test:
  keep the index this node already holds; otherwise take the smallest index below ``MAX_NODES_PER_IMEX_DOMAIN``
  that no other entry of the clique holds; never take a held index; a full clique is an ``IndexExhausted``
  error that names the holders. Two entries that claim one index (only possible through a writer that does
  not follow these rules) are resolved deterministically: the smaller node name keeps it, the other moves;
* ``ownerReferences`` merging (``merge_owner_reference``): our pod is added, nobody else's reference is
  touched, so the clique object lives while any daemon pod of the clique lives;
* ``Registry``: the executor. It reads the object, computes our entry, and writes it back with the
  resourceVersion it read (optimistic concurrency: a ``Conflict`` re-reads and recomputes, so two daemons
  racing for one index cannot both win). Only our own entry is ever added, changed or removed; other entries
  are carried over as the raw JSON we read, unknown fields included. Two backends:
  ``CliqueBackend`` (ComputeDomainCliques=true): ``ComputeDomainClique <cdUID>.<cliqueID>`` in the pod
  namespace, created with our entry, the CD and clique labels and our pod as owner when missing;
  ``StatusBackend`` (legacy): the ComputeDomain's ``status.nodes`` through the status subresource.

Our entry is found by node name (the list-map key). ``unregister`` removes it only while it still carries
our pod IP, so a terminating old pod cannot delete the entry a replacement pod on the same node wrote.

Concurrency: one ``Registry`` per daemon, called from the run loop, the peer loop and the readiness loop of
one event loop; an ``asyncio.Lock`` serialises its read-modify-write cycles, so the daemon never races itself
(only other daemons, which the resourceVersion handles). The conflict retry is bounded and jittered; when it
gives up the caller's loop retries later.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.api.types import ReadyStatus, clique_name
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, KubeClient, Raw, Resource
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.errors import Conflict, NotFound

__all__ = [
    "CliqueBackend",
    "DaemonEntry",
    "Identity",
    "IndexExhausted",
    "RegistrationError",
    "Registry",
    "StatusBackend",
    "allocate_index",
    "desired_entry",
    "merge_owner_reference",
]

log = logging.getLogger(__name__)


class RegistrationError(Exception):
    """Our entry could not be written; the message says why and what to do."""


class IndexExhausted(RegistrationError):  # noqa: N818 (reads better at the raise site)
    """Every index of the clique is held by another node."""


@dataclass(frozen=True, slots=True)
class DaemonEntry:
    """One daemon's registration, independent of the backend's wire names."""

    node_name: str
    ip_address: str
    clique_id: str
    index: int
    status: ReadyStatus = ReadyStatus.NOT_READY


@dataclass(frozen=True, slots=True)
class Identity:
    """Who we are: the entry key (node name) and what we write into it."""

    node_name: str
    ip_address: str
    clique_id: str


# --------------------------------------------------------------------------------------------------------
# Pure rules


def allocate_index(entries: Sequence[DaemonEntry], me: Identity, max_nodes: int) -> int:
    """The index our entry must carry, given every entry of the object (ours included, if present)."""
    peers = [e for e in entries if e.clique_id == me.clique_id and e.node_name != me.node_name]
    taken = {e.index for e in peers}
    own = next((e for e in entries if e.node_name == me.node_name), None)
    if own is not None and own.clique_id == me.clique_id and 0 <= own.index < max_nodes:
        if own.index not in taken:
            return own.index
        # Someone else claims our index too. Only the smaller node name keeps it, so exactly one moves
        # whichever of the two daemons computes first.
        holders = sorted([me.node_name, *(e.node_name for e in peers if e.index == own.index)])
        if holders[0] == me.node_name:
            return own.index
    for index in range(max_nodes):
        if index not in taken:
            return index
    holders_text = ", ".join(f"{e.index}={e.node_name}" for e in sorted(peers, key=lambda e: e.index))
    raise IndexExhausted(
        f"clique {me.clique_id!r}: all {max_nodes} IMEX slots are held ({holders_text}); node {me.node_name} "
        f"cannot join. Raise MAX_NODES_PER_IMEX_DOMAIN or remove the entries of nodes that left"
    )


def desired_entry(entries: Sequence[DaemonEntry], me: Identity, status: ReadyStatus, max_nodes: int) -> DaemonEntry:
    """Our entry as it must be: our IP and clique, a stable index, and the status we mirror."""
    return DaemonEntry(
        node_name=me.node_name,
        ip_address=me.ip_address,
        clique_id=me.clique_id,
        index=allocate_index(entries, me, max_nodes),
        status=status,
    )


def own_entry(entries: Sequence[DaemonEntry], node_name: str) -> DaemonEntry | None:
    return next((e for e in entries if e.node_name == node_name), None)


def merge_owner_reference(refs: Sequence[Mapping[str, Any]], own: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``refs`` plus ``own`` (matched by UID), or None when ``own`` is already there. Others stay untouched."""
    if any(ref.get("uid") == own.get("uid") for ref in refs):
        return None
    return [dict(ref) for ref in refs] + [dict(own)]


# --------------------------------------------------------------------------------------------------------
# Backends: where the entries live and how they are spelled on the wire


class Backend(Protocol):
    @property
    def resource(self) -> Resource: ...

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def subresource(self) -> str | None: ...

    def items(self, obj: Raw) -> list[Raw]:
        """The raw entry list of ``obj`` (a fresh list; entries are the object's own dicts)."""

    def with_items(self, obj: Raw, items: list[Raw]) -> Raw:
        """A copy of ``obj`` whose entry list is ``items``."""

    def decode(self, item: Raw) -> DaemonEntry: ...

    def encode(self, entry: DaemonEntry) -> Raw: ...

    def key(self, item: Raw) -> str: ...

    def new_object(self, items: list[Raw], owner: Raw) -> Raw | None:
        """A body to create when the object is missing, or None when we must not create it."""

    def check(self, obj: Raw) -> None:
        """Raise RegistrationError when ``obj`` is not ours to write (another CD with the same name)."""

    def wants_owner(self) -> bool: ...


def _entry_from(item: Raw, node_key: str) -> DaemonEntry:
    raw_status = str(item.get("status") or ReadyStatus.NOT_READY)
    try:
        status = ReadyStatus(raw_status)
    except ValueError:
        status = ReadyStatus.NOT_READY
    index = item.get("index")
    return DaemonEntry(
        node_name=str(item.get(node_key) or ""),
        ip_address=str(item.get("ipAddress") or ""),
        clique_id=str(item.get("cliqueID") or ""),
        index=index if isinstance(index, int) else -1,
        status=status,
    )


def _entry_to(entry: DaemonEntry, node_key: str) -> Raw:
    return {
        node_key: entry.node_name,
        "ipAddress": entry.ip_address,
        "cliqueID": entry.clique_id,
        "index": entry.index,
        "status": str(entry.status),
    }


@dataclass
class CliqueBackend:
    """``ComputeDomainClique <cdUID>.<cliqueID>``, top-level ``daemons[]`` keyed by ``nodeName``."""

    namespace: str
    cd_uid: str
    clique_id: str
    resource: Resource = COMPUTE_DOMAIN_CLIQUES
    subresource: str | None = None

    @property
    def name(self) -> str:
        return clique_name(self.cd_uid, self.clique_id)

    def items(self, obj: Raw) -> list[Raw]:
        return list(obj.get("daemons") or [])

    def with_items(self, obj: Raw, items: list[Raw]) -> Raw:
        out = dict(obj)
        out["daemons"] = items
        return out

    def decode(self, item: Raw) -> DaemonEntry:
        return _entry_from(item, "nodeName")

    def encode(self, entry: DaemonEntry) -> Raw:
        return _entry_to(entry, "nodeName")

    def key(self, item: Raw) -> str:
        return str(item.get("nodeName") or "")

    def new_object(self, items: list[Raw], owner: Raw) -> Raw | None:
        return {
            "apiVersion": GROUP_VERSION,
            "kind": "ComputeDomainClique",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {COMPUTE_DOMAIN_LABEL: self.cd_uid, CLIQUE_LABEL: self.clique_id},
                "ownerReferences": [owner],
            },
            "daemons": items,
        }

    def check(self, obj: Raw) -> None:
        label = (obj.get("metadata") or {}).get("labels", {}).get(COMPUTE_DOMAIN_LABEL)
        if label not in (None, self.cd_uid):
            raise RegistrationError(
                f"ComputeDomainClique {self.namespace}/{self.name} carries {COMPUTE_DOMAIN_LABEL}={label}, "
                f"not our ComputeDomain {self.cd_uid}; refusing to write it"
            )

    def wants_owner(self) -> bool:
        return True


@dataclass
class StatusBackend:
    """Legacy: ``ComputeDomain.status.nodes[]`` keyed by ``name``, written through the status subresource."""

    namespace: str
    name: str
    cd_uid: str
    resource: Resource = COMPUTE_DOMAINS
    subresource: str | None = "status"

    def items(self, obj: Raw) -> list[Raw]:
        return list((obj.get("status") or {}).get("nodes") or [])

    def with_items(self, obj: Raw, items: list[Raw]) -> Raw:
        out = dict(obj)
        status = dict(out.get("status") or {})
        status["nodes"] = items
        status.setdefault("status", str(ReadyStatus.NOT_READY))
        out["status"] = status
        return out

    def decode(self, item: Raw) -> DaemonEntry:
        return _entry_from(item, "name")

    def encode(self, entry: DaemonEntry) -> Raw:
        return _entry_to(entry, "name")

    def key(self, item: Raw) -> str:
        return str(item.get("name") or "")

    def new_object(self, items: list[Raw], owner: Raw) -> Raw | None:
        return None  # the user creates ComputeDomains, never a daemon

    def check(self, obj: Raw) -> None:
        uid = (obj.get("metadata") or {}).get("uid")
        if uid != self.cd_uid:
            raise RegistrationError(
                f"ComputeDomain {self.namespace}/{self.name} has UID {uid}, not {self.cd_uid}: the domain this "
                f"daemon belongs to was deleted (and maybe recreated under the same name)"
            )

    def wants_owner(self) -> bool:
        return False


# --------------------------------------------------------------------------------------------------------
# The executor


Mutation = Callable[[list[DaemonEntry]], DaemonEntry]


class Registry:
    """Reads, computes and writes our own entry (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        backend: Backend,
        me: Identity,
        *,
        max_nodes: int,
        owner: Raw,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        max_attempts: int = 60,
    ) -> None:
        self._client = client
        self.backend = backend
        self.me = me
        self.max_nodes = max_nodes
        self._owner = owner
        self._clock: Clock = clock or MonotonicClock()
        self._rng = rng or random.Random()
        self._max_attempts = max_attempts
        self._lock = asyncio.Lock()
        # The status we mirror from our pod; written with every (re-)registration.
        self.status = ReadyStatus.NOT_READY
        self.last_written: DaemonEntry | None = None

    def entries(self, obj: Raw | None) -> list[DaemonEntry]:
        return [] if obj is None else [self.backend.decode(i) for i in self.backend.items(obj)]

    def needs_write(self, obj: Raw | None) -> bool:
        """Whether ``obj`` (e.g. a watch event) lacks our entry as we want it; cheap, no I/O."""
        if obj is None:
            return True
        try:
            self.backend.check(obj)
            entries = self.entries(obj)
            want = desired_entry(entries, self.me, self.status, self.max_nodes)
        except RegistrationError:
            return True
        if own_entry(entries, self.me.node_name) != want:
            return True
        if self.backend.wants_owner():
            refs = (obj.get("metadata") or {}).get("ownerReferences") or []
            return merge_owner_reference(refs, self._owner) is not None
        return False

    async def register(self) -> DaemonEntry:
        """Make our entry exist as desired (index kept or allocated, our IP, mirrored status)."""

        def mutate(entries: list[DaemonEntry]) -> DaemonEntry:
            return desired_entry(entries, self.me, self.status, self.max_nodes)

        return await self._update(mutate, create=True)

    async def set_status(self, status: ReadyStatus) -> DaemonEntry:
        """Mirror our pod's readiness into our entry (re-registering if the entry went missing)."""
        self.status = status
        return await self.register()

    async def unregister(self) -> bool:
        """Remove our entry if it still carries our IP. True when something was removed."""
        async with self._lock:
            for attempt in range(1, self._max_attempts + 1):
                try:
                    obj = await self._client.get(
                        self.backend.resource, self.backend.name, namespace=self.backend.namespace
                    )
                except NotFound:
                    return False
                self.backend.check(obj)
                items = self.backend.items(obj)
                kept = [
                    i
                    for i in items
                    if not (
                        self.backend.key(i) == self.me.node_name
                        and self.backend.decode(i).ip_address == self.me.ip_address
                    )
                ]
                if len(kept) == len(items):
                    return False
                try:
                    await self._write(self.backend.with_items(obj, kept))
                except (Conflict, NotFound):
                    await self._pause(attempt)
                    continue
                self.last_written = None
                log.info("unregistered node=%s object=%s", self.me.node_name, self.backend.name)
                return True
        raise RegistrationError(f"could not remove our entry from {self.backend.name}: too many conflicts")

    # ---- internals ------------------------------------------------------------------------------------

    async def _write(self, obj: Raw) -> Raw:
        return await self._client.replace(
            self.backend.resource, obj, namespace=self.backend.namespace, subresource=self.backend.subresource
        )

    async def _pause(self, attempt: int) -> None:
        # Jittered, growing pause between conflict retries: many daemons start at once and all write the
        # same object; spreading them out lets each attempt succeed instead of colliding again.
        delay = min(0.5, 0.005 * 2 ** min(attempt, 8)) * (0.5 + self._rng.random())
        await self._clock.sleep(delay)

    async def _update(self, mutate: Mutation, *, create: bool) -> DaemonEntry:
        async with self._lock:
            last_error: Exception | None = None
            for attempt in range(1, self._max_attempts + 1):
                try:
                    return await self._update_once(mutate, create=create)
                except (Conflict, NotFound) as exc:
                    # Conflict: someone wrote in between (maybe took "our" free index); AlreadyExists: a peer
                    # created the object first; NotFound: it was deleted under us. Re-read and recompute.
                    last_error = exc
                    await self._pause(attempt)
            raise RegistrationError(
                f"could not write our entry to {self.backend.resource.kind} {self.backend.name} after "
                f"{self._max_attempts} attempts: {last_error}"
            )

    async def _update_once(self, mutate: Mutation, *, create: bool) -> DaemonEntry:
        b = self.backend
        try:
            obj: Raw | None = await self._client.get(b.resource, b.name, namespace=b.namespace)
        except NotFound:
            obj = None
        if obj is None:
            entry = mutate([])
            body = b.new_object([b.encode(entry)], self._owner) if create else None
            if body is None:
                raise RegistrationError(f"{b.resource.kind} {b.namespace}/{b.name} does not exist")
            # AlreadyExists (a peer created it first) is a Conflict: the caller re-reads and merges.
            await self._client.create(b.resource, body, namespace=b.namespace)
            self._note(entry, created=True)
            return entry
        b.check(obj)
        items = b.items(obj)
        entries = [b.decode(i) for i in items]
        entry = mutate(entries)
        current = own_entry(entries, self.me.node_name)
        changed = False
        if entry != current:
            new_item = b.encode(entry)
            replaced = False
            new_items: list[Raw] = []
            for item in items:
                if b.key(item) == self.me.node_name:
                    if not replaced:
                        merged = copy.deepcopy(item)
                        merged.update(new_item)
                        new_items.append(merged)
                        replaced = True
                    # a second entry with our key cannot come from a list-map; drop it if it does
                else:
                    new_items.append(item)
            if not replaced:
                new_items.append(new_item)
            obj = b.with_items(obj, new_items)
            changed = True
        if b.wants_owner():
            meta = dict(obj.get("metadata") or {})
            refs = merge_owner_reference(meta.get("ownerReferences") or [], self._owner)
            if refs is not None:
                meta["ownerReferences"] = refs
                obj = dict(obj)
                obj["metadata"] = meta
                changed = True
        if changed:
            await self._write(obj)
            self._note(entry, created=False)
        else:
            self.last_written = entry
        return entry

    def _note(self, entry: DaemonEntry, *, created: bool) -> None:
        previous = self.last_written
        self.last_written = entry
        if previous is None or previous.index != entry.index or previous.ip_address != entry.ip_address:
            log.info(
                "registered node=%s object=%s index=%d ip=%s status=%s created=%s",
                entry.node_name,
                self.backend.name,
                entry.index,
                entry.ip_address,
                entry.status,
                created,
            )
        elif previous.status != entry.status:
            log.info("entry status node=%s object=%s status=%s", entry.node_name, self.backend.name, entry.status)


def pod_owner_reference(pod_name: str, pod_uid: str) -> Raw:
    """The ownerReference to our daemon pod: the clique object goes away with the last daemon pod."""
    return {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}
