"""The node agent's on-disk record of what it prepared, and the rules for changing it.

Owns `<plugin dir>/checkpoint.json` and its lock file. The checkpoint is the node-local source of truth
that lets Unprepare work without the API server, makes Prepare idempotent, guards channels against two
claims, survives crashes at any point and is invalidated by a reboot. Format and rules:
`docs/design/0004-checkpoint.md`.

Two layers:

- pure state transitions on an immutable `Checkpoint` (`begin_prepare`, `complete_prepare`,
  `finish_unprepare`, `reconcile_boot`, `expire_tombstones`, ...): no I/O, no clock, table-testable;
- `CheckpointStore`, the thin I/O: JSON with a checksum, atomic replace (temp file, fsync, rename, fsync of
  the directory), and a node-wide `fcntl.flock` held for every read-modify-write, so several processes
  (or a restarted agent racing its predecessor) never lose an update. At start-up (`open`) it takes over a
  file the reference driver left at the same path (`checkpoint_reference`) and moves aside a file it cannot
  understand, so the agent starts either way.

Concurrency model: the store's methods block (file I/O, lock waits); async callers run them through
`asyncio.to_thread` (the `*_async` helpers do). The lock is not re-entrant; taking it twice from one
thread is a bug and raises instead of deadlocking. Reads without the lock are allowed and see a complete
file, because writers only ever rename a finished file into place.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from computedomain.api.limits import brief, shown
from computedomain.atomic import write_atomically

log = logging.getLogger(__name__)

CHECKPOINT_VERSION: Final = 1
CHECKPOINT_FILE: Final = "checkpoint.json"
LOCK_FILE: Final = "checkpoint.lock"
DEFAULT_BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")
# A stale Prepare can only arrive within one kubelet call (45 s) of the Unprepare it raced; keep the
# tombstone twice that long.
DEFAULT_TOMBSTONE_TTL: Final = timedelta(seconds=90)
DEFAULT_LOCK_TIMEOUT_S: Final = 10.0
# A node holds a few claims; a file much larger than any real checkpoint is not read into memory.
MAX_FILE_BYTES: Final = 16 * 1024 * 1024
# Beside the file: the reference's original after a takeover, and files that could not be read.
REFERENCE_COPY: Final = "checkpoint.json.reference"
UNREADABLE_PREFIX: Final = "checkpoint.json.unreadable-"
_TMP_PREFIX: Final = ".checkpoint.json.tmp-"

T = TypeVar("T")


# --- errors ------------------------------------------------------------------------------------------------


class CheckpointError(Exception):
    """Base of everything this module raises on purpose."""


class CheckpointCorruptError(CheckpointError):
    """The file exists but cannot be trusted. At start-up it is moved aside (`CheckpointStore.open`); later
    (someone replaced it while the agent runs) every change fails with this until the agent restarts."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"checkpoint {path} cannot be read: {reason}")


class LockTimeoutError(CheckpointError):
    """Another process holds the checkpoint lock for too long. Retryable."""


class StalePrepareError(CheckpointError):
    """A Prepare for a claim this node already unprepared or aborted, with the same claim state: it is a
    late retry that raced the Unprepare (#1162) and must not resurrect the claim. Permanent."""


class ChannelInUseError(CheckpointError):
    """Another claim still holds a requested channel (its Unprepare has not arrived yet). Retryable."""

    def __init__(self, channel: int, holder: str) -> None:
        self.channel = channel
        self.holder = holder
        super().__init__(
            f"IMEX channel {channel} is still prepared for claim {holder} on this node; "
            "waiting for that claim to be unprepared"
        )


class InvalidTransitionError(CheckpointError):
    """A caller asked for a transition the state machine does not have (a bug in the caller)."""


# --- model -------------------------------------------------------------------------------------------------


class ClaimState(StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"
    # Tombstones: the claim is gone from this node; kept for a while to reject stale Prepare retries.
    PREPARE_ABORTED = "PrepareAborted"
    UNPREPARE_COMPLETED = "UnprepareCompleted"

    @property
    def is_tombstone(self) -> bool:
        return self in (ClaimState.PREPARE_ABORTED, ClaimState.UNPREPARE_COMPLETED)


class DeviceKind(StrEnum):
    CHANNEL = "channel"
    DAEMON = "daemon"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class NodeLabel(_Model):
    """A node label this claim set; undo removes it only while it still has this value."""

    key: str
    value: str


class PreparedResource(_Model):
    """The side effects of one device config of a claim: what Unprepare has to undo."""

    kind: DeviceKind
    domain_id: str = Field(alias="domainID")
    # IMEX channel IDs handed to the workload (channel claims), for the one-holder-per-channel guard.
    channels: tuple[int, ...] = ()
    node_label: NodeLabel | None = Field(None, alias="nodeLabel")
    # Per-domain host directory mounted at /imexd (daemon claims).
    domain_dir: str | None = Field(None, alias="domainDir")
    # Channel isolation: the clique whose ComputeDomainClique lists this claim for the domain's channel
    # (undo takes it off there). Claims of the same domain may share such a channel on a node.
    clique_id: str | None = Field(None, alias="cliqueID")


class CheckpointDevice(_Model):
    """A device as returned to the kubelet; replayed verbatim when Prepare is repeated."""

    request_names: tuple[str, ...] = Field(alias="requestNames")
    pool_name: str = Field(alias="poolName")
    device_name: str = Field(alias="deviceName")
    cdi_device_ids: tuple[str, ...] = Field((), alias="cdiDeviceIDs")
    share_id: str | None = Field(None, alias="shareID")


class ClaimEntry(_Model):
    uid: str
    namespace: str
    name: str
    state: ClaimState
    # Identifies the claim state the Prepare acted on (see claim_fingerprint); a tombstone rejects a Prepare
    # only when the fingerprint is unchanged, so a later legitimate Prepare of the same claim still works.
    fingerprint: str = ""
    resources: tuple[PreparedResource, ...] = ()
    cdi_spec_files: tuple[str, ...] = Field((), alias="cdiSpecFiles")
    devices: tuple[CheckpointDevice, ...] = ()
    started_at: datetime = Field(alias="startedAt")
    updated_at: datetime = Field(alias="updatedAt")
    completed_at: datetime | None = Field(None, alias="completedAt")
    tombstoned_at: datetime | None = Field(None, alias="tombstonedAt")
    # Why the entry is in its state when that is not obvious, e.g. demoted after a reboot.
    note: str = ""

    @property
    def channels(self) -> frozenset[int]:
        return frozenset(c for r in self.resources for c in r.channels)


class Checkpoint(_Model):
    version: Literal[1] = CHECKPOINT_VERSION
    boot_id: str = Field("", alias="bootID")
    claims: dict[str, ClaimEntry] = Field(default_factory=dict)

    def get(self, uid: str) -> ClaimEntry | None:
        return self.claims.get(uid)

    def with_entry(self, entry: ClaimEntry) -> Checkpoint:
        return self.model_copy(update={"claims": {**self.claims, entry.uid: entry}})

    def without(self, uids: Iterable[str]) -> Checkpoint:
        drop = set(uids)
        return self.model_copy(update={"claims": {u: e for u, e in self.claims.items() if u not in drop}})

    def in_state(self, *states: ClaimState) -> list[ClaimEntry]:
        return [e for e in self.claims.values() if e.state in states]


def claim_fingerprint(claim_status: Mapping[str, Any]) -> str:
    """A stable digest of a ResourceClaim's `status` (allocation and reservations), as JSON. A stale
    Prepare retry sees the same status as the attempt that was unprepared; a new use of the claim (another
    reservation, a new allocation) changes it."""
    canonical = json.dumps(claim_status, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


# --- pure transitions -------------------------------------------------------------------------------------


def check_prepare(cp: Checkpoint, uid: str, fingerprint: str) -> ClaimEntry | None:
    """What Prepare must do first. Returns the completed entry when the claim is already prepared (return
    its devices unchanged), None when preparing may go ahead; raises StalePrepareError for a late retry."""
    entry = cp.get(uid)
    if entry is None or entry.state is ClaimState.PREPARE_STARTED:
        return None
    if entry.state is ClaimState.PREPARE_COMPLETED:
        return entry
    if entry.fingerprint == fingerprint:
        raise StalePrepareError(
            f"claim {entry.namespace}/{entry.name} ({uid}) was already {entry.state} on this node at "
            f"{entry.tombstoned_at}; refusing a stale Prepare for the same claim state"
        )
    return None


def channel_holder(
    cp: Checkpoint, channels: Iterable[int], except_uid: str, *, domain: str | None = None
) -> tuple[int, str] | None:
    """(channel, uid) of another completed claim that still holds one of channels, if any. With ``domain``
    (a channel of that domain under channel isolation), completed claims of the same domain do not count:
    all claims of a domain on a node get its one channel."""
    wanted = set(channels)
    if not wanted:
        return None
    for entry in cp.in_state(ClaimState.PREPARE_COMPLETED):
        if entry.uid == except_uid:
            continue
        held = (
            entry.channels
            if domain is None
            else {c for r in entry.resources if r.domain_id != domain for c in r.channels}
        )
        taken = wanted & held
        if taken:
            return min(taken), entry.uid
    return None


def _merge(old: Iterable[T], new: Iterable[T]) -> tuple[T, ...]:
    out: list[T] = []
    for item in (*old, *new):
        if item not in out:
            out.append(item)
    return tuple(out)


def begin_prepare(
    cp: Checkpoint,
    *,
    uid: str,
    namespace: str,
    name: str,
    fingerprint: str,
    resources: Iterable[PreparedResource],
    cdi_spec_files: Iterable[str],
    now: datetime,
) -> Checkpoint:
    """Record the intent to prepare, before any side effect, with everything needed to undo it.

    A repeated attempt of a claim still in PrepareStarted keeps what earlier attempts recorded (their side
    effects may exist) and adds the new plan. Raises StalePrepareError, ChannelInUseError, or
    InvalidTransitionError for a claim already completed (call check_prepare first)."""
    resources = tuple(resources)
    if check_prepare(cp, uid, fingerprint) is not None:
        raise InvalidTransitionError(f"claim {uid} is already PrepareCompleted; return its devices instead")
    held = None
    for resource in resources:
        # A domain's claims share its channel on a node: channel 0 of its own IMEX domain (driverManaged: the
        # node label), or its channel under isolation. hostManaged channel 0 is every domain's: no guard.
        if held is None and (resource.clique_id is not None or resource.node_label is not None):
            held = channel_holder(cp, resource.channels, except_uid=uid, domain=resource.domain_id)
    if held is not None:
        raise ChannelInUseError(*held)
    old = cp.get(uid)
    resume = old is not None and old.state is ClaimState.PREPARE_STARTED
    entry = ClaimEntry(
        uid=uid,
        namespace=namespace,
        name=name,
        state=ClaimState.PREPARE_STARTED,
        fingerprint=fingerprint,
        resources=_merge(old.resources, resources) if resume and old else resources,
        cdi_spec_files=_merge(old.cdi_spec_files, cdi_spec_files) if resume and old else tuple(cdi_spec_files),
        started_at=old.started_at if resume and old else now,
        updated_at=now,
    )
    return cp.with_entry(entry)


def record_channel(cp: Checkpoint, uid: str, resource: PreparedResource, channel: int, *, now: datetime) -> Checkpoint:
    """Channel isolation: the started claim's ``resource`` (its domain's channel in a clique, not known when
    the entry was begun) gets ``channel``. Raises ChannelInUseError while a completed claim of another domain
    on this node still holds it, InvalidTransitionError unless the claim is PrepareStarted with that resource."""
    entry = cp.get(uid)
    if entry is None or entry.state is not ClaimState.PREPARE_STARTED or resource not in entry.resources:
        raise InvalidTransitionError(f"claim {uid} has no started resource {resource} to record a channel for")
    held = channel_holder(cp, (channel,), except_uid=uid, domain=resource.domain_id)
    if held is not None:
        raise ChannelInUseError(*held)
    updated = resource.model_copy(update={"channels": (channel,)})
    resources = _merge((), (updated if r == resource else r for r in entry.resources))
    return cp.with_entry(entry.model_copy(update={"resources": resources, "updated_at": now}))


def complete_prepare(cp: Checkpoint, uid: str, devices: Iterable[CheckpointDevice], *, now: datetime) -> Checkpoint:
    """PrepareStarted -> PrepareCompleted, once every side effect is in place."""
    entry = cp.get(uid)
    if entry is None or entry.state is not ClaimState.PREPARE_STARTED:
        state = entry.state if entry else "absent"
        raise InvalidTransitionError(f"claim {uid} cannot complete Prepare from state {state}")
    done = entry.model_copy(
        update={
            "state": ClaimState.PREPARE_COMPLETED,
            "devices": tuple(devices),
            "completed_at": now,
            "updated_at": now,
            "note": "",
        }
    )
    return cp.with_entry(done)


def undo_plan(cp: Checkpoint, uid: str) -> ClaimEntry | None:
    """The entry whose side effects Unprepare must undo, or None when there is nothing to undo."""
    entry = cp.get(uid)
    if entry is None or entry.state.is_tombstone:
        return None
    return entry


def finish_unprepare(cp: Checkpoint, uid: str, *, now: datetime) -> Checkpoint:
    """After the side effects are undone: PrepareCompleted -> UnprepareCompleted, PrepareStarted ->
    PrepareAborted. Unknown claims and tombstones are left as they are (Unprepare is idempotent)."""
    entry = cp.get(uid)
    if entry is None or entry.state.is_tombstone:
        return cp
    state = (
        ClaimState.UNPREPARE_COMPLETED if entry.state is ClaimState.PREPARE_COMPLETED else ClaimState.PREPARE_ABORTED
    )
    tombstone = entry.model_copy(
        update={
            "state": state,
            "resources": (),
            "cdi_spec_files": (),
            "devices": (),
            "tombstoned_at": now,
            "updated_at": now,
        }
    )
    return cp.with_entry(tombstone)


def expire_tombstones(cp: Checkpoint, *, now: datetime, ttl: timedelta = DEFAULT_TOMBSTONE_TTL) -> Checkpoint:
    """Drop tombstones older than ttl (and any without a timestamp)."""
    expired = [
        e.uid
        for e in cp.claims.values()
        if e.state.is_tombstone and (e.tombstoned_at is None or now - e.tombstoned_at >= ttl)
    ]
    return cp.without(expired) if expired else cp


def reconcile_boot(cp: Checkpoint, boot_id: str) -> tuple[Checkpoint, list[ClaimEntry]]:
    """Apply the boot-ID rule. Returns the checkpoint to keep and the entries invalidated by a reboot.

    After a reboot nothing prepared before it is in place any more (containers, device nodes, tmpfs CDI
    specs), so no entry may short-circuit a Prepare. Live entries are demoted to PrepareStarted, which
    keeps their undo information (node labels and persistent files survive reboots) until an Unprepare or
    the stale-claim cleanup disposes of them, and lets a new Prepare redo the work. Tombstones are dropped:
    no retry crosses a reboot. A file without a boot ID (never stamped) adopts the current one."""
    if cp.boot_id == boot_id:
        return cp, []
    if not cp.boot_id:
        return cp.model_copy(update={"boot_id": boot_id}), []
    invalidated = [e for e in cp.claims.values() if not e.state.is_tombstone]
    note = f"invalidated by reboot (was {{state}} under boot {cp.boot_id})"
    claims = {
        e.uid: e.model_copy(
            update={
                "state": ClaimState.PREPARE_STARTED,
                "devices": (),
                "completed_at": None,
                "note": note.format(state=e.state),
            }
        )
        for e in invalidated
    }
    return Checkpoint(boot_id=boot_id, claims=claims), invalidated


# --- serialisation -----------------------------------------------------------------------------------------


def _checksum(payload: Mapping[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def dumps(cp: Checkpoint) -> str:
    payload = cp.model_dump(mode="json", by_alias=True)
    body = {"version": payload.pop("version"), "checksum": _checksum(payload), **payload}
    return json.dumps(body, indent=1) + "\n"


def loads(text: str, path: Path) -> Checkpoint:
    """Our format (see `decode` for every format this agent reads)."""
    return _ours(_parse(text, path), path)


def decode(
    text: str, path: Path, *, cdi_root: Path | None = None, now: datetime | None = None
) -> tuple[Checkpoint, str | None]:
    """The checkpoint in `text`, and the reference driver's layout when the file is the reference's (None for
    ours). Raises `CheckpointCorruptError` naming what does not fit."""
    raw = _parse(text, path)
    # Imported here: the reference module builds this module's model.
    from computedomain.plugin import checkpoint_reference

    if checkpoint_reference.is_reference(raw):
        return checkpoint_reference.convert(raw, path=path, cdi_root=cdi_root, now=now or datetime.now(UTC))
    return _ours(raw, path), None


def _parse(text: str, path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(path, f"not JSON: {brief(str(exc), 200)}") from None
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(path, "not a JSON object")
    return raw


def _ours(raw: dict[str, Any], path: Path) -> Checkpoint:
    raw = dict(raw)
    version = raw.pop("version", None)
    if version != CHECKPOINT_VERSION:
        if isinstance(version, int) and version > CHECKPOINT_VERSION:
            raise CheckpointCorruptError(
                path,
                f"format version {version} is newer than this agent's {CHECKPOINT_VERSION}; "
                "downgrading the node agent is not supported",
            )
        raise CheckpointCorruptError(path, f"unknown format version {brief(version)}")
    stored = raw.pop("checksum", None)
    if stored != _checksum(raw):
        raise CheckpointCorruptError(path, "checksum mismatch (edited by hand or damaged on disk)")
    try:
        return Checkpoint.model_validate({"version": version, **raw})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CheckpointCorruptError(path, f"invalid content at {shown(where, 200)}: {first['msg']}") from None


# --- file I/O ----------------------------------------------------------------------------------------------


def read_boot_id(path: Path = DEFAULT_BOOT_ID_PATH) -> str:
    boot_id = path.read_text().strip()
    if not boot_id:
        raise CheckpointError(f"boot ID file {path} is empty")
    return boot_id


class _Held(Exception):  # noqa: N818 (the poll's signal: someone else holds the lock)
    pass


def _lock_now(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise _Held from exc
        raise


class FileLock:
    """An exclusive `flock` on a lock file that is never deleted (deleting it would let two holders lock
    two different inodes). Polls without blocking (a tenacity loop, every ``poll_s`` until ``timeout_s``) so a
    stuck holder becomes a timeout, not a hang."""

    def __init__(self, path: Path, *, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, poll_s: float = 0.05) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._owner: int | None = None
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                raise RuntimeError(f"lock {self.path} is already held by this thread (not re-entrant)")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            polls = Retrying(
                stop=stop_after_delay(self.timeout_s),
                wait=wait_fixed(self.poll_s),
                retry=retry_if_exception_type(_Held),
                reraise=True,
            )
            try:
                polls(_lock_now, fd)
            except _Held:
                raise LockTimeoutError(f"could not lock {self.path} within {self.timeout_s:g} s") from None
            with self._guard:
                self._owner = me
            try:
                yield
            finally:
                with self._guard:
                    self._owner = None
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class MovedAside:
    """A checkpoint file `open` could not read and renamed instead of refusing to start."""

    path: Path
    to: Path
    reason: str

    def __str__(self) -> str:
        return (
            f"checkpoint {self.path} could not be read ({self.reason}); moved to {self.to.name} and started with an "
            "empty one: claims prepared before are not known to this node agent (their pods keep running; the "
            "kubelet's Unprepare of them does nothing here)"
        )


@dataclass(frozen=True)
class OpenReport:
    """What `CheckpointStore.open` found."""

    invalidated: tuple[ClaimEntry, ...] = ()
    moved_aside: MovedAside | None = None
    # The reference driver's layout when its file was taken over, and how many claims came with it.
    reference_layout: str | None = None
    taken_over: int = 0


class CheckpointStore:
    """The checkpoint file of one plugin directory. Call `open()` once at start-up."""

    def __init__(
        self,
        directory: Path,
        *,
        boot_id_path: Path = DEFAULT_BOOT_ID_PATH,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        cdi_root: Path | None = None,
    ) -> None:
        """`cdi_root`: where the reference driver's claim CDI specs are, recorded for claims taken over from its
        checkpoint so that their Unprepare removes them too."""
        self.directory = directory
        self.path = directory / CHECKPOINT_FILE
        self.lock = FileLock(directory / LOCK_FILE, timeout_s=lock_timeout_s)
        self.boot_id_path = boot_id_path
        self.cdi_root = cdi_root
        # The last text of our format read or written here and its checkpoint: a file that still holds
        # exactly that text is not parsed, checked and validated again (a Prepare reads the file three
        # times, each read O(entries), tombstones included). One tuple, swapped whole: threads read it.
        self._decoded: tuple[str, Checkpoint] | None = None

    # -- reads

    def _text(self) -> str | None:
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_FILE_BYTES:
            raise CheckpointCorruptError(self.path, f"larger than {MAX_FILE_BYTES} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointCorruptError(self.path, f"not UTF-8 text: {exc.reason}") from None

    def _load(self) -> tuple[Checkpoint, str | None]:
        text = self._text()
        if text is None:
            return Checkpoint(), None
        decoded = self._decoded
        if decoded is not None and decoded[0] == text:
            return decoded[1], None
        cp, layout = decode(text, self.path, cdi_root=self.cdi_root)
        if layout is None:
            self._decoded = (text, cp)
        return cp, layout

    def read(self) -> Checkpoint:
        """The current content, without the lock. A missing file reads as an empty, unstamped checkpoint."""
        return self._load()[0]

    # -- writes (callers must hold the lock)

    def _write(self, cp: Checkpoint) -> None:
        text = dumps(cp)
        write_atomically(self.path, text, mode=0o600, tmp_prefix=_TMP_PREFIX)
        self._decoded = (text, cp)  # `loads(dumps(cp)) == cp`: what a read of this text would give

    def update(self, change: Callable[[Checkpoint], tuple[Checkpoint, T]]) -> T:
        """Read-modify-write under the lock. `change` is a pure function returning (new checkpoint, value);
        the file is rewritten only when the checkpoint changed. Exceptions from `change` leave the file
        untouched and propagate."""
        with self.lock.held():
            current = self.read()
            new, value = change(current)
            if new != current:
                self._write(new)
            return value

    def open(self) -> OpenReport:
        """Start-up: create the directory, remove temp files of interrupted writes, take over the reference
        driver's file (its original is kept as `checkpoint.json.reference`), move aside a file that cannot be
        read (`checkpoint.json.unreadable-<time>`) and start empty, apply the boot-ID rule. Never raises for
        the file's content; each of these is one log line, and the report says what happened."""
        self.directory.mkdir(parents=True, exist_ok=True)
        boot_id = read_boot_id(self.boot_id_path)
        moved: MovedAside | None = None
        layout: str | None = None
        with self.lock.held():
            for leftover in self.directory.glob(_TMP_PREFIX + "*"):
                log.info("removing temp file of an interrupted checkpoint write path=%s", leftover)
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
            existed = self.path.exists()
            try:
                current, layout = self._load()
            except CheckpointCorruptError as exc:
                moved = self._move_aside(exc.reason)
                current, existed = Checkpoint(), False
            if layout is not None:
                self._keep_reference_copy(layout, current)
            new, invalidated = reconcile_boot(current, boot_id)
            if invalidated:
                log.warning(
                    "node rebooted since the checkpoint was written; %d prepared claim(s) invalidated "
                    "path=%s old_boot_id=%s boot_id=%s claims=%s",
                    len(invalidated),
                    self.path,
                    current.boot_id,
                    boot_id,
                    ",".join(f"{e.namespace}/{e.name}:{e.uid}" for e in invalidated),
                )
            if new != current or not existed or layout is not None:
                self._write(new)
        return OpenReport(
            invalidated=tuple(invalidated),
            moved_aside=moved,
            reference_layout=layout,
            taken_over=len(current.claims) if layout is not None else 0,
        )

    def _move_aside(self, reason: str) -> MovedAside:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        to = self.directory / f"{UNREADABLE_PREFIX}{stamp}"
        self.path.replace(to)
        moved = MovedAside(self.path, to, reason)
        log.error("%s", moved)
        return moved

    def _keep_reference_copy(self, layout: str, taken: Checkpoint) -> None:
        text = self._text() or ""
        write_atomically(self.directory / REFERENCE_COPY, text, mode=0o600, tmp_prefix=_TMP_PREFIX)
        states = sorted({e.state.value for e in taken.claims.values()})
        log.warning(
            "took over the reference driver's checkpoint path=%s layout=%s claims=%d states=%s original_kept_as=%s",
            self.path,
            layout,
            len(taken.claims),
            ",".join(states) or "-",
            REFERENCE_COPY,
        )

    # -- async conveniences (the store blocks; never call it on the event loop directly)

    async def update_async(self, change: Callable[[Checkpoint], tuple[Checkpoint, T]]) -> T:
        return await asyncio.to_thread(self.update, change)

    async def read_async(self) -> Checkpoint:
        return await asyncio.to_thread(self.read)
