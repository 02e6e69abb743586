"""The reference driver's environment, as its operators set it through the chart's `env` lists: Go durations,
Go booleans in FEATURE_GATES, klog verbosities, and the other variables the reference's users set; each read
by our processes' own settings loaders."""

from __future__ import annotations

import pytest

from computedomain.goformats import klog_level, parse_bool, parse_duration
from computedomain.settings import (
    ControllerSettings,
    FeatureGate,
    PluginSettings,
    SettingsError,
    load_settings,
)

PLUGIN = {"NODE_NAME": "n1"}
CONTROLLER = {"POD_NAME": "p"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("15s", 15.0),
        ("15", 15.0),
        ("2.5", 2.5),
        ("1m30s", 90.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("250us", 0.00025),
        ("250µs", 0.00025),
        ("1h2m3s4ms", 3723.004),
        (".5s", 0.5),
        ("0", 0.0),
        (" 10s ", 10.0),
    ],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration("X", text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "15x", "-2s", "1m 30s", "15ss", "1e3s", ".s", "ten", "1" * 70 + "s"])
def test_bad_durations_name_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match=r"^X '.*' is not a duration; use seconds \(15\) or a Go duration \(15s\)$"):
        parse_duration("X", text)


@pytest.mark.parametrize(
    ("text", "value"),
    [(t, True) for t in ("1", "t", "T", "TRUE", "true", "True")]
    + [(f, False) for f in ("0", "f", "F", "FALSE", "false", "False")],
)
def test_go_booleans(text: str, value: bool) -> None:
    assert parse_bool("X", text) is value
    # The same forms in FEATURE_GATES, as the reference's chart renders the featureGates map.
    gates = load_settings(PluginSettings, environ={**PLUGIN, "FEATURE_GATES": f"CrashOnNVLinkFabricErrors={text},"})
    assert gates.gate(FeatureGate.CRASH_ON_NVLINK_FABRIC_ERRORS) is value


@pytest.mark.parametrize("text", ["yes", "on", "2", "tru", ""])
def test_not_go_booleans(text: str) -> None:
    with pytest.raises(ValueError, match="must be true or false"):
        parse_bool("X", text)
    if text:
        with pytest.raises(SettingsError, match="must look like Name=true or Name=false"):
            load_settings(PluginSettings, environ={**PLUGIN, "FEATURE_GATES": f"CrashOnNVLinkFabricErrors={text}"})


@pytest.mark.parametrize(("verbosity", "level"), [("0", "info"), ("4", "info"), ("5", "info"), ("6", "debug")])
def test_klog_verbosity_maps_to_our_levels(verbosity: str, level: str) -> None:
    assert klog_level("X", verbosity) == level
    settings = load_settings(PluginSettings, environ={**PLUGIN, "LOG_LEVEL": "warning", "LOG_VERBOSITY": verbosity})
    assert settings.log_level == level, "LOG_VERBOSITY, when set, decides"


@pytest.mark.parametrize("text", ["-1", "high", "4.5", "\u0661"])
def test_bad_verbosity(text: str) -> None:
    with pytest.raises(SettingsError, match=r"^LOG_VERBOSITY .* must be a klog verbosity, 0 to 7"):
        load_settings(PluginSettings, environ={**PLUGIN, "LOG_VERBOSITY": text})


def test_reference_controller_env() -> None:
    """The variables the reference's chart renders and its users add, read by our controller."""
    env = {
        **CONTROLLER,
        "LOG_VERBOSITY": "4",
        "LOG_VERBOSITY_CD_DAEMON": "7",
        "ADDITIONAL_NAMESPACES": " old-ns, other ,,",
        "KUBE_API_QPS": "5",
        "KUBE_API_BURST": "10",
        "FEATURE_GATES": "IMEXDaemonsWithDNSNames=True,ComputeDomainCliques=1,ContextualLogging=t,",
        "LEADER_ELECTION_ENABLED": "true",
        "LEADER_ELECTION_LEASE_DURATION": "1m",
        "LEADER_ELECTION_RENEW_DEADLINE": "30s",
        "LEADER_ELECTION_RETRY_PERIOD": "2500ms",
        "PPROF_PATH": "",
        "NAMESPACE": "dra-driver-nvidia-gpu",
    }
    s = load_settings(ControllerSettings, environ=env)
    assert (s.log_level, s.daemon_log_level) == ("info", "debug")
    assert s.managed_namespaces == ("dra-driver-nvidia-gpu", "old-ns", "other")
    assert (s.kube_api_qps, s.kube_api_burst) == (5.0, 10)
    assert s.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES) and s.gate(FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES)
    durations = (s.leader_election_lease_duration, s.leader_election_renew_deadline)
    assert (*durations, s.leader_election_retry_period) == (60.0, 30.0, 2.5)
    with pytest.raises(SettingsError, match="need lease duration > renew deadline > retry period"):
        load_settings(ControllerSettings, environ={**env, "LEADER_ELECTION_RENEW_DEADLINE": "2m"})
    with pytest.raises(SettingsError, match=r"^LEADER_ELECTION_LEASE_DURATION '15 s' is not a duration"):
        load_settings(ControllerSettings, environ={**env, "LEADER_ELECTION_LEASE_DURATION": "15 s"})
    # Flags take Go durations too.
    s = load_settings(ControllerSettings, ["--leader-election-retry-period", "1s"], environ=env)
    assert s.leader_election_retry_period == 1.0


def test_reference_node_agent_env() -> None:
    s = load_settings(
        PluginSettings,
        environ={**PLUGIN, "LOG_VERBOSITY": "6", "HEALTHCHECK_PORT": "-1", "KUBE_API_QPS": "5", "KUBE_API_BURST": "10"},
    )
    assert s.log_level == "debug" and s.health_port == -1 and s.kube_api_qps == 5.0
