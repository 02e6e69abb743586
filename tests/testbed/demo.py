"""`make demo`: two simulated GB200 NVL72 racks run a two-pod job in a ComputeDomain, end to end.

What happens (a few minutes warm, on a laptop-sized machine):
  1. the local control plane starts, or the running one is reused (`make cluster-up`);
  2. 38 simulated nodes join: 2 racks of 18 compute trays (one NVLink clique each) and 2 nodes without
     NVLink (tests/testbed/sim: kwok nodes with their own directories, loopback networks and fake driver);
  3. `helm install` of manifests/helm/compute-domain; the controller replicas and the 38 node agents the
     chart creates run as real processes with their pods' identity (node agents ten to a process);
  4. a ComputeDomain and a Job of two pods that need its IMEX channel; progress while the per-domain IMEX
     daemons come up (the IMEX simulator plays `nvidia-imex`);
  5. what a user wants to see: the CD with its conditions, the daemons per clique with their indices and
     IPs, and the channel device each pod got (from the CDI spec the node agent wrote);
  6. cleanup: the job, the ComputeDomain, `helm uninstall` (its teardown hooks run too), the nodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

import yaml

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.status_view import gather
from tests.testbed.cluster import LocalCluster
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.pods import CDI_ANNOTATION, Hosting

CD_NAME = "imex-demo"
JOB = "nccl-allreduce"
T0 = time.monotonic()


def say(text: str = "") -> None:
    print(text, flush=True)


def step(text: str) -> None:
    say(f"\n== [{time.monotonic() - T0:5.1f}s] {text}")


def indent(text: str, by: str = "   ") -> str:
    return "\n".join(by + line for line in text.rstrip().splitlines())


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


async def show_progress(sim: SimCluster, within: float = 240) -> None:
    """One line whenever the picture changes: workload pods, daemons, clique entries, CD status."""
    last = ""
    start = time.monotonic()
    while time.monotonic() - start < within:
        cd = sim.get("computedomain", CD_NAME, sim.workload_ns) or {}
        uid = cd.get("metadata", {}).get("uid", "")
        workers = sim.items("pods", sim.workload_ns, f"job-name={JOB}")
        daemons = sim.items("pods", sim.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}") if uid else []
        cliques = [c for c in sim.items("computedomaincliques", sim.driver_ns) if c["metadata"]["name"].startswith(uid)]
        entries = [d for c in cliques for d in c.get("daemons") or ()]
        status = (cd.get("status") or {}).get("status") or "-"
        line = (
            f"workers {sum(p['status'].get('phase') == 'Running' for p in workers)}/{len(workers)} Running | "
            f"IMEX daemon pods {sum(_ready(p) for p in daemons)}/{len(daemons)} Ready | "
            f"clique entries {sum(e.get('status') == 'Ready' for e in entries)}/{len(entries)} Ready | CD {status}"
        )
        if line != last:
            say(f"   [{time.monotonic() - T0:5.1f}s] {line}")
            last = line
        if status == "Ready" and workers and all(p["status"].get("phase") == "Running" for p in workers):
            return
        await asyncio.sleep(0.3)
    raise SystemExit(f"the domain did not become Ready within {within:.0f}s; logs are in {sim.log_dir}")


def channels(sim: SimCluster) -> str:
    rows = []
    for pod in sorted(sim.items("pods", sim.workload_ns, f"job-name={JOB}"), key=lambda p: p["spec"]["nodeName"]):
        node = sim.topology.by_name[pod["spec"]["nodeName"]]
        ids = [
            i
            for ids in json.loads(pod["metadata"].get("annotations", {}).get(CDI_ANNOTATION, "{}")).values()
            for i in ids
        ]
        devices: list[str] = []
        for spec_file in node.cdi_spec_files():
            spec = yaml.safe_load(spec_file.read_text())
            for device in spec.get("devices") or ():
                if f"{spec['kind']}={device['name']}" in ids:
                    for dn in (device.get("containerEdits") or {}).get("deviceNodes") or ():
                        devices.append(
                            f"{dn['path']} (c {dn.get('major')}:{dn.get('minor')}, mode {oct(dn.get('fileMode', 0))})"
                        )
        rows.append(f"{pod['metadata']['name']} on {node.name} ({pod['status'].get('podIP')}):")
        rows += [f"    CDI device {i}" for i in ids] + [f"    -> {d}" for d in devices or ["(no device node)"]]
    return "\n".join(rows)


async def demo() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    step("control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), started or reused")
    local = LocalCluster()
    await asyncio.to_thread(local.up)
    config = SimConfig(racks=2, non_fabric=2, prefix="", hosting=Hosting(plugins_per_host=10), restart_backoff_s=2.0)
    sim = SimCluster(local, config)
    step("38 simulated nodes, the kubelet stand-ins, and `helm install` of the chart")
    async with sim:
        table = sim.kubectl("get", "nodes", "-l", f"sim.testbed.computedomain/cluster={sim.id}",
                            "-L", "nvidia.com/gpu.clique", "--sort-by=.metadata.name").splitlines()  # fmt: skip
        say(indent("\n".join([*table[:3], f"... ({len(table) - 1} nodes)"])))
        for clique, nodes in sim.topology.cliques().items():
            say(f"   clique {clique}: {nodes[0].name} .. {nodes[-1].name} ({len(nodes)} trays)")
        say(f"   no NVLink: {', '.join(n.name for n in sim.topology.non_fabric())}")
        say(f"   helm install {sim.config.release} manifests/helm/compute-domain -n {sim.driver_ns} "
            + " ".join(f"--set {v}" for v in sim.helm_values()))  # fmt: skip
        await sim.wait_installed()
        say(indent(sim.kubectl("get", "deploy,daemonset", "-n", sim.driver_ns)))

        step(f"a ComputeDomain and a two-pod Job that needs its IMEX channel (namespace {sim.workload_ns})")
        sim.apply(sim.compute_domain(CD_NAME, num_nodes=2))
        sim.apply(sim.job(JOB, CD_NAME, 2))
        say(f"   kubectl create computedomain {CD_NAME}; kubectl create job {JOB} (2 pods, one per tray, same clique)")
        step("waiting for the domain: claims prepared, IMEX daemons up, all READY")
        created = time.monotonic()
        await show_progress(sim)
        say(f"   ComputeDomain Ready and both workers Running {time.monotonic() - created:.1f}s after kubectl create")

        step("kubectl get computedomain")
        say(indent(sim.kubectl("get", "computedomain", "-n", sim.workload_ns)))
        step(f"computedomain status {CD_NAME}")
        assert sim.client is not None
        say(indent(await gather(sim.client, CD_NAME, sim.workload_ns)))
        step("the IMEX channel each worker got (from the node agent's CDI spec on its node)")
        say(indent(channels(sim)))

        step("cleanup: the job, the ComputeDomain (the controller tears its daemons down), helm uninstall")
        await sim.akubectl("delete", "job", JOB, "-n", sim.workload_ns, "--cascade=foreground", "--wait=true")
        await sim.delete_compute_domains()
        say("   ComputeDomain gone; daemons, claim templates and node labels removed by the controller")
        await sim.uninstall(hooks=True)
        say("   helm uninstall done (pre-delete and post-delete hooks ran as Jobs on the simulated nodes)")
    step(f"done in {time.monotonic() - T0:.0f}s. The cluster keeps running (`make cluster-down` stops it).")
    say(
        "   Next: `make test` runs the unit and cluster tests; tests/cluster/system/ has the scenarios on\n"
        "   19+ simulated nodes; docs/design/0008-simulated-cluster.md explains the simulation."
    )


def main() -> int:
    asyncio.run(demo())
    return 0


if __name__ == "__main__":
    sys.exit(main())
