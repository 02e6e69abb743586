"""imexd.cfg and nodes.cfg rendering, the per-CD hostname prefix, and the cfg parser."""

from __future__ import annotations

import uuid

import pytest

from imex.config import (
    MAX_NODES_PER_IMEX_DOMAIN,
    ImexConfig,
    ImexConfigError,
    hostname_prefix,
    parse_cfg,
    parse_nodes_cfg,
    render_imexd_cfg,
    render_nodes_cfg_dns,
    render_nodes_cfg_ips,
    slot_hostname,
)

CD_UID = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"


def test_imexd_cfg_keys() -> None:
    values = parse_cfg(render_imexd_cfg(cmd_bind_ip="10.1.2.3"))
    assert values["IMEX_CMD_BIND_INTERFACE_IP"] == "10.1.2.3"
    assert values["IMEX_CMD_PORT"] == "50005"
    assert values["SERVER_PORT"] == "50000"
    assert values["IMEX_NODE_CONFIG_FILE"] == "/imexd/nodes.cfg"
    assert values["IMEX_CMD_ENABLED"] == "1"
    assert values["DAEMONIZE"] == "0"
    assert values["LOG_FILE_NAME"] == ""
    assert values["BIND_INTERFACE_IP"] == ""
    assert values["IMEX_WAIT_FOR_QUORUM"] == "RECOVERY"
    assert values["IMEX_ENABLE_AUTH_ENCRYPTION"] == "0"
    assert values["IMEX_NODE_DISCONNECTED_GRACE_TIME"] == "-1"
    assert values["IMEX_CMD_UNIX_DOMAIN_PATH"] == ""


def test_typed_view_round_trips() -> None:
    cfg = ImexConfig.parse(
        render_imexd_cfg(
            cmd_bind_ip="127.5.0.1",
            nodes_config_file="/x/nodes.cfg",
            server_port=51000,
            cmd_unix_domain_path="/run/s.sock",
        )
    )
    assert cfg == ImexConfig(
        node_config_file="/x/nodes.cfg",
        server_port=51000,
        cmd_enabled=True,
        cmd_bind_ip="127.5.0.1",
        cmd_port=50005,
        cmd_unix_domain_path="/run/s.sock",
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cmd_bind_ip": "pod-ip"}, "IMEX_CMD_BIND_INTERFACE_IP 'pod-ip' is not an IP"),
        ({"cmd_bind_ip": "10.0.0.1", "server_port": 0}, "SERVER_PORT 0 is not a TCP port"),
        ({"cmd_bind_ip": "10.0.0.1", "cmd_port": 70000}, "IMEX_CMD_PORT 70000"),
    ],
)
def test_imexd_cfg_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ImexConfigError, match=match):
        render_imexd_cfg(**kwargs)  # type: ignore[arg-type]


def test_ipv6_pod_ip_is_accepted() -> None:
    assert parse_cfg(render_imexd_cfg(cmd_bind_ip="fd00::5"))["IMEX_CMD_BIND_INTERFACE_IP"] == "fd00::5"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("SERVER_PORT 50000\n", r"^f:1: malformed line"),
        ("# c\nlower=1\n", r"^f:2: malformed line"),
        ("A=1\nA=2\n", r"^f:2: A set twice"),
    ],
)
def test_cfg_parser_is_strict(text: str, match: str) -> None:
    with pytest.raises(ImexConfigError, match=match):
        parse_cfg(text, source="f")


def test_cfg_parser_keeps_values_with_equals_and_empty() -> None:
    assert parse_cfg("A=x=y\nB=\n\n# comment\n") == {"A": "x=y", "B": ""}


def test_typed_view_rejects_non_integer_port() -> None:
    with pytest.raises(ImexConfigError, match="SERVER_PORT='fifty' is not an integer"):
        ImexConfig.parse("SERVER_PORT=fifty\n")


def test_hostname_prefix_is_per_cd_and_a_valid_dns_label() -> None:
    prefix = hostname_prefix(CD_UID)
    assert prefix == "compute-domain-daemon-1b4e28ba2fa1411d8a1f6ec5c1f3a8e2"
    other = hostname_prefix(str(uuid.uuid4()))
    assert other != prefix
    longest = slot_hostname(prefix, MAX_NODES_PER_IMEX_DOMAIN - 1)
    assert len(longest) <= 63
    assert longest.replace("-", "").isalnum() and longest == longest.lower()


def test_hostname_prefix_rejects_non_uuid() -> None:
    with pytest.raises(ImexConfigError, match="is not a UUID"):
        hostname_prefix("../../etc")


def test_dns_nodes_cfg_has_one_name_per_slot() -> None:
    prefix = hostname_prefix(CD_UID)
    names = parse_nodes_cfg(render_nodes_cfg_dns(prefix))
    assert len(names) == 18
    assert names[0] == f"{prefix}-0000" and names[17] == f"{prefix}-0017"
    assert len(set(names)) == 18


def test_two_domains_never_share_names() -> None:
    a = set(parse_nodes_cfg(render_nodes_cfg_dns(hostname_prefix(str(uuid.uuid4())))))
    b = set(parse_nodes_cfg(render_nodes_cfg_dns(hostname_prefix(str(uuid.uuid4())))))
    assert not a & b


def test_legacy_ip_nodes_cfg() -> None:
    assert render_nodes_cfg_ips(["10.0.0.2", "10.0.0.1"]) == "10.0.0.2\n10.0.0.1\n"
    with pytest.raises(ImexConfigError, match="peer IP 'node-a'"):
        render_nodes_cfg_ips(["node-a"])


def test_slot_index_must_be_non_negative() -> None:
    with pytest.raises(ImexConfigError):
        slot_hostname("p", -1)
