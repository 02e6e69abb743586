"""Whether a ComputeDomain's nodes share one NVLink clique: the ``SpansCliques`` condition and its Event.

Multi-Node NVLink does not cross cliques: a domain whose daemons run in two cliques is two IMEX domains, and
a node without a clique has no NVLink fabric at all, so a job placed like that silently falls back to slower
paths between the groups. Nothing fails, which is why it must be said: while the domain's nodes (its
``status.nodes``, driverManaged) are in more than one clique, or any of them in none, the condition
``SpansCliques`` is True with the nodes of each group named, and a Warning Event says so whenever the set
of groups changes (not at every node that joins a group). The condition goes once the nodes share one
clique again. Node names are bounded in the message, so a domain of a thousand nodes costs one short line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from computedomain.api.models import ComputeDomain, ComputeDomainNode, ComputeDomainStatus, Condition
from computedomain.controller.status import EventSpec, find_condition, true_condition

SPAN_CONDITION = "SpansCliques"
REASON_SPANS_CLIQUES = "MultipleCliques"
REASON_WITHOUT_CLIQUE = "NodesWithoutClique"
EVENT_REASON = "SpansCliques"
# Node names shown per group; the rest are counted.
SHOWN_PER_GROUP = 8


def groups(nodes: Sequence[ComputeDomainNode]) -> dict[str, list[str]]:
    """Clique ID ("" for none) -> the domain's node names in it, sorted."""
    out: dict[str, list[str]] = {}
    for node in nodes:
        out.setdefault(node.clique_id, []).append(node.name)
    return {clique: sorted(names) for clique, names in sorted(out.items())}


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN_PER_GROUP])
    more = len(names) - SHOWN_PER_GROUP
    return f"{shown} and {more} more" if more > 0 else shown


def message(by_clique: Mapping[str, Sequence[str]]) -> str:
    fabric = {c: n for c, n in by_clique.items() if c}
    parts = [f"clique {clique}: {_names(names)}" for clique, names in fabric.items()]
    if "" in by_clique:
        parts.append(f"no clique: {_names(by_clique[''])}")
    where = f"{len(fabric)} NVLink cliques" if len(fabric) > 1 else "nodes without an NVLink clique"
    return (
        f"the domain's nodes are in {where} ({'; '.join(parts)}); Multi-Node NVLink does not cross cliques, so "
        "its pods fall back to slower paths between these groups: keep a job's pods in one clique "
        "(node affinity on nvidia.com/gpu.clique)"
    )


def span_condition(cd: ComputeDomain, nodes: Sequence[ComputeDomainNode], now: datetime) -> Condition | None:
    """``SpansCliques`` while the nodes are in more than one clique or any in none; None otherwise."""
    by_clique = groups(nodes)
    if len(by_clique) < 2 and "" not in by_clique:
        return None
    reason = REASON_SPANS_CLIQUES if len([c for c in by_clique if c]) > 1 else REASON_WITHOUT_CLIQUE
    return true_condition(cd, SPAN_CONDITION, reason=reason, message=message(by_clique), now=now)


def with_span(cd: ComputeDomain, new: ComputeDomainStatus, now: datetime) -> ComputeDomainStatus:
    """``new`` with the condition set from its nodes, or removed."""
    condition = span_condition(cd, new.nodes or (), now)
    kept = [c for c in new.conditions or () if c.type != SPAN_CONDITION]
    return new.model_copy(update={"conditions": [*kept, condition] if condition else kept})


def current(status: ComputeDomainStatus | None) -> Condition | None:
    return find_condition(status, SPAN_CONDITION)


def span_events(cd: ComputeDomain, new: ComputeDomainStatus) -> list[EventSpec]:
    """A Warning naming the nodes when the set of groups changes while the condition is set."""
    if current(new) is None:
        return []
    before = set(groups(cd.status.nodes or ())) if cd.status and current(cd.status) is not None else set()
    after = set(groups(new.nodes or ()))
    if before == after:
        return []
    return [EventSpec("Warning", EVENT_REASON, current(new).message)]  # type: ignore[union-attr]
