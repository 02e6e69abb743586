"""The per-domain IMEX daemon DaemonSet, as a pure builder (SPEC section 4, reference section 2.3).

``computedomain-daemon-<cdUID>`` in the driver namespace. Its pods land only on nodes that carry the CD
label with this domain's UID (the node agent sets it when it prepares a channel claim), tolerate every taint,
claim a daemon device from the daemon template, and learn who they are from the downward API. The DaemonSet
is never updated after creation (as upstream): daemons of a running domain are not rolled.

Each domain gets its own DNS hostname prefix (``IMEX_HOSTNAME_PREFIX``), so that two domains never share
peer names even when pod IPs are reused (upstream #1447): ``imex.config.hostname_prefix``, the function the
daemon uses when the variable is missing.

A DaemonSet the reference driver made for a running domain is adopted, and ``taken_over`` is its one update:
this pod template with the updateStrategy ``OnDelete``, so that no running daemon is restarted (their
workloads keep their IMEX domain) and every daemon started from then on is ours. Those daemons use the
reference's peer names (``compute-domain-daemon-NNNN``, the same for every domain), so that they and the
reference's daemons still running resolve each slot to the same address (docs/design/0011).
"""

from __future__ import annotations

from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL, DAEMON_CHECK_PORT
from computedomain.api.models import ComputeDomain
from computedomain.controller.claim_templates import daemon_object_name
from computedomain.settings import ControllerSettings, render_imex_config_overrides
from imex.config import HOSTNAME_PREFIX_BASE, hostname_prefix

CONTAINER_NAME = "compute-domain-daemon"
CLAIM_NAME = "compute-domain-daemon"
SERVICE_ACCOUNT = "compute-domain-daemon-service-account"
DAEMON_COMMAND = ("python", "-m", "imex", "daemon", "run")
CHECK_COMMAND = ("python", "-m", "imex", "daemon", "check")


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _probe(period: int, failures: int) -> dict[str, Any]:
    # Answered by the daemon wrapper itself (`imex daemon run` serves GET /ready: `check`'s verdict, 200 only on
    # exactly READY): an nvidia-imex-ctl exec per probe instead of a fresh Python (`CHECK_COMMAND`, kept for
    # people), which cost ~0.1-0.2 CPU s a probe and timed out on loaded nodes.
    return {
        "httpGet": {"path": "/ready", "port": DAEMON_CHECK_PORT},
        "initialDelaySeconds": 0,
        "periodSeconds": period,
        "timeoutSeconds": 10,
        "successThreshold": 1,
        "failureThreshold": failures,
    }


# The peer-name prefix the reference driver uses for every domain.
REFERENCE_PEER_PREFIX = HOSTNAME_PREFIX_BASE


def daemon_env(
    cd: ComputeDomain, settings: ControllerSettings, *, peer_prefix: str | None = None
) -> list[dict[str, Any]]:
    return [
        _field_env("NODE_NAME", "spec.nodeName"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_UID", "metadata.uid"),
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        {"name": "COMPUTE_DOMAIN_UUID", "value": cd.uid},
        {"name": "COMPUTE_DOMAIN_NAME", "value": cd.metadata.name},
        {"name": "COMPUTE_DOMAIN_NAMESPACE", "value": cd.metadata.namespace},
        {"name": "IMEX_HOSTNAME_PREFIX", "value": peer_prefix or hostname_prefix(cd.uid)},
        {"name": "FEATURE_GATES", "value": settings.feature_gates.render()},
        {"name": "LOG_LEVEL", "value": settings.daemon_log_level},
        {"name": "MAX_NODES_PER_IMEX_DOMAIN", "value": str(settings.max_nodes_per_imex_domain)},
        {"name": "CHECK_PORT", "value": str(DAEMON_CHECK_PORT)},
        *(
            [{"name": "IMEX_CONFIG_OVERRIDES", "value": render_imex_config_overrides(overrides)}]
            if (overrides := settings.imex_config_overrides)
            else []
        ),
        # Keep the NVIDIA container runtime from injecting every GPU into the daemon (upstream #402).
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    ]


# Root without capabilities: it rewrites the pod's /etc/hosts (a root-owned file the kubelet mounts) and its
# /imexd (a root-owned host directory), and nvidia-imex opens the fabric-imex-mgmt capability device (mode
# 0400, root). Nothing it does needs a capability; the root filesystem stays read-only, with scratch space
# where nvidia-imex writes (its stats file under /var/log) and /tmp. docs/security.md has the reasoning.
CONTAINER_SECURITY: dict[str, Any] = {
    "runAsUser": 0,
    "runAsGroup": 0,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
SCRATCH = {"tmp": "/tmp", "var-log": "/var/log"}


def _resources(settings: ControllerSettings) -> dict[str, Any]:
    """The daemon claim, and CD_DAEMON_RESOURCES as requests and limits both: the Guaranteed QoS class."""
    resources: dict[str, Any] = {"claims": [{"name": CLAIM_NAME}]}
    if quantities := settings.daemon_resources:
        resources["requests"] = dict(quantities)
        resources["limits"] = dict(quantities)
    return resources


def daemonset(cd: ComputeDomain, settings: ControllerSettings, *, peer_prefix: str | None = None) -> dict[str, Any]:
    name = daemon_object_name(cd.uid)
    selector = {COMPUTE_DOMAIN_LABEL: cd.uid}
    pod_spec: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "nodeSelector": dict(selector),
        # Daemons must run wherever the workload runs, whatever the node's taints (upstream #305).
        "tolerations": [
            {"operator": "Exists", "effect": effect} for effect in ("NoSchedule", "NoExecute", "PreferNoSchedule")
        ],
        # Peer names resolve through /etc/hosts; keep search-domain lookups from flooding DNS (upstream #1447).
        "dnsConfig": {"options": [{"name": "ndots", "value": "1"}]},
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": CONTAINER_NAME,
                "image": settings.image_name,
                "command": list(DAEMON_COMMAND),
                "env": daemon_env(cd, settings, peer_prefix=peer_prefix),
                # Tolerant startup (IMEX may wait ~20 min for peers), strict readiness.
                "startupProbe": _probe(period=1, failures=1200),
                "livenessProbe": _probe(period=60, failures=20),
                "readinessProbe": _probe(period=10, failures=1),
                "resources": _resources(settings),
                "securityContext": dict(CONTAINER_SECURITY),
                "volumeMounts": [{"name": name, "mountPath": path} for name, path in SCRATCH.items()],
            }
        ],
        "volumes": [{"name": name, "emptyDir": {"sizeLimit": "64Mi"}} for name in SCRATCH],
        "resourceClaims": [{"name": CLAIM_NAME, "resourceClaimTemplateName": name}],
    }
    if settings.daemon_priority_class:
        # Ahead of the training pods that wait for them, and not their eviction victims (upstream, 20k GPUs).
        pod_spec["priorityClassName"] = settings.daemon_priority_class
    if settings.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": dict(selector),
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
        },
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "template": {"metadata": {"labels": dict(selector)}, "spec": pod_spec},
        },
    }


def taken_over(current: dict[str, Any], cd: ComputeDomain, settings: ControllerSettings) -> dict[str, Any]:
    """The reference's DaemonSet ``current`` (as read, with its resourceVersion) with this project's pod
    template, the reference's peer names and ``OnDelete`` updates: the body of its one replacing write."""
    ours = daemonset(cd, settings, peer_prefix=REFERENCE_PEER_PREFIX)
    spec = {**current.get("spec", {}), "template": ours["spec"]["template"], "updateStrategy": {"type": "OnDelete"}}
    return {**current, "spec": spec}
