"""What a killed run left on a reused cluster, and taking it back.

Every simulated cluster (`make demo`, the system tests, the benchmarks: `tests.testbed.sim.SimCluster`)
records what it is about to create in `<cluster root>/sims/<id>.json` and removes the record after its own
cleanup. A record whose owner process is gone is what a killed run left: when the next command reuses the
cluster, `reclaim` removes what the record names (the kwok of its own and the pods' processes that outlived
the run, the release uninstalled without
hooks, ComputeDomains and cliques no controller finalizes any more, pods, nodes, their ResourceSlices,
the namespaces, the node trees) and prints one line saying so. A record of a live process is left alone:
parallel runs share the cluster. When the cluster itself is stopped, only the processes and files remain
to remove.

A process of a test session that only runs a kwok of its own (the node agent tests' stand-in kwok) records
just that: a record with no release, namespaces, nodes or root.

Real nodes keep a record of their own (`tests.testbed.realnode.nodes`, taken down by their next `up`), and
the CRDs and DeviceClasses are taken over by `LocalCluster.install_base` whoever wrote them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.testbed.cluster import LocalCluster

# What a killed run may leave holding up a namespace's deletion: finalizers nobody removes any more.
# What a dead run's processes would have released: the controller's finalizers, and the simulated container
# runtime's on its pods (without it a forced pod delete waits for ever).
FINALIZED_KINDS = ("computedomains.resource.nvidia.com", "computedomaincliques.resource.nvidia.com", "pods")


def start_time(pid: int) -> int | None:
    """The kernel's start time of a process (field 22 of /proc/PID/stat): with the PID, its identity."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int | None, start: int | None) -> bool:
    return pid is not None and start is not None and start_time(pid) == start


@dataclass
class SimRecord:
    """What one simulated cluster creates on the control plane and the machine."""

    id: str
    release: str
    driver_ns: str
    workload_ns: str
    nodes: list[str]
    root: str
    pid: int = field(default_factory=os.getpid)
    start: int | None = field(default_factory=lambda: start_time(os.getpid()))
    kwok_pid: int | None = None
    kwok_start: int | None = None

    @classmethod
    def load(cls, path: Path) -> SimRecord | None:
        """The record in `path`, or None for one that is unreadable (a run killed while writing it)."""
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    def namespaces(self) -> list[str]:
        return sorted({ns for ns in (self.driver_ns, self.workload_ns) if ns})

    def owner_alive(self) -> bool:
        return alive(self.pid, self.start)

    def summary(self) -> str:
        names = self.namespaces()
        if not names:
            return "its kwok" if self.kwok_pid else "nothing"
        return (
            f"release {self.release} in {self.driver_ns}, {len(self.nodes)} nodes, "
            f"namespace{'s' if len(names) > 1 else ''} {' and '.join(names)}"
        )


def records_dir(local: LocalCluster) -> Path:
    return local.root / "sims"


def register(local: LocalCluster, record: SimRecord) -> None:
    """Write (or rewrite) `record` before what it names is created."""
    directory = records_dir(local)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{record.id}.json"
    tmp.write_text(json.dumps(asdict(record)))
    tmp.replace(directory / f"{record.id}.json")


def unregister(local: LocalCluster, record_id: str) -> None:
    (records_dir(local) / f"{record_id}.json").unlink(missing_ok=True)


def stale(records: dict[Path, SimRecord | None]) -> dict[Path, SimRecord | None]:
    """The records a killed run left: unreadable ones, and those whose owner process is gone."""
    return {path: r for path, r in records.items() if r is None or not r.owner_alive()}


def read_records(local: LocalCluster) -> dict[Path, SimRecord | None]:
    return {path: SimRecord.load(path) for path in sorted(records_dir(local).glob("*.json"))}


def reclaim(local: LocalCluster, *, cluster_running: bool = True) -> list[SimRecord]:
    """Remove what killed runs left (see the module docstring); one line per run. Returns their records."""
    from tests.testbed.cluster import log

    done = []
    for path, record in stale(read_records(local)).items():
        if record is not None:
            _stop_process(record.kwok_pid, record.kwok_start)
            if record.root:  # an empty root would name every process of the machine
                for pid in processes_of(Path(record.root)):
                    _stop_group(pid)
                _remove_tree(Path(record.root))
            if cluster_running:
                _remove_objects(local, record)
                log(f"removed what a killed run (pid {record.pid}) left on the cluster: {record.summary()}")
            done.append(record)
        path.unlink(missing_ok=True)
    return done


def processes_of(root: Path) -> list[int]:
    """The processes a simulated cluster started that outlived it: every pod's process has its kubeconfig
    (and logs, node directories) below the simulation's root, in its environment or arguments."""
    marker = f"{root}/".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (proc / "environ").read_bytes() or marker in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
    return found


def _stop_group(pid: int) -> None:
    """The process and its process group (each pod's process leads one, with what it started)."""
    with contextlib.suppress(OSError):
        group = os.getpgid(pid)
        if group != os.getpgid(0):
            os.killpg(group, signal.SIGKILL)
            return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _stop_process(pid: int | None, start: int | None, grace: float = 10.0) -> None:
    if pid is None or not alive(pid, start):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and alive(pid, start):
        time.sleep(0.1)
    if alive(pid, start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove_objects(local: LocalCluster, record: SimRecord) -> None:
    namespaces = record.namespaces()
    if record.release:
        # Without hooks: the hooks' Jobs would need the simulated nodes' pod runner, gone with the run.
        subprocess.run(
            [str(local.root / "bin" / "helm"), f"--kubeconfig={local.kubeconfig}", "uninstall", record.release,
             "--namespace", record.driver_ns, "--no-hooks", "--ignore-not-found"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    for ns in namespaces:
        for kind in FINALIZED_KINDS:
            names = local.kubectl("get", kind, "-n", ns, "-o", "name", check=False).stdout.split()
            for name in names:
                local.kubectl("patch", name, "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                              check=False)  # fmt: skip
        local.kubectl("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", check=False)
    if record.nodes:
        local.kubectl("delete", "nodes", *record.nodes, "--ignore-not-found", "--wait=false", check=False)
        listed = local.kubectl("get", "resourceslices", "-o", "json", check=False)
        with contextlib.suppress(ValueError):
            nodes = set(record.nodes)
            slices = [
                s["metadata"]["name"]
                for s in json.loads(listed.stdout or "{}").get("items", ())
                if s.get("spec", {}).get("nodeName") in nodes
            ]
            if slices:
                local.kubectl("delete", "resourceslices", *slices, "--ignore-not-found", check=False)
    if namespaces:
        # Waited for: a next run of the same names (the demo's) creates these namespaces again.
        local.kubectl("delete", "namespaces", *namespaces, "--ignore-not-found", "--wait=true", "--timeout=120s",
                      check=False)  # fmt: skip


def _remove_tree(root: Path) -> None:
    """A simulated cluster's node trees (`cds*` temporary directories, nothing else); not while anything is
    mounted below them (host IMEX bind mounts)."""
    if not root.name.startswith("cds") or not root.is_dir():
        return
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = Path(line.split()[4])
            if point == root or root in point.parents:
                return
    shutil.rmtree(root, ignore_errors=True)
