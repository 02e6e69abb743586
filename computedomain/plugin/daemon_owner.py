"""Who may get an IMEX daemon device: the node agent's half of the rule that only a ComputeDomain's own daemon
pods do (docs/security.md; the other half is the admission policy on daemon claims).

A daemon device gives a container the ``fabric-imex-mgmt`` capability and read-write access to its domain's
``/imexd``. Before any of that is prepared, ``check_daemon_claim`` requires, for the domain UID the claim's
``ComputeDomainDaemonConfig`` names:

* the claim lives in a namespace the daemons run in (``NAMESPACE`` and ``ADDITIONAL_NAMESPACES``);
* it is reserved for pods only, and for at least one;
* each of those pods exists with the UID the reservation names, and its controller (the ownerReference
  with ``controller: true``) is the DaemonSet ``computedomain-daemon-<UID>`` (``apps/v1``) of that
  namespace, and that DaemonSet exists now with the UID the ownerReference names.

Anything else is ``ClaimRejected``: one line that states the rule, then what differs. This holds even where
the admission policies are not installed. The reads are two live GETs per pod (``KubeDaemonPods``), as
Prepare reads its claim: a cache could lag behind a DaemonSet that was just replaced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from computedomain.api.constants import DAEMON_TEMPLATE_PREFIX
from computedomain.api.limits import shown
from computedomain.kube.client import DAEMONSETS, PODS, KubeClient
from computedomain.kube.errors import NotFound
from computedomain.plugin.collaborators import ClaimSnapshot
from computedomain.plugin.failures import ClaimRejected

__all__ = ["DaemonPods", "KubeDaemonPods", "OwnerRef", "PodFacts", "check_daemon_claim"]


@dataclass(frozen=True, slots=True)
class OwnerRef:
    api_version: str
    kind: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What the rule reads of a pod: its UID and its controller."""

    uid: str
    controller: OwnerRef | None

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> PodFacts:
        meta = raw.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}
        owners = meta.get("ownerReferences")
        controller = None
        for ref in owners if isinstance(owners, list) else ():
            if isinstance(ref, Mapping) and ref.get("controller") is True:
                controller = OwnerRef(*(str(ref.get(k) or "") for k in ("apiVersion", "kind", "name", "uid")))
                break
        return cls(uid=str(meta.get("uid") or ""), controller=controller)


class DaemonPods(Protocol):
    async def pod(self, namespace: str, name: str) -> PodFacts | None:
        """The pod as the apiserver has it now, or None when there is none."""
        ...

    async def daemonset_uid(self, namespace: str, name: str) -> str | None:
        """The UID of the DaemonSet with this name now, or None when there is none."""
        ...


class KubeDaemonPods:
    """`DaemonPods` over the API server (RBAC: get pods and daemonsets in the daemons' namespaces)."""

    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def pod(self, namespace: str, name: str) -> PodFacts | None:
        try:
            return PodFacts.from_raw(await self._client.get(PODS, name, namespace=namespace))
        except NotFound:
            return None

    async def daemonset_uid(self, namespace: str, name: str) -> str | None:
        try:
            raw = await self._client.get(DAEMONSETS, name, namespace=namespace)
        except NotFound:
            return None
        return str((raw.get("metadata") or {}).get("uid") or "") or None


async def check_daemon_claim(
    claim: ClaimSnapshot, domain_uid: str, *, namespaces: Sequence[str], pods: DaemonPods | None
) -> None:
    """Return when every pod reserving ``claim`` belongs to the domain's DaemonSet; else ``ClaimRejected``."""
    ns = claim.namespace
    daemonset = f"{DAEMON_TEMPLATE_PREFIX}{domain_uid}"  # the name the controller gives it
    rule = (
        f"the IMEX daemon device of ComputeDomain {domain_uid} is only for pods of its DaemonSet {daemonset} in "
        f"namespace {', '.join(namespaces) or '(none configured)'}"
    )

    def refuse(why: str) -> ClaimRejected:
        return ClaimRejected(f"{rule}; {why}")

    where = f"ResourceClaim {ns}/{claim.name}"
    if ns not in namespaces:
        raise refuse(f"{where} is in namespace {shown(ns)}")
    if pods is None:
        raise refuse("this node agent cannot read pods to check that")
    reserved = claim.status.get("reservedFor")
    consumers = [c for c in reserved if isinstance(c, Mapping)] if isinstance(reserved, list) else []
    if not consumers:
        raise refuse(f"{where} is reserved for no pod")
    expected_uid: str | None = None
    for consumer in consumers:
        name, uid = str(consumer.get("name") or ""), str(consumer.get("uid") or "")
        if consumer.get("resource") != "pods" or consumer.get("apiGroup") not in (None, ""):
            raise refuse(f"{where} is reserved for {shown(str(consumer.get('resource')))} {shown(name)}, not a pod")
        pod = await pods.pod(ns, name)
        if pod is None or pod.uid != uid:
            raise refuse(f"pod {ns}/{shown(name)} (UID {shown(uid)}) reserving {where} does not exist")
        owner = pod.controller
        if owner is None or (owner.api_version, owner.kind, owner.name) != ("apps/v1", "DaemonSet", daemonset):
            by = f"{shown(owner.kind)} {shown(owner.name)}" if owner else "nothing"
            raise refuse(f"pod {ns}/{shown(name)} reserving {where} is controlled by {by}")
        if expected_uid is None:
            expected_uid = await pods.daemonset_uid(ns, daemonset)
        if owner.uid != expected_uid:
            now = f"it now has UID {expected_uid}" if expected_uid else "it does not exist"
            raise refuse(f"pod {ns}/{shown(name)} belongs to DaemonSet {daemonset} UID {shown(owner.uid)}; {now}")
