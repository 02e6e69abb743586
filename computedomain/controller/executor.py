"""The thin, impure half of the reconcile: apply ``Plan``s through the Kubernetes API, and sweep orphans.

``Reconciler.reconcile(uid)`` is the work queue's callback. It reads the domain from the synced caches (a
domain the cache does not have is left alone: missing from a cache is not deleted), then loops
``desired`` -> apply the batch -> ``fold`` the apiserver's answers -> ``desired`` until the plan is empty.
Every write is conditional: merge patches of finalizers carry the resourceVersion they were computed from,
status writes are PUTs of the status subresource with the cached resourceVersion, deletes carry the UID
precondition, node label removal tests the label's value. A conflict fails the pass; the work queue retries it
with backoff, by which time the watch has delivered the newer object.

``Sweeper`` removes orphans (``cleanup``): coalesced requests (after every reconcile, on events about
unknown domains), a run at start and one every ``period`` seconds. It does API work only when the caches show
candidates, and then first confirms them with a consistent list of ComputeDomains from the apiserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from prometheus_client import Counter

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, GROUP_VERSION
from computedomain.api.models import ComputeDomain
from computedomain.controller import cleanup, nodes
from computedomain.controller.caches import Caches
from computedomain.controller.observed import Child, ChildKind, NodeView, Observed, decode_child
from computedomain.controller.reconcile import (
    Action,
    AddFinalizer,
    CreateChild,
    DeleteChild,
    Gone,
    NameTaken,
    ReleaseChild,
    RemoveFinalizer,
    Result,
    UnlabelNode,
    WriteStatus,
    desired,
    fold,
)
from computedomain.kube.client import (
    COMPUTE_DOMAIN_CLIQUES,
    COMPUTE_DOMAINS,
    DAEMONSETS,
    NETWORK_POLICIES,
    NODES,
    RESOURCE_CLAIM_TEMPLATES,
    KubeClient,
    Raw,
    Resource,
)
from computedomain.kube.clock import utcnow
from computedomain.kube.converge import DONE, ReconcileResult, RequeueAfter
from computedomain.kube.errors import AlreadyExists, Invalid, NotFound
from computedomain.kube.events import EventRecorder, EventType, ObjectRef
from computedomain.settings import ControllerSettings

log = logging.getLogger(__name__)

MAX_ROUNDS = 16
CONFLICT_RECHECK = 30.0
RELEASED_RECHECK = 10.0

ORPHANS_REMOVED = Counter(
    "computedomain_controller_orphans_removed_total", "Orphaned objects removed by the sweep, by kind.", ["kind"]
)
SWEEPS = Counter("computedomain_controller_sweeps_total", "Orphan sweeps, by outcome.", ["outcome"])


def resource_of(kind: ChildKind) -> Resource:
    if kind is ChildKind.DAEMONSET:
        return DAEMONSETS
    if kind is ChildKind.NETWORK_POLICY:
        return NETWORK_POLICIES
    return RESOURCE_CLAIM_TEMPLATES


def cd_ref(cd: ComputeDomain) -> ObjectRef:
    return ObjectRef(
        kind="ComputeDomain",
        api_version=GROUP_VERSION,
        name=cd.metadata.name,
        namespace=cd.metadata.namespace,
        uid=cd.uid,
    )


def _finalizers_without_ours(finalizers: tuple[str, ...]) -> list[str]:
    return [f for f in finalizers if f != COMPUTE_DOMAIN_FINALIZER]


class Writer:
    """The API calls behind each action; shared by the reconcile and the sweep."""

    def __init__(self, client: KubeClient, caches: Caches, recorder: EventRecorder | None) -> None:
        self.client = client
        self.caches = caches
        self.recorder = recorder

    def event(self, cd: ComputeDomain, type_: str, reason: str, message: str) -> None:
        if self.recorder is not None:
            self.recorder.record(cd_ref(cd), type_, reason, message)

    async def delete_child(self, child: Child) -> Child | Gone:
        try:
            raw = await self.client.delete(
                resource_of(child.kind), child.name, namespace=child.namespace, uid=child.uid
            )
        except NotFound:
            return Gone()
        if raw.get("kind") == "Status" or not (raw.get("metadata") or {}).get("finalizers"):
            return Gone()
        return decode_child(raw, child.kind)

    async def release_child(self, child: Child) -> Child | Gone:
        patch: dict[str, Any] = {
            "metadata": {
                "resourceVersion": child.resource_version,
                "finalizers": _finalizers_without_ours(child.finalizers) or None,
            }
        }
        try:
            raw = await self.client.merge_patch(resource_of(child.kind), child.name, patch, namespace=child.namespace)
        except NotFound:
            return Gone()
        released = decode_child(raw, child.kind)
        return Gone() if released.terminating and not released.finalizers else released

    async def unlabel_node(self, node: NodeView) -> Gone:
        # NotFound: the node is gone. Invalid: the test op failed, so the label no longer names this domain.
        # Either way the label is no longer ours.
        with contextlib.suppress(NotFound, Invalid):
            await self.client.json_patch(NODES, node.name, nodes.unlabel_patch(node))
        return Gone()


class Reconciler:
    """The work queue's callback: ``reconcile(uid)`` converges one domain (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        caches: Caches,
        settings: ControllerSettings,
        *,
        recorder: EventRecorder | None = None,
        after_reconcile: Callable[[], None] | None = None,
        now: Callable[[], datetime] = utcnow,
    ) -> None:
        self.client = client
        self.caches = caches
        self.settings = settings
        self.writer = Writer(client, caches, recorder)
        self._after = after_reconcile
        self._now = now
        # Domains whose finalizer we removed, by UID -> the resourceVersion we removed it from.
        self._released: dict[str, tuple[str, float]] = {}

    async def reconcile(self, uid: str) -> ReconcileResult:
        try:
            return await self._reconcile(uid)
        finally:
            if self._after is not None:
                self._after()

    async def _reconcile(self, uid: str) -> ReconcileResult:
        observed = self.caches.observe(uid)
        if observed is None:
            self._released.pop(uid, None)
            return DONE
        released = self._released.get(uid)
        if released is not None and released[0] == observed.cd.metadata.resource_version:
            # We dropped our finalizer from exactly this version, so the domain is gone and the cache lags.
            # Nothing would wake us for an unchanged object if it were not: look once more later, and after
            # that treat it as any other domain.
            if time.monotonic() - released[1] < RELEASED_RECHECK:
                return RequeueAfter(RELEASED_RECHECK)
            del self._released[uid]
        created: list[str] = []
        try:
            return await self._converge(observed, created)
        finally:
            if created:
                # One Event per pass, not one per object: Events are API writes too.
                self.writer.event(observed.cd, EventType.NORMAL, "Created", "created " + ", ".join(created))

    async def _converge(self, observed: Observed, created: list[str]) -> ReconcileResult:
        uid = observed.cd.uid
        for _ in range(MAX_ROUNDS):
            plan = desired(observed, self.settings, self._now())
            if not plan:
                if plan.waiting:
                    log.debug("reconcile waiting cd=%s uid=%s %s", _name(observed.cd), uid, plan.waiting)
                break
            log.debug("reconcile cd=%s uid=%s actions=%s", _name(observed.cd), uid, plan.actions)
            results = await asyncio.gather(
                *(self._apply(observed, a, created) for a in plan.actions), return_exceptions=True
            )
            error: BaseException | None = None
            for action, result in zip(plan.actions, results, strict=True):
                if isinstance(result, BaseException):
                    error = error or result
                    continue
                observed = fold(observed, action, result)
            if error is not None:
                raise error
        else:
            log.warning("reconcile did not converge cd=%s uid=%s rounds=%d", _name(observed.cd), uid, MAX_ROUNDS)
            return RequeueAfter(1.0)
        if observed.template_name_conflict and observed.cd.metadata.deletion_timestamp is None:
            return RequeueAfter(CONFLICT_RECHECK)
        return DONE

    async def _apply(self, observed: Observed, action: Action, created: list[str]) -> Result:
        cd = observed.cd
        patch: dict[str, Any]
        if isinstance(action, AddFinalizer):
            patch = {
                "metadata": {
                    "resourceVersion": cd.metadata.resource_version,
                    "finalizers": [*cd.metadata.finalizers, COMPUTE_DOMAIN_FINALIZER],
                }
            }
            with_finalizer = ComputeDomain.model_validate(
                await self.client.merge_patch(COMPUTE_DOMAINS, cd.metadata.name, patch, namespace=cd.metadata.namespace)
            )
            self.caches.note_written(with_finalizer)
            return with_finalizer
        if isinstance(action, RemoveFinalizer):
            patch = {
                "metadata": {
                    "resourceVersion": cd.metadata.resource_version,
                    "finalizers": _finalizers_without_ours(cd.metadata.finalizers) or None,
                }
            }
            with contextlib.suppress(NotFound):
                raw = await self.client.merge_patch(
                    COMPUTE_DOMAINS, cd.metadata.name, patch, namespace=cd.metadata.namespace
                )
                self.caches.note_written(ComputeDomain.model_validate(raw))
            self._released[cd.uid] = (cd.metadata.resource_version, time.monotonic())
            log.info("teardown complete cd=%s uid=%s", _name(cd), cd.uid)
            # Whatever the apiserver answered, our part is done: fold a copy without our finalizer.
            meta = cd.metadata.model_copy(
                update={"finalizers": tuple(_finalizers_without_ours(cd.metadata.finalizers))}
            )
            return cd.model_copy(update={"metadata": meta})
        if isinstance(action, CreateChild):
            return await self._create(cd, action, created)
        if isinstance(action, DeleteChild):
            if action.child.kind is ChildKind.WORKLOAD_TEMPLATE:
                self.writer.event(cd, EventType.NORMAL, "TearingDown", "deleting the domain's objects")
            return await self.writer.delete_child(action.child)
        if isinstance(action, ReleaseChild):
            return await self.writer.release_child(action.child)
        if isinstance(action, UnlabelNode):
            return await self.writer.unlabel_node(action.node)
        if isinstance(action, WriteStatus):
            body = {
                "apiVersion": cd.api_version,
                "kind": cd.kind,
                "metadata": {
                    "name": cd.metadata.name,
                    "namespace": cd.metadata.namespace,
                    "resourceVersion": cd.metadata.resource_version,
                },
                "status": action.status.to_api(),
            }
            raw = await self.client.replace(
                COMPUTE_DOMAINS, body, namespace=cd.metadata.namespace, subresource="status"
            )
            written = ComputeDomain.model_validate(raw)
            self.caches.note_written(written)
            log.info(
                "status written cd=%s uid=%s status=%s",
                _name(cd),
                cd.uid,
                written.status.status if written.status else "",
            )
            for ev in action.events:
                self.writer.event(cd, ev.type, ev.reason, ev.message)
            return written
        raise TypeError(f"unknown action {action!r}")  # pragma: no cover

    async def _create(self, cd: ComputeDomain, action: CreateChild, created: list[str]) -> Child | NameTaken:
        resource = resource_of(action.kind)
        try:
            raw = await self.client.create(resource, action.body, namespace=action.namespace)
        except AlreadyExists:
            raw = await self.client.get(resource, action.name, namespace=action.namespace)
            existing = decode_child(raw, action.kind)
            if existing.cd_uid != cd.uid:
                detail = (
                    f"ResourceClaimTemplate {action.namespace}/{action.name} already exists and does not belong "
                    "to this ComputeDomain; delete it, or recreate the ComputeDomain with another "
                    "spec.channel.resourceClaimTemplate.name"
                )
                if action.kind is not ChildKind.WORKLOAD_TEMPLATE:
                    raise
                log.warning("workload template name taken cd=%s uid=%s template=%s", _name(cd), cd.uid, action.name)
                return NameTaken(detail)
            return existing
        child = decode_child(raw, action.kind)
        self.caches.note_created(child)
        log.info("created cd=%s uid=%s object=%s", _name(cd), cd.uid, child)
        created.append(f"{_describe(action.kind)} {child.namespace}/{child.name}")
        return child


def _describe(kind: ChildKind) -> str:
    return {
        ChildKind.DAEMONSET: "DaemonSet",
        ChildKind.DAEMON_TEMPLATE: "daemon ResourceClaimTemplate",
        ChildKind.WORKLOAD_TEMPLATE: "ResourceClaimTemplate",
    }[kind]


def _name(cd: ComputeDomain) -> str:
    return f"{cd.metadata.namespace}/{cd.metadata.name}"


class Sweeper:
    """Coalesced orphan sweeps (see the module docstring)."""

    def __init__(self, writer: Writer, *, period: float = 600.0, min_interval: float = 1.0) -> None:
        self.writer = writer
        self.period = period
        self.min_interval = min_interval
        self._wake = asyncio.Event()

    def request(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                did_io = await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                SWEEPS.labels("error").inc()
                log.info("orphan sweep failed error=%r", exc, exc_info=not hasattr(exc, "status"))
                did_io = True
                self._wake.set()  # try again after the pause
            if did_io:
                await asyncio.sleep(self.min_interval)
            try:
                async with asyncio.timeout(self.period):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def sweep(self) -> bool:
        """One pass; True when it had to talk to the apiserver."""
        caches = self.writer.caches
        found = cleanup.candidates(caches.children(), caches.nodes.list(), caches.all_cliques(), caches.known_uids())
        if not found:
            SWEEPS.labels("clean").inc()
            return False
        live = await self.writer.client.list_all(COMPUTE_DOMAINS)
        orphans = cleanup.confirm(found, {_uid_of(cd) for cd in live.items})
        if not orphans:
            SWEEPS.labels("lagging_cache").inc()
            return True
        log.info("removing orphans of deleted ComputeDomains: %s", orphans.describe())
        await asyncio.gather(
            *(self._child(c) for c in orphans.children),
            *(self.writer.unlabel_node(n) for n in orphans.nodes),
            *(self._clique(c.metadata.namespace, c.metadata.name) for c in orphans.cliques),
        )
        ORPHANS_REMOVED.labels("node_label").inc(len(orphans.nodes))
        SWEEPS.labels("removed").inc()
        return True

    async def _child(self, child: Child) -> None:
        result: Child | Gone = child
        if not child.terminating:
            result = await self.writer.delete_child(child)
        if isinstance(result, Child) and result.has_our_finalizer:
            await self.writer.release_child(result)
        ORPHANS_REMOVED.labels(child.kind.value).inc()

    async def _clique(self, namespace: str, name: str) -> None:
        with contextlib.suppress(NotFound):
            await self.writer.client.delete(COMPUTE_DOMAIN_CLIQUES, name, namespace=namespace)
        ORPHANS_REMOVED.labels("ComputeDomainClique").inc()


def _uid_of(raw: Raw) -> str:
    meta: dict[str, Any] = raw.get("metadata") or {}
    return str(meta.get("uid") or "")
