"""Leader election's two retry loops on a fake clock: a standby campaigns every retry period jittered to
1..1.2x (a tenacity loop) and tries at once when the holder releases; the Lease watch that speeds that up is
opened again a retry period after an error, quietly at first. The algorithm itself is tested against the
real control plane (tests/cluster/kube/test_leader.py)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from computedomain.kube.client import KubeClient, WatchEvent
from computedomain.kube.clock import FakeClock
from computedomain.kube.errors import Transient
from computedomain.kube.leader import LeaderElector

SEED = 11


class Leases:
    """One Lease held by ``holder`` (renewed on every read); a watch that fails or hands out ``events``."""

    def __init__(self, clock: FakeClock, holder: str, *, watch_fails: bool = False) -> None:
        self.clock = clock
        self.holder = holder
        self.renewals = 0
        self.reads: list[float] = []
        self.watch_fails = watch_fails
        self.watches: list[float] = []
        self.events: asyncio.Queue[WatchEvent] = asyncio.Queue()

    def lease(self) -> dict[str, Any]:
        self.renewals += 1
        return {
            "metadata": {"name": "l", "namespace": "ns", "resourceVersion": str(self.renewals)},
            "spec": {"holderIdentity": self.holder, "leaseDurationSeconds": 15, "renewTime": str(self.renewals)},
        }

    async def get(self, *_: Any, **__: Any) -> dict[str, Any]:
        self.reads.append(self.clock.now())
        return self.lease()

    async def replace(self, _: Any, body: dict[str, Any], **__: Any) -> dict[str, Any]:
        self.holder = body["spec"]["holderIdentity"]
        return body

    async def watch(self, *_: Any, **__: Any) -> AsyncIterator[WatchEvent]:
        self.watches.append(self.clock.now())
        if self.watch_fails:
            raise Transient("watch leases: connection refused", reason="ConnectionError")
        while True:
            yield await self.events.get()


def elector(leases: Leases, clock: FakeClock) -> LeaderElector:
    print(f"seed={SEED}")
    return LeaderElector(
        cast(KubeClient, leases), namespace="ns", name="l", identity="me", clock=clock, rng=random.Random(SEED)
    )


async def test_a_standby_campaigns_every_retry_period_jittered_to_at_most_1_2x() -> None:
    clock = FakeClock(0.0)
    leases = Leases(clock, holder="other")
    task = asyncio.create_task(elector(leases, clock).run())
    await clock.advance(100.0)
    task.cancel()
    await asyncio.wait({task})
    gaps = [b - a for a, b in zip(leases.reads, leases.reads[1:], strict=False)]
    assert len(gaps) >= 40
    assert all(2.0 <= g < 2.4 for g in gaps), gaps
    assert len({round(g, 6) for g in gaps}) > 10  # jittered


async def test_a_released_lease_is_tried_at_once_not_on_the_next_tick() -> None:
    clock = FakeClock(0.0)
    leases = Leases(clock, holder="other")
    task = asyncio.create_task(elector(leases, clock).run())
    await clock.advance(0.5)
    assert len(leases.reads) == 1
    leases.holder = ""
    await leases.events.put(WatchEvent("MODIFIED", {"spec": {"holderIdentity": None}}))
    await clock.settle()
    assert len(leases.reads) == 2 and leases.reads[1] == 0.5
    assert leases.holder == "me"
    task.cancel()
    await asyncio.wait({task})


async def test_a_failing_lease_watch_is_reopened_each_retry_period_warning_from_the_fifth(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(0.0)
    caplog.set_level(logging.DEBUG, logger="computedomain.kube.leader")
    leases = Leases(clock, holder="other", watch_fails=True)
    task = asyncio.create_task(elector(leases, clock).run())
    await clock.advance(13.0)
    task.cancel()
    await asyncio.wait({task})
    assert leases.watches == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    lines = [r for r in caplog.records if "lease watch" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.DEBUG] * 4 + [logging.WARNING] * 3
    assert "connection refused" in lines[0].getMessage()
