"""Kubernetes Events (core/v1) on our objects, with client-side de-duplication and a spam filter.

What it owns: turning "tell the user X happened to object O" into as few API writes as possible.

* ``EventCorrelator`` (pure, no I/O) decides per call: **create** a new Event, **patch** the existing one
  (the same object, type, reason and message seen within ``window`` seconds: its ``count`` goes up and
  ``lastTimestamp`` moves), or **drop** the write because the object exceeded its budget (a token bucket per
  involved object, ``burst`` writes then one per ``refill`` seconds; dropped repeats are still counted and
  the next permitted patch carries the total). A reconcile loop that fails every few milliseconds therefore
  costs one create plus a bounded trickle of patches, never a flood. While a write for an Event is still
  queued, further occurrences only bump its count (**coalesce**): the write sends the newest count.
* ``EventRecorder.record()`` is synchronous and never raises: it asks the correlator, then hands the write
  to one background writer task (so reconciles do not wait on Event writes, and a create is always sent
  before the patches of the same Event). Pending patches of one Event coalesce: the writer sends the
  newest count once. A patch that finds its Event gone (Events expire after an hour) re-creates it.
  ``flush()`` waits for the writes queued so far; ``aclose()`` flushes and stops the writer.

Concurrency: one recorder per process, used from the event loop thread; the correlator state is touched
only synchronously, the writer is the single task doing I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from prometheus_client import Counter

from computedomain.kube.client import EVENTS, Raw, Resource
from computedomain.kube.clock import Clock, MonotonicClock, utcnow
from computedomain.kube.errors import KubeError, NotFound
from computedomain.kube.ratelimit import TokenBucket

__all__ = [
    "Decision",
    "EventCorrelator",
    "EventRecorder",
    "EventSink",
    "EventType",
    "ObjectRef",
]

log = logging.getLogger(__name__)

EVENT_WRITES = Counter(
    "computedomain_events_total",
    "Kubernetes Event writes by action (create, patch, dropped, failed).",
    ["action"],
)

MAX_MESSAGE = 1024


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The ``involvedObject`` of an Event."""

    kind: str
    api_version: str
    name: str
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    field_path: str | None = None

    @classmethod
    def for_object(cls, resource: Resource, obj: Mapping[str, Any]) -> ObjectRef:
        """A reference to a raw object of ``resource`` (uses its metadata)."""
        meta = obj.get("metadata") or {}
        return cls(
            kind=resource.kind,
            api_version=resource.api_version,
            name=str(meta.get("name") or ""),
            namespace=meta.get("namespace") if resource.namespaced else None,
            uid=meta.get("uid"),
        )

    def to_dict(self) -> Raw:
        out: Raw = {"kind": self.kind, "apiVersion": self.api_version, "name": self.name}
        if self.namespace:
            out["namespace"] = self.namespace
        if self.uid:
            out["uid"] = self.uid
        if self.resource_version:
            out["resourceVersion"] = self.resource_version
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.kind, self.namespace or "", self.name, self.uid or "")


@dataclass(slots=True)
class _Entry:
    name: str
    namespace: str
    count: int
    first_seen: float
    last_seen: float
    first_timestamp: str
    create_queued: bool = False
    pending: bool = False  # a write for this Event is queued and not yet picked up by the writer
    written: int = 0  # the count the API has (0: not created yet)


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do for one ``record`` call: ``action`` is ``create``, ``patch``, ``coalesce`` (a write is
    already queued and will carry the new count) or ``drop`` (over the object's budget)."""

    action: str
    entry: _Entry = field(repr=False)


class EventCorrelator:
    """Pure dedupe and spam-filter logic (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        window: float = 600.0,
        burst: int = 25,
        refill: float = 300.0,
        max_entries: int = 4096,
    ) -> None:
        self._clock: Clock = clock or MonotonicClock()
        self.window = window
        self._burst = burst
        self._rate = 1.0 / refill
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._buckets: OrderedDict[tuple[str, str, str, str], TokenBucket] = OrderedDict()

    def observe(self, ref: ObjectRef, type_: str, reason: str, message: str, *, name: str, namespace: str) -> Decision:
        """Account one occurrence; ``name``/``namespace`` are used only if a new Event is needed."""
        now = self._clock.now()
        key = (ref.key, type_, reason, message)
        entry = self._entries.get(key)
        if entry is not None and now - entry.last_seen > self.window:
            entry = None  # a new episode: a fresh Event rather than a very old count
        if entry is None:
            entry = _Entry(
                name=name,
                namespace=namespace,
                count=0,
                first_seen=now,
                last_seen=now,
                first_timestamp=_now_rfc3339(),
            )
        entry.count += 1
        entry.last_seen = now
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        if entry.pending:
            # The queued write will read the count when it is sent: nothing more to send, no token spent.
            return Decision("coalesce", entry)
        if not self._allow(ref.key):
            return Decision("drop", entry)
        entry.pending = True
        if not entry.create_queued:
            entry.create_queued = True
            return Decision("create", entry)
        return Decision("patch", entry)

    def _allow(self, obj_key: tuple[str, str, str, str]) -> bool:
        bucket = self._buckets.get(obj_key)
        if bucket is None:
            bucket = TokenBucket(self._rate, self._burst, clock=self._clock)
            self._buckets[obj_key] = bucket
        self._buckets.move_to_end(obj_key)
        while len(self._buckets) > self._max_entries:
            self._buckets.popitem(last=False)
        return bucket.try_take()


class EventSink(Protocol):
    """The two client calls the recorder needs (``KubeClient`` provides them)."""

    async def create(self, resource: Resource, body: Mapping[str, Any], *, namespace: str | None = None) -> Raw: ...

    async def merge_patch(
        self,
        resource: Resource,
        name: str,
        patch: Mapping[str, Any],
        *,
        namespace: str | None = None,
    ) -> Raw: ...


def _now_rfc3339() -> str:
    return utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Fire-and-forget Event recording for one component (see the module docstring)."""

    def __init__(
        self,
        sink: EventSink,
        *,
        component: str,
        instance: str,
        correlator: EventCorrelator | None = None,
        max_pending: int = 1000,
    ) -> None:
        self._sink = sink
        self.component = component
        self.instance = instance
        self._correlator = correlator or EventCorrelator()
        self._queue: asyncio.Queue[tuple[str, _Entry, Raw]] = asyncio.Queue(maxsize=max_pending)
        self._writer: asyncio.Task[None] | None = None

    def record(self, ref: ObjectRef, type_: EventType | str, reason: str, message: str) -> None:
        """Record an Event on ``ref``. Never raises and never waits; must be called on the event loop."""
        try:
            message = message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."
            namespace = ref.namespace or "default"
            name = f"{ref.name}.{time.time_ns():x}"
            decision = self._correlator.observe(ref, str(type_), reason, message, name=name, namespace=namespace)
            if decision.action == "coalesce":
                return
            if decision.action == "drop":
                EVENT_WRITES.labels("dropped").inc()
                return
            body = self._body(ref, str(type_), reason, message, decision.entry)
            self._queue.put_nowait((decision.action, decision.entry, body))
            if self._writer is None or self._writer.done():
                self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="event-writer")
        except asyncio.QueueFull:
            EVENT_WRITES.labels("dropped").inc()
            log.warning("event dropped (writer backlog full) reason=%s object=%s", reason, ref.key)
        except Exception:
            log.exception("event recording failed reason=%s object=%s", reason, ref.key)

    def _body(self, ref: ObjectRef, type_: str, reason: str, message: str, entry: _Entry) -> Raw:
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": entry.name, "namespace": entry.namespace},
            "involvedObject": ref.to_dict(),
            "type": type_,
            "reason": reason,
            "message": message,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": entry.first_timestamp,
            "lastTimestamp": _now_rfc3339(),
            "count": entry.count,
        }

    async def _write_loop(self) -> None:
        while True:
            action, entry, body = await self._queue.get()
            try:
                await self._write(action, entry, body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                EVENT_WRITES.labels("failed").inc()
                level = logging.INFO if isinstance(exc, KubeError) else logging.WARNING
                log.log(level, "event write failed event=%s/%s error=%r", entry.namespace, entry.name, exc)
            finally:
                self._queue.task_done()

    async def _write(self, action: str, entry: _Entry, body: Raw) -> None:
        entry.pending = False  # occurrences from now on need a write of their own
        count = entry.count
        if action == "patch" and entry.written >= count:
            return  # an earlier write already carried this count
        if action == "create" or entry.written == 0:
            # (a patch of an Event whose create failed becomes the create)
            body = {**body, "count": count}
            await self._sink.create(EVENTS, body, namespace=entry.namespace)
            EVENT_WRITES.labels("create").inc()
        else:
            patch = {"count": count, "lastTimestamp": _now_rfc3339()}
            try:
                await self._sink.merge_patch(EVENTS, entry.name, patch, namespace=entry.namespace)
                EVENT_WRITES.labels("patch").inc()
            except NotFound:
                # The apiserver expired it (event TTL): start a new one under a new name.
                entry.name = f"{body['involvedObject']['name']}.{time.time_ns():x}"
                body = {**body, "metadata": {"name": entry.name, "namespace": entry.namespace}, "count": count}
                await self._sink.create(EVENTS, body, namespace=entry.namespace)
                EVENT_WRITES.labels("create").inc()
        entry.written = max(entry.written, count)

    async def flush(self) -> None:
        """Wait until every write queued so far is done (sent or failed)."""
        await self._queue.join()

    async def aclose(self) -> None:
        """Flush, then stop the writer."""
        if self._writer is not None and not self._writer.done():
            await self.flush()
            self._writer.cancel()
            await asyncio.wait({self._writer})
