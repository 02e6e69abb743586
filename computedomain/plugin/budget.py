"""The time one kubelet call gives a claim, and how attempts are retried within it.

The kubelet gives NodePrepareResources and NodeUnprepareResources 45 s. Each claim gets ``Budget.seconds``
(``PREPARE_BUDGET``, default 40 s) so that our answer still arrives in time. ``within_budget`` runs attempts
until one succeeds, one fails permanently, or the budget is spent; retryable failures back off from
``backoff_initial`` doubling to ``backoff_max``, each delay jittered (0.5x..1.5x).

What the kubelet gets when the budget is spent depends on how the last attempt ended:

* it failed retryably: that error, as ``retryable error: <why> (still failing after N attempts in 40s; the
  kubelet will call again)``, on one line, because the kubelet puts it into the pod's Events as it is. An
  attempt is not started when twice the last one's time would not fit after the backoff, so the budget
  ends on the error just seen rather than on a cut attempt;
* it was still running, or waiting for something on its way (``StillWaitingError``): nothing, the claim is
  left out of the answer, which the kubelet also treats as "call again".

A permanent failure ends the claim's call at once with ``permanent error: <why>``.

Time is the injected ``Clock`` (deadline, backoff sleeps and the cut of a running attempt), so unit tests
decide with a fake clock when the budget ends.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from computedomain.kube.clock import Clock, run_within
from computedomain.metrics import Counter
from computedomain.plugin.failures import ClaimError, RetryableError, StillWaitingError, classify
from computedomain.plugin.preparer import ClaimRef

__all__ = ["Budget", "within_budget"]

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    delay = budget.backoff_initial
    attempts = 0
    last = ""
    last_failed: ClaimError | None = None
    while True:
        attempts += 1
        began = clock.now()
        try:
            return await run_within(clock, max(deadline - began, 0.001), attempt(deadline))
        except TimeoutError:
            last = last or "no answer within the budget"
            last_failed = None  # the budget ended an attempt in progress
            break
        except Exception as exc:
            err = classify(exc)
            if err is None:
                log.exception("%s failed unexpectedly claim=%s", operation, ref)
                err = RetryableError(f"internal error: {type(exc).__name__}: {exc}")
            ATTEMPT_ERRORS.labels(operation, type(exc).__name__).inc()
            if not err.retryable:
                log.warning("%s failed permanently claim=%s attempt=%d error=%s", operation, ref, attempts, err)
                return failed(f"permanent error: {err}")
            last = str(err)
            last_failed = None if isinstance(err, StillWaitingError) else err
            sleep = delay * (0.5 + rng.random())
            now = clock.now()
            # Twice the last attempt's time must be left after the backoff: an attempt the budget would cut
            # short tells the user less than the error just seen.
            if now + sleep + 2 * (now - began) >= deadline:
                break
            log.info(
                "%s attempt failed; retrying claim=%s attempt=%d in=%.2fs error=%s",
                operation,
                ref,
                attempts,
                sleep,
                err,
            )
            await clock.sleep(sleep)
            delay = min(delay * 2, budget.backoff_max)
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
