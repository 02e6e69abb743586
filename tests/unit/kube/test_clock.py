"""run_within: asyncio.timeout measured by an injectable clock."""

from __future__ import annotations

import asyncio

import pytest

from computedomain.kube.clock import FakeClock, run_within

pytestmark = pytest.mark.timeout(5)


async def test_result_error_and_timeout_follow_the_fake_clock() -> None:
    clock = FakeClock()

    async def value() -> int:
        await clock.sleep(1.0)
        return 7

    async def boom() -> None:
        raise ValueError("boom")

    task = asyncio.ensure_future(run_within(clock, 2.0, value()))
    await clock.advance(1.0)
    assert await task == 7
    with pytest.raises(ValueError, match="boom"):
        await run_within(clock, 2.0, boom())
    hung = asyncio.Event()
    task = asyncio.ensure_future(run_within(clock, 3.0, hung.wait()))
    await clock.advance(2.9)
    assert not task.done()
    await clock.advance(0.2)
    with pytest.raises(TimeoutError):
        await task


async def test_cancelling_the_caller_cancels_the_work_and_propagates() -> None:
    clock = FakeClock()
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.ensure_future(run_within(clock, 10.0, work()))
    await clock.settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()
    assert clock.sleepers == 0
