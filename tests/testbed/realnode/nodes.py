"""`RealNodes`: N nodes, each a real kubelet + containerd in a mount and network namespace of its own.

    nodes = RealNodes(LocalCluster(), count=2)
    nodes.up()      # namespaces, network, kubelets Ready, images imported
    ...             # helm install the chart; pods on nodes.names run as real containers
    nodes.down()    # pods, processes, namespaces, cgroups, Node objects, directories: all gone

Layout (all under `<cluster root>/realnodes/`, recorded in `state.json` before each step is taken, so a run
that was killed is cleaned up by the next `up` or `down`):

- **hub**: a network namespace with a bridge (198.18.0.1/16), the `kubernetes` Service IP 10.96.0.1 on its
  loopback, and `netd` (the Service relay to the apiserver on the host's loopback, and the apiserver's
  egress proxy to the kubelets). Routes send each node's pod range to that node.
- **node i**: a mount + network namespace (held by a `sleep`): `eth0` = 198.18.0.(10+i) (a veth into the
  hub's bridge), pods on a CNI bridge in 198.19.i.0/24. In its mount namespace the node's own directories are
  bound over `/run` (containerd's sockets and shims, runc's state, `/var/run/cdi`), `/var/lib` (kubelet,
  CNI, containerd's root) and `/var/log` (pod logs), and files with the kubelet's expected values over
  `vm.overcommit_memory`, `kernel.panic` and `kernel.panic_on_oops` (`protectKernelDefaults: true`: the kubelet
  checks them instead of writing the machine's). The driver root is an overlay at /run/nvidia/driver
  (see `driverroot`).
- **cgroups**: each kubelet gets `cgroupRoot` `<this process' cgroup>/cdtb-<id>-<node>`, created in every
  hierarchy beforehand (cpuset values copied), so two kubelets never clean up each other's pods.
- **identity**: a client certificate `CN=system:node:<name>, O=system:nodes` from the test bed's CA: the Node
  authorizer and NodeRestriction judge the kubelet as on any cluster.

Nothing here touches the machine's interfaces, routes, firewall, `/proc/sys`, or its `/run/containerd`,
`/var/lib/kubelet`, `/var/log/pods`, `/var/lib/cni`: every write to those paths lands in the node's own
directories, and every network change happens inside namespaces created here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.testbed import image as image_builder
from tests.testbed.cluster import LocalCluster, build_binaries, log
from tests.testbed.realnode import driverroot
from tests.testbed.realnode.driverroot import DriverFacts

REPO = Path(__file__).resolve().parents[3]
SERVICE_IP = "10.96.0.1"
HUB_IP = "198.18.0.1"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
SET_LABEL = "realnode.testbed.computedomain/set"
# Where each node's fake driver root is mounted inside its namespace: the GPU Operator's driver container
# path, the same on every node, so one chart value (nvidiaDriverRoot) serves them all.
DRIVER_ROOT = "/run/nvidia/driver"
# The kubelet's expectations under protectKernelDefaults, where this machine may differ.
KERNEL_DEFAULTS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
CGROUP_FS = Path("/sys/fs/cgroup")
READY_TIMEOUT = 120.0
# Namespace holders: no inherited stdio (a caller's pipe would stay open as long as they live).
_DETACHED: dict[str, Any] = {
    "stdin": subprocess.DEVNULL,
    "stdout": subprocess.DEVNULL,
    "stderr": subprocess.DEVNULL,
    "start_new_session": True,
}


def node_ip(index: int) -> str:
    return f"198.18.0.{10 + index}"


def pod_cidr(index: int) -> str:
    return f"198.19.{index}.0/24"


class RealNodeError(RuntimeError):
    pass


def _run(argv: list[str], *, input: str | None = None, timeout: float = 60) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
    if result.returncode != 0:
        raise RealNodeError(f"{shlex.join(argv)[:300]} failed ({result.returncode}): {result.stderr.strip()[:2000]}")
    return result.stdout


def _start_time(pid: int) -> int | None:
    """The kernel's start time of a process (field 22 of /proc/PID/stat): with the PID, a process' identity."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _ns_id(pid: int, kind: str) -> str | None:
    try:
        return str(Path(f"/proc/{pid}/ns/{kind}").readlink())
    except OSError:
        return None


@dataclass
class Proc:
    """A process this test bed started: PID + start time, so a reused PID is never signalled."""

    pid: int
    start: int | None

    @classmethod
    def of(cls, pid: int) -> Proc:
        return cls(pid, _start_time(pid))

    def alive(self) -> bool:
        return self.start is not None and _start_time(self.pid) == self.start and not _zombie(self.pid)

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, grace: float = 10.0) -> None:
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@dataclass
class Node:
    name: str
    index: int
    dir: Path
    cgroup_root: str
    facts: DriverFacts
    holder: Proc | None = None
    mnt_ns: str | None = None
    containerd: Proc | None = None
    kubelet: Proc | None = None
    host_imex: Proc | None = None

    @property
    def ip(self) -> str:
        return node_ip(self.index)

    @property
    def driver_upper(self) -> Path:
        """The node's own layer of its driver root (writable from the host; the overlay shows changes)."""
        return self.dir / "driver.upper"

    @property
    def cdi_dir(self) -> Path:
        """The node's /var/run/cdi, seen from the host."""
        return self.dir / "run" / "cdi"

    @property
    def kubelet_dir(self) -> Path:
        return self.dir / "var-lib" / "kubelet"

    @property
    def logs(self) -> Path:
        """Kept after teardown (until the next `up`), for a failed run's post-mortem."""
        return self.dir.parent / "logs" / self.name

    def to_json(self) -> dict[str, Any]:
        def proc(p: Proc | None) -> list[int | None] | None:
            return [p.pid, p.start] if p else None

        return {
            "name": self.name, "index": self.index, "dir": str(self.dir), "cgroup_root": self.cgroup_root,
            "facts": [self.facts.channels_major, self.facts.channel_count], "holder": proc(self.holder),
            "mnt_ns": self.mnt_ns, "containerd": proc(self.containerd), "kubelet": proc(self.kubelet),
            "host_imex": proc(self.host_imex),
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Node:
        def proc(value: list[int | None] | None) -> Proc | None:
            return Proc(int(value[0]), value[1]) if value and value[0] is not None else None  # type: ignore[arg-type]

        return cls(
            name=data["name"], index=data["index"], dir=Path(data["dir"]), cgroup_root=data["cgroup_root"],
            facts=DriverFacts(*data["facts"]), holder=proc(data["holder"]), mnt_ns=data.get("mnt_ns"),
            containerd=proc(data["containerd"]), kubelet=proc(data["kubelet"]), host_imex=proc(data.get("host_imex")),
        )  # fmt: skip

    def nsenter(self) -> list[str]:
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--"]


@dataclass
class State:
    id: str
    hub: Proc | None = None
    netd: Proc | None = None
    nodes: list[Node] = field(default_factory=list)
    cgroup_dirs: list[str] = field(default_factory=list)  # created here, removed deepest first
    # The process whose run these nodes serve (a demo, a test session); None: `python -m tests.testbed.realnode
    # up`, whose nodes run until `down`. Nodes whose owner is gone are a killed run's (`orphaned`).
    owner: Proc | None = None

    def orphaned(self) -> bool:
        return self.owner is not None and not self.owner.alive()

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "hub": [self.hub.pid, self.hub.start] if self.hub else None,
                "netd": [self.netd.pid, self.netd.start] if self.netd else None,
                "nodes": [n.to_json() for n in self.nodes],
                "cgroup_dirs": self.cgroup_dirs,
                "owner": [self.owner.pid, self.owner.start] if self.owner else None,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> State:
        data = json.loads(text)
        return cls(
            id=data["id"],
            hub=Proc(*data["hub"]) if data.get("hub") else None,
            netd=Proc(*data["netd"]) if data.get("netd") else None,
            nodes=[Node.from_json(n) for n in data.get("nodes", [])],
            cgroup_dirs=list(data.get("cgroup_dirs", [])),
            owner=Proc(*data["owner"]) if data.get("owner") else None,
        )


def _own_cgroup() -> str:
    """The deepest cgroup path of this process over all hierarchies (the one that limits its memory)."""
    paths = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if line]
    return max(paths, key=lambda p: p.count("/")).rstrip("/")


def _hierarchies() -> list[Path]:
    return sorted(p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink())


class RealNodes:
    def __init__(
        self, cluster: LocalCluster, count: int = 2, *, root: Path | None = None, egress_socket: Path | None = None
    ) -> None:
        """`root` and `egress_socket` default to the cluster's; another pair runs a second, independent set
        (whose kubelets the apiserver cannot reach for logs: its egress goes to the default socket)."""
        self.cluster = cluster
        self.count = count
        self.root = root or cluster.root / "realnodes"
        self.egress_socket = egress_socket or cluster.egress_socket
        self.state_file = self.root / "state.json"
        self.state: State | None = None
        self.bin: Path | None = None
        self.image: image_builder.Built | None = None
        self.timings: dict[str, float] = {}

    # --- state -----------------------------------------------------------------------------------------

    def _save(self) -> None:
        assert self.state is not None
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(self.state.to_json())
        tmp.rename(self.state_file)

    def load(self) -> State | None:
        try:
            return State.from_json(self.state_file.read_text())
        except (OSError, ValueError, KeyError):
            return None

    @property
    def nodes(self) -> list[Node]:
        return self.state.nodes if self.state else []

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # --- up ----------------------------------------------------------------------------------------------

    def up(self, *, owned: bool = True) -> None:
        """Start the nodes (taking down an earlier set first). `owned`: they belong to this process's run, and
        a later command that finds this process gone takes them down (`reclaim`)."""
        if os.geteuid() != 0:
            raise RealNodeError("real nodes need root (namespaces, mounts, cgroups)")
        start = time.monotonic()
        stale = self.load()
        if stale is not None:
            log("real nodes: cleaning up after an earlier run")
            self._teardown(stale)
        self.bin = build_binaries()
        self.image = image_builder.build()
        self.timings["image_s"] = self.image.seconds
        _rmtree(self.root / "logs")
        self.root.mkdir(parents=True, exist_ok=True)
        set_id = "r" + secrets.token_hex(3)
        self.state = State(id=set_id, owner=Proc.of(os.getpid()) if owned else None)
        self._save()
        try:
            self._start_hub()
            own = _own_cgroup()
            for i in range(self.count):
                name = f"rn-{set_id}-{i}"
                node = Node(
                    name=name, index=i, dir=self.root / name, cgroup_root=f"{own}/cdtb-{set_id}-{i}",
                    facts=DriverFacts(channels_major=230 + i, channel_count=4 + 2 * i),
                )  # fmt: skip
                self.state.nodes.append(node)
                self._start_node(node)
            t0 = time.monotonic()
            for node in self.nodes:
                self._start_kubelet(node)
            self._wait_ready()
            self.timings["node_ready_s"] = time.monotonic() - t0
        except BaseException:
            self.down()
            raise
        self.timings["up_s"] = time.monotonic() - start
        log(f"real nodes {', '.join(self.names)} Ready in {self.timings['up_s']:.1f}s "
            f"(kubelet start -> Ready {self.timings['node_ready_s']:.1f}s)")  # fmt: skip

    def _start_hub(self) -> None:
        assert self.state is not None
        hub = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"], **_DETACHED)
        self.state.hub = Proc.of(hub.pid)
        self._save()
        _wait_for(lambda: _ns_id(hub.pid, "net") != _ns_id(os.getpid(), "net"), "the hub namespace")
        ns = ["nsenter", "-t", str(hub.pid), "-n", "--"]
        script = f"""
            ip link set lo up
            ip addr add {SERVICE_IP}/32 dev lo
            ip link add br0 type bridge
            ip addr add {HUB_IP}/16 dev br0
            ip link set br0 up
            echo 1 > /proc/sys/net/ipv4/ip_forward
        """
        _run([*ns, "sh", "-ec", script])
        ports = (self.cluster.state() or {}).get("ports", {})
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / "netd.log").open("ab") as out:
            netd = subprocess.Popen(
                [sys.executable, "-m", "tests.testbed.realnode.netd", f"--hub-netns=/proc/{hub.pid}/ns/net",
                 f"--apiserver=127.0.0.1:{ports['apiserver']}", f"--service={SERVICE_IP}:443",
                 f"--egress-socket={self.egress_socket}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
            )  # fmt: skip
        self.state.netd = Proc.of(netd.pid)
        self._save()
        _wait_for(lambda: self.egress_socket.exists() or netd.poll() is not None, "netd")
        if netd.poll() is not None:
            raise RealNodeError(f"netd exited: {(logs / 'netd.log').read_text()[-2000:]}")

    def _make_cgroups(self, node: Node) -> None:
        assert self.state is not None
        for hierarchy in _hierarchies():
            path = hierarchy
            for part in node.cgroup_root.strip("/").split("/"):
                parent, path = path, path / part
                if path.exists():
                    continue
                path.mkdir()
                self.state.cgroup_dirs.append(str(path))
                self._save()
                for name in ("cpuset.cpus", "cpuset.mems"):  # a v1 cpuset child starts empty: copy them
                    if (parent / name).exists():
                        (path / name).write_text((parent / name).read_text())

    def _start_node(self, node: Node) -> None:
        assert self.state is not None and self.state.hub is not None and self.bin is not None and self.image
        d = node.dir
        node.logs.mkdir(parents=True, exist_ok=True)
        for sub in ("run", "var-lib", "var-log", "pki", "cni", "opt", "sysctl", "driver.upper",
                    "driver.work", "volume-plugins", DRIVER_ROOT.lstrip("/")):  # fmt: skip
            (d / sub).mkdir(parents=True, exist_ok=True)
        for key, value in KERNEL_DEFAULTS.items():
            (d / "sysctl" / key.replace("/", ".")).write_text(value + "\n")
        peers = [node_ip(i) for i in range(self.count)]
        driverroot.lay_out(d / "driver.upper", node.name, node.facts, node_ip=node.ip, peer_ips=peers)
        self._make_cgroups(node)
        self._node_cert(node)
        self._write_configs(node)

        holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "--", "sleep", "infinity"], **_DETACHED
        )
        node.holder = Proc.of(holder.pid)
        self._save()
        _wait_for(lambda: _ns_id(holder.pid, "mnt") != _ns_id(os.getpid(), "mnt"), f"{node.name}'s namespaces")
        node.mnt_ns = _ns_id(holder.pid, "mnt")
        self._save()
        binds = [("run", "/run"), ("var-lib", "/var/lib"), ("var-log", "/var/log")]
        mounts = [f"mount --bind {shlex.quote(str(d / src))} {dst}" for src, dst in binds]
        mounts += [
            f"mount --bind -o ro {shlex.quote(str(d / 'sysctl' / key.replace('/', '.')))} /proc/sys/{key}"
            for key in KERNEL_DEFAULTS
        ]
        mounts.append(
            "mount -t overlay overlay -o "
            + shlex.quote(
                f"lowerdir={':'.join(map(str, self.image.lowers))},upperdir={d / 'driver.upper'},"
                f"workdir={d / 'driver.work'}"
            )
            + f" {DRIVER_ROOT}"
        )
        # A private namespace made shared: its mounts propagate among themselves (hostPath mounts with
        # HostToContainer propagation need that), never to the machine's namespace.
        mounts.append("mount --make-rshared /")
        hub_pid = self.state.hub.pid
        veth = f"v{self.state.id}{node.index}"
        _run(["ip", "link", "add", "name", veth, "netns", str(hub_pid), "type", "veth", "peer", "name", "eth0",
              "netns", str(holder.pid)])  # fmt: skip
        _run(["nsenter", "-t", str(hub_pid), "-n", "--", "sh", "-ec",
              f"ip link set {veth} master br0 up; ip route add {pod_cidr(node.index)} via {node.ip}"])  # fmt: skip
        network = f"""
            ip link set lo up
            ip addr add {node.ip}/16 dev eth0
            ip link set eth0 up
            ip route add default via {HUB_IP}
            echo 1 > /proc/sys/net/ipv4/ip_forward
        """
        _run([*node.nsenter(), "sh", "-ec", "\n".join(mounts) + "\n" + network])
        for sub in ("cdi", "containerd"):
            (d / "run" / sub).mkdir(exist_ok=True)

        env = {**os.environ, "PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin"}
        with (node.logs / "containerd.log").open("ab") as out:
            proc = subprocess.Popen(
                [*node.nsenter(), str(self.bin / "containerd"), "--config", str(d / "containerd.toml")],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )  # fmt: skip
        node.containerd = Proc.of(proc.pid)
        self._save()
        sock = d / "run" / "containerd" / "containerd.sock"
        _wait_for(lambda: sock.exists() or proc.poll() is not None, f"{node.name}'s containerd")
        if proc.poll() is not None:
            raise RealNodeError(
                f"containerd of {node.name} exited: {(node.logs / 'containerd.log').read_text()[-2000:]}"
            )
        for archive in (self.pause_archive(), self.image.archive):
            self.ctr(node, "images", "import", "--no-unpack=false", str(archive), timeout=180)

    def pause_archive(self) -> Path:
        """The sandbox image: the pause program built by testbin, packed as an OCI archive (cached)."""
        from tests.testbed.oci import ImageConfig, write_archive, write_layer

        assert self.bin is not None
        program = (self.bin / "pause").resolve()
        out = program.parent / "pause.oci.tar"
        if not out.exists():
            tree = program.parent / "pause-rootfs"
            tree.mkdir(exist_ok=True)
            target = tree / "pause"
            if not target.exists():
                target.write_bytes(program.read_bytes())
                target.chmod(0o755)
            layer = write_layer(tree, program.parent / "pause-layer.tar.gz")
            write_archive(out, PAUSE_IMAGE, [layer], ImageConfig(env=[], cmd=[], entrypoint=["/pause"], user="65535"))
        return out

    def ctr(self, node: Node, *args: str, timeout: float = 60) -> str:
        assert self.bin is not None
        return _run([*node.nsenter(), str(self.bin / "ctr"), "--address", "/run/containerd/containerd.sock",
                     "-n", "k8s.io", *args], timeout=timeout)  # fmt: skip

    def _node_cert(self, node: Node) -> None:
        pki, out = self.cluster.pki, node.dir / "pki"
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        (out / "ext").write_text("extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
        _run(["openssl", "req", *ec, "-keyout", str(out / "kubelet.key"), "-out", str(out / "kubelet.csr"),
              "-subj", f"/O=system:nodes/CN=system:node:{node.name}"])  # fmt: skip
        _run(["openssl", "x509", "-req", "-in", str(out / "kubelet.csr"), "-CA", str(pki / "ca.crt"),
              "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-out", str(out / "kubelet.crt"), "-days", "30",
              "-extfile", str(out / "ext")])  # fmt: skip

    def _write_configs(self, node: Node) -> None:
        assert self.bin is not None and self.state is not None
        d = node.dir
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "testbed", "cluster": {"server": f"https://{SERVICE_IP}:443",
                                                         "certificate-authority": str(self.cluster.pki / "ca.crt")}}],
            "users": [{"name": "kubelet", "user": {"client-certificate": str(d / "pki" / "kubelet.crt"),
                                                   "client-key": str(d / "pki" / "kubelet.key")}}],
            "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": "kubelet"}}],
            "current-context": "testbed",
        }  # fmt: skip
        (d / "kubelet.kubeconfig").write_text(json.dumps(kubeconfig, indent=1))
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.cluster.pki / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "address": node.ip, "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
            "cgroupDriver": "cgroupfs", "cgroupRoot": node.cgroup_root, "failCgroupV1": False,
            "failSwapOn": False, "protectKernelDefaults": True,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "volumePluginDir": str(d / "volume-plugins"),
            "resolvConf": "/etc/resolv.conf", "clusterDNS": [], "maxPods": 30,
            # A shared machine: no image garbage collection (the images were imported, not pulled), no
            # eviction because of what other work does to the disk or memory.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "registerNode": True,
            "nodeStatusUpdateFrequency": "5s", "syncFrequency": "10s", "shutdownGracePeriod": "0s",
        }  # fmt: skip
        (d / "kubelet.yaml").write_text(json.dumps(kubelet, indent=1))
        index = node.index
        cni = {
            "cniVersion": "1.0.0", "name": "testbed",
            "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr(index),
                                                                      "gateway": f"198.19.{index}.1"}]],
                                  "routes": [{"dst": "0.0.0.0/0"}]}}],
        }  # fmt: skip
        (d / "cni" / "10-testbed.conflist").write_text(json.dumps(cni, indent=1))
        (d / "containerd.toml").write_text(
            CONTAINERD_CONFIG.format(
                root=d / "containerd", opt=d / "opt", bin=self.bin, cni_conf=d / "cni", pause=PAUSE_IMAGE
            )
        )

    def _start_kubelet(self, node: Node) -> None:
        assert self.bin is not None and self.state is not None
        d = node.dir
        labels = f"nvidia.com/gpu.present=true,{SET_LABEL}={self.state.id}"
        with (node.logs / "kubelet.log").open("ab") as out:
            proc = subprocess.Popen(
                [*node.nsenter(), str(self.bin / "kubelet"), f"--config={d / 'kubelet.yaml'}",
                 f"--kubeconfig={d / 'kubelet.kubeconfig'}", f"--hostname-override={node.name}",
                 f"--node-ip={node.ip}", f"--node-labels={labels}", "--v=2"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin"},
            )  # fmt: skip
        node.kubelet = Proc.of(proc.pid)
        self._save()

    def restart_kubelet(self, node: Node) -> None:
        """Stop the kubelet (SIGTERM, as systemd does) and start it again; pods and containers stay."""
        if node.kubelet:
            node.kubelet.stop()
        self._start_kubelet(node)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            ready = 0
            for node in self.nodes:
                if node.kubelet is None or not node.kubelet.alive():
                    raise RealNodeError(f"the kubelet of {node.name} exited:\n{self.log_tail(node, 'kubelet')}")
                result = self.cluster.kubectl("get", "node", node.name, "-o", "json", check=False)
                if result.returncode == 0:
                    conditions = json.loads(result.stdout).get("status", {}).get("conditions") or []
                    ready += any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            if ready == len(self.nodes):
                return
            time.sleep(0.5)
        raise RealNodeError(
            "real nodes not Ready in time:\n" + "\n".join(self.log_tail(n, "kubelet") for n in self.nodes)
        )

    def log_tail(self, node: Node, component: str, lines: int = 25) -> str:
        try:
            text = (node.logs / f"{component}.log").read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {node.name} {component}\n" + "\n".join(text.splitlines()[-lines:])

    # --- host IMEX (hostManaged) -----------------------------------------------------------------------

    def start_host_imex(self, node: Node) -> None:
        """The node's own `nvidia-imex` service (the simulator), chrooted into its driver root."""
        if node.host_imex and node.host_imex.alive():
            return
        with (node.logs / "host-imex.log").open("ab") as out:
            proc = subprocess.Popen(
                [*node.nsenter(), shutil.which("chroot") or "/usr/sbin/chroot", DRIVER_ROOT, "/usr/bin/nvidia-imex", "-c",
                 "/etc/nvidia-imex/config.cfg"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={"PATH": "/opt/venv/bin:/usr/bin:/bin", "IMEX_SIM_NODE_IP": node.ip},
            )  # fmt: skip
        node.host_imex = Proc.of(proc.pid)
        self._save()

    def stop_host_imex(self, node: Node) -> None:
        if node.host_imex:
            node.host_imex.stop()
        node.host_imex = None
        self._save()

    # --- measurements ------------------------------------------------------------------------------------

    def memory_mib(self) -> dict[str, float]:
        """Resident memory of each node's kubelet and containerd, and of its shims (one per pod)."""
        out: dict[str, float] = {}
        for node in self.nodes:
            for name, proc in (("kubelet", node.kubelet), ("containerd", node.containerd)):
                if proc and proc.alive():
                    out[f"{node.name}/{name}"] = _rss_mib(proc.pid)
            shims = [pid for pid in _pids_in_mnt_ns(node.mnt_ns) if _comm(pid) == "containerd-shim"]
            out[f"{node.name}/shims({len(shims)})"] = sum(_rss_mib(pid) for pid in shims)
        return out

    # --- down --------------------------------------------------------------------------------------------

    def reclaim(self) -> bool:
        """Take down a set whose owner process is gone (a killed demo or test run); True when there was one."""
        state = self.load()
        if state is None or not state.orphaned():
            return False
        assert state.owner is not None
        log(f"real nodes {', '.join(n.name for n in state.nodes) or '-'} of a killed run (pid {state.owner.pid}): "
            "taking them down")  # fmt: skip
        self._teardown(state)
        return True

    def down(self) -> None:
        state = self.state or self.load()
        if state is not None:
            self._teardown(state)
        self.state = None

    def _teardown(self, state: State) -> None:
        names = [n.name for n in state.nodes]
        if names and self.cluster.healthy(patience=2.0):
            # Graceful first: the kubelets stop the containers and tear down the sandboxes (CNI).
            for name in names:
                self.cluster.kubectl("delete", "pods", "-A", f"--field-selector=spec.nodeName={name}",
                                     "--grace-period=5", "--wait=false", check=False)  # fmt: skip
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                n.kubelet and n.kubelet.alive() and self._pods_on(n.name) for n in state.nodes
            ):
                time.sleep(0.5)
        for node in state.nodes:
            for proc in (node.kubelet, node.host_imex, node.containerd):
                if proc:
                    proc.stop(grace=10)
        for node in state.nodes:
            # Whatever still runs in the node's namespace (shims) or its cgroups (containers) dies now.
            for pid in _pids_in_mnt_ns(node.mnt_ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _kill_cgroup_tree(node.cgroup_root)
            if node.holder:
                node.holder.stop(grace=0)
        for proc in (state.netd, state.hub):
            if proc:
                proc.stop(grace=5)
        with contextlib.suppress(FileNotFoundError):
            self.egress_socket.unlink()
        # Cgroups the kubelets made below their roots, then the roots and their parents made here.
        deadline = time.monotonic() + 20
        leftovers = []
        for node in state.nodes:
            while True:
                leftovers = _remove_cgroup_tree(node.cgroup_root)
                if not leftovers or time.monotonic() > deadline:
                    break
                _kill_cgroup_tree(node.cgroup_root)
                time.sleep(0.2)
        for path in sorted(state.cgroup_dirs, key=lambda p: p.count("/"), reverse=True):
            with contextlib.suppress(FileNotFoundError, OSError):
                Path(path).rmdir()
        if names and self.cluster.healthy(patience=2.0):
            self.cluster.kubectl("delete", "nodes", *names, "--ignore-not-found", "--timeout=30s", check=False)
            self._forget_releases(state.id)
        for node in state.nodes:
            if _mounted_below(node.dir):
                raise RealNodeError(f"mounts remain below {node.dir}; not deleting it")
            _rmtree(node.dir)
        self.state_file.unlink(missing_ok=True)
        if leftovers:
            raise RealNodeError(f"cgroups could not be removed: {leftovers[:5]}")
        log(f"real nodes {', '.join(names) or '-'} removed")

    def _forget_releases(self, set_id: str) -> None:
        """What a release on these nodes leaves when its run was killed: the release (uninstalled without
        hooks: its controller is gone with the nodes), ComputeDomains nobody finalizes, the namespaces."""
        helm = [str(self.cluster.root / "bin" / "helm"), f"--kubeconfig={self.cluster.kubeconfig}"]
        namespaces = [f"{set_id}-{suffix}" for suffix in ("driver", "host", "work")]
        for ns in namespaces:
            listed = subprocess.run([*helm, "list", "-q", "-n", ns], capture_output=True, text=True, timeout=60)
            for release in listed.stdout.split():
                subprocess.run([*helm, "uninstall", release, "-n", ns, "--no-hooks"], capture_output=True, timeout=120)
            cds = self.cluster.kubectl("get", "computedomains", "-n", ns, "-o", "name", check=False).stdout.split()
            for cd in cds:
                self.cluster.kubectl("patch", cd, "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                                     check=False)  # fmt: skip
        self.cluster.kubectl("delete", "namespace", *namespaces, "--ignore-not-found", "--wait=false", check=False)

    @staticmethod
    def leftovers(state: State) -> list[str]:
        """What of `state` is still on the machine (after `down`: nothing)."""
        out: list[str] = []
        for node in state.nodes:
            out += [f"process {pid} in {node.name}'s namespace" for pid in _pids_in_mnt_ns(node.mnt_ns)]
            out += [f"cgroup {path}" for path in _cgroup_dirs(node.cgroup_root)]
            out += [f"directory {node.dir}"] if node.dir.exists() else []
            out += [f"{what} of {node.name}" for what, proc in (("holder", node.holder), ("kubelet", node.kubelet),
                    ("containerd", node.containerd), ("host IMEX", node.host_imex)) if proc and proc.alive()]  # fmt: skip
        out += [f"cgroup {path}" for path in state.cgroup_dirs if Path(path).exists()]
        out += [f"{what}" for what, proc in (("hub", state.hub), ("netd", state.netd)) if proc and proc.alive()]
        return out

    def _pods_on(self, name: str) -> bool:
        result = self.cluster.kubectl("get", "pods", "-A", f"--field-selector=spec.nodeName={name}", "-o", "name",
                                      check=False)  # fmt: skip
        return result.returncode != 0 or bool(result.stdout.strip())


CONTAINERD_CONFIG = """\
version = 3
root = "{root}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.blockfile",
                    "io.containerd.snapshotter.v1.erofs"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  cdi_spec_dirs = ["/var/run/cdi"]
  # This machine's capability bounding set lacks CAP_SYS_RESOURCE: without this every sandbox fails.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{bin}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin}/cni"]
    conf_dir = "{cni_conf}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
"""


def _wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RealNodeError(f"{what} did not come up within {timeout:.0f}s")
        time.sleep(0.05)


def _rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _pids_in_mnt_ns(ns: str | None) -> list[int]:
    if not ns:
        return []
    me = os.getpid()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me and _ns_id(int(entry.name), "mnt") == ns:
            out.append(int(entry.name))
    return out


def _cgroup_dirs(root: str) -> list[Path]:
    """Every existing directory at or below `root` in every hierarchy, deepest first."""
    out: list[Path] = []
    for hierarchy in _hierarchies():
        top = hierarchy / root.strip("/")
        if top.is_dir():
            out.extend(p for p in top.rglob("*") if p.is_dir())
            out.append(top)
    return sorted(out, key=lambda p: len(p.parts), reverse=True)


def _kill_cgroup_tree(root: str) -> None:
    for path in _cgroup_dirs(root):
        with contextlib.suppress(OSError, ValueError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _remove_cgroup_tree(root: str) -> list[str]:
    """rmdir everything below (and including) root's leaf; returns what could not be removed."""
    left = []
    for path in _cgroup_dirs(root):
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            left.append(str(path))
    return left


def _mounted_below(root: Path) -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4]
            if point == str(root) or point.startswith(f"{root}/"):
                out.append(point)
    return out


def _rmtree(path: Path) -> None:
    """rm -rf that never crosses into a mount (there should be none: the namespaces are gone)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False, capture_output=True, timeout=120)
