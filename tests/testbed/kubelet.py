"""A STAND-IN for the kubelet's DRA side on one simulated node (test bed and demo only; not product code).

kwok plays the rest of the kubelet (node heartbeats, pod phases). This stand-in does what the kubelet's
plugin manager and DRA manager do, over the plugin's real unix sockets and the real API server:

- **registration**: watches the registrar directory for `*-reg.sock` files like the kubelet's plugin
  watcher, runs the handshake (`KubeletClient`: GetInfo, validation, dial the endpoint,
  NotifyRegistrationStatus); a socket that is replaced (the plugin restarted) is registered again, a
  socket that disappears is deregistered;
- **Prepare before the pod runs**: watches the pods bound to its node; for a Pending pod with
  `resourceClaims` it resolves the claim names (template claims through `status.resourceClaimStatuses`),
  checks that each claim is allocated and reserved for the pod, records it in its claim cache *before*
  calling the driver (as the kubelet does, so that a failed or interrupted Prepare is still unprepared
  later), and calls `NodePrepareResources` per driver with the kubelet's 45 s deadline. When every claim
  is prepared it annotates the pod `testbed.computedomain/claims-prepared: "true"` (plus the CDI device IDs
  it got), which is kwok's cue to run it (`kwok-stages.yaml`);
- **Unprepare before the pod goes**: for a terminating pod it calls `NodeUnprepareResources` for each of
  its cached claims no other pod on the node uses, and only when all succeeded annotates the pod
  `testbed.computedomain/claims-unprepared: "true"`, kwok's cue to delete it. While the plugin is down the
  pod stays Terminating and its claims stay allocated and reserved, as on a real node;
- **failures** are recorded as Warning Events on the pod (`FailedPrepareDynamicResources`, the kubelet's
  reason, and `FailedUnprepareDynamicResources` for the other direction) and retried after the pod
  worker's backoff (the kubelet's is 10 s; tests shorten it).

Not modelled: containers, CDI injection (the CDI IDs are only recorded), the kubelet's own checkpoint (the
stand-in is never restarted in the middle of a test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc

from computedomain.kube.client import PODS, RESOURCE_CLAIMS, KubeClient, Raw
from computedomain.kube.errors import KubeError, NotFound
from computedomain.kube.events import EventRecorder, EventType, ObjectRef
from computedomain.kube.informer import Informer, object_key
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from tests.testbed.kubelet_client import KUBELET_DRA_TIMEOUT_S, KubeletClient, RegistrationRejectedError

log = logging.getLogger("kubelet-standin")

PREPARED_ANNOTATION: Final = "testbed.computedomain/claims-prepared"
UNPREPARED_ANNOTATION: Final = "testbed.computedomain/claims-unprepared"
CDI_ANNOTATION: Final = "testbed.computedomain/cdi-devices"
KUBELET_BACKOFF_S: Final = 10.0
WATCH_INTERVAL_S: Final = 0.1


class NotYetError(Exception):
    """The pod cannot be handled yet (claim not created/allocated/reserved); retry soon, no Event."""


@dataclass
class CachedClaim:
    """The kubelet's claim info: which pods of this node use the claim, and whether Prepare succeeded."""

    ref: ClaimRef
    drivers: tuple[str, ...]
    pods: set[str] = field(default_factory=set)
    prepared: bool = False
    cdi_ids: tuple[str, ...] = ()


@dataclass
class _Plugin:
    socket: Path
    identity: tuple[int, int]  # (inode, ctime): a re-created socket may reuse the inode number
    client: KubeletClient


def pod_claim_names(pod: Raw) -> list[str] | None:
    """The ResourceClaim names of a pod; None while a template's claim has not been created yet."""
    statuses = {
        s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
    }
    names = []
    for rc in (pod.get("spec") or {}).get("resourceClaims") or ():
        if rc.get("resourceClaimName"):
            names.append(str(rc["resourceClaimName"]))
        elif rc.get("resourceClaimTemplateName"):
            if rc["name"] not in statuses:
                return None
            if statuses[rc["name"]]:  # None: the claim is not needed (a template that produced none)
                names.append(str(statuses[rc["name"]]))
    return names


class KubeletStandIn:
    def __init__(
        self,
        client: KubeClient,
        node_name: str,
        registrar_dir: Path,
        *,
        backoff_s: float = KUBELET_BACKOFF_S,
        dra_timeout_s: float = KUBELET_DRA_TIMEOUT_S,
        pods: Informer[Raw] | None = None,
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.registrar_dir = registrar_dir
        self.backoff_s = backoff_s
        self.dra_timeout_s = dra_timeout_s
        self.plugins: dict[str, _Plugin] = {}
        self.claims: dict[str, CachedClaim] = {}
        self.events = EventRecorder(client, component="kubelet", instance=node_name)
        # `pods`: an informer of a wider set of pods that the caller runs and shares among the stand-ins of
        # many nodes (one watch instead of one per node); otherwise this stand-in watches its node's pods.
        self._own_informer = pods is None
        self.pods: Informer[Raw] = (
            pods
            if pods is not None
            else Informer(
                client,
                PODS,
                decode=lambda raw: raw,
                field_selector=f"spec.nodeName={node_name}",
                name=f"pods-{node_name}",
            )
        )
        self.pods.add_handler(
            on_add=self._enqueue_pod, on_update=lambda _o, new: self._enqueue_pod(new), on_delete=self._enqueue_pod
        )
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.registrations = 0
        self.calls: list[tuple[str, str]] = []  # (operation, claim uid), for tests
        # Test hook, called synchronously right before an RPC goes out: (operation, claims).
        self.on_call: Callable[[str, list[ClaimRef]], None] | None = None

    # -- lifecycle

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._watch_plugins(), name=f"standin-plugins-{self.node_name}")
                if self._own_informer:
                    tasks.create_task(self.pods.run(), name=f"standin-pods-{self.node_name}")
                tasks.create_task(self._dispatch(), name=f"standin-dispatch-{self.node_name}")
        finally:
            for worker in self._workers.values():
                worker.cancel()
            for timer in self._timers.values():
                timer.cancel()
            for plugin in self.plugins.values():
                await plugin.client.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.events.aclose(), 2)

    # -- plugin watcher

    async def _watch_plugins(self) -> None:
        while True:
            await self._scan_plugins()
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _scan_plugins(self) -> None:
        seen: dict[Path, tuple[int, int]] = {}
        if self.registrar_dir.is_dir():
            for path in self.registrar_dir.glob("*-reg.sock"):
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    seen[path] = (st.st_ino, st.st_ctime_ns)
        for name, plugin in list(self.plugins.items()):
            if seen.get(plugin.socket) != plugin.identity:
                log.info("plugin socket gone or replaced; deregistering driver=%s", name)
                del self.plugins[name]
                await plugin.client.close()
        known = {p.socket: p.identity for p in self.plugins.values()}
        for path, identity in seen.items():
            if known.get(path) == identity:
                continue
            client = KubeletClient(path, driver_name=path.name.removesuffix("-reg.sock"), timeout_s=self.dra_timeout_s)
            try:
                await asyncio.wait_for(client.register(), 15)
            except (grpc.aio.AioRpcError, RegistrationRejectedError, TimeoutError, OSError) as exc:
                log.info("registration failed socket=%s error=%r; trying again", path, exc)
                await client.close()
                continue
            assert client.info is not None
            self.plugins[client.info.name] = _Plugin(path, identity, client)
            self.registrations += 1
            log.info("registered driver=%s endpoint=%s", client.info.name, client.info.endpoint)
            self._enqueue_all()

    def record_prepared(self, pod: Raw, ref: ClaimRef, driver: str, cdi_ids: Iterable[str]) -> None:
        """`ref` of `pod` was prepared by a driver no longer registered here, as the kubelet's own checkpoint
        remembers it when one plugin replaces another under running pods: this stand-in calls no Prepare for it
        (and lets the pod run), and calls Unprepare on whichever plugin serves `driver` when the pod goes."""
        meta = pod["metadata"]
        key = object_key(meta["namespace"], meta["name"])
        cached = self.claims.setdefault(ref.uid, CachedClaim(ref, (driver,)))
        cached.pods.add(key)
        cached.prepared, cached.cdi_ids = True, tuple(cdi_ids)
        self._mark(key)

    # -- pod queue (one worker per pod at a time, dirty marks coalesce)

    def _enqueue_pod(self, pod: Raw) -> None:
        if (pod.get("spec") or {}).get("nodeName") != self.node_name:
            return  # another node's pod (shared informer)
        meta = pod.get("metadata") or {}
        self._mark(object_key(meta.get("namespace"), str(meta.get("name"))))

    def _enqueue_all(self) -> None:
        for pod in self.pods.list():
            self._enqueue_pod(pod)

    def _mark(self, key: str) -> None:
        self._dirty.add(key)
        self._wake.set()

    def _retry_later(self, key: str, delay: float) -> None:
        if key in self._timers:
            self._timers[key].cancel()
        jittered = delay * (1 + 0.5 * random.random())
        self._timers[key] = asyncio.get_running_loop().call_later(jittered, self._mark, key)

    async def _dispatch(self) -> None:
        await self.pods.has_synced()
        while True:
            await self._wake.wait()
            self._wake.clear()
            for key in list(self._dirty):
                if key in self._workers:
                    continue  # marked dirty; the running worker picks it up again
                self._dirty.discard(key)
                self._workers[key] = asyncio.create_task(self._work(key), name=f"standin-pod-{key}")

    async def _work(self, key: str) -> None:
        try:
            while True:
                try:
                    await self._sync_pod(key)
                except NotYetError as exc:
                    log.debug("pod not ready for DRA yet pod=%s why=%s", key, exc)
                    self._retry_later(key, 0.2)
                except Exception:
                    log.exception("pod sync failed pod=%s", key)
                    self._retry_later(key, self.backoff_s)
                if key not in self._dirty:
                    return
                self._dirty.discard(key)
        finally:
            self._workers.pop(key, None)
            if key in self._dirty:
                self._wake.set()

    # -- the pod sync

    async def _sync_pod(self, key: str) -> None:
        pod = self.pods.get_by_key(key)
        if pod is None:
            return
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if not (pod.get("spec") or {}).get("resourceClaims"):
            return
        if meta.get("deletionTimestamp"):
            if annotations.get(UNPREPARED_ANNOTATION) != "true":
                await self._unprepare_pod(pod)
            return
        if annotations.get(PREPARED_ANNOTATION) == "true" or (pod.get("status") or {}).get("phase") != "Pending":
            return
        await self._prepare_pod(pod)

    def _pod_ref(self, pod: Raw) -> ObjectRef:
        return ObjectRef.for_object(PODS, pod)

    async def _annotate(self, pod: Raw, annotations: dict[str, str]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(NotFound):  # gone already: nothing to tell kwok
            await self.client.merge_patch(
                PODS, meta["name"], {"metadata": {"annotations": annotations}}, namespace=meta["namespace"]
            )

    async def _prepare_pod(self, pod: Raw) -> None:
        meta = pod["metadata"]
        pod_key = object_key(meta["namespace"], meta["name"])
        names = pod_claim_names(pod)
        if names is None:
            raise NotYetError("template claims not created yet")
        wanted: list[CachedClaim] = []
        for name in names:
            try:
                claim = await self.client.get(RESOURCE_CLAIMS, name, namespace=meta["namespace"])
            except NotFound:
                raise NotYetError(f"claim {name} not found") from None
            status = claim.get("status") or {}
            allocation = status.get("allocation")
            if not allocation:
                raise NotYetError(f"claim {name} not allocated")
            if meta["uid"] not in {r.get("uid") for r in status.get("reservedFor") or ()}:
                raise NotYetError(f"claim {name} not reserved for the pod")
            uid = str(claim["metadata"]["uid"])
            drivers = tuple(sorted({str(r["driver"]) for r in (allocation.get("devices") or {}).get("results") or ()}))
            cached = self.claims.setdefault(uid, CachedClaim(ClaimRef(meta["namespace"], name, ClaimUid(uid)), drivers))
            cached.pods.add(pod_key)  # before calling the driver: a failed Prepare is still unprepared later
            wanted.append(cached)
        errors = await self._call_drivers("prepare", [c for c in wanted if not c.prepared])
        if errors:
            message = "Failed to prepare dynamic resources: " + "; ".join(errors)
            self.events.record(self._pod_ref(pod), EventType.WARNING, "FailedPrepareDynamicResources", message)
            log.info("prepare failed pod=%s %s", pod_key, message)
            self._retry_later(pod_key, self.backoff_s)
            return
        cdi = {c.ref.name: list(c.cdi_ids) for c in wanted}
        await self._annotate(pod, {PREPARED_ANNOTATION: "true", CDI_ANNOTATION: json.dumps(cdi, sort_keys=True)})
        log.info("claims prepared; pod may run pod=%s claims=%s", pod_key, ",".join(c.ref.name for c in wanted))

    async def _unprepare_pod(self, pod: Raw) -> None:
        meta = pod["metadata"]
        pod_key = object_key(meta["namespace"], meta["name"])
        mine = [c for c in self.claims.values() if pod_key in c.pods]
        # Claims still used by another (running) pod of this node stay prepared.
        release = [c for c in mine if not (c.pods - {pod_key})]
        errors = await self._call_drivers("unprepare", release)
        if errors:
            message = "Failed to unprepare dynamic resources: " + "; ".join(errors)
            self.events.record(self._pod_ref(pod), EventType.WARNING, "FailedUnprepareDynamicResources", message)
            log.info("unprepare failed; pod stays terminating pod=%s %s", pod_key, message)
            self._retry_later(pod_key, self.backoff_s)
            return
        for claim in mine:
            claim.pods.discard(pod_key)
            if not claim.pods:
                self.claims.pop(claim.ref.uid, None)
        await self._annotate(pod, {UNPREPARED_ANNOTATION: "true"})
        log.info("claims unprepared; pod may go pod=%s", pod_key)

    async def _call_drivers(self, operation: str, claims: Iterable[CachedClaim]) -> list[str]:
        """One call per driver (the kubelet groups a pod's claims by driver); returns error texts."""
        by_driver: dict[str, list[CachedClaim]] = {}
        for claim in claims:
            for driver in claim.drivers:
                by_driver.setdefault(driver, []).append(claim)
        errors: list[str] = []
        for driver, group in by_driver.items():
            plugin = self.plugins.get(driver)
            if plugin is None:
                errors.append(f"DRA driver {driver} is not registered")
                continue
            refs = [c.ref for c in group]
            for ref in refs:
                self.calls.append((operation, ref.uid))
            if self.on_call is not None:
                self.on_call(operation, refs)
            try:
                if operation == "prepare":
                    results: dict[ClaimUid, Any] = await plugin.client.prepare(refs)
                else:
                    results = await plugin.client.unprepare(refs)
            except grpc.aio.AioRpcError as exc:
                errors.append(
                    f"{driver}: Node{operation.capitalize()}Resources failed: {exc.code().name}: {exc.details()}"
                )
                continue
            for claim in group:
                result = results.get(claim.ref.uid)
                if result is None:
                    errors.append(f"{driver}: claim {claim.ref.namespace}/{claim.ref.name} not finished by the driver")
                elif result.error:
                    errors.append(f"{driver}: claim {claim.ref.namespace}/{claim.ref.name}: {result.error}")
                elif operation == "prepare":
                    claim.prepared = True
                    claim.cdi_ids = tuple(i for d in result.devices for i in d.cdi_device_ids)
        return errors


async def pod_events(client: KubeClient, namespace: str, pod: str) -> list[dict[str, Any]]:
    """Events recorded on a pod (for tests)."""
    from computedomain.kube.client import EVENTS

    listed = await client.list(EVENTS, namespace=namespace, field_selector=f"involvedObject.name={pod}")
    return listed.items


__all__ = [
    "CDI_ANNOTATION",
    "PREPARED_ANNOTATION",
    "UNPREPARED_ANNOTATION",
    "KubeError",
    "KubeletStandIn",
    "pod_claim_names",
    "pod_events",
]
