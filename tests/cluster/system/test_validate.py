"""`computedomain validate` on a simulated rack installed by helm: it passes on healthy nodes (each pod's
channel device has its node's major, every daemon READY, the domain Ready), it fails naming the node and
why when that node's IMEX dies at every start (its daemon is not READY, so the node agent does not finish
preparing the channel there), when no controller makes the domain's channel template it says so before any
pod exists (a pod made before its template gets no claim, and its Events would name that instead of the
node), and it leaves nothing behind either way."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from computedomain import validate
from computedomain.kube.client import COMPUTE_DOMAINS, PODS
from imex.procfs import ProcFS
from tests.conftest import REPO, Cluster
from tests.testbed.imex_simulator.faults import dying_imex
from tests.testbed.sim.cluster import SimCluster, SimConfig, chart_image
from tests.testbed.sim.topology import SELECTOR_LABEL

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rack(cluster: Cluster) -> AsyncIterator[SimCluster]:
    async with SimCluster(cluster.local, SimConfig(racks=1, trays_per_rack=2, non_fabric=0, install=False)) as sim:
        await sim.install(
            "--set", f"validation.nodeSelector={SELECTOR_LABEL}={sim.id}",
            "--set", f"validation.namespace={sim.workload_ns}",
            "--set", "validation.timeoutSeconds=300",
        )  # fmt: skip
        await sim.wait_installed(within=300)
        yield sim


def _options(sim: SimCluster, timeout: float, namespace: str = "") -> validate.Options:
    return validate.Options(
        namespace=namespace or sim.workload_ns,
        image=chart_image(),
        node_selector=f"{SELECTOR_LABEL}={sim.id}",
        count=2,
        timeout=timeout,
        driver_namespace=sim.driver_ns,
    )


async def _nothing_left(sim: SimCluster, namespace: str = "") -> None:
    assert sim.client is not None
    ns = namespace or sim.workload_ns
    left = await sim.client.list_all(PODS, namespace=ns, label_selector=validate.RUN_LABEL)
    domains = await sim.client.list_all(COMPUTE_DOMAINS, namespace=ns, label_selector=validate.RUN_LABEL)
    assert [p["metadata"]["name"] for p in left.items] == []  # not even Terminating ones
    assert domains.items == []


async def test_the_cli_passes_on_healthy_nodes(rack: SimCluster, cluster: Cluster) -> None:
    sim = rack
    argv = [sys.executable, "-m", "computedomain", "validate", "--image", chart_image(), "-n", sim.workload_ns,
            "--node-selector", f"{SELECTOR_LABEL}={sim.id}", "--count", "2", "--timeout", "300",
            "--driver-namespace", sim.driver_ns]  # fmt: skip
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    lines = out.strip().splitlines()
    assert lines[-1].startswith("PASS: 2 nodes"), out
    for node in sim.topology:
        major = ProcFS(node.root).imex_channel_major()
        (row,) = [ln for ln in lines if ln.startswith(node.name + " ")]
        assert f"channel0 {major}:0" in row and "READY (" in row and row.endswith("ok"), out
    await _nothing_left(sim)


async def test_a_node_whose_imex_dies_fails_with_its_name_and_reason(rack: SimCluster) -> None:
    sim = rack
    assert sim.client is not None
    broken = sorted(sim.topology, key=lambda n: n.name)[1]
    with dying_imex(broken.root / "usr/bin/nvidia-imex"):
        result = await validate.run(sim.client, _options(sim, timeout=45), host_managed=False)
    text = validate.table(result) + "\n" + validate.verdict(result)
    assert not result.ok, text
    by_node = {n.node: n for n in result.nodes}
    assert not by_node[broken.name].ok and "IMEX daemon" in by_node[broken.name].reason, text
    assert validate.verdict(result).startswith("FAIL: "), text
    await _nothing_left(sim)


async def test_no_channel_template_fails_before_any_pod(rack: SimCluster, namespace: str) -> None:
    """The rack's controller watches its workload namespace only: in another one nobody makes the template."""
    sim = rack
    assert sim.client is not None
    result = await validate.run(sim.client, _options(sim, timeout=3, namespace=namespace), host_managed=False)
    text = validate.table(result) + "\n" + validate.verdict(result)
    assert not result.ok and "made no ResourceClaimTemplate" in result.reason, text
    assert f"in {namespace} within 3s: is the controller running?" in result.reason, text
    assert validate.verdict(result).startswith("FAIL: the controller made no"), text
    await _nothing_left(sim, namespace)
    jobs = await sim.client.list_all(validate.JOBS, namespace=namespace)
    assert jobs.items == [], "the Job is made only once the template exists"


async def test_helm_test_runs_the_same_check_in_the_image(rack: SimCluster) -> None:
    sim = rack
    result = await asyncio.to_thread(
        sim.helm, "test", sim.config.release, "--namespace", sim.driver_ns, "--timeout", "10m", check=False
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Phase:          Succeeded" in out, out
    assert sim.runner is not None
    (pod,) = [p for p in sim.items("pods", sim.driver_ns) if p["metadata"]["name"].endswith("-validate")]
    log = sim.runner.pod_log(sim.driver_ns, pod["metadata"]["name"], "validate")
    assert "PASS: 2 nodes" in log, log
    await _nothing_left(sim)
