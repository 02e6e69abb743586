"""`SimCluster`: simulated NVL72 racks on the local control plane with this service installed by `helm install`.

    async with SimCluster(LocalCluster(), SimConfig(racks=2, non_fabric=2)) as sim:
        await sim.wait_installed()
        ...  # kubectl create a ComputeDomain and a workload in sim.workload_ns

What `__aenter__` does, in order: lay out the node trees (`topology`); start a kwok of our own that manages
only this simulation's nodes (so its stages are the current `tests/testbed/kwok-stages.yaml`, and other
tests' nodes are not ours); create the Nodes; start one kubelet stand-in per node (`tests/testbed/kubelet.py`:
plugin registration, Prepare before a pod with claims may run, Unprepare before it may go); start the pod
runner (`pods`); in hostManaged mode start the host IMEX services (`hostimex`); `helm install` the chart
(`SimConfig.install`; else the test calls `install` when it is ready).

The chart is installed as an operator would, plus what sharing a cluster with other tests needs: node
selectors that keep the controller and node agents on this simulation's nodes, the DeviceClasses left out
when another installation owns them already, uninstall teardown limited to the workload namespace, and the
controller limited to the workload namespace's ComputeDomains (see `podhost --one`).

`__aexit__` deletes the workload namespace's ComputeDomains and waits until the controller released them,
uninstalls the release, stops everything, deletes the Nodes (and their ResourceSlices) and the node trees.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, DRIVER_NAME
from computedomain.kube.client import COMPUTE_DOMAINS, DEVICE_CLASSES, PODS, RESOURCE_SLICES, ClientConfig, KubeClient
from computedomain.kube.errors import NotFound
from tests.testbed import leftovers
from tests.testbed.cluster import KWOK_NODE_ANNOTATION, KWOK_STAGES, LocalCluster, free_port
from tests.testbed.kubelet import KubeletStandIn
from tests.testbed.sim.containers import REPO
from tests.testbed.sim.hostimex import HostImex, mounted_below
from tests.testbed.sim.pods import Hosting, PodRunner
from tests.testbed.sim.topology import SELECTOR_LABEL, SimTopology, build_topology

log = logging.getLogger("sim")
T = TypeVar("T")

CHART = REPO / "manifests" / "helm" / "compute-domain"
GV = "resource.nvidia.com/v1beta1"
TESTBED_LOGGERS = ("sim", "kubelet-standin")


def chart_image() -> str:
    """The image the chart renders by default (values image.repository : Chart appVersion)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image'].get('tag') or chart['appVersion']}"


@dataclass
class SimConfig:
    racks: int = 2
    trays_per_rack: int = 18
    non_fabric: int = 2
    mode: str = "driverManaged"  # or hostManaged
    hosting: Hosting = field(default_factory=Hosting)
    prefix: str | None = None  # node name prefix; None: a random one (tests share the cluster)
    release: str = "cd"
    helm_set: list[str] = field(default_factory=list)
    restart_backoff_s: float = 10.0
    kubelet_backoff_s: float = 2.0
    log_level: str = "info"
    keep_root: bool = False
    # False: `__aenter__` stops before `helm install` (nodes, kubelets and pod runner up); `install` later,
    # for tests that first build what another driver left on the nodes.
    install: bool = True


def start_kwok(
    local: LocalCluster, annotation_value: str, log_path: Path, *, lease_s: int = 40, cidr: str = "10.246.0.1/16"
) -> subprocess.Popen[bytes]:
    """A kwok of its own that manages only the Nodes annotated `kwok.x-k8s.io/node=<annotation_value>`, with
    the test bed's stages; `lease_s` is the node lease duration (kwok renews a lease every quarter of it)."""
    bin_dir = Path(
        subprocess.run(
            [str(REPO / "testbin" / "build.sh"), "--print"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        kwok = subprocess.Popen(
            [
                str(bin_dir / "kwok"), f"--kubeconfig={local.root / 'kwok.kubeconfig'}",
                f"--config={KWOK_STAGES}", "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={annotation_value}",
                f"--cidr={cidr}", "--node-ip=10.0.0.3", f"--node-lease-duration-seconds={lease_s}",
                f"--server-address=127.0.0.1:{port}",
            ],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if kwok.poll() is not None:
            raise RuntimeError(f"kwok exited at start; see {log_path}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp,
        ):
            if resp.status == 200:
                return kwok
        time.sleep(0.2)
    kwok.kill()
    raise RuntimeError("kwok not healthy within 60s")


def stop_kwok(kwok: subprocess.Popen[bytes]) -> None:
    kwok.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        kwok.wait(10)
    if kwok.poll() is None:
        kwok.kill()
        kwok.wait(5)


async def eventually(check: Callable[[], Awaitable[T | None]], *, within: float, what: str, interval: float = 0.2) -> T:
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = await check()
        except (AssertionError, NotFound) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)


class SimCluster:
    def __init__(self, local: LocalCluster, config: SimConfig | None = None) -> None:
        self.local = local
        self.config = config or SimConfig()
        # Starts with a letter: the id is also a label value passed with `helm --set`, where an all-digit
        # or "1e5..." id would turn into a number and fail the install.
        self.id = "c" + uuid.uuid4().hex[:5]
        prefix = self.config.prefix if self.config.prefix is not None else f"s{self.id[1:5]}-"
        self.root = Path(tempfile.mkdtemp(prefix="cds", dir="/tmp"))
        self.topology: SimTopology = build_topology(
            self.root,
            racks=self.config.racks,
            trays_per_rack=self.config.trays_per_rack,
            non_fabric=self.config.non_fabric,
            prefix=prefix,
        )
        self.driver_ns = f"{prefix}cd-system".lstrip("-")
        self.workload_ns = f"{prefix}workloads".lstrip("-")
        self.image = chart_image()
        self.kwok_value = f"sim-{self.id}"
        self.client: KubeClient | None = None
        self.standins: dict[str, KubeletStandIn] = {}
        self.runner: PodRunner | None = None
        self.host_imex: HostImex | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._kwok: subprocess.Popen[bytes] | None = None
        self.installed = False
        self.timings: dict[str, float] = {}
        self._log_handler: logging.Handler | None = None
        self._record: leftovers.SimRecord | None = None

    @property
    def host_managed(self) -> bool:
        return self.config.mode == "hostManaged"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    # -- tools

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        result = self.local.kubectl(*args, check=False, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout + ("" if check else result.stderr)

    async def akubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        return await asyncio.to_thread(self.kubectl, *args, check=check, input=input)

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.local.kubeconfig), "HELM_CACHE_HOME": str(self.root / "helm-cache")}
        result = subprocess.run(
            [str(self.local.root / "bin" / "helm"), *args], capture_output=True, text=True, env=env, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args[:2])} failed: {result.stderr.strip()}")
        return result

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], namespace: str | None = None) -> str:
        items = obj if isinstance(obj, list) else [obj]
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        return self.kubectl("apply", "-f", "-", *(["-n", namespace] if namespace else []), input=body)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json", *(["-n", namespace] if namespace else [])]
        result = self.local.kubectl(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        obj: dict[str, Any] = json.loads(result.stdout)
        return obj

    def items(self, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json", *(["-n", namespace] if namespace else ["-A"])]
        if selector:
            args += ["-l", selector]
        items: list[dict[str, Any]] = json.loads(self.kubectl(*args))["items"]
        return items

    # -- lifecycle

    async def __aenter__(self) -> SimCluster:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    async def _start(self) -> None:
        start = time.monotonic()
        self.topology.write()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The test bed's own record (pod runner, kubelet stand-ins) at the loggers' levels: what happened when.
        self._log_handler = logging.FileHandler(self.log_dir / "testbed.log")
        self._log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        for name in TESTBED_LOGGERS:
            logging.getLogger(name).addHandler(self._log_handler)
        # One client plays every node's kubelet (a real one allows itself 50 QPS per node) and the container
        # runtime; the client's default 20 QPS, shared by 72 nodes, made pods wait for the token bucket.
        qps = 50.0 * len(self.topology.nodes)
        self.client = await KubeClient.connect(
            kubeconfig=self.local.kubeconfig, config=ClientConfig(qps=qps, burst=int(2 * qps))
        )
        self._record = leftovers.SimRecord(
            id=self.id, release=self.config.release, driver_ns=self.driver_ns, workload_ns=self.workload_ns,
            nodes=[n.name for n in self.topology], root=str(self.root),
        )  # fmt: skip
        leftovers.register(self.local, self._record)
        for ns in (self.driver_ns, self.workload_ns):
            await self._wait_terminated(ns)
            self.kubectl("create", "namespace", ns, check=False)
        self._start_kwok()
        assert self._kwok is not None
        self._record.kwok_pid, self._record.kwok_start = self._kwok.pid, leftovers.start_time(self._kwok.pid)
        leftovers.register(self.local, self._record)
        self.apply([n.manifest(self.id, self.kwok_value) for n in self.topology])
        self.runner = PodRunner(
            self.client,
            self.topology,
            images={self.image},
            admin_kubeconfig=self.local.kubeconfig,
            state_dir=self.root,
            # All of the configured hosting (fast ctl, IMEX heartbeats) reaches the runner; only the scope
            # defaults to this simulation's workload namespace.
            hosting=dataclasses.replace(
                self.config.hosting, controller_scope=self.config.hosting.controller_scope or self.workload_ns
            ),
            restart_backoff_s=self.config.restart_backoff_s,
        )
        for node in self.topology:
            # The stand-ins share the pod runner's informer: one pod watch for the simulation, not one per node.
            standin = KubeletStandIn(
                self.client,
                node.name,
                node.registrar_dir,
                backoff_s=self.config.kubelet_backoff_s,
                pods=self.runner.informer,
            )
            self.standins[node.name] = standin
            self._tasks.append(asyncio.create_task(standin.run(), name=f"kubelet-{node.name}"))
        self._tasks.append(asyncio.create_task(self.runner.run(), name="pod-runner"))
        if self.host_managed:
            self.host_imex = HostImex(self.topology, self.log_dir)
            await self.host_imex.start_all()
        await asyncio.to_thread(self.kubectl, "wait", "--for=condition=Ready", "--timeout=120s",
                                *[f"node/{n.name}" for n in self.topology])  # fmt: skip
        self.timings["nodes"] = time.monotonic() - start
        if self.config.install:
            await self.install()

    async def _wait_terminated(self, namespace: str, within: float = 120) -> None:
        """A namespace of these names that an earlier run deleted may still be terminating: wait it out."""
        phase = self.kubectl("get", "namespace", namespace, "-o", "jsonpath={.status.phase}", check=False)
        if phase.startswith("Terminating"):
            log.warning("namespace %s of an earlier run is still terminating; waiting for it", namespace)
            await self.akubectl("wait", "--for=delete", f"namespace/{namespace}", f"--timeout={within:.0f}s",
                                check=False)  # fmt: skip

    async def install(self, *args: str) -> None:
        """`helm install` the chart with the simulation's values (`helm_values`) and `args` after them."""
        start = time.monotonic()
        await asyncio.to_thread(self._helm_install, *args)
        self.installed = True
        self.timings["helm install"] = time.monotonic() - start

    def helm_values(self) -> list[str]:
        def esc(key: str) -> str:
            return key.replace(".", "\\.")

        values = [
            f"controller.nodeSelector.{esc(SELECTOR_LABEL)}={self.id}",
            f"kubeletPlugin.nodeSelector.{esc(SELECTOR_LABEL)}={self.id}",
            f"uninstall.namespaces={{{self.workload_ns}}}",
            f"logLevel={self.config.log_level}",
            # The driver's /proc files live in each node's fake driver root (the chart's default
            # nvidiaDriverRoot "/", the node's tree), which the agent sees at /driver-root.
            "kubeletPlugin.containers.computeDomains.env[0].name=PROC_ROOT",
            "kubeletPlugin.containers.computeDomains.env[0].value=/driver-root/proc",
        ]
        if self.get("deviceclass", CHANNEL_DEVICE_CLASS) is not None:
            values.append("resources.computeDomains.deviceClasses=false")
        if self.host_managed:
            values += ["featureGates.HostManagedIMEXDaemon=true", "resources.computeDomains.imex.mode=hostManaged"]
        return values + self.config.helm_set

    def _helm_install(self, *extra: str) -> None:
        args = ["install", self.config.release, str(CHART), "--namespace", self.driver_ns]
        for item in self.helm_values():
            args += ["--set", item]
        self.helm(*args, *extra)

    def _start_kwok(self) -> None:
        self._kwok = start_kwok(self.local, self.kwok_value, self.log_dir / "kwok.log")

    async def wait_installed(self, within: float = 240) -> None:
        """Controller replicas Ready and every node agent's pod Ready with its ResourceSlice published."""
        assert self.client is not None
        client = self.client
        nodes = {n.name for n in self.topology}

        async def ready() -> bool:
            pods = (await client.list(PODS, namespace=self.driver_ns)).items
            ready_pods = [
                p for p in pods
                if p["status"].get("phase") == "Running"
                and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or ())
            ]  # fmt: skip
            components = [p["metadata"].get("labels", {}).get("app.kubernetes.io/component") for p in ready_pods]
            slices = (await client.list(RESOURCE_SLICES, field_selector=f"spec.driver={DRIVER_NAME}")).items
            published = {s["spec"].get("nodeName") for s in slices} & nodes
            return (
                components.count("kubelet-plugin") == len(nodes) and "controller" in components and published == nodes
            )

        start = time.monotonic()
        await eventually(ready, within=within, what="controller and node agents Ready, ResourceSlices published")
        self.timings["agents ready"] = time.monotonic() - start

    async def delete_compute_domains(self, within: float = 120) -> None:
        assert self.client is not None
        client = self.client
        await self.akubectl("delete", "computedomains", "--all", "-n", self.workload_ns, "--wait=false", check=False)

        async def gone() -> bool:
            return not (await client.list(COMPUTE_DOMAINS, namespace=self.workload_ns)).items

        await eventually(gone, within=within, what="ComputeDomains released by the controller")

    async def uninstall(self, *, hooks: bool = False) -> None:
        if not self.installed:
            return
        args = ["uninstall", self.config.release, "--namespace", self.driver_ns, "--wait", "--timeout=300s"]
        if not hooks:
            args.append("--no-hooks")
        await asyncio.to_thread(self.helm, *args, check=False)
        self.installed = False

    async def _stop(self) -> None:
        client = self.client
        with contextlib.suppress(Exception):
            if self.installed:
                await self.akubectl("delete", "pods", "--all", "-n", self.workload_ns, "--wait=false", check=False)
                await self.delete_compute_domains()
        with contextlib.suppress(Exception):
            await self.uninstall(hooks=False)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.host_imex is not None:
            await self.host_imex.stop_all()
        if self._kwok is not None:
            stop_kwok(self._kwok)
        names = [n.name for n in self.topology]
        self.kubectl("delete", "node", *names, "--wait=false", check=False)
        if client is not None:
            with contextlib.suppress(Exception):
                slices = (await client.list(RESOURCE_SLICES, field_selector=f"spec.driver={DRIVER_NAME}")).items
                for s in slices:
                    if s["spec"].get("nodeName") in self.topology.by_name:
                        with contextlib.suppress(NotFound):
                            await client.delete(RESOURCE_SLICES, s["metadata"]["name"])
            # Pods of ours left on deleted nodes would keep their namespaces Terminating.
            with contextlib.suppress(Exception):
                for ns in (self.driver_ns, self.workload_ns):
                    await self.akubectl(
                        "delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", "--wait=false", check=False
                    )
                    await self.akubectl("delete", "namespace", ns, "--wait=false", check=False)
            await client.close()
        if self.host_imex is not None:
            self.host_imex.unmount_all()
        if self._log_handler is not None:
            for name in TESTBED_LOGGERS:
                logging.getLogger(name).removeHandler(self._log_handler)
            self._log_handler.close()
        if self._record is not None:
            leftovers.unregister(self.local, self._record.id)
        if not self.config.keep_root:
            if mounted_below(self.root):
                log.error("bind mounts remain below %s; not deleting it", self.root)
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    # -- workloads (what a user creates)

    def compute_domain(self, name: str, *, num_nodes: int = 0, mode: str = "Single") -> dict[str, Any]:
        return {
            "apiVersion": GV,
            "kind": "ComputeDomain",
            "metadata": {"name": name, "namespace": self.workload_ns},
            "spec": {
                "numNodes": num_nodes,
                "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}, "allocationMode": mode},
            },
        }

    def workload_pod(self, name: str, cd: str, node: str | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "terminationGracePeriodSeconds": 5,
            "tolerations": [{"operator": "Exists"}],
            "nodeSelector": {SELECTOR_LABEL: self.id, **({"kubernetes.io/hostname": node} if node else {})},
            "containers": [
                {
                    "name": "worker",
                    "image": "example.invalid/nccl-test:1",
                    "command": ["all_reduce_perf", "-b", "8", "-e", "1G"],
                    "resources": {"claims": [{"name": "imex-channel"}]},
                }
            ],
            "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": f"{cd}-channel"}],
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.workload_ns},
            "spec": spec,
        }

    def job(self, name: str, cd: str, pods: int, *, affinity_clique: bool = True) -> dict[str, Any]:
        """A Job of `pods` workers that all need the CD's channel, spread one per node of one clique."""
        template = self.workload_pod("unused", cd)
        spec = template["spec"]
        spec.pop("terminationGracePeriodSeconds")
        spec["restartPolicy"] = "Never"
        labels = {"job": name}
        affinity: dict[str, Any] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels}}
                ]
            }
        }
        if affinity_clique:
            affinity["podAffinity"] = {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": "nvidia.com/gpu.clique", "labelSelector": {"matchLabels": labels}}
                ]
            }
        spec["affinity"] = affinity
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": self.workload_ns},
            "spec": {
                "completions": pods,
                "parallelism": pods,
                "backoffLimit": 0,
                "template": {"metadata": {"labels": labels}, "spec": spec},
            },
        }

    async def device_classes_present(self) -> bool:
        assert self.client is not None
        try:
            await self.client.get(DEVICE_CLASSES, CHANNEL_DEVICE_CLASS)
        except NotFound:
            return False
        return True
