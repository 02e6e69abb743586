"""Our pod's Ready condition -> our entry's status."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any, cast

import pytest

from computedomain.api.models import ReadyStatus
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient
from computedomain.kube.clock import FakeClock
from imex.daemon.check import CheckResult
from imex.daemon.readiness import ReadinessMirror, pod_status
from imex.daemon.registration import CliqueBackend, Identity, Registry, pod_owner_reference
from tests.unit.imex.daemon.fakes import FakeApi


def pod(phase: str = "Running", ready: str | None = "True", uid: str = "u1") -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready})
    return {"metadata": {"name": "p", "uid": uid}, "status": {"phase": phase, "conditions": conditions}}


@pytest.mark.parametrize(
    ("obj", "want"),
    [
        (pod(), ReadyStatus.READY),
        (pod(ready="False"), ReadyStatus.NOT_READY),
        (pod(ready="Unknown"), ReadyStatus.NOT_READY),
        (pod(ready=None), ReadyStatus.NOT_READY),
        (pod(phase="Pending"), ReadyStatus.NOT_READY),
        (pod(phase="Failed"), ReadyStatus.NOT_READY),
        (pod(uid="someone-else"), None),
        (None, None),
    ],
)
def test_pod_status(obj: dict[str, Any] | None, want: ReadyStatus | None) -> None:
    assert pod_status(obj, "u1") == want


async def registered() -> tuple[FakeApi, Registry, Callable[[], str]]:
    """A registered daemon's API, registry, and a reader of its entry's status."""
    api = FakeApi()
    cd = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"
    registry = Registry(
        cast(KubeClient, api),
        CliqueBackend(namespace="ns", cd_uid=cd, clique_id="c.0"),
        Identity("n1", "10.0.0.1", "c.0"),
        max_nodes=18,
        owner=pod_owner_reference("p", "u1"),
        rng=random.Random(0),
    )
    await registry.register()

    def status() -> str:
        obj = api.read(COMPUTE_DOMAIN_CLIQUES, "ns", f"{cd}.c.0")
        assert obj is not None
        return str(obj["daemons"][0]["status"])

    return api, registry, status


async def test_mirror_writes_only_on_change(monkeypatch: pytest.MonkeyPatch) -> None:
    api, registry, status = await registered()
    mirror = ReadinessMirror(cast(KubeClient, api), registry, namespace="ns", pod_name="p", pod_uid="u1")
    current: dict[str, Any] = {"pod": pod(ready="False")}
    monkeypatch.setattr(mirror.informer, "get", lambda name, namespace=None: current["pod"])

    assert await mirror.mirror_once() is ReadyStatus.NOT_READY
    assert mirror.writes == 0  # registered NotReady already
    current["pod"] = pod()
    assert await mirror.mirror_once() is ReadyStatus.READY
    assert status() == "Ready" and mirror.writes == 1
    await mirror.mirror_once()
    assert mirror.writes == 1
    current["pod"] = pod(ready="False")
    await mirror.mirror_once()
    assert status() == "NotReady" and mirror.writes == 2
    current["pod"] = pod(uid="replacement")
    assert await mirror.mirror_once() is None
    assert mirror.writes == 2


async def test_before_the_pods_first_ready_the_entry_follows_our_own_check(monkeypatch: pytest.MonkeyPatch) -> None:
    api, registry, status = await registered()
    answers: list[CheckResult | Exception] = []

    async def own_check() -> CheckResult:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    mirror = ReadinessMirror(
        cast(KubeClient, api), registry, namespace="ns", pod_name="p", pod_uid="u1", own_check=own_check
    )
    current: dict[str, Any] = {"pod": pod(ready="False")}
    monkeypatch.setattr(mirror.informer, "get", lambda name, namespace=None: current["pod"])

    not_ready = CheckResult(False, "IMEX daemon not ready: state WAITING_FOR_PEERS")
    answers[:] = [not_ready, OSError("ctl gone"), CheckResult(True, "READY")]
    assert await mirror.early_once() is False and await mirror.mirror_once() is ReadyStatus.NOT_READY
    assert await mirror.early_once() is False and await mirror.mirror_once() is ReadyStatus.NOT_READY
    assert mirror.writes == 0
    # IMEX is READY before the kubelet's startup probe asked: the entry is Ready now.
    assert await mirror.early_once() is False and await mirror.mirror_once() is ReadyStatus.READY
    assert status() == "Ready" and mirror.writes == 1
    # ... and not ready again before that probe: NotReady again.
    answers[:] = [not_ready, CheckResult(True, "READY")]
    await mirror.early_once()
    assert await mirror.mirror_once() is ReadyStatus.NOT_READY and status() == "NotReady"
    await mirror.early_once()
    assert await mirror.mirror_once() is ReadyStatus.READY and mirror.writes == 3
    # The kubelet marks the pod Ready: from now on its condition alone decides, and the check is not asked.
    current["pod"] = pod()
    assert await mirror.mirror_once() is ReadyStatus.READY and mirror.writes == 3
    assert await mirror.early_once() is True and answers == []
    current["pod"] = pod(ready="False")
    assert await mirror.mirror_once() is ReadyStatus.NOT_READY and status() == "NotReady"


async def test_the_early_check_begins_when_imex_is_spawned_and_asks_often_at_first() -> None:
    """No query before nvidia-imex exists; then 20 ms, 30 ms, 45 ms ... apart (at most 1 s), so a daemon
    READY a tenth of a second after its spawn is seen within a few hundredths."""
    api, registry, _status = await registered()
    clock = FakeClock()
    asked: list[float] = []

    async def own_check() -> CheckResult:
        asked.append(clock.now())
        return CheckResult(False, "IMEX daemon not ready: state UNAVAILABLE")

    spawned = asyncio.Event()
    mirror = ReadinessMirror(
        cast(KubeClient, api), registry, namespace="ns", pod_name="p", pod_uid="u1",
        clock=clock, own_check=own_check, imex_started=spawned,
    )  # fmt: skip
    poll = asyncio.create_task(mirror._until_pod_ready())
    try:
        await clock.advance(5.0)
        assert asked == [], "asked before nvidia-imex was spawned"
        spawned.set()
        start = clock.now()
        await clock.advance(6.0)
        gaps = [b - a for a, b in zip([start, *asked], asked, strict=False)]
        assert gaps[:6] == pytest.approx([0.0, 0.02, 0.03, 0.045, 0.0675, 0.10125])
        assert max(gaps) == pytest.approx(1.0) and sum(1 for at in asked if at - start <= 0.2) == 5
    finally:
        poll.cancel()
        await asyncio.gather(poll, return_exceptions=True)
