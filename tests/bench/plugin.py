"""Node agent benchmark: Prepare latency, p50/p99 (SPEC section 9: channel Prepare of a ready domain p99 < 20 ms;
hostManaged including the `nvidia-imex-ctl` exec p99 < 100 ms). Not pass/fail: it reports figures.

    make bench-plugin     (python -m tests.bench plugin; BENCH_PLUGIN_SAMPLES=200 per round, BENCH_ROUNDS=3)

A Prepare that returns an error is counted as a failure and has no latency.

Scenarios, every call through the real gRPC sockets with the kubelet stand-in's client (45 s deadline),
on a real checkpoint (fsync'd) and CDI directory:

1. `ready, in-process`: the Preparer with in-memory claim/CD/label collaborators, i.e. the agent's own cost;
2. `ready, cluster`: the agent as a process against the local control plane (claim GET, node label GET) when
   `make cluster-up` runs one;
3. `hostManaged`: chroot into a driver root (read-only bind mounts; needs root) and run `nvidia-imex-ctl -q -u`
   for every Prepare against the simulated host daemon: once with the fake driver root's native ctl (a static
   program that asks the daemon's socket, in about the milliseconds of the C binary) and once with the IMEX
   simulator's Python ctl;
4. `50 claims at once`: one NodePrepareResources call with 50 daemon claims (each its own domain).

Each Prepare is followed by an Unprepare (one channel per node) outside the measured time; tombstones are
expired between rounds so the checkpoint stays at its steady-state size.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, NODES, RESOURCE_CLAIMS, KubeClient
from computedomain.kube.errors import NotFound
from computedomain.plugin.checkpoint import expire_tombstones
from computedomain.plugin.collaborators import DomainInfo
from computedomain.plugin.grpc_server import PluginServer, SocketPaths
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from imex.host_check import check_host_imex_ready
from tests.bench.figures import Figure, Target
from tests.bench.harness import Bench, cd_body
from tests.testbed import image, serviceaccount
from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, write_fake_driver_root
from tests.testbed.fake_driver_root.build import native_imex_ctl
from tests.testbed.imex_simulator.wrappers import install_wrappers, package_root
from tests.testbed.kubelet_client import KubeletClient
from tests.testbed.nodes import gb200_node
from tests.testbed.sim.topology import CLUSTER_UUID
from tests.unit.plugin.fakes import Bed

REPO = Path(__file__).resolve().parents[2]
SOCKET = "/run/nvidia-imex/imex_ctrl.sock"


READY = Target("p99", 0.020, "p99 < 20 ms")
HOST = Target("p99", 0.100, "p99 < 100 ms")
FAKES = "claim, domain and node label lookups answered in memory (the agent's own cost)"


@contextlib.asynccontextmanager
async def served(bed: Bed, root: Path) -> AsyncIterator[KubeletClient]:
    paths = SocketPaths.for_driver(root / "reg", root / "plugins")
    server = PluginServer(bed.preparer, paths, health_port=None)
    await server.start()
    try:
        async with KubeletClient(paths.registration) as kubelet:
            yield kubelet
    finally:
        await server.stop(0)


async def expire(bed: Bed) -> None:
    now = datetime.now(UTC) + timedelta(days=1)
    await bed.store.update_async(lambda cp: (expire_tombstones(cp, now=now), None))


async def channel_rounds(
    bed: Bed, kubelet: KubeletClient, rounds: int, *, mode: str | None = None, cd: DomainInfo | None = None
) -> tuple[list[float], int]:
    cd = cd or bed.domains.add("bench")
    bed.readiness.set_ready(cd.uid)
    latencies: list[float] = []
    errors = 0
    for i in range(rounds + 5):
        ref = bed.channel_claim(cd, mode)
        start = time.perf_counter()
        result = (await kubelet.prepare([ref])).get(ref.uid)
        took = time.perf_counter() - start
        if i >= 5:  # the first calls warm up the channel and the thread pool
            if result is None or result.error:
                errors += 1
            else:
                latencies.append(took)
        await kubelet.unprepare([ref])
        await expire(bed)
    return latencies, errors


Sample = tuple[list[float], int]  # latencies (s) of the calls that succeeded, and how many failed


async def bench_ready_inprocess(samples: int) -> tuple[Sample, Sample]:
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
    try:
        bed = Bed(root, budget_s=40)
        async with served(bed, root) as kubelet:
            single = await channel_rounds(bed, kubelet, samples)
            every = await channel_rounds(bed, kubelet, max(samples // 2, 1), mode="All")
        return single, every
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def bench_fifty(samples: int) -> Sample:
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
    try:
        bed = Bed(root, budget_s=40)
        latencies: list[float] = []
        errors = 0
        async with served(bed, root) as kubelet:
            for i in range(samples + 1):
                refs = [bed.daemon_claim(bed.domains.add("bench", name=f"cd{i}-{j}")) for j in range(50)]
                start = time.perf_counter()
                results = await kubelet.prepare(refs)
                took = time.perf_counter() - start
                failed = sum(1 for r in refs if r.uid not in results or results[r.uid].error)
                if i:  # the first call warms up
                    errors += failed
                    if not failed:
                        latencies.append(took)
                await kubelet.unprepare(refs)
                await expire(bed)
        return latencies, errors
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    """Lazily unmount every mount point below ``root``, deepest first."""
    inside = [
        Path(line.split()[4])
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if Path(line.split()[4]).is_relative_to(root)
    ]
    for target in sorted(inside, key=lambda p: len(p.parts), reverse=True):
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


def _sweep_killed_roots() -> None:
    """Driver roots of an earlier run that was killed before its teardown (its ``owner.pid`` names a process
    that is gone): unmount and remove them, so a killed run leaves nothing mounted for long."""
    for stale in Path("/tmp").glob("bp-root-*"):
        try:
            pid = int((stale / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            _unmount_under(stale)
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def chroot_root() -> Iterator[Path]:
    """A driver root of read-only bind mounts of what Python and sh need, plus a writable opt/bin and run.
    The mounts are the host's (a chroot needs them there); ``owner.pid`` lets the next run clean up after a
    run killed before its teardown."""
    _sweep_killed_roots()
    root = Path(tempfile.mkdtemp(prefix="bp-root-", dir="/tmp"))
    (root / "owner.pid").write_text(str(os.getpid()))
    for sub in ("dev", "run", "opt/bin"):
        (root / sub).mkdir(parents=True)
    sources = sorted(
        {"/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", sys.base_prefix, sys.prefix, str(package_root())},
        key=lambda s: len(Path(s).parts),
    )
    mounted: list[Path] = []
    try:
        for source in sources:
            src = Path(source)
            if not src.exists():
                continue
            target = root / src.relative_to("/")
            if src.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists() and not target.is_symlink():
                    target.symlink_to(src.readlink())
                continue
            if any(src.is_relative_to(Path("/") / m.relative_to(root)) for m in mounted):
                continue
            target.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(target)], check=True, capture_output=True)
            mounted.append(target)
        yield root
    finally:
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


async def bench_host_managed(samples: int) -> list[tuple[str, Sample, Sample]]:
    """(label, Prepare incl. the chrooted ctl, the ctl exec alone) per ctl."""
    from tests.unit.imex.test_host_check import start_host_daemon

    rows = []
    with chroot_root() as root:
        tmp = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
        daemon = start_host_daemon(root, tmp, peers=[])
        try:

            async def check() -> None:
                await check_host_imex_ready(driver_root=root, socket_path=SOCKET)

            for label, install in (
                ("native ctl", lambda: _native_ctl(root / "opt/bin/nvidia-imex-ctl")),
                ("IMEX simulator ctl (Python)", lambda: install_wrappers(root / "opt/bin")),
            ):
                install()
                work = tmp / label.split()[0]
                work.mkdir()
                bed = Bed(work, host_managed=True, host_check=check, budget_s=40)
                async with served(bed, work) as kubelet:
                    prepare = await channel_rounds(bed, kubelet, samples)
                bare: list[float] = []
                bare_errors = 0
                for _ in range(samples):
                    start = time.perf_counter()
                    try:
                        await check()
                    except Exception:
                        bare_errors += 1
                        continue
                    bare.append(time.perf_counter() - start)
                rows.append((label, prepare, (bare, bare_errors)))
        finally:
            daemon.kill()
            daemon.wait(30)
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _native_ctl(path: Path) -> None:
    path.unlink(missing_ok=True)
    shutil.copy2(native_imex_ctl(), path)


async def bench_cluster(bench: Bench, samples: int) -> Sample:
    """The agent as a process against the cluster: claim GET and node label GET on every Prepare."""
    client = await bench.client()
    ns = await bench.namespace("plugin")
    node = f"bench-plugin-{bench.tag}"
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
    proc: subprocess.Popen[bytes] | None = None
    clique = f"{CLUSTER_UUID}.1"
    try:
        await client.create(NODES, gb200_node(node, clique=clique))
        cd = await client.create(COMPUTE_DOMAINS, cd_body("bench", ns))
        uid = cd["metadata"]["uid"]
        entry = {"nodeName": node, "ipAddress": "10.0.0.9", "cliqueID": clique, "index": 0, "status": "Ready"}
        await client.create(COMPUTE_DOMAIN_CLIQUES, {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainClique",
            "metadata": {"name": f"{uid}.{clique}", "namespace": ns}, "daemons": [entry]})  # fmt: skip
        tray = SimulatedClique(cluster_uuid=CLUSTER_UUID, clique_id=1)
        write_fake_driver_root(root / "driver", SimulatedNode(name=node, clique=tray))
        account = await bench.service_account()  # the agent takes a pod's in-cluster path
        env = {
            **{k: v for k, v in os.environ.items() if k != "KUBECONFIG"}, **image.runtime_env(),
            **serviceaccount.cluster_env(bench.local.server),
            "NODE_NAME": node, "NAMESPACE": ns,
            "KUBELET_REGISTRAR_DIRECTORY_PATH": str(root / "reg"), "KUBELET_PLUGINS_DIRECTORY_PATH": str(root / "plugins"),
            "CDI_ROOT": str(root / "cdi"), "NVIDIA_DRIVER_ROOT": str(root / "driver"),
            "PROC_ROOT": str(root / "driver/proc"), "HEALTHCHECK_PORT": "-1",
            "LOG_LEVEL": "warning",
            # Back-to-back Prepares would otherwise measure the client's token bucket (default 20 QPS),
            # not the agent: a real node prepares a few claims per pod start, well inside the burst.
            "KUBE_API_QPS": "500", "KUBE_API_BURST": "1000",
        }  # fmt: skip
        with bench.step("starting the node agent"):
            log_path = root / "node-agent.log"  # a file, not a pipe that fills up and stops the agent
            with log_path.open("ab") as log:
                argv = serviceaccount.mounted([sys.executable, "-m", "computedomain", "kubelet-plugin"], account)
                proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=log)  # noqa: ASYNC220
            sock = root / "reg" / f"{DRIVER_NAME}-reg.sock"
            deadline = time.monotonic() + 60
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = log_path.read_text(errors="replace").strip()
                    raise RuntimeError(f"the node agent did not register (exit {proc.poll()}): {err[-300:]}")
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # caches synced
        latencies: list[float] = []
        errors = 0
        async with KubeletClient(sock) as kubelet:
            for i in range(samples + 5):
                ref = await _allocated_claim(client, ns, f"c{i}", node, uid)
                start = time.perf_counter()
                result = (await kubelet.prepare([ref])).get(ref.uid)
                took = time.perf_counter() - start
                if i >= 5:
                    if result is None or result.error:
                        errors += 1
                    else:
                        latencies.append(took)
                await kubelet.unprepare([ref])
                # A ready domain's daemon runs on the node, so its label is there when the next Prepare comes.
                await client.merge_patch(NODES, node, {"metadata": {"labels": {COMPUTE_DOMAIN_LABEL: uid}}})
                await asyncio.sleep(0.01)
        return latencies, errors
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        with contextlib.suppress(NotFound):
            await client.delete(NODES, node)
        shutil.rmtree(root, ignore_errors=True)


async def _allocated_claim(client: KubeClient, ns: str, name: str, node: str, domain: str) -> ClaimRef:
    claim = await client.create(RESOURCE_CLAIMS, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": [{"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}]}}})  # fmt: skip
    params = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": domain}
    status = {"allocation": {"devices": {
        "results": [{"request": "channel", "driver": DRIVER_NAME, "pool": node, "device": "channel-0"}],
        "config": [{"source": "FromClaim", "requests": ["channel"], "opaque": {"driver": DRIVER_NAME, "parameters": params}}]}}}  # fmt: skip
    await client.merge_patch(RESOURCE_CLAIMS, name, {"status": status}, namespace=ns, subresource="status")
    return ClaimRef(ns, name, ClaimUid(claim["metadata"]["uid"]))


async def run(bench: Bench) -> None:
    """Entry point of `python -m tests.bench plugin` (`make bench-plugin`)."""
    samples = bench.size("BENCH_PLUGIN_SAMPLES", 200, 5)
    rounds = bench.size("BENCH_ROUNDS", 3, 1)
    section = bench.section
    section.note(
        f"{rounds} rounds of {samples} Prepares per scenario (fewer where noted), through the real gRPC sockets"
    )
    ready = section.figure(Figure("ready-inprocess", "channel Prepare, ready domain (in-process)", target=READY,
                                  simulated=FAKES))  # fmt: skip
    every = section.figure(Figure("ready-all", "channel Prepare, All mode, 2048 channels", simulated=FAKES))
    cluster = section.figure(Figure("ready-cluster", "channel Prepare, ready domain (agent process + API)",
                                    target=READY, simulated="clique entry written by the benchmark"))  # fmt: skip
    fifty = section.figure(Figure("fifty", "50 daemon claims in one call (whole call)", simulated=FAKES))
    host: dict[str, tuple[Figure, Figure]] = {}
    for index in range(rounds):
        with bench.step(f"round {index + 1}: in-process Prepare"):
            single, all_mode = await bench_ready_inprocess(samples)
            ready.round(*single)
            every.round(*all_mode)
        with bench.step(f"round {index + 1}: Prepare through the agent process and the API"):
            cluster.round(*await bench_cluster(bench, samples))
        if os.geteuid() == 0:
            with bench.step(f"round {index + 1}: hostManaged Prepare (chroot + nvidia-imex-ctl)"):
                for label, prepare, bare in await bench_host_managed(max(samples // 4, 5)):
                    if label not in host:
                        host[label] = (
                            section.figure(Figure(f"host-{label}", f"hostManaged Prepare incl. chroot + {label}",
                                                  target=HOST if label.startswith("native") else None,
                                                  simulated="the host IMEX daemon (IMEX simulator)")),
                            section.figure(Figure(f"ctl-{label}", f"  of which the ctl exec alone ({label})")),
                        )  # fmt: skip
                    host[label][0].round(*prepare)
                    host[label][1].round(*bare)
        with bench.step(f"round {index + 1}: 50 claims in one call"):
            fifty.round(*await bench_fifty(max(samples // 10, 2)))
    if os.geteuid() != 0:
        section.note("hostManaged: not measured (needs root for the chroot)")
