"""List-then-watch caches ("informers") of decoded object projections.

What it owns: for one resource and one scope (namespace, label selector, field selector), an in-memory
store of the caller's projection ``T`` of each object, kept current by a list followed by a watch from the
list's resourceVersion; optional indices by arbitrary keys (e.g. a label value); and event handlers that are
told about adds, updates and deletes *after* the store reflects them, so a handler that enqueues a key and a
reconcile that reads the store agree.

Rules that make the cache trustworthy:

* ``has_synced()`` / ``wait_for_sync()`` resolve only after the first complete (paginated, consistent) list
  has been stored; callers must not act (write status, delete orphans) before that.
* An object leaves the store only on a real ``DELETED`` event or when a re-list no longer contains it. There
  is no TTL and no write overlay that could resurrect or drop objects.
* The watch asks for bookmarks, so the resourceVersion to resume from stays fresh on quiet resources. A
  ``410 Gone`` (version compacted away) triggers a full re-list, diffed against the store: objects missing
  from it are reported deleted, changed ones updated. A broken or silent watch (nothing, not even a bookmark,
  for ``inactivity_timeout`` seconds) is reconnected from the last version, with jittered backoff while it
  keeps failing (a tenacity loop, ``computedomain.retry``). Watches also end by themselves after a random 5-10 minutes, as client-go's do.
* Objects are decoded from raw JSON by the caller's ``decode`` after ``metadata.managedFields`` is dropped;
  the raw dict is not kept.
* A bad object costs only itself. One that breaks a bound of the client's decoder (``decoding``: nested too
  deep, too large) or that ``decode`` refuses is left out of the store (as if deleted, when an earlier
  version was stored), logged once per version (WARNING, at most ``REJECT_LOG_BURST`` lines and then one
  per ``REJECT_LOG_PERIOD`` seconds per process, DEBUG beyond), counted, and handed to the ``on_reject``
  handlers (``event_reporter``: a Warning Event on the object that names the field and the limit). The
  list or watch goes on with the next object.
* A list or watch the apiserver refuses for good (403 Forbidden: an RBAC rule is missing; 401) sets
  ``failure`` to one line naming the verb and resource and the fix, logged once as a WARNING; components
  report it as unready (``problems``). It clears at the next list or watch that works, so fixing the
  ClusterRole heals the component without a restart.

Concurrency: ``run()`` is one task per informer (run it in a ``TaskGroup``); it is the only writer of the
store. Readers (``get``, ``list``, ``by_index``) are synchronous and see a consistent store because the event
loop never interleaves them with an update. Handlers run inline in the informer task: they must be quick and
must not block (enqueue a key and return); an exception in a handler is logged and does not stop the watch.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from computedomain.api.limits import shown
from computedomain.kube.client import KubeClient, Raw, Resource
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.decoding import Rejected
from computedomain.kube.errors import Gone, KubeError, explain
from computedomain.kube.events import EventRecorder, EventType, ObjectRef
from computedomain.kube.ratelimit import TokenBucket
from computedomain.metrics import Counter, Gauge
from computedomain.retry import Backoff, retrying

__all__ = ["Informer", "Rejection", "event_reporter", "object_key", "problems", "wait_for_sync"]

log = logging.getLogger(__name__)

T = TypeVar("T")

INFORMER_OBJECTS = Gauge("computedomain_informer_objects", "Objects in an informer's store.", ["informer"])
INFORMER_EVENTS = Counter("computedomain_informer_events_total", "Watch events applied, by type.", ["informer", "type"])
INFORMER_RELISTS = Counter(
    "computedomain_informer_relists_total", "Full lists, by reason (initial, gone, error).", ["informer", "reason"]
)
INFORMER_WATCH_RESTARTS = Counter(
    "computedomain_informer_watch_restarts_total",
    "Watch reconnections, by reason (timeout, closed, error).",
    ["informer", "reason"],
)

INFORMER_REJECTED = Counter(
    "computedomain_informer_rejected_objects_total",
    "Object versions an informer skipped because they broke a decoding bound or could not be decoded.",
    ["informer"],
)

REJECT_LOG_BURST = 10
REJECT_LOG_PERIOD = 10.0
# One budget for the WARNING lines of every informer of the process: many hostile objects cost a few lines.
_REJECT_LOG = TokenBucket(1.0 / REJECT_LOG_PERIOD, REJECT_LOG_BURST)
REASON_OBJECT_SKIPPED = "ObjectSkipped"


@dataclass(frozen=True, slots=True)
class Rejection:
    """An object version an informer skipped, and why (one line naming the field and the limit)."""

    ref: ObjectRef
    reason: str


AddHandler = Callable[[T], None]
UpdateHandler = Callable[[T, T], None]
DeleteHandler = Callable[[T], None]
IndexFunc = Callable[[T], Iterable[str]]
RejectHandler = Callable[[Rejection], None]


def object_key(namespace: str | None, name: str) -> str:
    """The store key: ``namespace/name`` for namespaced objects, ``name`` for cluster-scoped ones."""
    return f"{namespace}/{name}" if namespace else name


def _meta(raw: Raw) -> Mapping[str, Any]:
    meta = raw.get("metadata")
    return meta if isinstance(meta, dict) else {}


class Informer(Generic[T]):
    """A list-then-watch cache of ``T`` projections. See the module docstring."""

    def __init__(
        self,
        client: KubeClient,
        resource: Resource,
        *,
        decode: Callable[[Raw], T],
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        name: str | None = None,
        page_size: int = 500,
        inactivity_timeout: float = 70.0,
        watch_timeout: tuple[int, int] = (300, 600),
        max_backoff: float = 30.0,
        indexers: Mapping[str, IndexFunc[T]] | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.name = name or "/".join(
            p for p in (resource.plural, namespace or "", label_selector or "", field_selector or "") if p
        )
        self._decode = decode
        self._page_size = page_size
        self._inactivity_timeout = inactivity_timeout
        self._watch_timeout = watch_timeout
        self._clock: Clock = clock or MonotonicClock()
        self._rng = rng or random.Random()  # jitter only; injectable for deterministic tests
        # 0.2 s doubling to max_backoff, 0.5x..1.5x
        self._backoff = Backoff(0.2, max_backoff, spread=0.5, rng=self._rng)
        self._failures = 0
        self._reason = "initial"
        self._pause = 0.0
        self._items: dict[str, T] = {}
        self._rvs: dict[str, str] = {}
        self._indexers: dict[str, IndexFunc[T]] = dict(indexers or {})
        self._indices: dict[str, dict[str, set[str]]] = {n: {} for n in self._indexers}
        self._indexed: dict[str, dict[str, tuple[str, ...]]] = {n: {} for n in self._indexers}
        self._on_add: list[AddHandler[T]] = []
        self._on_update: list[UpdateHandler[T]] = []
        self._on_delete: list[DeleteHandler[T]] = []
        self._on_reject: list[RejectHandler] = []
        # Skipped objects by key: the version skipped and why (each version is told once).
        self._rejected: dict[str, Rejection] = {}
        self._resource_version: str | None = None
        self._synced = asyncio.Event()
        self._objects = INFORMER_OBJECTS.labels(self.name)
        #: why this cache cannot be kept current (a refused list or watch), or None
        self.failure: str | None = None

    # ---- configuration (before run) -----------------------------------------------------------------

    def add_handler(
        self,
        *,
        on_add: AddHandler[T] | None = None,
        on_update: UpdateHandler[T] | None = None,
        on_delete: DeleteHandler[T] | None = None,
        on_reject: RejectHandler | None = None,
    ) -> None:
        """Register callbacks; they should only enqueue work. Objects already stored are replayed as adds,
        objects skipped now (``Rejection``) as rejects."""
        if on_add is not None:
            self._on_add.append(on_add)
            for obj in list(self._items.values()):
                self._call(on_add, obj)
        if on_update is not None:
            self._on_update.append(on_update)
        if on_delete is not None:
            self._on_delete.append(on_delete)
        if on_reject is not None:
            self._on_reject.append(on_reject)
            for rejection in list(self._rejected.values()):
                self._call(on_reject, rejection)

    # ---- reads --------------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def has_synced(self, within: float | None = None) -> bool:
        """Wait until the first full list is stored; False if ``within`` seconds pass first."""
        try:
            async with asyncio.timeout(within):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    @property
    def resource_version(self) -> str | None:
        """The version the watch resumes from (None before the first list and after a 410)."""
        return self._resource_version

    def get(self, name: str, namespace: str | None = None) -> T | None:
        return self._items.get(object_key(namespace, name))

    def get_by_key(self, key: str) -> T | None:
        return self._items.get(key)

    def list(self) -> builtins.list[T]:
        return list(self._items.values())

    def keys(self) -> builtins.list[str]:
        return list(self._items)

    def by_index(self, index: str, value: str) -> builtins.list[T]:
        keys = self._indices[index].get(value, ())
        return [self._items[k] for k in keys]

    def index_values(self, index: str) -> builtins.list[str]:
        return list(self._indices[index])

    def rejected(self) -> builtins.list[Rejection]:
        """The objects skipped now (see the module docstring)."""
        return list(self._rejected.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    # ---- the loop -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch, forever (until cancelled). tenacity runs the restarts; the failure count is ours,
        because it starts over after every watch that worked (``_failed`` says how long to wait)."""
        self._failures = 0
        self._reason = "initial"
        self._pause = 0.0
        restarts = retrying(self._clock, wait=lambda _: self._pause)
        async for attempt in restarts:
            with attempt:
                try:
                    while True:
                        if self._resource_version is None:
                            await self._relist(self._reason)
                        await self._watch()
                        self._failures = 0
                except Gone as exc:
                    log.info("informer re-list informer=%s reason=gone error=%s", self.name, exc)
                    self._resource_version = None
                    self._reason = "gone"
                    self._pause = 0.0
                    INFORMER_WATCH_RESTARTS.labels(self.name, "gone").inc()
                    raise
                except Exception as exc:
                    self._pause = self._failed(exc)
                    raise

    def _failed(self, exc: Exception) -> float:
        """Count and report a failed list or watch; the seconds to wait before the next (jittered backoff;
        none after the first silent watch)."""
        self._failures += 1
        failures = self._failures
        delay = self._backoff.delay(failures)
        timeout = isinstance(exc, KubeError) and exc.reason == "Timeout"
        INFORMER_WATCH_RESTARTS.labels(self.name, "timeout" if timeout else "error").inc()
        if isinstance(exc, KubeError) and exc.permanent:
            self._refused(exc)
        else:
            # Connection trouble and apiserver restarts are weather: debug while it lasts a few
            # rounds, then a warning per restart (it is no longer weather); a bug (not a KubeError)
            # with its traceback.
            lvl = logging.DEBUG if failures < 5 and isinstance(exc, KubeError) else logging.WARNING
            log.log(
                lvl,
                "informer restart informer=%s failures=%d retry_in=%.2fs error=%r",
                self.name,
                failures,
                delay,
                exc,
                exc_info=not isinstance(exc, KubeError),
            )
        if self._resource_version is None:
            self._reason = "error"
        if failures == 1 and timeout:
            return 0.0  # a silent watch: reconnect at once
        return delay

    async def _relist(self, reason: str) -> None:
        INFORMER_RELISTS.labels(self.name, reason).inc()
        fresh: dict[str, T] = {}
        rvs: dict[str, str] = {}
        skipped: set[str] = set()
        token: str | None = None
        list_rv = ""
        while True:
            page = await self.client.list(
                self.resource,
                namespace=self.namespace,
                label_selector=self.label_selector,
                field_selector=self.field_selector,
                limit=self._page_size,
                continue_token=token,
            )
            list_rv = list_rv or page.resource_version
            for raw in page.items:
                key, rv = self._key_rv(raw)
                obj = self._decode_raw(raw)
                if obj is None:
                    skipped.add(key)
                else:
                    fresh[key] = obj
                    rvs[key] = rv
            for bad in page.rejected:
                skipped.add(self._reject(bad.raw, bad.reason))
            token = page.continue_token
            if not token:
                break
        # Diff against what we had: only the list decides what is gone, and it is complete here.
        for key in self._rejected.keys() - skipped:
            del self._rejected[key]
        added: list[T] = []
        updated: list[tuple[T, T]] = []
        deleted = [self._items[k] for k in self._items.keys() - fresh.keys()]
        for key in self._items.keys() - fresh.keys():
            self._remove(key)
        for key, obj in fresh.items():
            old = self._items.get(key)
            old_rv = self._rvs.get(key)
            self._store(key, rvs[key], obj)
            if old is None:
                added.append(obj)
            elif old_rv != rvs[key]:
                updated.append((old, obj))
        self._resource_version = list_rv
        self._objects.set(len(self._items))
        self._synced.set()
        self._working()
        log.info(
            "informer listed informer=%s objects=%d resource_version=%s added=%d updated=%d deleted=%d",
            self.name,
            len(self._items),
            list_rv,
            len(added),
            len(updated),
            len(deleted),
        )
        for obj in deleted:
            self._dispatch_delete(obj)
        for obj in added:
            self._dispatch_add(obj)
        for old, new in updated:
            self._dispatch_update(old, new)

    async def _watch(self) -> None:
        lo, hi = self._watch_timeout
        timeout_seconds = self._rng.randint(lo, max(lo, hi))
        stream = self.client.watch(
            self.resource,
            namespace=self.namespace,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            resource_version=self._resource_version,
            timeout_seconds=timeout_seconds,
            allow_bookmarks=True,
            inactivity_timeout=self._inactivity_timeout,
        )
        async with contextlib.aclosing(stream):
            async for event in stream:
                self._apply(event.type, event.object, event.resource_version, event.rejected)
        INFORMER_WATCH_RESTARTS.labels(self.name, "closed").inc()

    def _refused(self, exc: KubeError) -> None:
        failure = f"informer {self.name}: {explain(exc)}"
        if failure != self.failure:
            log.warning("cache cannot be kept current: %s", failure)
        self.failure = failure

    def _working(self) -> None:
        if self.failure is not None:
            log.info("informer works again informer=%s (was: %s)", self.name, self.failure)
            self.failure = None

    def _apply(self, etype: str, raw: Raw, rv: str, rejected: Rejected | None = None) -> None:
        INFORMER_EVENTS.labels(self.name, etype).inc()
        self._working()
        if etype == "BOOKMARK":
            self._resource_version = rv or self._resource_version
            return
        key, _ = self._key_rv(raw)
        if etype in ("ADDED", "MODIFIED"):
            obj = None
            if rejected is not None:
                self._reject(raw, rejected.reason)
            else:
                obj = self._decode_raw(raw)
            old = self._items.get(key)
            self._resource_version = rv or self._resource_version
            if obj is None:
                # Skipped: an earlier version must not stay behind as if it were current.
                if old is not None:
                    self._remove(key)
                    self._objects.set(len(self._items))
                    self._dispatch_delete(old)
                return
            self._rejected.pop(key, None)
            self._store(key, rv, obj)
            self._objects.set(len(self._items))
            if old is None:
                self._dispatch_add(obj)
            else:
                self._dispatch_update(old, obj)
        elif etype == "DELETED":
            old = self._items.get(key)
            self._remove(key)
            self._rejected.pop(key, None)
            self._resource_version = rv or self._resource_version
            self._objects.set(len(self._items))
            # Handlers get the final state from the event: it is newer than what we stored.
            final = self._decode_raw(raw, quiet=True) if rejected is None else None
            gone = final if final is not None else old
            if gone is not None:
                self._dispatch_delete(gone)
        else:
            log.warning("informer ignoring event informer=%s type=%s", self.name, etype)

    # ---- store and index maintenance ----------------------------------------------------------------

    def _key_rv(self, raw: Raw) -> tuple[str, str]:
        meta = _meta(raw)
        ns = meta.get("namespace") if self.resource.namespaced else None
        return object_key(ns, str(meta.get("name") or "")), str(meta.get("resourceVersion") or "")

    def _decode_raw(self, raw: Raw, *, quiet: bool = False) -> T | None:
        """The projection of ``raw``; None when ``decode`` refuses it (skipped and told, unless ``quiet``)."""
        meta = raw.get("metadata")
        if isinstance(meta, dict):
            meta.pop("managedFields", None)
        try:
            return self._decode(raw)
        except Exception as exc:
            if not quiet:
                self._reject(raw, f"cannot be decoded: {_one_line(exc)}")
            return None

    def _reject(self, raw: Raw, reason: str) -> str:
        """Skip one object version: log (rate-limited), count, and tell the ``on_reject`` handlers, once per
        version. Returns its key."""
        meta = _meta(raw)
        key, rv = self._key_rv(raw)
        known = self._rejected.get(key)
        if known is not None and known.ref.resource_version == rv:
            return key
        uid = meta.get("uid")
        ref = ObjectRef(
            kind=self.resource.kind,
            api_version=self.resource.api_version,
            name=key.rpartition("/")[2],
            namespace=key.rpartition("/")[0] or None,
            uid=uid if isinstance(uid, str) else None,
            resource_version=rv,
        )
        rejection = Rejection(ref, reason)
        self._rejected[key] = rejection
        INFORMER_REJECTED.labels(self.name).inc()
        lvl = logging.WARNING if _REJECT_LOG.try_take() else logging.DEBUG
        log.log(
            lvl, "informer skips an object informer=%s object=%s resource_version=%s: %s", self.name, key, rv, reason
        )
        for fn in self._on_reject:
            self._call(fn, rejection)
        return key

    def _store(self, key: str, rv: str, obj: T) -> None:
        self._items[key] = obj
        self._rvs[key] = rv
        for name, fn in self._indexers.items():
            new_values = tuple(dict.fromkeys(fn(obj)))
            old_values = self._indexed[name].get(key, ())
            if new_values == old_values:
                continue
            index = self._indices[name]
            for v in old_values:
                self._unindex(index, v, key)
            for v in new_values:
                index.setdefault(v, set()).add(key)
            if new_values:
                self._indexed[name][key] = new_values
            else:
                self._indexed[name].pop(key, None)

    def _remove(self, key: str) -> None:
        self._items.pop(key, None)
        self._rvs.pop(key, None)
        for name in self._indexers:
            for v in self._indexed[name].pop(key, ()):
                self._unindex(self._indices[name], v, key)

    @staticmethod
    def _unindex(index: dict[str, set[str]], value: str, key: str) -> None:
        keys = index.get(value)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del index[value]

    # ---- handlers -----------------------------------------------------------------------------------

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("informer handler failed informer=%s handler=%r", self.name, fn)

    def _dispatch_add(self, obj: T) -> None:
        for fn in self._on_add:
            self._call(fn, obj)

    def _dispatch_update(self, old: T, new: T) -> None:
        for fn in self._on_update:
            self._call(fn, old, new)

    def _dispatch_delete(self, obj: T) -> None:
        for fn in self._on_delete:
            self._call(fn, obj)


def _one_line(exc: Exception) -> str:
    """A decode error in one line: pydantic's first error as ``field: message``, anything else by type."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            return shown(f"{where}: {first.get('msg', '')}", 200)
        except Exception:
            pass  # the plain form below
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {shown(text, 200)}"


def event_reporter(recorder: EventRecorder) -> RejectHandler:
    """An ``on_reject`` handler: a Warning Event on the skipped object (the recorder dedupes and rate-limits)."""

    def report(rejection: Rejection) -> None:
        ref = rejection.ref
        recorder.record(
            ref,
            EventType.WARNING,
            REASON_OBJECT_SKIPPED,
            f"{recorder.component} skips this {ref.kind} until it changes: {rejection.reason}",
        )

    return report


async def wait_for_sync(*informers: Informer[Any], within: float | None = None) -> None:
    """Wait until every informer has synced; ``TimeoutError`` naming the ones that did not."""
    results = await asyncio.gather(*(i.has_synced(within) for i in informers))
    missing = [i.name for i, ok in zip(informers, results, strict=True) if not ok]
    if missing:
        raise TimeoutError(f"caches not synced after {within}s: {', '.join(missing)}")


def problems(*informers: Informer[Any]) -> list[str]:
    """Why these caches are not current: each refused informer's one-line failure (for readiness)."""
    return [i.failure for i in informers if i.failure is not None]
