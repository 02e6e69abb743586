"""Compute-domain daemons as real processes against the real apiserver, one simulated node each.

Each ``DaemonNode`` is a kwok Node, a real Pod bound to it (kwok marks it Running, so ownerReferences, the
pod label patch and the pod watch are real), and ``python -m imex daemon run`` with the pod's identity in
its env, its own loopback IP (``127.a.b.c`` as POD_IP), its own ``/imexd`` directory and hosts file, and
either the IMEX simulator or a do-nothing stand-in as ``nvidia-imex``. The daemon runs in a session of its
own, so ``kill()`` takes it and its IMEX child down together, as a container's death would.

``ProbeKubelet`` plays the kubelet's readiness probe: it runs the daemon's ``check`` code with each pod's
settings and writes the pod's Ready condition when the result changes. The daemons only learn about it
through their pod watch, as in a real cluster.

Every wait has a generous deadline that only guards against hangs; no assertion depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.settings import load_settings
from imex.daemon.check import check
from imex.daemon.settings import DaemonSettings
from tests.conftest import REPO, Cluster
from tests.testbed.imex_simulator.ctl import query_status
from tests.testbed.nodes import gb200_node

GUARD_S = 120.0


def wait_until(
    what: str, predicate: Callable[[], bool], timeout_s: float = GUARD_S, on_fail: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}\n{on_fail()}")
        time.sleep(0.1)


FAKE_IMEX = """#!/bin/sh
# Stand-in for nvidia-imex where only registration matters: ignores SIGUSR1, dies on SIGTERM.
trap '' USR1
exec sleep 100000
"""


@dataclass
class DaemonNode:
    node: str
    clique: str
    ip: str
    dir: Path
    env: dict[str, str]
    pod: str = ""
    uid: str = ""
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def hosts(self) -> Path:
        return self.dir / "hosts"

    @property
    def fault_file(self) -> Path:
        return self.dir / "faults"

    @property
    def log_path(self) -> Path:
        return self.dir / "daemon.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def daemon_env(self) -> dict[str, str]:
        return {
            **self.env,
            "NODE_NAME": self.node,
            "POD_NAME": self.pod,
            "POD_UID": self.uid,
            "POD_IP": self.ip,
            "CLIQUE_ID": self.clique,
            "IMEXD_DIR": str(self.dir / "imexd"),
            "HOSTS_FILE": str(self.hosts),
            "IMEX_SIM_HOSTS_FILE": str(self.hosts),
            "IMEX_SIM_FAULT_FILE": str(self.fault_file),
        }

    def settings(self) -> DaemonSettings:
        return load_settings(DaemonSettings, environ=self.daemon_env())

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.node}: already running"
        self.hosts.touch()
        with self.log_path.open("ab") as log:
            log.write(f"==== start {self.starts} ip={self.ip} pod={self.pod}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "imex", "daemon", "run"],
                env={**os.environ, **self.daemon_env()},
                stdout=log,
                stderr=log,
                cwd=REPO,
                start_new_session=True,
            )
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL the daemon and its IMEX child: no cleanup runs (a crashed container)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.exit_codes.append(self.proc.wait())

    def terminate(self, timeout_s: float = GUARD_S) -> int:
        """SIGTERM to the daemon only, as the kubelet sends it; the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout_s)
        self.exit_codes.append(code)
        return code

    def stop_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def sim_status(self) -> dict[str, Any] | None:
        try:
            return query_status((self.ip, 50005), 5)
        except Exception:
            return None


class Domain:
    """One ComputeDomain's daemons in the test namespace (the driver namespace stand-in)."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        root: Path,
        *,
        imex: str,
        env: dict[str, str] | None = None,
        cd_uid: str | None = None,
    ) -> None:
        # With a real IMEX (simulator) a ProbeKubelet decides readiness: new pods start NotReady, as they
        # would under a kubelet whose readiness probe has not passed yet (kwok marks them Ready at once).
        self.probed = imex == "simulator"
        self.cluster = cluster
        self.namespace = namespace
        self.root = root
        self.cd_uid = cd_uid or str(uuid.uuid4())
        self.net = f"127.{random.randint(20, 250)}.{random.randint(1, 250)}"
        self.nodes: list[DaemonNode] = []
        self._node_names: list[str] = []
        self._next_ip = 1
        bin_dir = root / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        if imex == "simulator":
            from tests.testbed.imex_simulator.wrappers import install_wrappers

            wrappers = install_wrappers(bin_dir)
            imex_bin, ctl_bin = str(wrappers["nvidia-imex"]), str(wrappers["nvidia-imex-ctl"])
        else:
            fake = bin_dir / "fake-imex"
            fake.write_text(FAKE_IMEX)
            fake.chmod(0o755)
            imex_bin, ctl_bin = str(fake), "/bin/false"
        self.env = {
            "KUBECONFIG": str(cluster.kubeconfig),
            "POD_NAMESPACE": namespace,
            "COMPUTE_DOMAIN_UUID": self.cd_uid,
            "COMPUTE_DOMAIN_NAME": "cd",
            "COMPUTE_DOMAIN_NAMESPACE": namespace,
            "MAX_NODES_PER_IMEX_DOMAIN": "18",
            "IMEX_BINARY": imex_bin,
            "IMEX_CTL_BINARY": ctl_bin,
            "LOG_LEVEL": "info",
            "KUBE_API_QPS": "50",
            "KUBE_API_BURST": "100",
            **(env or {}),
        }

    def new_ip(self) -> str:
        ip = f"{self.net}.{self._next_ip}"
        self._next_ip += 1
        return ip

    def add(self, specs: list[tuple[str, str]]) -> list[DaemonNode]:
        """Nodes (name, clique) with one daemon pod each; nothing started yet."""
        prefix = uuid.uuid4().hex[:6]
        made = []
        for name, clique in specs:
            node_name = f"{prefix}-{name}"
            d = self.root / node_name
            d.mkdir()
            made.append(DaemonNode(node=node_name, clique=clique, ip=self.new_ip(), dir=d, env=dict(self.env)))
        self.cluster.apply([gb200_node(n.node, clique=n.clique or None) for n in made])
        self._node_names += [n.node for n in made]
        self.create_pods(made)
        self.nodes += made
        return made

    def create_pods(self, nodes: list[DaemonNode]) -> None:
        pods = []
        for n in nodes:
            n.pod = f"cd-daemon-{n.node}-{uuid.uuid4().hex[:4]}"
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": n.pod, "labels": {COMPUTE_DOMAIN_LABEL: self.cd_uid}},
                    "spec": {
                        "nodeName": n.node,
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [{"name": "compute-domain-daemon", "image": "compute-domain-daemon:test"}],
                    },
                }
            )
        self.cluster.apply(pods, self.namespace)
        names = {n.pod for n in nodes}
        # kwok sets phase Running and Ready=True once; start daemons (and the probe) only after that, so the
        # probe's first write is not overwritten.
        wait_until(
            "daemon pods Running",
            lambda: (
                all(p["status"].get("phase") == "Running" for p in self.pods() if p["metadata"]["name"] in names)
                and names <= {p["metadata"]["name"] for p in self.pods()}
            ),
        )
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.pods()}
        for n in nodes:
            n.uid = uids[n.pod]
            if self.probed:
                self.set_ready(n, False)

    def set_ready(self, n: DaemonNode, ready: bool) -> None:
        patch = {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        self.cluster.kubectl(
            "patch",
            "pod",
            n.pod,
            "-n",
            self.namespace,
            "--subresource=status",
            "--type=strategic",
            "-p",
            json.dumps(patch),
        )

    def replace_pod(self, n: DaemonNode, new_ip: str) -> None:
        """The pod is deleted and a new one lands on the same node with another IP (a rescheduled pod)."""
        self.cluster.kubectl("delete", "pod", n.pod, "-n", self.namespace, "--wait=false")
        n.ip = new_ip
        self.create_pods([n])

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(
            self.cluster.kubectl("get", "pods", "-n", self.namespace, "-o", "json")
        )["items"]
        return items

    def pod(self, n: DaemonNode) -> dict[str, Any]:
        return self.cluster.get("pod", n.pod, self.namespace)

    def clique(self, clique: str) -> dict[str, Any] | None:
        code, out = self.cluster.try_kubectl(
            "get", "computedomaincliques", f"{self.cd_uid}.{clique}", "-n", self.namespace, "-o", "json"
        )
        if code != 0:
            assert "NotFound" in out, out
            return None
        result: dict[str, Any] = json.loads(out)
        return result

    def entries(self, clique: str) -> dict[str, dict[str, Any]]:
        obj = self.clique(clique)
        return {} if obj is None else {d["nodeName"]: d for d in obj.get("daemons") or []}

    def logs(self, nodes: list[DaemonNode] | None = None) -> str:
        return "\n".join(f"----- {n.node} ({n.ip})\n{n.log()[-4000:]}" for n in (nodes or self.nodes))

    def cleanup(self) -> None:
        for n in self.nodes:
            n.stop_all()
        if self._node_names:
            self.cluster.kubectl("delete", "node", *self._node_names, "--wait=false", check=False)


class ProbeKubelet:
    """Runs each daemon's readiness check every ``period_s`` and writes its pod's Ready condition on change."""

    def __init__(self, domain: Domain, nodes: list[DaemonNode], period_s: float = 1.0) -> None:
        self.domain = domain
        self.nodes = nodes
        self.period_s = period_s
        self.last: dict[str, bool] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe-kubelet", daemon=True)

    def __enter__(self) -> ProbeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            for n in list(self.nodes):
                if n.proc is None or not n.uid:
                    continue
                try:
                    result = asyncio.run(check(n.settings()))
                    key = n.pod
                    if self.last.get(key) != result.ready:
                        self.domain.set_ready(n, result.ready)
                        self.last[key] = result.ready
                except Exception as exc:  # keep probing; the test reports these
                    # A pod the test just replaced (new pod, new IP) is gone before the probe notices.
                    if "NotFound" not in repr(exc):
                        self.errors.append(f"{n.node}: {exc!r}")
            self._stop.wait(self.period_s)
