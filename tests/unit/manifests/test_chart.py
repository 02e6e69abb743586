"""What the chart renders: the processes' env (parsed by their own settings loaders), probes, host paths,
privileges, both modes; and that the CRDs, DeviceClasses and kustomize trees are the same objects."""

from __future__ import annotations

import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from computedomain.api.constants import HEALTH_PORT
from computedomain.controller.daemonset import SERVICE_ACCOUNT
from computedomain.settings import (
    ControllerSettings,
    FeatureGate,
    ImexMode,
    PluginSettings,
    load_settings,
)
from tests.unit.manifests.chart import (
    CHART,
    HOST_MANAGED,
    KUBECTL,
    REPO,
    Rendered,
    container,
    env_of,
    generate,
    need_helm,
    render,
)

FIELDS = {
    "metadata.name": "pod-1",
    "metadata.namespace": "nvidia-compute-domain",
    "spec.nodeName": "node-1",
    "status.podIP": "10.244.1.7",
}


def _env_names(cls: type) -> set[str]:
    return {f.metadata["env"] for f in fields(cls) if "env" in f.metadata}


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render()


@pytest.fixture(scope="module")
def host() -> Rendered:
    return render(*HOST_MANAGED)


def _controller(r: Rendered) -> dict[str, Any]:
    return container(r.one("Deployment", component="controller"), "compute-domain")


def _agent(r: Rendered) -> dict[str, Any]:
    return container(r.one("DaemonSet", component="kubelet-plugin"), "compute-domains")


def test_controller_env_is_what_the_controller_reads(default: Rendered) -> None:
    env = env_of(_controller(default), FIELDS)
    assert set(env) <= _env_names(ControllerSettings)
    assert set(env) >= {
        "FEATURE_GATES", "IMEX_MODE", "IMEX_ISOLATION", "IMEX_HOST_SOCKET_PATH", "NAMESPACE", "KUBECONFIG",
        "LOG_LEVEL", "LOG_FORMAT", "POD_NAME", "IMAGE_NAME", "CD_DAEMON_IMAGE_PULL_SECRET_NAMES",
        "LOG_LEVEL_CD_DAEMON", "MAX_NODES_PER_IMEX_DOMAIN", "HTTP_ENDPOINT", "METRICS_PATH",
        "ADDITIONAL_NAMESPACES", "LEADER_ELECTION_ENABLED", "LEADER_ELECTION_LEASE_LOCK_NAMESPACE",
        "LEADER_ELECTION_LEASE_LOCK_NAME", "LEADER_ELECTION_LEASE_DURATION", "LEADER_ELECTION_RENEW_DEADLINE",
        "LEADER_ELECTION_RETRY_PERIOD",
    }  # fmt: skip
    settings = load_settings(ControllerSettings, environ=env)
    assert settings.imex_mode is ImexMode.DRIVER_MANAGED
    assert settings.leader_election_enabled and settings.pod_name == "pod-1"
    assert settings.leader_election_namespace == "nvidia-compute-domain"
    assert (settings.leader_election_lease_duration, settings.leader_election_renew_deadline) == (15.0, 10.0)
    assert settings.leader_election_retry_period == 2.0
    assert settings.max_nodes_per_imex_domain == 18
    assert settings.image_name.startswith("ghcr.io/computedomain/computedomain:")


def test_node_agent_env_is_what_the_node_agent_reads(default: Rendered) -> None:
    env = env_of(_agent(default), FIELDS)
    assert set(env) - {"NVIDIA_VISIBLE_DEVICES"} <= _env_names(PluginSettings)
    assert set(env) >= {
        "FEATURE_GATES", "IMEX_MODE", "IMEX_ISOLATION", "IMEX_HOST_SOCKET_PATH", "NAMESPACE", "KUBECONFIG",
        "LOG_LEVEL", "LOG_FORMAT", "NODE_NAME", "KUBELET_REGISTRAR_DIRECTORY_PATH", "KUBELET_PLUGINS_DIRECTORY_PATH",
        "CDI_ROOT", "NVIDIA_DRIVER_ROOT", "CONTAINER_DRIVER_ROOT", "HEALTHCHECK_PORT", "GPU_CLIQUE_LABEL_ENABLED",
        "POD_IP",
    }  # fmt: skip
    settings = load_settings(PluginSettings, environ=env)
    assert settings.node_name == "node-1" and settings.health_port == HEALTH_PORT == 51515
    # The health server binds the pod IP; the kubelet's gRPC probes dial the pod IP, so they still reach it.
    assert settings.pod_ip == "10.244.1.7"
    assert "host" not in _agent(default)["livenessProbe"]["grpc"]
    assert (settings.driver_root, settings.driver_root_mount) == ("/", "/driver-root")
    # /proc/devices and /proc/driver/nvidia are not namespaced: the container's own /proc is the host's.
    assert settings.proc_root == "/proc" and "PROC_ROOT" not in env
    assert not settings.gpu_clique_label_enabled


def test_values_reach_the_env() -> None:
    r = render(
        "featureGates.CrashOnNVLinkFabricErrors=false",
        "featureGates.MPSSupport=true",
        "kubeletPlugin.containers.computeDomains.gpuCliqueLabelEnabled=true",
        "kubeletPlugin.containers.computeDomains.healthcheckPort=6000",
        "logLevel=debug",
        "controller.replicas=3",
        "controller.leaderElection.enabled=false",
        "additionalNamespaces={old-ns}",
        "imagePullSecrets={regcred}",
        "image.tag=v9",
    )
    env = env_of(_controller(r), FIELDS)
    assert env["FEATURE_GATES"] == "CrashOnNVLinkFabricErrors=false,MPSSupport=true,"
    controller = load_settings(ControllerSettings, environ=env)
    assert not controller.gate(FeatureGate.CRASH_ON_NVLINK_FABRIC_ERRORS)
    assert controller.log_level == "debug" and controller.daemon_log_level == "debug"
    assert controller.managed_namespaces == ("nvidia-compute-domain", "old-ns")
    assert controller.pull_secrets == ("regcred",) and controller.image_name.endswith(":v9")
    assert not controller.leader_election_enabled
    assert r.one("Deployment", component="controller")["spec"]["replicas"] == 3
    agent = load_settings(PluginSettings, environ=env_of(_agent(r), FIELDS))
    assert agent.gpu_clique_label_enabled and agent.health_port == 6000
    probe = _agent(r)["livenessProbe"]["grpc"]
    assert probe == {"port": 6000, "service": "liveness"}
    # The daemon's ServiceAccount and permissions follow the domains into the additional namespace.
    assert {
        o["metadata"]["namespace"] for o in r.all("ServiceAccount") if o["metadata"]["name"] == SERVICE_ACCOUNT
    } == {
        "nvidia-compute-domain",
        "old-ns",
    }


def test_node_agent_metrics(default: Rendered) -> None:
    """On by default, as in the reference chart: HTTP_ENDPOINT from kubeletPlugin.metrics.computeDomainHttpEndpoint,
    the container port and the scrape annotations from its port."""
    agent = _agent(default)
    settings = load_settings(PluginSettings, environ=env_of(agent, FIELDS))
    assert (settings.http_endpoint, settings.metrics_path) == (":8081", "/metrics")
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in agent["ports"]

    r = render("kubeletPlugin.metrics.computeDomainHttpEndpoint=:9400", "kubeletPlugin.metrics.metricsPath=/m")
    agent = _agent(r)
    settings = load_settings(PluginSettings, environ=env_of(agent, FIELDS))
    assert (settings.http_endpoint, settings.metrics_path) == (":9400", "/m")
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in agent["ports"]
    annotations = r.one("DaemonSet", component="kubelet-plugin")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400", "prometheus.io/path": "/m"}

    r = render("kubeletPlugin.metrics.enabled=false")
    agent = _agent(r)
    assert not {"HTTP_ENDPOINT", "METRICS_PATH"} & set(env_of(agent, FIELDS))
    assert [p["name"] for p in agent["ports"]] == ["healthcheck"]
    assert "annotations" not in r.one("DaemonSet", component="kubelet-plugin")["spec"]["template"]["metadata"]
    assert load_settings(PluginSettings, environ=env_of(agent, FIELDS)).http_endpoint == ""


def test_controller_metrics_switch_keeps_the_probes() -> None:
    r = render("controller.metrics.enabled=false", "controller.metrics.httpEndpoint=:9090")
    c = _controller(r)
    settings = load_settings(ControllerSettings, environ=env_of(c, FIELDS))
    assert (settings.http_endpoint, settings.metrics_path) == (":9090", "")
    assert c["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert "annotations" not in r.one("Deployment", component="controller")["spec"]["template"]["metadata"]


def test_host_managed(default: Rendered, host: Rendered) -> None:
    for c in (_controller(host), _agent(host)):
        env = env_of(c, FIELDS)
        assert env["IMEX_MODE"] == "hostManaged" and "HostManagedIMEXDaemon=true" in env["FEATURE_GATES"]
    assert load_settings(PluginSettings, environ=env_of(_agent(host), FIELDS)).host_managed
    assert default.names("DeviceClass") == {
        "compute-domain-default-channel.nvidia.com",
        "compute-domain-daemon.nvidia.com",
    }
    assert host.names("DeviceClass") == {"compute-domain-default-channel.nvidia.com"}
    assert SERVICE_ACCOUNT in default.names("ServiceAccount")
    assert SERVICE_ACCOUNT not in host.names("ServiceAccount")


def test_controller_deployment(default: Rendered) -> None:
    deployment = default.one("Deployment", component="controller")
    assert deployment["spec"]["replicas"] == 2
    c = _controller(default)
    assert c["command"] == ["python", "-m", "computedomain", "controller"]
    port = int(env_of(c)["HTTP_ENDPOINT"].rsplit(":", 1)[1])
    assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_node_agent_daemonset(default: Rendered) -> None:
    ds = default.one("DaemonSet", component="kubelet-plugin")
    pod = ds["spec"]["template"]["spec"]
    c = _agent(default)
    assert c["command"] == ["python", "-m", "computedomain", "kubelet-plugin"]
    env = env_of(c)
    assert c["livenessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": "liveness"}
    assert c["startupProbe"]["grpc"] == {"port": HEALTH_PORT, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": "readiness"}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert host_paths == {
        "kubelet-registrar": "/var/lib/kubelet/plugins_registry",
        "kubelet-plugins": "/var/lib/kubelet/plugins",
        "cdi": "/var/run/cdi",
        "driver-root": "/",
    }
    # Registrar, plugins and CDI dirs at the host's paths (kubelet and the runtime read them there).
    for name, env_name in [
        ("kubelet-registrar", "KUBELET_REGISTRAR_DIRECTORY_PATH"),
        ("kubelet-plugins", "KUBELET_PLUGINS_DIRECTORY_PATH"),
        ("cdi", "CDI_ROOT"),
    ]:
        assert mounts[name]["mountPath"] == host_paths[name] == env[env_name]
    assert mounts["driver-root"]["readOnly"] is True
    assert mounts["driver-root"]["mountPath"] == env["CONTAINER_DRIVER_ROOT"] == "/driver-root"
    assert host_paths["driver-root"] == env["NVIDIA_DRIVER_ROOT"]


@pytest.mark.parametrize(
    "sets",
    [["nvidiaDriverRoot=/run/nvidia/driver"], ["kubeletPlugin.nvidiaDriverRoot=/run/nvidia/driver"]],
    ids=["nvidiaDriverRoot", "older name"],
)
def test_gpu_operator_driver_root(sets: list[str]) -> None:
    """The reference's value (and our older key) mounts the GPU Operator's driver root and names it as the
    host path the base CDI spec uses."""
    r = render(*sets)
    pod = r.one("DaemonSet", component="kubelet-plugin")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    assert volume["hostPath"]["path"] == "/run/nvidia/driver"
    agent = load_settings(PluginSettings, environ=env_of(_agent(r), FIELDS))
    assert (agent.driver_root, agent.driver_root_mount) == ("/run/nvidia/driver", "/driver-root")


def test_operator_env_is_appended_and_replaces_the_charts() -> None:
    agent_env = "kubeletPlugin.containers.computeDomains.env"
    r = render(
        f"{agent_env}[0].name=PROC_ROOT",
        f"{agent_env}[0].value=/driver-root/proc",
        f"{agent_env}[1].name=LOG_LEVEL",
        f"{agent_env}[1].value=debug",
        f"{agent_env}[2].name=MY_NODE",
        f"{agent_env}[2].valueFrom.fieldRef.fieldPath=spec.nodeName",
        "controller.containers.computeDomain.env[0].name=KUBE_API_QPS",
        "controller.containers.computeDomain.env[0].value=7",
    )
    agent = _agent(r)
    names = [e["name"] for e in agent["env"]]
    assert len(names) == len(set(names)), "every name once"
    assert names[-3:] == ["PROC_ROOT", "LOG_LEVEL", "MY_NODE"], "the operator's entries come last"
    assert {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in agent["env"]
    settings = load_settings(PluginSettings, environ=env_of(agent, FIELDS))
    assert settings.proc_root == "/driver-root/proc" and settings.log_level == "debug"
    controller = _controller(r)
    assert env_of(controller, FIELDS)["KUBE_API_QPS"] == "7"
    assert load_settings(ControllerSettings, environ=env_of(controller, FIELDS)).kube_api_qps == 7.0
    assert env_of(controller, FIELDS)["LOG_LEVEL"] == "info", "one container's env is not the other's"


def test_only_the_node_agent_is_privileged() -> None:
    r = render(hooks=True)
    privileged = set()
    for obj in r.objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for c in pod["containers"]:
            if c.get("securityContext", {}).get("privileged"):
                privileged.add((obj["kind"], c["name"]))
            else:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, obj["metadata"]["name"]
        if not any(v.get("hostPath") for v in pod.get("volumes", [])):
            continue
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "kubelet-plugin"
    assert privileged == {("DaemonSet", "compute-domains")}


def test_feature_gates_render_in_the_processes_syntax() -> None:
    r = render("featureGates.ComputeDomainCliques=false", "featureGates.IMEXDaemonsWithDNSNames=false")
    env = env_of(_controller(r), FIELDS)
    assert env["FEATURE_GATES"] == "ComputeDomainCliques=false,IMEXDaemonsWithDNSNames=false,"
    settings = load_settings(ControllerSettings, environ=env)
    assert not settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES)


def test_chart_crds_are_the_generated_ones() -> None:
    chart_crds = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    generated = {p.name: p.read_text() for p in (REPO / "manifests" / "crds").glob("*.yaml")}
    assert chart_crds == generated, "run `python manifests/generate.py` after `make crds`"


def test_device_classes_match_manifests_deviceclasses(default: Rendered) -> None:
    isolated = render(
        "resources.computeDomains.imex.mode=hostManaged",
        "featureGates.HostManagedIMEXDaemon=true",
        "featureGates.IMEXChannelIsolation=true",
        "resources.computeDomains.imex.isolation=channel",
    )
    for name, file, chart in [
        ("compute-domain-default-channel.nvidia.com", "channel.yaml", default),
        ("compute-domain-daemon.nvidia.com", "daemon.yaml", default),
        ("compute-domain-channel.nvidia.com", "channel-isolated.yaml", isolated),
    ]:
        on_disk = yaml.safe_load((REPO / "manifests" / "deviceclasses" / file).read_text())
        rendered = chart.one("DeviceClass", name)
        assert (rendered["apiVersion"], rendered["metadata"]["name"], rendered["spec"]) == (
            on_disk["apiVersion"],
            on_disk["metadata"]["name"],
            on_disk["spec"],
        )


def test_kustomize_base_is_generated_from_the_chart() -> None:
    need_helm()
    stale = [str(p) for p, text in generate.render().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `python manifests/generate.py`: {stale}"


def _kustomize(overlay: str) -> dict[tuple[str, str, str], Any]:
    if not KUBECTL.exists():
        pytest.skip("kubectl is not built (make testbin)")
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(REPO / "manifests" / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return _by_key(list(yaml.safe_load_all(out)))


def _by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], Any]:
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects if o}


def _helm_as_kustomize(*sets: str) -> dict[tuple[str, str, str], Any]:
    objects = [generate.strip_helm(o) for o in render(*sets).objects]
    objects.append(generate.namespace_object())
    objects += [yaml.safe_load(p.read_text()) for p in sorted((REPO / "manifests" / "crds").glob("*.yaml"))]
    return _by_key(objects)


@pytest.mark.parametrize(("overlay", "sets"), [("driver-managed", ()), ("host-managed", HOST_MANAGED)])
def test_kustomize_overlays_equal_the_chart(overlay: str, sets: tuple[str, ...]) -> None:
    kustomized, helm = _kustomize(overlay), _helm_as_kustomize(*sets)
    assert sorted(kustomized) == sorted(helm)
    for key, obj in helm.items():
        assert kustomized[key] == obj, key


def test_every_template_file_is_documented() -> None:
    for path in Path(CHART / "templates").glob("*.yaml"):
        assert path.read_text().lstrip().startswith(("{{- /*", "{{- if", "{{- /* ")), path.name
