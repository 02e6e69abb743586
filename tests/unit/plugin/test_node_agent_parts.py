"""Pure parts of the node agent: the ResourceSlice plan, daemon readiness, the clique label, and the cleanup."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ComputeDomain, ComputeDomainClique
from computedomain.kube.client import ObjectList
from computedomain.kube.clock import FakeClock
from computedomain.kube.workqueue import DONE, RequeueAfter
from computedomain.plugin.cdi import ClaimSpec, channel_edits
from computedomain.plugin.checkpoint import (
    Checkpoint,
    ClaimState,
    NodeLabel,
    PreparedResource,
    begin_prepare,
    finish_unprepare,
)
from computedomain.plugin.cleanup import Cleanup
from computedomain.plugin.clique_label import NodeHardware, desired_label
from computedomain.plugin.collaborators import DomainInfo
from computedomain.plugin.domains import evaluate
from computedomain.plugin.node_holder import RELEASE_SETTLE_S, NodeHolder
from computedomain.plugin.resourceslice import Holding, plan, published_devices, slice_name
from imex.discovery import Discovery, FabricNotReadyError, FabricState, GpuFabricInfo
from imex.procfs import ProcFS
from tests.testbed.fake_driver_root import write_proc_files
from tests.unit.plugin.fakes import NODE, Bed

# --- ResourceSlice ------------------------------------------------------------------------------------------


def test_devices_per_mode() -> None:
    assert [d.name for d in published_devices(host_managed=False, imex_supported=True)] == ["channel-0", "daemon-0"]
    assert [d.name for d in published_devices(host_managed=True, imex_supported=True)] == ["channel-0"]
    assert published_devices(host_managed=False, imex_supported=False) == ()


def test_channel_places_follow_the_holder() -> None:
    def names(**kwargs: Any) -> list[str]:
        return [d.name for d in published_devices(imex_supported=True, channel_devices=3, **kwargs)]

    # hostManaged: every place, always, all channel 0 and nobody's.
    host = published_devices(host_managed=True, imex_supported=True, channel_devices=3)
    assert [(d.name, d.id, d.holder) for d in host] == [
        ("channel-0", 0, None),
        ("channel-0-1", 0, None),
        ("channel-0-2", 0, None),
    ]
    # driverManaged: free -> one device; held -> all places with the holder; draining -> channel-0, still its.
    assert names(host_managed=False) == ["channel-0", "daemon-0"]
    held = published_devices(host_managed=False, imex_supported=True, channel_devices=3, holding=Holding("D"))
    assert [(d.name, d.holder) for d in held] == [
        ("channel-0", "D"),
        ("channel-0-1", "D"),
        ("channel-0-2", "D"),
        ("daemon-0", None),
    ]
    assert held[1].to_api()["attributes"] == {
        "type": {"string": "channel"},
        "id": {"int": 0},
        "domain": {"string": "D"},
    }
    assert names(host_managed=False, holding=Holding("D", draining=True)) == ["channel-0", "daemon-0"]
    # Channel isolation keeps its numbered places.
    assert names(host_managed=True, isolated=True) == ["channel-0", "channel-1", "channel-2"]


class _Publisher:
    """Its ``informer.list()`` is the slice as the apiserver has what was set."""

    def __init__(self) -> None:
        self.devices: tuple[Any, ...] = ()
        self.informer = self

    def set_devices(self, devices: Any) -> None:
        self.devices = tuple(devices)

    def list(self) -> list[dict[str, Any]]:
        return [{"spec": {"devices": [d.to_api() for d in self.devices]}}]


class _Claims:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.lists = 0

    async def list_all(self, _resource: Any, *, namespace: str | None = None) -> Any:
        self.lists += 1
        return ObjectList(items=list(self.items), resource_version="1")


def _allocated(name: str, uid: str, pool: str = NODE) -> dict[str, Any]:
    results = [{"driver": "compute-domain.nvidia.com", "pool": pool, "device": "channel-0-1", "request": "channel"}]
    return {"metadata": {"name": name, "uid": uid}, "status": {"allocation": {"devices": {"results": results}}}}


async def test_node_holder_drains_before_the_node_is_free(tmp_path: Path) -> None:
    """held while the checkpoint has a live channel claim of D; then draining (channel-0 alone, D's) for the
    settle time and while a claim of D is allocated here; then free, and the label left behind goes."""
    clock = FakeClock()
    domain = str(uuid.uuid4())
    now = datetime(2026, 1, 1, tzinfo=UTC)
    resource = PreparedResource(
        kind="channel", domain_id=domain, channels=(0,), node_label=NodeLabel(key=COMPUTE_DOMAIN_LABEL, value=domain)
    )
    cp = begin_prepare(
        Checkpoint(),
        uid="c1",
        namespace="ns",
        name="w-0",
        fingerprint="f",
        resources=(resource,),
        cdi_spec_files=(),
        now=now,
    )
    state = {"cp": cp}
    publisher, claims = _Publisher(), _Claims()
    holder = NodeHolder(
        claims,  # type: ignore[arg-type]
        publisher,  # type: ignore[arg-type]
        node_name=NODE,
        read_checkpoint=lambda: state["cp"],
        node_label=lambda: domain,
        domain_namespace=lambda uid: "ns",
        devices=lambda holding: published_devices(
            host_managed=False, imex_supported=True, channel_devices=4, holding=holding
        ),
        clock=clock,
    )
    assert await holder._reconcile("holder") == DONE
    assert [d.holder for d in publisher.devices] == [domain] * 4 + [None]
    state["cp"] = finish_unprepare(cp, "c1", now=now)
    # An agent restarted now (the controller already took the label off) drains on from what its slice says.
    restarted = NodeHolder(
        claims,  # type: ignore[arg-type]
        publisher,  # type: ignore[arg-type]
        node_name=NODE,
        read_checkpoint=lambda: state["cp"],
        node_label=lambda: None,
        domain_namespace=lambda uid: "ns",
        devices=holder.devices,
        clock=clock,
    )
    assert isinstance(await restarted._reconcile("holder"), RequeueAfter)
    assert [(d.name, d.holder) for d in publisher.devices] == [("channel-0", domain), ("daemon-0", None)]
    result = await holder._reconcile("holder")
    assert isinstance(result, RequeueAfter) and result.seconds == RELEASE_SETTLE_S
    assert [(d.name, d.holder) for d in publisher.devices] == [("channel-0", domain), ("daemon-0", None)]
    assert claims.lists == 0
    # A pod of D that was scheduled on the slice of before: its claim keeps the node D's.
    claims.items = [_allocated("w-1", "c2"), _allocated("w-0", "c1"), _allocated("elsewhere", "c3", pool="n2")]
    await clock.advance(RELEASE_SETTLE_S)
    assert isinstance(await holder._reconcile("holder"), RequeueAfter)
    assert publisher.devices[0].holder == domain
    claims.items = claims.items[1:]  # only the claim unprepared here and another node's are left
    await clock.advance(RELEASE_SETTLE_S)
    assert await holder._reconcile("holder") == DONE
    assert [(d.name, d.holder) for d in publisher.devices] == [("channel-0", None), ("daemon-0", None)]


def test_plan_creates_then_is_stable_then_repairs() -> None:
    devices = published_devices(host_managed=False, imex_supported=True)
    first = plan([], node_name=NODE, node_uid="u1", devices=devices)
    assert first.create is not None and not first.delete
    body = first.create
    assert body["metadata"]["name"] == slice_name(NODE) == f"{NODE}-compute-domain.nvidia.com"
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "u1", "controller": True}
    ]
    assert body["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert body["spec"]["devices"][0] == {
        "name": "channel-0",
        "attributes": {"type": {"string": "channel"}, "id": {"int": 0}},
    }
    stored = {**body, "metadata": {**body["metadata"], "resourceVersion": "7", "uid": "s1"}}
    assert plan([stored], node_name=NODE, node_uid="u1", devices=devices).empty
    # The Node was re-created (new UID) and the mode changed: one update, next generation.
    update = plan([stored], node_name=NODE, node_uid="u2", devices=devices[:1]).update
    assert update is not None and update["spec"]["pool"]["generation"] == 2
    assert update["metadata"]["resourceVersion"] == "7"
    # A slice left by someone else for this node and driver goes; none at all without IMEX.
    foreign = {"metadata": {"name": "00000-compute-domain.nvidia.com-x"}, "spec": {"pool": {"generation": 4}}}
    repaired = plan([stored, foreign], node_name=NODE, node_uid="u1", devices=devices)
    assert repaired.delete == ("00000-compute-domain.nvidia.com-x",) and repaired.update is not None
    assert repaired.update["spec"]["pool"]["generation"] == 5
    assert plan([stored], node_name=NODE, node_uid="u1", devices=()).delete == (slice_name(NODE),)


def test_long_node_names_give_valid_slice_names() -> None:
    name = slice_name("n" * 250)
    assert len(name) <= 253 and name != slice_name("n" * 251)


# --- readiness -----------------------------------------------------------------------------------------------


def cd_with_nodes(uid: str, nodes: list[tuple[str, str]], num_nodes: int = 0) -> ComputeDomain:
    status: dict[str, Any] = {"status": "NotReady"}
    if nodes:
        status["nodes"] = [{"name": n, "ipAddress": "10.0.0.1", "cliqueID": "c", "status": s} for n, s in nodes]
    return ComputeDomain.model_validate(
        {
            "metadata": {"name": "job", "namespace": "team-a", "uid": uid},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": "t"}}},
            "status": status,
        }
    )


def clique(uid: str, entries: list[tuple[str, str]]) -> ComputeDomainClique:
    return ComputeDomainClique.model_validate(
        {
            "metadata": {"name": f"{uid}.c", "namespace": "drv", "labels": {COMPUTE_DOMAIN_LABEL: uid}},
            "daemons": [{"nodeName": n, "ipAddress": "10.0.0.1", "cliqueID": "c", "status": s} for n, s in entries],
        }
    )


def test_readiness_from_this_nodes_clique_entry() -> None:
    uid = str(uuid.uuid4())
    domain = DomainInfo(uid, "job", "team-a", 2)
    kw: dict[str, Any] = {"cd": cd_with_nodes(uid, []), "use_cliques": True, "dns_names": True}
    ready = evaluate(NODE, domain, "c", clique=clique(uid, [(NODE, "Ready"), ("other", "NotReady")]), **kw)
    assert ready.ready
    other = evaluate(NODE, domain, "c", clique=clique(uid, [(NODE, "NotReady"), ("other", "Ready")]), **kw)
    assert not other.ready and f"ComputeDomainClique {uid}.c: entry NotReady" in other.why
    missing = evaluate(NODE, domain, "c", clique=None, **kw)
    assert not missing.ready and "not found" in missing.why and "no status.nodes entry" in missing.why
    # Domains from before the clique gate: CD status still counts.
    kw["cd"] = cd_with_nodes(uid, [(NODE, "Ready")])
    assert evaluate(NODE, domain, "c", clique=None, **kw).ready


def test_legacy_ip_mode_waits_for_num_nodes() -> None:
    uid = str(uuid.uuid4())
    domain = DomainInfo(uid, "job", "team-a", 2)
    one = cd_with_nodes(uid, [(NODE, "Ready"), ("b", "NotReady")], 2)
    state = evaluate(NODE, domain, "c", clique=None, cd=one, use_cliques=False, dns_names=False)
    assert not state.ready and "1 of 2 daemons Ready" in state.why
    both = cd_with_nodes(uid, [(NODE, "Ready"), ("b", "Ready")], 2)
    assert evaluate(NODE, domain, "c", clique=None, cd=both, use_cliques=False, dns_names=False).ready


# --- clique --------------------------------------------------------------------------------------------------


class Fabric:
    def __init__(self, infos: list[GpuFabricInfo]) -> None:
        self.infos = infos

    def driver_version(self) -> Any:
        raise NotImplementedError

    def gpu_fabric_infos(self) -> list[GpuFabricInfo]:
        return self.infos


async def test_clique_refresh_keeps_a_known_clique(tmp_path: Path) -> None:
    cluster = uuid.uuid4()
    fabric = Fabric([GpuFabricInfo("0", FabricState.COMPLETED, cluster, 3)])
    hw = NodeHardware(Discovery(fabric, ProcFS(write_proc_files(tmp_path))), crash_on_fabric_errors=True)
    assert hw.load() == f"{cluster}.3" == desired_label(hw.clique_id)
    fabric.infos = [GpuFabricInfo("0", FabricState.IN_PROGRESS)]
    assert await hw.refresh() == f"{cluster}.3", "a failed read never clears the clique"
    fabric.infos = [GpuFabricInfo("0", FabricState.COMPLETED, cluster, 4)]
    assert await hw.refresh() == f"{cluster}.4"
    assert desired_label("") is None
    assert hw.fabric_imex_mgmt() is not None and hw.imex_channel_major() == 242 and hw.imex_support() is None
    strict = NodeHardware(
        Discovery(Fabric([GpuFabricInfo("0", FabricState.NOT_STARTED)]), ProcFS(tmp_path)), crash_on_fabric_errors=True
    )
    with pytest.raises(FabricNotReadyError):
        strict.load()


def test_node_without_imex_says_why(tmp_path: Path) -> None:
    root = write_proc_files(tmp_path, channels_major=None)
    hw = NodeHardware(Discovery(Fabric([]), ProcFS(root)), crash_on_fabric_errors=True)
    assert hw.load() == ""
    reason = hw.imex_support()
    assert reason is not None and "nvidia-caps-imex-channels" in reason


# --- cleanup -------------------------------------------------------------------------------------------------


async def test_cleanup_undoes_stale_partial_prepares_and_orphans(tmp_path: Path) -> None:
    bed = Bed(tmp_path)
    cd = bed.domains.add("team-a")
    now = datetime.now(UTC)
    kept = bed.channel_claim(cd)
    gone_uid = str(uuid.uuid4())
    bed.labels.labels[COMPUTE_DOMAIN_LABEL] = cd.uid
    label = NodeLabel(key=COMPUTE_DOMAIN_LABEL, value=cd.uid)

    def started(uid: str, name: str) -> None:
        resource = PreparedResource(kind="channel", domain_id=cd.uid, channels=(0,), node_label=label)
        bed.store.update(
            lambda cp: (
                begin_prepare(
                    cp,
                    uid=uid,
                    namespace="team-a",
                    name=name,
                    fingerprint="f",
                    resources=[resource],
                    cdi_spec_files=[str(bed.cdi.path_for(uid))],
                    now=now,
                ),
                None,
            )
        )
        bed.cdi.write(ClaimSpec(uid, {"channel-0": channel_edits(242, [0])}))

    started(kept.uid, kept.name)  # its claim exists: left for the kubelet
    started(gone_uid, "deleted-claim")  # its claim is gone: undone
    orphan = str(uuid.uuid4())
    bed.cdi.write(ClaimSpec(orphan, {"channel-0": channel_edits(242, [0])}))
    (bed.plugin_dir / "domains" / "dead-domain").mkdir(parents=True)
    (bed.plugin_dir / "domains" / cd.uid).mkdir()
    cleanup = Cleanup(
        bed.preparer,
        bed.cdi,
        claim_uid=bed.claims.claim_uid,
        known_domains=lambda: {cd.uid},
        domains_dir=bed.plugin_dir / "domains",
        tombstone_ttl=timedelta(seconds=0),
    )
    report = await cleanup.run_once()
    assert report.undone_claims == [gone_uid]
    assert report.removed_specs == [orphan]
    assert report.removed_domain_dirs == ["dead-domain"]
    checkpoint = bed.store.read()
    assert checkpoint.get(kept.uid).state is ClaimState.PREPARE_STARTED  # type: ignore[union-attr]
    assert checkpoint.get(gone_uid).state is ClaimState.PREPARE_ABORTED  # type: ignore[union-attr]
    assert set(bed.cdi.list_claims()) == {kept.uid}
    assert bed.labels.labels == {COMPUTE_DOMAIN_LABEL: cd.uid}, "the controller's label: the agent never removes it"
    # Next round: the tombstone expires (TTL 0 here).
    await asyncio.sleep(0.01)
    assert (await cleanup.run_once()).expired_tombstones == 1
