"""The one convergence loop of the service: every reconciler runs on a ``Converger``.

A ``Converger[K]`` owns a keyed ``WorkQueue[K]`` and ``workers`` tasks that call ``reconcile(key)``. Event
handlers only ``add(key)``; the reconcile reads its caches, does its writes, and returns. Who uses it: the
controller (key: ComputeDomain UID, 32 workers) and its orphan sweeper, the IMEX daemon's peer sync and
readiness mirror, and the node agent's ResourceSlice publisher, clique label and cleanup (one key each).

What it guarantees, whatever the reconcile:

* **Coalescing per key**: adds of a key that is already waiting are one run; adds while it runs make exactly
  one more run afterwards; one key never runs twice at once (the queue's rules). ``spacing`` additionally
  keeps a key from starting more often than once per ``spacing`` seconds (the sweeper), and ``every``
  re-adds a key that long after each success (periodic work).
* **Backoff with jitter**: a failed run is retried after ``backoff_initial * 2**n`` (capped at
  ``backoff_max``, times 1..1.1 random), and never sooner than a 429's ``Retry-After``. The numbers are a
  ``Retries`` policy, which each process takes from its settings (``Retries.of``: ``RETRY_BACKOFF_*``,
  ``RETRY_WARN_AFTER``, ``STUCK_RECHECK_PERIOD``).
* **Escalation by what the error is, not by its class name** (``classify``):

  - *transient* (5xx, 404/409/410/429, no answer, timeouts, I/O errors): retried quietly (debug log);
  - *repeated*: the same key failed ``warn_after`` times in a row: one WARNING, and the ``Reporter`` is told
    (the controller writes a condition and an Event), then quiet again until it recovers;
  - *permanent* (a 4xx the apiserver will answer the same way again, e.g. 403 Forbidden, 422 Invalid, a
    quota; or ``Stuck`` raised by the reconcile itself, e.g. a bad spec): one WARNING per distinct problem,
    the ``Reporter`` is told, and the key is **parked**: no backoff retries; it runs again when something
    adds it (its object or one of its inputs changed) or after ``stuck_recheck`` seconds, because some
    inputs (RBAC rules, quotas) send no event this component could watch;
  - anything unexpected (a bug) is logged once with its traceback and retried like a repeated failure.

  A success after an escalation logs one INFO line and tells the ``Reporter`` (``recovered``).

* ``failing()`` lists the keys whose latest failure was escalated, for health endpoints and tests.

Concurrency: one event loop. The queue's producer methods are synchronous, so informer handlers call
``add`` directly. Reporter calls are awaited by the worker while the key still counts as processing, so a
report and the next run of the same key never overlap. ``run()`` returns only by cancellation; it shuts the
queue down and cancels in-flight reconciles.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.errors import KubeError, TooManyRequests, explain
from computedomain.kube.ratelimit import ItemBackoff, TokenBucket
from computedomain.kube.workqueue import DONE, Done, QueueShutDown, ReconcileResult, RequeueAfter, WorkQueue
from computedomain.metrics import Counter, Histogram

__all__ = [
    "DEFAULT_RETRIES",
    "DONE",
    "Converger",
    "Done",
    "Failure",
    "ReconcileResult",
    "Reporter",
    "RequeueAfter",
    "Retries",
    "RetrySettings",
    "Severity",
    "Stuck",
    "classify",
]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)

_DURATION_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)

RECONCILE_TOTAL = Counter(
    "computedomain_reconcile_total",
    "Reconcile calls by result (success, requeue_after, error, stuck, cancelled).",
    ["name", "result"],
)
RECONCILE_TIME = Histogram(
    "computedomain_reconcile_time_seconds",
    "Reconcile latency by result.",
    ["name", "result"],
    buckets=_DURATION_BUCKETS,
)
ESCALATIONS = Counter(
    "computedomain_reconcile_escalations_total",
    "Keys whose failures were escalated, by severity (repeated, permanent).",
    ["name", "severity"],
)


class RetrySettings(Protocol):
    """What ``Retries.of`` reads from a process's settings."""

    @property
    def retry_backoff_initial(self) -> float: ...

    @property
    def retry_backoff_max(self) -> float: ...

    @property
    def retry_warn_after(self) -> int: ...

    @property
    def stuck_recheck_period(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Retries:
    """How a loop retries: backoff bounds, failures before a warning, and the recheck of a parked key."""

    backoff_initial: float = 0.005
    backoff_max: float = 300.0
    warn_after: int = 5
    stuck_recheck: float = 300.0

    @classmethod
    def of(cls, settings: RetrySettings) -> Retries:
        return cls(
            settings.retry_backoff_initial,
            settings.retry_backoff_max,
            settings.retry_warn_after,
            settings.stuck_recheck_period,
        )


DEFAULT_RETRIES = Retries()


class Severity(StrEnum):
    TRANSIENT = "transient"
    REPEATED = "repeated"
    PERMANENT = "permanent"


class Stuck(Exception):  # noqa: N818 (a state of the key, not a failure of the loop)
    """Raised by a reconcile: this key cannot progress until its object or its inputs change.

    ``str(exc)`` is for the user (it names the field or the permission, and the fix); ``reason`` is a
    CamelCase word for conditions and Events.
    """

    def __init__(self, message: str, *, reason: str = "Stuck") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Failure:
    """An escalated failure of one key, as told to the ``Reporter``."""

    severity: Severity
    reason: str
    message: str
    attempts: int


def classify(exc: BaseException) -> tuple[Severity, str, str]:
    """(transient or permanent, a CamelCase reason, a one-line message naming what and the fix)."""
    if isinstance(exc, Stuck):
        return Severity.PERMANENT, exc.reason, str(exc)
    if isinstance(exc, KubeError):
        if not exc.permanent:
            return Severity.TRANSIENT, exc.reason or "ApiUnavailable", explain(exc)
        if exc.status == 403:
            reason = "QuotaExceeded" if "exceeded quota" in exc.message else "Forbidden"
        else:
            reason = {401: "Unauthorized", 422: "Invalid"}.get(exc.status, "Rejected")
        return Severity.PERMANENT, reason, explain(exc)
    if isinstance(exc, TimeoutError):
        return Severity.TRANSIENT, "Timeout", f"timed out: {exc}" if str(exc) else "timed out"
    if isinstance(exc, OSError):
        return Severity.TRANSIENT, "IOError", f"{type(exc).__name__}: {exc}"
    return Severity.TRANSIENT, "InternalError", f"{type(exc).__name__}: {exc}"


def _expected(exc: BaseException) -> bool:
    return isinstance(exc, Stuck | KubeError | TimeoutError | OSError)


class Reporter(Protocol[K_contra]):
    """Tells users about escalated failures (the controller: a condition and an Event on the domain)."""

    async def escalated(self, key: K_contra, failure: Failure) -> None: ...

    async def recovered(self, key: K_contra) -> None: ...


@dataclass(slots=True)
class _Episode:
    """Consecutive failures of one key since its last success."""

    attempts: int = 0
    reported: tuple[Severity, str] | None = None
    traceback_logged: bool = False
    failure: Failure | None = None


class Converger(Generic[K]):
    """A work queue of keys plus the workers that converge them. See the module docstring."""

    def __init__(
        self,
        name: str,
        reconcile: Callable[[K], Awaitable[ReconcileResult]],
        *,
        workers: int = 1,
        retries: Retries = DEFAULT_RETRIES,
        spacing: float = 0.0,
        every: float | None = None,
        reporter: Reporter[K] | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        retry_rate: float = 10.0,
    ) -> None:
        self.name = name
        self._reconcile = reconcile
        self.workers = max(1, workers)
        self.warn_after = max(1, retries.warn_after)
        self.stuck_recheck = retries.stuck_recheck
        self.spacing = spacing
        self.every = every
        self.reporter = reporter
        self.clock: Clock = clock or MonotonicClock()
        backoff: ItemBackoff[K] = ItemBackoff(
            base=retries.backoff_initial, cap=retries.backoff_max, jitter=0.1, rng=rng
        )
        # Failure re-adds of all keys together are rate limited too (client-go's 10/s, burst 100), so that
        # many failing keys cannot retry in a storm.
        bucket = TokenBucket(retry_rate, 100, clock=self.clock)
        self.queue: WorkQueue[K] = WorkQueue(name, clock=self.clock, backoff=backoff, bucket=bucket)
        self._episodes: dict[K, _Episode] = {}

    # ---- producers ----------------------------------------------------------------------------------

    def add(self, key: K) -> None:
        """``key`` needs converging (an event about it or one of its inputs); wakes a parked key."""
        self.queue.add(key)

    def add_after(self, key: K, delay: float) -> None:
        self.queue.add_after(key, delay)

    # ---- observation --------------------------------------------------------------------------------

    def failing(self) -> dict[K, Failure]:
        """Keys whose current run of failures was escalated (repeated or permanent), with the failure."""
        return {k: e.failure for k, e in self._episodes.items() if e.failure is not None and e.reported}

    def attempts(self, key: K) -> int:
        """Consecutive failed runs of ``key`` (0 after a success)."""
        episode = self._episodes.get(key)
        return episode.attempts if episode else 0

    # ---- the workers --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the workers until cancelled."""
        try:
            async with asyncio.TaskGroup() as tg:
                for i in range(self.workers):
                    tg.create_task(self._worker(), name=f"{self.name}-worker-{i}")
        finally:
            self.queue.shutdown()

    async def _worker(self) -> None:
        while True:
            try:
                key = await self.queue.get()
            except QueueShutDown:
                return
            start = self.clock.now()
            if self.spacing > 0:
                self.queue.hold(key, start + self.spacing)
            label = "cancelled"
            try:
                result = await self._reconcile(key)
            except asyncio.CancelledError:
                self.queue.done(key)
                raise
            except Exception as exc:
                label = await self._failed(key, exc)
            else:
                label = await self._succeeded(key, result)
            finally:
                RECONCILE_TOTAL.labels(self.name, label).inc()
                RECONCILE_TIME.labels(self.name, label).observe(max(0.0, self.clock.now() - start))
            self.queue.done(key)

    async def _succeeded(self, key: K, result: ReconcileResult) -> str:
        self.queue.forget(key)
        episode = self._episodes.pop(key, None)
        if episode is not None and episode.reported is not None:
            log.info("reconcile recovered queue=%s key=%s after_attempts=%d", self.name, key, episode.attempts)
            await self._report_recovered(key)
        if isinstance(result, RequeueAfter):
            self.queue.add_after(key, result.seconds)
            return "requeue_after"
        if self.every is not None:
            self.queue.add_after(key, self.every)
        return "success"

    async def _failed(self, key: K, exc: Exception) -> str:
        episode = self._episodes.setdefault(key, _Episode())
        episode.attempts += 1
        severity, reason, message = classify(exc)
        if severity is Severity.TRANSIENT and (episode.attempts >= self.warn_after or not _expected(exc)):
            severity = Severity.REPEATED
        if not _expected(exc) and not episode.traceback_logged:
            episode.traceback_logged = True
            log.warning("reconcile raised unexpectedly queue=%s key=%s error=%r", self.name, key, exc, exc_info=exc)
        if severity is Severity.PERMANENT:
            self.queue.forget(key)
            self.queue.add_after(key, self.stuck_recheck)
            delay = self.stuck_recheck
        else:
            at_least = (exc.retry_after or 0.0) if isinstance(exc, TooManyRequests) else 0.0
            delay = self.queue.add_rate_limited(key, at_least=at_least)
        log.debug(
            "reconcile failed queue=%s key=%s attempt=%d severity=%s retry_in=%.3fs error=%s",
            self.name,
            key,
            episode.attempts,
            severity,
            delay,
            message,
        )
        if severity is Severity.TRANSIENT:
            return "error"
        failure = Failure(severity, reason, message, episode.attempts)
        episode.failure = failure
        previous = episode.reported
        # Repeated failures are told once per episode; a permanent one again only when the problem changes.
        if (
            previous is not None
            and previous[0] is severity
            and (severity is Severity.REPEATED or previous[1] == message)
        ):
            return "error" if severity is Severity.REPEATED else "stuck"
        episode.reported = (severity, message)
        ESCALATIONS.labels(self.name, severity.value).inc()
        if severity is Severity.PERMANENT:
            log.warning(
                "reconcile stuck until its inputs change queue=%s key=%s reason=%s recheck_in=%.0fs: %s",
                self.name,
                key,
                reason,
                delay,
                message,
            )
        else:
            log.warning(
                "reconcile keeps failing queue=%s key=%s attempts=%d reason=%s: %s",
                self.name,
                key,
                episode.attempts,
                reason,
                message,
            )
        await self._report_escalated(key, failure)
        return "stuck" if severity is Severity.PERMANENT else "error"

    async def _report_escalated(self, key: K, failure: Failure) -> None:
        if self.reporter is None:
            return
        try:
            await self.reporter.escalated(key, failure)
        except Exception as exc:
            # The report is best effort (its own write may fail for the same reason); the log line stands.
            log.info("reporting a failure failed queue=%s key=%s error=%r", self.name, key, exc)

    async def _report_recovered(self, key: K) -> None:
        if self.reporter is None:
            return
        try:
            await self.reporter.recovered(key)
        except Exception as exc:
            log.info("reporting a recovery failed queue=%s key=%s error=%r", self.name, key, exc)
