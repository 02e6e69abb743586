"""Channel isolation in the domain's reconcile (pure): the template's class, ``allocationMode: All`` refused,
the channels and the exhausted clique in the status, the records deleted (not waited for) at teardown, and
the isolation guard."""

from __future__ import annotations

from typing import Any

import pytest

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, ISOLATED_CHANNEL_DEVICE_CLASS
from computedomain.api.models import ComputeDomainClique, ReadyStatus
from computedomain.controller import adoption, guard
from computedomain.controller.channels import Lingering
from computedomain.controller.observed import ChildKind, Observed, decode_child
from computedomain.controller.reconcile import CreateChild, DeleteRecord, WriteStatus, desired
from computedomain.settings import ControllerSettings, ImexIsolation
from tests.unit.controller.helpers import (
    DRIVER_NS,
    NOW,
    OTHER_UID,
    UID,
    child,
    compute_domain,
    host_settings,
    settings,
)
from tests.unit.controller.test_reconcile import walk

CLIQUE = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"


def isolated(**env: str) -> ControllerSettings:
    gates = "HostManagedIMEXDaemon=true,IMEXChannelIsolation=true"
    return settings(IMEX_MODE="hostManaged", FEATURE_GATES=gates, IMEX_ISOLATION="channel", **env)


def record(
    clique_id: str = CLIQUE, channel: int | None = None, *, uid: str = UID, deleting: bool = False
) -> ComputeDomainClique:
    meta: dict[str, Any] = {"name": f"{uid}.{clique_id}", "namespace": DRIVER_NS, "uid": f"r-{clique_id}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T11:00:00Z"
    body: dict[str, Any] = {"metadata": meta, "preparedClaims": [{"claimUID": "c1", "nodeName": "gb-1"}]}
    if channel is not None:
        body["channel"] = channel
    return ComputeDomainClique.model_validate(body)


def test_workload_template_requests_any_channel_device() -> None:
    plan = desired(Observed(cd=compute_domain(), children=()), isolated(), NOW)
    (create,) = plan.actions
    assert isinstance(create, CreateChild) and create.kind is ChildKind.WORKLOAD_TEMPLATE
    (request,) = create.body["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": ISOLATED_CHANNEL_DEVICE_CLASS}  # any place, no holder
    params = create.body["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert params["allocationMode"] == "Single"
    assert decode_child(create.body).content.device_class == ISOLATED_CHANNEL_DEVICE_CLASS


def test_allocation_mode_all_is_refused_and_nothing_is_created() -> None:
    plan = desired(Observed(cd=compute_domain(finalizers=(), allocation_mode="All")), isolated(), NOW)
    assert not plan.actions
    assert plan.stuck is not None
    reason, message = plan.stuck
    assert reason == "InvalidSpec"
    assert "allocationMode All is refused with channel isolation" in message and "allocationMode Single" in message
    # without isolation, hostManaged forces Single as before
    assert desired(Observed(cd=compute_domain(finalizers=(), allocation_mode="All")), host_settings(), NOW)


def test_status_lists_the_channels_per_clique() -> None:
    observed = Observed(
        cd=compute_domain(),
        children=(child(ChildKind.WORKLOAD_TEMPLATE),),
        cliques=(record("a.1", 7), record("b.2", 3), record("c.3"), record("d.4", 9, deleting=True)),
    )
    batches, final = walk(observed, isolated())
    assert batches == [["WriteStatus"]]
    status = final.cd.status
    assert status is not None and status.status is ReadyStatus.READY
    assert [(c.clique_id, c.channel) for c in status.channels or ()] == [("a.1", 7), ("b.2", 3)]
    (cond,) = status.conditions or ()
    assert "IMEX channel 7 in clique a.1, 3 in clique b.2" in cond.message
    assert status.to_api()["channels"] == [{"cliqueID": "a.1", "channel": 7}, {"cliqueID": "b.2", "channel": 3}]


def test_no_channel_yet_is_ready_and_says_so() -> None:
    observed = Observed(cd=compute_domain(), children=(child(ChildKind.WORKLOAD_TEMPLATE),))
    _, final = walk(observed, isolated())
    assert final.cd.status is not None and final.cd.status.status is ReadyStatus.READY
    assert "no pod has asked for an IMEX channel yet" in (final.cd.status.conditions or ())[0].message
    assert "channels" not in final.cd.status.to_api()


def test_exhausted_clique_makes_the_domain_not_ready_naming_the_limit() -> None:
    observed = Observed(
        cd=compute_domain(),
        children=(child(ChildKind.WORKLOAD_TEMPLATE),),
        cliques=(record("a.1"),),
        exhausted_cliques=frozenset({"a.1"}),
    )
    plan = desired(observed, isolated(IMEX_CHANNEL_COUNT="4"), NOW)
    (write,) = plan.actions
    assert isinstance(write, WriteStatus) and write.status.status is ReadyStatus.NOT_READY
    (cond,) = write.status.conditions or ()
    assert cond.reason == "ChannelsExhausted"
    assert "no free IMEX channel for this domain in clique a.1: channels 1 to 3 (IMEX_CHANNEL_COUNT 4" in cond.message
    assert "resources.computeDomains.imex.channelCount" in cond.message
    # a flip from Ready says so with a Warning Event
    ready = compute_domain(status={"status": "Ready", "conditions": [{
        "type": "Ready", "status": "True", "reason": "HostManaged", "message": "ok",
        "lastTransitionTime": "2026-11-29T11:00:00Z"}]})  # fmt: skip
    plan = desired(Observed(cd=ready, children=observed.children, cliques=observed.cliques,
                            exhausted_cliques=observed.exhausted_cliques), isolated(), NOW)  # fmt: skip
    (write,) = plan.actions
    assert isinstance(write, WriteStatus)
    assert [(e.type, e.reason) for e in write.events] == [("Warning", "NotReady")]


def test_exhausted_names_the_nodes_that_still_hold_channels_of_deleted_domains() -> None:
    """Channels a deleted domain's records keep while nodes list claims prepared with them (a node agent that
    never unprepares, or one whose token lists claims it does not hold): the message counts them and names
    the nodes, which is what an operator acts on."""
    observed = Observed(
        cd=compute_domain(),
        children=(child(ChildKind.WORKLOAD_TEMPLATE),),
        cliques=(record("a.1"),),
        exhausted_cliques=frozenset({"a.1"}),
        lingering=Lingering(2, frozenset({"gb-7", "gb-3"})),
    )
    (write,) = desired(observed, isolated(IMEX_CHANNEL_COUNT="4"), NOW).actions
    assert isinstance(write, WriteStatus)
    (cond,) = write.status.conditions or ()
    assert (
        "its pods there wait. 2 of them are held by deleted ComputeDomains whose claims nodes gb-3, gb-7 still "
        "list as prepared: each is freed once those node agents unprepare them" in cond.message
    )
    assert cond.message.endswith("resources.computeDomains.imex.channelCount")


def test_teardown_deletes_the_records_without_waiting_for_them() -> None:
    observed = Observed(
        cd=compute_domain(deleting=True),
        children=(child(ChildKind.WORKLOAD_TEMPLATE),),
        cliques=(record("a.1", 7), record("b.2", 2, deleting=True)),
    )
    batches, _ = walk(observed, isolated())
    assert batches == [
        ["DeleteChild WorkloadTemplate"],
        ["DeleteRecord"],  # only the one not being deleted yet
        ["ReleaseChild WorkloadTemplate"],
        ["RemoveFinalizer"],
    ]
    plan = desired(Observed(cd=compute_domain(deleting=True), cliques=(record("a.1", 7),)), isolated(), NOW)
    assert [type(a) for a in plan.actions] == [DeleteRecord]
    # without isolation the records are the sweep's, as before
    assert not [a for a in desired(observed, host_settings(), NOW).actions if isinstance(a, DeleteRecord)]


@pytest.mark.parametrize(
    ("isolation", "template_class", "deleting", "found"),
    [
        (ImexIsolation.CHANNEL, CHANNEL_DEVICE_CLASS, False, "made with IMEX_ISOLATION=domain"),
        (ImexIsolation.CHANNEL, ISOLATED_CHANNEL_DEVICE_CLASS, False, ""),
        (ImexIsolation.DOMAIN, ISOLATED_CHANNEL_DEVICE_CLASS, False, "made with IMEX_ISOLATION=channel"),
        (ImexIsolation.DOMAIN, CHANNEL_DEVICE_CLASS, False, ""),
        (ImexIsolation.CHANNEL, CHANNEL_DEVICE_CLASS, True, ""),  # terminating: torn down the same either way
    ],
)
def test_isolation_guard(isolation: ImexIsolation, template_class: str, deleting: bool, found: str) -> None:
    def made_for(raw: dict[str, Any]) -> None:
        raw["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = template_class

    template = child(ChildKind.WORKLOAD_TEMPLATE, edit=made_for)
    cds = [compute_domain(deleting=deleting), compute_domain(uid=OTHER_UID, name="clean")]
    # A template of either channel class is the domain's child (adopted), so the guard sees it.
    children = adoption.children_of(cds, [template], settings())
    assert children == [template]
    findings = guard.check_isolation(isolation, cds, children)
    assert [f.evidence for f in findings] == (
        [f"workload template of class {template_class}, {found}"] if found else []
    )
    if findings:
        error = guard.isolation_conflict(isolation, findings)
        assert f"refusing to start with IMEX_ISOLATION={isolation.value}" in str(error)
        assert "team/cd1" in str(error) and "drain their workloads and delete them" in str(error)
