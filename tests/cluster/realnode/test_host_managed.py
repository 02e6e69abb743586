"""hostManaged mode on real nodes: the node agent's chrooted `nvidia-imex-ctl` in its real container.

Each node runs its "host" IMEX service (the simulator, chrooted into the node's driver root, in the node's
namespaces); its command socket is `/etc/nvidia-imex/imex_ctrl.sock` inside the driver root, where the agent
looks by default. The nodes' IMEX config lists both nodes, so one service alone waits for its peer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.cluster.realnode.conftest import Scenario, installed, wait_for
from tests.testbed.realnode.nodes import RealNodes
from tests.testbed.realnode.release import RealRelease

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def release(real_nodes: RealNodes) -> Iterator[RealRelease]:
    with installed(RealRelease(real_nodes, mode="hostManaged")) as release:
        yield release


def test_pod_waits_for_the_host_daemon_and_starts_once_it_is_ready(real_nodes: RealNodes, release: RealRelease) -> None:
    scenario = Scenario(release)
    first, second = real_nodes.nodes
    real_nodes.start_host_imex(first)  # its peer is not up: WAITING_FOR_PEERS
    cd = scenario.name("host")
    template = scenario.compute_domain(cd)
    wait_for(lambda: (release.get("computedomain", cd, scenario.ns) or {}).get("status", {}).get("status") == "Ready",
             "the ComputeDomain Ready (hostManaged: the template exists)")  # fmt: skip
    pod = scenario.name("host")
    created = time.monotonic()
    scenario.pod(pod, first.name, template, "ls -la /dev/nvidia-caps-imex-channels; sleep 3600")

    def told() -> str:
        events = scenario.events(pod)
        return events if "WaitingForIMEX" in events else ""

    # The agent says what the pod waits for at once, long before the kubelet's Prepare call ends (40 s).
    try:
        events = wait_for(told, "a WaitingForIMEX Event naming the node, the mode and the host daemon's state")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the pod's events:\n{scenario.events(pod)}") from None
    print(f"\npod created -> WaitingForIMEX Event seen: {time.monotonic() - created:.1f}s")
    (line,) = [e for e in events.splitlines() if e.startswith("WaitingForIMEX")]
    assert f"on node {first.name} (hostManaged)" in line and "WAITING_FOR_PEERS" in line, line
    assert "FailedPrepareDynamicResources" not in events, "the agent's Event comes before the kubelet's"
    pod_obj = scenario.get_pod(pod)
    assert pod_obj is not None and pod_obj["status"]["phase"] == "Pending"
    waiting = (pod_obj["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("waiting", {})
    assert waiting.get("reason", "ContainerCreating") == "ContainerCreating", pod_obj["status"]

    real_nodes.start_host_imex(second)  # both services see each other: READY
    scenario.wait_running(pod, timeout=120)
    assert scenario.events(pod).count("WaitingForIMEX") == 1, "said once"
    logs = scenario.logs(pod)
    assert f"{first.facts.channels_major}, 0" in logs and "channel0" in logs, logs
    scenario.delete("pod", pod)
    scenario.delete("computedomain", cd)
