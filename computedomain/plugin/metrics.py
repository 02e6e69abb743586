"""The node agent's kubelet-facing metrics, under the reference driver's names, plus its registration state.

Operators' dashboards and alerts for the reference driver read these series, so they keep its names, label
names and meaning:

| series | labels | meaning |
|---|---|---|
| `nvidia_dra_requests_total` | driver, operation | NodePrepareResources / NodeUnprepareResources calls completed |
| `nvidia_dra_request_duration_seconds` | driver, operation | their duration (buckets 0.05 s doubling, 9) |
| `nvidia_dra_requests_inflight` | driver, operation | calls running now |
| `nvidia_dra_node_prepare_errors_total` | driver, error_type | claims whose Prepare failed: `prepare_devices`, or `lock_acquire` when the checkpoint lock timed out |
| `nvidia_dra_node_unprepare_errors_total` | driver, error_type | the same for Unprepare (`unprepare_devices`, `lock_acquire`) |
| `nvidia_dra_prepared_devices` | node, driver, device_type | devices of completed claims in the checkpoint (`channel`, `daemon`) |
| `computedomain_plugin_registered` | node, driver | 1 while the kubelet has accepted our registration |

`Instrumented` wraps the `Preparer` the gRPC server calls, so the algorithm (`prepare`) stays free of them;
the request series exist at 0 from the start, as the reference's do. The prepared-devices and registration
gauges are read at scrape time (`watch_node`) from the checkpoint file (lock-free: writes are atomic
renames) and the server's last registration answer. The per-claim outcome and latency series of our own
(`computedomain_plugin_*`) stay in `prepare` and `budget`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from computedomain.metrics import REGISTRY, Collector, Counter, Gauge, GaugeMetricFamily, Histogram
from computedomain.plugin.checkpoint import Checkpoint, CheckpointError, ClaimState
from computedomain.plugin.preparer import (
    ClaimRef,
    ClaimUid,
    Preparer,
    PrepareResult,
    RegistrationStatus,
    UnprepareResult,
)

log = logging.getLogger(__name__)

R = TypeVar("R", PrepareResult, UnprepareResult)

PREPARE: Final = "prepare"
UNPREPARE: Final = "unprepare"
# The checkpoint lock's timeout message (checkpoint.FileLock): such a failure is the reference's lock_acquire.
LOCK_MESSAGE: Final = "could not lock "

REQUESTS = Counter("nvidia_dra_requests_total", "DRA requests completed.", ["driver", "operation"])
REQUEST_SECONDS = Histogram(
    "nvidia_dra_request_duration_seconds",
    "Duration of DRA requests.",
    ["driver", "operation"],
    buckets=tuple(0.05 * 2**i for i in range(9)),
)
INFLIGHT = Gauge("nvidia_dra_requests_inflight", "DRA requests in progress.", ["driver", "operation"])
PREPARE_ERRORS = Counter(
    "nvidia_dra_node_prepare_errors", "Claims whose Prepare failed, by error type.", ["driver", "error_type"]
)
UNPREPARE_ERRORS = Counter(
    "nvidia_dra_node_unprepare_errors", "Claims whose Unprepare failed, by error type.", ["driver", "error_type"]
)


def error_type(operation: str, error: str) -> str:
    if LOCK_MESSAGE in error:
        return "lock_acquire"
    return "prepare_devices" if operation == PREPARE else "unprepare_devices"


class Instrumented:
    """A `Preparer` that records the request series around another one."""

    def __init__(self, inner: Preparer, *, driver: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.driver = driver
        self._clock = clock
        for operation in (PREPARE, UNPREPARE):
            REQUESTS.labels(driver, operation)
            REQUEST_SECONDS.labels(driver, operation)
            INFLIGHT.labels(driver, operation)

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, PrepareResult]:
        return await self._record(PREPARE, PREPARE_ERRORS, self.inner.prepare(claims))

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[ClaimUid, UnprepareResult]:
        return await self._record(UNPREPARE, UNPREPARE_ERRORS, self.inner.unprepare(claims))

    async def _record(
        self, operation: str, errors: Counter, call: Awaitable[Mapping[ClaimUid, R]]
    ) -> Mapping[ClaimUid, R]:
        INFLIGHT.labels(self.driver, operation).inc()
        started = self._clock()
        try:
            results = await call
        finally:
            INFLIGHT.labels(self.driver, operation).dec()
            REQUESTS.labels(self.driver, operation).inc()
            REQUEST_SECONDS.labels(self.driver, operation).observe(self._clock() - started)
        for result in results.values():
            if result.error:
                errors.labels(self.driver, error_type(operation, result.error)).inc()
        return results


def device_type(device_name: str) -> str:
    """`channel-0` -> `channel`, `daemon-0` -> `daemon`."""
    return device_name.rsplit("-", 1)[0]


@dataclass(frozen=True)
class NodeState:
    """Where one node agent's scrape-time gauges come from: its checkpoint and its last registration answer."""

    node: str
    driver: str
    checkpoint: Callable[[], Checkpoint]
    registration: Callable[[], RegistrationStatus | None]

    def prepared_devices(self) -> Tally[str] | None:
        try:
            checkpoint = self.checkpoint()
        except (CheckpointError, OSError) as exc:
            # The agent itself reports an unreadable checkpoint; a scrape must not fail over it.
            log.debug("prepared devices not readable for metrics node=%s: %s", self.node, exc)
            return None
        counts: Tally[str] = Tally({"channel": 0, "daemon": 0})
        for entry in checkpoint.claims.values():
            if entry.state is ClaimState.PREPARE_COMPLETED:
                counts.update(device_type(d.device_name) for d in entry.devices)
        return counts


class _NodeStates(Collector):
    """The scrape-time gauges of every node agent of this process (one, except in the test bed's hosts)."""

    def __init__(self) -> None:
        self.states: dict[str, NodeState] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        devices = GaugeMetricFamily(
            "nvidia_dra_prepared_devices",
            "Devices of prepared claims on this node, by device type.",
            labels=["node", "driver", "device_type"],
        )
        registered = GaugeMetricFamily(
            "computedomain_plugin_registered",
            "1 while the kubelet has accepted this node agent's registration.",
            labels=["node", "driver"],
        )
        for state in list(self.states.values()):
            for kind, n in sorted((state.prepared_devices() or {}).items()):
                devices.add_metric([state.node, state.driver, kind], n)
            status = state.registration()
            registered.add_metric([state.node, state.driver], 1 if status is not None and status.registered else 0)
        yield devices
        yield registered


_NODES = _NodeStates()
REGISTRY.register(_NODES)


def watch_node(state: NodeState) -> None:
    """Report `state`'s gauges from now on (replacing an earlier agent of the same node)."""
    _NODES.states[state.node] = state


__all__ = ["Instrumented", "NodeState", "device_type", "error_type", "watch_node"]
