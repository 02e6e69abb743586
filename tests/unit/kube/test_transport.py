"""The HTTP/1.1 transport on a real socket: keep-alive reuse, a connection the server closed while idle,
streamed (chunked) watch bodies with an inactivity deadline, hang-ups and size bounds."""

from __future__ import annotations

import asyncio

import pytest

from computedomain.kube import errors
from computedomain.kube.client import PODS, ClientConfig, KubeClient
from computedomain.kube.transport import Endpoint, Transport, TransportError
from tests.unit.kube.fake_http import FakeServer, Reply

pytestmark = pytest.mark.timeout(10)


async def test_keep_alive_reuses_one_connection_and_sends_identity() -> None:
    async with FakeServer() as fake:
        tokens = iter(["t1", "t2", "t3"])

        async def token() -> str:
            return next(tokens)

        transport = Transport(Endpoint.parse(fake.url), auth=token, user_agent="ua/1")
        try:
            for _ in range(3):
                resp = await transport.request("GET", "/api/v1/pods", within=2)
                assert resp.status == 200
        finally:
            await transport.close()
    assert fake.connections == 1
    assert [r.headers["authorization"] for r in fake.requests] == ["Bearer t1", "Bearer t2", "Bearer t3"]
    assert fake.requests[0].headers["user-agent"] == "ua/1"
    assert fake.requests[0].headers["host"] == fake.url.removeprefix("http://")


async def test_a_connection_closed_while_idle_is_replaced_transparently() -> None:
    async with FakeServer() as fake:
        transport = Transport(Endpoint.parse(fake.url))
        try:
            await transport.request("GET", "/a", within=2)
            fake.drop_idle_connections()
            await asyncio.sleep(0.05)  # let the close reach us (a real idle timeout is long past here)
            resp = await transport.request("POST", "/b", body=b"{}", within=2)
        finally:
            await transport.close()
    assert resp.status == 200
    assert [r.path for r in fake.requests] == ["/a", "/b"], "the request went out exactly once more"
    assert fake.connections == 2


async def test_a_hang_up_on_a_fresh_connection_is_an_error_not_a_retry() -> None:
    async with FakeServer() as fake:
        fake.replies = [Reply(hang_up=True)]
        transport = Transport(Endpoint.parse(fake.url))
        try:
            with pytest.raises(TransportError):
                await transport.request("POST", "/x", body=b"{}", within=2)
        finally:
            await transport.close()
    assert len(fake.requests) == 1


async def test_connection_close_answers_are_not_pooled() -> None:
    async with FakeServer() as fake:
        fake.replies = [Reply(close_after=True), Reply()]
        transport = Transport(Endpoint.parse(fake.url))
        try:
            await transport.request("GET", "/a", within=2)
            await transport.request("GET", "/b", within=2)
        finally:
            await transport.close()
    assert fake.connections == 2


async def test_request_deadline() -> None:
    async with FakeServer() as fake:
        fake.replies = [Reply(chunks=[b"{}"], pause=1.0)]
        transport = Transport(Endpoint.parse(fake.url))
        try:
            with pytest.raises(TimeoutError):
                await transport.request("GET", "/slow", within=0.2)
        finally:
            await transport.close()


async def test_oversized_body_is_refused() -> None:
    async with FakeServer() as fake:
        fake.replies = [Reply(chunks=[b"x" * 1024] * 4)]
        transport = Transport(Endpoint.parse(fake.url))
        try:
            resp = await transport.stream("GET", "/big", within=2)
            with pytest.raises(TransportError, match="larger than 2000"):
                await resp.read(limit=2000)
            resp.aclose()
        finally:
            await transport.close()


def _client(url: str, **config: object) -> KubeClient:
    return KubeClient(Transport(Endpoint.parse(url)), config=ClientConfig(qps=0, **config))  # type: ignore[arg-type]


async def test_watch_events_split_across_chunks_and_lines() -> None:
    events = (
        b'{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}}}\n'
        b'{"type":"MODIFIED","object":{"metadata":{"name":"a","resourceVersion":"2"}}}\n'
        b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"3"}}}\n'
    )
    async with FakeServer() as fake:
        # pieces that cut through an event and hold several at once
        fake.replies = [Reply(chunks=[events[:10], events[10:100], events[100:]])]
        client = _client(fake.url)
        try:
            got = [(e.type, e.resource_version) async for e in client.watch(PODS, namespace="ns", resource_version="0")]
        finally:
            await client.close()
    assert got == [("ADDED", "1"), ("MODIFIED", "2"), ("BOOKMARK", "3")]
    assert fake.requests[0].target.startswith("/api/v1/namespaces/ns/pods?watch=true")


async def test_a_silent_watch_is_transient() -> None:
    async with FakeServer() as fake:
        fake.replies = [Reply(chunks=[b'{"type":"ADDED","object":{"metadata":{"name":"a"}}}\n', b""], pause=0.5)]
        client = _client(fake.url)
        try:
            with pytest.raises(errors.Transient, match="silent"):
                async for _ in client.watch(PODS, inactivity_timeout=0.2):
                    pass
        finally:
            await client.close()


async def test_watch_error_status_and_expired_event() -> None:
    async with FakeServer() as fake:
        fake.replies = [
            Reply(
                chunks=[
                    b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}\n'
                ]
            )
        ]
        client = _client(fake.url)
        try:
            with pytest.raises(errors.Gone):
                async for _ in client.watch(PODS, resource_version="1"):
                    pass
        finally:
            await client.close()


def test_endpoint_parsing() -> None:
    assert Endpoint.parse("https://10.0.0.1:6443").url == "https://10.0.0.1:6443"
    assert Endpoint.parse("https://kube.example").port == 443
    ep = Endpoint.parse("https://[fd00::1]:443")
    assert (ep.host, ep.authority) == ("fd00::1", "[fd00::1]")
    with pytest.raises(ValueError, match="path prefix"):
        Endpoint.parse("https://proxy.example/k8s")
