"""Our pod's Ready condition -> our entry's status."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from computedomain.api.models import ReadyStatus
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient
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


async def test_mirror_writes_only_on_change(monkeypatch: pytest.MonkeyPatch) -> None:
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
    mirror = ReadinessMirror(cast(KubeClient, api), registry, namespace="ns", pod_name="p", pod_uid="u1")
    current: dict[str, Any] = {"pod": pod(ready="False")}
    monkeypatch.setattr(mirror.informer, "get", lambda name, namespace=None: current["pod"])

    def status() -> str:
        obj = api.read(COMPUTE_DOMAIN_CLIQUES, "ns", f"{cd}.c.0")
        assert obj is not None
        return str(obj["daemons"][0]["status"])

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
