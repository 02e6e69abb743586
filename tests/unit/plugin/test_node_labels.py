"""The node's ComputeDomain label: written with the resourceVersion read, decided again after each 409, and a
node that keeps changing under us ends in a one-line retryable error instead of a loop."""

from __future__ import annotations

import asyncio
import re
from typing import Any, cast

import pytest

from computedomain.kube.client import KubeClient, Resource
from computedomain.kube.errors import Conflict
from computedomain.plugin.failures import LabelConflictError
from computedomain.plugin.node_labels import NodeLabels

KEY = "resource.nvidia.com/computeDomain"


class Node:
    """One Node's labels behind get and merge-patch; the first ``conflicts`` conditional writes meet a 409
    (``rival`` is what another writer put there meanwhile, if anything)."""

    def __init__(self, conflicts: int, rival: str | None = None) -> None:
        self.labels: dict[str, str] = {}
        self.rv = 1
        self.conflicts = conflicts
        self.rival = rival
        self.reads = 0
        self.writes = 0

    async def get(self, resource: Resource, name: str, **_: Any) -> dict[str, Any]:
        self.reads += 1
        await asyncio.sleep(0)
        return {"metadata": {"name": name, "labels": dict(self.labels), "resourceVersion": str(self.rv)}}

    async def merge_patch(self, resource: Resource, name: str, patch: dict[str, Any], **_: Any) -> dict[str, Any]:
        meta = patch["metadata"]
        if self.conflicts:
            self.conflicts -= 1
            self.rv += 1
            if self.rival is not None:
                self.labels[KEY] = self.rival
            raise Conflict("the object has been modified")
        assert meta.get("resourceVersion") == str(self.rv)
        self.writes += 1
        for key, value in meta["labels"].items():
            if value is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = value
        self.rv += 1
        return {}


async def test_a_conflict_reads_again_and_writes_with_the_new_version() -> None:
    node = Node(conflicts=2)
    await NodeLabels(cast(KubeClient, node), "n1").ensure_label(KEY, "cd-1")
    assert node.labels == {KEY: "cd-1"}
    assert (node.reads, node.writes) == (3, 1)


async def test_a_rival_domain_that_won_the_race_is_a_label_conflict_not_a_retry() -> None:
    node = Node(conflicts=1, rival="cd-2")
    with pytest.raises(LabelConflictError, match=re.escape(f"carries {KEY}=cd-2 of another")):
        await NodeLabels(cast(KubeClient, node), "n1").ensure_label(KEY, "cd-1")
    assert node.reads == 2


async def test_a_node_that_keeps_changing_ends_after_five_attempts() -> None:
    node = Node(conflicts=100)
    with pytest.raises(LabelConflictError, match=r"kept changing under us \(5 conflicts\)"):
        await NodeLabels(cast(KubeClient, node), "n1").ensure_label(KEY, "cd-1")
    assert node.reads == 5
    node.conflicts, node.labels = 100, {KEY: "cd-1"}
    with pytest.raises(LabelConflictError, match="5 conflicts"):
        await NodeLabels(cast(KubeClient, node), "n1").remove_label_if(KEY, "cd-1")


async def test_remove_only_while_it_still_has_our_value() -> None:
    node = Node(conflicts=1, rival="cd-2")
    node.labels = {KEY: "cd-1"}
    assert await NodeLabels(cast(KubeClient, node), "n1").remove_label_if(KEY, "cd-1") is False
    assert node.labels == {KEY: "cd-2"}
