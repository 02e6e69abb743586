"""The RBAC table of docs/rbac-table.md: what the apiserver grants each ServiceAccount of the chart.

For each identity the apiserver is asked (a SelfSubjectRulesReview, impersonating the ServiceAccount with its
groups) what it may do in the release namespace, in an additional namespace and in any other namespace (which
shows the cluster-wide grants); what every ServiceAccount may do anyway (discovery, self reviews) is left out.
A fixed list of sensitive actions is then checked one by one (SelfSubjectAccessReviews), so the table also
says what each identity cannot do. Namespaces are written as placeholders, so the table does not depend on
the run. Admission policies narrow several of these grants further; docs/security.md says where.
"""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import Cluster
from tests.unit.manifests.chart import render

VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
RELEASE, EXTRA, TENANT = "the release namespace", "the additional namespace", "any other namespace"

# (verb, resource[/subresource], namespace placeholder or "" for cluster scope)
SENSITIVE = [
    ("get", "secrets", RELEASE),
    ("create", "pods", RELEASE),
    ("create", "pods", TENANT),
    ("create", "serviceaccounts/token", RELEASE),
    ("delete", "nodes", ""),
    ("update", "nodes/status", ""),
    ("create", "resourceclaims", TENANT),
    ("update", "computedomains", TENANT),
    ("delete", "computedomains", TENANT),
    ("create", "computedomaincliques", TENANT),
    ("patch", "daemonsets", TENANT),
    ("create", "clusterrolebindings", ""),
    ("create", "validatingadmissionpolicies", ""),
    ("update", "customresourcedefinitions", ""),  # any CRD: the CRD hook may update only its two, by name
    ("impersonate", "users", ""),
]

IDENTITIES = [
    ("controller", "compute-domain-controller", (RELEASE,)),
    ("node agent", "compute-domain-kubelet-plugin", (RELEASE,)),
    ("IMEX daemon", "compute-domain-daemon-service-account", (RELEASE, EXTRA)),
    ("uninstall hooks (exist only while `helm uninstall` runs)", "compute-domain-uninstall", (RELEASE,)),
    ("CRD hook (exists only while `helm install` or `helm upgrade` runs)", "compute-domain-crds", (RELEASE,)),
]


def _impersonate(sa: str, ns: str) -> list[str]:
    return [
        f"--as=system:serviceaccount:{ns}:{sa}",
        "--as-group=system:serviceaccounts",
        f"--as-group=system:serviceaccounts:{ns}",
        "--as-group=system:authenticated",
    ]


Rule = tuple[str, str, str, str]  # (apiGroup, resource, name or "", verb)


def _rules(cluster: Cluster, who: list[str], namespace: str) -> set[Rule]:
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectRulesReview",
        "spec": {"namespace": namespace},
    }
    out = cluster.kubectl("create", "--validate=false", "-o", "json", "-f", "-", *who, input=json.dumps(review))
    status = json.loads(out)["status"]
    assert not status.get("incomplete"), status.get("evaluationError")
    rules: set[Rule] = set()
    for rule in status.get("resourceRules", []):
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for name in rule.get("resourceNames") or [""]:
                    for verb in rule.get("verbs", []):
                        rules.add((group, resource, name, verb))
    return rules


def _rows(rules: set[Rule]) -> list[tuple[str, str, str, str]]:
    grouped: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for group, resource, name, verb in rules:
        grouped[(group or "core", resource, name)].add(verb)
    rows = []
    for (group, resource, name), verbs in sorted(grouped.items()):
        ordered = sorted(verbs, key=lambda v: (VERBS.index(v) if v in VERBS else len(VERBS), v))
        rows.append((group, resource, name, ", ".join(ordered)))
    return rows


def _can(cluster: Cluster, who: list[str], verb: str, resource: str, namespace: str) -> bool:
    resource, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, resource, *who]
    args += [f"--subresource={sub}"] if sub else []
    args += ["-n", namespace] if namespace else []
    code, _ = cluster.try_kubectl(*args)
    return code == 0


def _hook_rbac(namespace: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The hooks' ServiceAccounts and permissions (uninstall and CRD upgrade), as Helm would create them."""
    objects = render(*sets, hooks=True, namespace=namespace).objects
    return [o for o in objects if "helm.sh/hook" in o["metadata"].get("annotations", {}) and o["kind"] != "Job"]


def _section(
    cluster: Cluster, title: str, sa: str, home: str, actual: dict[str, str], baseline: dict[str, set[Rule]]
) -> list[str]:
    who = _impersonate(sa, actual[home])
    lines = [
        f"## {title}: `{sa}` in {home}",
        "",
        "| where | API group | resource | name | verbs |",
        "|---|---|---|---|---|",
    ]
    everywhere = _rules(cluster, who, actual[TENANT]) - baseline[TENANT]
    for row in _rows(everywhere):
        lines.append(f"| every namespace, cluster-scoped | {' | '.join(row)} |")
    for place in (RELEASE, EXTRA):
        local = _rules(cluster, who, actual[place]) - baseline[place] - everywhere
        for row in _rows(local):
            lines.append(f"| {place} | {' | '.join(row)} |")
    return [*lines, ""]


def _matrix(cluster: Cluster, actual: dict[str, str], identities: list[tuple[str, str, tuple[str, ...]]]) -> list[str]:
    """Sensitive actions checked one by one (SelfSubjectAccessReviews) for each identity."""
    columns = [(f"{title.split(' (')[0]} ({home})" if len(homes) > 1 else title.split(" (")[0], sa, home)
               for title, sa, homes in identities for home in homes]  # fmt: skip
    lines = [
        "## Sensitive actions, checked one by one",
        "",
        "| action | " + " | ".join(name for name, _, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for verb, resource, place in SENSITIVE:
        cells = [
            "yes" if _can(cluster, _impersonate(sa, actual[home]), verb, resource, actual.get(place, "")) else "no"
            for _, sa, home in columns
        ]
        lines.append(f"| `{verb} {resource}`" + (f" in {place}" if place else "") + " | " + " | ".join(cells) + " |")
    return [*lines, ""]


def header(install: str, generated_by: str) -> list[str]:
    text = (
        f"Generated by `tests/cluster/manifests/{generated_by}` (`RBAC_TABLE_UPDATE=1` rewrites it) from the chart "
        f"installed with {install}, on the test bed's control plane: for each ServiceAccount a "
        "SelfSubjectRulesReview as that account, in the release namespace, the additional namespace and any other "
        "namespace (cluster-wide grants show there too), without what every ServiceAccount may do anyway "
        '(discovery, self reviews). The test fails when a role is widened or narrowed. RBAC cannot name "my node" '
        "or \"my pod\": the admission policies narrow the node agent's and the daemon's writes further "
        "(docs/security.md)."
    )
    return textwrap.wrap(text, width=110, break_on_hyphens=False)


def build(
    cluster: Cluster,
    *,
    release_ns: str,
    extra_ns: str,
    tenant_ns: str,
    tmp: Path,
    install: str = "its defaults (driverManaged) and one additional namespace",
    generated_by: str = "test_security.py::test_rbac_table_matches_the_checked_in_one",
    identities: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
) -> str:
    """``identities``: ServiceAccount names to include (all when empty); ``sets``: the install's ``--set``s,
    for the hooks' objects."""
    actual = {RELEASE: release_ns, EXTRA: extra_ns, TENANT: tenant_ns}
    chosen = [i for i in IDENTITIES if not identities or i[1] in identities]
    hooks = _hook_rbac(release_ns, sets)
    hooks_file = tmp / "hook-rbac.yaml"
    hooks_file.write_text(yaml.safe_dump_all(hooks))
    cluster.kubectl("apply", "-f", str(hooks_file))
    try:
        baseline_who = _impersonate("nobody", tenant_ns)
        baseline = {place: _rules(cluster, baseline_who, ns) for place, ns in actual.items()}
        lines = [
            "# RBAC of each identity of the chart, as the apiserver grants it",
            "",
            *header(install, generated_by),
            "",
        ]
        for title, sa, homes in chosen:
            for home_place in homes:
                lines += _section(cluster, title, sa, home_place, actual, baseline)
        lines += _matrix(cluster, actual, chosen)
        return "\n".join(lines).rstrip() + "\n"
    finally:
        cluster.kubectl("delete", "-f", str(hooks_file), "--wait=false", check=False)
