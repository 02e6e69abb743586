"""Step two of Prepare: what is done on the node for one planned device, once ``PrepareStarted`` (with the
undo record) is in the checkpoint. Every step is idempotent, so a retried or resumed Prepare repeats it.

* driverManaged channel: the node's CD label must not name another domain (a retryable conflict; the
  controller labels the node with the domain's UID as soon as the claim is allocated here, which is what
  brings the domain's IMEX daemon), then wait for **this node's** daemon entry to be Ready (watch-driven,
  until just before the budget ends), then the channel device nodes to inject;
* hostManaged channel: the host IMEX check (``nvidia-imex-ctl -q`` chrooted into the driver root, exact
  ``READY``), then channel 0; no label, no wait;
* a node without an NVLink clique gets no channel device: no daemon to wait for, nothing to inject;
* daemon: the per-domain config directory (mounted at ``/imexd``), the domain's identity as env, and the
  ``fabric-imex-mgmt`` capability device on fabric nodes.

A claim that waits for IMEX (driverManaged: its daemon here not Ready after ``WAIT_NOTICE_S``; hostManaged:
the host check not ``READY``) is told once through ``waiting`` (``prepare`` puts it on the claim's pods as an
Event), and the wait goes on: the pod still starts within one watch event (one backoff step) of IMEX turning
ready.

The result is the device's CDI container edits; ``prepare`` writes them into the claim's spec.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from computedomain.kube.clock import Clock
from computedomain.plugin import cdi
from computedomain.plugin.cdi import ContainerEdits
from computedomain.plugin.checkpoint import DeviceKind
from computedomain.plugin.claim_plan import DevicePlan
from computedomain.plugin.collaborators import DaemonReadiness, Hardware, HostCheck, NodeLabeler, RunBlocking
from computedomain.plugin.failures import ClaimRejected, NotReadyError, RetryableError, classify

__all__ = ["WAIT_NOTICE_S", "SideEffects", "Waiting"]

#: how long a channel claim waits for its IMEX daemon here before its pods are told why (the first pod on a
#: node waits for the daemon to start: about a second on the real nodes)
WAIT_NOTICE_S: Final = 2.0

#: told what a claim waits for (once per claim: ``prepare`` decides)
Waiting = Callable[[str], None]


def _silent(_why: str) -> None:
    pass


#: left of the budget when the readiness wait gives up, so its own NotReadyError (which says what it saw)
#: ends the attempt rather than the budget's cut
READINESS_MARGIN_S = 0.05


@dataclass(frozen=True)
class SideEffects:
    host_managed: bool
    labels: NodeLabeler
    readiness: DaemonReadiness
    hardware: Hardware
    host_check: HostCheck | None
    clock: Clock
    run_blocking: RunBlocking = asyncio.to_thread

    async def apply(self, device: DevicePlan, deadline: float, waiting: Waiting = _silent) -> ContainerEdits:
        if device.resource.kind is DeviceKind.CHANNEL:
            return await self._channel(device, deadline, waiting)
        return await self._daemon(device)

    async def _channel(self, device: DevicePlan, deadline: float, waiting: Waiting) -> ContainerEdits:
        clique = self.hardware.clique_id
        if self.host_managed:
            if not clique:
                return ContainerEdits()  # not on an MNNVL fabric: nothing to inject, nothing to check
            if self.host_check is None:
                raise ClaimRejected("hostManaged mode without a host IMEX check configured")
            try:
                await self.host_check()
            except Exception as exc:
                # The check raises its own errors (HostImexNotReadyError): told when they heal (retryable).
                if isinstance(classify(exc), RetryableError):
                    waiting(f"the host's IMEX daemon is not ready: {exc}")
                raise
        else:
            label = device.resource.node_label
            assert label is not None
            await self.labels.check_label(label.key, label.value)
            if clique:
                remaining = deadline - self.clock.now() - READINESS_MARGIN_S
                first = min(WAIT_NOTICE_S, remaining)
                try:
                    await self.readiness.wait_ready(device.domain, clique, first)
                except NotReadyError as exc:
                    if remaining <= first:
                        raise
                    waiting(str(exc))
                    await self.readiness.wait_ready(device.domain, clique, remaining - first)
        if not device.inject_channels:
            return ContainerEdits()
        major = await self.run_blocking(self.hardware.imex_channel_major)
        return cdi.channel_edits(major, device.inject_channels)

    async def _daemon(self, device: DevicePlan) -> ContainerEdits:
        domain = device.domain
        domain_dir = Path(device.resource.domain_dir or "")
        await self.run_blocking(domain_dir.mkdir, mode=0o755, parents=True, exist_ok=True)
        clique = self.hardware.clique_id
        cap = await self.run_blocking(self.hardware.fabric_imex_mgmt) if clique else None
        return cdi.daemon_edits(
            domain_dir=domain_dir,
            clique_id=clique,
            domain_uid=domain.uid,
            domain_name=domain.name,
            domain_namespace=domain.namespace,
            fabric_imex_mgmt=cap,
        )
