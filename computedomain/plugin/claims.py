"""Reading ResourceClaims for Prepare: one live GET per claim (resource.k8s.io/v1).

Prepare must act on the claim as it is now (the kubelet's helper does the same), not on a cache that may
lag behind a re-allocation; Unprepare never reads claims at all.

``wait_gone`` watches one claim (field selector on its name) while its Prepare waits for IMEX: the claim
deleted, replaced, being deleted or reserved for no pod any more (its pod was deleted) ends it, so the
Prepare can be undone at once instead of at the next cleanup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from computedomain.kube.client import RESOURCE_CLAIMS, KubeClient
from computedomain.kube.errors import Gone, NotFound
from computedomain.plugin.collaborators import ClaimSnapshot
from computedomain.plugin.failures import ClaimNotFoundError


class KubeClaimReader:
    """`collaborators.ClaimReader` over the API server."""

    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def get_claim(self, namespace: str, name: str) -> ClaimSnapshot:
        try:
            return ClaimSnapshot.from_raw(await self._client.get(RESOURCE_CLAIMS, name, namespace=namespace))
        except NotFound:
            raise ClaimNotFoundError(f"ResourceClaim {namespace}/{name} does not exist") from None

    async def claim_uid(self, namespace: str, name: str) -> str | None:
        """The UID of the claim with this name now, or None when there is none (for the stale-claim cleanup)."""
        try:
            claim = await self.get_claim(namespace, name)
        except ClaimNotFoundError:
            return None
        return claim.uid

    async def wait_gone(self, namespace: str, name: str, uid: str) -> None:
        """Return once the claim ``uid`` is gone or no pod uses it any more (see the module docstring)."""
        while True:
            try:
                raw = await self._client.get(RESOURCE_CLAIMS, name, namespace=namespace)
            except NotFound:
                return
            if _gone(raw, uid):
                return
            version = str((raw.get("metadata") or {}).get("resourceVersion") or "")
            try:
                async for event in self._client.watch(
                    RESOURCE_CLAIMS,
                    namespace=namespace,
                    field_selector=f"metadata.name={name}",
                    resource_version=version,
                    timeout_seconds=300,
                ):
                    if event.type == "DELETED" or (event.type != "BOOKMARK" and _gone(event.object, uid)):
                        return
            except Gone:
                continue


def _gone(raw: Mapping[str, Any], uid: str) -> bool:
    meta = raw.get("metadata") or {}
    status = raw.get("status") or {}
    return str(meta.get("uid") or "") != uid or bool(meta.get("deletionTimestamp")) or not status.get("reservedFor")
