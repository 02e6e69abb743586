"""A node the reference driver prepared claims on: its checkpoint (same path as ours) and CDI files are taken
over by the node agent, a repeated Prepare replays them, Unprepare undoes them; a checkpoint the agent cannot
read is moved aside and named (log line, Event on the Node), and the agent serves anyway."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.plugin.checkpoint import REFERENCE_COPY, UNREADABLE_PREFIX, ClaimState
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from tests.cluster.plugin.conftest import Harness, SimNode, eventually
from tests.testbed import reference
from tests.testbed.kubelet_client import KubeletClient

pytestmark = pytest.mark.cluster


def node_event(harness: Harness, node: SimNode, reason: str) -> dict[str, Any] | None:
    return next((e for e in harness.node_events(node) if e.get("reason") == reason), None)


async def call(node: SimNode, ref: ClaimRef, operation: str) -> str:
    async with KubeletClient(node.registrar_dir / f"{DRIVER_NAME}-reg.sock") as kubelet:
        if operation == "prepare":
            result = (await kubelet.prepare([ref]))[ref.uid]
            return result.error or ",".join(i for d in result.devices for i in d.cdi_device_ids)
        return (await kubelet.unprepare([ref]))[ref.uid].error


@pytest.mark.timeout(180)
async def test_reference_checkpoint_is_taken_over_and_unprepared(harness: Harness) -> None:
    node = await harness.add_node(standin=False)
    cd = harness.create_cd("ref")
    harness.set_clique(cd, node, "Ready")
    cd_uid = cd["metadata"]["uid"]
    params = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": cd_uid}
    claim = harness.manual_claim_pod("p", node, params)
    ref = ClaimRef(harness.ns, claim["metadata"]["name"], ClaimUid(claim["metadata"]["uid"]))

    # What the reference leaves on this node: its checkpoint, the claim's CDI spec (YAML), the node label.
    assert node.plugin.stop() == 0
    state = reference.RefClaim(ref.uid, cd_uid, node.name, name=ref.name, namespace=ref.namespace)
    doc = reference.checkpoint_v2([state], boot_id=node.store().read().boot_id)
    await asyncio.to_thread(reference.write_checkpoint, node.plugin_dir, doc)
    spec = reference.write_claim_spec(node.cdi_dir, ref.uid, {"channel-0": reference.channel_edits(511)})
    harness.kubectl("label", "node", node.name, f"{COMPUTE_DOMAIN_LABEL}={cd_uid}")
    await harness.restart_plugin(node)

    event = await eventually(lambda: node_event(harness, node, "CheckpointTakenOver"), what="takeover Event")
    assert "1 claim(s)" in event["message"] and event["type"] == "Normal"
    assert node.plugin.log().count("cannot be recomputed outside Go") == 1
    assert json.loads((node.plugin_dir / REFERENCE_COPY).read_text()) == doc
    entry = node.store().read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED

    # The kubelet asks again (a restarted kubelet, a new container): the reference's devices come back as they were.
    assert await call(node, ref, "prepare") == f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0"
    assert spec.exists(), "the reference's CDI spec is what the running container's device comes from"
    # The pod ends: our Unprepare undoes what the reference did.
    assert await call(node, ref, "unprepare") == ""
    assert not spec.exists()
    # The label the reference's agent set is the controller's now: it goes once no claim is allocated here.
    assert harness.node_labels(node)[COMPUTE_DOMAIN_LABEL] == cd_uid
    entry = node.store().read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.UNPREPARE_COMPLETED


@pytest.mark.timeout(120)
async def test_unreadable_checkpoint_is_moved_aside_and_the_agent_serves(harness: Harness) -> None:
    node = await harness.add_node(standin=False)
    assert node.plugin.stop() == 0
    store = node.store()
    damaged = store.path.read_text().replace('"bootID"', '"bootId"')
    await asyncio.to_thread(store.path.write_text, damaged)
    await harness.restart_plugin(node)  # registers: no crash loop

    event = await eventually(lambda: node_event(harness, node, "CheckpointUnreadable"), what="Warning Event")
    assert (
        event["type"] == "Warning" and str(store.path) in event["message"] and "checksum mismatch" in event["message"]
    )
    (moved,) = node.plugin_dir.glob(f"{UNREADABLE_PREFIX}*")
    assert moved.read_text() == damaged and moved.name in event["message"]
    errors = [line for line in node.plugin.log().splitlines() if "could not be read" in line]
    assert len(errors) == 1 and str(store.path) in errors[0] and "ERROR" in errors[0]
    assert store.read().claims == {}
