"""Informers against a real apiserver: add/update/delete reach the store and the handlers, selectors scope
the cache, indices follow label changes, and a forced 410 (too-old resourceVersion) re-lists correctly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from computedomain.kube.client import KubeClient, Raw
from computedomain.kube.informer import Informer, wait_for_sync
from computedomain.metrics import REGISTRY
from tests.cluster.kube.conftest import CONFIGMAPS, compact_etcd
from tests.conftest import Cluster

pytestmark = pytest.mark.cluster


@dataclass(frozen=True)
class CM:
    name: str
    labels: dict[str, str]
    data: dict[str, str]

    @classmethod
    def decode(cls, raw: Raw) -> CM:
        meta = raw["metadata"]
        return cls(meta["name"], dict(meta.get("labels") or {}), dict(raw.get("data") or {}))


def cm(name: str, **labels: str) -> Raw:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {}}


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def add(self, obj: CM) -> None:
        self._note("add", obj.name)

    def update(self, old: CM, new: CM) -> None:
        self._note("update", new.name)

    def delete(self, obj: CM) -> None:
        self._note("delete", obj.name)

    def _note(self, kind: str, name: str) -> None:
        self.events.append((kind, name))
        self.changed.set()

    async def wait_for(self, pred: Callable[[], bool], within: float = 10.0) -> None:
        async with asyncio.timeout(within):
            while not pred():
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def running(inf: Informer[CM]) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(inf.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.wait({task})


async def test_add_update_delete_with_selector_and_index(kube: KubeClient, namespace: str) -> None:
    await kube.create(CONFIGMAPS, cm("pre", app="cd", team="a"), namespace=namespace)
    await kube.create(CONFIGMAPS, cm("outside"), namespace=namespace)
    inf = Informer(
        kube,
        CONFIGMAPS,
        decode=CM.decode,
        namespace=namespace,
        label_selector="app=cd",
        indexers={"team": lambda o: [o.labels["team"]] if "team" in o.labels else []},
    )
    rec = Recorder()
    inf.add_handler(on_add=rec.add, on_update=rec.update, on_delete=rec.delete)
    assert not inf.synced
    async with running(inf):
        await wait_for_sync(inf, within=10)
        assert inf.keys() == [f"{namespace}/pre"]
        assert rec.events == [("add", "pre")]
        assert [o.name for o in inf.by_index("team", "a")] == ["pre"]

        await kube.create(CONFIGMAPS, cm("new", app="cd", team="b"), namespace=namespace)
        await rec.wait_for(lambda: ("add", "new") in rec.events)
        assert inf.get("new", namespace) == CM("new", {"app": "cd", "team": "b"}, {})

        await kube.merge_patch(CONFIGMAPS, "new", {"metadata": {"labels": {"team": "a"}}}, namespace=namespace)
        await rec.wait_for(lambda: ("update", "new") in rec.events)
        assert sorted(o.name for o in inf.by_index("team", "a")) == ["new", "pre"]
        assert inf.by_index("team", "b") == []

        await kube.create(CONFIGMAPS, cm("other", app="else"), namespace=namespace)
        await kube.delete(CONFIGMAPS, "pre", namespace=namespace)
        await rec.wait_for(lambda: ("delete", "pre") in rec.events)
        assert inf.get("pre", namespace) is None
        assert [o.name for o in inf.by_index("team", "a")] == ["new"]
        assert inf.get("other", namespace) is None, "the label selector scopes the cache"
        assert inf.get("outside", namespace) is None

        # Labelling an object out of the selector is a DELETED event for this watch.
        await kube.merge_patch(CONFIGMAPS, "new", {"metadata": {"labels": {"app": None}}}, namespace=namespace)
        await rec.wait_for(lambda: ("delete", "new") in rec.events)
        assert len(inf) == 0
    assert ("add", "other") not in rec.events


async def test_relist_after_gone_reconciles_the_store(kube: KubeClient, namespace: str, cluster: Cluster) -> None:
    for name in ("keep", "drop", "change"):
        await kube.create(CONFIGMAPS, cm(name, app="cd"), namespace=namespace)
    inf = Informer(kube, CONFIGMAPS, decode=CM.decode, namespace=namespace, label_selector="app=cd")
    rec = Recorder()
    inf.add_handler(on_add=rec.add, on_update=rec.update, on_delete=rec.delete)
    async with running(inf):
        assert await inf.has_synced(within=10)
    assert len(inf) == 3

    # While nobody watches: delete, change and create; then resume from a compacted-away version.
    await kube.delete(CONFIGMAPS, "drop", namespace=namespace)
    await kube.merge_patch(CONFIGMAPS, "change", {"data": {"v": "2"}}, namespace=namespace)
    fresh = await kube.create(CONFIGMAPS, cm("fresh", app="cd"), namespace=namespace)
    assert inf.get("drop", namespace) is not None, "a stopped cache keeps what it knew"
    await asyncio.to_thread(compact_etcd, cluster, int(fresh["metadata"]["resourceVersion"]))
    # White-box: resume from a version older than both the compaction and the watch cache's window.
    inf._resource_version = "1"
    gone_before = REGISTRY.get_sample_value(
        "computedomain_informer_relists_total", {"informer": inf.name, "reason": "gone"}
    )
    rec.events.clear()
    async with running(inf):
        await rec.wait_for(lambda: len(rec.events) >= 3)
        assert sorted(rec.events) == [("add", "fresh"), ("delete", "drop"), ("update", "change")]
    assert sorted(inf.keys()) == sorted(f"{namespace}/{n}" for n in ("keep", "change", "fresh"))
    change = inf.get("change", namespace)
    assert change is not None and change.data == {"v": "2"}
    gone_after = REGISTRY.get_sample_value(
        "computedomain_informer_relists_total", {"informer": inf.name, "reason": "gone"}
    )
    assert (gone_after or 0) == (gone_before or 0) + 1


async def test_silent_watch_reconnects_without_relisting(kube: KubeClient, namespace: str) -> None:
    inf = Informer(kube, CONFIGMAPS, decode=CM.decode, namespace=namespace, inactivity_timeout=1.0)
    rec = Recorder()
    inf.add_handler(on_add=rec.add)
    async with running(inf):
        assert await inf.has_synced(within=10)
        await asyncio.sleep(2.5)  # at least one inactivity timeout on an idle namespace
        await kube.create(CONFIGMAPS, cm("late"), namespace=namespace)
        await rec.wait_for(lambda: ("add", "late") in rec.events)
    relists = REGISTRY.get_sample_value(
        "computedomain_informer_relists_total", {"informer": inf.name, "reason": "initial"}
    )
    assert relists == 1
