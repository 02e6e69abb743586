"""Our metrics module writes what prometheus-client writes: the same operations on both, the same text.

prometheus-client is a test dependency only: it is the reference here (and its parser reads our output in
the plugin's and the system tests)."""

from __future__ import annotations

import random
import re

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from computedomain import metrics

#: the values that depend on when and where the test runs
_TIME_LIKE = re.compile(r"^((?:\w+_created|process_\w+|python_gc_\w+)(?:\{[^}]*\})?) \S+$", re.M)


def _masked(text: bytes) -> str:
    return _TIME_LIKE.sub(r"\1 X", text.decode())


def _both(seed: int) -> tuple[str, str]:
    """Build the same metrics in both libraries, drive them the same random way, render both."""
    ours_registry, theirs_registry = metrics.CollectorRegistry(), prometheus_client.CollectorRegistry()
    built = []
    for lib, registry in ((metrics, ours_registry), (prometheus_client, theirs_registry)):
        built.append(
            (
                lib.Counter(
                    "t_requests_total", "Requests.\nSecond line \\ too.", ["driver", "operation"], registry=registry
                ),
                lib.Counter("t_errors", "Errors (no _total in the name).", ["error_type"], registry=registry),
                lib.Counter("t_plain_total", "A counter without labels.", registry=registry),
                lib.Gauge("t_inflight", "In flight.", ["operation"], registry=registry),
                lib.Gauge("t_level", "A gauge without labels.", registry=registry),
                lib.Histogram(
                    "t_seconds",
                    "Durations.",
                    ["operation"],
                    registry=registry,
                    buckets=tuple(0.05 * 2**i for i in range(9)),
                ),
                lib.Histogram("t_default_seconds", "Default buckets, no labels.", registry=registry),
                lib.Gauge("t_untouched", "Labelled, never used.", ["x"], registry=registry),
            )
        )
    rng = random.Random(seed)
    for _ in range(200):
        op = rng.choice(["prepare", "unprepare", 'we"ird\\va\nlue'])
        value = rng.choice([0.0, 1e-9, 0.05, 0.1, 0.7, 3.0, 12.8, 1e7, 123456789.5])
        for counter, errors, plain_counter, inflight, plain_gauge, seconds, default, _ in built:
            counter.labels("d", op).inc()
            errors.labels(op).inc(value)
            plain_counter.inc(value)
            inflight.labels(op).inc(value)
            inflight.labels(op).dec()
            plain_gauge.set(-value)
            seconds.labels(op).observe(value)
            default.observe(value)
    ours, theirs = (
        _masked(lib.generate_latest(r)) for lib, r in ((metrics, ours_registry), (prometheus_client, theirs_registry))
    )
    return ours, theirs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_same_text_as_prometheus_client(seed: int) -> None:
    print(f"seed={seed}")
    ours, theirs = _both(seed)
    assert ours == theirs
    assert "t_requests_created{" in ours and 't_seconds_bucket{le="+Inf",operation="prepare"}' in ours


def test_default_series_are_prometheus_clients() -> None:
    # The process-wide registries: the same default families, in the same order, with the same help.
    ours = [f for f in text_string_to_metric_families(metrics.generate_latest().decode())]
    theirs = [f for f in text_string_to_metric_families(prometheus_client.generate_latest().decode())]
    default = ("python_", "process_")
    assert [(f.name, f.type, f.documentation) for f in ours if f.name.startswith(default)] == [
        (f.name, f.type, f.documentation) for f in theirs if f.name.startswith(default)
    ]
    by_name = {f.name: f for f in ours}
    assert by_name["process_resident_memory_bytes"].samples[0].value > 1e6
    assert by_name["python_info"].samples[0].labels["implementation"] == "CPython"


def test_content_type_and_misuse() -> None:
    assert metrics.CONTENT_TYPE_LATEST == prometheus_client.CONTENT_TYPE_LATEST
    registry = metrics.CollectorRegistry()
    counter = metrics.Counter("t_x_total", "X.", ["a"], registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.Counter("t_x", "X again.", registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("1").inc(-1)
    with pytest.raises(ValueError, match="label values"):
        counter.labels("1", "2")
    with pytest.raises(ValueError, match="use labels"):
        counter.inc()
    counter.labels(7).inc(2)
    assert registry.get_sample_value("t_x_total", {"a": "7"}) == 2
    assert registry.get_sample_value("t_x_total", {"a": "8"}) is None
