"""HTTP/1.1 to the apiserver over asyncio streams: the wire under ``client.KubeClient``.

What it owns: a pool of keep-alive connections to one apiserver (TLS with the credentials' context, or plain
HTTP for tests), one request/response exchange with a deadline (``request``), and streamed responses that own
their connection (``stream``: watches). Framing is ``h11`` (sans-I/O HTTP/1.1: request and response parsing,
chunked transfer, keep-alive rules); this module only moves bytes between it and the socket.

Why not a general HTTP client: the service needs a dozen lines of HTTP (one host, JSON bodies, bearer or
client-certificate auth, streamed watches), and a general client plus the generated Kubernetes client cost
every process about 1,300-1,500 imported modules and 60 MiB before any work; with this module a process
imports about 280-450 (count them with ``python -X importtime``).

Failures are ``TransportError`` (an ``OSError``: the caller maps it to ``Transient``) or ``TimeoutError``.
A pooled connection that the server closed while idle is found out on reuse and the request goes once more
over a new connection, as Go's and every other keep-alive client does; nothing else is retried here.

Concurrency: one ``Transport`` per client, shared by its tasks. A connection is used by one exchange at a
time: taken from the idle list (or opened), returned only when the exchange ended cleanly and both sides
want to keep it. Responses are bounded (``max_body``) and headers by h11's event-size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

import h11

__all__ = ["Endpoint", "Response", "StreamResponse", "Transport", "TransportError"]

_READ_SIZE: Final = 64 * 1024
#: the largest response body read into memory (a list of thousands of objects is a few MiB)
MAX_BODY: Final = 256 * 1024 * 1024
#: the largest header block, and the largest chunk-size line, h11 buffers
MAX_HEADERS: Final = 64 * 1024

Headers = Sequence[tuple[str, str]]


class TransportError(OSError):
    """No (complete) answer: connection refused or broken, TLS failure, malformed HTTP."""


class BodyTooLargeError(TransportError):
    """A response body over the reader's limit (the rest is not read; the connection is closed)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the apiserver listens: ``https://host:port`` (or ``http`` in unit tests)."""

    scheme: str
    host: str
    port: int
    #: name to check the server certificate against when it differs from ``host`` (kubeconfig tls-server-name)
    server_name: str = ""

    @classmethod
    def parse(cls, url: str, *, server_name: str = "") -> Endpoint:
        parts = urlsplit(url if "://" in url else f"https://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"apiserver URL {url!r} must look like https://host[:port]")
        if parts.path not in ("", "/"):
            raise ValueError(f"apiserver URL {url!r}: a path prefix is not supported")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, server_name)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(
        default_factory=lambda: h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADERS)
    )
    reused: bool = False

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and self.h11.our_state is h11.IDLE

    def close(self) -> None:
        self.writer.close()


class _StaleConnectionError(Exception):
    """A reused connection turned out closed before any answer: send again over a new one."""


class StreamResponse:
    """A response whose body is read as it arrives; owns its connection until ``aclose``."""

    def __init__(self, conn: _Conn, status: int, headers: Mapping[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self._done = False

    async def chunks(self, idle_timeout: float | None) -> AsyncIterator[bytes]:
        """The body's data as it arrives; ``TimeoutError`` when nothing came for ``idle_timeout`` seconds."""
        while not self._done:
            try:
                event = self._conn.h11.next_event()
                if event is h11.NEED_DATA:
                    async with asyncio.timeout(idle_timeout):
                        data = await _read(self._conn)
                    self._conn.h11.receive_data(data)
                    continue
            except h11.RemoteProtocolError as exc:
                raise TransportError(f"malformed HTTP response body: {exc}") from exc
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                self._done = True
            else:
                raise TransportError(f"unexpected HTTP event in a streamed body: {type(event).__name__}")

    async def read(self, limit: int = MAX_BODY) -> bytes:
        body = bytearray()
        async for chunk in self.chunks(None):
            body += chunk
            if len(body) > limit:
                raise BodyTooLargeError(f"response body larger than {limit} bytes")
        return bytes(body)

    def aclose(self) -> None:
        """Close the connection (a stream's connection is never reused)."""
        self._done = True
        self._conn.close()


async def _read(conn: _Conn) -> bytes:
    try:
        return await conn.reader.read(_READ_SIZE)
    except (ConnectionError, ssl.SSLError) as exc:
        raise TransportError(f"{type(exc).__name__}: {exc}") from exc


class Transport:
    """Keep-alive HTTP/1.1 connections to one apiserver (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        ssl_context: ssl.SSLContext | None = None,
        auth: Callable[[], Awaitable[str | None]] | None = None,
        user_agent: str = "computedomain",
        max_idle: int = 16,
    ) -> None:
        if endpoint.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()
        self.endpoint = endpoint
        self._ssl = ssl_context if endpoint.scheme == "https" else None
        self._auth = auth
        self.user_agent = user_agent
        self._max_idle = max_idle
        self._idle: list[_Conn] = []
        self._closed = False

    # ---- connections -----------------------------------------------------------------------------------

    async def _open(self) -> _Conn:
        if self._closed:
            raise TransportError("the client was closed")
        ep = self.endpoint
        try:
            reader, writer = await asyncio.open_connection(
                ep.host,
                ep.port,
                ssl=self._ssl,
                server_hostname=(ep.server_name or ep.host) if self._ssl else None,
                limit=_READ_SIZE,
            )
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot connect to {ep.url}: {exc}") from exc
        return _Conn(reader, writer)

    def _take(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        return None

    def _give_back(self, conn: _Conn) -> None:
        if (
            not self._closed
            and conn.h11.our_state is h11.DONE
            and conn.h11.their_state is h11.DONE
            and len(self._idle) < self._max_idle
        ):
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()

    # ---- exchanges --------------------------------------------------------------------------------------

    async def _headers(self, headers: Headers, body: bytes | None) -> list[tuple[str, str]]:
        out = [("Host", self.endpoint.authority), ("User-Agent", self.user_agent)]
        token = await self._auth() if self._auth is not None else None
        if token:
            out.append(("Authorization", f"Bearer {token}"))
        out += list(headers)
        if body is not None:
            out.append(("Content-Length", str(len(body))))
        return out

    async def _send(self, conn: _Conn, method: str, target: str, headers: Headers, body: bytes | None) -> None:
        all_headers = await self._headers(headers, body)
        try:
            data = conn.h11.send(h11.Request(method=method, target=target, headers=all_headers))
            if body:
                data = (data or b"") + (conn.h11.send(h11.Data(data=body)) or b"")
            data = (data or b"") + (conn.h11.send(h11.EndOfMessage()) or b"")
            conn.writer.write(data)
            await conn.writer.drain()
        except h11.LocalProtocolError as exc:
            raise TransportError(f"cannot send {method} {target}: {exc}") from exc
        except (ConnectionError, ssl.SSLError) as exc:
            if conn.reused:
                raise _StaleConnectionError from exc
            raise TransportError(f"{method} {target}: {type(exc).__name__}: {exc}") from exc

    async def _response_head(self, conn: _Conn) -> h11.Response:
        got_data = False
        while True:
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise TransportError(f"malformed HTTP response: {exc}") from exc
            if event is h11.NEED_DATA:
                try:
                    data = await _read(conn)
                except TransportError:
                    if conn.reused and not got_data:
                        raise _StaleConnectionError from None
                    raise
                if not data and conn.reused and not got_data:
                    raise _StaleConnectionError
                got_data = got_data or bool(data)
                try:
                    conn.h11.receive_data(data)
                except h11.RemoteProtocolError as exc:
                    raise TransportError(f"malformed HTTP response: {exc}") from exc
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                return event
            if isinstance(event, h11.ConnectionClosed):
                if conn.reused and not got_data:
                    raise _StaleConnectionError
                raise TransportError("the server closed the connection without an answer")
            raise TransportError(f"unexpected HTTP event {type(event).__name__}")

    async def _exchange(self, method: str, target: str, headers: Headers, body: bytes | None) -> StreamResponse:
        for _ in range(2):
            conn = self._take() or await self._open()
            try:
                await self._send(conn, method, target, headers, body)
                head = await self._response_head(conn)
            except _StaleConnectionError:
                conn.close()
                continue
            except BaseException:
                conn.close()
                raise
            decoded = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
            return StreamResponse(conn, head.status_code, decoded)
        raise TransportError(f"{method} {target}: the server closed two connections in a row")

    async def request(
        self,
        method: str,
        target: str,
        *,
        headers: Headers = (),
        body: bytes | None = None,
        within: float | None = None,
        limit: int = MAX_BODY,
    ) -> Response:
        """One exchange, the whole body read (``BodyTooLargeError`` past ``limit`` bytes), within ``within`` seconds
        (``TimeoutError`` otherwise)."""
        resp: StreamResponse | None = None
        try:
            async with asyncio.timeout(within):
                resp = await self._exchange(method, target, headers, body)
                data = await resp.read(limit)
        except BaseException:
            if resp is not None:
                resp.aclose()
            raise
        self._give_back(resp._conn)
        return Response(resp.status, resp.headers, data)

    async def stream(
        self, method: str, target: str, *, headers: Headers = (), within: float | None = None
    ) -> StreamResponse:
        """Send and wait (``within`` seconds) for the response head; the caller reads the body and must ``aclose``."""
        async with asyncio.timeout(within):
            return await self._exchange(method, target, headers, None)
