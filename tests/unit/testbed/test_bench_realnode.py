"""The real-node benchmark reads Prepare and Unprepare durations from the node agent's own exposition: the
series it parses are the ones `plugin.metrics` exports, and a sample is one call's duration or nothing. Its
driverManaged floor counts the kubelet's and nvidia-imex's parts of a first pod's chain and nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from computedomain.metrics import generate_latest
from computedomain.plugin.metrics import Instrumented
from computedomain.plugin.preparer import ClaimRef, ClaimUid, PrepareResult, UnprepareResult
from tests.bench.realnode import Calls, _floor

DRIVER = "bench.compute-domain.nvidia.com"  # a label of its own: the registry is process-wide


class Slow:
    """A Preparer whose calls take what the fake clock says."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock = clock
        self.seconds = seconds

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        self.clock[0] += self.seconds
        return {c.uid: PrepareResult() for c in claims}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        self.clock[0] += self.seconds / 10
        return {c.uid: UnprepareResult() for c in claims}


def scrape() -> Calls:
    return Calls.parse(generate_latest().decode(), driver=DRIVER)


async def test_one_call_between_two_scrapes_is_its_duration_two_are_none() -> None:
    clock = [100.0]
    inner = Slow(clock, 0.25)
    agent = Instrumented(inner, driver=DRIVER, clock=lambda: clock[0])
    claim = ClaimRef("ns", "c", ClaimUid("uid-1"))
    before = scrape()
    assert before.inflight == {"prepare": 0.0, "unprepare": 0.0}
    await agent.prepare([claim])
    one = scrape()
    assert one.since(before, "prepare") == 0.25
    assert one.since(before, "unprepare") is None  # no call: no sample
    await agent.unprepare([claim])
    assert scrape().since(one, "unprepare") == pytest.approx(0.025)
    inner.seconds = 1.0
    await agent.prepare([claim])
    await agent.prepare([claim])
    assert scrape().since(one, "prepare") is None  # two calls: which took how long is unknown
    assert Calls.parse(generate_latest().decode()).since(before, "prepare") is None  # another driver's series


def test_the_floor_leaves_out_the_wrapper_and_the_node_agent_and_needs_every_mark() -> None:
    marks = {"daemon-process": 0.5, "daemon-starting": 0.8, "imex-started": 0.9, "daemon-ready": 1.0,
             "entry-ready": 1.02, "agent-prepared": 1.05, "running": 1.25}  # fmt: skip
    # 0.5 to the wrapper's start, 0.1 of nvidia-imex, 0.2 of the kubelet after Prepare
    assert _floor(marks) == pytest.approx(0.8)
    assert _floor({**marks, "daemon-starting": 0.6}) == pytest.approx(0.8)  # the wrapper's own time is not in it
    for step in ("daemon-process", "imex-started", "daemon-ready", "agent-prepared", "running"):
        assert _floor({k: v for k, v in marks.items() if k != step}) is None, step
