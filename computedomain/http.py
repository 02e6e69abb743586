"""The HTTP endpoint of our processes: prometheus-client metrics, `/healthz`, optionally `/readyz`.

Owns parsing `HTTP_ENDPOINT` (`host:port`; empty host: every address; `[v6]:port` and a bare IPv6 literal
before the last colon both work) and a small HTTP/1.1 server on the caller's event loop (asyncio streams,
framing by `h11`, as the API client's transport). It answers GET (and HEAD) of three paths and nothing else:
the metrics are the process-wide prometheus-client registry, rendered at scrape time; `/healthz` answers while
the event loop does; `/readyz` is served only when the caller passes a readiness function (`(ready, details)`:
200 or 503 with the details as JSON); a caller may add paths of its own (the IMEX daemon's `/ready`). Requests are bounded (headers 16 KiB, no bodies) and a connection that
sends nothing for `IDLE_TIMEOUT_S` is closed, so a scraper cannot hold the loop.

Used by the controller (with `/readyz`: ready once caches synced, with the leadership state), the node agent
and the IMEX daemon wrapper (only `/healthz` and its probe's `/ready`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import h11

from computedomain.metrics import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from computedomain.settings import EndpointError, parse_endpoint

__all__ = ["EndpointError", "HttpServer", "bound_port", "parse_endpoint", "start_http"]

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, Mapping[str, Any]]]


IDLE_TIMEOUT_S: Final = 30.0
_MAX_HEADERS: Final = 16 * 1024

Answer = tuple[int, str, bytes]
#: a route's handler: (status, content type, body), computed now (a coroutine is awaited)
Handler = Callable[[], Answer | Awaitable[Answer]]


class HttpServer:
    """A listening endpoint; `cleanup()` stops it."""

    def __init__(self, routes: Mapping[str, Handler]) -> None:
        self._routes = routes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._accept, host, port)

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def cleanup(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (TimeoutError, ConnectionError, h11.ProtocolError):
            pass  # a client that went away, idled or spoke no HTTP: nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADERS)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                async with asyncio.timeout(IDLE_TIMEOUT_S):
                    conn.receive_data(await reader.read(16 * 1024))
                continue
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                continue  # a body or the end of the request: ignored, the answer depends only on the path
            method = event.method.decode("ascii", "replace")
            path = event.target.decode("ascii", "replace").split("?", 1)[0]
            handler = self._routes.get(path)
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain; charset=utf-8", b"method not allowed\n"
            elif handler is None:
                status, ctype, body = 404, "text/plain; charset=utf-8", b"not found\n"
            else:
                answer = handler()
                status, ctype, body = await answer if inspect.isawaitable(answer) else answer
            headers = [("Content-Type", ctype), ("Content-Length", str(len(body)))]
            out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
            if method != "HEAD":
                out += conn.send(h11.Data(data=body)) or b""
            out += conn.send(h11.EndOfMessage()) or b""
            writer.write(out)
            await writer.drain()
            # Read the rest of the request (a client may send a body), then the next one or the end.
            while conn.their_state is h11.SEND_BODY:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    async with asyncio.timeout(IDLE_TIMEOUT_S):
                        conn.receive_data(await reader.read(16 * 1024))
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()


async def start_http(
    endpoint: str,
    *,
    metrics_path: str,
    readiness: Readiness | None = None,
    registry: CollectorRegistry = REGISTRY,
    routes: Mapping[str, Handler] | None = None,
) -> HttpServer:
    """Serve until `await server.cleanup()`. An empty metrics_path serves no metrics; `routes` adds paths."""
    host, port = parse_endpoint(endpoint)
    served: dict[str, Handler] = {"/healthz": lambda: (200, "text/plain; charset=utf-8", b"ok\n"), **(routes or {})}
    if metrics_path:
        served[metrics_path] = lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry))
    if readiness is not None:
        ready_fn = readiness

        def readyz() -> Answer:
            ready, details = ready_fn()
            return 200 if ready else 503, "application/json", json.dumps(dict(details)).encode()

        served["/readyz"] = readyz
    server = HttpServer(served)
    await server.start(host, port)
    log.info("http serving endpoint=%s:%d metrics=%s", host, port, metrics_path or "(off)")
    return server


def bound_port(server: HttpServer) -> int:
    """The port actually bound (port 0 in tests picks a free one)."""
    return server.port
