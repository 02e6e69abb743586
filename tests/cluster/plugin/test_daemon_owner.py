"""A tenant cannot get another domain's IMEX daemon device, even with the admission policies out of the way:
the node agent prepares a daemon claim only for a pod of the domain's own DaemonSet (docs/security.md).

The chart is not installed here, so no admission policy stands in front: the node agent's check is all
there is. The tenant is a ServiceAccount with rights in its own namespace only, acting with its own token;
the real scheduler allocates the daemon device of the node's ResourceSlice to the tenant's claim, and the
kubelet stand-in asks the node agent (a real process) to prepare it. The legitimate path is the victim
domain's own DaemonSet, built by the controller's own builders, whose pod the real DaemonSet controller makes.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DAEMON_DEVICE_CLASS, DRIVER_NAME
from computedomain.api.models import ComputeDomain
from computedomain.controller.claim_templates import daemon_template
from computedomain.controller.daemonset import daemonset
from computedomain.plugin.checkpoint import ClaimState
from computedomain.settings import ControllerSettings, load_settings
from tests.cluster.manifests.release import token_kubeconfig
from tests.cluster.plugin.conftest import GV, Harness, eventually
from tests.testbed.kubelet import PREPARED_ANNOTATION

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

KUBECTL = Path(__file__).resolve().parents[3] / ".cluster" / "bin" / "kubectl"
DAEMON_SA = "compute-domain-daemon-service-account"


def _tenant(h: Harness, ns: str, tmp: Path) -> Path:
    """A ServiceAccount of ``ns`` that may create claims and pods there, nothing else; its kubeconfig."""
    h.kubectl("create", "serviceaccount", "tenant", "-n", ns)
    h.cluster.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "tenant", "namespace": ns},
                "rules": [
                    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "create"]},
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "create", "delete"]},
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
    token = h.kubectl("create", "token", "tenant", "-n", ns, "--duration=1h").strip()
    return token_kubeconfig(h.cluster, token, ns, tmp / "tenant.kubeconfig")


def _as(kubeconfig: Path, *args: str, body: Any = None) -> str:
    result = subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(kubeconfig), *args],
        input=json.dumps(body) if body is not None else None, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


async def test_a_tenant_pod_is_refused_the_daemon_device_and_the_domains_daemon_gets_it(
    harness: Harness, tmp_path: Path
) -> None:
    h = harness
    node = await h.add_node()
    victim = h.create_cd("victim")
    uid = victim["metadata"]["uid"]
    tenant_ns = f"tenant-{uuid.uuid4().hex[:6]}"
    h.cluster.local.create_namespace(tenant_ns)
    try:
        tenant = _tenant(h, tenant_ns, tmp_path)
        # The tenant knows the victim's UID and asks for the daemon device with the victim's daemon config.
        _as(tenant, "create", "-f", "-", body={
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "steal"},
            "spec": {"devices": {
                "requests": [{"name": "daemon", "exactly": {"deviceClassName": DAEMON_DEVICE_CLASS}}],
                "config": [{"requests": ["daemon"], "opaque": {"driver": DRIVER_NAME, "parameters": {
                    "apiVersion": GV, "kind": "ComputeDomainDaemonConfig", "domainID": uid}}}],
            }},
        })  # fmt: skip
        _as(tenant, "create", "-f", "-", body={
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "thief"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name}, "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "c", "image": "example.invalid/x:1", "resources": {"claims": [{"name": "d"}]}}],
                "resourceClaims": [{"name": "d", "resourceClaimName": "steal"}],
            },
        })  # fmt: skip
        rule = (
            f"the IMEX daemon device of ComputeDomain {uid} is only for pods of its DaemonSet "
            f"computedomain-daemon-{uid} in namespace {h.driver_ns}; ResourceClaim {tenant_ns}/steal is in "
            f"namespace {tenant_ns}"
        )

        def refused() -> str | None:
            for event in h.pod_events("thief", tenant_ns):
                if event["reason"] == "FailedPrepareDynamicResources" and rule in event["message"]:
                    return str(event["message"])
            return None

        message = await eventually(refused, within=60, what="the Prepare refusal on the tenant pod")
        assert "permanent error" in message
        claim = h.get("resourceclaim", "steal", tenant_ns)
        assert claim is not None
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"]) == (node.name, "daemon-0"), "the scheduler did allocate it"
        assert claim["status"]["reservedFor"][0]["name"] == "thief"
        pod = h.get("pod", "thief", tenant_ns)
        assert pod is not None and PREPARED_ANNOTATION not in (pod["metadata"].get("annotations") or {})
        assert pod["status"]["phase"] == "Pending"
        # Nothing was written for it: no checkpoint entry, no /imexd directory, no CDI spec.
        assert node.store().read().get(claim["metadata"]["uid"]) is None
        assert not (node.plugin_dir / "domains" / uid).exists()
        assert node.cdi_spec(claim["metadata"]["uid"]) is None
        # The tenant leaves; the node's daemon device is free again.
        _as(tenant, "delete", "pod", "thief", "--wait=false")
    finally:
        h.kubectl("delete", "pod", "thief", "-n", tenant_ns, "--force", "--grace-period=0", check=False)
        h.kubectl("delete", "namespace", tenant_ns, "--wait=false", check=False)
    await eventually(lambda: h.get("resourceclaim", "steal", tenant_ns) is None or None, what="the tenant's claim gone")

    # The victim's own daemon: the DaemonSet and daemon template the controller makes for it (its builders),
    # on a node labelled for the domain; the DaemonSet controller makes the pod, the scheduler allocates.
    settings = load_settings(ControllerSettings, [], environ={"NAMESPACE": h.driver_ns, "IMAGE_NAME": "x.invalid/d:1"})
    cd = ComputeDomain.model_validate(victim)
    h.kubectl("create", "serviceaccount", DAEMON_SA, "-n", h.driver_ns)
    for obj in (daemon_template(cd, settings), daemonset(cd, settings)):
        obj["metadata"].pop("finalizers", None)  # no controller runs here to release them
        h.cluster.apply(obj, h.driver_ns)
    h.kubectl("label", "node", node.name, f"{COMPUTE_DOMAIN_LABEL}={uid}")

    def daemon_prepared() -> dict[str, Any] | None:
        out = h.kubectl("get", "pods", "-n", h.driver_ns, "-l", f"{COMPUTE_DOMAIN_LABEL}={uid}", "-o", "json")
        for pod in json.loads(out)["items"]:
            if PREPARED_ANNOTATION in (pod["metadata"].get("annotations") or {}):
                return dict(pod)
        return None

    daemon = await eventually(daemon_prepared, within=60, what="the domain's daemon pod prepared")
    assert daemon["metadata"]["ownerReferences"][0]["name"] == f"computedomain-daemon-{uid}"
    claim = h.claim_of(daemon["metadata"]["name"], h.driver_ns)
    assert claim is not None
    entry = node.store().read().get(claim["metadata"]["uid"])
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED
    assert (node.plugin_dir / "domains" / uid).is_dir()
    h.kubectl("delete", "daemonset", f"computedomain-daemon-{uid}", "-n", h.driver_ns, "--wait=false")
    await eventually(lambda: daemon_prepared() is None or None, within=60, what="the daemon pod unprepared and gone")
