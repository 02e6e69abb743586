"""hostManaged mode, the mode-switch guard, and caches that lag behind the apiserver."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL
from computedomain.controller.guard import ModeConflictError
from tests.cluster.controller.conftest import Harness, eventually
from tests.cluster.controller.test_lifecycle import children_of
from tests.conftest import MakeNode

pytestmark = pytest.mark.cluster

HOST = {"IMEX_MODE": "hostManaged", "FEATURE_GATES": "HostManagedIMEXDaemon=true"}


async def test_host_managed(harness: Harness, make_node: MakeNode) -> None:
    h = harness
    async with h.controller(**HOST):
        uid = h.create_cd("gamma", num_nodes=8, mode="All")["metadata"]["uid"]

        def ready() -> dict[str, Any] | None:
            obj = h.get_json("computedomain", "gamma", "-n", h.cd_ns)
            return obj if obj.get("status", {}).get("status") == "Ready" else None

        obj = await eventually(ready, what="hostManaged CD Ready")
        assert obj["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
        assert "nodes" not in obj["status"]
        (cond,) = obj["status"]["conditions"]
        assert cond["reason"] == "HostManaged" and "checked per claim" in cond["message"]
        template = h.get_json("resourceclaimtemplate", "gamma-channel", "-n", h.cd_ns)
        params = template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        assert params["allocationMode"] == "Single" and params["domainID"] == uid
        assert children_of(h, uid) == {
            "daemonsets": [],
            "resourceclaimtemplates": [f"{h.cd_ns}/gamma-channel"],
            "nodes": [],
        }
        h.kubectl("delete", "computedomain", "gamma", "-n", h.cd_ns, "--wait=false")
        await eventually(lambda: h.try_get("computedomain", "gamma", "-n", h.cd_ns) is None or None, what="gone")
        assert children_of(h, uid) == {"daemonsets": [], "resourceclaimtemplates": [], "nodes": []}


async def test_guard_refuses_host_mode_over_driver_managed_domains(harness: Harness) -> None:
    h = harness
    async with h.controller():
        h.create_cd("driver-made")
        await eventually(
            lambda: (
                h.try_get("daemonsets", "-n", h.driver_ns, "-l", COMPUTE_DOMAIN_LABEL).get("items")  # type: ignore[union-attr]
                or None
            ),
            what="DaemonSet",
        )
    with pytest.raises(ModeConflictError) as refused:
        async with h.controller(**HOST):
            pass
    message = str(refused.value)
    assert f"{h.cd_ns}/driver-made" in message and "IMEX_MODE=hostManaged" in message and "DaemonSet" in message
    # The process refuses with exit code 3 and the same message.
    proc = h.spawn(**HOST)
    assert await asyncio.to_thread(proc.wait, 60) == 3
    assert f"{h.cd_ns}/driver-made" in h.logs[-1].read_text()


async def test_guard_refuses_driver_mode_over_host_managed_domains(harness: Harness) -> None:
    h = harness
    async with h.controller(**HOST):
        h.create_cd("host-made")
        await eventually(
            lambda: h.try_get("resourceclaimtemplate", "host-made-channel", "-n", h.cd_ns), what="template"
        )
    with pytest.raises(ModeConflictError) as refused:
        async with h.controller():
            pass
    assert f"{h.cd_ns}/host-made" in str(refused.value) and "IMEX_MODE=driverManaged" in str(refused.value)
    # Deleting the domain (a hostManaged controller tears it down) lifts the refusal.
    async with h.controller(**HOST):
        h.kubectl("delete", "computedomain", "host-made", "-n", h.cd_ns, "--wait=false")
        await eventually(lambda: h.try_get("computedomain", "host-made", "-n", h.cd_ns) is None or None, what="gone")
    async with h.controller():
        pass


async def test_a_domain_missing_from_a_lagging_cache_is_not_deleted(harness: Harness, make_node: MakeNode) -> None:
    h = harness
    async with h.controller() as ctl:
        uid = h.create_cd("delta")["metadata"]["uid"]
        await eventually(lambda: len(children_of(h, uid)["resourceclaimtemplates"]) == 2 or None, what="children")
        node = make_node(clique="c0ffee.2")["metadata"]["name"]
        h.allocated_claim(uid, node)  # the controller labels the node for it
        await eventually(lambda: ctl.caches.nodes.get(node), what="node labelled and in cache")
        # Make the CD cache lag: it "forgets" the domain, as if its ADDED event had not arrived yet.
        ctl.caches.cds._remove(f"{h.cd_ns}/delta")
        assert ctl.caches.cd(uid) is None
        assert ctl.sweeper is not None
        assert await ctl.sweeper.sweep() is True  # it had to ask the apiserver ...
        before = children_of(h, uid)
        assert before["daemonsets"] and len(before["resourceclaimtemplates"]) == 2 and before["nodes"] == [node]
        # ... and a reconcile of a domain it cannot see does nothing at all.
        reconciler_result = await ctl_reconcile(ctl, uid)
        assert reconciler_result is None or str(reconciler_result) == "Done()"
        assert children_of(h, uid) == before


async def ctl_reconcile(ctl: Any, uid: str) -> Any:
    from computedomain.controller.executor import Reconciler, Writer

    return await Reconciler(Writer(ctl.client, ctl.caches, None), ctl.settings).reconcile(uid)


ISOLATED = {
    **HOST,
    "IMEX_ISOLATION": "channel",
    "FEATURE_GATES": "HostManagedIMEXDaemon=true,IMEXChannelIsolation=true",
}


async def test_guard_refuses_to_switch_the_isolation_under_live_domains(harness: Harness) -> None:
    """Both ways; a template of either channel class is the domain's own (adopted), so the guard sees it."""
    h = harness
    async with h.controller(**HOST):
        h.create_cd("shared-made")
        await eventually(
            lambda: h.try_get("resourceclaimtemplate", "shared-made-channel", "-n", h.cd_ns), what="template"
        )
    with pytest.raises(ModeConflictError) as refused:
        async with h.controller(**ISOLATED):
            pass
    message = str(refused.value)
    assert "refusing to start with IMEX_ISOLATION=channel" in message and f"{h.cd_ns}/shared-made" in message

    async with h.controller(**HOST):  # the way out: delete the domains under the isolation they were made with
        h.kubectl("delete", "computedomain", "shared-made", "-n", h.cd_ns, "--wait=false")
        await eventually(lambda: h.try_get("computedomain", "shared-made", "-n", h.cd_ns) is None or None, what="gone")
    async with h.controller(**ISOLATED):
        h.create_cd("isolated-made")
        template = await eventually(
            lambda: h.try_get("resourceclaimtemplate", "isolated-made-channel", "-n", h.cd_ns), what="template"
        )
        request = template["spec"]["spec"]["devices"]["requests"][0]
        assert request["exactly"]["deviceClassName"] == "compute-domain-channel.nvidia.com"
    with pytest.raises(ModeConflictError) as refused:
        async with h.controller(**HOST):
            pass
    message = str(refused.value)
    assert "refusing to start with IMEX_ISOLATION=domain" in message and f"{h.cd_ns}/isolated-made" in message
