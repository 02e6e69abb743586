"""What each process exposes: every metric family's name, type and label names, from the process's own import
path in a fresh interpreter (the registry is process-wide). Dashboards, alerts and the reference driver's
users read these names; a change here is a change of an external contract.

Counters are listed by family name: the exposition adds `_total` (and `_created`), histograms `_bucket`,
`_count` and `_sum`. Families of scrape-time collectors list the labels of the samples they have with no
state behind them; their full label sets are tested with their state (`tests/unit/controller/test_app.py`,
`tests/unit/plugin/test_metrics.py`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_TABLE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
from computedomain.metrics import REGISTRY
out = {}
for collector in list(REGISTRY._collector_to_names):
    labelnames = getattr(collector, "_labelnames", None)
    for family in collector.collect():
        labels = {k for s in family.samples for k in s.labels} - {"le"} if labelnames is None else set(labelnames)
        out[family.name] = [family.type, sorted(labels)]
print(json.dumps(out))
"""

DEFAULTS = {
    "python_gc_objects_collected": ["counter", ["generation"]],
    "python_gc_objects_uncollectable": ["counter", ["generation"]],
    "python_gc_collections": ["counter", ["generation"]],
    "python_info": ["gauge", ["implementation", "major", "minor", "patchlevel", "version"]],
    "process_virtual_memory_bytes": ["gauge", []],
    "process_resident_memory_bytes": ["gauge", []],
    "process_start_time_seconds": ["gauge", []],
    "process_cpu_seconds": ["counter", []],
    "process_open_fds": ["gauge", []],
    "process_max_fds": ["gauge", []],
}
#: the Kubernetes I/O layer and the HTTP endpoint: in every process
KUBE = {
    "computedomain_kube_api_requests": ["counter", ["code", "resource", "verb"]],
    "computedomain_kube_api_request_duration_seconds": ["histogram", ["resource", "verb"]],
    "computedomain_kube_api_retries": ["counter", ["error", "resource", "verb"]],
    "computedomain_kube_api_rate_limiter_wait_seconds": ["histogram", []],
    "computedomain_events": ["counter", ["action"]],
    "computedomain_events_dropped": ["counter", ["reason"]],
    "computedomain_informer_objects": ["gauge", ["informer"]],
    "computedomain_informer_events": ["counter", ["informer", "type"]],
    "computedomain_informer_relists": ["counter", ["informer", "reason"]],
    "computedomain_informer_watch_restarts": ["counter", ["informer", "reason"]],
    "computedomain_informer_rejected_objects": ["counter", ["informer"]],
    "computedomain_workqueue_depth": ["gauge", ["name"]],
    "computedomain_workqueue_adds": ["counter", ["name"]],
    "computedomain_workqueue_queue_duration_seconds": ["histogram", ["name"]],
    "computedomain_workqueue_work_duration_seconds": ["histogram", ["name"]],
    "computedomain_workqueue_retries": ["counter", ["name"]],
    "computedomain_reconcile": ["counter", ["name", "result"]],
    "computedomain_reconcile_time_seconds": ["histogram", ["name", "result"]],
    "computedomain_reconcile_escalations": ["counter", ["name", "severity"]],
    "computedomain_http_refused_connections": ["counter", ["limit"]],
}
CONTROLLER = {
    **DEFAULTS,
    **KUBE,
    "computedomain_controller_orphans_removed": ["counter", ["kind"]],
    "computedomain_controller_sweeps": ["counter", ["outcome"]],
    "computedomain_controller_imex_channel_writes": ["counter", ["action"]],
    "computedomain_leader_is_leader": ["gauge", ["lease"]],
    "computedomain_leader_transitions": ["counter", ["event", "lease"]],
    "computedomain_compute_domains": ["gauge", ["status"]],
    "nvidia_dra_compute_domain_info": ["gauge", ["status"]],  # the reference's name
    # per domain (cd_namespace, cd_name): see docs/security.md on what the controller's metrics name
    "computedomain_compute_domain_ready": ["gauge", []],
    "computedomain_imex_daemons": ["gauge", []],
}
NODE_AGENT = {
    **DEFAULTS,
    **KUBE,
    "computedomain_plugin_attempt_errors": ["counter", ["error", "operation"]],
    "computedomain_plugin_prepare_claims": ["counter", ["outcome"]],
    "computedomain_plugin_unprepare_claims": ["counter", ["outcome"]],
    "computedomain_plugin_prepare_seconds": ["histogram", []],
    "computedomain_plugin_grpc_refused_connections": ["counter", ["limit"]],
    # the reference's names, labels and meaning (computedomain/plugin/metrics.py)
    "nvidia_dra_requests": ["counter", ["driver", "operation"]],
    "nvidia_dra_request_duration_seconds": ["histogram", ["driver", "operation"]],
    "nvidia_dra_requests_inflight": ["gauge", ["driver", "operation"]],
    "nvidia_dra_node_prepare_errors": ["counter", ["driver", "error_type"]],
    "nvidia_dra_node_unprepare_errors": ["counter", ["driver", "error_type"]],
    "nvidia_dra_prepared_devices": ["gauge", []],
    "computedomain_plugin_registered": ["gauge", []],
}
DAEMON = {**DEFAULTS, **KUBE}  # registered by the layers it uses; it serves no /metrics

#: label names that would name a domain, its namespace or its tenant
DOMAIN_LABELS = {"cd_name", "cd_namespace", "cd_uid", "domain", "computedomain", "namespace", "claim"}


def _exposed(module: str) -> dict[str, list[object]]:
    out = subprocess.run([sys.executable, "-c", _TABLE, module], capture_output=True, text=True, check=True).stdout
    table: dict[str, list[object]] = json.loads(out)
    return table


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("computedomain.controller.app", CONTROLLER),
        ("computedomain.plugin.app", NODE_AGENT),
        ("imex.daemon.run", DAEMON),
    ],
)
def test_each_process_exposes_its_families(module: str, expected: dict[str, list[object]]) -> None:
    assert _exposed(module) == expected


def test_no_node_side_family_names_a_domain() -> None:
    # A node agent's scrape (any pod may reach it) and a daemon's counters carry no domain of any tenant:
    # their labels are drivers, operations, outcomes, error types and the fixed names of loops and caches.
    for table in (NODE_AGENT, DAEMON):
        labels = {label for _type, names in table.values() for label in names}  # type: ignore[attr-defined]
        assert not labels & DOMAIN_LABELS
