"""Process helpers: the SIGUSR2 task dump, CDs-by-status metrics."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace
from typing import Any

from computedomain.controller.app import _DomainStatusCollector, dump_tasks
from tests.unit.controller.helpers import compute_domain


async def test_dump_tasks_names_every_task() -> None:
    async def parked() -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(parked(), name="parked-for-the-dump")
    await asyncio.sleep(0)
    out = io.StringIO()
    dump_tasks(out)
    task.cancel()
    text = out.getvalue()
    assert "asyncio tasks" in text and "parked-for-the-dump" in text and "parked" in text


def test_domains_by_status() -> None:
    ready = {"status": "Ready"}
    cds = [
        compute_domain(status=ready),
        compute_domain(status=ready),
        compute_domain(status={"status": "NotReady"}),
        compute_domain(),
        compute_domain(deleting=True, status=ready),
    ]
    collector = _DomainStatusCollector()
    fake: Any = SimpleNamespace(cds=SimpleNamespace(synced=True, list=lambda: cds))
    collector.caches = fake
    families = {f.name: {s.labels["status"]: s.value for s in f.samples} for f in collector.collect()}
    assert families["computedomain_compute_domains"] == {"Ready": 2, "NotReady": 1, "Unknown": 1, "Terminating": 1}
    assert families["nvidia_dra_compute_domain_info"] == {"Ready": 2, "NotReady": 1}
