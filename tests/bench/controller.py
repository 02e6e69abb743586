"""Controller benchmarks (SPEC section 9), over several rounds, each at the controller's shipped client limits
and at a raised limit beside it (`BENCH_LIMITS`, `BENCH_QPS`; the SPEC targets are checked on the
defaults). Every latency runs from the request that causes a change to the watch event that shows it (one
clock, this process), failures counted apart.

1. **Start-up**: process start -> the first write of a reconcile observed (a domain that existed before the
   process gets our finalizer): imports, credentials, every cache listed and watching, then the reconcile.
2. **Create burst**: `BENCH_BURST` (100) ComputeDomains created at once -> all three children observed, per
   domain, against the bare API-write floor in the same round: for as many domains in another namespace, the
   same five writes (the CD, its finalizer patch, daemon template, DaemonSet, workload template) issued
   directly by this process without a client limit, timed the same way (CD create request -> the three
   children observed). Each timed part starts once the DaemonSet controller has processed every DaemonSet
   of the part before (with 2,000 Nodes that is about a CPU second per 100 DaemonSets, which would otherwise
   fall into the next part, whichever side caused it), and the floor's children are deleted after its round.
   A warm-up round before the counted ones is not counted (the first burst after a start pays for the
   connection pool's TLS handshakes and first-use costs; the start-up figure is the cold start's).
3. **Ready latency**: the last clique entry written Ready -> the CD's status observed Ready (`BENCH_READY`
   samples per round; clique entries are written by this process, standing in for the daemons).
4. **Scale**: `BENCH_SCALE` (1,000) domains on `BENCH_NODES` (2,000) GB200 Node objects: create -> all Ready,
   how long the domains' Ready Events trail the last Ready (each is recorded when its status write returns;
   read from the controller's metrics, which it renders at most once a second: to within that second) and
   the requests in that time, then the idle window (`BENCH_IDLE`, 30 s from the moment all were Ready
   and their Events written: the API requests the controller makes in it, Events and watches included,
   beside the reference's 5, and its CPU), its RSS, then delete ->
   gone; API requests, writes and Events per domain lifecycle (create -> Ready -> delete), from the
   controller's own metrics. The Nodes carry GB200 labels but no kwok annotation: 2,000 kwok-heartbeated
   nodes would measure this machine's lease writes rather than the controller (whose node cache holds only
   nodes with a ComputeDomain label anyway).

The controller runs as a process (`tests.cluster.controller.proc`, the product's entry point limited to the
benchmark's namespace) with a cluster-admin ServiceAccount's token and the CA at the in-pod path, as a pod of it
would run (so its memory and start-up are the in-cluster path's, without the kubeconfig loader). Stand-in daemon pods are owned by a ConfigMap of this
benchmark (a controller owner reference), so the DaemonSet controller leaves them alone: it would adopt an
orphan that carries the domain's label and delete it from a node that is not labelled for the domain.
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
from collections.abc import Callable
from dataclasses import dataclass
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
    Resource,
)
from computedomain.kube.errors import NotFound
from computedomain.kube.informer import Informer
from computedomain.settings import ControllerSettings, load_settings
from tests.bench.figures import Figure, Section, Target, percentile
from tests.bench.harness import Bench, Watching, cd_body, gather_limited, poll, release_finalizers, wait_for
from tests.testbed import image, serviceaccount
from tests.testbed.cluster import KWOK_NODE_ANNOTATION, REPO, free_port
from tests.testbed.nodes import gb200_node

SIMULATED_READY = "clique entries written by the benchmark in place of IMEX daemons"
CONFIG_MAPS = Resource("", "v1", "configmaps", True, "ConfigMap")
WRITES = ("create", "update", "patch", "delete")
# API requests of the reference controller in the 30 s after 1,000 domains were Ready, measured beside ours
# on the same control plane: its status loop reads caches, and it writes no Events.
REFERENCE_IDLE_REQUESTS = 5


@dataclass(frozen=True)
class Limits:
    """The controller's client limits for one pass of a benchmark: the shipped defaults, or a raised limit.

    SPEC 9: every target holds at the shipped defaults; a figure reached only with a raised limit is reported
    beside it. So each controller benchmark runs its figures once per `Limits` (`BENCH_LIMITS`, default
    both), each figure's title saying which; the targets are checked on the defaults.
    """

    name: str  # "defaults" or "raised"
    qps: float
    burst: int

    @property
    def shipped(self) -> bool:
        return self.name == "defaults"

    @property
    def label(self) -> str:
        return f"{self.name}: {self.qps:g} qps, burst {self.burst}"

    def env(self) -> dict[str, str]:
        """The controller's environment for these limits (none for the defaults: the process's own)."""
        return {} if self.shipped else {"KUBE_API_QPS": f"{self.qps:g}", "KUBE_API_BURST": str(self.burst)}

    def title(self, text: str) -> str:
        return f"{text} [{self.label}]"

    def target(self, target: Target) -> Target | None:
        return target if self.shipped else None


def limits() -> list[Limits]:
    """`BENCH_LIMITS` (default `defaults,raised`); the raised limit is `BENCH_QPS` (1,000), burst twice it."""
    raised = float(os.environ.get("BENCH_QPS", "1000"))
    shipped = load_settings(ControllerSettings, [], environ={})
    every = {
        "defaults": Limits("defaults", shipped.kube_api_qps, shipped.kube_api_burst),
        "raised": Limits("raised", raised, int(raised) * 2),
    }
    chosen = [n.strip() for n in os.environ.get("BENCH_LIMITS", "defaults,raised").split(",") if n.strip()]
    unknown = [n for n in chosen if n not in every]
    if unknown or not chosen:
        raise ValueError(f"BENCH_LIMITS {','.join(chosen)!r}: use defaults, raised or both (comma separated)")
    return [every[n] for n in chosen]


def per_limits(section: Section, all_limits: list[Limits], make: Callable[[Limits], Figure]) -> dict[str, Figure]:
    """One figure per limits, registered next to each other (the report shows them side by side)."""
    return {lim.name: section.figure(make(lim)) for lim in all_limits}


class ControllerProcess:
    """`python -m tests.cluster.controller.proc`: the controller's entry point, limited to one namespace, with
    a pod's credentials at the in-pod path (`Bench.service_account`)."""

    def __init__(
        self,
        bench: Bench,
        driver_ns: str,
        cd_ns: str,
        lim: Limits,
        service_account: Path,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("KUBE_API_QPS", "KUBE_API_BURST", "KUBECONFIG")},
            **image.runtime_env(),  # the allocator settings of the image, as in its pod
            **serviceaccount.cluster_env(bench.local.server),
            "NAMESPACE": driver_ns,
            "IMAGE_NAME": "registry.example/computedomain:bench",
            **lim.env(),
            "HTTP_ENDPOINT": f"127.0.0.1:{self.port}",
            "LOG_LEVEL": os.environ.get("BENCH_CONTROLLER_LOG_LEVEL", "warning"),
            "TEST_CD_NAMESPACE": cd_ns,
            **(extra or {}),
        }
        # Its log goes to a file: a pipe nobody reads fills up and stops the controller at its next write.
        self.log = bench.local.logs / f"bench-controller-{bench.tag}-{self.port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                serviceaccount.mounted([sys.executable, "-m", "tests.cluster.controller.proc"], service_account),
                cwd=REPO, env=env, stderr=log,
            )  # fmt: skip

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

    def _samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        out = []
        for m in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", self.get("/metrics"), re.M):
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2))))
        return out

    def requests(self, *, events: bool = False) -> Counter[str]:
        """API requests by verb and resource (Events only if asked), from the controller's metrics."""
        out: Counter[str] = Counter()
        for labels, value in self._samples("computedomain_kube_api_requests_total"):
            if events or labels["resource"] != "events":
                code = "" if labels["code"].startswith("2") else f" ({labels['code']})"
                out[f"{labels['verb']} {labels['resource']}{code}"] += int(value)
        return out

    def events(self) -> Counter[str]:
        """Event writes by outcome (create, patch, dropped, failed), from the controller's metrics."""
        out: Counter[str] = Counter()
        for labels, value in self._samples("computedomain_events_total"):
            out[labels["action"]] += int(value)
        return out

    def watch_events(self) -> Counter[str]:
        """Watch events its informers applied, by resource and type, from the controller's metrics."""
        out: Counter[str] = Counter()
        for labels, value in self._samples("computedomain_informer_events_total"):
            out[f"{labels['informer'].split('/')[0]} {labels['type']}"] += int(value)
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


def lifecycle(delta: Counter[str], count: int) -> tuple[float, float, float]:
    """(requests, writes, Event writes) per domain from the controller's request counts over whole lifecycles;
    watches are not requests a domain causes, Event writes are counted apart from the others."""
    requests = sum(v for k, v in delta.items() if not k.startswith("watch") and " events" not in k)
    writes = sum(v for k, v in delta.items() if k.split()[0] in WRITES and " events" not in k)
    events = sum(v for k, v in delta.items() if k.split()[0] in ("create", "patch") and " events" in k)
    return requests / count, writes / count, events / count


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Children(Watching):
    """Watches DaemonSets and ResourceClaimTemplates of every namespace: when all three children of a
    domain (by its UID label) were first observed."""

    def __init__(self, client: KubeClient) -> None:
        self.kinds: dict[str, set[str]] = {}
        self.done: dict[str, float] = {}
        super().__init__([
            Informer(client, DAEMONSETS, label_selector=COMPUTE_DOMAIN_LABEL, decode=decode_daemonset),
            Informer(client, RESOURCE_CLAIM_TEMPLATES, label_selector=COMPUTE_DOMAIN_LABEL, decode=decode_template),
        ])  # fmt: skip
        for informer in self.informers:
            informer.add_handler(on_add=self._seen)

    def _seen(self, child: Child) -> None:
        now = time.monotonic()
        kinds = self.kinds.setdefault(child.cd_uid, set())
        kinds.add(child.kind.value)
        if len(kinds) == 3:
            self.done.setdefault(child.cd_uid, now)


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
    client: KubeClient, children: Children, settings: ControllerSettings, ns: str, count: int, index: str
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
    client: KubeClient, children: Children, ns: str, count: int, index: str
) -> tuple[list[float], int]:
    started: dict[str, float] = {}

    async def one(name: str) -> None:
        t0 = time.monotonic()
        raw = await client.create(COMPUTE_DOMAINS, cd_body(name, ns))
        started[raw["metadata"]["uid"]] = t0

    results = await asyncio.gather(*(one(f"burst-{index}-{i}") for i in range(count)), return_exceptions=True)
    ok, missing = await _settle(children, started, 120)
    return ok, missing + sum(1 for r in results if isinstance(r, BaseException))


async def delete_all(client: KubeClient, ns: str, within: float = 600, *, unowned: bool = False) -> None:
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
        await client.delete(PODS, name, namespace=ns, grace_period_seconds=0)


async def _delete(client: KubeClient, name: str, ns: str, resource: Resource = COMPUTE_DOMAINS) -> None:
    with contextlib.suppress(NotFound):
        await client.delete(resource, name, namespace=ns)


async def delete_floor_children(client: KubeClient, floor_ns: str, floor_drv: str) -> None:
    """Delete the floor's children (no controller does: its domains had no finalizer of a running controller)
    and wait until they are gone, so they neither pile up over rounds nor get deleted during the next one (the
    workload templates' owner references would have the garbage collector do it, at its 20 writes/s)."""
    kinds = ((RESOURCE_CLAIM_TEMPLATES, floor_ns), (RESOURCE_CLAIM_TEMPLATES, floor_drv), (DAEMONSETS, floor_drv))

    async def listed() -> list[tuple[Resource, str, str]]:
        out = []
        for resource, ns in kinds:
            items = (await client.list_all(resource, namespace=ns, label_selector=COMPUTE_DOMAIN_LABEL)).items
            out += [(resource, ns, o["metadata"]["name"]) for o in items]
        return out

    await gather_limited([_delete(client, name, ns, resource) for resource, ns, name in await listed()])

    async def gone() -> bool:
        return not await listed()

    await poll(gone, 120, "the floor's children deleted", interval=0.2)


async def caught_up(client: KubeClient, namespaces: tuple[str, ...]) -> None:
    """Wait until the DaemonSet controller has processed every DaemonSet of `namespaces` (its observed
    generation is the current one). With 2,000 Nodes it checks each against a new DaemonSet's selector: about
    a CPU second per 100 DaemonSets, which must not fall into the next timed round, whichever side caused it."""

    async def done() -> bool:
        for ns in namespaces:
            for ds in (await client.list_all(DAEMONSETS, namespace=ns, label_selector=COMPUTE_DOMAIN_LABEL)).items:
                if (ds.get("status") or {}).get("observedGeneration") != ds["metadata"].get("generation"):
                    return False
        return True

    await poll(done, 120, "the DaemonSet controller caught up", interval=0.1)


async def stand_in_owner(client: KubeClient, ns: str) -> dict[str, Any]:
    """The owner reference of this benchmark's stand-in daemon pods in `ns` (a ConfigMap it creates once)."""
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bench-stand-in-daemons", "namespace": ns}}
    try:
        raw = await client.create(CONFIG_MAPS, body)
    except Exception:
        raw = await client.get(CONFIG_MAPS, "bench-stand-in-daemons", namespace=ns)
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": raw["metadata"]["name"],
            "uid": raw["metadata"]["uid"], "controller": True}  # fmt: skip


def stand_in_daemon_pod(name: str, ns: str, cd_uid: str, node: str, owner: dict[str, Any]) -> dict[str, Any]:
    """A Pod object bound to `node` with the domain's label: what the controller knows of a daemon. `owner`
    (`stand_in_owner`) keeps the DaemonSet controller from adopting and deleting it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {COMPUTE_DOMAIN_LABEL: cd_uid},
            "ownerReferences": [owner],
        },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "daemon", "image": "registry.example/computedomain:bench"}],
        },
    }


async def ready_round(
    client: KubeClient, driver_ns: str, cd_ns: str, samples: int, index: str
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
    owner = await stand_in_owner(client, driver_ns)
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
                    await client.create(PODS, stand_in_daemon_pod(f"{name}-{node}", driver_ns, uid, node, owner))
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


def bench_node(name: str, clique: str) -> dict[str, Any]:
    node = gb200_node(name, clique=clique)
    node["metadata"]["annotations"].pop(KWOK_NODE_ANNOTATION)
    node["metadata"]["labels"].pop("type")
    node["metadata"]["labels"]["computedomain-bench"] = "true"
    return node


async def startup_round(bench: Bench, client: KubeClient, driver_ns: str, cd_ns: str, lim: Limits, index: int
                        ) -> tuple[ControllerProcess, float | None]:  # fmt: skip
    """Start a controller while a domain it has never seen waits in `cd_ns`: seconds from the process start to
    our finalizer on that domain observed. Returns the running controller."""
    name = f"startup-{lim.name}-{index}"
    seen: dict[str, float] = {}
    cds = Informer(client, COMPUTE_DOMAINS, namespace=cd_ns, decode=lambda raw: raw)

    def note(raw: Raw) -> None:
        if raw["metadata"]["name"] == name and COMPUTE_DOMAIN_FINALIZER in (raw["metadata"].get("finalizers") or ()):
            seen.setdefault(name, time.monotonic())

    cds.add_handler(on_add=note, on_update=lambda _o, n: note(n))
    task = asyncio.create_task(cds.run())
    try:
        await cds.has_synced()
        await client.create(COMPUTE_DOMAINS, cd_body(name, cd_ns))
        ctl = ControllerProcess(bench, driver_ns, cd_ns, lim, await bench.service_account())
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: name in seen, 60, "the first reconcile's write")
        return ctl, (seen[name] - ctl.started if name in seen else None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@dataclass
class ScaleRound:
    converged: float
    rss: float
    idle_cpu: float  # fraction of one core over the idle window
    idle_requests: Counter[str]  # by verb and resource, Events and watches included
    idle_events: Counter[str]  # watch events applied in the idle window, by resource and type
    trail: float  # the last domain Ready -> every domain's Ready Event written
    trail_requests: Counter[str]  # the requests in that time
    delta: Counter[str]  # requests of whole lifecycles, by verb and resource
    events: Counter[str]  # Event writes by outcome


async def scale_round(client: KubeClient, ctl: ControllerProcess, cd_ns: str, count: int, idle: float) -> ScaleRound:
    before, events_before = ctl.requests(events=True), ctl.events()
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
        await wait_for(lambda: len(ready_at) >= count, 900, f"{count} ComputeDomains Ready", interval=0.02)
        converged = max(ready_at.values()) - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # The burst's last writes are the Ready Events of its last domains: each is recorded when its status write
    # returns, so they trail the last Ready by one write (and whatever Events queued before them).
    ready = ctl.requests(events=True)

    def events_written() -> bool:
        done = ctl.events() - events_before
        return sum(done[k] for k in ("create", "patch", "dropped", "failed")) >= count

    with contextlib.suppress(TimeoutError):  # fewer Events than domains: the window starts after a minute
        await wait_for(events_written, 60, "every domain's Ready Event written", interval=0.02)
    trail = time.monotonic() - max(ready_at.values())
    # The idle window: from the moment every domain was Ready and told so, whatever the controller still does.
    start, watched, cpu0 = ctl.requests(events=True), ctl.watch_events(), ctl.cpu_seconds()
    await asyncio.sleep(idle)
    idle_cpu = (ctl.cpu_seconds() - cpu0) / idle
    idle_requests = ctl.requests(events=True) - start
    idle_events = ctl.watch_events() - watched
    rss = ctl.rss_mib()
    await delete_all(client, cd_ns)
    await asyncio.sleep(1.0)
    return ScaleRound(converged, rss, idle_cpu, idle_requests, idle_events, trail, start - ready,
                      ctl.requests(events=True) - before, ctl.events() - events_before)  # fmt: skip


@dataclass
class Sizes:
    burst: int
    ready: int
    scale: int
    nodes: int
    idle: float
    rounds: int
    scale_rounds: int
    startups: int


async def run(bench: Bench) -> None:
    section = bench.section
    all_limits = limits()
    sizes = Sizes(
        burst=bench.size("BENCH_BURST", 100, 5),
        ready=bench.size("BENCH_READY", 30, 3),
        scale=bench.size("BENCH_SCALE", 1000, 10),
        nodes=bench.size("BENCH_NODES", 2000, 20),
        idle=bench.sizef("BENCH_IDLE", 30, 1),
        rounds=bench.size("BENCH_ROUNDS", 5, 1),
        scale_rounds=bench.size("BENCH_SCALE_ROUNDS", 3, 1),
        startups=bench.size("BENCH_STARTUPS", 5, 1),
    )
    section.note(
        f"controller as a process at {' and at '.join(lim.label for lim in all_limits)} (targets: defaults); the "
        f"floor without a client limit. {sizes.startups} start-ups; {sizes.rounds} rounds of a {sizes.burst}-domain "
        f"burst and {sizes.ready} Ready samples; {sizes.scale_rounds} scale rounds of {sizes.scale} domains on "
        f"{sizes.nodes} Node objects"
    )

    def fig(key: str, title: str, target: Target | None = None, **kw: Any) -> dict[str, Figure]:
        return per_limits(section, all_limits, lambda lim: Figure(f"{key}-{lim.name}", lim.title(title),
                                                                   target=lim.target(target) if target else None,
                                                                   **kw))  # fmt: skip

    figures = {
        "startup": fig("startup", "process start -> first reconcile's write observed",
                       Target("p99", 1.0, "< 1 s (reference ~0.9 s)")),
        "floor": fig("floor", "floor: CD + 4 direct writes per domain, all at once -> children observed"),
        "burst": fig("burst", "controller: CD created -> all 3 children observed"),
        "ratio": fig("ratio", "controller / floor, p99 per round", Target("max", 1.2, "p99 within 1.2x of the floor"),
                     unit="x"),
        "ready": fig("ready", "last clique entry Ready -> CD Ready observed", Target("p99", 0.5, "p99 < 0.5 s"),
                     simulated=SIMULATED_READY),
    }  # fmt: skip
    client = await bench.client()
    driver_ns, cd_ns = await bench.namespace("drv"), await bench.namespace("cd")
    floor_ns, floor_drv = await bench.namespace("fl"), await bench.namespace("fld")
    settings = load_settings(ControllerSettings, [], environ={"NAMESPACE": floor_drv, "IMAGE_NAME": "x"})
    scale_figures = scale_section(section, all_limits, sizes)
    rack = uuid.uuid4()
    with bench.step(f"creating {sizes.nodes} Node objects"):
        await gather_limited([client.create(NODES, bench_node(f"bench-gb-{bench.tag}-{i:04d}", f"{rack}.{i // 18}"))
                              for i in range(sizes.nodes)])  # fmt: skip
    try:
        for lim in all_limits:
            await one_pass(bench, client, lim, sizes, figures, scale_figures, settings,
                           (driver_ns, cd_ns, floor_ns, floor_drv))  # fmt: skip
    finally:
        with bench.step(f"deleting {sizes.nodes} Node objects"):
            await delete_bench_nodes(client)


async def one_pass(
    bench: Bench,
    client: KubeClient,
    lim: Limits,
    sizes: Sizes,
    figures: dict[str, dict[str, Figure]],
    scale_figures: dict[str, dict[str, Figure]],
    settings: ControllerSettings,
    namespaces: tuple[str, str, str, str],
) -> None:
    """Every figure at one set of limits: start-ups, bursts against the floor (each timed round starting on a
    cluster that caught up with the one before), Ready latency, scale."""
    driver_ns, cd_ns, floor_ns, floor_drv = namespaces
    f = {k: v[lim.name] for k, v in figures.items()}
    ctl: ControllerProcess | None = None
    try:
        for index in range(sizes.startups):
            with bench.step(f"{lim.name}: start-up {index + 1}"):
                if ctl is not None:
                    ctl.stop()
                ctl, took = await startup_round(bench, client, driver_ns, cd_ns, lim, index)
                f["startup"].round([took] if took is not None else [], 0 if took is not None else 1)
                await ctl.ready()
                await delete_all(client, cd_ns)
        assert ctl is not None
        answers: Counter[str] = Counter()
        async with Children(client) as children:
            # Round 0 is not counted: the first burst after a start pays for the connection pool's TLS
            # handshakes and first-use costs on both sides (the start-up figure measures a cold start).
            for index in range(sizes.rounds + 1):
                tag, name = f"{lim.name}-{index}", f"{lim.name}, " + (f"round {index}" if index else "warm-up")
                with bench.step(f"{name}: the floor's {sizes.burst} domains"):
                    await caught_up(client, (driver_ns, floor_drv))
                    floor = await floor_round(client, children, settings, floor_ns, sizes.burst, tag)
                with bench.step(f"{name}: a burst of {sizes.burst} ComputeDomains"):
                    await caught_up(client, (floor_drv,))
                    before = ctl.requests(events=True)
                    burst = await burst_round(client, children, cd_ns, sizes.burst, tag)
                    if index:
                        answers.update({k: v for k, v in (ctl.requests(events=True) - before).items() if "(" in k})
                if index:
                    f["floor"].round(*floor)
                    f["burst"].round(*burst)
                    if floor[0] and burst[0]:
                        f["ratio"].round([percentile(burst[0], 99) / percentile(floor[0], 99)])
                with bench.step(f"{name}: deleting the round's domains"):
                    await delete_all(client, cd_ns)
                    await delete_all(client, floor_ns, unowned=True)
                    await delete_floor_children(client, floor_ns, floor_drv)
        f["burst"].note = "the controller's answers other than 2xx during the bursts: " + (
            ", ".join(f"{k}={v}" for k, v in sorted(answers.items())) or "none (no 429)"
        )
        for index in range(sizes.rounds):
            with bench.step(f"{lim.name}, round {index + 1}: Ready latency"):
                f["ready"].round(*await ready_round(client, driver_ns, cd_ns, sizes.ready, f"{lim.name}-{index}"))
            with bench.step(f"{lim.name}, round {index + 1}: deleting the Ready samples' domains and stand-in pods"):
                await delete_all(client, cd_ns)
                await delete_pods(client, driver_ns)
        await scale(bench, client, ctl, lim, cd_ns, sizes, {k: v[lim.name] for k, v in scale_figures.items()})
    finally:
        if ctl is not None:
            ctl.stop()


def scale_section(section: Section, all_limits: list[Limits], sizes: Sizes) -> dict[str, dict[str, Figure]]:
    count, nodes, idle = sizes.scale, sizes.nodes, sizes.idle
    sim = f"{nodes} Node objects (GB200 labels, no kubelet); no daemons: numNodes 0"

    def fig(key: str, title: str, target: Target | None = None, **kw: Any) -> dict[str, Figure]:
        return per_limits(section, all_limits, lambda lim: Figure(f"{key}-{lim.name}", lim.title(title),
                                                                   target=lim.target(target) if target else None,
                                                                   **kw))  # fmt: skip

    return {
        "rss": fig("scale-rss", f"controller RSS with {count} domains and {nodes} nodes cached",
                   Target("max", 100, "< 100 MiB (the reference: 136 MiB)"), unit="MiB", simulated=sim),
        "converge": fig("scale-converge", f"{count} domains created at once -> all Ready observed", simulated=sim),
        "trail": fig("scale-events-trail", "the last domain Ready -> every domain's Ready Event written", unit="s"),
        "trail-requests": fig("scale-trail-requests", "API requests in that time (the Ready Events)",
                              unit="requests"),
        "idle-requests": fig("scale-idle-requests",
                             f"API requests in the {idle:g} s after all {count} were Ready and their Events written "
                             "(Events, watches included)",
                             Target("max", REFERENCE_IDLE_REQUESTS + 0.5, f"<= {REFERENCE_IDLE_REQUESTS}, the reference's"),
                             unit="requests"),
        "idle-cpu": fig("scale-idle-cpu", f"controller CPU in those {idle:g} s", Target("max", 1.0, "~0 (no polling)"),
                        unit="%"),
        # What the controller is told in that time: other controllers' writes (the DaemonSet controller still
        # writing the status of a thousand new DaemonSets on two thousand nodes) are events it must read.
        "idle-events": fig("scale-idle-events", f"watch events the controller applied in those {idle:g} s",
                           unit="events"),
        "requests": fig("scale-requests", "API requests per domain lifecycle (create -> Ready -> delete), "
                        "Events apart", unit="requests"),
        "writes": fig("scale-writes", "API writes per domain lifecycle (create -> Ready -> delete)", unit="requests"),
        "events": fig("scale-events", "Events written per domain lifecycle", unit="events"),
    }  # fmt: skip


async def scale(bench: Bench, client: KubeClient, ctl: ControllerProcess, lim: Limits, cd_ns: str, sizes: Sizes,
                f: dict[str, Figure]) -> None:  # fmt: skip
    details: Counter[str] = Counter()
    idle_details: Counter[str] = Counter()
    idle_watched: Counter[str] = Counter()
    trail_details: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for index in range(sizes.scale_rounds):
        with bench.step(f"{lim.name}, scale round {index + 1}: {sizes.scale} domains to Ready and back"):
            result = await scale_round(client, ctl, cd_ns, sizes.scale, sizes.idle)
        requests, writes, events = lifecycle(result.delta, sizes.scale)
        f["rss"].round([result.rss])
        f["converge"].round([result.converged])
        f["trail"].round([result.trail])
        f["trail-requests"].round([sum(result.trail_requests.values())])
        f["idle-requests"].round([sum(result.idle_requests.values())])
        f["idle-cpu"].round([result.idle_cpu * 100])
        f["idle-events"].round([sum(result.idle_events.values())])
        f["requests"].round([requests])
        f["writes"].round([writes])
        f["events"].round([events])
        details.update(result.delta)
        idle_details.update(result.idle_requests)
        idle_watched.update(result.idle_events)
        trail_details.update(result.trail_requests)
        dropped.update({k: v for k, v in result.events.items() if k in ("dropped", "failed")})
    rounds = sizes.scale_rounds
    f["requests"].note = "by verb and resource, mean over rounds: " + ", ".join(
        f"{k}={v / rounds / sizes.scale:.2f}" for k, v in sorted(details.items()) if not k.startswith("watch")
    )
    f["idle-events"].note = ("by resource and type, all rounds: " + ", ".join(
        f"{k}={v}" for k, v in sorted(idle_watched.items())) if idle_watched else "none")  # fmt: skip
    for key, seen in (("idle-requests", idle_details), ("trail-requests", trail_details)):
        f[key].note = ("by verb and resource, all rounds: " + ", ".join(
            f"{k}={v}" for k, v in sorted(seen.items())) if seen else "none")  # fmt: skip
    f["events"].note = (
        f"Events not written, all rounds: {', '.join(f'{k}={v}' for k, v in sorted(dropped.items()))}"
        if dropped else "every Event recorded was written"
    )  # fmt: skip


async def delete_bench_nodes(client: KubeClient) -> None:
    """Delete every Node object `bench_node` made."""
    listed = await client.list_all(NODES, label_selector="computedomain-bench")
    await gather_limited([_delete_node(client, n["metadata"]["name"]) for n in listed.items])


async def _delete_node(client: KubeClient, name: str) -> None:
    with contextlib.suppress(NotFound):
        await client.delete(NODES, name)
