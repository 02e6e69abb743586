"""driverManaged mode on real nodes: IMEX daemons and workloads as real containers, channels through CDI.

One chart release for the module. Each test creates its own ComputeDomain and pods and leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.cluster.realnode.conftest import (
    Scenario,
    cdi_claim_files,
    checkpoint_claims,
    installed,
    live_state,
    wait_for,
)
from tests.testbed.realnode.nodes import RealNodes
from tests.testbed.realnode.release import RealRelease

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

LIST_CHANNELS = "ls -la /dev/nvidia-caps-imex-channels; sleep 3600"


@pytest.fixture(scope="module")
def release(real_nodes: RealNodes) -> Iterator[RealRelease]:
    with installed(RealRelease(real_nodes, mode="driverManaged")) as release:
        print(f"\nchart installed on the real nodes in {release.install_s:.1f}s")
        yield release


@pytest.fixture
def scenario(release: RealRelease) -> Iterator[Scenario]:
    scenario = Scenario(release)
    yield scenario
    scenario.remove_leftovers()


def channel_lines(logs: str) -> dict[str, tuple[str, int, int]]:
    """`ls -la` lines of channel devices: name -> (mode, major, minor)."""
    out = {}
    for line in logs.splitlines():
        match = re.match(r"^(c\S+)\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s.*\s(channel\d+)$", line.strip())
        if match:
            out[match.group(4)] = (match.group(1), int(match.group(2)), int(match.group(3)))
    return out


def test_domain_on_both_nodes_gives_each_worker_its_nodes_channel0(
    scenario: Scenario, real_nodes: RealNodes, release: RealRelease
) -> None:
    cd = scenario.name("cd")
    template = scenario.compute_domain(cd, num_nodes=2)
    workers = [scenario.name(f"w{i}") for i in range(2)]
    start = time.monotonic()
    for worker, node in zip(workers, real_nodes.nodes, strict=True):
        scenario.pod(worker, node.name, template, LIST_CHANNELS)
    for worker in workers:
        scenario.wait_running(worker)
    print(f"\nkubectl create -> both workers Running: {time.monotonic() - start:.1f}s")
    print(f"memory with a domain running (MiB): {real_nodes.memory_mib()}")

    uid = release.get("computedomain", cd, scenario.ns)["metadata"]["uid"]  # type: ignore[index]
    wait_for(lambda: (release.get("computedomain", cd, scenario.ns) or {}).get("status", {}).get("status") == "Ready",
             "the ComputeDomain Ready")  # fmt: skip
    daemons = release.items("pods", release.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}")
    assert sorted(p["spec"]["nodeName"] for p in daemons) == sorted(real_nodes.names)
    for daemon in daemons:
        assert daemon["status"]["containerStatuses"][0]["containerID"].startswith("containerd://"), daemon["status"]
    # A daemon's entry turns Ready on its own check, up to a startup-probe period before the kubelet marks
    # its pod Ready (design note 0005): the pods follow.
    wait_for(lambda: all(p["status"]["containerStatuses"][0]["ready"]
                         for p in release.items("pods", release.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}")),
             "the daemon pods Ready", timeout=30)  # fmt: skip
    for worker, node in zip(workers, real_nodes.nodes, strict=True):
        logs = scenario.logs(worker)
        channels = channel_lines(logs)
        assert channels == {"channel0": ("crw-rw-rw-", node.facts.channels_major, 0)}, logs

    scenario.delete("pod", *workers)
    scenario.delete("computedomain", cd)
    assert release.items("daemonsets", release.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}") == []
    wait_for(lambda: not release.items("pods", release.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}"), "daemons gone")
    assert [
        c for c in release.items("computedomaincliques", release.driver_ns) if c["metadata"]["name"].startswith(uid)
    ] == []
    for node in real_nodes.nodes:
        labels = release.get("node", node.name)["metadata"].get("labels", {})  # type: ignore[index]
        assert COMPUTE_DOMAIN_LABEL not in labels
        wait_for(lambda node=node: not cdi_claim_files(node), f"no claim CDI spec left on {node.name}")
        assert [c for c in checkpoint_claims(node) if live_state(node, c)] == []


def test_reference_names_and_the_crd_hook_on_real_kubelets(release: RealRelease) -> None:
    """What reference users' scripts use works against real containers: `kubectl logs` by the pod label
    dra-driver-nvidia-gpu-component and the container names, the Lease name. The controller runs as the image's
    non-root user (a real kubelet refuses runAsNonRoot for root), and the CRD hook Job ran to completion."""
    ns = release.driver_ns
    for component, container in (("controller", "compute-domain"), ("kubelet-plugin", "compute-domains")):
        selector = f"dra-driver-nvidia-gpu-component={component}"
        logs = release.kubectl("logs", "-n", ns, "-l", selector, "-c", container, "--tail=5")
        assert logs.strip(), f"kubectl logs -l {selector} -c {container}: nothing"
    (controller,) = release.items("pods", ns, "dra-driver-nvidia-gpu-component=controller")
    context = controller["spec"]["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == 65532, context
    lease = release.get("lease", "dra-driver-nvidia-gpu-controller", ns)
    assert lease is not None and lease["spec"]["holderIdentity"].startswith(controller["metadata"]["name"]), lease
    hook_done = [
        e
        for e in release.items("events", ns)
        if e["involvedObject"]["kind"] == "Job" and e["involvedObject"]["name"].endswith("-crds")
        and e["reason"] == "Completed"
    ]  # fmt: skip
    assert hook_done, "no Completed event of the CRD hook Job"


def test_allocation_mode_all_then_pod_deletion_unprepares(scenario: Scenario, real_nodes: RealNodes) -> None:
    node = real_nodes.nodes[1]
    cd = scenario.name("all")
    template = scenario.compute_domain(cd, num_nodes=1, mode="All")
    pod = scenario.name("all")
    scenario.pod(pod, node.name, template, LIST_CHANNELS)
    scenario.wait_running(pod)
    channels = channel_lines(scenario.logs(pod))
    assert channels == {
        f"channel{i}": ("crw-rw-rw-", node.facts.channels_major, i) for i in range(node.facts.channel_count)
    }
    claim = scenario.claim_uid(pod)
    assert live_state(node, claim) == "PrepareCompleted"
    assert f"k8s.compute-domain.nvidia.com-claim_{claim}.json" in cdi_claim_files(node)

    scenario.delete("pod", pod)
    # The kubelet calls NodeUnprepareResources once the pod is gone: the spec file and the entry go.
    wait_for(lambda: f"k8s.compute-domain.nvidia.com-claim_{claim}.json" not in cdi_claim_files(node),
             "the claim's CDI spec removed")  # fmt: skip
    assert live_state(node, claim) is None
    scenario.delete("computedomain", cd)


def _container_pid(real_nodes: RealNodes, node_name: str, container_id: str) -> int:
    node = real_nodes.node(node_name)
    for line in real_nodes.ctr(node, "tasks", "list").splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == container_id.removeprefix("containerd://"):
            return int(fields[1])
    raise AssertionError(f"no task for container {container_id} on {node_name}")


def test_node_agent_killed_mid_prepare_restarts_and_the_pod_starts(
    scenario: Scenario, real_nodes: RealNodes, release: RealRelease
) -> None:
    node = real_nodes.nodes[0]
    agent = release.agent_pods()[node.name]
    restarts = agent["status"]["containerStatuses"][0]["restartCount"]
    cd = scenario.name("kill")
    template = scenario.compute_domain(cd, num_nodes=1)
    pod = scenario.name("kill")
    scenario.pod(pod, node.name, template, LIST_CHANNELS)
    claim = scenario.claim_uid(pod)
    # Prepare waits for this node's IMEX daemon (started only now, Ready after its first probe): the
    # checkpoint says PrepareStarted meanwhile. SIGKILL the agent's process right then.
    wait_for(lambda: live_state(node, claim) == "PrepareStarted", "Prepare in progress", timeout=60, interval=0.02)
    os.kill(_container_pid(real_nodes, node.name, agent["status"]["containerStatuses"][0]["containerID"]),
            signal.SIGKILL)  # fmt: skip

    scenario.wait_running(pod, timeout=180)
    agent_after = wait_for(lambda: release.agent_pods().get(node.name), "the node agent pod")
    assert agent_after["metadata"]["uid"] == agent["metadata"]["uid"], "the kubelet restarts the container in place"
    assert agent_after["status"]["containerStatuses"][0]["restartCount"] == restarts + 1
    assert channel_lines(scenario.logs(pod)) == {"channel0": ("crw-rw-rw-", node.facts.channels_major, 0)}
    assert live_state(node, claim) == "PrepareCompleted"
    assert cdi_claim_files(node).count(f"k8s.compute-domain.nvidia.com-claim_{claim}.json") == 1

    scenario.delete("pod", pod)
    scenario.delete("computedomain", cd)
    wait_for(lambda: live_state(node, claim) is None and not cdi_claim_files(node), "nothing stale on the node")


def test_kubelet_restart_leaves_prepared_claims_and_pods_alone(
    scenario: Scenario, real_nodes: RealNodes, release: RealRelease
) -> None:
    node = real_nodes.nodes[1]
    cd = scenario.name("kr")
    template = scenario.compute_domain(cd, num_nodes=1)
    before = scenario.name("before")
    scenario.pod(before, node.name, template, LIST_CHANNELS)
    running = scenario.wait_running(before)
    claim = scenario.claim_uid(before)
    entry = checkpoint_claims(node)[claim]
    spec = (node.cdi_dir / f"k8s.compute-domain.nvidia.com-claim_{claim}.json").read_text()
    agent = release.agent_pods()[node.name]["metadata"]["name"]
    registrations = _registrations(release, agent)

    real_nodes.restart_kubelet(node)
    # The plugin registers again with the new kubelet (which finds its registration socket anew).
    wait_for(lambda: _registrations(release, agent) > registrations, "the plugin registered with the new kubelet")
    wait_for(lambda: _node_ready(release, node.name), "the node Ready again")

    pod = scenario.get_pod(before)
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert (
        pod["status"]["containerStatuses"][0]["containerID"] == running["status"]["containerStatuses"][0]["containerID"]
    )
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert checkpoint_claims(node)[claim] == entry
    assert (node.cdi_dir / f"k8s.compute-domain.nvidia.com-claim_{claim}.json").read_text() == spec

    # Both directions work through the new registration: Unprepare of the old claim (the node's one channel
    # is free again), Prepare of a new one.
    scenario.delete("pod", before)
    wait_for(lambda: live_state(node, claim) is None, "the old claim unprepared")
    after = scenario.name("after")
    scenario.pod(after, node.name, template, LIST_CHANNELS)
    scenario.wait_running(after)
    scenario.delete("pod", after)
    scenario.delete("computedomain", cd)


def _node_ready(release: RealRelease, name: str) -> bool:
    conditions = (release.get("node", name) or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _registrations(release: RealRelease, agent: str) -> int:
    """How often the node agent was told by a kubelet that its registration was accepted (its own log)."""
    logs = release.kubectl("logs", "-n", release.driver_ns, agent, check=False)  # the kubelet may still be starting
    return logs.count("kubelet accepted plugin registration")


def test_node_agent_token_is_bound_to_its_node_and_confined_to_it(real_nodes: RealNodes, release: RealRelease) -> None:
    mine, other = real_nodes.nodes
    agent = release.agent_pods()[mine.name]
    token = release.kubectl("exec", "-n", release.driver_ns, agent["metadata"]["name"], "--",
                            "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token").strip()  # fmt: skip

    def as_agent(*args: str, stdin: str | None = None) -> tuple[int, str]:
        local = release.cluster
        result = subprocess.run(
            [str(local.root / "bin" / "kubectl"), f"--server={local.server}",
             f"--certificate-authority={local.pki / 'ca.crt'}", f"--token={token}", *args],
            capture_output=True, text=True, timeout=60, input=stdin,
        )  # fmt: skip
        return result.returncode, result.stdout + result.stderr

    code, out = as_agent("auth", "whoami", "-o", "json")
    assert code == 0, out
    extra = json.loads(out)["status"]["userInfo"]["extra"]
    assert extra["authentication.kubernetes.io/node-name"] == [mine.name]
    assert extra["authentication.kubernetes.io/pod-name"] == [agent["metadata"]["name"]]

    # Its own node: allowed (the label it maintains).
    code, out = as_agent("label", "node", mine.name, "nvidia.com/gpu.clique=probe", "--overwrite")
    assert code == 0, out
    as_agent("label", "node", mine.name, "nvidia.com/gpu.clique-")
    # The label that brings a domain's IMEX daemon to a node is the controller's, even on the agent's own.
    code, out = as_agent("label", "node", mine.name, f"{COMPUTE_DOMAIN_LABEL}=00000000-0000-4000-8000-000000000000")
    assert code != 0 and f"{COMPUTE_DOMAIN_LABEL} is the controller's" in out, out
    # The other node: refused, with the policy's message.
    code, out = as_agent("label", "node", other.name, "nvidia.com/gpu.clique=stolen", "--overwrite")
    assert code != 0 and f"may only change its own Node, not {other.name}" in out, out
    slices = [s for s in release.items("resourceslices") if s["spec"].get("nodeName") == other.name]
    assert slices, "the other node's ResourceSlice"
    victim = slices[0]
    victim["spec"]["devices"] = []
    # Unconditional: a stale resourceVersion (the agent republishes its slice) would end in a Conflict before
    # admission ever sees the write.
    victim["metadata"].pop("resourceVersion", None)
    for _ in range(5):  # the apiserver may still answer Conflict when the agent republishes meanwhile: again
        code, out = as_agent("replace", "-f", "-", stdin=json.dumps(victim))
        if "(Conflict)" not in out:
            break
    assert code != 0 and f"may only write ResourceSlices of its own node, not {other.name}" in out, out
    # Clique entries are the IMEX daemons' to write: the agent may only read them.
    code, out = as_agent("auth", "can-i", "patch", "computedomaincliques.resource.nvidia.com", "-n", release.driver_ns)
    assert out.strip() == "no", out


def test_a_pod_outside_the_domains_daemonset_never_gets_its_daemon_device(
    scenario: Scenario, real_nodes: RealNodes, release: RealRelease
) -> None:
    """The node agent's check alone (the chart's daemon-claims admission policy is unbound for this test): a
    workload pod whose claim got another domain's daemon device allocated stays ContainerCreating, and the
    kubelet's Event carries the node agent's refusal, naming the rule."""
    node = real_nodes.nodes[0]
    cd = scenario.name("victim")
    scenario.compute_domain(cd)
    uid = release.get("computedomain", cd, scenario.ns)["metadata"]["uid"]  # type: ignore[index]
    (binding,) = [
        b for b in release.items("validatingadmissionpolicybindings", selector=f"app.kubernetes.io/instance={release.release}")
        if b["metadata"]["name"].endswith("-daemon-claims")
    ]  # fmt: skip
    release.kubectl("delete", "validatingadmissionpolicybinding", binding["metadata"]["name"])
    claim, pod = scenario.name("steal"), scenario.name("thief")
    try:
        body = json.dumps({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim},
            "spec": {"devices": {
                "requests": [{"name": "daemon", "exactly": {"deviceClassName": "compute-domain-daemon.nvidia.com"}}],
                "config": [{"requests": ["daemon"], "opaque": {"driver": "compute-domain.nvidia.com", "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainDaemonConfig", "domainID": uid}}}],
            }},
        })  # fmt: skip
        # The apiserver drops the policy a moment after its binding is gone.
        wait_for(lambda: release.cluster.kubectl("apply", "-n", scenario.ns, "-f", "-", input=body, check=False)
                 .returncode == 0, "the claim admitted")  # fmt: skip
        release.kubectl("apply", "-n", scenario.ns, "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name}, "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "c", "image": "ghcr.io/computedomain/computedomain:0.1.0",
                                "command": ["sleep", "3600"], "resources": {"claims": [{"name": "d"}]}}],
                "resourceClaims": [{"name": "d", "resourceClaimName": claim}],
            },
        }))  # fmt: skip
        rule = f"is only for pods of its DaemonSet computedomain-daemon-{uid} in namespace {release.driver_ns}"

        def refused() -> str | None:
            events = scenario.events(pod)
            return events if rule in events else None

        events = wait_for(refused, "the refusal on the pod")
        assert "FailedPrepareDynamicResources" in events and f"is in namespace {scenario.ns}" in events, events
        status = (scenario.get_pod(pod) or {}).get("status", {})
        waiting = status["containerStatuses"][0]["state"].get("waiting", {})
        assert status["phase"] == "Pending" and waiting.get("reason") == "ContainerCreating", status
        claim_obj = release.get("resourceclaim", claim, scenario.ns)
        assert claim_obj is not None and claim_obj["status"]["allocation"]["devices"]["results"][0]["device"] == (
            "daemon-0"
        )
        assert live_state(node, claim_obj["metadata"]["uid"]) is None
        assert not cdi_claim_files(node)
    finally:
        release.kubectl("delete", "pod", pod, "-n", scenario.ns, "--wait=true", "--timeout=120s", check=False)
        release.kubectl("delete", "resourceclaim", claim, "-n", scenario.ns, check=False)
        for key in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
            binding["metadata"].pop(key, None)
        binding.pop("status", None)
        release.kubectl("create", "-f", "-", input=json.dumps(binding))
        scenario.delete("computedomain", cd)


def test_four_pods_of_a_domain_share_a_node_another_domain_waits_for_the_last(
    scenario: Scenario, real_nodes: RealNodes, release: RealRelease
) -> None:
    """Design note 0014 on real kubelets: 4 pods of one domain on one node each get the node's channel 0
    (one IMEX daemon there); a pod of another domain pinned to that node is never placed on it while the first
    domain holds it (Pending with the scheduler's reason); deleting the 4 pods one by one unprepares each, and
    after the last the other domain's pod runs there."""
    node = real_nodes.nodes[0]
    cd, other = scenario.name("quad"), scenario.name("other")
    template, other_template = scenario.compute_domain(cd, num_nodes=1), scenario.compute_domain(other, num_nodes=1)
    pods = [scenario.name(f"quad{i}") for i in range(4)]
    for pod in pods:
        scenario.pod(pod, node.name, template, LIST_CHANNELS)
    for pod in pods:
        scenario.wait_running(pod)
    uid = release.get("computedomain", cd, scenario.ns)["metadata"]["uid"]  # type: ignore[index]
    for pod in pods:
        logs = scenario.logs(pod)
        assert channel_lines(logs) == {"channel0": ("crw-rw-rw-", node.facts.channels_major, 0)}, logs
    daemons = release.items("pods", release.driver_ns, f"{COMPUTE_DOMAIN_LABEL}={uid}")
    assert [p["spec"]["nodeName"] for p in daemons] == [node.name], "one IMEX daemon for the 4 pods"
    claims = [scenario.claim_uid(pod) for pod in pods]
    assert all(live_state(node, c) == "PrepareCompleted" for c in claims)

    intruder = scenario.name("other")
    scenario.pod(intruder, node.name, other_template, LIST_CHANNELS)
    wait_for(lambda: "FailedScheduling" in scenario.events(intruder), "the other domain's pod FailedScheduling")
    assert not (scenario.get_pod(intruder) or {})["spec"].get("nodeName"), scenario.events(intruder)

    for i, (pod, claim) in enumerate(zip(pods, claims, strict=True)):
        scenario.delete("pod", pod)
        wait_for(lambda claim=claim: live_state(node, claim) is None, f"claim of {pod} unprepared")
        if i < len(pods) - 1:
            labels = release.get("node", node.name)["metadata"].get("labels", {})  # type: ignore[index]
            assert labels.get(COMPUTE_DOMAIN_LABEL) == uid, f"{len(pods) - 1 - i} pods of the domain still run"
            assert not (scenario.get_pod(intruder) or {})["spec"].get("nodeName"), "never placed on a held node"
    scenario.wait_running(intruder)
    other_uid = release.get("computedomain", other, scenario.ns)["metadata"]["uid"]  # type: ignore[index]
    labels = release.get("node", node.name)["metadata"].get("labels", {})  # type: ignore[index]
    assert labels.get(COMPUTE_DOMAIN_LABEL) == other_uid
    scenario.delete("pod", intruder)
    scenario.delete("computedomain", cd, other)
    wait_for(lambda: not cdi_claim_files(node), f"no claim CDI spec left on {node.name}")
