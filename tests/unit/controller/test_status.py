"""Status aggregation: entries, the global verdict, the Ready condition, change detection, Events."""

from __future__ import annotations

from datetime import timedelta

import pytest

from computedomain.api.models import ComputeDomainNode, ComputeDomainStatus, ReadyStatus
from computedomain.controller import status
from tests.unit.controller.helpers import NOW, clique, compute_domain, pod


def _node(name: str, state: str = "Ready", clique_id: str = "c.1", index: int = 0) -> ComputeDomainNode:
    return ComputeDomainNode.model_validate(
        {"name": name, "ipAddress": "10.0.0.1", "cliqueID": clique_id, "index": index, "status": state}
    )


def test_entries_from_cliques_and_non_fabric_pods() -> None:
    c1 = clique("c.1", ("gb-2", "10.0.0.2", 1, "Ready"), ("gb-1", "10.0.0.1", 0, "NotReady"))
    pods = [
        pod("cpu-1", ip="10.0.1.1", ready=True),
        pod("cpu-2", ip="10.0.1.2", ready=False),
        pod("gb-1", clique_id="c.1"),  # a fabric pod: its entry comes from the clique
        pod("gb-9", clique_id=None),  # not labelled yet: a fabric pod, no entry of its own
        pod("cpu-3", ip=""),  # no IP yet
    ]
    entries = status.node_entries([c1], pods)
    assert [(n.name, n.clique_id, n.index, n.status.value) for n in entries] == [
        ("cpu-1", "", -1, "Ready"),
        ("cpu-2", "", -1, "NotReady"),
        ("gb-1", "c.1", 0, "NotReady"),
        ("gb-2", "c.1", 1, "Ready"),
    ]


@pytest.mark.parametrize(
    ("nodes", "num_nodes", "state", "reason", "message"),
    [
        ([], 0, "Ready", "NoDaemonsExpected", "no daemons registered yet"),
        ([], 2, "NotReady", "WaitingForDaemons", "0 of 2 expected daemons registered (spec.numNodes), 0 ready"),
        ([_node("a"), _node("b")], 2, "Ready", "DaemonsReady", "2 of 2 daemons ready"),
        (
            [_node("a"), _node("gb-7", "NotReady"), _node("c"), _node("d", "NotReady")],
            0,
            "NotReady",
            "DaemonsNotReady",
            "2 of 4 daemons ready; node gb-7: NotReady, node d: NotReady",
        ),
        (
            [_node("a"), _node("b", "NotReady")],
            4,
            "NotReady",
            "WaitingForDaemons",
            "2 of 4 expected daemons registered (spec.numNodes), 1 ready; node b: NotReady",
        ),
        ([_node(f"n{i}", "NotReady") for i in range(7)], 0, "NotReady", "DaemonsNotReady", "and 2 more"),
    ],
)
def test_assess(nodes: list[ComputeDomainNode], num_nodes: int, state: str, reason: str, message: str) -> None:
    verdict = status.assess(nodes, num_nodes)
    assert (verdict.status.value, verdict.reason) == (state, reason)
    assert message in verdict.message


def test_build_status_omits_empty_nodes_and_keeps_transition_time() -> None:
    cd = compute_domain()
    first = status.build_status(cd, status.assess([], 0), [], NOW)
    assert "nodes" not in first.to_api()
    assert first.to_api()["conditions"][0]["status"] == "True"
    later = cd.model_copy(update={"status": first})
    same = status.build_status(later, status.assess([_node("a")], 0), [_node("a")], NOW + timedelta(minutes=5))
    assert same.conditions is not None and same.conditions[0].last_transition_time == NOW
    flipped = status.build_status(later, status.assess([_node("a", "NotReady")], 0), [], NOW + timedelta(minutes=5))
    assert flipped.conditions is not None and flipped.conditions[0].last_transition_time == NOW + timedelta(minutes=5)
    assert flipped.to_api()["nodes"] if flipped.nodes else True


def test_index_is_always_serialized() -> None:
    s = status.build_status(compute_domain(), status.assess([_node("a", index=0)], 0), [_node("a", index=0)], NOW)
    assert s.to_api()["nodes"] == [
        {"name": "a", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 0, "status": "Ready"}
    ]


def test_status_differs_ignores_order_and_timestamps() -> None:
    cd = compute_domain()
    a = status.build_status(cd, status.assess([_node("a"), _node("b")], 0), [_node("a"), _node("b")], NOW)
    b = status.build_status(
        cd, status.assess([_node("b"), _node("a")], 0), [_node("b"), _node("a")], NOW + timedelta(1)
    )
    assert not status.status_differs(a, b)
    c = status.build_status(cd, status.assess([_node("a"), _node("b", "NotReady")], 0), [_node("a")], NOW)
    assert status.status_differs(a, c)
    assert status.status_differs(None, a)
    assert status.status_differs(ComputeDomainStatus(status=ReadyStatus.READY), a)


def test_transition_events() -> None:
    cd = compute_domain()
    ready = status.build_status(cd, status.assess([], 0), [], NOW)
    assert [(e.type, e.reason) for e in status.transition_events(cd, ready)] == [("Normal", "Ready")]
    # The first NotReady of a new domain is expected, not worth a warning.
    waiting = status.build_status(cd, status.assess([], 2), [], NOW)
    assert status.transition_events(cd, waiting) == []
    was_ready = cd.model_copy(update={"status": ready})
    down = status.build_status(was_ready, status.assess([_node("gb-7", "NotReady")], 0), [], NOW)
    events = status.transition_events(was_ready, down)
    assert [(e.type, e.reason) for e in events] == [("Warning", "NotReady")]
    assert "node gb-7: NotReady" in events[0].message
    # Same verdict again: nothing new to tell.
    was_down = cd.model_copy(update={"status": down})
    assert status.transition_events(was_down, down) == []


def test_a_node_that_is_not_ready_is_lost() -> None:
    from computedomain.controller.observed import decode_node

    def raw(ready: str | None) -> dict[str, object]:
        conditions = (
            []
            if ready is None
            else [
                {
                    "type": "Ready",
                    "status": ready,
                    "reason": "NodeStatusUnknown",
                    "lastTransitionTime": "2026-11-29T12:00:00Z",
                }
            ]
        )
        return {"metadata": {"name": "gb-1", "resourceVersion": "1"}, "status": {"conditions": conditions}}

    assert decode_node(raw("True")).lost == ""
    assert decode_node(raw(None)).lost == "", "no condition yet: not known to be lost"
    assert decode_node(raw("Unknown")).lost == "Ready=Unknown since 2026-11-29T12:00:00Z: NodeStatusUnknown"
    assert status.lost_nodes([decode_node(raw("False")), decode_node(raw("True"))]) == {
        "gb-1": "Ready=False since 2026-11-29T12:00:00Z: NodeStatusUnknown"
    }


def test_only_more_progress_of_a_waiting_domain_may_wait_for_the_next_write() -> None:
    cd = compute_domain()

    def verdict(nodes: list[ComputeDomainNode], num_nodes: int) -> ComputeDomainStatus:
        return status.build_status(cd, status.assess(nodes, num_nodes), nodes, NOW)

    none_yet = verdict([], 3)
    one = verdict([_node("a", "NotReady")], 3)
    all_registered = verdict([_node("a"), _node("b", "NotReady"), _node("c", "NotReady")], 3)
    two_ready = verdict([_node("a"), _node("b"), _node("c", "NotReady")], 3)
    ready = verdict([_node("a"), _node("b"), _node("c")], 3)
    # One more daemon registered or ready while the domain waits: progress.
    assert status.is_progress(none_yet, one)
    assert status.is_progress(one, all_registered)
    assert status.is_progress(all_registered, two_ready)
    # What someone waits for is never held: the first status, the flip to Ready and back.
    assert not status.is_progress(None, one)
    assert not status.is_progress(two_ready, ready)
    assert not status.is_progress(ready, two_ready)
    # A failure the controller reports, or a new generation of the spec, is no mere progress either.
    stuck = status.build_status(cd, status.failure_verdict("Forbidden", "may not create daemonsets"), [], NOW)
    assert not status.is_progress(one, stuck)
    assert not status.is_progress(stuck, one)
    newer = status.build_status(
        cd.model_copy(update={"metadata": cd.metadata.model_copy(update={"generation": 2})}),
        status.assess([_node("a"), _node("b", "NotReady")], 3),
        [],
        NOW,
    )
    assert not status.is_progress(one, newer)
