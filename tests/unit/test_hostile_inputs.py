"""Inputs from outside that used to be accepted, or to crash, and must end in a one-line error naming the
field: settings (socket path, HTTP endpoint, ports, rates), the driver's /proc files, opaque configs in
claims, the checkpoint's CDI spec paths, and the output of nvidia-imex-ctl. One test per input; each failed
before its fix."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from computedomain.api.models import OpaqueConfigError, decode_opaque_config
from computedomain.plugin.checkpoint import DeviceKind, PreparedResource, begin_prepare
from computedomain.plugin.opaque import ConfigError, resolve
from computedomain.settings import (
    ControllerSettings,
    EndpointError,
    PluginSettings,
    SettingsError,
    load_settings,
    parse_endpoint,
    validate_host_socket_path,
)
from imex import host_check
from imex.discovery import ProcFormatError
from imex.procfs import parse_capability, parse_char_devices, parse_params
from tests.unit.plugin.fakes import Bed, channel_params, claim_status

UID = "0b9c3f0e-1111-4000-8000-000000000001"
NODE_ENV = {"NODE_NAME": "gb-1"}


# --- settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["//x", "//etc/nvidia-imex/imex_ctrl.sock", "/run/imex\n.sock", "/run/\r", "/a\x00b"])
def test_socket_path_rejects_double_slash_and_control_characters(path: str) -> None:
    with pytest.raises(SettingsError, match="IMEX_HOST_SOCKET_PATH"):
        validate_host_socket_path(path)
    with pytest.raises(SettingsError, match="IMEX_HOST_SOCKET_PATH"):
        load_settings(ControllerSettings, environ={"IMEX_HOST_SOCKET_PATH": path})


@pytest.mark.parametrize(
    "endpoint", [":\u00b2", ":\u0668\u0660", ":\uff18\uff10", ":99999", ":-1", "host\n:80", "a b:80", ":" + "9" * 5000]
)
def test_http_endpoint_is_ascii_host_port_in_range(endpoint: str) -> None:
    with pytest.raises(EndpointError, match="HTTP_ENDPOINT") as raised:
        parse_endpoint(endpoint)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300
    with pytest.raises(SettingsError, match="HTTP_ENDPOINT"):
        load_settings(ControllerSettings, environ={"HTTP_ENDPOINT": endpoint})


@pytest.mark.parametrize("endpoint", [":8080", "0.0.0.0:8080", "[::1]:9", "::1:9", "localhost:0", "10.0.0.1:65535"])
def test_http_endpoint_good_forms(endpoint: str) -> None:
    parse_endpoint(endpoint)


@pytest.mark.parametrize(
    ("cls", "env", "value"),
    [
        (PluginSettings, "HEALTHCHECK_PORT", "65536"),
        (PluginSettings, "HEALTHCHECK_PORT", "\u0665\u0661\u0665\u0661\u0665"),
        (ControllerSettings, "KUBE_API_QPS", "0"),
        (ControllerSettings, "KUBE_API_QPS", "-5"),
        (ControllerSettings, "KUBE_API_QPS", "nan"),
        (ControllerSettings, "KUBE_API_QPS", "inf"),
        (ControllerSettings, "KUBE_API_QPS", "1e9"),
        (ControllerSettings, "KUBE_API_BURST", "0"),
        (ControllerSettings, "KUBE_API_BURST", "10000000"),
        (ControllerSettings, "MAX_NODES_PER_IMEX_DOMAIN", "100000"),
        (ControllerSettings, "LEADER_ELECTION_LEASE_DURATION", "nan"),
        (ControllerSettings, "KUBE_API_BURST", "1" * 5000),
    ],
)
def test_numbers_are_range_checked(cls: type[ControllerSettings], env: str, value: str) -> None:
    with pytest.raises(SettingsError, match=env) as raised:
        load_settings(cls, environ={**NODE_ENV, env: value})
    assert len(str(raised.value)) < 300, "a huge value is not echoed whole"


def test_defaults_and_a_disabled_health_port_stay_valid() -> None:
    assert load_settings(PluginSettings, environ={**NODE_ENV, "HEALTHCHECK_PORT": "-1"}).health_port == -1
    settings = load_settings(ControllerSettings, environ={"KUBE_API_QPS": "50", "KUBE_API_BURST": "100"})
    assert (settings.kube_api_qps, settings.kube_api_burst) == (50.0, 100)


@pytest.mark.parametrize("node", ["a/b", "Node-1", "gb\n1", "x" * 300, "-a"])
def test_node_name_must_be_a_node_name(node: str) -> None:
    with pytest.raises(SettingsError, match="NODE_NAME"):
        load_settings(PluginSettings, environ={"NODE_NAME": node})


def test_daemon_timings_reject_nan() -> None:
    from imex.daemon.settings import DaemonSettings

    with pytest.raises(SettingsError, match="CHECK_TIMEOUT"):
        load_settings(DaemonSettings, environ={"CHECK_TIMEOUT": "nan"})


# --- /proc ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("major", ["\u0662\u0664\u0662", "\uff12\uff14\uff12", "\u00b2"])
def test_proc_devices_majors_are_ascii_digits(major: str) -> None:
    with pytest.raises(ProcFormatError, match="proc/devices:2"):
        parse_char_devices(f"Character devices:\n{major} nvidia-caps-imex-channels\n", source="proc/devices")


def test_proc_devices_huge_major_is_a_format_error() -> None:
    with pytest.raises(ProcFormatError, match="proc/devices:2") as raised:
        parse_char_devices("Character devices:\n" + "9" * 5000 + " nvidia-caps\n", source="proc/devices")
    assert len(str(raised.value)) < 300


@pytest.mark.parametrize("value", ["\u0662\u0660\u0664\u0668", "9" * 5000, "100000000000", "1048577"])
def test_imex_channel_count_is_bounded(value: str) -> None:
    with pytest.raises(ProcFormatError, match="ImexChannelCount") as raised:
        parse_params(f"ImexChannelCount: {value}\n", source="params")
    assert len(str(raised.value)) < 300


def test_imex_channel_count_up_to_the_minor_limit() -> None:
    assert parse_params("ImexChannelCount: 1048576\n", source="params").imex_channel_count == 1 << 20


@pytest.mark.parametrize(("key", "value"), [("DeviceFileMinor", "1048576"), ("DeviceFileMode", "65536")])
def test_capability_numbers_are_bounded(key: str, value: str) -> None:
    text = {"DeviceFileMinor": "4323", "DeviceFileMode": "256", "DeviceFileModify": "1", key: value}
    body = "".join(f"{k}: {v}\n" for k, v in text.items())
    with pytest.raises(ProcFormatError, match=key):
        parse_capability(body, name="fabric-imex-mgmt", source="cap")


# --- opaque configs ------------------------------------------------------------------------------------


def test_huge_domain_id_is_not_echoed() -> None:
    params = channel_params("x" * 1_000_000)
    with pytest.raises(OpaqueConfigError, match="domainID") as raised:
        decode_opaque_config(params)
    assert len(str(raised.value)) < 400
    with pytest.raises(OpaqueConfigError, match="unknown kind") as raised:
        decode_opaque_config({**params, "kind": "K" * 1_000_000})
    assert len(str(raised.value)) < 400
    with pytest.raises(OpaqueConfigError, match="unknown field") as raised:
        decode_opaque_config({**channel_params(UID), "f" * 1_000_000: 1})
    assert len(str(raised.value)) < 400


def test_parameters_as_a_list_of_pairs_are_refused() -> None:
    pairs = [[k, v] for k, v in channel_params(UID).items()]
    status = claim_status("channel-0", {})
    status["allocation"]["devices"]["config"][0]["opaque"]["parameters"] = pairs
    with pytest.raises(ConfigError, match=r"config\[0\].*parameters must be a JSON object"):
        resolve(status["allocation"])


# --- the checkpoint's CDI spec paths ---------------------------------------------------------------------


async def test_undo_removes_only_our_spec_files_in_the_cdi_directory(tmp_path: Path) -> None:
    bed = Bed(tmp_path)
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    lookalike = tmp_path / "k8s.compute-domain.nvidia.com-claim_x.json"
    lookalike.write_text("{}")
    inside = bed.cdi.root / "not-ours.json"
    inside.parent.mkdir(parents=True, exist_ok=True)
    inside.write_text("{}")
    ours = bed.cdi.path_for(UID)
    ours.write_text("{}")
    escape = bed.cdi.root / ".." / "victim.json"
    paths = (str(victim), str(lookalike), str(inside), str(escape), "relative.json", str(ours))
    resource = PreparedResource(kind=DeviceKind.CHANNEL, domainID=UID)
    now = datetime.now(UTC)
    bed.store.update(
        lambda cp: (
            begin_prepare(
                cp, uid=UID, namespace="ns", name="c", fingerprint="f", resources=[resource],
                cdi_spec_files=paths, now=now,
            ),
            None,
        )
    )  # fmt: skip
    assert await bed.preparer.undo(UID) is not None
    assert victim.exists() and lookalike.exists() and inside.exists()
    assert not ours.exists()


# --- nvidia-imex-ctl output ------------------------------------------------------------------------------


async def test_ctl_output_is_read_with_a_bound() -> None:
    flood = "import sys\nwhile True: sys.stdout.write('x' * 65536)\n"
    result = await host_check.run_command([sys.executable, "-c", flood], timeout_s=20)
    assert len(result.output) <= host_check.MAX_CTL_OUTPUT_BYTES + 200
    assert result.exit_code != 0 and "output cut" in result.output


async def test_ctl_short_output_is_whole() -> None:
    result = await host_check.run_command([sys.executable, "-c", "print('READY')"], timeout_s=20)
    assert (result.exit_code, result.output) == (0, "READY\n")
