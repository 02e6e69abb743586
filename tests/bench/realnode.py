"""Real-node benchmark: what a claim costs on a real kubelet, and the node side's memory and start-up.

    make bench-realnode   (python -m tests.bench realnode; BENCH_ROUNDS=3, BENCH_REAL_SAMPLES=3 per round)

Two real nodes (tests/testbed/realnode: kubelet + containerd + runc, the service's image) and the chart
installed by helm, once in driverManaged and once in hostManaged mode (the host IMEX service being the
simulator chrooted into each node's driver root). Per round, on the first node, one pod after the other:

- pod create -> Running of a pod without a claim, of the same pod with a channel claim of a domain that
  exists (its template is there), and of a further pod of that domain on the node beside it (design note
  0014); the ratios of their medians to the pod without a claim are the cost of the claim. In driverManaged
  mode the controller labels the node once the claim is allocated there, which brings the domain's IMEX
  daemon, and the claim's Prepare returns once that daemon's entry is Ready: each sample starts on a node
  without the daemon (the previous one is gone), as a job's first pod on a node does. In hostManaged mode
  it runs the chrooted `nvidia-imex-ctl -q`. In driverManaged mode also a pod without a claim and without
  any volume (no service account token): the kubelet waits for a pod's volumes before it starts it, so
  its difference to the pod without a claim is that wait, which a daemon pod without volumes would not
  have (design note 0009).
- the node agent's Prepare of the first pod's claim and of the further pod's (its domain ready on the node:
  SPEC 9's ready-domain Prepare, on a real kubelet) and Unprepare of the further pod's (the one Unprepare
  that nothing else follows closely in either mode), from its own `nvidia_dra_request_duration_seconds`
  (scraped through the apiserver's pod proxy before and after each call: a sample is taken only where
  exactly one call happened in between, so it is that call's duration; driverManaged's daemon claim gets a
  figure of its own);
- memory while a claim is prepared: the RSS of the node agent container's processes and of the IMEX daemon
  wrapper process (the container's other process, the `nvidia-imex` simulator, is a stand-in and not
  counted), beside the containers' cgroup memory (page cache included);
- start-up to serving, from the process' start (the kernel's start time) to the line it logs when serving
  (containerd's timestamp of the line): the node agent to `plugin serving` (its sockets are up), the
  controller to `caches synced` (ready, reconciling once it leads); once per install and once per round
  after deleting the pod.

Every time is measured on this machine's clock: pod phases as watch events of this process, processes'
start times and containerd's log timestamps on the same real-time clock. If real nodes cannot start here,
every figure of the section says why in one line and the benchmark ends without failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, NODES, PODS, RESOURCE_CLAIMS, KubeClient, Raw
from computedomain.kube.informer import Informer
from tests.bench.figures import Figure, Section, Target
from tests.bench.harness import Bench, Watching, wait_for
from tests.testbed.realnode.nodes import CGROUP_FS, Node, RealNodes
from tests.testbed.realnode.release import RealRelease

IMAGE = "ghcr.io/computedomain/computedomain:0.1.0"
GV = "resource.nvidia.com/v1beta1"
METRICS_PORT = 8081  # the chart's kubeletPlugin.metrics.computeDomainHttpEndpoint
MODES = ("driverManaged", "hostManaged")
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
REAL = "nothing: real kubelet, containerd and runc; the IMEX daemon (nvidia-imex) is the simulator"


def not_possible() -> str:
    """Why real nodes cannot start on this machine, or "" (the checks `RealNodes.up` would fail on first)."""
    if os.geteuid() != 0:
        return "real nodes need root (namespaces, mounts, cgroups)"
    missing = [tool for tool in ("unshare", "nsenter", "ip", "mount", "openssl") if not shutil.which(tool, path=PATH)]
    if missing:
        return f"real nodes need {', '.join(missing)} on PATH"
    if not (CGROUP_FS / "memory").is_dir() and not (CGROUP_FS / "cgroup.controllers").exists():
        return f"real nodes need a cgroup memory controller under {CGROUP_FS}"
    return ""


# --- the node agent's metrics --------------------------------------------------------------------------

SERIES = re.compile(r'^nvidia_dra_(request_duration_seconds_sum|request_duration_seconds_count|requests_inflight)'
                    r'\{([^}]*)\} ([0-9.e+-]+)$', re.M)  # fmt: skip


@dataclass(frozen=True)
class Calls:
    """The agent's totals per operation: calls finished, their seconds, calls in progress."""

    count: dict[str, float]
    seconds: dict[str, float]
    inflight: dict[str, float]

    @classmethod
    def parse(cls, text: str, driver: str = DRIVER_NAME) -> Calls:
        count: dict[str, float] = {}
        seconds: dict[str, float] = {}
        inflight: dict[str, float] = {}
        for m in SERIES.finditer(text):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.get("driver") != driver:
                continue
            target = {"request_duration_seconds_sum": seconds, "request_duration_seconds_count": count}.get(
                m.group(1), inflight
            )
            target[labels.get("operation", "")] = float(m.group(3))
        return cls(count, seconds, inflight)

    def since(self, before: Calls, operation: str) -> float | None:
        """The duration of the one call of `operation` between `before` and this; None unless exactly one."""
        if self.count.get(operation, 0) - before.count.get(operation, 0) != 1:
            return None
        return self.seconds.get(operation, 0.0) - before.seconds.get(operation, 0.0)


# --- what runs on a node, seen from the host ---------------------------------------------------------


def _clock_offset() -> float:
    """Real time minus the clock the kernel's process start times count on (CLOCK_BOOTTIME)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def _started_at(pid: int) -> float | None:
    """A process' start as a Unix time (10 ms resolution: the kernel counts clock ticks)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK") + _clock_offset()


def _rss_mib(pid: int) -> dict[str, float]:
    """VmRSS and its parts (RssAnon: the process' own; RssFile: mapped files, the image's Python and
    libraries, shared with every process that maps them) in MiB."""
    out = {"VmRSS": 0.0, "RssAnon": 0.0, "RssFile": 0.0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) / 1024
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class Container:
    """A running container of a real node: its cgroup (memory hierarchy) and processes."""

    cgroup: Path

    @classmethod
    def of(cls, node: Node, pod: Raw, name: str) -> Container | None:
        statuses = (pod.get("status") or {}).get("containerStatuses") or ()
        cid = next((s.get("containerID", "") for s in statuses if s.get("name") == name), "")
        cid = cid.split("://", 1)[-1]
        if not cid:
            return None
        for top in (CGROUP_FS / "memory", CGROUP_FS):  # cgroup v1's memory hierarchy, else the unified one
            root = top / node.cgroup_root.strip("/")
            if root.is_dir():
                found = next((p for p in root.rglob(cid) if p.is_dir()), None)
                if found is not None:
                    return cls(found)
        return None

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError, ValueError):
            return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
        return []

    def started_at(self) -> float | None:
        starts = [s for s in map(_started_at, self.pids()) if s is not None]
        return min(starts) if starts else None

    def rss_mib(self, keep: Callable[[str], bool] = lambda _cmd: True) -> dict[str, float]:
        """VmRSS, RssAnon and RssFile summed over the container's processes that `keep` (by command line)."""
        total = {"VmRSS": 0.0, "RssAnon": 0.0, "RssFile": 0.0}
        for pid in self.pids():
            if keep(_cmdline(pid)):
                for key, value in _rss_mib(pid).items():
                    total[key] += value
        return total

    def working_set_mib(self) -> float:
        """The container's memory as the kubelet reports it (container_memory_working_set_bytes): the
        cgroup's usage less its inactive file pages."""
        stat: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            lines = (self.cgroup / "memory.stat").read_text().splitlines()
            stat = {k: int(v) for k, v in (line.split() for line in lines)}
        for name, inactive in (("memory.usage_in_bytes", "total_inactive_file"), ("memory.current", "inactive_file")):
            with contextlib.suppress(OSError, ValueError):
                usage = int((self.cgroup / name).read_text())
                return max(0, usage - stat.get(inactive, 0)) / 2**20
        return float("nan")


def _log_times(release: RealRelease, ns: str, pod: str, container: str, needles: Iterable[str]) -> dict[str, float]:
    """containerd's timestamp of the first log line of `container` that contains each of `needles` (those found)."""
    text = release.kubectl("logs", "-n", ns, pod, "-c", container, "--timestamps", check=False)
    found: dict[str, float] = {}
    for line in text.splitlines():
        stamp, _, rest = line.partition(" ")
        for needle in needles:
            if needle in rest and needle not in found:
                with contextlib.suppress(ValueError):
                    # RFC 3339 with nanoseconds: Python parses microseconds.
                    stamp = re.sub(r"(\.\d{6})\d*", r"\1", stamp).replace("Z", "+00:00")
                    found[needle] = datetime.fromisoformat(stamp).timestamp()
    return found


def _log_time(release: RealRelease, ns: str, pod: str, container: str, needle: str) -> float | None:
    """containerd's timestamp of the first log line of `container` that contains `needle`."""
    return _log_times(release, ns, pod, container, (needle,)).get(needle)


# --- the benchmark --------------------------------------------------------------------------------------


class Figures:
    def __init__(self, section: Section) -> None:
        def fig(key: str, title: str, **kw: Any) -> Figure:
            return section.figure(Figure(key, title, simulated=kw.pop("simulated", REAL), **kw))

        self.plain = {m: fig(f"plain-{m}", f"{m}: pod without a claim, create -> Running") for m in MODES}
        # What a pod without any volume (no service account token) takes: the kubelet's volume wait is what a
        # daemon pod without volumes would save (design note 0009's table of other designs).
        self.bare = fig("bare-driverManaged", "driverManaged: pod without a claim and without volumes "
                        "(automountServiceAccountToken: false), create -> Running")  # fmt: skip
        self.bare_ratio = fig("bare-ratio-driverManaged", "driverManaged: pod without volumes / no claim (round medians)",
                              unit="x")  # fmt: skip
        self.claim = {m: fig(f"claim-{m}", f"{m}: pod with a channel claim, create -> Running") for m in MODES}
        self.ratio = {
            m: fig(
                f"ratio-{m}",
                f"{m}: first pod of the domain on the node with a claim / no claim (round medians)",
                unit="x",
                target=Target("max", 1.5, "< 1.5x"),
            )
            for m in MODES
        }
        self.further = {
            m: fig(f"further-{m}", f"{m}: a further pod of the domain on that node, create -> Running") for m in MODES
        }
        self.further_ratio = {m: fig(f"further-ratio-{m}", f"{m}: further pod / no claim (round medians)", unit="x",
                                     target=Target("max", 1.2, "< 1.2x")) for m in MODES}  # fmt: skip
        self.floor = fig(
            "floor-driverManaged",
            "driverManaged: the least a first pod can take while its domain's IMEX daemon is a pod the DaemonSet "
            "starts at allocation: the daemon wrapper process's start + its nvidia-imex spawn -> Ready + the "
            "kubelet after Prepare, nothing for the wrapper or the node agent (round medians) / no claim",
            unit="x",
        )
        self.steps = {m: {step: fig(f"step-{m}-{step}", f"{m}: first pod's create -> {title}") for step, title in STEPS[m]}
                      for m in MODES}  # fmt: skip
        self.prepare = {m: fig(f"prepare-{m}", f"{m}: node agent Prepare of the channel claim") for m in MODES}
        # SPEC 9: a ready domain's channel Prepare p99 < 20 ms; hostManaged, with the ctl exec, p99 < 100 ms.
        self.further_prepare = {
            m: fig(f"prepare-further-{m}", f"{m}: node agent Prepare of the further pod's channel claim (domain ready)",
                   target=Target("p99", 0.1, "p99 < 100 ms") if m == "hostManaged" else Target("p99", 0.02, "p99 < 20 ms"))
            for m in MODES
        }  # fmt: skip
        self.unprepare = {m: fig(f"unprepare-{m}", f"{m}: node agent Unprepare of the further pod's channel claim")
                          for m in MODES}  # fmt: skip
        self.daemon_prepare = fig("prepare-daemon", "driverManaged: node agent Prepare of the daemon's claim")
        self.agent_rss = fig("agent-rss", "node agent RSS, claim prepared (container's processes)", unit="MiB",
                             target=Target("max", 64.0, "< 64 MiB"))  # fmt: skip
        self.agent_cgroup = fig("agent-cgroup", "node agent container memory (working set, as the kubelet reports it)",
                                unit="MiB", target=Target("max", 64.0, "< 64 MiB"))  # fmt: skip
        self.wrapper_rss = fig("wrapper-rss", "IMEX daemon wrapper RSS (driverManaged)", unit="MiB",
                               target=Target("max", 56.0, "< 56 MiB"))  # fmt: skip
        self.daemon_cgroup = fig("daemon-cgroup", "IMEX daemon container memory (working set, simulator included)",
                                 unit="MiB", simulated="nvidia-imex (IMEX simulator, Python) in the same container")  # fmt: skip
        self.agent_start = fig("agent-start", "node agent: process start -> serving (plugin serving)",
                               target=Target("max", 1.0, "< 1 s"))  # fmt: skip
        self.controller_start = fig("controller-start", "controller: process start -> serving (caches synced)",
                                    target=Target("max", 1.0, "< 1 s"))  # fmt: skip
        self.all = section.figures

    def not_measured(self, why: str) -> None:
        for figure in self.all:
            figure.note = f"not measured: {why}"


class Pods:
    """Pod phases of a namespace as this process sees them (watch events, first time seen)."""

    def __init__(self, client: KubeClient, namespace: str) -> None:
        self.running: dict[str, float] = {}
        self.seen: dict[str, Raw] = {}
        self.informer: Informer[Raw] = Informer(client, PODS, decode=lambda r: r, namespace=namespace)
        self.informer.add_handler(on_add=self._saw, on_update=lambda _o, n: self._saw(n), on_delete=self._gone)
        self.task: asyncio.Task[None] | None = None

    def _saw(self, pod: Raw) -> None:
        name = pod["metadata"]["name"]
        self.seen[name] = pod
        if (pod.get("status") or {}).get("phase") == "Running":
            self.running.setdefault(f"{name}/{pod['metadata']['uid']}", time.time())

    def _gone(self, pod: Raw) -> None:
        self.seen.pop(pod["metadata"]["name"], None)

    async def __aenter__(self) -> Pods:
        self.task = asyncio.create_task(self.informer.run())
        await self.informer.has_synced()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


# Where the first pod's time goes: the moments of its chain, each the first watch event that shows it, and
# inside the IMEX daemon's container its wrapper's start and the lines it logs (containerd's timestamps).
DAEMON_CONTAINER = "compute-domain-daemon"
DAEMON_LINES = {
    "daemon-starting": "starting daemon",
    "daemon-slot": "our slot",
    "imex-started": "started nvidia-imex",
    "daemon-ready": "status=Ready (",
}
STEPS = {
    "driverManaged": (
        ("allocated", "its claim allocated"),
        ("bound", "pod bound to the node"),
        ("labelled", "node labelled with the domain (the controller saw the allocation)"),
        ("daemon-created", "IMEX daemon pod created (DaemonSet)"),
        ("daemon-bound", "IMEX daemon pod bound"),
        ("daemon-process", "IMEX daemon wrapper process started (its kernel start time)"),
        ("daemon-running", "IMEX daemon pod Running"),
        ("daemon-starting", "wrapper logged `starting daemon` (imports, version check and probe server done)"),
        ("entry", "daemon's clique entry written"),
        ("daemon-slot", "wrapper logged `our slot` (registered)"),
        ("imex-started", "wrapper logged `started nvidia-imex`"),
        ("daemon-ready", "wrapper logged its readiness `status=Ready`"),
        ("entry-ready", "daemon's clique entry Ready"),
        ("agent-prepared", "node agent logged `prepared` (its Prepare of the claim returns)"),
        ("running", "pod Running"),
    ),
    "hostManaged": (
        ("allocated", "its claim allocated"),
        ("bound", "pod bound to the node"),
        ("agent-prepared", "node agent logged `prepared` (its Prepare of the claim returns)"),
        ("running", "pod Running"),
    ),
}


class Timeline(Watching):
    """The first pod's chain from create to Running, seen through watches of the claims, the pods of both
    namespaces, the Nodes and the clique objects: per step, the first time (this process' clock) a watch
    event shows it after the pod's create request."""

    def __init__(self, client: KubeClient, workload_ns: str, driver_ns: str) -> None:
        watched = (
            (RESOURCE_CLAIMS, workload_ns, self._claim),
            (PODS, workload_ns, self._pod),
            (PODS, driver_ns, self._daemon),
            (NODES, None, self._node),
            (COMPUTE_DOMAIN_CLIQUES, driver_ns, self._clique),
        )
        informers: list[Informer[Raw]] = []
        for resource, namespace, saw in watched:
            informer: Informer[Raw] = Informer(client, resource, decode=lambda r: r, namespace=namespace)
            informer.add_handler(on_add=saw, on_update=lambda _o, n, saw=saw: saw(n))
            informers.append(informer)
        super().__init__(informers)
        self.pod = self.node = ""
        self.t0 = 0.0
        self.marks: dict[str, float] = {}

    def start(self, pod: str, node: str, t0: float) -> None:
        self.pod, self.node, self.t0, self.marks = pod, node, t0, {}

    def since_create(self) -> dict[str, float]:
        return {step: at - self.t0 for step, at in self.marks.items()}

    def _mark(self, step: str) -> None:
        if self.pod:
            self.marks.setdefault(step, time.time())

    def _claim(self, claim: Raw) -> None:
        if str(claim["metadata"]["name"]).startswith(f"{self.pod}-") and (claim.get("status") or {}).get("allocation"):
            self._mark("allocated")

    def _pod(self, pod: Raw) -> None:
        if pod["metadata"]["name"] == self.pod:
            if (pod.get("spec") or {}).get("nodeName"):
                self._mark("bound")
            if (pod.get("status") or {}).get("phase") == "Running":
                self._mark("running")

    def _daemon(self, pod: Raw) -> None:
        meta = pod["metadata"]
        if COMPUTE_DOMAIN_LABEL in (meta.get("labels") or {}) and not meta.get("deletionTimestamp"):
            self._mark("daemon-created")
            if (pod.get("spec") or {}).get("nodeName") == self.node:
                self._mark("daemon-bound")
                if (pod.get("status") or {}).get("phase") == "Running":
                    self._mark("daemon-running")

    def _node(self, node: Raw) -> None:
        if node["metadata"]["name"] == self.node and COMPUTE_DOMAIN_LABEL in (node["metadata"].get("labels") or {}):
            self._mark("labelled")

    def _clique(self, clique: Raw) -> None:
        for entry in clique.get("daemons") or ():
            if entry.get("nodeName") == self.node:
                self._mark("entry")
                if entry.get("status") == "Ready":
                    self._mark("entry-ready")


class RealBench:
    def __init__(self, bench: Bench, nodes: RealNodes, figures: Figures) -> None:
        self.bench = bench
        self.nodes = nodes
        self.f = figures
        self.rounds = bench.size("BENCH_ROUNDS", 3, 1)
        self.samples = bench.size("BENCH_REAL_SAMPLES", 3, 1)

    async def kubectl(self, release: RealRelease, *args: str, input: str | None = None) -> str:
        return await asyncio.to_thread(release.kubectl, *args, input=input)

    async def calls(self, release: RealRelease, agent: str) -> Calls:
        path = f"/api/v1/namespaces/{release.driver_ns}/pods/{agent}:{METRICS_PORT}/proxy/metrics"
        return Calls.parse(await self.kubectl(release, "get", "--raw", path))

    async def mode(self, client: KubeClient, mode: str) -> None:
        bench, nodes = self.bench, self.nodes
        release = RealRelease(nodes, mode=mode)
        with bench.step(f"{mode}: installing the chart on the real nodes"):
            await asyncio.to_thread(release.install)
        try:
            bench.section.note(f"{mode}: chart installed, node agents and controller Ready in {release.install_s:.1f}s")
            await self.start_ups(release, when=f"{mode}, installed")
            if mode == "hostManaged":
                for node in nodes.nodes:
                    nodes.start_host_imex(node)
            cd = f"bench-{bench.tag}"
            await self.kubectl(release, "apply", "-n", release.workload_ns, "-f", "-", input=_json({
                "apiVersion": GV, "kind": "ComputeDomain", "metadata": {"name": cd},
                "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": f"{cd}-channel"}}},
            }))  # fmt: skip
            with bench.step(f"{mode}: waiting for the ComputeDomain's channel template"):
                await _until(lambda: _exists(release, "resourceclaimtemplate", f"{cd}-channel", release.workload_ns),
                             120, "the channel ResourceClaimTemplate")  # fmt: skip
            async with (
                Pods(client, release.workload_ns) as work,
                Pods(client, release.driver_ns) as system,
                Timeline(client, release.workload_ns, release.driver_ns) as timeline,
            ):
                for index in range(self.rounds):
                    with bench.step(f"{mode}: round {index + 1}"):
                        await self.round(release, mode, f"{cd}-channel", (work, system, timeline), index)
                    with bench.step(f"{mode}: round {index + 1}: restarting the node agent and the controller"):
                        await self.restarts(release, system)
        finally:
            with bench.step(f"{mode}: uninstalling the chart"):
                await asyncio.to_thread(release.uninstall)
                if mode == "hostManaged":
                    for node in nodes.nodes:
                        nodes.stop_host_imex(node)

    async def round(
        self, release: RealRelease, mode: str, template: str, watched: tuple[Pods, Pods, Timeline], index: int
    ) -> None:
        work, system, timeline = watched
        node = self.nodes.nodes[0]
        steps: dict[str, list[float]] = {step: [] for step, _ in STEPS[mode]}
        plain: list[float] = []
        bare: list[float] = []
        claim: list[float] = []
        further: list[float] = []
        prepares: list[float] = []
        unprepares: list[float] = []
        daemon_prepares: list[float] = []
        further_prepares: list[float] = []
        floors: list[float] = []
        missed = missed_further = missed_unprepare = 0
        for sample in range(self.samples):
            name = f"plain-{index}-{sample}"
            plain.append(await self.pod_running(release, work, name, node, None))
            await self.delete_pod(release, work, name)
            if mode == "driverManaged":
                name = f"bare-{index}-{sample}"
                bare.append(await self.pod_running(release, work, name, node, None, volumes=False))
                await self.delete_pod(release, work, name)

            agent = _agent(system, node.name)
            before = await self.calls(release, agent)
            name = f"claim-{index}-{sample}"
            daemon_seen: dict[str, Calls] = {}

            async def at_daemon_running() -> None:  # driverManaged: the daemon's Prepare alone, then ours
                def running() -> bool:
                    return any(p.get("status", {}).get("phase") == "Running" and p["spec"].get("nodeName") == node.name
                               and COMPUTE_DOMAIN_LABEL in (p["metadata"].get("labels") or {})
                               for p in system.seen.values())  # fmt: skip

                await wait_for(running, 300, "the IMEX daemon Running", interval=0.05)
                daemon_seen["calls"] = await self.calls(release, agent)  # noqa: B023 (awaited within the sample)

            watcher = asyncio.create_task(at_daemon_running()) if mode == "driverManaged" else None
            try:
                claim.append(await self.pod_running(release, work, name, node, template, timeline))
                marks = timeline.since_create()
                inside = await asyncio.to_thread(_log_marks, release, system, node, f"{release.workload_ns}/{name}-")
                marks.update({step: at - timeline.t0 for step, at in inside.items()})
                for step, at in marks.items():
                    steps.setdefault(step, []).append(at)
                if (floor := _floor(marks)) is not None:
                    floors.append(floor)
            finally:
                if watcher is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(watcher, 30)
            after = await self.calls(release, agent)
            middle = daemon_seen.get("calls")
            if mode == "driverManaged" and middle is not None:
                got, daemon = after.since(middle, "prepare"), middle.since(before, "prepare")
                if daemon is not None:
                    daemon_prepares.append(daemon)
            else:
                got = after.since(before, "prepare")
            if got is None:
                missed += 1
            else:
                prepares.append(got)
            if sample == self.samples - 1:
                await self.memory(release, node, system, mode)
            # A further pod of the domain on the node, beside the first (several pods per node, 0014).
            second = f"further-{index}-{sample}"
            further.append(await self.pod_running(release, work, second, node, template))
            if (took := (await self.calls(release, agent)).since(after, "prepare")) is not None:
                further_prepares.append(took)
            else:
                missed_further += 1
            await self.delete_pod(release, work, second)
            # The Unprepare sampled is the further pod's: nothing else is unprepared beside it, in either mode.
            # (In driverManaged the first pod's, below, shared its scrape window with another Unprepare in every
            # sample of a run; the daemon claim's comes about 0.4 s after it.)
            unprepared = await self.wait_calls(release, agent, after, "unprepare")
            if unprepared is not None:
                unprepares.append(unprepared)
            else:
                missed_unprepare += 1
            after = await self.calls(release, agent)
            # The kubelet unprepares once the pod's containers are gone, around the time the object goes:
            # scrape from the delete request on.
            await work.informer.client.delete(PODS, name, namespace=release.workload_ns)
            await self.wait_calls(release, agent, after, "unprepare")
            await wait_for(lambda: name not in work.seen, 120, f"pod {name} deleted")  # noqa: B023
            if mode == "driverManaged":  # the next sample starts on a node without the daemon
                await wait_for(lambda: not any(COMPUTE_DOMAIN_LABEL in (p["metadata"].get("labels") or {})
                                               for p in system.seen.values()), 300, "the IMEX daemon gone")  # fmt: skip
        self.f.plain[mode].round(plain)
        if bare:
            self.f.bare.round(bare)
            self.f.bare_ratio.round([statistics.median(bare) / statistics.median(plain)])
        self.f.claim[mode].round(claim)
        self.f.ratio[mode].round([statistics.median(claim) / statistics.median(plain)])
        self.f.further[mode].round(further)
        self.f.further_ratio[mode].round([statistics.median(further) / statistics.median(plain)])
        for step, values in steps.items():
            if step in self.f.steps[mode]:
                self.f.steps[mode][step].round(values, self.samples - len(values))
        self.f.prepare[mode].round(prepares)
        self.f.further_prepare[mode].round(further_prepares)
        self.f.unprepare[mode].round(unprepares)
        if daemon_prepares:
            self.f.daemon_prepare.round(daemon_prepares)
        if floors:
            self.f.floor.round([statistics.median(floors) / statistics.median(plain)])
        if missed:
            self.f.prepare[mode].note = f"{missed} sample(s) not taken: more than one Prepare call between two scrapes"
        if missed_further:
            self.f.further_prepare[mode].note = f"{missed_further} sample(s) not taken: more than one Prepare call"
        if missed_unprepare:
            self.f.unprepare[
                mode
            ].note = f"{missed_unprepare} sample(s) not taken: more than one Unprepare call between two scrapes"
        self.bench.section.note(
            f"{mode} round {index + 1}: no claim {statistics.median(plain):.2f}s, first pod with a claim "
            f"{statistics.median(claim):.2f}s, further pod {statistics.median(further):.2f}s"
            f" (median of {len(plain)}), Prepare {', '.join(f'{p * 1000:.0f}ms' for p in prepares) or '-'}"
        )

    async def pod_running(
        self, release: RealRelease, work: Pods, name: str, node: Node, template: str | None,
        timeline: Timeline | None = None, volumes: bool = True,
    ) -> float:  # fmt: skip
        spec: dict[str, Any] = {
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "3600"]}],
        }
        if not volumes:
            spec["automountServiceAccountToken"] = False
        if template:
            spec["containers"][0]["resources"] = {"claims": [{"name": "channel"}]}
            spec["resourceClaims"] = [{"name": "channel", "resourceClaimTemplateName": template}]
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": release.workload_ns},
                "spec": spec}  # fmt: skip
        client = work.informer.client
        t0 = time.time()
        if timeline is not None:
            timeline.start(name, node.name, t0)
        created = await client.create(PODS, body)
        key = f"{name}/{created['metadata']['uid']}"
        await wait_for(lambda: key in work.running, 150, f"pod {name} Running", interval=0.02)
        return work.running[key] - t0

    async def delete_pod(self, release: RealRelease, work: Pods, name: str) -> None:
        await work.informer.client.delete(PODS, name, namespace=release.workload_ns)
        await wait_for(lambda: name not in work.seen, 120, f"pod {name} deleted")

    async def wait_calls(self, release: RealRelease, agent: str, before: Calls, operation: str) -> float | None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = await self.calls(release, agent)
            if now.count.get(operation, 0) > before.count.get(operation, 0):
                return now.since(before, operation)
            await asyncio.sleep(0.05)
        return None

    async def memory(self, release: RealRelease, node: Node, system: Pods, mode: str) -> None:
        agent = next(p for p in system.seen.values() if _is_agent(p) and p["spec"].get("nodeName") == node.name)
        container = Container.of(node, agent, "compute-domains")
        if container is not None:
            rss = container.rss_mib()
            self.f.agent_rss.round([rss["VmRSS"]])
            self.f.agent_rss.note = _rss_note(rss, len(container.pids()))
            self.f.agent_cgroup.round([container.working_set_mib()])
        if mode != "driverManaged":
            return
        daemon = next((p for p in system.seen.values() if COMPUTE_DOMAIN_LABEL in (p["metadata"].get("labels") or {})
                       and p["spec"].get("nodeName") == node.name), None)  # fmt: skip
        statuses = ((daemon or {}).get("status") or {}).get("containerStatuses") or [{}]
        daemon_container = Container.of(node, daemon, statuses[0].get("name", "")) if daemon else None
        if daemon_container is not None:
            rss = daemon_container.rss_mib(lambda cmd: "nvidia-imex" not in cmd)
            self.f.wrapper_rss.round([rss["VmRSS"]])
            self.f.wrapper_rss.note = _rss_note(rss, 1)
            self.f.daemon_cgroup.round([daemon_container.working_set_mib()])

    async def start_ups(self, release: RealRelease, when: str, only: str = "") -> None:
        """Process start -> serving of the running node agents (or only `only`) and the controller; a note
        names each start, so that the slowest of a run can be told apart (installed with the others, a
        replacement)."""
        pods = await asyncio.to_thread(release.items, "pods", release.driver_ns)
        seen: list[str] = []
        by_node = {n.name: n for n in self.nodes.nodes}
        for pod in pods:
            node = by_node.get(pod["spec"].get("nodeName", ""))
            if node is None or pod["metadata"].get("deletionTimestamp"):
                continue
            if _is_agent(pod) and (not only or pod["metadata"]["name"] == only):
                figure, container, needle = self.f.agent_start, "compute-domains", "plugin serving"
            elif _component(pod) == "controller" and (not only or pod["metadata"]["name"] == only):
                figure, container, needle = self.f.controller_start, "compute-domain", "caches synced"
            else:
                continue
            found = Container.of(node, pod, container)
            started = found.started_at() if found else None
            serving = await _poll_value(
                functools.partial(_log_time, release, release.driver_ns, pod["metadata"]["name"], container, needle), 60
            )
            if started is None or serving is None:
                figure.failures += 1
                continue
            figure.round([serving - started])
            seen.append(f"{'node agent' if figure is self.f.agent_start else 'controller'} {serving - started:.2f}s")
        self.bench.section.note(f"start -> serving ({when}): {', '.join(seen) or 'none measured'}")

    async def restarts(self, release: RealRelease, system: Pods) -> None:
        """Delete one node agent pod and the controller pod; measure their replacements' start-up."""
        node = self.nodes.nodes[-1]
        old = {
            p["metadata"]["uid"] for p in system.seen.values()
            if (_is_agent(p) and p["spec"].get("nodeName") == node.name) or _component(p) == "controller"
        }  # fmt: skip
        for uid in old:
            pod = next(p for p in system.seen.values() if p["metadata"]["uid"] == uid)
            await self.kubectl(
                release, "delete", "pod", "-n", release.driver_ns, pod["metadata"]["name"], "--wait=false"
            )

        def replaced() -> list[str]:
            fresh = [p for p in system.seen.values() if p["metadata"]["uid"] not in old and _ready(p)
                     and ((_is_agent(p) and p["spec"].get("nodeName") == node.name) or _component(p) == "controller")]  # fmt: skip
            return [p["metadata"]["name"] for p in fresh] if len(fresh) == 2 else []

        await wait_for(lambda: bool(replaced()), 180, "the node agent and the controller replaced and Ready")
        for name in replaced():
            await self.start_ups(release, when=f"{release.mode}, a replacement", only=name)
        await asyncio.to_thread(release.wait_installed)


def _log_marks(release: RealRelease, system: Pods, node: Node, claim_prefix: str) -> dict[str, float]:
    """When the node agent of `node` logged that it prepared the claim named `claim_prefix`..., and the IMEX
    daemon there (driverManaged) started its wrapper and logged each of `DAEMON_LINES` (those seen)."""
    marks: dict[str, float] = {}
    agent = _agent(system, node.name)
    needle = f"prepared claim={claim_prefix}"
    if (prepared := _log_time(release, release.driver_ns, agent, "compute-domains", needle)) is not None:
        marks["agent-prepared"] = prepared
    daemon = next((p for p in system.seen.values() if COMPUTE_DOMAIN_LABEL in (p["metadata"].get("labels") or {})
                   and p["spec"].get("nodeName") == node.name and not p["metadata"].get("deletionTimestamp")), None)  # fmt: skip
    if daemon is None:
        return marks
    container = Container.of(node, daemon, DAEMON_CONTAINER)
    if container is not None and (started := container.started_at()) is not None:
        marks["daemon-process"] = started
    lines = _log_times(release, release.driver_ns, daemon["metadata"]["name"], DAEMON_CONTAINER, DAEMON_LINES.values())
    marks.update({step: lines[needle] for step, needle in DAEMON_LINES.items() if needle in lines})
    return marks


def _floor(marks: dict[str, float]) -> float | None:
    """The first pod's time without anything of the wrapper's or the node agent's own (driverManaged): the
    kubelet's start of the daemon pod up to its wrapper process, nvidia-imex from its spawn to the wrapper's
    `status=Ready`, and the kubelet from the node agent's Prepare to the pod Running. None when a mark is
    missing (hostManaged has no daemon)."""
    needed = ("daemon-process", "imex-started", "daemon-ready", "agent-prepared", "running")
    if any(step not in marks for step in needed):
        return None
    imex = marks["daemon-ready"] - marks["imex-started"]
    return marks["daemon-process"] + imex + (marks["running"] - marks["agent-prepared"])


def _rss_note(rss: dict[str, float], processes: int) -> str:
    return (f"last round: {rss['RssAnon']:.1f} MiB anonymous + {rss['RssFile']:.1f} MiB mapped files (the image's "
            f"Python and libraries, shared with every process that maps them); {processes} process(es)")  # fmt: skip


def _component(pod: Raw) -> str:
    return str((pod["metadata"].get("labels") or {}).get("app.kubernetes.io/component", ""))


def _is_agent(pod: Raw) -> bool:
    return _component(pod) == "kubelet-plugin"


def _agent(system: Pods, node: str) -> str:
    for pod in system.seen.values():
        if _is_agent(pod) and pod["spec"].get("nodeName") == node and not pod["metadata"].get("deletionTimestamp"):
            return str(pod["metadata"]["name"])
    raise RuntimeError(f"no node agent pod on {node}")


def _ready(pod: Raw) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _exists(release: RealRelease, kind: str, name: str, ns: str) -> bool:
    return release.get(kind, name, ns) is not None


def _json(value: Any) -> str:
    return json.dumps(value)


async def _until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not there within {within:.0f}s")
        await asyncio.sleep(0.5)


async def _poll_value(get: Callable[[], float | None], within: float) -> float | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(get)
        if value is not None:
            return value
        await asyncio.sleep(0.5)
    return None


async def run(bench: Bench) -> None:
    figures = Figures(bench.section)
    why = not_possible()
    if why:
        figures.not_measured(why)
        bench.section.note(f"not measured: {why}")
        return
    nodes = RealNodes(bench.local, count=2)
    with bench.step("starting two real nodes"):
        try:
            await asyncio.to_thread(nodes.up)
        except Exception as exc:  # the machine cannot run them: one line, no failure
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            figures.not_measured(f"real nodes did not start: {reason}")
            bench.section.note(f"not measured: real nodes did not start: {reason}")
            return
    try:
        bench.section.note(
            f"real nodes {', '.join(nodes.names)} up in {nodes.timings.get('up_s', 0):.1f}s; "
            f"{bench.size('BENCH_ROUNDS', 3, 1)} rounds of {bench.size('BENCH_REAL_SAMPLES', 3, 1)} pods per kind "
            "on the first node, one pod at a time"
        )
        client = await bench.client(qps=50)
        real = RealBench(bench, nodes, figures)
        for mode in MODES:
            await real.mode(client, mode)
    finally:
        with bench.step("stopping the real nodes"):
            await asyncio.to_thread(nodes.down)
