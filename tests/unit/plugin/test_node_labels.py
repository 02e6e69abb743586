"""The node's ComputeDomain label as the node agent sees it: only read (the controller writes it). Another
domain's label refuses a Prepare, but only after a live read (a lagging watch never refuses), and a check
that passes on the watch costs no request."""

from __future__ import annotations

import re
from typing import Any, cast

import pytest

from computedomain.kube.client import KubeClient, Raw, Resource
from computedomain.kube.informer import Informer
from computedomain.plugin.failures import LabelConflictError
from computedomain.plugin.node_labels import NodeLabels

KEY = "resource.nvidia.com/computeDomain"


class Node:
    """One Node behind GET; any write fails the test (the agent writes no CD label)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.reads = 0

    async def get(self, resource: Resource, name: str, **_: Any) -> dict[str, Any]:
        self.reads += 1
        return {"metadata": {"name": name, "labels": dict(self.labels)}}

    async def merge_patch(self, *_: Any, **__: Any) -> dict[str, Any]:
        raise AssertionError("the node agent never writes the CD label")


class Watch:
    """What the agent's watch of its Node shows (``synced``, ``get``)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.synced = True

    def get(self, name: str) -> Raw:
        return {"metadata": {"name": name, "labels": self.labels}}


def labels(node: Node, watch: Watch | None = None) -> NodeLabels:
    return NodeLabels(cast(KubeClient, node), "n1", cast(Informer[Raw], watch) if watch is not None else None)


async def test_absent_or_ours_passes_and_on_a_synced_watch_costs_no_request() -> None:
    for seen in ({}, {KEY: "cd-1"}):
        node = Node(dict(seen))
        await labels(node, Watch(dict(seen))).check_label(KEY, "cd-1")
        assert node.reads == 0
    node = Node({})
    await labels(node).check_label(KEY, "cd-1")  # no watch: read live
    assert node.reads == 1


async def test_another_domains_label_refuses_after_a_live_read() -> None:
    node = Node({KEY: "cd-2"})
    with pytest.raises(LabelConflictError, match=re.escape(f"node n1 carries {KEY}=cd-2 of another ComputeDomain")):
        await labels(node, Watch({KEY: "cd-2"})).check_label(KEY, "cd-1")
    assert node.reads == 1


async def test_a_lagging_watch_never_refuses() -> None:
    node = Node({KEY: "cd-1"})  # the controller already moved the label to this claim's domain
    await labels(node, Watch({KEY: "cd-2"})).check_label(KEY, "cd-1")
    assert node.reads == 1
