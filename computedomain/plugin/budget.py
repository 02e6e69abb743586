"""The time one kubelet call gives a claim, and how attempts are retried within it.

The kubelet gives NodePrepareResources and NodeUnprepareResources 45 s. Each claim gets ``Budget.seconds``
(``PREPARE_BUDGET``, default 40 s) so that our answer still arrives in time. ``within_budget`` runs attempts
in a tenacity loop (``computedomain.retry``) until one succeeds, one fails permanently, or the budget is
spent; retryable failures back off from ``backoff_initial`` doubling to ``backoff_max``, each delay jittered
(0.5x..1.5x). A retry is logged at DEBUG, from the fifth attempt on at WARNING.

What the kubelet gets when the budget is spent depends on how the last attempt ended:

* it failed retryably: that error, as ``retryable error: <why> (still failing after N attempts in 40s; the
  kubelet will call again)``, on one line, because the kubelet puts it into the pod's Events as it is. An
  attempt is not started when twice the last one's time would not fit after the backoff, so the budget
  ends on the error just seen rather than on a cut attempt;
* it was still running, or waiting for something on its way (``StillWaitingError``): nothing, the claim is
  left out of the answer, which the kubelet also treats as "call again".

A permanent failure ends the claim's call at once with ``permanent error: <why>``.

Time is the injected ``Clock`` (the deadline, tenacity's sleeps and the cut of a running attempt), so unit
tests decide with a fake clock when the budget ends.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeVar

from tenacity import retry_if_exception

from computedomain.kube.clock import Clock, run_within
from computedomain.metrics import Counter
from computedomain.plugin.failures import ClaimError, RetryableError, StillWaitingError, classify
from computedomain.plugin.preparer import ClaimRef
from computedomain.retry import Backoff, before_deadline, log_retry, retrying

__all__ = ["Budget", "within_budget"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: retries are logged at DEBUG, from this attempt on at WARNING (the end of the budget always is)
WARN_AFTER: Final = 5

ATTEMPT_ERRORS = Counter(
    "computedomain_plugin_attempt_errors_total",
    "Failed Prepare/Unprepare attempts by operation and error class.",
    ["operation", "error"],
)


@dataclass(frozen=True)
class Budget:
    seconds: float = 40.0
    backoff_initial: float = 0.25
    backoff_max: float = 3.0


async def within_budget(
    budget: Budget,
    ref: ClaimRef,
    operation: str,
    attempt: Callable[[float], Awaitable[T]],
    failed: Callable[[str], T],
    *,
    clock: Clock,
    rng: random.Random,
) -> T | None:
    """``attempt(deadline)`` until it returns; ``failed("permanent error: ...")`` or, when the budget is spent
    on a retryable error, ``failed("retryable error: ...")``; None when it ends on an attempt still running or
    waiting (the claim is left out of the answer). ``deadline`` is on ``clock``."""
    deadline = clock.now() + budget.seconds
    # Twice the last attempt's time must be left after the backoff: an attempt the budget would cut short
    # tells the user less than the error just seen.
    stop = before_deadline(clock, deadline, reserve=2.0)
    attempts = 0

    async def once() -> T:
        nonlocal attempts
        attempts += 1
        try:
            return await run_within(clock, max(stop.remaining(), 0.001), attempt(deadline))
        except TimeoutError:
            raise  # the budget ended an attempt in progress: not retried
        except Exception as exc:
            err = classify(exc)
            if err is None:
                log.exception("%s failed unexpectedly claim=%s", operation, ref)
                err = RetryableError(f"internal error: {type(exc).__name__}: {exc}")
            ATTEMPT_ERRORS.labels(operation, type(exc).__name__).inc()
            raise err from exc

    loop = retrying(
        clock,
        wait=Backoff(budget.backoff_initial, budget.backoff_max, spread=0.5, rng=rng),
        stop=stop,
        retry=retry_if_exception(lambda exc: isinstance(exc, ClaimError) and exc.retryable),
        before_sleep=log_retry(log, f"{operation} claim={ref}", warn_after=WARN_AFTER),
    )
    last_failed: ClaimError | None = None
    try:
        return await loop(once)
    except TimeoutError:
        last = "no answer within the budget"
    except ClaimError as err:
        if not err.retryable:
            log.warning("%s failed permanently claim=%s attempt=%d error=%s", operation, ref, attempts, err)
            return failed(f"permanent error: {err}")
        last = " ".join(str(err).split())
        last_failed = None if isinstance(err, StillWaitingError) else err
    log.warning(
        "%s not finished within %gs; the kubelet will call again claim=%s attempts=%d last_error=%s",
        operation,
        budget.seconds,
        ref,
        attempts,
        last,
    )
    if last_failed is None:
        return None
    reason = " ".join(str(last_failed).split())  # one line: the kubelet puts it into an Event as it is
    return failed(
        f"retryable error: {reason} (still failing after {attempts} attempts in {budget.seconds:g}s; "
        "the kubelet will call again)"
    )
