"""The node agent's ComputeDomain cache (``plugin.domains.DomainCache``) on the real apiserver: a claim that
names a UID no ComputeDomain has costs one live list of every ComputeDomain, not one per Prepare attempt."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest

from computedomain.kube.client import KubeClient
from computedomain.plugin.domains import DomainCache

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


class CountingLists:
    """The real client, counting its full lists."""

    def __init__(self, client: KubeClient) -> None:
        self._client, self.lists = client, 0

    async def list_all(self, *args: Any, **kwargs: Any) -> Any:
        self.lists += 1
        return await self._client.list_all(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


async def test_an_unknown_domain_is_listed_for_once(kube: KubeClient) -> None:
    client = CountingLists(kube)
    cache = DomainCache(client)  # type: ignore[arg-type]
    watching = asyncio.create_task(cache.run())
    try:
        await cache.informer.has_synced()
        before = client.lists
        unknown = str(uuid.uuid4())
        for _ in range(5):
            assert await cache.get_domain(unknown) is None
        assert client.lists - before == 1
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
