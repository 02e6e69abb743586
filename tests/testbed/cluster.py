"""The local Kubernetes control plane of the test bed: real etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok, built from the Go module proxy by `testbin/build.sh`, all on 127.0.0.1.

    python -m tests.testbed.cluster up      start (or reuse) the cluster under .cluster/
    python -m tests.testbed.cluster down    stop it
    python -m tests.testbed.cluster status  say whether it runs

What `up` lays out under `.cluster/`:
  pki/          a CA, the apiserver's serving certificate, client certificates per component, the
                service-account signing key (openssl; RBAC is on, so identities matter)
  kubeconfig    the admin kubeconfig (system:masters); one kubeconfig per component beside it
  bin/          links to kubectl and helm
  logs/         one log per component
  state.json    ports and process ids, so `down` and the next `up` find the processes

kwok manages only nodes annotated `kwok.x-k8s.io/node=fake`: it keeps them Ready through node leases and
moves pods bound to them to Running, and lets deleted pods go. Processes run in their own sessions, so a
cluster started by `make cluster-up` outlives the command and is reused by later test runs.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.testbed import leftovers

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO / ".cluster"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_STAGES = Path(__file__).with_name("kwok-stages.yaml")
BASE_MANIFESTS = REPO / "manifests"
START_TIMEOUT = 180.0
# The field manager of what the test bed applies (server-side).
FIELD_MANAGER = "computedomain-testbed"
# Bumped when the components' flags change, so a running cluster started with older flags is replaced.
CONFIG_GENERATION = 2
EGRESS_SELECTOR = """apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: {socket}
"""


def log(message: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_binaries(target: str = "all") -> Path:
    """Build what `target` of testbin/build.sh lacks (`control-plane` or `all`; idempotent, cached by version)
    and return the bin directory."""
    argv = [str(REPO / "testbin" / "build.sh"), target]
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


#: starts of the control plane on fresh ports when one was taken meanwhile (see ``LocalCluster._up``)
PORT_TRIES = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """A CA, the apiserver serving cert and one client cert per identity. Idempotent."""
    if (pki / "done").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=computedomain-testbed-ca", cwd=pki)  # fmt: skip
    leaves = {
        "apiserver": ("/CN=kube-apiserver", "serverAuth",
                      "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                      "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1"),
        "admin": ("/O=system:masters/CN=testbed-admin", "clientAuth", ""),
        "controller-manager": ("/CN=system:kube-controller-manager", "clientAuth", ""),
        "scheduler": ("/CN=system:kube-scheduler", "clientAuth", ""),
        "kwok": ("/O=system:masters/CN=kwok-controller", "clientAuth", ""),
        "apiserver-kubelet-client": ("/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth", ""),
    }  # fmt: skip
    for name, (subject, usage, san) in leaves.items():
        ext = pki / f"{name}.ext"
        ext.write_text(f"extendedKeyUsage={usage}\nkeyUsage=digitalSignature,keyEncipherment\n{san}\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "3650", "-extfile", ext.name, cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    (pki / "done").write_text("ok\n")


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    def data(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {"server": server, "certificate-authority-data": data("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": data(f"{user}.crt"),
                                          "client-key-data": data(f"{user}.key")}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": user}}],
        "current-context": "testbed",
    }  # fmt: skip
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


@dataclass
class Component:
    name: str
    argv: list[str]
    health_url: str | None


class LocalCluster:
    def __init__(self, root: Path = DEFAULT_ROOT, *, priority_and_fairness: bool = False) -> None:
        """`priority_and_fairness`: the apiserver with API Priority and Fairness on, as production clusters run
        it (429 with Retry-After when a priority level's queues are full). Off by default, as the test bed always
        ran: its tests and benchmarks are its only tenant."""
        self.root = root
        self.priority_and_fairness = priority_and_fairness
        self.pki = root / "pki"
        self.logs = root / "logs"
        self.state_file = root / "state.json"
        self.kubeconfig = root / "kubeconfig"
        self.egress_config = root / "egress-selector.yaml"
        # Where the real nodes' egress proxy listens while they run (tests/testbed/realnode/netd.py).
        self.egress_socket = root / "egress.sock"

    # --- state ---------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        return state

    @property
    def server(self) -> str:
        state = self.state()
        if state is None:
            raise RuntimeError("the cluster is not running; run `make cluster-up`")
        return f"https://127.0.0.1:{state['ports']['apiserver']}"

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _get(self, url: str, timeout: float = 2.0, verify: bool = True) -> tuple[int, str]:
        # The controller-manager and the scheduler serve self-signed certificates of their own; only the
        # apiserver's is ours to verify.
        ctx = self._ssl_context() if verify else ssl._create_unverified_context()
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (OSError, ssl.SSLError) as exc:
            return 0, str(exc)

    def healthy(self, patience: float = 30.0) -> bool:
        """A started cluster whose processes all live and whose apiserver answers /readyz.

        A loaded machine can make /readyz slow; tearing down a cluster other test runs share because of
        one slow answer would be worse than waiting, so a live cluster gets `patience` seconds."""
        state = self.state()
        if state is None or not state.get("ready") or not all(_alive(pid) for pid in state["pids"].values()):
            return False
        if state.get("generation", 1) != CONFIG_GENERATION:
            return False
        if state.get("priority_and_fairness", False) != self.priority_and_fairness:
            return False
        deadline = time.monotonic() + patience
        while True:
            if self._get(f"{self.server}/readyz", timeout=5.0)[0] == 200:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)

    # --- lifecycle -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Serializes up/down across processes: parallel test runs share one cluster."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def up(self) -> bool:
        """Start the cluster unless a healthy one runs. Returns True when this call started it."""
        with self._lock():
            return self._up()

    def _up(self, port_tries: int = PORT_TRIES) -> bool:
        start = time.monotonic()
        bin_dir = build_binaries("control-plane")
        if self.healthy():
            self._link_tools(bin_dir)
            log(f"reusing the running cluster ({self.server})")
            leftovers.reclaim(self)
            if (self.root / "realnodes" / "state.json").exists():
                from tests.testbed.realnode.nodes import RealNodes

                RealNodes(self).reclaim()
            return False
        self._down(quiet=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        make_pki(self.pki)
        self.egress_config.write_text(EGRESS_SELECTOR.format(socket=self.egress_socket))
        ports = {name: free_port() for name in
                 ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok")}  # fmt: skip
        server = f"https://127.0.0.1:{ports['apiserver']}"
        for user in ("admin", "controller-manager", "scheduler", "kwok"):
            target = self.kubeconfig if user == "admin" else self.root / f"{user}.kubeconfig"
            write_kubeconfig(target, server, self.pki, user)
        self._link_tools(bin_dir)
        pids: dict[str, int] = {}
        self.state_file.write_text(json.dumps({"ports": ports, "pids": pids, "bin": str(bin_dir)}))
        try:
            for component in self._components(bin_dir, ports):
                pids[component.name] = self._spawn(component)
                self.state_file.write_text(json.dumps({"ports": ports, "pids": pids, "bin": str(bin_dir)}))
                if component.health_url:
                    self._wait_healthy(component)
            self._wait_ready()
        except BaseException as exc:
            self._down(quiet=True)
            # A port found free was taken before its component bound it (any process's outgoing connection
            # may get it from the ephemeral range): start again on other ports.
            if isinstance(exc, RuntimeError) and "address already in use" in str(exc) and port_tries > 1:
                first = str(exc).splitlines()[0].rstrip(":")
                log(f"a port was taken before the control plane bound it ({first}); starting again on other ports")
                return self._up(port_tries - 1)
            raise
        self.state_file.write_text(json.dumps({"ports": ports, "pids": pids, "bin": str(bin_dir), "ready": True,
                                               "generation": CONFIG_GENERATION,
                                               "priority_and_fairness": self.priority_and_fairness}))  # fmt: skip
        log(f"cluster up in {time.monotonic() - start:.1f}s: {server}")
        return True

    def _components(self, bin_dir: Path, ports: dict[str, int]) -> list[Component]:
        pki, root = self.pki, self.root
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
        return [
            Component("etcd", [
                str(bin_dir / "etcd"), "--name=testbed", f"--data-dir={root / 'etcd'}",
                f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=testbed={peer_url}", "--unsafe-no-fsync",
                "--quota-backend-bytes=4294967296", "--log-level=warn",
            ], None),
            Component("kube-apiserver", [
                str(bin_dir / "kube-apiserver"), f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16", "--authorization-mode=Node,RBAC",
                # Real nodes (tests/testbed/realnode) join with node certificates: the Node authorizer and
                # NodeRestriction judge their kubelets. The apiserver reaches a kubelet at its InternalIP
                # through the real nodes' egress proxy (their network namespaces are not the host's).
                "--enable-admission-plugins=NodeRestriction",
                "--kubelet-preferred-address-types=InternalIP",
                f"--egress-selector-config-file={self.egress_config}",
                # The apiserver listens on loopback only, which the kubernetes Endpoints may not contain.
                "--endpoint-reconciler-type=none",
                # ConfigMaps bypass the watch cache, so tests can make a resourceVersion expire for real
                # (compact etcd -> 410 Gone); nothing of this service watches ConfigMaps.
                "--watch-cache-sizes=configmaps#0",
                # The DRA beta versions, as clusters that ran DRA before v1 still serve them: the admission
                # policies must judge a claim or slice sent in any served version.
                "--runtime-config=resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true",
                "--allow-privileged=true", f"--enable-priority-and-fairness={str(self.priority_and_fairness).lower()}",
                "--v=1",
            ], f"https://127.0.0.1:{ports['apiserver']}/readyz"),
            Component("kube-controller-manager", [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={root / 'controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={root / 'controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={root / 'controller-manager.kubeconfig'}",
                "--bind-address=127.0.0.1", f"--secure-port={ports['controller_manager']}",
                "--leader-elect=false", "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
                "--concurrent-daemonset-syncs=5", "--kube-api-qps=200", "--kube-api-burst=400", "--v=1",
            ], f"https://127.0.0.1:{ports['controller_manager']}/healthz"),
            Component("kube-scheduler", [
                str(bin_dir / "kube-scheduler"), f"--kubeconfig={root / 'scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={root / 'scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={root / 'scheduler.kubeconfig'}",
                "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}", "--leader-elect=false",
                "--v=1",
            ], f"https://127.0.0.1:{ports['scheduler']}/healthz"),
            Component("kwok", [
                str(bin_dir / "kwok"), f"--kubeconfig={root / 'kwok.kubeconfig'}", f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--cidr=10.244.0.1/16", "--node-ip=10.0.0.1",
                f"--server-address=127.0.0.1:{ports['kwok']}",
            ], f"http://127.0.0.1:{ports['kwok']}/healthz"),
        ]  # fmt: skip

    def _spawn(self, component: Component) -> int:
        logfile = (self.logs / f"{component.name}.log").open("ab")
        proc = subprocess.Popen(
            component.argv,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.root,
        )
        log(f"started {component.name} (pid {proc.pid})")
        return proc.pid

    def _wait_healthy(self, component: Component) -> None:
        assert component.health_url
        deadline = time.monotonic() + START_TIMEOUT
        status, body = 0, ""
        while time.monotonic() < deadline:
            state = self.state() or {}
            pid = state.get("pids", {}).get(component.name)
            if pid is None or not _alive(pid):
                raise RuntimeError(f"{component.name} exited during start; see {self.logs / component.name}.log:\n"
                                   + self.log_tail(component.name))  # fmt: skip
            status, body = self._get(component.health_url, verify=component.name == "kube-apiserver")
            if status == 200:
                return
            time.sleep(0.25)
        raise RuntimeError(f"{component.name} not healthy after {START_TIMEOUT:.0f}s ({status}: {body[:300]})")

    def _wait_ready(self) -> None:
        """The default ServiceAccount exists once the controller-manager works; pods need it."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._get(f"{self.server}/api/v1/namespaces/default/serviceaccounts/default")[0] == 200:
                return
            time.sleep(0.25)
        raise RuntimeError("the controller-manager created no default ServiceAccount in time")

    def _link_tools(self, bin_dir: Path) -> None:
        links = self.root / "bin"
        links.mkdir(exist_ok=True)
        for tool in ("kubectl", "helm"):
            link = links / tool
            link.unlink(missing_ok=True)
            link.symlink_to(bin_dir / tool)

    def down(self, quiet: bool = False) -> None:
        with self._lock():
            self._down(quiet)

    def _down(self, quiet: bool = False) -> None:
        if (self.root / "realnodes" / "state.json").exists():
            # Real nodes (tests/testbed/realnode) hold namespaces, mounts and cgroups: gone before the cluster.
            from tests.testbed.realnode.nodes import RealNodes

            RealNodes(self).down()
        # Simulated clusters of killed runs: their kwok processes and node trees (the objects go with etcd).
        leftovers.reclaim(self, cluster_running=False)
        state = self.state()
        if state is None:
            if not quiet:
                log("no cluster state; nothing to stop")
            return
        # Reverse start order, so nothing reconnects to a stopped apiserver for long.
        for name, pid in reversed(list(state["pids"].items())):
            _terminate(pid)
            if not quiet:
                log(f"stopped {name}")
        self.state_file.unlink(missing_ok=True)
        shutil.rmtree(self.root / "etcd", ignore_errors=True)

    def log_tail(self, component: str, lines: int = 30) -> str:
        try:
            text = (self.logs / f"{component}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def memory_mib(self) -> dict[str, float]:
        """Resident memory per component, from /proc."""
        out: dict[str, float] = {}
        for name, pid in (self.state() or {"pids": {}})["pids"].items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) / 1024
        return out

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """kubectl against this cluster; one that has not returned after `timeout` seconds (a `delete --wait`
        of an object no one finalizes waits for good) is killed and raises `subprocess.TimeoutExpired`."""
        result = subprocess.run(
            [str(self.root / "bin" / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=False,
            input=input,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise KubectlError(args, result.returncode, result.stderr)
        return result

    # --- what this service's tests and benchmarks install -----------------------------------------

    def install_base(self) -> list[str]:
        """The CRDs and DeviceClasses every test and benchmark of this service needs (idempotent).

        Returns the objects (`kind/name`) that were absent, so a caller can remove exactly what it added."""
        manifests = [f"-f={m}" for m in (BASE_MANIFESTS / "crds", BASE_MANIFESTS / "deviceclasses")]
        wanted = self.kubectl("create", "--dry-run=client", "-o", "name", *manifests).stdout.split()
        listed = json.loads(
            self.kubectl("get", "--ignore-not-found", "--show-managed-fields", "-o", "json", *wanted).stdout or "{}"
        )
        present = listed.get("items", []) if "items" in listed else [listed] if listed else []
        absent = sorted(set(wanted) - {_object_name(o) for o in present})
        # Server-side apply, taking over the fields whoever wrote them (`helm install`'s crds/, the chart's CRD
        # hook, a release's DeviceClasses): client-side apply refuses objects it did not write itself.
        self.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}", *manifests)
        taken = takeover_line(present)
        if taken:
            log(taken)
        crds = [f"crd/{plural}.resource.nvidia.com" for plural in ("computedomains", "computedomaincliques")]
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
        return absent

    def remove_base(self, objects: list[str]) -> None:
        """Remove what `install_base` added (CRDs take their remaining custom resources with them)."""
        if objects:
            self.kubectl("delete", "--ignore-not-found", "--wait=true", "--timeout=120s", *objects)

    def create_namespace(self, name: str) -> None:
        """A namespace with its default ServiceAccount (pods need it; the controller-manager adds it)."""
        self.kubectl("create", "namespace", name)
        self.kubectl("wait", "--for=create", "--timeout=60s", "serviceaccount/default", "-n", name)

    def delete_namespace(self, name: str, *, wait: bool = False) -> None:
        self.kubectl("delete", "namespace", name, "--ignore-not-found", f"--wait={str(wait).lower()}", "--timeout=120s")


def _object_name(obj: dict[str, Any]) -> str:
    """`kind.group/name`, as `kubectl -o name` prints it."""
    group = obj.get("apiVersion", "").rpartition("/")[0]
    kind = obj.get("kind", "").lower()
    return f"{kind}.{group}/{obj['metadata']['name']}" if group else f"{kind}/{obj['metadata']['name']}"


def takeover_line(objects: Any) -> str | None:
    """One line naming the objects `install_base` took over and who had written them (their field managers
    and Helm release), or None when the test bed wrote them all itself."""
    taken = []
    for obj in objects:
        meta = obj.get("metadata", {})
        writers = sorted({m.get("manager", "?") for m in meta.get("managedFields") or ()} - {FIELD_MANAGER})
        if not writers:
            continue
        release = (meta.get("annotations") or {}).get("meta.helm.sh/release-name")
        if release:
            writers.append(f"release {release} in {meta['annotations'].get('meta.helm.sh/release-namespace', '?')}")
        taken.append(f"{obj.get('kind', '?')} {meta.get('name', '?')} ({', '.join(writers)})")
    if not taken:
        return None
    return f"took over what others wrote before this run: {'; '.join(taken)}"


class KubectlError(RuntimeError):
    """A kubectl call failed; the message is one line naming the command and kubectl's own complaint."""

    def __init__(self, args: tuple[str, ...], code: int, stderr: str) -> None:
        self.returncode = code
        self.stderr = stderr
        shown = " ".join(a for a in args if not a.startswith("-f="))[:120]
        reason = " ".join(stderr.split())[:300] or f"exit code {code}"
        super().__init__(f"kubectl {shown}: {reason}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def _terminate(pid: int, grace: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_cluster(root: Path = DEFAULT_ROOT, *, priority_and_fairness: bool = False) -> Iterator[LocalCluster]:
    """A running cluster for the duration of the block; stopped afterwards only if this block started it."""
    cluster = LocalCluster(root, priority_and_fairness=priority_and_fairness)
    started = cluster.up()
    try:
        yield cluster
    finally:
        if started:
            cluster.down()


def main(argv: list[str]) -> int:
    cluster = LocalCluster()
    command = argv[0] if argv else "status"
    if command == "up":
        cluster.up()
        bin_dir = cluster.root / "bin"
        print(
            f"\nThe cluster runs at {cluster.server}.\nUse it with:\n"
            f"  export KUBECONFIG={cluster.kubeconfig.relative_to(REPO)} PATH=$PWD/{bin_dir.relative_to(REPO)}:$PATH\n"
            "  kubectl get nodes,computedomains -A\n"
            "Stop it with `make cluster-down`."
        )
        return 0
    if command == "down":
        cluster.down()
        return 0
    if command == "status":
        healthy = cluster.healthy(patience=5.0)
        print("running" if healthy else "not running")
        if healthy:
            for name, mib in cluster.memory_mib().items():
                print(f"  {name:26} {mib:7.1f} MiB")
        return 0 if healthy else 1
    print(f"usage: python -m tests.testbed.cluster up|down|status (got {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
