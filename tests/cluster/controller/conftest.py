"""Fixtures for the controller's cluster tests: a driver namespace per test, the controller in-process or as
a subprocess, and polling helpers. Every controller here only handles ComputeDomains of the test's own
namespace (``cd_namespace``), so tests can share the cluster with everything else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.controller.app import Controller
from computedomain.kube.client import KubeClient
from computedomain.settings import ControllerSettings, load_settings
from tests.cluster.claims import allocated_claim
from tests.conftest import REPO, Cluster

T = TypeVar("T")

IMAGE = "registry.example/computedomain:test"


def compute_domain(
    name: str, *, num_nodes: int = 0, template: str | None = None, mode: str = "Single"
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {
            "numNodes": num_nodes,
            "channel": {"resourceClaimTemplate": {"name": template or f"{name}-channel"}, "allocationMode": mode},
        },
    }


async def eventually(
    check: Callable[[], T | None], *, within: float = 20.0, interval: float = 0.1, what: str = ""
) -> T:
    """Poll ``check`` (sync, may call kubectl) until it returns something truthy."""
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


def env_for(cluster: Cluster, driver_ns: str, **extra: str) -> dict[str, str]:
    return {
        "KUBECONFIG": str(cluster.kubeconfig),
        "NAMESPACE": driver_ns,
        "IMAGE_NAME": IMAGE,
        "KUBE_API_QPS": "200",
        "KUBE_API_BURST": "400",
        "LOG_LEVEL": "info",
        **extra,
    }


@dataclass
class Harness:
    """The cluster plus this test's driver namespace and CD namespace."""

    cluster: Cluster
    driver_ns: str
    cd_ns: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    cluster_scoped: list[tuple[str, str]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    def kubectl(self, *args: str, check: bool = True) -> str:
        return self.cluster.kubectl(*args, check=check)

    def get_json(self, *args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json"))
        return out

    def try_get(self, *args: str) -> dict[str, Any] | None:
        code, out = self.cluster.try_kubectl("get", *args, "-o", "json")
        if code != 0:
            if "NotFound" in out or "not found" in out:
                return None
            raise AssertionError(out)
        result: dict[str, Any] = json.loads(out[out.index("{") :])
        return result

    def create_cd(self, name: str, **kwargs: Any) -> dict[str, Any]:
        code, out = self.cluster.create(compute_domain(name, **kwargs), namespace=self.cd_ns)
        assert code == 0, out
        created: dict[str, Any] = json.loads(out)
        return created

    def daemon_pod(self, cd_uid: str, node: str, clique_id: str, namespace: str | None = None) -> str:
        """A pod standing in for the domain's IMEX daemon on ``node`` (kwok runs it): the controller keeps the
        clique entries of nodes that have one and prunes the others. Its controller is a ConfigMap, so the
        domain's DaemonSet neither adopts nor deletes it (the node carries no CD label)."""
        ns = namespace or self.driver_ns
        code, out = self.cluster.create(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"stand-in-{node}"}}, ns
        )
        assert code == 0, out
        owner = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": f"stand-in-{node}",
            "uid": json.loads(out)["metadata"]["uid"],
            "controller": True,
        }
        name = f"daemon-{node}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {COMPUTE_DOMAIN_LABEL: cd_uid, CLIQUE_LABEL: clique_id},
                "ownerReferences": [owner],
            },
            "spec": {
                "nodeName": node,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "compute-domain-daemon", "image": "compute-domain-daemon:test"}],
            },
        }
        self.cluster.apply(pod, ns)
        return name

    def allocated_claim(self, cd_uid: str, node: str, *, name: str | None = None) -> str:
        """A channel claim of the domain in its namespace, ``channel-0`` of ``node`` allocated (``claims``)."""
        return allocated_claim(self.cluster, self.cd_ns, cd_uid, node, name=name)

    def restricted_kubeconfig(self, *, without: tuple[str, str]) -> Path:
        """Credentials of a ServiceAccount with the chart's controller RBAC (``manifests/base``) minus one
        ``(resource, verb)``: what a cluster whose ClusterRole lacks that verb gives the controller."""
        resource, verb = without
        sa = f"ctl-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "serviceaccount", sa, "-n", self.driver_ns)
        docs = list(yaml.safe_load_all((REPO / "manifests" / "base" / "rbac-controller.yaml").read_text()))

        def rules(kind: str, name_suffix: str) -> list[dict[str, Any]]:
            doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix))
            out = []
            for rule in doc["rules"]:
                verbs = [v for v in rule["verbs"] if not (resource in rule["resources"] and v == verb)]
                if verbs:
                    out.append({**rule, "verbs": verbs})
            return out

        subject = [{"kind": "ServiceAccount", "name": sa, "namespace": self.driver_ns}]
        cluster_name = f"test-{self.driver_ns}-{sa}"
        objects = [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": cluster_name},
             "rules": rules("ClusterRole", "-controller")},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": cluster_name}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": sa, "namespace": self.driver_ns}, "rules": rules("Role", "controller")},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": sa, "namespace": self.driver_ns}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa}},
        ]  # fmt: skip
        self.cluster.apply(objects)
        self.cluster_scoped += [("clusterrole", cluster_name), ("clusterrolebinding", cluster_name)]
        token = self.kubectl("create", "token", sa, "-n", self.driver_ns, "--duration=1h").strip()
        config = json.loads(self.kubectl("config", "view", "--raw", "-o", "json"))
        config["users"] = [{"name": sa, "user": {"token": token}}]
        for context in config["contexts"]:
            context["context"]["user"] = sa
        path = REPO / ".cluster" / f"kubeconfig-{sa}"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        self.files.append(path)
        return path

    def settings(self, **env: str) -> ControllerSettings:
        return load_settings(ControllerSettings, [], environ=env_for(self.cluster, self.driver_ns, **env))

    @contextlib.asynccontextmanager
    async def controller(
        self, *, kubeconfig: Path | None = None, wait_ready: bool = True, **env: str
    ) -> AsyncIterator[Controller]:
        """An in-process controller (as ``kubeconfig``'s identity, by default the admin), until the block ends."""
        settings = self.settings(**env)
        client = await KubeClient.connect(kubeconfig=kubeconfig or self.cluster.kubeconfig)
        ctl = Controller(settings, client, cd_namespace=self.cd_ns, identity=f"test-{uuid.uuid4().hex[:6]}")
        task = asyncio.create_task(ctl.run(), name="controller-under-test")
        try:
            while wait_ready and not ctl.ready:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
            yield ctl
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.close()

    def spawn(self, *, log_name: str = "controller", **env: str) -> subprocess.Popen[bytes]:
        """The controller as a subprocess (for SIGKILL and leader election)."""
        full = {**os.environ, **env_for(self.cluster, self.driver_ns, **env), "TEST_CD_NAMESPACE": self.cd_ns}
        log_path = REPO / ".cluster" / "logs" / f"test-{self.cd_ns}-{log_name}-{len(self.logs)}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = log_path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.controller.proc"],
            cwd=REPO,
            env=full,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        handle.close()
        self.procs.append(proc)
        self.logs.append(log_path)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        for kind, name in self.cluster_scoped:
            self.kubectl("delete", kind, name, "--wait=false", check=False)
        for path in self.files:
            path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def harness(cluster: Cluster, namespace: str) -> Iterator[Harness]:
    driver_ns = f"drv-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", driver_ns)
    h = Harness(cluster, driver_ns, namespace)
    try:
        yield h
    finally:
        h.stop_all()
        # Whatever a failed test left behind must not block namespace deletion.
        for kind, ns in (
            ("computedomains", namespace),
            ("daemonsets", driver_ns),
            ("resourceclaimtemplates", driver_ns),
            ("resourceclaimtemplates", namespace),
        ):
            names = cluster.kubectl("get", kind, "-n", ns, "-o", "name", check=False).split()
            for name in names:
                cluster.kubectl(
                    "patch", name, "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
                )
        cluster.kubectl("delete", "namespace", driver_ns, "--wait=false", check=False)


Waiter = Callable[..., Awaitable[Any]]
