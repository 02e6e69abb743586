"""The node agent's channel records (``plugin.channels.ChannelRecords``) against the real apiserver and the
real CRD: the channel a claim gets is read only from the record the agent's own write listed the claim in,
never from a lagging cache that still shows an earlier record of the same name (deleted since, its channel
given to another domain)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient
from computedomain.plugin.channels import ChannelRecords
from computedomain.plugin.collaborators import DomainInfo
from computedomain.plugin.failures import ChannelNotAssignedError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

CLIQUE = "5a4e6f10-9c1b-4d2e-8f3a-0b1c2d3e4f50.3"
NODE = "gb-1"


def record(namespace: str, domain: str, *, channel: int, claims: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "ComputeDomainClique",
        "metadata": {"name": f"{domain}.{CLIQUE}", "namespace": namespace, "labels": {COMPUTE_DOMAIN_LABEL: domain}},
        "channel": channel,
        "preparedClaims": [{"claimUID": c, "nodeName": NODE} for c in claims],
    }


async def test_a_lagging_cache_never_hands_out_an_earlier_records_channel(kube: KubeClient, namespace: str) -> None:
    a, b, claim = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    domain = DomainInfo(uid=a, name="a", namespace="team")
    # The claim was prepared before with A's earlier record (channel 5); the agent's cache saw that.
    await kube.create(COMPUTE_DOMAIN_CLIQUES, record(namespace, a, channel=5, claims=[claim]), namespace=namespace)
    agent = ChannelRecords(kube, node_name=NODE, namespace=namespace)
    watching = asyncio.create_task(agent.informer.run())
    await agent.informer.has_synced()
    assert agent.known(a, CLIQUE) == 5
    watching.cancel()  # the cache stops here: it lags from now on
    with contextlib.suppress(asyncio.CancelledError):
        await watching
    # Since then: the claim was unprepared, the record deleted, and channel 5 given to domain B.
    await kube.delete(COMPUTE_DOMAIN_CLIQUES, f"{a}.{CLIQUE}", namespace=namespace)
    await kube.create(COMPUTE_DOMAIN_CLIQUES, record(namespace, b, channel=5, claims=["other"]), namespace=namespace)

    # The claim is prepared again: the agent lists it in a new record and waits for that one's channel.
    with pytest.raises(ChannelNotAssignedError, match="waiting for the controller to assign an IMEX channel to "):
        await agent.acquire(domain, CLIQUE, claim, channel_count=2048, timeout_s=1.0)
    fresh = await kube.get(COMPUTE_DOMAIN_CLIQUES, f"{a}.{CLIQUE}", namespace=namespace)
    assert fresh["preparedClaims"] == [{"claimUID": claim, "nodeName": NODE}] and "channel" not in fresh

    # The cache catches up and the controller assigns channel 7: that is what the claim gets.
    watching = asyncio.create_task(agent.informer.run())
    try:
        waiting = asyncio.create_task(agent.acquire(domain, CLIQUE, claim, channel_count=2048, timeout_s=30))
        await kube.merge_patch(COMPUTE_DOMAIN_CLIQUES, f"{a}.{CLIQUE}", {"channel": 7}, namespace=namespace)
        assert await waiting == 7
        # Listed once only, however often Prepare is retried; a record that has its channel answers at once.
        assert await agent.acquire(domain, CLIQUE, claim, channel_count=2048, timeout_s=5) == 7
        now = await kube.get(COMPUTE_DOMAIN_CLIQUES, f"{a}.{CLIQUE}", namespace=namespace)
        assert [c["claimUID"] for c in now["preparedClaims"]] == [claim]
        assert await agent.release(a, CLIQUE, claim)
        assert not await agent.release(a, CLIQUE, claim)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        # The agent's record carries the controller's finalizer; no controller runs here.
        patch = {"metadata": {"finalizers": None}}
        await kube.merge_patch(COMPUTE_DOMAIN_CLIQUES, f"{a}.{CLIQUE}", patch, namespace=namespace)
