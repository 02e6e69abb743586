"""Supervision of a real child process, and SIGUSR1 coalescing with fake time.

The child is a small Python program that records what happens to it (start, SIGTERM, SIGUSR1) in an event
file and holds an exclusive flock on a shared lock file while alive: a second child alive at the same time
cannot take the lock and records OVERLAP. Backoff, the stop timeout and the SIGUSR1 window are measured in
fake time (``FakeClock``), so "restarted after the backoff, not before" is an exact assertion: before it,
the supervisor is provably still parked on the clock. Real time is only waited on for what the child does
(start, exit), with generous guards; no assertion waits for something not to happen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from computedomain.kube.clock import FakeClock
from imex.daemon.process import ImexProcess, ReloadCoalescer

GUARD_S = 30.0

CHILD = r"""
import fcntl, os, signal, sys, time
events, lock = sys.argv[1], sys.argv[2]
pid = os.getpid()
def note(what):
    with open(events, "a") as f:
        f.write(f"{what} {pid}\n")
fd = os.open(lock, os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    note("OVERLAP")
    fcntl.flock(fd, fcntl.LOCK_EX)
def on_term(*_):
    if os.environ.get("CHILD_IGNORE_TERM"):
        note("term-ignored")
        return
    note("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, lambda *_: note("usr1"))
note("start")
print(f"hello from child {pid}", flush=True)
print("second line", flush=True)
while True:
    time.sleep(0.05)
"""


class Child:
    def __init__(self, tmp_path: Path) -> None:
        self.script = tmp_path / "child.py"
        self.script.write_text(CHILD)
        self.events = tmp_path / "events"
        self.lock = tmp_path / "lock"

    def argv(self) -> list[str]:
        return [sys.executable, str(self.script), str(self.events), str(self.lock)]

    def lines(self) -> list[str]:
        return self.events.read_text().splitlines() if self.events.exists() else []

    def pids(self, what: str) -> list[int]:
        return [int(line.split()[1]) for line in self.lines() if line.split()[0] == what]


async def until(what: str, predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def child(tmp_path: Path) -> Child:
    return Child(tmp_path)


async def test_start_logs_child_output_line_by_line(child: Child, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="imex.daemon.nvidia-imex")
    proc = ImexProcess(child.argv(), clock=FakeClock())
    assert await proc.start() is True
    assert await proc.start() is False  # already running
    pid = proc.pid
    assert pid is not None
    await until("both lines logged", lambda: "second line" in caplog.text)
    messages = [r.getMessage() for r in caplog.records if r.name == "imex.daemon.nvidia-imex"]
    assert messages[:2] == [f"nvidia-imex[{pid}]: hello from child {pid}", f"nvidia-imex[{pid}]: second line"]
    assert await proc.stop() == 0


async def test_killed_child_is_restarted_after_exponential_backoff(child: Child) -> None:
    clock = FakeClock()
    proc = ImexProcess(child.argv(), clock=clock, backoff_initial=2.0, backoff_max=60.0)
    await proc.start()
    await until("first start", lambda: len(child.pids("start")) == 1)
    first = child.pids("start")[0]

    os.kill(first, signal.SIGKILL)
    await until("exit noticed", lambda: proc.unexpected_exits == 1)
    await until("backoff sleep", lambda: clock.sleepers == 1)
    assert not alive(first)  # reaped before anything else happens
    await clock.advance(1.9)
    assert clock.sleepers == 1 and proc.starts == 1, "restarted before the backoff elapsed"
    await clock.advance(0.2)
    await until("second start", lambda: len(child.pids("start")) == 2)
    second = child.pids("start")[1]
    assert proc.pid == second

    os.kill(second, signal.SIGKILL)  # crashes again at once: the delay doubles
    await until("second exit noticed", lambda: proc.unexpected_exits == 2)
    await until("backoff sleep", lambda: clock.sleepers == 1)
    await clock.advance(3.9)
    assert clock.sleepers == 1 and proc.starts == 2
    await clock.advance(0.2)
    await until("third start", lambda: len(child.pids("start")) == 3)

    assert await proc.stop() == 0
    assert "OVERLAP" not in child.events.read_text()
    assert clock.sleepers == 0 and not proc.wanted, "a stopped process has nothing left that could restart it"
    await clock.advance(1000)
    assert proc.starts == 3


async def test_backoff_resets_after_a_long_run(child: Child) -> None:
    clock = FakeClock()
    proc = ImexProcess(child.argv(), clock=clock, backoff_initial=1.0, backoff_max=8.0)
    await proc.start()
    await until("first start", lambda: len(child.pids("start")) == 1)
    for n in range(1, 4):  # three quick crashes: 1, 2, 4
        pid = child.pids("start")[-1]
        os.kill(pid, signal.SIGKILL)
        await until("exit", lambda n=n: proc.unexpected_exits == n)  # type: ignore[misc]
        await until("sleep", lambda: clock.sleepers == 1)
        await clock.advance(2 ** (n - 1))
        await until("restart", lambda n=n: len(child.pids("start")) == n + 1)  # type: ignore[misc]
    await clock.advance(10)  # the child now runs longer than the maximum delay
    os.kill(child.pids("start")[-1], signal.SIGKILL)
    await until("exit", lambda: proc.unexpected_exits == 4)
    await until("sleep", lambda: clock.sleepers == 1)
    await clock.advance(1.0)  # back to the initial delay instead of 8
    await until("restart after reset", lambda: len(child.pids("start")) == 5)
    await proc.stop()


async def test_child_killed_during_restart_never_leaves_two_children(
    child: Child, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHILD_IGNORE_TERM", "1")
    clock = FakeClock()
    proc = ImexProcess(child.argv(), clock=clock, stop_timeout=GUARD_S, backoff_initial=1.0)
    await proc.start()
    await until("first start", lambda: len(child.pids("start")) == 1)
    old = child.pids("start")[0]

    restart = asyncio.create_task(proc.restart("index changed"))
    await until("SIGTERM delivered and ignored", lambda: child.pids("term-ignored") == [old])
    assert not restart.done()
    assert len(child.pids("start")) == 1, "the new child must wait for the old one to be gone"
    os.kill(old, signal.SIGKILL)  # dies in the middle of the restart
    await asyncio.wait_for(restart, GUARD_S)
    await until("new child started", lambda: len(child.pids("start")) >= 2)
    starts = child.pids("start")
    assert len(starts) == 2 and starts[0] == old and not alive(old)
    assert proc.pid == starts[1]

    # The supervisor saw the old child die too (the restart reaped it); it must not add a third child. It
    # would first park on the clock for its backoff: it does not.
    await clock.settle()
    assert clock.sleepers == 0 and proc.unexpected_exits == 0
    await clock.advance(100)
    assert len(child.pids("start")) == 2
    assert "OVERLAP" not in child.events.read_text()

    # A child that ignores SIGTERM is killed after the stop timeout.
    proc.stop_timeout = 5.0
    stopping = asyncio.create_task(proc.stop())
    await until("SIGTERM ignored again", lambda: child.pids("term-ignored") == [old, starts[1]])
    await clock.advance(4.9)
    assert alive(starts[1]) and not stopping.done(), "killed before the stop timeout"
    await clock.advance(0.2)
    assert await asyncio.wait_for(stopping, GUARD_S) == -signal.SIGKILL
    assert not alive(starts[1])


async def test_graceful_stop_sends_sigterm_and_waits(child: Child) -> None:
    proc = ImexProcess(child.argv(), clock=FakeClock())
    await proc.start()
    await until("start", lambda: len(child.pids("start")) == 1)
    pid = child.pids("start")[0]
    assert await proc.stop() == 0
    assert child.pids("term") == [pid]
    assert not alive(pid)
    assert proc.pid is None and not proc.wanted
    assert await proc.stop() == 0  # idempotent: reports the last child's status


async def test_reload_reaches_the_child_as_one_sigusr1_per_window(child: Child) -> None:
    clock = FakeClock()
    proc = ImexProcess(child.argv(), clock=clock, reload_interval=5.0)
    await proc.start()
    await until("start", lambda: len(child.pids("start")) == 1)
    # Just started: the child resolved everything itself, so a reload waits for the window.
    proc.request_reload()
    proc.request_reload()
    assert proc.reloads.sent == 0 and proc.reloads.pending and proc.reloads.coalesced == 1
    await clock.advance(5.3)
    await until("one SIGUSR1", lambda: len(child.pids("usr1")) == 1)
    assert proc.reloads.sent == 1 and not proc.reloads.pending
    await proc.stop()


# --------------------------------------------------------------------------------------------------------
# ReloadCoalescer in fake time


class Sink:
    def __init__(self, clock: FakeClock, ok: bool = True) -> None:
        self.clock = clock
        self.times: list[float] = []
        self.ok = ok

    def __call__(self) -> bool:
        self.times.append(self.clock.now())
        return self.ok


async def test_coalescer_first_request_goes_out_at_once_then_one_per_window() -> None:
    clock = FakeClock(start=100.0)
    sink = Sink(clock)
    c = ReloadCoalescer(sink, interval=5.0, margin=0.25, clock=clock)
    c.request()
    assert sink.times == [100.0]
    for _ in range(3):  # a burst inside the window: one deferred send
        await clock.advance(1.0)
        c.request()
    assert sink.times == [100.0] and c.pending and c.coalesced == 2
    await clock.advance(2.2)  # t = 105.2: still inside the window (5 s + margin)
    assert sink.times == [100.0]
    await clock.advance(0.05)  # t = 105.25
    assert sink.times == [100.0, 105.25]
    assert not c.pending
    await clock.advance(10.0)
    c.request()  # long after: immediate again
    assert sink.times == [100.0, 105.25, 115.25]
    gaps = [b - a for a, b in zip(sink.times, sink.times[1:], strict=False)]
    assert all(gap >= 5.0 for gap in gaps)


async def test_coalescer_reset_drops_pending_and_restarts_the_window() -> None:
    clock = FakeClock(start=0.0)
    sink = Sink(clock)
    c = ReloadCoalescer(sink, interval=5.0, margin=0.0, clock=clock)
    c.request()
    await clock.advance(1.0)
    c.request()
    assert c.pending
    c.reset()  # a fresh child started at t=1 and read the mapping itself
    assert not c.pending
    await clock.advance(10.0)
    assert sink.times == [0.0]
    c.request()
    assert sink.times == [0.0, 11.0]
    c.reset()
    c.request()
    assert sink.times == [0.0, 11.0]
    await clock.advance(5.0)
    assert sink.times == [0.0, 11.0, 16.0]


async def test_coalescer_counts_only_delivered_signals() -> None:
    clock = FakeClock(start=0.0)
    sink = Sink(clock, ok=False)
    c = ReloadCoalescer(sink, interval=5.0, clock=clock)
    c.request()
    assert sink.times == [0.0] and c.sent == 0
    c.cancel()
