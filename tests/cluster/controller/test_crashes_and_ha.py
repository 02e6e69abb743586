"""SIGKILL at random points of create and delete, and two replicas with leader election."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.request
import uuid

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.cluster.controller.conftest import Harness, compute_domain, eventually, free_port
from tests.cluster.controller.test_lifecycle import children_of
from tests.conftest import MakeNode

pytestmark = pytest.mark.cluster

EMPTY = {"daemonsets": [], "resourceclaimtemplates": [], "nodes": []}


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


async def _kill_later(proc: subprocess.Popen[bytes], delay: float) -> None:
    await asyncio.sleep(delay)
    _kill(proc)


def _complete(h: Harness, uid: str, name: str) -> bool:
    kids = children_of(h, uid)
    cd = h.try_get("computedomain", name, "-n", h.cd_ns) or {}
    return (
        len(kids["daemonsets"]) == 1
        and len(kids["resourceclaimtemplates"]) == 2
        and (cd.get("status", {}).get("status") == "Ready")
    )


async def _crash_iterations(h: Harness, make_node: MakeNode, iterations: int, seed: int) -> None:
    rng = random.Random(seed)
    node = make_node(clique="c0ffee.3")["metadata"]["name"]
    # How far each kill got (children existing across the iteration's domains), to show kills land mid-work.
    at_kill: list[tuple[int, int]] = []

    async def started(name: str) -> subprocess.Popen[bytes]:
        port = free_port()
        proc = h.spawn(log_name=name, HTTP_ENDPOINT=f"127.0.0.1:{port}")
        await eventually(lambda: _state(port).get("leading") is True or None, within=30, interval=0.05, what=name)
        return proc

    def present(uids: list[str]) -> int:
        return sum(len(v) for uid in uids for k, v in children_of(h, uid).items() if k != "nodes")

    proc = await started("first")
    for i in range(iterations):
        names = [f"k{i}-{j}" for j in range(3)]
        items = [compute_domain(n) for n in names]
        h.cluster.apply(items, namespace=h.cd_ns)
        await _kill_later(proc, rng.uniform(0.0, 0.2))
        uids = [h.get_json("computedomain", n, "-n", h.cd_ns)["metadata"]["uid"] for n in names]
        h.kubectl("label", "node", node, f"{COMPUTE_DOMAIN_LABEL}={uids[0]}", "--overwrite")
        created = present(uids)
        proc = await started(f"recreate{i}")
        for uid, name in zip(uids, names, strict=True):
            await eventually(lambda uid=uid, name=name: _complete(h, uid, name), within=30, what=f"{name} complete")
        h.kubectl("delete", "computedomain", *names, "-n", h.cd_ns, "--wait=false")
        await _kill_later(proc, rng.uniform(0.0, 0.2))
        at_kill.append((created, present(uids)))
        proc = await started(f"redelete{i}")
        for name in names:
            await eventually(
                lambda name=name: h.try_get("computedomain", name, "-n", h.cd_ns) is None or None,
                within=30,
                what=f"{name} gone",
            )
        for uid in uids:
            assert children_of(h, uid) == EMPTY, f"iteration {i}: leftovers of {uid}"
    _kill(proc)
    print(f"children (of 9) present at the create kill / at the delete kill: {at_kill}")


@pytest.mark.timeout(300)
async def test_sigkill_during_create_and_delete(harness: Harness, make_node: MakeNode, seed: int) -> None:
    await _crash_iterations(harness, make_node, iterations=int(os.environ.get("CRASH_ITERATIONS", "10")), seed=seed)


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_sigkill_many_iterations(harness: Harness, make_node: MakeNode, seed: int) -> None:
    await _crash_iterations(harness, make_node, iterations=30, seed=seed)


# --- leader election -----------------------------------------------------------------------------------


def _state(port: int) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            state: dict[str, object] = json.loads(resp.read())
            return state
    except Exception as exc:
        return {"error": repr(exc)}


def _writes(port: int) -> int:
    """API writes this replica made, excluding its own Lease traffic."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    total = 0
    for m in re.finditer(r"^computedomain_kube_api_requests_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels["verb"] in ("create", "update", "patch", "delete", "apply") and labels["resource"] not in (
            "leases",
            "events",
        ):
            total += int(float(m.group(2)))
    return total


async def _leading(port: int, *, within: float) -> float:
    start = time.monotonic()
    await eventually(lambda: _state(port).get("leading") is True or None, within=within, interval=0.05, what="leader")
    return time.monotonic() - start


@pytest.mark.timeout(180)
async def test_two_replicas_one_writer_handover_and_takeover(harness: Harness) -> None:
    h = harness
    lease = f"cd-controller-{uuid.uuid4().hex[:6]}"
    durations = {
        "LEADER_ELECTION_LEASE_DURATION": "6",
        "LEADER_ELECTION_RENEW_DEADLINE": "4",
        "LEADER_ELECTION_RETRY_PERIOD": "1",
    }

    def replica(name: str, port: int) -> subprocess.Popen[bytes]:
        return h.spawn(
            log_name=name,
            LEADER_ELECTION_ENABLED="true",
            LEADER_ELECTION_LEASE_LOCK_NAMESPACE=h.driver_ns,
            LEADER_ELECTION_LEASE_LOCK_NAME=lease,
            POD_NAME=name,
            HTTP_ENDPOINT=f"127.0.0.1:{port}",
            **durations,
        )

    pa, pb, pc = free_port(), free_port(), free_port()
    a = replica("a", pa)
    await _leading(pa, within=30)
    b = replica("b", pb)
    await eventually(lambda: _state(pb).get("ready") is True or None, within=30, what="b synced")
    assert _state(pb)["leading"] is False

    uid = h.create_cd("ha1")["metadata"]["uid"]
    await eventually(lambda: _complete(h, uid, "ha1"), within=30, what="ha1 complete")
    assert _writes(pa) > 0 and _writes(pb) == 0, "only the leader writes"

    # Graceful: SIGTERM releases the lease and the standby takes over at once.
    a.send_signal(signal.SIGTERM)
    handover = await _leading(pb, within=15)
    assert await asyncio.to_thread(a.wait, 15) == 0
    print(f"graceful handover: {handover:.2f}s")
    assert handover < 3.0
    uid2 = h.create_cd("ha2")["metadata"]["uid"]
    await eventually(lambda: _complete(h, uid2, "ha2"), within=30, what="ha2 complete under the new leader")

    # Crash: SIGKILL; a standby takes over once the lease expires (lease 6 s + one retry period).
    c = replica("c", pc)
    await eventually(lambda: _state(pc).get("ready") is True or None, within=30, what="c synced")
    assert _writes(pc) == 0
    _kill(b)
    takeover = await _leading(pc, within=20)
    print(f"takeover after SIGKILL: {takeover:.2f}s (lease 6s)")
    assert takeover <= 6 + 1.5 + 1.0
    h.kubectl("delete", "computedomain", "ha1", "ha2", "-n", h.cd_ns, "--wait=false")
    for name in ("ha1", "ha2"):
        await eventually(lambda name=name: h.try_get("computedomain", name, "-n", h.cd_ns) is None or None, what="gone")
    assert children_of(h, uid) == EMPTY and children_of(h, uid2) == EMPTY
    _kill(c)


@pytest.mark.timeout(120)
async def test_lost_leadership_ends_the_process(harness: Harness) -> None:
    h = harness
    lease = f"cd-controller-{uuid.uuid4().hex[:6]}"
    port = free_port()
    proc = h.spawn(
        log_name="lost",
        LEADER_ELECTION_ENABLED="true",
        LEADER_ELECTION_LEASE_LOCK_NAMESPACE=h.driver_ns,
        LEADER_ELECTION_LEASE_LOCK_NAME=lease,
        LEADER_ELECTION_LEASE_DURATION="6",
        LEADER_ELECTION_RENEW_DEADLINE="4",
        LEADER_ELECTION_RETRY_PERIOD="1",
        POD_NAME="victim",
        HTTP_ENDPOINT=f"127.0.0.1:{port}",
    )
    await _leading(port, within=30)
    # Someone else takes the Lease (as a partitioned leader would find after its lease ran out).
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    patch = json.dumps({"spec": {"holderIdentity": "intruder", "renewTime": now, "acquireTime": now}})
    h.kubectl("patch", "lease", lease, "-n", h.driver_ns, "--type=merge", "-p", patch)
    code = await asyncio.to_thread(proc.wait, 30)
    assert code == 1
    assert "leadership lost" in h.logs[-1].read_text()
