"""A scripted apiserver stand-in for the client unit tests, on aiohttp's test server (``aiohttp.test_utils``).

Each request is recorded as ``Recorded(method, target, headers, body)``; the answer is the next queued
``Reply`` (default: 200 with a small object), or what ``answer`` returns. A reply can be streamed in chunks
with pauses, or close the connection instead of answering, so the client's keep-alive, watch and failure
paths run on a real socket.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class Reply:
    status: int = 200
    body: bytes = b'{"metadata": {"name": "x", "resourceVersion": "7"}}'
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: stream the body in these pieces (chunked transfer), sleeping ``pause`` seconds before each
    chunks: list[bytes] | None = None
    pause: float = 0.0
    #: close the connection without answering (after the whole request was read)
    hang_up: bool = False
    #: close the connection after answering (no keep-alive)
    close_after: bool = False
    #: after the last chunk, keep the stream open until this event is set (a watch that goes quiet)
    hold_open: asyncio.Event | None = None


def json_reply(obj: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Reply:
    return Reply(status=status, body=json.dumps(obj).encode(), headers=headers or [])


def status_reply(code: int, reason: str, message: str, headers: list[tuple[str, str]] | None = None) -> Reply:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason}
    body["message"] = message
    return json_reply(body, code, headers)


@dataclass(frozen=True)
class Recorded:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


class ApiStub:
    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[Recorded] = []
        self.url = ""
        #: when set, answers every request instead of the queue (a stand-in that routes by path)
        self.answer: Callable[[Recorded], Reply] | None = None
        #: when set, every request waits for this event before it is answered
        self.hold: asyncio.Event | None = None
        self.in_flight = 0
        self.most_in_flight = 0
        self._transports: list[asyncio.BaseTransport] = []
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._server = TestServer(app, host="127.0.0.1")

    @property
    def connections(self) -> int:
        return len(self._transports)

    async def __aenter__(self) -> ApiStub:
        await self._server.start_server()
        self.url = str(self._server.make_url("")).rstrip("/")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.close()

    def drop_idle_connections(self) -> None:
        """Close every connection from the server side, as an apiserver does with idle keep-alives."""
        for transport in self._transports:
            transport.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        if not any(t is request.transport for t in self._transports):
            self._transports.append(request.transport)
        headers = {k.lower(): v for k, v in request.headers.items()}
        recorded = Recorded(request.method, request.path_qs, headers, await request.read())
        self.requests.append(recorded)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold.wait()
        finally:
            self.in_flight -= 1
        reply = self.answer(recorded) if self.answer else self.replies.pop(0) if self.replies else Reply()
        if reply.hang_up:
            request.transport.close()
            raise asyncio.CancelledError  # nothing more goes out on this connection
        resp_headers = {"Content-Type": "application/json", **dict(reply.headers)}
        if reply.chunks is None:
            resp = web.Response(status=reply.status, body=reply.body, headers=resp_headers)
            if reply.close_after:
                resp.force_close()
            return resp
        stream = web.StreamResponse(status=reply.status, headers=resp_headers)
        stream.enable_chunked_encoding()
        await stream.prepare(request)
        for chunk in reply.chunks:
            await asyncio.sleep(reply.pause)
            await stream.write(chunk)
        if reply.hold_open is not None:
            await reply.hold_open.wait()
        await stream.write_eof()
        return stream
