"""The container side of the simulated kubelets: run the pods of this service that kwok reports Running.

kwok moves a pod to Running (after the kubelet stand-in prepared its claims, for pods with claims) and gives
it a pod IP from its node's podCIDR; nothing would run. The `PodRunner` watches the pods bound to the
simulation's nodes and, for every container whose image is the release image (controller replicas, node
agents, IMEX daemons, uninstall hook Jobs), does what the kubelet and the container runtime would:

- **identity**: a token of the pod's ServiceAccount from the TokenRequest API, bound to the pod (so the
  apiserver adds the node name to the user, RBAC and the admission policies see the real identity, and the
  token dies with the pod), with the cluster's CA and the namespace as files at the in-pod path and
  `KUBERNETES_SERVICE_HOST`/`_PORT` in the env, so the product takes a pod's in-cluster path
  (`tests.testbed.serviceaccount`: a process of its own gets the files in a mount namespace of its own, a
  pod host points the loader at each container's directory);
- **env, args, paths, ports**: `containers.translate` (downward API, `$(VAR)`, CDI edits of the pod's
  prepared claims from the node's CDI dir, mount paths into the node's tree, per-pod address and ports);
- **hardware**: nothing of its own: the node's tree is its driver root (mock NVML, `/proc` files, the IMEX
  simulator; `tests.testbed.fake_driver_root`), which the node agent reads through the chart's
  `/driver-root` mount like any hostPath;
- **IMEX**: an IMEX daemon container gets `nvidia-imex`/`nvidia-imex-ctl` from the base CDI spec, as on a
  real node; with no mount namespace, per-pod wrappers (`IMEX_BINARY`/`IMEX_CTL_BINARY`, first in PATH) run
  those files with what a container would give them implicitly (its IP, its `/etc/hosts`);
- **lifecycle**: a finalizer of ours keeps the pod object (and with it the bound token) alive until the
  process has stopped, as the kubelet keeps a terminating pod; deletion is SIGTERM, then SIGKILL after
  `terminationGracePeriodSeconds`; a process that exits is restarted per `restartPolicy` with the kubelet's
  doubling back-off (`restart_backoff_s` first, 300 s at most) and the restart count shows in the status;
  a Job's container that ends makes the pod Succeeded or Failed;
- **probes**: `probes.Prober`; a pod with probes turns NotReady before its process starts and Ready only
  when every container's readiness (after its startup probe) passes;
- **init containers** (of the release image) run in order before the others, each to its end; what one
  wrote to `/dev/termination-log` is its status's termination message. CDI device nodes of the prepared
  claims are created (mknod, as root) in the pod's `/dev`;
- **logs**: `<state dir>/logs/<namespace>_<pod>_<container>.log`.

Hosting: node agents and IMEX daemons run as one process each, or, with `Hosting.per_host > 1`, several per
`podhost` process (see there). A controller runs through `podhost --one --scope NS` when a scope is set.

Concurrency: one informer task; one worker task per pod (by UID) that owns that pod's processes, probes and
status writes; the informer's handlers only set events on workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import socket
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from computedomain.kube.client import PODS, KubeClient, Raw, Resource
from computedomain.kube.errors import KubeError, NotFound
from computedomain.kube.informer import Informer
from tests.testbed import serviceaccount
from tests.testbed.imex_simulator.forkserver import client_script
from tests.testbed.sim.containers import (
    REPO,
    ContainerPlan,
    Mounts,
    UnsupportedPodError,
    cdi_edits,
    container_env,
    container_ports,
    translate,
)
from tests.testbed.sim.launch import HostPool, Launched, start_process
from tests.testbed.sim.probes import Prober
from tests.testbed.sim.topology import SimNode, SimTopology

log = logging.getLogger("sim.pods")

FINALIZER: Final = "sim.testbed.computedomain/container-runtime"
CDI_ANNOTATION: Final = "testbed.computedomain/cdi-devices"
MAX_BACKOFF_S: Final = 300.0


@dataclass(frozen=True)
class Hosting:
    """How many node agents / IMEX daemons share one process (1: a process each, as in production)."""

    plugins_per_host: int = 1
    daemons_per_host: int = 1
    controller_scope: str | None = None  # namespace of the ComputeDomains the controller handles
    # Heartbeat interval and misses of the simulated IMEX peers. The defaults (0.5 s x 3) detect a dead peer
    # quickly in small tests; a 72-node domain on 2 cores needs more slack, or peers of a busy process look
    # dead and links churn.
    imex_heartbeat_s: float = 0.5
    imex_heartbeat_misses: int = 3
    # Start each daemon's `nvidia-imex` (the simulator) by fork from one process that imported it once
    # (tests.testbed.imex_simulator.forkserver) instead of a fresh Python (~0.1 CPU s of imports per start).
    imex_fork_server: bool = False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _kind(program: tuple[str, ...]) -> str:
    if program[:3] == ("-m", "computedomain", "kubelet-plugin"):
        return "node-agent"
    if program[:4] == ("-m", "imex", "daemon", "run"):
        return "imex-daemon"
    if program[:3] == ("-m", "computedomain", "controller"):
        return "controller"
    return "other"


@dataclass
class ContainerState:
    spec: dict[str, Any]
    plan: ContainerPlan | None = None
    launched: Launched | None = None
    ready: bool = False
    restarts: int = 0
    running_since: float = 0.0
    exit_code: int | None = None
    finished: bool = False
    restart_now: asyncio.Event = field(default_factory=asyncio.Event)


class PodWorker:
    def __init__(self, runner: PodRunner, pod: Raw, node: SimNode) -> None:
        self.runner = runner
        self.pod = pod
        self.node = node
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.dir = runner.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.deleting = asyncio.Event()
        self.containers = [ContainerState(c) for c in pod["spec"]["containers"] if c.get("image") in runner.images]
        self.init_containers = [
            ContainerState(c) for c in pod["spec"].get("initContainers") or () if c.get("image") in runner.images
        ]
        self.init_messages: dict[str, str] = {}
        self._status_lock = asyncio.Lock()
        self.status_written = False  # our first status write is done: from then on our Ready verdict stands
        self._reasserting = False
        self.task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    # -- setup

    async def _service_account(self) -> Path:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        # `kubectl create token SA --bound-object-kind=Pod ...` as one request instead of a kubectl process per
        # pod: a TokenRequest is a create on the ServiceAccount's `token` subresource, whose path a Resource
        # with that plural gives.
        token_request = Resource("", "v1", f"serviceaccounts/{sa}/token", True, "TokenRequest")
        reply = await self.runner.client.create(
            token_request,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": 86400,
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid},
                },
            },
            namespace=self.namespace,
        )
        return serviceaccount.write_dir(
            self.dir / "serviceaccount",
            token=str(reply["status"]["token"]),
            ca=self.runner.ca,
            namespace=self.namespace,
        )

    def _claim_cdi_ids(self, container: Mapping[str, Any]) -> list[str]:
        annotation = (self.pod["metadata"].get("annotations") or {}).get(CDI_ANNOTATION)
        if not annotation:
            return []
        by_claim: dict[str, list[str]] = json.loads(annotation)
        statuses = {
            s["name"]: s.get("resourceClaimName") for s in self.pod.get("status", {}).get("resourceClaimStatuses") or ()
        }
        names = {
            rc["name"]: rc.get("resourceClaimName") or statuses.get(rc["name"])
            for rc in self.pod["spec"].get("resourceClaims") or ()
        }
        ids: list[str] = []
        for ref in (container.get("resources") or {}).get("claims") or ():
            claim = names.get(ref["name"])
            ids += by_claim.get(claim or "", [])
        return ids

    def _mounts(self, container: Mapping[str, Any], cdi: Mapping[str, Any]) -> Mounts:
        mounts = Mounts()
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or ()}
        for vm in container.get("volumeMounts") or ():
            volume = volumes.get(vm["name"], {})
            if "hostPath" in volume:
                host = self.node.host_path(volume["hostPath"]["path"])
            elif "emptyDir" in volume:
                host = self.dir / "volumes" / vm["name"]
            else:
                continue  # projected tokens, configMaps, secrets: nothing of ours needs them
            host = host / vm.get("subPath", "")
            host.mkdir(parents=True, exist_ok=True)
            mounts.add(vm["mountPath"], host)
        for mount in cdi.get("mounts") or ():
            mounts.add(mount["containerPath"], self.node.machine_path(mount["hostPath"]))
        mounts.add("/etc/hosts", self.dir / "etc-hosts")
        mounts.add("/proc", self.node.host_path("/proc"))
        mounts.add("/dev/termination-log", self._termination_log(str(container.get("name"))))
        devices = cdi.get("deviceNodes") or ()
        if devices:
            # The runtime creates a CDI device node in the container from its type, major and minor; here in
            # the pod's /dev (as root; without it the container sees none, as a runtime without CDI would do).
            dev = self.dir / "dev"
            for node in devices:
                if not str(node.get("path", "")).startswith("/dev/") or ".." in str(node["path"]):
                    continue
                path = dev / str(node["path"]).removeprefix("/dev/")
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(int(node["major"]), int(node["minor"])))
            mounts.add("/dev/nvidia-caps-imex-channels", dev / "nvidia-caps-imex-channels")
        return mounts

    def _imex_wrappers(self, mounts: Mounts) -> dict[str, str]:
        """Wrappers of the `nvidia-imex`/`nvidia-imex-ctl` the pod's CDI mounts provide (none: none, and the
        daemon fails to start its IMEX as in a real container that lacks it)."""
        bin_dir = self.dir / "bin"
        bin_dir.mkdir(exist_ok=True)
        hosts = mounts.translate("/etc/hosts")
        sim_env = {
            "IMEX_SIM_HOSTS_FILE": str(hosts),
            "IMEX_SIM_NODE_IP": self.pod_ip,
            "IMEX_SIM_FAULT_FILE": str(self.dir / "imex-faults"),
            "IMEX_SIM_HEARTBEAT_INTERVAL": str(self.runner.hosting.imex_heartbeat_s),
            "IMEX_SIM_HEARTBEAT_MISSES": str(self.runner.hosting.imex_heartbeat_misses),
        }
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sim_env.items())
        out = {}
        for name, setting in (("nvidia-imex", "IMEX_BINARY"), ("nvidia-imex-ctl", "IMEX_CTL_BINARY")):
            provided = mounts.translate(f"/usr/bin/{name}")
            if provided is None or not provided.is_file():
                continue
            path = bin_dir / name
            path.write_text(
                "#!/bin/sh\n"
                f"# {name} of pod {self.key} on {self.node.name}: the one its CDI spec mounts, with the pod's\n"
                "# IP and /etc/hosts (a container would see them without being told)\n"
                f"export {exports}\n"
                f'exec {shlex.quote(str(provided))} "$@"\n'
            )
            path.chmod(0o755)
            out[setting] = str(path)
        if self.runner.fork_server_port and "IMEX_BINARY" in out:
            forked = bin_dir / "nvidia-imex-forked"
            forked.write_text(client_script(self.runner.fork_server_port))
            forked.chmod(0o755)
            wrapper = Path(out["IMEX_BINARY"])
            wrapper.write_text(wrapper.read_text().replace("\nexec ", f"\nexec {shlex.quote(str(forked))} ", 1))
        return out

    @property
    def pod_ip(self) -> str:
        return str(self.pod.get("status", {}).get("podIP") or "")

    async def _plan(self, state: ContainerState, service_account: Path) -> ContainerPlan:
        spec = state.spec
        env = container_env(self.pod, spec, lookup=None)
        specs = [yaml.safe_load(p.read_text()) for p in self.node.cdi_spec_files()]
        cdi = cdi_edits(specs, self._claim_cdi_ids(spec))
        for item in cdi.get("env") or ():
            name, _, value = item.partition("=")
            env[name] = value
        mounts = self._mounts(spec, cdi)
        mounts.add(str(serviceaccount.SERVICE_ACCOUNT_DIR), service_account)
        plan = translate(pod=self.pod, container=spec, env=env, mounts=mounts, free_port=free_port)
        base = {
            "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "HOME": str(self.dir),
            "LANG": "C.UTF-8",
        }
        plan.env = {**base, **plan.env, **self.runner.cluster_env}
        plan.env.pop("KUBECONFIG", None)  # the chart's empty value: in-cluster
        if _kind(plan.program) == "imex-daemon":
            plan.env.update({k: v for k, v in self._imex_wrappers(plan.mounts).items() if k not in plan.env})
        return plan

    # -- status

    async def write_status(self, phase: str | None = None) -> None:
        async with self._status_lock:
            try:
                current = await self.runner.client.get(PODS, self.name, namespace=self.namespace)
            except NotFound:
                return
            if current["metadata"]["uid"] != self.uid:
                return
            status = current.get("status") or {}
            flag = "True" if self.ready() else "False"
            conditions = [
                c for c in status.get("conditions") or () if c.get("type") not in ("Ready", "ContainersReady")
            ]
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            old = {c.get("type"): c for c in status.get("conditions") or ()}
            for ctype in ("ContainersReady", "Ready"):
                same = old.get(ctype, {}).get("status") == flag
                conditions.append(
                    {"type": ctype, "status": flag, "lastTransitionTime": old[ctype]["lastTransitionTime"] if same and old[ctype].get("lastTransitionTime") else now}
                )  # fmt: skip
            by_name = {c.spec["name"]: c for c in self.containers}
            statuses = []
            for cs in status.get("containerStatuses") or ():
                mine = by_name.get(cs.get("name"))
                if mine is not None:
                    cs = {**cs, "ready": mine.ready, "restartCount": mine.restarts}
                    if mine.finished:
                        cs["state"] = {"terminated": {"exitCode": mine.exit_code or 0, "reason": "Completed" if mine.exit_code == 0 else "Error", "finishedAt": now}}  # fmt: skip
                    elif mine.launched is None and mine.exit_code is not None:
                        cs["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
                        cs["lastState"] = {"terminated": {"exitCode": mine.exit_code, "reason": "Error", "finishedAt": now}}  # fmt: skip
                    elif mine.launched is not None:
                        cs["state"] = {"running": {"startedAt": now if not cs.get("state", {}).get("running") else cs["state"]["running"]["startedAt"]}}  # fmt: skip
                statuses.append(cs)
            patch: dict[str, Any] = {"conditions": conditions, "containerStatuses": statuses}
            if self.init_containers:
                patch["initContainerStatuses"] = [self._init_status(c, now) for c in self.init_containers]
            if phase:
                patch["phase"] = phase
            with contextlib.suppress(NotFound):
                await self.runner.client.merge_patch(
                    PODS, self.name, {"status": patch}, namespace=self.namespace, subresource="status"
                )
                self.status_written = True

    def _init_status(self, state: ContainerState, now: str) -> dict[str, Any]:
        """An init container's status as the kubelet reports it; the termination message is what the process
        wrote to its /dev/termination-log (the kubelet keeps at most 4 KiB)."""
        name = state.spec["name"]
        base = {"name": name, "image": state.spec.get("image", ""), "imageID": "", "ready": state.finished,
                "restartCount": state.restarts}  # fmt: skip
        if state.exit_code is None:
            running = (
                {"running": {"startedAt": now}}
                if state.launched is not None
                else {"waiting": {"reason": "PodInitializing"}}
            )
            return {**base, "state": running}  # fmt: skip
        terminated = {"exitCode": state.exit_code, "reason": "Completed" if state.exit_code == 0 else "Error",
                      "finishedAt": now, "message": self.init_messages.get(name, "")[:4096]}  # fmt: skip
        return {**base, "state": {"terminated": terminated}}

    async def _run_init(self) -> bool:
        """Init containers in order, each to its end (restartPolicy Never: the first failure fails the pod).
        True when the main containers may start."""
        for state in self.init_containers:
            assert state.plan is not None
            log_path = self.runner.state_dir / "logs" / f"{self.namespace}_{self.name}_{state.plan.name}.log"
            state.launched = await self.runner.launch(state.plan, f"{self.uid}/{state.plan.name}/0", log_path)
            await self.write_status()
            waiting = asyncio.create_task(state.launched.wait())
            deleting = asyncio.create_task(self.deleting.wait())
            await asyncio.wait({waiting, deleting}, return_when=asyncio.FIRST_COMPLETED)
            deleting.cancel()
            if not waiting.done():
                state.launched.kill()
                await waiting
                return False
            state.exit_code, state.launched, state.finished = waiting.result(), None, True
            message = self._termination_log(state.spec["name"])
            with contextlib.suppress(OSError, UnicodeDecodeError):
                self.init_messages[state.spec["name"]] = message.read_text()[:4096]
            if state.exit_code != 0:
                await self.write_status(phase="Failed" if self.pod["spec"].get("restartPolicy") == "Never" else None)
                return False
        if self.init_containers:
            await self.write_status()
        return True

    def _termination_log(self, container: str) -> Path:
        return self.dir / f"termination-{container}"

    def _changed(self) -> None:
        self.runner.spawn(self.write_status(), f"status-{self.key}")

    def ready(self) -> bool:
        return all(c.ready for c in self.containers) and not self.deleting.is_set()

    def reassert(self, pod: Raw) -> None:
        """The kubelet owns its pods' Ready condition: when the API shows another verdict than ours (the node
        lifecycle controller marks a node's pods NotReady while the node's lease lags, as kwok's does on two
        loaded cores), our next status sync puts ours back, as the kubelet's status manager does. Without it
        such a pod stayed NotReady for good, and with it its daemon's entry and the domain."""
        if not self.status_written or self._reasserting or self._status_lock.locked():
            return
        shown = next(
            (c.get("status") for c in (pod.get("status") or {}).get("conditions") or () if c.get("type") == "Ready"),
            None,
        )
        if shown == ("True" if self.ready() else "False"):
            return
        self._reasserting = True

        async def sync() -> None:
            try:
                await self.write_status()
            finally:
                self._reasserting = False

        self.runner.spawn(sync(), f"status-{self.key}")

    # -- lifecycle

    async def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "etc-hosts").write_text(
            f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{self.pod_ip} {self.name}\n"
        )
        try:
            await self.runner.client.json_patch(
                PODS, self.name, [{"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}]
                if self.pod["metadata"].get("finalizers") else
                [{"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}],
                namespace=self.namespace,
            )  # fmt: skip
        except KubeError as exc:
            log.info("pod gone before it started pod=%s (%s)", self.key, exc)
            return
        try:
            t0 = time.monotonic()
            service_account = await self._service_account()
            t1 = time.monotonic()
            for state in (*self.init_containers, *self.containers):
                state.plan = await self._plan(state, service_account)
            if not await self._run_init():
                return
            if any(c.spec.get(p) for c in self.containers for p in ("startupProbe", "readinessProbe")):
                await self.write_status()
            log.info("starting pod=%s token=%.2fs plan+status=%.2fs", self.key, t1 - t0, time.monotonic() - t1)
            async with asyncio.TaskGroup() as tasks:
                for state in self.containers:
                    tasks.create_task(self._container(state), name=f"container-{self.key}-{state.spec['name']}")
        except (UnsupportedPodError, RuntimeError, OSError) as exc:
            log.error("cannot run pod=%s: %s", self.key, exc)
        finally:
            await release_finalizer(self.runner.client, self.namespace, self.name, self.uid)

    async def _container(self, state: ContainerState) -> None:
        assert state.plan is not None
        plan = state.plan
        policy = self.pod["spec"].get("restartPolicy", "Always")
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        log_path = self.runner.state_dir / "logs" / f"{self.namespace}_{self.name}_{plan.name}.log"
        backoff = self.runner.restart_backoff_s
        while not self.deleting.is_set():
            with log_path.open("a") as handle:
                handle.write(
                    f"==== {time.strftime('%H:%M:%S')} start #{state.restarts} on {self.node.name} ip={self.pod_ip}\n"
                )
            state.launched = await self.runner.launch(plan, f"{self.uid}/{plan.name}/{state.restarts}", log_path)
            state.running_since = time.monotonic()
            state.restart_now.clear()
            self.runner.processes[(self.key, plan.name)] = state.launched

            def on_ready(ok: bool, state: ContainerState = state) -> None:
                if ok != state.ready:
                    log.info("pod=%s container=%s ready=%s", self.key, state.spec["name"], ok)
                    state.ready = ok
                    self._changed()

            def on_dead(why: str, state: ContainerState = state) -> None:
                log.info("pod=%s container=%s: %s; restarting", self.key, state.spec["name"], why)
                if state.launched is not None:
                    state.launched.kill()

            prober = Prober(
                state.spec, plan, container_ports(state.spec), self.pod_ip,
                on_ready=on_ready, on_failed_liveness=on_dead, period_scale=self.runner.probe_scale,
            )  # fmt: skip
            probing = asyncio.create_task(prober.run())
            waiting = asyncio.create_task(state.launched.wait())
            deleting = asyncio.create_task(self.deleting.wait())
            await asyncio.wait({waiting, deleting}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                state.launched.terminate()
                try:
                    await asyncio.wait_for(asyncio.shield(waiting), grace)
                except TimeoutError:
                    state.launched.kill()
                    await waiting
            deleting.cancel()
            probing.cancel()
            code = waiting.result()
            ran = time.monotonic() - state.running_since
            state.exit_code, state.launched, state.ready = code, None, False
            if self.deleting.is_set():
                return
            log.info("pod=%s container=%s exited code=%d after %.1fs", self.key, plan.name, code, ran)
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                state.finished = True
                if all(c.finished for c in self.containers):
                    failed = any(c.exit_code for c in self.containers)
                    await self.write_status(phase="Failed" if failed else "Succeeded")
                return
            state.restarts += 1
            backoff = self.runner.restart_backoff_s if ran > 600 else backoff
            self._changed()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.deleting.wait(), backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)


async def release_finalizer(client: KubeClient, namespace: str, name: str, uid: str) -> None:
    """Take our finalizer off pod `uid` if it still carries it; a concurrent change of its finalizers (the
    patch's test fails) is read again, a few times."""
    for _ in range(5):
        try:
            current = await client.get(PODS, name, namespace=namespace)
            finalizers = current["metadata"].get("finalizers") or []
            if current["metadata"]["uid"] != uid or FINALIZER not in finalizers:
                return
            await client.json_patch(
                PODS, name,
                [{"op": "test", "path": "/metadata/finalizers", "value": finalizers},
                 {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != FINALIZER]}],
                namespace=namespace,
            )  # fmt: skip
            return
        except NotFound:
            return
        except KubeError as exc:
            log.warning("releasing the finalizer of pod=%s/%s: %s", namespace, name, exc)
    log.error("pod=%s/%s keeps finalizer %s after 5 attempts", namespace, name, FINALIZER)


class PodRunner:
    def __init__(
        self,
        client: KubeClient,
        topology: SimTopology,
        *,
        images: set[str],
        admin_kubeconfig: Path,
        state_dir: Path,
        hosting: Hosting | None = None,
        restart_backoff_s: float = 10.0,
        probe_scale: float = 1.0,
    ) -> None:
        self.client = client
        self.topology = topology
        self.images = images
        admin = yaml.safe_load(admin_kubeconfig.read_text())
        self.ca = serviceaccount.ca_pem(admin)
        self.cluster_env = serviceaccount.cluster_env(admin["clusters"][0]["cluster"]["server"])
        self.state_dir = state_dir
        self.hosting = hosting or Hosting()
        self.restart_backoff_s = restart_backoff_s
        self.probe_scale = probe_scale
        self.workers: dict[str, PodWorker] = {}
        self.processes: dict[tuple[str, str], Launched] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self.fork_server: asyncio.subprocess.Process | None = None
        self.fork_server_port = 0
        self.informer: Informer[Raw] = Informer(client, PODS, decode=lambda raw: raw, name="sim-pods")
        self.informer.add_handler(on_add=self._seen, on_update=lambda _old, new: self._seen(new), on_delete=self._gone)
        base_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.pools = {
            "node-agent": HostPool("node-agent", self.hosting.plugins_per_host, base_env, state_dir / "logs"),
            "imex-daemon": HostPool("imex-daemon", self.hosting.daemons_per_host, base_env, state_dir / "logs"),
        }

    def spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def launch(self, plan: ContainerPlan, container_id: str, log_path: Path) -> Launched:
        kind = _kind(plan.program)
        pool = self.pools.get(kind)
        service_account = plan.mounts.translate(str(serviceaccount.SERVICE_ACCOUNT_DIR))
        assert service_account is not None  # _plan mounts it in every container
        if pool is not None and pool.per_host > 1:
            return await pool.launch(container_id, plan.argv, plan.env, log_path, service_account)
        argv = plan.argv
        if kind == "controller" and self.hosting.controller_scope:
            argv = [sys.executable, "-m", "tests.testbed.sim.podhost", "--one",
                    f"--scope={self.hosting.controller_scope}", "--", *plan.argv]  # fmt: skip
        return await start_process(serviceaccount.mounted(argv, service_account), plan.env, log_path)

    # -- watch

    def _node(self, pod: Raw) -> SimNode | None:
        return self.topology.by_name.get((pod.get("spec") or {}).get("nodeName") or "")

    def _seen(self, pod: Raw) -> None:
        meta = pod.get("metadata") or {}
        worker = self.workers.get(meta.get("uid", ""))
        if worker is not None:
            worker.pod = pod if not meta.get("deletionTimestamp") else worker.pod
            if meta.get("deletionTimestamp"):
                worker.deleting.set()
            else:
                worker.reassert(pod)
            return
        node = self._node(pod)
        status = pod.get("status") or {}
        if (
            node is None
            or meta.get("deletionTimestamp")
            or status.get("phase") != "Running"
            or not status.get("podIP")
            or not any(c.get("image") in self.images for c in pod["spec"]["containers"])
        ):
            return
        worker = PodWorker(self, pod, node)
        self.workers[worker.uid] = worker
        worker.task = asyncio.create_task(worker.run(), name=f"pod-{worker.key}")
        log.info("running pod=%s node=%s ip=%s", worker.key, node.name, worker.pod_ip)

    def _gone(self, pod: Raw) -> None:
        worker = self.workers.get((pod.get("metadata") or {}).get("uid", ""))
        if worker is not None:
            worker.deleting.set()

    async def run(self) -> None:
        try:
            if self.hosting.imex_fork_server:
                await self._start_fork_server()
            await self.informer.run()
        finally:
            await self.stop_all()

    async def _start_fork_server(self) -> None:
        log_path = self.state_dir / "logs" / "imex-forkserver.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as handle:
            self.fork_server = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.testbed.imex_simulator.forkserver",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=handle,
                cwd=REPO, env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}, start_new_session=True,
            )  # fmt: skip
        assert self.fork_server.stdout is not None
        self.fork_server_port = int(await asyncio.wait_for(self.fork_server.stdout.readline(), 60))

    async def stop_all(self) -> None:
        """Stop every container (SIGTERM, short grace) and release our finalizers."""
        for worker in self.workers.values():
            worker.deleting.set()
        tasks = [w.task for w in self.workers.values() if w.task is not None and not w.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=40)
            for task in pending:
                task.cancel()
        for pool in self.pools.values():
            await pool.close()
        if self.fork_server is not None and self.fork_server.returncode is None:
            assert self.fork_server.stdin is not None
            self.fork_server.stdin.close()  # the server's end: it SIGKILLs any simulator still running
            try:
                await asyncio.wait_for(self.fork_server.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.fork_server.pid, 9)
                await self.fork_server.wait()
        for task in list(self._background):
            task.cancel()
        # A pod deleted while the runner stopped has no worker left to release it: without this sweep it
        # would stay Terminating for good (and a `kubectl delete --wait` of it would never return).
        with contextlib.suppress(KubeError):
            for pod in (await self.client.list_all(PODS)).items:
                meta = pod["metadata"]
                if pod["spec"].get("nodeName") in self.topology.by_name and FINALIZER in (meta.get("finalizers") or ()):
                    await release_finalizer(self.client, meta["namespace"], meta["name"], meta["uid"])

    # -- for tests

    def worker(self, namespace: str, name: str) -> PodWorker | None:
        for worker in self.workers.values():
            if worker.namespace == namespace and worker.name == name and not worker.deleting.is_set():
                return worker
        return None

    def pod_log(self, namespace: str, name: str, container: str) -> str:
        path = self.state_dir / "logs" / f"{namespace}_{name}_{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""
