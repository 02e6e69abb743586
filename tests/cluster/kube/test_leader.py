"""Leader election against a real apiserver: two electors, exactly one leads; a graceful release hands
over within about one retry period; the standby never runs leader work while the other holds the lease."""

from __future__ import annotations

import asyncio
import time

import pytest

from computedomain.kube.client import LEASES, KubeClient
from computedomain.kube.leader import LeaderElector

pytestmark = pytest.mark.cluster
RETRY = 12.0


class Log:
    def __init__(self) -> None:
        self.leading: list[str] = []
        self.stopped: list[str] = []
        self.changed = asyncio.Event()

    async def until(self, leading: list[str], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while self.leading != leading:
                self.changed.clear()
                await self.changed.wait()


def elector(kube: KubeClient, namespace: str, who: str, log: Log, retry_period: float = 0.5) -> LeaderElector:
    async def work() -> None:
        log.leading.append(who)
        log.changed.set()
        await asyncio.Event().wait()

    return LeaderElector(
        kube,
        namespace=namespace,
        name="controller",
        identity=f"{who}-id",
        lease_duration=max(15.0, 3 * retry_period),
        renew_deadline=max(10.0, 2 * retry_period),
        retry_period=retry_period,
        on_started_leading=work,
        on_stopped_leading=lambda: log.stopped.append(who),
    )


async def test_exactly_one_leads_and_release_hands_over_promptly(kube: KubeClient, namespace: str) -> None:
    log = Log()
    # A long retry period: the standby can only take over before its next retry by watching the Lease.
    a = elector(kube, namespace, "a", log, retry_period=RETRY)
    b = elector(kube, namespace, "b", log, retry_period=RETRY)
    ta = asyncio.create_task(a.run())
    await log.until(["a"])
    tb = asyncio.create_task(b.run())
    try:
        await _handover(kube, namespace, log, a, b, ta)
    finally:
        for t in (ta, tb):
            t.cancel()
        await asyncio.wait({ta, tb})
    lease = await kube.get(LEASES, "controller", namespace=namespace)
    assert not lease["spec"].get("holderIdentity"), "the last leader released on shutdown"


async def _handover(
    kube: KubeClient, namespace: str, log: Log, a: LeaderElector, b: LeaderElector, ta: asyncio.Task[None]
) -> None:
    await asyncio.sleep(1.0)  # b has tried once and must have failed
    assert log.leading == ["a"]
    assert a.is_leader and not b.is_leader
    assert b.holder == "a-id"
    lease = await kube.get(LEASES, "controller", namespace=namespace)
    assert lease["spec"]["holderIdentity"] == "a-id"
    assert lease["spec"]["leaseDurationSeconds"] == 3 * RETRY

    start = time.monotonic()
    ta.cancel()  # graceful shutdown: release
    await asyncio.wait({ta})
    assert log.stopped == ["a"]
    await log.until(["a", "b"], within=RETRY)
    handover = time.monotonic() - start
    # Not a performance bound (bench-controller measures that): anything before the next retry tick proves
    # the standby reacted to the release itself rather than polling or waiting for the lease to expire.
    assert handover < RETRY, f"standby took {handover:.2f}s after a graceful release"
    lease = await kube.get(LEASES, "controller", namespace=namespace)
    assert lease["spec"]["holderIdentity"] == "b-id"
    assert lease["spec"]["leaseTransitions"] == 1


async def test_losing_the_lease_stops_the_work(kube: KubeClient, namespace: str) -> None:
    from computedomain.kube.leader import LeadershipLost

    log = Log()
    a = elector(kube, namespace, "a", log)
    ta = asyncio.create_task(a.run())
    await log.until(["a"])
    # Someone else (an operator, a split brain) takes the lease with a proper read-modify-write.
    lease = await kube.get(LEASES, "controller", namespace=namespace)
    lease["spec"]["holderIdentity"] = "intruder"
    await kube.replace(LEASES, lease, namespace=namespace)
    with pytest.raises(LeadershipLost):
        async with asyncio.timeout(5):
            await ta
    assert log.stopped == ["a"]
    assert not a.is_leader
    lease = await kube.get(LEASES, "controller", namespace=namespace)
    assert lease["spec"]["holderIdentity"] == "intruder", "a deposed leader must not release someone else's lease"
