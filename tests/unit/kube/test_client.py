"""The client's request core against a tiny local HTTP server: error mapping, call-level retries
(Transient and 429 with Retry-After), no retries for NotFound/Conflict, connection errors, paths."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

import pytest

from computedomain.kube import client as client_module
from computedomain.kube import errors
from computedomain.kube.client import (
    COMPUTE_DOMAINS,
    DAEMONSETS,
    NODES,
    PODS,
    ClientConfig,
    KubeClient,
)
from computedomain.kube.config import Credentials
from tests.unit.kube.apistub import ApiStub, Recorded, Reply, json_reply, status_reply

pytestmark = pytest.mark.timeout(10)


def base_credentials(fake: ApiStub) -> Credentials:
    return Credentials(fake.url)


def client_for(url: str, **config: object) -> KubeClient:
    settings: dict[str, object] = {
        "max_attempts": 4,
        "backoff_base": 0.001,
        "backoff_cap": 0.01,
        "deadline": 5.0,
        "qps": 0,
    }
    settings.update(config)
    return KubeClient(Credentials(url), config=ClientConfig(**settings), rng=random.Random(3))  # type: ignore[arg-type]


@pytest.fixture
async def api() -> AsyncIterator[tuple[ApiStub, KubeClient]]:
    async with ApiStub() as fake:
        client = client_for(fake.url)
        try:
            yield fake, client
        finally:
            await client.close()


async def test_paths_queries_and_content_types(api: tuple[ApiStub, KubeClient]) -> None:
    fake, client = api
    await client.get(PODS, "p", namespace="ns")
    await client.list(COMPUTE_DOMAINS, label_selector="a=b,c in (d)", limit=10)
    await client.merge_patch(NODES, "n1", {"metadata": {"labels": {"x": None}}})
    await client.replace(COMPUTE_DOMAINS, {"metadata": {"name": "cd", "namespace": "ns"}}, subresource="status")
    await client.delete(PODS, "p", namespace="ns", uid="u1", propagation_policy="Background")
    methods = [(r.method, r.target) for r in fake.requests]
    assert methods[0] == ("GET", "/api/v1/namespaces/ns/pods/p")
    path, _, query = methods[1][1].partition("?")
    assert path == "/apis/resource.nvidia.com/v1beta1/computedomains"
    assert parse_qs(query) == {"labelSelector": ["a=b,c in (d)"], "limit": ["10"]}
    # Every write carries the apiserver's deadline: the client's per-request timeout (10 s by default).
    assert methods[2] == ("PATCH", "/api/v1/nodes/n1?fieldManager=computedomain&timeout=10000ms")
    assert fake.requests[2].headers["content-type"] == "application/merge-patch+json"
    assert json.loads(fake.requests[2].body) == {"metadata": {"labels": {"x": None}}}
    assert methods[3] == (
        "PUT",
        "/apis/resource.nvidia.com/v1beta1/namespaces/ns/computedomains/cd/status?fieldManager=computedomain&timeout=10000ms",
    )
    # compact JSON: the apiserver keeps embedded raw fields byte for byte
    assert fake.requests[3].headers["content-type"] == "application/json"
    assert fake.requests[3].body == b'{"metadata":{"name":"cd","namespace":"ns"}}'
    assert methods[4] == ("DELETE", "/api/v1/namespaces/ns/pods/p?timeout=10000ms")
    assert json.loads(fake.requests[4].body)["preconditions"] == {"uid": "u1"}
    # one keep-alive connection carried all five
    assert fake.connections == 1


async def test_transient_errors_are_retried_then_succeed(api: tuple[ApiStub, KubeClient]) -> None:
    fake, client = api
    fake.replies = [
        status_reply(503, "ServiceUnavailable", "etcd leader changed"),
        status_reply(500, "InternalError", "x"),
    ]
    out = await client.get(PODS, "p", namespace="ns")
    assert out["metadata"]["resourceVersion"] == "7"
    assert len(fake.requests) == 3


async def test_retries_run_out_with_the_last_error(api: tuple[ApiStub, KubeClient]) -> None:
    fake, client = api
    fake.replies = [status_reply(503, "ServiceUnavailable", f"try {i}") for i in range(10)]
    with pytest.raises(errors.Transient, match="try 3"):
        await client.get(PODS, "p", namespace="ns")
    assert len(fake.requests) == 4


class RecordingClock:
    """Time that never waits: it records what the client asked to sleep."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def now(self) -> float:
        return sum(self.slept)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


async def test_too_many_requests_honours_retry_after(api: tuple[ApiStub, KubeClient]) -> None:
    fake, client = api
    clock = RecordingClock()
    client._clock = clock
    fake.replies = [status_reply(429, "TooManyRequests", "APF", [("Retry-After", "1")])]
    await client.get(PODS, "p", namespace="ns")
    assert len(clock.slept) == 1
    assert clock.slept[0] >= 1.0, "the retry must wait at least Retry-After"
    assert len(fake.requests) == 2


async def test_errors_name_the_request_that_failed(api: tuple[ApiStub, KubeClient]) -> None:
    fake, client = api
    fake.replies = [status_reply(403, "Forbidden", 'daemonsets.apps is forbidden: User "x" cannot create ...')]
    with pytest.raises(errors.Forbidden) as caught:
        await client.create(DAEMONSETS, {"metadata": {"name": "d"}}, namespace="drv")
    err = caught.value
    assert (err.verb, err.resource, err.namespace) == ("create", "daemonsets.apps", "drv")
    assert err.permanent
    assert "may not create daemonsets.apps in namespace drv" in errors.explain(err)


async def test_retry_after_longer_than_the_deadline_is_raised_to_the_caller(api: tuple[ApiStub, KubeClient]) -> None:
    fake, client = api
    fake.replies = [status_reply(429, "TooManyRequests", "APF", [("Retry-After", "30")])]
    with pytest.raises(errors.TooManyRequests) as exc:
        await client.get(PODS, "p", namespace="ns")
    assert exc.value.retry_after == 30.0
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    ("code", "reason", "cls"),
    [(404, "NotFound", errors.NotFound), (409, "Conflict", errors.Conflict), (422, "Invalid", errors.Invalid)],
)
async def test_caller_errors_are_not_retried(
    api: tuple[ApiStub, KubeClient], code: int, reason: str, cls: type[errors.KubeError]
) -> None:
    fake, client = api
    fake.replies = [status_reply(code, reason, "nope")]
    with pytest.raises(cls):
        await client.get(PODS, "p", namespace="ns")
    assert len(fake.requests) == 1


async def test_connection_refused_is_transient() -> None:
    client = client_for("http://127.0.0.1:1", max_attempts=2, timeout=2.0, qps=20.0)
    try:
        with pytest.raises(errors.Transient):
            await client.get(PODS, "x", namespace="default")
    finally:
        await client.close()


def test_resource_paths_validate_scope() -> None:
    assert PODS.path(namespace="ns") == "/api/v1/namespaces/ns/pods"
    assert PODS.path() == "/api/v1/pods"
    assert COMPUTE_DOMAINS.path(namespace="ns", name="cd", subresource="status") == (
        "/apis/resource.nvidia.com/v1beta1/namespaces/ns/computedomains/cd/status"
    )
    with pytest.raises(ValueError, match="namespaced"):
        PODS.path(name="p")
    with pytest.raises(ValueError, match="cluster-scoped"):
        NODES.path(namespace="ns", name="n")


async def test_a_client_with_its_own_budget_never_takes_the_tokens_of_the_first(
    api: tuple[ApiStub, KubeClient],
) -> None:
    fake, base = api
    clock = RecordingClock()
    client = KubeClient(base.credentials, config=ClientConfig(qps=1, burst=2), clock=clock)
    events = client.with_own_budget()
    for _ in range(5):
        await events.get(PODS, "e", namespace="ns")
    assert len(clock.slept) == 3, "the second client waits on its own bucket (burst 2, then 1 per second)"
    clock.slept.clear()
    await client.get(PODS, "p", namespace="ns")
    await client.get(PODS, "p", namespace="ns")
    assert clock.slept == [], "the first client's burst is untouched by the other's writes"
    await events.close()
    await client.get(PODS, "p", namespace="ns")  # closing the other closed nothing
    await client.close()
    assert len(fake.requests) == 8


async def test_a_background_request_takes_a_slot_only_when_no_other_request_waits() -> None:
    async with ApiStub() as fake:
        fake.hold = asyncio.Event()
        client = client_for(fake.url, max_in_flight=2)
        reports = client.with_own_budget(background=True)
        try:
            held = [asyncio.create_task(client.get(PODS, f"held{i}", namespace="ns")) for i in range(2)]
            for _ in range(200):  # until both slots are taken, or two seconds
                if fake.in_flight == 2:
                    break
                await asyncio.sleep(0.01)
            status = asyncio.create_task(reports.get(PODS, "status", namespace="ns"))
            await asyncio.sleep(0)
            work = [asyncio.create_task(client.get(PODS, f"work{i}", namespace="ns")) for i in range(3)]
            await asyncio.sleep(0.05)
            fake.hold.set()
            await asyncio.gather(*held, *work, status)
            order = [r.path.rsplit("/", 1)[1] for r in fake.requests]
            assert order[2:] == ["work0", "work1", "work2", "status"], "the waiting work went first, in order"
            assert fake.most_in_flight == 2, "the background client shares the slots"
        finally:
            await client.close()


async def test_requests_in_flight_are_bounded_and_the_rest_wait_their_turn() -> None:
    async with ApiStub() as fake:
        fake.hold = asyncio.Event()
        client = client_for(fake.url, max_in_flight=3)
        try:
            calls = [asyncio.create_task(client.get(PODS, f"p{i}", namespace="ns")) for i in range(10)]
            for _ in range(200):  # until three are held, or two seconds
                if fake.in_flight == 3:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # time for the other seven to arrive, were they not held back
            assert fake.most_in_flight == 3, "no more than max_in_flight requests reach the server at once"
            fake.hold.set()
            await asyncio.gather(*calls)
            assert fake.most_in_flight == 3
            assert len(fake.requests) == 10
        finally:
            await client.close()


async def test_a_write_gives_the_apiserver_the_clients_timeout() -> None:
    async with ApiStub() as fake:
        client = client_for(fake.url, timeout=2.5)
        try:
            await client.apply(COMPUTE_DOMAINS, {"metadata": {"name": "cd", "namespace": "ns"}}, force=True)
            await client.get(PODS, "p", namespace="ns")
        finally:
            await client.close()
    apply, get = (parse_qs(r.target.partition("?")[2]) for r in fake.requests)
    assert apply == {"fieldManager": ["computedomain"], "timeout": ["2500ms"], "force": ["true"]}
    assert get == {}  # reads keep the apiserver's own limit (a list may take long)


async def test_retries_back_off_with_jitter_and_stop_before_the_calls_deadline(
    api: tuple[ApiStub, KubeClient],
) -> None:
    fake, _ = api
    clock = RecordingClock()
    client = KubeClient(
        base_credentials(fake),
        config=ClientConfig(qps=0, max_attempts=10, backoff_base=1.0, backoff_cap=100.0, deadline=10.0),
        clock=clock,
        rng=random.Random(7),
    )
    fake.replies = [status_reply(503, "ServiceUnavailable", f"try {i}") for i in range(10)]
    try:
        with pytest.raises(errors.Transient):
            await client.get(PODS, "p", namespace="ns")
    finally:
        await client.close()
    for n, slept in enumerate(clock.slept):
        assert 0.5 * 2**n <= slept < 1.5 * 2**n, clock.slept
    assert len(set(round(s / 2**n, 6) for n, s in enumerate(clock.slept))) > 1, "jittered, not a fixed factor"
    assert sum(clock.slept) < 10.0, "no wait runs past the call's deadline"
    assert len(fake.requests) == len(clock.slept) + 1 < 10


async def test_a_list_page_over_the_bound_is_asked_for_again_with_fewer_items(
    api: tuple[ApiStub, KubeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's objects of about a megabyte each make a page of 500 hundreds of MiB (the reader pays
    several times that to decode it, or fails for good over the body bound): the page is asked for again
    with half the items until it fits, and the smaller page comes back with its continue token."""
    monkeypatch.setattr(client_module, "MAX_PAGE_BYTES", 4096)
    fake, client = api
    big = "x" * 1000

    def answer(request: Recorded) -> Reply:
        limit = int(parse_qs(request.target.partition("?")[2])["limit"][0])
        items = [{"metadata": {"name": f"cd{i}", "annotations": {"pad": big}}} for i in range(limit)]
        return json_reply({"metadata": {"resourceVersion": "9", "continue": "next"}, "items": items})

    fake.answer = answer
    page = await client.list(COMPUTE_DOMAINS, limit=8)
    asked = [parse_qs(r.target.partition("?")[2])["limit"] for r in fake.requests]
    assert asked == [["8"], ["4"], ["2"]]  # 8 and 4 items of 1 KiB are over 4 KiB, 2 fit
    assert [i["metadata"]["name"] for i in page.items] == ["cd0", "cd1"] and page.continue_token == "next"


async def test_one_object_over_the_page_bound_is_an_error_that_says_so(
    api: tuple[ApiStub, KubeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "MAX_PAGE_BYTES", 512)
    fake, client = api
    fake.answer = lambda _: json_reply({"metadata": {}, "items": [{"metadata": {"name": "a", "x": "y" * 1000}}]})
    with pytest.raises(errors.TooLarge, match="over 512 bytes") as err:
        await client.list(COMPUTE_DOMAINS, limit=2)
    assert err.value.permanent  # the informer names it in its failure (readiness), rather than retrying quietly
    assert [parse_qs(r.target.partition("?")[2])["limit"] for r in fake.requests] == [["2"], ["1"]]
