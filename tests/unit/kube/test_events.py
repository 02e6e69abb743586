"""Event de-duplication: count bumps instead of new Events, a per-object spam filter, coalesced writes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import pytest

from computedomain.kube.client import COMPUTE_DOMAINS, EVENTS, NODES, Raw, Resource
from computedomain.kube.clock import FakeClock
from computedomain.kube.errors import Forbidden, NotFound, Transient
from computedomain.kube.events import EventCorrelator, EventRecorder, EventType, ObjectRef

pytestmark = pytest.mark.timeout(5)

CD = ObjectRef(kind="ComputeDomain", api_version="resource.nvidia.com/v1beta1", name="cd", namespace="ns", uid="u-1")


class FakeSink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Raw]] = []
        self.fail_next: list[Exception] = []

    def _maybe_fail(self) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)

    async def _wire(self, name: str) -> None:
        """Where a write is on the wire (instant here)."""

    async def create(self, resource: Resource, body: Mapping[str, Any], *, namespace: str | None = None) -> Raw:
        assert resource is EVENTS
        await self._wire(str(body["metadata"]["name"]))
        self._maybe_fail()
        self.calls.append(("create", str(body["metadata"]["name"]), dict(body)))
        return dict(body)

    async def merge_patch(
        self,
        resource: Resource,
        name: str,
        patch: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> Raw:
        await self._wire(name)
        self._maybe_fail()
        self.calls.append(("patch", name, dict(patch)))
        return dict(patch)

    @property
    def actions(self) -> list[str]:
        return [c[0] for c in self.calls]


def observe(c: EventCorrelator, message: str = "2 of 4 daemons ready", ref: ObjectRef = CD) -> str:
    """One occurrence, with its write (if any) taken by the writer at once."""
    d = c.observe(ref, "Normal", "NotReady", message, name="n", namespace="ns")
    d.entry.pending = False
    return d.action


def test_occurrences_while_a_write_is_queued_coalesce_without_spending_budget() -> None:
    c = EventCorrelator(clock=FakeClock(), burst=2)
    first = c.observe(CD, "Normal", "NotReady", "m", name="n", namespace="ns")
    assert first.action == "create"
    for _ in range(50):
        assert c.observe(CD, "Normal", "NotReady", "m", name="n", namespace="ns").action == "coalesce"
    assert first.entry.count == 51
    first.entry.pending = False
    assert observe(c, "m") == "patch"
    assert observe(c, "m") == "drop"


def test_first_occurrence_creates_then_repeats_patch() -> None:
    c = EventCorrelator(clock=FakeClock())
    assert [observe(c) for _ in range(4)] == ["create", "patch", "patch", "patch"]


def test_different_message_or_object_is_a_different_event() -> None:
    c = EventCorrelator(clock=FakeClock())
    other = ObjectRef(kind="ComputeDomain", api_version="resource.nvidia.com/v1beta1", name="cd2", namespace="ns")
    assert observe(c) == "create"
    assert observe(c, "3 of 4 daemons ready") == "create"
    assert observe(c, ref=other) == "create"
    assert observe(c) == "patch"


def test_window_expiry_starts_a_new_event() -> None:
    clock = FakeClock()
    c = EventCorrelator(clock=clock, window=600.0)
    assert observe(c) == "create"
    clock._now += 599.0
    assert observe(c) == "patch"
    clock._now += 601.0
    assert observe(c) == "create"


def test_spam_filter_bounds_writes_per_object() -> None:
    clock = FakeClock()
    c = EventCorrelator(clock=clock, burst=25, refill=300.0)
    actions = [observe(c) for _ in range(1000)]
    assert actions.count("create") == 1
    assert actions.count("patch") == 24
    assert actions.count("drop") == 975
    clock._now += 300.0
    assert observe(c) == "patch", "one more write per refill period"
    assert observe(c) == "drop"


async def test_recorder_coalesces_a_tight_loop_into_one_write() -> None:
    sink = FakeSink()
    rec = EventRecorder(sink, component="compute-domain-controller", instance="ctrl-0")
    for _ in range(100):
        rec.record(CD, EventType.WARNING, "DaemonNotReady", "node gb-7: IMEX WAITING_FOR_PEERS")
    await rec.flush()
    # The writer had not run yet: 99 occurrences coalesced into the queued create, which is sent with the
    # newest count: one API write for 100 occurrences.
    assert sink.actions == ["create"]
    _, name, body = sink.calls[0]
    assert body["count"] == 100
    assert body["type"] == "Warning"
    assert body["reason"] == "DaemonNotReady"
    assert body["involvedObject"] == {
        "kind": "ComputeDomain",
        "apiVersion": "resource.nvidia.com/v1beta1",
        "name": "cd",
        "namespace": "ns",
        "uid": "u-1",
    }
    assert body["metadata"]["namespace"] == "ns"
    assert body["source"] == {"component": "compute-domain-controller"}
    assert name.startswith("cd.")
    rec.record(CD, EventType.WARNING, "DaemonNotReady", "node gb-7: IMEX WAITING_FOR_PEERS")
    await rec.flush()
    assert sink.actions == ["create", "patch"]
    assert sink.calls[1][1] == name
    assert sink.calls[1][2]["count"] == 101
    await rec.aclose()


async def test_recorder_patches_after_each_flush() -> None:
    sink = FakeSink()
    rec = EventRecorder(sink, component="c", instance="i")
    for expected in (1, 2, 3):
        rec.record(CD, EventType.NORMAL, "Ready", "all daemons ready")
        await rec.flush()
        assert sink.calls[-1][2]["count"] == expected
    assert sink.actions == ["create", "patch", "patch"]
    await rec.aclose()


class HeldSink(FakeSink):
    """Writes for the Events of held objects wait until released; counts the writes on the wire at once."""

    def __init__(self, *held: str) -> None:
        super().__init__()
        self.gates = {name: asyncio.Event() for name in held}
        self.in_flight = 0
        self.most_in_flight = 0

    async def _wire(self, name: str) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            gate = self.gates.get(name.split(".")[0])
            if gate is not None:
                await gate.wait()
            await asyncio.sleep(0)
        finally:
            self.in_flight -= 1


def ref(name: str) -> ObjectRef:
    return ObjectRef(kind="ComputeDomain", api_version="resource.nvidia.com/v1beta1", name=name, namespace="ns")


async def test_writers_send_different_events_at_once_and_one_event_in_order() -> None:
    sink = HeldSink("slow")
    rec = EventRecorder(sink, component="c", instance="i", writers=4)
    for name in ("slow", "a", "b", "c"):
        rec.record(ref(name), EventType.NORMAL, "Ready", "all daemons ready")
    for _ in range(20):
        await asyncio.sleep(0)
    # The three others were written while the slow one's create was on the wire.
    assert [name.split(".")[0] for _a, name, _b in sink.calls] == ["a", "b", "c"]
    assert sink.most_in_flight >= 2
    # A repeat of the slow Event while its create is on the wire: an idle writer takes the patch and must
    # wait for the create rather than send the patch beside it (the apiserver would answer 404).
    rec.record(ref("slow"), EventType.NORMAL, "Ready", "all daemons ready")
    for _ in range(20):
        await asyncio.sleep(0)
    assert [name.split(".")[0] for _a, name, _b in sink.calls] == ["a", "b", "c"]
    sink.gates["slow"].set()
    await rec.flush()
    slow = [(action, body.get("count")) for action, name, body in sink.calls if name.startswith("slow.")]
    assert slow == [("create", 1), ("patch", 2)]
    await rec.aclose()


async def test_patch_of_expired_event_recreates_it() -> None:
    sink = FakeSink()
    rec = EventRecorder(sink, component="c", instance="i")
    rec.record(CD, EventType.NORMAL, "Ready", "all daemons ready")
    await rec.flush()
    sink.fail_next.append(NotFound('events "cd.1" not found', status=404))
    rec.record(CD, EventType.NORMAL, "Ready", "all daemons ready")
    await rec.flush()
    assert sink.actions == ["create", "create"]
    assert sink.calls[1][2]["count"] == 2
    assert sink.calls[0][1] != sink.calls[1][1]
    await rec.aclose()


async def test_write_failures_are_swallowed_and_a_later_patch_creates() -> None:
    sink = FakeSink()
    rec = EventRecorder(sink, component="c", instance="i")
    sink.fail_next.append(Transient("apiserver down"))
    rec.record(CD, EventType.WARNING, "Failed", "x")
    await rec.flush()
    assert sink.calls == []
    rec.record(CD, EventType.WARNING, "Failed", "x")
    await rec.flush()
    assert sink.actions == ["create"]
    assert sink.calls[0][2]["count"] == 2
    await rec.aclose()


async def test_cluster_scoped_object_events_go_to_default_namespace_and_long_messages_are_cut() -> None:
    sink = FakeSink()
    rec = EventRecorder(sink, component="c", instance="i")
    node = ObjectRef.for_object(NODES, {"metadata": {"name": "gb-7", "uid": "n-1"}})
    rec.record(node, EventType.WARNING, "LabelConflict", "x" * 5000)
    await rec.flush()
    body = sink.calls[0][2]
    assert body["metadata"]["namespace"] == "default"
    assert "namespace" not in body["involvedObject"]
    assert len(body["message"]) == 1024
    await rec.aclose()


def test_object_ref_for_namespaced_object() -> None:
    ref = ObjectRef.for_object(COMPUTE_DOMAINS, {"metadata": {"name": "cd", "namespace": "ns", "uid": "u"}})
    assert ref.to_dict() == {
        "kind": "ComputeDomain",
        "apiVersion": "resource.nvidia.com/v1beta1",
        "name": "cd",
        "namespace": "ns",
        "uid": "u",
    }


class BlockedSink(FakeSink):
    """A sink whose writes wait until released: the writer falls behind."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def create(self, resource: Resource, body: Mapping[str, Any], *, namespace: str | None = None) -> Raw:
        await self.release.wait()
        return await super().create(resource, body, namespace=namespace)


def drop_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Events not written" in r.getMessage()]


async def test_events_beyond_the_backlog_are_told_in_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    sink = BlockedSink()
    rec = EventRecorder(sink, component="c", instance="i", max_pending=3, summary_interval=60.0, clock=clock)
    refs = [ObjectRef(kind="ComputeDomain", api_version="v", name=f"cd{i}", namespace="ns") for i in range(50)]
    for ref in refs:
        rec.record(ref, EventType.NORMAL, "Ready", "ready")
    await clock.settle()
    assert drop_lines(caplog) == [], "nothing is said before the interval ends"
    await clock.advance(60.0)
    # Three were queued before the writer ran (and it still waits on the first): 47 were not written.
    assert drop_lines(caplog) == ["47 Events not written in the last 60s: 47 the writer's backlog was full"]
    sink.release.set()
    await rec.flush()
    assert len(sink.calls) == 3
    rec.record(refs[-1], EventType.NORMAL, "Ready", "ready")
    await rec.flush()
    assert sink.calls[-1][2]["involvedObject"]["name"] == "cd49", "a dropped Event is written at its next occurrence"
    await clock.advance(60.0)
    assert len(drop_lines(caplog)) == 1, "no line for an interval without drops"
    await rec.aclose()


async def test_failed_writes_are_summed_up_by_reason_not_logged_one_by_one(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    sink = FakeSink()
    rec = EventRecorder(sink, component="c", instance="i", summary_interval=60.0, clock=clock)
    sink.fail_next = [Forbidden("events is forbidden", status=403) for _ in range(20)]
    for i in range(20):
        rec.record(ObjectRef(kind="ComputeDomain", api_version="v", name=f"cd{i}"), EventType.NORMAL, "Ready", "x")
    await rec.flush()
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    await rec.aclose()
    assert drop_lines(caplog) == ["20 Events not written in the last 60s: 20 the write failed (Forbidden: 20)"]
