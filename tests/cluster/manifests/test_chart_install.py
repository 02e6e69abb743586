"""The chart against the real apiserver: install in both modes, the admission policies at work, and
`helm uninstall` tearing ComputeDomains down through its hooks before the controller goes."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.manifests.release import (
    HELM,
    SELECT_LABEL,
    bound_kubeconfig,
    helm,
    install_args,
    mark_succeeded,
    run_controller,
    run_like_pod,
    running_pod,
    wait_for,
)
from tests.conftest import REPO, Cluster, MakeNode

pytestmark = pytest.mark.cluster

HOST_MANAGED = ("resources.computeDomains.imex.mode=hostManaged", "featureGates.HostManagedIMEXDaemon=true")
DRIVER = "compute-domain.nvidia.com"


class Release:
    def __init__(self, cluster: Cluster, namespace: str, selector: str) -> None:
        self.cluster, self.namespace, self.selector = cluster, namespace, selector
        self.name = "cd"
        self.installed = False

    def install(self, *sets: str) -> None:
        self.installed = True  # a failed install leaves a failed release (and cluster-wide objects) to remove
        helm(self.cluster, *install_args(self.name, self.namespace, self.selector, *sets))

    def cluster_objects(self) -> list[str]:
        out = self.cluster.kubectl(
            "get", "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings",
            "-l", f"app.kubernetes.io/instance={self.name}", "-o", "name",
        )  # fmt: skip
        return [line for line in out.split() if f"-{self.namespace}-" in line]


@pytest.fixture
def release(cluster: Cluster, namespace: str, make_node: MakeNode) -> Iterator[Release]:
    selector = f"s{uuid.uuid4().hex[:10]}"
    make_node(labels={SELECT_LABEL: selector})
    r = Release(cluster, namespace, selector)
    yield r
    if r.installed:
        helm(cluster, "uninstall", r.name, "--namespace", namespace, "--no-hooks", "--wait", check=False)


def _names(cluster: Cluster, kind: str, namespace: str) -> set[str]:
    return set(cluster.kubectl("get", kind, "-n", namespace, "-o", "jsonpath={.items[*].metadata.name}").split())


@pytest.mark.parametrize("mode", ["driverManaged", "hostManaged"])
def test_install_creates_what_the_mode_needs(cluster: Cluster, release: Release, mode: str) -> None:
    release.install(*(HOST_MANAGED if mode == "hostManaged" else ()))
    ns = release.namespace
    assert _names(cluster, "deployments", ns) == {"cd-compute-domain-controller"}
    assert _names(cluster, "daemonsets", ns) == {"cd-compute-domain-kubelet-plugin"}
    accounts = _names(cluster, "serviceaccounts", ns) - {"default"}
    expected = {"cd-compute-domain-controller", "cd-compute-domain-kubelet-plugin"}
    if mode == "driverManaged":
        expected.add("compute-domain-daemon-service-account")
    assert accounts == expected
    deployment = cluster.get("deployment", "cd-compute-domain-controller", ns)
    assert deployment["spec"]["replicas"] == 2
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["IMEX_MODE"] == mode
    # Both controller replicas and the node agent run on the node labelled for this release (kwok).
    wait_for(
        lambda: cluster.get("deployment", "cd-compute-domain-controller", ns)["status"].get("readyReplicas") == 2,
        "controller replicas",
    )
    wait_for(
        lambda: cluster.get("daemonset", "cd-compute-domain-kubelet-plugin", ns)["status"].get("numberReady") == 1,
        "node agent",
    )
    # The ingress NetworkPolicies are taken by the apiserver and select exactly their component's running pods
    # (the test bed has no network plugin: nothing enforces them here).
    for component in ("controller", "kubelet-plugin"):
        policy = cluster.get("networkpolicy", f"cd-compute-domain-{component}-ingress", ns)
        selector = ",".join(f"{k}={v}" for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
        selected = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json"))["items"]
        components = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in selected}
        assert components == {component}, components
        assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    kinds = {line.split("/")[0] for line in release.cluster_objects()}
    assert kinds == {
        "clusterrole.rbac.authorization.k8s.io",
        "clusterrolebinding.rbac.authorization.k8s.io",
        "validatingadmissionpolicy.admissionregistration.k8s.io",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io",
    }
    # Nothing left behind (no ComputeDomains existed, so skipping the hooks is safe here).
    helm(cluster, "uninstall", release.name, "--namespace", ns, "--no-hooks", "--wait")
    release.installed = False
    assert release.cluster_objects() == []
    assert _names(cluster, "deployments,daemonsets,roles,rolebindings", ns) == set()


def _claim(domain_id: Any, **extra: Any) -> dict[str, Any]:
    params = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": domain_id}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"generateName": "claim-"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "channel", "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"}}
                ],
                "config": [{"requests": ["channel"], "opaque": {"driver": DRIVER, "parameters": {**params, **extra}}}],
            }
        },
    }


CLAIM_CONTROLLER = "--as=system:serviceaccount:kube-system:resource-claim-controller"


def test_admission_rejects_bad_opaque_configs_at_create(cluster: Cluster, release: Release) -> None:
    """As the creators the channel-claims policy lets through (the resourceclaim controller, the chart's
    controller for templates), so that what refuses is the opaque-config policy."""
    release.install()
    good = str(uuid.uuid4())
    ns = release.namespace

    def create(obj: dict[str, Any], user: str = CLAIM_CONTROLLER) -> tuple[int, str]:
        return cluster.try_kubectl("create", "-f", "-", "-o", "json", "-n", ns, user, input=json.dumps(obj))

    # The policy is active once the apiserver has loaded it; a bad claim may pass for a moment before.
    wait_for(lambda: create(_claim(good, bogus=1))[0] != 0, "policy active")
    for claim, field in [
        (_claim(good, allocationModes="All"), "unknown field 'allocationModes'"),
        (_claim("not-a-uuid"), "spec.devices.config[0].opaque.parameters.domainID"),
        (_claim(good.upper()), "canonical lower-case UUID"),
        (_claim(good, allocationMode="Many"), "spec.devices.config[0].opaque.parameters.allocationMode"),
        (_claim(good, apiVersion="resource.nvidia.com/v1"), "opaque.parameters.apiVersion"),
        (_claim(good, kind="ComputeDomainConfig"), "opaque.parameters.kind: unknown kind 'ComputeDomainConfig'"),
    ]:
        code, out = create(claim)
        assert code != 0 and field in out, out
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "bad"},
        "spec": {"spec": _claim("nope")["spec"]},
    }
    code, out = create(template, f"--as=system:serviceaccount:{ns}:{release.name}-compute-domain-controller")
    assert code != 0 and "spec.spec.devices.config[0].opaque.parameters.domainID" in out
    code, out = create(_claim(good, allocationMode="All"))
    assert code == 0, out


def _slice(node: str, driver: str = DRIVER) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{uuid.uuid4().hex[:6]}"},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}},
    }


def test_node_agent_writes_only_its_own_node(
    cluster: Cluster, release: Release, make_node: MakeNode, tmp_path: Path
) -> None:
    release.install()
    ns = release.namespace
    other = make_node()["metadata"]["name"]
    pod = wait_for(lambda: running_pod(cluster, ns, "app.kubernetes.io/component=kubelet-plugin"), "node agent pod")
    mine = pod["spec"]["nodeName"]
    # The node agent's real credentials: a token of its ServiceAccount bound to its pod, which carries the
    # pod's node name; the same as impersonating the account with that user extra.
    kubeconfig = bound_kubeconfig(
        cluster, ns, pod["spec"]["serviceAccountName"], pod["metadata"]["name"], tmp_path / "agent"
    )
    as_agent = ["--kubeconfig", str(kubeconfig)]
    impersonate = [f"--as=system:serviceaccount:{ns}:cd-compute-domain-kubelet-plugin"]
    with_node = [*impersonate, f"--as-user-extra=authentication.kubernetes.io/node-name={mine}"]

    def run(args: list[str], *cmd: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        if args is as_agent:
            result = subprocess.run(
                [str(REPO / ".cluster" / "bin" / "kubectl"), *args, *cmd], input=json.dumps(body) if body else None,
                capture_output=True, text=True,
            )  # fmt: skip
            return result.returncode, result.stdout + result.stderr
        return cluster.try_kubectl(*args, *cmd, input=json.dumps(body) if body else None)

    created = []
    try:
        for who in (as_agent, with_node):
            wait_for(lambda who=who: run(who, "create", "-f", "-", body=_slice(other))[0] != 0, "policy active")
            code, out = run(who, "create", "-f", "-", "-o", "name", body=_slice(mine))
            assert code == 0, out
            created.append(out.strip())
            code, out = run(who, "create", "-f", "-", body=_slice(other))
            assert code != 0 and f"may only write ResourceSlices of its own node, not {other}" in out, out
            code, out = run(who, "create", "-f", "-", body=_slice(mine, driver="gpu.nvidia.com"))
            assert code != 0 and "spec.driver" in out, out
            code, out = run(who, "label", "node", mine, "--overwrite", "nvidia.com/gpu.clique=probe.1")
            assert code == 0, out
            code, out = run(who, "label", "node", mine, "nvidia.com/gpu.clique-")
            assert code == 0, out
            # The CD label brings a domain's IMEX daemon: the controller's alone, even on the agent's own node.
            code, out = run(
                who, "label", "node", mine, "--overwrite", f"resource.nvidia.com/computeDomain={uuid.uuid4()}"
            )
            assert code != 0 and "metadata.labels" in out and "is the controller's" in out, out
            cluster.kubectl("label", "node", mine, f"resource.nvidia.com/computeDomain={uuid.uuid4()}")
            code, out = run(who, "label", "node", mine, "resource.nvidia.com/computeDomain-")
            assert code != 0 and "resource.nvidia.com/computeDomain" in out, out
            cluster.kubectl("label", "node", mine, "resource.nvidia.com/computeDomain-")
            code, out = run(who, "label", "node", other, "nvidia.com/gpu.clique=stolen.1")
            assert code != 0 and f"may only change its own Node, not {other}" in out, out
            code, out = run(who, "label", "node", mine, "--overwrite", "nvidia.com/gpu.present=false")
            assert code != 0 and "metadata.labels" in out and "nvidia.com/gpu.present" in out, out
            code, out = run(who, "annotate", "node", mine, "x=y")
            assert code != 0 and "annotations" in out, out
        # Credentials without a node name are refused outright.
        code, out = run(impersonate, "create", "-f", "-", body=_slice(mine))
        assert code != 0 and "name no node" in out, out
    finally:
        for name in created:
            cluster.kubectl("delete", name, check=False)


def _cd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
    }


def _run_hook(cluster: Cluster, ns: str, phase: str, tmp: Path, seen: dict[str, Any]) -> None:
    """Be the kubelet for the hook Job of `phase`: run its command here, then report it Succeeded."""
    pod = wait_for(
        lambda: running_pod(cluster, ns, f"batch.kubernetes.io/job-name=cd-compute-domain-uninstall-{phase}"),
        f"{phase} hook pod",
        timeout=120,
    )
    proc = run_like_pod(cluster, pod, "teardown", tmp)
    assert proc.wait(timeout=120) == 0, (tmp / f"{pod['metadata']['name']}.log").read_text()
    seen[phase] = {
        "deployments": _names(cluster, "deployments", ns),
        "log": (tmp / f"{pod['metadata']['name']}.log").read_text(),
    }
    mark_succeeded(cluster, pod)


def test_uninstall_tears_domains_down_before_the_controller(
    cluster: Cluster, release: Release, make_node: MakeNode, tmp_path: Path
) -> None:
    workloads = f"w-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", workloads)
    ns = release.namespace
    controller: subprocess.Popen[str] | None = None
    try:
        release.install(f"uninstall.namespaces={{{workloads}}}", "controller.replicas=1")
        pod = wait_for(lambda: running_pod(cluster, ns, "app.kubernetes.io/component=controller"), "controller pod")
        controller = run_controller(cluster, pod, tmp_path, workloads)
        cluster.apply(_cd("job"), workloads)
        wait_for(
            lambda: "job-channel" in _names(cluster, "resourceclaimtemplates", workloads),
            "workload template",
            timeout=60,
        )

        seen: dict[str, Any] = {}
        uninstall = subprocess.Popen(
            [str(HELM), "uninstall", release.name, "-n", ns, "--wait", "--timeout=180s"],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        _run_hook(cluster, ns, "pre-delete", tmp_path, seen)
        # The pre-delete hook finished only after the domain was gone, while the controller still existed.
        assert "no ComputeDomains left" in seen["pre-delete"]["log"]
        assert seen["pre-delete"]["deployments"] == {"cd-compute-domain-controller"}
        assert _names(cluster, "computedomains", workloads) == set()
        assert _names(cluster, "resourceclaimtemplates", workloads) == set()
        _run_hook(cluster, ns, "post-delete", tmp_path, seen)
        out, _ = uninstall.communicate(timeout=180)
        assert uninstall.returncode == 0, out
        release.installed = False
        assert seen["post-delete"]["deployments"] == set()  # post-delete ran after the release was gone
        # Nothing left: release objects, hook Jobs and their RBAC, children of the domain.
        assert release.cluster_objects() == []
        assert _names(cluster, "deployments,daemonsets,jobs,roles,rolebindings", ns) == set()
        assert _names(cluster, "serviceaccounts", ns) <= {"default"}
        assert _names(cluster, "resourceclaimtemplates", ns) == set()
    finally:
        if controller is not None:
            controller.terminate()
            controller.wait(timeout=30)
        cluster.kubectl("delete", "namespace", workloads, "--wait=false", check=False)
