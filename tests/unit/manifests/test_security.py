"""Least privilege and tenant isolation as the chart and the controller render them: each container's
security context, the driver root mounted read-only all the way down, the image's default user, and the
admission policies that keep tenants away from daemon devices and each daemon to its own objects.
docs/security.md explains every privilege that remains; the cluster tests prove the policies on a real
apiserver (tests/cluster/manifests/test_security.py)."""

from __future__ import annotations

import errno
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from computedomain import atomic
from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL, DAEMON_DEVICE_CLASS
from computedomain.controller import daemonset
from computedomain.controller.network_policy import network_policy
from imex import hosts_file
from tests.unit.controller.helpers import compute_domain, settings
from tests.unit.manifests.chart import (
    HOST_MANAGED,
    REPO,
    Rendered,
    admission_policy,
    container,
    policy_variables,
    render,
)

READ = ("get", "list", "watch")


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render(hooks=True)


def _pods(r: Rendered) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for obj in r.objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if pod:
            out.append((obj["metadata"]["name"], pod))
    return out


def _daemon_pod() -> dict[str, Any]:
    pod: dict[str, Any] = daemonset.daemonset(compute_domain(), settings())["spec"]["template"]["spec"]
    return pod


def test_every_container_is_confined(default: Rendered) -> None:
    """Read-only root, no privilege escalation, no capabilities, RuntimeDefault seccomp; the one exception
    (the node agent, privileged for NVML) is checked below."""
    pods = [*_pods(default), ("daemon", _daemon_pod())]
    assert {name for name, _ in pods} >= {
        "compute-domain-controller",
        "compute-domain-kubelet-plugin",
        "compute-domain-uninstall-pre-delete",
        "daemon",
    }
    for name, pod in pods:
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            if sc.get("privileged"):
                assert name == "compute-domain-kubelet-plugin"
                continue
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name


def test_root_only_where_needed(default: Rendered) -> None:
    """The image runs as 65532; the node agent and the daemon ask for root in their pod specs."""
    for name, pod in _pods(default):
        (c,) = pod["containers"]
        if name == "compute-domain-kubelet-plugin":
            assert c["securityContext"]["runAsUser"] == 0
        else:
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    (daemon,) = _daemon_pod()["containers"]
    assert daemon["securityContext"]["runAsUser"] == 0
    dockerfile = (REPO / "Dockerfile").read_text()
    final_stage = dockerfile.rsplit("\nFROM ", 1)[1]
    (user,) = re.findall(r"^USER (\S+)$", final_stage, re.MULTILINE)
    assert user == "65532:65532"


def test_daemon_gets_scratch_space_for_a_read_only_root() -> None:
    pod = _daemon_pod()
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"/tmp": "tmp", "/var/log": "var-log"}
    assert all("emptyDir" in volumes[n] for n in mounts.values())


def test_node_agent_without_privileges() -> None:
    for sets, added in [((), None), (HOST_MANAGED, ["SYS_CHROOT"])]:
        r = render("kubeletPlugin.containers.computeDomains.securityContext.privileged=false", *sets)
        c = container(r.one("DaemonSet", component="kubelet-plugin"), "compute-domains")
        sc = c["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"].get("add") == added and sc["capabilities"]["drop"] == ["ALL"]
    # Every other key of securityContext (the reference's) replaces the chart's, false included.
    r = render("kubeletPlugin.containers.computeDomains.securityContext.readOnlyRootFilesystem=false")
    sc = container(r.one("DaemonSet", component="kubelet-plugin"), "compute-domains")["securityContext"]
    assert sc == {"privileged": True, "readOnlyRootFilesystem": False, "runAsUser": 0, "runAsGroup": 0}


def test_driver_root_is_read_only_recursively(default: Rendered) -> None:
    c = container(default.one("DaemonSet", component="kubelet-plugin"), "compute-domains")
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "driver-root"]
    assert mount["readOnly"] is True and mount["recursiveReadOnly"] == "IfPossible"
    assert mount.get("mountPropagation", "None") == "None"  # recursive read-only needs it


def test_hosts_file_is_rewritten_in_place_under_a_read_only_root(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text("127.0.0.1\tlocalhost\n")
        monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
        entries = [hosts_file.HostEntry("10.0.0.1", "compute-domain-daemon-x-0000")]
        assert hosts_file.update_hosts_file(hosts, "cd", entries)
        assert "10.0.0.1\tcompute-domain-daemon-x-0000" in hosts.read_text()
        assert "localhost" in hosts.read_text()


def test_daemon_claims_policy_in_both_modes() -> None:
    for sets in ((), HOST_MANAGED):
        r = render("additionalNamespaces={old-driver}", *sets)
        policy = admission_policy(r, "daemon-claims")
        rules = policy["spec"]["matchConstraints"]["resourceRules"]
        assert {(res, op) for rule in rules for res in rule["resources"] for op in rule["operations"]} == {
            ("resourceclaims", "CREATE"),
            ("resourceclaimtemplates", "CREATE"),
        }
        variables = policy_variables(policy)
        assert variables["namespaces"].strip("'") == '["nvidia-compute-domain","old-driver"]'
        assert "system:serviceaccount:nvidia-compute-domain:compute-domain-controller" in variables["creators"]
        assert "system:serviceaccount:kube-system:resource-claim-controller" in variables["creators"]
        (condition,) = policy["spec"]["matchConditions"]
        assert DAEMON_DEVICE_CLASS in condition["expression"] and "ComputeDomainDaemonConfig" in condition["expression"]


DAEMON_NAMESPACES = ["nvidia-compute-domain", "old-driver"]


def test_daemon_identity_policy_covers_every_write_the_daemon_is_granted(default: Rendered) -> None:
    rendered = render("additionalNamespaces={old-driver}")
    # One set of checks, bound twice: pods and cliques in the daemons' namespaces, domains in every namespace.
    policy = admission_policy(rendered, "daemon-identity")
    status = admission_policy(rendered, "daemon-identity-status")
    assert {k: v for k, v in policy["spec"].items() if k != "matchConstraints"} == {
        k: v for k, v in status["spec"].items() if k != "matchConstraints"
    }
    (condition,) = policy["spec"]["matchConditions"]
    for ns in ("nvidia-compute-domain", "old-driver"):
        assert f"system:serviceaccount:{ns}:compute-domain-daemon-service-account" in condition["expression"]

    def matched(p: dict[str, Any], namespace: str | None) -> set[tuple[str, str, str]]:
        """What `p` matches of writes in `namespace` (None: in any namespace)."""
        selector = p["spec"]["matchConstraints"].get("namespaceSelector")
        if selector is not None:
            assert selector == {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": DAEMON_NAMESPACES}
                ]
            }
            if namespace is None or namespace not in DAEMON_NAMESPACES:
                return set()
        return {
            (group, resource, op)
            for rule in p["spec"]["matchConstraints"]["resourceRules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for op in rule["operations"]
        }

    verb_to_op = {"create": "CREATE", "update": "UPDATE", "patch": "UPDATE", "delete": "DELETE"}
    legacy = render("additionalNamespaces={old-driver}", "featureGates.ComputeDomainCliques=false")
    for r in (rendered, legacy):
        for kind in ("Role", "ClusterRole"):
            for role in r.all(kind):
                if role["metadata"]["labels"].get("app.kubernetes.io/component") != "daemon":
                    continue
                namespace = role["metadata"].get("namespace") if kind == "Role" else None
                covered = matched(policy, namespace) | matched(status, namespace)
                for rule in role["rules"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            for verb in rule["verbs"]:
                                if verb in verb_to_op:
                                    assert (group, resource, verb_to_op[verb]) in covered, (namespace, resource, verb)
    variables = policy_variables(policy)
    # The domain comes from the pod name the DaemonSet gives its pods: computedomain-daemon-<uid>-xxxxx.
    assert "computedomain-daemon-" in variables["domain"] and "substring(21, 57)" in variables["domain"]
    assert len(daemonset.daemonset(compute_domain(), settings())["metadata"]["name"]) == 57
    assert CLIQUE_LABEL in variables["cliqueLabel"]
    host = render(*HOST_MANAGED).all("ValidatingAdmissionPolicy")
    assert not [p for p in host if "daemon-identity" in p["metadata"]["name"]]  # no daemons in hostManaged


def test_node_agent_policy_checks_the_pool_name(default: Rendered) -> None:
    policy = admission_policy(default, "node-agent-own-node")
    assert any("spec.?pool.?name" in v["expression"] for v in policy["spec"]["validations"])


def test_daemon_pods_carry_the_label_the_network_policy_selects() -> None:
    cd = compute_domain()
    ds = daemonset.daemonset(cd, settings())
    policy = network_policy(cd, settings())
    labels = ds["spec"]["template"]["metadata"]["labels"]
    for selector in (policy["spec"]["podSelector"], policy["spec"]["ingress"][0]["from"][0]["podSelector"]):
        assert selector["matchLabels"].items() <= labels.items()
    assert labels[COMPUTE_DOMAIN_LABEL] == cd.uid


def test_ingress_policies_admit_only_the_monitoring_namespaces_to_the_metrics_port(default: Rendered) -> None:
    """On by default: each of the controller and the node agent gets an Ingress policy selecting exactly its
    own pods, whose one rule lets the monitoring namespaces reach the `metrics` port; the health port (the
    kubelet probes it from the node) and everything else get no rule."""
    workloads = {"controller": default.one("Deployment", component="controller"),
                 "kubelet-plugin": default.one("DaemonSet", component="kubelet-plugin")}  # fmt: skip
    for component, workload in workloads.items():
        policy = default.one("NetworkPolicy", f"compute-domain-{component}-ingress")
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
        others = [w for c, w in workloads.items() if c != component]
        assert not any(
            spec["podSelector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
            for w in others
        )
        (rule,) = spec["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
        (peer,) = rule["from"]
        assert peer == {"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}  # fmt: skip
        ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", ())}
        assert "metrics" in ports
    # The monitoring namespaces are a value; without any, or without the node agent's metrics, no port is open.
    r = render("ingressNetworkPolicy.monitoringNamespaces={prom,obs}", "kubeletPlugin.metrics.enabled=false")
    rule = r.one("NetworkPolicy", "compute-domain-controller-ingress")["spec"]["ingress"][0]
    assert rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["prom", "obs"]
    assert r.one("NetworkPolicy", "compute-domain-kubelet-plugin-ingress")["spec"]["ingress"] == []
    # ... and one key turns them off.
    off = render("ingressNetworkPolicy.enabled=false")
    assert not any(n.endswith("-ingress") for n in off.names("NetworkPolicy"))


def test_channel_claims_policy_in_both_modes() -> None:
    """Claims and templates of the channel classes: templates only from the controller, claims only from the
    resourceclaim controller (which makes them for a pod from its namespace's template)."""
    for sets in (
        (),
        (*HOST_MANAGED, "featureGates.IMEXChannelIsolation=true", "resources.computeDomains.imex.isolation=channel"),
    ):
        policy = admission_policy(render(*sets), "channel-claims")
        rules = policy["spec"]["matchConstraints"]["resourceRules"]
        assert {(res, op) for rule in rules for res in rule["resources"] for op in rule["operations"]} == {
            ("resourceclaims", "CREATE"),
            ("resourceclaimtemplates", "CREATE"),
        }
        variables = policy_variables(policy)
        assert "system:serviceaccount:nvidia-compute-domain:compute-domain-controller" in variables["creators"]
        assert "system:serviceaccount:kube-system:resource-claim-controller" in variables["creators"]
        (condition,) = policy["spec"]["matchConditions"]
        for channel_class in ("compute-domain-default-channel.nvidia.com", "compute-domain-channel.nvidia.com"):
            assert channel_class in condition["expression"] and channel_class in variables["classes"]


def test_hook_permissions_do_not_outlive_a_failed_hook(default: Rendered) -> None:
    """The hooks' ServiceAccounts, ClusterRoles and bindings (list/delete every ComputeDomain, update the
    CRDs) are deleted whatever the hook's outcome; only a failed Job (or the test pod) stays, for its logs."""
    hooks = [o for o in default.objects if "helm.sh/hook" in o["metadata"].get("annotations", {})]
    assert {o["kind"] for o in hooks} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"}
    for obj in hooks:
        policy = set(obj["metadata"]["annotations"]["helm.sh/hook-delete-policy"].split(","))
        assert ("hook-failed" in policy) == (obj["kind"] not in ("Job", "Pod")), (
            obj["kind"],
            obj["metadata"]["name"],
            policy,
        )
