"""The daemon's own entry in the domain: which DNS slot (index) it holds, at which IP, and its readiness.

What it owns:

* the index rules, as pure functions (``allocate_index``, ``desired_entry``) that the unit tests table-test:
  keep the index this node already holds; otherwise take a free index below ``MAX_NODES_PER_IMEX_DOMAIN``,
  the first in this node's own order of preference (``slot_preference``: a hash of node name and slot, so
  daemons starting together want different slots instead of all wanting slot 0; the legacy backend, whose
  writes conflict whatever slot they take, keeps the smallest free index); never take an index
  another entry of the clique holds; a full clique is an ``IndexExhausted`` error that names the holders.
  Two entries that claim one index (only possible through a writer that does not follow these rules) are
  resolved deterministically: the smaller node name keeps it, the other moves;
* the slot locks: holding index N means holding the annotation ``resource.nvidia.com/index-N`` (value: the
  node name) of the ComputeDomainClique, written in the same server-side apply as the entry, under this
  node's own field manager. The apiserver refuses (409) an apply that sets a lock another manager holds
  with another value, so two daemons cannot both get an index, and writes that touch different slots and
  different entries never conflict: nobody rewrites anybody else's entry, and no write carries a
  resourceVersion. A lock whose node has no entry any more (its daemon was killed and the controller pruned
  the entry) is taken over with a forced apply guarded by the resourceVersion of the object that showed it
  stale, as is any write after a conflict on fields other than a lock (entries written by a writer before
  these locks: an older daemon, the reference driver);
* ``Registry``: the executor. ``register`` (and ``set_status``) apply our entry: labels, our pod as an owner
  reference (a list-map keyed by UID: nobody else's is touched, so the clique object lives while any daemon
  pod of the clique lives), the lock, the entry; the object is created by the first apply.
  ``unregister`` removes our entry and our lock with a JSON patch that tests, at the entry's position, our
  node name and our pod IP, so a terminating old pod cannot delete the entry a replacement pod on the same
  node wrote. Two backends: ``CliqueBackend`` (ComputeDomainCliques=true): ``ComputeDomainClique
  <cdUID>.<cliqueID>`` in the pod namespace, with the locks; ``StatusBackend`` (legacy):
  ``ComputeDomain.status.nodes`` through the status subresource, which cannot hold a lock, so every write
  there is guarded by the resourceVersion read (optimistic concurrency).

Our entry is found by node name (the list-map key). Design note: docs/design/0005-imex-daemon.md.

Concurrency: one ``Registry`` per daemon, called from the run loop, the peer loop and the readiness loop of
one event loop; an ``asyncio.Lock`` serialises its writes, so the daemon never races itself (only other
daemons, which the locks and resourceVersions handle). Retries after a conflict are a tenacity loop of at most
``max_attempts`` (``Registry._retrying``); when they run out the caller's loop retries later.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.api.types import INDEX_LOCK_PREFIX, ReadyStatus, clique_name, index_lock, index_locks
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, KubeClient, Raw, Resource
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.errors import Conflict, Invalid, NotFound
from computedomain.retry import Backoff, retrying

__all__ = [
    "LOCK_PREFIX",
    "Claim",
    "CliqueBackend",
    "DaemonEntry",
    "Identity",
    "IndexExhausted",
    "RegistrationError",
    "Registry",
    "StatusBackend",
    "allocate_index",
    "desired_entry",
    "field_manager",
    "lock_key",
    "locks_of",
    "plan_claim",
    "slot_preference",
]

log = logging.getLogger(__name__)

#: ``<LOCK_PREFIX><index>`` is the annotation that says which node holds a slot of the clique.
LOCK_PREFIX: Final = INDEX_LOCK_PREFIX
#: the apiserver's limit on a field manager's name
_MAX_MANAGER: Final = 128


class RegistrationError(Exception):
    """Our entry could not be written; the message says why and what to do."""


class _Again(Exception):  # noqa: N818 (not an error: the retry loop's signal)
    """A write refused by a conflict: plan again on the newer object, after a pause when ``pause``."""

    def __init__(self, cause: Exception, *, pause: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.pause = pause


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


def slot_preference(node_name: str, max_nodes: int) -> list[int]:
    """This node's order of preference over the slots: the same on every call, different between nodes."""

    def weight(slot: int) -> bytes:
        return hashlib.sha256(f"{node_name}\0{slot}".encode()).digest()

    return sorted(range(max_nodes), key=weight)


def lock_key(index: int) -> str:
    return index_lock(index)


def locks_of(obj: Raw | None) -> dict[int, str]:
    """index -> node name of every slot lock on ``obj``."""
    return index_locks(((obj or {}).get("metadata") or {}).get("annotations"))


def allocate_index(
    entries: Sequence[DaemonEntry],
    me: Identity,
    max_nodes: int,
    locks: Mapping[int, str] | None = None,
    *,
    spread: bool = True,
) -> int:
    """The index our entry must carry, given every entry of the object (ours included, if present) and the
    slot locks: ours if we hold one, else the first free slot in our order of preference (``spread``; else
    the smallest), slots that no live lock names before slots whose lock outlived its entry."""
    locks = locks or {}
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
    order = slot_preference(me.node_name, max_nodes) if spread else range(max_nodes)
    free = [i for i in order if i not in taken]
    if free:
        # A lock of ours on a free slot: we held it before (our entry was pruned or we moved); take it back.
        mine = [i for i in free if locks.get(i) == me.node_name]
        unlocked = [i for i in free if i not in locks]
        return (mine or unlocked or free)[0]
    holders_text = ", ".join(f"{e.index}={e.node_name}" for e in sorted(peers, key=lambda e: e.index))
    raise IndexExhausted(
        f"clique {me.clique_id!r}: all {max_nodes} IMEX slots are held ({holders_text}); node {me.node_name} "
        f"cannot join. Raise MAX_NODES_PER_IMEX_DOMAIN or remove the entries of nodes that left"
    )


def desired_entry(
    entries: Sequence[DaemonEntry],
    me: Identity,
    status: ReadyStatus,
    max_nodes: int,
    locks: Mapping[int, str] | None = None,
    *,
    spread: bool = True,
) -> DaemonEntry:
    """Our entry as it must be: our IP and clique, a stable index, and the status we mirror."""
    return DaemonEntry(
        node_name=me.node_name,
        ip_address=me.ip_address,
        clique_id=me.clique_id,
        index=allocate_index(entries, me, max_nodes, locks, spread=spread),
        status=status,
    )


@dataclass(frozen=True, slots=True)
class Claim:
    """What one write asks for: our entry, and whether its lock must be taken from another node (a lock
    that outlived its node's entry), which only a write guarded by the resourceVersion may do."""

    entry: DaemonEntry
    takeover: bool


def plan_claim(
    entries: Sequence[DaemonEntry],
    locks: Mapping[int, str],
    me: Identity,
    status: ReadyStatus,
    max_nodes: int,
    *,
    spread: bool = True,
) -> Claim:
    entry = desired_entry(entries, me, status, max_nodes, locks, spread=spread)
    holder = locks.get(entry.index)
    return Claim(entry, takeover=holder is not None and holder != me.node_name)


def own_entry(entries: Sequence[DaemonEntry], node_name: str) -> DaemonEntry | None:
    return next((e for e in entries if e.node_name == node_name), None)


def field_manager(node_name: str) -> str:
    """This node's field manager: its entry and its lock are its own fields (the name fits the API's limit)."""
    name = f"compute-domain-daemon.{node_name}"
    if len(name) <= _MAX_MANAGER:
        return name
    return f"compute-domain-daemon.{hashlib.sha256(node_name.encode()).hexdigest()[:40]}"


def _json_pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


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

    @property
    def has_locks(self) -> bool:
        """Whether slot locks can live on the object (else every write is guarded by resourceVersion)."""

    @property
    def items_path(self) -> str:
        """The JSON pointer of the entry list."""

    def items(self, obj: Raw) -> list[Raw]:
        """The raw entry list of ``obj`` (a fresh list; entries are the object's own dicts)."""

    def decode(self, item: Raw) -> DaemonEntry: ...

    def encode(self, entry: DaemonEntry) -> Raw: ...

    def key(self, item: Raw) -> str: ...

    def applied(self, entry: DaemonEntry, owner: Raw) -> Raw:
        """The configuration we apply: our entry (and the object's identity: labels, our owner reference)."""

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
    has_locks: bool = True
    items_path: str = "/daemons"

    @property
    def name(self) -> str:
        return clique_name(self.cd_uid, self.clique_id)

    def items(self, obj: Raw) -> list[Raw]:
        return list(obj.get("daemons") or [])

    def decode(self, item: Raw) -> DaemonEntry:
        return _entry_from(item, "nodeName")

    def encode(self, entry: DaemonEntry) -> Raw:
        return _entry_to(entry, "nodeName")

    def key(self, item: Raw) -> str:
        return str(item.get("nodeName") or "")

    def applied(self, entry: DaemonEntry, owner: Raw) -> Raw:
        return {
            "apiVersion": GROUP_VERSION,
            "kind": "ComputeDomainClique",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {COMPUTE_DOMAIN_LABEL: self.cd_uid, CLIQUE_LABEL: self.clique_id},
                "annotations": {lock_key(entry.index): entry.node_name},
                "ownerReferences": [owner],
            },
            "daemons": [self.encode(entry)],
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
    has_locks: bool = False
    items_path: str = "/status/nodes"

    def items(self, obj: Raw) -> list[Raw]:
        return list((obj.get("status") or {}).get("nodes") or [])

    def decode(self, item: Raw) -> DaemonEntry:
        return _entry_from(item, "name")

    def encode(self, entry: DaemonEntry) -> Raw:
        return _entry_to(entry, "name")

    def key(self, item: Raw) -> str:
        return str(item.get("name") or "")

    def applied(self, entry: DaemonEntry, owner: Raw) -> Raw:
        # Only our entry: status.status and the conditions are the controller's fields.
        return {
            "apiVersion": GROUP_VERSION,
            "kind": "ComputeDomain",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "status": {"nodes": [self.encode(entry)]},
        }

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


class Registry:
    """Applies and removes our own entry (see the module docstring)."""

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
        self._pause = Backoff(0.01, 0.5, spread=0.5, rng=rng)
        self._max_attempts = max_attempts
        self._lock = asyncio.Lock()
        self.field_manager = field_manager(me.node_name)
        # The status we mirror from our pod; written with every (re-)registration.
        self.status = ReadyStatus.NOT_READY
        self.last_written: DaemonEntry | None = None
        # The newest object we know (an apply's answer, a read, a watch event): where a claim is planned.
        self._view: Raw | None = None
        #: writes refused because another daemon took the slot first (the rest of the refusals are stale
        #: resourceVersions of guarded writes)
        self.lock_conflicts = 0

    def entries(self, obj: Raw | None) -> list[DaemonEntry]:
        return [] if obj is None else [self.backend.decode(i) for i in self.backend.items(obj)]

    def observe(self, obj: Raw | None) -> None:
        """A newer object from a watch: the next claim is planned on it."""
        if obj is not None:
            self._view = obj

    def needs_write(self, obj: Raw | None) -> bool:
        """Whether ``obj`` (e.g. a watch event) lacks our entry as we want it; cheap, no I/O."""
        if obj is None:
            return True
        try:
            self.backend.check(obj)
            entries = self.entries(obj)
            locks = locks_of(obj)
            want = desired_entry(entries, self.me, self.status, self.max_nodes, locks, spread=self.backend.has_locks)
        except RegistrationError:
            return True
        if own_entry(entries, self.me.node_name) != want:
            return True
        if self.backend.has_locks and locks.get(want.index) != self.me.node_name:
            return True
        if self.backend.wants_owner():
            refs = (obj.get("metadata") or {}).get("ownerReferences") or []
            return not any(ref.get("uid") == self._owner.get("uid") for ref in refs if isinstance(ref, Mapping))
        return False

    async def register(self) -> DaemonEntry:
        """Make our entry exist as desired (index kept or allocated, our IP, mirrored status)."""
        async with self._lock:
            return await self._apply_entry()

    async def set_status(self, status: ReadyStatus) -> DaemonEntry:
        """Mirror our pod's readiness into our entry (re-registering if the entry went missing)."""
        self.status = status
        return await self.register()

    async def unregister(self) -> bool:
        """Remove our entry (and our lock) if it still carries our IP. True when something was removed."""
        b = self.backend

        async def once() -> bool:
            try:
                obj = await self._client.get(b.resource, b.name, namespace=b.namespace)
            except NotFound:
                return False
            b.check(obj)
            ops = self._removal(obj)
            if ops is None:
                return False
            try:
                await self._client.json_patch(b.resource, b.name, ops, namespace=b.namespace, subresource=b.subresource)
            except (Invalid, Conflict) as exc:
                # A test failed: the list moved under us (another entry removed before ours). Again.
                raise _Again(exc, pause=True) from exc
            except NotFound:
                return False
            self.last_written = None
            self._view = None
            log.info("unregistered node=%s object=%s", self.me.node_name, b.name)
            return True

        async with self._lock:
            try:
                return await self._retrying()(once)
            except _Again as exc:
                raise RegistrationError(f"could not remove our entry from {b.name}: the list kept changing") from exc

    # ---- internals ------------------------------------------------------------------------------------

    def _removal(self, obj: Raw) -> list[Raw] | None:
        """JSON patch ops that remove our entry (at its position, tested) and our lock; None: nothing of ours."""
        b = self.backend
        items = b.items(obj)
        for position, item in enumerate(items):
            entry = b.decode(item)
            if b.key(item) != self.me.node_name or entry.ip_address != self.me.ip_address:
                continue
            path = f"{b.items_path}/{position}"
            ops: list[Raw] = [
                {"op": "test", "path": f"{path}/{'nodeName' if b.has_locks else 'name'}", "value": self.me.node_name},
                {"op": "test", "path": f"{path}/ipAddress", "value": self.me.ip_address},
                {"op": "remove", "path": path},
            ]
            if b.has_locks and locks_of(obj).get(entry.index) == self.me.node_name:
                lock = f"/metadata/annotations/{_json_pointer(lock_key(entry.index))}"
                ops += [{"op": "test", "path": lock, "value": self.me.node_name}, {"op": "remove", "path": lock}]
            return ops
        return None

    def _shows_our_slot(self, view: Raw) -> bool:
        if self.last_written is None:
            return True
        own = own_entry(self.entries(view), self.me.node_name)
        return own is not None and own.index == self.last_written.index

    async def _read(self) -> Raw | None:
        b = self.backend
        try:
            return await self._client.get(b.resource, b.name, namespace=b.namespace)
        except NotFound:
            return None

    def _retrying(self) -> AsyncRetrying:
        """Writes refused by a conflict, again at most ``max_attempts`` times: at once after losing a slot to
        another daemon (plan again on the newer object), else after a jittered pause that grows from 10 ms to
        0.5 s (a guarded write conflicts with any other write to the object)."""

        def wait(retry_state: RetryCallState) -> float:
            exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
            pause = isinstance(exc, _Again) and exc.pause
            return self._pause.delay(retry_state.attempt_number) if pause else 0.0

        return retrying(
            self._clock,
            wait=wait,
            stop=stop_after_attempt(self._max_attempts),
            retry=retry_if_exception_type(_Again),
        )

    async def _apply_entry(self) -> DaemonEntry:
        b = self.backend
        view = self._view
        if view is None or not self._shows_our_slot(view):
            # Never plan a write on a view older than our last one: an old view without our entry would
            # make us "allocate" again and move away from the index we hold.
            view = await self._read()
        force = False

        async def once() -> DaemonEntry:
            nonlocal view, force
            if view is not None:
                b.check(view)
            elif not b.has_locks:
                raise RegistrationError(f"{b.resource.kind} {b.namespace}/{b.name} does not exist")
            locks = locks_of(view) if b.has_locks else {}
            claim = plan_claim(self.entries(view), locks, self.me, self.status, self.max_nodes, spread=b.has_locks)
            guarded = force or claim.takeover or not b.has_locks
            body = b.applied(claim.entry, self._owner)
            if guarded and view is not None:
                body["metadata"]["resourceVersion"] = (view.get("metadata") or {}).get("resourceVersion")
            try:
                written = await self._client.apply(
                    b.resource,
                    body,
                    namespace=b.namespace,
                    subresource=b.subresource,
                    field_manager=self.field_manager,
                    force=guarded,
                )
            except Conflict as exc:
                view = await self._read()
                holder = locks_of(view).get(claim.entry.index)
                if not guarded and holder not in (None, self.me.node_name):
                    # Another daemon got this slot first: plan again on the newer object, at once.
                    self.lock_conflicts += 1
                    raise _Again(exc, pause=False) from exc
                # A stale resourceVersion, or fields another writer owns: a guarded, forced write next.
                force = True
                raise _Again(exc, pause=guarded) from exc
            except NotFound as exc:
                # Legacy backend: the ComputeDomain is gone.
                raise RegistrationError(f"{b.resource.kind} {b.namespace}/{b.name} does not exist") from exc
            self._view = written
            self._note(claim.entry, created=view is None)
            return claim.entry

        try:
            return await self._retrying()(once)
        except _Again as exc:
            raise RegistrationError(
                f"could not write our entry to {b.resource.kind} {b.name} after {self._max_attempts} attempts: "
                f"{exc.cause}"
            ) from exc.cause

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
