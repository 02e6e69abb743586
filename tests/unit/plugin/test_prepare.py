"""The Preparer (SPEC section 6) over in-memory collaborators and a real checkpoint and CDI directory.

Time is a fake clock: budgets, backoff and readiness timeouts end when ``drive`` moves it; file I/O runs
inline, so no real time passes anywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.kube.clock import FakeClock
from computedomain.plugin.checkpoint import ClaimState
from computedomain.plugin.failures import RetryableError
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from computedomain.plugin.side_effects import WAIT_NOTICE_S
from imex.host_check import HostImexNotReadyError, ImexState
from tests.unit.plugin.fakes import CLIQUE, NODE, Bed, channel_params, claim_status, host_ready

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")


def fake_bed(tmp_path: Path, **kwargs: Any) -> Bed:
    return Bed(tmp_path, clock=FakeClock(), **kwargs)


def fake(bed: Bed) -> FakeClock:
    assert isinstance(bed.clock, FakeClock)
    return bed.clock


async def until(what: str, predicate: Callable[[], bool], rounds: int = 1000) -> None:
    """Let the event loop run (no time passes) until the code under test got somewhere."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"gave up waiting for {what}")


async def drive(bed: Bed, task: asyncio.Task[T], step: float = 0.05, limit: float = 100.0) -> T:
    """Move fake time in steps until ``task`` is done."""
    clock = fake(bed)
    start = clock.now()
    while not task.done():
        assert clock.now() - start < limit, "the task did not finish"
        await clock.advance(step)
    return task.result()


def start(coro: Any) -> asyncio.Task[Any]:
    return asyncio.ensure_future(coro)


def spec_nodes(bed: Bed, uid: str) -> list[dict[str, object]]:
    spec = bed.cdi.read(uid)
    assert spec is not None
    (device,) = spec["devices"]
    nodes: list[dict[str, object]] = device["containerEdits"]["deviceNodes"]
    return nodes


async def test_ready_domain_channel_claim(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a")
    bed.readiness.set_ready(cd.uid)
    ref = bed.channel_claim(cd)
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.ok, result.error
    (device,) = result.devices
    assert (device.pool_name, device.device_name, device.request_names) == (NODE, "channel-0", ("channel",))
    assert device.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0",)
    assert spec_nodes(bed, ref.uid) == [
        {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 242, "minor": 0, "fileMode": 0o666}
    ]
    # The fake cannot write (the real NodeLabels never writes it: test_node_labels.py); the check ran once.
    assert bed.labels.labels == {} and bed.labels.checks == 1
    entry = bed.store.read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED
    # Idempotent: the same devices again, no new side effects.
    again = (await bed.preparer.prepare([ref]))[ref.uid]
    assert again == result and bed.labels.checks == 1


async def test_all_mode_injects_every_channel(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a")
    bed.readiness.set_ready(cd.uid)
    ref = bed.channel_claim(cd, "All")
    assert (await bed.preparer.prepare([ref]))[ref.uid].ok
    assert [n["minor"] for n in spec_nodes(bed, ref.uid)] == list(range(bed.hardware.count))


async def test_prepare_waits_for_this_nodes_daemon(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=10)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    task = asyncio.create_task(bed.preparer.prepare([ref]))
    await until("the readiness wait", lambda: bed.readiness.waits == 1)
    assert not task.done()
    # No label yet is no refusal: the controller sets it once the claim is allocated, and the daemon follows.
    assert bed.labels.checks == 1
    assert bed.cdi.read(ref.uid) is None
    bed.readiness.set_ready(cd.uid)
    result = (await asyncio.wait_for(task, 5))[ref.uid]
    assert result.ok


async def test_a_waiting_claim_tells_its_pods_once_and_starts_when_ready(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=30)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    task = start(bed.preparer.prepare([ref]))
    await fake(bed).advance(WAIT_NOTICE_S - 0.1)
    assert bed.notices == [], "a daemon that turns ready quickly is not worth an Event"
    await fake(bed).advance(0.2)
    (notice,) = bed.notices
    assert notice[0] == ref.name
    assert notice[1].startswith(f"waiting for IMEX on node {NODE} (driverManaged): node {NODE} not ready in"), notice
    await fake(bed).advance(10)
    assert len(bed.notices) == 1 and not task.done(), "once, and the Prepare still waits"
    bed.readiness.set_ready(cd.uid)
    assert (await asyncio.wait_for(task, 5))[ref.uid].ok


async def test_a_claim_whose_pod_is_deleted_while_it_waits_is_undone_at_once(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=30)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    task = start(bed.preparer.prepare([ref]))
    await fake(bed).advance(WAIT_NOTICE_S + 0.1)
    assert bed.notices
    bed.claims.delete(ref)

    def undone() -> bool:
        entry = bed.store.read().get(ref.uid)
        return entry is not None and entry.state is ClaimState.PREPARE_ABORTED

    await until("the waiting claim undone", undone)
    assert bed.cdi.list_claims() == {}
    assert "unprepared while this Prepare ran" in (await asyncio.wait_for(task, 5))[ref.uid].error


async def test_host_managed_waiting_claim_says_the_host_state_at_once(tmp_path: Path) -> None:
    async def host_check() -> None:
        # What the real check raises (imex.host_check), not the preparer's own error type.
        raise HostImexNotReadyError(
            "host nvidia-imex daemon not ready: state WAITING_FOR_PEERS",
            state=ImexState.WAITING_FOR_PEERS,
            output="WAITING_FOR_PEERS",
            exit_code=0,
        )

    bed = fake_bed(tmp_path, host_managed=True, host_check=host_check, budget_s=5)
    ref = bed.channel_claim(bed.domains.add("team-a"))
    task = start(bed.preparer.prepare([ref]))
    await until("the first host check", lambda: bool(bed.notices))
    (notice,) = bed.notices
    assert f"node {NODE} (hostManaged)" in notice[1] and "WAITING_FOR_PEERS" in notice[1], notice
    await drive(bed, task)
    assert len(bed.notices) == 1


async def test_not_ready_within_budget_is_left_out(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=0.5)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    assert await drive(bed, start(bed.preparer.prepare([ref]))) == {}
    entry = bed.store.read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED


async def test_budget_spent_on_retryable_errors_returns_the_last_one_on_one_line(tmp_path: Path) -> None:
    outputs = iter(["state INITIALIZING"])

    async def host_check() -> None:
        output = next(outputs, "state UNAVAILABLE\nconnection refused\n  on /run/imex.sock")
        raise RetryableError(f"host nvidia-imex daemon not ready: {output}")

    bed = fake_bed(tmp_path, host_managed=True, budget_s=0.6, host_check=host_check)
    ref = bed.channel_claim(bed.domains.add("team-a"))
    error = (await drive(bed, start(bed.preparer.prepare([ref]))))[ref.uid].error
    assert error.startswith("retryable error: host nvidia-imex daemon not ready: state UNAVAILABLE"), error
    assert "\n" not in error and "connection refused on /run/imex.sock" in error
    assert "attempts in 0.6s; the kubelet will call again" in error
    entry = bed.store.read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED, "nothing undone: the next call goes on"
    assert bed.cdi.list_claims() == {}


async def test_an_attempt_still_running_at_the_end_is_left_out_even_after_errors(tmp_path: Path) -> None:
    calls = 0

    async def host_check() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RetryableError("host nvidia-imex daemon not ready: state UNAVAILABLE")
        await asyncio.Event().wait()  # a hanging ctl: the budget ends while it runs

    bed = fake_bed(tmp_path, host_managed=True, budget_s=1.0, host_check=host_check)
    ref = bed.channel_claim(bed.domains.add("team-a"))
    assert await drive(bed, start(bed.preparer.prepare([ref]))) == {}
    assert calls == 2


async def test_another_domains_label_is_retryable(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=0.5)
    cd = bed.domains.add("team-a")
    bed.readiness.set_ready(cd.uid)
    bed.labels.labels[COMPUTE_DOMAIN_LABEL] = "0b9c3f0e-0000-4000-8000-000000000000"
    ref = bed.channel_claim(cd)
    error = (await drive(bed, start(bed.preparer.prepare([ref]))))[ref.uid].error
    # The budget ended on a retryable error: the kubelet gets it (and shows it in the pod's Events).
    assert error.startswith("retryable error: ") and "0b9c3f0e-0000-4000-8000-000000000000" in error, error
    assert "the kubelet will call again" in error and "\n" not in error
    # Freed within the budget: a retry succeeds.
    bed.set_budget(5)
    conflicts = bed.labels.conflicts
    task = asyncio.create_task(bed.preparer.prepare([ref]))
    await until("a conflicting attempt", lambda: bed.labels.conflicts > conflicts)
    del bed.labels.labels[COMPUTE_DOMAIN_LABEL]
    assert (await drive(bed, task))[ref.uid].ok


def assert_untouched(bed: Bed) -> None:
    assert bed.store.read().claims == {}
    assert bed.cdi.list_claims() == {}
    assert bed.labels.checks == 0


async def test_unknown_opaque_field_is_permanent_and_named(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd, allocationMde="All")
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.error.startswith("permanent error:") and "unknown field 'allocationMde'" in result.error
    assert bed.claims.gets == 1, "a permanent error is not retried"
    assert_untouched(bed)


@pytest.mark.parametrize("domain_id", ["../../etc", "not-a-uuid", "6F1C2A52-0D4E-4B5E-9A77-5C3E0C1D2F40"])
async def test_bad_domain_id_touches_nothing(tmp_path: Path, domain_id: str) -> None:
    bed = fake_bed(tmp_path)
    ref = bed.claims.add("team-a", "w", claim_status("channel-0", channel_params(domain_id)))
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert "permanent error" in result.error and "domainID" in result.error
    assert_untouched(bed)
    assert not (bed.plugin_dir / "domains").exists()


async def test_claim_from_another_namespace_is_permanent(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a")
    ref = bed.claims.add("team-b", "w", claim_status("channel-0", channel_params(cd.uid)))
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert "not found in namespace team-b" in result.error and "team-a" in result.error
    assert_untouched(bed)


async def test_replaced_or_unallocated_claims_fail_permanently(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    stale = ClaimRef(ref.namespace, ref.name, ClaimUid("11111111-2222-4333-8444-555555555555"))
    assert "was replaced" in (await bed.preparer.prepare([stale]))[stale.uid].error
    bare = bed.claims.add("team-a", "bare", {})
    assert "is not allocated" in (await bed.preparer.prepare([bare]))[bare.uid].error


async def test_unprepare_undoes_everything_and_rejects_a_stale_retry(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a")
    bed.readiness.set_ready(cd.uid)
    ref = bed.channel_claim(cd)
    assert (await bed.preparer.prepare([ref]))[ref.uid].ok
    assert (await bed.preparer.unprepare([ref]))[ref.uid].ok
    assert bed.cdi.list_claims() == {}
    entry = bed.store.read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.UNPREPARE_COMPLETED
    # The kubelet's late retry of the same claim state must not resurrect it (#1162).
    late = (await bed.preparer.prepare([ref]))[ref.uid]
    assert "permanent error" in late.error and "stale Prepare" in late.error
    assert bed.cdi.list_claims() == {}
    # Unprepare is idempotent; unknown claims too.
    assert (await bed.preparer.unprepare([ref]))[ref.uid].ok


async def test_unprepare_cancels_a_waiting_prepare_without_leaks(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=10)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    waiting = asyncio.create_task(bed.preparer.prepare([ref]))
    await until("the readiness wait", lambda: bed.readiness.waits == 1)
    assert (await bed.preparer.unprepare([ref]))[ref.uid].ok
    result = (await drive(bed, waiting))[ref.uid]
    assert "unprepared while this Prepare ran" in result.error
    bed.readiness.set_ready(cd.uid)
    await fake(bed).advance(1.0)  # nothing of the cancelled Prepare may still be running and write
    assert bed.cdi.list_claims() == {}
    entry = bed.store.read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_ABORTED


async def test_claims_of_one_domain_share_channel_0_and_another_domain_waits(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=0.5)
    cd, other = bed.domains.add("team-a"), bed.domains.add("team-b")
    bed.readiness.set_ready(cd.uid)
    bed.readiness.set_ready(other.uid)
    first, second = bed.channel_claim(cd), bed.channel_claim(cd, device="channel-0-1")
    results = await bed.preparer.prepare([first, second])
    assert results[first.uid].ok and results[second.uid].ok, results
    specs = bed.cdi.list_claims()
    assert set(specs) == {first.uid, second.uid}
    # Another domain's claim waits while this domain holds the node: the checkpoint's guard, then the label
    # (the controller's: it names the first domain until its claims here are gone).
    bed.labels.labels[COMPUTE_DOMAIN_LABEL] = cd.uid
    theirs = bed.channel_claim(other)
    error = (await drive(bed, start(bed.preparer.prepare([theirs]))))[theirs.uid].error
    assert error.startswith("retryable error: ") and "channel 0" in error, error
    await bed.preparer.unprepare([first])
    await bed.preparer.unprepare([second])
    error = (await drive(bed, start(bed.preparer.prepare([theirs]))))[theirs.uid].error
    assert error.startswith("retryable error: ") and f"{COMPUTE_DOMAIN_LABEL}={cd.uid}" in error, error
    bed.labels.labels[COMPUTE_DOMAIN_LABEL] = other.uid  # the controller moved it
    bed.set_budget(5)
    assert (await bed.preparer.prepare([theirs]))[theirs.uid].ok


async def test_host_managed_domains_share_channel_0(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, host_managed=True, host_check=host_ready)
    refs = [bed.channel_claim(bed.domains.add(f"team-{i}"), device=f"channel-0-{i}") for i in (1, 2)]
    results = await bed.preparer.prepare(refs)
    assert all(r.ok for r in results.values()) and len(results) == 2, results


async def test_no_clique_succeeds_without_injection(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, clique="")
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.ok and result.devices[0].cdi_device_ids == ()
    assert bed.cdi.list_claims() == {} and bed.readiness.waits == 0
    assert bed.labels.checks == 1


async def test_daemon_claim_gets_imexd_env_and_fabric_device(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path)
    cd = bed.domains.add("team-a", name="job")
    ref = bed.daemon_claim(cd)
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.ok, result.error
    # The base spec's device first: nvidia-imex and the driver's files (cdi_base), then the claim's own.
    assert result.devices[0].cdi_device_ids == (
        "k8s.compute-domain.nvidia.com/device=all",
        f"k8s.compute-domain.nvidia.com/claim={ref.uid}-daemon-0",
    )
    spec = bed.cdi.read(ref.uid)
    assert spec is not None
    edits = spec["devices"][0]["containerEdits"]
    domain_dir = bed.plugin_dir / "domains" / cd.uid
    assert domain_dir.is_dir()
    assert edits["mounts"] == [
        {"hostPath": str(domain_dir), "containerPath": "/imexd", "options": ["rw", "nosuid", "nodev", "bind"]}
    ]
    assert edits["env"] == [
        f"CLIQUE_ID={CLIQUE}",
        f"COMPUTE_DOMAIN_UUID={cd.uid}",
        "COMPUTE_DOMAIN_NAME=job",
        "COMPUTE_DOMAIN_NAMESPACE=team-a",
    ]
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidia-caps/nvidia-cap4323", "type": "c", "major": 241, "minor": 4323, "fileMode": 256}
    ]
    assert bed.labels.checks == 0


async def test_host_managed_checks_the_host_daemon(tmp_path: Path) -> None:
    ready = False
    calls = 0

    async def host_check() -> None:
        nonlocal calls
        calls += 1
        if not ready:
            raise RetryableError("host nvidia-imex daemon not ready: state WAITING_FOR_PEERS")

    bed = fake_bed(tmp_path, host_managed=True, budget_s=0.3, host_check=host_check)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd, "All")
    error = (await drive(bed, start(bed.preparer.prepare([ref]))))[ref.uid].error
    assert calls > 1
    assert error.startswith("retryable error: host nvidia-imex daemon not ready: state WAITING_FOR_PEERS"), error
    ready = True
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.ok
    assert [n["minor"] for n in spec_nodes(bed, ref.uid)] == [0], "hostManaged always hands out channel 0 only"
    assert bed.labels.checks == 0, "no node label in hostManaged mode"
    daemon = bed.daemon_claim(cd)
    error = (await bed.preparer.prepare([daemon]))[daemon.uid].error
    assert "permanent error" in error and "hostManaged" in error


async def test_fifty_claims_at_once(tmp_path: Path) -> None:
    bed = fake_bed(tmp_path, budget_s=20)
    refs = [bed.daemon_claim(bed.domains.add("team-a", name=f"cd{i}")) for i in range(50)]
    results = await bed.preparer.prepare(refs)
    assert len(results) == 50 and all(r.ok for r in results.values())
    assert len(bed.store.read().in_state(ClaimState.PREPARE_COMPLETED)) == 50
