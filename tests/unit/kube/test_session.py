"""The client's aiohttp session on a real socket: keep-alive reuse and identity, a connection the server closed,
no second POST or PATCH after a connection closed on it, deadlines, size bounds, streamed watches with an
inactivity deadline, a token re-read at once after a 401, and the environment's proxy."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from computedomain.kube import errors
from computedomain.kube.client import COMPUTE_DOMAINS, PODS, ClientConfig, KubeClient
from computedomain.kube.config import Credentials, TokenFile
from computedomain.kube.decoding import MAX_OBJECT_BYTES
from tests.unit.kube.apistub import ApiStub, Reply, status_reply

pytestmark = pytest.mark.timeout(20)


def _client(url: str, auth: object = None, **config: object) -> KubeClient:
    settings: dict[str, object] = {"qps": 0, "max_attempts": 3, "backoff_base": 0.001, "backoff_cap": 0.01}
    settings.update(config)
    creds = Credentials(url) if auth is None else Credentials(url, auth=auth)  # type: ignore[arg-type]
    return KubeClient(creds, config=ClientConfig(**settings), rng=random.Random(5))  # type: ignore[arg-type]


class Tokens:
    tls = None

    def __init__(self, *tokens: str) -> None:
        self._tokens = iter(tokens)

    async def authorization(self) -> str | None:
        return f"Bearer {next(self._tokens)}"

    async def rejected(self, authorization: str | None) -> bool:
        return False


async def test_keep_alive_reuses_one_connection_and_sends_identity() -> None:
    async with ApiStub() as fake:
        client = _client(fake.url, Tokens("t1", "t2", "t3"), user_agent="ua/1")
        try:
            for _ in range(3):
                await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
    assert fake.connections == 1
    assert [r.headers["authorization"] for r in fake.requests] == ["Bearer t1", "Bearer t2", "Bearer t3"]
    assert fake.requests[0].headers["user-agent"] == "ua/1"
    assert fake.requests[0].headers["host"] == fake.url.removeprefix("http://")


async def test_a_connection_closed_while_idle_is_replaced() -> None:
    async with ApiStub() as fake:
        client = _client(fake.url)
        try:
            await client.get(PODS, "a", namespace="ns")
            fake.drop_idle_connections()
            await asyncio.sleep(0.05)  # let the close reach us (a real idle timeout is long past here)
            await client.create(PODS, {"metadata": {"name": "b"}}, namespace="ns")
        finally:
            await client.close()
    assert [r.method for r in fake.requests] == ["GET", "POST"], "the POST went out exactly once"
    assert fake.connections == 2


@pytest.mark.parametrize("write", ["create", "merge_patch", "apply"])
async def test_a_write_the_server_read_and_then_hung_up_on_is_never_sent_again(write: str) -> None:
    """A POST or PATCH that reached the apiserver may have been carried out: a connection closed before the
    answer is an error for the caller, never a second request (even over a kept-alive connection)."""
    async with ApiStub() as fake:
        client = _client(fake.url, max_attempts=5)
        try:
            await client.get(PODS, "warm", namespace="ns")  # the write goes over a reused connection
            fake.replies = [Reply(hang_up=True)]
            body = {"metadata": {"name": "cd", "namespace": "ns"}}
            with pytest.raises(errors.Transient) as caught:
                if write == "create":
                    await client.create(COMPUTE_DOMAINS, body)
                elif write == "merge_patch":
                    await client.merge_patch(COMPUTE_DOMAINS, "cd", {"spec": {}}, namespace="ns")
                else:
                    await client.apply(COMPUTE_DOMAINS, body)
        finally:
            await client.close()
    assert caught.value.verb in ("create", "patch", "apply")
    assert [r.method for r in fake.requests[1:]] == ["POST" if write == "create" else "PATCH"], "sent once"


async def test_a_read_the_server_hung_up_on_goes_again() -> None:
    async with ApiStub() as fake:
        fake.replies = [Reply(hang_up=True)]
        client = _client(fake.url)
        try:
            out = await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
    assert out["metadata"]["resourceVersion"] == "7"
    assert [r.method for r in fake.requests] == ["GET", "GET"]


async def test_a_write_refused_with_429_goes_again() -> None:
    async with ApiStub() as fake:
        fake.replies = [status_reply(429, "TooManyRequests", "APF", [("Retry-After", "0")])]
        client = _client(fake.url)
        try:
            await client.create(PODS, {"metadata": {"name": "p"}}, namespace="ns")
        finally:
            await client.close()
    assert [r.method for r in fake.requests] == ["POST", "POST"]


@pytest.mark.parametrize("status", [301, 307, 308])
async def test_a_redirect_is_an_error_not_the_object(status: int) -> None:
    """A 3xx (not followed: the token would go to the new address) was taken as success, its empty body as the
    object written."""
    async with ApiStub() as fake:
        fake.replies = [Reply(status=status, body=b"", headers=[("Location", "https://elsewhere.example/")])] * 2
        client = _client(fake.url)
        try:
            with pytest.raises(errors.KubeError) as caught:
                await client.merge_patch(PODS, "p", {"metadata": {"labels": {"a": "b"}}}, namespace="ns")
            with pytest.raises(errors.KubeError):
                [_ async for _ in client.watch(PODS, namespace="ns")]
        finally:
            await client.close()
    assert caught.value.status == status
    assert [r.method for r in fake.requests] == ["PATCH", "GET"], "sent once each, to the server asked"


async def test_a_write_that_found_no_server_goes_again() -> None:
    client = _client("http://127.0.0.1:1", max_attempts=2)
    try:
        with pytest.raises(errors.Transient) as caught:
            await client.create(PODS, {"metadata": {"name": "p"}}, namespace="ns")
    finally:
        await client.close()
    assert "127.0.0.1:1" in str(caught.value), "the line names the address"
    assert caught.value.reason == "ConnectFailed"


async def test_connection_close_answers_are_not_pooled() -> None:
    async with ApiStub() as fake:
        fake.replies = [Reply(close_after=True), Reply()]
        client = _client(fake.url)
        try:
            await client.get(PODS, "a", namespace="ns")
            await client.get(PODS, "b", namespace="ns")
        finally:
            await client.close()
    assert fake.connections == 2


async def test_every_call_has_a_deadline() -> None:
    async with ApiStub() as fake:
        fake.replies = [Reply(chunks=[b"{}"], pause=2.0)]
        client = _client(fake.url, timeout=0.2, max_attempts=1)
        try:
            with pytest.raises(errors.Transient, match=r"no response within 0\.2s") as caught:
                await client.get(PODS, "slow", namespace="ns")
        finally:
            await client.close()
    assert caught.value.reason == "Timeout"


async def test_an_oversized_object_is_refused_unread() -> None:
    async with ApiStub() as fake:
        fake.replies = [Reply(chunks=[b"x" * (1 << 20)] * (MAX_OBJECT_BYTES // (1 << 20) + 2))]
        client = _client(fake.url)
        try:
            with pytest.raises(errors.Permanent, match="over"):
                await client.get(PODS, "big", namespace="ns")
        finally:
            await client.close()


async def test_a_rotated_token_is_read_at_once_after_a_401(tmp_path: Path) -> None:
    """The kubelet rotated the service account token; the apiserver refuses the old one: the file is read
    again at once (not a minute later) and the request goes once more with the new token."""
    token = tmp_path / "token"
    token.write_text("old\n")
    accepted = {"Bearer old"}
    async with ApiStub() as fake:
        fake.answer = lambda r: (
            Reply() if r.headers.get("authorization") in accepted else status_reply(401, "Unauthorized", "no")
        )
        client = _client(fake.url, TokenFile(token))
        try:
            await client.get(PODS, "p", namespace="ns")
            token.write_text("new\n")
            accepted = {"Bearer new"}
            out = await client.create(PODS, {"metadata": {"name": "q"}}, namespace="ns")
            token.write_text("newer\n")  # within the minute, the accepted token is kept
            await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
    assert out["metadata"]["name"] == "x"
    sent = [r.headers["authorization"] for r in fake.requests]
    assert sent == ["Bearer old", "Bearer old", "Bearer new", "Bearer new"]


async def test_a_401_is_raised_when_no_fresher_token_exists(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old\n")
    async with ApiStub() as fake:
        fake.answer = lambda r: status_reply(401, "Unauthorized", "no")
        client = _client(fake.url, TokenFile(token))
        try:
            with pytest.raises(errors.Permanent) as caught:
                await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
    assert caught.value.status == 401
    assert len(fake.requests) == 1


async def test_https_proxy_and_no_proxy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP(S)_PROXY sends the apiserver's requests through the proxy; NO_PROXY exempts the apiserver."""
    async with ApiStub() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        client = _client("http://apiserver.invalid:8080")
        try:
            await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
        assert proxy.requests[0].headers["host"] == "apiserver.invalid:8080"
        assert proxy.requests[0].path.endswith("/api/v1/namespaces/ns/pods/p")
        monkeypatch.setenv("NO_PROXY", "apiserver.invalid")
        client = _client("http://apiserver.invalid:8080", max_attempts=1)
        try:
            with pytest.raises(errors.Transient, match=r"apiserver\.invalid"):
                await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
        assert len(proxy.requests) == 1


async def test_a_server_url_with_a_path_prefix() -> None:
    async with ApiStub() as fake:
        client = _client(f"{fake.url}/clusters/a/")
        try:
            await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
    assert fake.requests[0].path == "/clusters/a/api/v1/namespaces/ns/pods/p"


async def test_watch_events_split_across_chunks_and_lines() -> None:
    events = (
        b'{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}}}\n'
        b'{"type":"MODIFIED","object":{"metadata":{"name":"a","resourceVersion":"2"}}}\n'
        b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"3"}}}\n'
    )
    async with ApiStub() as fake:
        # pieces that cut through an event and hold several at once
        fake.replies = [Reply(chunks=[events[:10], events[10:100], events[100:]])]
        client = _client(fake.url)
        try:
            got = [(e.type, e.resource_version) async for e in client.watch(PODS, namespace="ns", resource_version="0")]
        finally:
            await client.close()
    assert got == [("ADDED", "1"), ("MODIFIED", "2"), ("BOOKMARK", "3")]
    assert fake.requests[0].target.startswith("/api/v1/namespaces/ns/pods?watch=true")
    assert "allowWatchBookmarks=true" in fake.requests[0].target


async def test_a_silent_watch_is_transient() -> None:
    async with ApiStub() as fake:
        fake.replies = [Reply(chunks=[b'{"type":"ADDED","object":{"metadata":{"name":"a"}}}\n', b"x"], pause=1.0)]
        client = _client(fake.url)
        try:
            with pytest.raises(errors.Transient, match="silent") as caught:
                async for _ in client.watch(PODS, inactivity_timeout=0.2):
                    pass
        finally:
            await client.close()
    assert caught.value.reason == "Timeout"


async def test_watch_error_status_and_expired_event() -> None:
    async with ApiStub() as fake:
        fake.replies = [
            Reply(
                chunks=[
                    b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}\n'
                ]
            ),
            status_reply(410, "Expired", "too old as well"),
        ]
        client = _client(fake.url)
        try:
            for _ in range(2):
                with pytest.raises(errors.Gone):
                    async for _ in client.watch(PODS, resource_version="1"):
                        pass
        finally:
            await client.close()
