"""Supervision of the ``nvidia-imex`` child process.

What it owns:

* ``ImexProcess``: starts ``nvidia-imex -c <cfg>`` in the foreground, copies its combined stdout/stderr into
  our log line by line, restarts it with exponential backoff when it exits unasked (a tenacity loop with
  ``computedomain.retry.Backoff``, no jitter: one child per pod, nothing to spread; the count starts over
  after a child ran longer than the maximum delay, and every unasked exit is a WARNING), restarts it on request (``restart``: only when the daemon's
  own index changed, or in legacy IP mode when the peer list changed), and stops it gracefully: SIGTERM,
  then SIGKILL after ``stop_timeout`` (on the injected clock, like the backoff). A new child is spawned only after the previous one has been reaped
  (``wait()`` returned), so there are never two IMEX daemons fighting for the same ports and node ID;
* ``ReloadCoalescer``: IMEX honours SIGUSR1 (re-resolve peer names, reconnect) at most once per 5 s and
  silently drops the rest. A mapping change that arrives inside the window would be lost, so requests are
  coalesced: the first goes out at once, later ones inside the window become one deferred signal at the end
  of the window (plus a small margin for clock skew between the two processes). A freshly started child
  counts as "just signalled": it resolves the names itself at start, and a signal during its
  initialisation could be ignored.

The child stays in our process group and only it is signalled: when the container dies, the runtime kills
the whole group, so no orphaned IMEX daemon survives its supervisor.

Concurrency: one event loop. ``start``, ``restart`` and ``stop`` hold an ``asyncio.Lock`` for the whole
spawn or terminate-and-reap, so they never interleave. One supervisor task per ``ImexProcess`` waits for
the current child's exit; when the child it waited for is no longer the current one (``restart`` replaced
it) it waits for the new one, otherwise tenacity sleeps the backoff and the next attempt spawns under the lock. All waiting goes
through the injectable ``Clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence

from tenacity import RetryCallState, retry_if_exception_type

from computedomain.kube.clock import Clock, MonotonicClock, run_within
from computedomain.retry import Backoff, retrying

__all__ = ["ChildExited", "ImexProcess", "ReloadCoalescer"]

log = logging.getLogger(__name__)
child_log = logging.getLogger("imex.daemon.nvidia-imex")


class ChildExited(Exception):  # noqa: N818 (an event the restart loop retries on, not a failure of ours)
    """The child exited without being asked to; the supervisor restarts it after the backoff."""

    def __init__(self, pid: int, returncode: int | None, lived: float) -> None:
        super().__init__(f"pid {pid} exited with {returncode} after {lived:.1f}s")
        self.pid = pid
        self.returncode = returncode
        self.lived = lived


class ReloadCoalescer:
    """At most one ``send()`` per ``interval + margin`` seconds; requests in between become one later send."""

    def __init__(
        self,
        send: Callable[[], bool],
        *,
        interval: float = 5.0,
        margin: float = 0.25,
        clock: Clock | None = None,
    ) -> None:
        self._send = send
        self.interval = interval
        self.margin = margin if interval > 0 else 0.0
        self._clock: Clock = clock or MonotonicClock()
        self._last: float | None = None
        self._timer: asyncio.Task[None] | None = None
        self.sent = 0
        self.coalesced = 0

    @property
    def pending(self) -> bool:
        return self._timer is not None

    def request(self) -> None:
        if self._timer is not None:
            self.coalesced += 1
            return
        now = self._clock.now()
        window = self.interval + self.margin
        if self._last is None or now - self._last >= window:
            self._fire()
            return
        self._timer = asyncio.get_running_loop().create_task(self._later(self._last + window - now))

    def reset(self) -> None:
        """A fresh child started: it reads the mapping itself, so nothing pending is needed."""
        self.cancel()
        self._last = self._clock.now()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _later(self, delay: float) -> None:
        await self._clock.sleep(delay)
        self._timer = None
        self._fire()

    def _fire(self) -> None:
        self._last = self._clock.now()
        if self._send():
            self.sent += 1


class ImexProcess:
    """One supervised ``nvidia-imex`` (see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stop_timeout: float = 10.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        reload_interval: float = 5.0,
        clock: Clock | None = None,
        name: str = "nvidia-imex",
    ) -> None:
        self.argv = list(argv)
        self._env = dict(env) if env is not None else None
        self.stop_timeout = stop_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._clock: Clock = clock or MonotonicClock()
        self.name = name
        self._lock = asyncio.Lock()
        self._child: asyncio.subprocess.Process | None = None
        self._child_started = 0.0
        self._pump: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._wanted = False
        self._failures = 0
        self.starts = 0
        #: set once the first child was spawned (the readiness mirror's early check waits for it)
        self.spawned = asyncio.Event()
        self.unexpected_exits = 0
        self.reloads = ReloadCoalescer(self._send_sigusr1, interval=reload_interval, clock=self._clock)

    # ---- observation ----------------------------------------------------------------------------------

    @property
    def wanted(self) -> bool:
        """True between ``start`` and ``stop``, also while a crashed child waits for its restart."""
        return self._wanted

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.pid if child is not None and child.returncode is None else None

    # ---- control --------------------------------------------------------------------------------------

    async def start(self) -> bool:
        """Make sure the child runs and is supervised. True when this call started it."""
        async with self._lock:
            if self._wanted and self._child is not None and self._child.returncode is None:
                return False
            self._wanted = True
            if self._child is None or self._child.returncode is not None:
                await self._reap_locked()
                await self._spawn_locked()
            if self._supervisor is None or self._supervisor.done():
                self._supervisor = asyncio.get_running_loop().create_task(
                    self._supervise(), name=f"{self.name}-supervisor"
                )
            return True

    async def restart(self, reason: str) -> None:
        """Stop the child gracefully, reap it, start a new one (its config changed)."""
        async with self._lock:
            log.info("restarting %s reason=%s pid=%s", self.name, reason, self.pid)
            self._wanted = True
            await self._terminate_locked()
            await self._spawn_locked()
            if self._supervisor is None or self._supervisor.done():
                self._supervisor = asyncio.get_running_loop().create_task(
                    self._supervise(), name=f"{self.name}-supervisor"
                )

    def request_reload(self) -> None:
        """Ask the child to re-resolve its peers (SIGUSR1), coalesced to IMEX's window."""
        self.reloads.request()

    async def stop(self) -> int | None:
        """Graceful stop: SIGTERM, SIGKILL after ``stop_timeout``; returns the exit status (None if none ran)."""
        self._wanted = False
        self.reloads.cancel()
        # Cancel the supervisor under the lock: it can then only be waiting (for the child, the backoff or the
        # lock), never half-way through a spawn that would leave an untracked child behind.
        async with self._lock:
            supervisor, self._supervisor = self._supervisor, None
            if supervisor is not None:
                supervisor.cancel()
            code = await self._terminate_locked()
        if supervisor is not None:
            await asyncio.wait({supervisor})  # it was cancelled above; our own cancellation still propagates
        return code

    # ---- internals (lock held) ------------------------------------------------------------------------

    async def _spawn_locked(self) -> None:
        assert self._child is None or self._child.returncode is not None, "previous child not reaped"
        self._child = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self._env,
        )
        self._child_started = self._clock.now()
        self.starts += 1
        self.spawned.set()
        self.reloads.reset()
        self._pump = asyncio.get_running_loop().create_task(self._copy_output(self._child))
        log.info("started %s pid=%d argv=%s", self.name, self._child.pid, " ".join(self.argv))

    async def _terminate_locked(self) -> int | None:
        child = self._child
        if child is None:
            return None
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
            try:
                await run_within(self._clock, self.stop_timeout, child.wait())
            except TimeoutError:
                log.warning("%s pid=%d ignored SIGTERM for %gs; killing it", self.name, child.pid, self.stop_timeout)
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
        await self._reap_locked()
        log.info("stopped %s pid=%d exit=%s", self.name, child.pid, child.returncode)
        return child.returncode

    async def _reap_locked(self) -> None:
        child = self._child
        if child is None:
            return
        await child.wait()
        if self._pump is not None:
            # The pipe closes when the child exits, unless it left a grandchild holding it: do not hang.
            # (asyncio.wait neither raises on its timeout nor swallows a cancellation of ours.)
            await asyncio.wait({self._pump}, timeout=2.0)
            self._pump.cancel()
            self._pump = None

    # ---- supervision ----------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        # tenacity runs the restarts; the failure count is ours, because it starts over after a healthy run.
        backoff = Backoff(self.backoff_initial, self.backoff_max, spread=0)
        restarts = retrying(
            self._clock,
            wait=lambda _: backoff.delay(self._failures),
            retry=retry_if_exception_type(ChildExited),
            before_sleep=self._log_exit,
        )
        async for attempt in restarts:
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    async with self._lock:  # after the backoff; start() spawned the first child
                        if self._wanted and (self._child is None or self._child.returncode is not None):
                            await self._spawn_locked()
                await self._until_unexpected_exit()

    async def _until_unexpected_exit(self) -> None:
        """Wait for the current child; raise ``ChildExited`` when it exits unasked, return when not wanted."""
        while self._wanted:
            child = self._child
            if child is None:
                return
            await child.wait()
            async with self._lock:
                if not self._wanted or self._child is not child:
                    continue  # a restart or stop replaced or ended it on purpose
                await self._reap_locked()
                lived = self._clock.now() - self._child_started
                self.unexpected_exits += 1
                self._failures = 1 if lived >= self.backoff_max else self._failures + 1
                raise ChildExited(child.pid, child.returncode, lived)

    def _log_exit(self, retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
        if isinstance(exc, ChildExited):
            log.warning(
                "%s pid=%d exited unexpectedly exit=%s lived=%.1fs restart_in=%.2fs",
                self.name,
                exc.pid,
                exc.returncode,
                exc.lived,
                retry_state.upcoming_sleep,
            )

    async def _copy_output(self, child: asyncio.subprocess.Process) -> None:
        stream = child.stdout
        if stream is None:
            return
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the stream limit: take what is there
                line = await stream.read(65536)
            if not line:
                return
            child_log.info("%s[%d]: %s", self.name, child.pid, line.decode(errors="replace").rstrip())

    def _send_sigusr1(self) -> bool:
        child = self._child
        if child is None or child.returncode is not None:
            return False  # a restart will read the current mapping anyway
        try:
            os.kill(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return False
        log.info("sent SIGUSR1 to %s pid=%d", self.name, child.pid)
        return True
