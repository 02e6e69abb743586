"""Installing the chart into the test bed, and acting as the kubelet for the few pods these tests need to
run: a pod's command runs here with the pod's env and a token of its ServiceAccount bound to the pod (so
the apiserver sees the pod's real identity, node name included)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO, Cluster
from tests.testbed.reference import reference_crds

CHART = REPO / "manifests" / "helm" / "compute-domain"
HELM = REPO / ".cluster" / "bin" / "helm"
SELECT_LABEL = "compute-domain.test/chart"
CRDS = REPO / "manifests" / "crds"


def helm(cluster: Cluster, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HELM_CACHE_HOME": "/tmp/helm-cache"}
    result = subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {result.stderr}")
    return result


def install_args(release: str, namespace: str, selector: str, *sets: str) -> list[str]:
    """The shared cluster already has the DeviceClasses and current CRDs (tests/conftest.py) and other tests'
    GPU nodes: leave the DeviceClasses and CRDs alone (no CRD hook Job, whose pod nothing would run on a kwok
    node; the CRD test drives it itself) and put this release's pods only on nodes labelled for it."""
    base = [
        "resources.computeDomains.deviceClasses=false",
        "crds.upgrade=false",
        f"controller.nodeSelector.{SELECT_LABEL.replace('.', chr(92) + '.')}={selector}",
        f"kubeletPlugin.nodeSelector.{SELECT_LABEL.replace('.', chr(92) + '.')}={selector}",
    ]
    args = ["install", release, str(CHART), "--namespace", namespace]
    for item in [*base, *sets]:
        args += ["--set", item]
    return args


def bound_kubeconfig(cluster: Cluster, namespace: str, service_account: str, pod: str, path: Path) -> Path:
    """A kubeconfig holding only a token of `service_account` bound to `pod`."""
    token = cluster.kubectl(
        "create", "token", service_account, "-n", namespace, "--bound-object-kind=Pod",
        f"--bound-object-name={pod}", "--duration=1h",
    ).strip()  # fmt: skip
    return token_kubeconfig(cluster, token, namespace, path)


def token_kubeconfig(cluster: Cluster, token: str, namespace: str, path: Path) -> Path:
    """A kubeconfig for the test bed's apiserver holding only `token`."""
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = admin["clusters"][0]["cluster"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": server}],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
                "current-context": "c",
            }
        )
    )
    return path


def wait_for(predicate: Any, what: str, timeout: float = 60.0, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def running_pod(cluster: Cluster, namespace: str, selector: str) -> dict[str, Any] | None:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    return running[0] if running else None


def pod_env(pod: dict[str, Any], container: str) -> dict[str, str]:
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "status.podIP": pod.get("status", {}).get("podIP", ""),
    }
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    env = {}
    for item in c.get("env", []):
        source = item.get("valueFrom")  # an empty value comes back from the apiserver without "value"
        env[item["name"]] = fields[source["fieldRef"]["fieldPath"]] if source else item.get("value", "")
    return env


def local_argv(command: list[str]) -> list[str]:
    """The container's command with its `python` replaced by this interpreter (same packages)."""
    return [sys.executable if command[0] == "python" else command[0], *command[1:]]


def run_like_pod(
    cluster: Cluster, pod: dict[str, Any], container: str, tmp: Path, *, argv: list[str] | None = None
) -> subprocess.Popen[str]:
    """Start `container` of `pod` here: its command (or `argv`), its env, its ServiceAccount's bound token."""
    kubeconfig = bound_kubeconfig(
        cluster, pod["metadata"]["namespace"], pod["spec"]["serviceAccountName"], pod["metadata"]["name"],
        tmp / f"{pod['metadata']['name']}-{uuid.uuid4().hex[:6]}.kubeconfig",
    )  # fmt: skip
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    env = {**os.environ, **pod_env(pod, container), "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(REPO)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = (tmp / f"{pod['metadata']['name']}.log").open("w")
    return subprocess.Popen(
        argv or local_argv(c["command"]), env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )


# The real controller with the chart's env and its pod's identity, limited to the domains of one namespace
# (the cluster is shared); its RBAC is the chart's. Only its HTTP port is a free one: processes here share
# the machine's ports.
CONTROLLER_SCRIPT = (
    "import asyncio, os, sys\nos.environ['HTTP_ENDPOINT'] = '127.0.0.1:0'\n"
    "from computedomain.controller.app import main\nfrom computedomain.logs import configure_logging\n"
    "from computedomain.settings import ControllerSettings, load_settings\n"
    "s = load_settings(ControllerSettings)\nconfigure_logging(s)\n"
    "sys.exit(asyncio.run(main(s, cd_namespace=sys.argv[1])))\n"
)


def run_controller(cluster: Cluster, pod: dict[str, Any], tmp: Path, cd_namespace: str) -> subprocess.Popen[str]:
    """The controller container of `pod`, run here (see CONTROLLER_SCRIPT) for the domains of `cd_namespace`."""
    return run_like_pod(
        cluster, pod, "compute-domain", tmp, argv=[sys.executable, "-c", CONTROLLER_SCRIPT, cd_namespace]
    )


def mark_succeeded(cluster: Cluster, pod: dict[str, Any]) -> None:
    """Report the pod's containers as exited 0, as a kubelet would."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    statuses = [
        {
            "name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}},
        }
        for c in pod["spec"]["containers"]
    ]  # fmt: skip
    patch = {"status": {"phase": "Succeeded", "containerStatuses": statuses}}
    cluster.kubectl(
        "patch", "pod", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"], "--subresource=status",
        "--type=merge", "-p", json.dumps(patch),
    )  # fmt: skip


# --- CRDs left by the reference ---------------------------------------------------------------------------------


def chart_crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(CRDS.glob("*.yaml"))]


def replace_crd_spec(cluster: Cluster, crd: dict[str, Any]) -> None:
    """PUT the CRD with this spec, leaving its metadata alone (`kubectl replace -f` would rewrite the
    last-applied annotation that the session's `kubectl apply` of the CRDs relies on)."""
    name = crd["metadata"]["name"]
    current = cluster.get("crd", name)
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
    cluster.kubectl("replace", "--raw", path, "-f", "-", input=json.dumps({**current, "spec": crd["spec"]}))


@contextlib.contextmanager
def crds_as_the_reference_ships_them(cluster: Cluster) -> Iterator[None]:
    """The shared cluster's CRDs turned into the reference's (no status.conditions, short names or printer
    columns) for the block; the chart's again afterwards."""
    for crd in reference_crds(chart_crds()):
        replace_crd_spec(cluster, crd)
    try:
        yield
    finally:
        for crd in chart_crds():
            replace_crd_spec(cluster, crd)
