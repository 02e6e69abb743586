"""The node agent as a real process on simulated nodes: the real scheduler allocates the channel from our
ResourceSlice, the kubelet stand-in prepares through the gRPC sockets, kwok runs the pod only then."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
import yaml

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME, GPU_CLIQUE_NODE_LABEL
from tests.cluster.plugin.conftest import Harness, eventually
from tests.testbed.fake_driver_root import write_fake_driver_root
from tests.testbed.kubelet import PREPARED_ANNOTATION
from tests.testbed.sim.pods import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


async def test_resourceslice_is_published_owned_by_the_node(harness: Harness) -> None:
    node = await harness.add_node()
    rs = harness.get("resourceslice", f"{node.name}-{DRIVER_NAME}")
    assert rs is not None
    assert rs["spec"]["pool"] == {"name": node.name, "generation": 1, "resourceSliceCount": 1}
    assert rs["spec"]["nodeName"] == node.name and rs["spec"]["driver"] == DRIVER_NAME
    owner = rs["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Node", node.name, True)
    assert {d["name"]: d["attributes"] for d in rs["spec"]["devices"]} == {
        "channel-0": {"type": {"string": "channel"}, "id": {"int": 0}},
        "daemon-0": {"type": {"string": "daemon"}, "id": {"int": 0}},
    }
    # The IMEX daemons' base CDI spec, from the node's driver root (host paths: the agent runs on the host here).
    base = yaml.safe_load((node.cdi_dir / "k8s.compute-domain.nvidia.com-device_base.yaml").read_text())
    mounts = {m["containerPath"]: m["hostPath"] for m in base["devices"][0]["containerEdits"]["mounts"]}
    assert mounts["/usr/bin/nvidia-imex"] == str(node.root / "driver/usr/bin/nvidia-imex")
    assert mounts["/usr/bin/nvidia-imex-ctl"] == str(node.root / "driver/usr/bin/nvidia-imex-ctl")
    # Kept current: deleted by hand, it comes back.
    harness.kubectl("delete", "resourceslice", f"{node.name}-{DRIVER_NAME}")
    back = await eventually(lambda: harness.get("resourceslice", f"{node.name}-{DRIVER_NAME}"), what="re-created slice")
    assert back["metadata"]["uid"] != rs["metadata"]["uid"]
    # ... and survives a restart unchanged: the new agent's first sync finds it current.
    node.plugin.kill()
    await harness.restart_plugin(node)
    await eventually(
        lambda: node.plugin.log().rpartition("===== start")[2].count("ResourceSlice in sync") == 1 or None,
        what="the restarted agent's first slice sync",
    )
    again = harness.get("resourceslice", f"{node.name}-{DRIVER_NAME}")
    assert again is not None and again["metadata"]["uid"] == back["metadata"]["uid"]


@pytest.mark.parametrize("mode", ["Single", "All"])
async def test_workload_pod_gets_the_channel_and_deletion_undoes_it(harness: Harness, mode: str) -> None:
    node = await harness.add_node()
    cd = harness.create_cd("job", mode=mode)
    template = harness.channel_template(cd)
    harness.set_clique(cd, node, "Ready")
    harness.pod("worker", node, template)
    await eventually(lambda: harness.phase("worker") == "Running", within=60, what="pod Running")
    claim = harness.claim_of("worker")
    assert claim is not None
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (DRIVER_NAME, node.name, "channel-0")
    claim_uid = claim["metadata"]["uid"]
    spec = node.cdi_spec(claim_uid)
    assert spec is not None and spec["kind"] == "k8s.compute-domain.nvidia.com/claim"
    (device,) = spec["devices"]
    assert device["name"] == f"{claim_uid}-channel-0"
    nodes = device["containerEdits"]["deviceNodes"]
    assert nodes[0] == {
        "path": "/dev/nvidia-caps-imex-channels/channel0",
        "type": "c",
        "major": 242,
        "minor": 0,
        "fileMode": 0o666,
    }
    assert len(nodes) == (2048 if mode == "All" else 1)
    # The CD label is the controller's (none runs here): the node agent never writes it.
    assert COMPUTE_DOMAIN_LABEL not in harness.node_labels(node)
    pod = harness.get("pod", "worker", harness.ns)
    assert pod is not None and pod["metadata"]["annotations"][PREPARED_ANNOTATION] == "true"

    harness.kubectl("delete", "pod", "worker", "-n", harness.ns, "--wait=false")
    await eventually(lambda: harness.get("pod", "worker", harness.ns) is None, within=60, what="pod gone")
    assert node.cdi_spec(claim_uid) is None
    assert COMPUTE_DOMAIN_LABEL not in harness.node_labels(node)
    await eventually(
        lambda: harness.get("resourceclaim", claim["metadata"]["name"], harness.ns) is None, what="claim gone"
    )


async def test_prepare_waits_for_this_nodes_daemon_then_succeeds(harness: Harness) -> None:
    node = await harness.add_node()
    cd = harness.create_cd("wait")
    template = harness.channel_template(cd)
    harness.set_clique(cd, node, "NotReady")
    harness.pod("worker", node, template)
    await eventually(
        lambda: "waiting for this node's IMEX daemon" in node.plugin.log() or None,
        what="the agent to see the daemon NotReady and wait",
    )
    assert harness.phase("worker") == "Pending"
    # The pod says why, long before the kubelet's call ends (40 s), and keeps waiting.
    told = await eventually(
        lambda: [e for e in harness.pod_events("worker") if e["reason"] == "WaitingForIMEX"] or None,
        within=30,
        what="a WaitingForIMEX Event on the pod",
    )
    assert f"on node {node.name} (driverManaged)" in told[0]["message"], told
    harness.set_clique(cd, node, "Ready")
    # Watch-driven: well inside the 40 s budget (a polling agent would answer only after it, then be retried).
    await eventually(lambda: harness.phase("worker") == "Running", within=30, what="pod Running")
    assert harness.get("pod", "worker", harness.ns)["metadata"]["annotations"][PREPARED_ANNOTATION] == "true"  # type: ignore[index]
    assert len([e for e in harness.pod_events("worker") if e["reason"] == "WaitingForIMEX"]) == 1


async def test_a_pod_deleted_while_its_claim_waits_is_undone_at_once(harness: Harness) -> None:
    node = await harness.add_node()
    cd = harness.create_cd("gone")
    template = harness.channel_template(cd)
    harness.set_clique(cd, node, "NotReady")
    harness.pod("worker", node, template)
    await eventually(
        lambda: [e for e in harness.pod_events("worker") if e["reason"] == "WaitingForIMEX"] or None,
        within=30,
        what="the claim waiting (its pod told)",
    )
    claim = harness.claim_of("worker")
    assert claim is not None
    harness.kubectl("delete", "pod", "worker", "-n", harness.ns, "--wait=false", "--grace-period=0", "--force")
    # Not at the next cleanup pass (10 min): as soon as the claim is gone.
    await eventually(
        lambda: "claim gone while it waited for IMEX" in node.plugin.log() or None, within=30, what="seen gone"
    )

    def undone() -> bool | None:
        entry = node.store().read().get(claim["metadata"]["uid"])
        return (entry is not None and entry.state.is_tombstone) or None

    await eventually(undone, within=30, what="the claim's entry undone")


async def test_another_domains_label_is_retryable(harness: Harness) -> None:
    node = await harness.add_node()
    cd = harness.create_cd("second")
    template = harness.channel_template(cd)
    harness.set_clique(cd, node, "Ready")
    # A real domain's UID: a controller's orphan sweep may remove labels of domains that do not exist.
    other = harness.create_cd("first")["metadata"]["uid"]
    harness.kubectl("label", "node", node.name, f"{COMPUTE_DOMAIN_LABEL}={other}")
    harness.pod("worker", node, template)
    await eventually(lambda: "carries" in node.plugin.log() and other in node.plugin.log(), what="conflict retries")
    assert harness.phase("worker") == "Pending"
    assert harness.node_labels(node)[COMPUTE_DOMAIN_LABEL] == other, "another domain's label is never overwritten"
    harness.kubectl("label", "node", node.name, f"{COMPUTE_DOMAIN_LABEL}-")
    await eventually(lambda: harness.phase("worker") == "Running", within=45, what="pod Running after the label went")
    assert COMPUTE_DOMAIN_LABEL not in harness.node_labels(node), "the node agent never writes the CD label"


async def test_unknown_opaque_field_is_a_permanent_error_in_the_pods_events(harness: Harness) -> None:
    node = await harness.add_node()
    cd = harness.create_cd("typo")
    params = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": cd["metadata"]["uid"],
        "allocationMde": "All",
    }
    harness.manual_claim_pod("worker", node, params)

    def event() -> str | None:
        for ev in harness.pod_events("worker"):
            if ev["reason"] == "FailedPrepareDynamicResources":
                return str(ev["message"])
        return None

    message = await eventually(event, within=30, what="FailedPrepareDynamicResources event")
    assert "permanent error" in message and "unknown field 'allocationMde'" in message
    assert harness.phase("worker") == "Pending"
    assert node.cdi_files() == [] and COMPUTE_DOMAIN_LABEL not in harness.node_labels(node)


async def test_bad_domain_id_touches_nothing(harness: Harness) -> None:
    node = await harness.add_node()
    harness.create_cd("badid")
    params = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": "../../etc",
    }
    harness.manual_claim_pod("worker", node, params)

    def event() -> str | None:
        return next(
            (str(e["message"]) for e in harness.pod_events("worker") if e["reason"] == "FailedPrepareDynamicResources"),
            None,
        )

    message = await eventually(event, within=30, what="FailedPrepareDynamicResources event")
    assert "permanent error" in message and "domainID" in message
    assert node.cdi_files() == [] and COMPUTE_DOMAIN_LABEL not in harness.node_labels(node)
    assert node.store().read().claims == {}, "nothing recorded: validation runs before any side effect"
    assert not (node.plugin_dir / "domains").exists()


async def test_gpu_clique_label_follows_the_hardware(harness: Harness) -> None:
    enabled = {"GPU_CLIQUE_LABEL_ENABLED": "true"}
    fabric = await harness.add_node(env=enabled, standin=False)
    await eventually(
        lambda: harness.node_labels(fabric).get(GPU_CLIQUE_NODE_LABEL) == fabric.clique, what="clique label set"
    )
    harness.kubectl("label", "node", fabric.name, f"{GPU_CLIQUE_NODE_LABEL}-")
    fabric.plugin.kill()
    await harness.restart_plugin(fabric)
    await eventually(lambda: GPU_CLIQUE_NODE_LABEL in harness.node_labels(fabric), what="clique label restored")
    # A node without a clique loses a label it should not have.
    plain = await harness.add_node(clique=False, env=enabled, standin=False)
    harness.kubectl("label", "node", plain.name, f"{GPU_CLIQUE_NODE_LABEL}=stale.1", "--overwrite")
    plain.plugin.kill()
    await harness.restart_plugin(plain)
    await eventually(lambda: GPU_CLIQUE_NODE_LABEL not in harness.node_labels(plain), what="stale clique label removed")


async def test_node_without_imex_publishes_nothing_and_says_why(harness: Harness, tmp_path: Path) -> None:
    root = write_fake_driver_root(tmp_path / "no-imex", channels_major=None)
    node = await harness.add_node(driver_root=root, standin=False, wait_slice=False)
    (event, *_) = await eventually(
        lambda: [e for e in harness.node_events(node) if e["reason"] == "NoIMEXSupport"], what="NoIMEXSupport Event"
    )
    message = event["message"]
    assert "nvidia-caps-imex-channels" in message
    assert harness.get("resourceslice", f"{node.name}-{DRIVER_NAME}") is None
    assert node.plugin.proc is not None and node.plugin.proc.poll() is None, "it keeps running, it does not crash-loop"
    assert "NO IMEX SUPPORT" in node.plugin.log()


async def test_metrics_endpoint_serves_prepare_outcomes(harness: Harness) -> None:
    port = free_port()
    node = await harness.add_node(env={"HTTP_ENDPOINT": f"127.0.0.1:{port}", "METRICS_PATH": "/m"})
    cd = harness.create_cd("metrics")
    template = harness.channel_template(cd)
    harness.set_clique(cd, node, "Ready")
    harness.pod("worker", node, template)
    await eventually(lambda: harness.phase("worker") == "Running", within=60, what="pod Running")

    def get(path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return str(resp.read().decode())

    body = await asyncio.to_thread(get, "/m")
    (ok,) = [
        line for line in body.splitlines() if line.startswith('computedomain_plugin_prepare_claims_total{outcome="ok"}')
    ]
    assert float(ok.split()[-1]) >= 1
    assert "computedomain_plugin_prepare_seconds_bucket" in body
    # The reference's series, under its names (plugin/metrics.py).
    (requests,) = [
        line
        for line in body.splitlines()
        if line.startswith('nvidia_dra_requests_total{driver="compute-domain.nvidia.com",operation="prepare"}')
    ]
    assert float(requests.split()[-1]) >= 1
    assert (
        f'nvidia_dra_prepared_devices{{device_type="channel",driver="compute-domain.nvidia.com",node="{node.name}"}} 1.0'
        in body
    )
    assert await asyncio.to_thread(get, "/healthz") == "ok\n"
