"""Fleet benchmark: `BENCH_FLEET_NODES` (1,000) kwok nodes, `BENCH_FLEET_DOMAINS` (200) ComputeDomains created at
once, each of `nodes / domains` nodes of one rack: how long the controller takes to converge them all, how
many API requests it makes per domain lifecycle, and its memory over time.

What is real: the control plane, kwok keeping 1,000 Nodes Ready (its own process, one node lease renewal
per node every 150 s), the controller as a process (`tests.cluster.controller.proc`, the product's entry
point limited to the benchmark's namespace). What is simulated, by this process, per domain once the
controller's DaemonSet for it is observed: its daemons, i.e. one bound daemon Pod per node (kwok runs it:
Running, Ready, a pod IP), standing in for the DaemonSet controller, the scheduler and the kubelet, and
each daemon's own clique entry (upserted NotReady, then Ready), standing in for the IMEX daemon. Nodes are
not labelled with the domain, so the DaemonSet itself starts no pods (2 cores cannot run the scheduler's
DRA path for 1,000 pods as well; the 72-node benchmark runs that path for real).

Figures, each at the controller's shipped client limits and at a raised limit beside it (`BENCH_LIMITS`,
`BENCH_QPS`; targets checked on the defaults): create burst -> every domain Ready (observed), per domain
create -> Ready, last entry Ready -> CD Ready (the controller's reaction under load), API requests, writes,
status writes and Events per domain lifecycle (create -> Ready -> delete -> gone, from the controller's
metrics), controller RSS at the peak and after the deletes; series: domains Ready and controller RSS over
time. The stand-in daemon pods are owned by a ConfigMap of the benchmark, so the DaemonSet controller does
not adopt them (and delete them from nodes not labelled for the domain).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, DAEMONSETS, NODES, PODS, KubeClient, Raw
from computedomain.kube.errors import Conflict, NotFound
from computedomain.kube.informer import Informer
from tests.bench.controller import (
    ControllerProcess,
    delete_all,
    delete_pods,
    lifecycle,
    limits,
    per_limits,
    stand_in_daemon_pod,
    stand_in_owner,
)
from tests.bench.figures import Figure, Series, Target
from tests.bench.harness import Bench, cd_body, gather_limited, poll, wait_for
from tests.testbed.cluster import KWOK_NODE_ANNOTATION
from tests.testbed.nodes import gb200_node
from tests.testbed.sim.cluster import start_kwok, stop_kwok

SIMULATED = "1,000 kwok nodes; daemon pods and clique entries written by the benchmark in place of daemons"
RACK = 18


class Fleet:
    """The stand-in daemons and the watch-driven milestones of one round."""

    def __init__(
        self, client: KubeClient, driver_ns: str, cd_ns: str, nodes: list[str], per_domain: int, owner: dict[str, Any]
    ) -> None:
        self.client = client
        self.owner = owner
        self.driver_ns = driver_ns
        self.cd_ns = cd_ns
        self.nodes = nodes
        self.per_domain = per_domain
        self.created: dict[str, float] = {}  # CD uid -> create request sent
        self.slot: dict[str, int] = {}  # CD uid -> domain index (which nodes)
        self.ready_at: dict[str, float] = {}
        self.last_entry_at: dict[str, float] = {}
        self.started: set[str] = set()
        self.failures = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.t0 = 0.0
        self.curve: list[tuple[float, float]] = []
        self.rss_peak = 0.0

    def on_cd(self, raw: Raw) -> None:
        uid = raw["metadata"]["uid"]
        if (raw.get("status") or {}).get("status") == "Ready" and uid in self.created and uid not in self.ready_at:
            self.ready_at[uid] = time.monotonic()
            self.curve.append((self.ready_at[uid] - self.t0, len(self.ready_at)))

    def on_daemonset(self, raw: Raw) -> None:
        uid = (raw["metadata"].get("labels") or {}).get(COMPUTE_DOMAIN_LABEL, "")
        if uid in self.slot and uid not in self.started:
            self.started.add(uid)
            task = asyncio.create_task(self._daemons(uid))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def on_clique(self, raw: Raw) -> None:
        uid = raw["metadata"]["name"].partition(".")[0]
        entries = raw.get("daemons") or ()
        if uid in self.slot and sum(1 for d in entries if d.get("status") == "Ready") >= self.per_domain:
            self.last_entry_at.setdefault(uid, time.monotonic())

    async def _daemons(self, uid: str) -> None:
        index = self.slot[uid]
        nodes = self.nodes[index * self.per_domain : (index + 1) * self.per_domain]
        clique = f"{uuid.UUID(int=index // (RACK // self.per_domain or 1))}.1"
        try:
            pods = await asyncio.gather(*(self._pod(uid, node) for node in nodes))
            for state in ("NotReady", "Ready"):
                await asyncio.gather(*(self._entry(uid, clique, node, slot, pod, state)
                                       for slot, (node, pod) in enumerate(zip(nodes, pods, strict=True))))  # fmt: skip
        except Exception:  # a stand-in that failed: the domain is counted as a failure
            self.failures += 1

    async def _pod(self, uid: str, node: str) -> str:
        name = f"daemon-{uid[:8]}-{node}"
        pod = stand_in_daemon_pod(name, self.driver_ns, uid, node, self.owner)
        pod["spec"]["tolerations"] = [{"operator": "Exists"}]
        await self.client.create(PODS, pod)
        return name

    async def _entry(self, uid: str, clique: str, node: str, slot: int, pod: str, state: str) -> None:
        """Upsert this daemon's entry, as the daemon does (get, then create or replace; retry on conflict)."""
        name = f"{uid}.{clique}"
        entry = {"nodeName": node, "ipAddress": f"10.{slot}.0.1", "cliqueID": clique, "index": slot, "status": state}
        for _ in range(50):
            try:
                current = await self.client.get(COMPUTE_DOMAIN_CLIQUES, name, namespace=self.driver_ns)
            except NotFound:
                body = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainClique",
                        "metadata": {"name": name, "namespace": self.driver_ns, "labels": {COMPUTE_DOMAIN_LABEL: uid}},
                        "daemons": [entry]}  # fmt: skip
                with contextlib.suppress(Conflict):
                    await self.client.create(COMPUTE_DOMAIN_CLIQUES, body)
                    return
                continue
            daemons = [d for d in current.get("daemons") or () if d.get("nodeName") != node] + [entry]
            with contextlib.suppress(Conflict):
                await self.client.replace(COMPUTE_DOMAIN_CLIQUES, {**current, "daemons": daemons})
                return
        raise RuntimeError(f"clique {name}: too many conflicts")


def fleet_node(name: str, clique: str, kwok_value: str) -> dict[str, Any]:
    node = gb200_node(name, clique=clique)
    node["metadata"]["annotations"][KWOK_NODE_ANNOTATION] = kwok_value
    node["metadata"]["labels"]["computedomain-fleet"] = kwok_value
    return node


async def run(bench: Bench) -> None:
    section = bench.section
    all_limits = limits()
    node_count = bench.size("BENCH_FLEET_NODES", 1000, 10)
    domains = bench.size("BENCH_FLEET_DOMAINS", 200, 2)
    rounds = bench.size("BENCH_ROUNDS", 3, 1)
    per_domain = max(1, node_count // domains)
    section.note(
        f"{node_count} kwok nodes, {rounds} rounds of {domains} domains x {per_domain} nodes created at once, the "
        f"controller at {' and at '.join(lim.label for lim in all_limits)} (targets: defaults)"
    )

    def fig(key: str, title: str, target: Target | None = None, **kw: Any) -> dict[str, Figure]:
        return per_limits(section, all_limits, lambda lim: Figure(f"{key}-{lim.name}", lim.title(title),
                                                                   target=lim.target(target) if target else None,
                                                                   **kw))  # fmt: skip

    figures = {
        "converge": fig("converge", f"{domains} domains created at once -> all Ready observed", simulated=SIMULATED),
        "per-domain": fig("per-domain", "per domain: create -> Ready observed", simulated=SIMULATED),
        "reaction": fig("reaction", "last entry Ready -> CD Ready, under load (both observed)",
                        Target("p99", 0.5, "p99 < 0.5 s"), simulated=SIMULATED),
        "requests": fig("requests", "controller API requests per domain lifecycle, Events apart", unit="requests"),
        "writes": fig("writes", "of which writes (create, update, patch, delete)", unit="requests"),
        "status": fig("status", "of which status writes", unit="requests"),
        "events": fig("events", "Events written per domain lifecycle", unit="events"),
        "rss-peak": fig("rss-peak", f"controller RSS, {domains} domains and their daemons cached",
                        Target("max", 100, "< 100 MiB (SPEC: at 1,000 domains)"), unit="MiB"),
        "rss-after": fig("rss-after", "controller RSS after the deletes", unit="MiB"),
    }  # fmt: skip
    client = await bench.client()
    driver_ns, cd_ns = await bench.namespace("fleet-drv"), await bench.namespace("fleet-cd")
    kwok_value = f"fleet-{bench.tag}"
    names = [f"fleet-{bench.tag}-{i:04d}" for i in range(node_count)]
    kwok = None
    try:
        with bench.step("starting kwok for the fleet's nodes"):
            kwok = await asyncio.to_thread(start_kwok, bench.local, kwok_value,
                                           bench.local.logs / f"kwok-{kwok_value}.log", lease_s=600, cidr="10.248.0.1/16")  # fmt: skip
        with bench.step(f"creating {node_count} kwok nodes"):
            t = time.monotonic()
            await gather_limited([client.create(NODES, fleet_node(n, f"{uuid.UUID(int=i // RACK)}.1", kwok_value))
                                  for i, n in enumerate(names)])  # fmt: skip

            async def all_ready() -> bool:
                listed = await client.list_all(NODES, label_selector=f"computedomain-fleet={kwok_value}")
                return sum(1 for n in listed.items if any(c.get("type") == "Ready" and c.get("status") == "True"
                                                          for c in (n.get("status") or {}).get("conditions") or ())) >= node_count  # fmt: skip

            await poll(all_ready, 300, f"{node_count} kwok nodes Ready", interval=1.0)
            section.note(f"{node_count} nodes created and Ready (kwok) in {time.monotonic() - t:.1f}s")
        owner = await stand_in_owner(client, driver_ns)
        memory = Series("memory", "controller RSS over the rounds", "MiB", xlabel="seconds since the first create")
        ready_series = Series("convergence", f"{domains} domains Ready over time", "domains Ready", simulated=SIMULATED)
        for lim in all_limits:
            f = {k: v[lim.name] for k, v in figures.items()}
            with bench.step(f"{lim.name}: starting the controller"):
                ctl = ControllerProcess(bench, driver_ns, cd_ns, lim, await bench.service_account())
            try:
                await ctl.ready()
                t_first = time.monotonic()
                for index in range(rounds):
                    with bench.step(f"{lim.name}, round {index + 1}: {domains} domains to Ready and deleted"):
                        fleet, delta = await fleet_round(client, ctl, (driver_ns, cd_ns), names, per_domain, domains,
                                                         f"{lim.name}-{index}", memory, t_first, owner)  # fmt: skip
                    record(f, fleet, delta, domains)
                    ready_series.curves[f"{lim.name}, round {index + 1}"] = fleet.curve
                    f["rss-after"].round([ctl.rss_mib()])
            finally:
                ctl.stop()
        section.series += [ready_series, memory]
    finally:
        with bench.step(f"deleting {node_count} kwok nodes"):
            listed = await client.list_all(NODES, label_selector=f"computedomain-fleet={kwok_value}")
            await gather_limited([_delete(client, NODES, n["metadata"]["name"]) for n in listed.items])
        if kwok is not None:
            stop_kwok(kwok)


def record(f: dict[str, Figure], fleet: Fleet, delta: Counter[str], domains: int) -> None:
    """One round's figures."""
    ok = [fleet.ready_at[u] - fleet.created[u] for u in fleet.created if u in fleet.ready_at]
    failed = domains - len(ok)
    f["per-domain"].round(ok, failed)
    if not failed:
        f["converge"].round([max(fleet.ready_at.values()) - fleet.t0])
    f["reaction"].round(
        [fleet.ready_at[u] - fleet.last_entry_at[u] for u in fleet.ready_at if u in fleet.last_entry_at]
    )
    f["rss-peak"].round([fleet.rss_peak])
    requests, writes, events = lifecycle(delta, domains)
    f["requests"].round([requests])
    f["writes"].round([writes])
    f["status"].round([delta["update computedomains"] / domains])
    f["events"].round([events])
    f["requests"].note = "by verb and resource, last round: " + ", ".join(
        f"{k}={v / domains:.2f}" for k, v in sorted(delta.items()) if not k.startswith("watch")
    )


async def fleet_round(
    client: KubeClient,
    ctl: ControllerProcess,
    namespaces: tuple[str, str],
    names: list[str],
    per_domain: int,
    domains: int,
    index: str,
    memory: Series,
    t_first: float,
    owner: dict[str, Any],
) -> tuple[Fleet, Counter[str]]:
    """Create `domains` domains at once, wait until all are Ready (or failed), delete them and their daemon
    pods; returns the round's milestones and the controller's requests by verb and resource (Events too)."""
    driver_ns, cd_ns = namespaces
    fleet = Fleet(client, driver_ns, cd_ns, names, per_domain, owner)
    informers: list[tuple[Informer[Raw], Any]] = [
        (Informer(client, COMPUTE_DOMAINS, namespace=cd_ns, decode=lambda r: r), fleet.on_cd),
        (Informer(client, DAEMONSETS, namespace=driver_ns, decode=lambda r: r), fleet.on_daemonset),
        (Informer(client, COMPUTE_DOMAIN_CLIQUES, namespace=driver_ns, decode=lambda r: r), fleet.on_clique),
    ]
    for informer, handler in informers:
        informer.add_handler(on_add=handler, on_update=lambda _o, n, h=handler: h(n))
    tasks = [asyncio.create_task(i.run()) for i, _ in informers]

    async def sample() -> None:
        while True:
            rss = ctl.rss_mib()
            fleet.rss_peak = max(fleet.rss_peak, rss)
            memory.add(index, time.monotonic() - t_first, rss)
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())

    async def create(i: int) -> None:
        t0 = time.monotonic()
        raw = await client.create(COMPUTE_DOMAINS, cd_body(f"fleet-{index}-{i}", cd_ns, num_nodes=per_domain))
        fleet.slot[raw["metadata"]["uid"]] = i
        fleet.created[raw["metadata"]["uid"]] = t0
        for informer, handler in informers[1:]:  # a child seen before the UID was known
            for obj in informer.list():
                handler(obj)

    try:
        for informer, _ in informers:
            await informer.has_synced()
        before = ctl.requests(events=True)
        fleet.t0 = time.monotonic()
        await gather_limited([create(i) for i in range(domains)])
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: len(fleet.ready_at) + fleet.failures >= domains, 600, f"{domains} domains Ready",
                           interval=0.1)  # fmt: skip
        await delete_all(client, cd_ns, within=600)
        await delete_pods(client, driver_ns)
        await asyncio.sleep(1.0)
        return fleet, ctl.requests(events=True) - before
    finally:
        for task in [*tasks, sampler, *fleet.tasks]:
            task.cancel()
        await asyncio.gather(*tasks, sampler, *fleet.tasks, return_exceptions=True)


async def _delete(client: KubeClient, resource: Any, name: str, ns: str | None = None) -> None:
    with contextlib.suppress(NotFound):
        await client.delete(resource, name, namespace=ns)
