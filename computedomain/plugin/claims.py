"""Reading ResourceClaims for Prepare: one live GET per claim (resource.k8s.io/v1).

Prepare must act on the claim as it is now (the kubelet's helper does the same), not on a cache that may
lag behind a re-allocation; Unprepare never reads claims at all.
"""

from __future__ import annotations

from computedomain.kube.client import RESOURCE_CLAIMS, KubeClient
from computedomain.kube.errors import NotFound
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
