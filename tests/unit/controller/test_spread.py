"""A domain whose nodes are in several NVLink cliques, or in none, says so: the SpansCliques condition names
the nodes of each group, and a Warning Event says so when the set of groups changes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from computedomain.api.models import ComputeDomainStatus
from computedomain.controller import spread
from computedomain.controller.observed import Observed
from computedomain.controller.reconcile import desired_status
from computedomain.controller.status import EventSpec
from tests.unit.controller.helpers import NOW, clique, compute_domain, pod, settings


@dataclass
class _Write:
    status: ComputeDomainStatus
    events: list[EventSpec]


def _write(observed: Observed) -> _Write:
    new = desired_status(observed, settings(), NOW)
    return _Write(new, spread.span_events(observed.cd, new))


def _span(write: _Write) -> str | None:
    found = spread.current(write.status)
    return found.message if found else None


def test_one_clique_has_no_condition() -> None:
    ready = Observed(cd=compute_domain(finalizers=()))
    one = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), ("gb-2", "10.0.0.2", 1, "Ready"))
    observed = replace(ready, cliques=(one,), pods=(pod("gb-1", clique_id="c.1"), pod("gb-2", clique_id="c.1")))
    write = _write(observed)
    assert _span(write) is None and not [e for e in write.events if e.reason == spread.EVENT_REASON]


def test_two_cliques_and_a_node_without_one_are_named_with_an_event_per_change_of_groups() -> None:
    ready = Observed(cd=compute_domain(finalizers=()))
    c1 = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"))
    c2 = clique("c.2", ("gb-9", "10.0.0.9", 0, "Ready"))
    pods = (pod("gb-1", clique_id="c.1"), pod("gb-9", clique_id="c.2"))
    first = _write(replace(ready, cliques=(c1, c2), pods=pods))
    message = _span(first)
    assert message is not None and "2 NVLink cliques (clique c.1: gb-1; clique c.2: gb-9)" in message
    assert spread.current(first.status).reason == spread.REASON_SPANS_CLIQUES  # type: ignore[union-attr]
    (event,) = [e for e in first.events if e.reason == spread.EVENT_REASON]
    assert event.type == "Warning" and "gb-1" in event.message and "gb-9" in event.message

    # Another node joins c.1: the condition names it, but the groups are the same: no new Event.
    stored = replace(ready, cd=ready.cd.model_copy(update={"status": first.status}))
    c1b = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), ("gb-2", "10.0.0.2", 1, "Ready"))
    second = _write(replace(stored, cliques=(c1b, c2), pods=(*pods, pod("gb-2", clique_id="c.1"))))
    assert "clique c.1: gb-1, gb-2" in (_span(second) or "")
    assert not [e for e in second.events if e.reason == spread.EVENT_REASON]

    # A node without a clique joins: a new group, a new Event naming it.
    stored = replace(ready, cd=ready.cd.model_copy(update={"status": second.status}))
    third = _write(replace(stored, cliques=(c1b, c2), pods=(*pods, pod("gb-2", clique_id="c.1"), pod("cpu-1"))))
    assert "no clique: cpu-1" in (_span(third) or "")
    (event,) = [e for e in third.events if e.reason == spread.EVENT_REASON]
    assert "cpu-1" in event.message


def test_only_nodes_without_a_clique_and_bounded_names() -> None:
    nodes = [f"cpu-{i:02d}" for i in range(20)]
    ready = Observed(cd=compute_domain(finalizers=()))
    write = _write(replace(ready, pods=tuple(pod(n) for n in nodes)))
    condition = spread.current(write.status)
    assert condition is not None and condition.reason == spread.REASON_WITHOUT_CLIQUE
    assert "nodes without an NVLink clique (no clique: cpu-00," in condition.message
    assert "and 12 more" in condition.message and "cpu-19" not in condition.message
