"""System benchmark (SPEC section 9): a 72-node ComputeDomain over 4 simulated NVL72 cliques, end to end.

The chart is installed by helm on 4 racks x 18 trays (tests/testbed/sim; node agents and IMEX daemons 18 to a
process, each daemon with its own IMEX simulator process), then, per round, one ComputeDomain and one
workload pod per node are created at once (`kubectl apply`). Timestamps come from watch events seen by this
process (one clock):

- last daemon READY -> CD Ready: from the moment the last of the 72 clique entries turns Ready (each daemon
  reports READY there, from its pod's Ready condition, which the kubelet's probe of `nvidia-imex-ctl -q` sets)
  to the moment the ComputeDomain's status turns Ready. Target: < 2 s (p99 < 0.5 s for the event-driven path);
- whole bring-up: from `kubectl apply` of the CD and the 72 pods until the CD is Ready and all 72 pods Run.

Rounds are few (each costs 72 daemons and IMEX simulators on two shared cores): medians over what ran.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, PODS, Raw
from computedomain.kube.informer import Informer
from tests.testbed.cluster import LocalCluster
from tests.testbed.sim.cluster import SimCluster, SimConfig, eventually
from tests.testbed.sim.pods import Hosting

RACKS = 4
ROUNDS = 1
NODES = RACKS * 18


class Clock:
    """Watch-driven milestones of one round."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, str]] = {}
        self.all_ready_at: float | None = None
        self.cd_ready_at: float | None = None
        self.pods_running: set[str] = set()
        self.pods_done_at: float | None = None
        self.first_entry_at: float | None = None

    def clique(self, obj: Raw) -> None:
        now = time.monotonic()
        self.entries[obj["metadata"]["name"]] = {d["nodeName"]: d.get("status", "") for d in obj.get("daemons") or ()}
        if self.first_entry_at is None and any(self.entries.values()):
            self.first_entry_at = now
        statuses = [s for c in self.entries.values() for s in c.values()]
        if self.all_ready_at is None and len(statuses) == NODES and all(s == "Ready" for s in statuses):
            self.all_ready_at = now

    def cd(self, obj: Raw) -> None:
        if self.cd_ready_at is None and (obj.get("status") or {}).get("status") == "Ready":
            self.cd_ready_at = time.monotonic()

    def pod(self, obj: Raw) -> None:
        if (obj.get("status") or {}).get("phase") == "Running":
            self.pods_running.add(obj["metadata"]["name"])
        if self.pods_done_at is None and len(self.pods_running) >= NODES:
            self.pods_done_at = time.monotonic()


async def one_round(sim: SimCluster, index: int) -> dict[str, float]:
    assert sim.client is not None
    clock = Clock()
    informers: list[Informer[Raw]] = [
        Informer(sim.client, COMPUTE_DOMAIN_CLIQUES, decode=lambda r: r, namespace=sim.driver_ns),
        Informer(sim.client, COMPUTE_DOMAINS, decode=lambda r: r, namespace=sim.workload_ns),
        Informer(sim.client, PODS, decode=lambda r: r, namespace=sim.workload_ns),
    ]
    for informer, handler in zip(informers, (clock.clique, clock.cd, clock.pod), strict=True):
        informer.add_handler(on_add=handler, on_update=lambda _o, n, h=handler: h(n))  # type: ignore[misc]
    tasks = [asyncio.create_task(i.run()) for i in informers]
    for informer in informers:
        await informer.has_synced()
    name = f"bench-{index}"
    objects: list[dict[str, Any]] = [sim.compute_domain(name, num_nodes=NODES)]
    objects += [sim.workload_pod(f"{name}-{n.name}", name, n.name) for n in sim.topology]
    start = time.monotonic()
    await asyncio.to_thread(sim.apply, objects)

    async def done() -> bool:
        return bool(clock.cd_ready_at and clock.pods_done_at)

    try:
        await eventually(done, within=900, what="72-node domain Ready and 72 pods Running", interval=0.5)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert clock.cd_ready_at and clock.pods_done_at and clock.all_ready_at
    result = {
        "last daemon READY -> CD Ready (s)": clock.cd_ready_at - clock.all_ready_at,
        "kubectl create -> first daemon registered (s)": (clock.first_entry_at or start) - start,
        "kubectl create -> last daemon READY (s)": clock.all_ready_at - start,
        "kubectl create -> CD Ready (s)": clock.cd_ready_at - start,
        "kubectl create -> all 72 pods Running (s)": clock.pods_done_at - start,
    }
    pods = [p["metadata"]["name"] for p in sim.items("pods", sim.workload_ns)]
    await sim.akubectl("delete", "pods", "-n", sim.workload_ns, "--wait=true", "--timeout=300s", *pods)
    await sim.delete_compute_domains(within=300)
    return result


async def main() -> None:
    config = SimConfig(
        racks=RACKS,
        trays_per_rack=18,
        non_fabric=0,
        hosting=Hosting(
            plugins_per_host=18, daemons_per_host=18, fast_imex_ctl=True, imex_heartbeat_s=2.0, imex_heartbeat_misses=10
        ),
        restart_backoff_s=2.0,
        log_level="warning",
    )
    start = time.monotonic()
    async with SimCluster(LocalCluster(), config) as sim:
        await sim.wait_installed(within=600)
        print(
            f"simulated cluster: {NODES} nodes in {RACKS} cliques, chart installed and every node agent Ready "
            f"in {time.monotonic() - start:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in sim.timings.items())})",
            flush=True,
        )
        rounds = []
        for index in range(ROUNDS):
            result = await one_round(sim, index)
            rounds.append(result)
            print(f"round {index}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
        print(f"\n{'72-node domain, 4 cliques':48} {'median':>8} {'max':>8}   (n={len(rounds)})")
        for key in rounds[0]:
            values = [r[key] for r in rounds]
            print(f"  {key:46} {statistics.median(values):8.2f} {max(values):8.2f}")
        target = statistics.median(r["last daemon READY -> CD Ready (s)"] for r in rounds)
        print(f"  SPEC 9: CD Ready < 2 s after the last daemon READY: {'met' if target < 2 else 'NOT met'}")
