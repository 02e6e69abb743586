"""The child objects: names, labels, finalizers and the daemon pod spec (SPEC sections 2 and 4)."""

from __future__ import annotations

from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, COMPUTE_DOMAIN_LABEL, TEMPLATE_TARGET_LABEL
from computedomain.controller.claim_templates import daemon_template, workload_template
from computedomain.controller.daemonset import daemonset
from imex.config import hostname_prefix
from tests.unit.controller.helpers import DRIVER_NS, UID, compute_domain, host_settings, settings


def _env(ds: dict[str, Any]) -> dict[str, Any]:
    container = ds["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_daemonset_identity_and_scheduling() -> None:
    ds = daemonset(compute_domain(), settings())
    meta = ds["metadata"]
    assert meta["name"] == f"computedomain-daemon-{UID}" and len(meta["name"]) == 57
    assert meta["namespace"] == DRIVER_NS
    assert meta["labels"] == {COMPUTE_DOMAIN_LABEL: UID}
    assert meta["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
    assert "generateName" not in meta and "ownerReferences" not in meta
    spec = ds["spec"]
    assert spec["selector"]["matchLabels"] == {COMPUTE_DOMAIN_LABEL: UID}
    assert spec["template"]["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: UID}
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {COMPUTE_DOMAIN_LABEL: UID}
    assert pod["tolerations"] == [
        {"operator": "Exists", "effect": "NoSchedule"},
        {"operator": "Exists", "effect": "NoExecute"},
        {"operator": "Exists", "effect": "PreferNoSchedule"},
    ]
    assert pod["resourceClaims"] == [
        {"name": "compute-domain-daemon", "resourceClaimTemplateName": f"computedomain-daemon-{UID}"}
    ]
    container = pod["containers"][0]
    assert container["resources"] == {"claims": [{"name": "compute-domain-daemon"}]}
    assert container["command"] == ["python", "-m", "imex", "daemon", "run"]
    assert container["image"] == "registry.example/computedomain:1"
    assert "imagePullSecrets" not in pod


def test_daemonset_probes_ask_the_daemon_for_its_check() -> None:
    container = daemonset(compute_domain(), settings())["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "CHECK_PORT", "value": "8080"} in container["env"]
    for probe, period, failures in (("startupProbe", 1, 1200), ("livenessProbe", 60, 20), ("readinessProbe", 10, 1)):
        assert container[probe]["httpGet"] == {"path": "/ready", "port": 8080}
        assert (container[probe]["periodSeconds"], container[probe]["failureThreshold"]) == (period, failures)
        assert container[probe]["timeoutSeconds"] == 10


def test_daemonset_env() -> None:
    env = _env(
        daemonset(
            compute_domain(), settings(LOG_LEVEL_CD_DAEMON="debug", FEATURE_GATES="CrashOnNVLinkFabricErrors=false")
        )
    )
    for name, path in (
        ("NODE_NAME", "spec.nodeName"),
        ("POD_IP", "status.podIP"),
        ("POD_UID", "metadata.uid"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ):
        assert env[name] == {"fieldRef": {"fieldPath": path}}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["LOG_LEVEL"] == "debug"
    assert env["MAX_NODES_PER_IMEX_DOMAIN"] == "18"
    assert "CrashOnNVLinkFabricErrors=false" in env["FEATURE_GATES"]
    assert "ComputeDomainCliques=true" in env["FEATURE_GATES"]
    assert (env["COMPUTE_DOMAIN_UUID"], env["COMPUTE_DOMAIN_NAME"], env["COMPUTE_DOMAIN_NAMESPACE"]) == (
        UID,
        "cd1",
        "team",
    )
    assert env["IMEX_HOSTNAME_PREFIX"] == hostname_prefix(UID)


def test_hostname_prefix_is_per_domain_and_fits_a_dns_label() -> None:
    a = hostname_prefix(UID)
    b = hostname_prefix("9c0e28ba-2fa1-411d-8a1f-6ec5c1f3a8e3")
    assert a != b
    assert a == "compute-domain-daemon-1b4e28ba2fa1411d8a1f6ec5c1f3a8e2"
    assert len(a + "-0017") <= 63


def test_pull_secrets() -> None:
    pod = daemonset(compute_domain(), settings(CD_DAEMON_IMAGE_PULL_SECRET_NAMES="a, b c"))["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}, {"name": "c"}]


def test_daemon_template() -> None:
    t = daemon_template(compute_domain(), settings())
    assert t["metadata"]["name"] == f"computedomain-daemon-{UID}"
    assert t["metadata"]["namespace"] == DRIVER_NS
    assert t["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: UID, TEMPLATE_TARGET_LABEL: "Daemon"}
    assert t["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
    devices = t["spec"]["spec"]["devices"]
    assert devices["requests"] == [
        {"name": "daemon", "exactly": {"deviceClassName": "compute-domain-daemon.nvidia.com"}}
    ]
    assert devices["config"] == [
        {
            "requests": ["daemon"],
            "opaque": {
                "driver": "compute-domain.nvidia.com",
                "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "ComputeDomainDaemonConfig",
                    "domainID": UID,
                },
            },
        }
    ]


@pytest.mark.parametrize(
    ("mode", "host", "expected"),
    [("Single", False, "Single"), ("All", False, "All"), ("All", True, "Single"), ("Single", True, "Single")],
)
def test_workload_template(mode: str, host: bool, expected: str) -> None:
    cfg = host_settings() if host else settings()
    t = workload_template(compute_domain(allocation_mode=mode, template="my-channel"), cfg)
    assert (t["metadata"]["name"], t["metadata"]["namespace"]) == ("my-channel", "team")
    assert t["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: UID, TEMPLATE_TARGET_LABEL: "Workload"}
    assert t["metadata"]["finalizers"] == [COMPUTE_DOMAIN_FINALIZER]
    assert t["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "name": "cd1",
            "uid": UID,
            "controller": True,
        }
    ]
    devices = t["spec"]["spec"]["devices"]
    # Only devices no other domain holds (several pods of this one on a node; design note 0014).
    selector = (
        '!("domain" in device.attributes["compute-domain.nvidia.com"]) || '
        f'device.attributes["compute-domain.nvidia.com"].domain == "{UID}"'
    )
    assert devices["requests"] == [
        {
            "name": "channel",
            "exactly": {
                "deviceClassName": "compute-domain-default-channel.nvidia.com",
                "selectors": [{"cel": {"expression": selector}}],
            },
        }
    ]
    params = devices["config"][0]["opaque"]["parameters"]
    assert params == {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": UID,
        "allocationMode": expected,
    }
