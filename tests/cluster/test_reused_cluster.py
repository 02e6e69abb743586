"""The README's commands in any order on one cluster: what `make demo` leaves (CRDs that `helm install` and the
chart's CRD hook wrote) is taken over by the test bed's install, and what a killed demo leaves (its release,
nodes, namespaces, kwok) is removed by the next command, after which a demo of the same names installs again.

A cluster of its own (under .cluster/reuse, started fresh), so the CRDs are helm's and not the session's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.testbed import leftovers
from tests.testbed.cluster import FIELD_MANAGER, LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = REPO / ".cluster" / "reuse"
CRDS = ("computedomains.resource.nvidia.com", "computedomaincliques.resource.nvidia.com")
# The demo's install (tests/testbed/demo.py: the fixed names, `helm install` with its hooks) on two trays;
# `kill` stops after the install, as a demo interrupted there would.
DEMO = """
import asyncio, sys
from pathlib import Path
from tests.testbed.cluster import LocalCluster
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.pods import Hosting

async def main() -> None:
    config = SimConfig(racks=1, trays_per_rack=2, non_fabric=0, prefix="", hosting=Hosting(plugins_per_host=2),
                       restart_backoff_s=2.0)
    async with SimCluster(LocalCluster(Path(sys.argv[1])), config) as sim:
        await sim.wait_installed()
        print("installed", flush=True)
        if sys.argv[2] == "kill":
            await asyncio.sleep(3600)
        await sim.uninstall(hooks=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def local() -> Iterator[LocalCluster]:
    cluster = LocalCluster(ROOT)
    cluster.down(quiet=True)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def demo(local: LocalCluster, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", DEMO, str(local.root), mode], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.strip() == "installed":
            return proc
    proc.wait()
    raise AssertionError(f"the demo's install failed (exit {proc.returncode}):\n{''.join(out[-30:])}")


def helm_releases(local: LocalCluster, namespace: str) -> list[str]:
    argv = [str(local.root / "bin" / "helm"), f"--kubeconfig={local.kubeconfig}", "list", "-q", "-n", namespace]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()


def test_after_a_demo_the_test_beds_install_takes_over_the_crds_helm_and_its_hook_wrote(
    local: LocalCluster,
) -> None:
    proc = demo(local, "finish")
    assert proc.wait(timeout=600) == 0
    before = {n: json.loads(local.kubectl("get", "crd", n, "--show-managed-fields", "-o", "json").stdout) for n in CRDS}
    assert all(FIELD_MANAGER not in {m["manager"] for m in crd["metadata"]["managedFields"]} for crd in before.values())

    added = local.install_base()

    assert not any("customresourcedefinition" in name for name in added), added
    for name in CRDS:
        crd = json.loads(local.kubectl("get", "crd", name, "--show-managed-fields", "-o", "json").stdout)
        assert FIELD_MANAGER in {m["manager"] for m in crd["metadata"]["managedFields"]}
        assert crd["metadata"]["uid"] == before[name]["metadata"]["uid"]  # taken over, not recreated


def test_what_a_killed_demo_left_is_removed_by_the_next_command_and_the_demo_installs_again(
    local: LocalCluster,
) -> None:
    proc = demo(local, "kill")
    proc.kill()
    proc.wait()
    (record,) = [r for r in leftovers.read_records(local).values() if r is not None]
    assert record.kwok_pid is not None and leftovers.alive(record.kwok_pid, record.kwok_start)
    assert helm_releases(local, record.driver_ns) == [record.release]

    assert local.up() is False  # reused: the killed run's leftovers go
    assert not leftovers.read_records(local)
    assert not leftovers.alive(record.kwok_pid, record.kwok_start)
    assert helm_releases(local, record.driver_ns) == []
    for ns in (record.driver_ns, record.workload_ns):
        assert local.kubectl("get", "namespace", ns, "--ignore-not-found", "-o", "name").stdout == ""
    assert local.kubectl("get", "nodes", *record.nodes, "--ignore-not-found", "-o", "name").stdout == ""

    again = demo(local, "finish")
    assert again.wait(timeout=600) == 0
    local.install_base()
