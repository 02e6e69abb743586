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

from computedomain.kube.client import NODES, KubeClient, Raw
from computedomain.kube.errors import Conflict
from computedomain.kube.informer import Informer
from computedomain.plugin.failures import LabelConflictError

log = logging.getLogger(__name__)

_MAX_CONFLICTS: Final = 5


class NodeLabels:
    """`collaborators.NodeLabeler` for one node. With `informer` (a watch of this Node), a label that is already in
    place costs no request; every write and every removal decision still reads the Node live."""

    def __init__(self, client: KubeClient, node_name: str, informer: Informer[Raw] | None = None) -> None:
        self._client = client
        self.node_name = node_name
        self.informer = informer

    def _cached(self, key: str) -> str | None:
        if self.informer is None or not self.informer.synced:
            return None
        node = self.informer.get(self.node_name)
        labels = ((node or {}).get("metadata") or {}).get("labels") or {}
        value = labels.get(key)
        return str(value) if value is not None else None

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
        if self._cached(key) == value:
            return  # the daemon of this domain runs here already: the common case of a Prepare
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

    async def set_label(self, key: str, value: str | None) -> bool:
        """Make key=value (None: absent), unconditionally. Returns whether a write was needed."""
        labels, _ = await self._read()
        if labels.get(key) == value:
            return False
        await self._patch({key: value}, None)
        return True
