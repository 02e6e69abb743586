"""hostManaged mode on real nodes: the node agent's chrooted `nvidia-imex-ctl` in its real container.

Each node runs its "host" IMEX service (the simulator, chrooted into the node's driver root, in the node's
namespaces); its command socket is `/etc/nvidia-imex/imex_ctrl.sock` inside the driver root, where the agent
looks by default. The nodes' IMEX config lists both nodes, so one service alone waits for its peer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.realnode.conftest import Scenario, wait_for
from tests.testbed.realnode.nodes import RealNodes
from tests.testbed.realnode.release import RealRelease

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def release(real_nodes: RealNodes) -> Iterator[RealRelease]:
    release = RealRelease(real_nodes, mode="hostManaged")
    release.install()
    try:
        yield release
    finally:
        release.uninstall()
        for node in real_nodes.nodes:
            real_nodes.stop_host_imex(node)


def test_pod_waits_for_the_host_daemon_and_starts_once_it_is_ready(real_nodes: RealNodes, release: RealRelease) -> None:
    scenario = Scenario(release)
    first, second = real_nodes.nodes
    real_nodes.start_host_imex(first)  # its peer is not up: WAITING_FOR_PEERS
    cd = scenario.name("host")
    template = scenario.compute_domain(cd)
    wait_for(lambda: (release.get("computedomain", cd, scenario.ns) or {}).get("status", {}).get("status") == "Ready",
             "the ComputeDomain Ready (hostManaged: the template exists)")  # fmt: skip
    pod = scenario.name("host")
    scenario.pod(pod, first.name, template, "ls -la /dev/nvidia-caps-imex-channels; sleep 3600")

    def refused() -> str:
        events = scenario.events(pod)
        return events if "FailedPrepareDynamicResources" in events and "WAITING_FOR_PEERS" in events else ""

    try:
        events = wait_for(refused, "a FailedPrepareDynamicResources Event naming the host daemon's state")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the pod's events:\n{scenario.events(pod)}") from None
    assert "nvidia-imex" in events or "IMEX" in events, events
    pod_obj = scenario.get_pod(pod)
    assert pod_obj is not None and pod_obj["status"]["phase"] == "Pending"
    waiting = (pod_obj["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("waiting", {})
    assert waiting.get("reason", "ContainerCreating") == "ContainerCreating", pod_obj["status"]

    real_nodes.start_host_imex(second)  # both services see each other: READY
    scenario.wait_running(pod, timeout=120)
    logs = scenario.logs(pod)
    assert f"{first.facts.channels_major}, 0" in logs and "channel0" in logs, logs
    scenario.delete("pod", pod)
    scenario.delete("computedomain", cd)
