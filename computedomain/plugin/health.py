"""Device health as the kubelet's DRAResourceHealth stream reports it (its pods' `allocatedResourcesStatus`).

What is known about a published device, and nothing more (`device_health`, pure, table-tested):

- every device needs the IMEX channel devices of the NVIDIA driver (`nvidia-caps-imex-channels` in
  `/proc/devices`, the channel count in the driver's params): checked again at every report, so a driver
  that went away turns the devices UNHEALTHY with the reason;
- in hostManaged mode `channel-0` also needs the host's IMEX daemon: the state the last Prepare's
  `nvidia-imex-ctl -q` saw (READY: healthy; anything else: unhealthy, with the state). Before any Prepare
  nothing is known about it and the report says so. The agent runs no probe of its own for this: a host
  check per report would be an exec every heartbeat on every node for a signal the next Prepare gets anyway;
- a driverManaged channel's usefulness depends on the domain's daemons, which are per domain, not per
  device: the ComputeDomain's status reports them, not this stream.

`HealthReports` is the source the gRPC servicer streams: the full list at once, again whenever it changes,
and at least every `heartbeat_s` (the kubelet treats a device as Unknown when no report arrived within its
`health_check_timeout_seconds`, which is set to three heartbeats). Concurrency: one instance per agent on
its event loop; each stream waits on the same change event; the hardware check runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from computedomain.kube.clock import Clock, MonotonicClock, run_within

__all__ = ["DEFAULT_HEARTBEAT_S", "DeviceHealth", "Health", "HealthReports", "HostState", "device_health"]

DEFAULT_HEARTBEAT_S: Final = 60.0
#: the kubelet truncates longer messages
MAX_MESSAGE: Final = 1024


class Health(IntEnum):
    """The wire values of the kubelet's `HealthStatus`."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    device: str
    health: Health
    message: str


@dataclass(frozen=True, slots=True)
class HostState:
    """What the last host IMEX check saw: ready or not, and the ctl's state/output in one line."""

    ready: bool
    detail: str


def _clip(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def device_health(
    devices: Sequence[str], *, imex_problem: str | None, host_managed: bool, host: HostState | None
) -> tuple[DeviceHealth, ...]:
    """The report for ``devices`` (names of this node's published devices)."""
    out = []
    for name in devices:
        if imex_problem is not None:
            out.append(DeviceHealth(name, Health.UNHEALTHY, _clip(f"no IMEX channels on this node: {imex_problem}")))
        elif host_managed and name.startswith("channel"):
            if host is None:
                text = "IMEX channels present; the host IMEX daemon is checked at the first Prepare"
                out.append(DeviceHealth(name, Health.HEALTHY, text))
            elif host.ready:
                out.append(DeviceHealth(name, Health.HEALTHY, "host IMEX daemon READY at the last Prepare"))
            else:
                text = f"host IMEX daemon not ready at the last Prepare: {host.detail}"
                out.append(DeviceHealth(name, Health.UNHEALTHY, _clip(text)))
        else:
            out.append(DeviceHealth(name, Health.HEALTHY, "IMEX channels present"))
    return tuple(out)


class HealthReports:
    """The current report, and a stream of it (see the module docstring)."""

    def __init__(
        self,
        devices: Sequence[str],
        *,
        pool: str,
        host_managed: bool,
        imex_problem: Callable[[], str | None],
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        run_blocking: Callable[[Callable[[], str | None]], Awaitable[str | None]] | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Clock | None = None,
    ) -> None:
        self.devices = tuple(devices)
        self.pool = pool
        self.host_managed = host_managed
        self.heartbeat_s = heartbeat_s
        self._imex_problem = imex_problem
        self._run_blocking = run_blocking or asyncio.to_thread
        self._wall_clock = wall_clock
        self._clock: Clock = clock or MonotonicClock()
        self._host: HostState | None = None
        # Set (and replaced) on every change: a stream waits on the one it saw before its last report.
        self._changed = asyncio.Event()

    @property
    def timeout_s(self) -> int:
        return int(3 * self.heartbeat_s)

    def note_host_check(self, state: HostState) -> None:
        """The outcome of a Prepare's host IMEX check (hostManaged)."""
        if state != self._host:
            self._host = state
            self._changed.set()
            self._changed = asyncio.Event()

    async def report(self) -> tuple[float, tuple[DeviceHealth, ...]]:
        """(Unix time of the check, the devices' health), with the hardware checked now."""
        problem = await self._run_blocking(self._imex_problem)
        health = device_health(self.devices, imex_problem=problem, host_managed=self.host_managed, host=self._host)
        return self._wall_clock(), health

    async def stream(self) -> AsyncIterator[tuple[float, tuple[DeviceHealth, ...]]]:
        """The report now, then after every change and at least every heartbeat; ends when cancelled."""
        while True:
            changed = self._changed
            yield await self.report()
            with contextlib.suppress(TimeoutError):  # the heartbeat: report again even without a change
                await run_within(self._clock, self.heartbeat_s, changed.wait())
