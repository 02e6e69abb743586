"""The chart on the real nodes: `helm install` of manifests/helm/compute-domain, unchanged, with values only.

    release = RealRelease(nodes, mode="driverManaged")
    release.install()     # node agents Ready on every real node, their ResourceSlices published
    ...                   # ComputeDomains and workloads in release.workload_ns
    release.uninstall()   # ComputeDomains torn down by the controller, helm uninstall (hooks), namespaces

The values are what any operator of such nodes would set: the driver root (`nvidiaDriverRoot`, the GPU
Operator's /run/nvidia/driver), the agent's `PROC_ROOT` inside it (the nodes' driver /proc files are fake),
node selectors that keep the release on the real nodes (kwok nodes of other tests carry the GPU labels too),
one controller replica (two cores), the uninstall hook limited to the workload namespace, and the mode. The
image is the one `tests.testbed.image` built and the nodes imported: the chart's default name and tag.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, DRIVER_NAME
from tests.testbed.realnode.nodes import DRIVER_ROOT, SET_LABEL, RealNodeError, RealNodes

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "manifests" / "helm" / "compute-domain"
INSTALL_TIMEOUT = 180.0


class RealRelease:
    def __init__(
        self, nodes: RealNodes, *, mode: str = "driverManaged", release: str = "", extra_values: Sequence[str] = ()
    ) -> None:
        assert nodes.state is not None, "start the real nodes first"
        self.nodes = nodes
        self.cluster = nodes.cluster
        self.mode = mode
        self.extra_values = list(extra_values)  # --set values after the test bed's own
        set_id = nodes.state.id
        # Cluster-scoped objects carry the release name: one of this node set's own.
        self.release = release or f"cd-{set_id}"
        self.driver_ns = f"{set_id}-{'host' if mode == 'hostManaged' else 'driver'}"
        self.workload_ns = f"{set_id}-work"
        self.installed = False
        self.install_s = 0.0

    # --- kubectl / helm ----------------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        result = self.cluster.kubectl(*args, check=False, input=input)
        if check and result.returncode != 0:
            raise RealNodeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def get(self, kind: str, name: str = "", namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, *([name] if name else []), "-o", "json", *(["-n", namespace] if namespace else [])]
        result = self.cluster.kubectl(*args, check=False)
        if result.returncode != 0:
            return None
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def items(self, kind: str, namespace: str | None = None, selector: str = "") -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json", *(["-n", namespace] if namespace else ["-A"])]
        if selector:
            args.append(f"-l={selector}")
        items: list[dict[str, Any]] = json.loads(self.kubectl(*args))["items"]
        return items

    def helm(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.cluster.root / "bin" / "helm"), f"--kubeconfig={self.cluster.kubeconfig}", *args],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if result.returncode != 0:
            raise RealNodeError(f"helm {' '.join(args[:2])} failed: {result.stderr.strip()}")
        return result.stdout

    # --- install -----------------------------------------------------------------------------------------

    def values(self) -> list[str]:
        assert self.nodes.state is not None
        selector = SET_LABEL.replace(".", "\\.")
        values = [
            f"nvidiaDriverRoot={DRIVER_ROOT}",
            "kubeletPlugin.containers.computeDomains.env[0].name=PROC_ROOT",
            "kubeletPlugin.containers.computeDomains.env[0].value=/driver-root/proc",
            f"kubeletPlugin.nodeSelector.{selector}={self.nodes.state.id}",
            f"controller.nodeSelector.{selector}={self.nodes.state.id}",
            "controller.replicas=1",
            f"uninstall.namespaces={{{self.workload_ns}}}",
        ]
        if self.get("deviceclass", CHANNEL_DEVICE_CLASS) is not None:
            values.append("resources.computeDomains.deviceClasses=false")
        if self.mode == "hostManaged":
            values += ["featureGates.HostManagedIMEXDaemon=true", "resources.computeDomains.imex.mode=hostManaged"]
        return values + self.extra_values

    def install(self) -> None:
        start = time.monotonic()
        self.kubectl("create", "namespace", self.workload_ns, check=False)
        args = ["install", self.release, str(CHART), "--namespace", self.driver_ns, "--create-namespace"]
        for value in self.values():
            args += ["--set", value]
        self.helm(*args)
        self.installed = True
        self.wait_installed()
        self.install_s = time.monotonic() - start

    def agent_pods(self) -> dict[str, dict[str, Any]]:
        """The running node agent pod of each real node."""
        pods = self.items("pods", self.driver_ns, "app.kubernetes.io/component=kubelet-plugin")
        return {p["spec"].get("nodeName", ""): p for p in pods if not p["metadata"].get("deletionTimestamp")}

    def wait_installed(self, within: float = INSTALL_TIMEOUT) -> None:
        deadline = time.monotonic() + within
        names = set(self.nodes.names)
        while time.monotonic() < deadline:
            pods = self.items("pods", self.driver_ns)
            ready = {
                (p["metadata"].get("labels", {}).get("app.kubernetes.io/component"), p["spec"].get("nodeName"))
                for p in pods
                if _ready(p)
            }
            agents = {node for component, node in ready if component == "kubelet-plugin"}
            controller = any(component == "controller" for component, _ in ready)
            slices = {
                s["spec"].get("nodeName")
                for s in self.items("resourceslices")
                if s["spec"].get("driver") == DRIVER_NAME and s["spec"].get("nodeName") in names
            }
            if agents == names and controller and slices == names:
                return
            time.sleep(1.0)
        raise RealNodeError(
            f"the release is not ready after {within:.0f}s:\n{self.kubectl('get', 'pods', '-o', 'wide', '-n', self.driver_ns)}"
        )

    # --- uninstall ---------------------------------------------------------------------------------------

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.kubectl("delete", "computedomains", "--all", "-n", self.workload_ns, "--wait=true", "--timeout=120s",
                     check=False)  # fmt: skip
        self.kubectl("delete", "pods", "--all", "-n", self.workload_ns, "--wait=true", "--timeout=60s", check=False)
        self.helm("uninstall", self.release, "--namespace", self.driver_ns, "--wait", "--timeout=180s")
        self.kubectl("delete", "namespace", self.workload_ns, self.driver_ns, "--wait=true", "--timeout=120s",
                     check=False)  # fmt: skip
        self.installed = False


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
