"""Node agent benchmark: Prepare latency, p50/p99 (SPEC section 9: channel Prepare of a ready domain p99 < 20 ms;
hostManaged including the `nvidia-imex-ctl` exec p99 < 100 ms). Not pass/fail: it prints figures.

    make bench-plugin                               (python -m tests.bench plugin; BENCH_PLUGIN_ROUNDS=200)
    python -m tests.bench.plugin [--rounds N]

Scenarios, every call through the real gRPC sockets with the kubelet stand-in's client (45 s deadline),
on a real checkpoint (fsync'd) and CDI directory:

1. `ready, in-process`: the Preparer with in-memory claim/CD/label collaborators, i.e. the agent's own cost;
2. `ready, cluster`: the agent as a process against the local control plane (claim GET, node label GET) when
   `make cluster-up` runs one;
3. `hostManaged`: chroot into a driver root (read-only bind mounts; needs root) and run `nvidia-imex-ctl -q -u`
   for every Prepare: once with a native stand-in ctl (a shell script printing READY: the exec cost of a
   C binary) and once with the IMEX simulator's Python ctl against the simulated host daemon;
4. `50 claims at once`: one NodePrepareResources call with 50 daemon claims (each its own domain).

Each Prepare is followed by an Unprepare (one channel per node) outside the measured time; tombstones are
expired between rounds so the checkpoint stays at its steady-state size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from computedomain.api.constants import CHANNEL_DEVICE_CLASS, COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.plugin.checkpoint import expire_tombstones
from computedomain.plugin.grpc_server import PluginServer, SocketPaths
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from imex.host_check import check_host_imex_ready
from tests.testbed.imex_simulator.wrappers import install_wrappers, package_root
from tests.testbed.kubelet_client import KubeletClient
from tests.unit.plugin.fakes import Bed

REPO = Path(__file__).resolve().parents[2]
SOCKET = "/run/nvidia-imex/imex_ctrl.sock"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(name: str, ms: list[float], errors: int = 0) -> dict[str, object]:
    row = {
        "scenario": name,
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2) if ms else None,
        "p99_ms": round(pct(ms, 0.99), 2) if ms else None,
        "max_ms": round(max(ms), 2) if ms else None,
        "errors": errors,
    }
    print(
        f"{name:48} n={row['n']:<4} p50={row['p50_ms']} ms  p99={row['p99_ms']} ms  max={row['max_ms']} ms  errors={errors}"
    )
    return row


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
    bed: Bed, kubelet: KubeletClient, rounds: int, *, mode: str | None = None
) -> tuple[list[float], int]:
    cd = bed.domains.add("bench")
    bed.readiness.set_ready(cd.uid)
    ms: list[float] = []
    errors = 0
    for _ in range(rounds + 5):
        ref = bed.channel_claim(cd, mode)
        start = time.perf_counter()
        result = (await kubelet.prepare([ref])).get(ref.uid)
        took = (time.perf_counter() - start) * 1000
        if result is None or result.error:
            errors += 1
        ms.append(took)
        await kubelet.unprepare([ref])
        await expire(bed)
    return ms[5:], errors  # the first calls warm up the channel and the thread pool


async def bench_ready_inprocess(rounds: int) -> list[dict[str, object]]:
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
    try:
        bed = Bed(root, budget_s=40)
        async with served(bed, root) as kubelet:
            single = report("channel Prepare, ready domain (in-process)", *await channel_rounds(bed, kubelet, rounds))
            every = report(
                "channel Prepare, All mode, 2048 channels", *await channel_rounds(bed, kubelet, rounds // 2, mode="All")
            )
        return [single, every]
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def bench_fifty(rounds: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
    try:
        bed = Bed(root, budget_s=40)
        ms: list[float] = []
        errors = 0
        async with served(bed, root) as kubelet:
            for _ in range(rounds + 1):
                refs = [bed.daemon_claim(bed.domains.add("bench", name=f"cd{i}")) for i in range(50)]
                start = time.perf_counter()
                results = await kubelet.prepare(refs)
                ms.append((time.perf_counter() - start) * 1000)
                errors += sum(1 for r in refs if r.uid not in results or results[r.uid].error)
                await kubelet.unprepare(refs)
                await expire(bed)
        return report("50 daemon claims in one call (whole call)", ms[1:], errors)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def chroot_root() -> Iterator[Path]:
    """A driver root of read-only bind mounts of what Python and sh need, plus a writable opt/bin and run."""
    root = Path(tempfile.mkdtemp(prefix="bp-root-", dir="/tmp"))
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
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


async def bench_host_managed(rounds: int) -> list[dict[str, object]]:
    if os.geteuid() != 0:
        print("hostManaged: skipped (needs root for the chroot)")
        return []
    from tests.unit.imex.test_host_check import start_host_daemon

    rows = []
    with chroot_root() as root:
        tmp = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
        daemon = start_host_daemon(root, tmp, peers=[])
        try:

            async def check() -> None:
                await check_host_imex_ready(driver_root=root, socket_path=SOCKET)

            for label, install in (
                ("native stand-in ctl", lambda: _native_ctl(root / "opt/bin/nvidia-imex-ctl")),
                ("IMEX simulator ctl (Python)", lambda: install_wrappers(root / "opt/bin")),
            ):
                install()
                work = tmp / label.split()[0]
                work.mkdir()
                bed = Bed(work, host_managed=True, host_check=check, budget_s=40)
                async with served(bed, work) as kubelet:
                    rows.append(
                        report(
                            f"hostManaged Prepare incl. chroot + {label}", *await channel_rounds(bed, kubelet, rounds)
                        )
                    )
                bare: list[float] = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    await check()
                    bare.append((time.perf_counter() - start) * 1000)
                rows.append(report(f"  of which the ctl exec alone ({label})", bare))
        finally:
            daemon.kill()
            daemon.wait(30)
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _native_ctl(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.write_text("#!/bin/sh\necho READY\n")
    path.chmod(0o755)


async def bench_cluster(rounds: int) -> dict[str, object] | None:
    from computedomain.kube.client import NODES, KubeClient
    from tests.testbed.cluster import LocalCluster
    from tests.testbed.nodes import gb200_node

    local = LocalCluster()
    if not local.healthy():
        print("ready domain through the cluster: skipped (no cluster; run `make cluster-up`)")
        return None
    node = f"bench-{uuid.uuid4().hex[:6]}"
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
    client = await KubeClient.connect(kubeconfig=local.kubeconfig)
    proc: subprocess.Popen[bytes] | None = None

    def kubectl(*args: str, input: str | None = None) -> str:
        return local.kubectl(*args, input=input).stdout

    try:
        kubectl("apply", "-f", "-", input=json.dumps(gb200_node(node, clique="6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1")))
        kubectl("create", "namespace", ns)
        cd = json.loads(kubectl("create", "-n", ns, "-o", "json", "-f", "-", input=json.dumps({
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain", "metadata": {"name": "bench"},
            "spec": {"channel": {"resourceClaimTemplate": {"name": "bench-channel"}}}})))  # fmt: skip
        uid = cd["metadata"]["uid"]
        clique = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"
        entry = {"nodeName": node, "ipAddress": "10.0.0.9", "cliqueID": clique, "index": 0, "status": "Ready"}
        clique_obj = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainClique",
            "metadata": {"name": f"{uid}.{clique}"},
            "daemons": [entry],
        }
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(clique_obj))
        from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, write_fake_driver_root

        tray = SimulatedClique(cluster_uuid=uuid.UUID(clique.partition(".")[0]), clique_id=1)
        write_fake_driver_root(root / "driver", SimulatedNode(name=node, clique=tray))
        env = {
            **os.environ, "NODE_NAME": node, "KUBECONFIG": str(local.kubeconfig), "NAMESPACE": ns,
            "KUBELET_REGISTRAR_DIRECTORY_PATH": str(root / "reg"), "KUBELET_PLUGINS_DIRECTORY_PATH": str(root / "plugins"),
            "CDI_ROOT": str(root / "cdi"), "NVIDIA_DRIVER_ROOT": str(root / "driver"),
            "PROC_ROOT": str(root / "driver/proc"), "HEALTHCHECK_PORT": "-1",
            "LOG_LEVEL": "warning",
            # Back-to-back Prepares would otherwise measure the client's token bucket (default 20 QPS),
            # not the agent: a real node prepares a few claims per pod start, well inside the burst.
            "KUBE_API_QPS": "500", "KUBE_API_BURST": "1000",
        }  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "computedomain", "kubelet-plugin"], cwd=REPO, env=env)  # noqa: ASYNC220
        sock = root / "reg" / f"{DRIVER_NAME}-reg.sock"
        for _ in range(200):
            if sock.exists():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # caches synced
        ms: list[float] = []
        errors = 0
        async with KubeletClient(sock) as kubelet:
            for i in range(rounds + 5):
                ref = await _allocated_claim(client, ns, f"c{i}", node, uid)
                start = time.perf_counter()
                result = (await kubelet.prepare([ref])).get(ref.uid)
                ms.append((time.perf_counter() - start) * 1000)
                if result is None or result.error:
                    errors += 1
                    print("  error:", result)
                await kubelet.unprepare([ref])
                # A ready domain's daemon runs on the node, so its label is there when the next Prepare comes.
                await client.merge_patch(NODES, node, {"metadata": {"labels": {COMPUTE_DOMAIN_LABEL: uid}}})
                await asyncio.sleep(0.01)
        return report("channel Prepare, ready domain (agent process + API)", ms[5:], errors)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
        await client.close()
        local.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        local.kubectl("delete", "node", node, "--wait=false", check=False)
        shutil.rmtree(root, ignore_errors=True)


async def _allocated_claim(client: object, ns: str, name: str, node: str, domain: str) -> ClaimRef:
    from computedomain.kube.client import RESOURCE_CLAIMS, KubeClient

    assert isinstance(client, KubeClient)
    claim = await client.create(RESOURCE_CLAIMS, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": [{"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}]}}})  # fmt: skip
    params = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": domain}
    status = {"allocation": {"devices": {
        "results": [{"request": "channel", "driver": DRIVER_NAME, "pool": node, "device": "channel-0"}],
        "config": [{"source": "FromClaim", "requests": ["channel"], "opaque": {"driver": DRIVER_NAME, "parameters": params}}]}}}  # fmt: skip
    await client.merge_patch(RESOURCE_CLAIMS, name, {"status": status}, namespace=ns, subresource="status")
    return ClaimRef(ns, name, ClaimUid(claim["metadata"]["uid"]))


async def main(rounds: int = int(os.environ.get("BENCH_PLUGIN_ROUNDS", "200"))) -> None:
    """Entry point of `python -m tests.bench plugin` (`make bench-plugin`)."""
    print(f"node agent benchmark: {rounds} rounds per scenario (medians and p99 of Prepare latency)")
    rows: list[dict[str, object] | None] = []
    steps: list[Callable[[], Awaitable[object]]] = [
        lambda: bench_ready_inprocess(rounds),
        lambda: bench_cluster(rounds),
        lambda: bench_host_managed(max(rounds // 4, 20)),
        lambda: bench_fifty(max(rounds // 10, 10)),
    ]
    for step in steps:
        out = await step()
        rows.extend(out if isinstance(out, list) else [out])  # type: ignore[arg-type]
    print(json.dumps([r for r in rows if r], indent=None))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.rounds))
