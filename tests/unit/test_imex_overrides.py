"""The reference's IMEX config overrides (``resources.computeDomains.imex.config`` as IMEX_CONFIG_OVERRIDES) and
the IMEX daemon pods' priority class and Guaranteed resources: parsed and refused at start with one line naming
the key, handed by the controller to the daemon pods, written by the daemon into its imexd.cfg."""

from __future__ import annotations

import pytest

from computedomain.controller.daemonset import daemonset
from computedomain.settings import (
    DRIVER_OWNED_IMEX_KEYS,
    ControllerSettings,
    SettingsError,
    load_settings,
    parse_daemon_resources,
    parse_imex_config_overrides,
    render_imex_config_overrides,
)
from imex.config import parse_cfg, render_imexd_cfg
from imex.daemon.settings import DaemonSettings
from tests.unit.controller.helpers import compute_domain, host_settings, settings


def test_overrides_parse_the_reference_form() -> None:
    text = " IMEX_NODE_DISCONNECTED_GRACE_TIME = 60 ,LOG_LEVEL=2,,"
    assert parse_imex_config_overrides(text) == {"IMEX_NODE_DISCONNECTED_GRACE_TIME": "60", "LOG_LEVEL": "2"}
    assert parse_imex_config_overrides("") == {}
    assert parse_imex_config_overrides("IMEX_WAIT_FOR_QUORUM=") == {"IMEX_WAIT_FOR_QUORUM": ""}
    overrides = {"B_KEY": "2", "A_KEY": "x y"}
    assert parse_imex_config_overrides(render_imex_config_overrides(overrides)) == overrides


@pytest.mark.parametrize("key", sorted(DRIVER_OWNED_IMEX_KEYS))
def test_a_key_the_service_owns_is_refused_naming_it(key: str) -> None:
    with pytest.raises(SettingsError) as err:
        parse_imex_config_overrides(f"LOG_LEVEL=2,{key}=10.0.0.1")
    message = str(err.value)
    assert "\n" not in message and f"IMEX_CONFIG_OVERRIDES: {key} is set by the service" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("LOG_LEVEL=2\nIMEX_NODE_CONFIG_FILE=/x", "the value of 'LOG_LEVEL' contains a newline"),
        ("LOG_LEVEL=2\rX=1", "the value of 'LOG_LEVEL' contains a newline"),
        ("LOG\nLEVEL=2", "key 'LOG\\nLEVEL' contains a newline"),
        ("LOG_LEVEL", "item 'LOG_LEVEL' must look like KEY=VALUE"),
        ("=2", "item '=2' must look like KEY=VALUE"),
        ("log_level=2", "item 'log_level=2' must look like KEY=VALUE"),
        ("LOG_LEVEL=\x07", "the value of LOG_LEVEL must be printable"),
        ("LOG_LEVEL=" + "9" * 1025, "the value of LOG_LEVEL must be printable and at most 1024"),
        (",".join(f"K{i}=1" for i in range(65)), "65 settings, at most 64"),
    ],
)
def test_malformed_overrides_are_refused_in_one_line(text: str, expected: str) -> None:
    with pytest.raises(SettingsError) as err:
        parse_imex_config_overrides(text)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_the_controller_and_the_daemon_refuse_them_at_start() -> None:
    with pytest.raises(SettingsError, match="IMEX_NODE_CONFIG_FILE is set by the service"):
        settings(IMEX_CONFIG_OVERRIDES="IMEX_NODE_CONFIG_FILE=/tmp/evil.cfg")
    with pytest.raises(SettingsError, match="IMEX_CMD_BIND_INTERFACE_IP is set by the service"):
        load_settings(DaemonSettings, ["--imex-config-overrides", "IMEX_CMD_BIND_INTERFACE_IP=1.2.3.4"], environ={})


def test_the_daemon_writes_the_overrides_into_imexd_cfg() -> None:
    daemon = load_settings(
        DaemonSettings, [], environ={"IMEX_CONFIG_OVERRIDES": "IMEX_NODE_DISCONNECTED_GRACE_TIME=60,IMEX_NEW_KEY=a b,"}
    )
    values = parse_cfg(render_imexd_cfg(cmd_bind_ip="10.1.2.3", overrides=daemon.imex_config_overrides))
    assert values["IMEX_NODE_DISCONNECTED_GRACE_TIME"] == "60"  # replaced, once (parse_cfg refuses duplicates)
    assert values["IMEX_NEW_KEY"] == "a b"  # added
    assert values["IMEX_CMD_BIND_INTERFACE_IP"] == "10.1.2.3"
    default = parse_cfg(render_imexd_cfg(cmd_bind_ip="10.1.2.3"))
    assert default["IMEX_NODE_DISCONNECTED_GRACE_TIME"] == "-1" and "IMEX_NEW_KEY" not in default


def _pod(cfg: ControllerSettings) -> dict[str, object]:
    spec: dict[str, object] = daemonset(compute_domain(), cfg)["spec"]["template"]["spec"]
    return spec


def _env(cfg: ControllerSettings) -> dict[str, str]:
    container = _pod(cfg)["containers"][0]  # type: ignore[index]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_the_controller_hands_the_overrides_to_the_daemon_pods_in_driver_managed_mode_only() -> None:
    text = "LOG_LEVEL=2,IMEX_NODE_DISCONNECTED_GRACE_TIME=60,"
    env = _env(settings(IMEX_CONFIG_OVERRIDES=text))
    assert parse_imex_config_overrides(env["IMEX_CONFIG_OVERRIDES"]) == parse_imex_config_overrides(text)
    assert "IMEX_CONFIG_OVERRIDES" not in _env(settings())
    # hostManaged: checked all the same, but the host owns its IMEX config.
    assert host_settings(IMEX_CONFIG_OVERRIDES=text).imex_config_overrides == {}
    with pytest.raises(SettingsError):
        host_settings(IMEX_CONFIG_OVERRIDES="DAEMONIZE=1")


def test_daemon_pods_get_the_priority_class_and_guaranteed_resources() -> None:
    plain = _pod(settings())
    assert "priorityClassName" not in plain
    assert plain["containers"][0]["resources"] == {"claims": [{"name": "compute-domain-daemon"}]}  # type: ignore[index]
    pod = _pod(
        settings(CD_DAEMON_PRIORITY_CLASS_NAME="system-node-critical", CD_DAEMON_RESOURCES="cpu=250m,memory=256Mi,")
    )
    assert pod["priorityClassName"] == "system-node-critical"
    resources = pod["containers"][0]["resources"]  # type: ignore[index]
    assert resources["requests"] == resources["limits"] == {"cpu": "250m", "memory": "256Mi"}
    assert resources["claims"] == [{"name": "compute-domain-daemon"}]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"CD_DAEMON_PRIORITY_CLASS_NAME": "System Critical"},
            "CD_DAEMON_PRIORITY_CLASS_NAME 'System Critical' is not",
        ),
        ({"CD_DAEMON_RESOURCES": "cpu=250m"}, "set both cpu and memory"),
        ({"CD_DAEMON_RESOURCES": "cpu=250m,memory=lots"}, "memory 'lots' is not a positive quantity"),
        ({"CD_DAEMON_RESOURCES": "cpu=0,memory=1Gi"}, "cpu '0' is not a positive quantity"),
        ({"CD_DAEMON_RESOURCES": "gpu=1,cpu=1,memory=1Gi"}, "item 'gpu=1' must be cpu=QUANTITY or memory=QUANTITY"),
    ],
)
def test_bad_priority_class_or_resources_are_refused_at_start(env: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError) as err:
        settings(**env)
    assert expected in str(err.value)


def test_resources_parse() -> None:
    assert parse_daemon_resources("memory=1Gi, cpu=1.5 ,") == {"memory": "1Gi", "cpu": "1.5"}
    assert parse_daemon_resources("") == {}
