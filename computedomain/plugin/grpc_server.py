"""The node agent's gRPC surface: everything the kubelet and the kubelet's probes talk to.

Owns three asyncio gRPC servers and the socket files they listen on:

- plugin registration (`pluginregistration.Registration`) on `<registrar dir>/<driver>-reg.sock`, which the
  kubelet's plugin watcher finds; GetInfo answers with the absolute path of the DRA socket and the DRA
  service versions served; NotifyRegistrationStatus is recorded and logged;
- the DRA node service in both wire versions (`k8s.io.kubelet.pkg.apis.dra.v1` and `...v1beta1`) on
  `<plugins dir>/<driver>/dra.sock`; both translate into the version-free model of `preparer` and delegate
  to an injected `Preparer`; beside them on the same socket the kubelet's device health stream
  (`v1alpha1.DRAResourceHealth/NodeWatchResources`), which relays `health.HealthReports`;
- `grpc.health.v1` on TCP (the pod probes; on the pod IP when it is known, else on every address), services
  `""` and `liveness`, whose Check dials the two unix sockets above by path, so a deleted socket file or a
  wedged server turns into NOT_SERVING; and `readiness`, which is also NOT_SERVING while the agent reports a
  problem (a cache whose list or watch the apiserver refuses: the log line names the verb and resource).

This is the only module of the package that imports grpc. Everything runs on the caller's event loop;
servicer methods never block it (the Preparer is async). Start order is DRA first, registration second,
so the kubelet never learns an endpoint that is not listening yet; stale socket files from a previous run
are removed before listening and again after stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from computedomain.api.constants import DRIVER_NAME, HEALTH_PORT
from computedomain.plugin.health import HealthReports
from computedomain.plugin.preparer import (
    ClaimRef,
    ClaimUid,
    Preparer,
    PrepareResult,
    RegistrationStatus,
    UnprepareResult,
    strip_subrequest,
)
from computedomain.plugin.proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)

# The generated *_pb2_grpc glue has no type stubs; treat it as dynamic rather than sprinkle ignores.
_dra_v1_grpc: Any = dra_v1_pb2_grpc
_dra_v1beta1_grpc: Any = dra_v1beta1_pb2_grpc
_registration_grpc: Any = pluginregistration_v1_pb2_grpc
_dra_health_grpc: Any = dra_health_v1alpha1_pb2_grpc
_dra_health: Any = dra_health_v1alpha1_pb2

log = logging.getLogger(__name__)

DEFAULT_REGISTRAR_DIR: Final = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR: Final = Path("/var/lib/kubelet/plugins")
PLUGIN_TYPE: Final = "DRAPlugin"
# The gRPC service names, as the kubelet expects them in PluginInfo.supported_versions (preferred first).
DRA_V1: Final = "v1.DRAPlugin"
DRA_V1BETA1: Final = "v1beta1.DRAPlugin"
SUPPORTED_VERSIONS: Final = (DRA_V1, DRA_V1BETA1)
HEALTH_SERVICES: Final = frozenset({"", "liveness"})
READINESS_SERVICE: Final = "readiness"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH: Final = 107


class SocketPathError(ValueError):
    """A socket path that cannot be used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class SocketPaths:
    registration: Path
    dra: Path

    @classmethod
    def for_driver(
        cls,
        registrar_dir: Path = DEFAULT_REGISTRAR_DIR,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        driver_name: str = DRIVER_NAME,
    ) -> SocketPaths:
        """The kubelet's layout. Paths must be the same inside the container and on the host, because
        the endpoint we report is dialled by the kubelet."""
        return cls(
            registration=registrar_dir.absolute() / f"{driver_name}-reg.sock",
            dra=plugins_dir.absolute() / driver_name / "dra.sock",
        )


def _check_socket_path(path: Path) -> None:
    if not path.is_absolute():
        raise SocketPathError(f"socket path {path} must be absolute (the kubelet dials it as given)")
    if len(str(path).encode()) > MAX_UNIX_SOCKET_PATH:
        raise SocketPathError(
            f"socket path {path} is longer than {MAX_UNIX_SOCKET_PATH} bytes, the limit of unix sockets; "
            "use a shorter kubelet registrar/plugins directory"
        )


def remove_stale_socket(path: Path) -> bool:
    """Remove what a previous run left at path. Returns whether something was removed. A directory
    there is a configuration error, not something to delete."""
    if path.is_dir() and not path.is_symlink():
        raise SocketPathError(f"{path} is a directory; expected a unix socket path")
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    log.info("removed stale socket path=%s", path)
    return True


def _unix_target(path: Path) -> str:
    return f"unix:{path}"


def tcp_address(host: str, port: int) -> str:
    """gRPC's `host:port`: empty host -> every address (`[::]`, dual-stack), IPv6 literals bracketed."""
    if not host:
        return f"[::]:{port}"
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


# --- DRA node service ------------------------------------------------------------------------------------


class _DraService:
    """One servicer object for both DRA wire versions; `pb2` selects the message classes."""

    def __init__(self, pb2: ModuleType, preparer: Preparer, version: str, *, carries_share_id: bool) -> None:
        self._pb2 = pb2
        self._preparer = preparer
        self._version = version
        self._carries_share_id = carries_share_id

    @staticmethod
    def _claims(request: Any) -> list[ClaimRef]:
        seen: dict[str, ClaimRef] = {}
        for claim in request.claims:
            seen.setdefault(claim.uid, ClaimRef(claim.namespace, claim.name, ClaimUid(claim.uid)))
        return list(seen.values())

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        claims = self._claims(request)
        response = self._pb2.NodePrepareResourcesResponse()
        if not claims:
            return response
        log.debug("NodePrepareResources version=%s claims=%s", self._version, ",".join(map(str, claims)))
        try:
            results: Mapping[ClaimUid, PrepareResult] = await self._preparer.prepare(claims)
        except Exception as exc:
            log.exception("prepare raised version=%s claims=%s", self._version, ",".join(map(str, claims)))
            await context.abort(grpc.StatusCode.INTERNAL, f"prepare failed: {exc}")
            raise  # abort raises; this only satisfies the type checker
        for claim in claims:
            result = results.get(claim.uid)
            if result is None:
                log.info("prepare not finished; the kubelet will retry claim=%s", claim)
                continue
            entry = response.claims[claim.uid]
            entry.error = result.error
            for device in result.devices:
                out = entry.devices.add(
                    request_names=[strip_subrequest(n) for n in device.request_names],
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=list(device.cdi_device_ids),
                )
                if self._carries_share_id and device.share_id is not None:
                    out.share_id = device.share_id
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        claims = self._claims(request)
        response = self._pb2.NodeUnprepareResourcesResponse()
        if not claims:
            return response
        log.debug("NodeUnprepareResources version=%s claims=%s", self._version, ",".join(map(str, claims)))
        try:
            results: Mapping[ClaimUid, UnprepareResult] = await self._preparer.unprepare(claims)
        except Exception as exc:
            log.exception("unprepare raised version=%s claims=%s", self._version, ",".join(map(str, claims)))
            await context.abort(grpc.StatusCode.INTERNAL, f"unprepare failed: {exc}")
            raise
        for claim in claims:
            result = results.get(claim.uid)
            if result is None:
                log.info("unprepare not finished; the kubelet will retry claim=%s", claim)
                continue
            response.claims[claim.uid].error = result.error
        return response


class _ResourceHealthService:
    """`v1alpha1.DRAResourceHealth`: every report of `HealthReports` as one message, until the kubelet hangs up."""

    def __init__(self, reports: HealthReports) -> None:
        self._reports = reports

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802 (gRPC name)
        log.debug("kubelet opened the device health stream devices=%s", ",".join(self._reports.devices))
        async for at, devices in self._reports.stream():
            yield _dra_health.NodeWatchResourcesResponse(
                devices=[
                    _dra_health.DeviceHealth(
                        device=_dra_health.DeviceIdentifier(pool_name=self._reports.pool, device_name=d.device),
                        health=int(d.health),
                        last_updated_time=int(at),
                        health_check_timeout_seconds=self._reports.timeout_s,
                        message=d.message,
                    )
                    for d in devices
                ]
            )


# --- registration ------------------------------------------------------------------------------------------


class _RegistrationService:
    def __init__(self, driver_name: str, endpoint: Path, on_status: Any) -> None:
        self._info = pluginregistration_v1_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=driver_name,
            endpoint=str(endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )
        self._on_status = on_status

    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        return self._info

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        self._on_status(RegistrationStatus(registered=request.plugin_registered, error=request.error))
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


# --- health ------------------------------------------------------------------------------------------------


class _HealthService:
    def __init__(self, self_check: Any, readiness: Callable[[], Sequence[str]]) -> None:
        self._self_check = self_check
        self._readiness = readiness

    async def _status(self, service: str) -> Any:
        problem = await self._self_check()
        if problem:
            log.warning("health check failed: %s", problem)
            return health_pb2.HealthCheckResponse.NOT_SERVING
        if service == READINESS_SERVICE and self._readiness():
            return health_pb2.HealthCheckResponse.NOT_SERVING  # the agent logged why when it happened
        return health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        if request.service not in HEALTH_SERVICES | {READINESS_SERVICE}:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=await self._status(request.service))

    async def List(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        statuses = {name: await self._status(name) for name in (*sorted(HEALTH_SERVICES), READINESS_SERVICE)}
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in statuses.items()}
        )

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 (gRPC name)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served; poll Check")


# --- the whole surface -------------------------------------------------------------------------------------


class PluginServer:
    """Registration + DRA (v1, v1beta1) on unix sockets, health on TCP. `start()` then `stop()`."""

    def __init__(
        self,
        preparer: Preparer,
        paths: SocketPaths,
        *,
        driver_name: str = DRIVER_NAME,
        health_port: int | None = HEALTH_PORT,
        health_host: str = "",
        self_check_timeout_s: float = 3.0,
        readiness: Callable[[], Sequence[str]] = lambda: (),
        device_health: HealthReports | None = None,
    ) -> None:
        """health_port None disables the health server; 0 picks a free port (see `health_port`). health_host
        is the address it binds (the pod IP, so several agents on one machine do not clash); empty: all.
        device_health: what the kubelet's device health stream reports (default: no devices)."""
        for path in (paths.registration, paths.dra):
            _check_socket_path(path)
        self.paths = paths
        self.driver_name = driver_name
        self._preparer = preparer
        self._health_port_wanted = health_port
        self._health_host = health_host
        self._self_check_timeout_s = self_check_timeout_s
        self._readiness = readiness
        self.device_health = device_health or HealthReports((), pool="", host_managed=False, imex_problem=lambda: None)
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.registration_status: RegistrationStatus | None = None
        self.registered = asyncio.Event()

    # -- lifecycle

    async def start(self) -> None:
        if self._dra_server is not None:
            raise RuntimeError("PluginServer already started")
        try:
            self._dra_server = await self._start_unix(self.paths.dra, self._add_dra_services)
            self._reg_server = await self._start_unix(self.paths.registration, self._add_registration)
            if self._health_port_wanted is not None:
                self._health_server = grpc.aio.server()
                health = _HealthService(self.self_check, self._readiness)
                health_pb2_grpc.add_HealthServicer_to_server(health, self._health_server)
                address = tcp_address(self._health_host, self._health_port_wanted)
                self.health_port = self._health_server.add_insecure_port(address)
                await self._health_server.start()
        except BaseException:
            await self.stop(grace_s=0)
            raise
        log.info(
            "plugin serving driver=%s registration=%s dra=%s versions=%s health=%s",
            self.driver_name,
            self.paths.registration,
            self.paths.dra,
            ",".join(SUPPORTED_VERSIONS),
            tcp_address(self._health_host, self.health_port) if self.health_port is not None else "off",
        )

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting, let in-flight calls finish for up to grace_s, remove the socket files."""
        # Registration first: the kubelet should stop routing to us before the service goes away.
        servers = [self._reg_server, self._dra_server, self._health_server]
        self._reg_server = self._dra_server = self._health_server = None
        for server in servers:
            if server is not None:
                await server.stop(grace_s)
        for path in (self.paths.registration, self.paths.dra):
            with contextlib.suppress(OSError):
                remove_stale_socket(path)

    async def __aenter__(self) -> PluginServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _start_unix(self, path: Path, add: Any) -> grpc.aio.Server:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(path)
        server = grpc.aio.server()
        add(server)
        server.add_insecure_port(_unix_target(path))
        await server.start()
        return server

    def _add_dra_services(self, server: grpc.aio.Server) -> None:
        _dra_v1_grpc.add_DRAPluginServicer_to_server(
            _DraService(dra_v1_pb2, self._preparer, "v1", carries_share_id=True), server
        )
        _dra_v1beta1_grpc.add_DRAPluginServicer_to_server(
            _DraService(dra_v1beta1_pb2, self._preparer, "v1beta1", carries_share_id=False), server
        )
        _dra_health_grpc.add_DRAResourceHealthServicer_to_server(_ResourceHealthService(self.device_health), server)

    def _add_registration(self, server: grpc.aio.Server) -> None:
        _registration_grpc.add_RegistrationServicer_to_server(
            _RegistrationService(self.driver_name, self.paths.dra, self._record_registration), server
        )

    def _record_registration(self, status: RegistrationStatus) -> None:
        self.registration_status = status
        if status.registered:
            log.info("kubelet accepted plugin registration driver=%s", self.driver_name)
            self.registered.set()
        else:
            self.registered.clear()
            # Loud on purpose: with a rejected registration no pod on this node can get a channel.
            log.error(
                "KUBELET REJECTED PLUGIN REGISTRATION driver=%s error=%r; no claim of this driver can be "
                "prepared on this node until the kubelet accepts a new registration",
                self.driver_name,
                status.error,
            )

    # -- self check (used by the health service)

    async def self_check(self) -> str | None:
        """Dial our own sockets by path like the kubelet does. Returns None when healthy, else why not."""
        deadline = self._self_check_timeout_s
        try:
            async with grpc.aio.insecure_channel(_unix_target(self.paths.registration)) as channel:
                stub = _registration_grpc.RegistrationStub(channel)
                info = await stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=deadline)
            if info.name != self.driver_name or info.endpoint != str(self.paths.dra):
                where = self.paths.registration
                return f"registration socket {where} answers for {info.name} at {info.endpoint}"
            async with grpc.aio.insecure_channel(_unix_target(self.paths.dra)) as channel:
                await _dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    dra_v1_pb2.NodePrepareResourcesRequest(), timeout=deadline
                )
                await _dra_v1beta1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    dra_v1beta1_pb2.NodePrepareResourcesRequest(), timeout=deadline
                )
        except grpc.aio.AioRpcError as exc:
            return f"self-call over unix socket failed: {exc.code().name}: {exc.details()}"
        return None
