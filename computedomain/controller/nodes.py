"""The CD label on Nodes: who removes it and when.

The node agent labels a node ``resource.nvidia.com/computeDomain=<cdUID>`` when it prepares a channel claim;
that label is what schedules the domain's daemon on the node. The controller never adds it. It removes it
(a) for every node of a domain being torn down (``reconcile``), and (b) when the label names a domain that no
longer exists: the node agent may label a node after its domain's teardown already ran, and such a node is
then blocked for every other domain. (b) runs at start, periodically, after every reconcile of a domain being
torn down or gone and on node events, always from the cache first and confirmed against the apiserver before
any write (a domain missing from a lagging cache is not a deleted domain).

Removal is a JSON patch that first tests the label's value, so a label that meanwhile names another domain is
never removed (upstream PR #518).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.controller.observed import NodeView

_LABEL_PATH = "/metadata/labels/" + COMPUTE_DOMAIN_LABEL.replace("~", "~0").replace("/", "~1")


def stale_labels(nodes: Iterable[NodeView], known_uids: Collection[str]) -> list[NodeView]:
    """Nodes whose CD label names a domain that is not in ``known_uids``."""
    return sorted((n for n in nodes if n.cd_uid and n.cd_uid not in known_uids), key=lambda n: n.name)


def unlabel_patch(node: NodeView) -> list[dict[str, Any]]:
    """Remove the CD label only if it still names the same domain (a failed test is a 422, not a write)."""
    return [
        {"op": "test", "path": _LABEL_PATH, "value": node.cd_uid},
        {"op": "remove", "path": _LABEL_PATH},
    ]
