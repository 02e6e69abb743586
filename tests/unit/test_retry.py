"""The tenacity building blocks: the capped, jittered backoff, the stop before a deadline on an injected clock,
the retry log that escalates from DEBUG to WARNING, and the loop that re-raises the last error. Time is a clock
that jumps on every sleep: tenacity's ``sleep`` hook is the clock's, so nothing sleeps for real."""

from __future__ import annotations

import logging
import random

import pytest
from tenacity import retry_if_exception_type, stop_after_attempt

from computedomain.retry import Backoff, again_on, before_deadline, log_retry, retrying
from tests.unit.jump_clock import JumpClock

SEED = 20261202


class Flaky:
    """Fails ``failures`` times (each attempt taking ``takes`` seconds on the clock), then answers ``"ok"``."""

    def __init__(self, clock: JumpClock, failures: int, *, takes: float = 0.0, error: type[Exception] = OSError):
        self.clock = clock
        self.failures = failures
        self.takes = takes
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.takes:
            await self.clock.sleep(self.takes)
        if self.calls <= self.failures:
            raise self.error(f"attempt {self.calls} failed")
        return "ok"


def test_backoff_doubles_to_the_cap_without_spread() -> None:
    backoff = Backoff(0.25, 3.0, spread=0)
    assert [backoff.delay(n) for n in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert backoff.delay(0) == 0.25
    assert backoff.delay(10_000) == 3.0  # no overflow however long a loop runs


def test_backoff_jitter_stays_within_the_spread_and_follows_the_seed() -> None:
    print(f"seed={SEED}")
    backoff = Backoff(0.25, 3.0, spread=0.5, rng=random.Random(SEED))
    delays = [backoff.delay(n) for n in range(1, 200)]
    bases = [min(3.0, 0.25 * 2 ** min(n - 1, 64)) for n in range(1, 200)]
    assert all(0.5 * b <= d < 1.5 * b for d, b in zip(delays, bases, strict=True))
    assert len(set(delays)) == len(delays)  # jittered: no two equal
    again = Backoff(0.25, 3.0, spread=0.5, rng=random.Random(SEED))
    assert [again.delay(n) for n in range(1, 200)] == delays


def test_backoff_refuses_a_spread_that_could_make_a_delay_negative() -> None:
    with pytest.raises(ValueError, match="spread"):
        Backoff(1.0, 2.0, spread=1.0)


async def test_retrying_sleeps_the_backoff_on_the_clock_and_returns_the_answer() -> None:
    clock = JumpClock()
    flaky = Flaky(clock, failures=4)
    result = await retrying(clock, wait=Backoff(1.0, 4.0, spread=0))(flaky)
    assert result == "ok"
    assert flaky.calls == 5
    assert clock.sleeps == [1.0, 2.0, 4.0, 4.0]


async def test_retrying_re_raises_the_last_error_not_a_retry_error() -> None:
    clock = JumpClock()
    flaky = Flaky(clock, failures=10)
    with pytest.raises(OSError, match="attempt 3 failed"):
        await retrying(clock, wait=Backoff(1.0, 1.0, spread=0), stop=stop_after_attempt(3))(flaky)


async def test_an_error_outside_the_retry_predicate_ends_the_loop_at_once() -> None:
    clock = JumpClock()
    flaky = Flaky(clock, failures=10, error=KeyError)
    with pytest.raises(KeyError):
        await retrying(clock, wait=Backoff(1.0, 1.0, spread=0), retry=retry_if_exception_type(OSError))(flaky)
    assert flaky.calls == 1
    assert clock.sleeps == []


async def test_before_deadline_keeps_room_for_the_next_attempt() -> None:
    """Attempts of 1 s, 1 s apart, a deadline at 10 s and room for twice the last attempt: the fourth attempt
    ends at 7 s, and 7 + 1 (sleep) + 2 x 1 (reserve) reaches the deadline, so there is no fifth."""
    clock = JumpClock()
    flaky = Flaky(clock, failures=100, takes=1.0)
    stop = before_deadline(clock, 10.0, reserve=2.0)
    with pytest.raises(OSError, match="attempt 4 failed"):
        await retrying(clock, wait=Backoff(1.0, 1.0, spread=0), stop=stop)(flaky)
    assert flaky.calls == 4
    assert clock.now() == 7.0
    assert stop.remaining() == 3.0


async def test_before_deadline_without_reserve_starts_no_attempt_past_the_deadline() -> None:
    clock = JumpClock()
    flaky = Flaky(clock, failures=100, takes=0.5)
    with pytest.raises(OSError):
        await retrying(clock, wait=Backoff(1.0, 1.0, spread=0), stop=before_deadline(clock, 5.0))(flaky)
    # attempts start at 0, 1.5, 3.0 and 4.5 (each 0.5 s, then 1 s of sleep); a fifth would start at 6.0
    assert flaky.calls == 4
    assert clock.now() == 5.0


async def test_log_retry_is_quiet_at_first_and_warns_from_the_nth_attempt(caplog: pytest.LogCaptureFixture) -> None:
    clock = JumpClock()
    logger = logging.getLogger("computedomain.test_retry")
    caplog.set_level(logging.DEBUG, logger=logger.name)
    flaky = Flaky(clock, failures=5)
    hook = log_retry(logger, "label node node=n1", warn_after=3)
    await retrying(clock, wait=Backoff(0.5, 8.0, spread=0), before_sleep=hook)(flaky)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.DEBUG, logging.DEBUG, logging.WARNING, logging.WARNING, logging.WARNING]
    assert not any(r.levelno == logging.INFO for r in caplog.records)
    assert caplog.records[2].getMessage() == (
        "label node node=n1 failed; retrying attempt=3 in=2.00s error=attempt 3 failed"
    )


async def test_again_on_retries_only_the_named_errors_at_once_and_re_raises_the_last() -> None:
    clock = JumpClock()
    flaky = Flaky(clock, failures=2, error=ConnectionResetError)
    assert await again_on(3, ConnectionResetError)(flaky) == "ok"
    assert flaky.calls == 3
    flaky = Flaky(clock, failures=5, error=ConnectionResetError)
    with pytest.raises(ConnectionResetError, match="attempt 3 failed"):
        await again_on(3, ConnectionResetError)(flaky)
    flaky = Flaky(clock, failures=5, error=KeyError)
    with pytest.raises(KeyError):
        await again_on(3, ConnectionResetError)(flaky)
    assert flaky.calls == 1
