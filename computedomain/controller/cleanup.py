"""Orphans: children, node labels and cliques whose ComputeDomain is gone.

A domain's teardown normally removes everything; orphans appear when a domain vanished without it (finalizer
removed by hand, a crash of an older version, a node labelled after teardown). The sweep runs at start,
periodically, and whenever an event shows an object labelled for a domain the CD cache does not know.

Two steps, both pure here: ``candidates`` picks, from the caches, what is labelled for a domain the CD cache
does not know; ``confirm`` keeps only candidates whose domain is also missing from a fresh, consistent list
of ComputeDomains read from the apiserver. A domain that is merely missing from a lagging cache is never
treated as deleted. What a confirmed orphan gets: children are deleted and, once terminating, released from
our finalizer; node labels are removed (``nodes.unlabel_patch``); cliques are deleted (their daemons, if any
remain, are orphans of the same domain and go with the DaemonSet).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from computedomain.api.models import ComputeDomainClique
from computedomain.controller.nodes import stale_labels
from computedomain.controller.observed import Child, NodeView


@dataclass(frozen=True)
class Orphans:
    children: tuple[Child, ...] = ()
    nodes: tuple[NodeView, ...] = ()
    cliques: tuple[ComputeDomainClique, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.children or self.nodes or self.cliques)

    @property
    def uids(self) -> set[str]:
        return {c.cd_uid for c in self.children} | {n.cd_uid for n in self.nodes} | {c.domain_uid for c in self.cliques}

    def describe(self) -> str:
        parts = [str(c) for c in self.children]
        parts += [f"label on node {n.name}" for n in self.nodes]
        parts += [f"clique {c.metadata.namespace}/{c.metadata.name}" for c in self.cliques]
        return ", ".join(parts)


def candidates(
    children: Iterable[Child],
    nodes: Iterable[NodeView],
    cliques: Iterable[ComputeDomainClique],
    known_uids: Collection[str],
) -> Orphans:
    """Everything labelled for a domain that ``known_uids`` (the CD cache) does not contain."""
    return Orphans(
        children=tuple(
            sorted(
                (c for c in children if c.cd_uid and c.cd_uid not in known_uids),
                key=lambda c: (c.kind, c.namespace, c.name),
            )
        ),
        nodes=tuple(stale_labels(nodes, known_uids)),
        cliques=tuple(
            sorted(
                # One being deleted already waits for its finalizer (a channel record: for its claims).
                (
                    c
                    for c in cliques
                    if c.domain_uid and c.domain_uid not in known_uids and c.metadata.deletion_timestamp is None
                ),
                key=lambda c: (c.metadata.namespace, c.metadata.name),
            )
        ),
    )


def confirm(found: Orphans, live_uids: Collection[str]) -> Orphans:
    """Keep only the candidates whose domain the apiserver does not have either."""
    return Orphans(
        children=tuple(c for c in found.children if c.cd_uid not in live_uids),
        nodes=tuple(n for n in found.nodes if n.cd_uid not in live_uids),
        cliques=tuple(c for c in found.cliques if c.domain_uid not in live_uids),
    )
