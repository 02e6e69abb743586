"""hostManaged mode: the node agent checks the host's nvidia-imex (the simulator, on a unix socket inside a
fake driver root) with `chroot <root> nvidia-imex-ctl -q -u <socket>` before it hands out channel 0."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from tests.cluster.plugin.conftest import Harness, eventually, fake_node
from tests.testbed.fake_driver_root import write_fake_driver_root
from tests.testbed.imex_simulator.wrappers import install_wrappers
from tests.unit.imex.conftest import system_in_root
from tests.unit.imex.test_host_check import start_host_daemon

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

SOCKET = "/run/nvidia-imex/imex_ctrl.sock"
HOST_MANAGED = {
    "IMEX_MODE": "hostManaged",
    "FEATURE_GATES": "HostManagedIMEXDaemon=true",
    "IMEX_HOST_SOCKET_PATH": SOCKET,
}


@pytest.fixture
def host_root(tmp_path: Path) -> Iterator[Path]:
    """A fabric node's driver root (mock NVML of an NVL72 tray) that the agent can also chroot into."""
    root = write_fake_driver_root(tmp_path / "driver-root", fake_node("host-managed"), imex=False)
    install_wrappers(root / "opt" / "bin")
    with system_in_root(root):
        yield root


def events(harness: Harness, pod: str, reason: str) -> list[str]:
    return [str(e["message"]) for e in harness.pod_events(pod) if e["reason"] == reason]


async def test_channel_waits_for_the_host_daemon_and_daemon_claims_are_refused(
    harness: Harness, host_root: Path, tmp_path: Path
) -> None:
    # A peer that never comes keeps the host daemon WAITING_FOR_PEERS.
    daemon = start_host_daemon(host_root, tmp_path, peers=["127.77.0.2"])
    try:
        node = await harness.add_node(driver_root=host_root, env=HOST_MANAGED)
        rs = harness.get("resourceslice", f"{node.name}-{DRIVER_NAME}")
        # Channel 0, and the further places on it for more pods of a domain (8 by default), no daemon device.
        assert rs is not None
        assert [d["name"] for d in rs["spec"]["devices"]] == ["channel-0", *(f"channel-0-{i}" for i in range(1, 8))]
        cd = harness.create_cd("host", mode="All")  # hostManaged hands out channel 0 whatever the mode
        template = harness.channel_template(cd)
        harness.pod("worker", node, template)
        await eventually(
            lambda: "host nvidia-imex daemon not ready: state WAITING_FOR_PEERS" in node.plugin.log(),
            within=60,
            what="retries that say the daemon's state",
        )
        # Once the budget is spent, the retryable error with the daemon's state reaches the pod's Events.
        (failed, *_) = await eventually(
            lambda: [m for m in events(harness, "worker", "FailedPrepareDynamicResources") if "retryable" in m],
            within=60,
            what="a FailedPrepareDynamicResources event with the retryable error",
        )
        assert "retryable error: host nvidia-imex daemon not ready: state WAITING_FOR_PEERS" in failed, failed
        assert "output: " in failed and "\n" not in failed
        assert harness.phase("worker") == "Pending" and node.cdi_files() == []
    finally:
        daemon.kill()
        daemon.wait(30)
    daemon = start_host_daemon(host_root, tmp_path, peers=[])  # alone in its domain: READY
    try:
        await eventually(lambda: harness.phase("worker") == "Running", within=60, what="pod Running once READY")
        claim = harness.claim_of("worker")
        assert claim is not None
        spec = node.cdi_spec(claim["metadata"]["uid"])
        assert spec is not None
        assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == [
            "/dev/nvidia-caps-imex-channels/channel0"
        ]
        assert COMPUTE_DOMAIN_LABEL not in harness.node_labels(node), "no node label in hostManaged mode"

        # A daemon claim (only a stale or hand-made one can exist: no daemon device is published).
        params = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainDaemonConfig",
            "domainID": cd["metadata"]["uid"],
        }
        harness.manual_claim_pod("daemon", node, params, device="daemon-0")
        failed = await eventually(lambda: events(harness, "daemon", "FailedPrepareDynamicResources"), what="event")
        assert "permanent error" in failed[0] and "IMEX_MODE=hostManaged" in failed[0]

        harness.kubectl("delete", "pod", "worker", "-n", harness.ns, "--wait=false")
        await eventually(lambda: harness.get("pod", "worker", harness.ns) is None, within=60, what="pod gone")
        assert node.cdi_spec(claim["metadata"]["uid"]) is None
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
