"""Lease-based leader election (coordination.k8s.io/v1 Lease), client-go's algorithm.

What it owns: one Lease ``namespace/name`` and the decision "this process may write". Identity is
``<pod>-<uuid4>`` (fresh per process, so a restarted pod never mistakes an old term for its own).

* **Acquire**: every ``retry_period`` (jittered to 1..1.2x; a tenacity loop), read the Lease; take it when it is missing, has no holder
  (released), or its holder has not renewed for ``lease_duration`` *as observed by our own clock* (the
  remote ``renewTime`` is never compared with our wall clock, so clock skew cannot cause two leaders).
* **Renew**: every ``retry_period`` write ``renewTime``. If no renewal succeeds for ``renew_deadline``, or
  the Lease shows another holder, leadership is lost: the leader's work is cancelled,
  ``on_stopped_leading`` runs and ``run()`` raises ``LeadershipLost``; the caller exits so the next term
  starts with clean memory.
* **Release** (graceful shutdown, i.e. ``run()`` cancelled, or the work returned): clear
  ``holderIdentity`` so a standby takes over at once instead of waiting out the lease. A standby watches
  the Lease while it waits, so it tries again as soon as the holder is cleared (or the Lease deleted),
  not only on its next ``retry_period`` tick.
* Every write is a PUT carrying the resourceVersion that was read (or a create): a concurrent change by
  another candidate is a 409 ``Conflict`` and this round simply fails. No blind writes.

Concurrency: ``run()`` is one task. The leader's work (``on_started_leading``) runs as a child task of it,
so cancelling ``run()`` cancels the work first, then releases the Lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from tenacity import retry_if_exception_type, retry_if_result

from computedomain.kube.client import LEASES, KubeClient, Raw
from computedomain.kube.clock import Clock, MonotonicClock, utcnow
from computedomain.kube.errors import Conflict, KubeError, NotFound
from computedomain.metrics import Counter, Gauge
from computedomain.retry import Backoff, log_retry, retrying

__all__ = ["LeaderElector", "LeadershipLost", "make_identity"]

log = logging.getLogger(__name__)

IS_LEADER = Gauge("computedomain_leader_is_leader", "1 while this process holds the lease.", ["lease"])
TRANSITIONS = Counter(
    "computedomain_leader_transitions_total", "Leadership changes seen by this process.", ["lease", "event"]
)


class LeadershipLost(Exception):  # noqa: N818 (an event, not a failure of ours)
    """The lease could not be renewed in time or was taken over; the process should exit."""


def make_identity(pod_name: str) -> str:
    """``<pod>-<uuid4>``; the host name when there is no pod name (a process outside a pod)."""
    return f"{pod_name or os.uname().nodename}-{uuid.uuid4()}"


def _micro_time() -> str:
    return utcnow().strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Campaign for, hold and release one Lease. See the module docstring."""

    def __init__(
        self,
        client: KubeClient,
        *,
        namespace: str,
        name: str,
        identity: str | None = None,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_started_leading: Callable[[], Coroutine[Any, Any, None]] | None = None,
        on_stopped_leading: Callable[[], None] | None = None,
        on_new_leader: Callable[[str], None] | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity or make_identity("")
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._on_started = on_started_leading
        self._on_stopped = on_stopped_leading
        self._on_new_leader = on_new_leader
        self._clock: Clock = clock or MonotonicClock()
        self._rng = rng or random.Random()  # jitter only
        self._lease: Raw | None = None  # the last Lease we read or wrote
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0  # our monotonic time when _observed last changed
        self._leading = False
        self._last_holder: str | None = None
        self._gauge = IS_LEADER.labels(f"{namespace}/{name}")
        self._gauge.set(0)

    @property
    def is_leader(self) -> bool:
        return self._leading

    @property
    def holder(self) -> str | None:
        """The holder we last observed (may be stale by up to ``retry_period``)."""
        return self._last_holder

    # ---- the campaign -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Acquire, then run ``on_started_leading`` while renewing; release on cancellation or when the
        work returns. Raises ``LeadershipLost`` when leadership is lost (and the work was cancelled)."""
        await self._acquire()
        work: asyncio.Task[None] | None = None
        try:
            self._became_leader()
            if self._on_started is not None:
                work = asyncio.create_task(self._on_started(), name=f"leader-work-{self.name}")
            await self._renew_until_lost(work)
        finally:
            if work is not None and not work.done():
                work.cancel()
                await asyncio.wait({work})
            lost = not self._leading
            self._leading = False
            self._stopped_leading()
            if not lost:
                await asyncio.shield(self._release())

    async def _acquire(self) -> None:
        released = asyncio.Event()
        watcher = asyncio.create_task(self._watch_for_release(released), name=f"leader-watch-{self.name}")

        async def attempt() -> bool:
            released.clear()
            try:
                return await self._try_acquire_or_renew()
            except KubeError as exc:
                log.info("leader election: acquire failed lease=%s/%s error=%r", self.namespace, self.name, exc)
                return False

        async def sleep(seconds: float) -> None:
            await self._sleep_or(released, seconds)

        # retry_period x U[1, 1.2): client-go's jitter, as Backoff's symmetric spread around 1.1 x retry_period
        period = 1.1 * self.retry_period
        campaign = retrying(
            self._clock,
            wait=Backoff(period, period, spread=1 / 11, rng=self._rng),
            retry=retry_if_result(lambda won: not won),
            sleep=sleep,
        )
        try:
            await campaign(attempt)
        finally:
            watcher.cancel()
            await asyncio.wait({watcher})

    async def _sleep_or(self, event: asyncio.Event, seconds: float) -> None:
        sleeping = asyncio.ensure_future(self._clock.sleep(seconds))
        woken = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({sleeping, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (sleeping, woken):
                future.cancel()

    async def _watch_for_release(self, released: asyncio.Event) -> None:
        """Set `released` when the Lease loses its holder or disappears. Best effort: on any error the
        periodic retry still acquires, so errors only pause the watch for a retry period."""

        async def watch() -> None:
            stream = self.client.watch(
                LEASES, namespace=self.namespace, field_selector=f"metadata.name={self.name}", timeout_seconds=300
            )
            async for event in stream:
                holder = (event.object.get("spec") or {}).get("holderIdentity")
                if event.type == "DELETED" or (event.type in ("ADDED", "MODIFIED") and not holder):
                    released.set()

        restarts = retrying(
            self._clock,
            wait=Backoff(self.retry_period, self.retry_period, spread=0),
            retry=retry_if_exception_type(KubeError),
            before_sleep=log_retry(log, f"leader election: lease watch lease={self.namespace}/{self.name}"),
        )
        while True:  # a watch that ends at its timeout is opened again at once
            await restarts(watch)

    async def _renew_until_lost(self, work: asyncio.Task[None] | None) -> None:
        last_renew = self._clock.now()
        while True:
            sleep = asyncio.ensure_future(self._clock.sleep(self.retry_period))
            waiting: set[asyncio.Future[Any]] = {sleep}
            if work is not None:
                waiting.add(work)
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not sleep.done():
                    sleep.cancel()
            if work is not None and work.done():
                error = None if work.cancelled() else work.exception()
                if error is not None:
                    raise error
                return  # the work finished: release
            remaining = self.renew_deadline - (self._clock.now() - last_renew)
            try:
                async with asyncio.timeout(max(0.1, min(self.retry_period, remaining))):
                    ok = await self._try_acquire_or_renew()
            except (KubeError, TimeoutError) as exc:
                log.info("leader election: renew failed lease=%s/%s error=%r", self.namespace, self.name, exc)
                ok = False
            if ok:
                last_renew = self._clock.now()
                continue
            if self._last_holder not in (None, "", self.identity):
                self._leading = False
                raise LeadershipLost(f"lease {self.namespace}/{self.name} taken over by {self._last_holder}")
            if self._clock.now() - last_renew >= self.renew_deadline:
                self._leading = False
                raise LeadershipLost(f"lease {self.namespace}/{self.name} not renewed within {self.renew_deadline:g}s")

    # ---- one round ----------------------------------------------------------------------------------

    async def _try_acquire_or_renew(self) -> bool:
        now_wall = _micro_time()
        lease = self._lease if self._leading else None
        if lease is None:
            try:
                lease = await self.client.get(LEASES, self.name, namespace=self.namespace)
            except NotFound:
                return await self._create(now_wall)
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        observed = (holder, str(spec.get("renewTime") or ""))
        if observed != self._observed:
            self._observed = observed
            self._observed_at = self._clock.now()
        self._note_holder(holder)
        if holder and holder != self.identity and not self._expired(spec):
            return False
        new_spec = dict(spec)
        new_spec["holderIdentity"] = self.identity
        new_spec["leaseDurationSeconds"] = round(self.lease_duration)
        new_spec["renewTime"] = now_wall
        if holder != self.identity:
            new_spec["acquireTime"] = now_wall
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        body = {**lease, "spec": new_spec}
        try:
            self._lease = await self.client.replace(LEASES, body, namespace=self.namespace)
        except Conflict:
            self._lease = None  # someone else wrote; re-read next round
            return False
        self._note_holder(self.identity)
        return True

    def _expired(self, spec: dict[str, Any]) -> bool:
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        return self._clock.now() - self._observed_at >= duration

    async def _create(self, now_wall: str) -> bool:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": round(self.lease_duration),
                "acquireTime": now_wall,
                "renewTime": now_wall,
                "leaseTransitions": 0,
            },
        }
        try:
            self._lease = await self.client.create(LEASES, body, namespace=self.namespace)
        except Conflict:  # AlreadyExists: another candidate was faster
            return False
        self._note_holder(self.identity)
        return True

    async def _release(self) -> None:
        """Clear the holder (only if it is still us, by resourceVersion) so a standby takes over at once."""
        lease = self._lease
        if lease is None:
            return
        spec = dict(lease.get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            return
        now_wall = _micro_time()
        spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=now_wall, acquireTime=now_wall)
        try:
            async with asyncio.timeout(self.renew_deadline):
                await self.client.replace(LEASES, {**lease, "spec": spec}, namespace=self.namespace)
            log.info("leader election: released lease=%s/%s identity=%s", self.namespace, self.name, self.identity)
        except (KubeError, TimeoutError) as exc:
            log.warning("leader election: release failed lease=%s/%s error=%r", self.namespace, self.name, exc)
        self._lease = None

    # ---- notifications ------------------------------------------------------------------------------

    def _note_holder(self, holder: str) -> None:
        if holder != self._last_holder:
            self._last_holder = holder
            if holder:
                log.info("leader election: new leader lease=%s/%s holder=%s", self.namespace, self.name, holder)
                if self._on_new_leader is not None:
                    try:
                        self._on_new_leader(holder)
                    except Exception:
                        log.exception("on_new_leader failed")

    def _became_leader(self) -> None:
        self._leading = True
        self._gauge.set(1)
        TRANSITIONS.labels(f"{self.namespace}/{self.name}", "started").inc()
        log.info("leader election: started leading lease=%s/%s identity=%s", self.namespace, self.name, self.identity)

    def _stopped_leading(self) -> None:
        self._gauge.set(0)
        TRANSITIONS.labels(f"{self.namespace}/{self.name}", "stopped").inc()
        log.info("leader election: stopped leading lease=%s/%s identity=%s", self.namespace, self.name, self.identity)
        if self._on_stopped is not None:
            try:
                self._on_stopped()
            except Exception:
                log.exception("on_stopped_leading failed")
