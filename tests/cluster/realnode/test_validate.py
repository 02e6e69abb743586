"""The validator on real nodes, in both modes: `computedomain validate` from a workstation and `helm test` of
the release pass on two healthy nodes (each container sees its node's channel device, the IMEX daemons or the
host daemon READY, the domain Ready), and fail naming the node and why when its IMEX is broken: the host
daemon stopped (hostManaged), the node's `nvidia-imex` dying at every start (driverManaged). Each run leaves
nothing of its own behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from computedomain import validate
from tests.cluster.realnode.conftest import IMAGE, installed
from tests.conftest import REPO, Cluster
from tests.testbed.imex_simulator.faults import dying_imex
from tests.testbed.realnode.nodes import RealNodes
from tests.testbed.realnode.release import RealRelease

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", params=["driverManaged", "hostManaged"])
def release(request: pytest.FixtureRequest, real_nodes: RealNodes) -> Iterator[RealRelease]:
    mode: str = request.param
    assert real_nodes.state is not None
    work_ns = f"{real_nodes.state.id}-work"
    release = RealRelease(real_nodes, mode=mode, extra_values=[
        f"validation.namespace={work_ns}", f"validation.nodes={{{','.join(real_nodes.names)}}}",
        "validation.timeoutSeconds=120",
    ])  # fmt: skip
    with installed(release, host_imex=mode == "hostManaged"):
        yield release


def _validate(release: RealRelease, cluster: Cluster, timeout: int) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "computedomain", "validate", "--image", IMAGE, "-n", release.workload_ns,
            "--nodes", ",".join(release.nodes.names), "--timeout", str(timeout),
            "--driver-namespace", release.driver_ns]  # fmt: skip
    if release.mode == "hostManaged":
        argv.append("--host-managed")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout + 180)


def _nothing_left(release: RealRelease) -> None:
    pods = release.items("pods", release.workload_ns, validate.RUN_LABEL)
    assert [p["metadata"]["name"] for p in pods] == []  # not even Terminating ones
    assert release.items("computedomains", release.workload_ns, validate.RUN_LABEL) == []


def test_the_cli_passes_on_healthy_nodes(release: RealRelease, cluster: Cluster) -> None:
    result = _validate(release, cluster, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    lines = out.strip().splitlines()
    assert lines[-1].startswith("PASS: 2 nodes"), out
    for node in release.nodes.nodes:
        (row,) = [ln for ln in lines if ln.startswith(node.name + " ")]
        assert f"channel0 {node.facts.channels_major}:0" in row and "READY (" in row and row.endswith("ok"), out
    _nothing_left(release)


def test_helm_test_passes_and_its_pod_keeps_the_table(release: RealRelease) -> None:
    out = release.helm("test", release.release, "--namespace", release.driver_ns, "--timeout", "10m")
    assert "Phase:          Succeeded" in out, out
    (pod,) = [p for p in release.items("pods", release.driver_ns) if p["metadata"]["name"].endswith("-validate")]
    log = release.kubectl("logs", "-n", release.driver_ns, pod["metadata"]["name"])
    assert "PASS: 2 nodes" in log, log
    for node in release.nodes.nodes:
        assert f"channel0 {node.facts.channels_major}:0" in log, log
    _nothing_left(release)


def test_a_node_with_broken_imex_fails_with_its_name_and_reason(
    release: RealRelease, real_nodes: RealNodes, cluster: Cluster
) -> None:
    healthy, broken = real_nodes.nodes
    if release.mode == "hostManaged":
        real_nodes.stop_host_imex(broken)  # no socket there; its peer waits for it
        try:
            result = _validate(release, cluster, timeout=40)
        finally:
            real_nodes.start_host_imex(broken)
        expected = {broken.name: "state UNAVAILABLE", healthy.name: "state WAITING_FOR_PEERS"}
    else:
        with dying_imex(broken.driver_upper / "usr/bin/nvidia-imex"):
            result = _validate(release, cluster, timeout=40)
        expected = {broken.name: "IMEX daemon"}
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    lines = out.strip().splitlines()
    assert lines[-1].startswith("FAIL: "), out
    for name, why in expected.items():
        (row,) = [ln for ln in lines if ln.startswith(name + " ")]
        assert "FAIL: " in row and why in row, out
        assert "READY (host daemon" not in row, "a host daemon is READY only where the channel was prepared"
    _nothing_left(release)
