"""Prometheus metrics of our processes: prometheus-client's, under one import path.

The metric kinds (`Counter`, `Gauge`, `Histogram`), the scrape-time collectors (`Collector`,
`GaugeMetricFamily`, `CounterMetricFamily`), the process-wide `REGISTRY` with prometheus-client's default
series (`python_gc_*`, `python_info`, `process_*`) and the text exposition (`generate_latest`,
`CONTENT_TYPE_LATEST`) are prometheus-client's own; this module only names them, so that the modules that
count import one place of ours and `computedomain.http` serves this registry. Nothing here renders or
parses the exposition format.

The series' names and labels are an external contract: dashboards and alerts built for the reference driver
read `nvidia_dra_*` (`computedomain/plugin/metrics.py`, the controller's `nvidia_dra_compute_domain_info`),
ours read `computedomain_*` (`tests/unit/test_metrics.py` lists what each process exposes).

Concurrency: prometheus-client's values change under a lock per metric, so a thread (`asyncio.to_thread`)
may count too; the scrape-time collectors run on the event loop that serves the scrape.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "CONTENT_TYPE_LATEST",
    "REGISTRY",
    "Collector",
    "CollectorRegistry",
    "Counter",
    "CounterMetricFamily",
    "Gauge",
    "GaugeMetricFamily",
    "Histogram",
    "generate_latest",
]
