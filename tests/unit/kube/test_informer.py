"""An informer whose list or watch is refused says so (``failure``) and heals when the refusal ends."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient, ObjectList, Raw, WatchEvent
from computedomain.kube.clock import FakeClock
from computedomain.kube.errors import Forbidden, KubeError
from computedomain.kube.informer import Informer, problems

pytestmark = pytest.mark.timeout(5)


def refused(verb: str) -> KubeError:
    err = Forbidden(f"computedomaincliques is forbidden: cannot {verb}", status=403, reason="Forbidden")
    return err.for_request(verb, "computedomaincliques.resource.nvidia.com", "drv")


class FakeApi:
    """list and watch of one resource; each can be made to refuse."""

    def __init__(self) -> None:
        self.refuse_list = False
        self.refuse_watch = False
        self.lists = 0
        self.watches = 0
        self.events: asyncio.Queue[WatchEvent] = asyncio.Queue()

    async def list(self, resource: Any, **kwargs: Any) -> ObjectList:
        self.lists += 1
        if self.refuse_list:
            raise refused("list")
        item: Raw = {"metadata": {"name": "a", "namespace": "drv", "resourceVersion": "5"}}
        return ObjectList(items=[item], resource_version="5")

    async def watch(self, resource: Any, **kwargs: Any) -> AsyncGenerator[WatchEvent, None]:
        self.watches += 1
        if self.refuse_watch:
            raise refused("watch")
        while True:
            yield await self.events.get()


async def test_a_refused_list_or_watch_is_reported_and_heals() -> None:
    api = FakeApi()
    api.refuse_list = True
    clock = FakeClock()
    informer: Informer[Raw] = Informer(
        KubeClient.__new__(KubeClient),
        COMPUTE_DOMAIN_CLIQUES,
        decode=lambda raw: raw,
        namespace="drv",
        name="cliques",
        clock=clock,
        rng=random.Random(1),
    )
    informer.client = api  # type: ignore[assignment]
    task = asyncio.create_task(informer.run())
    try:
        await clock.settle()
        assert not informer.synced
        assert informer.failure is not None
        assert "may not list computedomaincliques.resource.nvidia.com in namespace drv" in informer.failure
        assert problems(informer) == [informer.failure]

        api.refuse_list = False
        api.refuse_watch = True
        await clock.advance(60.0)
        assert informer.synced
        assert informer.failure is not None and "may not watch" in informer.failure, "listing alone is not enough"

        api.refuse_watch = False
        await clock.advance(60.0)
        api.events.put_nowait(WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "6"}}))
        await clock.settle()
        assert informer.failure is None
        assert problems(informer) == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_restarts_that_keep_failing_warn_and_do_not_stay_at_info(caplog: pytest.LogCaptureFixture) -> None:
    informer: Informer[Raw] = Informer(
        KubeClient.__new__(KubeClient),
        COMPUTE_DOMAIN_CLIQUES,
        decode=lambda raw: raw,
        name="cliques",
        clock=FakeClock(),
        rng=random.Random(1),
    )
    caplog.set_level("DEBUG", logger="computedomain.kube.informer")
    for _ in range(7):
        informer._failed(KubeError("connection refused"))
    levels = [r.levelname for r in caplog.records if "informer restart" in r.getMessage()]
    assert levels == ["DEBUG"] * 4 + ["WARNING"] * 3, levels
