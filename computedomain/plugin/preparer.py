"""The version-free contract between the kubelet-facing gRPC layer and the code that prepares claims.

The kubelet speaks DRA v1 or v1beta1 (two proto packages with the same shape); `grpc_server` translates
either into the plain, immutable values below and calls a `Preparer`. Nothing here knows about gRPC,
protobuf or Kubernetes clients, so the prepare logic can be tested and benchmarked without sockets.

Result contract (the kubelet's): the returned mapping is keyed by claim UID. A claim with a non-empty
`error` failed; a claim *left out* of the mapping is "not done yet" (e.g. an attempt was still running when its budget ran out) and the
kubelet calls again later. A `Preparer` should raise only for bugs: the server turns an exception into an
RPC-level error, which makes the kubelet drop the whole response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

ClaimUid = NewType("ClaimUid", str)


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """What the kubelet tells us about a claim: enough to fetch it, never its contents."""

    namespace: str
    name: str
    uid: ClaimUid

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.uid}"


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One allocated device as handed back to the kubelet for the container runtime."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...] = ()
    # Only DRA v1 carries it; v1beta1 drops it.
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class UnprepareResult:
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class RegistrationStatus:
    """What the kubelet answered to our registration."""

    registered: bool
    error: str = ""


class Preparer(Protocol):
    """Prepares and unprepares claims; injected into the gRPC server."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        """Prepare every claim; see the module docstring for the meaning of missing entries."""
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        """Undo prepare for every claim, from node-local state alone."""
        ...


def strip_subrequest(request_name: str) -> str:
    """`req/sub` -> `req`: the kubelet matches containers by the top-level request name only."""
    return request_name.split("/", 1)[0]
