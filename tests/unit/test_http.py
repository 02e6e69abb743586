"""The shared HTTP endpoint (metrics, /healthz, /readyz) on a real socket, and the bounds it keeps against
clients that trickle, idle, flood, send bodies or do not read."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from computedomain.http import REFUSED, EndpointError, Exposition, Limits, bound_port, parse_endpoint, start_http
from computedomain.kube.clock import FakeClock
from computedomain.metrics import CollectorRegistry, Counter, GaugeMetricFamily
from tests.unit.trickle import trickle


@pytest.mark.parametrize(
    ("endpoint", "parsed"),
    [
        (":8080", ("0.0.0.0", 8080)),
        ("10.1.2.3:8081", ("10.1.2.3", 8081)),
        ("[fd00::5]:8081", ("fd00::5", 8081)),
        ("fd00::5:8081", ("fd00::5", 8081)),  # `$(POD_IP):port` with an IPv6 pod IP
    ],
)
def test_parse_endpoint(endpoint: str, parsed: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == parsed


@pytest.mark.parametrize("endpoint", ["8080", "host:", "host:http", ":70000"])
def test_bad_endpoint_is_one_line(endpoint: str) -> None:
    with pytest.raises(EndpointError, match=r"HTTP_ENDPOINT .* must look like host:port"):
        parse_endpoint(endpoint)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_metrics_healthz_and_readyz() -> None:
    registry = CollectorRegistry()
    Counter("cd_test_things_total", "Things.", registry=registry).inc(3)
    ready = False
    runner = await start_http(
        "127.0.0.1:0", metrics_path="/m", readiness=lambda: (ready, {"synced": ready}), registry=registry
    )
    try:
        base = f"http://127.0.0.1:{bound_port(runner)}"
        status, body = await asyncio.to_thread(_get, base + "/m")
        assert status == 200 and "cd_test_things_total 3.0" in body
        assert await asyncio.to_thread(_get, base + "/healthz") == (200, "ok\n")
        assert await asyncio.to_thread(_get, base + "/readyz") == (503, '{"synced": false}')
        ready = True
        assert await asyncio.to_thread(_get, base + "/readyz") == (200, '{"synced": true}')
    finally:
        await runner.cleanup()


async def test_no_metrics_path_and_no_readiness() -> None:
    runner = await start_http("127.0.0.1:0", metrics_path="")
    try:
        base = f"http://127.0.0.1:{bound_port(runner)}"
        assert (await asyncio.to_thread(_get, base + "/metrics"))[0] == 404
        assert (await asyncio.to_thread(_get, base + "/readyz"))[0] == 404
        assert (await asyncio.to_thread(_get, base + "/healthz"))[0] == 200
    finally:
        await runner.cleanup()


async def test_methods_and_bodies() -> None:
    runner = await start_http("127.0.0.1:0", metrics_path="")
    try:
        base = f"http://127.0.0.1:{bound_port(runner)}"
        async with aiohttp.ClientSession() as session:
            async with session.head(base + "/healthz") as head:
                assert head.status == 200 and head.headers["Content-Length"] == "3" and await head.read() == b""
            async with session.post(base + "/healthz") as post:
                assert post.status == 405 and post.headers["Allow"] == "GET, HEAD"
            # A body is refused unread, and the connection closed (its bytes are never parsed).
            async with session.get(base + "/healthz", data=b"x" * 100_000) as with_body:
                assert with_body.status == 413 and with_body.headers.get("Connection") == "close"
    finally:
        await runner.cleanup()


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1) == b""
    except ConnectionError:
        return True


async def test_headers_trickled_a_byte_at_a_time_lose_the_connection() -> None:
    """A client that sends its request head slowly holds a connection only until the request deadline, however
    steadily it sends; today's server kept it as long as each byte came within its idle timeout."""
    runner = await start_http("127.0.0.1:0", metrics_path="", limits=Limits(request_deadline_s=0.5))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"
        sent, closed = await trickle(reader, writer, head)  # ~5 s for the whole head, ten times the deadline
        closed = closed or await _closed_by_server(reader)
        writer.close()
        assert closed and sent < len(head), f"sent {sent} of {len(head)} bytes"
        # A prompt client is answered as before.
        assert (await asyncio.to_thread(_get, f"http://127.0.0.1:{bound_port(runner)}/healthz"))[0] == 200
    finally:
        await runner.cleanup()


def _fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


def _refused(limit: str) -> float:
    return REFUSED.labels(limit)._value.get()


async def test_idle_connections_cannot_exhaust_descriptors() -> None:
    """Three hundred connections that never send a byte: the server keeps at most its cap open (the shipped
    caps), resets the others at once, and closes the ones it kept at the request deadline."""
    limits = dataclasses.replace(Limits(), request_deadline_s=2.0)
    runner = await start_http("127.0.0.1:0", metrics_path="", limits=limits)
    port = bound_port(runner)
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    before, refused_before = _fds(), _refused("connections") + _refused("connections_per_peer")
    loop = asyncio.get_running_loop()

    def refused() -> float:
        return _refused("connections") + _refused("connections_per_peer") - refused_before

    try:
        began = loop.time()
        for i in range(300):
            # From several loopback addresses, so that both the per-peer and the total cap are reached.
            sock = socket.socket()
            sock.bind((f"127.0.0.{2 + i % 12}", 0))
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            clients.append(await asyncio.open_connection(sock=sock))
        # Let the server see them all (bounded, however loaded the machine).
        for _ in range(200):
            if refused() >= len(clients) - limits.connections:
                break
            await asyncio.sleep(0.01)
        within_one_deadline = loop.time() - began < limits.request_deadline_s
        server_side = _fds() - before - len(clients)
        assert server_side <= limits.connections, server_side
        assert runner.server.open_connections <= limits.connections
        if within_one_deadline:
            # All of them were open at once: every one over the cap was refused. (On a machine so loaded that
            # opening them took longer, kept ones reach their deadline and free their places meanwhile.)
            assert refused() >= len(clients) - limits.connections
        assert all([await _closed_by_server(reader) for reader, _ in clients])
        assert runner.server.open_connections == 0
    finally:
        for _, writer in clients:
            writer.close()
        await runner.cleanup()


async def test_addresses_that_fill_every_slot_do_not_keep_the_probe_out() -> None:
    """Two addresses hold all four slots with connections that send nothing (3 and 1, within the test's caps;
    the request deadline is 30 s here): the kubelet's probe from a third address is answered, and the busiest
    address's oldest connection is reset for it. The previous server reset the probe's connection."""
    limits = Limits(request_deadline_s=30.0, connections=4, connections_per_peer=3)
    runner = await start_http("127.0.0.1:0", metrics_path="", limits=limits)
    loop = asyncio.get_running_loop()
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.2", "127.0.0.2"):
            sock = socket.socket()
            sock.bind((ip, 0))
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", bound_port(runner)))
            clients.append(await asyncio.open_connection(sock=sock))
        for _ in range(200):  # until the server saw them all (bounded, however loaded the machine)
            if runner.server.open_connections == 4:
                break
            await asyncio.sleep(0.01)
        assert runner.server.open_connections == 4
        status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{bound_port(runner)}/healthz")
        assert status == 200
        assert await asyncio.wait_for(_closed_by_server(clients[0][0]), 10)
        for _ in range(200):  # the probe's connection ends with its answer: three are left
            if runner.server.open_connections == 3:
                break
            await asyncio.sleep(0.01)
        assert runner.server.open_connections == 3
    finally:
        for _, writer in clients:
            writer.close()
        await runner.cleanup()


async def test_a_client_that_does_not_read_the_answer_loses_the_connection() -> None:
    registry = CollectorRegistry()

    class Big:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            family = GaugeMetricFamily("t_big", "Many series.", labels=["i"])
            for i in range(100_000):
                family.add_metric([f"{i:040d}"], i)
            yield family

    registry.register(Big())
    runner = await start_http("127.0.0.1:0", metrics_path="/metrics", registry=registry,
                              limits=Limits(answer_deadline_s=0.5))  # fmt: skip
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", bound_port(runner)))
        _, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        for _ in range(100):  # never reads; the server gives up at the deadline
            await asyncio.sleep(0.05)
            if not runner.server.open_connections:
                break
        assert runner.server.open_connections == 0
        writer.close()
    finally:
        await runner.cleanup()


async def test_small_answers_left_unread_do_not_hold_the_connection() -> None:
    """Pipelined requests whose small answers the client never reads: once the kernel's buffers are full the
    server holds a few bytes it cannot send. asyncio's close() would wait for them forever (the keep-alive
    close has no deadline), so a handful of such clients would hold every connection slot; the answer
    deadline covers every byte, so the connection goes."""
    # However many requests it takes (the per-connection cap would end the connection first).
    limits = Limits(request_deadline_s=0.3, answer_deadline_s=0.5, requests_per_connection=1_000_000)
    runner = await start_http("127.0.0.1:0", metrics_path="", limits=limits)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", bound_port(runner)))

        def unsent() -> int:
            handler = next(iter(runner.server.slots), None)
            transport = handler.transport if handler is not None else None
            return transport.get_write_buffer_size() if transport is not None else 0

        for _ in range(2000):  # until the server has bytes it cannot hand to the kernel
            await asyncio.wait_for(loop.sock_sendall(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 20), 5)
            await asyncio.sleep(0.01)
            if unsent():
                break
        assert unsent(), "the kernel's buffers never filled"
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not runner.server.open_connections:
                break
        assert runner.server.open_connections == 0
    finally:
        sock.close()
        await runner.cleanup()


async def test_a_flood_of_scrapes_costs_one_render_per_interval() -> None:
    registry = CollectorRegistry()
    renders: list[int] = []

    class Counted:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            renders.append(1)
            yield GaugeMetricFamily("t_renders", "Renders so far.", len(renders))

    registry.register(Counted())
    runner = await start_http("127.0.0.1:0", metrics_path="/metrics", registry=registry)
    try:
        url = f"http://127.0.0.1:{bound_port(runner)}/metrics"
        # Forty at once, from five addresses (eight connections each, the per-peer cap).
        sessions = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8, local_addr=(f"127.0.0.{2 + i}", 0)))
            for i in range(5)
        ]

        async def scrape(session: aiohttp.ClientSession) -> str:
            async with session.get(url) as resp:
                return await resp.text()

        try:
            bodies = await asyncio.gather(*(scrape(sessions[i % 5]) for i in range(40)))
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
        # The first renders at once; the 39 that came within the interval share the next render.
        assert len(renders) == 2
        assert {b.split("\nt_renders ")[1].split()[0] for b in bodies} == {"1.0", "2.0"}
    finally:
        await runner.cleanup()


async def test_exposition_never_serves_values_from_before_a_scrape() -> None:
    registry = CollectorRegistry()
    counter = Counter("t_things", "Things.", registry=registry)
    clock = FakeClock()
    exposition = Exposition(registry, every_s=1.0, clock=clock)
    assert b"t_things_total 0.0" in await exposition.text()
    counter.inc()
    waiting = [asyncio.create_task(exposition.text()) for _ in range(10)]
    await clock.advance(0.5)
    assert not any(t.done() for t in waiting)
    await clock.advance(0.5)
    assert {await t for t in waiting} == {await waiting[0]} and b"t_things_total 1.0" in await waiting[0]
    assert exposition.renders == 2
    await clock.advance(5)
    counter.inc()
    assert b"t_things_total 2.0" in await exposition.text()  # idle long enough: rendered at once
    assert exposition.renders == 3


async def _raw(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await reader.read(200)
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def test_request_heads_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """Lines of 4 KiB and 32 headers at most; a bad request is the client's: answered 400, never logged as our
    error (aiohttp logs each one with its traceback at ERROR)."""
    runner = await start_http("127.0.0.1:0", metrics_path="")
    port = bound_port(runner)
    try:
        ok = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 4000) for i in range(30))
        assert (await _raw(port, ok + b"\r\n")).startswith(b"HTTP/1.1 200 ")
        long_line = b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 5000 + b"\r\n\r\n"
        many = b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(40)) + b"\r\n"
        long_path = b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n"
        for head in (long_line, many, long_path):
            answer = await _raw(port, head)
            assert answer[:13] in (b"HTTP/1.0 400 ", b"HTTP/1.1 400 ") or answer == b"", answer[:80]
        assert (await _raw(port, b"\x16\x03\x01 not HTTP\r\n\r\n"))[:13] in (b"HTTP/1.0 400 ", b"HTTP/1.1 400 ")
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_client_that_resets_before_its_answer_costs_no_error_line(caplog: pytest.LogCaptureFixture) -> None:
    """A client that sends a request and resets the connection before the answer is ready (any pod can): the
    answer is dropped without an ERROR line and a traceback, which such clients could otherwise write to our
    log at will; the previous server logged one per connection."""
    answered = asyncio.Event()
    proceed = asyncio.Event()

    async def slow() -> tuple[int, str, bytes]:
        answered.set()
        await proceed.wait()
        return 200, "text/plain", b"x" * 65536

    runner = await start_http("127.0.0.1:0", metrics_path="", routes={"/slow": slow})
    try:
        for _ in range(3):
            answered.clear()
            proceed.clear()
            _, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            await asyncio.wait_for(answered.wait(), 10)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
            writer.transport.abort()
            await asyncio.sleep(0.05)
            proceed.set()
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not runner.server.open_connections:
                    break
        assert runner.server.open_connections == 0
        assert (await asyncio.to_thread(_get, f"http://127.0.0.1:{bound_port(runner)}/healthz"))[0] == 200
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every piece of bytes aiohttp's parser is handed, on any connection."""
    sizes: list[int] = []
    data_received = web.RequestHandler.data_received

    def counted(self: web.RequestHandler, data: bytes) -> None:
        sizes.append(len(data))
        data_received(self, data)

    monkeypatch.setattr(web.RequestHandler, "data_received", counted)
    return sizes


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer off a raw connection: its head and its body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = re.search(rb"\r\nContent-Length: (\d+)\r\n", head)
    assert length is not None, head
    return head, await asyncio.wait_for(reader.readexactly(int(length[1])), 5)


async def _rest(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes or resets the connection."""
    received = b""
    try:
        while data := await asyncio.wait_for(reader.read(65536), 5):
            received += data
    except ConnectionError:
        pass
    return received


@pytest.mark.parametrize(
    ("split", "chunks"),
    [
        pytest.param(False, 3_000, id="one-write"),
        pytest.param(True, 3_000, id="header-and-head-end-split-across-reads"),
        pytest.param(False, 40_000, id="240-KB"),
    ],
)
async def test_a_chunked_body_is_never_parsed(handed: list[int], split: bool, chunks: int) -> None:
    """A GET announcing a chunked body of 1-byte chunks: the parser is handed its head and not a byte more,
    the answer is 413 and the connection closed. aiohttp's parser turned each chunk into a Python callback
    (5 ms of the loop per read of 200 KB); the previous server handed it up to 256 KiB per read. A client still
    sending when the connection closes (more than the kernel's buffers hold) may see a reset instead."""
    runner = await start_http("127.0.0.1:0", metrics_path="")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\ntransfer-ENCODING: chunked\r\n\r\n"
        stream = head + b"1\r\nx\r\n" * chunks
        # Split inside the header's name and between the two line ends that end the head (the server's reads
        # follow the writes, or coalesce them: the outcome is the same).
        cuts = [0, 40, len(head) - 1, len(stream)] if split else [0, len(stream)]
        for begin, end in itertools.pairwise(cuts):
            if begin:
                await asyncio.sleep(0.05)
            writer.write(stream[begin:end])
            await writer.drain()
        # Read at once: a reset that comes before the answer is read makes asyncio drop the answer.
        answer = await _rest(reader)
        writer.close()
        if chunks * 6 < 65536 or answer:
            assert answer.startswith(b"HTTP/1.1 413 ") and b"\r\nConnection: close\r\n" in answer, answer[:200]
        assert sum(handed) == len(head), handed
    finally:
        await runner.cleanup()


async def test_bytes_after_a_cut_head_end_the_connection(handed: list[int]) -> None:
    """Pipelined GETs, then a head announcing a body, then a stream of bytes: aiohttp resumes reading once its
    queue of answers drains, and the server then read and threw away whatever came, at line rate, for as long
    as the answers took (a core for seconds per connection). Now the first bytes read after the cut end the
    connection: the client's writes fail long before it has sent 256 MiB."""
    # Scrapes wait for the next render: 16 of them keep aiohttp's queue of answers full for seconds.
    runner = await start_http("127.0.0.1:0", metrics_path="/metrics", limits=Limits(metrics_every_s=0.5))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        gets = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 17 + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 16
        writer.write(gets + b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        junk = b"x" * 65536
        sent = 0
        with pytest.raises(ConnectionError):
            while sent < 256 << 20:
                writer.write(junk)
                await writer.drain()
                sent += len(junk)
                if not sent % (1 << 20):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(reader.read(1 << 20), 0.001)  # keep the answers flowing
        print(f"bytes sent before the reset: {sent:,}")
        writer.close()
        assert sum(handed) <= len(gets) + 200, handed
    finally:
        await runner.cleanup()


async def test_a_content_length_body_is_refused_unread(handed: list[int]) -> None:
    """A GET with a 20 KB body announced by Content-Length: 413, the connection closed, and only the head
    handed to the parser (the previous server handed it the body as well)."""
    runner = await start_http("127.0.0.1:0", metrics_path="")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n"
        writer.write(head + b"x" * 20_000)
        await writer.drain()
        answer = await _rest(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413 ") and b"\r\nConnection: close\r\n" in answer, answer[:200]
        assert sum(handed) == len(head), handed
    finally:
        await runner.cleanup()


async def test_heads_and_keep_alive_still_work_in_bounded_reads(handed: list[int]) -> None:
    """A plain GET, one with `Content-Length: 0`, a head of 120 KB (30 lines of 4 KB: the largest kind the
    server takes) and three pipelined GETs, on one kept-alive connection: each answered 200, and the parser
    handed at most `read_size` bytes at a time (the previous server handed it the whole head at once)."""
    runner = await start_http("127.0.0.1:0", metrics_path="")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        plain = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        big = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 4000) for i in range(30))
        sent = [plain, b"GET /healthz HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n", big + b"\r\n", plain * 3]
        for request in sent:
            writer.write(request)
            await writer.drain()
            for _ in range(request.count(b"GET ")):
                head, body = await _answer(reader)
                assert head.startswith(b"HTTP/1.1 200 ") and body == b"ok\n", head
                assert b"Connection: close" not in head
        writer.close()
        assert sum(handed) == sum(map(len, sent)) and max(handed) <= Limits().read_size, handed
    finally:
        await runner.cleanup()


async def test_a_connection_ends_after_its_request_cap() -> None:
    """One connection asking `/healthz` again and again (the shipped cap): the hundredth answer says
    `Connection: close` and the server closes the connection; the previous server answered forever, a core
    busy on one connection."""
    cap = Limits().requests_per_connection
    runner = await start_http("127.0.0.1:0", metrics_path="")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        closing = []
        for _ in range(cap):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head, _ = await _answer(reader)
            closing.append(b"\r\nConnection: close\r\n" in head)
        assert closing == [False] * (cap - 1) + [True]
        assert await _rest(reader) == b""
        writer.close()
        # A new connection is answered as before.
        assert (await asyncio.to_thread(_get, f"http://127.0.0.1:{bound_port(runner)}/healthz"))[0] == 200
    finally:
        await runner.cleanup()
