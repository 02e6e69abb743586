"""Channel isolation benchmark (hostManaged, `IMEX_ISOLATION=channel`): what it costs. Not pass/fail.

    make bench-channels   (python -m tests.bench channels; BENCH_CHANNEL_DOMAINS=200, BENCH_ROUNDS=3,
                           BENCH_PLUGIN_SAMPLES=200 Prepares per scenario and round)

1. **Assignment**: the controller as a process (shipped client limits) with channel isolation, 18 Node objects
   of one clique (the controller gives a channel only to a record naming a node of its clique), N domains (200)
   existing and Ready; then N channel records created at once, as the node agents create them for the first
   pod of each domain in a clique (finalizer, one prepared claim). Measured per record: its create request ->
   the watch event that shows its channel; and the whole burst: first create -> last channel seen. Checked:
   N distinct channels. Also the controller's API requests per assigned channel (its metrics).
2. **Extra time per Prepare**: channel Prepares of a ready domain through the real gRPC sockets on a real
   checkpoint and CDI directory (as `plugin`'s in-process scenario), hostManaged with the host check answered
   at once: without isolation (shared channel 0), with isolation and the domain's channel known in memory
   (the agent's own extra work: a second checkpoint write), and with isolation against the apiserver (the
   node agent's `ChannelRecords`: the record already has its channel, as for every pod but a domain's first
   in a clique; each Prepare appends its claim to the record, each Unprepare, outside the measured time,
   removes it). The extra time is the difference of the medians, per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.controller.channels import LOCK_PREFIX
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, LEASES, NODES, KubeClient, Raw
from computedomain.kube.informer import Informer
from computedomain.plugin.channels import ChannelRecords
from tests.bench.controller import ControllerProcess, bench_node, delete_all, delete_bench_nodes, limits, per_limits
from tests.bench.figures import Figure
from tests.bench.harness import Bench, cd_body, gather_limited, poll, wait_for
from tests.bench.plugin import Sample, channel_rounds, served
from tests.testbed.sim.topology import CLUSTER_UUID
from tests.unit.plugin.fakes import CLIQUE as BED_CLIQUE
from tests.unit.plugin.fakes import NODE, Bed

CLIQUE = f"{CLUSTER_UUID}.1"
ISOLATION_ENV = {
    "IMEX_MODE": "hostManaged",
    "IMEX_ISOLATION": "channel",
    "FEATURE_GATES": "HostManagedIMEXDaemon=true,IMEXChannelIsolation=true",
}


def record_body(namespace: str, domain_uid: str, node: str, clique: str = CLIQUE) -> dict[str, Any]:
    """A channel record as a node agent creates it: the request for a channel."""
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "ComputeDomainClique",
        "metadata": {
            "name": f"{domain_uid}.{clique}",
            "namespace": namespace,
            "labels": {COMPUTE_DOMAIN_LABEL: domain_uid},
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
        },
        "preparedClaims": [{"claimUID": str(uuid.uuid4()), "nodeName": node}],
    }


async def assignment_round(
    client: KubeClient, ctl: ControllerProcess, namespaces: tuple[str, str], nodes: list[str], index: int, count: int
) -> tuple[list[float], int, float, float]:
    """(per-record latencies, failures, whole burst in s, controller requests per channel). The records list
    claims of `nodes`, Node objects labelled with the clique: the controller gives a channel only to a record
    that names a node of its clique."""
    driver_ns, cd_ns = namespaces
    uids = [
        raw["metadata"]["uid"]
        for raw in await gather_limited(
            [client.create(COMPUTE_DOMAINS, cd_body(f"ch-{index}-{i}", cd_ns)) for i in range(count)]
        )
    ]

    async def all_ready() -> bool:
        items = (await client.list_all(COMPUTE_DOMAINS, namespace=cd_ns)).items
        return sum(1 for cd in items if (cd.get("status") or {}).get("status") == "Ready") >= count

    await poll(all_ready, 300, f"{count} domains Ready")
    seen: dict[str, float] = {}
    channels: dict[str, int] = {}

    def note(raw: Raw) -> None:
        name = raw["metadata"]["name"]
        if raw.get("channel") is not None and name not in seen:
            seen[name] = time.monotonic()
            channels[name] = int(raw["channel"])

    informer: Informer[Raw] = Informer(client, COMPUTE_DOMAIN_CLIQUES, decode=lambda r: r, namespace=driver_ns)
    informer.add_handler(on_add=note, on_update=lambda _old, new: note(new))
    watching = asyncio.create_task(informer.run())
    try:
        await informer.has_synced()
        before = sum(ctl.requests().values())
        started: dict[str, float] = {}

        async def one(i: int, uid: str) -> None:
            body = record_body(driver_ns, uid, nodes[i % len(nodes)])
            started[body["metadata"]["name"]] = time.monotonic()
            await client.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=driver_ns)

        await asyncio.gather(*(one(i, uid) for i, uid in enumerate(uids)))
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: len(seen) >= count, 300, f"{count} channels assigned")
        latencies = [seen[name] - t0 for name, t0 in started.items() if name in seen]
        whole = (max(seen.values()) - min(started.values())) if len(seen) >= count else float("nan")
        if len(set(channels.values())) != len(channels):
            raise AssertionError(f"channels not distinct: {sorted(channels.values())}")
        requests = (sum(ctl.requests().values()) - before) / max(len(seen), 1)
        return latencies, count - len(latencies), whole, requests
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await delete_all(client, cd_ns)  # the controller deletes the records once no claim holds them
        # Each node agent's Unprepare takes its claim off the record (the records' nodes exist: their claims
        # hold the channels until then).
        records = (await client.list_all(COMPUTE_DOMAIN_CLIQUES, namespace=driver_ns)).items
        await gather_limited([
            client.merge_patch(COMPUTE_DOMAIN_CLIQUES, r["metadata"]["name"], {"preparedClaims": []}, namespace=driver_ns)
            for r in records
        ])  # fmt: skip

        async def released() -> bool:
            records = (await client.list_all(COMPUTE_DOMAIN_CLIQUES, namespace=driver_ns)).items
            leases = (await client.list_all(LEASES, namespace=driver_ns)).items
            return not records and not [x for x in leases if x["metadata"]["name"].startswith(LOCK_PREFIX)]

        await poll(released, 300, "the records and their locks gone")


async def prepare_scenarios(client: KubeClient, ns: str, samples: int) -> tuple[Sample, Sample, Sample]:
    """(shared channel 0, isolation with the channel in memory, isolation against the apiserver)."""

    async def host_ready() -> None:
        return None

    out: list[Sample] = []
    for kind in ("shared", "memory", "api"):
        root = Path(tempfile.mkdtemp(prefix="bch-", dir="/tmp"))
        records: ChannelRecords | None = None
        watching: asyncio.Task[None] | None = None
        try:
            if kind == "api":
                records = ChannelRecords(client, node_name=NODE, namespace=ns)
                watching = asyncio.create_task(records.run())
                await records.informer.has_synced()
            bed = Bed(
                root,
                budget_s=40,
                host_managed=True,
                host_check=host_ready,
                isolated=kind != "shared",
                channels=records,
            )
            cd = bed.domains.add("bench")
            if records is not None:
                # The domain's record has its channel already (its first pod in the clique asked for it).
                body = {**record_body(ns, cd.uid, NODE, BED_CLIQUE), "channel": 7, "preparedClaims": []}
                await client.create(COMPUTE_DOMAIN_CLIQUES, body, namespace=ns)
                uid = cd.uid
                await wait_for(
                    lambda r=records, u=uid: r.known(u, BED_CLIQUE) == 7, 30, "the record in the agent's cache"
                )
            async with served(bed, root) as kubelet:
                out.append(await channel_rounds(bed, kubelet, samples, cd=cd))
        finally:
            if watching is not None:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching
            shutil.rmtree(root, ignore_errors=True)
    return out[0], out[1], out[2]


async def run(bench: Bench) -> None:
    """Entry point of `python -m tests.bench channels` (`make bench-channels`)."""
    count = bench.size("BENCH_CHANNEL_DOMAINS", 200, 10)
    rounds = bench.size("BENCH_ROUNDS", 3, 1)
    samples = bench.size("BENCH_PLUGIN_SAMPLES", 200, 5)
    section = bench.section
    all_limits = limits()
    section.note(
        f"{rounds} rounds; assignment: {count} domains at once (created and Ready first: their writes use up "
        f"the controller's burst), at each client limit; Prepare: {samples} per scenario and round through the "
        "real gRPC sockets"
    )
    per_record = per_limits(section, all_limits, lambda lim: Figure(
        f"assign-{lim.name}", lim.title(f"channel record created -> channel seen ({count} at once)"),
        simulated="the node agents' record creates, made by the benchmark"))  # fmt: skip
    burst = per_limits(section, all_limits, lambda lim: Figure(
        f"assign-all-{lim.name}", lim.title(f"{count} channel records at once -> all assigned")))  # fmt: skip
    requests = per_limits(section, all_limits, lambda lim: Figure(
        f"assign-requests-{lim.name}", lim.title("controller API requests per channel assigned"),
        unit="requests"))  # fmt: skip
    shared = section.figure(Figure("prepare-shared", "channel Prepare, hostManaged, shared channel 0 (in-process)",
                                   simulated="claim and domain lookups in memory; host check answers at once"))  # fmt: skip
    memory = section.figure(Figure("prepare-memory", "channel Prepare, channel isolation, channel in memory",
                                   simulated="as above; the channel records in memory"))  # fmt: skip
    api = section.figure(Figure("prepare-api", "channel Prepare, channel isolation, record on the apiserver",
                                simulated="as above; the records on the local apiserver"))  # fmt: skip
    extra = section.figure(Figure("prepare-extra", "extra time per Prepare with channel isolation (API)"))
    client = await bench.client()
    nodes = [f"bench-ch-{bench.tag}-{i:02d}" for i in range(18)]
    with bench.step(f"creating {len(nodes)} Node objects of clique {CLIQUE}"):
        await gather_limited([client.create(NODES, bench_node(n, CLIQUE)) for n in nodes])
    try:
        for index in range(rounds):
            for lim in all_limits:
                with bench.step(f"round {index + 1}: starting the controller with channel isolation [{lim.label}]"):
                    driver_ns = await bench.namespace("chdrv")
                    cd_ns = await bench.namespace("chcd")
                    account = await bench.service_account()
                    ctl = ControllerProcess(bench, driver_ns, cd_ns, lim, account, extra=ISOLATION_ENV)
                try:
                    await ctl.ready()
                    with bench.step(f"round {index + 1}: {count} channel records at once [{lim.label}]"):
                        latencies, failed, whole, per_channel = await assignment_round(
                            client, ctl, (driver_ns, cd_ns), nodes, index, count
                        )
                        per_record[lim.name].round(latencies, failed)
                        finished = whole == whole  # NaN: not all assigned
                        burst[lim.name].round([whole] if finished else [], 0 if finished else 1)
                        requests[lim.name].round([per_channel])
                finally:
                    ctl.stop()
            with bench.step(f"round {index + 1}: Prepare with and without channel isolation"):
                ns = await bench.namespace("chprep")
                a, b, c = await prepare_scenarios(client, ns, samples)
                shared.round(*a)
                memory.round(*b)
                api.round(*c)
                if a[0] and c[0]:
                    extra.round([statistics.median(c[0]) - statistics.median(a[0])])
    finally:
        with bench.step(f"deleting {len(nodes)} Node objects"):
            await delete_bench_nodes(client)
