"""Checkpoint: the pure state machine, then the file layer (atomicity, lock, boot ID, corruption)."""

from __future__ import annotations

import json
import logging
import multiprocessing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from computedomain.plugin import checkpoint as ck
from computedomain.plugin.checkpoint import (
    ChannelInUseError,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointDevice,
    CheckpointStore,
    ClaimState,
    DeviceKind,
    InvalidTransitionError,
    LockTimeoutError,
    NodeLabel,
    PreparedResource,
    StalePrepareError,
)

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
CD = "6f1c2d3e-0000-4000-8000-00000000cd01"
UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
CHANNEL0 = PreparedResource(
    kind=DeviceKind.CHANNEL,
    domain_id=CD,
    channels=(0,),
    node_label=NodeLabel(key="resource.nvidia.com/computeDomain", value=CD),
)
DEVICE = CheckpointDevice(
    request_names=("channel",),
    pool_name="node-a",
    device_name="channel-0",
    cdi_device_ids=(f"k8s.compute-domain.nvidia.com/claim={UID_A}-channel-0",),
)


def begin(cp: Checkpoint, uid: str = UID_A, fingerprint: str = "fp1", now: datetime = T0, **kw: object) -> Checkpoint:
    args: dict[str, object] = {
        "uid": uid,
        "namespace": "ns",
        "name": f"claim-{uid[:4]}",
        "fingerprint": fingerprint,
        "resources": [CHANNEL0],
        "cdi_spec_files": [f"/var/run/cdi/k8s.compute-domain.nvidia.com-claim_{uid}.json"],
        "now": now,
    }
    args.update(kw)
    return ck.begin_prepare(cp, **args)  # type: ignore[arg-type]


def prepared(uid: str = UID_A) -> Checkpoint:
    return ck.complete_prepare(begin(Checkpoint(boot_id="boot-1"), uid), uid, [DEVICE], now=T0)


# --- pure transitions --------------------------------------------------------------------------------------


def test_prepare_lifecycle_and_idempotent_prepare() -> None:
    cp = begin(Checkpoint(boot_id="boot-1"))
    entry = cp.get(UID_A)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED
    assert entry.resources == (CHANNEL0,)
    # A retry of a half-done prepare goes ahead.
    assert ck.check_prepare(cp, UID_A, "fp1") is None
    cp = ck.complete_prepare(cp, UID_A, [DEVICE], now=T0 + timedelta(seconds=1))
    done = ck.check_prepare(cp, UID_A, "fp1")
    assert done is not None and done.devices == (DEVICE,)
    assert done.completed_at == T0 + timedelta(seconds=1)
    with pytest.raises(InvalidTransitionError):
        begin(cp)


def test_complete_requires_started() -> None:
    with pytest.raises(InvalidTransitionError, match="absent"):
        ck.complete_prepare(Checkpoint(), UID_A, [DEVICE], now=T0)
    with pytest.raises(InvalidTransitionError, match="PrepareCompleted"):
        ck.complete_prepare(prepared(), UID_A, [DEVICE], now=T0)


def test_unprepare_of_completed_leaves_tombstone_that_rejects_stale_prepare() -> None:
    cp = prepared()
    plan = ck.undo_plan(cp, UID_A)
    assert plan is not None and plan.resources == (CHANNEL0,) and plan.cdi_spec_files
    cp = ck.finish_unprepare(cp, UID_A, now=T0 + timedelta(seconds=5))
    tomb = cp.get(UID_A)
    assert tomb is not None and tomb.state is ClaimState.UNPREPARE_COMPLETED
    assert tomb.resources == () and tomb.devices == () and tomb.cdi_spec_files == ()
    assert ck.undo_plan(cp, UID_A) is None
    # Issue #1162: the kubelet's late retry of the same Prepare must not resurrect the claim.
    with pytest.raises(StalePrepareError, match="UnprepareCompleted"):
        ck.check_prepare(cp, UID_A, "fp1")
    with pytest.raises(StalePrepareError):
        begin(cp)
    # The same claim, used again with another reservation, may be prepared.
    assert ck.check_prepare(cp, UID_A, "fp2") is None
    again = begin(cp, fingerprint="fp2")
    assert again.claims[UID_A].state is ClaimState.PREPARE_STARTED


def test_unprepare_of_started_is_aborted_and_idempotent() -> None:
    cp = begin(Checkpoint())
    cp = ck.finish_unprepare(cp, UID_A, now=T0)
    assert cp.claims[UID_A].state is ClaimState.PREPARE_ABORTED
    with pytest.raises(StalePrepareError, match="PrepareAborted"):
        ck.check_prepare(cp, UID_A, "fp1")
    assert ck.finish_unprepare(cp, UID_A, now=T0 + timedelta(seconds=1)) == cp
    assert ck.finish_unprepare(cp, "unknown", now=T0) == cp


OTHER_CD = "6f1c2d3e-0000-4000-8000-00000000cd02"
OTHER_CHANNEL0 = PreparedResource(
    kind=DeviceKind.CHANNEL,
    domain_id=OTHER_CD,
    channels=(0,),
    node_label=NodeLabel(key="resource.nvidia.com/computeDomain", value=OTHER_CD),
)


def test_channel_held_by_completed_claim_blocks_another_domain_not_its_own() -> None:
    cp = prepared(UID_A)
    # Claims of one domain share its channel 0 (several pods on the node).
    assert begin(cp, UID_B).claims[UID_B].state is ClaimState.PREPARE_STARTED
    with pytest.raises(ChannelInUseError) as err:
        begin(cp, UID_B, resources=[OTHER_CHANNEL0])
    assert err.value.channel == 0 and err.value.holder == UID_A
    # Once A is unprepared, the other domain can go.
    cp = ck.finish_unprepare(cp, UID_A, now=T0)
    assert begin(cp, UID_B, resources=[OTHER_CHANNEL0]).claims[UID_B].state is ClaimState.PREPARE_STARTED
    # hostManaged channel 0 (no node label) is every domain's: no guard.
    host = PreparedResource(kind=DeviceKind.CHANNEL, domain_id=OTHER_CD, channels=(0,))
    assert begin(prepared(UID_A), UID_B, resources=[host]).claims[UID_B].state is ClaimState.PREPARE_STARTED


def test_started_claim_does_not_hold_channel_and_daemon_claims_hold_none() -> None:
    cp = begin(Checkpoint(), UID_A)
    assert begin(cp, UID_B).claims[UID_B].channels == frozenset({0})
    daemon = PreparedResource(kind=DeviceKind.DAEMON, domain_id=CD, domain_dir="/x/domains/" + CD)
    cp = prepared(UID_A)
    assert begin(cp, UID_B, resources=[daemon]).claims[UID_B].channels == frozenset()


def test_resumed_prepare_keeps_earlier_undo_information() -> None:
    other = PreparedResource(kind=DeviceKind.CHANNEL, domain_id=CD, channels=(0, 1))
    cp = begin(Checkpoint(), now=T0)
    cp = begin(cp, resources=[other], cdi_spec_files=["/b.json"], now=T0 + timedelta(seconds=3))
    entry = cp.claims[UID_A]
    assert entry.resources == (CHANNEL0, other)
    assert entry.cdi_spec_files[-1] == "/b.json" and len(entry.cdi_spec_files) == 2
    assert entry.started_at == T0 and entry.updated_at == T0 + timedelta(seconds=3)


def test_expire_tombstones() -> None:
    cp = ck.finish_unprepare(prepared(UID_A), UID_A, now=T0)
    cp = begin(cp, UID_B, now=T0)
    assert ck.expire_tombstones(cp, now=T0 + timedelta(seconds=89)) == cp
    later = ck.expire_tombstones(cp, now=T0 + timedelta(seconds=90))
    assert set(later.claims) == {UID_B}  # live entries are never expired
    assert set(ck.expire_tombstones(cp, now=T0 + timedelta(seconds=10), ttl=timedelta(seconds=5)).claims) == {UID_B}


def test_reconcile_boot() -> None:
    cp = prepared(UID_A)
    cp = begin(cp.model_copy(update={"claims": {**cp.claims}}), UID_B, resources=[])
    cp = ck.finish_unprepare(
        begin(cp, "cccccccc-0000-4000-8000-000000000003", resources=[]), "cccccccc-0000-4000-8000-000000000003", now=T0
    )

    same, none = ck.reconcile_boot(cp, "boot-1")
    assert same == cp and none == []
    adopted, none = ck.reconcile_boot(cp.model_copy(update={"boot_id": ""}), "boot-9")
    assert adopted.boot_id == "boot-9" and none == [] and adopted.claims == cp.claims

    after, invalidated = ck.reconcile_boot(cp, "boot-2")
    assert after.boot_id == "boot-2"
    assert {e.uid for e in invalidated} == {UID_A, UID_B}
    assert set(after.claims) == {UID_A, UID_B}  # tombstone dropped
    a = after.claims[UID_A]
    assert a.state is ClaimState.PREPARE_STARTED and a.devices == ()
    assert a.resources == (CHANNEL0,)  # still knows what to undo
    assert "reboot" in a.note and "PrepareCompleted" in a.note
    # The kubelet's next Prepare re-does the work instead of replaying devices that no longer exist.
    assert ck.check_prepare(after, UID_A, "fp1") is None
    assert ck.channel_holder(after, [0], except_uid=UID_B) is None


def test_claim_fingerprint_is_order_independent() -> None:
    s1 = {"allocation": {"devices": {"results": [{"device": "channel-0"}]}}, "reservedFor": [{"uid": "p1"}]}
    s2 = {"reservedFor": [{"uid": "p1"}], "allocation": {"devices": {"results": [{"device": "channel-0"}]}}}
    assert ck.claim_fingerprint(s1) == ck.claim_fingerprint(s2)
    assert ck.claim_fingerprint(s1) != ck.claim_fingerprint({**s1, "reservedFor": [{"uid": "p2"}]})


# --- file layer --------------------------------------------------------------------------------------------


@pytest.fixture
def boot_file(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("boot-1\n")
    return path


@pytest.fixture
def store(tmp_path: Path, boot_file: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "plugin", boot_id_path=boot_file, lock_timeout_s=2.0)
    assert s.open() == ck.OpenReport()
    return s


def _add(uid: str) -> ck.Callable[[Checkpoint], tuple[Checkpoint, None]]:
    return lambda cp: (begin(cp, uid, resources=[]), None)


def test_open_creates_stamped_file_and_round_trips(store: CheckpointStore) -> None:
    raw = json.loads(store.path.read_text())
    assert raw["version"] == 1 and raw["bootID"] == "boot-1" and raw["checksum"].startswith("sha256:")
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"
    store.update(lambda cp: (ck.complete_prepare(begin(cp), UID_A, [DEVICE], now=T0), None))
    back = store.read()
    assert back.claims[UID_A].devices == (DEVICE,)
    assert back.claims[UID_A].resources[0].node_label == CHANNEL0.node_label
    raw = json.loads(store.path.read_text())
    entry = raw["claims"][UID_A]
    assert entry["state"] == "PrepareCompleted"
    assert entry["resources"][0]["domainID"] == CD
    assert entry["devices"][0]["cdiDeviceIDs"] == list(DEVICE.cdi_device_ids)


def test_what_is_written_reads_back_equal_from_the_text(store: CheckpointStore) -> None:
    # The store keeps the checkpoint it wrote beside its text and serves it while the file holds that text;
    # this is what makes that the same as parsing it.
    cp = ck.complete_prepare(begin(Checkpoint(bootID="boot-1")), UID_A, [DEVICE], now=T0 + timedelta(microseconds=7))
    cp, _ = ck.reconcile_boot(cp, "boot-2")  # A demoted, with a note
    cp = ck.finish_unprepare(begin(cp, UID_B), UID_B, now=T0 + timedelta(seconds=1))
    assert cp.claims[UID_A].note and cp.claims[UID_B].state.is_tombstone and cp.claims[UID_B].tombstoned_at
    assert ck.loads(ck.dumps(cp), store.path) == cp


def test_a_file_that_still_holds_the_text_read_or_written_is_not_decoded_again(
    store: CheckpointStore, boot_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real = ck.decode
    monkeypatch.setattr(ck, "decode", lambda *a, **kw: decoded.append(1) or real(*a, **kw))
    store.update(_add(UID_A))
    store.read()
    store.update(lambda cp: (ck.complete_prepare(cp, UID_A, [DEVICE], now=T0), None))
    assert store.read().claims[UID_A].state == ClaimState.PREPARE_COMPLETED
    assert decoded == []  # every read found the text this store had written last
    other = CheckpointStore(store.path.parent, boot_id_path=boot_file, lock_timeout_s=2.0)  # another process
    other.update(_add(UID_B))
    assert set(store.read().claims) == {UID_A, UID_B} and decoded == [1, 1]  # other's own read, then ours
    assert set(store.read().claims) == {UID_A, UID_B} and decoded == [1, 1]
    store.path.write_text(store.path.read_text().replace(UID_B, UID_B.upper()))  # edited by hand
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        store.read()


def test_update_returns_value_and_skips_unchanged_writes(store: CheckpointStore) -> None:
    before = store.path.stat().st_ino
    assert store.update(lambda cp: (cp, "same")) == "same"
    assert store.path.stat().st_ino == before  # not rewritten
    store.update(_add(UID_A))
    assert store.path.stat().st_ino != before  # replaced by rename


def test_failed_change_leaves_file_untouched(store: CheckpointStore) -> None:
    store.update(_add(UID_A))
    text = store.path.read_text()

    def boom(cp: Checkpoint) -> tuple[Checkpoint, None]:
        raise ChannelInUseError(0, UID_B)

    with pytest.raises(ChannelInUseError):
        store.update(boom)
    assert store.path.read_text() == text


def test_interrupted_write_keeps_old_content(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.update(_add(UID_A))
    text = store.path.read_text()

    def crash(self: Path, target: Path) -> Path:
        raise OSError("simulated power loss before rename")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(OSError, match="power loss"):
        store.update(_add(UID_B))
    monkeypatch.undo()
    assert store.path.read_text() == text
    assert [p.name for p in store.directory.iterdir() if p.name.startswith(".checkpoint")] == []


def test_open_removes_temp_files_of_a_crashed_writer(store: CheckpointStore) -> None:
    leftover = store.directory / ".checkpoint.json.tmp-abc123"
    leftover.write_text('{"half": ')
    store.open()
    assert not leftover.exists()
    assert store.read().boot_id == "boot-1"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda t: t[: len(t) // 2], "not JSON"),
        (lambda t: t.replace('"PrepareStarted"', '"PrepareCompleted"'), "checksum mismatch"),
        (lambda t: t.replace('"version": 1', '"version": 7'), "newer than this agent"),
        (lambda t: "[]", "not a JSON object"),
        (lambda t: "[" * 100_000, "not JSON"),
        (lambda t: '{"v2": {"preparedClaims": {"x": 1}}}', "reference driver checkpoint: v2.preparedClaims['x']"),
    ],
)
def test_an_unreadable_file_is_moved_aside_at_start_up(
    store: CheckpointStore, mutate: ck.Callable[[str], str], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    store.update(_add(UID_A))
    damaged = mutate(store.path.read_text())
    store.path.write_text(damaged)
    with pytest.raises(CheckpointCorruptError) as err:  # while running: every change fails, nothing is lost
        store.update(_add(UID_B))
    assert reason in str(err.value) and str(store.path) in str(err.value)
    assert store.path.read_text() == damaged
    caplog.set_level(logging.ERROR)
    report = store.open()  # at start-up: moved aside, started empty
    moved = report.moved_aside
    assert moved is not None and reason in moved.reason and moved.path == store.path
    assert moved.to.name.startswith(ck.UNREADABLE_PREFIX) and moved.to.read_text() == damaged
    assert store.read().claims == {} and store.read().boot_id == "boot-1"
    line = str(moved)
    assert "\n" not in line and str(store.path) in line and moved.to.name in line
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [line]
    assert store.open() == ck.OpenReport()  # once


def test_an_oversized_file_is_not_read(store: CheckpointStore) -> None:
    with store.path.open("w") as f:
        f.truncate(ck.MAX_FILE_BYTES + 1)
    with pytest.raises(CheckpointCorruptError, match="larger than"):
        store.read()
    assert store.open().moved_aside is not None


def test_checksum_valid_but_schema_invalid(store: CheckpointStore) -> None:
    raw = json.loads(store.path.read_text())
    raw.pop("checksum")
    raw["claims"] = {UID_A: {"uid": UID_A, "state": "Prepared?"}}
    raw["checksum"] = ck._checksum({k: v for k, v in raw.items() if k != "version"})
    store.path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointCorruptError, match="invalid content at claims"):
        store.read()


def test_reboot_invalidates_prepared_claims(
    store: CheckpointStore, boot_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store.update(lambda cp: (ck.complete_prepare(begin(cp), UID_A, [DEVICE], now=T0), None))
    boot_file.write_text("boot-2\n")
    caplog.set_level(logging.WARNING)
    invalidated = store.open().invalidated
    assert [e.uid for e in invalidated] == [UID_A]
    assert invalidated[0].state is ClaimState.PREPARE_COMPLETED  # as it was before the reboot
    cp = store.read()
    assert cp.boot_id == "boot-2" and cp.claims[UID_A].state is ClaimState.PREPARE_STARTED
    assert any("rebooted" in r.getMessage() and UID_A in r.getMessage() for r in caplog.records)
    assert store.open() == ck.OpenReport()  # only once


def test_missing_boot_id_file_is_an_error(tmp_path: Path) -> None:
    s = CheckpointStore(tmp_path / "p", boot_id_path=tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        s.open()


def test_lock_is_not_reentrant(store: CheckpointStore) -> None:
    with store.lock.held(), pytest.raises(RuntimeError, match="re-entrant"):
        store.update(_add(UID_A))


# Child processes (spawned, so they share nothing with this process but the files).


def _try_update(directory: str, boot_id_path: str, result: multiprocessing.Queue[str]) -> None:
    s = CheckpointStore(Path(directory), boot_id_path=Path(boot_id_path), lock_timeout_s=0.3)
    try:
        s.update(_add(UID_B))
        result.put("updated")
    except LockTimeoutError as exc:
        result.put(f"timeout: {exc}")


def _add_many(directory: str, boot_id_path: str, worker: int, count: int) -> None:
    s = CheckpointStore(Path(directory), boot_id_path=Path(boot_id_path), lock_timeout_s=60)
    for i in range(count):
        uid = f"{worker:08d}-0000-4000-8000-{i:012d}"
        s.update(lambda cp, uid=uid: (begin(cp, uid, resources=[]), None))


def test_lock_excludes_other_processes(store: CheckpointStore, boot_file: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    result: multiprocessing.Queue[str] = ctx.Queue()
    with store.lock.held():
        child = ctx.Process(target=_try_update, args=(str(store.directory), str(boot_file), result))
        child.start()
        outcome = result.get(timeout=60)
        child.join(timeout=60)
    assert outcome.startswith("timeout: could not lock")
    assert UID_B not in store.read().claims


def test_concurrent_read_modify_write_loses_nothing(store: CheckpointStore, boot_file: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    workers, count = 4, 15
    procs = [
        ctx.Process(target=_add_many, args=(str(store.directory), str(boot_file), w, count)) for w in range(workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=100)
    assert [p.exitcode for p in procs] == [0] * workers
    claims = store.read().claims
    assert len(claims) == workers * count
    assert not [p for p in store.directory.iterdir() if p.name.startswith(".checkpoint")]
