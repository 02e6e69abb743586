"""Least privilege, asserted on what the chart renders; and the admission policies' rules agree with the
code they stand in front of (the strict opaque-config decoder, the node agent's writes)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
import yaml

from computedomain.api.models import ComputeDomainChannelConfig, ComputeDomainDaemonConfig
from tests.unit.manifests.chart import CHART, HOST_MANAGED, REPO, Rendered, admission_policy, policy_variables, render

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)


def _rules(role: dict[str, Any]) -> set[Rule]:
    out = set()
    for rule in role.get("rules", []):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


def _grants(r: Rendered, component: str) -> set[Rule]:
    grants: set[Rule] = set()
    for kind in ("ClusterRole", "Role"):
        for role in r.all(kind):
            if role["metadata"]["labels"].get("app.kubernetes.io/component") == component:
                grants |= _rules(role)
    return grants


def _v(group: str, resource: str, *verbs: str) -> set[Rule]:
    return {(group, resource, v) for v in verbs}


READ = ("get", "list", "watch")

CONTROLLER = (
    _v("resource.nvidia.com", "computedomains", *READ, "patch")
    | _v("resource.nvidia.com", "computedomains/status", "update")
    | _v("resource.k8s.io", "resourceclaimtemplates", *READ, "create", "patch", "delete")
    | _v("", "nodes", *READ, "patch")
    | _v("", "events", "create", "patch")
    | _v("apps", "daemonsets", *READ, "create", "update", "patch", "delete")
    | _v("", "pods", *READ)
    | _v("resource.nvidia.com", "computedomaincliques", *READ, "update", "delete")
    | _v("coordination.k8s.io", "leases", "create", "get", "list", "watch", "update")
)
# driverManaged only: the daemons' per-domain NetworkPolicies, and the claims the CD node label follows.
NETWORK_POLICIES = _v("networking.k8s.io", "networkpolicies", *READ, "create", "delete")
CLAIMS = _v("resource.k8s.io", "resourceclaims", "list", "watch")
NODE_AGENT = (
    _v("resource.k8s.io", "resourceslices", *READ, "create", "update", "patch", "delete")
    | _v("resource.k8s.io", "resourceclaims", *READ)
    | _v("resource.nvidia.com", "computedomains", *READ)
    | _v("", "nodes", *READ, "patch")
    | _v("", "events", "create", "patch")
)
# driverManaged only, in the daemons' namespaces: cliques (readiness) and the daemon claims' owner check.
NODE_AGENT_DAEMONS = (
    _v("resource.nvidia.com", "computedomaincliques", *READ) | _v("", "pods", "get") | _v("apps", "daemonsets", "get")
)
DAEMON = _v("resource.nvidia.com", "computedomaincliques", *READ, "create", "update", "patch") | _v(
    "", "pods", *READ, "patch"
)


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render(hooks=True)


def test_exact_grants(default: Rendered) -> None:
    assert _grants(default, "controller") == CONTROLLER | NETWORK_POLICIES | CLAIMS
    assert _grants(render(*HOST_MANAGED), "controller") == CONTROLLER
    assert _grants(render("daemonNetworkPolicy.enabled=false"), "controller") == CONTROLLER | CLAIMS | (
        NETWORK_POLICIES - _v("networking.k8s.io", "networkpolicies", "create")
    )
    assert _grants(default, "kubelet-plugin") == NODE_AGENT | NODE_AGENT_DAEMONS
    assert _grants(default, "daemon") == DAEMON
    assert _grants(render(*HOST_MANAGED), "kubelet-plugin") == NODE_AGENT
    assert _grants(render(*HOST_MANAGED), "daemon") == set()
    legacy = render("featureGates.ComputeDomainCliques=false")
    assert _grants(legacy, "daemon") == DAEMON | _v("resource.nvidia.com", "computedomains", *READ) | _v(
        "resource.nvidia.com", "computedomains/status", "patch"
    )


def test_exact_grants_with_channel_isolation() -> None:
    """The records (the node agent creates and patches them; the controller also patches the channel in), the
    channel locks (Leases of the release namespace) and the claims (the controller verifies the records'
    entries against them); docs/security.md says what narrows each."""
    r = render(
        *HOST_MANAGED, "featureGates.IMEXChannelIsolation=true", "resources.computeDomains.imex.isolation=channel"
    )
    assert _grants(r, "controller") == CONTROLLER | _v("resource.nvidia.com", "computedomaincliques", "patch") | _v(
        "coordination.k8s.io", "leases", "delete"
    ) | _v("resource.k8s.io", "resourceclaims", "list", "watch")
    assert _grants(r, "kubelet-plugin") == NODE_AGENT | _v(
        "resource.nvidia.com", "computedomaincliques", *READ, "create", "patch"
    )


def test_no_wildcards_secrets_or_escalation(default: Rendered) -> None:
    for kind in ("ClusterRole", "Role"):
        for role in default.all(kind):
            for group, resource, verb in _rules(role):
                assert "*" not in (group, resource, verb), role["metadata"]["name"]
                assert resource not in ("secrets", "configmaps", "serviceaccounts/token")
                assert verb not in ("escalate", "bind", "impersonate", "deletecollection")


def test_namespaced_powers_stay_in_managed_namespaces(default: Rendered) -> None:
    """DaemonSets, pods and cliques only through Roles; cluster-wide only what lives in user namespaces."""
    for role in default.all("ClusterRole"):
        for _, resource, verb in _rules(role):
            assert resource not in ("daemonsets", "computedomaincliques", "leases"), role["metadata"]["name"]
            assert not (resource == "pods" and verb != "get"), role["metadata"]["name"]


def test_lease_update_only_for_its_own_lease(default: Rendered) -> None:
    role = default.one("Role", "compute-domain-controller-leader-election")
    by_verbs = {tuple(r["verbs"]): r.get("resourceNames") for r in role["rules"]}
    # list and watch (with a metadata.name field selector): a standby sees the release at once. The name is
    # the reference chart's Lease, so its controller and ours never both lead.
    assert by_verbs == {("create",): None, ("get", "list", "watch", "update"): ["dra-driver-nvidia-gpu-controller"]}
    role = render("controller.leaderElection.leaseName=mine").one("Role", "compute-domain-controller-leader-election")
    assert {tuple(r["verbs"]): r.get("resourceNames") for r in role["rules"]}[("get", "list", "watch", "update")] == [
        "mine"
    ]


def _hook_objects(r: Rendered, component: str) -> list[dict[str, Any]]:
    return [
        o
        for o in r.objects
        if "helm.sh/hook" in o["metadata"].get("annotations", {})
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


def test_uninstall_permissions_exist_only_during_hooks(default: Rendered) -> None:
    hook_objects = _hook_objects(default, "uninstall")
    assert {o["kind"] for o in hook_objects} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"}
    (role,) = [o for o in hook_objects if o["kind"] == "ClusterRole"]
    assert _rules(role) == _v("resource.nvidia.com", "computedomains", "list", "delete") | _v(
        "resource.k8s.io", "resourceslices", "list", "delete"
    )
    for o in hook_objects:
        annotations = o["metadata"]["annotations"]
        if o["kind"] != "Job":
            assert annotations["helm.sh/hook"] == "pre-delete,post-delete"
            assert int(annotations["helm.sh/hook-weight"]) < 0  # before the Jobs
        assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    jobs = {o["metadata"]["annotations"]["helm.sh/hook"]: o for o in hook_objects if o["kind"] == "Job"}
    assert set(jobs) == {"pre-delete", "post-delete"}
    assert jobs["pre-delete"]["spec"]["template"]["spec"]["containers"][0]["command"][3] == "pre-delete"
    assert "hook" not in str(render().objects)  # without hooks, nothing of them remains


def test_crd_hook_may_only_update_the_two_crds(default: Rendered) -> None:
    hook_objects = _hook_objects(default, "crds")
    assert {o["kind"] for o in hook_objects} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"}
    (role,) = [o for o in hook_objects if o["kind"] == "ClusterRole"]
    (rule,) = role["rules"]
    assert rule["verbs"] == ["get", "update"] and rule["resources"] == ["customresourcedefinitions"]
    assert sorted(rule["resourceNames"]) == [
        "computedomaincliques.resource.nvidia.com",
        "computedomains.resource.nvidia.com",
    ]
    for o in hook_objects:
        annotations = o["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"  # not on rollback
        assert (int(annotations["helm.sh/hook-weight"]) < 0) == (o["kind"] != "Job")
    (job,) = [o for o in hook_objects if o["kind"] == "Job"]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[3] == "--chart-version=" + yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    crds = [json.loads(arg) for arg in command[4:]]
    on_disk = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "manifests" / "crds").glob("*.yaml"))]
    assert crds == on_disk, "the Job applies exactly the chart's CRDs"
    assert not _hook_objects(render("crds.upgrade=false", hooks=True), "crds")


def test_node_agent_policy_covers_every_write_it_is_granted(default: Rendered) -> None:
    policy = admission_policy(default, "node-agent-own-node")
    (condition,) = policy["spec"]["matchConditions"]
    assert "system:serviceaccount:nvidia-compute-domain:compute-domain-kubelet-plugin" in condition["expression"]
    matched = {
        (group, resource, op)
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for op in rule["operations"]
    }
    verb_to_op = {"create": "CREATE", "update": "UPDATE", "patch": "UPDATE", "delete": "DELETE"}
    for group, resource, verb in _grants(default, "kubelet-plugin"):
        if verb in verb_to_op and resource not in ("events",):
            assert (group, resource, verb_to_op[verb]) in matched, (resource, verb)


def test_opaque_config_policy_agrees_with_the_decoder(default: Rendered) -> None:
    policy = admission_policy(default, "opaque-configs")
    assert {op for r in policy["spec"]["matchConstraints"]["resourceRules"] for op in r["operations"]} == {"CREATE"}
    variables = policy_variables(policy)
    for model in (ComputeDomainChannelConfig, ComputeDomainDaemonConfig):
        aliases = {f.alias or name for name, f in model.model_fields.items()}
        (listed,) = re.findall(rf"'{model.__name__}': \[([^\]]*)\]", variables["fields"])
        assert {s.strip(" '") for s in listed.split(",")} == aliases, model.__name__
    pattern = re.fullmatch(r"'(.*)'", variables["uuid"].strip())
    assert pattern
    samples = [str(uuid.uuid4()), str(uuid.uuid4()).upper(), "{" + str(uuid.uuid4()) + "}", str(uuid.uuid4().hex), "x"]
    for sample in samples:
        canonical = str(uuid.UUID(sample)) == sample if sample != "x" else False
        assert bool(re.fullmatch(pattern.group(1), sample)) == canonical, sample


def test_opaque_config_policy_can_be_turned_off() -> None:
    assert not [
        p
        for p in render("admission.validateOpaqueConfigs=false").all("ValidatingAdmissionPolicy")
        if "opaque" in p["metadata"]["name"]
    ]
