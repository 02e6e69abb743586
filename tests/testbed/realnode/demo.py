"""`make demo REAL=1`: a two-pod job in a ComputeDomain on two real nodes (kubelet, containerd, runc).

What happens (about two minutes warm; the first run also builds the node binaries and the image):
  1. the local control plane starts, or the running one is reused;
  2. the service's image is built without Docker (`make image`), two real nodes start in namespaces of their
     own and import it; each has a fake NVIDIA driver root (its own channel major) with the IMEX simulator;
  3. `helm install` of the chart, unchanged, with values for these nodes;
  4. a ComputeDomain and a Job of two pods, one per node, that list their IMEX channel devices;
  5. what a user sees: the IMEX daemons as real containers, the domain Ready, and `kubectl logs` of each
     worker showing the character device its container got through CDI;
  6. cleanup: the job, the ComputeDomain, `helm uninstall`, the real nodes (nothing is left on the machine).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.testbed.cluster import LocalCluster
from tests.testbed.demo import T0, indent, say, step
from tests.testbed.realnode.nodes import RealNodes
from tests.testbed.realnode.release import RealRelease

CD_NAME = "imex-demo"
JOB = "channel-check"


def job(nodes: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": JOB},
        "spec": {
            "completions": len(nodes), "parallelism": len(nodes), "completionMode": "Indexed",
            "template": {"spec": {
                "restartPolicy": "Never",
                "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {"job-name": JOB}}, "topologyKey": "kubernetes.io/hostname"}]},
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}},
                "containers": [{
                    "name": "worker", "image": "ghcr.io/computedomain/computedomain:0.1.0",
                    "command": ["sh", "-c", "hostname; ls -la /dev/nvidia-caps-imex-channels; sleep 5"],
                    "resources": {"claims": [{"name": "imex-channel"}]},
                }],
                "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": f"{CD_NAME}-channel"}],
            }},
        },
    }  # fmt: skip


def main() -> int:
    step("control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), started or reused")
    local = LocalCluster()
    local.up()
    nodes = RealNodes(local, count=2)
    step("the image (built without Docker, cached) and two real nodes: kubelet + containerd + runc each")
    nodes.up()
    assert nodes.image is not None
    say(f"   image {nodes.image.name}: {nodes.image.size / 1e6:.1f} MB compressed, imported into each node")
    say(indent(local.kubectl("get", "nodes", "-o", "wide", "-l", "realnode.testbed.computedomain/set").stdout))
    for node in nodes.nodes:
        say(f"   {node.name}: driver root /run/nvidia/driver, nvidia-caps-imex-channels major "
            f"{node.facts.channels_major}, {node.facts.channel_count} channels")  # fmt: skip
    release = RealRelease(nodes)
    try:
        step("helm install manifests/helm/compute-domain (unchanged; values only)")
        say("   " + " ".join(f"--set {v}" for v in release.values()))
        release.install()
        say(indent(release.kubectl("get", "pods", "-o", "wide", "-n", release.driver_ns)))

        step(f"a ComputeDomain and a Job of two pods, one per real node (namespace {release.workload_ns})")
        release.kubectl("apply", "-n", release.workload_ns, "-f", "-", input=json.dumps({
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain", "metadata": {"name": CD_NAME},
            "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": f"{CD_NAME}-channel"}}},
        }))  # fmt: skip
        release.kubectl("apply", "-n", release.workload_ns, "-f", "-", input=json.dumps(job(nodes.names)))
        created = time.monotonic()
        last = ""
        while time.monotonic() - created < 240:
            cd = release.get("computedomain", CD_NAME, release.workload_ns) or {}
            uid = cd.get("metadata", {}).get("uid", "")
            daemons = release.items("pods", release.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}") if uid else []
            workers = release.items("pods", release.workload_ns, f"job-name={JOB}")
            done = sum(p["status"].get("phase") == "Succeeded" for p in workers)
            ready = sum(any(c.get("ready") for c in p["status"].get("containerStatuses") or ()) for p in daemons)
            status = (cd.get("status") or {}).get("status", "-")
            line = f"IMEX daemon containers {ready}/{len(daemons)} ready | CD {status} | workers {done}/2 done"
            if line != last:
                say(f"   [{time.monotonic() - T0:5.1f}s] {line}")
                last = line
            if done == 2:
                break
            time.sleep(0.5)
        else:
            raise SystemExit(f"the job did not finish in time; node logs are in {nodes.root / 'logs'}")
        say(f"   both workers done {time.monotonic() - created:.1f}s after kubectl create")

        step("the IMEX daemons are real containers (containerd), Ready through their probe")
        for pod in daemons:
            status = pod["status"]["containerStatuses"][0]
            say(f"   {pod['metadata']['name']} on {pod['spec']['nodeName']}: {status['containerID'][:25]}... "
                f"ready={status['ready']}")  # fmt: skip
        step("kubectl logs of each worker: the channel device its container got")
        for pod in sorted(workers, key=lambda p: p["spec"]["nodeName"]):
            say(f"   $ kubectl logs {pod['metadata']['name']}   (on {pod['spec']['nodeName']})")
            say(indent(release.kubectl("logs", "-n", release.workload_ns, pod["metadata"]["name"]), "     "))

        step("cleanup: the job, the ComputeDomain, helm uninstall, the real nodes")
        release.kubectl("delete", "job", JOB, "-n", release.workload_ns, "--cascade=foreground", "--wait=true")
    finally:
        release.uninstall()
        nodes.down()
    step(f"done in {time.monotonic() - T0:.0f}s. The control plane keeps running (`make cluster-down` stops it).")
    say("   tests/cluster/realnode/ has the scenarios on real nodes; docs/design/0009-real-nodes.md explains them.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
