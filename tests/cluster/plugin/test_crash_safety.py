"""SIGKILL of the node agent at random points of Prepare and Unprepare, with the real scheduler, claims and
kubelet stand-in: after each restart nothing leaks and nothing is stuck (SPEC section 9, "crashes").

Default run: PLUGIN_CRASH_ITERATIONS (10) rounds; under `-m slow` the long variant runs 25, each run with a
seed of its own.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.plugin.checkpoint import ClaimState, dumps
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from tests.cluster.plugin.conftest import Harness, SimNode, eventually
from tests.testbed.kubelet_client import KubeletClient

pytestmark = pytest.mark.cluster

ITERATIONS = int(os.environ.get("PLUGIN_CRASH_ITERATIONS", "10"))


def live_entries(node: SimNode) -> list[str]:
    return [f"{e.name}:{e.state}" for e in node.store().read().claims.values() if not e.state.is_tombstone]


async def kill_during(
    harness: Harness,
    node: SimNode,
    pod: str,
    operation: str,
    rng: random.Random,
    stats: Counter[str],
) -> None:
    """Arm a SIGKILL of the agent at a random moment of the stand-in's next `operation` call: 0-30 ms after
    the RPC goes out (Prepare of a ready domain takes about that long here: claim GET, checkpoint writes,
    node label, CDI spec), so kills land before, inside and after the work. `stats` counts where the kill
    left the claim's checkpoint entry. Then start a new agent process."""
    standin = node.standin
    assert standin is not None and node.plugin.proc is not None
    proc = node.plugin.proc
    loop = asyncio.get_running_loop()
    fired = asyncio.Event()

    def hook(op: str, refs: list[ClaimRef]) -> None:
        if op != operation or fired.is_set():
            return
        fired.set()
        loop.call_later(rng.uniform(0.0, 0.03), lambda: proc.poll() is None and proc.send_signal(signal.SIGKILL))

    standin.on_call = hook
    try:
        await eventually(fired.is_set, within=60, interval=0.01, what=f"{operation} call")
        await eventually(lambda: proc.poll() is not None, within=10, interval=0.01, what="the agent to die")
    finally:
        standin.on_call = None
    states = [str(e.state) for e in node.store().read().claims.values() if e.name.startswith(f"{pod}-")]
    stats[f"{operation}: {states[0] if states else 'no entry yet'}"] += 1
    await harness.restart_plugin(node)


async def crash_rounds(harness: Harness, iterations: int, seed: int) -> None:
    rng = random.Random(seed)
    node = await harness.add_node()
    cd = harness.create_cd("crash")
    template = harness.channel_template(cd)
    harness.set_clique(cd, node, "Ready")
    standin = node.standin
    assert standin is not None
    stats: Counter[str] = Counter()
    for i in range(iterations):
        pod = f"w{i}"
        armed = asyncio.create_task(kill_during(harness, node, pod, "prepare", rng, stats))
        harness.pod(pod, node, template)
        await armed
        await eventually(lambda p=pod: harness.phase(p) == "Running", within=90, what=f"{pod} Running after a crash")
        claim = harness.claim_of(pod)
        assert claim is not None
        claim_uid = claim["metadata"]["uid"]
        assert node.cdi_spec(claim_uid) is not None
        assert COMPUTE_DOMAIN_LABEL not in harness.node_labels(node), "the CD label is the controller's"

        armed = asyncio.create_task(kill_during(harness, node, pod, "unprepare", rng, stats))
        harness.kubectl("delete", "pod", pod, "-n", harness.ns, "--wait=false")
        await armed
        await eventually(lambda p=pod: harness.get("pod", p, harness.ns) is None, within=90, what=f"{pod} gone")
        # Nothing stuck "deleted,allocated,reserved", nothing leaked.
        await eventually(
            lambda n=claim["metadata"]["name"]: harness.get("resourceclaim", n, harness.ns) is None,
            within=60,
            what="claim released",
        )
        assert node.cdi_spec(claim_uid) is None, f"round {i}: CDI spec leaked"
        assert COMPUTE_DOMAIN_LABEL not in harness.node_labels(node), f"round {i}: node label leaked"
        assert live_entries(node) == [], f"round {i}: channel still held in the checkpoint"
    assert node.plugin.starts == 1 + 2 * iterations
    print(
        f"\nSIGKILL points over {iterations} rounds (claim state in the checkpoint at the kill): {dict(sorted(stats.items()))}"
    )


@pytest.mark.timeout(900)
async def test_sigkill_during_prepare_and_unprepare(harness: Harness, seed: int) -> None:
    await crash_rounds(harness, ITERATIONS, seed)


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_sigkill_during_prepare_and_unprepare_long(harness: Harness, seed: int) -> None:
    await crash_rounds(harness, 25, seed)


@pytest.mark.timeout(240)
async def test_stale_prepare_after_unprepare_and_reboot_across_restarts(harness: Harness) -> None:
    node = await harness.add_node(standin=False)
    cd = harness.create_cd("stale")
    harness.set_clique(cd, node, "Ready")
    params = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": cd["metadata"]["uid"],
    }
    claim = harness.manual_claim_pod("p", node, params)
    ref = ClaimRef(harness.ns, claim["metadata"]["name"], ClaimUid(claim["metadata"]["uid"]))
    socket = node.registrar_dir / f"{DRIVER_NAME}-reg.sock"

    async def call(operation: str) -> str:
        async with KubeletClient(socket) as kubelet:
            if operation == "prepare":
                result = (await kubelet.prepare([ref]))[ref.uid]
                return result.error or ",".join(i for d in result.devices for i in d.cdi_device_ids)
            return (await kubelet.unprepare([ref]))[ref.uid].error

    first = await call("prepare")
    assert first.endswith(f"claim={ref.uid}-channel-0")
    node.plugin.kill()
    await harness.restart_plugin(node)
    assert await call("prepare") == first, "a completed claim returns the same devices after a crash"
    assert await call("unprepare") == ""
    node.plugin.kill()
    await harness.restart_plugin(node)
    late = await call("prepare")
    assert "permanent error" in late and "stale Prepare" in late, late
    assert node.cdi_spec(ref.uid) is None and COMPUTE_DOMAIN_LABEL not in harness.node_labels(node)

    # A reboot: another boot ID, and /var/run (the CDI specs) is empty again.
    harness.kubectl("delete", "pod", "p", "-n", harness.ns, "--force", "--grace-period=0")
    harness.kubectl("delete", "resourceclaim", claim["metadata"]["name"], "-n", harness.ns, "--wait=false")
    claim2 = harness.manual_claim_pod("q", node, params)
    ref = ClaimRef(harness.ns, claim2["metadata"]["name"], ClaimUid(claim2["metadata"]["uid"]))
    assert (await call("prepare")).endswith("-channel-0")
    assert node.plugin.stop() == 0
    store = node.store()
    rebooted = store.read().model_copy(update={"boot_id": "boot-before-the-reboot"})
    store.path.write_text(dumps(rebooted))
    await asyncio.to_thread(Path(node.cdi_dir / f"k8s.compute-domain.nvidia.com-claim_{ref.uid}.json").unlink)
    await harness.restart_plugin(node)
    assert "node rebooted since the checkpoint was written" in node.plugin.log()
    entry = node.store().read().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED, "a reboot invalidates completed claims"
    assert (await call("prepare")).endswith("-channel-0"), "the kubelet's next Prepare redoes the work"
    assert node.cdi_spec(ref.uid) is not None
