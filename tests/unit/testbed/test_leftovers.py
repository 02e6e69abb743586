"""What a reused cluster's next command decides about what earlier runs left: which simulated clusters are a
killed run's, and which base objects others wrote (and `install_base` takes over)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.testbed import leftovers
from tests.testbed.cluster import FIELD_MANAGER, LocalCluster, _object_name, takeover_line
from tests.testbed.leftovers import SimRecord
from tests.testbed.realnode.nodes import Proc, State


def record(**kwargs: object) -> SimRecord:
    values: dict[str, object] = {
        "id": "cabc12", "release": "cd", "driver_ns": "cd-system", "workload_ns": "workloads",
        "nodes": ["gb-r0-t0", "gb-r0-t1"], "root": "/nonexistent/cdsxyz",
    }  # fmt: skip
    values.update(kwargs)
    return SimRecord(**values)  # type: ignore[arg-type]


def dead_pid() -> tuple[int, int | None]:
    """A process that ran and exited (its pid and start time, as a record of it holds them)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = leftovers.start_time(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, start


def test_a_record_of_this_process_is_live_and_one_of_an_exited_process_is_stale(tmp_path: Path) -> None:
    mine = record(id="mine")
    pid, start = dead_pid()
    gone = record(id="gone", pid=pid, start=start)
    reused = record(id="reused", pid=os.getpid(), start=(mine.start or 0) + 1)  # same pid, another process
    records = {tmp_path / f"{r.id}.json": r for r in (mine, gone, reused)}
    records[tmp_path / "torn.json"] = None
    assert mine.owner_alive()
    assert sorted(p.name for p in leftovers.stale(records)) == ["gone.json", "reused.json", "torn.json"]


def test_records_round_trip_and_a_torn_one_reads_as_none(tmp_path: Path) -> None:
    local = LocalCluster(tmp_path)
    leftovers.register(local, record(kwok_pid=123, kwok_start=456))
    (leftovers.records_dir(local) / "torn.json").write_text('{"id": "c')
    read = leftovers.read_records(local)
    assert read[leftovers.records_dir(local) / "cabc12.json"] == record(kwok_pid=123, kwok_start=456)
    assert read[leftovers.records_dir(local) / "torn.json"] is None
    leftovers.unregister(local, "cabc12")
    assert list(leftovers.read_records(local)) == [leftovers.records_dir(local) / "torn.json"]


def test_with_the_cluster_stopped_a_stale_record_goes_with_its_kwok_and_node_trees(tmp_path: Path) -> None:
    local = LocalCluster(tmp_path / "cluster")
    kwok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    root = tmp_path / "cdsleft"
    (root / "node-0").mkdir(parents=True)
    # A pod's process: its kubeconfig below the simulation's root, in a session of its own.
    pod = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                           env={**os.environ, "KUBECONFIG": str(root / "pods" / "p" / "kubeconfig")})  # fmt: skip
    not_ours = tmp_path / "elsewhere"
    not_ours.mkdir()
    pid, start = dead_pid()
    leftovers.register(local, record(id="a", pid=pid, start=start, kwok_pid=kwok.pid,
                                     kwok_start=leftovers.start_time(kwok.pid), root=str(root)))  # fmt: skip
    leftovers.register(local, record(id="b", pid=pid, start=start, root=str(not_ours)))
    leftovers.register(local, record(id="live", root=str(tmp_path / "cdslive")))
    try:
        done = leftovers.reclaim(local, cluster_running=False)
        assert sorted(r.id for r in done) == ["a", "b"]
        assert kwok.wait(timeout=15) != 0
        assert pod.wait(timeout=15) == -9
        assert leftovers.processes_of(root) == []
        assert not root.exists()
        assert not_ours.exists()  # only the simulation's own temporary trees are removed
        assert [p.name for p in leftovers.read_records(local)] == ["live.json"]
    finally:
        kwok.kill()
        pod.kill()


def test_a_killed_sessions_own_kwok_is_stopped_and_nothing_else_is_touched(tmp_path: Path) -> None:
    local = LocalCluster(tmp_path / "cluster")
    kwok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    pid, start = dead_pid()
    leftovers.register(local, SimRecord(id="standin", release="", driver_ns="", workload_ns="", nodes=[], root="",
                                        pid=pid, start=start, kwok_pid=kwok.pid,
                                        kwok_start=leftovers.start_time(kwok.pid)))  # fmt: skip
    try:
        # With the cluster running: a record that names no release, namespace or node asks nothing of it.
        done = leftovers.reclaim(local, cluster_running=True)
        assert [r.summary() for r in done] == ["its kwok"]
        assert kwok.wait(timeout=15) != 0
        assert bystander.poll() is None  # an empty root names no process
        assert list(leftovers.read_records(local)) == []
    finally:
        kwok.kill()
        bystander.kill()


def test_the_summary_names_the_release_nodes_and_namespaces() -> None:
    assert record().summary() == "release cd in cd-system, 2 nodes, namespaces cd-system and workloads"
    assert record(workload_ns="cd-system").summary() == "release cd in cd-system, 2 nodes, namespace cd-system"


def crd(name: str, *managers: str, release: str | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "managedFields": [{"manager": m} for m in managers]}
    if release:
        meta["annotations"] = {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": "cd-system"}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": meta}


def test_install_base_names_what_others_wrote_and_is_quiet_about_its_own() -> None:
    assert takeover_line([crd("computedomains.resource.nvidia.com", FIELD_MANAGER)]) is None
    assert takeover_line([]) is None
    line = takeover_line([
        crd("computedomains.resource.nvidia.com", "helm", "crds.py", FIELD_MANAGER),
        crd("computedomaincliques.resource.nvidia.com", FIELD_MANAGER),
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
         "metadata": {"name": "compute-domain-default-channel.nvidia.com", "managedFields": [{"manager": "helm"}],
                      "annotations": {"meta.helm.sh/release-name": "cd", "meta.helm.sh/release-namespace": "cd-system"}}},
    ])  # fmt: skip
    assert line == (
        "took over what others wrote before this run: CustomResourceDefinition computedomains.resource.nvidia.com "
        "(crds.py, helm); DeviceClass compute-domain-default-channel.nvidia.com (helm, release cd in cd-system)"
    )
    assert "\n" not in line


def test_object_names_are_the_ones_kubectl_prints() -> None:
    assert _object_name(json.loads(json.dumps(crd("x.resource.nvidia.com")))) == (
        "customresourcedefinition.apiextensions.k8s.io/x.resource.nvidia.com"
    )
    assert _object_name({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n"}}) == "namespace/n"


def test_real_nodes_of_a_gone_owner_are_orphaned_and_those_without_one_are_the_users() -> None:
    pid, start = dead_pid()
    killed = State(id="r1", owner=Proc(pid, start))
    assert State.from_json(killed.to_json()) == killed
    assert State.from_json(killed.to_json()).orphaned()
    assert not State(id="r2", owner=Proc.of(os.getpid())).orphaned()
    assert not State.from_json(State(id="r3").to_json()).orphaned()  # `realnode up`: until `down`
    legacy = json.loads(State(id="r4").to_json())
    del legacy["owner"]
    assert not State.from_json(json.dumps(legacy)).orphaned()
