"""Labels on this node: the ComputeDomain label (`resource.nvidia.com/computeDomain=<cd uid>`) that pulls the
domain's IMEX daemon onto the node, and the `nvidia.com/gpu.clique` topology label.

Writes are JSON merge patches of `metadata.labels` only (never a full Node update, which could overwrite
other writers' fields). The CD label is written conditionally, with the resourceVersion that was read, so
"add only if absent" and "remove only while it still has our value" hold against concurrent writers (the
controller's orphan sweep, another node agent during an upgrade); a conflict re-reads and decides again
(``computedomain.retry.again_on``, at most five attempts).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from computedomain.kube.client import NODES, KubeClient, Raw
from computedomain.kube.errors import Conflict
from computedomain.kube.informer import Informer
from computedomain.plugin.failures import LabelConflictError
from computedomain.retry import again_on

log = logging.getLogger(__name__)

_MAX_CONFLICTS: Final = 5
T = TypeVar("T")


class NodeLabels:
    """`collaborators.NodeLabeler` for one node. With `informer` (a watch of this Node), a label that is already in
    place costs no request; every write and every removal decision still reads the Node live."""

    def __init__(self, client: KubeClient, node_name: str, informer: Informer[Raw] | None = None) -> None:
        self._client = client
        self.node_name = node_name
        self.informer = informer

    def cached(self, key: str) -> str | None:
        """The label's value as the Node's watch last saw it (None: absent, or no synced watch)."""
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
        if self.cached(key) == value:
            return  # the daemon of this domain runs here already: the common case of a Prepare

        async def once() -> None:
            labels, rv = await self._read()
            current = labels.get(key)
            if current == value:
                return
            if current is not None:
                raise LabelConflictError(
                    f"node {self.node_name} carries {key}={current} of another ComputeDomain; a node serves one "
                    "ComputeDomain at a time, waiting for that domain's claim to be unprepared"
                )
            await self._patch({key: value}, rv)
            log.info("labelled node node=%s %s=%s", self.node_name, key, value)

        await self._again_on_conflict(key, once)

    async def remove_label_if(self, key: str, value: str) -> bool:
        async def once() -> bool:
            labels, rv = await self._read()
            if labels.get(key) != value:
                return False
            await self._patch({key: None}, rv)
            return True

        return await self._again_on_conflict(key, once)

    async def _again_on_conflict(self, key: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt`` (read, decide, write with the resourceVersion read) again after a 409, a few times."""
        try:
            return await again_on(_MAX_CONFLICTS, Conflict)(attempt)
        except Conflict:
            raise LabelConflictError(
                f"node {self.node_name}: label {key} kept changing under us ({_MAX_CONFLICTS} conflicts)"
            ) from None

    async def set_label(self, key: str, value: str | None) -> bool:
        """Make key=value (None: absent), unconditionally. Returns whether a write was needed."""
        labels, _ = await self._read()
        if labels.get(key) == value:
            return False
        await self._patch({key: value}, None)
        return True
