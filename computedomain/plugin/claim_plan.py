"""Step one of Prepare: every check of a claim that needs no side effect, and the plan of what to do.

``ClaimPlanner.plan(ref)`` reads the claim live and the ComputeDomains it names, and either raises (a
``ClaimRejected`` or a retryable error, see ``failures``) or returns a ``ClaimPlan``: per allocated device
its decoded config, its domain, the undo record the checkpoint will hold (``PreparedResource``) and the
channels to inject. Nothing on the node is touched here, so a bad claim leaves nothing behind.

Checks, in order: the claim is allocated and its UID is the one the kubelet named; its opaque configs
decode strictly (``opaque.resolve``: unknown fields and a ``domainID`` that is not a UUID are rejected);
every device is one this node publishes, from this node's pool; daemon claims are refused in hostManaged
mode, and otherwise only prepared for pods of the domain's own DaemonSet (``daemon_owner``); a channel
claim's ComputeDomain exists in the claim's own namespace, a daemon claim's anywhere.

With channel isolation a channel device is a place for one claim, and the channel is the domain's in this
node's clique, not the device's: ``allocationMode: All`` is refused, and the plan carries the clique (the
undo record's ``cliqueID``) and the channel if it is known already; otherwise ``prepare`` acquires it
(``channels``) once ``PrepareStarted`` is recorded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.plugin import cdi
from computedomain.plugin.checkpoint import DeviceKind, NodeLabel, PreparedResource, claim_fingerprint
from computedomain.plugin.collaborators import (
    ChannelAssignments,
    ClaimReader,
    ClaimSnapshot,
    DomainInfo,
    DomainLookup,
    Hardware,
    RunBlocking,
)
from computedomain.plugin.daemon_owner import DaemonPods, check_daemon_claim
from computedomain.plugin.failures import ClaimRejected
from computedomain.plugin.opaque import ResolvedDevice, resolve
from computedomain.plugin.preparer import ClaimRef

__all__ = ["PUBLISHED_DEVICES", "ClaimPlan", "ClaimPlanner", "DevicePlan", "published_device_names"]

PUBLISHED_DEVICES: Final = frozenset({cdi.CHANNEL_DEVICE, cdi.DAEMON_DEVICE})


def published_device_names(channel_devices: int = 1, *, isolated: bool = True) -> frozenset[str]:
    """What a node publishes: ``channel-0`` (and with channel isolation ``channel-1`` ..., without it
    ``channel-0-1`` ...) and ``daemon-0``."""
    return PUBLISHED_DEVICES | {cdi.channel_device(i, isolated=isolated) for i in range(channel_devices)}


@dataclass(frozen=True, slots=True)
class DevicePlan:
    resolved: ResolvedDevice
    domain: DomainInfo
    resource: PreparedResource
    inject_channels: tuple[int, ...] = ()

    @property
    def isolated(self) -> bool:
        """Channel isolation on a node with a clique: the claim must hold the domain's channel (``acquire``)."""
        return self.resource.clique_id is not None

    def with_channel(self, channel: int) -> DevicePlan:
        resource = self.resource.model_copy(update={"channels": (channel,)})
        return DevicePlan(self.resolved, self.domain, resource, (channel,))


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    claim: ClaimSnapshot
    fingerprint: str
    devices: tuple[DevicePlan, ...]

    @property
    def resources(self) -> tuple[PreparedResource, ...]:
        return tuple(d.resource for d in self.devices)


@dataclass(frozen=True)
class ClaimPlanner:
    node_name: str
    host_managed: bool
    domains_dir: Path
    claims: ClaimReader
    domains: DomainLookup
    hardware: Hardware
    driver_name: str = DRIVER_NAME
    run_blocking: RunBlocking = asyncio.to_thread
    #: where daemon claims may be prepared, and how their pods are read (None: no daemon claim passes)
    daemon_namespaces: tuple[str, ...] = ()
    daemon_pods: DaemonPods | None = None
    # Channel isolation: the domains' channels (None without it), and how many channel devices are published.
    channels: ChannelAssignments | None = None
    channel_devices: int = 1

    async def plan(self, ref: ClaimRef) -> ClaimPlan:
        claim = await self.claims.get_claim(ref.namespace, ref.name)
        if claim.uid != ref.uid:
            raise ClaimRejected(
                f"ResourceClaim {ref.namespace}/{ref.name} has UID {claim.uid}, not {ref.uid}: it was replaced"
            )
        allocation = claim.allocation
        if allocation is None:
            raise ClaimRejected(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
        devices = [await self._device(claim, item) for item in resolve(allocation, driver=self.driver_name)]
        return ClaimPlan(claim=claim, fingerprint=claim_fingerprint(claim.status), devices=tuple(devices))

    async def _device(self, claim: ClaimSnapshot, item: ResolvedDevice) -> DevicePlan:
        device = item.device
        if device.pool != self.node_name:
            raise ClaimRejected(
                f"device {device.device} was allocated from pool {device.pool!r}, not from this node {self.node_name!r}"
            )
        if device.device not in published_device_names(self.channel_devices, isolated=self.channels is not None):
            raise ClaimRejected(f"device {device.device} is not a device this node publishes")
        kind = item.kind
        if kind is DeviceKind.DAEMON and self.host_managed:
            raise ClaimRejected(
                "daemon claims are not supported with IMEX_MODE=hostManaged: the host runs nvidia-imex itself"
            )
        if kind is DeviceKind.DAEMON:
            await check_daemon_claim(claim, item.domain_id, namespaces=self.daemon_namespaces, pods=self.daemon_pods)
        domain = await self.domains.get_domain(item.domain_id)
        if kind is DeviceKind.DAEMON:
            if domain is None:
                raise ClaimRejected(f"ComputeDomain {item.domain_id} of this daemon claim does not exist")
            domain_dir = str(self.domains_dir / domain.uid)
            return DevicePlan(item, domain, PreparedResource(kind=kind, domain_id=domain.uid, domain_dir=domain_dir))
        if domain is None or domain.namespace != claim.namespace:
            where = f" (it is in namespace {domain.namespace})" if domain else ""
            raise ClaimRejected(
                f"ComputeDomain {item.domain_id} not found in namespace {claim.namespace}{where}; a channel "
                "claim must come from the ComputeDomain's own ResourceClaimTemplate"
            )
        if self.channels is not None:
            return self._isolated(item, domain)
        count = await self.run_blocking(self.hardware.imex_channel_count)
        # hostManaged: all domains share channel 0 of the host's IMEX domain.
        ids = (0,) if self.host_managed else tuple(cdi.channel_ids(item.all_channels, count))
        inject = ids if self.hardware.clique_id else ()
        label = None if self.host_managed else NodeLabel(key=COMPUTE_DOMAIN_LABEL, value=domain.uid)
        resource = PreparedResource(kind=kind, domain_id=domain.uid, channels=inject or (0,), node_label=label)
        return DevicePlan(item, domain, resource, inject)

    def _isolated(self, item: ResolvedDevice, domain: DomainInfo) -> DevicePlan:
        """Channel isolation: the domain's channel in this node's clique (hostManaged: no node label)."""
        assert self.channels is not None
        if item.all_channels:
            raise ClaimRejected(
                "allocationMode All is refused with channel isolation (IMEX_ISOLATION=channel): it would give the "
                "pod every IMEX channel of the node, other ComputeDomains' channels included; use Single"
            )
        clique = self.hardware.clique_id
        if not clique:
            # Not on an MNNVL fabric: nothing to inject, no channel to hold.
            return DevicePlan(item, domain, PreparedResource(kind=item.kind, domain_id=domain.uid))
        known = self.channels.known(domain.uid, clique)
        channels = (known,) if known is not None else ()
        resource = PreparedResource(kind=item.kind, domain_id=domain.uid, channels=channels, clique_id=clique)
        return DevicePlan(item, domain, resource, channels)
