"""Tenant isolation and least privilege on the real apiserver, with the chart installed as an operator would
(docs/security.md). Identities are real: a tenant with only namespaced rights and its own token; the daemon
and the node agent with tokens bound to their pods (so the apiserver adds the pod and node names the
admission policies read); the controller running as its pod with the chart's env and RBAC.

The local control plane has no network plugin, so nothing enforces NetworkPolicies here: their test checks
the objects the controller makes and that their selectors pick exactly the domain's daemon pods.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL, DAEMON_DEVICE_CLASS, DRIVER_NAME
from tests.cluster.claims import allocated_claim
from tests.cluster.manifests import rbac_table
from tests.cluster.manifests.release import (
    SELECT_LABEL,
    bound_kubeconfig,
    helm,
    install_args,
    run_controller,
    running_pod,
    token_kubeconfig,
    wait_for,
)
from tests.conftest import REPO, Cluster
from tests.testbed.nodes import gb200_node

pytestmark = pytest.mark.cluster

KUBECTL = REPO / ".cluster" / "bin" / "kubectl"
RELEASE = "compute-domain"  # the chart's default names: compute-domain-controller, ...
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
DAEMON_SA = "compute-domain-daemon-service-account"
LEASE = "dra-driver-nvidia-gpu-controller"  # the reference chart's Lease name, the default


@dataclass
class Installed:
    cluster: Cluster
    ns: str  # release namespace
    extra_ns: str  # additionalNamespaces
    tenant_ns: str
    workload_ns: str  # where this module's ComputeDomains live
    node: str
    tmp: Path

    def user(self, sa: str, ns: str | None = None) -> str:
        return f"system:serviceaccount:{ns or self.ns}:{sa}"


def _kubectl(kubeconfig: Path | str, *args: str, body: Any = None) -> tuple[int, str]:
    result = subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(kubeconfig), *args],
        input=json.dumps(body) if body is not None else None, capture_output=True, text=True,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def installed(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    suffix = uuid.uuid4().hex[:8]
    names = [f"sec-{suffix}", f"secadd-{suffix}", f"tenant-{suffix}", f"secw-{suffix}"]
    for name in names:
        cluster.kubectl("create", "namespace", name)
    selector = f"s{suffix}"
    node = gb200_node(f"sec-{suffix}", labels={SELECT_LABEL: selector})
    cluster.apply(node)
    ns, extra = names[0], names[1]
    helm(
        cluster,
        *install_args(RELEASE, ns, selector, f"additionalNamespaces={{{extra}}}", "controller.replicas=1"),
    )
    try:
        yield Installed(
            cluster, ns, extra, names[2], names[3], node["metadata"]["name"], tmp_path_factory.mktemp("sec")
        )
    finally:
        helm(cluster, "uninstall", RELEASE, "--namespace", ns, "--no-hooks", "--wait", check=False)
        _drop_finalizers(cluster, names)
        # Pods this module made by hand on its node: gone before the node, so nothing waits for a kubelet.
        cluster.kubectl("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", check=False)
        cluster.kubectl("delete", "namespace", *names, "--wait=false", check=False)
        cluster.kubectl("delete", "node", node["metadata"]["name"], "--wait=false", check=False)


def _create_cd(c: Cluster, namespace: str, name: str, num_nodes: int = 0) -> str:
    """A ComputeDomain; its UID."""
    c.apply(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
        }
    )
    return str(c.get("computedomain", name, namespace)["metadata"]["uid"])


def _drop_finalizers(cluster: Cluster, namespaces: list[str]) -> None:
    """What a failed test may leave behind with our finalizer and no controller to remove it."""
    for ns in namespaces:
        for kind in ("computedomains", "daemonsets", "resourceclaimtemplates"):
            for name in cluster.kubectl("get", kind, "-n", ns, "-o", "name", check=False).split():
                cluster.kubectl(
                    "patch", name, "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
                )


# --- tenants and the daemon device ---------------------------------------------------------------


def _claim(kind: str, request: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [request]}
    if params is not None:
        devices["config"] = [{"requests": [request["name"]], "opaque": {"driver": DRIVER_NAME, "parameters": params}}]
    spec = {"devices": devices}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"generateName": "steal-"}
        if kind == "ResourceClaim"
        else {"name": f"steal-{uuid.uuid4().hex[:6]}"},
        "spec": spec if kind == "ResourceClaim" else {"spec": spec},
    }


def _in_version(body: dict[str, Any], version: str) -> dict[str, Any]:
    """`body` (a v1 claim or template of `_claim`) as `version` sends it: v1beta2 has v1's shape, v1beta1 puts
    an exact request's fields beside its name (no `exactly`)."""
    out = json.loads(json.dumps(body))
    out["apiVersion"] = f"resource.k8s.io/{version}"
    if version == "v1beta1":
        spec = out["spec"] if out["kind"] == "ResourceClaim" else out["spec"]["spec"]
        spec["devices"]["requests"] = [{"name": r["name"], **r.get("exactly", {}), **{k: v for k, v in r.items() if k not in ("name", "exactly")}} for r in spec["devices"]["requests"]]  # fmt: skip
    return out


def _params(kind: str, domain: str) -> dict[str, Any]:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "domainID": domain}


def _tenant_kubeconfig(s: Installed) -> Path:
    """A ServiceAccount of the tenant namespace that may create claims, templates and pods there, nothing else."""
    c, ns = s.cluster, s.tenant_ns
    c.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": ns}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "tenant", "namespace": ns},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims", "resourceclaimtemplates"],
                        "verbs": ["get", "list", "create", "delete"],
                    },
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]},
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "tenant", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
                "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}],
            },
        ]
    )
    token = c.kubectl("create", "token", "tenant", "-n", ns, "--duration=1h").strip()
    return token_kubeconfig(c, token, ns, s.tmp / "tenant.kubeconfig")


def test_tenant_cannot_claim_a_daemon_device(installed: Installed) -> None:
    s, c = installed, installed.cluster
    # The victim: a ComputeDomain of another team; the tenant learnt its UID.
    victim = _create_cd(c, s.workload_ns, "victim")
    tenant = _tenant_kubeconfig(s)
    daemon_request = {"name": "daemon", "exactly": {"deviceClassName": DAEMON_DEVICE_CLASS}}
    subrequests = {
        "name": "any",
        "firstAvailable": [
            {"name": "gpu", "deviceClassName": "gpu.example.com"},
            {"name": "imex", "deviceClassName": DAEMON_DEVICE_CLASS},
        ],
    }
    daemon_config = _params("ComputeDomainDaemonConfig", victim)
    reserved = f"reserved for the ComputeDomain daemon pods in namespace {s.ns}, {s.extra_ns}"

    other_request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}
    # The tenant's identity works: a claim of another driver's class passes.
    code, out = _kubectl(tenant, "create", "-f", "-", "-o", "name", body=_claim("ResourceClaim", other_request, None))
    assert code == 0, out
    attacks = [
        ("ResourceClaim", daemon_request, daemon_config, "spec.devices.requests[0]"),
        ("ResourceClaim", daemon_request, None, "spec.devices.requests[0]"),
        ("ResourceClaimTemplate", daemon_request, daemon_config, "spec.spec.devices.requests[0]"),
        ("ResourceClaim", subrequests, None, "spec.devices.requests[0]"),
        # Another class (or a CEL selector) cannot avoid the config the node agent needs to prepare it.
        ("ResourceClaim", other_request, daemon_config, "spec.devices.config[0].opaque.parameters.kind"),
    ]
    wait_for(lambda: _kubectl(tenant, "create", "-f", "-", body=_claim(*attacks[0][:3]))[0] != 0, "policy active")
    for kind, request, params, field in attacks:
        code, out = _kubectl(tenant, "create", "-f", "-", body=_claim(kind, request, params))
        assert code != 0 and f"{field}: the IMEX daemon device" in out and reserved in out, out
        assert "forbidden" in out.lower()
    # The beta versions the apiserver serves are judged as v1 (matchPolicy Equivalent), v1beta1's shape
    # without `exactly` included.
    for version in ("v1beta1", "v1beta2"):
        for kind, request, params, field in attacks[:4]:
            code, out = _kubectl(tenant, "create", "-f", "-", body=_in_version(_claim(kind, request, params), version))
            assert code != 0 and f"{field}: the IMEX daemon device" in out and reserved in out, (version, out)
    code, out = _kubectl(
        tenant, "create", "-f", "-", body=_in_version(_claim("ResourceClaim", other_request, None), "v1beta1")
    )
    assert code == 0, out  # the conversion itself refuses nothing
    # Not even a cluster admin may make daemon claims by hand in the daemons' namespace ...
    code, out = c.create(_claim("ResourceClaim", daemon_request, daemon_config), s.ns)
    assert code != 0 and "may create ResourceClaims for the IMEX daemon device, not " in out, out
    # ... while the controller's own template and the claims Kubernetes makes from it for a pod pass.
    template = _claim("ResourceClaimTemplate", daemon_request, daemon_config)
    template["metadata"]["name"] = f"computedomain-daemon-{victim}"
    as_controller = [f"--as={s.user('compute-domain-controller')}", "--as-group=system:serviceaccounts"]
    code, out = c.try_kubectl("create", "-n", s.ns, "-f", "-", *as_controller, input=json.dumps(template))
    assert code == 0, out
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"daemon-{uuid.uuid4().hex[:6]}", "namespace": s.ns},
        "spec": {
            "nodeSelector": {"compute-domain.test/nowhere": "x"},
            "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "d"}]}}],
            "resourceClaims": [{"name": "d", "resourceClaimTemplateName": template["metadata"]["name"]}],
        },
    }
    c.apply(pod)

    def generated() -> str | None:
        statuses = c.get("pod", pod["metadata"]["name"], s.ns).get("status", {}).get("resourceClaimStatuses") or []
        return statuses[0].get("resourceClaimName") if statuses else None

    claim = wait_for(generated, "the resourceclaim controller's claim for the daemon pod")
    assert c.get("resourceclaim", claim, s.ns)["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == (
        DAEMON_DEVICE_CLASS
    )
    c.kubectl("delete", "pod", pod["metadata"]["name"], "-n", s.ns, "--wait=false")


def test_tenant_cannot_hold_a_channel_device_without_a_domain(installed: Installed) -> None:
    """A bare claim of a channel class would keep a node's channel device allocated (no domain's pod fits
    there) for as long as its pod exists: refused at create for everyone but the resourceclaim controller,
    which makes claims only from a pod's template, and channel templates come only from the controller."""
    s, c = installed, installed.cluster
    domain = _create_cd(c, s.workload_ns, "channel-owner")
    tenant = _tenant_kubeconfig(s)
    config = _params("ComputeDomainChannelConfig", domain)
    rule = "IMEX channel devices are only for the pods of a ComputeDomain"
    channel = {"name": "channel", "exactly": {"deviceClassName": CHANNEL_CLASS}}
    isolated = {"name": "channel", "exactly": {"deviceClassName": "compute-domain-channel.nvidia.com"}}
    fallback = {"name": "any", "firstAvailable": [{"name": "c", "deviceClassName": CHANNEL_CLASS}]}
    attacks = [
        ("ResourceClaim", channel, config, "spec.devices.requests[0]"),
        ("ResourceClaim", channel, None, "spec.devices.requests[0]"),
        ("ResourceClaim", isolated, None, "spec.devices.requests[0]"),
        ("ResourceClaim", fallback, None, "spec.devices.requests[0]"),
        ("ResourceClaimTemplate", channel, config, "spec.spec.devices.requests[0]"),
    ]
    wait_for(lambda: _kubectl(tenant, "create", "-f", "-", body=_claim(*attacks[0][:3]))[0] != 0, "policy active")
    for kind, request, params, field in attacks:
        code, out = _kubectl(tenant, "create", "-f", "-", body=_claim(kind, request, params))
        assert code != 0 and f"{field}: {rule}" in out and "forbidden" in out.lower(), out
        for version in ("v1beta1", "v1beta2"):
            code, out = _kubectl(tenant, "create", "-f", "-", body=_in_version(_claim(kind, request, params), version))
            assert code != 0 and f"{field}: {rule}" in out, (version, out)
    # Not even a cluster admin, in the domain's own namespace ...
    code, out = c.create(_claim("ResourceClaim", channel, config), s.workload_ns)
    assert code != 0 and rule in out and "may create ResourceClaims of a channel DeviceClass, not " in out, out
    # ... while the domain's own template (the controller made it) and the claims Kubernetes makes from it
    # for a pod of that namespace pass.
    template = _claim("ResourceClaimTemplate", channel, config)
    as_controller = [f"--as={s.user('compute-domain-controller')}", "--as-group=system:serviceaccounts"]
    code, out = c.try_kubectl("create", "-n", s.tenant_ns, "-f", "-", *as_controller, input=json.dumps(template))
    assert code == 0, out
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"worker-{uuid.uuid4().hex[:6]}", "namespace": s.tenant_ns},
        "spec": {
            "nodeSelector": {"compute-domain.test/nowhere": "x"},
            "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "ch"}]}}],
            "resourceClaims": [{"name": "ch", "resourceClaimTemplateName": template["metadata"]["name"]}],
        },
    }
    code, out = _kubectl(tenant, "create", "-f", "-", body=pod)
    assert code == 0, out

    def generated() -> str | None:
        got = c.get("pod", pod["metadata"]["name"], s.tenant_ns)
        statuses = got.get("status", {}).get("resourceClaimStatuses") or []
        return statuses[0].get("resourceClaimName") if statuses else None

    claim = wait_for(generated, "the resourceclaim controller's claim for the worker pod")
    exactly = c.get("resourceclaim", claim, s.tenant_ns)["spec"]["devices"]["requests"][0]["exactly"]
    assert {k: exactly[k] for k in channel["exactly"]} == channel["exactly"]  # the apiserver adds its defaults
    c.kubectl("delete", "pod", pod["metadata"]["name"], "-n", s.tenant_ns, "--wait=false")


def _deep_template(name: str, parameters: str) -> str:
    """A ResourceClaimTemplate labelled like a ComputeDomain's child, with opaque parameters as given (raw
    JSON text) for another driver, so no policy of ours looks inside them."""
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "labels": {COMPUTE_DOMAIN_LABEL: str(uuid.uuid4())}},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.example.com", "parameters": "@P@"}}],
        }}},
    }  # fmt: skip
    return json.dumps(template).replace('"@P@"', parameters)


def test_a_hostile_template_costs_only_itself(installed: Installed) -> None:
    """Opaque parameters nested as deep as the apiserver stores them (it bounds their size, 10,240 bytes, not
    their depth: `{"a":`, 5,116 `[`, `11` and the closing brackets are 10,240 bytes and 5,117 levels) in a labelled template of a tenant. The controller's
    template cache skips it with an Event naming the field and the limit, and every other domain converges.
    The chart's admission policies are on: they let it in (its driver is not ours)."""
    s, c = installed, installed.cluster
    tenant = _tenant_kubeconfig(s)

    def params(levels: int, pad: int = 0) -> str:
        return '{"a":' + "[" * (levels - 1) + "1" * (1 + pad) + "]" * (levels - 1) + "}"

    assert len(params(5117, pad=1)) == 10_240  # 5,118 levels would take 10,241 bytes
    result = subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(tenant), "create", "-f", "-"],
        input=_deep_template("deep-one-byte-more", params(5117, pad=2)), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "may not be more than 10240 bytes" in result.stderr, result.stderr
    result = subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(tenant), "create", "-f", "-", "-o", "jsonpath={.metadata.uid}"],
        input=_deep_template("deep", params(5117, pad=1)), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    hostile_uid = result.stdout.strip()
    pod = wait_for(lambda: running_pod(c, s.ns, "app.kubernetes.io/component=controller"), "controller pod")
    controller = run_controller(c, pod, s.tmp, s.workload_ns)
    try:
        _create_cd(c, s.workload_ns, "steady")

        def ready() -> bool:
            cd = c.get("computedomain", "steady", s.workload_ns)
            return (cd.get("status") or {}).get("status") == "Ready"

        wait_for(ready, "the other domain Ready", timeout=60)

        def told() -> dict[str, Any] | None:
            out = c.kubectl(
                "get", "events", "-n", s.tenant_ns, "--field-selector", "involvedObject.name=deep", "-o", "json"
            )
            events = [e for e in json.loads(out)["items"] if e["reason"] == "ObjectSkipped"]
            return events[0] if events else None

        event = wait_for(told, "the Event on the hostile template")
        assert event["type"] == "Warning" and event["involvedObject"]["uid"] == hostile_uid
        assert event["involvedObject"]["kind"] == "ResourceClaimTemplate"
        message = event["message"]
        assert message.startswith("computedomain-controller skips this ResourceClaimTemplate until it changes:")
        assert "spec.spec.devices.config[0].opaque.parameters.a[0][0]" in message, message
        assert "is nested 5124 levels deep; the limit is 200 levels" in message, message
    finally:
        c.kubectl("delete", "computedomain", "steady", "-n", s.workload_ns, "--wait=false", check=False)
        wait_for(
            lambda: not c.kubectl("get", "computedomain", "steady", "-n", s.workload_ns, "--ignore-not-found", "-o", "name").strip(),
            "the domain torn down",
            timeout=60,
        )  # fmt: skip
        controller.terminate()
        controller.wait(timeout=30)
        c.kubectl("delete", "resourceclaimtemplate", "deep", "-n", s.tenant_ns, check=False)


# --- each daemon only writes its own objects --------------------------------------------------------


def _daemon_pod(s: Installed, domain: str) -> dict[str, Any]:
    name = f"computedomain-daemon-{domain}-{uuid.uuid4().hex[:5]}"
    s.cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": s.ns, "labels": {COMPUTE_DOMAIN_LABEL: domain}},
            "spec": {"serviceAccountName": DAEMON_SA, "nodeName": s.node, "containers": [{"name": "c", "image": "x"}]},
        }
    )
    return s.cluster.get("pod", name, s.ns)


def _clique(domain: str, pod: dict[str, Any], *entries: tuple[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainClique",
        "metadata": {
            "name": f"{domain}.c1",
            "labels": {COMPUTE_DOMAIN_LABEL: domain, CLIQUE_LABEL: "c1"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
            ],
        },
        "daemons": [
            {"nodeName": node, "ipAddress": ip, "cliqueID": "c1", "index": i, "status": "NotReady"}
            for i, (node, ip) in enumerate(entries)
        ],
    }


def test_daemon_writes_only_its_own_pod_and_entry(installed: Installed) -> None:
    s, c = installed, installed.cluster
    mine, theirs = str(uuid.uuid4()), str(uuid.uuid4())
    pod = _daemon_pod(s, mine)
    other = _daemon_pod(s, theirs)
    kubeconfig = bound_kubeconfig(c, s.ns, DAEMON_SA, pod["metadata"]["name"], s.tmp / "daemon.kubeconfig")
    config = yaml.safe_load(kubeconfig.read_text())

    def run(*args: str, body: Any = None) -> tuple[int, str]:
        return _kubectl(kubeconfig, "-n", s.ns, *args, body=body)

    def replace(name: str, change: Any) -> tuple[int, str]:
        obj = c.get("computedomainclique", name, s.ns)
        change(obj)
        return run("replace", "-f", "-", body=obj)

    # What the daemon does: label its own pod with its clique, register its entry, update it.
    wait_for(lambda: run("label", "pod", other["metadata"]["name"], f"{CLIQUE_LABEL}=c1")[0] != 0, "policy active")
    code, out = run("label", "pod", pod["metadata"]["name"], f"{CLIQUE_LABEL}=c1")
    assert code == 0, out
    code, out = run("create", "-f", "-", body=_clique(mine, pod, (s.node, "10.1.0.1")))
    assert code == 0, out
    c.kubectl(
        "patch", "computedomainclique", f"{mine}.c1", "-n", s.ns, "--type=json",
        "-p", json.dumps([{"op": "add", "path": "/daemons/-", "value": {"nodeName": "peer", "ipAddress": "10.1.0.2", "cliqueID": "c1", "index": 1}}]),
    )  # fmt: skip
    code, out = replace(f"{mine}.c1", lambda o: o["daemons"][0].update(status="Ready"))
    assert code == 0, out

    refused = [
        (run("label", "pod", other["metadata"]["name"], f"{CLIQUE_LABEL}=c1"), "may only update its own pod"),
        (run("label", "pod", pod["metadata"]["name"], "evil=1"), "may only set the label"),
        (run("annotate", "pod", pod["metadata"]["name"], "evil=1"), "may only set the label"),
        (run("create", "-f", "-", body=_clique(theirs, pod, (s.node, "10.1.0.1"))), f"not CREATE {theirs}.c1"),
        (replace(f"{mine}.c1", lambda o: o["daemons"][1].update(ipAddress="10.6.6.6")), "not of peer"),
        (replace(f"{mine}.c1", lambda o: o["daemons"].pop(1)), "not of peer"),
        (replace(f"{mine}.c1", lambda o: o["daemons"][0].update(ipAddress="not-an-ip")), "ipAddress"),
        (
            replace(
                f"{mine}.c1",
                lambda o: o["metadata"]["ownerReferences"].append(
                    {"apiVersion": "v1", "kind": "Pod", "name": "x", "uid": str(uuid.uuid4())}
                ),
            ),
            "may only add its own pod",
        ),
        (
            replace(f"{mine}.c1", lambda o: o["metadata"]["labels"].update({COMPUTE_DOMAIN_LABEL: theirs})),
            "metadata.labels",
        ),
        (run("delete", "computedomainclique", f"{mine}.c1"), "cannot delete"),  # RBAC
    ]
    for (code, out), why in refused:
        assert code != 0 and why in out, out
    # A token of the daemon's ServiceAccount that is not bound to a pod names no pod: refused outright.
    unbound = s.tmp / "unbound.kubeconfig"
    config["users"][0]["user"]["token"] = c.kubectl("create", "token", DAEMON_SA, "-n", s.ns).strip()
    unbound.write_text(yaml.safe_dump(config))
    code, out = _kubectl(
        unbound, "-n", s.ns, "label", "pod", pod["metadata"]["name"], "--overwrite", f"{CLIQUE_LABEL}=c2"
    )
    assert code != 0 and "name no pod and node" in out, out


def test_legacy_daemon_writes_only_its_own_status_entry(installed: Installed) -> None:
    """ComputeDomainCliques=false: daemons write their domain's status.nodes. The policy's rules, with RBAC
    out of the way (a group that may do anything), so only the policy decides."""
    s, c = installed, installed.cluster
    mine, _ = (_create_cd(c, s.workload_ns, name, num_nodes=2) for name in ("legacy-mine", "legacy-theirs"))
    pod = _daemon_pod(s, mine)
    who = [
        f"--as={s.user(DAEMON_SA)}",
        "--as-group=system:masters",
        f"--as-user-extra=authentication.kubernetes.io/pod-name={pod['metadata']['name']}",
        f"--as-user-extra=authentication.kubernetes.io/pod-uid={pod['metadata']['uid']}",
        f"--as-user-extra=authentication.kubernetes.io/node-name={s.node}",
    ]

    def update(name: str, change: Any) -> tuple[int, str]:
        cd = c.get("computedomain", name, s.workload_ns)
        cd.setdefault("status", {"status": "NotReady"})
        change(cd["status"])
        args = ["replace", "--subresource=status", "-n", s.workload_ns, "-f", "-", *who]
        return c.try_kubectl(*args, input=json.dumps(cd))

    def entry(node: str) -> dict[str, Any]:
        return {"name": node, "ipAddress": "10.2.0.1", "cliqueID": "c1", "index": 0, "status": "NotReady"}

    add_own = lambda st: st.setdefault("nodes", []).append(entry(s.node))  # noqa: E731
    wait_for(lambda: update("legacy-theirs", add_own)[0] != 0, "policy active")
    code, out = update("legacy-mine", add_own)
    assert code == 0, out
    refused = [
        (update("legacy-theirs", add_own), "may only update the status of its own ComputeDomain"),
        (update("legacy-mine", lambda st: st["nodes"].append(dict(entry("peer"), index=1))), "not of peer"),
        (update("legacy-mine", lambda st: st.update(status="Ready")), "not status.status"),
    ]
    for (code, out), why in refused:
        assert code != 0 and why in out, out


# --- RBAC and the node agent's pool -------------------------------------------------------------------


def test_standby_controller_may_watch_its_lease(installed: Installed) -> None:
    s, c = installed, installed.cluster
    pod = wait_for(lambda: running_pod(c, s.ns, "app.kubernetes.io/component=controller"), "controller pod")
    kubeconfig = bound_kubeconfig(c, s.ns, pod["spec"]["serviceAccountName"], pod["metadata"]["name"], s.tmp / "ctl")
    c.apply({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": LEASE, "namespace": s.ns}})
    selector = f"--field-selector=metadata.name={LEASE}"
    code, out = _kubectl(kubeconfig, "-n", s.ns, "get", "leases", selector, "-o", "name")
    assert code == 0 and LEASE in out, out
    code, out = _kubectl(kubeconfig, "-n", s.ns, "get", "leases", selector, "--watch-only", "--request-timeout=2s")
    assert "forbidden" not in out.lower(), out
    code, out = _kubectl(kubeconfig, "-n", s.ns, "auth", "can-i", "watch", f"leases/{LEASE}")
    assert out.strip() == "yes", out
    # Other Leases stay out of reach.
    code, out = _kubectl(kubeconfig, "-n", s.ns, "get", "leases", "-o", "name")
    assert code != 0 and "forbidden" in out.lower(), out


def test_node_agent_publishes_only_its_own_pool(installed: Installed) -> None:
    s, c = installed, installed.cluster
    as_agent = [
        f"--as={s.user('compute-domain-kubelet-plugin')}",
        f"--as-user-extra=authentication.kubernetes.io/node-name={s.node}",
    ]

    def slice_(pool: str) -> str:
        return json.dumps(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"sec-{uuid.uuid4().hex[:8]}"},
                "spec": {
                    "driver": DRIVER_NAME,
                    "nodeName": s.node,
                    "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                },
            }
        )

    wait_for(lambda: c.try_kubectl("create", "-f", "-", *as_agent, input=slice_("elsewhere"))[0] != 0, "policy active")
    code, out = c.try_kubectl("create", "-f", "-", *as_agent, input=slice_("elsewhere"))
    assert code != 0 and "spec.pool.name: the node agent of node" in out and "not elsewhere" in out, out
    code, out = c.try_kubectl("create", "-f", "-", "-o", "name", *as_agent, input=slice_(s.node))
    assert code == 0, out
    c.kubectl("delete", out.strip())


# --- the daemons' NetworkPolicy ------------------------------------------------------------------------


def test_each_domain_gets_a_network_policy_selecting_its_own_daemons(installed: Installed) -> None:
    s, c = installed, installed.cluster
    pod = wait_for(lambda: running_pod(c, s.ns, "app.kubernetes.io/component=controller"), "controller pod")
    controller = run_controller(c, pod, s.tmp, s.workload_ns)
    try:
        uids = {name: _create_cd(c, s.workload_ns, name) for name in ("team-a", "team-b")}

        def policies() -> dict[str, dict[str, Any]] | None:
            items = json.loads(c.kubectl("get", "networkpolicies", "-n", s.ns, "-o", "json"))["items"]
            found = {p["metadata"]["labels"].get(COMPUTE_DOMAIN_LABEL): p for p in items}
            return found if set(uids.values()) <= set(found) else None

        found = wait_for(policies, "a NetworkPolicy per domain", timeout=60)
        # A claim of team-a allocated on the node: the controller labels it, the DaemonSet controller makes
        # team-a's daemon pod there.
        allocated_claim(c, s.workload_ns, uids["team-a"], s.node)
        daemon = wait_for(
            lambda: (json.loads(c.kubectl("get", "pods", "-n", s.ns, "-l", f"{COMPUTE_DOMAIN_LABEL}={uids['team-a']}", "-o", "json"))["items"] or [None])[0],
            "team-a's daemon pod",
        )  # fmt: skip
        labels = daemon["metadata"]["labels"]

        def selects(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
            return selector["matchLabels"].items() <= pod_labels.items() and not selector.get("matchExpressions")

        own, other = found[uids["team-a"]]["spec"], found[uids["team-b"]]["spec"]
        assert selects(own["podSelector"], labels) and not selects(other["podSelector"], labels)
        (rule,) = own["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": 50000}]  # nothing for 50005 or anything else
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"} and selects(peer["podSelector"], labels)
        assert not selects(other["ingress"][0]["from"][0]["podSelector"], labels)
        assert own["policyTypes"] == ["Ingress"]
        # Teardown takes the policy with the domain.
        c.kubectl("delete", "computedomain", "team-a", "-n", s.workload_ns, "--wait=false")
        wait_for(
            lambda: uids["team-a"] not in (policies() or {}) and _gone(c, s.ns, uids["team-a"]),
            "policy gone",
            timeout=60,
        )
    finally:
        # The controller tears every domain of the namespace down (it adopted the other tests' ones too).
        c.kubectl("delete", "computedomains", "--all", "-n", s.workload_ns, "--wait=false", check=False)
        wait_for(
            lambda: not c.kubectl("get", "computedomains", "-n", s.workload_ns, "-o", "name", check=False).strip(),
            "the domains torn down",
            timeout=90,
        )
        c.kubectl("label", "node", s.node, f"{COMPUTE_DOMAIN_LABEL}-", check=False)
        controller.terminate()
        controller.wait(timeout=30)


def _gone(c: Cluster, ns: str, uid: str) -> bool:
    out = c.kubectl("get", "networkpolicies", "-n", ns, "-l", f"{COMPUTE_DOMAIN_LABEL}={uid}", "-o", "name")
    return not out.strip()


# --- the RBAC table ------------------------------------------------------------------------------------------


def test_rbac_table_matches_the_checked_in_one(installed: Installed) -> None:
    """docs/rbac-table.md is what the apiserver grants each identity of the chart; a widened (or narrowed)
    role fails here. RBAC_TABLE_UPDATE=1 rewrites the file from this run."""
    s = installed
    table = rbac_table.build(s.cluster, release_ns=s.ns, extra_ns=s.extra_ns, tenant_ns=s.tenant_ns, tmp=s.tmp)
    path = REPO / "docs" / "rbac-table.md"
    if os.environ.get("RBAC_TABLE_UPDATE") == "1":
        path.write_text(table)
    assert path.read_text() == table, f"the granted permissions changed; review, then RBAC_TABLE_UPDATE=1:\n{table}"
