"""The daemon pod's probe endpoint: ``GET /ready`` on ``<pod IP>:CHECK_PORT``, answered with ``check``'s verdict.

The kubelet's startup, readiness and liveness probes all ask it (``computedomain/controller/daemonset.py``),
so a probe costs an ``nvidia-imex-ctl`` exec instead of a fresh Python. 200 only on exactly READY; 503 with
the ctl's answer otherwise, or with the refusal while one of the daemon's caches is refused (a Forbidden list
or watch: the message names the verb and the resource), since a daemon that cannot see its peers or its pod
is not serving its domain.

IMEX leaves READY for the moment it connects to a peer that just joined (every SIGUSR1 that maps a new
peer), and the readiness probe is strict (period 10 s, one failure): a probe that landed in that moment
marked the pod NotReady for a whole period, so the domain flapped NotReady whenever a node joined. While the
ctl answers WAITING_FOR_PEERS, the verdict is the first READY within ``SETTLE_S`` (checked again every
``SETTLE_EVERY_S``, a tenacity poll on the daemon's clock), else the last one: a peer that does not connect still fails the probe.

The port is reachable from other pods, so a request never starts a ctl of its own (``SharedCheck``): at most
one verdict is being reached at a time, every request that comes meanwhile waits for it, and a verdict
answers the requests of the next ``FRESH_S`` too. However many requests come, the ctl runs at most once per
``FRESH_S`` plus, while IMEX is between peers, once per ``SETTLE_EVERY_S``.

Concurrency: one event loop; the verdict in progress is one task, shared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from tenacity import retry_if_result, wait_fixed

from computedomain.http import Answer, HttpServer, start_http
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.informer import Informer
from computedomain.kube.informer import problems as informer_problems
from computedomain.retry import before_deadline, last_result, retrying
from imex.daemon.check import CheckResult, check
from imex.daemon.settings import DaemonSettings
from imex.host_check import ImexState

__all__ = ["FRESH_S", "SETTLE_EVERY_S", "SETTLE_S", "SharedCheck", "serve_check", "settled_check"]

#: how long ``GET /ready`` waits for a WAITING_FOR_PEERS daemon to turn READY (well inside the probe's 10 s)
SETTLE_S: Final = 4.0
SETTLE_EVERY_S: Final = 0.2
#: how long a verdict answers later requests (the fastest probe, the startup probe, asks every second)
FRESH_S: Final = 1.0

Check = Callable[[DaemonSettings], Awaitable[CheckResult]]


async def settled_check(settings: DaemonSettings, clock: Clock, *, run: Check = check) -> CheckResult:
    """``check``, again while IMEX is between peers (see the module docstring), for at most ``SETTLE_S``."""
    settle = retrying(
        clock,
        wait=wait_fixed(SETTLE_EVERY_S),
        stop=before_deadline(clock, clock.now() + SETTLE_S),
        retry=retry_if_result(lambda result: result.state is ImexState.WAITING_FOR_PEERS),
        give_up=last_result,
    )
    result: CheckResult = await settle(run, settings)
    return result


class SharedCheck:
    """``settled_check`` for every request at once: one in flight, its verdict reused for ``FRESH_S``."""

    def __init__(self, settings: DaemonSettings, clock: Clock, *, run: Check = check) -> None:
        self._settings = settings
        self._clock = clock
        self._run = run
        self._pending: asyncio.Task[CheckResult] | None = None
        self._verdict: CheckResult | None = None
        self._fresh_until = float("-inf")

    async def verdict(self) -> CheckResult:
        if self._verdict is not None and self._clock.now() < self._fresh_until:
            return self._verdict
        if self._pending is None:
            self._pending = asyncio.create_task(self._reach(), name="ready-check")
        # Shielded: a request that gives up does not cancel the check the others wait for.
        return await asyncio.shield(self._pending)

    async def _reach(self) -> CheckResult:
        try:
            result = await settled_check(self._settings, self._clock, run=self._run)
            self._verdict, self._fresh_until = result, self._clock.now() + FRESH_S
            return result
        finally:
            self._pending = None

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


async def serve_check(
    settings: DaemonSettings,
    caches: Sequence[Informer[Any]] = (),
    *,
    clock: Clock | None = None,
    run: Check = check,
) -> HttpServer | None:
    """Serve the probes on the pod IP (None when ``CHECK_PORT`` is 0); ``caches`` are read at each request."""
    if not settings.check_port:
        return None
    shared = SharedCheck(settings, clock or MonotonicClock(), run=run)

    async def ready() -> Answer:
        refused = informer_problems(*caches)
        if refused:
            return 503, "text/plain; charset=utf-8", ("; ".join(refused) + "\n").encode()
        result = await shared.verdict()
        return 200 if result.ready else 503, "text/plain; charset=utf-8", f"{result.message}\n".encode()

    host = f"[{settings.pod_ip}]" if ":" in settings.pod_ip else settings.pod_ip
    server = await start_http(f"{host}:{settings.check_port}", metrics_path="", routes={"/ready": ready})
    server.on_cleanup.append(shared.close)
    return server
