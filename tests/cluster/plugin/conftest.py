"""Fixtures for the node agent's cluster tests.

Each test gets simulated nodes of its own: a kwok-managed Node, a fake driver root (the mock NVML library
answering for an NVL72 tray, `/proc` files of a real H200, the IMEX simulator), short kubelet directories (unix socket paths are limited to
107 bytes), the node agent as a real process (`python -m computedomain kubelet-plugin`) and the kubelet
stand-in in the test's event loop.

These nodes are managed by a kwok of this session (annotation `kwok.x-k8s.io/node=standin`) started from the
current `tests/testbed/kwok-stages.yaml`, so the tests see the stand-in gating of pods with claims even when
the shared cluster's kwok was started from an older stages file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, DAEMON_DEVICE_CLASS, DRIVER_NAME
from computedomain.controller.claim_templates import holder_selector
from computedomain.kube.client import KubeClient
from computedomain.plugin.checkpoint import CheckpointStore
from tests.conftest import REPO, Cluster
from tests.testbed import leftovers
from tests.testbed.cluster import KWOK_NODE_ANNOTATION, KWOK_STAGES, LocalCluster, free_port
from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, write_fake_driver_root
from tests.testbed.kubelet import KubeletStandIn
from tests.testbed.nodes import gb200_node

T = TypeVar("T")

STANDIN_ANNOTATION_VALUE = "standin"
CLUSTER_UUID = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40"
GV = "resource.nvidia.com/v1beta1"


def fake_node(name: str, *, clique: bool = True) -> SimulatedNode:
    """The hardware facts of a test node: an NVL72 tray of clique `<CLUSTER_UUID>.1`, or a node without one."""
    if not clique:
        return SimulatedNode(name=name)
    return SimulatedNode(name=name, clique=SimulatedClique(cluster_uuid=uuid.UUID(CLUSTER_UUID), clique_id=1))


@pytest.fixture(scope="session")
def standin_kwok(cluster: Cluster) -> Iterator[None]:
    with running_standin_kwok(cluster.local):
        yield


@contextlib.contextmanager
def running_standin_kwok(local: LocalCluster) -> Iterator[None]:
    """A kwok for the nodes these tests make (annotation ``kwok.x-k8s.io/node=standin``) on ``local``."""
    bin_dir = Path(
        subprocess.run(
            [str(REPO / "testbin" / "build.sh"), "--print"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    log = (local.logs / f"kwok-standin-{os.getpid()}.log").open("ab")
    proc = subprocess.Popen(
        [
            str(bin_dir / "kwok"),
            f"--kubeconfig={local.root / 'kwok.kubeconfig'}",
            f"--config={KWOK_STAGES}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={STANDIN_ANNOTATION_VALUE}",
            "--cidr=10.245.0.1/16",
            "--node-ip=10.0.0.2",
            f"--server-address=127.0.0.1:{free_port()}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    # A run killed before its teardown leaves this kwok: the record lets the next command stop it.
    record = leftovers.SimRecord(id=f"standin-kwok-{os.getpid()}", release="", driver_ns="", workload_ns="",
                                 nodes=[], root="", kwok_pid=proc.pid, kwok_start=leftovers.start_time(proc.pid))  # fmt: skip
    leftovers.register(local, record)
    try:
        time.sleep(1.0)
        assert proc.poll() is None, "the stand-in kwok exited at start; see .cluster/logs/kwok-standin-*.log"
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        leftovers.unregister(local, record.id)


async def eventually(
    check: Callable[[], T | None], *, within: float = 30.0, interval: float = 0.1, what: str = ""
) -> T:
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = check()
        except AssertionError as exc:
            last = exc
        if last and not isinstance(last, AssertionError):
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what or check}: last={last!r}")
        await asyncio.sleep(interval)


@dataclass
class PluginProcess:
    """One node agent process; `kill()` is SIGKILL, `start()` starts a new one on the same node state."""

    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.log_path.open("ab")
        handle.write(f"\n===== start {self.starts} =====\n".encode())
        handle.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "computedomain", "kubelet-plugin"],
            cwd=REPO,
            env={**os.environ, **self.env},
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        handle.close()
        self.starts += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class SimNode:
    """One simulated node: Node object, disk state, agent process, kubelet stand-in."""

    name: str
    root: Path
    driver_ns: str
    clique: str
    plugin: PluginProcess
    standin: KubeletStandIn | None = None
    standin_task: asyncio.Task[None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def registrar_dir(self) -> Path:
        return self.root / "reg"

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins" / DRIVER_NAME

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def store(self) -> CheckpointStore:
        return CheckpointStore(self.plugin_dir, boot_id_path=Path("/proc/sys/kernel/random/boot_id"))

    def cdi_spec(self, claim_uid: str) -> dict[str, Any] | None:
        path = self.cdi_dir / f"k8s.compute-domain.nvidia.com-claim_{claim_uid}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.glob("*.json")) if self.cdi_dir.exists() else []


class Harness:
    def __init__(self, cluster: Cluster, namespace: str, client: KubeClient) -> None:
        self.cluster = cluster
        self.ns = namespace
        self.client = client
        self.driver_ns = f"drv-{uuid.uuid4().hex[:8]}"
        cluster.kubectl("create", "namespace", self.driver_ns)
        self.nodes: list[SimNode] = []

    # -- objects

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, check=check, input=input)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json"] + (["-n", namespace] if namespace else [])
        code, out = self.cluster.try_kubectl(*args)
        if code != 0:
            if "NotFound" in out or "not found" in out:
                return None
            raise AssertionError(out)
        result: dict[str, Any] = json.loads(out[out.index("{") :])
        return result

    def create_cd(self, name: str, *, mode: str = "Single", num_nodes: int = 0) -> dict[str, Any]:
        body = {
            "apiVersion": GV,
            "kind": "ComputeDomain",
            "metadata": {"name": name},
            "spec": {
                "numNodes": num_nodes,
                "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}, "allocationMode": mode},
            },
        }
        code, out = self.cluster.create(body, self.ns)
        assert code == 0, out
        cd: dict[str, Any] = json.loads(out)
        return cd

    def channel_template(self, cd: dict[str, Any], *, params: dict[str, Any] | None = None) -> str:
        """The workload ResourceClaimTemplate the controller creates for a CD (SPEC section 4)."""
        name = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
        parameters = params or {
            "apiVersion": GV,
            "kind": "ComputeDomainChannelConfig",
            "domainID": cd["metadata"]["uid"],
            "allocationMode": cd["spec"]["channel"]["allocationMode"],
        }
        self.cluster.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "channel",
                                    "exactly": {
                                        "deviceClassName": CHANNEL_DEVICE_CLASS,
                                        "selectors": [{"cel": {"expression": holder_selector(cd["metadata"]["uid"])}}],
                                    },
                                }
                            ],
                            "config": [
                                {"requests": ["channel"], "opaque": {"driver": DRIVER_NAME, "parameters": parameters}}
                            ],
                        }
                    }
                },
            },
            self.ns,
        )
        return name

    def daemon_template(self, cd: dict[str, Any]) -> str:
        name = f"computedomain-daemon-{cd['metadata']['uid']}"
        params = {"apiVersion": GV, "kind": "ComputeDomainDaemonConfig", "domainID": cd["metadata"]["uid"]}
        self.cluster.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [{"name": "daemon", "exactly": {"deviceClassName": DAEMON_DEVICE_CLASS}}],
                            "config": [
                                {"requests": ["daemon"], "opaque": {"driver": DRIVER_NAME, "parameters": params}}
                            ],
                        }
                    }
                },
            },
            self.driver_ns,
        )
        return name

    def pod(self, name: str, node: SimNode, template: str, namespace: str | None = None) -> None:
        self.cluster.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node.name},
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {"name": "c", "image": "example.invalid/worker:1", "resources": {"claims": [{"name": "cd"}]}}
                    ],
                    "resourceClaims": [{"name": "cd", "resourceClaimTemplateName": template}],
                },
            },
            namespace or self.ns,
        )

    def manual_claim_pod(
        self,
        pod: str,
        node: SimNode,
        params: dict[str, Any],
        *,
        device: str = "channel-0",
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """A pod bound to node with a claim allocated by hand (status written as an admin would), for inputs an
        admission policy would refuse at create time: the agent must defend itself anyway (and a policy may
        not be installed)."""
        ns = namespace or self.ns
        request = device.split("-")[0]
        klass = CHANNEL_DEVICE_CLASS if request == "channel" else DAEMON_DEVICE_CLASS
        claim_name = f"{pod}-claim"
        self.cluster.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": claim_name},
                "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": klass}}]}},
            },
            ns,
        )
        self.cluster.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod},
                "spec": {
                    "nodeName": node.name,
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {"name": "c", "image": "example.invalid/worker:1", "resources": {"claims": [{"name": "cd"}]}}
                    ],
                    "resourceClaims": [{"name": "cd", "resourceClaimName": claim_name}],
                },
            },
            ns,
        )
        pod_obj = self.get("pod", pod, ns)
        assert pod_obj is not None
        status = {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [{"request": request, "driver": DRIVER_NAME, "pool": node.name, "device": device}],
                        "config": [
                            {
                                "source": "FromClaim",
                                "requests": [request],
                                "opaque": {"driver": DRIVER_NAME, "parameters": params},
                            }
                        ],
                    },
                },
                "reservedFor": [{"resource": "pods", "name": pod, "uid": pod_obj["metadata"]["uid"]}],
            }
        }
        self.kubectl(
            "patch",
            "resourceclaim",
            claim_name,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )
        claim = self.get("resourceclaim", claim_name, ns)
        assert claim is not None
        return claim

    def claim_of(self, pod: str, namespace: str | None = None) -> dict[str, Any] | None:
        obj = self.get("pod", pod, namespace or self.ns)
        statuses = (obj or {}).get("status", {}).get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        return self.get("resourceclaim", statuses[0]["resourceClaimName"], namespace or self.ns)

    def phase(self, pod: str, namespace: str | None = None) -> str | None:
        obj = self.get("pod", pod, namespace or self.ns)
        return None if obj is None else str(obj.get("status", {}).get("phase"))

    def node_labels(self, node: SimNode) -> dict[str, str]:
        obj = self.get("node", node.name)
        assert obj is not None
        labels: dict[str, str] = obj["metadata"].get("labels") or {}
        return labels

    def set_clique(self, cd: dict[str, Any], node: SimNode, status: str) -> None:
        """Play the IMEX daemon: this node's entry in ComputeDomainClique <cdUID>.<cliqueID>."""
        uid = cd["metadata"]["uid"]
        clique_id = node.clique
        self.cluster.apply(
            {
                "apiVersion": GV,
                "kind": "ComputeDomainClique",
                "metadata": {
                    "name": f"{uid}.{clique_id}",
                    "labels": {
                        "resource.nvidia.com/computeDomain": uid,
                        "resource.nvidia.com/computeDomain.cliqueID": clique_id,
                    },
                },
                "daemons": [
                    {
                        "nodeName": node.name,
                        "ipAddress": "10.245.0.9",
                        "cliqueID": clique_id,
                        "index": 0,
                        "status": status,
                    }
                ],
            },
            self.driver_ns,
        )

    def node_events(self, node: SimNode) -> list[dict[str, Any]]:
        out = self.kubectl(
            "get",
            "events",
            "-A",
            "--field-selector",
            f"involvedObject.kind=Node,involvedObject.name={node.name}",
            "-o",
            "json",
        )
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    def pod_events(self, pod: str, namespace: str | None = None) -> list[dict[str, Any]]:
        out = self.kubectl(
            "get", "events", "-n", namespace or self.ns, "--field-selector", f"involvedObject.name={pod}", "-o", "json"
        )
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    # -- nodes

    async def add_node(
        self,
        *,
        clique: bool = True,
        env: dict[str, str] | None = None,
        driver_root: Path | None = None,
        standin: bool = True,
        backoff_s: float = 1.0,
        wait_slice: bool = True,
    ) -> SimNode:
        name = f"gb-{uuid.uuid4().hex[:8]}"
        clique_id = f"{CLUSTER_UUID}.1" if clique else ""
        node_obj = gb200_node(name, clique=clique_id or None)
        node_obj["metadata"]["annotations"][KWOK_NODE_ANNOTATION] = STANDIN_ANNOTATION_VALUE
        self.cluster.apply(node_obj)
        root = Path(tempfile.mkdtemp(prefix="cdp-", dir="/tmp"))
        # A given root brings its own NVML answers and /proc.
        fake_root = driver_root or write_fake_driver_root(root / "driver", fake_node(name, clique=clique))
        log_path = REPO / ".cluster" / "logs" / f"test-plugin-{name}.log"
        plugin_env = {
            "NODE_NAME": name,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "NAMESPACE": self.driver_ns,
            "KUBELET_REGISTRAR_DIRECTORY_PATH": str(root / "reg"),
            "KUBELET_PLUGINS_DIRECTORY_PATH": str(root / "plugins"),
            "CDI_ROOT": str(root / "cdi"),
            "NVIDIA_DRIVER_ROOT": str(fake_root),
            "PROC_ROOT": str(fake_root / "proc"),
            "HEALTHCHECK_PORT": "-1",
            "KUBE_API_QPS": "50",
            "KUBE_API_BURST": "100",
            "LOG_LEVEL": "info",
            **(env or {}),
        }
        node = SimNode(name, root, self.driver_ns, clique_id, PluginProcess(plugin_env, log_path))
        self.nodes.append(node)
        node.plugin.start()
        if standin:
            node.standin = KubeletStandIn(self.client, name, root / "reg", backoff_s=backoff_s)
            node.standin_task = asyncio.create_task(node.standin.run(), name=f"standin-{name}")
        await self.wait_registered(node)
        if wait_slice:
            await eventually(
                lambda: self.get("resourceslice", f"{name}-{DRIVER_NAME}"), what="the node's ResourceSlice"
            )
        return node

    async def wait_registered(self, node: SimNode, *, after: int = 0) -> None:
        if node.standin is None:
            sock = node.registrar_dir / f"{DRIVER_NAME}-reg.sock"

            def listening() -> bool:
                # A SIGKILLed agent leaves its socket file behind, which refuses connections: wait for a listener.
                with socket.socket(socket.AF_UNIX) as probe:
                    try:
                        probe.connect(str(sock))
                    except OSError:
                        return False
                return True

            await eventually(listening, what="plugin socket")
            return
        standin = node.standin
        await eventually(
            lambda: standin.registrations > after and DRIVER_NAME in standin.plugins,
            what=f"plugin registration on {node.name}",
        )

    async def restart_plugin(self, node: SimNode) -> None:
        before = node.standin.registrations if node.standin else 0
        node.plugin.start()
        await self.wait_registered(node, after=before)

    async def close(self) -> None:
        for node in self.nodes:
            if node.standin_task is not None:
                # Pods still on the node need the stand-in to go: force them first.
                self.kubectl(
                    "delete", "pods", "--all", "-n", self.ns, "--force", "--grace-period=0", "--wait=false", check=False
                )
                node.standin_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await node.standin_task
            node.plugin.stop()
        for node in self.nodes:
            self.kubectl("delete", "node", node.name, "--wait=false", check=False)
            shutil.rmtree(node.root, ignore_errors=True)
        self.kubectl("delete", "namespace", self.driver_ns, "--wait=false", check=False)


@pytest.fixture
async def harness(cluster: Cluster, namespace: str, standin_kwok: None) -> AsyncIterator[Harness]:
    client = await KubeClient.connect(kubeconfig=cluster.kubeconfig)
    h = Harness(cluster, namespace, client)
    try:
        yield h
    finally:
        for node in h.nodes:
            if node.plugin.proc is not None and node.plugin.proc.poll() not in (None, 0, -9):
                print(f"--- plugin log of {node.name}:\n{node.plugin.log()[-4000:]}")
        await h.close()
        await client.close()
