"""The node agent's reference-named metrics (plugin/metrics.py), scraped from the real HTTP endpoint."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from computedomain.http import bound_port, start_http
from computedomain.plugin import checkpoint as ck
from computedomain.plugin.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointDevice,
    DeviceKind,
    PreparedResource,
)
from computedomain.plugin.metrics import Instrumented, NodeState, error_type, watch_node
from computedomain.plugin.preparer import ClaimRef, ClaimUid, PrepareResult, RegistrationStatus, UnprepareResult
from tests.unit.plugin.test_checkpoint import CD, T0, begin

DRIVER = "test.compute-domain.nvidia.com"  # a driver label of its own: the registry is process-wide


def _claim(n: int) -> ClaimRef:
    return ClaimRef("ns", f"c{n}", ClaimUid(f"uid-{n}"))


class Scripted:
    """A Preparer answering from a script; `gate` holds Prepare until the test lets it go."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        await self.gate.wait()
        return {
            claims[0].uid: PrepareResult(),
            claims[1].uid: PrepareResult(error="retryable error: could not lock /x/checkpoint.lock within 10 s"),
            claims[2].uid: PrepareResult(error="permanent error: unknown field 'bogus'"),
        }

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        return {c.uid: UnprepareResult(error="cdi: read-only file system") for c in claims}


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if sample.labels.get("driver") == DRIVER and "le" not in sample.labels:
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def _with_devices() -> Checkpoint:
    daemon = CheckpointDevice(request_names=("daemon",), pool_name="n", device_name="daemon-0")
    channel = CheckpointDevice(request_names=("channel",), pool_name="n", device_name="channel-0")
    cp = begin(Checkpoint(boot_id="b"), "uid-a")
    cp = ck.complete_prepare(cp, "uid-a", [channel], now=T0)
    daemon_resource = PreparedResource(kind=DeviceKind.DAEMON, domain_id=CD)
    cp = ck.complete_prepare(begin(cp, "uid-b", resources=[daemon_resource]), "uid-b", [daemon], now=T0)
    return begin(cp, "uid-c", resources=[daemon_resource])  # started, not completed: not counted


async def test_request_series_errors_and_node_gauges_on_the_endpoint() -> None:
    inner = Scripted()
    preparer = Instrumented(inner, driver=DRIVER)
    checkpoint: list[Checkpoint | Exception] = [_with_devices()]

    def read() -> Checkpoint:
        if isinstance(checkpoint[0], Exception):
            raise checkpoint[0]
        return checkpoint[0]

    registration: list[RegistrationStatus | None] = [None]
    watch_node(NodeState(node="node-m", driver=DRIVER, checkpoint=read, registration=lambda: registration[0]))
    runner = await start_http("127.0.0.1:0", metrics_path="/metrics")
    try:
        port = bound_port(runner)
        zero = await asyncio.to_thread(_scrape, port)
        # The request series exist from the start, at 0, as the reference's do.
        for operation in ("prepare", "unprepare"):
            assert zero[f"nvidia_dra_requests_total{{driver={DRIVER},operation={operation}}}"] == 0
            assert zero[f"nvidia_dra_requests_inflight{{driver={DRIVER},operation={operation}}}"] == 0
            assert zero[f"nvidia_dra_request_duration_seconds_count{{driver={DRIVER},operation={operation}}}"] == 0
        assert zero[f"nvidia_dra_prepared_devices{{device_type=channel,driver={DRIVER},node=node-m}}"] == 1
        assert zero[f"nvidia_dra_prepared_devices{{device_type=daemon,driver={DRIVER},node=node-m}}"] == 1
        assert zero[f"computedomain_plugin_registered{{driver={DRIVER},node=node-m}}"] == 0

        call = asyncio.create_task(preparer.prepare([_claim(1), _claim(2), _claim(3)]))
        await asyncio.sleep(0)
        during = await asyncio.to_thread(_scrape, port)
        assert during[f"nvidia_dra_requests_inflight{{driver={DRIVER},operation=prepare}}"] == 1
        inner.gate.set()
        await call
        await preparer.unprepare([_claim(1)])
        registration[0] = RegistrationStatus(registered=True)
        checkpoint[0] = CheckpointCorruptError(__file__, "not JSON")  # a scrape survives an unreadable file
        after = await asyncio.to_thread(_scrape, port)
    finally:
        await runner.cleanup()
    assert after[f"nvidia_dra_requests_inflight{{driver={DRIVER},operation=prepare}}"] == 0
    assert after[f"nvidia_dra_requests_total{{driver={DRIVER},operation=prepare}}"] == 1
    assert after[f"nvidia_dra_requests_total{{driver={DRIVER},operation=unprepare}}"] == 1
    assert after[f"nvidia_dra_request_duration_seconds_count{{driver={DRIVER},operation=prepare}}"] == 1
    assert after[f"nvidia_dra_node_prepare_errors_total{{driver={DRIVER},error_type=lock_acquire}}"] == 1
    assert after[f"nvidia_dra_node_prepare_errors_total{{driver={DRIVER},error_type=prepare_devices}}"] == 1
    assert after[f"nvidia_dra_node_unprepare_errors_total{{driver={DRIVER},error_type=unprepare_devices}}"] == 1
    assert after[f"computedomain_plugin_registered{{driver={DRIVER},node=node-m}}"] == 1
    assert not [k for k in after if k.startswith("nvidia_dra_prepared_devices")]


def test_error_types() -> None:
    assert error_type("prepare", "retryable error: could not lock /p/checkpoint.lock within 10 s") == "lock_acquire"
    assert error_type("unprepare", "x") == "unprepare_devices"
