"""Which ComputeDomain holds this node (driverManaged, ``IMEX_ISOLATION=domain``), and so which channel
devices the node publishes (design note 0014).

A node's channel 0 serves the IMEX domain of the one ComputeDomain whose daemon runs there. Several pods of
that domain may share it; a pod of another domain must not be placed on the node at all. The scheduler
keeps it so from what the ResourceSlice says (``resourceslice.published_devices``):

- **free**: only ``channel-0``, without a holder. Of two domains' claims scheduled at once, the scheduler
  gives the one device to one of them; the other is placed elsewhere or stays Pending.
- **held by D**: ``channel-0`` ... ``channel-0-<n-1>``, each with attribute ``domain=D``. A domain's
  workload template selects only devices without a holder or with its own UID, so only pods of D fit.
- **draining D**: D's last claim here is gone: ``channel-0`` alone, still ``domain=D``, so nothing of
  another domain fits while a pod of D may still be on its way here. The node turns free once
  ``RELEASE_SETTLE_S`` has passed since it began to drain and no claim of D in D's namespace is allocated
  on this node (a live list), apart from claims this node has unprepared already.

The holder is the domain of the live channel claims in the checkpoint (a claim's ``PrepareStarted`` makes
it so before any side effect); without any, the last holder drains: the one this process saw, else the one
this node's ComputeDomain label or its published slice names (an agent restarted meanwhile). The label
itself is the controller's, which removes it once no claim of the domain is allocated here (the same fact
the drain waits for). Prepare and Unprepare wake the loop; the settle time re-adds the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from computedomain.api.constants import DRIVER_NAME, HOLDER_ATTRIBUTE
from computedomain.kube.client import RESOURCE_CLAIMS, KubeClient, Raw
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.kube.workqueue import RequeueAfter
from computedomain.plugin.checkpoint import Checkpoint, DeviceKind
from computedomain.plugin.resourceslice import Device, Holding, SlicePublisher

__all__ = ["RELEASE_SETTLE_S", "NodeHolder", "allocated_here", "live_domains"]

log = logging.getLogger(__name__)

#: how long a drained node stays its last holder's before it may turn free: a pod of that domain whose
#: scheduling cycle began on the slice of before has landed (its claim is written) well within it
RELEASE_SETTLE_S: Final = 2.0
_KEY: Final = "holder"


def live_domains(cp: Checkpoint) -> set[str]:
    """Domains of the channel claims this node has prepared or is preparing."""
    return {
        r.domain_id
        for e in cp.claims.values()
        if not e.state.is_tombstone
        for r in e.resources
        if r.kind is DeviceKind.CHANNEL
    }


def allocated_here(
    claims: Iterable[Raw], *, node_name: str, unprepared: set[str], driver: str = DRIVER_NAME
) -> list[str]:
    """Names of the claims allocated a device of ours on this node that may still be prepared here."""
    found = []
    for claim in claims:
        meta = claim.get("metadata") or {}
        if meta.get("deletionTimestamp") or str(meta.get("uid") or "") in unprepared:
            continue
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()
        if any(r.get("driver") == driver and r.get("pool") == node_name for r in results if isinstance(r, dict)):
            found.append(str(meta.get("name") or ""))
    return found


class NodeHolder:
    """Keeps the published channel devices in step with the domain holding this node."""

    def __init__(
        self,
        client: KubeClient,
        publisher: SlicePublisher,
        *,
        node_name: str,
        read_checkpoint: Callable[[], Checkpoint],
        node_label: Callable[[], str | None],
        domain_namespace: Callable[[str], str | None],
        devices: Callable[[Holding | None], Sequence[Device]],
        clock: Clock | None = None,
        settle_s: float = RELEASE_SETTLE_S,
        retries: Retries = DEFAULT_RETRIES,
    ) -> None:
        self.client = client
        self.publisher = publisher
        self.node_name = node_name
        self.read_checkpoint = read_checkpoint
        self.node_label = node_label
        self.domain_namespace = domain_namespace
        self.devices = devices
        self.clock: Clock = clock or MonotonicClock()
        self.settle_s = settle_s
        self.holding: Holding | None = None
        self._drain_since: float | None = None
        self.loop: Converger[str] = Converger("node-holder", self._reconcile, retries=retries)

    def wake(self) -> None:
        self.loop.add(_KEY)

    async def run(self) -> None:
        self.loop.add(_KEY)
        await self.loop.run()

    def _published(self) -> str | None:
        """The holder the slice names now (an agent restarted while the node drained: it drains on)."""
        for item in self.publisher.informer.list():
            for device in (item.get("spec") or {}).get("devices") or ():
                holder = ((device.get("attributes") or {}).get(HOLDER_ATTRIBUTE) or {}).get("string")
                if holder:
                    return str(holder)
        return None

    def _set(self, holding: Holding | None) -> None:
        if holding != self.holding:
            log.info("node holder node=%s holding=%s", self.node_name, holding)
        self.holding = holding
        self.publisher.set_devices(self.devices(holding))

    async def _reconcile(self, _key: str) -> ReconcileResult:
        cp = await asyncio.to_thread(self.read_checkpoint)
        live = live_domains(cp)
        if live:
            current = self.holding.domain if self.holding is not None else None
            # Never switch while the holder is live (a claim of another domain refused by Prepare is live too).
            self._set(Holding(current if current in live else min(live)))
            self._drain_since = None
            return DONE
        last = self.holding.domain if self.holding is not None else (self.node_label() or self._published())
        if last is None:
            self._set(None)
            return DONE
        now = self.clock.now()
        if self._drain_since is None:
            self._drain_since = now
        self._set(Holding(last, draining=True))
        left = self._drain_since + self.settle_s - now
        if left > 0:
            return RequeueAfter(left)
        namespace = self.domain_namespace(last)
        if namespace is not None:
            listed = await self.client.list_all(RESOURCE_CLAIMS, namespace=namespace)
            unprepared = {uid for uid, e in cp.claims.items() if e.state.is_tombstone}
            waiting = allocated_here(listed.every, node_name=self.node_name, unprepared=unprepared)
            if waiting:
                log.debug("node holder: claims of %s allocated here, still draining claims=%s", last, waiting)
                return RequeueAfter(self.settle_s)
        self._drain_since = None
        self._set(None)
        return DONE
