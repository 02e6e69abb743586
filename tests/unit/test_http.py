"""The shared HTTP endpoint (metrics, /healthz, /readyz) on a real socket."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from computedomain.http import EndpointError, bound_port, parse_endpoint, start_http
from computedomain.metrics import CollectorRegistry, Counter


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
