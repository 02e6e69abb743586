"""The daemon's start-up steps (label own pod, register our entry) outlast a slow apiserver: transient errors
are retried with doubling pauses on the daemon's clock, permanent ones end the daemon, SIGTERM ends the wait."""

from __future__ import annotations

import asyncio
import logging

import pytest

from computedomain.kube.clock import FakeClock
from computedomain.kube.converge import Retries
from computedomain.kube.errors import Forbidden, Transient
from imex.daemon.run import persist

RETRIES = Retries(backoff_initial=0.005, backoff_max=4.0, warn_after=3)


class Step:
    """Fails with the scripted errors, then answers "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def timeout() -> Transient:
    return Transient("patch /api/v1/namespaces/ns/pods/p: no response within 10s", reason="Timeout")


async def test_transient_errors_are_retried_with_doubling_pauses(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    step = Step(*(timeout() for _ in range(5)))
    caplog.set_level(logging.DEBUG, logger="imex.daemon.run")
    task = asyncio.create_task(persist("label own pod", step, asyncio.Event(), RETRIES, clock))
    # 0.5 s (the floor over backoff_initial), doubling, capped at backoff_max: no attempt before its time.
    for calls, pause in enumerate([0.5, 1.0, 2.0, 4.0, 4.0], start=1):
        await clock.settle()
        assert step.calls == calls and clock.sleepers == 1
        await clock.advance(pause - 0.01)
        assert step.calls == calls
        await clock.advance(0.01)
    assert await task == "done"
    assert step.calls == 6
    levels = [r.levelno for r in caplog.records]
    # quiet while it may still recover, then a warning per attempt: never a loop of INFO lines
    assert levels == [logging.DEBUG, logging.DEBUG, logging.WARNING, logging.WARNING, logging.WARNING]
    assert "label own pod failed; retrying attempt=1 in=0.50s error=patch" in caplog.records[0].getMessage()


async def test_a_permanent_error_is_raised_at_once() -> None:
    step = Step(Forbidden("pods is forbidden: cannot patch", status=403))
    with pytest.raises(Forbidden):
        await persist("label own pod", step, asyncio.Event(), RETRIES, FakeClock())
    assert step.calls == 1


async def test_stop_ends_the_wait_between_attempts() -> None:
    clock = FakeClock()
    stop = asyncio.Event()
    step = Step(timeout(), timeout())
    task = asyncio.create_task(persist("register our entry", step, stop, RETRIES, clock))
    await clock.settle()
    assert clock.sleepers == 1 and step.calls == 1
    stop.set()
    assert await task is None
    assert step.calls == 1
