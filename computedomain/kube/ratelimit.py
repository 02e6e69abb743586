"""Rate limiting primitives shared by the API client and the work queue.

``TokenBucket`` is a reservation-style bucket (as golang.org/x/time/rate's ``Reserve``): ``reserve()``
always succeeds and returns how long the caller must wait, so a burst of callers is spread out in arrival
order instead of all polling. ``ItemBackoff`` is the per-key exponential backoff with jitter that the work
queue applies to failing keys (the one backoff that is not tenacity's: it is kept per key across runs, which no
library offers; see ``workqueue``). ``Waiters`` are tasks waiting for a turn, woken one at a time, oldest first:
the work queue's idle workers wait on it, and ``Slots`` (the client's requests in flight, foreground before
background) on two of them.

Concurrency: all are plain objects mutated only from the event loop thread; ``reserve()``, ``when()`` and
``wake_one()`` are synchronous, so no two coroutines can interleave inside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Generic, TypeVar

from computedomain.kube.clock import Clock, MonotonicClock

__all__ = ["ItemBackoff", "Slots", "TokenBucket", "Waiters"]

K = TypeVar("K", bound=Hashable)


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up. A rate <= 0 disables limiting."""

    def __init__(self, rate: float, burst: int, *, clock: Clock | None = None) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self._clock: Clock = clock or MonotonicClock()
        self._tokens = float(self.burst)
        self._last: float | None = None

    def _refill(self) -> None:
        now = self._clock.now()
        if self._last is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now

    def try_take(self) -> bool:
        """Take a token only if one is available now (for dropping, not delaying, excess work)."""
        if self.rate <= 0:
            return True
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def reserve(self) -> float:
        """Take one token; return the seconds to wait before using it (0 when one was available)."""
        if self.rate <= 0:
            return 0.0
        self._refill()
        self._tokens -= 1.0
        if self._tokens >= 0:
            return 0.0
        return -self._tokens / self.rate

    async def acquire(self) -> float:
        """Wait for a token; return how long we waited."""
        delay = self.reserve()
        if delay > 0:
            await self._clock.sleep(delay)
        return delay


class ItemBackoff(Generic[K]):
    """Per-key exponential backoff: ``base * 2**failures`` capped at ``cap``, times (1 + jitter*U[0,1))."""

    def __init__(
        self,
        *,
        base: float = 0.005,
        cap: float = 1000.0,
        jitter: float = 0.1,
        rng: random.Random | None = None,
    ) -> None:
        self.base = base
        self.cap = cap
        self.jitter = jitter
        # Injected for deterministic tests; the default is a private, unseeded generator.
        self._rng = rng or random.Random()
        self._failures: dict[K, int] = {}

    def when(self, key: K) -> float:
        """Record one more failure of ``key`` and return its delay."""
        n = self._failures.get(key, 0)
        self._failures[key] = n + 1
        delay = self.cap if n >= 64 else min(self.cap, self.base * (2**n))
        if self.jitter > 0:
            delay *= 1.0 + self.jitter * self._rng.random()
        return delay

    def failures(self, key: K) -> int:
        return self._failures.get(key, 0)

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)


class Waiters:
    """Tasks waiting for a turn, oldest first; ``wake_one`` gives the turn to the oldest still waiting."""

    def __init__(self) -> None:
        self._queue: deque[asyncio.Future[None]] = deque()

    async def wait(self, *, pass_on: Callable[[], object]) -> None:
        """Until woken. A task cancelled just as it was woken calls ``pass_on`` so the turn is not lost."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.cancelled():
                pass_on()
            raise

    def wake_one(self) -> bool:
        """Wake the oldest waiter; False when none waits."""
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():  # a cancelled waiter stays queued until it comes up here
                waiter.set_result(None)
                return True
        return False


class Slots:
    """At most ``size`` requests in flight. A freed slot goes to the longest-waiting foreground request, and
    to a background one only when no foreground request waits (``KubeClient.with_own_budget``)."""

    def __init__(self, size: int) -> None:
        self._free = size
        # A freed slot is handed to a waiter, never returned to the pool while one waits.
        self._foreground = Waiters()
        self._background = Waiters()

    @contextlib.asynccontextmanager
    async def slot(self, *, background: bool = False) -> AsyncIterator[None]:
        if self._free > 0:
            self._free -= 1
        else:
            await (self._background if background else self._foreground).wait(pass_on=self._release)
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        if not self._foreground.wake_one() and not self._background.wake_one():
            self._free += 1
