"""The two ResourceClaimTemplates of a ComputeDomain, as pure builders (SPEC sections 2 and 4).

* The **daemon template** ``computedomain-daemon-<cdUID>`` in the driver namespace (driverManaged only): one
  request ``daemon`` of class ``compute-domain-daemon.nvidia.com`` with an opaque
  ``ComputeDomainDaemonConfig{domainID}``. The DaemonSet's pods claim from it.
* The **workload template**, named by the user (``spec.channel.resourceClaimTemplate.name``) in the CD's
  namespace: one request ``channel`` of class ``compute-domain-default-channel.nvidia.com`` with an opaque
  ``ComputeDomainChannelConfig{domainID, allocationMode}``. In hostManaged mode the allocation mode is forced to
  ``Single``: every domain shares channel 0 of the host's IMEX domain. With channel isolation the request's
  class is ``compute-domain-channel.nvidia.com`` instead: any of a node's channel devices, since each is a
  place for one claim and the node agent injects the domain's own channel (design note 0012). Without it the
request selects only channel devices that no other domain holds (attribute ``domain``: several pods of a
domain on one node, never a node another domain's IMEX daemon serves; design note 0014).

Both carry the CD label (value: CD UID), the target label and our finalizer. The workload template, in the
domain's own namespace, also names the domain as its controller owner (the garbage collector's backstop; no
``blockOwnerDeletion``); the daemon template cannot (an owner reference across namespaces is invalid). Lifetime
is managed by finalizers; what makes an object a child is ``adoption``'s rule.
"""

from __future__ import annotations

from typing import Any

from computedomain.api.constants import (
    CHANNEL_DEVICE_CLASS,
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    DAEMON_DEVICE_CLASS,
    DAEMON_TEMPLATE_PREFIX,
    DRIVER_NAME,
    GROUP_VERSION,
    HOLDER_ATTRIBUTE,
    ISOLATED_CHANNEL_DEVICE_CLASS,
    TEMPLATE_TARGET_DAEMON,
    TEMPLATE_TARGET_LABEL,
    TEMPLATE_TARGET_WORKLOAD,
)
from computedomain.api.models import AllocationMode, ComputeDomain
from computedomain.settings import ControllerSettings

DAEMON_REQUEST = "daemon"
CHANNEL_REQUEST = "channel"


def daemon_object_name(cd_uid: str) -> str:
    """Name of both the DaemonSet and the daemon template: 57 characters, so pod names stay within 63."""
    return f"{DAEMON_TEMPLATE_PREFIX}{cd_uid}"


def workload_template_name(cd: ComputeDomain) -> str:
    return cd.spec.channel.resource_claim_template.name


def channel_device_class(settings: ControllerSettings) -> str:
    return ISOLATED_CHANNEL_DEVICE_CLASS if settings.channel_isolation else CHANNEL_DEVICE_CLASS


def allocation_mode(cd: ComputeDomain, settings: ControllerSettings) -> AllocationMode:
    if settings.host_managed:
        return AllocationMode.SINGLE
    return cd.spec.channel.allocation_mode


def holder_selector(cd_uid: str) -> str:
    """CEL: a device no domain holds, or this one (``||`` short-circuits, so the attribute is read only
    where it exists)."""
    attrs = f'device.attributes["{DRIVER_NAME}"]'
    return f'!("{HOLDER_ATTRIBUTE}" in {attrs}) || {attrs}.{HOLDER_ATTRIBUTE} == "{cd_uid}"'


def _template(
    *,
    name: str,
    namespace: str,
    cd_uid: str,
    target: str,
    request: str,
    device_class: str,
    params: dict[str, Any],
    selectors: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = selectors
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {COMPUTE_DOMAIN_LABEL: cd_uid, TEMPLATE_TARGET_LABEL: target},
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": request, "exactly": exactly}],
                    "config": [
                        {
                            "requests": [request],
                            "opaque": {"driver": DRIVER_NAME, "parameters": {"apiVersion": GROUP_VERSION, **params}},
                        }
                    ],
                }
            }
        },
    }


def daemon_template(cd: ComputeDomain, settings: ControllerSettings) -> dict[str, Any]:
    return _template(
        name=daemon_object_name(cd.uid),
        namespace=settings.namespace,
        cd_uid=cd.uid,
        target=TEMPLATE_TARGET_DAEMON,
        request=DAEMON_REQUEST,
        device_class=DAEMON_DEVICE_CLASS,
        params={"kind": "ComputeDomainDaemonConfig", "domainID": cd.uid},
    )


def workload_template(cd: ComputeDomain, settings: ControllerSettings) -> dict[str, Any]:
    body = _template(
        name=workload_template_name(cd),
        namespace=cd.metadata.namespace,
        cd_uid=cd.uid,
        target=TEMPLATE_TARGET_WORKLOAD,
        request=CHANNEL_REQUEST,
        device_class=channel_device_class(settings),
        params={
            "kind": "ComputeDomainChannelConfig",
            "domainID": cd.uid,
            "allocationMode": allocation_mode(cd, settings).value,
        },
        selectors=None if settings.channel_isolation else [{"cel": {"expression": holder_selector(cd.uid)}}],
    )
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": cd.api_version, "kind": cd.kind, "name": cd.metadata.name, "uid": cd.uid, "controller": True}
    ]
    return body
