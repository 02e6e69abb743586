"""What the chart's dashboard and alerts query, and what a scrape of the service exports: shared by the unit
test (queries parse, objects render) and the system test (every queried series is one a live process
exports)."""

from __future__ import annotations

import json
from typing import Any

import promql_parser

from tests.unit.manifests.chart import CHART, Rendered, render

# Series a Prometheus server makes up itself, not exported by any target.
SYNTHESIZED = frozenset({"up"})
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "files" / "dashboard.json").read_text())
    return loaded


def dashboard_queries() -> list[str]:
    queries = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(METRIC, label) is Grafana's, not PromQL: the metric is what it queries.
            queries.append(variable["definition"].removeprefix("label_values(").split(",")[0])
    return queries


def rules(r: Rendered | None = None) -> list[dict[str, Any]]:
    r = r or render("monitoring.prometheusRule.enabled=true")
    (rule,) = r.all("PrometheusRule")
    return [x for group in rule["spec"]["groups"] for x in group["rules"]]


def series_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects (raises ValueError when it does not parse)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)
            return
        for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None:
                walk(child)
        for arg in getattr(node, "args", None) or ():
            walk(arg)

    walk(promql_parser.parse(expr))
    return names


def exported_series(exposition: str) -> set[str]:
    """The series names a scrape can contain, from the families it declares (`# TYPE`), children or not."""
    out: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            base = name.removesuffix("_total") if kind == "counter" else name
            out |= {base + suffix for suffix in SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            out.add(line.split("{", 1)[0].split(" ", 1)[0])
    return out
