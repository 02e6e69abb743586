"""Chaos on the real control plane: kube-apiserver and etcd restarted, the controller and node agents SIGKILLed,
each in the middle of a burst of ComputeDomain creates and deletes. After every round each new domain
converges (Ready, its workload pods Running) and each deleted one is gone; at the end nothing is left: no
orphaned child, clique or node label, no stuck finalizer, no channel still held on a node (checkpoint
entries, CDI specs).

The control plane is a cluster of this module's own (``.cluster/chaos/``, its own ports), started for the
module and stopped after it: restarting the apiserver of the cluster other tests share would break them.
What runs on it: the controller as a process, four simulated nodes with a node agent process and the
kubelet stand-in each (the plugin tests' harness), and the IMEX daemons played by the product's own
registration code (``imex.daemon.registration``) for every daemon pod that runs, since no IMEX hardware
exists here. The played daemons never unregister (they "die" with their pods), so the controller's
pruning and the garbage collector do that work.

Random: the order of the disruptions and the moment each hits the burst come from the ``seed`` fixture
(printed; ``TEST_SEED`` replays a run). ``CHAOS_ROUNDS`` (default 4: each disruption once) sets the rounds.
Cost in ``make test``: about 3-4 minutes on a 2-core machine, most of it the second control plane's start
and the apiserver and etcd restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.api.models import ReadyStatus
from computedomain.controller.daemonset import SERVICE_ACCOUNT
from computedomain.kube.client import PODS, KubeClient
from computedomain.kube.errors import KubeError
from imex.daemon.registration import CliqueBackend, Identity, Registry, pod_owner_reference
from tests.cluster.controller.conftest import Harness as ControllerHarness
from tests.cluster.plugin.conftest import Harness, SimNode, running_standin_kwok
from tests.conftest import REPO, Cluster
from tests.testbed.cluster import LocalCluster, _alive, _terminate

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.asyncio(loop_scope="module"),
]

T = TypeVar("T")

ROOT = REPO / ".cluster" / "chaos"
ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "4"))
DISRUPTIONS = ("kube-apiserver", "etcd", "controller", "node-agent")
CONVERGE_S = 180.0


class ChaosCluster(LocalCluster):
    """A LocalCluster whose components can be restarted one at a time."""

    def restart(self, name: str) -> None:
        """SIGTERM the component, start it again with the same flags and ports, wait until it serves."""
        state = self.state()
        assert state is not None and state.get("ready"), "the chaos cluster is not running"
        _terminate(state["pids"][name])
        component = next(c for c in self._components(Path(state["bin"]), state["ports"]) if c.name == name)
        state["pids"][name] = self._spawn(component)
        self.state_file.write_text(json.dumps(state))
        if component.health_url:
            self._wait_healthy(component)
        deadline = time.monotonic() + 120
        while self._get(f"{self.server}/readyz", timeout=5.0)[0] != 200:  # etcd: the apiserver reconnects
            assert time.monotonic() < deadline, f"the apiserver did not get ready after restarting {name}"
            assert _alive(state["pids"][name]), f"{name} exited after its restart:\n{self.log_tail(name)}"
            time.sleep(0.25)


@pytest.fixture(scope="module")
def chaos_cluster() -> Iterator[tuple[ChaosCluster, Cluster]]:
    local = ChaosCluster(ROOT)
    local.up()
    try:
        local.install_base()
        cluster = Cluster(local)
        with running_standin_kwok(local):
            yield local, cluster
    finally:
        local.down()


async def api(what: str, call: Callable[[], T], within: float = 120.0) -> T:
    """A test's own API call (kubectl): while the apiserver restarts it fails, so try again."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await asyncio.to_thread(call)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def until(what: str, check: Callable[[], Awaitable[bool] | bool], within: float = CONVERGE_S) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            result = check()
            if isinstance(result, Awaitable):
                result = await result
            if result:
                return
        except (AssertionError, KubeError):
            pass  # the apiserver may be restarting
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.5)


class PlayedDaemons:
    """The IMEX daemons of every running daemon pod, played by the product's registration code: each registers
    its entry Ready (created with an owner reference to its pod). None ever unregisters."""

    def __init__(self, client: KubeClient, driver_ns: str, cliques: dict[str, str]) -> None:
        self.client = client
        self.driver_ns = driver_ns
        self.cliques = cliques  # node -> clique ID
        self.registered: set[str] = set()  # pod UIDs

    async def run(self) -> None:
        while True:
            with contextlib.suppress(KubeError, OSError):
                await self.sync()
            await asyncio.sleep(0.25)

    async def sync(self) -> None:
        pods = await self.client.list(PODS, namespace=self.driver_ns, label_selector=COMPUTE_DOMAIN_LABEL)
        for pod in pods.items:
            meta, status = pod["metadata"], pod.get("status") or {}
            node = (pod.get("spec") or {}).get("nodeName")
            if (
                meta["uid"] in self.registered
                or status.get("phase") != "Running"
                or not node
                or meta.get("deletionTimestamp")
            ):
                continue
            clique = self.cliques[node]
            cd_uid = meta["labels"][COMPUTE_DOMAIN_LABEL]
            registry = Registry(
                self.client,
                CliqueBackend(namespace=self.driver_ns, cd_uid=cd_uid, clique_id=clique),
                Identity(node_name=node, ip_address=status.get("podIP") or "10.245.9.9", clique_id=clique),
                max_nodes=18,
                owner=pod_owner_reference(meta["name"], meta["uid"]),
            )
            await self.client.merge_patch(
                PODS, meta["name"], {"metadata": {"labels": {CLIQUE_LABEL: clique}}}, namespace=self.driver_ns
            )
            await registry.set_status(ReadyStatus.READY)
            self.registered.add(meta["uid"])


@pytest_asyncio.fixture(loop_scope="module")
async def world(
    chaos_cluster: tuple[ChaosCluster, Cluster],
) -> AsyncIterator[tuple[ChaosCluster, Harness, ControllerHarness]]:
    local, cluster = chaos_cluster
    ns = f"t-{uuid.uuid4().hex[:10]}"
    local.create_namespace(ns)
    client = await KubeClient.connect(kubeconfig=cluster.kubeconfig)
    nodes = Harness(cluster, ns, client)
    cluster.kubectl("create", "serviceaccount", SERVICE_ACCOUNT, "-n", nodes.driver_ns)  # the chart's, for daemon pods
    controller = ControllerHarness(cluster, nodes.driver_ns, ns)
    try:
        yield local, nodes, controller
    finally:
        controller.stop_all()
        await nodes.close()
        await client.close()


async def test_domains_converge_through_restarts_and_kills(
    world: tuple[ChaosCluster, Harness, ControllerHarness], seed: int
) -> None:
    local, h, ctl = world
    rng = random.Random(seed)
    procs = {"controller": ctl.spawn(log_name="chaos")}
    sim: list[SimNode] = [await h.add_node() for _ in range(4)]
    daemons = PlayedDaemons(h.client, h.driver_ns, {n.name: n.clique for n in sim})
    player = asyncio.create_task(daemons.run(), name="played-daemons")
    try:
        all_uids: list[str] = []
        await chaos_rounds(local, h, ctl, sim, procs, rng, seed, all_uids)
    finally:
        player.cancel()
        await asyncio.gather(player, return_exceptions=True)
    await all_clear(h, sim, all_uids)
    assert procs["controller"].poll() is None, "the controller died on its own"
    assert all(n.plugin.proc is not None and n.plugin.proc.poll() is None for n in sim), "a node agent died on its own"


async def chaos_rounds(
    local: ChaosCluster,
    h: Harness,
    ctl: ControllerHarness,
    sim: list[SimNode],
    procs: dict[str, Any],
    rng: random.Random,
    seed: int,
    all_uids: list[str],
) -> None:
    order = list(DISRUPTIONS) if len(DISRUPTIONS) <= ROUNDS else []
    rng.shuffle(order)
    plan = [*order, *(rng.choice(DISRUPTIONS) for _ in range(ROUNDS - len(order)))][:ROUNDS]
    print(f"chaos plan (seed {seed}): {plan}")
    previous: list[tuple[str, str]] = []  # (domain, pod) of the last round

    async def disrupt(what: str, after: float) -> str:
        await asyncio.sleep(after)
        if what in ("kube-apiserver", "etcd"):
            await asyncio.to_thread(local.restart, what)
        elif what == "controller":
            proc = procs["controller"]
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
            procs["controller"] = ctl.spawn(log_name="chaos")
        else:
            victim = rng.choice(sim)
            victim.plugin.kill()
            await h.restart_plugin(victim)
        return f"{what} after {after:.2f}s"

    def domain_ready(name: str) -> bool:
        cd = h.get("computedomain", name, h.ns)
        return bool(cd) and (cd or {}).get("status", {}).get("status") == "Ready"

    for r, what in enumerate(plan):
        pair = sim[(r % 2) * 2 : (r % 2) * 2 + 2]
        names = [f"r{r}-{i}" for i in range(len(pair))]
        chaos = asyncio.create_task(disrupt(what, rng.uniform(0.0, 2.0)))
        # The burst: this round's domains and workloads, and the deletion of the last round's.
        for name, node in zip(names, pair, strict=True):
            cd = await api("create", lambda name=name: h.get("computedomain", name, h.ns) or h.create_cd(name))  # type: ignore[misc]
            all_uids.append(cd["metadata"]["uid"])
            await api("pod", lambda name=name, node=node: h.pod(f"{name}-w", node, f"{name}-channel"))  # type: ignore[misc]
        for name, pod in previous:
            await api(
                "delete",
                lambda pod=pod: h.kubectl("delete", "pod", pod, "-n", h.ns, "--wait=false", "--ignore-not-found"),
            )  # type: ignore[misc]
            await api(
                "delete",
                lambda name=name: h.kubectl(
                    "delete", "computedomain", name, "-n", h.ns, "--wait=false", "--ignore-not-found"
                ),
            )  # type: ignore[misc]
        print(f"round {r}: {await chaos}")
        for name in names:
            await until(f"round {r}: {name} Ready", lambda name=name: domain_ready(name))  # type: ignore[misc]
            await until(f"round {r}: {name}-w Running", lambda name=name: h.phase(f"{name}-w") == "Running")  # type: ignore[misc]
        for name, pod in previous:
            await until(f"round {r}: {name} gone", lambda name=name: h.get("computedomain", name, h.ns) is None)  # type: ignore[misc]
            await until(f"round {r}: {pod} gone", lambda pod=pod: h.get("pod", pod, h.ns) is None)  # type: ignore[misc]
        previous = [(name, f"{name}-w") for name in names]

    for name, pod in previous:
        h.kubectl("delete", "pod", pod, "-n", h.ns, "--wait=false")
        h.kubectl("delete", "computedomain", name, "-n", h.ns, "--wait=false")
    await until(
        "the last domains gone",
        lambda: not json.loads(h.kubectl("get", "computedomains", "-n", h.ns, "-o", "json"))["items"],
    )


async def all_clear(h: Harness, sim: list[SimNode], all_uids: list[str]) -> None:
    # Nothing left of any domain: children, cliques, node labels (the controller's work) ...
    def leftovers() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for kind, where in (
            ("daemonsets", ["-n", h.driver_ns]),
            ("resourceclaimtemplates", ["-A"]),
            ("computedomaincliques", ["-n", h.driver_ns]),
            ("nodes", []),
        ):
            items = json.loads(h.kubectl("get", kind, *where, "-l", COMPUTE_DOMAIN_LABEL, "-o", "json"))["items"]
            names = [i["metadata"]["name"] for i in items if i["metadata"]["labels"][COMPUTE_DOMAIN_LABEL] in all_uids]
            if names:
                out[kind] = names
        return out

    await until("no orphans", lambda: not leftovers(), within=60)
    # ... and no channel held on any node (the node agents' work).
    for node in sim:
        await until(
            f"{node.name} holds nothing",
            lambda node=node: (
                not [e for e in node.store().read().claims.values() if not e.state.is_tombstone]  # type: ignore[misc]
                and not node.cdi_files()
            ),
            within=60,
        )
