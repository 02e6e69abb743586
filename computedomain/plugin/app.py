"""The node agent process: `python -m computedomain kubelet-plugin`.

Wires the building blocks together and owns the process lifecycle:

start-up, in order (each failure is one line on stderr and a non-zero exit; nothing is half-started):
  1. directories: `<plugins dir>/compute-domain.nvidia.com` (checkpoint, sockets, per-domain dirs), CDI root;
  2. hardware: the clique ID (strict fabric mode refuses to start on an unfinished NVLink registration), the
     driver version when IMEX daemons use DNS names (driverManaged), and whether the node has IMEX at all
     (if not: run, publish no devices, say why; never crash-loop);
  3. the checkpoint: the reference driver's file at the same path is taken over, a file that cannot be read is
     moved aside (a Warning Event on the Node and an error line name it: never a crash loop), boot-ID rule;
     steps 1-3 call no API and run beside the apiserver's version check (`kube.version`, which refuses an
     unsupported server); the first of them to fail ends the process;
  4. the Kubernetes client, the ComputeDomain (and clique) caches, the Preparer;
  5. gRPC: DRA socket first (with the kubelet's device health stream: `health`), then registration (the
     kubelet must never learn an endpoint that does not listen yet), health on TCP (the pod IP when POD_IP is
     set, else every address);
  6. background work, each on a one-key convergence loop (`kube.converge`: backoff, one warning when it
     keeps failing): ResourceSlice publishing, clique refresh (and the `nvidia.com/gpu.clique` label),
     startup + periodic cleanup;
  7. with `HTTP_ENDPOINT` set: prometheus metrics on `METRICS_PATH`, `/healthz` and `/readyz`
     (`computedomain.http`), started by `serve` right after step 3, so a bad endpoint or a taken port is a
     start-up error too.

Readiness (`readiness()`: `/readyz` and the gRPC health service `readiness`): not ready while a cache's list
or watch is refused (RBAC); the details, and the one warning logged, name the verb and the resource.

SIGTERM/SIGINT: stop registration and DRA (in-flight calls get a grace period; an unfinished Prepare is
recorded as PrepareStarted and finished or undone by the next process), stop the background tasks, close
the client, exit 0. A SIGKILL at any point is survivable by design: see `prepare` and `checkpoint`.

Hardware comes from the driver root and `/proc` only: NVML is the driver root's `libnvidia-ml.so.1`
(`imex.nvml`), the driver's facts are `PROC_ROOT`'s files, and in driverManaged mode the base CDI spec for
the IMEX daemons (`cdi_base`) is written from the driver root at step 2. A test node differs from a GB200
node only in its (fake) driver root.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, DRIVER_NAME
from computedomain.http import EndpointError, HttpServer, start_http
from computedomain.kube.client import NODES, KubeClient, Raw
from computedomain.kube.converge import Retries
from computedomain.kube.events import EventRecorder, EventType, ObjectRef
from computedomain.kube.informer import Informer, event_reporter
from computedomain.kube.informer import problems as informer_problems
from computedomain.kube.version import UnsupportedServerError, require_supported
from computedomain.plugin.budget import Budget
from computedomain.plugin.cdi import CdiSpecDir
from computedomain.plugin.cdi_base import base_edits, write_base_spec
from computedomain.plugin.channels import ChannelRecords
from computedomain.plugin.checkpoint import CheckpointError, CheckpointStore, OpenReport
from computedomain.plugin.claims import KubeClaimReader
from computedomain.plugin.cleanup import Cleanup
from computedomain.plugin.clique_label import CliqueLabeler, NodeHardware
from computedomain.plugin.collaborators import ClaimSnapshot, HostCheck
from computedomain.plugin.daemon_owner import KubeDaemonPods
from computedomain.plugin.domains import DaemonReadinessWatch, DomainCache
from computedomain.plugin.grpc_server import PluginServer, SocketPaths
from computedomain.plugin.health import HealthReports, HostState
from computedomain.plugin.metrics import Instrumented, NodeState, watch_node
from computedomain.plugin.node_holder import NodeHolder
from computedomain.plugin.node_labels import NodeLabels
from computedomain.plugin.nvml_child import ChildNvmlSource
from computedomain.plugin.prepare import Preparer, PreparerConfig
from computedomain.plugin.resourceslice import Device, Holding, SlicePublisher, published_devices
from computedomain.settings import FeatureGate, PluginSettings
from imex.discovery import Discovery, HardwareDiscovery, HardwareError, check_driver_for_dns_names
from imex.host_check import HostCheckError, check_host_imex_ready
from imex.nvml import nvml_discovery
from imex.procfs import ProcFS

log = logging.getLogger(__name__)

COMPONENT: Final = "compute-domain-kubelet-plugin"
STOP_GRACE_S: Final = 5.0


class StartupError(Exception):
    """Start-up cannot continue; the message is the one line the operator sees."""


def make_discovery(settings: PluginSettings, *, nvml_child: ChildNvmlSource | None = None) -> HardwareDiscovery:
    """NVML from the driver root, the driver's facts from PROC_ROOT. nvml_child: each NVML read in a child
    process (`nvml_child`), so that pynvml never loads into this one; without it, NVML in process."""
    if nvml_child is not None:
        proc_root = Path(settings.proc_root)
        return Discovery(nvml_child, ProcFS(proc_root.parent, devices_path=proc_root / "devices"))
    return nvml_discovery(Path(settings.driver_root_mount), proc_root=Path(settings.proc_root))


class NodeAgent:
    """The assembled node agent. `await agent.run(stop)` serves until stop is set."""

    def __init__(
        self,
        settings: PluginSettings,
        client: KubeClient,
        discovery: HardwareDiscovery,
        *,
        boot_id_path: Path | None = None,
        host_check: HostCheck | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.plugin_dir = Path(settings.kubelet_plugins_dir) / DRIVER_NAME
        self.paths = SocketPaths.for_driver(Path(settings.kubelet_registrar_dir), Path(settings.kubelet_plugins_dir))
        self.hardware = NodeHardware(
            discovery, crash_on_fabric_errors=settings.gate(FeatureGate.CRASH_ON_NVLINK_FABRIC_ERRORS)
        )
        store_kwargs: dict[str, Any] = {"boot_id_path": boot_id_path} if boot_id_path else {}
        self.store = CheckpointStore(self.plugin_dir, cdi_root=Path(settings.cdi_root), **store_kwargs)
        self.checkpoint_report = OpenReport()
        self.cdi = CdiSpecDir(Path(settings.cdi_root))
        self.events = EventRecorder(client, component=COMPONENT, instance=settings.pod_name or settings.node_name)
        self.domains = DomainCache(client)
        self.readiness = DaemonReadinessWatch(
            client,
            self.domains,
            node_name=settings.node_name,
            driver_namespace=settings.namespace,
            use_cliques=settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES),
            dns_names=settings.gate(FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES),
        )
        self.node_informer: Informer[Raw] = Informer(
            client, NODES, decode=lambda raw: raw, field_selector=f"metadata.name={settings.node_name}", name="node"
        )
        self.labels = NodeLabels(client, settings.node_name, self.node_informer)
        self.claims = KubeClaimReader(client)
        if host_check is None and settings.host_managed:
            host_check = self._host_check
        self.channels: ChannelRecords | None = None
        self.channel_devices = settings.imex_channel_claims_per_node
        if settings.channel_isolation:
            self.channels = ChannelRecords(
                client, node_name=settings.node_name, namespace=settings.namespace, domains=self.domains
            )
        self.preparer = Preparer(
            PreparerConfig(
                node_name=settings.node_name,
                plugin_dir=self.plugin_dir,
                host_managed=settings.host_managed,
                budget=Budget(settings.prepare_budget, settings.prepare_backoff_initial, settings.prepare_backoff_max),
                daemon_namespaces=settings.managed_namespaces,
                channel_devices=self.channel_devices,
            ),
            store=self.store,
            cdi_dir=self.cdi,
            claims=self.claims,
            domains=self.domains,
            labels=self.labels,
            readiness=self.readiness,
            hardware=self.hardware,
            host_check=host_check,
            daemon_pods=KubeDaemonPods(client),
            channels=self.channels,
            on_change=self._holder_changed,
            notify=self._tell_pods,
        )
        self.retries = Retries.of(settings)
        self.cleanup = Cleanup(
            self.preparer,
            self.cdi,
            claim_uid=self.claims.claim_uid,
            known_domains=lambda: self.domains.known_uids() if self.domains.informer.synced else None,
            domains_dir=self.preparer.config.domains_dir,
            interval_s=settings.cleanup_interval,
            retries=self.retries,
        )
        self.clique_labeler = CliqueLabeler(
            self.labels,
            self.hardware,
            # Channel isolation: the controller hands a channel only to records of the node's own clique.
            enabled=settings.gpu_clique_label_enabled or settings.channel_isolation,
            refresh_s=settings.clique_refresh_interval,
            retries=self.retries,
        )
        health_port = settings.health_port if settings.health_port >= 0 else None
        self.server = PluginServer(
            Instrumented(self.preparer, driver=DRIVER_NAME),
            self.paths,
            health_port=health_port,
            health_host=settings.pod_ip,
            readiness=lambda: self.readiness_problems(),
        )
        watch_node(
            NodeState(
                node=settings.node_name,
                driver=DRIVER_NAME,
                checkpoint=self.store.read,
                registration=lambda: self.server.registration_status,
            )
        )
        self.publisher: SlicePublisher | None = None
        self.holder: NodeHolder | None = None

    def _tell_pods(self, claim: ClaimSnapshot, message: str) -> None:
        """A Warning Event on each pod the claim is reserved for (what it waits for)."""
        for consumer in claim.status.get("reservedFor") or ():
            if isinstance(consumer, dict) and consumer.get("resource") == "pods" and consumer.get("name"):
                ref = ObjectRef(
                    kind="Pod",
                    api_version="v1",
                    name=str(consumer["name"]),
                    namespace=claim.namespace,
                    uid=str(consumer.get("uid") or "") or None,
                )
                self.events.record(ref, EventType.WARNING, "WaitingForIMEX", message)

    def _holder_changed(self) -> None:
        if self.holder is not None:
            self.holder.wake()

    def _devices(self, holding: Holding | None = None, *, imex_supported: bool = True) -> tuple[Device, ...]:
        return published_devices(
            host_managed=self.settings.host_managed,
            imex_supported=imex_supported,
            channel_devices=self.channel_devices,
            isolated=self.settings.channel_isolation,
            holding=holding,
        )

    def _domain_namespace(self, uid: str) -> str | None:
        cd = self.domains.lookup(uid)
        return cd.metadata.namespace if cd is not None else None

    async def _run_holder(self) -> None:
        """The holder decides what the slice offers first (the publisher waits for it): a node held before a
        restart must not look free for a moment."""
        assert self.holder is not None
        await self.node_informer.has_synced()
        await self.domains.informer.has_synced()
        await self.holder.publisher.informer.has_synced()
        await self.holder.run()

    def informers(self) -> list[Informer[Any]]:
        slices = [self.publisher.informer] if self.publisher is not None else []
        records = [self.channels.informer] if self.channels is not None else []
        return [self.domains.informer, self.node_informer, *self.readiness.informers(), *records, *slices]

    def readiness_problems(self) -> list[str]:
        """Why the agent cannot keep its caches current (a refused list or watch), for readiness."""
        return informer_problems(*self.informers())

    def readiness_report(self) -> tuple[bool, dict[str, Any]]:
        problems = self.readiness_problems()
        return not problems, {"ready": not problems, "node": self.settings.node_name, "problems": problems}

    async def _host_check(self) -> None:
        try:
            await check_host_imex_ready(
                driver_root=Path(self.settings.driver_root_mount), socket_path=self.settings.imex_host_socket_path
            )
        except HostCheckError as exc:
            self.server.device_health.note_host_check(HostState(ready=False, detail=str(exc)))
            raise
        self.server.device_health.note_host_check(HostState(ready=True, detail="READY"))

    def prepare_startup(self) -> None:
        """Steps 1-3 of the module docstring (blocking; raises StartupError)."""
        settings = self.settings
        try:
            self.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            cdi_root = Path(settings.cdi_root)
            if cdi_root.exists() and not cdi_root.is_dir():
                raise StartupError(f"CDI_ROOT {cdi_root} exists and is not a directory")
            cdi_root.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create the plugin directories: {exc}") from None
        try:
            clique = self.hardware.load()
        except HardwareError as exc:
            raise StartupError(str(exc)) from None
        no_imex = self.hardware.imex_support()
        if no_imex is None and not settings.host_managed and settings.gate(FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES):
            try:
                check_driver_for_dns_names(self.hardware.discovery.driver_version())
            except HardwareError as exc:
                raise StartupError(str(exc)) from None
        if not settings.host_managed:
            self._write_base_spec(require_imex=bool(clique) and no_imex is None)
        try:
            self.checkpoint_report = self.store.open()
        except (CheckpointError, OSError) as exc:
            raise StartupError(f"cannot open the checkpoint in {self.plugin_dir}: {exc}") from None
        devices = self._devices(imex_supported=no_imex is None)
        # Every name a channel device may have here (driverManaged: the further places while a domain holds it).
        names = [d.name for d in self._devices(Holding(""), imex_supported=no_imex is None)]
        self.server.device_health = HealthReports(
            names,
            pool=settings.node_name,
            host_managed=settings.host_managed,
            imex_problem=self.hardware.imex_support,
        )
        self.publisher = SlicePublisher(
            self.client,
            node_name=settings.node_name,
            devices=devices,
            events=self.events,
            no_imex_reason=no_imex,
            retries=self.retries,
            wait_for_devices=bool(devices) and not settings.host_managed and not settings.channel_isolation,
        )
        if devices and not settings.host_managed and not settings.channel_isolation:
            self.holder = NodeHolder(
                self.client,
                self.publisher,
                node_name=settings.node_name,
                read_checkpoint=self.store.read,
                node_label=lambda: self.labels.cached(COMPUTE_DOMAIN_LABEL),
                domain_namespace=self._domain_namespace,
                devices=self._devices,
                retries=self.retries,
            )
        log.info(
            "node agent starting node=%s mode=%s clique=%r imex=%s reboot_invalidated=%d plugin_dir=%s cdi_root=%s",
            settings.node_name,
            settings.imex_mode,
            clique,
            "yes" if no_imex is None else f"no ({no_imex})",
            len(self.checkpoint_report.invalidated),
            self.plugin_dir,
            settings.cdi_root,
        )

    def _write_base_spec(self, *, require_imex: bool) -> None:
        """The IMEX daemons' CDI device `.../device=all` from the driver root (`cdi_base`)."""
        settings = self.settings
        try:
            edits = base_edits(
                driver_root=Path(settings.driver_root_mount),
                host_driver_root=settings.driver_root,
                driver_version=str(self.hardware.discovery.driver_version()),
                require_imex=require_imex,
            )
            path = write_base_spec(Path(settings.cdi_root), edits)
        except HardwareError as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:
            raise StartupError(f"cannot write the base CDI spec into CDI_ROOT {settings.cdi_root}: {exc}") from None
        log.info(
            "wrote base CDI spec path=%s mounts=%d device_nodes=%d", path, len(edits.mounts), len(edits.device_nodes)
        )

    def report_checkpoint(self) -> None:
        """Events on the Node for what start-up found in the checkpoint file (on the event loop)."""
        report = self.checkpoint_report
        node = ObjectRef(kind="Node", api_version="v1", name=self.settings.node_name)
        if report.moved_aside is not None:
            self.events.record(node, EventType.WARNING, "CheckpointUnreadable", str(report.moved_aside))
        if report.reference_layout is not None:
            self.events.record(
                node,
                EventType.NORMAL,
                "CheckpointTakenOver",
                f"took over {report.taken_over} claim(s) from the reference driver's checkpoint "
                f"({report.reference_layout} layout) in {self.plugin_dir}; its Go checksums cannot be verified here, "
                "its structure was checked",
            )

    async def run(self, stop: asyncio.Event) -> None:
        if self.publisher is None:
            await asyncio.to_thread(self.prepare_startup)
        assert self.publisher is not None
        self.report_checkpoint()
        report = event_reporter(self.events)  # objects the caches skip (a hostile one costs only itself)
        for informer in self.informers():
            informer.add_handler(on_reject=report)
        background: list[asyncio.Task[Any]] = []

        def spawn(name: str, make: Callable[[], Any]) -> None:
            background.append(asyncio.create_task(_logged(name, make), name=name))

        spawn("cd-informer", self.domains.run)
        spawn("node-informer", self.node_informer.run)
        spawn("clique-informer", self.readiness.run)
        if self.channels is not None:
            spawn("channel-records", self.channels.run)
        await self.server.start()
        stopped: asyncio.Task[Any] = asyncio.create_task(stop.wait(), name="stop")
        trim = asyncio.create_task(_trim_heap_when(self.server.registered), name="heap-trim")
        try:
            if self.holder is not None:
                spawn("node-holder", self._run_holder)
            spawn("resourceslice", self.publisher.run)
            spawn("clique", self.clique_labeler.run)
            spawn("cleanup", self.cleanup.run)
            done, _ = await asyncio.wait([stopped, *background], return_when=asyncio.FIRST_COMPLETED)
        finally:
            log.info("node agent stopping")
            await self.server.stop(STOP_GRACE_S)
            for task in (stopped, trim, *background):
                task.cancel()
            await asyncio.gather(stopped, trim, *background, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.events.aclose(), 2.0)
        for task in done:
            if task is stopped or task.cancelled():
                continue
            if task.exception() is not None:
                raise RuntimeError(f"background task {task.get_name()} failed") from task.exception()
            raise RuntimeError(f"background task {task.get_name()} ended unexpectedly")


async def _trim_heap_when(registered: asyncio.Event) -> None:
    """Once the kubelet has accepted the registration (start-up is over: imports, the caches' first lists,
    the checkpoint and CDI work), give the heap pages start-up freed back to the kernel. glibc keeps freed
    memory at the top of its heaps for reuse and returns it only past a threshold; the agent's steady state
    never needs it again, and on every GPU node it is about half a MiB of RSS. Not glibc (musl): no-op."""
    await registered.wait()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


async def _logged(name: str, make: Callable[[], Any]) -> None:
    try:
        await make()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %s failed", name)
        raise


async def serve(settings: PluginSettings, stop: asyncio.Event, *, nvml_child: ChildNvmlSource | None = None) -> int:
    """The node agent until `stop` is set: 0 then, 1 when start-up or a background task fails (a start-up
    failure is one `error: ...` line on stderr). Installs no signal handlers: the caller owns `stop`
    (`main`: SIGTERM/SIGINT; the test bed's pod host: the container's stop). nvml_child: see
    `make_discovery` (the agent's own process: one; agents hosted several to a process: none)."""
    client = await KubeClient.for_component(settings, field_manager=COMPONENT)
    http: HttpServer | None = None
    try:
        agent = NodeAgent(settings, client, make_discovery(settings, nvml_child=nvml_child))
        try:
            # The node's own start-up (driver files, NVML, checkpoint, CDI; no API call) runs beside the version
            # check, two round trips to an apiserver that at install is busy with everything else starting;
            # whichever fails first is the one line (a bad driver root does not wait for a slow apiserver).
            await asyncio.gather(require_supported(client, "the node agent"), asyncio.to_thread(agent.prepare_startup))
            if settings.http_endpoint:
                http = await _start_http(settings, agent)
        except (UnsupportedServerError, StartupError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        try:
            await agent.run(stop)
        except RuntimeError as exc:
            log.error("node agent failed: %s", exc)
            return 1
        log.info("node agent stopped")
        return 0
    finally:
        if http is not None:
            await http.cleanup()
        await client.close()


async def _start_http(settings: PluginSettings, agent: NodeAgent) -> HttpServer:
    try:
        return await start_http(
            settings.http_endpoint, metrics_path=settings.metrics_path, readiness=agent.readiness_report
        )
    except (EndpointError, OSError) as exc:
        raise StartupError(f"cannot serve HTTP on HTTP_ENDPOINT {settings.http_endpoint!r}: {exc}") from None


async def main(settings: PluginSettings, nvml_child: ChildNvmlSource | None = None) -> int:
    """The process: `serve` until SIGTERM/SIGINT; NVML read in `nvml_child` (one started early) or a new one."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await serve(settings, stop, nvml_child=nvml_child or ChildNvmlSource(Path(settings.driver_root_mount)))
