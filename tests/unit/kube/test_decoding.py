"""Bounded decoding: the depth and size limits, a hostile object in a list, a get and a watch stream (served
by a tiny local HTTP server standing in for the apiserver), and an informer that goes on past it."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_core import from_json

from computedomain.kube.client import RESOURCE_CLAIM_TEMPLATES, ClientConfig, KubeClient
from computedomain.kube.config import Credentials
from computedomain.kube.decoding import MAX_DEPTH, MAX_EVENT_BYTES, MAX_OBJECT_BYTES, DecodeError, decode, decode_items
from computedomain.kube.errors import Permanent, Unreadable
from computedomain.kube.informer import Informer, Rejection
from tests.unit.kube.apistub import ApiStub, Recorded, Reply

pytestmark = pytest.mark.timeout(20)

# As deep as the apiserver stores opaque parameters: 10,240 bytes of them, `{"a":` then `[` * 5,116.
APISERVER_DEPTH = 5117
FIELD = "spec.spec.devices.config[0].opaque.parameters.a[0][0][0][0]... ("


def template(name: str, *, depth: int = 1, rv: str = "1") -> dict[str, Any]:
    """A labelled ResourceClaimTemplate whose opaque parameters nest ``depth`` levels (the object itself
    adds 7 levels above them)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "tenant", "uid": f"uid-{name}", "resourceVersion": rv},
        "spec": {"spec": {"devices": {"config": [{"opaque": {"driver": "x", "parameters": "@P@"}}]}}},
    } | {"depth": depth}


def encode(obj: dict[str, Any]) -> bytes:
    """Compact JSON as the apiserver writes it, with the parameters nested ``obj['depth']`` levels."""
    depth = obj.pop("depth", 1)
    params = '{"a":' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"
    return json.dumps(obj, separators=(",", ":")).replace('"@P@"', params).encode()


def listing(*items: dict[str, Any]) -> bytes:
    body = b",".join(encode(item) for item in items)
    return b'{"kind":"ResourceClaimTemplateList","metadata":{"resourceVersion":"9"},"items":[' + body + b"]}"


# ---- the decoder ---------------------------------------------------------------------------------------


def test_the_parser_accepts_max_depth_and_refuses_deeper_by_itself() -> None:
    """The fast path's bound: pydantic-core's parser takes MAX_DEPTH levels of arrays and objects and
    refuses a few more instead of exhausting the stack (the standard json module's RecursionError)."""
    for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
        inner = b"[]" if opening == b"[" else b"1"
        ok = opening * (MAX_DEPTH - (opening == b"[")) + inner + closing * (MAX_DEPTH - (opening == b"["))
        assert decode(ok).cuts == ()
        deep = opening * (MAX_DEPTH + 2) + inner + closing * (MAX_DEPTH + 2)
        with pytest.raises(ValueError, match="recursion limit exceeded"):
            from_json(deep)
    with pytest.raises(RecursionError):
        json.loads(encode(template("t", depth=APISERVER_DEPTH)))


def test_a_value_nested_too_deep_is_cut_and_named() -> None:
    decoded = decode(encode(template("t", depth=APISERVER_DEPTH)))
    (cut,) = decoded.cuts
    assert decoded.value["metadata"]["name"] == "t"
    reason = decoded.reason(cut)
    assert reason.startswith(FIELD) and f"the limit is {MAX_DEPTH} levels" in reason
    assert f"nested {APISERVER_DEPTH + 7} levels deep" in reason


def test_one_hostile_item_costs_only_itself() -> None:
    data = listing(template("a"), template("evil", depth=APISERVER_DEPTH), template("b", depth=150))
    items, rejected = decode_items(decode(data), ("items",))
    assert [i["metadata"]["name"] for i in items] == ["a", "b"]
    (bad,) = rejected
    assert bad.metadata["name"] == "evil" and bad.metadata["uid"] == "uid-evil"
    assert bad.reason.startswith(FIELD)


def test_strings_that_look_like_structure_do_not_confuse_the_scan() -> None:
    tricky = {'k\\"[{': ']}],{"[', "deep": "@D@"}
    body = json.dumps(tricky, separators=(",", ":")).replace('"@D@"', "[" * 300 + "]" * 300).encode()
    decoded = decode(body)
    assert decoded.value['k\\"[{'] == ']}],{"['
    (cut,) = decoded.cuts
    assert cut.path[:2] == ("deep", 0) and decoded.value["deep"] is not None


def test_a_cut_outside_the_items_and_broken_json_are_errors() -> None:
    envelope = b'{"metadata":{"x":' + b"[" * 300 + b"]" * 300 + b'},"items":[]}'
    with pytest.raises(DecodeError, match=r"metadata\.x\[0\]"):
        decode_items(decode(envelope), ("items",))
    with pytest.raises(DecodeError, match="not JSON"):
        decode(b'{"items":[')
    with pytest.raises(DecodeError, match="not JSON"):
        decode(b"[" * 300 + b"}")


# ---- the client and an informer against a stand-in apiserver --------------------------------------------


class FakeApiserver:
    """Serves one list, one get and one watch stream of ResourceClaimTemplates (a stand-in: the same paths
    and bodies the apiserver sends, nothing else)."""

    def __init__(self, listed: bytes, watch_lines: list[bytes]) -> None:
        self.listed = listed
        self.watch_lines = watch_lines
        self.watches = 0
        self.lists = 0
        self.done = asyncio.Event()

    def answer(self, request: Recorded) -> Reply:
        if "watch=true" in request.target:
            self.watches += 1
            # In pieces, as a socket delivers them; then quiet, until the test ends.
            stream = b"".join(line + b"\n" for line in self.watch_lines) if self.watches == 1 else b""
            pieces = [stream[at : at + (1 << 20)] for at in range(0, len(stream), 1 << 20)]
            return Reply(chunks=pieces, hold_open=self.done)
        if request.path.endswith("resourceclaimtemplates"):
            self.lists += 1
            return Reply(body=self.listed)
        return Reply(body=encode(template("evil", depth=APISERVER_DEPTH)))


async def serve(fake: FakeApiserver) -> AsyncIterator[KubeClient]:
    async with ApiStub() as server:
        server.answer = fake.answer
        client = KubeClient(
            Credentials(server.url),
            config=ClientConfig(qps=0, max_attempts=1),
            rng=random.Random(1),
        )
        try:
            yield client
        finally:
            fake.done.set()
            await client.close()


def event(etype: str, obj: dict[str, Any]) -> bytes:
    return b'{"type":"' + etype.encode() + b'","object":' + encode(obj) + b"}"


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[FakeApiserver, KubeClient]]:
    big = template("huge", rv="12")
    big["metadata"]["annotations"] = {"pad": "x" * (MAX_EVENT_BYTES + 10)}
    fake = FakeApiserver(
        listing(template("a"), template("evil", depth=APISERVER_DEPTH), template("b")),
        [
            event("MODIFIED", template("a", depth=APISERVER_DEPTH, rv="10")),  # a good object turns bad
            event("ADDED", big),  # over the size limit
            event("ADDED", template("c", rv="13")),  # and the watch goes on
            event("DELETED", template("evil", depth=APISERVER_DEPTH, rv="14")),
            event("ADDED", template("last", rv="15")),
        ],
    )
    async for client in serve(fake):
        yield fake, client


async def test_a_get_of_a_hostile_object_is_a_permanent_error_naming_the_field(
    hostile: tuple[FakeApiserver, KubeClient],
) -> None:
    _, client = hostile
    with pytest.raises(Permanent) as caught:
        await client.get(RESOURCE_CLAIM_TEMPLATES, "evil", namespace="tenant")
    assert FIELD in str(caught.value) and f"the limit is {MAX_DEPTH} levels" in str(caught.value)
    # Permanent by the retry rule too (it has no status code): Prepare refuses the claim, never retries it.
    assert caught.value.permanent and isinstance(caught.value, Unreadable)


async def test_the_informer_skips_hostile_objects_reports_each_once_and_goes_on(
    hostile: tuple[FakeApiserver, KubeClient],
) -> None:
    fake, client = hostile
    informer: Informer[dict[str, Any]] = Informer(client, RESOURCE_CLAIM_TEMPLATES, decode=lambda raw: raw)
    told: list[Rejection] = []
    deleted: list[str] = []
    last = asyncio.Event()
    informer.add_handler(
        on_reject=told.append,
        on_delete=lambda o: deleted.append(o["metadata"]["name"]),
        on_add=lambda o: last.set() if o["metadata"]["name"] == "last" else None,
    )
    task = asyncio.create_task(informer.run())
    try:
        assert await informer.has_synced(5)
        assert sorted(informer.keys()) == ["tenant/a", "tenant/b"]
        await asyncio.wait_for(last.wait(), 10)  # events apply in order: everything before it is in
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert sorted(informer.keys()) == ["tenant/b", "tenant/c", "tenant/last"]
    assert fake.lists == 1 and fake.watches == 1  # never restarted
    assert [(r.ref.name, r.ref.resource_version) for r in told] == [("evil", "1"), ("a", "10"), ("huge", "12")]
    assert deleted == ["a"]  # its good version left the store with it
    evil, turned, huge = told
    assert evil.ref.uid == "uid-evil" and evil.ref.kind == "ResourceClaimTemplate"
    assert evil.reason.startswith(FIELD) and turned.reason.startswith(FIELD)
    assert f"the limit is {MAX_EVENT_BYTES:,} bytes" in huge.reason
    assert sorted(r.ref.name for r in informer.rejected()) == ["a", "huge"]  # evil was deleted


async def test_an_object_a_get_reads_is_read_in_a_watch_too() -> None:
    """The watch's bound is the object's plus the event around it: a claim the node agent's GET reads but the
    controller's watch refused (by the 29 bytes of the envelope) was missing from the claim cache, and so
    never verified in its channel record."""
    big = template("big", rv="3")
    big["metadata"]["annotations"] = {"pad": ""}
    big["metadata"]["annotations"]["pad"] = "x" * (MAX_OBJECT_BYTES - 10 - len(encode(big)))
    body = encode(big)
    assert len(body) == MAX_OBJECT_BYTES - 10
    done = asyncio.Event()

    def answer(request: Recorded) -> Reply:
        if "watch=true" in request.target:
            line = event("MODIFIED", big) + b"\n"
            return Reply(chunks=[line[at : at + (1 << 20)] for at in range(0, len(line), 1 << 20)], hold_open=done)
        return Reply(body=body)

    async with ApiStub() as server:
        server.answer = answer
        client = KubeClient(Credentials(server.url), config=ClientConfig(qps=0, max_attempts=1))
        try:
            got = await client.get(RESOURCE_CLAIM_TEMPLATES, "big", namespace="tenant")
            assert got["metadata"]["name"] == "big"
            stream = client.watch(RESOURCE_CLAIM_TEMPLATES, namespace="tenant", resource_version="1")
            first = await anext(aiter(stream))
            await stream.aclose()
            assert first.rejected is None and first.object["metadata"]["name"] == "big"
        finally:
            done.set()
            await client.close()


async def test_documents_for_the_pure_python_pruner_are_decoded_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1.6 MB watch event nested too deep took 214 ms of the pure-Python pruner on the event loop, in the
    controller and in every node agent; now such a document over ``INLINE_PRUNE_BYTES`` is pruned beside the
    loop. Small ones stay inline (a thread hop would cost more than they do), and one the fast decoder takes
    never meets the pruner."""
    from computedomain.kube import client as client_module

    threads: list[bool] = []
    real = client_module.pruned

    def spy(data: bytes) -> Any:
        threads.append(threading.current_thread() is not threading.main_thread())
        return real(data)

    monkeypatch.setattr(client_module, "pruned", spy)

    def deep(levels: int, pad: int) -> bytes:
        return b'{"p":"' + b"x" * pad + b'","v":' + b"[" * levels + b"]" * levels + b"}"

    cases = {
        "shallow, small": (json.dumps({"a": "x" * 1000}).encode(), []),
        "shallow, large": (json.dumps({"a": "x" * (1 << 20)}).encode(), []),
        "deep, small": (deep(MAX_DEPTH + 10, 100), [False]),
        "deep, over the pruner's inline bound": (deep(MAX_DEPTH + 10, client_module.INLINE_PRUNE_BYTES), [True]),
    }
    for what, (data, expected) in cases.items():
        threads.clear()
        decoded = await client_module._decode(data)
        assert isinstance(decoded.value, dict), what
        assert threads == expected, what


async def test_a_stream_of_blank_lines_lets_the_loop_turn() -> None:
    """A stream in the middle sent 4 MiB of newlines in one chunk: the watch read them without letting the
    event loop turn (525 ms). Now it turns every ``LINES_PER_TURN`` lines."""
    from computedomain.kube import client as client_module

    blank = 20 * client_module.LINES_PER_TURN

    async def chunks() -> AsyncIterator[bytes]:
        yield b"\n" * blank + b'{"a":1}\n'

    turns = 0
    done = False

    async def ticker() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = turns
    lines = [line async for line, _ in client_module._lines(chunks(), 1 << 20) if line.strip()]
    done = True
    await task
    assert lines == [b'{"a":1}']
    assert turns - start >= blank // client_module.LINES_PER_TURN - 1, turns - start
