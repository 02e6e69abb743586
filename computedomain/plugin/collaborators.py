"""What Prepare needs from the world around it: the facts it reads and the protocols of the collaborators
that ``app`` injects (Kubernetes-backed in the agent, in-memory in unit tests and benchmarks).

Reads: the claim (``ClaimReader``, one live GET), the ComputeDomain (``DomainLookup``), the node's
hardware (``Hardware``), the node's CD label (``NodeLabeler``: another domain's is refused). Side effects:
the wait for this node's daemon (``DaemonReadiness``), the host IMEX check of hostManaged mode
(``HostCheck``), and with channel isolation the domain's channel in this node's clique
(``ChannelAssignments``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

from computedomain.plugin.cdi import CapabilityDevice

__all__ = [
    "ChannelAssignments",
    "ClaimReader",
    "ClaimSnapshot",
    "DaemonReadiness",
    "DomainInfo",
    "DomainLookup",
    "Hardware",
    "HostCheck",
    "NodeLabeler",
    "RunBlocking",
]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class ClaimSnapshot:
    """The parts of a ResourceClaim that Prepare reads."""

    namespace: str
    name: str
    uid: str
    status: Mapping[str, Any]

    @property
    def allocation(self) -> Mapping[str, Any] | None:
        allocation = self.status.get("allocation")
        return allocation if isinstance(allocation, Mapping) and allocation else None

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> ClaimSnapshot:
        meta = raw.get("metadata") or {}
        return cls(
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            uid=str(meta.get("uid") or ""),
            status=dict(raw.get("status") or {}),
        )


@dataclass(frozen=True, slots=True)
class DomainInfo:
    """What Prepare needs to know about a ComputeDomain."""

    uid: str
    name: str
    namespace: str
    num_nodes: int = 0


class ClaimReader(Protocol):
    async def get_claim(self, namespace: str, name: str) -> ClaimSnapshot:
        """The claim as the apiserver has it now; ClaimNotFoundError if it does not exist."""
        ...

    async def wait_gone(self, namespace: str, name: str, uid: str) -> None:
        """Return once the claim is deleted or replaced or reserved for no pod (it may take forever)."""
        ...


class DomainLookup(Protocol):
    async def get_domain(self, uid: str) -> DomainInfo | None:
        """The ComputeDomain with this UID in any namespace, or None."""
        ...


class NodeLabeler(Protocol):
    async def check_label(self, key: str, value: str) -> None:
        """LabelConflictError while this node's label ``key`` has another value than ``value`` (absent is
        fine: the controller sets the CD label)."""
        ...


class DaemonReadiness(Protocol):
    async def wait_ready(self, domain: DomainInfo, clique_id: str, timeout_s: float) -> None:
        """Return once this node's daemon of the domain is Ready; NotReadyError after timeout_s."""
        ...


class Hardware(Protocol):
    """Node facts Prepare needs; `clique_id` is the current value (refreshed elsewhere)."""

    @property
    def clique_id(self) -> str: ...

    def imex_channel_major(self) -> int: ...

    def imex_channel_count(self) -> int: ...

    def fabric_imex_mgmt(self) -> CapabilityDevice | None: ...


HostCheck = Callable[[], Awaitable[None]]


class ChannelAssignments(Protocol):
    """Channel isolation: the IMEX channel of a domain in a clique (``plugin.channels``)."""

    def known(self, domain_uid: str, clique_id: str) -> int | None:
        """The channel as far as is known without asking (a cache), or None."""
        ...

    async def acquire(
        self, domain: DomainInfo, clique_id: str, claim_uid: str, *, channel_count: int, timeout_s: float
    ) -> int:
        """List the claim as holding the domain's channel, wait until the channel is assigned, return it;
        ChannelNotAssignedError after timeout_s."""
        ...

    async def release(self, domain_uid: str, clique_id: str, claim_uid: str) -> bool:
        """The claim no longer holds the channel; True when it was listed."""
        ...

    def node_claims(self) -> list[tuple[str, str, str]]:
        """(domain UID, clique ID, claim UID) of every claim this node has listed."""
        ...

    async def hold(self, domain_uid: str, clique_id: str, claim_uid: str) -> bool:
        """The claim, prepared here, is listed for this node (again, if its entry went); True when it had to be."""
        ...


class RunBlocking(Protocol):
    """How blocking work (checkpoint and CDI files, /proc reads) is run off the event loop: ``asyncio.to_thread``
    in the agent; inline in unit tests, so that a fake clock alone decides when time passes."""

    def __call__(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]: ...
