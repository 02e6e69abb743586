"""Channel isolation on the node (hostManaged, IMEX_ISOLATION=channel): Prepare holds the domain's own channel
and injects only it, waits (retryably, saying why) until it is assigned, refuses allocationMode All, lets the
claims of one domain share its channel but not another domain's; Unprepare releases, and the cleanup
finishes a release that failed. The Preparer over fakes and a real checkpoint and CDI directory; a fake clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from computedomain.api.models import ComputeDomainClique
from computedomain.plugin import channels
from computedomain.plugin.checkpoint import ClaimState
from computedomain.plugin.claim_plan import published_device_names
from computedomain.plugin.collaborators import DomainInfo
from computedomain.plugin.failures import ClaimRejected, RetryableError
from computedomain.plugin.resourceslice import published_devices
from tests.unit.plugin.fakes import CLIQUE, Bed, FakeChannels
from tests.unit.plugin.test_prepare import drive, fake_bed, spec_nodes, start

pytestmark = pytest.mark.timeout(30)


def iso_bed(tmp_path: Path, **kwargs: Any) -> Bed:
    return fake_bed(tmp_path, isolated=True, **kwargs)


def fakes(bed: Bed) -> FakeChannels:
    assert isinstance(bed.channels, FakeChannels)
    return bed.channels


def channel_node(channel: int) -> dict[str, object]:
    return {"path": f"/dev/nvidia-caps-imex-channels/channel{channel}", "type": "c", "major": 242,
            "minor": channel, "fileMode": 0o666}  # fmt: skip


async def test_the_domain_gets_its_own_channel_and_only_that(tmp_path: Path) -> None:
    bed = iso_bed(tmp_path)
    a, b = bed.domains.add("team-a", "a"), bed.domains.add("team-b", "b")
    ref_a, ref_b = bed.channel_claim(a), bed.channel_claim(b, device="channel-1")
    results = await bed.preparer.prepare([ref_a, ref_b])
    assert results[ref_a.uid].ok and results[ref_b.uid].ok, results
    ka, kb = fakes(bed).known(a.uid, CLIQUE), fakes(bed).known(b.uid, CLIQUE)
    assert ka is not None and kb is not None and ka != kb
    assert spec_nodes(bed, ref_a.uid) == [channel_node(ka)]
    assert spec_nodes(bed, ref_b.uid) == [channel_node(kb)]
    assert fakes(bed).holders(a.uid) == {ref_a.uid} and fakes(bed).holders(b.uid) == {ref_b.uid}
    entry = bed.store.read().get(ref_a.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED
    assert [(r.clique_id, r.channels) for r in entry.resources] == [(CLIQUE, (ka,))]
    assert bed.labels.checks == 0  # hostManaged: no node label


async def test_waits_with_a_retryable_error_until_the_channel_is_assigned(tmp_path: Path) -> None:
    bed = iso_bed(tmp_path)
    fakes(bed).auto = False
    cd = bed.domains.add("team-a", "a")
    ref = bed.channel_claim(cd)
    result = (await drive(bed, start(bed.preparer.prepare([ref]))))[ref.uid]
    assert result.error.startswith("retryable error: waiting for the controller to assign an IMEX channel")
    assert "team-a/a" in result.error and "the kubelet will call again" in result.error
    assert fakes(bed).holders(cd.uid) == {ref.uid}  # listed before anything else: the channel is held
    entry = bed.store.read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED
    assert bed.cdi.read(ref.uid) is None
    fakes(bed).assign(cd.uid, CLIQUE, 42)
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.ok, result.error
    assert spec_nodes(bed, ref.uid) == [channel_node(42)]


async def test_allocation_mode_all_is_refused(tmp_path: Path) -> None:
    bed = iso_bed(tmp_path)
    ref = bed.channel_claim(bed.domains.add("team-a"), "All")
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.error.startswith("permanent error: allocationMode All is refused with channel isolation")
    assert bed.store.read().get(ref.uid) is None and fakes(bed).acquired == 0


async def test_claims_of_one_domain_share_its_channel_but_not_another_domains(tmp_path: Path) -> None:
    bed = iso_bed(tmp_path)
    a, b = bed.domains.add("team-a", "a"), bed.domains.add("team-b", "b")
    first, second = bed.channel_claim(a), bed.channel_claim(a, device="channel-1")
    results = await bed.preparer.prepare([first, second])
    assert results[first.uid].ok and results[second.uid].ok
    k = fakes(bed).known(a.uid, CLIQUE)
    assert k is not None and spec_nodes(bed, second.uid) == [channel_node(k)]
    # A record that says b has a's channel (it cannot happen: the guard on the node refuses it anyway).
    fakes(bed).assign(b.uid, CLIQUE, k)
    bed.set_budget(0.3)
    other = bed.channel_claim(b, device="channel-2")
    result = (await drive(bed, start(bed.preparer.prepare([other]))))[other.uid]
    assert result.error.startswith(f"retryable error: IMEX channel {k} is still prepared for claim"), result.error
    assert bed.cdi.read(other.uid) is None


async def test_unprepare_releases_and_the_cleanup_finishes_a_failed_release(tmp_path: Path) -> None:
    bed = iso_bed(tmp_path)
    cd = bed.domains.add("team-a")
    ref, kept = bed.channel_claim(cd), bed.channel_claim(cd, device="channel-1")
    assert all(r.ok for r in (await bed.preparer.prepare([ref, kept])).values())
    fakes(bed).release_fails = True
    assert (await bed.preparer.unprepare([ref]))[ref.uid].ok  # the channel stays reserved a while longer
    assert fakes(bed).holders(cd.uid) == {ref.uid, kept.uid}
    fakes(bed).release_fails = False
    assert await bed.preparer.release_stale_channels() == [ref.uid]
    assert fakes(bed).holders(cd.uid) == {kept.uid}  # the live claim stays listed
    assert (await bed.preparer.unprepare([kept]))[kept.uid].ok
    assert fakes(bed).holders(cd.uid) == set()
    assert await bed.preparer.release_stale_channels() == []


async def test_the_cleanup_lists_a_prepared_claim_again_whatever_was_written_to_its_record(tmp_path: Path) -> None:
    """An entry of a claim still prepared here that went from the record (written by anyone but this node)
    comes back at the next cleanup, so the record and its channel stay while the containers run."""
    bed = iso_bed(tmp_path)
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    assert (await bed.preparer.prepare([ref]))[ref.uid].ok
    assert await bed.preparer.hold_prepared_channels() == []
    fakes(bed).claims[(cd.uid, CLIQUE)].clear()  # the entry is taken off behind the node's back
    assert await bed.preparer.hold_prepared_channels() == [ref.uid]
    assert fakes(bed).holders(cd.uid) == {ref.uid}
    assert (await bed.preparer.unprepare([ref]))[ref.uid].ok
    assert await bed.preparer.hold_prepared_channels() == []
    assert fakes(bed).holders(cd.uid) == set()


async def test_a_node_without_a_clique_injects_nothing_and_holds_nothing(tmp_path: Path) -> None:
    bed = iso_bed(tmp_path, clique="")
    cd = bed.domains.add("team-a")
    ref = bed.channel_claim(cd)
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.ok and result.devices[0].cdi_device_ids == ()
    assert fakes(bed).acquired == 0


async def test_channel_devices_are_places_for_claims(tmp_path: Path) -> None:
    places = published_devices(host_managed=True, imex_supported=True, channel_devices=3, isolated=True)
    assert [d.name for d in places] == ["channel-0", "channel-1", "channel-2"]
    assert [d.id for d in places] == [0, 1, 2]
    assert published_device_names() == {"channel-0", "daemon-0"}
    bed = iso_bed(tmp_path, channel_devices=2)
    ref = bed.channel_claim(bed.domains.add("team-a"), device="channel-2")
    result = (await bed.preparer.prepare([ref]))[ref.uid]
    assert result.error == "permanent error: device channel-2 is not a device this node publishes"


# --- the pure verdict of plugin.channels ---------------------------------------------------------------

DOMAIN = DomainInfo(uid="d1", name="a", namespace="team-a")


def record(name: str = f"d1.{CLIQUE}", channel: int | None = None, *, deleting: bool = False) -> ComputeDomainClique:
    meta: dict[str, Any] = {"name": name, "namespace": "driver"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T11:00:00Z"
    return ComputeDomainClique.model_validate({"metadata": meta, "channel": channel})


@pytest.mark.parametrize(
    ("mine", "others", "count", "exhausted", "outcome"),
    [
        (None, [], 2048, "", "waiting for the record of ComputeDomain team-a/a"),
        (record(), [], 2048, "", "waiting for the controller to assign an IMEX channel to ComputeDomain team-a/a"),
        (record(), [], 2048, "no free IMEX channel ...", ": no free IMEX channel ..."),
        (record(channel=5), [record("d2.x", 6)], 2048, "", 5),
        (record(channel=5), [record("d2.x", 5)], 2048, "", RetryableError("is recorded for d2.x too")),
        (record(channel=5), [], 4, "", ClaimRejected("is not one this node has (ImexChannelCount 4")),
        (record(channel=5, deleting=True), [], 2048, "", RetryableError("is being deleted")),
    ],
)
def test_evaluate(
    mine: ComputeDomainClique | None, others: list[ComputeDomainClique], count: int, exhausted: str, outcome: Any
) -> None:
    clique = [*(others), *([mine] if mine else [])]
    call = lambda: channels.evaluate(  # noqa: E731
        mine, clique, domain=DOMAIN, clique_id=CLIQUE, channel_count=count, exhausted=exhausted
    )
    if isinstance(outcome, Exception):
        with pytest.raises(type(outcome), match=str(outcome).replace("(", r"\(")):
            call()
    elif isinstance(outcome, int):
        assert call().channel == outcome
    else:
        verdict = call()
        assert verdict.channel is None and outcome in verdict.why


# --- the checkpoint's part -----------------------------------------------------------------------------


def test_record_channel_and_the_per_domain_guard() -> None:
    from datetime import UTC, datetime

    from computedomain.plugin.checkpoint import (
        ChannelInUseError,
        Checkpoint,
        DeviceKind,
        InvalidTransitionError,
        PreparedResource,
        begin_prepare,
        complete_prepare,
        record_channel,
    )

    now = datetime(2026, 12, 1, tzinfo=UTC)

    def begun(cp: Checkpoint, uid: str, domain: str, channels: tuple[int, ...] = ()) -> Checkpoint:
        resource = PreparedResource(kind=DeviceKind.CHANNEL, domain_id=domain, channels=channels, clique_id=CLIQUE)
        return begin_prepare(cp, uid=uid, namespace="ns", name=uid, fingerprint="f", resources=(resource,),
                             cdi_spec_files=(), now=now)  # fmt: skip

    pending = PreparedResource(kind=DeviceKind.CHANNEL, domain_id="a", clique_id=CLIQUE)
    cp = begun(Checkpoint(), "c1", "a")
    cp = record_channel(cp, "c1", pending, 5, now=now)
    entry = cp.get("c1")
    assert entry is not None and [r.channels for r in entry.resources] == [(5,)]
    cp = complete_prepare(cp, "c1", (), now=now)
    # a second claim of the same domain shares channel 5 ...
    cp2 = record_channel(begun(cp, "c2", "a"), "c2", pending, 5, now=now)
    assert cp2.get("c2") is not None
    # ... a claim of another domain may not, and a begin with the channel known is refused the same way
    other = PreparedResource(kind=DeviceKind.CHANNEL, domain_id="b", clique_id=CLIQUE)
    with pytest.raises(ChannelInUseError, match="IMEX channel 5 is still prepared for claim c1"):
        record_channel(begun(cp, "c3", "b"), "c3", other, 5, now=now)
    with pytest.raises(ChannelInUseError):
        begun(cp, "c3", "b", (5,))
    with pytest.raises(InvalidTransitionError):
        record_channel(cp, "c1", pending, 5, now=now)  # completed already
