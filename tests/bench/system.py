"""System benchmark (SPEC section 9): a 72-node ComputeDomain over 4 simulated NVL72 cliques, end to end.

The chart is installed by helm on 4 racks x 18 trays (tests/testbed/sim: kwok nodes, kubelet stand-ins, the
pod runner; node agents and IMEX daemon wrappers hosted 18 to a process, each daemon's `nvidia-imex` the
IMEX simulator), then, per round, one ComputeDomain and one workload pod per node are created at once
through the API. Every time below runs from the create request of the ComputeDomain (the cause; the pods'
requests follow at once) to a watch event seen by this process (the effect), on one clock:

- create -> CD Ready, and create -> all workers Running (SPEC 9: < 30 s);
- last clique entry Ready -> CD Ready: both are watch events of this process, so the figure is the
  controller's reaction plus the difference of two watch lags (SPEC 9: < 2 s);
- the controller's own part: CD create -> its three children observed, plus the reaction above, and the
  controller process' CPU seconds over the round.

Per round also a convergence series: daemon pods created / Running / Ready, clique entries Ready and
workers Running over time. Between rounds the workers and the domain are deleted and the next round waits
until the daemons are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.kube.client import (
    COMPUTE_DOMAIN_CLIQUES,
    COMPUTE_DOMAINS,
    DAEMONSETS,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    Raw,
)
from computedomain.kube.informer import Informer
from tests.bench.figures import Figure, Series, Target
from tests.bench.harness import Bench, gather_limited, poll, wait_for
from tests.testbed.sim.cluster import TESTBED_LOGGERS, SimCluster, SimConfig
from tests.testbed.sim.pods import Hosting

SIMULATED = "nodes (kwok), kubelet (stand-in + pod runner), nvidia-imex (IMEX simulator); processes hosted 18 to one"


def _ready(pod: Raw) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or ()
    )


class Round:
    """Watch-driven milestones of one round, each the first time this process saw it."""

    def __init__(self, nodes: int, t0: float) -> None:
        self.nodes = nodes
        self.t0 = t0
        self.cd_uid = ""
        self.entries: dict[str, str] = {}  # node -> status, over all cliques of the domain
        self.daemons: dict[str, dict[str, bool]] = {}  # pod name -> milestones
        self.workers_running: set[str] = set()
        self.children: set[str] = set()
        self.at: dict[str, float] = {}
        self.curves: dict[str, list[tuple[float, float]]] = {}
        self.requests: Counter[tuple[str, str, str]] = Counter()  # the apiserver's, during the round
        self.cpu: Counter[str] = Counter()  # CPU seconds of the bring-up's processes during the round, by kind
        self.admission: Counter[str] = Counter()  # the apiserver's seconds in each admission plugin, during it

    def _mark(self, what: str) -> None:
        self.at.setdefault(what, time.monotonic())

    def _point(self, curve: str, value: int) -> None:
        points = self.curves.setdefault(curve, [])
        if not points or points[-1][1] != value:
            points.append((time.monotonic() - self.t0, value))

    def clique(self, obj: Raw) -> None:
        if not self.cd_uid or not obj["metadata"]["name"].startswith(self.cd_uid):
            return
        for d in obj.get("daemons") or ():
            self.entries[d["nodeName"]] = d.get("status", "")
        ready = sum(1 for s in self.entries.values() if s == "Ready")
        self._point("clique entries Ready", ready)
        if ready >= self.nodes:
            self._mark("last entry Ready")

    def cd(self, obj: Raw) -> None:
        if (obj.get("status") or {}).get("status") == "Ready" and obj["metadata"]["uid"] == self.cd_uid:
            self._mark("CD Ready")

    def daemon(self, pod: Raw) -> None:
        if (pod["metadata"].get("labels") or {}).get(COMPUTE_DOMAIN_LABEL) != self.cd_uid or not self.cd_uid:
            return
        state = self.daemons.setdefault(pod["metadata"]["name"], {})
        state["running"] = state.get("running") or (pod.get("status") or {}).get("phase") == "Running"
        state["ready"] = state.get("ready") or _ready(pod)
        self._point("daemon pods created", len(self.daemons))
        self._point("daemon pods Running", sum(1 for s in self.daemons.values() if s["running"]))
        self._point("daemon pods Ready", sum(1 for s in self.daemons.values() if s["ready"]))

    def worker(self, pod: Raw) -> None:
        if (pod.get("status") or {}).get("phase") == "Running":
            self.workers_running.add(pod["metadata"]["name"])
            self._point("workers Running", len(self.workers_running))
        if len(self.workers_running) >= self.nodes:
            self._mark("workers Running")

    def child(self, obj: Raw) -> None:
        if (obj["metadata"].get("labels") or {}).get(COMPUTE_DOMAIN_LABEL) == self.cd_uid and self.cd_uid:
            self.children.add(f"{obj['kind']}/{obj['metadata']['name']}")
            if len(self.children) >= 3:
                self._mark("children")


def apiserver_requests(sim: SimCluster) -> tuple[Counter[tuple[str, str, str]], Counter[str]]:
    """The apiserver's request counters by (verb, resource, code) and its seconds in each admission plugin
    (all requests, matched or not: what a policy's match rules cost shows here), from its /metrics."""
    text = sim.local.kubectl("get", "--raw", "/metrics").stdout
    out: Counter[tuple[str, str, str]] = Counter()
    for m in re.finditer(r"^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        out[(labels.get("verb", ""), resource, labels.get("code", ""))] += int(float(m.group(2)))
    admission: Counter[str] = Counter()
    for m in re.finditer(
        r"^apiserver_admission_controller_admission_duration_seconds_sum\{([^}]*)\} ([0-9.e+]+)$", text, re.M
    ):
        admission[dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).get("name", "")] += float(m.group(2))
    return out, admission


def _watch(informer: Informer[Raw], handler: Callable[[Raw], None]) -> None:
    informer.add_handler(on_add=handler, on_update=lambda _o, n: handler(n))


def _controller_cpu(sim: SimCluster) -> tuple[int, float] | None:
    """The controller process (the one controller replica the runner started): its PID and CPU seconds."""
    assert sim.runner is not None
    for (key, _container), launched in sim.runner.processes.items():
        if key.startswith(f"{sim.driver_ns}/") and "controller" in key and launched.pid:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{launched.pid}/stat").read_text().rsplit(")", 1)[1].split()
                return launched.pid, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def _process_cpu() -> dict[int, tuple[int, float, bytes]]:
    """Every process' parent, CPU seconds so far and command line."""
    tck = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[int, float, bytes]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tck
                out[int(entry.name)] = (int(fields[1]), cpu, (entry / "cmdline").read_bytes())
    return out


def cpu_by_kind(sim: SimCluster) -> Counter[str]:
    """CPU seconds so far of the bring-up's processes by kind: the control plane's, and this process with its
    descendants (the simulation's kwok, hosted node agents and daemons, IMEX simulators, the controller)."""
    procs = _process_cpu()
    named: dict[int, str] = {pid: name for name, pid in (sim.local.state() or {}).get("pids", {}).items()}
    named.pop(next((p for p, n in named.items() if n == "kwok"), -1), None)  # the shared cluster's, not ours
    if sim.runner is not None:
        for kind, pool in sim.runner.pools.items():
            named.update({host.pid: f"hosted {kind}s" for host in pool.hosts})
        if sim.runner.fork_server is not None:
            named[sim.runner.fork_server.pid] = "IMEX simulators"
    me = os.getpid()
    named[me] = "bench, pod runner, kubelet stand-ins"

    def kind(pid: int) -> str | None:
        seen = 0
        while pid > 1 and seen < 64:
            if pid in named:
                return named[pid]
            parent, _cpu, cmdline = procs.get(pid, (0, 0.0, b""))
            if b"nvidia-imex" in cmdline and b"nvidia-imex-ctl" not in cmdline:
                return "IMEX simulators"
            if b"podhost\x00--one" in cmdline:
                return "controller"
            if b"kwok" in cmdline.split(b"\x00")[0]:
                return "kwok"
            pid, seen = parent, seen + 1
        return None

    out: Counter[str] = Counter()
    for pid, (_parent, cpu, _cmdline) in procs.items():
        k = kind(pid)
        if k is not None:
            out[k] += cpu
    return out


async def one_round(sim: SimCluster, index: int, nodes: int, within: float) -> Round:
    assert sim.client is not None
    client = sim.client
    name = f"bench-{index}"
    cd_body = sim.compute_domain(name, num_nodes=nodes)
    pods = [sim.workload_pod(f"{name}-{n.name}", name, n.name) for n in sim.topology if n.clique][:nodes]
    progress = Round(nodes, time.monotonic())
    informers: list[tuple[Informer[Raw], Callable[[Raw], None]]] = [
        (Informer(client, COMPUTE_DOMAIN_CLIQUES, decode=lambda r: r, namespace=sim.driver_ns), progress.clique),
        (Informer(client, COMPUTE_DOMAINS, decode=lambda r: r, namespace=sim.workload_ns), progress.cd),
        (Informer(client, PODS, decode=lambda r: r, namespace=sim.workload_ns), progress.worker),
        (Informer(client, PODS, decode=lambda r: r, namespace=sim.driver_ns, label_selector=COMPUTE_DOMAIN_LABEL),
         progress.daemon),
        (Informer(client, DAEMONSETS, decode=lambda r: r, namespace=sim.driver_ns), progress.child),
        (Informer(client, RESOURCE_CLAIM_TEMPLATES, decode=lambda r: r), progress.child),
    ]  # fmt: skip
    for informer, handler in informers:
        _watch(informer, handler)
    tasks = [asyncio.create_task(i.run()) for i, _ in informers]
    try:
        for informer, _ in informers:
            await informer.has_synced()
        cpu0 = _controller_cpu(sim)
        kinds0 = await asyncio.to_thread(cpu_by_kind, sim)
        requests0, admission0 = await asyncio.to_thread(apiserver_requests, sim)
        progress.t0 = time.monotonic()
        created = await client.create(COMPUTE_DOMAINS, cd_body)
        progress.cd_uid = created["metadata"]["uid"]
        for informer, handler in informers:  # events that arrived before the UID was known
            for obj in informer.list():
                handler(obj)
        await gather_limited([client.create(PODS, p) for p in pods], limit=16)
        await wait_for(lambda: "CD Ready" in progress.at and "workers Running" in progress.at, within,
                       f"a {nodes}-node domain Ready and its {nodes} workers Running", interval=0.1)  # fmt: skip
        cpu1 = _controller_cpu(sim)
        # Processes that started during the round count from 0; those that ended during it are missing.
        kinds1 = await asyncio.to_thread(cpu_by_kind, sim)
        progress.cpu = Counter({k: v - kinds0.get(k, 0.0) for k, v in kinds1.items() if v - kinds0.get(k, 0.0) > 0})
        if cpu0 is not None and cpu1 is not None and cpu0[0] == cpu1[0]:  # a restarted controller: no figure
            progress.at["controller cpu"] = cpu1[1] - cpu0[1]
        elif cpu0 is not None:
            progress.at["controller restarted"] = 1.0
        requests1, admission1 = await asyncio.to_thread(apiserver_requests, sim)
        progress.requests = requests1 - requests0
        progress.admission = Counter({k: v - admission0.get(k, 0.0) for k, v in admission1.items()})
        return progress
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _reset(sim: SimCluster) -> None:
    """Delete the round's workers and domain; wait until the daemons are gone too."""
    assert sim.client is not None
    client = sim.client
    await sim.akubectl("delete", "pods", "--all", "-n", sim.workload_ns, "--wait=true", "--timeout=300s")
    await sim.delete_compute_domains(within=300)

    async def no_daemons() -> bool:
        return not (await client.list(PODS, namespace=sim.driver_ns, label_selector=COMPUTE_DOMAIN_LABEL)).items

    await poll(no_daemons, 300, "the previous round's daemon pods gone")


async def run(bench: Bench) -> None:
    section = bench.section
    racks = bench.size("BENCH_RACKS", 4, 1)
    trays = bench.size("BENCH_TRAYS", 18, 3)
    rounds = bench.size("BENCH_ROUNDS", 3, 1)
    nodes = racks * trays
    per_host = min(18, trays)
    config = SimConfig(
        racks=racks,
        trays_per_rack=trays,
        non_fabric=0,
        hosting=Hosting(
            plugins_per_host=per_host,
            daemons_per_host=per_host,
            # A dead peer is still noticed within 20 s (a ping unanswered for 4 x 5 s), with 2.5x fewer
            # heartbeats than 2 s x 10: the 72 simulators' heartbeats (17 links each way) cost ~0.33 core at
            # 2 s, ~0.12 at 5 s (18 simulators alone: 4.6 -> 1.7 ms of CPU per second each).
            imex_heartbeat_s=5.0,
            imex_heartbeat_misses=4,
            imex_fork_server=True,
        ),
        restart_backoff_s=2.0,
        log_level="warning",
    )
    label = f"{nodes}-node domain ({racks} clique{'s' if racks > 1 else ''})"
    sim_text = SIMULATED.replace("18", str(per_host))
    create_ready = section.figure(Figure("create-ready", f"{label}: create -> CD Ready", simulated=sim_text))
    create_running = section.figure(Figure("create-running", f"{label}: create -> all {nodes} workers Running",
                                           target=Target("max", 30.0, "< 30 s"), simulated=sim_text))  # fmt: skip
    reaction = section.figure(Figure("reaction", "last clique entry Ready -> CD Ready (both observed)",
                                     target=Target("max", 2.0, "< 2 s"), simulated=sim_text))  # fmt: skip
    own = section.figure(Figure("controller-own", "controller's own part: create -> 3 children + entry Ready -> CD Ready",
                                target=Target("max", 2.0, "< 2 s")))  # fmt: skip
    own_cpu = section.figure(Figure("controller-cpu", "controller CPU over the round", unit="CPU s"))
    conflicts = section.figure(Figure("clique-conflicts", "clique object writes refused (409 Conflict) per accepted write",
                                      unit="x", simulated="daemons hosted 18 to a process on 2 shared cores"))  # fmt: skip
    api = section.figure(Figure("api-requests", "apiserver requests during the round (all clients)", unit="requests"))
    cpu = section.figure(Figure("round-cpu", "CPU of the bring-up's processes over the round (control plane, test bed, product)",
                                unit="CPU s", simulated="2 cores, shared with whatever else runs"))  # fmt: skip
    for logger in TESTBED_LOGGERS:  # the test bed's INFO record goes to its log file, not to this output
        logging.getLogger(logger).setLevel(logging.INFO)
        logging.getLogger(logger).propagate = False
    start = time.monotonic()
    with bench.step(f"starting a simulated cluster of {nodes} nodes"):
        sim = SimCluster(bench.local, config)
        await sim.__aenter__()
    try:
        with bench.step("installing the chart (helm) and waiting for every node agent"):
            await sim.wait_installed(within=600)
        section.note(
            f"simulated cluster: {nodes} nodes in {racks} cliques, chart installed and every node agent Ready in "
            f"{time.monotonic() - start:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in sim.timings.items())})"
        )
        for index in range(rounds):
            with bench.step(f"round {index + 1}: bringing up a {nodes}-node domain"):
                got = await one_round(sim, index, nodes, within=900)
            at = got.at
            create_ready.round([at["CD Ready"] - got.t0])
            create_running.round([at["workers Running"] - got.t0])
            reaction.round([at["CD Ready"] - at["last entry Ready"]])
            own.round([at["children"] - got.t0 + max(0.0, at["CD Ready"] - at["last entry Ready"])])
            if "controller cpu" in at:
                own_cpu.round([at["controller cpu"]])
            if "controller restarted" in at:
                own_cpu.note = f"the controller restarted during round {index + 1}: no CPU figure for it"
            req = got.requests
            clique_writes = {
                code: n
                for (verb, res, code), n in req.items()
                if res == "computedomaincliques" and verb in ("PUT", "POST", "PATCH", "APPLY")
            }
            accepted = sum(n for code, n in clique_writes.items() if code.startswith("2"))
            if accepted:
                conflicts.round([clique_writes.get("409", 0) / accepted])
            api.round([float(sum(n for (verb, _r, _c), n in req.items() if verb != "WATCH"))])
            top = Counter[str]()
            for (verb, res, code), n in req.items():
                top[f"{verb} {res}{'' if code.startswith('2') else f' ({code})'}"] += n
            api.note = "most frequent, last round: " + ", ".join(f"{k}={v}" for k, v in top.most_common(8))
            failed = Counter({k: v for k, v in top.items() if k.endswith(")")})
            api.note += "; not 2xx: " + (", ".join(f"{k}={v}" for k, v in failed.most_common(6)) or "none")
            cpu.round([sum(got.cpu.values())])
            cpu.note = "by process, last round: " + ", ".join(f"{k} {v:.1f}" for k, v in got.cpu.most_common())
            cpu.note += "; the apiserver's seconds in admission plugins: " + ", ".join(
                f"{k} {v:.2f}" for k, v in got.admission.most_common(4)
            )
            series = Series(f"convergence-{index + 1}", f"round {index + 1}: {label} converging", "count",
                            target_x=30.0, target_text="SPEC 9: workers Running < 30 s", simulated=sim_text)  # fmt: skip
            series.curves = got.curves
            section.series.append(series)
            section.note(
                f"round {index + 1}: CD Ready {at['CD Ready'] - got.t0:.1f}s, workers Running "
                f"{at['workers Running'] - got.t0:.1f}s after the create request"
            )
            with bench.step(f"round {index + 1}: deleting the workers and the domain"):
                await _reset(sim)
    finally:
        with bench.step("stopping the simulated cluster"):
            await sim.__aexit__(None, None, None)
