"""The Prepare budget as a tenacity loop: how many attempts fit, what the kubelet gets when the budget ends, and
the retry log that stays below INFO until a claim keeps failing. Time is the fake clock, moved past the budget
in one step: it wakes each sleeper at its own deadline, so every attempt, backoff and cut happens at its time."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from computedomain.kube.clock import FakeClock
from computedomain.plugin.budget import Budget, within_budget
from computedomain.plugin.failures import ClaimRejected, NotReadyError, RetryableError
from computedomain.plugin.preparer import ClaimRef, ClaimUid

REF = ClaimRef("ns", "claim", ClaimUid("uid-1"))
SEED = 4242
T = TypeVar("T")


class Attempts:
    """Each attempt takes ``takes`` seconds on the clock, then raises the next scripted error or answers."""

    def __init__(self, clock: FakeClock, errors: list[Exception], *, takes: float = 0.0) -> None:
        self.clock = clock
        self.errors = errors
        self.takes = takes
        self.calls = 0
        self.deadlines: list[float] = []
        self.ended: list[float] = []

    async def __call__(self, deadline: float) -> str:
        self.calls += 1
        self.deadlines.append(deadline)
        await self.clock.sleep(self.takes)
        self.ended.append(self.clock.now())
        if self.errors:
            raise self.errors.pop(0) if len(self.errors) > 1 else self.errors[0]
        return "prepared"


async def finish(clock: FakeClock, coro: Coroutine[Any, Any, T], seconds: float) -> T:
    task = asyncio.ensure_future(coro)
    await clock.advance(seconds + 1)
    assert task.done(), "the budget did not end on time"
    return task.result()


async def run(clock: FakeClock, attempts: Attempts, seconds: float = 40.0) -> str | None:
    print(f"seed={SEED}")
    call = within_budget(
        Budget(seconds, backoff_initial=0.25, backoff_max=3.0),
        REF,
        "Prepare",
        attempts,
        lambda why: f"failed: {why}",
        clock=clock,
        rng=random.Random(SEED),
    )
    return await finish(clock, call, seconds)


async def test_success_after_retryable_errors_within_the_budget() -> None:
    clock = FakeClock(0.0)
    failures = [RetryableError("a"), RetryableError("b"), RetryableError("c")]
    ended: list[float] = []

    async def attempt(deadline: float) -> str:
        ended.append(clock.now())
        if failures:
            raise failures.pop(0)
        return "prepared"

    call = within_budget(Budget(40.0), REF, "Prepare", attempt, str, clock=clock, rng=random.Random(SEED))
    assert await finish(clock, call, 40.0) == "prepared"
    assert len(ended) == 4
    # three backoffs of 0.25, 0.5 and 1.0 s, each jittered 0.5x..1.5x
    assert 0.875 <= ended[-1] < 2.625


async def test_a_permanent_error_ends_the_call_at_once() -> None:
    clock = FakeClock(0.0)
    attempts = Attempts(clock, [ClaimRejected("bad opaque config")], takes=0.5)
    assert await run(clock, attempts) == "failed: permanent error: bad opaque config"
    assert attempts.calls == 1
    assert attempts.ended == [0.5]


async def test_the_budget_ends_on_the_error_just_seen_with_room_for_the_next_attempt_kept() -> None:
    """Attempts of 2 s that keep failing: no attempt starts that twice the last one's time would not fit
    after its backoff, so every attempt ends inside the budget and the kubelet gets the last error."""
    clock = FakeClock(0.0)
    attempts = Attempts(clock, [RetryableError("host IMEX daemon\nnot READY")], takes=2.0)
    answer = await run(clock, attempts, seconds=20.0)
    assert answer is not None
    assert answer.startswith("failed: retryable error: host IMEX daemon not READY (still failing after ")
    assert f"after {attempts.calls} attempts in 20s; the kubelet will call again)" in answer
    assert attempts.calls >= 4
    assert attempts.ended[-1] <= 20.0  # every attempt ended inside the budget, none was cut
    assert attempts.ended[-1] + 3.0 * 1.5 + 2 * 2.0 >= 20.0  # the longest backoff and the reserve did not fit
    assert set(attempts.deadlines) == {20.0}


async def test_waiting_for_readiness_until_the_budget_ends_is_left_out_of_the_answer() -> None:
    clock = FakeClock(0.0)
    attempts = Attempts(clock, [NotReadyError("daemon of domain d not Ready")], takes=1.0)
    assert await run(clock, attempts, seconds=10.0) is None


async def test_an_attempt_still_running_when_the_budget_ends_is_left_out() -> None:
    clock = FakeClock(0.0)

    async def hangs(deadline: float) -> str:
        await asyncio.Event().wait()
        return "never"

    call = within_budget(Budget(5.0), REF, "Prepare", hangs, str, clock=clock, rng=random.Random(SEED))
    assert await finish(clock, call, 5.0) is None


async def test_retries_log_below_info_until_the_fifth_attempt(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(0.0)
    caplog.set_level(logging.DEBUG, logger="computedomain.plugin.budget")
    attempts = Attempts(clock, [RetryableError("daemon not ready")], takes=0.01)
    await run(clock, attempts, seconds=40.0)
    retries = [r for r in caplog.records if "failed; retrying" in r.getMessage()]
    assert len(retries) == attempts.calls - 1 > 5
    assert {r.levelno for r in retries[:4]} == {logging.DEBUG}
    assert {r.levelno for r in retries[4:]} == {logging.WARNING}
    assert retries[0].getMessage().startswith(f"Prepare claim={REF} failed; retrying attempt=1 in=")
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
