"""A keyed work queue (the client-go workqueue semantics, for asyncio); ``converge`` runs the workers.

What it owns: a set of keys that need work.

- **Dedupe**: adding a key that is already waiting is a no-op; a burst of events for one object becomes one
  run.
- **One at a time per key**: a key handed out by ``get()`` is "processing" until ``done(key)``. Adding it
  meanwhile marks it dirty, and ``done`` puts it back, so the change is seen by exactly one more run and
  never by two concurrent runs.
- **Delays**: ``add_after(key, s)`` (the earliest pending time wins), ``add_rate_limited(key)`` (failure
  backoff: per-key exponential with jitter, capped, combined with a global token bucket so that many failing
  keys cannot retry in a storm; ``forget(key)`` resets it) and ``hold(key, until)`` (adds before ``until``
  are deferred to it and coalesce into one run). This backoff is the queue's own, not tenacity's: tenacity
  (``computedomain.retry``, every other retry loop) retries one call, while this one outlives the call, is
  kept per key across runs, shared with the events that add the key and bounded by one bucket for all keys;
  no library offers that (client-go's workqueue rate limiters are what this follows).
- ``shutdown()``: ``get()`` raises ``QueueShutDown`` from then on; items still queued are dropped (the next
  process re-lists and re-enqueues everything anyway).
- Metrics per queue name: depth, adds, queue latency (add -> get), work duration (get -> done), retries.

Concurrency: everything runs on one event loop. The methods except ``get`` are synchronous, so handlers
(informer callbacks) can enqueue without awaiting. A worker waiting in ``get`` is woken only for a key it
can take: each key that becomes ready wakes one waiting worker (with 100 workers, waking all of them for
every key cost more CPU than the reconciles of a burst). Delayed keys have one timer task, asleep on the
injectable ``Clock`` until the earliest is due.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.ratelimit import ItemBackoff, TokenBucket, Waiters
from computedomain.metrics import Counter, Gauge, Histogram

__all__ = ["DONE", "Done", "QueueShutDown", "ReconcileResult", "RequeueAfter", "WorkQueue"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

_DURATION_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)

QUEUE_DEPTH = Gauge("computedomain_workqueue_depth", "Keys ready to be processed.", ["name"])
QUEUE_ADDS = Counter("computedomain_workqueue_adds_total", "Keys added (after dedupe).", ["name"])
QUEUE_LATENCY = Histogram(
    "computedomain_workqueue_queue_duration_seconds",
    "Time a key waited between being ready and being handed to a worker.",
    ["name"],
    buckets=_DURATION_BUCKETS,
)
WORK_DURATION = Histogram(
    "computedomain_workqueue_work_duration_seconds",
    "Time a worker spent on a key.",
    ["name"],
    buckets=_DURATION_BUCKETS,
)
QUEUE_RETRIES = Counter("computedomain_workqueue_retries_total", "Rate-limited re-adds (failures).", ["name"])


class QueueShutDown(Exception):  # noqa: N818 (mirrors asyncio.QueueShutDown)
    """Raised by ``WorkQueue.get`` once the queue is shut down."""


@dataclass(frozen=True, slots=True)
class Done:
    """A reconcile finished; nothing to do until the next event."""


@dataclass(frozen=True, slots=True)
class RequeueAfter:
    """A reconcile finished but wants to look again after ``seconds`` (not a failure: no backoff growth)."""

    seconds: float


DONE = Done()
ReconcileResult: TypeAlias = Done | RequeueAfter | None


class WorkQueue(Generic[K]):
    """Keyed, deduplicating, delaying, rate-limited work queue. See the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        clock: Clock | None = None,
        backoff: ItemBackoff[K] | None = None,
        bucket: TokenBucket | None = None,
    ) -> None:
        self.name = name
        self._clock: Clock = clock or MonotonicClock()
        # 5 ms doubling to 5 min: the client-go shape, with a lower cap so a user who fixed the cause
        # does not wait 16 minutes for the next attempt.
        self._backoff: ItemBackoff[K] = backoff or ItemBackoff(base=0.005, cap=300.0, jitter=0.1)
        # Global bucket on failure re-adds only (client-go's default controller limiter: 10/s, burst 100).
        self._bucket = bucket or TokenBucket(10.0, 100, clock=self._clock)
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: dict[K, float] = {}
        self._ready_since: dict[K, float] = {}
        self._waiting: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._held: dict[K, float] = {}
        # Workers waiting in get(); a ready key wakes one.
        self._idle = Waiters()
        # The task asleep until the earliest delayed key is due, and that time.
        self._timer: asyncio.Task[None] | None = None
        self._timer_due = 0.0
        self._shutting_down = False
        self._depth = QUEUE_DEPTH.labels(name)
        self._adds = QUEUE_ADDS.labels(name)
        self._latency = QUEUE_LATENCY.labels(name)
        self._work = WORK_DURATION.labels(name)
        self._retries = QUEUE_RETRIES.labels(name)

    # ---- producers ----------------------------------------------------------------------------------

    def add(self, key: K) -> None:
        """Mark ``key`` as needing work now. No-op if already queued; deferred if being processed."""
        if self._shutting_down or key in self._dirty:
            return
        held = self._held.get(key)
        if held is not None:
            wait = held - self._clock.now()
            if wait > 0:
                self.add_after(key, wait)
                return
            del self._held[key]
        self._dirty.add(key)
        self._adds.inc()
        if key in self._processing:
            return  # done() re-queues it
        self._push(key)

    def add_after(self, key: K, delay: float) -> None:
        """Add ``key`` after ``delay`` seconds; if it is already scheduled, the earlier time wins."""
        if self._shutting_down:
            return
        if delay <= 0:
            self.add(key)
            return
        due = self._clock.now() + delay
        current = self._waiting.get(key)
        if current is not None and current <= due:
            return
        self._waiting[key] = due
        heapq.heappush(self._heap, (due, next(self._seq), key))
        self._arm_timer()

    def add_rate_limited(self, key: K, *, at_least: float = 0.0) -> float:
        """Re-add a failed ``key`` after its backoff (and the global bucket); return the delay chosen."""
        delay = max(self._backoff.when(key), self._bucket.reserve(), at_least)
        self._retries.inc()
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset ``key``'s failure backoff (call after a success)."""
        self._backoff.forget(key)

    def hold(self, key: K, until: float) -> None:
        """Defer adds of ``key`` until the clock reaches ``until``; they coalesce into one run then."""
        self._held[key] = until

    def num_requeues(self, key: K) -> int:
        return self._backoff.failures(key)

    # ---- consumers ----------------------------------------------------------------------------------

    async def get(self) -> K:
        """Wait for the next ready key and mark it processing. Raises ``QueueShutDown``."""
        while True:
            if self._shutting_down:
                raise QueueShutDown(self.name)
            self._promote_due()
            if self._queue:
                key = self._queue.popleft()
                self._dirty.discard(key)
                now = self._clock.now()
                self._processing[key] = now
                self._latency.observe(max(0.0, now - self._ready_since.pop(key, now)))
                self._depth.set(len(self._queue))
                return key
            # Until a key may be ready for this worker (or the queue shuts down); a worker cancelled as it was
            # woken passes the wake on.
            await self._idle.wait(pass_on=self._idle.wake_one)

    def done(self, key: K) -> None:
        """Finish processing ``key``; if it was added meanwhile, queue it again."""
        started = self._processing.pop(key, None)
        if started is not None:
            self._work.observe(max(0.0, self._clock.now() - started))
        if key in self._dirty and not self._shutting_down:
            self._push(key)

    def shutdown(self) -> None:
        """Stop handing out keys: every ``get`` (current and future) raises ``QueueShutDown``."""
        self._shutting_down = True
        self._queue.clear()
        self._depth.set(0)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._idle.wake_one():
            pass

    # ---- introspection ------------------------------------------------------------------------------

    @property
    def clock(self) -> Clock:
        return self._clock

    def __len__(self) -> int:
        """Keys ready now (what ``depth`` reports), including delayed keys that have come due."""
        self._promote_due()
        return len(self._queue)

    @property
    def processing(self) -> frozenset[K]:
        return frozenset(self._processing)

    @property
    def waiting(self) -> dict[K, float]:
        """Delayed keys and the monotonic time at which each becomes ready."""
        return dict(self._waiting)

    def is_idle(self) -> bool:
        return not self._queue and not self._processing and not self._waiting

    # ---- internals ----------------------------------------------------------------------------------

    def _push(self, key: K) -> None:
        self._queue.append(key)
        self._ready_since.setdefault(key, self._clock.now())
        self._depth.set(len(self._queue))
        self._idle.wake_one()

    def _next_due(self) -> float | None:
        while self._heap:
            due, _, key = self._heap[0]
            if self._waiting.get(key) != due:  # superseded by an earlier add_after
                heapq.heappop(self._heap)
                continue
            return max(0.0, due - self._clock.now())
        return None

    def _promote_due(self) -> None:
        now = self._clock.now()
        while self._heap and self._heap[0][0] <= now:
            due, _, key = heapq.heappop(self._heap)
            if self._waiting.get(key) == due:
                del self._waiting[key]
                self.add(key)

    def _arm_timer(self) -> None:
        """Have the timer task asleep until the earliest delayed key is due (restarted if that moved up)."""
        due = self._next_due()
        if due is None or self._shutting_down:
            return
        at = self._clock.now() + due
        if self._timer is not None:
            if self._timer_due <= at:
                return
            self._timer.cancel()
        self._timer_due = at
        self._timer = asyncio.get_running_loop().create_task(self._fire(due), name=f"workqueue {self.name} timer")

    async def _fire(self, delay: float) -> None:
        await self._clock.sleep(delay)
        self._timer = None
        self._promote_due()
        self._arm_timer()
