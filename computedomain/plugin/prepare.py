"""Prepare and Unprepare of `compute-domain.nvidia.com` claims: the node agent's `Preparer` (SPEC section 6).

Read the units in this order; each is small and does one job:

1. `collaborators`: what Prepare reads and whom it asks (injected: Kubernetes-backed in the agent, in
   memory in tests and benchmarks);
2. `failures`: what can go wrong, and whether another attempt can help;
3. `claim_plan`: every check that needs no side effect, and the plan (undo record, channels to inject);
4. `side_effects`: what is done on the node per device (label check, readiness wait, host check, `/imexd`);
   with channel isolation, `channels` first makes the claim a holder of its domain's channel;
5. `budget`: attempts and backoff within the kubelet's deadline, and what the kubelet gets when it ends;
6. this module: the order of one attempt around the checkpoint, one attempt per claim at a time, and
   Unprepare.

One Prepare attempt: plan the claim (nothing touched yet) -> the checkpoint decides (completed: return the
stored devices; a tombstone of the same claim state: `StalePrepareError`, permanent, upstream #1162;
another completed claim holds the channel: retryable, #641) -> record `PrepareStarted` with the full undo
plan -> side effects per device (with channel isolation first: hold the domain's channel, then record it,
checked against the other claims on the node) -> write the claim's CDI spec -> `PrepareCompleted` with the
devices returned to the kubelet. A crash at any point leaves an entry that says what may exist.

Unprepare works from the checkpoint alone: it never fetches the claim or the CD and never validates
configs. It cancels a Prepare of the same claim still running in this process, undoes what the entry lists
(CDI spec files; the claim's entry in its domain's channel record, best effort, which the cleanup
finishes), and leaves a tombstone. The node's CD label is the controller's: it goes once no claim of the
domain is allocated here.

A claim that waits for IMEX says so once, as a Warning Event `WaitingForIMEX` on each pod it is reserved
for (node, mode, what was seen), and keeps waiting; from then on its claim is watched, and once the claim is
gone (its pod deleted) the Prepare is cancelled and undone at once, as an Unprepare would.

Concurrency: one task per claim of a request; claims are independent except through the checkpoint, whose
read-modify-writes run one at a time in a worker thread (``run_blocking``, injectable) (an asyncio lock in front of the file lock keeps
this process's own threads from polling for it). Per claim UID, one attempt at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TypeVar

from computedomain.api.constants import DRIVER_NAME
from computedomain.kube.clock import Clock, MonotonicClock, utcnow
from computedomain.metrics import Counter, Histogram
from computedomain.plugin import cdi
from computedomain.plugin.budget import Budget, within_budget
from computedomain.plugin.cdi import CdiSpecDir, ClaimSpec, ContainerEdits
from computedomain.plugin.checkpoint import (
    Checkpoint,
    CheckpointDevice,
    CheckpointStore,
    ClaimEntry,
    DeviceKind,
    InvalidTransitionError,
    begin_prepare,
    check_prepare,
    complete_prepare,
    finish_unprepare,
    record_channel,
    undo_plan,
)
from computedomain.plugin.claim_plan import ClaimPlanner, DevicePlan
from computedomain.plugin.collaborators import (
    ChannelAssignments,
    ClaimReader,
    ClaimSnapshot,
    DaemonReadiness,
    DomainLookup,
    Hardware,
    HostCheck,
    NodeLabeler,
    RunBlocking,
)
from computedomain.plugin.daemon_owner import DaemonPods
from computedomain.plugin.failures import ClaimRejected
from computedomain.plugin.preparer import ClaimRef, ClaimUid, PreparedDevice, PrepareResult, UnprepareResult
from computedomain.plugin.side_effects import READINESS_MARGIN_S, SideEffects

__all__ = ["Preparer", "PreparerConfig"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DOMAINS_DIR: Final = "domains"

PREPARE_CLAIMS = Counter(
    "computedomain_plugin_prepare_claims_total",
    "Claims handled by NodePrepareResources, by outcome (ok, error, unfinished).",
    ["outcome"],
)
UNPREPARE_CLAIMS = Counter(
    "computedomain_plugin_unprepare_claims_total",
    "Claims handled by NodeUnprepareResources, by outcome (ok, error, unfinished).",
    ["outcome"],
)
PREPARE_SECONDS = Histogram(
    "computedomain_plugin_prepare_seconds",
    "Time to prepare one claim, including retries.",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 45),
)


@dataclass(frozen=True)
class PreparerConfig:
    node_name: str
    plugin_dir: Path
    host_managed: bool = False
    driver_name: str = DRIVER_NAME
    budget: Budget = field(default_factory=Budget)
    #: the namespaces the IMEX daemons run in: daemon claims elsewhere are refused
    daemon_namespaces: tuple[str, ...] = ()
    # Channel isolation: channel devices the node publishes (with `Preparer(channels=...)`).
    channel_devices: int = 1

    @property
    def domains_dir(self) -> Path:
        return self.plugin_dir / DOMAINS_DIR


class Preparer:
    """The `preparer.Preparer` of this driver. See the module docstring."""

    def __init__(
        self,
        config: PreparerConfig,
        *,
        store: CheckpointStore,
        cdi_dir: CdiSpecDir,
        claims: ClaimReader,
        domains: DomainLookup,
        labels: NodeLabeler,
        readiness: DaemonReadiness,
        hardware: Hardware,
        host_check: HostCheck | None = None,
        daemon_pods: DaemonPods | None = None,
        channels: ChannelAssignments | None = None,
        clock: Clock | None = None,
        now: Callable[[], datetime] = utcnow,
        rng: random.Random | None = None,
        run_blocking: RunBlocking = asyncio.to_thread,
        on_change: Callable[[], None] | None = None,
        notify: Callable[[ClaimSnapshot, str], None] | None = None,
    ) -> None:
        self.config = config
        #: tells a claim's pods what it waits for (the agent: an Event on each), once per claim
        self.notify = notify or (lambda _claim, _message: None)
        self._noticed: set[str] = set()
        self._gone_watches: dict[str, asyncio.Task[None]] = {}
        #: told when a claim entry begins or is undone (``node_holder``: which domain holds the node)
        self.on_change = on_change or (lambda: None)
        self.run_blocking = run_blocking
        self.store = store
        self.cdi = cdi_dir
        self.channels = channels
        self.hardware = hardware
        self.clock: Clock = clock or MonotonicClock()
        self._now = now
        self._rng = rng or random.Random()
        self.planner = ClaimPlanner(
            node_name=config.node_name,
            host_managed=config.host_managed,
            domains_dir=config.domains_dir,
            claims=claims,
            domains=domains,
            hardware=hardware,
            driver_name=config.driver_name,
            run_blocking=run_blocking,
            daemon_namespaces=config.daemon_namespaces,
            daemon_pods=daemon_pods,
            channels=channels,
            channel_devices=config.channel_devices,
        )
        self.effects = SideEffects(
            host_managed=config.host_managed,
            labels=labels,
            readiness=readiness,
            hardware=hardware,
            host_check=host_check,
            clock=self.clock,
            run_blocking=run_blocking,
        )
        self.claims = claims
        self._store_lock = asyncio.Lock()
        self._claim_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._inflight: dict[str, set[asyncio.Task[Any]]] = {}

    # -- the Preparer protocol

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        results = await asyncio.gather(*(self._run_prepare(ref) for ref in claims))
        return {ref.uid: result for ref, result in zip(claims, results, strict=True) if result is not None}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        results = await asyncio.gather(*(self._run_unprepare(ref) for ref in claims))
        return {ref.uid: result for ref, result in zip(claims, results, strict=True) if result is not None}

    async def _run_prepare(self, ref: ClaimRef) -> PrepareResult | None:
        started = self.clock.now()
        # The work runs in a task of its own so that an Unprepare of the same claim can cancel it without
        # cancelling the RPC that waits for it.
        work = asyncio.create_task(
            within_budget(
                self.config.budget,
                ref,
                "prepare",
                lambda deadline: self._prepare_attempt(ref, deadline),
                lambda message: PrepareResult(error=message),
                clock=self.clock,
                rng=self._rng,
            ),
            name=f"prepare-{ref.uid}",
        )
        self._inflight.setdefault(ref.uid, set()).add(work)
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            work.cancel()  # the RPC itself is being cancelled (shutdown): so is its work
            raise
        finally:
            tasks = self._inflight.get(ref.uid)
            if tasks is not None:
                tasks.discard(work)
                if not tasks:
                    self._inflight.pop(ref.uid, None)
        if work.cancelled():
            log.info("prepare cancelled by an unprepare of the same claim claim=%s", ref)
            result: PrepareResult | None = PrepareResult(error=f"claim {ref} was unprepared while this Prepare ran")
        else:
            result = work.result()
        if result is None:
            PREPARE_CLAIMS.labels("unfinished").inc()
            return None
        PREPARE_CLAIMS.labels("ok" if result.ok else "error").inc()
        if result.ok:
            PREPARE_SECONDS.observe(self.clock.now() - started)
        return result

    async def _run_unprepare(self, ref: ClaimRef) -> UnprepareResult | None:
        result = await within_budget(
            self.config.budget,
            ref,
            "unprepare",
            lambda _: self._unprepare_attempt(ref),
            lambda message: UnprepareResult(error=message),
            clock=self.clock,
            rng=self._rng,
        )
        UNPREPARE_CLAIMS.labels("unfinished" if result is None else ("ok" if result.ok else "error")).inc()
        return result

    # -- checkpoint access

    async def _update(self, change: Callable[[Checkpoint], tuple[Checkpoint, T]]) -> T:
        async with self._store_lock:
            return await self.run_blocking(self.store.update, change)

    @contextlib.asynccontextmanager
    async def _claim_lock(self, uid: str) -> AsyncIterator[None]:
        """One attempt per claim UID at a time in this process (the checkpoint lock covers other processes)."""
        lock, users = self._claim_locks.get(uid, (asyncio.Lock(), 0))
        self._claim_locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._claim_locks[uid]
            if users <= 1:
                del self._claim_locks[uid]
            else:
                self._claim_locks[uid] = (lock, users - 1)

    # -- prepare

    async def _prepare_attempt(self, ref: ClaimRef, deadline: float) -> PrepareResult:
        plan = await self.planner.plan(ref)
        async with self._claim_lock(ref.uid):
            # A read without the lock sees a whole file; begin_prepare re-checks under the lock.
            done = check_prepare(await self.run_blocking(self.store.read), ref.uid, plan.fingerprint)
            if done is not None:
                log.debug("claim already prepared; returning its devices claim=%s", ref)
                return PrepareResult(devices=tuple(_to_prepared(d) for d in done.devices))
            spec_path = str(self.cdi.path_for(ref.uid))
            now = self._now()
            await self._update(
                lambda cp: (
                    begin_prepare(
                        cp,
                        uid=ref.uid,
                        namespace=ref.namespace,
                        name=ref.name,
                        fingerprint=plan.fingerprint,
                        resources=plan.resources,
                        cdi_spec_files=(spec_path,),
                        now=now,
                    ),
                    None,
                )
            )
            self.on_change()
            edits: dict[str, ContainerEdits] = {}
            devices_planned = list(plan.devices)
            for i, device in enumerate(devices_planned):
                if device.isolated:
                    devices_planned[i] = device = await self._acquire_channel(ref, device, deadline)
                edits[device.resolved.device.device] = await self.effects.apply(
                    device, deadline, lambda why: self._waiting(ref, plan.claim, why)
                )
            spec = ClaimSpec(ref.uid, edits)
            await self.run_blocking(self.cdi.write, spec)
            devices = tuple(self._result_device(spec, d) for d in devices_planned)
            try:
                await self._update(lambda cp: (complete_prepare(cp, ref.uid, devices, now=self._now()), None))
            except InvalidTransitionError:
                # Another process unprepared the claim meanwhile (its tombstone is there): drop our spec again.
                await self.run_blocking(self.cdi.remove, ref.uid)
                raise ClaimRejected(f"claim {ref} was unprepared while it was being prepared") from None
        self._forget(ref.uid)
        log.info(
            "prepared claim=%s devices=%s",
            ref,
            ",".join(f"{d.device_name}:{'/'.join(d.cdi_device_ids) or '-'}" for d in devices),
        )
        return PrepareResult(devices=tuple(_to_prepared(d) for d in devices))

    def _waiting(self, ref: ClaimRef, claim: ClaimSnapshot, why: str) -> None:
        """The claim waits for IMEX: say so to its pods once, and from now on undo it as soon as its pod is
        gone (the kubelet may never call again for a deleted pod)."""
        if ref.uid in self._noticed:
            return
        self._noticed.add(ref.uid)
        mode = "hostManaged" if self.config.host_managed else "driverManaged"
        message = f"waiting for IMEX on node {self.config.node_name} ({mode}): {why}; the pod starts once it is ready"
        log.info("claim waits for IMEX claim=%s why=%s", ref, why)
        self.notify(claim, message)
        if ref.uid not in self._gone_watches:
            self._gone_watches[ref.uid] = asyncio.create_task(self._undo_when_gone(ref), name=f"gone-{ref.uid}")

    async def _undo_when_gone(self, ref: ClaimRef) -> None:
        try:
            await self.claims.wait_gone(ref.namespace, ref.name, ref.uid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("cannot watch the waiting claim (the cleanup undoes it later) claim=%s error=%s", ref, exc)
            return
        self._gone_watches.pop(ref.uid, None)
        log.info("claim gone while it waited for IMEX; undoing it claim=%s", ref)
        await self._unprepare_attempt(ref)

    def _forget(self, uid: str) -> None:
        self._noticed.discard(uid)
        watch = self._gone_watches.pop(uid, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()

    async def _acquire_channel(self, ref: ClaimRef, device: DevicePlan, deadline: float) -> DevicePlan:
        """Channel isolation: hold the domain's channel in this clique (listed in its record before anything
        is injected), then record it in the checkpoint, whose guard refuses it while another domain's claim
        on this node still holds it."""
        assert self.channels is not None and device.resource.clique_id is not None
        count = await self.run_blocking(self.hardware.imex_channel_count)
        channel = await self.channels.acquire(
            device.domain,
            device.resource.clique_id,
            ref.uid,
            channel_count=count,
            timeout_s=deadline - self.clock.now() - READINESS_MARGIN_S,
        )
        if device.resource.channels == (channel,):
            return device
        now = self._now()
        await self._update(lambda cp: (record_channel(cp, ref.uid, device.resource, channel, now=now), None))
        return device.with_channel(channel)

    def _result_device(self, spec: ClaimSpec, device: DevicePlan) -> CheckpointDevice:
        allocated = device.resolved.device
        ids = spec.device_ids(allocated.device)
        if device.resource.kind is DeviceKind.DAEMON:
            ids = (cdi.BASE_DEVICE_ID, *ids)  # nvidia-imex and the driver's files (cdi_base, written at start)
        return CheckpointDevice(
            request_names=(allocated.request,),
            pool_name=allocated.pool,
            device_name=allocated.device,
            cdi_device_ids=ids,
        )

    # -- unprepare

    async def _unprepare_attempt(self, ref: ClaimRef) -> UnprepareResult:
        self._forget(ref.uid)
        await self._cancel_inflight_prepare(ref)
        async with self._claim_lock(ref.uid):
            entry = await self.undo(ref.uid)
        if entry is None:
            log.debug("unprepare: nothing to undo claim=%s", ref)
        else:
            log.info("unprepared claim=%s state_was=%s", ref, entry.state)
        return UnprepareResult()

    async def _cancel_inflight_prepare(self, ref: ClaimRef) -> None:
        """Cancel this process's running Prepare of the claim and wait until it has stopped. Its outcome is
        its RPC's business; a cancellation of this Unprepare itself still propagates."""
        tasks = [t for t in self._inflight.get(ref.uid, set()) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def undo(self, uid: str) -> ClaimEntry | None:
        """Undo what the checkpoint lists for the claim and leave a tombstone. Returns the undone entry, None
        when there was nothing to undo. Used by Unprepare and by the stale-claim cleanup."""
        checkpoint = await self.run_blocking(self.store.read)
        entry = undo_plan(checkpoint, uid)
        if entry is None:
            return None
        for spec_file in entry.cdi_spec_files:
            await self.run_blocking(self.cdi.remove_recorded, spec_file)
        await self._release_channels(uid, entry)
        await self._update(lambda cp: (finish_unprepare(cp, uid, now=self._now()), None))
        self.on_change()
        return entry

    async def _release_channels(self, uid: str, entry: ClaimEntry) -> None:
        """Take the claim off its domains' channel records. Best effort: a failure leaves the channel reserved
        a while longer (never less), until the cleanup sees the claim gone from the checkpoint."""
        if self.channels is None:
            return
        for resource in entry.resources:
            if resource.clique_id is None:
                continue
            try:
                await self.channels.release(resource.domain_id, resource.clique_id, uid)
            except Exception as exc:
                log.warning("could not release the IMEX channel yet (the cleanup retries) claim=%s error=%s", uid, exc)

    async def release_stale_channels(self) -> list[str]:
        """Cleanup: claims this node lists in channel records that the checkpoint no longer holds (their
        release failed, or the agent stopped in between). Each is decided under its claim lock, so a Prepare
        of the same claim cannot interleave. Returns the released claim UIDs."""
        if self.channels is None:
            return []
        released = []
        for domain_uid, clique_id, claim_uid in self.channels.node_claims():
            async with self._claim_lock(claim_uid):
                entry = (await self.run_blocking(self.store.read)).get(claim_uid)
                if entry is not None and not entry.state.is_tombstone:
                    continue
                if await self.channels.release(domain_uid, clique_id, claim_uid):
                    released.append(claim_uid)
        return released

    async def hold_prepared_channels(self) -> list[str]:
        """Cleanup: every claim the checkpoint holds with a channel stays listed in its record, whatever was
        written there since (``ChannelAssignments.hold``). Returns the claim UIDs listed again."""
        if self.channels is None:
            return []
        relisted = []
        for uid in list((await self.run_blocking(self.store.read)).claims):
            # Under the claim lock, read again: an Unprepare that took the entry off must not see it come back.
            async with self._claim_lock(uid):
                entry = (await self.run_blocking(self.store.read)).get(uid)
                if entry is None or entry.state.is_tombstone:
                    continue
                for resource in entry.resources:
                    held = resource.clique_id is not None and bool(resource.channels)
                    if held and await self.channels.hold(resource.domain_id, str(resource.clique_id), uid):
                        relisted.append(uid)
        return relisted


def _to_prepared(device: CheckpointDevice) -> PreparedDevice:
    return PreparedDevice(
        request_names=device.request_names,
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=device.cdi_device_ids,
        share_id=device.share_id,
    )
