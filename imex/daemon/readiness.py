"""Mirror our pod's Ready condition into our entry, driven by watch events of our own pod.

The kubelet runs ``check`` as the readiness probe and sets the pod's Ready condition from it; that condition
is the daemon's readiness as the rest of the system sees it (the node agent releases channels on it, the
controller aggregates it). Upstream noticed NotReady -> Ready only at the next informer resync, up to minutes
late (#742). Here an informer on exactly our pod (field selector on the name) delivers every change as a watch
event, and each event is mirrored at once; there is no periodic resync to wait for.

Before the kubelet first marks our pod Ready, the entry follows the daemon's own check instead: the startup
probe asks it only once a second, so a daemon whose IMEX turned READY just after a probe would keep its first
pod's Prepare waiting for the next one. Our own check (the same ctl query the probe runs) is asked from the
moment ``nvidia-imex`` is spawned (``imex_started``; a query before it only finds nothing listening),
``EARLY_MIN_S`` apart at first and ``EARLY_GROWTH`` times longer each time up to ``EARLY_MAX_S``, so that a
daemon READY within a tenth of a second is seen within a few hundredths. The entry is Ready from its first
READY; from the pod's first Ready on, the pod's condition alone decides, as above. The kubelet
sees the same READY at its next probe, so the two agree within a probe period; a check that turns not ready
again before that takes the entry back to NotReady.

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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from tenacity import retry_if_result, wait_exponential

from computedomain.api.types import ReadyStatus
from computedomain.kube.client import PODS, KubeClient, Raw
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.kube.informer import Informer
from computedomain.retry import retrying
from imex.daemon.check import CheckResult
from imex.daemon.registration import Registry

__all__ = ["ReadinessMirror", "pod_status"]

log = logging.getLogger(__name__)

_KEY = "readiness"

#: how often our own check is asked before the pod's first Ready: at first, the growth per check, at most
EARLY_MIN_S: Final = 0.02
EARLY_GROWTH: Final = 1.5
EARLY_MAX_S: Final = 1.0


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
        own_check: Callable[[], Awaitable[CheckResult]] | None = None,
        imex_started: asyncio.Event | None = None,
    ) -> None:
        self.registry = registry
        self.clock = clock or MonotonicClock()
        self.own_check = own_check
        self.imex_started = imex_started
        self.pod_was_ready = False  # from the pod's first Ready on, its condition alone decides
        self.check_ready = False  # our own check's latest verdict, until then
        self.namespace = namespace
        self.pod_name = pod_name
        self.pod_uid = pod_uid
        self.loop: Converger[str] = Converger(
            f"readiness/{pod_name}", self._reconcile, retries=retries, clock=self.clock
        )
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
            if self.own_check is not None:
                tasks.create_task(self._until_pod_ready(), name="readiness-early")

    async def _loop(self) -> None:
        await self.informer.has_synced()
        self.loop.add(_KEY)
        await self.loop.run()

    async def _until_pod_ready(self) -> None:
        if self.imex_started is not None:
            await self.imex_started.wait()
        poll = retrying(
            self.clock,
            wait=wait_exponential(multiplier=EARLY_MIN_S, exp_base=EARLY_GROWTH, min=EARLY_MIN_S, max=EARLY_MAX_S),
            retry=retry_if_result(lambda done: not done),
        )
        await poll(self.early_once)

    async def early_once(self) -> bool:
        """Ask our own check once, unless the pod was Ready already (then True: the poll ends)."""
        if self.pod_was_ready:
            return True
        assert self.own_check is not None
        try:
            ready = (await self.own_check()).ready
        except Exception as exc:  # the probes report a broken check; here it only means "not yet"
            log.debug("own check failed: %r", exc)
            ready = False
        if ready != self.check_ready and not self.pod_was_ready:
            self.check_ready = ready
            self.loop.add(_KEY)
        return self.pod_was_ready

    async def _reconcile(self, _key: str) -> ReconcileResult:
        await self.mirror_once()
        return DONE

    async def mirror_once(self) -> ReadyStatus | None:
        status = pod_status(self.informer.get(self.pod_name, self.namespace), self.pod_uid)
        if status is None:
            return None
        if status is ReadyStatus.READY:
            self.pod_was_ready = True
        early = not self.pod_was_ready and self.check_ready
        if early:
            status = ReadyStatus.READY  # our own check said READY before the kubelet's probe asked it
        written = self.registry.last_written
        if status == self.registry.status and written is not None and written.status == status:
            return status
        source = "our own check, before the pod's first Ready" if early else "the pod's Ready condition"
        log.info("readiness changed pod=%s/%s status=%s (%s)", self.namespace, self.pod_name, status, source)
        await self.registry.set_status(status)
        self.writes += 1
        return status
