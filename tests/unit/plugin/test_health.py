"""Device health for the kubelet's DRAResourceHealth stream: what is reported (table), when (fake clock), and
the stream itself over the DRA unix socket as the kubelet opens it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from computedomain.kube.clock import FakeClock
from computedomain.plugin.grpc_server import PluginServer, SocketPaths
from computedomain.plugin.health import DeviceHealth, Health, HealthReports, HostState, device_health
from computedomain.plugin.proto import dra_health_v1alpha1_pb2
from tests.unit.plugin.test_grpc_server import FakePreparer

pytestmark = pytest.mark.timeout(10)

H, U = Health.HEALTHY, Health.UNHEALTHY
DEVICES = ("channel-0", "daemon-0")


@pytest.mark.parametrize(
    ("imex_problem", "host_managed", "host", "want"),
    [
        (None, False, None, [("channel-0", H, "IMEX channels present"), ("daemon-0", H, "IMEX channels present")]),
        ("no nvidia-caps-imex-channels in /proc/devices", False, None,
         [(d, U, "no IMEX channels on this node: no nvidia-caps-imex-channels in /proc/devices") for d in DEVICES]),
        (None, True, None,
         [("channel-0", H, "IMEX channels present; the host IMEX daemon is checked at the first Prepare"),
          ("daemon-0", H, "IMEX channels present")]),
        (None, True, HostState(True, "READY"),
         [("channel-0", H, "host IMEX daemon READY at the last Prepare"), ("daemon-0", H, "IMEX channels present")]),
        (None, True, HostState(False, "state WAITING_FOR_PEERS"),
         [("channel-0", U, "host IMEX daemon not ready at the last Prepare: state WAITING_FOR_PEERS"),
          ("daemon-0", H, "IMEX channels present")]),
    ],
)  # fmt: skip
def test_device_health(
    imex_problem: str | None, host_managed: bool, host: HostState | None, want: list[tuple[str, Health, str]]
) -> None:
    got = device_health(DEVICES, imex_problem=imex_problem, host_managed=host_managed, host=host)
    assert got == tuple(DeviceHealth(*w) for w in want)


def test_long_messages_are_clipped_to_the_kubelets_limit() -> None:
    (only,) = device_health(["channel-0"], imex_problem="x" * 5000, host_managed=False, host=None)
    assert len(only.message) == 1024 and only.message.endswith("...")


async def _inline(fn: Callable[[], str | None]) -> str | None:
    return fn()


async def test_reports_now_on_change_and_every_heartbeat() -> None:
    clock = FakeClock()
    problem: list[str | None] = [None]
    reports = HealthReports(
        ["channel-0"],
        pool="node-a",
        host_managed=True,
        imex_problem=lambda: problem[0],
        heartbeat_s=60,
        run_blocking=_inline,
        wall_clock=lambda: 1234.0,
        clock=clock,
    )
    assert reports.timeout_s == 180
    got: list[tuple[float, tuple[DeviceHealth, ...]]] = []

    async def collect() -> None:
        async for report in reports.stream():
            got.append(report)

    task = asyncio.create_task(collect())
    await clock.settle()
    assert len(got) == 1 and got[0][0] == 1234.0
    # A Prepare saw the host daemon not ready: reported at once, no time passes.
    reports.note_host_check(HostState(False, "state UNAVAILABLE"))
    await clock.settle()
    assert len(got) == 2 and got[1][1][0].health is U
    # The same again is no change.
    reports.note_host_check(HostState(False, "state UNAVAILABLE"))
    await clock.settle()
    assert len(got) == 2
    # Nothing changes: the heartbeat reports again, with the hardware checked afresh.
    problem[0] = "the driver is gone"
    await clock.advance(59)
    assert len(got) == 2
    await clock.advance(1)
    assert len(got) == 3 and "the driver is gone" in got[2][1][0].message
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cdh", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_the_kubelets_stream_on_the_dra_socket(short_dir: Path) -> None:
    paths = SocketPaths.for_driver(short_dir / "registry", short_dir / "plugins")
    reports = HealthReports(
        ["channel-0"], pool="node-a", host_managed=True, imex_problem=lambda: None, run_blocking=_inline
    )
    server = PluginServer(FakePreparer(), paths, health_port=None, device_health=reports)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{paths.dra}") as channel:
            watch: Any = channel.unary_stream(
                "/v1alpha1.DRAResourceHealth/NodeWatchResources",
                request_serializer=dra_health_v1alpha1_pb2.NodeWatchResourcesRequest.SerializeToString,
                response_deserializer=dra_health_v1alpha1_pb2.NodeWatchResourcesResponse.FromString,
            )
            call = watch(dra_health_v1alpha1_pb2.NodeWatchResourcesRequest())
            first = await asyncio.wait_for(call.read(), 5)
            (device,) = first.devices
            assert (device.device.pool_name, device.device.device_name) == ("node-a", "channel-0")
            assert device.health == dra_health_v1alpha1_pb2.HEALTHY
            assert device.health_check_timeout_seconds == 180 and device.last_updated_time > 0
            reports.note_host_check(HostState(False, "state INITIALIZING"))
            second = await asyncio.wait_for(call.read(), 5)
            assert second.devices[0].health == dra_health_v1alpha1_pb2.UNHEALTHY
            assert "INITIALIZING" in second.devices[0].message
            call.cancel()
    finally:
        await server.stop(grace_s=0)
