"""Builders shared by the controller's unit tests."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from computedomain.api.constants import (
    CLIQUE_LABEL,
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
)
from computedomain.api.models import ComputeDomain, ComputeDomainClique
from computedomain.controller.claim_templates import daemon_template, workload_template
from computedomain.controller.daemonset import daemonset
from computedomain.controller.network_policy import network_policy
from computedomain.controller.observed import Child, ChildKind, NodeView, PodView, decode_child
from computedomain.settings import ControllerSettings, load_settings

UID = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"
OTHER_UID = "9c0e28ba-2fa1-411d-8a1f-6ec5c1f3a8e3"
NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
DRIVER_NS = "nvidia-dra"


def settings(**env: str) -> ControllerSettings:
    base = {"NAMESPACE": DRIVER_NS, "IMAGE_NAME": "registry.example/computedomain:1"}
    return load_settings(ControllerSettings, [], environ={**base, **env})


def host_settings(**env: str) -> ControllerSettings:
    return settings(IMEX_MODE="hostManaged", FEATURE_GATES="HostManagedIMEXDaemon=true", **env)


def compute_domain(
    *,
    uid: str = UID,
    name: str = "cd1",
    namespace: str = "team",
    num_nodes: int = 0,
    allocation_mode: str = "Single",
    finalizers: tuple[str, ...] = (COMPUTE_DOMAIN_FINALIZER,),
    deleting: bool = False,
    status: dict[str, Any] | None = None,
    template: str = "imex-channel-0",
) -> ComputeDomain:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid,
        "resourceVersion": "10",
        "generation": 1,
        "finalizers": list(finalizers),
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T11:00:00Z"
    raw: dict[str, Any] = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": meta,
        "spec": {
            "numNodes": num_nodes,
            "channel": {"resourceClaimTemplate": {"name": template}, "allocationMode": allocation_mode},
        },
    }
    if status is not None:
        raw["status"] = status
    return ComputeDomain.model_validate(raw)


def child(
    kind: ChildKind,
    *,
    uid: str = UID,
    name: str | None = None,
    namespace: str | None = None,
    terminating: bool = False,
    finalizers: tuple[str, ...] = (COMPUTE_DOMAIN_FINALIZER,),
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Child:
    """A child as the controller builds it for the domain ``uid`` (``edit`` changes the raw object first), decoded
    as the caches decode it."""
    cd, cfg = compute_domain(uid=uid), settings()
    raw: dict[str, Any] = {
        ChildKind.DAEMONSET: lambda: daemonset(cd, cfg),
        ChildKind.DAEMON_TEMPLATE: lambda: daemon_template(cd, cfg),
        ChildKind.WORKLOAD_TEMPLATE: lambda: workload_template(cd, cfg),
        ChildKind.NETWORK_POLICY: lambda: network_policy(cd, cfg),
    }[kind]()
    meta = raw["metadata"]
    meta.update(uid=f"obj-{kind.value}-{name}", resourceVersion="5", finalizers=list(finalizers))
    if name is not None:
        meta["name"] = name
    if namespace is not None:
        meta["namespace"] = namespace
    if terminating:
        meta["deletionTimestamp"] = "2026-11-29T11:00:00Z"
    if edit is not None:
        edit(raw)
    return decode_child(raw, kind)


def all_children(uid: str = UID) -> tuple[Child, ...]:
    return tuple(child(k, uid=uid) for k in ChildKind)


def node(name: str, uid: str = UID) -> NodeView:
    return NodeView(name=name, resource_version="3", cd_uid=uid)


def clique(clique_id: str, *entries: tuple[str, str, int, str], uid: str = UID) -> ComputeDomainClique:
    return ComputeDomainClique.model_validate(
        {
            "metadata": {
                "name": f"{uid}.{clique_id}",
                "namespace": DRIVER_NS,
                "labels": {COMPUTE_DOMAIN_LABEL: uid, CLIQUE_LABEL: clique_id},
            },
            "daemons": [
                {"nodeName": n, "ipAddress": ip, "cliqueID": clique_id, "index": i, "status": s}
                for n, ip, i, s in entries
            ],
        }
    )


def pod(node_name: str, *, ip: str = "10.0.0.9", ready: bool = True, clique_id: str | None = "") -> PodView:
    return PodView(
        namespace=DRIVER_NS,
        name=f"computedomain-daemon-x-{node_name}",
        cd_uid=UID,
        node_name=node_name,
        pod_ip=ip,
        ready=ready,
        clique_id=clique_id,
    )
