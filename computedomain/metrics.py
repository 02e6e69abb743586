"""Prometheus metrics of our processes: the one registry, the metric kinds we use, and its text exposition.

Owns `Counter`, `Gauge` and `Histogram` (with label names; `labels(*values)` gives a child), scrape-time
collectors (`Collector`, `GaugeMetricFamily`, `CounterMetricFamily`), the process-wide `REGISTRY` and
`generate_latest`, which writes what the Prometheus text format (0.0.4) parsers read.

The output is, line for line, what prometheus-client 0.26 writes for the same metrics, because dashboards,
alerts and scrapers were built on it (`tests/unit/test_metrics.py` compares the two): the same default
series (`python_gc_*`, `python_info`, `process_*`), a counter's `_total` and `_created` series, a
histogram's cumulative `_bucket`, `_count`, `_sum` and `_created`, the `_created` series moved to a gauge
family after their own, labels sorted by name, numbers formatted as Go formats them. What it leaves out is
what no process of ours uses (summaries, info/enum metrics, exemplars, OpenMetrics output, multiprocess
mode), and with it prometheus-client's imports of `http.server`, `wsgiref`, `urllib` and `email`, about
4 MiB in every process.

Concurrency: values change under one lock per metric, so a thread (`asyncio.to_thread`) may count too; a
scrape reads each value once.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final, Generic, NamedTuple, TypeVar

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

CONTENT_TYPE_LATEST: Final = "text/plain; version=1.0.0; charset=utf-8"
DEFAULT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_INF: Final = float("inf")


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


class MetricFamily:
    """One family as a scrape sees it: name (without `_total` for counters), type, help and samples."""

    type = "untyped"

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self._labelnames = tuple(labels)
        self.samples: list[Sample] = []

    def add_sample(self, suffix: str, labels: dict[str, str], value: float) -> None:
        self.samples.append(Sample(self.name + suffix, labels, value))


class GaugeMetricFamily(MetricFamily):
    type = "gauge"

    def __init__(
        self, name: str, documentation: str, value: float | None = None, labels: Sequence[str] | None = None
    ) -> None:
        super().__init__(name, documentation, labels or ())
        if value is not None:
            self.add_metric((), value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.add_sample("", dict(zip(self._labelnames, labels, strict=True)), value)


class CounterMetricFamily(MetricFamily):
    type = "counter"

    def __init__(
        self, name: str, documentation: str, value: float | None = None, labels: Sequence[str] | None = None
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labels or ())
        if value is not None:
            self.add_metric((), value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.add_sample("_total", dict(zip(self._labelnames, labels, strict=True)), value)


class Collector(ABC):
    """Anything the registry asks for families at scrape time."""

    @abstractmethod
    def collect(self) -> Iterable[MetricFamily]: ...


class CollectorRegistry(Collector):
    """Collectors in registration order; a metric name may be registered once."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def register(self, collector: Collector) -> None:
        with self._lock:
            names = set(collector.series_names()) if isinstance(collector, _Metric) else set()
            if names & self._names:
                raise ValueError(f"Duplicated timeseries in CollectorRegistry: {sorted(names & self._names)}")
            self._names |= names
            self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        with self._lock:
            self._collectors.remove(collector)
            if isinstance(collector, _Metric):
                self._names -= set(collector.series_names())

    def collect(self) -> Iterator[MetricFamily]:
        with self._lock:
            collectors = list(self._collectors)
        for collector in collectors:
            yield from collector.collect()

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one series, or None (for tests)."""
        for family in self.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return None


REGISTRY: Final = CollectorRegistry()


# --- metrics ------------------------------------------------------------------------------------------------


class _Child:
    __slots__ = ("_lock", "created", "value")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount


class _CounterChild(_Child):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        super().inc(amount)


class _GaugeChild(_Child):
    __slots__ = ()

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        with self._lock:
            self.value = float(value)


class _HistogramChild(_Child):
    __slots__ = ("_upper", "counts")

    def __init__(self, lock: threading.Lock, upper: tuple[float, ...]) -> None:
        super().__init__(lock)
        self._upper = upper
        self.counts = [0.0] * len(upper)

    def observe(self, amount: float) -> None:
        with self._lock:
            self.value += amount  # the sum
            for i, bound in enumerate(self._upper):
                if amount <= bound:
                    self.counts[i] += 1
                    break


ChildT = TypeVar("ChildT", bound=_Child)


class _Metric(Collector, Generic[ChildT]):
    """A metric with label names; without any, it is its own (only) child."""

    type = ""
    #: dropped from the name given (a counter's samples add `_total` back)
    name_suffix = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.name = name.removesuffix(self.name_suffix) if self.name_suffix else name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], ChildT] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> ChildT:
        raise NotImplementedError

    def series_names(self) -> tuple[str, ...]:
        return (self.name,)

    def labels(self, *values: object) -> ChildT:
        return self._child(tuple(map(str, values)))

    def _child(self, values: tuple[str, ...]) -> ChildT:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values, got {len(values)}")
            with self._lock:
                child = self._children.setdefault(values, self._new_child())
        return child

    def _only(self) -> ChildT:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {list(self.labelnames)}: use labels(...) first")
        return self._children[()]

    def _labelled(self) -> Iterator[tuple[dict[str, str], ChildT]]:
        for values, child in list(self._children.items()):
            yield dict(zip(self.labelnames, values, strict=True)), child


class Counter(_Metric[_CounterChild]):
    type = "counter"
    name_suffix = "_total"

    def _new_child(self) -> _CounterChild:
        return _CounterChild(self._lock)

    def series_names(self) -> tuple[str, ...]:
        return (f"{self.name}_total", f"{self.name}_created", self.name)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def collect(self) -> Iterator[MetricFamily]:
        family = MetricFamily(self.name, self.documentation)
        family.type = self.type
        for labels, child in self._labelled():
            family.add_sample("_total", labels, child.value)
            family.add_sample("_created", labels, child.created)
        yield family


class Gauge(_Metric[_GaugeChild]):
    type = "gauge"

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild(self._lock)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        self._only().set(value)

    def collect(self) -> Iterator[MetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation)
        for labels, child in self._labelled():
            family.add_sample("", labels, child.value)
        yield family


class Histogram(_Metric[_HistogramChild]):
    type = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        upper = [float(b) for b in buckets]
        if upper != sorted(upper):
            raise ValueError(f"{name}: buckets not in sorted order")
        if not upper or upper[-1] != _INF:
            upper.append(_INF)
        self._upper = tuple(upper)
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._lock, self._upper)

    def series_names(self) -> tuple[str, ...]:
        return tuple(f"{self.name}{suffix}" for suffix in ("", "_bucket", "_count", "_sum", "_created"))

    def observe(self, amount: float) -> None:
        self._only().observe(amount)

    def collect(self) -> Iterator[MetricFamily]:
        family = MetricFamily(self.name, self.documentation)
        family.type = self.type
        for labels, child in self._labelled():
            with self._lock:
                counts, total = list(child.counts), child.value
            cumulative = 0.0
            for bound, count in zip(self._upper, counts, strict=True):
                cumulative += count
                family.add_sample("_bucket", {**labels, "le": _go_float(bound)}, cumulative)
            family.add_sample("_count", labels, cumulative)
            family.add_sample("_sum", labels, total)
            family.add_sample("_created", labels, child.created)
        yield family


# --- the default series: garbage collector, Python, process ---------------------------------------------


class _GcCollector(Collector):
    def collect(self) -> Iterator[MetricFamily]:
        families = (
            CounterMetricFamily("python_gc_objects_collected", "Objects collected during gc", labels=["generation"]),
            CounterMetricFamily(
                "python_gc_objects_uncollectable", "Uncollectable objects found during GC", labels=["generation"]
            ),
            CounterMetricFamily(
                "python_gc_collections", "Number of times this generation was collected", labels=["generation"]
            ),
        )
        for generation, stats in enumerate(gc.get_stats()):
            for family, key in zip(families, ("collected", "uncollectable", "collections"), strict=True):
                family.add_metric([str(generation)], stats[key])
        yield from families


class _PlatformCollector(Collector):
    def __init__(self) -> None:
        major, minor, patchlevel = platform.python_version_tuple()
        info = {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "major": major,
            "minor": minor,
            "patchlevel": patchlevel,
        }
        self._family = GaugeMetricFamily("python_info", "Python platform information", labels=list(info))
        self._family.add_metric(list(info.values()), 1)

    def collect(self) -> Iterator[MetricFamily]:
        yield self._family


class _ProcessCollector(Collector):
    """CPU, memory, start time and file descriptors from /proc (nothing where there is none)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._pagesize = os.sysconf("SC_PAGE_SIZE")
        self._btime = 0.0
        try:
            with (proc / "stat").open("rb") as stat:
                for line in stat:
                    if line.startswith(b"btime "):
                        self._btime = float(line.split()[1])
        except OSError:
            pass

    def collect(self) -> Iterator[MetricFamily]:
        if not self._btime:
            return
        me = self._proc / "self"
        try:
            parts = (me / "stat").read_bytes().split(b")")[-1].split()
            yield GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", float(parts[20]))
            yield GaugeMetricFamily(
                "process_resident_memory_bytes", "Resident memory size in bytes.", float(parts[21]) * self._pagesize
            )
            yield GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                float(parts[19]) / self._ticks + self._btime,
            )
            yield CounterMetricFamily(
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
                (float(parts[11]) + float(parts[12])) / self._ticks,
            )
        except OSError:
            pass
        try:
            max_fds = None
            with (me / "limits").open("rb") as limits:
                for line in limits:
                    if line.startswith(b"Max open file"):
                        max_fds = float(line.split()[3])
                        break
            open_fds = sum(1 for _ in (me / "fd").iterdir())
            yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", open_fds)
            if max_fds is not None:
                yield GaugeMetricFamily("process_max_fds", "Maximum number of open file descriptors.", max_fds)
        except OSError:
            pass


def register_defaults(registry: CollectorRegistry) -> None:
    """The series every process exports first, in prometheus-client's order."""
    if platform.python_implementation() == "CPython":
        registry.register(_GcCollector())
    registry.register(_PlatformCollector())
    registry.register(_ProcessCollector())


register_defaults(REGISTRY)


# --- exposition ---------------------------------------------------------------------------------------------


def _go_float(value: float) -> str:
    """A number as Go's strconv formats it (and so prometheus-client): `1.0`, `+Inf`, `1.7e+09`."""
    if value == _INF:
        return "+Inf"
    if value == -_INF:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to an exponent sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _line(sample: Sample) -> str:
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
    return (
        f"{sample.name}{{{labels}}} {_go_float(sample.value)}\n"
        if labels
        else f"{sample.name} {_go_float(sample.value)}\n"
    )


def generate_latest(registry: Collector = REGISTRY) -> bytes:
    """The text exposition of every family the registry collects now."""
    out: list[str] = []
    for family in registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {documentation}\n# TYPE {name} {family.type}\n")
        created: list[str] = []
        for sample in family.samples:
            (created if sample.name == family.name + "_created" else out).append(_line(sample))
        if created:
            out.append(f"# HELP {family.name}_created {documentation}\n# TYPE {family.name}_created gauge\n")
            out.extend(created)
    return "".join(out).encode()
