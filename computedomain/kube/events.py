"""Kubernetes Events (core/v1) on our objects, with client-side de-duplication and a spam filter.

What it owns: turning "tell the user X happened to object O" into as few API writes as possible, written
on a budget of their own, so an Event never waits for or takes a token a reconcile needs.

* ``EventCorrelator`` (pure, no I/O) decides per call: **create** a new Event, **patch** the existing one
  (the same object, type, reason and message seen within ``window`` seconds: its ``count`` goes up and
  ``lastTimestamp`` moves), or **drop** the write because the object exceeded its budget (a token bucket per
  involved object, ``burst`` writes then one per ``refill`` seconds; dropped repeats are still counted and
  the next permitted patch carries the total). A reconcile loop that fails every few milliseconds therefore
  costs one create plus a bounded trickle of patches, never a flood. While a write for an Event is still
  queued, further occurrences only bump its count (**coalesce**): the write sends the newest count.
* ``EventRecorder.record()`` is synchronous and never raises: it asks the correlator, then hands the write
  to background writer tasks, started as the backlog grows up to ``writers`` (32, the requests the Event
  client has in flight at most; its token bucket paces them). One writer fell ~30 s behind the 1,000 Ready
  Events of a 1,000-domain burst on a busy apiserver, 8 still ~2 s: an Event should land while what it
  tells is news. Reconciles never wait on Event writes. One Event is written by one writer at a time (a
  lock per Event), so its create is always sent before its patches. Pending patches of one Event coalesce:
  the writer sends the newest count once. A patch that finds its Event gone (Events expire after an hour)
  re-creates it.
  ``flush()`` waits for the writes queued so far; ``aclose()`` flushes and stops the writers.
* The sink the recorder writes through is the process's client with a token bucket of its own
  (``KubeClient.with_own_budget``: the same connection pool and limits, as kube-scheduler and
  controller-runtime give their Event clients), so a burst of Events queues behind its own budget, never in
  front of a reconcile's writes.
* An Event that is not written (its object over the spam budget, the writer's backlog full, the write
  refused or failing) is counted by reason (``computedomain_events_dropped_total``) and told in **one
  summary line per interval** (``summary_interval``, 60 s), never one line per Event.

Concurrency: one recorder per process, used from the event loop thread; the correlator state is touched
only synchronously, the writers are the only tasks doing I/O, the summary another task that only logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from computedomain.kube.client import EVENTS, Raw, Resource
from computedomain.kube.clock import Clock, MonotonicClock, utcnow
from computedomain.kube.errors import KubeError, NotFound
from computedomain.kube.ratelimit import TokenBucket
from computedomain.metrics import Counter

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
EVENT_DROPS = Counter(
    "computedomain_events_dropped_total",
    "Events not written, by reason (object_budget, backlog, write_failed).",
    ["reason"],
)

# Why an Event was not written: the metric's label and the words of the summary line.
DROP_REASONS = {
    "object_budget": "over their object's Event budget (repeats are counted into its next write)",
    "backlog": "the writer's backlog was full",
    "write_failed": "the write failed",
}

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
    pending: bool = False  # a write for this Event is queued and not yet picked up by a writer
    written: int = 0  # the count the API has (0: not created yet)
    writing: asyncio.Lock | None = None  # held by the writer sending this Event (created on first write)


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
        writers: int = 32,
        summary_interval: float = 60.0,
        clock: Clock | None = None,
    ) -> None:
        self._sink = sink
        self.component = component
        self.instance = instance
        self._clock: Clock = clock or MonotonicClock()
        self._correlator = correlator or EventCorrelator(clock=self._clock)
        self._queue: asyncio.Queue[tuple[str, _Entry, Raw]] = asyncio.Queue(maxsize=max_pending)
        self._writers: list[asyncio.Task[None]] = []
        self._writer_count = max(1, writers)
        self.summary_interval = summary_interval
        # Events not written since the last summary line, by reason (the detail of a failure: its HTTP reason).
        self._dropped: Tally[tuple[str, str]] = Tally()
        self._summary: asyncio.Task[None] | None = None

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
                self._drop("object_budget")
                return
            body = self._body(ref, str(type_), reason, message, decision.entry)
            try:
                self._queue.put_nowait((decision.action, decision.entry, body))
            except asyncio.QueueFull:
                # This write never happens: the next occurrence of the Event must queue one of its own.
                decision.entry.pending = False
                self._drop("backlog")
                return
            self._writers = [w for w in self._writers if not w.done()]
            if len(self._writers) < min(self._writer_count, self._queue.qsize()):
                self._writers.append(asyncio.get_running_loop().create_task(self._write_loop(), name="event-writer"))
        except Exception:
            log.exception("event recording failed reason=%s object=%s", reason, ref.key)

    def _drop(self, reason: str, detail: str = "") -> None:
        """Count an Event that is not written; the summary line tells it within ``summary_interval``."""
        EVENT_WRITES.labels("dropped" if reason != "write_failed" else "failed").inc()
        EVENT_DROPS.labels(reason).inc()
        self._dropped[(reason, detail)] += 1
        if self._summary is None or self._summary.done():
            self._summary = asyncio.get_running_loop().create_task(self._summarize(), name="event-drop-summary")

    async def _summarize(self) -> None:
        await self._clock.sleep(self.summary_interval)
        self.log_dropped()

    def log_dropped(self) -> None:
        """The one line about the Events not written since the last one (nothing when there were none)."""
        if not self._dropped:
            return
        by_reason: Tally[str] = Tally()
        details: dict[str, Tally[str]] = {}
        for (reason, detail), n in self._dropped.items():
            by_reason[reason] += n
            if detail:
                details.setdefault(reason, Tally())[detail] += n
        parts = []
        for reason, n in by_reason.most_common():
            more = details.get(reason)
            extra = f" ({', '.join(f'{d}: {c}' for d, c in more.most_common(3))})" if more else ""
            parts.append(f"{n} {DROP_REASONS.get(reason, reason)}{extra}")
        total = sum(by_reason.values())
        self._dropped.clear()
        log.warning(
            "%d Events not written in the last %.0fs: %s",
            total,
            self.summary_interval,
            "; ".join(parts),
        )

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
                if entry.writing is None:
                    entry.writing = asyncio.Lock()
                async with entry.writing:  # after the create (or earlier patch) another writer is sending
                    await self._write(action, entry, body)
            except asyncio.CancelledError:
                raise
            except KubeError as exc:
                log.debug("event write failed event=%s/%s error=%r", entry.namespace, entry.name, exc)
                self._drop("write_failed", exc.reason or type(exc).__name__)
            except Exception as exc:
                log.warning("event write failed event=%s/%s error=%r", entry.namespace, entry.name, exc)
                self._drop("write_failed", type(exc).__name__)
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
        """Flush, then stop the writers; what was not written is told now rather than at the interval."""
        running = [w for w in self._writers if not w.done()]
        if running:
            await self.flush()
            for writer in running:
                writer.cancel()
            await asyncio.wait(running)
        if self._summary is not None and not self._summary.done():
            self._summary.cancel()
            await asyncio.wait({self._summary})
        self.log_dropped()
