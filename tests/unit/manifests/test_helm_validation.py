"""`helm template` refuses the invalid combinations of SPEC section 3 with the processes' own messages:
each case renders the chart with some values and loads the process settings from the equivalent env; the
SettingsError text must appear verbatim in helm's error."""

from __future__ import annotations

import subprocess

import pytest

from computedomain.settings import ControllerSettings, PluginSettings, SettingsError, load_settings
from tests.unit.manifests.chart import CHART, need_helm, render, template_error

GATE = "featureGates.HostManagedIMEXDaemon=true"
ISOLATION_GATE = "featureGates.IMEXChannelIsolation=true"
ISOLATED = "resources.computeDomains.imex.isolation=channel"

# (helm --set values, env of the process, settings class, the value helm must name)
CASES = [
    (["resources.computeDomains.imex.mode=bogus"], {"IMEX_MODE": "bogus"}, ControllerSettings, "imex.mode"),
    (["resources.computeDomains.imex.mode="], {"IMEX_MODE": ""}, ControllerSettings, "imex.mode"),
    (
        ["resources.computeDomains.imex.mode=hostManaged"],
        {"IMEX_MODE": "hostManaged"},
        ControllerSettings,
        "featureGates.HostManagedIMEXDaemon",
    ),
    (
        ["resources.computeDomains.imex.mode=hostManaged", "featureGates.HostManagedIMEXDaemon=false"],
        {"IMEX_MODE": "hostManaged", "FEATURE_GATES": "HostManagedIMEXDaemon=false,"},
        ControllerSettings,
        "featureGates.HostManagedIMEXDaemon",
    ),
    (
        ["resources.computeDomains.imex.isolation=channel"],
        {"IMEX_ISOLATION": "channel"},
        ControllerSettings,
        "imex.isolation",
    ),
    (
        ["resources.computeDomains.imex.mode=hostManaged", GATE, "resources.computeDomains.imex.isolation=channel"],
        {"IMEX_MODE": "hostManaged", "FEATURE_GATES": "HostManagedIMEXDaemon=true,", "IMEX_ISOLATION": "channel"},
        ControllerSettings,
        "imex.isolation",
    ),
    (["resources.computeDomains.imex.isolation=node"], {"IMEX_ISOLATION": "node"}, ControllerSettings, "isolation"),
    (
        ["resources.computeDomains.imex.isolation=node", ISOLATION_GATE],
        {"IMEX_ISOLATION": "node", "FEATURE_GATES": "IMEXChannelIsolation=true,"},
        ControllerSettings,
        "isolation",
    ),
    (
        ["resources.computeDomains.imex.isolation=channel", ISOLATION_GATE],
        {"IMEX_ISOLATION": "channel", "FEATURE_GATES": "IMEXChannelIsolation=true,"},
        ControllerSettings,
        "imex.isolation",
    ),
    (
        ["resources.computeDomains.imex.channelIdleRelease=5 q"],
        {"IMEX_CHANNEL_IDLE_RELEASE": "5 q"},
        ControllerSettings,
        "imex.channelIdleRelease",
    ),
    (
        ["resources.computeDomains.imex.channelCount=1"],
        {"IMEX_CHANNEL_COUNT": "1"},
        ControllerSettings,
        "imex.channelCount",
    ),
    (
        ["resources.computeDomains.imex.channelClaimsPerNode=200"],
        {"IMEX_CHANNEL_CLAIMS_PER_NODE": "200"},
        PluginSettings,
        "imex.channelClaimsPerNode",
    ),
    (
        ["featureGates.IMEXDaemonsWithDNSNames=false"],
        {"FEATURE_GATES": "IMEXDaemonsWithDNSNames=false,"},
        ControllerSettings,
        "featureGates",
    ),
    (
        ["resources.computeDomains.imex.hostSocketPath=etc/imex.sock"],
        {"IMEX_HOST_SOCKET_PATH": "etc/imex.sock"},
        PluginSettings,
        "hostSocketPath",
    ),
    (
        ["resources.computeDomains.imex.hostSocketPath=/etc/../imex.sock"],
        {"IMEX_HOST_SOCKET_PATH": "/etc/../imex.sock"},
        PluginSettings,
        "hostSocketPath",
    ),
    (
        ["resources.computeDomains.imex.hostSocketPath=/etc//imex.sock"],
        {"IMEX_HOST_SOCKET_PATH": "/etc//imex.sock"},
        PluginSettings,
        "hostSocketPath",
    ),
    (
        ["resources.computeDomains.imex.hostSocketPath=/etc/imex/"],
        {"IMEX_HOST_SOCKET_PATH": "/etc/imex/"},
        PluginSettings,
        "hostSocketPath",
    ),
    (
        ["resources.computeDomains.imex.hostSocketPath=//etc/imex.sock"],
        {"IMEX_HOST_SOCKET_PATH": "//etc/imex.sock"},
        PluginSettings,
        "hostSocketPath",
    ),
    (["featureGates.NoSuchGate=true"], {"FEATURE_GATES": "NoSuchGate=true,"}, ControllerSettings, "featureGates"),
    (
        ["featureGates.ComputeDomainCliques=maybe"],
        {"FEATURE_GATES": "ComputeDomainCliques=maybe,"},
        ControllerSettings,
        "featureGates.ComputeDomainCliques",
    ),
    (["logLevel=chatty"], {"LOG_LEVEL": "chatty"}, ControllerSettings, "logLevel"),
    (["logFormat=xml"], {"LOG_FORMAT": "xml"}, ControllerSettings, "logFormat"),
    (["maxNodesPerIMEXDomain=0"], {"MAX_NODES_PER_IMEX_DOMAIN": "0"}, ControllerSettings, "maxNodesPerIMEXDomain"),
    (
        ["maxNodesPerIMEXDomain=10001"],
        {"MAX_NODES_PER_IMEX_DOMAIN": "10001"},
        ControllerSettings,
        "maxNodesPerIMEXDomain",
    ),
    (
        ["controller.leaderElection.renewDeadline=20"],
        {"LEADER_ELECTION_ENABLED": "true", "POD_NAME": "p", "LEADER_ELECTION_RENEW_DEADLINE": "20s"},
        ControllerSettings,
        "controller.leaderElection",
    ),
    (["kubeletPlugin.cdiRoot=var/run/cdi"], {"CDI_ROOT": "var/run/cdi"}, PluginSettings, "kubeletPlugin.cdiRoot"),
    (["nvidiaDriverRoot=run/nvidia"], {"NVIDIA_DRIVER_ROOT": "run/nvidia"}, PluginSettings, "nvidiaDriverRoot"),
    (
        ["kubeletPlugin.nvidiaDriverRoot=run/nvidia"],
        {"NVIDIA_DRIVER_ROOT": "run/nvidia"},
        PluginSettings,
        "kubeletPlugin.nvidiaDriverRoot",
    ),
]


def _settings_message(env: dict[str, str], cls: type) -> str:
    base = {"NODE_NAME": "n1"} if cls is PluginSettings else {}
    with pytest.raises(SettingsError) as err:
        load_settings(cls, environ={**base, **env})
    return str(err.value)


@pytest.mark.parametrize(("sets", "env", "cls", "value"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_helm_template_fails_with_the_process_message(
    sets: list[str], env: dict[str, str], cls: type, value: str
) -> None:
    expected = _settings_message(env, cls)
    stderr = template_error(*sets)
    assert expected in stderr, f"helm said:\n{stderr}\nprocess says:\n{expected}"
    assert "(values: " in stderr and value in stderr.split("(values: ")[-1]
    (line,) = [ln for ln in stderr.splitlines() if expected in ln]  # one line, as the processes print it
    assert line.startswith("Error: execution error at (compute-domain/templates/validate.yaml")


def test_set_string_false_is_false() -> None:
    """Upstream treats --set-string Gate=false as enabled in Helm and disabled in the binaries; not here."""
    assert "HostManagedIMEXDaemon" in template_error(
        "resources.computeDomains.imex.mode=hostManaged", "featureGates.HostManagedIMEXDaemon=False"
    )


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["resources.computeDomains.imex.mode=hostManaged", GATE],
        # In hostManaged mode the DNS-name and clique gates are forced off, so their dependency does not apply.
        ["resources.computeDomains.imex.mode=hostManaged", GATE, "featureGates.IMEXDaemonsWithDNSNames=false"],
        ["featureGates.IMEXDaemonsWithDNSNames=false", "featureGates.ComputeDomainCliques=false"],
        ["featureGates.MPSSupport=true", "logLevel=DEBUG"],
        ["resources.computeDomains.imex.hostSocketPath=/run/imex/ctl.sock"],
        ["resources.computeDomains.imex.mode=hostManaged", GATE, ISOLATION_GATE, ISOLATED],
        ["resources.computeDomains.imex.mode=hostManaged", GATE, ISOLATION_GATE],  # the gate alone changes nothing
    ],
)
def test_valid_combinations_render(sets: list[str]) -> None:
    assert render(*sets).all("Deployment")


def test_channel_isolation_renders_its_class_env_rbac_and_policy() -> None:
    isolated = render("resources.computeDomains.imex.mode=hostManaged", GATE, ISOLATION_GATE, ISOLATED,
                      "resources.computeDomains.imex.channelCount=64")  # fmt: skip
    plain = render("resources.computeDomains.imex.mode=hostManaged", GATE)
    cls = "compute-domain-channel.nvidia.com"
    assert cls in isolated.names("DeviceClass") and cls not in plain.names("DeviceClass")
    assert any("channel-records" in n for n in isolated.names("ValidatingAdmissionPolicy"))
    assert not any("channel-records" in n for n in plain.names("ValidatingAdmissionPolicy"))
    controller = isolated.one("Deployment", component="controller")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in controller["env"]}
    assert (env["IMEX_ISOLATION"], env["IMEX_CHANNEL_COUNT"]) == ("channel", "64")
    roles = {r["metadata"]["name"]: r for r in isolated.all("Role")}
    locks = next(r for n, r in roles.items() if n.endswith("controller-channel-locks"))
    assert locks["rules"][0]["resources"] == ["leases"] and "create" in locks["rules"][0]["verbs"]
    agent = next(r for n, r in roles.items() if n.endswith("kubelet-plugin"))
    assert agent["rules"][0]["verbs"] == ["get", "list", "watch", "create", "patch"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["nvidiaDriverRoot=/run/nvidia/driver", "kubeletPlugin.nvidiaDriverRoot=/opt/driver"],
            "nvidiaDriverRoot '/run/nvidia/driver' and kubeletPlugin.nvidiaDriverRoot '/opt/driver' (its older name) "
            "differ: set only nvidiaDriverRoot (values: nvidiaDriverRoot)",
        ),
        (
            ["controller.containers.computeDomain.env[0].name=A", "controller.containers.computeDomain.env[1].name=A"],
            "controller.containers.computeDomain.env[1]: A is listed twice; keep one entry",
        ),
        (
            ["kubeletPlugin.containers.computeDomains.env[0].name=NVIDIA_DRIVER_ROOT"],
            "kubeletPlugin.containers.computeDomains.env[0]: NVIDIA_DRIVER_ROOT follows the driver root the chart "
            "mounts; set nvidiaDriverRoot instead",
        ),
    ],
)
def test_driver_root_and_env_values_are_checked(sets: list[str], message: str) -> None:
    stderr = template_error(*sets)
    (line,) = [ln for ln in stderr.splitlines() if message in ln]
    assert line.startswith("Error: execution error at (compute-domain/templates/validate.yaml")


def test_disabled_renders_nothing_and_skips_validation() -> None:
    assert render("resources.computeDomains.enabled=false", "resources.computeDomains.imex.mode=bogus").objects == []


def test_helm_refuses_a_cluster_older_than_1_34() -> None:
    """Chart.yaml's kubeVersion: `helm install` on an older apiserver fails at once, naming both versions."""
    helm = need_helm()

    def template(version: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [helm, "template", "t", str(CHART), "-n", "cd-system", "--kube-version", version],
            capture_output=True,
            text=True,
        )

    old = template("1.33.4")
    assert old.returncode != 0
    assert "requires kubeVersion: >=1.34.0-0 which is incompatible with Kubernetes v1.33.4" in old.stderr
    assert template("1.34.0").returncode == 0
    assert template("1.35.0-eks-1b0b7f6").returncode == 0


def test_channel_isolation_grants_and_confines_the_node_agent_in_the_overridden_namespace() -> None:
    """With namespaceOverride, every object of channel isolation (the Roles, their bindings, the records
    policy's node agent) is in the namespace the ServiceAccounts are in, not the release's: the node agent
    then gets its grants and the policy applies to it (before, neither did)."""
    isolated = render("resources.computeDomains.imex.mode=hostManaged", GATE, ISOLATION_GATE, ISOLATED,
                      "namespaceOverride=objs", namespace="rel")  # fmt: skip
    assert {o["metadata"]["namespace"] for o in isolated.objects if "namespace" in o["metadata"]} == {"objs"}
    subjects = [s for b in isolated.all("RoleBinding") for s in b.get("subjects", [])]
    assert subjects and {s["namespace"] for s in subjects} == {"objs"}
    (policy,) = [p for p in isolated.all("ValidatingAdmissionPolicy") if "channel-records" in p["metadata"]["name"]]
    assert "system:serviceaccount:objs:" in str(policy["spec"]) and "system:serviceaccount:rel:" not in str(policy)
