"""The plugin's gRPC surface over real unix sockets, driven by the kubelet stand-in, with a fake Preparer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest

from computedomain.plugin.grpc_server import (
    HEALTH_BOUNDS,
    REFUSED,
    SUPPORTED_VERSIONS,
    PluginServer,
    SocketPathError,
    SocketPaths,
    _Frames,
    tcp_address,
)
from computedomain.plugin.preparer import (
    ClaimRef,
    ClaimUid,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)
from computedomain.plugin.proto import dra_v1_pb2
from tests.testbed.kubelet_client import (
    V1,
    V1BETA1,
    KubeletClient,
    PluginInfo,
    RegistrationRejectedError,
    health_check,
    health_pb2,
    unary,
)
from tests.unit.trickle import trickle

DRIVER = "compute-domain.nvidia.com"


class FakePreparer:
    """Records calls; answers from a table; a UID in `unfinished` is left out of the result."""

    def __init__(self) -> None:
        self.prepared: list[list[ClaimRef]] = []
        self.unprepared: list[list[ClaimRef]] = []
        self.unfinished: set[str] = set()
        self.failing: dict[str, str] = {}
        self.raise_on_prepare: Exception | None = None

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        self.prepared.append(list(claims))
        if self.raise_on_prepare is not None:
            raise self.raise_on_prepare
        out: dict[ClaimUid, PrepareResult] = {}
        for c in claims:
            if c.uid in self.unfinished:
                continue
            if c.uid in self.failing:
                out[c.uid] = PrepareResult(error=self.failing[c.uid])
                continue
            out[c.uid] = PrepareResult(
                devices=(
                    PreparedDevice(
                        request_names=("channel/sub",),
                        pool_name="node-a",
                        device_name="channel-0",
                        cdi_device_ids=(f"k8s.compute-domain.nvidia.com/claim={c.uid}-channel-0",),
                        share_id="share-1",
                    ),
                )
            )
        return out

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        self.unprepared.append(list(claims))
        return {
            c.uid: UnprepareResult(error=self.failing.get(c.uid, "")) for c in claims if c.uid not in self.unfinished
        }


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="cdp", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def paths(short_dir: Path) -> SocketPaths:
    return SocketPaths.for_driver(short_dir / "registry", short_dir / "plugins", DRIVER)


@pytest.fixture
def preparer() -> FakePreparer:
    return FakePreparer()


@pytest.fixture
async def server(preparer: FakePreparer, paths: SocketPaths) -> AsyncIterator[PluginServer]:
    srv = PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1")
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace_s=0)


CLAIM_A = ClaimRef("ns1", "claim-a", ClaimUid("11111111-1111-1111-1111-111111111111"))
CLAIM_B = ClaimRef("ns2", "claim-b", ClaimUid("22222222-2222-2222-2222-222222222222"))


def test_socket_layout_is_the_kubelets(short_dir: Path) -> None:
    p = SocketPaths.for_driver(short_dir / "reg", short_dir / "plug", DRIVER)
    assert p.registration == short_dir / "reg" / "compute-domain.nvidia.com-reg.sock"
    assert p.dra == short_dir / "plug" / "compute-domain.nvidia.com" / "dra.sock"


async def test_registration_handshake(server: PluginServer, paths: SocketPaths) -> None:
    assert stat.S_ISSOCK(paths.registration.stat().st_mode)
    assert stat.S_ISSOCK(paths.dra.stat().st_mode)
    async with KubeletClient(paths.registration) as kubelet:
        assert kubelet.info is not None
        assert kubelet.info.type == "DRAPlugin"
        assert kubelet.info.name == DRIVER
        assert kubelet.info.endpoint == str(paths.dra)
        assert kubelet.info.supported_versions == SUPPORTED_VERSIONS == (V1, V1BETA1)
        assert kubelet.version == V1
    assert server.registration_status is not None
    assert server.registration_status.registered
    assert server.registered.is_set()


@pytest.mark.parametrize("version", [V1, V1BETA1])
async def test_prepare_unprepare_round_trip(
    server: PluginServer, paths: SocketPaths, preparer: FakePreparer, version: str
) -> None:
    async with KubeletClient(paths.registration, only_version=version) as kubelet:
        assert kubelet.version == version
        results = await kubelet.prepare([CLAIM_A, CLAIM_B, CLAIM_A])
        # Duplicates are collapsed before the Preparer sees them; identity fields arrive intact.
        assert preparer.prepared == [[CLAIM_A, CLAIM_B]]
        assert set(results) == {CLAIM_A.uid, CLAIM_B.uid}
        device = results[CLAIM_A.uid].devices[0]
        assert results[CLAIM_A.uid].error == ""
        assert device.request_names == ("channel",)  # subrequest stripped
        assert device.pool_name == "node-a"
        assert device.device_name == "channel-0"
        assert device.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={CLAIM_A.uid}-channel-0",)
        assert device.share_id == ("share-1" if version == V1 else None)

        unprepared = await kubelet.unprepare([CLAIM_B])
        assert preparer.unprepared == [[CLAIM_B]]
        assert unprepared == {CLAIM_B.uid: UnprepareResult()}


async def test_errors_and_unfinished_claims(server: PluginServer, paths: SocketPaths, preparer: FakePreparer) -> None:
    preparer.failing[CLAIM_A.uid] = "permanent: unknown field 'foo'"
    preparer.unfinished.add(CLAIM_B.uid)
    async with KubeletClient(paths.registration) as kubelet:
        results = await kubelet.prepare([CLAIM_A, CLAIM_B])
        assert results == {CLAIM_A.uid: PrepareResult(error="permanent: unknown field 'foo'")}
        assert await kubelet.unprepare([CLAIM_B]) == {}


async def test_preparer_exception_is_an_rpc_error(
    server: PluginServer, paths: SocketPaths, preparer: FakePreparer
) -> None:
    preparer.raise_on_prepare = RuntimeError("boom")
    async with KubeletClient(paths.registration) as kubelet:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kubelet.prepare([CLAIM_A])
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "boom" in (err.value.details() or "")


async def test_empty_request_does_not_reach_preparer(
    server: PluginServer, paths: SocketPaths, preparer: FakePreparer
) -> None:
    async with KubeletClient(paths.registration) as kubelet:
        assert await kubelet.prepare([]) == {}
    assert preparer.prepared == []


async def test_rejected_registration_is_recorded_and_logged(
    server: PluginServer, paths: SocketPaths, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    with pytest.raises(RegistrationRejectedError, match="plugin name"):
        await KubeletClient(paths.registration, driver_name="gpu.nvidia.com").register()
    assert server.registration_status is not None
    assert not server.registration_status.registered
    assert "plugin name" in server.registration_status.error
    assert not server.registered.is_set()
    assert any("REJECTED" in r.getMessage() for r in caplog.records)


async def test_stale_sockets_removed_on_start_and_stop(preparer: FakePreparer, paths: SocketPaths) -> None:
    for path in (paths.registration, paths.dra):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("left over by a crashed run")
    srv = PluginServer(preparer, paths, health_port=None)
    await srv.start()
    try:
        assert stat.S_ISSOCK(paths.registration.stat().st_mode)
        assert stat.S_ISSOCK(paths.dra.stat().st_mode)
        async with KubeletClient(paths.registration) as kubelet:
            assert CLAIM_A.uid in await kubelet.prepare([CLAIM_A])
    finally:
        await srv.stop(grace_s=0)
    assert not paths.registration.exists()
    assert not paths.dra.exists()


async def test_directory_at_socket_path_is_refused(preparer: FakePreparer, paths: SocketPaths) -> None:
    paths.dra.mkdir(parents=True)
    srv = PluginServer(preparer, paths, health_port=None)
    with pytest.raises(SocketPathError, match="is a directory"):
        await srv.start()
    assert not paths.registration.exists()


def test_too_long_socket_path_is_refused(preparer: FakePreparer) -> None:
    deep = Path("/tmp") / ("x" * 120)
    with pytest.raises(SocketPathError, match="longer than 107 bytes"):
        PluginServer(preparer, SocketPaths.for_driver(deep, deep), health_port=None)


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await health_check(channel, service, deadline_s=10)


@pytest.mark.parametrize("service", ["liveness", ""])
async def test_health_serving(server: PluginServer, service: str) -> None:
    assert server.health_port
    assert await _health(server.health_port, service) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("host", "address"),
    [("", "[::]:51515"), ("10.1.2.3", "10.1.2.3:51515"), ("fd00::5", "[fd00::5]:51515"), ("[::1]", "[::1]:51515")],
)
def test_health_address(host: str, address: str) -> None:
    assert tcp_address(host, 51515) == address


async def test_agents_on_pod_ips_share_the_health_port(preparer: FakePreparer, short_dir: Path) -> None:
    # Two agents on one machine (the simulated cluster's pod host): each binds its pod IP, same port.
    first = PluginServer(
        preparer,
        SocketPaths.for_driver(short_dir / "r1", short_dir / "p1", DRIVER),
        health_port=0,
        health_host="127.0.0.2",
    )
    await first.start()
    try:
        assert first.health_port
        second = PluginServer(
            preparer,
            SocketPaths.for_driver(short_dir / "r2", short_dir / "p2", DRIVER),
            health_port=first.health_port,
            health_host="127.0.0.3",
        )
        await second.start()
        try:
            assert second.health_port == first.health_port
            for ip in ("127.0.0.2", "127.0.0.3"):
                async with grpc.aio.insecure_channel(f"{ip}:{first.health_port}") as channel:
                    status = await health_check(channel, "liveness", deadline_s=10)
                assert status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await second.stop(grace_s=0)
    finally:
        await first.stop(grace_s=0)


async def test_health_unknown_service(server: PluginServer) -> None:
    assert server.health_port
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _health(server.health_port, "startup")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_readiness_follows_the_agents_problems(preparer: FakePreparer, paths: SocketPaths) -> None:
    problems: list[str] = []
    srv = PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", readiness=lambda: problems)
    async with srv:
        assert srv.health_port
        assert await _health(srv.health_port, "readiness") == health_pb2.HealthCheckResponse.SERVING
        problems.append("informer computedomains: RBAC: ... may not watch computedomains.resource.nvidia.com")
        assert await _health(srv.health_port, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await _health(srv.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING, (
            "a refused cache makes the agent unready, not dead: a restart cannot fix RBAC"
        )


@pytest.mark.parametrize("which", ["registration", "dra"])
async def test_health_not_serving_when_a_socket_is_gone(
    server: PluginServer, paths: SocketPaths, preparer: FakePreparer, which: str
) -> None:
    assert server.health_port
    # Someone wiped the kubelet's plugin directory: the servers still run but nobody can reach them.
    getattr(paths, which).unlink()
    assert await _health(server.health_port, "liveness") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert preparer.prepared == []


async def test_health_self_check_uses_dra_socket(server: PluginServer, paths: SocketPaths) -> None:
    # The check must go over the socket by path: a plain v1 client sees the same service it does.
    async with grpc.aio.insecure_channel(f"unix:{paths.dra}") as channel:
        reply = await unary(
            channel,
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            dra_v1_pb2.NodePrepareResourcesRequest,
            dra_v1_pb2.NodePrepareResourcesResponse,
        )(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=10)
    assert len(reply.claims) == 0
    assert await server.self_check() is None


@pytest.mark.parametrize(
    ("offered", "pinned", "chosen"),
    [
        ((V1, V1BETA1), None, V1),
        ((V1BETA1, V1), None, V1),
        ((V1BETA1,), None, V1BETA1),
        ((V1, V1BETA1), V1BETA1, V1BETA1),
    ],
)
def test_kubelet_stand_in_prefers_v1_and_falls_back(offered: tuple[str, ...], pinned: str | None, chosen: str) -> None:
    client = KubeletClient(Path("/unused"), only_version=pinned)
    assert client._choose_version(PluginInfo("DRAPlugin", DRIVER, "/abs/dra.sock", offered)) == chosen


def test_kubelet_stand_in_rejects_bad_plugin_info() -> None:
    client = KubeletClient(Path("/unused"), only_version=V1)
    with pytest.raises(RegistrationRejectedError, match="none of the supported versions"):
        client._choose_version(PluginInfo("DRAPlugin", DRIVER, "/abs/dra.sock", (V1BETA1,)))
    with pytest.raises(RegistrationRejectedError, match="not 'DRAPlugin'"):
        client._choose_version(PluginInfo("CSIPlugin", DRIVER, "/abs/dra.sock", (V1,)))
    with pytest.raises(RegistrationRejectedError, match="absolute"):
        client._choose_version(PluginInfo("DRAPlugin", DRIVER, "dra.sock", (V1,)))


# --- what the server library leaves to us: bounded requests, the health contract, graceful stop, deadlines


async def test_health_serves_check_only(server: PluginServer) -> None:
    """Check is the kubelet's probe; Watch (a stream held open from any pod) and List (every service's
    self-check for one request) are not served."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        watch = channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in watch(health_pb2.HealthCheckRequest(), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        list_ = unary(
            channel, "/grpc.health.v1.Health/List", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await list_(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_messages_are_grpc_health_v1s() -> None:
    # The bytes of grpc.health.v1 (field 1 of each, a string and an enum) as grpc-go's prober sends and reads.
    assert health_pb2.HealthCheckRequest(service="liveness").SerializeToString() == b"\n\x08liveness"
    assert health_pb2.HealthCheckResponse.FromString(b"\x08\x02").status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"


async def test_oversized_request_is_refused_before_it_is_read(server: PluginServer) -> None:
    # A 5-byte gRPC frame prefix that declares 1 GiB: refused from the prefix, nothing buffered.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda _: b"\x0a\x03abc" + b"x" * (5 * 1024 * 1024),
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(None, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (err.value.details() or "")


class SlowPreparer(FakePreparer):
    """Prepare waits for `release`; records a cancellation."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return await super().prepare(claims)


async def test_stop_lets_a_call_in_flight_finish_and_refuses_new_ones(paths: SocketPaths) -> None:
    preparer = SlowPreparer()
    srv = PluginServer(preparer, paths, health_port=None)
    await srv.start()
    async with KubeletClient(paths.registration) as kubelet:
        call = asyncio.ensure_future(kubelet.prepare([CLAIM_A]))
        await preparer.started.wait()
        stopping = asyncio.ensure_future(srv.stop(grace_s=10))
        await asyncio.sleep(0)  # stop() has begun draining
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kubelet.unprepare([CLAIM_B])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        preparer.release.set()
        result = await call
        await stopping
    assert result[CLAIM_A.uid].devices and not preparer.cancelled.is_set()
    assert not paths.dra.exists() and not paths.registration.exists()


async def test_stop_cancels_a_call_past_the_grace_period(paths: SocketPaths) -> None:
    preparer = SlowPreparer()
    srv = PluginServer(preparer, paths, health_port=None)
    await srv.start()
    async with KubeletClient(paths.registration) as kubelet:
        call = asyncio.ensure_future(kubelet.prepare([CLAIM_A]))
        await preparer.started.wait()
        await srv.stop(grace_s=0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, "told at once, not left to the kubelet's deadline"
    assert preparer.cancelled.is_set()


async def test_the_kubelets_deadline_cancels_the_prepare(paths: SocketPaths) -> None:
    preparer = SlowPreparer()
    async with PluginServer(preparer, paths, health_port=None):
        kubelet = KubeletClient(paths.registration, timeout_s=0.2)
        async with kubelet:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kubelet.prepare([CLAIM_A])
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(preparer.cancelled.wait(), 5)


# --- the bounds of each socket: what a pod that reaches the health port can cost ------------------------------

CHECK = "/grpc.health.v1.Health/Check"
GRPC_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", CHECK),
    (":authority", "node-agent"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


class RawClient:
    """An HTTP/2 client (h2) on a plain socket, so that a test can send what no gRPC library would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.reader, self.writer = reader, writer
        self.events: list[h2.events.Event] = []
        self.closed = False

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        client.h2.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    async def read_until(self, done: Callable[[list[h2.events.Event]], bool]) -> None:
        """Read until `done(events)` or the server closes the connection (a test's timeout if neither)."""
        while not done(self.events):
            try:
                data = await self.reader.read(65536)
            except ConnectionError:
                data = b""
            if not data:
                self.closed = True
                return
            try:
                self.events += self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                self.closed = True
                return
            await self.flush()

    def close(self) -> None:
        self.writer.close()


def _trailers(events: list[h2.events.Event]) -> dict[str, str]:
    for event in events:
        if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
            headers = dict(event.headers)
            if "grpc-status" in headers:
                return headers
    return {}


@pytest.fixture
async def bounded(preparer: FakePreparer, paths: SocketPaths) -> AsyncIterator[PluginServer]:
    """A health port with the shipped bounds but deadlines and connection caps small enough for a test."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=0.5, request_s=0.5, connections=4, connections_per_peer=3)
    srv = PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds)
    async with srv:
        yield srv


async def test_a_4mib_health_request_of_tiny_fields_is_refused_unread(server: PluginServer) -> None:
    """2M empty `service` fields: refused from its length prefix (a service name is a few bytes), never
    decoded; the previous server decoded all of it on the event loop and answered SERVING."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        check = channel.unary_unary(
            CHECK,
            request_serializer=lambda _: b"\x0a\x00" * (2 * 1024 * 1024),
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(None, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"(4194304 vs. {HEALTH_BOUNDS.max_message_bytes})" in (err.value.details() or "")


async def test_a_stalled_big_message_holds_one_window_at_most(server: PluginServer) -> None:
    """A call that declares 4 MiB and stalls: the server lets the peer send at most one small flow-control
    window on the connection (it held up to 4 MiB per connection before) and refuses the call from its prefix."""
    assert server.health_port
    client = await RawClient.connect(server.health_port)
    try:
        await client.read_until(lambda events: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events))
        assert client.h2.outbound_flow_control_window <= 65535
        assert client.h2.remote_settings.initial_window_size <= 65535
        client.h2.send_headers(1, GRPC_HEADERS)
        client.h2.send_data(1, b"\x00" + (4 * 1024 * 1024).to_bytes(4, "big") + b"\x0a" * 1000)
        await client.flush()
        await client.read_until(lambda events: bool(_trailers(events)))
        assert _trailers(client.events).get("grpc-status") == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    finally:
        client.close()


async def test_bytes_trickled_lose_the_connection_at_its_deadline(bounded: PluginServer) -> None:
    """A whole, valid Check sent a byte every 20 ms (~3 s): the connection is closed at its deadline (0.5 s
    here) before the request is complete; the previous server waited for it and answered."""
    assert bounded.health_port
    reader, writer = await asyncio.open_connection("127.0.0.1", bounded.health_port)
    request = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    request.initiate_connection()
    request.send_headers(1, GRPC_HEADERS)
    message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
    request.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
    data = request.data_to_send()
    sent, closed = await trickle(reader, writer, data)
    if not closed:
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(reader.read(65536), 10):
                pass
        closed = reader.at_eof()
    writer.close()
    assert closed and sent < len(data), f"sent {sent} of {len(data)} bytes"
    assert await _health(bounded.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_connections_beyond_the_cap_are_reset_and_idle_ones_closed(bounded: PluginServer) -> None:
    """Ten connections that send nothing, from two addresses: the server keeps 3 from one address and 4 in
    all (the test's caps), resets the others as they are accepted, and closes the kept ones at the idle
    deadline; the previous server kept all ten for good."""
    assert bounded.health_port
    before = {limit: REFUSED.labels(limit)._value.get() for limit in ("connections", "connections_per_peer")}
    clients = []
    for i in range(10):
        sock = socket.socket()
        sock.bind((f"127.0.0.{1 + i % 2}", 0))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", bounded.health_port))
        clients.append(await asyncio.open_connection(sock=sock))
    kept = 0
    for reader, _ in clients:
        with contextlib.suppress(ConnectionError):
            # An admitted connection gets the server's SETTINGS at once; a refused one is reset.
            kept += bool(await asyncio.wait_for(reader.read(65536), 10))
    assert kept == 4
    # The two addresses alternate: 2 each fill the 4 slots, and the 6 after them find every slot taken by an
    # address holding as many as theirs (equal shares never displace each other).
    refused = {limit: REFUSED.labels(limit)._value.get() - n for limit, n in before.items()}
    assert refused == {"connections": 6, "connections_per_peer": 0}, refused
    for reader, writer in clients:  # the kept ones are closed at the idle deadline
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(reader.read(65536), 10):
                pass
        writer.close()
    assert await _health(bounded.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_addresses_that_fill_every_slot_do_not_keep_the_probe_out(
    preparer: FakePreparer, paths: SocketPaths
) -> None:
    """Two addresses hold all four slots with connections that send nothing (3 and 1 of them, within the
    test's caps; idle ones are kept 30 s here): the kubelet's probe from a third address still gets in and is
    answered, and the busiest address's oldest connection is reset for it. The previous server refused the
    probe until an idle deadline freed a slot."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0, request_s=30.0, connections=4, connections_per_peer=3)
    bounded = PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds)
    await bounded.start()
    assert bounded.health_port
    clients = []
    try:
        for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.2", "127.0.0.2"):
            sock = socket.socket()
            sock.bind((ip, 0))
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", bounded.health_port))
            reader, writer = await asyncio.open_connection(sock=sock)
            assert await asyncio.wait_for(reader.read(65536), 10)  # admitted: the server's SETTINGS
            clients.append((reader, writer))
        assert len(bounded._servers["health"].slots) == 4
        displaced = REFUSED.labels("connections")._value.get()
        assert await _health(bounded.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
        assert REFUSED.labels("connections")._value.get() == displaced + 1  # counted under the limit it broke
        oldest = clients[0][0]
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(oldest.read(65536), 10):
                pass
        assert oldest.at_eof() or oldest.exception() is not None
    finally:
        for _, writer in clients:
            writer.close()
        await bounded.stop(grace_s=0)


async def test_empty_data_frames_are_not_taken_for_the_end_of_the_message(
    server: PluginServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Check whose message follows 100 empty DATA frames (HTTP/2 allows them; they carry nothing): it is
    answered SERVING, and nothing is logged. grpclib reads an empty frame as the end of the data, so the
    previous server logged an application error with a traceback for each such call (any pod can send them)
    and queued an entry per frame until the call ended."""
    assert server.health_port
    client = await RawClient.connect(server.health_port)
    try:
        client.h2.send_headers(1, GRPC_HEADERS)
        for _ in range(100):
            client.h2.send_data(1, b"")
        message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        client.h2.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
        await client.flush()
        await client.read_until(lambda events: bool(_trailers(events)))
        assert _trailers(client.events).get("grpc-status") == "0"
        answer = b"".join(e.data for e in client.events if isinstance(e, h2.events.DataReceived))
        assert health_pb2.HealthCheckResponse.FromString(answer[5:]).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        client.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_long_header_block_is_refused_undecoded(server: PluginServer) -> None:
    """A call whose headers are 2.5 KiB of Huffman-coded text (hpack decodes ~1.5 µs a byte in pure Python; h2
    accepts up to 1 MiB in CONTINUATION frames): the connection is closed before it is decoded. The previous
    server decoded it and answered the call."""
    assert server.health_port
    client = await RawClient.connect(server.health_port)
    try:
        client.h2.send_headers(1, [*GRPC_HEADERS, ("x-pad", "a" * 4000)])
        message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        client.h2.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
        await client.flush()
        await client.read_until(lambda events: bool(_trailers(events)))
        assert client.closed and not _trailers(client.events)
    finally:
        client.close()


async def test_streams_reset_at_once_lose_the_connection(preparer: FakePreparer, paths: SocketPaths) -> None:
    """ "Rapid reset": a call's headers and its RST_STREAM, again and again, never exceed the concurrent-stream
    cap, but grpclib keeps every such stream registered until the connection ends, and each later
    WINDOW_UPDATE walks them all (thousands per connection: tens of ms of the loop per read). The connection
    is closed once it has reset more streams than its bounds allow in its life (the idle deadline, 30 s here,
    is not what closes it); the previous server kept reading them."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port

        def rapid_reset(conn: h2.connection.H2Connection) -> None:
            for stream in range(1, 2 * 200, 2):
                conn.send_headers(stream, GRPC_HEADERS)
                conn.reset_stream(stream)

        await _closed_after(srv.health_port, rapid_reset)


async def test_frames_outside_calls_lose_the_connection(preparer: FakePreparer, paths: SocketPaths) -> None:
    """PINGs (h2 answers each by itself), SETTINGS and WINDOW_UPDATEs, and never a call: read and answered one
    1 KiB read after the other, they held the event loop for as long as the peer kept sending, every Prepare
    of the node waiting behind them (0.7 s for 200 turns of the loop with 8 such connections). The connection
    is closed once it sent more such frames than its bounds allow in its life (the idle deadline, 30 s here,
    is not what closes it); the previous server kept reading them."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port and bounds.control_frames_per_life
        pings = bounds.control_frames_per_life + 1
        await _closed_after(srv.health_port, lambda conn: [conn.ping(n.to_bytes(8, "big")) for n in range(pings)])


def _data_frame(stream: int, data: bytes = b"x", *, padded: bool = False) -> bytes:
    """A DATA frame as bytes, which h2's client would not send on a stream it holds reset; padded: with a pad
    length of 0 (one byte of flow-controlled length and no data)."""
    body = b"\x00" + data if padded else data
    return len(body).to_bytes(3, "big") + b"\x00" + (b"\x08" if padded else b"\x00") + stream.to_bytes(4, "big") + body


def _check_message(service: str = "liveness") -> bytes:
    message = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    return b"\x00" + len(message).to_bytes(4, "big") + message


@pytest.mark.parametrize("stream", ["reset by the peer", "answered, its request not ended"])
async def test_data_frames_outside_calls_lose_the_connection(
    preparer: FakePreparer, paths: SocketPaths, stream: str
) -> None:
    """One-byte DATA frames on a stream that carries no request: h2 answers each on a reset stream with a
    RST_STREAM by itself (and gives its flow-control window back), grpclib gives back the window of those on a
    call it has answered; 400,000 of them in 10 s took half of the event loop. They count among the frames
    outside calls (past the few a call may send): the connection is closed once it sent more than its bounds
    allow (the idle and request deadlines, 30 s here, are not what close it); the previous server kept reading
    them."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0, request_s=30.0)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port and bounds.control_frames_per_life
        client = await RawClient.connect(srv.health_port)
        try:
            client.h2.send_headers(1, GRPC_HEADERS)
            if stream == "reset by the peer":
                client.h2.reset_stream(1)
                await client.flush()
            else:
                client.h2.send_data(1, _check_message())
                await client.flush()
                await client.read_until(lambda events: bool(_trailers(events)))
                assert _trailers(client.events).get("grpc-status") == "0"
            frames = bounds.control_frames_per_life + bounds.data_frames_per_call + 1
            await _lost_after(client, _data_frame(1) * frames)
        finally:
            client.close()
        assert await _health(srv.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_padded_empty_data_frames_lose_the_connection(preparer: FakePreparer, paths: SocketPaths) -> None:
    """DATA frames of padding only, on a call waiting for its message: empty frames (passed over, as those
    without padding are), so frames outside calls; the connection is closed past the bound (the deadlines, 30 s
    here, are not what close it). The previous server took them for data, handed them to grpclib, which gave
    back their window, and kept reading them (160,000 in 4 s: 42% of the loop)."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0, request_s=30.0)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port and bounds.control_frames_per_life
        client = await RawClient.connect(srv.health_port)
        try:
            client.h2.send_headers(1, GRPC_HEADERS)
            await client.flush()
            await _lost_after(client, _data_frame(1, b"", padded=True) * (bounds.control_frames_per_life + 1))
        finally:
            client.close()
        assert await _health(srv.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_a_request_in_more_frames_than_a_call_may_send_loses_the_connection(
    preparer: FakePreparer, paths: SocketPaths
) -> None:
    """A Check whose message comes a byte per DATA frame, more frames than a call's few and the bound on
    frames outside calls together: the connection is closed before the message is complete (the deadlines,
    30 s here, are not what close it). The previous server read them all and answered."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0, request_s=30.0)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port and bounds.control_frames_per_life
        message = _check_message("x" * (bounds.control_frames_per_life + bounds.data_frames_per_call))
        client = await RawClient.connect(srv.health_port)
        try:
            client.h2.send_headers(1, GRPC_HEADERS)
            await client.flush()
            await _lost_after(client, b"".join(_data_frame(1, message[i : i + 1]) for i in range(len(message))))
            assert not _trailers(client.events)
        finally:
            client.close()
        assert await _health(srv.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_calls_whose_message_comes_in_a_few_frames_are_answered(server: PluginServer) -> None:
    """As many calls as a connection may open (16), one after the other, each message split over as many DATA
    frames as a call may send (the last an empty one that ends the request, as grpc-core sends it): all
    answered SERVING on one connection, which stays open. Counted as frames outside calls they would have
    lost it."""
    assert server.health_port and HEALTH_BOUNDS.streams_per_life
    client = await RawClient.connect(server.health_port)
    try:
        message = _check_message()
        parts = HEALTH_BOUNDS.data_frames_per_call - 1
        cuts = [len(message) * i // parts for i in range(parts + 1)]
        for stream in range(1, 2 * HEALTH_BOUNDS.streams_per_life, 2):
            client.h2.send_headers(stream, GRPC_HEADERS)
            for start, end in itertools.pairwise(cuts):
                client.h2.send_data(stream, message[start:end])
            client.h2.send_data(stream, b"", end_stream=True)
            await client.flush()
            await client.read_until(_answered_on(stream))
            assert _trailers_of(client.events, stream).get("grpc-status") == "0", stream
        assert not client.closed
    finally:
        client.close()


async def test_sixteen_checks_from_a_grpc_client_share_a_connection(server: PluginServer) -> None:
    """A gRPC client's 16 Checks on one channel: all answered SERVING on one connection, which its pings and
    window updates (frames outside calls too) do not lose."""
    assert server.health_port and HEALTH_BOUNDS.streams_per_life
    connections = set()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        for _ in range(HEALTH_BOUNDS.streams_per_life):
            assert await health_check(channel, "liveness", deadline_s=10) == health_pb2.HealthCheckResponse.SERVING
            connections |= set(server._servers["health"].slots)
    assert len(connections) == 1


def _trailers_of(events: list[h2.events.Event], stream: int) -> dict[str, str]:
    return _trailers([e for e in events if getattr(e, "stream_id", None) == stream])


def _answered_on(stream: int) -> Callable[[list[h2.events.Event]], bool]:
    return lambda events: bool(_trailers_of(events, stream))


async def _lost_after(client: RawClient, frames: bytes) -> None:
    """Writing `frames` on the client's connection loses it (within 10 s)."""
    client.writer.write(frames)
    with contextlib.suppress(ConnectionError):
        await client.writer.drain()
    await asyncio.wait_for(client.read_until(lambda _: False), 10)
    assert client.closed


async def _closed_after(port: int, send: Callable[[h2.connection.H2Connection], object]) -> None:
    """What `send` queues on a fresh connection loses it (within 10 s), and the port still answers a probe."""
    client = await RawClient.connect(port)
    try:
        send(client.h2)
        with contextlib.suppress(ConnectionError):
            await client.flush()
        await asyncio.wait_for(client.read_until(lambda _: False), 10)
        assert client.closed
    finally:
        client.close()
    assert await _health(port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_frame_types_http2_does_not_define_are_passed_over(
    server: PluginServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame of an unknown type before a Check (RFC 9113: ignore it): the Check is answered SERVING and
    nothing is logged. grpclib ended the connection on it and asyncio logged a traceback for each."""
    assert server.health_port
    client = await RawClient.connect(server.health_port)
    try:
        await client.flush()
        client.writer.write(b"\x00\x00\x04\x42\x00\x00\x00\x00\x00" + b"abcd")  # type 0x42, 4 bytes, stream 0
        client.h2.send_headers(1, GRPC_HEADERS)
        message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        client.h2.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
        await client.flush()
        await client.read_until(lambda events: bool(_trailers(events)))
        assert _trailers(client.events).get("grpc-status") == "0"
    finally:
        client.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_the_cap_on_concurrent_calls_is_advertised(preparer: FakePreparer, paths: SocketPaths) -> None:
    """A gRPC client queues calls beyond the server's SETTINGS_MAX_CONCURRENT_STREAMS (h2's default: 100)."""
    srv = PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1")
    async with srv:
        assert srv.health_port
        client = await RawClient.connect(srv.health_port)
        try:
            await client.read_until(lambda events: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events))
            assert client.h2.remote_settings.max_concurrent_streams == HEALTH_BOUNDS.streams_per_connection
        finally:
            client.close()


async def test_a_call_whose_message_stalls_loses_its_connection(preparer: FakePreparer, paths: SocketPaths) -> None:
    """Headers at once, then 3 of a declared 16 bytes and nothing more: the connection is closed at the request
    deadline (0.5 s here; the idle deadline, 30 s, is not what closes it); the previous server waited for good."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0, request_s=0.5)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port
        client = await RawClient.connect(srv.health_port)
        try:
            client.h2.send_headers(1, GRPC_HEADERS)
            client.h2.send_data(1, b"\x00" + (16).to_bytes(4, "big") + b"\x0a\x01a")
            await client.flush()
            await asyncio.wait_for(client.read_until(lambda _: False), 10)
            assert client.closed
        finally:
            client.close()


async def test_an_answer_the_peer_never_lets_through_loses_the_connection(bounded: PluginServer) -> None:
    """A Check from a peer whose flow-control window is 0 (SETTINGS_INITIAL_WINDOW_SIZE): the answer can never
    be sent, and a call in progress stops the idle deadline; the connection is reset at the request deadline
    (0.5 s here). The previous server held it, and its slot, for good."""
    assert bounded.health_port
    client = await RawClient.connect(bounded.health_port)
    try:
        client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        client.h2.send_headers(1, GRPC_HEADERS)
        message = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        client.h2.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
        await client.flush()
        await asyncio.wait_for(client.read_until(lambda _: False), 10)
        assert client.closed
        assert not any(isinstance(e, h2.events.DataReceived) for e in client.events)
    finally:
        client.close()
    assert await _health(bounded.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


async def test_pings_never_read_do_not_hold_the_connection(preparer: FakePreparer, paths: SocketPaths) -> None:
    """A flood of PINGs whose ACKs the peer never reads: the server stops reading and holds the unsent ACKs;
    at the idle deadline (3 s here, time for the flood to fill the buffers) the connection is reset, not
    closed after a flush that never comes (the previous server kept it for good). The bound on frames outside
    calls, which ends such a flood sooner, is off here: this is about the ACKs a peer does not take. The
    server's socket gets a small send buffer, so that the ACKs fill the kernel's buffers within the flood
    whatever the kernel's autotuning would grant (up to tcp_wmem's 4 MiB, more than the flood sends)."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=3.0, control_frames_per_life=None)
    bounded = PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds)
    await bounded.start()
    assert bounded.health_port
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", bounded.health_port))
        hello = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        hello.initiate_connection()
        await loop.sock_sendall(sock, hello.data_to_send())
        ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678"  # a PING frame
        served = bounded._servers["health"]
        stalled = shrunk = False
        for _ in range(400):  # until the server holds ACKs it cannot send (it then stops reading)
            with contextlib.suppress(BlockingIOError):
                sock.send(ping * 256)
            await asyncio.sleep(0.005)
            held = next(iter(served.slots), None)
            if held is None or held._transport is None:
                continue
            if not shrunk:
                held._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                shrunk = True
            if held._transport.get_write_buffer_size():
                stalled = True
                break
        assert stalled, "the server never held unsent bytes"
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not served.slots:
                break
        assert not served.slots
    finally:
        sock.close()
        await bounded.stop(grace_s=0)


@pytest.mark.parametrize(
    "frame",
    [
        # An unknown type announcing 16 MiB, of which only the first bytes come: h2 checked the length only once
        # the whole body had arrived, and each connection buffered the 16 MiB first.
        pytest.param(b"\xff\xff\xfe\xfe\x00\x00\x00\x00\x00" + b"x" * 1024, id="a frame longer than the limit"),
        # 2,730 settings HTTP/2 does not define: h2 kept each for the connection's life and walked them all at
        # every later SETTINGS (24 such frames and 101 small ones held the loop 0.5 s and grew it by 54 MiB).
        pytest.param(
            (16380).to_bytes(3, "big") + b"\x04\x00\x00\x00\x00\x00"
            + b"".join((0x10 + i).to_bytes(2, "big") + b"\x00\x00\x00\x01" for i in range(2730)),
            id="a SETTINGS frame of unknown settings",
        ),
    ],
)  # fmt: skip
async def test_frames_whose_header_says_too_much_lose_the_connection(
    preparer: FakePreparer, paths: SocketPaths, frame: bytes
) -> None:
    """Refused from the frame's header, before its body is buffered or parsed (the deadlines, 30 s here, are
    not what close it); the port still answers a probe."""
    bounds = dataclasses.replace(HEALTH_BOUNDS, idle_s=30.0, request_s=30.0)
    async with PluginServer(preparer, paths, health_port=0, health_host="127.0.0.1", health_bounds=bounds) as srv:
        assert srv.health_port
        client = await RawClient.connect(srv.health_port)
        try:
            await _lost_after(client, frame)
        finally:
            client.close()
        assert await _health(srv.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


def test_settings_http2_does_not_define_are_dropped() -> None:
    """A SETTINGS frame small enough to pass, with settings HTTP/2 does not define besides one it does: h2 is
    handed the one it knows only (RFC 9113: ignore the others), instead of keeping each for the connection's
    life."""
    frames = _Frames(HEALTH_BOUNDS)
    frames.max_frame_size = 16384
    streams = h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS
    entries = [(0x10 + i, 1) for i in range(3)] + [(int(streams), 7)]
    body = b"".join(code.to_bytes(2, "big") + value.to_bytes(4, "big") for code, value in entries)
    frames.add_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    frames.add_data(len(body).to_bytes(3, "big") + b"\x04\x00\x00\x00\x00\x00" + body)
    frame = next(frames)
    assert dict(frame.settings) == {streams: 7}
