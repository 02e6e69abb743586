"""Controller benchmarks (SPEC section 9), over several rounds; every latency runs from the request that causes a
change to the watch event that shows it (one clock, this process), failures counted apart.

1. **Create burst**: `BENCH_BURST` (100) ComputeDomains created at once -> all three children observed, per
   domain, against the bare API-write floor in the same round: for as many domains in another namespace, the
   same five writes (the CD, its finalizer patch, daemon template, DaemonSet, workload template) issued
   directly, timed the same way (CD create request -> the three children observed).
2. **Ready latency**: the last clique entry written Ready -> the CD's status observed Ready (`BENCH_READY`
   samples per round; clique entries are written by this process, standing in for the daemons).
3. **Scale**: `BENCH_SCALE` (1,000) domains on `BENCH_NODES` (2,000) GB200 Node objects: controller RSS with
   them cached, CPU over `BENCH_IDLE` seconds of idleness (no polling: ~0), and API requests per domain
   lifecycle (create -> Ready -> delete -> gone) by verb, from the controller's own metrics. The Nodes carry
   GB200 labels but no kwok annotation: 2,000 kwok-heartbeated nodes would measure this machine's lease
   writes rather than the controller (whose node cache holds only nodes with a ComputeDomain label anyway).

The controller runs as a process (`tests.cluster.controller.proc`, the product's entry point limited to the
benchmark's namespace) with the admin kubeconfig; it and the floor use the same client limits (`BENCH_QPS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ComputeDomain
from computedomain.controller.claim_templates import daemon_template, workload_template
from computedomain.controller.daemonset import daemonset
from computedomain.controller.observed import Child, decode_daemonset, decode_template
from computedomain.kube.client import (
    COMPUTE_DOMAIN_CLIQUES,
    COMPUTE_DOMAINS,
    DAEMONSETS,
    NODES,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    KubeClient,
    Raw,
)
from computedomain.kube.errors import NotFound
from computedomain.kube.informer import Informer
from computedomain.settings import ControllerSettings, load_settings
from tests.bench.figures import Figure, Target, percentile
from tests.bench.harness import Bench, cd_body, gather_limited, poll, release_finalizers, wait_for
from tests.testbed.cluster import KWOK_NODE_ANNOTATION, REPO, free_port
from tests.testbed.nodes import gb200_node

SIMULATED_READY = "clique entries written by the benchmark in place of IMEX daemons"


class ControllerProcess:
    """`python -m tests.cluster.controller.proc`: the controller's entry point, limited to one namespace."""

    def __init__(self, bench: Bench, driver_ns: str, cd_ns: str, qps: str) -> None:
        self.port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(bench.local.kubeconfig),
            "NAMESPACE": driver_ns,
            "IMAGE_NAME": "registry.example/computedomain:bench",
            "KUBE_API_QPS": qps,
            "KUBE_API_BURST": str(int(float(qps)) * 2),
            "HTTP_ENDPOINT": f"127.0.0.1:{self.port}",
            "LOG_LEVEL": "warning",
            "TEST_CD_NAMESPACE": cd_ns,
        }
        # Its log goes to a file: a pipe nobody reads fills up and stops the controller at its next write.
        self.log = bench.local.logs / f"bench-controller-{bench.tag}-{self.port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.cluster.controller.proc"], cwd=REPO, env=env, stderr=log
            )

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
            return str(resp.read().decode())

    async def ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.log.read_text(errors="replace").strip()
                raise RuntimeError(f"the controller exited with {self.proc.returncode}: {err[-300:]}")
            with contextlib.suppress(OSError):
                if '"leading": true' in await asyncio.to_thread(self.get, "/readyz"):
                    return
            await asyncio.sleep(0.05)
        raise TimeoutError("the controller did not become ready (leading) within 60s")

    def requests(self, *, events: bool = False) -> Counter[str]:
        """API requests by verb and resource (Events only if asked), from the controller's metrics."""
        out: Counter[str] = Counter()
        for m in re.finditer(
            r"^computedomain_kube_api_requests_total\{([^}]*)\} ([0-9.e+]+)$", self.get("/metrics"), re.M
        ):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if events or labels["resource"] != "events":
                code = "" if labels["code"].startswith("2") else f" ({labels['code']})"
                out[f"{labels['verb']} {labels['resource']}{code}"] += int(float(m.group(2)))
        return out

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Children:
    """Watches DaemonSets and ResourceClaimTemplates of every namespace: when all three children of a
    domain (by its UID label) were first observed."""

    def __init__(self, client: KubeClient) -> None:
        self.kinds: dict[str, set[str]] = {}
        self.done: dict[str, float] = {}
        self.informers = [
            Informer(client, DAEMONSETS, label_selector=COMPUTE_DOMAIN_LABEL, decode=decode_daemonset),
            Informer(client, RESOURCE_CLAIM_TEMPLATES, label_selector=COMPUTE_DOMAIN_LABEL, decode=decode_template),
        ]
        for informer in self.informers:
            informer.add_handler(on_add=self._seen)
        self.tasks: list[asyncio.Task[None]] = []

    def _seen(self, child: Child) -> None:
        now = time.monotonic()
        kinds = self.kinds.setdefault(child.cd_uid, set())
        kinds.add(child.kind.value)
        if len(kinds) == 3:
            self.done.setdefault(child.cd_uid, now)

    async def __aenter__(self) -> Children:
        self.tasks = [asyncio.create_task(i.run()) for i in self.informers]
        for informer in self.informers:
            await informer.has_synced()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _unfinalized(body: dict[str, Any]) -> dict[str, Any]:
    """The same object without our finalizer, so cleanup needs no update (the write costs the same)."""
    return {**body, "metadata": {k: v for k, v in body["metadata"].items() if k != "finalizers"}}


async def _settle(children: Children, started: dict[str, float], within: float) -> tuple[list[float], int]:
    """Latencies of the domains whose children all showed up in time; the others are failures."""
    with contextlib.suppress(TimeoutError):
        await wait_for(lambda: all(uid in children.done for uid in started), within, "children of every domain")
    ok = [children.done[uid] - t0 for uid, t0 in started.items() if uid in children.done]
    return ok, len(started) - len(ok)


async def floor_round(
    client: KubeClient, children: Children, settings: ControllerSettings, ns: str, count: int, index: int
) -> tuple[list[float], int]:
    started: dict[str, float] = {}

    async def one(name: str) -> None:
        t0 = time.monotonic()
        raw = await client.create(COMPUTE_DOMAINS, cd_body(name, ns))
        cd = ComputeDomain.model_validate(raw)
        started[raw["metadata"]["uid"]] = t0
        patch = {
            "metadata": {"resourceVersion": cd.metadata.resource_version, "finalizers": [COMPUTE_DOMAIN_FINALIZER]}
        }
        await client.merge_patch(COMPUTE_DOMAINS, name, patch, namespace=ns)
        await client.create(RESOURCE_CLAIM_TEMPLATES, _unfinalized(daemon_template(cd, settings)))
        await client.create(DAEMONSETS, _unfinalized(daemonset(cd, settings)))
        await client.create(RESOURCE_CLAIM_TEMPLATES, _unfinalized(workload_template(cd, settings)))

    results = await asyncio.gather(*(one(f"floor-{index}-{i}") for i in range(count)), return_exceptions=True)
    ok, missing = await _settle(children, started, 60)
    return ok, missing + sum(1 for r in results if isinstance(r, BaseException))


async def burst_round(
    client: KubeClient, children: Children, ns: str, count: int, index: int
) -> tuple[list[float], int]:
    started: dict[str, float] = {}

    async def one(name: str) -> None:
        t0 = time.monotonic()
        raw = await client.create(COMPUTE_DOMAINS, cd_body(name, ns))
        started[raw["metadata"]["uid"]] = t0

    results = await asyncio.gather(*(one(f"burst-{index}-{i}") for i in range(count)), return_exceptions=True)
    ok, missing = await _settle(children, started, 120)
    return ok, missing + sum(1 for r in results if isinstance(r, BaseException))


async def delete_all(client: KubeClient, ns: str, within: float = 300, *, unowned: bool = False) -> None:
    """Delete every domain of `ns` and wait until they are gone (`unowned`: no controller will release their
    finalizers, so strip them first)."""
    if unowned:
        await release_finalizers(client, ns)
    names = [o["metadata"]["name"] for o in (await client.list_all(COMPUTE_DOMAINS, namespace=ns)).items]
    await gather_limited([_delete(client, n, ns) for n in names])

    async def gone() -> bool:
        return not (await client.list_all(COMPUTE_DOMAINS, namespace=ns)).items

    await poll(gone, within, f"ComputeDomains of {ns} deleted")


async def delete_pods(client: KubeClient, ns: str) -> None:
    """Delete every pod of `ns` (stand-ins that no kubelet runs: they go at once) and wait until gone."""
    listed = await client.list_all(PODS, namespace=ns)
    await gather_limited([_delete_pod(client, p["metadata"]["name"], ns) for p in listed.items])

    async def gone() -> bool:
        return not (await client.list_all(PODS, namespace=ns)).items

    await poll(gone, 300, f"pods of {ns} deleted")


async def _delete_pod(client: KubeClient, name: str, ns: str) -> None:
    with contextlib.suppress(NotFound):
        await client.delete(PODS, name, namespace=ns)


async def _delete(client: KubeClient, name: str, ns: str) -> None:
    with contextlib.suppress(NotFound):
        await client.delete(COMPUTE_DOMAINS, name, namespace=ns)


async def ready_round(
    client: KubeClient, driver_ns: str, cd_ns: str, samples: int, index: int
) -> tuple[list[float], int]:
    status: dict[str, str] = {}
    seen_at: dict[tuple[str, str], float] = {}
    cds = Informer(client, COMPUTE_DOMAINS, namespace=cd_ns, decode=lambda raw: raw)

    def note(raw: Raw) -> None:
        name = raw["metadata"]["name"]
        status[name] = (raw.get("status") or {}).get("status") or ""
        seen_at.setdefault((name, status[name]), time.monotonic())

    cds.add_handler(on_add=note, on_update=lambda _o, n: note(n))
    task = asyncio.create_task(cds.run())
    latencies: list[float] = []
    failures = 0
    try:
        await cds.has_synced()
        for i in range(samples):
            name = f"ready-{index}-{i}"
            uid = (await client.create(COMPUTE_DOMAINS, cd_body(name, cd_ns, num_nodes=2)))["metadata"]["uid"]

            def entry(node: str, slot: int, state: str, i: int = i) -> dict[str, Any]:
                return {"nodeName": node, "ipAddress": f"10.9.{i % 250}.{slot + 1}", "cliqueID": "bench.1",
                        "index": slot, "status": state}  # fmt: skip

            clique = {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainClique",
                "metadata": {"name": f"{uid}.bench.1", "namespace": driver_ns, "labels": {COMPUTE_DOMAIN_LABEL: uid}},
                "daemons": [entry("n0", 0, "Ready"), entry("n1", 1, "NotReady")],
            }
            try:
                # The controller counts only entries whose daemon pod exists on the node: two bound pods stand
                # in for the daemons (no kubelet runs them; the controller only sees that they exist).
                for node in ("n0", "n1"):
                    await client.create(PODS, stand_in_daemon_pod(f"{name}-{node}", driver_ns, uid, node))
                written = await client.create(COMPUTE_DOMAIN_CLIQUES, clique)
                await wait_for(lambda name=name: status.get(name) == "NotReady", 30, f"{name} NotReady")
                body = {**written, "daemons": [entry("n0", 0, "Ready"), entry("n1", 1, "Ready")]}
                t0 = time.monotonic()
                await client.replace(COMPUTE_DOMAIN_CLIQUES, body)
                await wait_for(lambda name=name: status.get(name) == "Ready", 30, f"{name} Ready")
                latencies.append(seen_at[(name, "Ready")] - t0)
            except TimeoutError:
                failures += 1
        return latencies, failures
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def stand_in_daemon_pod(name: str, ns: str, cd_uid: str, node: str) -> dict[str, Any]:
    """A Pod object bound to `node` with the domain's label: what the controller knows of a daemon."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {COMPUTE_DOMAIN_LABEL: cd_uid}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "daemon", "image": "registry.example/computedomain:bench"}],
        },
    }


def bench_node(name: str, clique: str) -> dict[str, Any]:
    node = gb200_node(name, clique=clique)
    node["metadata"]["annotations"].pop(KWOK_NODE_ANNOTATION)
    node["metadata"]["labels"].pop("type")
    node["metadata"]["labels"]["computedomain-bench"] = "true"
    return node


async def scale_round(
    client: KubeClient, ctl: ControllerProcess, cd_ns: str, count: int, idle: float
) -> dict[str, Any]:
    before = ctl.requests()
    names = [f"scale-{i}" for i in range(count)]
    ready_at: dict[str, float] = {}
    cds = Informer(client, COMPUTE_DOMAINS, namespace=cd_ns, decode=lambda raw: raw)

    def note(raw: Raw) -> None:
        if (raw.get("status") or {}).get("status") == "Ready":
            ready_at.setdefault(raw["metadata"]["name"], time.monotonic())

    cds.add_handler(on_add=note, on_update=lambda _o, n: note(n))
    task = asyncio.create_task(cds.run())
    try:
        await cds.has_synced()
        t0 = time.monotonic()
        await gather_limited([client.create(COMPUTE_DOMAINS, cd_body(n, cd_ns)) for n in names])
        await wait_for(lambda: len(ready_at) >= count, 600, f"{count} ComputeDomains Ready", interval=0.1)
        converged = max(ready_at.values()) - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # Idle: no request of any kind (Events included) for 3 s, or 60 s passed (Events of 1,000 domains can
    # trickle out for minutes on a loaded machine: the idle figure then shows them); then measure.
    last, quiet_since, give_up = ctl.requests(events=True), time.monotonic(), time.monotonic() + 60
    while time.monotonic() - quiet_since < 3.0 and time.monotonic() < give_up:
        await asyncio.sleep(0.5)
        now = ctl.requests(events=True)
        if now != last:
            last, quiet_since = now, time.monotonic()
    rss = ctl.rss_mib()
    cpu0 = ctl.cpu_seconds()
    await asyncio.sleep(idle)
    idle_cpu = (ctl.cpu_seconds() - cpu0) / idle
    idle_requests = sum((ctl.requests(events=True) - last).values())
    await delete_all(client, cd_ns)
    await asyncio.sleep(1.0)
    after = ctl.requests()
    per_cd = {
        k: (after[k] - before[k]) / count
        for k in after
        if after[k] - before[k] > 0 and not k.startswith(("list", "watch"))
    }
    return {"rss": rss, "idle_cpu": idle_cpu, "idle_requests": idle_requests, "per_cd": per_cd, "converged": converged}


async def run(bench: Bench) -> None:
    section = bench.section
    burst_n = bench.size("BENCH_BURST", 100, 5)
    ready_n = bench.size("BENCH_READY", 30, 3)
    scale_n = bench.size("BENCH_SCALE", 1000, 10)
    nodes_n = bench.size("BENCH_NODES", 2000, 20)
    idle = bench.sizef("BENCH_IDLE", 10, 1)
    rounds = bench.size("BENCH_ROUNDS", 5, 1)
    scale_rounds = bench.size("BENCH_SCALE_ROUNDS", 3, 1)
    qps = os.environ.get("BENCH_QPS", "1000")
    section.note(
        f"controller as a process, client limits {qps} qps both for it and the floor; {rounds} rounds of a "
        f"{burst_n}-domain burst and {ready_n} Ready samples; {scale_rounds} scale rounds of {scale_n} domains "
        f"on {nodes_n} Node objects"
    )
    floor = section.figure(Figure("floor", "floor: CD + 4 direct writes per domain, all at once -> children observed"))
    burst = section.figure(Figure("burst", "controller: CD created -> all 3 children observed",
                                  target=Target("p99", 1.0, "p99 < 1 s")))  # fmt: skip
    ratio = section.figure(Figure("ratio", "controller / floor, p99 per round", unit="x",
                                  target=Target("max", 2.0, "within 2x of the floor")))  # fmt: skip
    ready = section.figure(Figure("ready", "last clique entry Ready -> CD Ready observed",
                                  target=Target("p99", 0.5, "p99 < 0.5 s"), simulated=SIMULATED_READY))  # fmt: skip
    client = await bench.client(qps=float(qps))
    driver_ns, cd_ns = await bench.namespace("drv"), await bench.namespace("cd")
    floor_ns, floor_drv = await bench.namespace("fl"), await bench.namespace("fld")
    settings = load_settings(ControllerSettings, [], environ={"NAMESPACE": floor_drv, "IMAGE_NAME": "x"})
    with bench.step("starting the controller"):
        ctl = ControllerProcess(bench, driver_ns, cd_ns, qps)
    try:
        await ctl.ready()
        async with Children(client) as children:
            for index in range(rounds):
                with bench.step(f"round {index + 1}: the floor's {burst_n} domains"):
                    floor.round(*await floor_round(client, children, settings, floor_ns, burst_n, index))
                with bench.step(f"round {index + 1}: a burst of {burst_n} ComputeDomains"):
                    burst.round(*await burst_round(client, children, cd_ns, burst_n, index))
                if floor.rounds[-1] and burst.rounds[-1]:
                    ratio.round([percentile(burst.rounds[-1], 99) / percentile(floor.rounds[-1], 99)])
                with bench.step(f"round {index + 1}: deleting the burst's domains"):
                    await delete_all(client, cd_ns)
                    await delete_all(client, floor_ns, unowned=True)
        for index in range(rounds):
            with bench.step(f"round {index + 1}: Ready latency"):
                ready.round(*await ready_round(client, driver_ns, cd_ns, ready_n, index))
            with bench.step(f"round {index + 1}: deleting the Ready samples' domains and stand-in pods"):
                await delete_all(client, cd_ns)
                await delete_pods(client, driver_ns)
        await scale(bench, client, ctl, cd_ns, scale_n, nodes_n, idle, scale_rounds)
    finally:
        ctl.stop()


async def scale(
    bench: Bench,
    client: KubeClient,
    ctl: ControllerProcess,
    cd_ns: str,
    count: int,
    nodes: int,
    idle: float,
    rounds: int,
) -> None:
    section = bench.section
    sim = f"{nodes} Node objects (GB200 labels, no kubelet); no daemons: numNodes 0"
    rss = section.figure(Figure("scale-rss", f"controller RSS with {count} domains and {nodes} nodes cached", unit="MiB",
                                target=Target("max", 80, "< 80 MiB"), simulated=sim))  # fmt: skip
    converge = section.figure(Figure("scale-converge", f"{count} domains created at once -> all Ready observed",
                                     simulated=sim))  # fmt: skip
    cpu = section.figure(Figure("scale-idle-cpu", f"idle CPU over {idle:g} s with {count} domains", unit="%",
                                target=Target("max", 1.0, "~0 (no polling)")))  # fmt: skip
    writes = section.figure(Figure("scale-writes", "API writes per domain lifecycle (create -> Ready -> delete)",
                                   unit="requests"))  # fmt: skip
    rack = uuid.uuid4()
    with bench.step(f"creating {nodes} Node objects"):
        await gather_limited([client.create(NODES, bench_node(f"bench-gb-{bench.tag}-{i:04d}", f"{rack}.{i // 18}"))
                              for i in range(nodes)])  # fmt: skip
    try:
        details: Counter[str] = Counter()
        for index in range(rounds):
            with bench.step(f"scale round {index + 1}: {count} domains to Ready and back"):
                result = await scale_round(client, ctl, cd_ns, count, idle)
            rss.round([result["rss"]])
            converge.round([result["converged"]])
            cpu.round([result["idle_cpu"] * 100])
            writes.round([sum(v for k, v in result["per_cd"].items() if not k.startswith("get"))])
            details.update(result["per_cd"])
            if result["idle_requests"]:
                cpu.note = f"{result['idle_requests']} API requests while idle"
        writes.note = "by verb, mean over rounds: " + ", ".join(
            f"{k}={v / rounds:.2f}" for k, v in sorted(details.items())
        )
    finally:
        with bench.step(f"deleting {nodes} Node objects"):
            listed = await client.list_all(NODES, label_selector="computedomain-bench")
            await gather_limited([_delete_node(client, n["metadata"]["name"]) for n in listed.items])


async def _delete_node(client: KubeClient, name: str) -> None:
    with contextlib.suppress(NotFound):
        await client.delete(NODES, name)
