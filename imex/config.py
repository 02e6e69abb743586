"""The IMEX configuration files: ``imexd.cfg`` and ``nodes.cfg``, rendered and parsed.

This module owns
- rendering ``imexd.cfg`` (the ``nvidia-imex`` daemon config) for a driverManaged daemon pod: foreground,
  logs to stderr, peer port 50000, command service bound to the pod IP on port 50005 (so
  ``nvidia-imex-ctl -c`` reaches it without guessing an address family, upstream #328/#540);
- rendering ``nodes.cfg``: one DNS name per slot ``0..max_nodes-1`` with a per-ComputeDomain hostname
  prefix (DNS-names mode), or the legacy list of peer IPs;
- the per-CD prefix: ``compute-domain-daemon-<CD UID hex>``. Upstream gave every CD the same names, and
  after pod-IP reuse a daemon of one domain talked to a daemon of another (#1447); the UID makes the
  names unique by construction, and 22 + 32 + 5 characters stay within a 63-character DNS label;
- a strict parser of the ``KEY=VALUE`` format and a typed view of the keys the simulator needs, so
  ``tests.testbed.imex_simulator`` reads exactly the files we render.

Pure functions only; writing the files is the daemon's job.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from imex.discovery import HardwareError

MAX_NODES_PER_IMEX_DOMAIN = 18
IMEX_SERVER_PORT = 50000
IMEX_CMD_PORT = 50005
IMEXD_DIR = "/imexd"
IMEXD_CFG_PATH = f"{IMEXD_DIR}/imexd.cfg"
NODES_CFG_PATH = f"{IMEXD_DIR}/nodes.cfg"

HOSTNAME_PREFIX_BASE = "compute-domain-daemon"


class ImexConfigError(HardwareError):
    """An IMEX config file or value is malformed. The message names file and line."""


# --------------------------------------------------------------------------------------------------------
# imexd.cfg


def render_imexd_cfg(
    *,
    cmd_bind_ip: str,
    nodes_config_file: str = NODES_CFG_PATH,
    server_port: int = IMEX_SERVER_PORT,
    cmd_port: int = IMEX_CMD_PORT,
    cmd_unix_domain_path: str = "",
    bind_interface_ip: str = "",
    overrides: Mapping[str, str] | None = None,
) -> str:
    """``imexd.cfg`` for one daemon. ``cmd_bind_ip`` is the pod IP.

    BIND_INTERFACE_IP stays empty by default: IMEX then finds its own address by matching local
    interfaces against ``nodes.cfg``, which is how one static nodes file serves every node. Auth and GSS
    keys are left out: encryption is off, and the daemon uses its defaults for anything unset.
    ``overrides`` (the operator's IMEX_CONFIG_OVERRIDES, checked by the settings) replace the value of a key
    written here, or are added after them.
    """
    _check_ip(cmd_bind_ip, "IMEX_CMD_BIND_INTERFACE_IP")
    if bind_interface_ip:
        _check_ip(bind_interface_ip, "BIND_INTERFACE_IP")
    for name, port in (("SERVER_PORT", server_port), ("IMEX_CMD_PORT", cmd_port)):
        if not 0 < port < 65536:
            raise ImexConfigError(f"{name} {port} is not a TCP port")
    values: list[tuple[str, str, str]] = [
        ("LOG_LEVEL", "4", "INFO"),
        ("LOG_FILE_NAME", "", "empty: log to stderr, which is the pod log"),
        ("STATS_FILE_NAME", "/var/log/nvidia-imex-stats.log", ""),
        ("LOG_APPEND_TO_LOG", "0", ""),
        ("LOG_FILE_MAX_SIZE", "1024", ""),
        ("LOG_MAX_ROTATE_COUNT", "10", ""),
        ("LOG_USE_SYSLOG", "0", ""),
        ("DAEMONIZE", "0", "stay in the foreground: the daemon pod supervises the process"),
        ("BIND_INTERFACE_IP", bind_interface_ip, "empty: matched against nodes.cfg"),
        ("SERVER_PORT", str(server_port), "peer connections"),
        ("IMEX_NODE_CONFIG_FILE", nodes_config_file, ""),
        ("NETWORK_INTERFACE", "", ""),
        ("IMEX_WAIT_FOR_QUORUM", "RECOVERY", ""),
        ("IMEX_ENABLE_AUTH_ENCRYPTION", "0", ""),
        ("IMEX_CMD_ENABLED", "1", "nvidia-imex-ctl needs the command service"),
        ("IMEX_CMD_BIND_INTERFACE_IP", cmd_bind_ip, "the pod IP"),
        ("IMEX_CMD_PORT", str(cmd_port), ""),
        ("IMEX_CMD_UNIX_DOMAIN_PATH", cmd_unix_domain_path, ""),
        ("IMEX_NODE_DISCONNECTED_GRACE_TIME", "-1", "never drop a lost peer's imports on a timer"),
    ]
    extra = dict(overrides or {})
    lines = ["# Written by the ComputeDomain IMEX daemon; regenerated at every start."]
    for key, value, why in values:
        if key in extra:
            value, why = extra.pop(key), "set by IMEX_CONFIG_OVERRIDES"
        if why:
            lines.append(f"# {why}")
        lines.append(f"{key}={value}")
    if extra:
        lines.append("# Added by IMEX_CONFIG_OVERRIDES")
        lines.extend(f"{key}={value}" for key, value in extra.items())
    return "\n".join(lines) + "\n"


def parse_cfg(text: str, *, source: str = "<cfg>") -> dict[str, str]:
    """``KEY=VALUE`` lines; ``#`` comments and blank lines are ignored; later duplicates are an error."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ImexConfigError(f"{source}:{number}: malformed line {raw!r}, want KEY=VALUE")
        if key in values:
            raise ImexConfigError(f"{source}:{number}: {key} set twice")
        values[key] = value.strip()
    return values


@dataclass(frozen=True)
class ImexConfig:
    """The keys of ``imexd.cfg`` that decide where an IMEX daemon listens and whom it talks to."""

    node_config_file: str
    server_port: int = IMEX_SERVER_PORT
    bind_interface_ip: str = ""
    cmd_enabled: bool = True
    cmd_bind_ip: str = ""
    cmd_port: int = IMEX_CMD_PORT
    cmd_unix_domain_path: str = ""

    @classmethod
    def from_values(cls, values: Mapping[str, str], *, source: str = "<cfg>") -> ImexConfig:
        def integer(key: str, default: int) -> int:
            raw = values.get(key, "")
            if raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ImexConfigError(f"{source}: {key}={raw!r} is not an integer") from None

        return cls(
            # The real daemon's default location, used when the key is absent.
            node_config_file=values.get("IMEX_NODE_CONFIG_FILE") or "/etc/nvidia-imex/nodes_config.cfg",
            server_port=integer("SERVER_PORT", IMEX_SERVER_PORT),
            bind_interface_ip=values.get("BIND_INTERFACE_IP", ""),
            cmd_enabled=integer("IMEX_CMD_ENABLED", 0) == 1,
            cmd_bind_ip=values.get("IMEX_CMD_BIND_INTERFACE_IP", ""),
            cmd_port=integer("IMEX_CMD_PORT", IMEX_CMD_PORT),
            cmd_unix_domain_path=values.get("IMEX_CMD_UNIX_DOMAIN_PATH", ""),
        )

    @classmethod
    def parse(cls, text: str, *, source: str = "<cfg>") -> ImexConfig:
        return cls.from_values(parse_cfg(text, source=source), source=source)


# --------------------------------------------------------------------------------------------------------
# nodes.cfg


def hostname_prefix(cd_uid: str) -> str:
    """The per-CD hostname prefix, e.g. ``compute-domain-daemon-1b4e28ba2fa1411d8a1f6ec5c1f3a8e2``."""
    try:
        parsed = uuid.UUID(cd_uid)
    except ValueError:
        raise ImexConfigError(f"ComputeDomain UID {cd_uid!r} is not a UUID") from None
    return f"{HOSTNAME_PREFIX_BASE}-{parsed.hex}"


def slot_hostname(prefix: str, index: int) -> str:
    """DNS name of slot ``index`` (the daemon's index inside its clique)."""
    if index < 0:
        raise ImexConfigError(f"IMEX slot index {index} is negative")
    return f"{prefix}-{index:04d}"


def render_nodes_cfg_dns(prefix: str, max_nodes: int = MAX_NODES_PER_IMEX_DOMAIN) -> str:
    """Static ``nodes.cfg`` of DNS-names mode: every slot's name, whether or not a daemon holds it.

    The file never changes while the domain lives; membership changes go through the hosts file and
    SIGUSR1, because IMEX reads nodes.cfg only at start.
    """
    if max_nodes < 1:
        raise ImexConfigError(f"MAX_NODES_PER_IMEX_DOMAIN {max_nodes} must be at least 1")
    return "".join(f"{slot_hostname(prefix, index)}\n" for index in range(max_nodes))


def render_nodes_cfg_ips(ips: Sequence[str]) -> str:
    """Legacy ``nodes.cfg`` (IMEXDaemonsWithDNSNames=false): the clique's peer IPs, one per line."""
    for ip in ips:
        _check_ip(ip, "peer IP")
    return "".join(f"{ip}\n" for ip in ips)


def parse_nodes_cfg(text: str) -> list[str]:
    """Names or IPs of ``nodes.cfg``, in order; the position is the IMEX node ID."""
    entries = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            entries.append(line)
    return entries


def _check_ip(value: str, what: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ImexConfigError(f"{what} {value!r} is not an IP address") from None
