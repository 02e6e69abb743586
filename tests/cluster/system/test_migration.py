"""The switch from the reference driver with a job running (docs/migrate.md, docs/design/0011), on a simulated
NVL72 rack of three trays with this service's processes as the chart runs them.

Before the switch the cluster holds what the reference leaves (`tests/testbed/reference.py`,
`tests/testbed/reference_chart`): its CRDs, its release (controller and node agents, the IMEX daemons'
ServiceAccount), its node agents' ResourceSlices and base CDI spec, and one running ComputeDomain: the
reference controller's templates, DaemonSet, finalizer, Lease and status, the node labels, two IMEX daemon
pods running and registered in their clique, two workload pods running with their channel, and on each node
the reference's checkpoint and claim CDI specs. The reference's Prepare is played by the test: it writes what
that Prepare writes and hands the result to the kubelet stand-in, as a kubelet remembers a Prepare's result
when the plugin that gave it is replaced. The daemons are this project's IMEX daemon under the reference's
peer names (the reference's binary is not available here).

Then the switch as the guide gives it: keep the daemons' ServiceAccount, turn the reference's ComputeDomain
part off with `helm upgrade`, `helm install` this chart (whose hook brings the CRDs up to date). Checked: the
running pods keep running, with their channel and their daemons (not restarted, same account), the node
agents take the checkpoints over and replace the ResourceSlices, the controller takes the Lease, the
DaemonSet and the templates over; a new pod of the domain starts on the third tray with a daemon of ours that
joins the same clique under the same peer names; deleting the pods and the domain afterwards leaves nothing
behind, on the cluster or on the nodes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.controller.daemonset import DAEMON_COMMAND, REFERENCE_PEER_PREFIX
from computedomain.plugin import cdi
from computedomain.plugin.cdi_base import base_edits, write_base_spec
from computedomain.plugin.checkpoint import read_boot_id
from computedomain.plugin.preparer import ClaimRef, ClaimUid
from computedomain.plugin.resourceslice import desired_slice, published_devices, slice_name
from imex.procfs import ProcFS
from tests.cluster.manifests.release import chart_crds, crds_as_the_reference_ships_them
from tests.cluster.system.conftest import clique_entries, daemon_pods, eventually
from tests.conftest import REPO, Cluster
from tests.testbed import reference
from tests.testbed.kubelet import CDI_ANNOTATION, pod_claim_names
from tests.testbed.sim.cluster import SimCluster, SimConfig
from tests.testbed.sim.pods import Hosting
from tests.testbed.sim.topology import DRIVER_VERSION, KUBELET_PLUGINS, SELECTOR_LABEL, SimNode

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="module")]

REFERENCE_CHART = REPO / "tests" / "testbed" / "reference_chart"
REFERENCE_RELEASE = "nvidia-dra-driver-gpu"
LEASE = "dra-driver-nvidia-gpu-controller"
DAEMON_ACCOUNT = "compute-domain-daemon-service-account"
PLUGIN_DIR = f"{KUBELET_PLUGINS}/{DRIVER_NAME}"
CD = "job"
REFERENCE_COMMAND = ("compute-domain-daemon", "run")  # its pod runner runs this project's daemon for it
AGENT_ENV = "kubeletPlugin.containers.computeDomains.env"  # env[0] is the simulation's PROC_ROOT
Raw = dict[str, Any]


def micro_time() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())


def running(pod: Raw | None) -> bool:
    return bool(pod and pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"))


def ready(pod: Raw | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions") or ()
    return running(pod) and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def until(sim: SimCluster, what: str, check: Callable[[], Any], within: float = 120) -> Any:
    async def probe() -> Any:
        return check()

    return await eventually(probe, within=within, what=what)


def allocated_claim(sim: SimCluster, pod: Raw) -> Raw | None:
    """The pod's one claim once the scheduler allocated and reserved it."""
    names = pod_claim_names(pod)
    if not names:
        return None
    claim = sim.get("resourceclaim", names[0], pod["metadata"]["namespace"])
    status = (claim or {}).get("status") or {}
    reserved = {r.get("uid") for r in status.get("reservedFor") or ()}
    return claim if status.get("allocation") and pod["metadata"]["uid"] in reserved else None


class ReferenceNode:
    """What the reference's node agent did on one node: a daemon claim and a channel claim prepared."""

    def __init__(self, sim: SimCluster, node: SimNode, cd: Raw) -> None:
        self.sim, self.node, self.cd = sim, node, cd
        self.claims: dict[str, tuple[Raw, Raw, reference.RefClaim]] = {}  # kind -> (pod, claim, its record)

    def add(self, kind: str, pod: Raw, claim: Raw) -> None:
        meta = claim["metadata"]
        record = reference.RefClaim(
            meta["uid"], self.cd["metadata"]["uid"], self.node.name, kind=kind, name=meta["name"],
            namespace=meta["namespace"], pod_uid=pod["metadata"]["uid"],
        )  # fmt: skip
        self.claims[kind] = (pod, claim, record)

    def write(self) -> None:
        """Its checkpoint (v2 with the v1 copy) and the two claims' CDI specs (YAML)."""
        records = [record for _, _, record in self.claims.values()]
        doc = reference.checkpoint_v2(records, boot_id=read_boot_id())
        reference.write_checkpoint(self.node.host_path(PLUGIN_DIR), doc)
        uid, meta = self.cd["metadata"]["uid"], self.cd["metadata"]
        domain_dir = Path(PLUGIN_DIR) / "domains" / uid
        self.node.host_path(str(domain_dir)).mkdir(parents=True, exist_ok=True)
        daemon = cdi.daemon_edits(
            domain_dir=domain_dir, clique_id=self.node.clique, domain_uid=uid, domain_name=meta["name"],
            domain_namespace=meta["namespace"], fabric_imex_mgmt=None,
        )  # fmt: skip
        major = ProcFS(self.node.root).imex_channel_major()
        reference.write_claim_spec(self.node.cdi_dir, self.uid("daemon"), {"daemon-0": daemon.to_cdi()})
        reference.write_claim_spec(
            self.node.cdi_dir, self.uid("channel"), {"channel-0": reference.channel_edits(major)}
        )

    def uid(self, kind: str) -> str:
        return str(self.claims[kind][1]["metadata"]["uid"])

    def prepared(self, kind: str) -> None:
        """The reference's Prepare returned: the kubelet (stand-in) records it and lets the pod run."""
        pod, claim, record = self.claims[kind]
        ref = ClaimRef(claim["metadata"]["namespace"], claim["metadata"]["name"], ClaimUid(record.uid))
        self.sim.standins[self.node.name].record_prepared(pod, ref, DRIVER_NAME, record.cdi_ids())


def create(sim: SimCluster, obj: Raw) -> Raw:
    out: Raw = json.loads(sim.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(obj)))
    return out


async def leave_reference_state(sim: SimCluster, nodes: list[SimNode]) -> tuple[Raw, dict[str, ReferenceNode]]:
    """Everything a reference installation with one ComputeDomain running on `nodes` leaves (module doc)."""
    ns, workloads = sim.driver_ns, sim.workload_ns
    sim.helm(
        "install", REFERENCE_RELEASE, str(REFERENCE_CHART), "-n", ns,
        "--set", f"nodeSelector.{SELECTOR_LABEL.replace('.', chr(92) + '.')}={sim.id}",
    )  # fmt: skip
    # Its node agents: a ResourceSlice per node (the kubelet helper's generated name) and the base CDI spec.
    devices = published_devices(host_managed=False, imex_supported=True)
    for node in sim.topology:
        node_uid = (sim.get("node", node.name) or {})["metadata"]["uid"]
        published = desired_slice(node.name, node_uid, devices, 1)
        published["metadata"]["generateName"] = f"{published['metadata'].pop('name')}-"
        create(sim, published)
        edits = base_edits(
            driver_root=node.root, host_driver_root="/", driver_version=DRIVER_VERSION, require_imex=True
        )
        write_base_spec(node.cdi_dir, edits)

    # Its controller: the domain's finalizer, templates and DaemonSet, its Lease.
    sim.apply(sim.compute_domain(CD, num_nodes=len(nodes)))
    finalizer = {"metadata": {"finalizers": [COMPUTE_DOMAIN_FINALIZER]}}
    sim.kubectl("patch", "computedomain", CD, "-n", workloads, "--type=merge", "-p", json.dumps(finalizer))
    cd = sim.get("computedomain", CD, workloads)
    assert cd is not None
    uid = cd["metadata"]["uid"]
    peer_names = [{"name": "IMEX_HOSTNAME_PREFIX", "value": reference.REFERENCE_HOSTNAME_PREFIX}]
    for obj in (
        reference.daemon_template(cd, ns),
        reference.workload_template(cd),
        reference.daemonset(cd, ns, image=sim.image, command=REFERENCE_COMMAND, env=peer_names),
    ):
        create(sim, obj)
    create(sim, {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": LEASE, "namespace": ns},
        "spec": {"holderIdentity": f"{REFERENCE_RELEASE}-controller-0-{uuid.uuid4()}", "leaseDurationSeconds": 15,
                 "acquireTime": micro_time(), "renewTime": micro_time(), "leaseTransitions": 0},
    })  # fmt: skip

    # A job: one pod per node; the reference's node agents label the nodes, which brings the daemons.
    sim.apply([sim.workload_pod(f"{CD}-{n.name}", CD, n.name) for n in nodes])
    for node in nodes:
        sim.kubectl("label", "node", node.name, f"{COMPUTE_DOMAIN_LABEL}={uid}")
    ref_nodes = {n.name: ReferenceNode(sim, n, cd) for n in nodes}

    def claims_allocated() -> bool:
        daemons = daemon_pods(sim, uid)
        for node in nodes:
            workload = sim.get("pod", f"{CD}-{node.name}", workloads)
            pairs = (("channel", workload), ("daemon", daemons.get(node.name)))
            for kind, pod in pairs:
                claim = allocated_claim(sim, pod) if pod else None
                if pod is None or claim is None:
                    return False
                ref_nodes[node.name].add(kind, pod, claim)
        return True

    await until(sim, "daemon and workload claims allocated", claims_allocated)
    for ref_node in ref_nodes.values():
        ref_node.write()
        ref_node.prepared("daemon")

    def daemons_ready() -> bool:
        entries = clique_entries(sim, uid).get(nodes[0].clique, {})
        pods = daemon_pods(sim, uid)
        return all(ready(pods.get(n.name)) and entries.get(n.name, {}).get("status") == "Ready" for n in nodes)

    await until(sim, "the reference's IMEX daemons Ready in their clique", daemons_ready, within=180)
    for ref_node in ref_nodes.values():  # the reference's Prepare of a channel waits for the local daemon
        ref_node.prepared("channel")
    await until(
        sim, "the job's pods Running",
        lambda: all(running(sim.get("pod", f"{CD}-{n.name}", workloads)) for n in nodes),
    )  # fmt: skip
    status = {"status": {"status": "Ready"}}
    sim.kubectl(
        "patch", "computedomain", CD, "-n", workloads, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    cd = sim.get("computedomain", CD, workloads)
    assert cd is not None
    return cd, ref_nodes


def switch(sim: SimCluster) -> Awaitable[None]:
    """docs/migrate.md, "Switching": the commands as a user runs them."""
    ns = sim.driver_ns
    # 1. Keep the IMEX daemons' ServiceAccount and hand it to the new release.
    sim.kubectl(
        "annotate", "serviceaccount", DAEMON_ACCOUNT, "-n", ns, "--overwrite", "helm.sh/resource-policy=keep",
        f"meta.helm.sh/release-name={sim.config.release}", f"meta.helm.sh/release-namespace={ns}",
    )  # fmt: skip
    # 2. Turn the reference's ComputeDomain part off (its GPU part stays).
    sim.helm(
        "upgrade", REFERENCE_RELEASE, str(REFERENCE_CHART), "-n", ns, "--reuse-values",
        "--set", "resources.computeDomains.enabled=false",
    )  # fmt: skip
    # Its controller's pod went; it releases the Lease on its way out (client-go's ReleaseOnCancel).
    released = {"spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time()}}
    sim.kubectl("patch", "lease", LEASE, "-n", ns, "--type=merge", "-p", json.dumps(released))
    # 3. Install this chart into the same namespace.
    return sim.install()


def objects_of(sim: SimCluster, uid: str) -> list[str]:
    out = sim.kubectl(
        "get", "daemonsets,resourceclaimtemplates,resourceclaims,computedomaincliques,networkpolicies,pods", "-A",
        "-l", f"{COMPUTE_DOMAIN_LABEL}={uid}", "-o", "name",
    )  # fmt: skip
    cliques = [
        c["metadata"]["name"] for c in sim.items("computedomaincliques", sim.driver_ns)
        if c["metadata"]["name"].startswith(f"{uid}.")
    ]  # fmt: skip
    return out.split() + cliques


async def test_running_domain_survives_the_switch_and_is_deleted_cleanly(cluster: Cluster) -> None:
    config = SimConfig(
        racks=1, trays_per_rack=3, non_fabric=0, install=False, hosting=Hosting(plugins_per_host=3),
        restart_backoff_s=1.0,
        # The node agents remove a gone domain's /imexd directory in their periodic cleanup only (10 min, as
        # the reference): every 5 s here, so that the test sees it go.
        helm_set=[f"{AGENT_ENV}[1].name=CLEANUP_INTERVAL", f"{AGENT_ENV}[1].value=5.0"],
    )  # fmt: skip
    with crds_as_the_reference_ships_them(cluster):
        async with SimCluster(cluster.local, config) as sim:
            ns, workloads = sim.driver_ns, sim.workload_ns
            *nodes, joining = list(sim.topology)
            cd, ref_nodes = await leave_reference_state(sim, nodes)
            uid = cd["metadata"]["uid"]
            account = (sim.get("serviceaccount", DAEMON_ACCOUNT, ns) or {})["metadata"]["uid"]
            pods_before = {n.name: sim.get("pod", f"{CD}-{n.name}", workloads) for n in nodes}
            daemons_before = daemon_pods(sim, uid)
            entries_before = clique_entries(sim, uid)

            await switch(sim)
            await sim.wait_installed(within=300)

            # The reference's ComputeDomain part is gone, its daemons' account is the same object.
            assert sim.get("deployment", f"{REFERENCE_RELEASE}-controller", ns) is None
            plugin = sim.get("daemonset", f"{REFERENCE_RELEASE}-kubelet-plugin", ns)
            assert plugin is not None and [c["name"] for c in plugin["spec"]["template"]["spec"]["containers"]] == [
                "gpus"
            ]
            daemon_sa = sim.get("serviceaccount", DAEMON_ACCOUNT, ns)
            assert daemon_sa is not None and daemon_sa["metadata"]["uid"] == account
            assert daemon_sa["metadata"]["annotations"]["meta.helm.sh/release-name"] == sim.config.release

            # CRDs: the chart's hook brought them up to date, and the controller's conditions are kept now.
            for crd in chart_crds():
                live = sim.get("crd", crd["metadata"]["name"])
                assert live is not None and live["spec"]["names"].get("shortNames") == crd["spec"]["names"].get(
                    "shortNames"
                )
                assert [v["schema"] for v in live["spec"]["versions"]] == [v["schema"] for v in crd["spec"]["versions"]]

            def cd_ready_with_conditions() -> Raw | None:
                current = sim.get("computedomain", CD, workloads) or {}
                conditions = {c["type"]: c["status"] for c in current.get("status", {}).get("conditions") or ()}
                return current if conditions.get("Ready") == "True" else None

            await until(sim, "Ready condition on the domain", cd_ready_with_conditions)

            # The controller took the Lease, the DaemonSet (OnDelete, our template, the reference's peer names).
            lease = sim.get("lease", LEASE, ns)
            holder = (lease or {}).get("spec", {}).get("holderIdentity") or ""
            controllers = [
                p["metadata"]["name"] for p in sim.items("pods", ns, "app.kubernetes.io/component=controller")
            ]
            assert any(holder.startswith(name) for name in controllers), (holder, controllers)
            ds = sim.get("daemonset", f"computedomain-daemon-{uid}", ns)
            assert ds is not None and ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
            (container,) = ds["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["IMEX_HOSTNAME_PREFIX"] == REFERENCE_PEER_PREFIX and "readinessProbe" in container
            events = sim.kubectl("get", "events", "-n", workloads, "--field-selector", f"involvedObject.name={CD}")
            assert "TookOverDaemonSet" in events

            # The node agents took the checkpoints over and replaced the reference's ResourceSlices.
            for node in nodes:
                node_events = sim.kubectl(
                    "get",
                    "events",
                    "-A",
                    "--field-selector",
                    f"involvedObject.kind=Node,involvedObject.name={node.name}",
                )
                assert "CheckpointTakenOver" in node_events, node_events
            slices = sim.items("resourceslices")
            names = sorted(s["metadata"]["name"] for s in slices if s["spec"].get("nodeName") in sim.topology.by_name)
            assert names == sorted(slice_name(n.name) for n in sim.topology)

            # The job runs on, with its channel; its daemons were not restarted.
            for node in nodes:
                pod = sim.get("pod", f"{CD}-{node.name}", workloads)
                before = pods_before[node.name]
                assert before is not None and running(pod) and pod is not None
                assert pod["metadata"]["uid"] == before["metadata"]["uid"]
                channel = ref_nodes[node.name].uid("channel")
                assert cdi.qualified_id(f"{channel}-channel-0") in pod["metadata"]["annotations"][CDI_ANNOTATION]
                assert reference.claim_spec_path(node.cdi_dir, channel).exists()
            daemons = daemon_pods(sim, uid)
            for node in nodes:
                pod = daemons[node.name]
                assert pod["metadata"]["uid"] == daemons_before[node.name]["metadata"]["uid"] and ready(pod)
                assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
            assert clique_entries(sim, uid) == entries_before

            # A new pod of the domain on the third tray: a daemon of ours joins the clique under the same names.
            sim.apply(sim.workload_pod(f"{CD}-{joining.name}", CD, joining.name))
            await until(
                sim, "the new pod Running", lambda: running(sim.get("pod", f"{CD}-{joining.name}", workloads)),
                within=180,
            )  # fmt: skip
            daemons = daemon_pods(sim, uid)
            new_daemon = daemons[joining.name]
            assert new_daemon["spec"]["containers"][0]["command"] == list(DAEMON_COMMAND)

            def three_ready() -> dict[str, Raw] | None:
                # A daemon of the clique reloads its IMEX peers when one joins, and is briefly not Ready.
                (entries,) = clique_entries(sim, uid).values()
                ok = set(entries) == {n.name for n in sim.topology}
                return entries if ok and {e["status"] for e in entries.values()} == {"Ready"} else None

            members = await until(sim, "three daemons Ready in the clique", three_ready)
            assert len({int(e["index"]) for e in members.values()}) == 3
            assert sim.runner is not None
            worker = sim.runner.worker(ns, new_daemon["metadata"]["name"])
            assert worker is not None
            lines = (worker.dir / "etc-hosts").read_text().splitlines()
            hosts = {parts[1]: parts[0] for parts in map(str.split, lines) if len(parts) == 2}
            for entry in members.values():
                assert hosts[f"{REFERENCE_PEER_PREFIX}-{int(entry['index']):04d}"] == entry["ipAddress"], hosts

            # Deleting the pods and the domain leaves nothing: objects, node labels, node files.
            pods = [f"{CD}-{n.name}" for n in sim.topology]
            await sim.akubectl("delete", "pods", "-n", workloads, "--wait=true", "--timeout=120s", *pods)
            await sim.akubectl("delete", "computedomain", CD, "-n", workloads, "--wait=true", "--timeout=120s")
            await until(sim, "no object of the domain left", lambda: not objects_of(sim, uid))
            assert sim.get("resourceclaimtemplate", f"{CD}-channel", workloads) is None
            for node in sim.topology:
                labels = (sim.get("node", node.name) or {})["metadata"]["labels"]
                assert COMPUTE_DOMAIN_LABEL not in labels, node.name
                claim_specs = [p.name for p in node.cdi_dir.iterdir() if "-claim_" in p.name]
                assert claim_specs == [], (node.name, claim_specs)
            domain_dirs = [n.host_path(f"{PLUGIN_DIR}/domains/{uid}") for n in sim.topology]
            await until(
                sim, "the domain's /imexd directories removed", lambda: not any(d.exists() for d in domain_dirs)
            )


async def test_with_the_reference_crds_left_the_controller_says_so_once_and_stops_writing(cluster: Cluster) -> None:
    """`crds.upgrade=false` and the reference's CRDs not applied yet: the apiserver prunes status.conditions.
    The controller says so once (a WARNING line, one Event) and does not rewrite the status it cannot store:
    each reconcile used to write it again, and each write caused the next reconcile."""
    config = SimConfig(
        racks=1, trays_per_rack=1, non_fabric=0, helm_set=["crds.upgrade=false", "controller.replicas=1"]
    )
    with crds_as_the_reference_ships_them(cluster):
        async with SimCluster(cluster.local, config) as sim:
            await sim.wait_installed()
            sim.apply(sim.compute_domain(CD, num_nodes=1))

            def dropped() -> list[Raw]:
                out = sim.kubectl(
                    "get", "events", "-n", sim.workload_ns, "-o", "json",
                    "--field-selector", f"involvedObject.name={CD},reason=StatusConditionsDropped",
                )  # fmt: skip
                items: list[Raw] = json.loads(out)["items"]
                return items

            (event,) = await until(sim, "the StatusConditionsDropped Event", dropped)
            cd = sim.get("computedomain", CD, sim.workload_ns)
            assert cd is not None and cd["status"]["status"] == "NotReady" and "conditions" not in cd["status"]
            # Reconciles with nothing new to write (each annotation change is one), then a window in which a
            # write loop would have written many times (each write is a watch event and the next reconcile).
            for i in range(5):
                sim.kubectl("annotate", "computedomain", CD, "-n", sim.workload_ns, f"test/poke={i}", "--overwrite")
            poked = (sim.get("computedomain", CD, sim.workload_ns) or {})["metadata"]["resourceVersion"]
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                now = sim.get("computedomain", CD, sim.workload_ns) or {}
                assert now["metadata"]["resourceVersion"] == poked, "the controller wrote the status again"
                await asyncio.sleep(0.2)
            (again,) = dropped()
            assert again["metadata"]["uid"] == event["metadata"]["uid"] and again.get("count", 1) == 1
            assert sim.runner is not None
            (controller,) = sim.items("pods", sim.driver_ns, "app.kubernetes.io/component=controller")
            log = sim.runner.pod_log(sim.driver_ns, controller["metadata"]["name"], "compute-domain")
            assert log.count("the apiserver dropped status.conditions") == 1, log
