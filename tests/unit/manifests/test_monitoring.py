"""The monitoring objects the chart renders (PodMonitor/ServiceMonitor, PrometheusRule, the dashboard's
ConfigMap), and that every dashboard and alert query parses as PromQL and names only series this service's
code registers (the live check is tests/cluster/system/test_scenarios.py)."""

from __future__ import annotations

import importlib
import json

import pytest

from computedomain.metrics import REGISTRY, generate_latest
from tests.unit.manifests.chart import render
from tests.unit.manifests.monitoring import (
    SYNTHESIZED,
    dashboard,
    dashboard_queries,
    exported_series,
    rules,
    series_names,
)

# The controller's and the node agent's modules register their metrics when imported.
for _module in ("computedomain.controller.app", "computedomain.plugin.app"):
    importlib.import_module(_module)


def test_all_off_by_default() -> None:
    kinds = {o["kind"] for o in render(hooks=True).objects}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule", "Service"}
    assert not [o for o in render().all("ConfigMap") if "dashboard" in o["metadata"]["name"]]


def test_every_query_parses_and_names_registered_series() -> None:
    registered = exported_series(generate_latest(REGISTRY).decode())
    queries = dashboard_queries() + [r["expr"] for r in rules()]
    assert len(queries) > 20
    unknown = {}
    for expr in queries:
        names = series_names(expr)  # ValueError: not PromQL
        missing = names - registered - SYNTHESIZED
        if missing:
            unknown[expr] = sorted(missing)
    assert unknown == {}
    # Both the reference's names and ours are on the dashboard.
    queried = set().union(*(series_names(q) for q in dashboard_queries()))
    assert {"nvidia_dra_compute_domain_info", "nvidia_dra_requests_total", "nvidia_dra_prepared_devices"} <= queried
    assert {"computedomain_compute_domain_ready", "computedomain_reconcile_total"} <= queried


def test_alerts() -> None:
    by_name = {r["alert"]: r for r in rules(render("monitoring.prometheusRule.enabled=true",
                                                   "monitoring.prometheusRule.domainNotReadyFor=30m"))}  # fmt: skip
    assert set(by_name) == {
        "ComputeDomainNotReady", "ComputeDomainIMEXDaemonsNotReady", "ComputeDomainPrepareErrors",
        "ComputeDomainNodeAgentNotRegistered", "ComputeDomainNodeAgentDown", "ComputeDomainControllerDown",
        "ComputeDomainControllerNoLeader",
    }  # fmt: skip
    assert by_name["ComputeDomainNotReady"]["for"] == "30m"
    for rule in by_name.values():
        # Scoped to this release's pods: a scrape adds their namespace to every series.
        assert 'namespace="nvidia-compute-domain"' in rule["expr"], rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    no_leader = rules(render("monitoring.prometheusRule.enabled=true", "controller.leaderElection.enabled=false"))
    assert "ComputeDomainControllerNoLeader" not in {r["alert"] for r in no_leader}


@pytest.mark.parametrize("kind", ["podMonitor", "serviceMonitor"])
def test_scrape_objects_select_the_pods(kind: str) -> None:
    r = render(f"monitoring.{kind}.enabled=true", f"monitoring.{kind}.labels.release=prom")
    for component, workload in (("controller", "Deployment"), ("kubelet-plugin", "DaemonSet")):
        pod = r.one(workload, component=component)["spec"]["template"]
        monitor = r.one(kind[0].upper() + kind[1:], component=component)
        assert monitor["metadata"]["labels"]["release"] == "prom"
        if kind == "podMonitor":
            selector = monitor["spec"]["selector"]["matchLabels"]
            (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        else:
            (service,) = [
                s for s in r.all("Service") if s["metadata"]["labels"]["app.kubernetes.io/component"] == component
            ]
            assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            selector = service["spec"]["selector"]
            (endpoint,) = monitor["spec"]["endpoints"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        assert "metrics" in {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}


def test_dashboard_configmap() -> None:
    (cm,) = [
        o for o in render("monitoring.dashboard.enabled=true").all("ConfigMap") if "dashboard" in o["metadata"]["name"]
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["compute-domain.json"]) == dashboard()
    assert len({p["id"] for p in dashboard()["panels"]}) == len(dashboard()["panels"])
