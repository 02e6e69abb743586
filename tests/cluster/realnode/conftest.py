"""Real-node scenarios: the chart on two real kubelets with containerd and runc (tests/testbed/realnode).

One pair of real nodes per session (`real_nodes`); each test module installs the chart once in its mode
(`tests.testbed.realnode.release.RealRelease`). What the tests assert is what a user sees: `kubectl logs` of
real containers, pod phases and Events, object status; and on the node what the kubelet leaves behind (CDI
files, the node agent's checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import Cluster
from tests.testbed.realnode.nodes import Node, RealNodes
from tests.testbed.realnode.release import RealRelease

IMAGE = "ghcr.io/computedomain/computedomain:0.1.0"
GV = "resource.nvidia.com/v1beta1"


@pytest.fixture(scope="session")
def real_nodes(cluster: Cluster) -> Iterator[RealNodes]:
    nodes = RealNodes(cluster.local, count=2)
    nodes.up()
    print(f"\nreal nodes: {nodes.timings}; memory {nodes.memory_mib()}")
    state = nodes.state
    assert state is not None
    try:
        yield nodes
    finally:
        print(f"\nreal nodes at the end: memory {nodes.memory_mib()}")
        nodes.down()
    # Teardown is exact: no process, cgroup, namespace (its holder), directory or Node object is left.
    assert RealNodes.leftovers(state) == []
    assert not [n for n in cluster.kubectl("get", "nodes", "-o", "name").split() if n.split("/")[-1] in
                {node.name for node in state.nodes}]  # fmt: skip


@contextlib.contextmanager
def installed(release: RealRelease, *, host_imex: bool = False) -> Iterator[RealRelease]:
    """``release`` installed for a module's tests, every node's host IMEX daemon started first when
    ``host_imex``; afterwards uninstalled, and whatever host daemons the tests left running stopped."""
    nodes = release.nodes
    try:
        if host_imex:
            for node in nodes.nodes:
                nodes.start_host_imex(node)
        release.install()
        yield release
    finally:
        release.uninstall()
        for node in nodes.nodes:
            nodes.stop_host_imex(node)


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 90.0, interval: float = 0.5) -> Any:
    """Poll a condition the cluster reaches on its own (no fake clock decides here: real kubelets do)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Scenario:
    """Objects of one test in the release's workload namespace, and what to read back."""

    def __init__(self, release: RealRelease) -> None:
        self.release = release
        self.ns = release.workload_ns
        self.suffix = uuid.uuid4().hex[:6]

    def name(self, base: str) -> str:
        return f"{base}-{self.suffix}"

    def compute_domain(self, name: str, *, num_nodes: int = 0, mode: str = "Single") -> str:
        self.release.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps({
            "apiVersion": GV, "kind": "ComputeDomain", "metadata": {"name": name},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"},
                                                         "allocationMode": mode}},
        }))  # fmt: skip
        return f"{name}-channel"

    def pod(self, name: str, node: str, template: str | None, command: str) -> None:
        spec: dict[str, Any] = {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{"name": "c", "image": IMAGE, "command": ["sh", "-c", command]}],
        }
        if template:
            spec["containers"][0]["resources"] = {"claims": [{"name": "channel"}]}
            spec["resourceClaims"] = [{"name": "channel", "resourceClaimTemplateName": template}]
        manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
        self.release.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(manifest))

    def get_pod(self, name: str) -> dict[str, Any] | None:
        return self.release.get("pod", name, self.ns)

    def phase(self, name: str) -> str:
        pod = self.get_pod(name)
        return str((pod or {}).get("status", {}).get("phase", "-"))

    def wait_running(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            pod = self.get_pod(name)
            return pod if pod and pod["status"].get("phase") == "Running" else None

        try:
            pod: dict[str, Any] = wait_for(running, f"pod {name} Running", timeout)
        except AssertionError:
            raise AssertionError(f"pod {name} not Running: {self.phase(name)}; events:\n{self.events(name)}") from None
        return pod

    def logs(self, name: str) -> str:
        return self.release.kubectl("logs", "-n", self.ns, name)

    def events(self, name: str) -> str:
        return self.release.kubectl(
            "get", "events", "-n", self.ns, f"--field-selector=involvedObject.name={name}",
            "-o", "custom-columns=REASON:.reason,MESSAGE:.message", "--sort-by=.lastTimestamp",
        )  # fmt: skip

    def claim_uid(self, pod_name: str) -> str:
        def uid() -> str | None:
            pod = self.get_pod(pod_name) or {}
            statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
            if not statuses or not statuses[0].get("resourceClaimName"):
                return None
            claim = self.release.get("resourceclaim", statuses[0]["resourceClaimName"], self.ns)
            return str(claim["metadata"]["uid"]) if claim else None

        value: str = wait_for(uid, f"the claim of pod {pod_name}")
        return value

    def delete(self, kind: str, *names: str) -> None:
        self.release.kubectl("delete", kind, *names, "-n", self.ns, "--wait=true", "--timeout=120s")

    def remove_leftovers(self) -> None:
        """What a test left in the namespace (it failed before its own deletes): its pods, then its domains,
        so that the next test finds the nodes free of them."""
        for kind in ("pods", "computedomains"):
            self.release.kubectl("delete", kind, "--all", "-n", self.ns, "--wait=true", "--timeout=120s",
                                 check=False)  # fmt: skip


def checkpoint_claims(node: Node) -> dict[str, dict[str, Any]]:
    path = node.kubelet_dir / "plugins" / "compute-domain.nvidia.com" / "checkpoint.json"
    try:
        claims: dict[str, dict[str, Any]] = json.loads(path.read_text()).get("claims") or {}
    except (OSError, ValueError):
        return {}
    return claims


def cdi_claim_files(node: Node) -> list[str]:
    return sorted(p.name for p in node.cdi_dir.glob("*claim_*.json"))


def live_state(node: Node, claim_uid: str) -> str | None:
    """The checkpoint state of a claim while it holds something (PrepareStarted/Completed); None when it is
    absent or only a tombstone remains."""
    entry = checkpoint_claims(node).get(claim_uid) or {}
    state = entry.get("state")
    return str(state) if state in ("PrepareStarted", "PrepareCompleted") else None
