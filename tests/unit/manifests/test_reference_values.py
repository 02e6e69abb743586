"""The reference chart's values keep working here: its keys with its meaning and shape, or a one-line refusal
that says what to use instead; a schema that rejects unknown keys and wrong types and stays in step with
values.yaml; the reference's names (pod label, container names, Lease). Rendered by the real helm; each
process's env is read by its own settings loader."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from computedomain.controller.daemonset import SERVICE_ACCOUNT
from computedomain.settings import ControllerSettings, FeatureGate, PluginSettings, load_settings
from tests.unit.manifests.chart import CHART, REPO, Rendered, container, env_of, render, template_error

REFERENCE_VALUES = REPO / "manifests" / "examples" / "values-from-reference.yaml"
MIGRATION_DOC = REPO / "docs" / "migrate.md"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
FIELDS = {
    "metadata.name": "pod-1",
    "metadata.namespace": "dra-driver-nvidia-gpu",
    "spec.nodeName": "node-1",
    "status.podIP": "10.244.1.7",
}


def _controller(r: Rendered) -> dict[str, Any]:
    return container(r.one("Deployment", component="controller"), "compute-domain")


def _agent(r: Rendered) -> dict[str, Any]:
    return container(r.one("DaemonSet", component="kubelet-plugin"), "compute-domains")


def _pod(r: Rendered, kind: str, component: str) -> dict[str, Any]:
    spec: dict[str, Any] = r.one(kind, component=component)["spec"]["template"]
    return spec


# --- the schema and values.yaml: the same keys, in both directions ----------------------------------------


def _schema_keys(node: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every key the schema names (objects with listed properties are walked), with its schema."""
    out: dict[str, dict[str, Any]] = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        out[path] = sub
        if sub.get("type") == "object" and "properties" in sub:
            out.update(_schema_keys(sub, path + "."))
    return out


def _values_keys(node: Any, schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Every key of values.yaml, down to where the schema stops listing properties (free-form maps)."""
    out: set[str] = set()
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.add(path)
        sub = schema.get(path, {})
        if isinstance(value, dict) and "properties" in sub:
            out |= _values_keys(value, schema, path + ".")
    return out


def test_schema_and_values_yaml_name_the_same_keys() -> None:
    """Drift fails here: a key added to values.yaml without the schema (helm would refuse it), or a schema
    key with no default that is not marked as a reference key or an older name (x-compat)."""
    schema = _schema_keys(SCHEMA)
    defaults = _values_keys(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
    assert sorted(defaults - set(schema)) == [], "keys of values.yaml the schema does not know"
    without_default = {k for k in schema if k not in defaults and not any(k.startswith(d + ".") for d in defaults)}
    unmarked = sorted(k for k in without_default if "x-compat" not in schema[k])
    assert unmarked == [], "schema keys with no default in values.yaml and no x-compat note"
    assert all("x-compat" not in schema[k] for k in defaults), "a key with a default is not a compat key"


def test_every_compat_key_is_in_the_migration_guide() -> None:
    doc = MIGRATION_DOC.read_text()
    compat = [k for k, sub in _schema_keys(SCHEMA).items() if "x-compat" in sub]
    assert compat and [k for k in compat if f"`{k}`" not in doc] == []


@pytest.mark.parametrize(
    ("sets", "error"),
    [
        (["bogus=1"], "at '': additional properties 'bogus' not allowed"),
        (["controller.replicaz=2"], "at '/controller': additional properties 'replicaz' not allowed"),
        (["kubeletPlugin.containers.computeDomains.healthCheckPort=1"], "additional properties 'healthCheckPort'"),
        (["controller.replicas=two"], "at '/controller/replicas': got string, want integer"),
        (["imagePullSecrets[0].secret=x"], "at '/imagePullSecrets/0'"),
        (["controller.containers.computeDomain.env=X"], "at '/controller/containers/computeDomain/env'"),
        (["kubeletPlugin.containers.computeDomains.env[0].value=/x"], "missing property 'name'"),
    ],
)
def test_schema_names_the_key(sets: list[str], error: str) -> None:
    assert error in template_error(*sets, namespace="cd")


# --- a values file written for the reference chart ----------------------------------------------------------


@pytest.fixture(scope="module")
def ref() -> Rendered:
    return render(values=(REFERENCE_VALUES,), namespace="gpu-operator", hooks=True)


def test_reference_values_file_reaches_the_processes(ref: Rendered) -> None:
    controller = load_settings(ControllerSettings, environ=env_of(_controller(ref), FIELDS))
    # logVerbosity "6" -> debug; the daemons' own LOG_VERBOSITY_CD_DAEMON "2" from env -> info.
    assert (controller.log_level, controller.daemon_log_level) == ("debug", "info")
    assert (controller.leader_election_lease_duration, controller.leader_election_renew_deadline) == (30.0, 20.0)
    assert controller.leader_election_retry_period == 5.0
    assert controller.leader_election_name == "dra-driver-nvidia-gpu-controller"
    assert controller.pull_secrets == ("nvcr-pull",)
    assert controller.managed_namespaces == ("dra-driver-nvidia-gpu", "nvidia-dra-driver-gpu")
    assert (controller.kube_api_qps, controller.kube_api_burst) == (10.0, 20)
    assert controller.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES)
    assert (controller.http_endpoint, controller.metrics_path) == (":8080", "/metrics")
    # The reference's IMEX config overrides and, from controller.priorityClassName, the daemons' priority class.
    assert controller.imex_config_overrides == {"IMEX_NODE_DISCONNECTED_GRACE_TIME": "60"}
    assert controller.daemon_priority_class == "system-node-critical"
    agent = load_settings(PluginSettings, environ=env_of(_agent(ref), FIELDS))
    assert agent.log_level == "info", "the node agent's own LOG_VERBOSITY 4 wins over logVerbosity 6"
    assert (agent.driver_root, agent.driver_root_mount) == ("/run/nvidia/driver", "/driver-root")
    assert (agent.http_endpoint, agent.health_port) == (":8081", 51515)


def test_reference_values_file_objects(ref: Rendered) -> None:
    namespaced = [o for o in ref.objects if "namespace" in o["metadata"]]
    per_namespace = {o["metadata"]["namespace"] for o in namespaced}
    # namespaceOverride moves everything; the daemon ServiceAccount and Roles also go to ADDITIONAL_NAMESPACES.
    assert per_namespace == {"dra-driver-nvidia-gpu", "nvidia-dra-driver-gpu"}
    assert {o["kind"] for o in namespaced if o["metadata"]["namespace"] == "nvidia-dra-driver-gpu"} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    assert {
        o["metadata"]["namespace"] for o in ref.all("ServiceAccount") if o["metadata"]["name"] == SERVICE_ACCOUNT
    } == {"dra-driver-nvidia-gpu", "nvidia-dra-driver-gpu"}
    # serviceAccount.name: the reference's names, with its annotations.
    accounts = {o["metadata"]["name"]: o for o in ref.all("ServiceAccount")}
    for name in ("dra-driver-controller", "dra-driver-kubeletplugin"):
        assert accounts[name]["metadata"]["annotations"] == {"example.com/owner": "platform-team"}
    controller = _pod(ref, "Deployment", "controller")
    agent = _pod(ref, "DaemonSet", "kubelet-plugin")
    assert controller["spec"]["serviceAccountName"] == "dra-driver-controller"
    assert agent["spec"]["serviceAccountName"] == "dra-driver-kubeletplugin"
    for pod in (controller, agent):
        assert pod["spec"]["imagePullSecrets"] == [{"name": "nvcr-pull"}]
    # Security contexts as given (merged over the chart's defaults), resources, update strategy, affinity.
    assert controller["spec"]["securityContext"]["runAsUser"] == 1000
    assert controller["spec"]["securityContext"]["fsGroup"] == 1000
    assert _controller(ref)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert _controller(ref)["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    # The reference's {privileged: true} picks the chart's privileged context (root, read-only root).
    assert _agent(ref)["securityContext"] == {
        "privileged": True,
        "readOnlyRootFilesystem": True,
        "runAsUser": 0,
        "runAsGroup": 0,
    }
    assert _agent(ref)["resources"] == {"limits": {"memory": "256Mi"}}
    ds = ref.one("DaemonSet", component="kubelet-plugin")
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    anti = controller["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    # The reference's affinity selects by its pod label, which our controller pods carry.
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= controller["metadata"]["labels"].items()
    host_paths = {v["name"]: v["hostPath"]["path"] for v in agent["spec"]["volumes"]}
    assert host_paths["driver-root"] == "/run/nvidia/driver"
    assert {o["metadata"]["name"] for o in ref.all("NetworkPolicy")} == {
        "compute-domain-controller",
        "compute-domain-kubelet-plugin",
        "compute-domain-controller-ingress",
        "compute-domain-kubelet-plugin-ingress",
    }
    # The admission policy confines the ServiceAccount actually used, in the namespace actually used.
    (policy,) = [p for p in ref.all("ValidatingAdmissionPolicy") if p["metadata"]["name"].endswith("own-node")]
    assert "system:serviceaccount:dra-driver-nvidia-gpu:dra-driver-kubeletplugin" in str(policy["spec"])


def test_ignored_reference_keys_change_nothing() -> None:
    """The GPU-only and webhook keys, accepted and ignored: the rendering is the same without them."""
    ignored = [
        "gpuResourcesEnabledOverride=true",
        "consumableShares=memory",
        "maskNvidiaDriverParams=true",
        "gpuDriverConfig.default=x",
        "webhook.enabled=true",
        "webhook.tls.mode=secret",
        "nvidiaCDIHookPath=/opt/hook",
        "kubeletPlugin.metrics.gpuHttpEndpoint=:9999",
        "kubeletPlugin.containers.gpus.healthcheckPort=1",
        "kubeletPlugin.containers.init.resources.requests.cpu=1",
        "resources.gpus.enabled=false",
        "resourceApiVersion=resource.k8s.io/v1",
    ]
    assert render(*ignored, hooks=True).objects == render(hooks=True).objects


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["resources.gpus.enabled=true"], "keep the reference chart for GPUs (gpu.nvidia.com)"),
        (["resourceApiVersion=resource.k8s.io/v1beta1"], "this service needs resource.k8s.io/v1 (Kubernetes 1.34"),
        (["controller.metrics.profilePath=/debug/pprof"], "this service has no Go profiler; send SIGUSR2"),
        (["altProcDevices=/var/lib/mock/proc-devices"], "[{name: PROC_ROOT, value: /driver-root/proc}] instead"),
        (["nvidiaCtkPath=/usr/bin/nvidia-ctk"], "nvidiaCtkPath is no longer supported"),
        (["namespace=nvidia"], "set the namespace with helm --namespace NAME (or namespaceOverride)"),
        (["serviceAccount.create=false"], "serviceAccount.create=false needs serviceAccount.name"),
        (["logLevel=debug", "logVerbosity=4"], "logLevel and logVerbosity are both set: keep one"),
        (["logVerbosity=loud"], "LOG_VERBOSITY 'loud' must be a klog verbosity, 0 to 7"),
        (
            [
                "additionalNamespaces={a}",
                "controller.containers.computeDomain.env[0].name=ADDITIONAL_NAMESPACES",
                "controller.containers.computeDomain.env[0].value=b",
            ],
            "additionalNamespaces and an ADDITIONAL_NAMESPACES entry",
        ),
        (["controller.leaderElection.leaseDuration=15 seconds"], "LEADER_ELECTION_LEASE_DURATION '15 seconds' is"),
        (["controller.leaderElection.renewDeadline=1m"], "need lease duration > renew deadline > retry period"),
        (["controller.metrics.httpEndpoint=localhost"], "HTTP_ENDPOINT 'localhost' must look like host:port"),
        (["kubeletPlugin.containers.computeDomains.healthcheckPort=70000"], "HEALTHCHECK_PORT '70000' must be"),
        (
            ["monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true"],
            "Prometheus would scrape every pod twice",
        ),
    ],
)
def test_what_cannot_be_honoured_fails_with_what_to_do(sets: list[str], message: str) -> None:
    stderr = template_error(*sets, namespace="cd")
    (line,) = [ln for ln in stderr.splitlines() if message in ln]
    assert line.startswith("Error: execution error at (compute-domain/templates/validate.yaml")
    assert line.rstrip().endswith(")") and "(values: " in line


def test_default_namespace_needs_allow_default_namespace() -> None:
    assert 'the namespace is "default"' in template_error(namespace="default")
    assert render("allowDefaultNamespace=true", namespace="default").all("Deployment")
    # A namespaceOverride elsewhere is fine whatever the release namespace.
    r = render("namespaceOverride=elsewhere", namespace="default")
    assert {o["metadata"]["namespace"] for o in r.objects if "namespace" in o["metadata"]} == {"elsewhere"}


# --- single keys -----------------------------------------------------------------------------------------------


def test_pull_secrets_as_objects_or_names() -> None:
    for sets in (["imagePullSecrets[0].name=a", "imagePullSecrets[1].name=b"], ["imagePullSecrets={a,b}"]):
        r = render(*sets, hooks=True)
        for obj in r.objects:
            pod = obj.get("spec", {}).get("template", {}).get("spec")
            if pod:
                assert pod["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}], obj["metadata"]["name"]
        settings = load_settings(ControllerSettings, environ=env_of(_controller(r), FIELDS))
        assert settings.pull_secrets == ("a", "b")


@pytest.mark.parametrize(
    ("sets", "seconds"),
    [
        ([], (15.0, 10.0, 2.0)),
        (
            ["controller.leaderElection.leaseDuration=1m30s", "controller.leaderElection.retryPeriod=500ms"],
            (90, 10, 0.5),
        ),
        (["controller.leaderElection.leaseDuration=20", "controller.leaderElection.renewDeadline=12.5"], (20, 12.5, 2)),
    ],
)
def test_leader_election_durations(sets: list[str], seconds: tuple[float, float, float]) -> None:
    s = load_settings(ControllerSettings, environ=env_of(_controller(render(*sets)), FIELDS))
    got = (s.leader_election_lease_duration, s.leader_election_renew_deadline, s.leader_election_retry_period)
    assert got == pytest.approx(seconds)


@pytest.mark.parametrize(("verbosity", "level"), [("0", "info"), ("4", "info"), ("7", "debug")])
def test_log_verbosity(verbosity: str, level: str) -> None:
    r = render(f"logVerbosity={verbosity}")
    for c, cls in ((_controller(r), ControllerSettings), (_agent(r), PluginSettings)):
        env = env_of(c, FIELDS)
        assert env["LOG_VERBOSITY"] == verbosity
        assert load_settings(cls, environ=env).log_level == level  # type: ignore[attr-defined]
    controller = load_settings(ControllerSettings, environ=env_of(_controller(r), FIELDS))
    assert controller.daemon_log_level == level


def test_reference_names() -> None:
    r = render()
    controller, agent = _pod(r, "Deployment", "controller"), _pod(r, "DaemonSet", "kubelet-plugin")
    assert controller["metadata"]["labels"]["dra-driver-nvidia-gpu-component"] == "controller"
    assert agent["metadata"]["labels"]["dra-driver-nvidia-gpu-component"] == "kubelet-plugin"
    assert [c["name"] for c in controller["spec"]["containers"]] == ["compute-domain"]
    assert [c["name"] for c in agent["spec"]["containers"]] == ["compute-domains"]
    assert env_of(_controller(r), FIELDS)["LEADER_ELECTION_LEASE_LOCK_NAME"] == "dra-driver-nvidia-gpu-controller"
    # With the reference's nameOverride, its label key and Lease follow it, as they do there.
    r = render("nameOverride=gpu-dra")
    assert _pod(r, "Deployment", "controller")["metadata"]["labels"]["gpu-dra-component"] == "controller"
    assert env_of(_controller(r), FIELDS)["LEADER_ELECTION_LEASE_LOCK_NAME"] == "gpu-dra-controller"
    assert (
        env_of(_controller(render("controller.leaderElection.leaseName=mine")), FIELDS)[
            "LEADER_ELECTION_LEASE_LOCK_NAME"
        ]
        == "mine"
    )


def test_selector_labels_override() -> None:
    r = render("selectorLabelsOverride.app=gpu-dra")
    for kind, component in (("Deployment", "controller"), ("DaemonSet", "kubelet-plugin")):
        obj = r.one(kind, component=component)
        selector = {"app": "gpu-dra", "app.kubernetes.io/component": component}
        assert obj["spec"]["selector"]["matchLabels"] == selector
        assert selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()


def test_service_account_create_false_uses_the_named_accounts() -> None:
    r = render("serviceAccount.create=false", "serviceAccount.name=pre")
    names = {o["metadata"]["name"] for o in r.all("ServiceAccount")}
    assert "pre-controller" not in names and "pre-kubeletplugin" not in names
    assert SERVICE_ACCOUNT in names  # the daemons' account: the controller names it in every daemon pod
    subjects = {s["name"] for b in [*r.all("ClusterRoleBinding"), *r.all("RoleBinding")] for s in b["subjects"]}
    assert {"pre-controller", "pre-kubeletplugin"} <= subjects, "still granted this service's permissions"


def test_health_port_follows_an_env_entry_and_can_be_off() -> None:
    r = render("kubeletPlugin.containers.computeDomains.env[0].name=HEALTHCHECK_PORT",
               "kubeletPlugin.containers.computeDomains.env[0].value=52000")  # fmt: skip
    agent = _agent(r)
    probes = [agent[p]["grpc"]["port"] for p in ("livenessProbe", "startupProbe", "readinessProbe")]
    assert probes == [52000] * 3
    assert load_settings(PluginSettings, environ=env_of(agent, FIELDS)).health_port == 52000
    for port in ("0", "-1"):
        agent = _agent(render(f"kubeletPlugin.containers.computeDomains.healthcheckPort={port}"))
        assert not {"livenessProbe", "startupProbe", "readinessProbe"} & agent.keys()
        assert [p["name"] for p in agent["ports"]] == ["metrics"]


def test_additional_namespaces_from_the_controller_env() -> None:
    """The reference chart reads ADDITIONAL_NAMESPACES from the controller's env to create the per-namespace
    RBAC and daemon ServiceAccounts; so does this one."""
    r = render("controller.containers.computeDomain.env[0].name=ADDITIONAL_NAMESPACES",
               "controller.containers.computeDomain.env[0].value= old-a\\, old-b \\,")  # fmt: skip
    settings = load_settings(ControllerSettings, environ=env_of(_controller(r), FIELDS))
    assert settings.managed_namespaces == ("dra-driver-nvidia-gpu", "old-a", "old-b")
    for ns in ("old-a", "old-b"):
        assert {o["kind"] for o in r.objects if o["metadata"].get("namespace") == ns} == {
            "ServiceAccount", "Role", "RoleBinding"
        }  # fmt: skip


def test_pdb() -> None:
    assert not render("controller.pdb.enabled=true", "controller.replicas=1").all("PodDisruptionBudget")
    (pdb,) = render("controller.pdb.enabled=true").all("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    (pdb,) = render("controller.pdb.enabled=true", "controller.pdb.maxUnavailable=50%").all("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == "50%" and "minAvailable" not in pdb["spec"]


def test_feature_gates_in_go_bool_forms() -> None:
    r = render("featureGates.CrashOnNVLinkFabricErrors=0", "featureGates.ComputeDomainCliques=T")
    env = env_of(_controller(r), FIELDS)
    assert env["FEATURE_GATES"] == "ComputeDomainCliques=true,CrashOnNVLinkFabricErrors=false,"
    assert "FEATURE_GATES: item 'ComputeDomainCliques=yes'" in template_error(
        "featureGates.ComputeDomainCliques=yes", namespace="cd"
    )


def test_every_values_example_in_docs_is_a_file_that_renders() -> None:
    assert REFERENCE_VALUES.name in MIGRATION_DOC.read_text()
