"""A reference user's switch against the real apiserver: their values file installs this chart and the
installed objects are what it says; CRDs the reference left behind (no status.conditions, no short names, no
printer columns) are brought up to date by the chart's hook while the ComputeDomains stored under them stay
as they are."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from computedomain.settings import ControllerSettings, PluginSettings, load_settings
from tests.cluster.manifests.release import (
    CHART,
    HELM,
    SELECT_LABEL,
    chart_crds,
    crds_as_the_reference_ships_them,
    helm,
    install_args,
    mark_succeeded,
    pod_env,
    run_like_pod,
    running_pod,
    wait_for,
)
from tests.conftest import REPO, Cluster, MakeNode

pytestmark = pytest.mark.cluster

REFERENCE_VALUES = REPO / "manifests" / "examples" / "values-from-reference.yaml"
RELEASE = "cd"


@pytest.fixture
def node_selector(make_node: MakeNode) -> str:
    selector = f"s{uuid.uuid4().hex[:10]}"
    make_node(labels={SELECT_LABEL: selector})
    return selector


@pytest.fixture
def namespaces(cluster: Cluster) -> Iterator[dict[str, str]]:
    """The release's namespace, the objects' (namespaceOverride) and an old driver namespace."""
    names = {role: f"t-{role}-{uuid.uuid4().hex[:8]}" for role in ("release", "objects", "old")}
    for name in names.values():
        cluster.kubectl("create", "namespace", name)
    yield names
    helm(cluster, "uninstall", RELEASE, "-n", names["release"], "--no-hooks", "--wait", check=False)
    cluster.kubectl("delete", "namespace", *names.values(), "--wait=false", check=False)


def _reference_values(tmp: Path, ns: dict[str, str], selector: str) -> Path:
    """The example file as a reference user wrote it; only what makes it this test's own changes: its
    namespaces, and pods placed on this test's node (the shared cluster has other GPU nodes)."""
    values = yaml.safe_load(REFERENCE_VALUES.read_text())
    values["namespaceOverride"] = ns["objects"]
    (entry,) = [
        e for e in values["controller"]["containers"]["computeDomain"]["env"] if e["name"] == "ADDITIONAL_NAMESPACES"
    ]
    entry["value"] = ns["old"]
    for component in ("controller", "kubeletPlugin"):
        values[component]["nodeSelector"] = {SELECT_LABEL: selector}
    values["resources"]["computeDomains"]["deviceClasses"] = False  # the shared cluster has them
    values["crds"] = {"upgrade": False}  # the CRD test below drives the hook
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_reference_values_file_installs(
    cluster: Cluster, namespaces: dict[str, str], node_selector: str, tmp_path: Path
) -> None:
    values = _reference_values(tmp_path, namespaces, node_selector)
    helm(cluster, "install", RELEASE, str(CHART), "-n", namespaces["release"], "-f", str(values))
    ns = namespaces["objects"]
    out = cluster.kubectl("get", "all,sa,roles,rolebindings,networkpolicies", "-n", namespaces["release"], "-o", "name")
    assert out.split() == ["serviceaccount/default"], "namespaceOverride: nothing of ours in the release namespace"

    # The reference's names: pod label, container names, ServiceAccounts with their annotation.
    controller = wait_for(
        lambda: running_pod(cluster, ns, "dra-driver-nvidia-gpu-component=controller"), "controller pod Running"
    )
    agent = wait_for(
        lambda: running_pod(cluster, ns, "dra-driver-nvidia-gpu-component=kubelet-plugin"), "node agent pod Running"
    )
    assert [c["name"] for c in controller["spec"]["containers"]] == ["compute-domain"]
    assert [c["name"] for c in agent["spec"]["containers"]] == ["compute-domains"]
    assert controller["spec"]["serviceAccountName"] == "dra-driver-controller"
    assert agent["spec"]["serviceAccountName"] == "dra-driver-kubeletplugin"
    for name in ("dra-driver-controller", "dra-driver-kubeletplugin"):
        annotations = cluster.get("serviceaccount", name, ns)["metadata"]["annotations"]
        assert annotations["example.com/owner"] == "platform-team"
    for pod in (controller, agent):
        assert pod["spec"]["imagePullSecrets"] == [{"name": "nvcr-pull"}]
    assert controller["spec"]["securityContext"]["runAsUser"] == 1000
    # The reference's {privileged: true}: the chart's privileged context (root, read-only root filesystem).
    agent_context = agent["spec"]["containers"][0]["securityContext"]
    assert agent_context == {"privileged": True, "readOnlyRootFilesystem": True, "runAsUser": 0, "runAsGroup": 0}
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in agent["spec"]["volumes"]}
    assert volumes["driver-root"] == "/run/nvidia/driver"
    ds = cluster.get("daemonset", "cd-compute-domain-kubelet-plugin", ns)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1

    # What the processes read from the installed pods' env.
    settings = load_settings(ControllerSettings, environ=pod_env(controller, "compute-domain"))
    assert (settings.log_level, settings.daemon_log_level) == ("debug", "info")
    durations = (settings.leader_election_lease_duration, settings.leader_election_renew_deadline)
    assert (*durations, settings.leader_election_retry_period) == (30.0, 20.0, 5.0)
    assert settings.leader_election_name == "dra-driver-nvidia-gpu-controller"
    assert settings.managed_namespaces == (ns, namespaces["old"])
    assert settings.pull_secrets == ("nvcr-pull",) and settings.kube_api_qps == 10.0
    plugin = load_settings(PluginSettings, environ=pod_env(agent, "compute-domains"))
    assert plugin.driver_root == "/run/nvidia/driver" and plugin.log_level == "info"

    # The objects the apiserver accepted: NetworkPolicies, the daemons' identity in the old namespace.
    policies = cluster.kubectl("get", "networkpolicies", "-n", ns, "-o", "jsonpath={.items[*].metadata.name}")
    expected = {"cd-compute-domain-controller", "cd-compute-domain-kubelet-plugin"}
    assert set(policies.split()) == expected | {f"{name}-ingress" for name in expected}
    old = cluster.kubectl("get", "sa,roles,rolebindings", "-n", namespaces["old"], "-o", "name").split()
    assert "serviceaccount/compute-domain-daemon-service-account" in old
    assert "role.rbac.authorization.k8s.io/cd-compute-domain-controller" in old


# --- CRDs left by the reference ---------------------------------------------------------------------------------


def _condition_survives(cluster: Cluster, name: str, ns: str) -> bool:
    cd = cluster.get("computedomain", name, ns)
    condition = {
        "type": "Ready", "status": "False", "reason": "Probe", "message": "written by the test",
        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": cd["metadata"]["generation"],
    }  # fmt: skip
    cd["status"] = {"status": "NotReady", "conditions": [condition]}
    # Without strict field validation, as our controller writes (kubectl would refuse the unknown field).
    cluster.kubectl("replace", "--subresource=status", "--validate=false", "-f", "-", input=json.dumps(cd))
    return bool((cluster.get("computedomain", name, ns).get("status") or {}).get("conditions"))


@pytest.fixture
def reference_crds(cluster: Cluster) -> Iterator[None]:
    with crds_as_the_reference_ships_them(cluster):
        yield


def test_old_reference_crds_are_brought_up_to_date(
    cluster: Cluster, reference_crds: None, namespaces: dict[str, str], node_selector: str, tmp_path: Path
) -> None:
    ns = namespaces["release"]
    workloads = namespaces["objects"]
    cd = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "running"},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "running-channel"}}},
    }
    cluster.apply(cd, workloads)
    assert not _condition_survives(cluster, "running", workloads), "the old CRD prunes status.conditions"
    before = cluster.get("computedomain", "running", workloads)

    args = install_args(RELEASE, ns, node_selector, "crds.upgrade=true", "controller.replicas=1")
    install = subprocess.Popen(
        [str(HELM), *args, "--timeout=180s"],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Be the kubelet for the pre-install hook: its command, its ServiceAccount's token bound to its pod.
        pod = wait_for(
            lambda: running_pod(cluster, ns, f"batch.kubernetes.io/job-name={RELEASE}-compute-domain-crds"),
            "CRD hook pod",
            timeout=120,
        )
        # Before the hook has run, Helm has installed nothing else.
        assert cluster.kubectl("get", "deployments", "-n", ns, "-o", "name").split() == []
        proc = run_like_pod(cluster, pod, "crds", tmp_path)
        log = tmp_path / f"{pod['metadata']['name']}.log"
        assert proc.wait(timeout=120) == 0, log.read_text()
        mark_succeeded(cluster, pod)
        out, _ = install.communicate(timeout=180)
        assert install.returncode == 0, out
    finally:
        if install.poll() is None:
            install.kill()
    ours = next(c for c in chart_crds() if c["spec"]["names"]["kind"] == "ComputeDomain")
    columns = len(ours["spec"]["versions"][0].get("additionalPrinterColumns") or ())
    assert f"is current (short names cd, {columns} printer columns, status.conditions yes; was: short names none, " \
        "0 printer columns, status.conditions no)" in log.read_text()  # fmt: skip

    # The CRDs are the chart's now; the ComputeDomain stored under the old one is untouched.
    for crd in chart_crds():
        live = cluster.get("crd", crd["metadata"]["name"])["spec"]
        assert live["names"].get("shortNames") == crd["spec"]["names"].get("shortNames")
        for got, want in zip(live["versions"], crd["spec"]["versions"], strict=True):
            assert got.get("additionalPrinterColumns", []) == want.get("additionalPrinterColumns", [])
            assert got["schema"] == want["schema"]
    after = cluster.get("computedomain", "running", workloads)
    for field in ("uid", "resourceVersion", "generation", "finalizers"):
        assert after["metadata"].get(field) == before["metadata"].get(field), field
    assert after["spec"] == before["spec"]
    assert _condition_survives(cluster, "running", workloads), "status.conditions is kept now"
    # Short name and printer columns answer.
    table = cluster.kubectl("get", "cd", "running", "-n", workloads)
    assert table.split()[:3] == ["NAME", "STATUS", "NODES"], table
    # The hook's permissions went with it.
    assert set(cluster.kubectl("get", "jobs,serviceaccounts", "-n", ns, "-o", "name").split()) == {
        "serviceaccount/cd-compute-domain-controller",
        "serviceaccount/cd-compute-domain-kubelet-plugin",
        "serviceaccount/compute-domain-daemon-service-account",
        "serviceaccount/default",
    }
