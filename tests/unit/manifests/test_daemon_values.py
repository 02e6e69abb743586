"""The chart's keys for the IMEX daemons: `resources.computeDomains.imex.config` (the reference's overrides),
`controller.priorityClassName` (the daemons' too, as in the reference) and `controller.daemonResources`. What
they render, and `helm template` refusing what the processes refuse, with the processes' own line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from computedomain.settings import ControllerSettings, SettingsError, load_settings
from imex.daemon.settings import DaemonSettings
from tests.unit.manifests.chart import container, env_of, render, template_error

CONFIG = "resources.computeDomains.imex.config"


def _controller_env(*sets: str, values: tuple[Path, ...] = ()) -> dict[str, str]:
    r = render(*sets, values=values)
    return env_of(container(r.one("Deployment", component="controller"), "compute-domain"), {})


def _controller(*sets: str) -> ControllerSettings:
    env = {k: v for k, v in _controller_env(*sets).items() if v != "<downward>"}
    return load_settings(ControllerSettings, environ={**env, "POD_NAME": "p"})


def test_defaults_give_the_daemons_system_node_critical_and_no_overrides() -> None:
    env = _controller_env()
    assert env["CD_DAEMON_PRIORITY_CLASS_NAME"] == "system-node-critical"
    assert "IMEX_CONFIG_OVERRIDES" not in env and "CD_DAEMON_RESOURCES" not in env
    pod = render().one("Deployment", component="controller")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"


def test_the_keys_reach_the_controller_and_through_it_the_daemons() -> None:
    settings = _controller(
        f"{CONFIG}.IMEX_NODE_DISCONNECTED_GRACE_TIME=60",
        f"{CONFIG}.IMEX_WAIT_FOR_QUORUM=NONE",
        "controller.priorityClassName=cd-daemons",
        "controller.daemonResources.cpu=250m",
        "controller.daemonResources.memory=256Mi",
    )
    assert settings.imex_config_overrides == {"IMEX_NODE_DISCONNECTED_GRACE_TIME": "60", "IMEX_WAIT_FOR_QUORUM": "NONE"}
    assert settings.daemon_priority_class == "cd-daemons"
    assert settings.daemon_resources == {"cpu": "250m", "memory": "256Mi"}
    # The daemon reads the same variable the controller hands it.
    daemon = load_settings(DaemonSettings, environ={"IMEX_CONFIG_OVERRIDES": _controller_env(
        f"{CONFIG}.IMEX_NODE_DISCONNECTED_GRACE_TIME=60")["IMEX_CONFIG_OVERRIDES"]})  # fmt: skip
    assert daemon.imex_config_overrides == {"IMEX_NODE_DISCONNECTED_GRACE_TIME": "60"}


def test_an_empty_priority_class_gives_none() -> None:
    assert _controller("controller.priorityClassName=").daemon_priority_class == ""


# (helm --set, the controller's env, the value helm must name)
CASES = [
    (
        [f"{CONFIG}.IMEX_NODE_CONFIG_FILE=/tmp/evil.cfg"],
        "IMEX_NODE_CONFIG_FILE=/tmp/evil.cfg,",
        "IMEX_NODE_CONFIG_FILE",
    ),
    ([f"{CONFIG}.IMEX_CMD_BIND_INTERFACE_IP=10.0.0.1"], "IMEX_CMD_BIND_INTERFACE_IP=10.0.0.1,", "BIND_INTERFACE_IP"),
    ([f"{CONFIG}.SERVER_PORT=50001"], "SERVER_PORT=50001,", "imex.config.SERVER_PORT"),
    ([f"{CONFIG}.log_level=2"], "log_level=2,", "imex.config"),
    ([f"{CONFIG}.LOG_LEVEL=\x07"], "LOG_LEVEL=\x07,", "imex.config.LOG_LEVEL"),
]


@pytest.mark.parametrize(("sets", "overrides", "value"), CASES, ids=[c[2] for c in CASES])
def test_helm_refuses_bad_overrides_with_the_process_message(sets: list[str], overrides: str, value: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(ControllerSettings, environ={"IMEX_CONFIG_OVERRIDES": overrides})
    _refused(template_error(*sets), str(err.value), value)


RESOURCE_CASES = [
    (["controller.priorityClassName=Not_A_Name"], {"CD_DAEMON_PRIORITY_CLASS_NAME": "Not_A_Name"}, "priorityClassName"),
    (["controller.daemonResources.cpu=250m"], {"CD_DAEMON_RESOURCES": "cpu=250m,"}, "daemonResources"),
    (
        ["controller.daemonResources.cpu=1", "controller.daemonResources.memory=lots"],
        {"CD_DAEMON_RESOURCES": "cpu=1,memory=lots,"},
        "daemonResources.memory",
    ),
    (["controller.daemonResources.gpu=1"], {"CD_DAEMON_RESOURCES": "gpu=1,"}, "daemonResources"),
]


@pytest.mark.parametrize(("sets", "env", "value"), RESOURCE_CASES, ids=[c[2] for c in RESOURCE_CASES])
def test_helm_refuses_bad_daemon_pod_values_with_the_process_message(
    sets: list[str], env: dict[str, str], value: str
) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(ControllerSettings, environ=env)
    _refused(template_error(*sets), str(err.value), value)


@pytest.mark.parametrize(
    ("config", "overrides"),
    [({"LOG\nLEVEL": "2"}, "LOG\nLEVEL=2,"), ({"LOG_LEVEL": "2\nIMEX_NODE_CONFIG_FILE=/tmp/evil.cfg"}, None)],
    ids=["newline in a key", "newline in a value"],
)
def test_a_newline_is_refused_naming_the_key(tmp_path: Path, config: dict[str, str], overrides: str | None) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"resources": {"computeDomains": {"imex": {"config": config}}}}))
    ((key, value),) = config.items()
    with pytest.raises(SettingsError) as err:
        load_settings(ControllerSettings, environ={"IMEX_CONFIG_OVERRIDES": overrides or f"{key}={value},"})
    _refused(template_error(values=(values,)), str(err.value), "imex.config")


def test_a_comma_in_a_value_is_refused() -> None:
    stderr = template_error(f"{CONFIG}.LOG_LEVEL=2\\,IMEX_NODE_CONFIG_FILE=/x")
    assert "IMEX_CONFIG_OVERRIDES: the value of 'LOG_LEVEL' contains ','" in stderr


def _refused(stderr: str, expected: str, value: str) -> None:
    assert expected in stderr, f"helm said:\n{stderr}\nprocess says:\n{expected}"
    (line,) = [ln for ln in stderr.splitlines() if expected in ln]  # one line, as the processes print it
    assert line.startswith("Error: execution error at (compute-domain/templates/validate.yaml")
    assert value in line.split("(values: ")[-1]
