"""The daemons' per-domain NetworkPolicy: when it is created, what it admits, and that teardown removes it."""

from __future__ import annotations

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.controller.network_policy import network_policy
from computedomain.controller.observed import ChildKind, Observed
from computedomain.controller.reconcile import CreateChild, desired
from tests.unit.controller.helpers import DRIVER_NS, UID, all_children, compute_domain, host_settings, settings
from tests.unit.controller.test_reconcile import NOW, walk

ON = {"DAEMON_NETWORK_POLICY": "true"}


def test_created_before_the_daemonset_when_enabled() -> None:
    batches, final = walk(Observed(cd=compute_domain(finalizers=())), settings(**ON))
    assert batches == [
        ["AddFinalizer"],
        ["create DaemonTemplate", "create NetworkPolicy"],  # in place before the first daemon pod
        ["create DaemonSet", "create WorkloadTemplate"],
        ["WriteStatus"],
    ]
    assert [c.kind for c in final.children if c.kind is ChildKind.NETWORK_POLICY]


def test_not_created_when_disabled_or_host_managed() -> None:
    for cfg in (settings(), host_settings(**ON)):
        batches, _ = walk(Observed(cd=compute_domain(finalizers=())), cfg)
        assert ["create NetworkPolicy"] not in batches


def test_recreated_when_someone_deleted_it() -> None:
    children = tuple(c for c in all_children() if c.kind is not ChildKind.NETWORK_POLICY)
    plan = desired(Observed(cd=compute_domain(), children=children), settings(**ON), NOW)
    (action,) = plan.actions
    assert isinstance(action, CreateChild) and action.kind is ChildKind.NETWORK_POLICY


def test_admits_only_the_domains_own_daemons_to_the_peer_port() -> None:
    cd = compute_domain()
    policy = network_policy(cd, settings(**ON))
    same_domain = {"matchLabels": {COMPUTE_DOMAIN_LABEL: UID}}
    assert policy["metadata"] == {
        "name": f"computedomain-daemon-{UID}",
        "namespace": DRIVER_NS,
        "labels": {COMPUTE_DOMAIN_LABEL: UID},
    }
    spec = policy["spec"]
    # The daemon pods of this domain (the DaemonSet's pod label) ...
    assert spec["podSelector"] == same_domain and spec["policyTypes"] == ["Ingress"]
    # ... admit one thing: the same domain's daemons on TCP 50000. The command service (50005) has no rule.
    assert spec["ingress"] == [{"from": [{"podSelector": same_domain}], "ports": [{"protocol": "TCP", "port": 50000}]}]
