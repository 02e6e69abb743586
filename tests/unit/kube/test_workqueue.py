"""Work queue semantics with fake time: dedupe, one-at-a-time per key, backoff, rate limit, delays, holds,
shutdown; and the client's in-flight slots, which wait on the same primitive. The workers and escalation are
tested in test_converge."""

from __future__ import annotations

import asyncio
import random

import pytest

from computedomain.kube.clock import FakeClock
from computedomain.kube.ratelimit import ItemBackoff, Slots, TokenBucket
from computedomain.kube.workqueue import QueueShutDown, WorkQueue

pytestmark = pytest.mark.timeout(5)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_queue(clock: FakeClock, *, jitter: float = 0.0, rate: float = 1000.0, burst: int = 1000) -> WorkQueue[str]:
    return WorkQueue(
        "test",
        clock=clock,
        backoff=ItemBackoff(base=0.005, cap=10.0, jitter=jitter, rng=random.Random(7)),
        bucket=TokenBucket(rate, burst, clock=clock),
    )


async def get_now(q: WorkQueue[str]) -> str:
    return await asyncio.wait_for(q.get(), 0.5)


async def test_dedupes_pending_keys(clock: FakeClock) -> None:
    q = make_queue(clock)
    for key in ["a", "b", "a", "a", "b", "c"]:
        q.add(key)
    assert len(q) == 3
    assert [await get_now(q) for _ in range(3)] == ["a", "b", "c"]
    assert len(q) == 0


async def test_key_added_while_processing_runs_again_after_done(clock: FakeClock) -> None:
    q = make_queue(clock)
    q.add("a")
    assert await get_now(q) == "a"
    q.add("a")
    q.add("a")
    assert len(q) == 0, "a key being processed must not be handed out again"
    assert q.processing == frozenset({"a"})
    q.done("a")
    assert len(q) == 1
    assert await get_now(q) == "a"
    q.done("a")
    assert q.is_idle()


async def test_backoff_grows_exponentially_and_resets_on_forget(clock: FakeClock) -> None:
    q = make_queue(clock)
    delays = [q.add_rate_limited("a") for _ in range(6)]
    assert delays == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.08, 0.16])
    assert q.num_requeues("a") == 6
    assert q.num_requeues("b") == 0, "backoff is per key"
    q.forget("a")
    assert q.num_requeues("a") == 0
    assert q.add_rate_limited("a") == pytest.approx(0.005)


def test_backoff_is_capped_and_jittered() -> None:
    backoff: ItemBackoff[str] = ItemBackoff(base=0.005, cap=10.0, jitter=0.1, rng=random.Random(1))
    delays = [backoff.when("k") for _ in range(40)]
    for n, d in enumerate(delays):
        nominal = min(10.0, 0.005 * 2**n)
        assert nominal <= d <= nominal * 1.1
    assert len({round(d, 9) for d in delays[-10:]}) > 1, "jitter spreads capped retries"


async def test_rate_limited_key_is_ready_only_after_its_backoff(clock: FakeClock) -> None:
    q = make_queue(clock)
    for _ in range(4):
        q.add_rate_limited("a")  # backoff now at 0.04 s for the 4th failure
    # Only the earliest scheduled time counts (0.005 s).
    assert q.waiting["a"] == pytest.approx(clock.now() + 0.005)
    getter = asyncio.create_task(q.get())
    await clock.settle()
    assert not getter.done()
    await clock.advance(0.004)
    assert not getter.done()
    await clock.advance(0.002)
    assert getter.done()
    assert getter.result() == "a"


async def test_global_token_bucket_spreads_failures_of_many_keys(clock: FakeClock) -> None:
    q = make_queue(clock, rate=10.0, burst=2)
    delays = [q.add_rate_limited(f"k{i}") for i in range(6)]
    # First two ride the burst (per-item 5 ms), then 10/s: 0.1, 0.2, 0.3, 0.4 s.
    assert delays == pytest.approx([0.005, 0.005, 0.1, 0.2, 0.3, 0.4])
    await clock.advance(0.25)
    got = [await get_now(q) for _ in range(4)]
    assert got == ["k0", "k1", "k2", "k3"]
    assert len(q) == 0


def test_token_bucket_refills(clock: FakeClock) -> None:
    bucket = TokenBucket(2.0, 2, clock=clock)
    assert [bucket.reserve() for _ in range(3)] == pytest.approx([0.0, 0.0, 0.5])
    clock._now += 10.0  # long idle: refills, but only up to the burst
    assert [bucket.reserve() for _ in range(3)] == pytest.approx([0.0, 0.0, 0.5])


async def test_add_after_delays_and_earliest_wins(clock: FakeClock) -> None:
    q = make_queue(clock)
    q.add_after("a", 30.0)
    q.add_after("a", 10.0)
    q.add_after("a", 20.0)
    q.add_after("b", 5.0)
    getter = asyncio.create_task(q.get())
    await clock.advance(4.9)
    assert not getter.done()
    await clock.advance(0.2)
    assert getter.result() == "b"
    await clock.advance(4.7)
    assert len(q) == 0
    await clock.advance(0.4)
    assert len(q) == 1
    assert await get_now(q) == "a"
    q.done("a")
    await clock.advance(100.0)
    assert len(q) == 0, "the superseded 20 s and 30 s schedules must not fire"


async def test_add_after_of_a_pending_key_is_deduped(clock: FakeClock) -> None:
    q = make_queue(clock)
    q.add("a")
    q.add_after("a", 1.0)
    await clock.advance(2.0)
    assert len(q) == 1
    assert await get_now(q) == "a"


async def test_shutdown_wakes_getters_and_stops_adds(clock: FakeClock) -> None:
    q = make_queue(clock)
    getters = [asyncio.create_task(q.get()) for _ in range(3)]
    await clock.settle()
    q.shutdown()
    for g in getters:
        with pytest.raises(QueueShutDown):
            await asyncio.wait_for(g, 0.5)
    q.add("a")
    assert len(q) == 0
    with pytest.raises(QueueShutDown):
        await get_now(q)


async def test_hold_defers_adds_and_coalesces_them(clock: FakeClock) -> None:
    q = make_queue(clock)
    q.hold("a", clock.now() + 1.0)
    for _ in range(5):
        q.add("a")
    assert len(q) == 0, "adds before the hold ends wait for it"
    await clock.advance(1.0)
    assert len(q) == 1
    assert await get_now(q) == "a"
    q.done("a")
    q.add("a")
    assert len(q) == 1, "after the hold, adds are immediate again"


async def test_delayed_keys_have_one_timer_however_many_workers_wait(clock: FakeClock) -> None:
    q = make_queue(clock)
    getters = [asyncio.create_task(q.get()) for _ in range(10)]
    q.add_after("a", 5.0)
    q.add_after("b", 3.0)
    await clock.settle()
    assert clock.sleepers == 1, "one timer task sleeps for the queue, not every waiting worker"
    await clock.advance(3.0)
    assert [g.result() for g in getters if g.done()] == ["b"]
    assert clock.sleepers == 1, "the timer sleeps again, until the next delayed key"
    await clock.advance(2.0)
    assert sorted(g.result() for g in getters if g.done()) == ["a", "b"]
    assert clock.sleepers == 0
    q.shutdown()
    await asyncio.gather(*getters, return_exceptions=True)


async def test_a_worker_cancelled_as_it_was_woken_passes_the_key_on(clock: FakeClock) -> None:
    q = make_queue(clock)
    first = asyncio.create_task(q.get())
    await clock.settle()
    second = asyncio.create_task(q.get())
    await clock.settle()
    q.add("a")  # wakes the first waiter...
    first.cancel()  # ...which is cancelled before it runs
    assert await asyncio.wait_for(second, 0.5) == "a"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_request_cancelled_as_it_was_handed_a_slot_passes_the_slot_on() -> None:
    slots = Slots(1)
    order: list[str] = []

    async def request(name: str, *, background: bool = False) -> None:
        async with slots.slot(background=background):
            order.append(name)
            await asyncio.sleep(0)

    async with slots.slot():
        cancelled = asyncio.create_task(request("cancelled"))
        report = asyncio.create_task(request("report", background=True))
        work = asyncio.create_task(request("work"))
        await asyncio.sleep(0)
    cancelled.cancel()  # handed the slot as the holder left, cancelled before it ran
    await asyncio.wait_for(asyncio.gather(work, report), 0.5)
    assert order == ["work", "report"], "the slot went on to the next foreground request, then the background one"
    assert cancelled.cancelled()
    async with asyncio.timeout(0.5), slots.slot():
        pass  # and was returned: one slot free again
