"""Process helpers: the SIGUSR2 task dump, CDs-by-status metrics."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace
from typing import Any

from computedomain.controller.app import _DomainStatusCollector, dump_tasks
from tests.unit.controller.helpers import clique, compute_domain


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
    nodes = [{"name": "n1", "ipAddress": "10.0.0.1", "cliqueID": "", "index": 0, "status": "NotReady"}]
    cds = [
        compute_domain(uid="u-a", name="a", status=ready),
        compute_domain(uid="u-b", name="b", status=ready),
        compute_domain(uid="u-c", name="c", status={"status": "NotReady", "nodes": nodes}),
        compute_domain(uid="u-d", name="d"),
        compute_domain(uid="u-e", name="e", deleting=True, status=ready),
    ]
    cliques = [
        clique("c1", ("n1", "10.0.0.1", 0, "Ready"), ("n2", "10.0.0.2", 1, "NotReady"), uid="u-a"),
        clique("c2", ("n3", "10.0.0.3", 0, "Ready"), uid="u-a"),
    ]
    collector = _DomainStatusCollector()
    fake: Any = SimpleNamespace(cds=SimpleNamespace(synced=True, list=lambda: cds), all_cliques=lambda: cliques)
    collector.caches = fake
    families = {f.name: f.samples for f in collector.collect()}

    def by(name: str, *labels: str) -> dict[tuple[str, ...], float]:
        return {tuple(s.labels[k] for k in labels): s.value for s in families[name]}

    assert by("computedomain_compute_domains", "status") == {
        ("Ready",): 2, ("NotReady",): 1, ("Unknown",): 1, ("Terminating",): 1
    }  # fmt: skip
    assert by("nvidia_dra_compute_domain_info", "status") == {("Ready",): 2, ("NotReady",): 1}
    # Per domain, terminating ones left out; daemons from the domain's cliques, else its status.nodes.
    assert by("computedomain_compute_domain_ready", "cd_namespace", "cd_name") == {
        ("team", "a"): 1, ("team", "b"): 1, ("team", "c"): 0, ("team", "d"): 0
    }  # fmt: skip
    daemons = by("computedomain_imex_daemons", "cd_name", "status")
    assert daemons == {
        ("a", "Ready"): 2, ("a", "NotReady"): 1, ("b", "Ready"): 0, ("b", "NotReady"): 0,
        ("c", "Ready"): 0, ("c", "NotReady"): 1, ("d", "Ready"): 0, ("d", "NotReady"): 0,
    }  # fmt: skip
