"""Prepare and Unprepare of `compute-domain.nvidia.com` claims: the node agent's `Preparer` (SPEC section 6).

Owns the per-claim algorithm and its retry budget; every collaborator that does I/O is injected (the claim
reader, the ComputeDomain lookup, the node labeller, the daemon readiness wait, the host IMEX check, the
hardware facts), so the whole algorithm runs in unit tests and benchmarks without a cluster.

Prepare of one claim, in order, with nothing touched before every check has passed:

1. fetch the ResourceClaim; it must be allocated and its UID must be the one the kubelet named;
2. resolve and strictly decode its opaque configs (`opaque.resolve`; the `domainID` must be a UUID);
   every device must be one this node publishes, from this node's pool;
3. look up each config's ComputeDomain: a channel claim must live in the CD's namespace (permanent error
   otherwise); daemon claims are refused in hostManaged mode;
4. the checkpoint decides: already completed -> return the stored devices; a tombstone of the same claim
   state -> permanent `StalePrepareError` (upstream #1162); another completed claim holds the channel ->
   retryable `ChannelInUseError` (#641);
5. record `PrepareStarted` with the full undo plan, then the side effects: node label with the CD UID
   (driverManaged channel), the wait for this node's daemon to be Ready (watch-driven, in `readiness`),
   the host `nvidia-imex-ctl -q` check (hostManaged channel), the per-domain `/imexd` directory (daemon),
   the claim's CDI spec; then `PrepareCompleted` with the devices returned to the kubelet.

Unprepare works from the checkpoint alone: it never fetches the claim or the CD and never validates
configs. It cancels a Prepare of the same claim still running in this process, undoes what the entry lists
(label only while it still has our value; CDI spec files), and leaves a tombstone.

Budget and retries: each claim gets `budget_s` (default 40 s, inside the kubelet's 45 s call deadline, so
our answer still reaches it); retryable errors are retried with jittered exponential backoff (0.25 s to
3 s). When the budget runs out, a claim whose last attempt ended in a retryable error gets that error
(`retryable error: ...`, one line, so the kubelet shows the reason in the pod's Events and calls again); a
claim still in progress (an attempt running, or waiting for its daemon to become Ready) is left out of the
result, which also makes the kubelet call again. Permanent errors end at once with a one-line
`permanent error: ...` message.

Concurrency: one task per claim of a request; claims are independent except through the checkpoint, whose
read-modify-writes run one at a time in a worker thread (an asyncio lock in front of the file lock keeps
this process's own threads from polling for it). Per claim UID, one attempt at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from prometheus_client import Counter, Histogram

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.kube.clock import utcnow
from computedomain.plugin import cdi
from computedomain.plugin.cdi import CdiError, CdiSpecDir, ClaimSpec, ContainerEdits
from computedomain.plugin.checkpoint import (
    ChannelInUseError,
    Checkpoint,
    CheckpointDevice,
    CheckpointError,
    CheckpointStore,
    ClaimEntry,
    DeviceKind,
    InvalidTransitionError,
    LockTimeoutError,
    NodeLabel,
    PreparedResource,
    StalePrepareError,
    begin_prepare,
    check_prepare,
    claim_fingerprint,
    complete_prepare,
    finish_unprepare,
    undo_plan,
)
from computedomain.plugin.opaque import ConfigError, ResolvedDevice, resolve
from computedomain.plugin.preparer import ClaimRef, ClaimUid, PreparedDevice, PrepareResult, UnprepareResult
from imex.discovery import HardwareError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BUDGET_S: Final = 40.0
BACKOFF_INITIAL_S: Final = 0.25
BACKOFF_MAX_S: Final = 3.0
DOMAINS_DIR: Final = "domains"
PUBLISHED_DEVICES: Final = frozenset({cdi.CHANNEL_DEVICE, cdi.DAEMON_DEVICE})

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
ATTEMPT_ERRORS = Counter(
    "computedomain_plugin_attempt_errors_total",
    "Failed Prepare/Unprepare attempts by operation and error class.",
    ["operation", "error"],
)


# --- errors ------------------------------------------------------------------------------------------------


class PrepareError(Exception):
    """A failed attempt. `retryable` says whether another attempt within the budget may succeed."""

    retryable = True


class RetryableError(PrepareError):
    retryable = True


class PermanentError(PrepareError):
    retryable = False


class ClaimNotFoundError(Exception):
    """The ResourceClaim does not exist (any more)."""


class LabelConflictError(Exception):
    """The node carries the ComputeDomain label of another domain."""


class NotReadyError(Exception):
    """This node's IMEX daemon of the domain did not become Ready in time; the message says what was seen."""


class StillWaitingError(RetryableError):
    """The attempt waited until the budget for something that is on its way (the daemon's readiness): the
    claim is in progress, not failing, so it is left out of the answer rather than reported as an error."""


def classify(exc: BaseException) -> PrepareError | None:
    """Map an error of a collaborator to retryable/permanent; None for unexpected ones (bugs)."""
    if isinstance(exc, PrepareError):
        return exc
    if isinstance(exc, StalePrepareError | ConfigError | CdiError | ClaimNotFoundError):
        return PermanentError(str(exc))
    if isinstance(exc, NotReadyError):
        return StillWaitingError(str(exc))
    if isinstance(exc, ChannelInUseError | LockTimeoutError | LabelConflictError):
        return RetryableError(str(exc))
    if isinstance(exc, CheckpointError):
        # Corruption or I/O trouble: another attempt may see a repaired file, and the message says what to do.
        return RetryableError(str(exc))
    retryable = getattr(exc, "retryable", None)  # imex.host_check errors carry it
    if isinstance(retryable, bool):
        return RetryableError(str(exc)) if retryable else PermanentError(str(exc))
    name = type(exc).__name__
    if name in ("NotFound", "Gone", "Permanent", "Invalid", "Forbidden"):
        return PermanentError(f"{name}: {exc}")
    if name in ("Transient", "TooManyRequests", "Conflict", "AlreadyExists"):
        return RetryableError(f"{name}: {exc}")
    if isinstance(exc, HardwareError):
        return PermanentError(str(exc))  # e.g. no IMEX channel device in /proc/devices: a node without IMEX
    if isinstance(exc, OSError):
        return RetryableError(f"{type(exc).__name__}: {exc}")
    return None


# --- collaborators ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimSnapshot:
    """The parts of a ResourceClaim that Prepare reads."""

    namespace: str
    name: str
    uid: str
    status: Mapping[str, Any]

    @property
    def allocation(self) -> Mapping[str, Any] | None:
        allocation = self.status.get("allocation")
        return allocation if isinstance(allocation, Mapping) and allocation else None

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> ClaimSnapshot:
        meta = raw.get("metadata") or {}
        return cls(
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            uid=str(meta.get("uid") or ""),
            status=dict(raw.get("status") or {}),
        )


@dataclass(frozen=True, slots=True)
class DomainInfo:
    """What Prepare needs to know about a ComputeDomain."""

    uid: str
    name: str
    namespace: str
    num_nodes: int = 0


class ClaimReader(Protocol):
    async def get_claim(self, namespace: str, name: str) -> ClaimSnapshot:
        """The claim as the apiserver has it now; ClaimNotFoundError if it does not exist."""
        ...


class DomainLookup(Protocol):
    async def get_domain(self, uid: str) -> DomainInfo | None:
        """The ComputeDomain with this UID in any namespace, or None."""
        ...


class NodeLabeler(Protocol):
    async def ensure_label(self, key: str, value: str) -> None:
        """Set key=value on this node; LabelConflictError if key already has another value."""
        ...

    async def remove_label_if(self, key: str, value: str) -> bool:
        """Remove key from this node only while it has value; True when removed."""
        ...


class DaemonReadiness(Protocol):
    async def wait_ready(self, domain: DomainInfo, clique_id: str, timeout_s: float) -> None:
        """Return once this node's daemon of the domain is Ready; NotReadyError after timeout_s."""
        ...


class Hardware(Protocol):
    """Node facts Prepare needs; `clique_id` is the current value (refreshed elsewhere)."""

    @property
    def clique_id(self) -> str: ...

    def imex_channel_major(self) -> int: ...

    def imex_channel_count(self) -> int: ...

    def fabric_imex_mgmt(self) -> cdi.CapabilityDevice | None: ...


HostCheck = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class PreparerConfig:
    node_name: str
    plugin_dir: Path
    host_managed: bool = False
    driver_name: str = DRIVER_NAME
    budget_s: float = DEFAULT_BUDGET_S
    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_max_s: float = BACKOFF_MAX_S

    @property
    def domains_dir(self) -> Path:
        return self.plugin_dir / DOMAINS_DIR


# --- the plan of one claim (pure) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _DevicePlan:
    resolved: ResolvedDevice
    domain: DomainInfo
    resource: PreparedResource
    inject_channels: tuple[int, ...] = ()


@dataclass
class _ClaimPlan:
    claim: ClaimSnapshot
    fingerprint: str
    devices: list[_DevicePlan] = field(default_factory=list)

    @property
    def resources(self) -> tuple[PreparedResource, ...]:
        return tuple(d.resource for d in self.devices)


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
        clock: Callable[[], datetime] = utcnow,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.cdi = cdi_dir
        self.claims = claims
        self.domains = domains
        self.labels = labels
        self.readiness = readiness
        self.hardware = hardware
        self.host_check = host_check
        self._clock = clock
        self._monotonic = monotonic
        self._rng = rng or random.Random()
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

    # -- budgets and retries

    async def _run_prepare(self, ref: ClaimRef) -> PrepareResult | None:
        started = self._monotonic()
        # The work runs in a task of its own so that an Unprepare of the same claim can cancel it without
        # cancelling the RPC that waits for it.
        work = asyncio.create_task(
            self._with_budget(ref, "prepare", lambda deadline: self._prepare_attempt(ref, deadline), _prepare_failed),
            name=f"prepare-{ref.uid}",
        )
        self._inflight.setdefault(ref.uid, set()).add(work)
        try:
            result = await work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the RPC itself is being cancelled (shutdown)
            log.info("prepare cancelled by an unprepare of the same claim claim=%s", ref)
            result = PrepareResult(error=f"claim {ref} was unprepared while this Prepare ran")
        finally:
            tasks = self._inflight.get(ref.uid)
            if tasks is not None:
                tasks.discard(work)
                if not tasks:
                    self._inflight.pop(ref.uid, None)
        if result is None:
            PREPARE_CLAIMS.labels("unfinished").inc()
            return None
        PREPARE_CLAIMS.labels("ok" if result.ok else "error").inc()
        if result.ok:
            PREPARE_SECONDS.observe(self._monotonic() - started)
        return result

    async def _run_unprepare(self, ref: ClaimRef) -> UnprepareResult | None:
        result = await self._with_budget(ref, "unprepare", lambda _: self._unprepare_attempt(ref), _unprepare_failed)
        UNPREPARE_CLAIMS.labels("unfinished" if result is None else ("ok" if result.ok else "error")).inc()
        return result

    async def _with_budget(
        self,
        ref: ClaimRef,
        operation: str,
        attempt: Callable[[float], Awaitable[T]],
        failed: Callable[[str], T],
    ) -> T | None:
        """Run attempts until one succeeds, one fails permanently (-> failed("permanent error: ...")), or the
        budget is spent: after a retryable error -> failed("retryable error: ..."); while an attempt is still
        running or waiting (`StillWaitingError`) -> None, the claim is left out of the answer."""
        deadline = self._monotonic() + self.config.budget_s
        delay = self.config.backoff_initial_s
        attempts = 0
        last = ""
        last_failed: PrepareError | None = None
        while True:
            attempts += 1
            began = self._monotonic()
            remaining = deadline - began
            try:
                async with asyncio.timeout(max(remaining, 0.001)):
                    return await attempt(deadline)
            except TimeoutError:
                last = last or "no answer within the budget"
                last_failed = None  # the budget ended an attempt in progress
                break
            except Exception as exc:
                err = classify(exc)
                if err is None:
                    log.exception("%s failed unexpectedly claim=%s", operation, ref)
                    err = RetryableError(f"internal error: {type(exc).__name__}: {exc}")
                ATTEMPT_ERRORS.labels(operation, type(exc).__name__).inc()
                if not err.retryable:
                    log.warning("%s failed permanently claim=%s attempt=%d error=%s", operation, ref, attempts, err)
                    return failed(f"permanent error: {err}")
                last = str(err)
                last_failed = None if isinstance(err, StillWaitingError) else err
                sleep = delay * (0.5 + self._rng.random())
                now = self._monotonic()
                # Twice the last attempt's time must be left after the backoff: an attempt the budget would
                # cut short tells the user less than the error just seen.
                if now + sleep + 2 * (now - began) >= deadline:
                    break
                log.info(
                    "%s attempt failed; retrying claim=%s attempt=%d in=%.2fs error=%s",
                    operation,
                    ref,
                    attempts,
                    sleep,
                    err,
                )
                await asyncio.sleep(sleep)
                delay = min(delay * 2, self.config.backoff_max_s)
        log.warning(
            "%s not finished within %gs; the kubelet will call again claim=%s attempts=%d last_error=%s",
            operation,
            self.config.budget_s,
            ref,
            attempts,
            last,
        )
        if last_failed is None:
            return None
        # One line: the kubelet puts it into an Event message as it is.
        reason = " ".join(str(last_failed).split())
        return failed(
            f"retryable error: {reason} (still failing after {attempts} attempts in "
            f"{self.config.budget_s:g}s; the kubelet will call again)"
        )

    # -- checkpoint access

    async def _update(self, change: Callable[[Checkpoint], tuple[Checkpoint, T]]) -> T:
        async with self._store_lock:
            return await self.store.update_async(change)

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
        plan = await self._plan(ref)
        async with self._claim_lock(ref.uid):
            # A read without the lock sees a whole file; begin_prepare re-checks under the lock.
            done = check_prepare(await self.store.read_async(), ref.uid, plan.fingerprint)
            if done is not None:
                log.debug("claim already prepared; returning its devices claim=%s", ref)
                return PrepareResult(devices=tuple(_to_prepared(d) for d in done.devices))
            spec_path = str(self.cdi.path_for(ref.uid))
            now = self._clock()
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
            edits: dict[str, ContainerEdits] = {}
            for device in plan.devices:
                edits[device.resolved.device.device] = await self._side_effects(device, deadline)
            spec = ClaimSpec(ref.uid, edits)
            await asyncio.to_thread(self.cdi.write, spec)
            devices = tuple(self._result_device(spec, d) for d in plan.devices)
            try:
                await self._update(lambda cp: (complete_prepare(cp, ref.uid, devices, now=self._clock()), None))
            except InvalidTransitionError:
                # Another process unprepared the claim meanwhile (its tombstone is there): drop our spec again.
                await asyncio.to_thread(self.cdi.remove, ref.uid)
                raise PermanentError(f"claim {ref} was unprepared while it was being prepared") from None
        log.info(
            "prepared claim=%s devices=%s",
            ref,
            ",".join(f"{d.device_name}:{'/'.join(d.cdi_device_ids) or '-'}" for d in devices),
        )
        return PrepareResult(devices=tuple(_to_prepared(d) for d in devices))

    async def _plan(self, ref: ClaimRef) -> _ClaimPlan:
        """Every check that needs no side effect. Raises PrepareError."""
        claim = await self.claims.get_claim(ref.namespace, ref.name)
        if claim.uid != ref.uid:
            raise PermanentError(
                f"ResourceClaim {ref.namespace}/{ref.name} has UID {claim.uid}, not {ref.uid}: it was replaced"
            )
        allocation = claim.allocation
        if allocation is None:
            raise PermanentError(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
        resolved = resolve(allocation, driver=self.config.driver_name)
        plan = _ClaimPlan(claim=claim, fingerprint=claim_fingerprint(claim.status))
        for item in resolved:
            plan.devices.append(await self._plan_device(claim, item))
        return plan

    async def _plan_device(self, claim: ClaimSnapshot, item: ResolvedDevice) -> _DevicePlan:
        device = item.device
        if device.pool != self.config.node_name:
            raise PermanentError(
                f"device {device.device} was allocated from pool {device.pool!r}, not from this node "
                f"{self.config.node_name!r}"
            )
        if device.device not in PUBLISHED_DEVICES:
            raise PermanentError(f"device {device.device} is not a device this node publishes")
        kind = item.kind
        if kind is DeviceKind.DAEMON and self.config.host_managed:
            raise PermanentError(
                "daemon claims are not supported with IMEX_MODE=hostManaged: the host runs nvidia-imex itself"
            )
        domain = await self.domains.get_domain(item.domain_id)
        if kind is DeviceKind.CHANNEL:
            if domain is None or domain.namespace != claim.namespace:
                where = f" (it is in namespace {domain.namespace})" if domain else ""
                raise PermanentError(
                    f"ComputeDomain {item.domain_id} not found in namespace {claim.namespace}{where}; a channel "
                    "claim must come from the ComputeDomain's own ResourceClaimTemplate"
                )
        elif domain is None:
            raise PermanentError(f"ComputeDomain {item.domain_id} of this daemon claim does not exist")
        if kind is DeviceKind.CHANNEL:
            count = await asyncio.to_thread(self.hardware.imex_channel_count)
            clique = self.hardware.clique_id
            if self.config.host_managed:
                ids: tuple[int, ...] = (0,)  # all CDs share channel 0 of the host's IMEX domain
            else:
                ids = tuple(cdi.channel_ids(item.all_channels, count))
            inject = ids if clique else ()
            label = None if self.config.host_managed else NodeLabel(key=COMPUTE_DOMAIN_LABEL, value=domain.uid)
            resource = PreparedResource(kind=kind, domain_id=domain.uid, channels=inject or (0,), node_label=label)
            return _DevicePlan(item, domain, resource, inject)
        domain_dir = str(self.config.domains_dir / domain.uid)
        resource = PreparedResource(kind=kind, domain_id=domain.uid, domain_dir=domain_dir)
        return _DevicePlan(item, domain, resource)

    async def _side_effects(self, device: _DevicePlan, deadline: float) -> ContainerEdits:
        domain = device.domain
        if device.resource.kind is DeviceKind.CHANNEL:
            if self.config.host_managed:
                if not self.hardware.clique_id:
                    return ContainerEdits()  # not on an MNNVL fabric: nothing to inject, nothing to check
                if self.host_check is None:
                    raise PermanentError("hostManaged mode without a host IMEX check configured")
                await self.host_check()
            else:
                label = device.resource.node_label
                assert label is not None
                await self.labels.ensure_label(label.key, label.value)
                if self.hardware.clique_id:
                    # Leave a moment so the wait's own NotReadyError (which says what it saw) beats the budget.
                    remaining = deadline - self._monotonic() - 0.05
                    await self.readiness.wait_ready(domain, self.hardware.clique_id, remaining)
            if not device.inject_channels:
                return ContainerEdits()
            major = await asyncio.to_thread(self.hardware.imex_channel_major)
            return cdi.channel_edits(major, device.inject_channels)
        domain_dir = Path(device.resource.domain_dir or "")
        await asyncio.to_thread(domain_dir.mkdir, mode=0o755, parents=True, exist_ok=True)
        cap = await asyncio.to_thread(self.hardware.fabric_imex_mgmt) if self.hardware.clique_id else None
        return cdi.daemon_edits(
            domain_dir=domain_dir,
            clique_id=self.hardware.clique_id,
            domain_uid=domain.uid,
            domain_name=domain.name,
            domain_namespace=domain.namespace,
            fabric_imex_mgmt=cap,
        )

    def _result_device(self, spec: ClaimSpec, device: _DevicePlan) -> CheckpointDevice:
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
        await self._cancel_inflight_prepare(ref)
        async with self._claim_lock(ref.uid):
            entry = await self.undo(ref.uid)
        if entry is None:
            log.debug("unprepare: nothing to undo claim=%s", ref)
        else:
            log.info("unprepared claim=%s state_was=%s", ref, entry.state)
        return UnprepareResult()

    async def _cancel_inflight_prepare(self, ref: ClaimRef) -> None:
        tasks = [t for t in self._inflight.get(ref.uid, set()) if not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(task)

    async def undo(self, uid: str) -> ClaimEntry | None:
        """Undo what the checkpoint lists for the claim and leave a tombstone. Returns the undone entry, None
        when there was nothing to undo. Used by Unprepare and by the stale-claim cleanup."""
        checkpoint = await self.store.read_async()
        entry = undo_plan(checkpoint, uid)
        if entry is None:
            return None
        for resource in entry.resources:
            label = resource.node_label
            if label is not None:
                removed = await self.labels.remove_label_if(label.key, label.value)
                if removed:
                    log.info("removed node label %s=%s claim=%s", label.key, label.value, uid)
        for spec_file in entry.cdi_spec_files:
            await asyncio.to_thread(self.cdi.remove_recorded, spec_file)
        await self._update(lambda cp: (finish_unprepare(cp, uid, now=self._clock()), None))
        return entry


def _to_prepared(device: CheckpointDevice) -> PreparedDevice:
    return PreparedDevice(
        request_names=device.request_names,
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=device.cdi_device_ids,
        share_id=device.share_id,
    )


def _prepare_failed(message: str) -> PrepareResult:
    return PrepareResult(error=message)


def _unprepare_failed(message: str) -> UnprepareResult:
    return UnprepareResult(error=message)
