"""A scripted HTTP/1.1 server on 127.0.0.1 for the client and transport unit tests.

Each request is recorded as `Recorded(method, target, headers, body)`; the answer is the next queued
`Reply` (default: 200 with a small object). A reply can be streamed in chunks with pauses, or close the
connection instead of answering, so the transport's keep-alive, chunked and failure paths are exercised on
a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11


@dataclass
class Reply:
    status: int = 200
    body: bytes = b'{"metadata": {"name": "x", "resourceVersion": "7"}}'
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: stream the body in these pieces (chunked transfer), sleeping `pause` seconds before each
    chunks: list[bytes] | None = None
    pause: float = 0.0
    #: close the connection without answering
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


class FakeServer:
    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[Recorded] = []
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []
        #: when set, answers every request instead of the queue (a stand-in that routes by path)
        self.answer: Callable[[Recorded], Reply] | None = None
        #: when set, every request waits for this event before it is answered
        self.hold: asyncio.Event | None = None
        self.in_flight = 0
        self.most_in_flight = 0

    async def __aenter__(self) -> FakeServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def drop_idle_connections(self) -> None:
        """Close every connection from the server side, as an apiserver does with idle keep-alives."""
        for writer in self.writers:
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        self.writers.append(writer)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, h11.ProtocolError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Request):
                request, body = event, bytearray()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                headers = {k.decode().lower(): v.decode() for k, v in request.headers}
                self.requests.append(Recorded(request.method.decode(), request.target.decode(), headers, bytes(body)))
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                try:
                    if self.hold is not None:
                        await self.hold.wait()
                finally:
                    self.in_flight -= 1
                recorded = self.requests[-1]
                reply = self.answer(recorded) if self.answer else self.replies.pop(0) if self.replies else Reply()
                if reply.hang_up:
                    return
                await self._answer(conn, writer, reply)
                if reply.close_after or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, reply: Reply) -> None:
        headers = [("Content-Type", "application/json"), *reply.headers]
        if reply.close_after:
            headers.append(("Connection", "close"))
        if reply.chunks is None:
            headers.append(("Content-Length", str(len(reply.body))))
            writer.write(conn.send(h11.Response(status_code=reply.status, headers=headers)) or b"")
            writer.write(conn.send(h11.Data(data=reply.body)) or b"")
        else:
            headers.append(("Transfer-Encoding", "chunked"))
            writer.write(conn.send(h11.Response(status_code=reply.status, headers=headers)) or b"")
            await writer.drain()
            for chunk in reply.chunks:
                await asyncio.sleep(reply.pause)
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
            if reply.hold_open is not None:
                await reply.hold_open.wait()
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
