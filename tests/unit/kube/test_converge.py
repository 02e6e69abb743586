"""The convergence loop with fake time: coalescing, backoff, and escalation by what the error is."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from computedomain.kube.clock import FakeClock
from computedomain.kube.converge import (
    DONE,
    Converger,
    Failure,
    ReconcileResult,
    RequeueAfter,
    Retries,
    Severity,
    Stuck,
)
from computedomain.kube.errors import Conflict, Forbidden, Invalid, TooManyRequests, Transient

pytestmark = pytest.mark.timeout(5)

Reconcile = Callable[[str], Awaitable[ReconcileResult]]


class Recorder:
    """A Reporter that remembers what it was told."""

    def __init__(self) -> None:
        self.escalations: list[tuple[str, Failure]] = []
        self.recoveries: list[str] = []

    async def escalated(self, key: str, failure: Failure) -> None:
        self.escalations.append((key, failure))

    async def recovered(self, key: str) -> None:
        self.recoveries.append(key)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def running(clock: FakeClock) -> AsyncIterator[Callable[..., Converger[str]]]:
    tasks: list[asyncio.Task[None]] = []

    def start(reconcile: Reconcile, **kwargs: object) -> Converger[str]:
        retries = Retries(
            backoff_initial=0.005,
            warn_after=kwargs.pop("warn_after", 5),  # type: ignore[arg-type]
            stuck_recheck=kwargs.pop("stuck_recheck", 300.0),  # type: ignore[arg-type]
        )
        loop: Converger[str] = Converger(
            "test",
            reconcile,
            clock=clock,
            rng=random.Random(7),
            retries=retries,
            **kwargs,  # type: ignore[arg-type]
        )
        tasks.append(asyncio.create_task(loop.run()))
        return loop

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def forbidden() -> Forbidden:
    err = Forbidden('daemonsets.apps is forbidden: User "ctl" cannot create resource', status=403, reason="Forbidden")
    return err.for_request("create", "daemonsets.apps", "drv")  # type: ignore[return-value]


async def test_one_key_never_runs_twice_at_once_and_adds_coalesce(
    clock: FakeClock, running: Callable[..., Converger[str]]
) -> None:
    running_now: set[str] = set()
    overlap: list[str] = []
    calls: dict[str, int] = {}
    release = asyncio.Event()

    async def reconcile(key: str) -> ReconcileResult:
        if key in running_now:
            overlap.append(key)
        running_now.add(key)
        calls[key] = calls.get(key, 0) + 1
        await release.wait()
        running_now.discard(key)
        return DONE

    loop = running(reconcile, workers=4)
    loop.add("a")
    loop.add("b")
    await clock.settle()
    assert running_now == {"a", "b"}
    for _ in range(5):
        loop.add("a")  # all while "a" is in flight: collapse into one more run
    await clock.settle()
    assert calls == {"a": 1, "b": 1}
    release.set()
    await clock.settle()
    assert not overlap
    assert calls == {"a": 2, "b": 1}


async def test_requeue_after_is_not_a_failure(clock: FakeClock, running: Callable[..., Converger[str]]) -> None:
    seen: list[float] = []

    async def reconcile(key: str) -> ReconcileResult:
        seen.append(clock.now())
        return RequeueAfter(60.0) if len(seen) < 3 else None

    start = clock.now()
    loop = running(reconcile)
    loop.add("cd")
    await clock.settle()
    await clock.advance(60.0)
    await clock.advance(60.0)
    await clock.advance(600.0)
    assert [t - start for t in seen] == pytest.approx([0.0, 60.0, 120.0])
    assert loop.queue.num_requeues("cd") == 0


async def test_transient_errors_back_off_quietly_and_a_success_resets(
    clock: FakeClock, running: Callable[..., Converger[str]], caplog: pytest.LogCaptureFixture
) -> None:
    outcomes: list[Exception | None] = [Conflict("stale"), Transient("etcd"), Transient("etcd"), None]
    times: list[float] = []

    async def reconcile(key: str) -> ReconcileResult:
        times.append(clock.now())
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return DONE

    caplog.set_level(logging.INFO, logger="computedomain.kube.converge")
    loop = running(reconcile)
    loop.add("k")
    await clock.settle()
    for _ in range(10):
        await clock.advance(0.005)
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == pytest.approx([0.005, 0.010, 0.020], rel=0.11)
    assert loop.attempts("k") == 0
    assert loop.queue.num_requeues("k") == 0
    assert not caplog.records, "transient failures below warn_after are retried quietly"


async def test_repeated_failures_warn_once_report_once_and_recover(
    clock: FakeClock, running: Callable[..., Converger[str]], caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    failures = 8

    async def reconcile(key: str) -> ReconcileResult:
        nonlocal failures
        if failures:
            failures -= 1
            raise Transient(f"etcd leader changed ({failures})", status=500)
        return DONE

    caplog.set_level(logging.INFO, logger="computedomain.kube.converge")
    loop = running(reconcile, warn_after=5, reporter=recorder)
    loop.add("k")
    for _ in range(40):
        await clock.advance(1.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "keeps failing" in warnings[0].getMessage()
    assert "attempts=5" in warnings[0].getMessage()
    assert [(k, f.severity, f.attempts) for k, f in recorder.escalations] == [("k", Severity.REPEATED, 5)]
    assert recorder.recoveries == ["k"]
    assert any("recovered" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert loop.failing() == {}


async def test_permanent_error_parks_the_key_until_it_is_added_again(
    clock: FakeClock, running: Callable[..., Converger[str]], caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    calls = 0

    async def reconcile(key: str) -> ReconcileResult:
        nonlocal calls
        calls += 1
        raise forbidden()

    caplog.set_level(logging.INFO, logger="computedomain.kube.converge")
    loop = running(reconcile, reporter=recorder, stuck_recheck=300.0)
    loop.add("cd")
    await clock.advance(299.0)
    assert calls == 1, "a permanent error is not retried on a backoff"
    [(key, failure)] = recorder.escalations
    assert (key, failure.severity, failure.reason) == ("cd", Severity.PERMANENT, "Forbidden")
    assert "may not create daemonsets.apps in namespace drv" in failure.message
    assert "grant the verb create" in failure.message
    assert set(loop.failing()) == {"cd"}
    loop.add("cd")  # an event: the object or an input changed
    await clock.settle()
    assert calls == 2
    await clock.advance(300.0)
    assert calls == 3, "rechecked after stuck_recheck, for inputs that send no event (RBAC, quotas)"
    assert len(recorder.escalations) == 1, "the same problem is reported once"
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


async def test_a_changed_permanent_problem_is_reported_again(
    clock: FakeClock, running: Callable[..., Converger[str]]
) -> None:
    recorder = Recorder()
    errors: list[Exception] = [
        Stuck("spec.channel.resourceClaimTemplate.name 'A_b' is not a DNS subdomain", reason="InvalidSpec"),
        Invalid("metadata.name: Invalid value", status=422, reason="Invalid"),
    ]

    async def reconcile(key: str) -> ReconcileResult:
        if errors:
            raise errors.pop(0)
        return DONE

    loop = running(reconcile, reporter=recorder)
    loop.add("cd")
    await clock.settle()
    loop.add("cd")
    await clock.settle()
    loop.add("cd")
    await clock.settle()
    assert [(f.reason, f.severity) for _, f in recorder.escalations] == [
        ("InvalidSpec", Severity.PERMANENT),
        ("Invalid", Severity.PERMANENT),
    ]
    assert recorder.recoveries == ["cd"]


async def test_unexpected_errors_log_their_traceback_once_and_escalate_at_once(
    clock: FakeClock, running: Callable[..., Converger[str]], caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()

    async def reconcile(key: str) -> ReconcileResult:
        raise KeyError("a bug")

    caplog.set_level(logging.INFO, logger="computedomain.kube.converge")
    loop = running(reconcile, reporter=recorder)
    loop.add("k")
    for _ in range(10):
        await clock.advance(1.0)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1
    assert [(f.severity, f.reason) for _, f in recorder.escalations] == [(Severity.REPEATED, "InternalError")]
    assert loop.attempts("k") > 3


async def test_too_many_requests_waits_at_least_retry_after(
    clock: FakeClock, running: Callable[..., Converger[str]]
) -> None:
    times: list[float] = []

    async def reconcile(key: str) -> ReconcileResult:
        times.append(clock.now())
        if len(times) == 1:
            raise TooManyRequests("throttled", status=429, retry_after=30.0)
        return DONE

    loop = running(reconcile)
    loop.add("k")
    await clock.settle()
    await clock.advance(29.0)
    assert len(times) == 1
    await clock.advance(1.5)
    assert len(times) == 2
    assert times[1] - times[0] == pytest.approx(30.0)


async def test_spacing_coalesces_adds_into_one_run_per_window(
    clock: FakeClock, running: Callable[..., Converger[str]]
) -> None:
    times: list[float] = []

    async def reconcile(key: str) -> ReconcileResult:
        times.append(clock.now())
        return DONE

    start = clock.now()
    loop = running(reconcile, spacing=1.0)
    loop.add("sweep")
    await clock.settle()
    for _ in range(10):
        loop.add("sweep")
        await clock.advance(0.05)
    await clock.advance(2.0)
    assert [t - start for t in times] == pytest.approx([0.0, 1.0])


async def test_every_repeats_a_key_after_each_success(clock: FakeClock, running: Callable[..., Converger[str]]) -> None:
    times: list[float] = []

    async def reconcile(key: str) -> ReconcileResult:
        times.append(clock.now())
        return DONE

    start = clock.now()
    loop = running(reconcile, every=600.0)
    loop.add("cleanup")
    await clock.settle()
    await clock.advance(1300.0)
    assert [t - start for t in times] == pytest.approx([0.0, 600.0, 1200.0])


async def test_cancelling_the_loop_marks_keys_done(clock: FakeClock) -> None:
    started = asyncio.Event()

    async def reconcile(key: str) -> ReconcileResult:
        started.set()
        await asyncio.Event().wait()
        return DONE

    loop: Converger[str] = Converger("test", reconcile, clock=clock)
    task = asyncio.create_task(loop.run())
    loop.add("k")
    await asyncio.wait_for(started.wait(), 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loop.queue.processing == frozenset()
