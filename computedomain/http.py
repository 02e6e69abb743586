"""The HTTP endpoint of our processes: prometheus-client metrics, `/healthz`, optionally `/readyz`.

Owns parsing `HTTP_ENDPOINT` (`host:port`; empty host: every address; `[v6]:port` and a bare IPv6 literal
before the last colon both work) and the aiohttp server on the caller's event loop. The metrics are the
process-wide prometheus-client registry, rendered at scrape time; `/healthz` answers while the event loop
does; `/readyz` is served only when the caller passes a readiness function (`(ready, details)`: 200 or 503
with the details as JSON).

Used by the controller (with `/readyz`: ready once caches synced, with the leadership state) and the node
agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.registry import CollectorRegistry

from computedomain.settings import EndpointError, parse_endpoint

__all__ = ["EndpointError", "bound_port", "parse_endpoint", "start_http"]

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, Mapping[str, Any]]]


async def start_http(
    endpoint: str,
    *,
    metrics_path: str,
    readiness: Readiness | None = None,
    registry: CollectorRegistry = REGISTRY,
) -> web.AppRunner:
    """Serve until `await runner.cleanup()`. An empty metrics_path serves no metrics."""
    host, port = parse_endpoint(endpoint)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    if metrics_path:
        app.router.add_get(metrics_path, metrics)
    app.router.add_get("/healthz", healthz)
    if readiness is not None:
        ready_fn = readiness

        async def readyz(_: web.Request) -> web.Response:
            ready, details = ready_fn()
            return web.json_response(dict(details), status=200 if ready else 503)

        app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("http serving endpoint=%s:%d metrics=%s", host, port, metrics_path or "(off)")
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port actually bound (port 0 in tests picks a free one)."""
    for address in runner.addresses:
        return int(address[1])
    raise RuntimeError("the HTTP server is not listening")
