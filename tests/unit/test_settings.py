"""Every startup rule of SPEC section 3 and every gate dependency, table-driven, through the same entry
point the processes use (env and flags), plus the CLI's exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from computedomain.settings import (
    ControllerSettings,
    FeatureGate,
    FeatureGates,
    ImexMode,
    PluginSettings,
    SettingsError,
    load_settings,
)

OK = None
NODE = {"NODE_NAME": "gb-1"}
HOST_ISOLATED = "HostManagedIMEXDaemon=true,IMEXChannelIsolation=true"


@pytest.mark.parametrize(
    ("env", "error"),
    [
        # defaults are valid
        ({}, OK),
        # rule 1: unknown mode (the empty string too)
        ({"IMEX_MODE": "selfManaged"}, "IMEX_MODE 'selfManaged' is unknown; use driverManaged or hostManaged"),
        ({"IMEX_MODE": ""}, "IMEX_MODE '' is unknown"),
        # rule 2: hostManaged needs its gate, and the mode is checked before the isolation
        ({"IMEX_MODE": "hostManaged"}, "requires the feature gate HostManagedIMEXDaemon=true"),
        ({"IMEX_MODE": "hostManaged", "IMEX_ISOLATION": "channel"}, "HostManagedIMEXDaemon=true"),
        ({"IMEX_MODE": "hostManaged", "FEATURE_GATES": "HostManagedIMEXDaemon=true"}, OK),
        # rule 3 and 4: isolation
        ({"IMEX_ISOLATION": "channel"}, "IMEX_ISOLATION=channel is not implemented yet; use domain"),
        ({"IMEX_ISOLATION": "node"}, "IMEX_ISOLATION 'node' is unknown; use domain"),
        # channel isolation: only with its gate (the message above stays without it), only hostManaged
        ({"IMEX_ISOLATION": "channel", "FEATURE_GATES": "IMEXChannelIsolation=false"}, "not implemented yet"),
        (
            {"IMEX_ISOLATION": "channel", "FEATURE_GATES": "IMEXChannelIsolation=true"},
            "IMEX_ISOLATION=channel needs IMEX_MODE=hostManaged: in driverManaged mode every ComputeDomain runs",
        ),
        (
            {"IMEX_MODE": "hostManaged", "IMEX_ISOLATION": "channel", "FEATURE_GATES": HOST_ISOLATED},
            OK,
        ),
        ({"IMEX_ISOLATION": "node", "FEATURE_GATES": "IMEXChannelIsolation=true"}, "use domain or channel"),
        (
            {"IMEX_MODE": "hostManaged", "IMEX_ISOLATION": "channel", "FEATURE_GATES": "IMEXChannelIsolation=true"},
            "HostManagedIMEXDaemon=true",
        ),
        # rule 5: cliques require DNS names (driverManaged) ...
        (
            {"FEATURE_GATES": "IMEXDaemonsWithDNSNames=false"},
            "ComputeDomainCliques=true requires IMEXDaemonsWithDNSNames",
        ),
        ({"FEATURE_GATES": "IMEXDaemonsWithDNSNames=false,ComputeDomainCliques=false"}, OK),
        # ... and are irrelevant in hostManaged mode
        ({"IMEX_MODE": "hostManaged", "FEATURE_GATES": "HostManagedIMEXDaemon=true,IMEXDaemonsWithDNSNames=false"}, OK),
        # rule 7: the host socket path
        ({"IMEX_HOST_SOCKET_PATH": "run/imex.sock"}, "IMEX_HOST_SOCKET_PATH 'run/imex.sock' must be an absolute"),
        ({"IMEX_HOST_SOCKET_PATH": "/etc/../run/imex.sock"}, "without '..'"),
        ({"IMEX_HOST_SOCKET_PATH": "/etc//nvidia-imex/x.sock"}, "normalised"),
        ({"IMEX_HOST_SOCKET_PATH": "/etc/nvidia-imex/"}, "normalised"),
        ({"IMEX_HOST_SOCKET_PATH": "/run/imex/ctl.sock"}, OK),
        # gate syntax
        ({"FEATURE_GATES": "HostManagedIMEXDaemon=true,"}, OK),
        ({"FEATURE_GATES": "HostManagedIMEXDaemon"}, "must look like Name=true"),
        ({"FEATURE_GATES": "HostManagedIMEXDaemon=yes"}, "must look like Name=true"),
        ({"FEATURE_GATES": "ImexDaemonsWithDnsNames=true"}, "unknown gate 'ImexDaemonsWithDnsNames'"),
        ({"FEATURE_GATES": "MPSSupport=true,TimeSlicingSettings=false"}, OK),
    ],
)
@pytest.mark.parametrize("cls", [ControllerSettings, PluginSettings])
def test_startup_rules(cls: type[ControllerSettings | PluginSettings], env: dict[str, str], error: str | None) -> None:
    environ = {**NODE, **env}
    if error is None:
        load_settings(cls, environ=environ)
        return
    with pytest.raises(SettingsError) as excinfo:
        load_settings(cls, environ=environ)
    assert error in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize(
    ("text", "gate", "expected"),
    [
        ("", FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES, True),
        ("", FeatureGate.COMPUTE_DOMAIN_CLIQUES, True),
        ("", FeatureGate.CRASH_ON_NVLINK_FABRIC_ERRORS, True),
        ("", FeatureGate.HOST_MANAGED_IMEX_DAEMON, False),
        ("", FeatureGate.IMEX_CHANNEL_ISOLATION, False),
        ("CrashOnNVLinkFabricErrors=false", FeatureGate.CRASH_ON_NVLINK_FABRIC_ERRORS, False),
        (" HostManagedIMEXDaemon = TRUE ,", FeatureGate.HOST_MANAGED_IMEX_DAEMON, True),
    ],
)
def test_gate_defaults_and_parsing(text: str, gate: FeatureGate, expected: bool) -> None:
    assert FeatureGates.parse(text).enabled(gate) is expected


def test_host_managed_forces_daemon_gates_off() -> None:
    settings = load_settings(
        ControllerSettings, environ={"IMEX_MODE": "hostManaged", "FEATURE_GATES": "HostManagedIMEXDaemon=true"}
    )
    assert settings.imex_mode is ImexMode.HOST_MANAGED
    assert not settings.gate(FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES)
    assert not settings.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES)


def test_channel_isolation_settings() -> None:
    env = {"IMEX_MODE": "hostManaged", "IMEX_ISOLATION": "channel", "FEATURE_GATES": HOST_ISOLATED}
    controller = load_settings(ControllerSettings, environ=env)
    assert controller.channel_isolation and controller.imex_channel_count == 2048
    plugin = load_settings(PluginSettings, environ={**NODE, **env, "IMEX_CHANNEL_CLAIMS_PER_NODE": "4"})
    assert plugin.channel_isolation and plugin.imex_channel_claims_per_node == 4
    assert not load_settings(ControllerSettings, environ={}).channel_isolation


def test_flags_override_env() -> None:
    settings = load_settings(
        ControllerSettings,
        ["--imex-mode", "hostManaged", "--feature-gates=HostManagedIMEXDaemon=true"],
        environ={"IMEX_MODE": "driverManaged"},
    )
    assert settings.host_managed


@pytest.mark.parametrize(
    ("cls", "env", "error"),
    [
        (PluginSettings, {}, "NODE_NAME is required"),
        (PluginSettings, {**NODE, "CDI_ROOT": "cdi"}, "CDI_ROOT 'cdi' must be an absolute path"),
        (PluginSettings, {**NODE, "HEALTHCHECK_PORT": "x"}, "HEALTHCHECK_PORT 'x' must be an integer"),
        (PluginSettings, {**NODE, "GPU_CLIQUE_LABEL_ENABLED": "maybe"}, "must be true or false"),
        (PluginSettings, {**NODE, "POD_IP": "10.0.0.300"}, "POD_IP '10.0.0.300' is not an IP address"),
        (ControllerSettings, {"MAX_NODES_PER_IMEX_DOMAIN": "0"}, "MAX_NODES_PER_IMEX_DOMAIN must be at least 1"),
        (ControllerSettings, {"LEADER_ELECTION_ENABLED": "true"}, "POD_NAME is required"),
        (
            ControllerSettings,
            {"LEADER_ELECTION_ENABLED": "true", "POD_NAME": "p", "LEADER_ELECTION_RENEW_DEADLINE": "20s"},
            "lease duration > renew deadline > retry period",
        ),
        (ControllerSettings, {"LOG_LEVEL": "chatty"}, "LOG_LEVEL 'chatty'"),
        (ControllerSettings, {"HTTP_ENDPOINT": "8080"}, "HTTP_ENDPOINT '8080' must look like host:port"),
        (PluginSettings, {**NODE, "HTTP_ENDPOINT": ":http"}, "HTTP_ENDPOINT ':http' must look like host:port"),
        # tunables: today's values are the defaults, nonsense is one line naming the variable
        (ControllerSettings, {"WORKERS": "0"}, "WORKERS 0 must be at least 1"),
        (ControllerSettings, {"SWEEP_PERIOD": "-1"}, "SWEEP_PERIOD -1.0 must not be negative"),
        (ControllerSettings, {"RETRY_BACKOFF_MAX": "-5s"}, "RETRY_BACKOFF_MAX -5.0 must not be negative"),
        (ControllerSettings, {"KUBE_API_TIMEOUT": "0"}, "KUBE_API_TIMEOUT 0.0 must be positive"),
        (ControllerSettings, {"RETRY_WARN_AFTER": "0"}, "RETRY_WARN_AFTER 0 must be at least 1"),
        (PluginSettings, {**NODE, "PREPARE_BUDGET": "45"}, "PREPARE_BUDGET 45.0 must be above 0 and below 45"),
        (PluginSettings, {**NODE, "CLEANUP_INTERVAL": "-1"}, "CLEANUP_INTERVAL -1.0 must not be negative"),
        (ControllerSettings, {"IMEX_CHANNEL_COUNT": "1"}, "IMEX_CHANNEL_COUNT 1 must be between 2 and 1048576"),
        (ControllerSettings, {"IMEX_CHANNEL_COUNT": "1048577"}, "IMEX_CHANNEL_COUNT 1048577 must be between"),
        (PluginSettings, {**NODE, "IMEX_CHANNEL_CLAIMS_PER_NODE": "0"}, "IMEX_CHANNEL_CLAIMS_PER_NODE 0 must be"),
        (PluginSettings, {**NODE, "IMEX_CHANNEL_CLAIMS_PER_NODE": "129"}, "one ResourceSlice holds 128 devices"),
    ],
)
def test_process_specific_rules(
    cls: type[ControllerSettings | PluginSettings], env: dict[str, str], error: str
) -> None:
    with pytest.raises(SettingsError, match=error):
        load_settings(cls, environ=env)


def test_controller_namespaces_and_pull_secrets() -> None:
    settings = load_settings(
        ControllerSettings,
        environ={
            "NAMESPACE": "nvidia",
            "ADDITIONAL_NAMESPACES": " a, ,b,nvidia",
            "CD_DAEMON_IMAGE_PULL_SECRET_NAMES": "x, y z",
        },
    )
    assert settings.managed_namespaces == ("nvidia", "a", "b")
    assert settings.pull_secrets == ("x", "y", "z")


def test_unknown_flag_is_an_error() -> None:
    with pytest.raises(SettingsError, match="unknown flag '--imex-mod'"):
        load_settings(ControllerSettings, ["--imex-mod", "x"], environ={})


def test_cli_exits_non_zero_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "computedomain", "check-settings", "controller"],
        env={"IMEX_ISOLATION": "channel", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr == "error: IMEX_ISOLATION=channel is not implemented yet; use domain\n"


@pytest.mark.parametrize("pod_ip", ["", "10.1.2.3", "fd00::5"])
def test_plugin_pod_ip(pod_ip: str) -> None:
    assert load_settings(PluginSettings, environ={**NODE, "POD_IP": pod_ip}).pod_ip == pod_ip


def test_tunables_default_to_the_values_the_code_had() -> None:
    controller = load_settings(ControllerSettings, environ={})
    assert (controller.workers, controller.sweep_period) == (100, 600.0)
    assert (controller.retry_backoff_initial, controller.retry_backoff_max) == (0.005, 300.0)
    assert (controller.kube_api_timeout, controller.retry_warn_after, controller.stuck_recheck_period) == (10, 5, 300)
    plugin = load_settings(PluginSettings, environ=NODE)
    assert (plugin.prepare_budget, plugin.prepare_backoff_initial, plugin.prepare_backoff_max) == (40.0, 0.25, 3.0)
    assert (plugin.cleanup_interval, plugin.clique_refresh_interval) == (600.0, 600.0)
    assert load_settings(PluginSettings, environ={**NODE, "POD_NAME": "agent-x"}).pod_name == "agent-x"


def test_debug_logging_leaves_the_header_decoder_quiet() -> None:
    """At debug level the HTTP/2 header decoder logged each header a peer of the health port sent, twice:
    about 3 KiB from a peer made 5,961 lines. Its logger stays at INFO whatever the level."""
    import logging

    from computedomain.logs import configure_logging

    root = logging.getLogger()
    before = (root.level, root.handlers[:], logging.getLogger("hpack").level)
    try:
        configure_logging(load_settings(ControllerSettings, environ={"LOG_LEVEL": "debug"}))
        assert root.level == logging.DEBUG
        assert not logging.getLogger("hpack").isEnabledFor(logging.DEBUG)
    finally:
        root.setLevel(before[0])
        root.handlers[:] = before[1]
        logging.getLogger("hpack").setLevel(before[2])
