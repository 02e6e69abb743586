"""What every benchmark gets: the cluster, its sizes, clients and namespaces it owns, and a step to blame.

A `Bench` is handed to a benchmark's `run(bench)`. Everything it creates through the bench (API clients,
namespaces) is removed by `close()` whatever happened, finalizers of this service's objects included (the
controller that would release them may be gone); the CRDs and DeviceClasses are installed by the runner
(`LocalCluster.install_base`, as the test fixtures do) and removed afterwards when the runner added them.

`bench.step("creating 100 ComputeDomains")` names what is going on, so a failure ends with one line that
says which step failed and why, instead of a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from computedomain.kube.client import (
    COMPUTE_DOMAIN_CLIQUES,
    COMPUTE_DOMAINS,
    DAEMONSETS,
    RESOURCE_CLAIM_TEMPLATES,
    ClientConfig,
    KubeClient,
)
from computedomain.kube.errors import KubeError, NotFound
from computedomain.kube.informer import Informer
from tests.bench.figures import Section
from tests.testbed import serviceaccount
from tests.testbed.cluster import LocalCluster

T = TypeVar("T")


class StepFailedError(Exception):
    """A benchmark step that did not complete; str() is the one line the runner prints."""


class Bench:
    def __init__(self, local: LocalCluster, section: Section, *, smoke: bool) -> None:
        self.local = local
        self.section = section
        self.smoke = smoke
        self.current = "starting"
        self.tag = uuid.uuid4().hex[:6]
        self._clients: list[KubeClient] = []
        self._namespaces: list[str] = []
        self._bindings: list[str] = []
        self._account: Path | None = None

    # -- sizes

    def size(self, env: str, full: float, smoke: float) -> int:
        """`env` from the environment when set, else the smoke or the full size."""
        return int(self.sizef(env, full, smoke))

    def sizef(self, env: str, full: float, smoke: float) -> float:
        value = os.environ.get(env)
        return float(value) if value else (smoke if self.smoke else full)

    # -- what the benchmark owns

    async def client(self, *, qps: float = 1000.0) -> KubeClient:
        client = await KubeClient.connect(
            kubeconfig=self.local.kubeconfig, config=ClientConfig(qps=qps, burst=int(qps) * 2)
        )
        self._clients.append(client)
        return client

    async def namespace(self, purpose: str) -> str:
        taken = sum(1 for n in self._namespaces if n.startswith(f"bench-{purpose}-{self.tag}"))
        name = f"bench-{purpose}-{self.tag}" + (f"-{taken}" if taken else "")  # a round may ask again
        await asyncio.to_thread(self.local.create_namespace, name)
        self._namespaces.append(name)
        return name

    async def service_account(self) -> Path:
        """The credentials the benchmarked processes (the controller, the node agent) run with, as a pod of
        theirs would: a ServiceAccount's token (bound to cluster-admin) and the cluster's CA in a directory
        that they mount at the in-pod path (`tests.testbed.serviceaccount.mounted`), so each takes a pod's
        in-cluster path and never imports the kubeconfig loader. On a control plane with API Priority and Fairness its requests
        are classified as an in-cluster controller's are (FlowSchema service-accounts, priority level
        workload-low)."""
        if self._account is None:
            ns = await self.namespace("sa")
            name = "bench-controller"
            binding = f"bench-controller-{self.tag}"
            await asyncio.to_thread(self.local.kubectl, "create", "serviceaccount", name, "-n", ns)
            self._bindings.append(binding)
            await asyncio.to_thread(self.local.kubectl, "create", "clusterrolebinding", binding,
                                    "--clusterrole=cluster-admin", f"--serviceaccount={ns}:{name}")  # fmt: skip
            token = (await asyncio.to_thread(self.local.kubectl, "create", "token", name, "-n", ns,
                                             "--duration=24h")).stdout.strip()  # fmt: skip
            admin = json.loads(self.local.kubeconfig.read_text())
            self._account = serviceaccount.write_dir(
                self.local.root / f"bench-controller-{self.tag}.serviceaccount",
                token=token, ca=serviceaccount.ca_pem(admin), namespace=ns,
            )  # fmt: skip
        return self._account

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        previous, self.current = self.current, what
        yield  # an exception leaves `current` naming this step, for the failure line
        self.current = previous

    def failure(self, exc: BaseException) -> str:
        """The one line that says what failed."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, KubeError | TimeoutError | OSError):
            reason = f"{type(exc).__name__}: {reason}"
        return f"failed while {self.current}: {reason[:400]}"

    async def close(self) -> None:
        """Remove what this benchmark created; errors here are reported, not raised."""
        if self._namespaces and not self._clients:
            await self.client()
        for ns in self._namespaces:
            client = self._clients[0]
            with contextlib.suppress(KubeError, OSError):
                await release_finalizers(client, ns)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.local.delete_namespace, ns, wait=True)
        for binding in self._bindings:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    self.local.kubectl, "delete", "clusterrolebinding", binding, "--ignore-not-found"
                )
        if self._account is not None:
            shutil.rmtree(self._account, ignore_errors=True)
        for c in self._clients:
            await c.close()
        self._clients.clear()


async def release_finalizers(client: KubeClient, namespace: str) -> None:
    """Strip finalizers of this service's objects in `namespace` (their controller may not run any more)."""
    for resource in (COMPUTE_DOMAINS, COMPUTE_DOMAIN_CLIQUES, DAEMONSETS, RESOURCE_CLAIM_TEMPLATES):
        try:
            items = (await client.list_all(resource, namespace=namespace)).items
        except NotFound:
            continue  # the CRD is not installed: nothing of that kind
        for obj in items:
            meta = obj["metadata"]
            if meta.get("finalizers"):
                with contextlib.suppress(NotFound):
                    await client.merge_patch(
                        resource, meta["name"], {"metadata": {"finalizers": None}}, namespace=namespace
                    )


class Watching:
    """Informers that run for the length of an ``async with`` block; entering waits until each has synced."""

    def __init__(self, informers: Sequence[Informer[Any]]) -> None:
        self.informers = list(informers)
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self.tasks = [asyncio.create_task(i.run()) for i in self.informers]
        for informer in self.informers:
            await informer.has_synced()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def wait_for(check: Callable[[], bool], within: float, what: str, *, interval: float = 0.01) -> None:
    """Wait until `check()` holds (state kept by watch handlers), else TimeoutError naming `what`."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {within:.0f}s")
        await asyncio.sleep(interval)


async def poll(check: Callable[[], Awaitable[bool]], within: float, what: str, *, interval: float = 0.5) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {within:.0f}s")
        await asyncio.sleep(interval)


async def gather_limited(coros: list[Awaitable[T]], limit: int = 64) -> list[T]:
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[T]) -> T:
        async with sem:
            return await c

    return list(await asyncio.gather(*(one(c) for c in coros)))


def cd_body(name: str, ns: str, *, num_nodes: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": f"{name}-ch"}}},
    }
