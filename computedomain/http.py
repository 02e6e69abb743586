"""The HTTP endpoint of our processes, on aiohttp.web: metrics, `/healthz`, optionally `/readyz`, own paths.

Owns `start_http` (parsing `HTTP_ENDPOINT` is `computedomain.settings.parse_endpoint`: `host:port`, empty
host: every address, `[v6]:port` and a bare IPv6 literal before the last colon both work), the answers of the
three shared paths and the bounds every listening socket of ours keeps. The metrics are the process-wide
prometheus-client registry in its text format (`generate_latest`); `/healthz` answers while the event loop
does; `/readyz` is served only when the caller passes a readiness function (`(ready, details)`: 200 or 503
with the details as JSON); a caller may add paths of its own (the IMEX daemon's `/ready`). aiohttp's
low-level server (`web.Server`) parses and frames; the routes are a table of exact paths.

Every port of ours is reachable from any pod unless a NetworkPolicy says otherwise, so (`Limits`):

- a connection has `request_deadline_s` from its open, or from its last answer, to deliver a whole request
  head (aiohttp's keep-alive timer runs from the open and does not restart on data): headers trickled a
  byte at a time, or nothing at all, lose the connection then;
- an answer has `answer_deadline_s` to be computed and taken by the client (every byte of it handed to the
  kernel: the connection's write buffer is zero, so an answer smaller than asyncio's usual 64 KiB buffer
  cannot sit unsent past the deadline, nor hold a closing connection open); a client that does not read it
  loses the connection;
- GET and HEAD only, and no body: aiohttp's parser is handed at most `read_size` bytes per turn of the
  loop, and nothing after a head that announces a body (any Transfer-Encoding, a Content-Length other than
  0; `_Gate` finds it in the bytes): that head is answered 413 and its connection closed, so no byte of a
  body is decoded (llhttp turns each chunk of a chunked body into a Python callback: a GET of 200 KB of
  1-byte chunks held the loop 5 ms per read); request and header lines of at most 4 KiB, at most 32 headers
  (aiohttp's C parser decodes the largest such head in 0.1-0.2 ms; nothing else of a request is decoded but
  its path); a head that does not parse is answered 400 and not logged as our error, nor is a client that
  resets before its answer;
- at most `requests_per_connection` answers on one connection, the last with `Connection: close`: the
  request deadline restarts at every answer, so one connection pipelining `/healthz` kept a core busy for
  as long as it liked; now a client must open new connections, which the next bounds limit;
- at most `connections` open at once and `connections_per_peer` from one address (`computedomain.slots`): a
  connection beyond either is reset as it is accepted, unless all are taken and it comes from an address
  holding fewer than the busiest one, whose oldest connection is reset instead
  (`computedomain_http_refused_connections_total`, by bound); so idle connections cannot exhaust file
  descriptors, nor a few addresses keep the kubelet's probe out;
- the metrics are rendered at most once per `metrics_every_s` (`Exposition`): a flood of scrapes costs one
  render per interval.

Concurrency: one event loop; aiohttp runs each connection as a task, fed by the connection's `_Gate` (the
transport's protocol throughout). Answers are computed on the loop:
the readiness functions and scrape-time collectors read in-memory state only.

Used by the controller (with `/readyz`: ready once caches synced, with the leadership state), the node agent
and the IMEX daemon wrapper (only `/healthz` and its probe's `/ready`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.metrics import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, generate_latest
from computedomain.settings import EndpointError, parse_endpoint
from computedomain.slots import Slots

__all__ = [
    "REFUSED",
    "Answer",
    "EndpointError",
    "Exposition",
    "Handler",
    "HttpServer",
    "Limits",
    "bound_port",
    "parse_endpoint",
    "start_http",
]

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, Mapping[str, Any]]]
Answer = tuple[int, str, bytes]
#: a route's handler: (status, content type, body), computed now (a coroutine is awaited)
Handler = Callable[[], Answer | Awaitable[Answer]]

TEXT: Final = "text/plain; charset=utf-8"

REFUSED = Counter(
    "computedomain_http_refused_connections_total",
    "Connections to an HTTP endpoint reset by the limit they broke: as they were accepted, or (connections) to give "
    "their slot to a newcomer from an address holding fewer.",
    ["limit"],
)


@dataclass(frozen=True)
class Limits:
    """The bounds of one endpoint (see the module docstring)."""

    request_deadline_s: float = 5.0
    answer_deadline_s: float = 15.0  # the daemon's /ready may wait out IMEX between peers (4 s) and the ctl
    connections: int = 64
    connections_per_peer: int = 8
    metrics_every_s: float = 1.0
    max_line_size: int = 4096
    max_headers: int = 32
    read_size: int = 8192  # what the parser is handed per turn of the loop, at most
    requests_per_connection: int = 100


class Exposition:
    """The registry's text exposition, rendered at most once per `every_s`.

    A scrape that comes sooner after the last render waits for the next one, which every scrape waiting
    shares; so no scrape sees values from before it arrived, and any number of them costs one render per
    interval. The render itself runs on the event loop: the collectors read the loop's own state."""

    def __init__(self, registry: CollectorRegistry, every_s: float, clock: Clock | None = None) -> None:
        self._registry = registry
        self._every_s = every_s
        self._clock = clock or MonotonicClock()
        self._due = float("-inf")
        self._next: asyncio.Task[bytes] | None = None
        self.renders = 0

    async def text(self) -> bytes:
        if self._next is None and self._clock.now() >= self._due:
            return self._render()
        if self._next is None:
            self._next = asyncio.create_task(self._later(), name="metrics-render")
        # Shielded: a scrape that gives up does not cancel the render the others wait for.
        return await asyncio.shield(self._next)

    async def _later(self) -> bytes:
        try:
            await self._clock.sleep(self._due - self._clock.now())
            return self._render()
        finally:
            self._next = None

    def _render(self) -> bytes:
        self._due = self._clock.now() + self._every_s
        self.renders += 1
        return generate_latest(self._registry)

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()


class _NotOurErrors(logging.Filter):
    """aiohttp logs every request it cannot parse at ERROR, with a traceback; such a request is the client's
    fault (answered 400), so anyone who reaches the port could fill our log. Those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


_server_log = logging.getLogger(f"{__name__}.server")
_server_log.addFilter(_NotOurErrors())


class _BoundedServer(web.Server):
    """aiohttp's server, counting open connections in total and by peer address."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], limits: Limits) -> None:
        super().__init__(
            handler,
            keepalive_timeout=limits.request_deadline_s,
            lingering_time=0,  # a body is never read, not even to be discarded
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_line_size,
            max_headers=limits.max_headers,
            access_log=None,
            logger=_server_log,
        )
        self.limits = limits
        self.slots: Slots[web.RequestHandler] = Slots(limits.connections, limits.connections_per_peer)

    def __call__(self) -> _Gate:  # type: ignore[override]
        return _Gate(self)

    def admit(self, transport: asyncio.Transport) -> web.RequestHandler | None:
        """A handler for a connection just accepted, or None when it breaks a limit."""
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        handler = super().__call__()
        admission = self.slots.admit(handler, peer)
        if admission.reset_by:
            REFUSED.labels(admission.reset_by).inc()
        if admission.refused:
            return None
        if admission.displaced is not None and admission.displaced.transport is not None:
            admission.displaced.transport.abort()
        return handler

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        self.slots.release(handler)
        super().connection_lost(handler, exc)

    @property
    def open_connections(self) -> int:
        return len(self.slots)


#: a whole `Content-Length: 0` line (lowered), from the line feed before it: the one mention that announces no body
_ZERO_LENGTH: Final = re.compile(rb"\ncontent-length[ \t]*:[ \t]*0+[ \t]*\r?(?=\n)")
#: the end of a head, from the line feed before it: a line of nothing but spaces, tabs and carriage returns
_HEAD_END: Final = re.compile(rb"\n[ \t\r]*\n")
#: what a line the parser takes may hold beyond `max_line_size` (its bound is on a path, or a header's name
#: and value): the method, the version, the colon, a space, the CR
_LINE_SLACK: Final = 32


class _Gate(asyncio.BufferedProtocol):
    """The protocol of every accepted connection: resets it, or stays in front of aiohttp's and hands its
    parser each read of at most `read_size` bytes, up to the end of the first head that announces a body.

    Such a head is found in the bytes, before the parser has them: a line of it mentions transfer-encoding
    or content-length anywhere (lowered), other than a whole `Content-Length: 0` line, or is longer than
    any line the parser takes whole (so cannot be examined whole). The parser (llhttp, strict for requests)
    ends a line only at CRLF and a head only at an empty line, so each header it reads begins after a line
    feed, and the first line of nothing but whitespace after that header is at or before the end of its
    head: cutting there never hands it a byte of a body. The cut head is answered (413 for a body, with
    `Connection: close`); what follows it is not read. A mention that is no such header (in a path, a value)
    is answered as usual, and the connection then idles out its request deadline. Each read costs a few
    scans in C of at most `read_size` bytes and the line in progress, whatever they hold (65 us for 8 KiB
    of `Content-Length: 0` lines, the costliest; 10 us for 8 KiB of pipelined GETs)."""

    def __init__(self, server: _BoundedServer) -> None:
        self._server = server
        self._handler: web.RequestHandler | None = None
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(server.limits.read_size)
        self._line = b""  # the line in progress: handed on already, examined once its line feed comes
        self._body = False  # a head announcing a body began: the parser gets nothing past its end
        self._cut = False  # that end was handed on
        self._answers = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        handler = self._server.admit(transport)
        if handler is None:
            transport.abort()  # RST: the descriptor is free at once (no TIME_WAIT, nothing to read)
            return
        # No bytes wait in our buffer: a write returns only when the kernel took all of it, so an answer the
        # client does not read meets the answer deadline however small it is, and a close never waits on a
        # buffer the client will not drain (asyncio's `close()` flushes first, with no deadline).
        transport.set_write_buffer_limits(high=0)
        self._handler, self._transport = handler, transport
        handler.connection_made(transport)

    def get_buffer(self, sizehint: int) -> bytearray:
        return self._buffer  # one read per turn of the loop fills at most this much

    def buffer_updated(self, nbytes: int) -> None:
        if self._handler is None:
            return
        if self._cut:
            # More bytes after a head that announced a body: aiohttp resumed reading (its queue of answers
            # drained), and the peer is sending the body or more. Nothing here reads them.
            assert self._transport is not None
            self._transport.abort()
            return
        data = bytes(self._buffer[:nbytes])
        end = self._end_of_body_head(data)
        if end is not None:
            data, self._cut = data[:end], True
            assert self._transport is not None
            self._transport.pause_reading()
        self._handler.data_received(data)

    def _end_of_body_head(self, data: bytes) -> int | None:
        """Where in `data` the head that announces a body ends; None: not in `data`, or no such head yet."""
        window = b"\n" + self._line + data  # from the line feed before the line in progress
        lines_end = window.rfind(b"\n") + 1
        line = window[lines_end:]
        start = 0
        if not self._body:
            start = _body_header(window[:lines_end].lower())
            if start < 0 and len(line) > self._server.limits.max_line_size + _LINE_SLACK:
                start = lines_end - 1
            self._body = start >= 0
        if not self._body:
            self._line = line
            return None
        self._line = b"x" if line.strip(b" \t\r") else b""  # all the head's end needs of it: is it blank
        end = _HEAD_END.search(window, start)
        return None if end is None else end.end() - (len(window) - len(data))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handler is not None:
            self._handler.connection_lost(exc)

    def eof_received(self) -> None:
        if self._handler is not None:
            self._handler.eof_received()

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def answered(self) -> bool:
        """One more answer on this connection: whether it is its last (`requests_per_connection`)."""
        self._answers += 1
        return self._answers >= self._server.limits.requests_per_connection


def _body_header(lines: bytes) -> int:
    """Where in `lines` (whole, lowered, after a line feed) the first mention that may announce a body is, or
    -1 (see `_Gate`)."""
    found = [lines.find(b"transfer-encoding")]
    if b"content-length" in lines and b"content-length" in _ZERO_LENGTH.sub(b"\n", lines):
        found.append(lines.find(b"content-length"))
    return min((at for at in found if at >= 0), default=-1)


class HttpServer:
    """A listening endpoint; `cleanup()` stops it."""

    def __init__(self, routes: Mapping[str, Handler], limits: Limits) -> None:
        self._routes = routes
        self._limits = limits
        #: called by `cleanup()` first: what the routes started (a render or a check in progress) stops
        self.on_cleanup: list[Callable[[], None]] = []
        self.server = _BoundedServer(self._handle, limits)
        self._runner = web.ServerRunner(self.server, shutdown_timeout=1.0)
        self._site: web.TCPSite | None = None

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port, backlog=self._limits.connections)
        try:
            await self._site.start()
        except BaseException:
            await self._runner.cleanup()
            raise

    @property
    def port(self) -> int:
        assert self._site is not None
        return self._site.port

    async def cleanup(self) -> None:
        for stop in self.on_cleanup:
            stop()
        await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self._limits.answer_deadline_s):
                response = await self._answer(request)
                gate = request.transport.get_protocol() if request.transport is not None else None
                if isinstance(gate, _Gate) and gate.answered():  # the connection's last
                    response.force_close()
                await response.prepare(request)
                await response.write_eof()
                return response
        except (TimeoutError, ConnectionError):
            # Not computed or not taken in time, or the client reset the connection meanwhile (any pod can, as
            # often as it likes: not our error, not logged): drop the connection, aiohttp then writes nothing.
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=503)

    async def _answer(self, request: web.BaseRequest) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return _text(405, "method not allowed\n", Allow="GET, HEAD")
        if request.body_exists:
            response = _text(413, "request bodies are refused\n")
            response.force_close()
            return response
        handler = self._routes.get(request.path)
        if handler is None:
            return _text(404, "not found\n")
        answer = handler()
        status, ctype, body = await answer if inspect.isawaitable(answer) else answer
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})


def _text(status: int, text: str, **headers: str) -> web.Response:
    return web.Response(status=status, body=text.encode(), headers={"Content-Type": TEXT, **headers})


async def start_http(
    endpoint: str,
    *,
    metrics_path: str,
    readiness: Readiness | None = None,
    registry: CollectorRegistry = REGISTRY,
    routes: Mapping[str, Handler] | None = None,
    limits: Limits = Limits(),
) -> HttpServer:
    """Serve until `await server.cleanup()`. An empty metrics_path serves no metrics; `routes` adds paths."""
    host, port = parse_endpoint(endpoint)
    served: dict[str, Handler] = {"/healthz": lambda: (200, TEXT, b"ok\n"), **(routes or {})}
    exposition = Exposition(registry, limits.metrics_every_s)
    if metrics_path:

        async def metrics() -> Answer:
            return 200, CONTENT_TYPE_LATEST, await exposition.text()

        served[metrics_path] = metrics
    if readiness is not None:
        ready_fn = readiness

        def readyz() -> Answer:
            ready, details = ready_fn()
            return 200 if ready else 503, "application/json", json.dumps(dict(details)).encode()

        served["/readyz"] = readyz
    server = HttpServer(served, limits)
    server.on_cleanup.append(exposition.close)
    await server.start(host, port)
    log.info("http serving endpoint=%s:%d metrics=%s", host, server.port, metrics_path or "(off)")
    return server


def bound_port(server: HttpServer) -> int:
    """The port actually bound (port 0 in tests picks a free one)."""
    return server.port
