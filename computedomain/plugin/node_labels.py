"""Labels on this node: the `nvidia.com/gpu.clique` topology label, which the node agent maintains, and the
ComputeDomain label (`resource.nvidia.com/computeDomain=<cd uid>`), which it only reads: the controller
derives that one from the channel claims allocated here (`computedomain.controller.nodes`), and the node
agent's admission policy refuses any change of it by the agent.

Writes are JSON merge patches of `metadata.labels` only (never a full Node update, which could overwrite
other writers' fields).
"""

from __future__ import annotations

import logging
from typing import Any

from computedomain.kube.client import NODES, KubeClient, Raw
from computedomain.kube.informer import Informer
from computedomain.plugin.failures import LabelConflictError

log = logging.getLogger(__name__)


class NodeLabels:
    """`collaborators.NodeLabeler` for one node. With `informer` (a watch of this Node), a check that passes
    costs no request; a refusal and every write read the Node live."""

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

    async def _read(self) -> dict[str, str]:
        node: dict[str, Any] = await self._client.get(NODES, self.node_name)
        return dict((node.get("metadata") or {}).get("labels") or {})

    async def check_label(self, key: str, value: str) -> None:
        """LabelConflictError while this node's ``key`` names another value (read live before refusing: the
        watch may lag). Absent is fine: the controller sets it once a claim is allocated here."""
        if self.informer is not None and self.informer.synced and self.cached(key) in (None, value):
            return  # the common case of a Prepare: no request
        current = (await self._read()).get(key)
        if current is not None and current != value:
            raise LabelConflictError(
                f"node {self.node_name} carries {key}={current} of another ComputeDomain; a node serves one "
                "ComputeDomain at a time, waiting for that domain's claims here to end (the controller then moves "
                "the label)"
            )

    async def set_label(self, key: str, value: str | None) -> bool:
        """Make key=value (None: absent), unconditionally. Returns whether a write was needed."""
        if (await self._read()).get(key) == value:
            return False
        await self._client.merge_patch(NODES, self.node_name, {"metadata": {"labels": {key: value}}})
        return True
