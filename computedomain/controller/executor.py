"""The thin, impure half of the reconcile: apply ``Plan``s through the Kubernetes API, and sweep orphans.

``Reconciler.reconcile(uid)`` is the work queue's callback. It reads the domain from the synced caches (a
domain the cache does not have is left alone: missing from a cache is not deleted), then loops
``desired`` -> apply the batch -> ``fold`` the apiserver's answers -> ``desired`` until the plan is empty.
Every write is conditional: merge patches of finalizers carry the resourceVersion they were computed from,
status writes are PUTs of the status subresource with the cached resourceVersion, deletes carry the UID
precondition, node label removal tests the label's value. A conflict fails the pass; the work queue retries it
with backoff, by which time the watch has delivered the newer object. A status write that only tells more
progress of a waiting domain (``status.is_progress``) within ``status.PROGRESS_INTERVAL`` of this process's
last status write for that domain waits for the rest of the interval (``RequeueAfter``): daemons that
register one after another cost a few status writes, not one each.

A plan that is ``stuck`` (a spec the controller cannot act on) raises ``Stuck``; any other failure simply
raises. The convergence loop (``kube.converge``) decides what that means: transient failures are retried
quietly with backoff, repeated and permanent ones reach ``report.DomainReporter``, which puts them on the
domain (condition and Event).

Status writes check what the apiserver kept (``StatusSchema``): a ComputeDomain CRD older than this controller
(the reference driver's, left on the cluster) prunes ``status.conditions``. The controller then says so once
(a WARNING line and a Warning Event ``StatusConditionsDropped`` on the domain where it saw it), stops treating
the missing conditions as a difference (no write, no Event per reconcile), probes again at most every
``PROBE_EVERY`` seconds with one write, and once conditions are kept again reconciles every domain so each
gets its condition.

``Sweeper`` removes orphans (``cleanup``): a one-key convergence loop, so requests (after every reconcile of a
domain being torn down or gone, on events about unknown domains) coalesce into at most one sweep per second,
with one every ``period`` seconds and at start. A sweep does API work only when the caches show candidates, and then first confirms them with
a consistent list of ComputeDomains from the apiserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.api.models import ComputeDomain, ComputeDomainClique, ComputeDomainStatus
from computedomain.api.types import index_lock, index_locks
from computedomain.controller import adoption, cleanup, daemonset, nodes, status
from computedomain.controller.caches import Caches
from computedomain.controller.observed import Child, ChildKind, NodeView, Observed, decode_child, decode_pod
from computedomain.controller.reconcile import (
    Action,
    AddFinalizer,
    CreateChild,
    DeleteChild,
    DeleteRecord,
    Gone,
    NameTaken,
    Pruned,
    PruneEntries,
    ReleaseChild,
    RemoveFinalizer,
    Result,
    TakeOverDaemonSet,
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
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    KubeClient,
    Raw,
    Resource,
)
from computedomain.kube.clock import utcnow
from computedomain.kube.converge import (
    DEFAULT_RETRIES,
    DONE,
    Converger,
    ReconcileResult,
    RequeueAfter,
    Retries,
    Stuck,
)
from computedomain.kube.errors import AlreadyExists, Invalid, NotFound
from computedomain.kube.events import EventRecorder, EventType, ObjectRef
from computedomain.metrics import Counter
from computedomain.settings import ControllerSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

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


class StatusSchema:
    """Whether the apiserver keeps the ``status.conditions`` the controller writes (see the module)."""

    PROBE_EVERY = 300.0

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pruned = False
        self._clock = clock
        self._probed_at = 0.0
        self._said = False

    def probe(self) -> bool:
        """While conditions are pruned: True at most once per ``PROBE_EVERY`` (that reconcile writes them)."""
        if not self.pruned or self._clock() - self._probed_at < self.PROBE_EVERY:
            return False
        self._probed_at = self._clock()
        return True

    def saw(self, sent: ComputeDomainStatus, written: ComputeDomain) -> str:
        """Record one status write's answer: "pruned" or "kept" when that changed, else ""."""
        if not sent.conditions:
            return ""
        kept = bool(written.status and written.status.conditions)
        if kept == (not self.pruned):
            return ""
        self.pruned = not kept
        self._probed_at = self._clock()
        return "kept" if kept else "pruned"

    def first_time(self) -> bool:
        said, self._said = self._said, True
        return not said


class Writer:
    """The API calls behind each action; shared by the reconcile and the sweep."""

    def __init__(
        self,
        client: KubeClient,
        caches: Caches,
        recorder: EventRecorder | None,
        *,
        on_conditions_kept: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        # Status writes report; the writes that make a domain work go before them under a burst.
        self._status_client = client.with_own_budget(background=True)
        self.caches = caches
        self.recorder = recorder
        self.schema = StatusSchema()
        self._on_kept = on_conditions_kept

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

    async def label_node(self, name: str, *, expect: str | None, value: str | None) -> bool:
        """Change the CD label of node ``name`` from ``expect`` to ``value`` (None: absent): read the node, then
        a merge patch with the resourceVersion read (``Conflict`` if it changed in between). False when the
        label was neither: it changed since the caches showed it, decide again."""
        try:
            raw = await self.client.get(NODES, name)
        except NotFound:
            return True
        meta = raw.get("metadata") or {}
        current = (meta.get("labels") or {}).get(COMPUTE_DOMAIN_LABEL)
        if current == value:
            return True
        if current != expect:
            return False
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion"), "labels": {COMPUTE_DOMAIN_LABEL: value}}}
        with contextlib.suppress(NotFound):
            await self.client.merge_patch(NODES, name, patch)
        return True

    async def write_status(self, cd: ComputeDomain, new: ComputeDomainStatus) -> ComputeDomain:
        """PUT the status subresource with the resourceVersion ``cd`` was read at (``Conflict`` if stale)."""
        body = {
            "apiVersion": cd.api_version,
            "kind": cd.kind,
            "metadata": {
                "name": cd.metadata.name,
                "namespace": cd.metadata.namespace,
                "resourceVersion": cd.metadata.resource_version,
            },
            "status": new.to_api(),
        }
        raw = await self._status_client.replace(
            COMPUTE_DOMAINS, body, namespace=cd.metadata.namespace, subresource="status"
        )
        written = ComputeDomain.model_validate(raw)
        self.caches.note_written(written)
        change = self.schema.saw(new, written)
        if change == "pruned" and self.schema.first_time():
            message = (
                "the apiserver dropped status.conditions from a status write: the ComputeDomain CRD on this cluster "
                "is older than this controller (the reference driver's CRDs are left behind by Helm). Conditions "
                "are not written until it is updated: helm upgrade with crds.upgrade=true, or kubectl apply "
                "--server-side -f the chart's crds/ directory. status.status and status.nodes are written as usual"
            )
            log.warning("%s cd=%s", message, _name(cd))
            self.event(cd, EventType.WARNING, "StatusConditionsDropped", message)
        elif change == "kept":
            log.info("the apiserver keeps status.conditions again (CRD updated); writing every domain's conditions")
            if self._on_kept is not None:
                self._on_kept()
        return written

    async def prune(self, cd: ComputeDomain, action: PruneEntries) -> Pruned:
        """Remove entries whose daemon pod is gone, decided on live reads, not on the caches (which lag each
        other: upstream, a lagging pod cache removed live entries and daemons swapped indices). The clique is
        read first, then the domain's pods are listed (a quorum read), so every entry read was written by a
        daemon whose pod the list shows unless that pod is gone since; an entry is removed only if it is one of
        ``action.nodes`` and no listed pod of the domain hosts it in this clique (``status.hosts_entry``). The
        rest of the clique is written back as read, with that resourceVersion: a daemon that registers after
        the read makes the write a ``Conflict`` (retried), never a lost entry. Design note 0002."""
        ns, name = action.clique.metadata.namespace, action.clique.metadata.name
        try:
            raw = await self.client.get(COMPUTE_DOMAIN_CLIQUES, name, namespace=ns)
        except NotFound:
            return Pruned(None, ())
        listed = await self.client.list_all(PODS, namespace=ns, label_selector=f"{COMPUTE_DOMAIN_LABEL}={cd.uid}")
        pods = tuple(decode_pod(p) for p in listed.items)
        clique = ComputeDomainClique.model_validate(raw)
        gone = set(action.nodes) & set(status.stale_entries([clique], pods).get(name, ()))
        if not gone:
            return Pruned(clique, pods)
        daemons = raw.get("daemons") or []
        kept = [d for d in daemons if not (isinstance(d, dict) and d.get("nodeName") in gone)]
        # The slot locks of the pruned entries go with them, so a newcomer need not take them over.
        meta = dict(raw.get("metadata") or {})
        stale = {index_lock(i) for i, node in index_locks(meta.get("annotations")).items() if node in gone}
        meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in stale}
        written = await self.client.replace(
            COMPUTE_DOMAIN_CLIQUES, {**raw, "metadata": meta, "daemons": kept}, namespace=ns
        )
        removed = ", ".join(sorted(gone & {str(d.get("nodeName")) for d in daemons if isinstance(d, dict)}))
        log.info("pruned stale clique entries cd=%s clique=%s/%s nodes=%s", _name(cd), ns, name, removed)
        self.event(
            cd,
            EventType.NORMAL,
            "DaemonGone",
            f"removed node {removed} from ComputeDomainClique {name}: its IMEX daemon pod is gone without having "
            "removed its entry (node lost or daemon killed)",
        )
        return Pruned(ComputeDomainClique.model_validate(written), pods)


class Reconciler:
    """The work queue's callback: ``reconcile(uid)`` converges one domain (see the module docstring)."""

    def __init__(
        self,
        writer: Writer,
        settings: ControllerSettings,
        *,
        after_reconcile: Callable[[], None] | None = None,
        now: Callable[[], datetime] = utcnow,
    ) -> None:
        self.writer = writer
        self.client = writer.client
        self.caches = writer.caches
        self.settings = settings
        self._after = after_reconcile
        self._now = now
        # Domains whose finalizer we removed, by UID -> the resourceVersion we removed it from.
        self._released: dict[str, tuple[str, float]] = {}
        # When this process last wrote each domain's status (monotonic), for spacing progress writes.
        self._status_written: dict[str, float] = {}

    async def reconcile(self, uid: str) -> ReconcileResult:
        try:
            return await self._reconcile(uid)
        finally:
            # Orphans come only from a domain being torn down or gone (a node labelled after its teardown);
            # a live domain's reconcile asks for no sweep.
            cd = self.caches.cd(uid)
            if self._after is not None and (cd is None or cd.metadata.deletion_timestamp is not None):
                self._after()

    async def _reconcile(self, uid: str) -> ReconcileResult:
        observed = self.caches.observe(uid)
        if observed is None:
            self._released.pop(uid, None)
            self._status_written.pop(uid, None)
            return DONE
        released = self._released.get(uid)
        if released is not None and released[0] == observed.cd.metadata.resource_version:
            # We dropped our finalizer from exactly this version, so the domain is gone and the cache lags.
            # Nothing would wake us for an unchanged object if it were not: look once more later, and after
            # that treat it as any other domain.
            if time.monotonic() - released[1] < RELEASED_RECHECK:
                return RequeueAfter(RELEASED_RECHECK)
            del self._released[uid]
        schema = self.writer.schema
        if schema.pruned and not schema.probe():
            observed = replace(observed, conditions_pruned=True)
        result = await self._converge(observed)
        if schema.pruned and result is DONE:
            return RequeueAfter(StatusSchema.PROBE_EVERY)  # so a fixed CRD is noticed without other events
        return result

    async def _converge(self, observed: Observed) -> ReconcileResult:
        uid = observed.cd.uid
        for _ in range(MAX_ROUNDS):
            plan = desired(observed, self.settings, self._now())
            if plan.stuck is not None:
                reason, message = plan.stuck
                raise Stuck(message, reason=reason)
            if not plan:
                if plan.waiting:
                    log.debug("reconcile waiting cd=%s uid=%s %s", _name(observed.cd), uid, plan.waiting)
                break
            wait = self._progress_wait(observed, plan.actions)
            if wait > 0:
                # Only progress to write, and the last write was moments ago: it coalesces with what comes next.
                return RequeueAfter(wait)
            log.debug("reconcile cd=%s uid=%s actions=%s", _name(observed.cd), uid, plan.actions)
            results = await gather_all(self._apply(observed, a) for a in plan.actions)
            for action, result in zip(plan.actions, results, strict=True):
                observed = fold(observed, action, result)
        else:
            log.warning("reconcile did not converge cd=%s uid=%s rounds=%d", _name(observed.cd), uid, MAX_ROUNDS)
            return RequeueAfter(1.0)
        if observed.name_conflicts and observed.cd.metadata.deletion_timestamp is None:
            return RequeueAfter(CONFLICT_RECHECK)
        return DONE

    def _progress_wait(self, observed: Observed, actions: tuple[Action, ...]) -> float:
        """Seconds to hold a status write that only tells progress (``status.is_progress``); 0: write now."""
        if len(actions) != 1 or not isinstance(actions[0], WriteStatus):
            return 0.0
        last = self._status_written.get(observed.cd.uid)
        if last is None or not status.is_progress(observed.cd.status, actions[0].status):
            return 0.0
        return max(0.0, last + status.PROGRESS_INTERVAL - time.monotonic())

    async def _apply(self, observed: Observed, action: Action) -> Result:
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
            self._status_written.pop(cd.uid, None)
            log.info("teardown complete cd=%s uid=%s", _name(cd), cd.uid)
            # Whatever the apiserver answered, our part is done: fold a copy without our finalizer.
            meta = cd.metadata.model_copy(
                update={"finalizers": tuple(_finalizers_without_ours(cd.metadata.finalizers))}
            )
            return cd.model_copy(update={"metadata": meta})
        if isinstance(action, CreateChild):
            return await self._create(cd, action)
        if isinstance(action, TakeOverDaemonSet):
            return await self._take_over(cd, action.child)
        if isinstance(action, DeleteChild):
            return await self.writer.delete_child(action.child)
        if isinstance(action, ReleaseChild):
            return await self.writer.release_child(action.child)
        if isinstance(action, UnlabelNode):
            return await self.writer.unlabel_node(action.node)
        if isinstance(action, PruneEntries):
            return await self.writer.prune(cd, action)
        if isinstance(action, DeleteRecord):
            meta = action.clique.metadata
            with contextlib.suppress(NotFound):
                await self.client.delete(
                    COMPUTE_DOMAIN_CLIQUES, meta.name, namespace=meta.namespace, uid=meta.uid, drop_managed_fields=True
                )
            log.info("deleted channel record cd=%s record=%s/%s", _name(cd), meta.namespace, meta.name)
            return Gone()
        if isinstance(action, WriteStatus):
            written = await self.writer.write_status(cd, action.status)
            self._status_written[cd.uid] = time.monotonic()
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

    async def _create(self, cd: ComputeDomain, action: CreateChild) -> Child | NameTaken:
        resource = resource_of(action.kind)
        try:
            raw = await self.client.create(resource, action.body, namespace=action.namespace)
        except AlreadyExists:
            raw = await self.client.get(resource, action.name, namespace=action.namespace)
            existing = decode_child(raw, action.kind)
            why = adoption.why_foreign(cd, existing, self.settings)
            if why is None:
                return existing
            detail = (
                f"{_describe(action.kind)} {action.namespace}/{action.name} already exists and is not this "
                f"ComputeDomain's ({why}); delete it"
            )
            if action.kind is ChildKind.WORKLOAD_TEMPLATE:
                detail += ", or recreate the ComputeDomain with another spec.channel.resourceClaimTemplate.name"
            log.warning("name taken cd=%s uid=%s object=%s why=%s", _name(cd), cd.uid, existing, why)
            return NameTaken(detail)
        child = decode_child(raw, action.kind)
        self.caches.note_created(child)
        log.info("created cd=%s uid=%s object=%s", _name(cd), cd.uid, child)
        return child

    async def _take_over(self, cd: ComputeDomain, child: Child) -> Child | Gone:
        """Replace the pod template of the reference's DaemonSet (read fresh; the write carries its
        resourceVersion, so a concurrent change is a ``Conflict`` and retried)."""
        try:
            current = await self.client.get(DAEMONSETS, child.name, namespace=child.namespace)
            raw = await self.client.replace(
                DAEMONSETS, daemonset.taken_over(current, cd, self.settings), namespace=child.namespace
            )
        except NotFound:
            return Gone()
        taken = decode_child(raw, ChildKind.DAEMONSET)
        log.info(
            "took over the reference driver's DaemonSet cd=%s uid=%s object=%s running_daemons=%d",
            _name(cd),
            cd.uid,
            taken,
            child.content.scheduled,
        )
        self.writer.event(
            cd,
            EventType.NORMAL,
            "TookOverDaemonSet",
            f"DaemonSet {child.namespace}/{child.name} was made by the reference driver: its {child.content.scheduled} "
            "running IMEX daemon(s) keep running; daemons started from now on are this service's (OnDelete updates)",
        )
        return taken


def _describe(kind: ChildKind) -> str:
    return {
        ChildKind.DAEMONSET: "DaemonSet",
        ChildKind.DAEMON_TEMPLATE: "daemon ResourceClaimTemplate",
        ChildKind.WORKLOAD_TEMPLATE: "ResourceClaimTemplate",
        ChildKind.NETWORK_POLICY: "NetworkPolicy",
    }[kind]


def _name(cd: ComputeDomain) -> str:
    return f"{cd.metadata.namespace}/{cd.metadata.name}"


class Sweeper:
    """Coalesced orphan sweeps on a one-key convergence loop (see the module docstring)."""

    KEY = "sweep"

    def __init__(
        self, writer: Writer, *, period: float = 600.0, spacing: float = 1.0, retries: Retries = DEFAULT_RETRIES
    ) -> None:
        self.writer = writer
        self.loop: Converger[str] = Converger(
            "orphan-sweep", self._reconcile, spacing=spacing, every=period, retries=retries
        )

    def request(self) -> None:
        self.loop.add(self.KEY)

    async def run(self) -> None:
        self.request()  # at start
        await self.loop.run()

    async def _reconcile(self, _key: str) -> ReconcileResult:
        try:
            await self.sweep()
        except Exception:
            SWEEPS.labels("error").inc()
            raise
        return DONE

    async def sweep(self) -> bool:
        """One pass; True when it had to talk to the apiserver."""
        caches = self.writer.caches
        ours = [c for c in caches.children() if adoption.belongs(c, caches.settings)]
        found = cleanup.candidates(ours, caches.nodes.list(), caches.all_cliques(), caches.known_uids())
        if not found:
            SWEEPS.labels("clean").inc()
            return False
        live = await self.writer.client.list_all(COMPUTE_DOMAINS)
        orphans = cleanup.confirm(found, {_uid_of(cd) for cd in live.items})
        if not orphans:
            SWEEPS.labels("lagging_cache").inc()
            return True
        log.info("removing orphans of deleted ComputeDomains: %s", orphans.describe())
        await gather_all(
            [
                *(self._child(c) for c in orphans.children),
                *(self.writer.unlabel_node(n) for n in orphans.nodes),
                *(self._clique(c.metadata.namespace, c.metadata.name) for c in orphans.cliques),
            ]
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


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Run all, let every one finish (none is left running unawaited), then raise the first error."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
