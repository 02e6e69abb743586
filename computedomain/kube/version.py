"""The Kubernetes versions this service runs on, checked once when a component starts.

Supported: Kubernetes 1.34 and later, serving ``resource.k8s.io/v1`` (Dynamic Resource Allocation, GA in
1.34): every ResourceClaim, ResourceClaimTemplate, ResourceSlice and DeviceClass the service reads or
writes is ``v1``. On an older apiserver nothing would work (the first template write fails, the kubelet never
calls the node agent), and the failures would surface one by one, far from their cause. So the controller,
the node agent and the IMEX daemon ask the apiserver first (``/version`` and the ``resource.k8s.io`` group)
and stop at once with one line naming the version found and the one needed. The chart says the same through
``kubeVersion`` in ``Chart.yaml``, so ``helm install`` refuses first.

``check`` is pure (the answers in, the message out); ``require_supported`` asks the apiserver.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Final

from computedomain.api.limits import brief
from computedomain.kube.client import KubeClient
from computedomain.kube.errors import KubeError, NotFound

log = logging.getLogger(__name__)

MIN_VERSION: Final = (1, 34)
RESOURCE_GROUP: Final = "resource.k8s.io"
RESOURCE_VERSION: Final = "v1"
_NUMBER = re.compile(r"[0-9]{1,4}", re.ASCII)
_GIT_VERSION = re.compile(r"v?([0-9]{1,4})\.([0-9]{1,4})", re.ASCII)


class UnsupportedServerError(RuntimeError):
    """The apiserver is older than this service supports; the message says which versions."""


def server_version(info: Mapping[str, Any]) -> tuple[int, int] | None:
    """(major, minor) from the apiserver's ``/version`` answer; providers append ``+`` to the minor
    ("1.33+"), so the leading digits count. None when it says neither."""
    major, minor = info.get("major"), info.get("minor")
    if isinstance(major, str) and isinstance(minor, str):
        ma, mi = _NUMBER.match(major), _NUMBER.match(minor)
        if ma and mi:
            return int(ma.group()), int(mi.group())
    git = info.get("gitVersion")
    found = _GIT_VERSION.match(git) if isinstance(git, str) else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def check(component: str, info: Mapping[str, Any], resource_versions: list[str] | None) -> str | None:
    """None when the apiserver is supported, else the one line to stop with. ``resource_versions`` are the
    versions the apiserver serves of ``resource.k8s.io`` (None: the group is not served at all)."""
    needed = f"Kubernetes {MIN_VERSION[0]}.{MIN_VERSION[1]} or later (serving {RESOURCE_GROUP}/{RESOURCE_VERSION})"
    version = server_version(info)
    shown = info.get("gitVersion") if isinstance(info.get("gitVersion"), str) else None
    found = (
        brief(shown, 40).strip("'")
        if shown
        else ("an unknown version" if version is None else f"{version[0]}.{version[1]}")
    )
    if version is not None and version < MIN_VERSION:
        return f"{component} needs {needed}; the apiserver is {found}: upgrade the cluster"
    if resource_versions is None or RESOURCE_VERSION not in resource_versions:
        served = ", ".join(resource_versions or ()) or "none"
        return (
            f"{component} needs {needed}; the apiserver ({found}) serves {RESOURCE_GROUP} versions: {served}. "
            f"Enable {RESOURCE_GROUP}/{RESOURCE_VERSION} (--runtime-config) or upgrade the cluster"
        )
    return None


async def require_supported(client: KubeClient, component: str) -> None:
    """Raise ``UnsupportedServerError`` when the apiserver is one ``check`` refuses. An apiserver that does not
    answer is not a reason to stop (the node agent's Unprepare works without it): one warning, and on."""
    try:
        info = await client.discover("/version")
        try:
            group = await client.discover(f"/apis/{RESOURCE_GROUP}")
        except NotFound:
            group = None
    except KubeError as exc:
        log.warning("could not ask the apiserver for its version, going on: %s", exc)
        return
    if group is None:
        versions = None
    else:
        listed = group.get("versions")
        versions = [str(v.get("version")) for v in listed if isinstance(v, Mapping)] if isinstance(listed, list) else []
    problem = check(component, info, versions)
    if problem is not None:
        raise UnsupportedServerError(problem)
