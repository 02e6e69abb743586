"""`make demo`: the local control plane with this service's CRDs and DeviceClasses installed, and a
ComputeDomain created from `manifests/examples/`, shown the way a user sees it."""

from __future__ import annotations

import sys

from tests.testbed.cluster import REPO, LocalCluster


def main() -> int:
    cluster = LocalCluster()
    cluster.up()

    def kubectl(*args: str) -> str:
        result = cluster.kubectl(*args, check=False)
        if result.returncode != 0:
            raise SystemExit(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    print("== installing the CRDs and DeviceClasses")
    print(kubectl("apply", "-f", str(REPO / "manifests" / "crds"), "-f", str(REPO / "manifests" / "deviceclasses")))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/computedomains.resource.nvidia.com")
    print("== a ComputeDomain, as a user creates it")
    print(kubectl("apply", "-n", "default", "-f", str(REPO / "manifests" / "examples" / "channel-injection.yaml")))
    print(kubectl("get", "computedomains", "-n", "default"))
    print("== the spec is immutable; a change is refused with the reason:")
    result = cluster.kubectl(
        "patch", "cd", "imex-demo", "-n", "default", "--type=merge", "-p", '{"spec":{"numNodes":3}}', check=False
    )
    print(result.stderr.strip())
    kubectl("delete", "-n", "default", "-f", str(REPO / "manifests" / "examples" / "channel-injection.yaml"))
    print(
        "\nThe cluster keeps running. Next:\n"
        "  export KUBECONFIG=.cluster/kubeconfig PATH=$PWD/.cluster/bin:$PATH\n"
        "  kubectl explain computedomain.spec\n"
        "  make test          # unit and cluster tests\n"
        "  make cluster-down  # stop the cluster\n"
        "The controller, node agent and IMEX daemons are not wired into the demo yet: status stays empty."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
