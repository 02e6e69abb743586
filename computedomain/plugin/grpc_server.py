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
seven threads); only this module imports it. The messages are protobuf's, generated from the kubelet's
`.proto` files (`proto/*_pb2`, see `proto/generate.py`; `grpc.health.v1` is grpclib's own generated module),
and grpclib's default codec encodes them; the method tables are read from the generated descriptors. What
grpclib leaves to its user is done here: `stop(grace_s)` drains as grpcio's did: new calls get UNAVAILABLE,
calls in flight get the grace period, then are cancelled and told UNAVAILABLE.

Every socket is bounded (`Bounds`; `HEALTH_BOUNDS` for the TCP health port, which any pod reaches,
`KUBELET_BOUNDS` for the unix sockets, sized from the kubelet's own limits: grpc's 4 MiB message, its 45 s
deadline). grpclib 0.4.9 has settings for the flow-control windows only (`Configuration`); the rest is a
minimal wrap of its server's protocol factory (`_BoundedServer`, `_Connection`): a connection beyond
`connections` (or `connections_per_peer` from one address) is reset as it is accepted, unless it comes from an
address holding fewer than the busiest one, whose oldest connection gives way (`computedomain.slots`: a few
pods cannot keep the kubelet's probe out); h2's connection gets
`SETTINGS_MAX_CONCURRENT_STREAMS`, a header list bound and a header block bound (`_Frames`: h2 joins up to
1 MiB of CONTINUATION frames, which hpack would decode at ~1.5 µs a byte); the socket is read `read_bytes` at a
time, and not at all while the peer does not read what we write; a connection with no call in progress is
closed (GOAWAY; reset when the peer has left what we wrote unread) `idle_s` after its open or its last call,
one whose request message has not arrived `request_s` after its headers, and one that has not taken an answer
message `request_s` after it was ready (a peer that opens no flow-control window) is reset; a request longer than `max_message_bytes` is refused from its length prefix,
unread (grpclib's own `recv_message` buffers whatever length is declared). So what is decoded on the event
loop from the health port stays small: at most 1 KiB of frames per read, a header block of 1 KiB, a message of
512 bytes (microseconds for protobuf's upb). Health Checks share one self-check at a time, so the health port
cannot fill the kubelet sockets' connection slots.
Everything runs on the caller's event loop;
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

from google.protobuf.message import DecodeError, Message
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.config import Configuration
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.v1 import health_pb2
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream
from h2.exceptions import FrameTooLargeError, ProtocolError
from h2.frame_buffer import FrameBuffer
from h2.settings import SettingCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    ExtensionFrame,
    Frame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
)

from computedomain.api.constants import DRIVER_NAME, HEALTH_PORT
from computedomain.metrics import Counter
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
from computedomain.plugin.proto import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2
from computedomain.slots import Slots

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
#: the largest request on the kubelet's sockets: grpc's default receive limit, which the reference plugin's
#: grpc-go server keeps (grpclib itself would buffer any size)
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


# --- the bounds of each listening socket -------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """What a client of one listening socket can cost (see `HEALTH_BOUNDS`, `KUBELET_BOUNDS` and the module
    docstring)."""

    #: the largest request message; a longer one is refused from its length prefix, unread
    max_message_bytes: int
    #: calls open at once on one connection (advertised as SETTINGS_MAX_CONCURRENT_STREAMS)
    streams_per_connection: int
    #: connections open at once, and from one peer address; more are reset as they are accepted
    connections: int
    connections_per_peer: int
    #: a connection without a call whose request has arrived is closed this long after its open or its last call
    idle_s: float
    #: a call's request message must have arrived this long after its headers, or the connection is closed
    request_s: float
    #: HTTP/2 flow-control window of a connection and of each stream: what a stalled peer can make us hold
    window_bytes: int = 65535
    #: the encoded header block of a call (HEADERS and CONTINUATION frames) and the header list it decodes to
    max_header_block_bytes: int = 1024
    max_header_list_bytes: int = 4096
    #: bytes read from the socket per turn of the event loop: what one turn may decode of frames
    read_bytes: int = 1024
    #: calls a connection may open, and streams it may reset, over its whole life (None: no bound); a peer
    #: that resets its streams at once ("rapid reset") would otherwise leave each one registered with grpclib
    #: until the connection ends, and every later WINDOW_UPDATE or SETTINGS walks all of them
    streams_per_life: int | None = None
    resets_per_life: int = 1024
    #: frames outside a call's headers and message (PING, SETTINGS, WINDOW_UPDATE, PRIORITY, GOAWAY, HEADERS
    #: again on a stream already open, empty DATA, padding aside, DATA on a stream whose request has ended or
    #: that was reset, a call's DATA beyond `data_frames_per_call`, frame types HTTP/2 does not define) a
    #: connection may send over its life (None: no bound); h2 answers PINGs and SETTINGS by itself, and DATA on
    #: a reset stream with a RST_STREAM (giving its flow-control window back), so a connection that only sends
    #: those would otherwise hold the loop for as long as it keeps sending
    control_frames_per_life: int | None = None
    #: DATA frames of a call's request not counted as frames outside calls (a grpc client sends a Check in one)
    data_frames_per_call: int = 8


#: the TCP health port, which any pod reaches: a message of a service name, few calls, short deadlines
HEALTH_BOUNDS: Final = Bounds(
    max_message_bytes=512,
    streams_per_connection=4,
    connections=32,
    connections_per_peer=8,
    idle_s=5.0,
    request_s=5.0,
    streams_per_life=16,  # a probe dials for each Check
    resets_per_life=16,
    control_frames_per_life=128,  # a grpc-go client: a few per connection and per call
    # packed small frames (113 empty SETTINGS, nine HEADERS of 97 indexed headers each) took 2-5 ms of a
    # 1 KiB read; a Check is about 100 bytes
    read_bytes=512,
)
#: the kubelet's unix sockets (root on the node reaches them): its messages, its 45 s deadline, its connection
#: kept across calls (closed when idle for 5 min; grpc-go dials again for the next call)
KUBELET_BOUNDS: Final = Bounds(
    max_message_bytes=MAX_MESSAGE_BYTES,
    streams_per_connection=16,
    connections=16,
    connections_per_peer=16,
    idle_s=300.0,
    request_s=45.0,
    window_bytes=MAX_MESSAGE_BYTES,
    max_header_block_bytes=4096,
    max_header_list_bytes=8192,
    read_bytes=16384,
)


#: the settings h2 knows (HTTP/2's and the extended CONNECT one); a SETTINGS frame of more than 16 entries (of
#: 6 bytes) is refused: extensions define a few more, nobody sends thousands
_SETTING_CODES: Final = frozenset(int(code) for code in SettingCodes)
_MAX_SETTINGS_BYTES: Final = 6 * 16


class _Frames(FrameBuffer):
    """h2's frame buffer with a bound on a header block (h2 joins up to 64 CONTINUATION frames, 1 MiB, and
    hpack decodes the block in pure Python, about 1.5 µs a byte when Huffman-coded) and on what a connection
    sends over its life (`Bounds.streams_per_life`, `resets_per_life`, `control_frames_per_life`). A DATA frame
    is part of a call only while the peer has not ended or reset that call's request, and only for the call's
    first `data_frames_per_call`; any other is a frame outside calls. Empty DATA frames (no data, padded or not,
    not the end of the stream) and frames of types HTTP/2 does not define are passed over, as RFC 9113 asks of
    the latter (grpclib ended the connection with a traceback on them)."""

    def __init__(self, bounds: Bounds) -> None:
        super().__init__(server=True)
        self._max_block = bounds.max_header_block_bytes
        self._streams_left = bounds.streams_per_life
        self._resets_left = bounds.resets_per_life
        self._control_left = bounds.control_frames_per_life
        self._data_per_call = bounds.data_frames_per_call
        #: the calls whose request the peer has not ended or reset: the DATA frames each may still send (kept
        #: only where frames outside calls are bounded; `streams_per_life` bounds it there)
        self._requests: dict[int, int] = {}
        self._last_stream = 0

    def _check_header(self) -> None:
        """Refuse a frame too long from its header alone: h2 checks the length only once the whole body has
        arrived, so a header announcing 16 MiB had each connection buffer that much before it was refused."""
        if len(self._data) < 9:
            return
        length = int.from_bytes(self._data[:3], "big")
        if length > self.max_frame_size:
            raise FrameTooLargeError(f"a frame of {length} bytes; the limit is {self.max_frame_size}")
        if self._data[3] == SettingsFrame.type and length > _MAX_SETTINGS_BYTES:
            raise ProtocolError(f"a SETTINGS frame of {length} bytes; the limit is {_MAX_SETTINGS_BYTES}")

    def __next__(self) -> Frame:
        while True:
            self._check_header()
            f = super().__next__()
            if isinstance(f, SettingsFrame) and any(code not in _SETTING_CODES for code in f.settings):
                # RFC 9113 says to ignore settings it does not define; h2 keeps each one for the life of the
                # connection and walks them all at every later SETTINGS (125 frames held the loop 0.5 s).
                f.settings = {k: v for k, v in f.settings.items() if k in _SETTING_CODES}
            # Empty DATA carries nothing (its padding neither), and grpclib would take it for the end of the
            # message (an error it logs with a traceback) and queue an entry for each.
            skip = isinstance(f, ExtensionFrame) or (
                isinstance(f, DataFrame) and not f.data and "END_STREAM" not in f.flags
            )
            outside = skip
            if isinstance(f, HeadersFrame) and f.stream_id > self._last_stream:  # a new call
                self._last_stream = f.stream_id
                if self._streams_left is not None:
                    self._streams_left -= 1
                    if self._streams_left < 0:
                        raise ProtocolError("more calls than one connection may open")
                if self._control_left is not None and "END_STREAM" not in f.flags:
                    self._requests[f.stream_id] = self._data_per_call
            elif isinstance(f, RstStreamFrame):
                self._requests.pop(f.stream_id, None)
                self._resets_left -= 1
                if self._resets_left < 0:
                    raise ProtocolError("more streams reset than one connection may reset")
            elif isinstance(f, DataFrame):
                # h2 answers DATA on a reset stream with a RST_STREAM, and grpclib gives back the window of DATA
                # on a call it has answered: neither is bounded by the call's message.
                left = self._requests.get(f.stream_id, 0)
                if not skip and left:
                    self._requests[f.stream_id] = left - 1
                else:
                    outside = True
            else:
                outside = True
            if isinstance(f, DataFrame | HeadersFrame) and "END_STREAM" in f.flags:
                self._requests.pop(f.stream_id, None)
            if outside and self._control_left is not None:
                self._control_left -= 1
                if self._control_left < 0:
                    raise ProtocolError("more frames outside calls than one connection may send")
            if not skip:
                return f

    def _update_header_buffer(self, f: Frame | None) -> Frame | None:
        if isinstance(f, HeadersFrame | ContinuationFrame):
            size = len(f.data) + sum(len(x.data) for x in self._headers_buffer)
            if size > self._max_block:
                raise ProtocolError(f"a header block longer than {self._max_block} bytes")
        return super()._update_header_buffer(f)


REFUSED = Counter(
    "computedomain_plugin_grpc_refused_connections_total",
    "gRPC connections (the health port, the kubelet's sockets) reset by the limit they broke: as they were "
    "accepted, or (connections) to give their slot to a newcomer from an address holding fewer.",
    ["limit"],
)


class _BoundedServer(Server):
    """grpclib's Server whose connections are `_Connection`s: it counts them, by peer address too."""

    def __init__(self, servable: _Servable, bounds: Bounds) -> None:
        window = max(bounds.window_bytes, 65535)  # the smallest HTTP/2 allows
        super().__init__(
            [servable], config=Configuration(http2_connection_window_size=window, http2_stream_window_size=window)
        )
        self.bounds = bounds
        self.slots: Slots[_Connection] = Slots(bounds.connections, bounds.connections_per_peer)

    def _protocol_factory(self) -> _Connection:  # type: ignore[override]
        return _Connection(self)

    def grpclib_protocol(self) -> H2Protocol:
        return super()._protocol_factory()

    def admit(self, connection: _Connection, peer: str) -> bool:
        admission = self.slots.admit(connection, peer)
        if admission.reset_by:
            REFUSED.labels(admission.reset_by).inc()
        if admission.displaced is not None:
            admission.displaced.abort()
        return not admission.refused

    def release(self, connection: _Connection) -> None:
        self.slots.release(connection)


class _Connection(asyncio.BufferedProtocol):
    """One accepted connection: admitted or reset, then grpclib's protocol with the bounds set on its h2
    connection, fed at most `read_bytes` per turn of the loop, closed at its idle deadline, and not read while
    the peer does not take what we write (h2 answers PINGs and SETTINGS on its own)."""

    def __init__(self, server: _BoundedServer) -> None:
        self._server = server
        self._bounds = server.bounds
        self._buffer = bytearray(self._bounds.read_bytes)
        self._transport: asyncio.Transport | None = None
        self._grpc: H2Protocol | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: calls whose request has arrived and that have not finished
        self.calls = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        if not self._server.admit(self, peer):
            transport.abort()  # RST: the descriptor is free at once
            return
        self._transport = transport
        grpc = self._server.grpclib_protocol()
        grpc.connection_made(transport)
        h2 = grpc.connection._connection
        h2.incoming_buffer = _Frames(self._bounds)
        h2.decoder.max_header_list_size = self._bounds.max_header_list_bytes
        h2.update_settings(
            {
                SettingCodes.MAX_CONCURRENT_STREAMS: self._bounds.streams_per_connection,
                SettingCodes.MAX_HEADER_LIST_SIZE: self._bounds.max_header_list_bytes,
            }
        )
        grpc.connection.flush()
        grpc.connection.bounded = self  # type: ignore[attr-defined]  # found by the calls of this connection
        self._grpc = grpc
        self._arm()

    def get_buffer(self, sizehint: int) -> bytearray:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._grpc is not None:
            self._grpc.data_received(bytes(self._buffer[:nbytes]))

    def pause_writing(self) -> None:
        if self._grpc is not None and self._transport is not None:
            self._grpc.pause_writing()
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._grpc is not None and self._transport is not None:
            self._grpc.resume_writing()
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.release(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._grpc is not None:
            self._grpc.connection_lost(exc)

    def call_started(self) -> None:
        self.calls += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def call_ended(self) -> None:
        self.calls -= 1
        self._arm()

    def close(self) -> None:
        """GOAWAY, then close: a grpc client dials again for its next call. A peer that does not read what we
        wrote (a flood of PINGs never read leaves their ACKs behind) is reset instead: asyncio's `close()`
        would wait for the peer to take those bytes, with no deadline, and keep the slot."""
        if self._grpc is not None and self._transport is not None and not self._transport.is_closing():
            with contextlib.suppress(Exception):
                self._grpc.connection._connection.close_connection()
                self._grpc.connection.flush()
            if self._transport.get_write_buffer_size():
                self._transport.abort()
            else:
                self._transport.close()

    def abort(self) -> None:
        """Reset at once (a call whose answer the peer would not take in time)."""
        if self._transport is not None:
            self._transport.abort()

    def _arm(self) -> None:
        if self.calls == 0 and self._transport is not None:
            self._timer = asyncio.get_running_loop().call_later(self._bounds.idle_s, self.close)


def _connection_of(stream: Stream[Any, Any]) -> _Connection:
    owner: _Connection = stream._stream.connection.bounded  # type: ignore[attr-defined]
    return owner


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


@dataclass(frozen=True, slots=True)
class _Method:
    path: str
    name: str
    request: type[Message]
    reply: type[Message]
    server_streaming: bool


def _methods(module: Any, service: str) -> tuple[_Method, ...]:
    """The methods of `service` in a generated module, from its descriptor (paths `/package.Service/Method`)."""
    described = module.DESCRIPTOR.services_by_name[service]
    return tuple(
        _Method(
            f"/{described.full_name}/{m.name}",
            m.name,
            getattr(module, m.input_type.name),
            getattr(module, m.output_type.name),
            m.server_streaming,
        )
        for m in described.methods
    )


DRA_V1_METHODS: Final = _methods(dra_v1_pb2, "DRAPlugin")
DRA_V1BETA1_METHODS: Final = _methods(dra_v1beta1_pb2, "DRAPlugin")
DRA_HEALTH_METHODS: Final = _methods(dra_health_v1alpha1_pb2, "DRAResourceHealth")
REGISTRATION_METHODS: Final = _methods(pluginregistration_v1_pb2, "Registration")
GRPC_HEALTH_METHODS: Final = _methods(health_pb2, "Health")


def _method(methods: Sequence[_Method], name: str) -> _Method:
    return next(m for m in methods if m.name == name)


async def _receive(stream: Stream[Any, Any], message_type: type[Message]) -> Any:
    """The request message, bounded: grpclib's own `recv_message` buffers whatever length the peer declares,
    and waits for it as long as the peer likes. Within the connection's `request_s` or the connection is closed;
    a length above `max_message_bytes` is refused from the prefix, unread."""
    bounds = _connection_of(stream)._bounds
    h2: Any = stream._stream  # grpclib.protocol.Stream: the only way to read the length prefix first
    if h2._h2_connection.open_inbound_streams > bounds.streams_per_connection:
        # h2 enforces the advertised cap only once the peer has acknowledged our settings
        raise GRPCError(Status.RESOURCE_EXHAUSTED, f"more than {bounds.streams_per_connection} calls on one connection")
    try:
        async with asyncio.timeout(bounds.request_s):
            prefix = await h2.recv_data(5)
            if len(prefix) != 5:
                raise GRPCError(Status.INTERNAL, "the request has no message")
            if prefix[0]:
                raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
            size = int.from_bytes(prefix[1:], "big")
            if size > bounds.max_message_bytes:
                raise GRPCError(
                    Status.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({size} vs. {bounds.max_message_bytes})",
                )
            data = await h2.recv_data(size)
    except TimeoutError:
        _connection_of(stream).close()
        raise GRPCError(Status.DEADLINE_EXCEEDED, f"the request did not arrive within {bounds.request_s:g}s") from None
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        raise GRPCError(Status.INTERNAL, f"the request is not a {message_type.DESCRIPTOR.full_name}: {exc}") from exc


async def _send(stream: Stream[Any, Any], reply: Any) -> None:
    """One reply message, taken by the peer within the connection's `request_s`: a peer that opens no
    flow-control window (SETTINGS_INITIAL_WINDOW_SIZE 0) would otherwise hold the call, so its connection,
    for good. Past the deadline the connection is reset."""
    connection = _connection_of(stream)
    try:
        async with asyncio.timeout(connection._bounds.request_s):
            await stream.send_message(reply)
    except TimeoutError:
        connection.abort()
        raise GRPCError(
            Status.DEADLINE_EXCEEDED, f"the answer was not taken within {connection._bounds.request_s:g}s"
        ) from None


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


@contextlib.contextmanager
def _in_progress(stream: Stream[Any, Any]) -> Iterator[None]:
    """A call whose request has arrived: its connection is not idle until it ends."""
    connection = _connection_of(stream)
    connection.call_started()
    try:
        yield
    finally:
        connection.call_ended()


def _mapping(calls: _Calls, methods: Sequence[_Method], servicer: object) -> dict[str, Handler]:
    """grpclib's method table for a service's `methods`, served by `servicer`'s methods of the same names:
    `async def M(request) -> reply`, or an async generator of replies for a server stream."""
    table: dict[str, Handler] = {}
    for method in methods:
        impl = getattr(servicer, method.name)
        request_type = method.request
        if method.server_streaming:

            async def serve(stream: Stream[Any, Any], impl: Any = impl, request_type: Any = request_type) -> None:
                request = await _receive(stream, request_type)
                with _in_progress(stream):
                    async with _told_when_stopped(calls, stream):
                        async for reply in impl(request):
                            await _send(stream, reply)

            cardinality = Cardinality.UNARY_STREAM
        else:

            async def serve(stream: Stream[Any, Any], impl: Any = impl, request_type: Any = request_type) -> None:
                with calls.one():
                    request = await _receive(stream, request_type)
                    with _in_progress(stream):
                        async with _told_when_stopped(calls, stream):
                            reply = await impl(request)
                        await _send(stream, reply)

            cardinality = Cardinality.UNARY_UNARY
        table[method.path] = Handler(serve, cardinality, request_type, method.reply)
    return table


@dataclass(frozen=True)
class _Servable:
    """What grpclib's Server takes: an object with a method table."""

    table: Mapping[str, Handler]

    def __mapping__(self) -> Mapping[str, Handler]:
        return self.table


SERVING: Final = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING


# --- DRA node service ------------------------------------------------------------------------------------


class _DraService:
    """One servicer object per DRA wire version: `pb2` is its generated module (v1beta1 has no share_id)."""

    def __init__(self, preparer: Preparer, version: str, pb2: Any) -> None:
        self._preparer = preparer
        self._version = version
        self._pb2 = pb2
        self._carries_share_id = "share_id" in pb2.Device.DESCRIPTOR.fields_by_name

    @staticmethod
    def _claims(request: Any) -> list[ClaimRef]:
        seen: dict[str, ClaimRef] = {}
        for claim in request.claims:
            seen.setdefault(claim.uid, ClaimRef(claim.namespace, claim.name, ClaimUid(claim.uid)))
        return list(seen.values())

    async def NodePrepareResources(self, request: Any) -> Any:  # noqa: N802 (gRPC name)
        claims = self._claims(request)
        response = self._pb2.NodePrepareResourcesResponse()
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
            entry = response.claims[claim.uid]
            entry.error = result.error
            for device in result.devices:
                added = entry.devices.add(
                    request_names=[strip_subrequest(n) for n in device.request_names],
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=list(device.cdi_device_ids),
                )
                if self._carries_share_id and device.share_id is not None:
                    added.share_id = device.share_id
        return response

    async def NodeUnprepareResources(self, request: Any) -> Any:  # noqa: N802 (gRPC name)
        claims = self._claims(request)
        response = self._pb2.NodeUnprepareResourcesResponse()
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
            response.claims[claim.uid].error = result.error
        return response


class _ResourceHealthService:
    """`v1alpha1.DRAResourceHealth`: every report of `HealthReports` as one message, until the kubelet hangs up."""

    def __init__(self, reports: HealthReports) -> None:
        self._reports = reports

    async def NodeWatchResources(  # noqa: N802 (gRPC name)
        self, request: dra_health_v1alpha1_pb2.NodeWatchResourcesRequest
    ) -> AsyncIterator[dra_health_v1alpha1_pb2.NodeWatchResourcesResponse]:
        log.debug("kubelet opened the device health stream devices=%s", ",".join(self._reports.devices))
        pb2 = dra_health_v1alpha1_pb2
        async for at, devices in self._reports.stream():
            yield pb2.NodeWatchResourcesResponse(
                devices=[
                    pb2.DeviceHealth(
                        device=pb2.DeviceIdentifier(pool_name=self._reports.pool, device_name=d.device),
                        health=int(d.health),  # type: ignore[arg-type]
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

    async def GetInfo(  # noqa: N802 (gRPC name)
        self, request: pluginregistration_v1_pb2.InfoRequest
    ) -> pluginregistration_v1_pb2.PluginInfo:
        return self._info

    async def NotifyRegistrationStatus(  # noqa: N802 (gRPC name)
        self, request: pluginregistration_v1_pb2.RegistrationStatus
    ) -> pluginregistration_v1_pb2.RegistrationStatusResponse:
        self._on_status(RegistrationStatus(registered=request.plugin_registered, error=request.error))
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


# --- health ------------------------------------------------------------------------------------------------


class _HealthService:
    """`grpc.health.v1.Health` as grpclib's generated module has it: Check; Watch is refused (poll Check)."""

    def __init__(self, self_check: Any, readiness: Callable[[], Sequence[str]]) -> None:
        self._self_check = self_check
        self._readiness = readiness

    async def _status(self, service: str) -> Any:
        problem = await self._self_check()
        if problem:
            log.warning("health check failed: %s", problem)
            return NOT_SERVING
        if service == READINESS_SERVICE and self._readiness():
            return NOT_SERVING  # the agent logged why when it happened
        return SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:  # noqa: N802
        if request.service not in HEALTH_SERVICES | {READINESS_SERVICE}:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=await self._status(request.service))

    async def Watch(  # noqa: N802 (gRPC name)
        self, request: health_pb2.HealthCheckRequest
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
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
        health_bounds: Bounds = HEALTH_BOUNDS,
        kubelet_bounds: Bounds = KUBELET_BOUNDS,
    ) -> None:
        """health_port None disables the health server; 0 picks a free port (see `health_port`). health_host
        is the address it binds (the pod IP, so several agents on one machine do not clash); empty: all.
        device_health: what the kubelet's device health stream reports (default: no devices). The bounds are
        those of the health port and of the kubelet's sockets."""
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
        self._health_bounds = health_bounds
        self._kubelet_bounds = kubelet_bounds
        self._check: asyncio.Task[str | None] | None = None
        # Started servers, in stop order: registration first, so the kubelet stops routing to us first.
        self._servers: dict[str, _BoundedServer] = {}
        self.health_port: int | None = None
        self.registration_status: RegistrationStatus | None = None
        self.registered = asyncio.Event()

    # -- lifecycle

    async def start(self) -> None:
        if self._servers or self._calls.draining:
            raise RuntimeError("PluginServer already started")
        calls = self._calls
        dra = _Servable(
            _mapping(calls, DRA_V1_METHODS, _DraService(self._preparer, "v1", dra_v1_pb2))
            | _mapping(calls, DRA_V1BETA1_METHODS, _DraService(self._preparer, "v1beta1", dra_v1beta1_pb2))
            | _mapping(calls, DRA_HEALTH_METHODS, _ResourceHealthService(self.device_health))
        )
        registration = _Servable(
            _mapping(
                calls,
                REGISTRATION_METHODS,
                _RegistrationService(self.driver_name, self.paths.dra, self._record_registration),
            )
        )
        try:
            await self._start_unix("dra", self.paths.dra, dra)
            await self._start_unix("registration", self.paths.registration, registration)
            if self._health_port_wanted is not None:
                listener = _tcp_listener(self._health_host, self._health_port_wanted)
                self.health_port = int(listener.getsockname()[1])
                health = _Servable(
                    _mapping(calls, GRPC_HEALTH_METHODS, _HealthService(self.self_check, self._readiness))
                )
                server = _BoundedServer(health, self._health_bounds)
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
        server = _BoundedServer(servable, self._kubelet_bounds)
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
        """Dial our own sockets by path like the kubelet does. Returns None when healthy, else why not. One
        check at a time: the health port's callers all wait for the one in progress, so that they cannot take
        the kubelet's connection slots on the unix sockets."""
        if self._check is None:
            self._check = asyncio.create_task(self._dial_self(), name="plugin-self-check")
            self._check.add_done_callback(lambda _: setattr(self, "_check", None))
        return await asyncio.shield(self._check)

    async def _dial_self(self) -> str | None:
        deadline = self._self_check_timeout_s
        try:
            channel = Channel(path=str(self.paths.registration))
            try:
                info = await _unary(channel, REGISTRATION_METHODS, "GetInfo")(
                    pluginregistration_v1_pb2.InfoRequest(), timeout=deadline
                )
            finally:
                channel.close()
            if info.name != self.driver_name or info.endpoint != str(self.paths.dra):
                where = self.paths.registration
                return f"registration socket {where} answers for {info.name} at {info.endpoint}"
            channel = Channel(path=str(self.paths.dra))
            try:
                for methods in (DRA_V1_METHODS, DRA_V1BETA1_METHODS):
                    prepare = _method(methods, "NodePrepareResources")
                    await _unary(channel, methods, prepare.name)(prepare.request(), timeout=deadline)
            finally:
                channel.close()
        except GRPCError as exc:
            return f"self-call over unix socket failed: {exc.status.name}: {exc.message}"
        except (OSError, TimeoutError, StreamTerminatedError) as exc:
            return f"self-call over unix socket failed: UNAVAILABLE: {exc or type(exc).__name__}"
        return None


def _unary(channel: Channel, methods: Sequence[_Method], name: str) -> UnaryUnaryMethod[Any, Any]:
    described = _method(methods, name)
    return UnaryUnaryMethod(channel, described.path, described.request, described.reply)


def _tcp_listener(host: str, port: int) -> socket.socket:
    """The health server's listening socket: on host, or on every address (dual-stack where the kernel
    has IPv6). Made here so that port 0 yields one port, which `health_port` reports."""
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host.strip("[]"), port), family=family)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))
