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

The gRPC library is grpclib (pure Python on `h2`, a few MiB where grpcio's core costs the agent ~11 MiB and
seven threads); only this module and `wire` (its codec) import it. Messages and method tables are
`kubelet_api`'s, encoded by `wire` (grpclib's `codec=`): the agent does not load the protobuf runtime. What
grpclib leaves to its user is done here: a request's declared length is checked before it is read
(`MAX_MESSAGE_BYTES`), and `stop(grace_s)` drains as grpcio's did: new calls get UNAVAILABLE, calls in flight
get the grace period, then are cancelled and told UNAVAILABLE. Everything runs on the caller's event loop;
servicer methods never block it (the Preparer is async). Start order is DRA first, registration second, so
the kubelet never learns an endpoint that is not listening yet; stale socket files from a previous run are
removed before listening and again after stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Server, Stream

from computedomain.api.constants import DRIVER_NAME, HEALTH_PORT
from computedomain.plugin import kubelet_api as api
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
from computedomain.plugin.wire import CODEC, Message, WireError

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
#: the largest request message read (grpc's default receive limit); grpclib itself would buffer any size
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
#: how long stop() waits for cancelled calls to end
STOP_WAIT_S: Final = 1.0


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


def tcp_address(host: str, port: int) -> str:
    """gRPC's `host:port`: empty host -> every address (`[::]`, dual-stack), IPv6 literals bracketed."""
    if not host:
        return f"[::]:{port}"
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


# --- gRPC plumbing on grpclib ----------------------------------------------------------------------------


class _Calls:
    """The unary calls in progress on a PluginServer's servers, so that stop() can let them finish. Once
    draining, a new call is refused with UNAVAILABLE (a kubelet keeps its connection across our stop)."""

    def __init__(self) -> None:
        self.running = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        if self.draining:
            raise GRPCError(Status.UNAVAILABLE, "the node agent is stopping")
        self.running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.running -= 1
            if not self.running:
                self._idle.set()

    async def drained(self, within_s: float) -> bool:
        self.draining = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._idle.wait()
        return not self.running


async def _receive(stream: Stream[Any, Any], message_type: type[Message]) -> Any:
    """The request message, bounded: grpclib's own `recv_message` buffers whatever length the peer declares,
    and the health port is reachable from the pod network."""
    h2: Any = stream._stream  # grpclib.protocol.Stream: the only way to read the length prefix first
    prefix = await h2.recv_data(5)
    if len(prefix) != 5:
        raise GRPCError(Status.INTERNAL, "the request has no message")
    if prefix[0]:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
    size = int.from_bytes(prefix[1:], "big")
    if size > MAX_MESSAGE_BYTES:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, f"received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})")
    try:
        return message_type.decode(await h2.recv_data(size))
    except WireError as exc:
        raise GRPCError(Status.INTERNAL, f"the request is not a {message_type.FULL_NAME}: {exc}") from exc


@contextlib.asynccontextmanager
async def _told_when_stopped(calls: _Calls, stream: Stream[Any, Any]) -> AsyncIterator[None]:
    """A call cancelled by stop() ends with UNAVAILABLE on the wire. grpclib would only cancel the handler and
    leave the caller waiting for its deadline on a connection that stays open."""
    try:
        yield
    except asyncio.CancelledError:
        if calls.draining:
            with contextlib.suppress(Exception):
                await stream.send_trailing_metadata(
                    status=Status.UNAVAILABLE, status_message="the node agent stopped before the call finished"
                )
        raise


def _mapping(calls: _Calls, service: api.Service, servicer: object) -> dict[str, Handler]:
    """grpclib's method table for `service`, served by `servicer`'s methods of the same names:
    `async def M(request) -> reply`, or an async generator of replies for a server stream."""
    table: dict[str, Handler] = {}
    for method in service.methods:
        impl = getattr(servicer, method.name)
        request_type = method.request
        if method.server_streaming:

            async def serve(stream: Stream[Any, Any], impl: Any = impl, request_type: Any = request_type) -> None:
                request = await _receive(stream, request_type)
                async with _told_when_stopped(calls, stream):
                    async for reply in impl(request):
                        await stream.send_message(reply)

            cardinality = Cardinality.UNARY_STREAM
        else:

            async def serve(stream: Stream[Any, Any], impl: Any = impl, request_type: Any = request_type) -> None:
                with calls.one():
                    request = await _receive(stream, request_type)
                    async with _told_when_stopped(calls, stream):
                        reply = await impl(request)
                    await stream.send_message(reply)

            cardinality = Cardinality.UNARY_UNARY
        table[service.path(method.name)] = Handler(serve, cardinality, request_type, method.reply)
    return table


@dataclass(frozen=True)
class _Servable:
    """What grpclib's Server takes: an object with a method table."""

    table: Mapping[str, Handler]

    def __mapping__(self) -> Mapping[str, Handler]:
        return self.table


SERVING: Final = api.SERVING
NOT_SERVING: Final = api.NOT_SERVING


# --- DRA node service ------------------------------------------------------------------------------------


class _DraService:
    """One servicer object per DRA wire version (they share the message classes; v1beta1 has no share_id)."""

    def __init__(self, preparer: Preparer, version: str, *, carries_share_id: bool) -> None:
        self._preparer = preparer
        self._version = version
        self._carries_share_id = carries_share_id

    @staticmethod
    def _claims(request: api.NodePrepareResourcesRequest | api.NodeUnprepareResourcesRequest) -> list[ClaimRef]:
        seen: dict[str, ClaimRef] = {}
        for claim in request.claims:
            seen.setdefault(claim.uid, ClaimRef(claim.namespace, claim.name, ClaimUid(claim.uid)))
        return list(seen.values())

    async def NodePrepareResources(  # noqa: N802 (gRPC name)
        self, request: api.NodePrepareResourcesRequest
    ) -> api.NodePrepareResourcesResponse:
        claims = self._claims(request)
        response = api.NodePrepareResourcesResponse()
        if not claims:
            return response
        log.debug("NodePrepareResources version=%s claims=%s", self._version, ",".join(map(str, claims)))
        try:
            results: Mapping[ClaimUid, PrepareResult] = await self._preparer.prepare(claims)
        except Exception as exc:
            log.exception("prepare raised version=%s claims=%s", self._version, ",".join(map(str, claims)))
            raise GRPCError(Status.INTERNAL, f"prepare failed: {exc}") from exc
        for claim in claims:
            result = results.get(claim.uid)
            if result is None:
                log.info("prepare not finished; the kubelet will retry claim=%s", claim)
                continue
            response.claims[claim.uid] = api.NodePrepareResourceResponse(
                devices=[
                    api.Device(
                        request_names=[strip_subrequest(n) for n in device.request_names],
                        pool_name=device.pool_name,
                        device_name=device.device_name,
                        cdi_device_ids=list(device.cdi_device_ids),
                        share_id=device.share_id if self._carries_share_id else None,
                    )
                    for device in result.devices
                ],
                error=result.error,
            )
        return response

    async def NodeUnprepareResources(  # noqa: N802 (gRPC name)
        self, request: api.NodeUnprepareResourcesRequest
    ) -> api.NodeUnprepareResourcesResponse:
        claims = self._claims(request)
        response = api.NodeUnprepareResourcesResponse()
        if not claims:
            return response
        log.debug("NodeUnprepareResources version=%s claims=%s", self._version, ",".join(map(str, claims)))
        try:
            results: Mapping[ClaimUid, UnprepareResult] = await self._preparer.unprepare(claims)
        except Exception as exc:
            log.exception("unprepare raised version=%s claims=%s", self._version, ",".join(map(str, claims)))
            raise GRPCError(Status.INTERNAL, f"unprepare failed: {exc}") from exc
        for claim in claims:
            result = results.get(claim.uid)
            if result is None:
                log.info("unprepare not finished; the kubelet will retry claim=%s", claim)
                continue
            response.claims[claim.uid] = api.NodeUnprepareResourceResponse(error=result.error)
        return response


class _ResourceHealthService:
    """`v1alpha1.DRAResourceHealth`: every report of `HealthReports` as one message, until the kubelet hangs up."""

    def __init__(self, reports: HealthReports) -> None:
        self._reports = reports

    async def NodeWatchResources(  # noqa: N802 (gRPC name)
        self, request: api.NodeWatchResourcesRequest
    ) -> AsyncIterator[api.NodeWatchResourcesResponse]:
        log.debug("kubelet opened the device health stream devices=%s", ",".join(self._reports.devices))
        async for at, devices in self._reports.stream():
            yield api.NodeWatchResourcesResponse(
                devices=[
                    api.DeviceHealth(
                        device=api.DeviceIdentifier(pool_name=self._reports.pool, device_name=d.device),
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
        self._info = api.PluginInfo(
            type=PLUGIN_TYPE,
            name=driver_name,
            endpoint=str(endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )
        self._on_status = on_status

    async def GetInfo(self, request: api.InfoRequest) -> api.PluginInfo:  # noqa: N802 (gRPC name)
        return self._info

    async def NotifyRegistrationStatus(  # noqa: N802 (gRPC name)
        self, request: api.RegistrationStatus
    ) -> api.RegistrationStatusResponse:
        self._on_status(RegistrationStatus(registered=request.plugin_registered, error=request.error))
        return api.RegistrationStatusResponse()


# --- health ------------------------------------------------------------------------------------------------


class _HealthService:
    def __init__(self, self_check: Any, readiness: Callable[[], Sequence[str]]) -> None:
        self._self_check = self_check
        self._readiness = readiness

    async def _status(self, service: str) -> int:
        problem = await self._self_check()
        if problem:
            log.warning("health check failed: %s", problem)
            return NOT_SERVING
        if service == READINESS_SERVICE and self._readiness():
            return NOT_SERVING  # the agent logged why when it happened
        return SERVING

    async def Check(self, request: api.HealthCheckRequest) -> api.HealthCheckResponse:  # noqa: N802 (gRPC name)
        if request.service not in HEALTH_SERVICES | {READINESS_SERVICE}:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {request.service!r}")
        return api.HealthCheckResponse(status=await self._status(request.service))

    async def List(self, request: api.HealthListRequest) -> api.HealthListResponse:  # noqa: N802 (gRPC name)
        statuses = {name: await self._status(name) for name in (*sorted(HEALTH_SERVICES), READINESS_SERVICE)}
        return api.HealthListResponse(
            statuses={name: api.HealthCheckResponse(status=s) for name, s in statuses.items()}
        )

    async def Watch(self, request: api.HealthCheckRequest) -> AsyncIterator[api.HealthCheckResponse]:  # noqa: N802
        raise GRPCError(Status.UNIMPLEMENTED, "Watch is not served; poll Check")
        yield  # an async generator, as a server stream's method is


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
        self._calls = _Calls()
        # Started servers, in stop order: registration first, so the kubelet stops routing to us first.
        self._servers: dict[str, Server] = {}
        self.health_port: int | None = None
        self.registration_status: RegistrationStatus | None = None
        self.registered = asyncio.Event()

    # -- lifecycle

    async def start(self) -> None:
        if self._servers or self._calls.draining:
            raise RuntimeError("PluginServer already started")
        calls = self._calls
        dra = _Servable(
            _mapping(calls, api.DRA_V1, _DraService(self._preparer, "v1", carries_share_id=True))
            | _mapping(calls, api.DRA_V1BETA1, _DraService(self._preparer, "v1beta1", carries_share_id=False))
            | _mapping(calls, api.DRA_HEALTH, _ResourceHealthService(self.device_health))
        )
        registration = _Servable(
            _mapping(
                calls,
                api.REGISTRATION,
                _RegistrationService(self.driver_name, self.paths.dra, self._record_registration),
            )
        )
        try:
            await self._start_unix("dra", self.paths.dra, dra)
            await self._start_unix("registration", self.paths.registration, registration)
            if self._health_port_wanted is not None:
                listener = _tcp_listener(self._health_host, self._health_port_wanted)
                self.health_port = int(listener.getsockname()[1])
                health = _Servable(_mapping(calls, api.GRPC_HEALTH, _HealthService(self.self_check, self._readiness)))
                server = Server([health], codec=CODEC)
                await server.start(sock=listener)
                self._servers["health"] = server
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
        """Refuse new calls, let those in flight finish for up to grace_s, close, remove the socket files."""
        servers = [self._servers[name] for name in ("registration", "dra", "health") if name in self._servers]
        self._servers.clear()
        if not await self._calls.drained(grace_s):
            log.warning(
                "stopping with %d call(s) unfinished after %gs; they are cancelled", self._calls.running, grace_s
            )
        for server in servers:
            server.close()
        for server in servers:
            # grpclib waits for the cancelled calls; bounded, as a call that ignores its cancellation must not
            # hold the process.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_WAIT_S):
                    await server.wait_closed()
        for path in (self.paths.registration, self.paths.dra):
            with contextlib.suppress(OSError):
                remove_stale_socket(path)

    async def __aenter__(self) -> PluginServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _start_unix(self, name: str, path: Path, servable: _Servable) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(path)
        server = Server([servable], codec=CODEC)
        await server.start(path=str(path))
        self._servers[name] = server

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
            channel = Channel(path=str(self.paths.registration), codec=CODEC)
            try:
                info = await _unary(channel, api.REGISTRATION, "GetInfo")(api.InfoRequest(), timeout=deadline)
            finally:
                channel.close()
            if info.name != self.driver_name or info.endpoint != str(self.paths.dra):
                where = self.paths.registration
                return f"registration socket {where} answers for {info.name} at {info.endpoint}"
            channel = Channel(path=str(self.paths.dra), codec=CODEC)
            try:
                for service in (api.DRA_V1, api.DRA_V1BETA1):
                    await _unary(channel, service, "NodePrepareResources")(
                        api.NodePrepareResourcesRequest(), timeout=deadline
                    )
            finally:
                channel.close()
        except GRPCError as exc:
            return f"self-call over unix socket failed: {exc.status.name}: {exc.message}"
        except (OSError, TimeoutError, StreamTerminatedError) as exc:
            return f"self-call over unix socket failed: UNAVAILABLE: {exc or type(exc).__name__}"
        return None


def _unary(channel: Channel, service: api.Service, method: str) -> UnaryUnaryMethod[Any, Any]:
    described = service.method(method)
    return UnaryUnaryMethod(channel, service.path(method), described.request, described.reply)


def _tcp_listener(host: str, port: int) -> socket.socket:
    """The health server's listening socket: on host, or on every address (dual-stack where the kernel
    has IPv6). Made here so that port 0 yields one port, which `health_port` reports."""
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host.strip("[]"), port), family=family)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))
