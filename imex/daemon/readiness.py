"""Mirror our pod's Ready condition into our entry, driven by watch events of our own pod.

The kubelet runs ``check`` as the readiness probe and sets the pod's Ready condition from it; that condition
is the daemon's readiness as the rest of the system sees it (the node agent releases channels on it, the
controller aggregates it). Upstream noticed NotReady -> Ready only at the next informer resync, up to minutes
late (#742). Here an informer on exactly our pod (field selector on the name) delivers every change as a watch
event, and each event is mirrored at once; there is no periodic resync to wait for.

What it owns: ``pod_status`` (pure: phase Running and condition Ready=True -> Ready; a pod with another UID
-- a replacement that reused the name -- is not ours and yields None), and ``ReadinessMirror``, the loop.

Concurrency: a one-key convergence loop (``kube.converge``) plus its informer task. The informer's handler
only adds the key; a pass reads the newest stored pod, so a flurry of status updates becomes one write.
Writes go through the shared ``Registry`` (its lock orders them against the peer loop's registrations). A
failed write is retried with backoff; a newer event supersedes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from computedomain.api.types import ReadyStatus
from computedomain.kube.client import PODS, KubeClient, Raw
from computedomain.kube.clock import Clock
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.kube.informer import Informer
from imex.daemon.registration import Registry

__all__ = ["ReadinessMirror", "pod_status"]

log = logging.getLogger(__name__)

_KEY = "readiness"


def pod_status(pod: Mapping[str, Any] | None, pod_uid: str) -> ReadyStatus | None:
    """Ready iff the pod runs and its Ready condition is True; None when ``pod`` is not our pod."""
    if pod is None:
        return None
    if pod_uid and (pod.get("metadata") or {}).get("uid") != pod_uid:
        return None
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return ReadyStatus.NOT_READY
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return ReadyStatus.READY if condition.get("status") == "True" else ReadyStatus.NOT_READY
    return ReadyStatus.NOT_READY


class ReadinessMirror:
    def __init__(
        self,
        client: KubeClient,
        registry: Registry,
        *,
        namespace: str,
        pod_name: str,
        pod_uid: str,
        retries: Retries = DEFAULT_RETRIES,
        clock: Clock | None = None,
    ) -> None:
        self.registry = registry
        self.namespace = namespace
        self.pod_name = pod_name
        self.pod_uid = pod_uid
        self.loop: Converger[str] = Converger(f"readiness/{pod_name}", self._reconcile, retries=retries, clock=clock)
        self.informer: Informer[Raw] = Informer(
            client,
            PODS,
            decode=lambda raw: raw,
            namespace=namespace,
            field_selector=f"metadata.name={pod_name}",
            name=f"own-pod/{pod_name}",
        )
        self.informer.add_handler(
            on_add=lambda _o: self.loop.add(_KEY),
            on_update=lambda _o, _n: self.loop.add(_KEY),
        )
        self.writes = 0

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.informer.run(), name="own-pod-informer")
            tasks.create_task(self._loop(), name="readiness-loop")

    async def _loop(self) -> None:
        await self.informer.has_synced()
        self.loop.add(_KEY)
        await self.loop.run()

    async def _reconcile(self, _key: str) -> ReconcileResult:
        await self.mirror_once()
        return DONE

    async def mirror_once(self) -> ReadyStatus | None:
        status = pod_status(self.informer.get(self.pod_name, self.namespace), self.pod_uid)
        if status is None:
            return None
        written = self.registry.last_written
        if status == self.registry.status and written is not None and written.status == status:
            return status
        log.info("pod readiness changed pod=%s/%s status=%s", self.namespace, self.pod_name, status)
        await self.registry.set_status(status)
        self.writes += 1
        return status
