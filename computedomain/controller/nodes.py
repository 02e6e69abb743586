"""The CD label on Nodes (driverManaged): the controller's alone, derived from the allocated channel claims.

A node carries ``resource.nvidia.com/computeDomain=<cdUID>`` while a channel claim of that domain, in the
domain's namespace, has a channel device allocated on the node; the label is what schedules the domain's
IMEX daemon there (the DaemonSet's node selector). The node agent only reads it (its admission policy refuses
any change of it), so a stolen node agent token cannot bring another tenant's daemon onto its node, and with it
the node into that tenant's IMEX domain: the claims it would need are made only by the resourceclaim
controller, from the domain's own template, for the domain's pods (``admission-channel-claims.yaml``), and
allocated only by the scheduler.

``NodeLabeller`` converges one node at a time (the work queue's key is the node name), woken by the claims
allocated there, the node's label and the domains of both:

- a node with a claim of a live domain D allocated and no CD label gets ``D`` as soon as the scheduler wrote
  the allocation (before the kubelet asks the node agent to prepare it: the daemon starts that much earlier);
- a label naming a live domain with no claim allocated there any more is removed, or replaced by the domain
  that now has one, once a live list of the domain's claims agrees (a lagging cache never removes a label);
- a label naming a domain this controller does not know is the orphan sweep's, which confirms against every
  namespace (``cleanup``); a domain being torn down loses its labels in its reconcile (``reconcile``).

Every write reads the node first and carries its resourceVersion, so a label that changed meanwhile is
decided again, never overwritten. Removal by the sweep and the teardown is a JSON patch that first tests the
label's value (upstream PR #518). Two domains with claims on one node at once cannot come from the scheduler
(design note 0014); should it happen, the label stays with the domain it names, or goes to the lowest UID.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, Final

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ComputeDomain
from computedomain.controller.observed import ClaimView, NodeView, decode_claim
from computedomain.kube.client import RESOURCE_CLAIMS
from computedomain.kube.converge import DONE, ReconcileResult
from computedomain.kube.workqueue import RequeueAfter

if TYPE_CHECKING:
    from computedomain.controller.executor import Writer

log = logging.getLogger(__name__)

_LABEL_PATH = "/metadata/labels/" + COMPUTE_DOMAIN_LABEL.replace("~", "~0").replace("/", "~1")
#: how soon a node whose label changed under a write is decided again
CHANGED_RECHECK_S: Final = 0.2


def stale_labels(nodes: Iterable[NodeView], known_uids: Collection[str]) -> list[NodeView]:
    """Nodes whose CD label names a domain that is not in ``known_uids``."""
    return sorted((n for n in nodes if n.cd_uid and n.cd_uid not in known_uids), key=lambda n: n.name)


def unlabel_patch(node: NodeView) -> list[dict[str, Any]]:
    """Remove the CD label only if it still names the same domain (a failed test is a 422, not a write)."""
    return [
        {"op": "test", "path": _LABEL_PATH, "value": node.cd_uid},
        {"op": "remove", "path": _LABEL_PATH},
    ]


def wanted(claims: Iterable[ClaimView], cd_of: Callable[[str], ComputeDomain | None]) -> set[str]:
    """The live domains whose channel claims, in the domain's own namespace, are allocated on a node."""
    found: set[str] = set()
    for claim in claims:
        cd = cd_of(claim.cd_uid) if claim.cd_uid else None
        if cd is not None and cd.metadata.deletion_timestamp is None and cd.metadata.namespace == claim.namespace:
            found.add(cd.uid)
    return found


def decide(current: str, want: set[str]) -> str | None:
    """The label a node should carry: ``current`` while its domain is wanted, else one of ``want`` (None:
    none)."""
    if current in want:
        return current
    return min(want) if want else None


class NodeLabeller:
    """The work queue's callback for the node-label loop (see the module docstring)."""

    def __init__(self, writer: Writer, *, request_sweep: Callable[[], None]) -> None:
        self.writer = writer
        self.caches = writer.caches
        self.request_sweep = request_sweep

    async def reconcile(self, node: str) -> ReconcileResult:
        cached = self.caches.nodes.get(node)
        current = cached.cd_uid if cached is not None else ""
        target = decide(current, wanted(self.caches.claims_on(node), self.caches.cd))
        if target == (current or None):
            return DONE
        if current:
            cd = self.caches.cd(current)
            if cd is None:
                self.request_sweep()  # another namespace's domain, or one that is gone: the sweep confirms
                return DONE
            if cd.metadata.deletion_timestamp is not None:
                return DONE  # its teardown removes it
            if await self._allocated_live(cd, node):
                return DONE  # the claims cache lags; its event wakes this node again
        if not await self.writer.label_node(node, expect=current or None, value=target):
            return RequeueAfter(CHANGED_RECHECK_S)
        if target is None:
            log.info(
                "removed node label node=%s %s=%s: no claim of it allocated there", node, COMPUTE_DOMAIN_LABEL, current
            )
        else:
            log.info("labelled node node=%s %s=%s", node, COMPUTE_DOMAIN_LABEL, target)
        return DONE

    async def _allocated_live(self, cd: ComputeDomain, node: str) -> bool:
        listed = await self.writer.client.list_all(RESOURCE_CLAIMS, namespace=cd.metadata.namespace)
        return any(c.cd_uid == cd.uid and node in c.nodes for c in map(decode_claim, listed.every))
