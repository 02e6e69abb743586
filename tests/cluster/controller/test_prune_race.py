"""Pruning a clique entry races the daemons on the real apiserver (upstream: informer caches lag each other, a
controller removed live entries, and daemons swapped indices under running jobs). The prune is planned from
the caches and decided on live reads: the clique first, then the domain's pods, then a write at the clique's
resourceVersion. Each test interleaves a daemon's registration at the worst moment by hooking the client."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ComputeDomain, ComputeDomainClique
from computedomain.controller.executor import Writer
from computedomain.controller.reconcile import PruneEntries
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, PODS, KubeClient
from computedomain.kube.errors import Conflict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

CLIQUE = "8f2c1d9e-0000-4000-8000-0000000000c1.7"
OTHER_CLIQUE = "8f2c1d9e-0000-4000-8000-0000000000c1.8"


class HookedClient:
    """The real client; ``after_list`` runs once right after the first pod list returns."""

    def __init__(self, client: KubeClient, after_list: Callable[[], Awaitable[None]]) -> None:
        self._client = client
        self._after_list: Callable[[], Awaitable[None]] | None = after_list

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def list_all(self, resource: Any, **kwargs: Any) -> Any:
        result = await self._client.list_all(resource, **kwargs)
        if resource is PODS and self._after_list is not None:
            hook, self._after_list = self._after_list, None
            await hook()
        return result


def _domain(namespace: str) -> ComputeDomain:
    return ComputeDomain.model_validate(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "race", "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": "race-channel"}}},
        }
    )


def _entry(node: str, index: int, clique: str = CLIQUE) -> dict[str, Any]:
    return {"nodeName": node, "ipAddress": f"10.9.0.{index + 1}", "cliqueID": clique, "index": index, "status": "Ready"}


async def _pod(kube: KubeClient, namespace: str, cd: ComputeDomain, node: str, clique: str | None) -> None:
    labels = {COMPUTE_DOMAIN_LABEL: cd.uid}
    if clique is not None:
        labels[CLIQUE_LABEL] = clique
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"daemon-{node}", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "d", "image": "registry.example/none:1"}]},
    }
    await kube.create(PODS, body, namespace=namespace)


async def _clique(kube: KubeClient, namespace: str, cd: ComputeDomain, *entries: dict[str, Any]) -> Any:
    body = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainClique",
        "metadata": {"name": f"{cd.uid}.{CLIQUE}", "labels": {COMPUTE_DOMAIN_LABEL: cd.uid}},
        "daemons": list(entries),
    }
    return ComputeDomainClique.model_validate(await kube.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=namespace))


async def _register(kube: KubeClient, namespace: str, cd: ComputeDomain, entry: dict[str, Any]) -> None:
    """What a daemon does: add its own entry with a read-modify-write at the read resourceVersion."""
    raw = await kube.get(COMPUTE_DOMAIN_CLIQUES, f"{cd.uid}.{CLIQUE}", namespace=namespace)
    await kube.replace(
        COMPUTE_DOMAIN_CLIQUES, {**raw, "daemons": [*(raw.get("daemons") or []), entry]}, namespace=namespace
    )


async def _nodes(kube: KubeClient, namespace: str, cd: ComputeDomain) -> list[str]:
    raw = await kube.get(COMPUTE_DOMAIN_CLIQUES, f"{cd.uid}.{CLIQUE}", namespace=namespace)
    return sorted(d["nodeName"] for d in raw.get("daemons") or [])


@pytest.fixture
async def cd(namespace: str) -> AsyncIterator[ComputeDomain]:
    yield _domain(namespace)


async def test_a_daemon_registering_during_the_prune_keeps_its_entry(
    kube: KubeClient, namespace: str, cd: ComputeDomain
) -> None:
    """The caches saw neither b's pod nor its entry; the prune of the dead c starts; right after the pod list,
    b's pod appears and b registers. b's entry must survive: the write conflicts (the reconcile retries on
    fresh reads) instead of dropping an entry the prune never saw a reason to drop. Read-pods-then-clique
    would have read b's entry without its pod and removed it."""
    await _pod(kube, namespace, cd, "race-a", CLIQUE)
    stale = await _clique(kube, namespace, cd, _entry("race-a", 0), _entry("race-c", 2))

    async def b_registers() -> None:
        await _pod(kube, namespace, cd, "race-b", None)  # not labelled yet: counts as a fabric pod
        await _register(kube, namespace, cd, _entry("race-b", 1))

    writer = Writer(cast(KubeClient, HookedClient(kube, b_registers)), cast(Any, None), None)
    # A planner whose caches lag proposes b too (it saw b's entry in a later clique event, not its pod).
    with pytest.raises(Conflict):
        await writer.prune(cd, PruneEntries(stale, ("race-b", "race-c")))
    assert await _nodes(kube, namespace, cd) == ["race-a", "race-b", "race-c"]

    # The retry, on fresh reads: c goes, b stays.
    result = await Writer(kube, cast(Any, None), None).prune(cd, PruneEntries(stale, ("race-b", "race-c")))
    assert result.clique is not None and sorted(d.node_name for d in result.clique.daemons or ()) == [
        "race-a",
        "race-b",
    ]
    assert await _nodes(kube, namespace, cd) == ["race-a", "race-b"]


async def test_a_pod_the_caches_had_not_seen_keeps_its_entry(
    kube: KubeClient, namespace: str, cd: ComputeDomain
) -> None:
    await _pod(kube, namespace, cd, "race-a", CLIQUE)
    stale = await _clique(kube, namespace, cd, _entry("race-a", 0))
    result = await Writer(kube, cast(Any, None), None).prune(cd, PruneEntries(stale, ("race-a",)))
    assert result.clique is not None and [d.node_name for d in result.clique.daemons or ()] == ["race-a"]
    assert {p.node_name for p in result.pods} == {"race-a"}


async def test_membership_is_the_domain_and_the_clique_together(
    kube: KubeClient, namespace: str, cd: ComputeDomain
) -> None:
    """A pod on the node keeps the entry only if it is the same domain's and in the same clique (or not
    labelled yet): another domain's daemon on b, or this domain's daemon in another clique on c, do not."""
    other = _domain(namespace)
    await _pod(kube, namespace, cd, "race-a", CLIQUE)
    await _pod(kube, namespace, cd, "race-c", OTHER_CLIQUE)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "other-b", "labels": {COMPUTE_DOMAIN_LABEL: other.uid, CLIQUE_LABEL: CLIQUE}},
        "spec": {"nodeName": "race-b", "containers": [{"name": "d", "image": "registry.example/none:1"}]},
    }
    await kube.create(PODS, body, namespace=namespace)
    stale = await _clique(kube, namespace, cd, _entry("race-a", 0), _entry("race-b", 1), _entry("race-c", 2))
    result = await Writer(kube, cast(Any, None), None).prune(cd, PruneEntries(stale, ("race-a", "race-b", "race-c")))
    assert result.clique is not None and [d.node_name for d in result.clique.daemons or ()] == ["race-a"]
    assert await _nodes(kube, namespace, cd) == ["race-a"]
