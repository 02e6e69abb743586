"""The project's tenacity building blocks: every retry loop of every process is a tenacity loop made of these.

What it owns:

* ``Backoff``: a tenacity wait. The n-th retry waits ``initial * 2**(n-1)``, the base capped at ``cap``,
  times a factor drawn from ``[1 - spread, 1 + spread)`` (``spread=0``: no jitter), so a delay never exceeds
  ``cap * (1 + spread)``. The random source is injectable, so a test with a seeded ``random.Random`` knows
  every delay. ``delay(n)`` is the same rule for a loop that counts its failures itself (a supervisor whose
  count starts over after a healthy run).
* ``before_deadline``: a tenacity stop that ends the loop when the next attempt could not start (the
  upcoming sleep) or could not finish (``reserve`` times the last attempt's duration) before ``deadline``,
  both measured on an injected ``Clock``. tenacity measures its own ``stop_after_delay`` on
  ``time.monotonic``; ours reads the clock the caller waits on, so a fake clock decides when a budget ends.
  Its ``began`` hook (tenacity's ``before``; ``retrying`` wires it) marks the start of each attempt.
* ``log_retry``: a tenacity ``before_sleep`` that logs one line per retry, at DEBUG until the
  ``warn_after``-th attempt and at WARNING from then on, so that a loop that keeps failing is seen and a
  loop that recovers costs no INFO line.
* ``retrying``: an ``AsyncRetrying`` that sleeps on the injected ``Clock`` (tenacity's ``sleep`` hook) and
  re-raises the last error rather than tenacity's ``RetryError``: callers see the error they know; with
  ``give_up=last_result`` a poll that runs out answers what it saw last.
* ``again_on``: a read-decide-write loop (optimistic concurrency): the next attempt reads again at once,
  at most ``attempts`` times, on the errors named (a 409, a failed JSON-patch test); the last one re-raised.

What retries where, and what is not retried: docs/design/0013-stack.md, "Retries". The keyed work queue
(``kube.workqueue``) keeps its own per-key backoff: tenacity retries one call, not a set of keys.

Concurrency: a ``before_deadline`` remembers when its attempt began, so it belongs to one loop; make a new
one per loop (``retrying`` is cheap). ``Backoff`` (only its random source changes) and ``log_retry`` may be
shared by the loops of one event loop.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Final

from tenacity import AsyncRetrying, RetryCallState
from tenacity.retry import retry_base, retry_if_exception_type
from tenacity.stop import stop_after_attempt, stop_base, stop_never
from tenacity.wait import wait_base

from computedomain.kube.clock import Clock

__all__ = ["Backoff", "again_on", "before_deadline", "last_result", "log_retry", "retrying"]

#: tenacity's default: any ``Exception`` (never a cancellation, which is a ``BaseException``)
_ANY_ERROR: Final = retry_if_exception_type()


class Backoff(wait_base):
    """``min(cap, initial * 2**(n-1)) * U[1 - spread, 1 + spread)`` before the n-th retry."""

    def __init__(self, initial: float, cap: float, *, spread: float = 0.5, rng: random.Random | None = None) -> None:
        if initial < 0 or cap < 0 or not 0 <= spread < 1:
            raise ValueError(f"Backoff: need initial >= 0, cap >= 0, 0 <= spread < 1 (got {initial}, {cap}, {spread})")
        self.initial = initial
        self.cap = cap
        self.spread = spread
        self._rng = rng or random.Random()

    def delay(self, n: int) -> float:
        """The wait before the n-th retry (n >= 1; smaller counts as 1)."""
        base = self.cap if n > 64 else min(self.cap, self.initial * 2 ** max(n - 1, 0))
        if not self.spread:
            return base
        return base * (1 - self.spread + 2 * self.spread * self._rng.random())

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)


class before_deadline(stop_base):  # noqa: N801 (tenacity's spelling: stop_after_delay, stop_before_delay)
    """Stop when ``clock.now() + upcoming sleep + reserve * (last attempt's duration) >= deadline``.

    Pass ``began`` as the loop's ``before`` hook so the duration is known; without it the reserve is 0."""

    def __init__(self, clock: Clock, deadline: float, *, reserve: float = 0.0) -> None:
        self.clock = clock
        self.deadline = deadline
        self.reserve = reserve
        self._began: float | None = None

    def began(self, retry_state: RetryCallState) -> None:
        self._began = self.clock.now()

    def remaining(self) -> float:
        return self.deadline - self.clock.now()

    def __call__(self, retry_state: RetryCallState) -> bool:
        now = self.clock.now()
        last = 0.0 if self._began is None else now - self._began
        return now + retry_state.upcoming_sleep + self.reserve * last >= self.deadline


def _outcome(retry_state: RetryCallState) -> str:
    outcome = retry_state.outcome
    if outcome is None:
        return "none"
    if outcome.failed:
        exc = outcome.exception()
        return " ".join(str(exc).split()) or type(exc).__name__
    return repr(outcome.result())


def last_result(retry_state: RetryCallState) -> Any:
    """A ``give_up`` for polls: the last attempt's result (or its error, raised)."""
    outcome = retry_state.outcome
    if outcome is None:
        raise RuntimeError("last_result: no attempt was made")
    return outcome.result()


def log_retry(logger: logging.Logger, what: str, *, warn_after: int = 5) -> Callable[[RetryCallState], None]:
    """A ``before_sleep`` hook: ``<what> failed; retrying attempt=N in=S error=...`` at DEBUG, at WARNING from
    attempt ``warn_after`` on. ``what`` carries the object as key=value pairs (``Prepare claim=ns/name``)."""

    def log(retry_state: RetryCallState) -> None:
        n = retry_state.attempt_number
        level = logging.WARNING if n >= warn_after else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(
                level,
                "%s failed; retrying attempt=%d in=%.2fs error=%s",
                what,
                n,
                retry_state.upcoming_sleep,
                _outcome(retry_state),
            )

    return log


def retrying(
    clock: Clock,
    *,
    wait: wait_base | Callable[[RetryCallState], float],
    stop: stop_base | Callable[[RetryCallState], bool] = stop_never,
    retry: retry_base | Callable[[RetryCallState], bool] = _ANY_ERROR,
    before: Callable[[RetryCallState], None] | None = None,
    before_sleep: Callable[[RetryCallState], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
    give_up: Callable[[RetryCallState], Any] | None = None,
) -> AsyncRetrying:
    """``AsyncRetrying`` sleeping on ``clock``; the last error is re-raised when ``stop`` ends the loop (a loop
    that retries on results ends in tenacity's ``RetryError``). A ``before_deadline`` stop gets its ``began``
    hook as ``before`` unless one is given. ``sleep`` replaces ``clock.sleep`` with another sleep on the same
    clock (one that a stop event cuts short). ``give_up`` answers instead when ``stop`` ends the loop
    (``last_result``: a poll that returns what it saw last)."""
    kwargs: dict[str, Any] = {}
    if before is None and isinstance(stop, before_deadline):
        before = stop.began
    if before is not None:
        kwargs["before"] = before
    if give_up is not None:
        kwargs["retry_error_callback"] = give_up
    return AsyncRetrying(
        sleep=sleep or clock.sleep,
        wait=wait,
        stop=stop,
        retry=retry,
        before_sleep=before_sleep,
        reraise=True,
        **kwargs,
    )


def again_on(attempts: int, *errors: type[Exception]) -> AsyncRetrying:
    """At most ``attempts`` attempts, the next at once after one of ``errors``; the last error re-raised. No
    pause: each attempt reads the object again, so the write that beat ours is what it decides on."""
    return AsyncRetrying(stop=stop_after_attempt(attempts), retry=retry_if_exception_type(errors), reraise=True)
