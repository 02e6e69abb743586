"""Labels on this node: the ComputeDomain label (`resource.nvidia.com/computeDomain=<cd uid>`) that pulls the
domain's IMEX daemon onto the node, and the `nvidia.com/gpu.clique` topology label.

Writes are JSON merge patches of `metadata.labels` only (never a full Node update, which could overwrite
other writers' fields). The CD label is written conditionally, with the resourceVersion that was read, so
"add only if absent" and "remove only while it still has our value" hold against concurrent writers (the
controller's orphan sweep, another node agent during an upgrade); a conflict re-reads and decides again.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from computedomain.kube.client import NODES, KubeClient
from computedomain.kube.errors import Conflict
from computedomain.plugin.prepare import LabelConflictError

log = logging.getLogger(__name__)

_MAX_CONFLICTS: Final = 5


class NodeLabels:
    """`prepare.NodeLabeler` for one node."""

    def __init__(self, client: KubeClient, node_name: str) -> None:
        self._client = client
        self.node_name = node_name

    async def _read(self) -> tuple[dict[str, str], str]:
        node: dict[str, Any] = await self._client.get(NODES, self.node_name)
        meta = node.get("metadata") or {}
        return dict(meta.get("labels") or {}), str(meta.get("resourceVersion") or "")

    async def _patch(self, labels: dict[str, str | None], resource_version: str | None) -> None:
        meta: dict[str, Any] = {"labels": labels}
        if resource_version:
            meta["resourceVersion"] = resource_version
        await self._client.merge_patch(NODES, self.node_name, {"metadata": meta})

    async def ensure_label(self, key: str, value: str) -> None:
        for _ in range(_MAX_CONFLICTS):
            labels, rv = await self._read()
            current = labels.get(key)
            if current == value:
                return
            if current is not None:
                raise LabelConflictError(
                    f"node {self.node_name} carries {key}={current} of another ComputeDomain; a node serves one "
                    "ComputeDomain at a time, waiting for that domain's claim to be unprepared"
                )
            try:
                await self._patch({key: value}, rv)
            except Conflict:
                continue
            log.info("labelled node node=%s %s=%s", self.node_name, key, value)
            return
        raise LabelConflictError(
            f"node {self.node_name}: label {key} kept changing under us ({_MAX_CONFLICTS} conflicts)"
        )

    async def remove_label_if(self, key: str, value: str) -> bool:
        for _ in range(_MAX_CONFLICTS):
            labels, rv = await self._read()
            if labels.get(key) != value:
                return False
            try:
                await self._patch({key: None}, rv)
            except Conflict:
                continue
            return True
        raise LabelConflictError(
            f"node {self.node_name}: label {key} kept changing under us ({_MAX_CONFLICTS} conflicts)"
        )

    async def current(self, key: str) -> str | None:
        labels, _ = await self._read()
        return labels.get(key)

    async def set_label(self, key: str, value: str | None) -> bool:
        """Make key=value (None: absent), unconditionally. Returns whether a write was needed."""
        labels, _ = await self._read()
        if labels.get(key) == value:
            return False
        await self._patch({key: value}, None)
        return True
