"""Controller benchmarks (SPEC section 9); prints medians, p99 and ratios, asserts nothing.

1. **Create burst**: ``BENCH_BURST`` (100) ComputeDomains created at once -> all three children exist, per
   domain, against the bare API-write floor measured in the same run: the same four writes per domain
   (finalizer patch, daemon template, DaemonSet, workload template) issued directly, all domains at once.
2. **Ready latency**: the last clique entry turns Ready -> the CD's status says Ready (``BENCH_READY`` samples).
3. **Scale**: ``BENCH_SCALE`` (1,000) domains on ``BENCH_NODES`` (2,000) GB200 Node objects: controller RSS
   with them cached, CPU over
   ``BENCH_IDLE`` seconds of idleness (no polling: ~0), and API requests per domain lifecycle
   (create -> Ready -> delete -> gone), by verb, from the controller's own metrics. The nodes carry GB200
   labels but no kwok annotation: 2,000 kwok-heartbeated nodes would mean ~200 lease writes a second, which
   would measure this 2-core machine rather than the controller (whose node cache only holds nodes that
   carry a ComputeDomain label anyway).

The controller runs as a subprocess (``tests.cluster.controller.proc``) with the admin kubeconfig, handling only
the benchmark's namespace; both it and the floor use the same client limits (``BENCH_QPS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
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
    NAMESPACES,
    NODES,
    RESOURCE_CLAIM_TEMPLATES,
    ClientConfig,
    KubeClient,
    Raw,
)
from computedomain.kube.errors import NotFound
from computedomain.kube.informer import Informer
from computedomain.settings import ControllerSettings, load_settings
from tests.testbed.cluster import DEFAULT_ROOT, KWOK_NODE_ANNOTATION
from tests.testbed.nodes import gb200_node

REPO = Path(__file__).resolve().parents[2]
KUBECONFIG = DEFAULT_ROOT / "kubeconfig"
BURST = int(os.environ.get("BENCH_BURST", "100"))
READY_SAMPLES = int(os.environ.get("BENCH_READY", "30"))
SCALE = int(os.environ.get("BENCH_SCALE", "1000"))
IDLE = float(os.environ.get("BENCH_IDLE", "10"))
NODE_COUNT = int(os.environ.get("BENCH_NODES", "2000"))
QPS = os.environ.get("BENCH_QPS", "1000")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def summary(label: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{label}: n={len(ms)} median={statistics.median(ms):.1f} ms p99={pct(ms, 99):.1f} ms max={max(ms):.1f} ms"


def cd_body(name: str, ns: str, *, num_nodes: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": f"{name}-ch"}}},
    }


async def ensure_namespace(client: KubeClient, name: str) -> None:
    await client.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


async def drop_namespace(client: KubeClient, name: str) -> None:
    """Delete everything the benchmark made, finalizers included, then the namespace."""
    for resource in (COMPUTE_DOMAINS, DAEMONSETS, RESOURCE_CLAIM_TEMPLATES):
        items = (await client.list_all(resource, namespace=name)).items
        for obj in items:
            meta = obj["metadata"]
            if meta.get("finalizers"):
                with contextlib.suppress(NotFound):
                    await client.merge_patch(resource, meta["name"], {"metadata": {"finalizers": None}}, namespace=name)
    with contextlib.suppress(NotFound):
        await client.delete(NAMESPACES, name)


class ControllerProcess:
    def __init__(self, driver_ns: str, cd_ns: str) -> None:
        self.port = _free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(KUBECONFIG),
            "NAMESPACE": driver_ns,
            "IMAGE_NAME": "registry.example/computedomain:bench",
            "KUBE_API_QPS": QPS,
            "KUBE_API_BURST": str(int(float(QPS)) * 2),
            "HTTP_ENDPOINT": f"127.0.0.1:{self.port}",
            "LOG_LEVEL": "warning",
            "TEST_CD_NAMESPACE": cd_ns,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.controller.proc"], cwd=REPO, env=env, stderr=subprocess.DEVNULL
        )

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
            return str(resp.read().decode())

    async def ready(self) -> None:
        for _ in range(600):
            try:
                if '"leading": true' in self.get("/readyz"):
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("controller did not become ready")

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

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_until(check: Callable[[], bool], within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.01)


async def gather_limited(coros: list[Awaitable[Any]], limit: int = 64) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[Any]) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


# --- 1. create burst vs the floor ------------------------------------------------------------------------


async def floor_run(client: KubeClient, settings: ControllerSettings, cd_ns: str) -> list[float]:
    """The same writes the controller makes per domain, issued directly: the floor for the latency."""
    names = [f"floor-{i}" for i in range(BURST)]
    created: list[ComputeDomain] = await gather_limited(
        [client.create(COMPUTE_DOMAINS, cd_body(n, cd_ns), decode=ComputeDomain.model_validate) for n in names]
    )
    start = time.monotonic()

    async def writes(cd: ComputeDomain) -> float:
        patch = {
            "metadata": {"resourceVersion": cd.metadata.resource_version, "finalizers": [COMPUTE_DOMAIN_FINALIZER]}
        }
        await client.merge_patch(COMPUTE_DOMAINS, cd.metadata.name, patch, namespace=cd_ns)
        await client.create(RESOURCE_CLAIM_TEMPLATES, _unfinalized(daemon_template(cd, settings)))
        await client.create(DAEMONSETS, _unfinalized(daemonset(cd, settings)))
        await client.create(RESOURCE_CLAIM_TEMPLATES, _unfinalized(workload_template(cd, settings)))
        return time.monotonic() - start

    return list(await asyncio.gather(*(writes(cd) for cd in created)))


def _unfinalized(body: dict[str, Any]) -> dict[str, Any]:
    """The same object without our finalizer, so cleanup after the run needs no update (same write cost)."""
    return {**body, "metadata": {k: v for k, v in body["metadata"].items() if k != "finalizers"}}


async def controller_burst(client: KubeClient, driver_ns: str, cd_ns: str) -> list[float]:
    children: dict[str, set[str]] = {}
    done: dict[str, float] = {}

    def seen(child: Child) -> None:
        kinds = children.setdefault(child.cd_uid, set())
        kinds.add(child.kind.value)
        if len(kinds) == 3 and child.cd_uid not in done:
            done[child.cd_uid] = time.monotonic()

    observers = [
        Informer(client, DAEMONSETS, namespace=driver_ns, label_selector=COMPUTE_DOMAIN_LABEL, decode=decode_daemonset),
        Informer(client, RESOURCE_CLAIM_TEMPLATES, label_selector=COMPUTE_DOMAIN_LABEL, decode=decode_template),
    ]
    for obs in observers:
        obs.add_handler(on_add=seen)
    tasks = [asyncio.create_task(o.run()) for o in observers]
    try:
        for o in observers:
            await o.has_synced()
        start: dict[str, float] = {}

        async def create(name: str) -> None:
            t0 = time.monotonic()
            raw: Raw = await client.create(COMPUTE_DOMAINS, cd_body(name, cd_ns))
            start[raw["metadata"]["uid"]] = t0

        await asyncio.gather(*(create(f"burst-{i}") for i in range(BURST)))
        await wait_until(lambda: all(uid in done for uid in start))
        return [done[uid] - start[uid] for uid in start]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- 2. last daemon Ready -> CD Ready ---------------------------------------------------------------------


async def ready_latency(client: KubeClient, driver_ns: str, cd_ns: str) -> list[float]:
    status: dict[str, str] = {}
    cds = Informer(client, COMPUTE_DOMAINS, namespace=cd_ns, decode=ComputeDomain.model_validate)
    changed = asyncio.Event()

    def note(cd: ComputeDomain) -> None:
        status[cd.metadata.name] = cd.status.status.value if cd.status else ""
        changed.set()

    cds.add_handler(on_add=note, on_update=lambda _o, n: note(n))
    task = asyncio.create_task(cds.run())
    samples: list[float] = []
    try:
        await cds.has_synced()
        for i in range(READY_SAMPLES):
            name = f"ready-{i}"
            uid = (await client.create(COMPUTE_DOMAINS, cd_body(name, cd_ns, num_nodes=2)))["metadata"]["uid"]

            def entry(node: str, index: int, state: str, i: int = i) -> dict[str, Any]:
                return {
                    "nodeName": node,
                    "ipAddress": f"10.9.{i}.{index + 1}",
                    "cliqueID": "bench.1",
                    "index": index,
                    "status": state,
                }

            clique = {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainClique",
                "metadata": {"name": f"{uid}.bench.1", "namespace": driver_ns, "labels": {COMPUTE_DOMAIN_LABEL: uid}},
                "daemons": [entry("n0", 0, "Ready"), entry("n1", 1, "NotReady")],
            }
            written = await client.create(COMPUTE_DOMAIN_CLIQUES, clique)
            await wait_until(lambda name=name: status.get(name) == "NotReady", within=30)
            await asyncio.sleep(0.05)
            body = {**written, "daemons": [entry("n0", 0, "Ready"), entry("n1", 1, "Ready")]}
            t0 = time.monotonic()
            await client.replace(COMPUTE_DOMAIN_CLIQUES, body)
            await wait_until(lambda name=name: status.get(name) == "Ready", within=30)
            samples.append(time.monotonic() - t0)
        return samples
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# --- 3. scale: RSS, idle CPU, requests per lifecycle -------------------------------------------------------


async def poll(check: Callable[[], Awaitable[bool]], within: float = 600.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.5)


async def _none_left(client: KubeClient, ns: str, prefix: str) -> bool:
    items = (await client.list_all(COMPUTE_DOMAINS, namespace=ns)).items
    return not any(o["metadata"]["name"].startswith(prefix) for o in items)


def bench_node(name: str, clique: str) -> dict[str, Any]:
    node = gb200_node(name, clique=clique)
    node["metadata"]["annotations"].pop(KWOK_NODE_ANNOTATION)
    node["metadata"]["labels"].pop("type")
    node["metadata"]["labels"]["computedomain-bench"] = "true"
    return node


async def scale(client: KubeClient, ctl: ControllerProcess, cd_ns: str) -> dict[str, Any]:
    rack = uuid.uuid4()
    await gather_limited(
        [client.create(NODES, bench_node(f"bench-gb-{i:04d}", f"{rack}.{i // 18}")) for i in range(NODE_COUNT)]
    )
    try:
        return await _scale(client, ctl, cd_ns)
    finally:
        names = [
            n["metadata"]["name"] for n in (await client.list_all(NODES, label_selector="computedomain-bench")).items
        ]
        await gather_limited([client.delete(NODES, n) for n in names])


async def _scale(client: KubeClient, ctl: ControllerProcess, cd_ns: str) -> dict[str, Any]:
    before = ctl.requests()
    names = [f"scale-{i}" for i in range(SCALE)]
    await gather_limited([client.create(COMPUTE_DOMAINS, cd_body(n, cd_ns)) for n in names])

    async def all_ready() -> bool:
        items = (await client.list_all(COMPUTE_DOMAINS, namespace=cd_ns)).items
        ready = sum(
            1
            for o in items
            if o["metadata"]["name"].startswith("scale-") and (o.get("status") or {}).get("status") == "Ready"
        )
        return ready >= SCALE

    await poll(all_ready)
    # Idle means: no request of any kind (Events included) for 3 s; then measure CPU and requests.
    settled, last, quiet_since = False, ctl.requests(events=True), time.monotonic()
    while not settled:
        await asyncio.sleep(0.5)
        now = ctl.requests(events=True)
        if now != last:
            last, quiet_since = now, time.monotonic()
        settled = time.monotonic() - quiet_since >= 3.0
    rss = ctl.rss_mb()
    cpu0 = ctl.cpu_seconds()
    await asyncio.sleep(IDLE)
    idle_cpu = (ctl.cpu_seconds() - cpu0) / IDLE
    idle_requests = sum((ctl.requests(events=True) - last).values())
    await gather_limited([client.delete(COMPUTE_DOMAINS, n, namespace=cd_ns) for n in names])
    await poll(lambda: _none_left(client, cd_ns, "scale-"))
    await asyncio.sleep(1.0)
    after = ctl.requests()
    per_cd = {
        k: (after[k] - before[k]) / SCALE
        for k in after
        if after[k] - before[k] > 0 and not k.startswith(("list", "watch"))
    }
    return {"rss_mb": rss, "idle_cpu": idle_cpu, "idle_requests": idle_requests, "per_cd": per_cd}


async def main() -> None:
    client = await KubeClient.connect(
        kubeconfig=KUBECONFIG, config=ClientConfig(qps=float(QPS), burst=int(float(QPS)) * 2)
    )
    tag = uuid.uuid4().hex[:6]
    driver_ns, cd_ns, floor_ns, floor_drv = f"bench-drv-{tag}", f"bench-cd-{tag}", f"bench-fl-{tag}", f"bench-fld-{tag}"
    for ns in (driver_ns, cd_ns, floor_ns, floor_drv):
        await ensure_namespace(client, ns)
    settings = load_settings(ControllerSettings, [], environ={"NAMESPACE": floor_drv, "IMAGE_NAME": "x"})
    ctl = ControllerProcess(driver_ns, cd_ns)
    try:
        print(f"(client limits: {QPS} qps; controller in a subprocess; {BURST} CDs per burst)", flush=True)
        floor = await floor_run(client, settings, floor_ns)
        await ctl.ready()
        burst = await controller_burst(client, driver_ns, cd_ns)
        print(summary("floor: 4 direct writes per CD, all CDs at once", floor))
        print(summary("controller: CD created -> all 3 children exist", burst))
        print(
            f"ratio controller/floor: median {statistics.median(burst) / statistics.median(floor):.2f}x, "
            f"p99 {pct(burst, 99) / pct(floor, 99):.2f}x   (target: p99 < 1 s and within 2x)"
        )
        ready = await ready_latency(client, driver_ns, cd_ns)
        print(summary("last clique entry Ready -> CD Ready", ready) + "   (target: p99 < 500 ms)")
        result = await scale(client, ctl, cd_ns)
        print(
            f"scale: {SCALE} CDs cached, {NODE_COUNT} nodes: controller RSS {result['rss_mb']:.0f} MB "
            "(target < 200 MB at 1,000 CDs on 2,000 nodes)"
        )
        print(
            f"scale: idle CPU over {IDLE:.0f}s: {result['idle_cpu'] * 100:.2f}% of one core, "
            f"{result['idle_requests']} API requests (target ~0: no polling)"
        )
        writes = sum(v for k, v in result["per_cd"].items() if not k.startswith("get"))
        detail = ", ".join(f"{k}={v:.2f}" for k, v in sorted(result["per_cd"].items()))
        print(f"scale: API requests per CD lifecycle (create -> Ready -> delete): {writes:.2f} writes; {detail}")
    finally:
        ctl.stop()
        for ns in (driver_ns, cd_ns, floor_ns, floor_drv):
            await drop_namespace(client, ns)
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
