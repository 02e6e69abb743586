"""Time for the Kubernetes I/O layer: a ``Clock`` protocol, the real monotonic clock and a fake one.

Everything in ``computedomain.kube`` that waits (work-queue backoff, rate limits, ``add_after``, leader
election renewals, event de-duplication windows) takes a ``Clock`` so that unit tests can run hours of
backoff in microseconds. ``now()`` is monotonic seconds, never wall time; wall-clock timestamps (Lease
``renewTime``, Event ``lastTimestamp``, condition and checkpoint times) come from ``utcnow``, the one
wall-clock reader, which callers inject where tests need a fixed time.

Concurrency: all clocks are used from a single asyncio event loop; ``FakeClock`` is not thread-safe.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Protocol, TypeVar

__all__ = ["Clock", "FakeClock", "MonotonicClock", "run_within", "utcnow"]

T = TypeVar("T")


def utcnow() -> datetime:
    """Wall-clock time, timezone-aware UTC."""
    return datetime.now(UTC)


class Clock(Protocol):
    """Monotonic time and sleeping, injectable for tests."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """Manually advanced time for unit tests.

    ``sleep`` parks the caller until a test calls ``advance``; ``advance`` wakes sleepers in deadline
    order and lets the event loop run between wake-ups, so chains of sleeps (a backoff that sleeps again
    after waking) behave as they would in real time.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """How many tasks are parked in ``sleep`` (cancelled ones excluded)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def settle(self, rounds: int = 20) -> None:
        """Let ready tasks run without moving time."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking every sleeper whose deadline is reached."""
        target = self._now + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
                await self.settle()
        self._now = target
        await self.settle()


async def run_within(clock: Clock, seconds: float, aw: Awaitable[T]) -> T:
    """Await ``aw``; after ``seconds`` on ``clock`` cancel it and raise ``TimeoutError`` (``asyncio.timeout``
    measured by an injectable clock). A cancellation of the caller cancels ``aw`` too and is re-raised."""
    task = asyncio.ensure_future(aw)
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        done, _ = await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        timer.cancel()
        await asyncio.wait({task, timer})
        raise
    timer.cancel()
    if task not in done:
        task.cancel()
        await asyncio.wait({task})
        if task.cancelled():
            raise TimeoutError(f"no result within {seconds:g}s")
    return task.result()
