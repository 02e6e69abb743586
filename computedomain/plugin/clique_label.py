"""This node's NVLink clique: the value Prepare uses, and the `nvidia.com/gpu.clique` node label.

- `NodeHardware` is what Prepare asks about the hardware (`collaborators.Hardware`): the current clique ID and the
  IMEX device facts, read through `imex.discovery`. The clique ID is read at start and refreshed
  periodically (upstream #1433): a new non-empty value replaces the old one, an empty or failed read never
  clears a known clique (a Fabric Manager hiccup must not turn a fabric node into a non-fabric one while
  its claims are prepared).
- `CliqueLabeler` keeps the `nvidia.com/gpu.clique=<clusterUUID>.<cliqueId>` label in line with it when
  GPU_CLIQUE_LABEL_ENABLED is set: set when there is a clique, removed when there is none, re-applied on
  every refresh so a label removed by hand comes back. Unlike upstream it does not remove the label on
  shutdown: a restart of the agent must not make workloads' topology affinity flap.

The desired label is a pure function (`desired_label`); the labeller is a small executor on a one-key
convergence loop (`kube.converge`): a refresh every `refresh_s`, failures retried with backoff.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from computedomain.api.constants import GPU_CLIQUE_NODE_LABEL
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.plugin.cdi import CapabilityDevice
from computedomain.plugin.node_labels import NodeLabels
from imex.discovery import HardwareDiscovery, HardwareError

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S: Final = 600.0


def desired_label(clique_id: str) -> str | None:
    """The label value for a clique ID; None means the label must be absent."""
    return clique_id or None


class NodeHardware:
    """`collaborators.Hardware` over a `HardwareDiscovery`, with the clique ID held between refreshes."""

    def __init__(self, discovery: HardwareDiscovery, *, crash_on_fabric_errors: bool) -> None:
        self.discovery = discovery
        self.crash_on_fabric_errors = crash_on_fabric_errors
        self._clique_id = ""

    @property
    def clique_id(self) -> str:
        return self._clique_id

    def read_clique_id(self) -> str:
        """Read the clique afresh (blocking); raises the discovery's errors. Sets it on first use."""
        clique = self.discovery.clique_id(crash_on_fabric_errors=self.crash_on_fabric_errors) or ""
        return clique

    def load(self) -> str:
        """Start-up read: errors propagate (strict fabric mode refuses to start)."""
        self._clique_id = self.read_clique_id()
        return self._clique_id

    async def refresh(self) -> str:
        """Periodic read: a new non-empty value wins, anything else keeps the known one."""
        try:
            clique = await asyncio.to_thread(self.read_clique_id)
        except HardwareError as exc:
            log.warning("clique refresh failed; keeping clique=%r error=%s", self._clique_id, exc)
            return self._clique_id
        if clique and clique != self._clique_id:
            log.info("NVLink clique changed old=%r new=%r", self._clique_id, clique)
            self._clique_id = clique
        elif not clique and self._clique_id:
            log.warning("clique read came back empty; keeping the known clique=%r", self._clique_id)
        return self._clique_id

    def imex_channel_major(self) -> int:
        return self.discovery.imex_channel_major()

    def imex_channel_count(self) -> int:
        return self.discovery.imex_channel_count()

    def fabric_imex_mgmt(self) -> CapabilityDevice | None:
        info = self.discovery.fabric_imex_mgmt()
        if info is None:
            return None
        return CapabilityDevice(major=self.discovery.nvidia_caps_major(), minor=info.minor, file_mode=info.mode)

    def imex_support(self) -> str | None:
        """None when the node can hand out IMEX channels, else why not (one line)."""
        try:
            self.discovery.imex_channel_major()
            self.discovery.imex_channel_count()
        except HardwareError as exc:
            return str(exc)
        return None


class CliqueLabeler:
    """Keeps `nvidia.com/gpu.clique` on the node equal to `desired_label(hardware.clique_id)`."""

    def __init__(
        self,
        labels: NodeLabels,
        hardware: NodeHardware,
        *,
        enabled: bool,
        refresh_s: float = DEFAULT_REFRESH_S,
        retries: Retries = DEFAULT_RETRIES,
    ) -> None:
        self.labels = labels
        self.hardware = hardware
        self.enabled = enabled
        self.loop: Converger[str] = Converger("clique", self._reconcile, every=refresh_s, retries=retries)

    async def sync(self) -> None:
        value = desired_label(self.hardware.clique_id)
        if await self.labels.set_label(GPU_CLIQUE_NODE_LABEL, value):
            if value is None:
                log.info("removed node label %s: this node is on no NVLink clique", GPU_CLIQUE_NODE_LABEL)
            else:
                log.info("set node label %s=%s", GPU_CLIQUE_NODE_LABEL, value)

    async def run(self) -> None:
        """Refresh the clique forever; label the node on every round when enabled."""
        self.loop.add("clique")
        await self.loop.run()

    async def _reconcile(self, _key: str) -> ReconcileResult:
        await self.hardware.refresh()
        if self.enabled:
            await self.sync()
        return DONE
