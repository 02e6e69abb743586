"""Settings of the compute-domain daemon (``python -m imex daemon run|check``).

The per-CD DaemonSet gives the daemon its identity through the downward API (``NODE_NAME``, ``POD_IP``,
``POD_UID``, ``POD_NAME``, ``POD_NAMESPACE``) and the CD through CDI env that the node agent injects with
the daemon claim (``CLIQUE_ID``, ``COMPUTE_DOMAIN_UUID``, ``COMPUTE_DOMAIN_NAME``,
``COMPUTE_DOMAIN_NAMESPACE``). The paths of ``/imexd``, the hosts file and the IMEX binaries are settings
too, so tests can run many daemons on one machine.

Same mechanism as ``computedomain.settings``: a frozen dataclass built once by ``load_settings`` (flags over
env over defaults), validated in the constructor with one-line ``SettingsError`` messages. ``check`` runs as
a kubelet probe with the same env but needs almost none of it, so the identity rules that only ``run``
needs live in ``validate_for_run`` instead of the constructor.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from computedomain.api.constants import DAEMON_CHECK_PORT as CHECK_PORT
from computedomain.api.constants import MAX_NODES_PER_IMEX_DOMAIN
from computedomain.api.limits import brief
from computedomain.api.types import clique_name
from computedomain.settings import (
    CommonSettings,
    FeatureGate,
    SettingsError,
    check_max_nodes,
    check_node_name,
    parse_imex_config_overrides,
    setting,
)
from imex.config import hostname_prefix

__all__ = ["DaemonSettings"]

_CLIQUE_ID = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?", re.ASCII)


@dataclass(frozen=True)
class DaemonSettings(CommonSettings):
    node_name: str = setting("NODE_NAME", "this node's name (downward API)", default="")
    pod_ip: str = setting("POD_IP", "this pod's IP (downward API); IMEX peers reach us here", default="")
    pod_uid: str = setting("POD_UID", "this pod's UID (downward API); owner of the clique object", default="")
    pod_namespace: str = setting("POD_NAMESPACE", "this pod's namespace: the driver namespace", default="")
    clique_id: str = setting("CLIQUE_ID", "NVLink clique of the node (CDI); empty: no fabric", default="")
    cd_uid: str = setting("COMPUTE_DOMAIN_UUID", "UID of the ComputeDomain (CDI)", default="")
    cd_name: str = setting("COMPUTE_DOMAIN_NAME", "name of the ComputeDomain (CDI)", default="")
    cd_namespace: str = setting("COMPUTE_DOMAIN_NAMESPACE", "namespace of the ComputeDomain (CDI)", default="default")
    max_nodes: int = setting(
        "MAX_NODES_PER_IMEX_DOMAIN", "DNS slots per clique (the controller's value)", default=MAX_NODES_PER_IMEX_DOMAIN
    )
    hostname_prefix_text: str = setting(
        "IMEX_HOSTNAME_PREFIX",
        "per-CD prefix of the slot names (the controller's); empty: derived from the CD UID",
        default="",
    )
    imexd_dir: str = setting("IMEXD_DIR", "directory of imexd.cfg and nodes.cfg", default="/imexd")
    hosts_file: str = setting("HOSTS_FILE", "hosts file that maps the IMEX slot names", default="/etc/hosts")
    imex_binary: str = setting("IMEX_BINARY", "the nvidia-imex executable (PATH lookup if bare)", default="nvidia-imex")
    imex_ctl_binary: str = setting(
        "IMEX_CTL_BINARY", "the nvidia-imex-ctl executable (PATH lookup if bare)", default="nvidia-imex-ctl"
    )
    sigusr1_interval: float = setting(
        "IMEX_SIGUSR1_INTERVAL", "IMEX honours SIGUSR1 at most once per this many seconds", default=5.0
    )
    imex_stop_timeout: float = setting(
        "IMEX_STOP_TIMEOUT", "seconds between SIGTERM and SIGKILL when stopping nvidia-imex", default=10.0
    )
    restart_backoff_initial: float = setting(
        "IMEX_RESTART_BACKOFF_INITIAL", "first delay before restarting a crashed nvidia-imex", default=1.0
    )
    restart_backoff_max: float = setting(
        "IMEX_RESTART_BACKOFF_MAX", "longest delay between restarts of a crash-looping nvidia-imex", default=30.0
    )
    imex_config_overrides_text: str = setting(
        "IMEX_CONFIG_OVERRIDES",
        "nvidia-imex settings over the defaults of imexd.cfg, KEY=VALUE,KEY=VALUE (the controller's)",
        default="",
    )
    check_timeout: float = setting("CHECK_TIMEOUT", "deadline of nvidia-imex-ctl in `check`", default=8.0)
    check_port: int = setting(
        "CHECK_PORT",
        "port on the pod IP where `run` answers the probes (GET /ready: 200 only on exactly READY); 0: none",
        default=CHECK_PORT,
    )
    shutdown_timeout: float = setting("SHUTDOWN_TIMEOUT", "deadline for removing our entry after SIGTERM", default=10.0)
    retry_backoff_initial: float = setting(
        "RETRY_BACKOFF_INITIAL", "first delay before a failed registration or peer update is retried", default=0.2
    )
    retry_backoff_max: float = setting("RETRY_BACKOFF_MAX", "longest delay between those retries", default=30.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_max_nodes(self.max_nodes)
        parse_imex_config_overrides(self.imex_config_overrides_text)
        for env, value in (
            ("IMEX_SIGUSR1_INTERVAL", self.sigusr1_interval),
            ("IMEX_STOP_TIMEOUT", self.imex_stop_timeout),
            ("IMEX_RESTART_BACKOFF_INITIAL", self.restart_backoff_initial),
            ("IMEX_RESTART_BACKOFF_MAX", self.restart_backoff_max),
            ("CHECK_TIMEOUT", self.check_timeout),
            ("SHUTDOWN_TIMEOUT", self.shutdown_timeout),
            ("RETRY_BACKOFF_INITIAL", self.retry_backoff_initial),
            ("RETRY_BACKOFF_MAX", self.retry_backoff_max),
        ):
            if value < 0:
                raise SettingsError(f"{env} {value!r} must not be negative")
        if not 0 <= self.check_port <= 65535:
            raise SettingsError(f"CHECK_PORT {self.check_port!r} must be a port number (0: no endpoint)")
        if self.hostname_prefix_text and not re.fullmatch(
            r"[a-z0-9]([a-z0-9-]{0,56}[a-z0-9])?", self.hostname_prefix_text
        ):
            raise SettingsError(
                f"IMEX_HOSTNAME_PREFIX {self.hostname_prefix_text!r} must be a DNS label of at most 58 characters "
                "(lower-case letters, digits, '-'), leaving room for the -NNNN slot suffix"
            )
        # Part of an object name (<cdUID>.<cliqueID>) and a label value: a lower-case DNS-subdomain part of
        # at most 63 characters.
        if self.clique_id and not _CLIQUE_ID.fullmatch(self.clique_id):
            raise SettingsError(f"CLIQUE_ID {brief(self.clique_id)} is malformed; want <clusterUUID>.<cliqueId>")

    # ---- derived -------------------------------------------------------------------------------------

    @property
    def dns_names(self) -> bool:
        return self.gate(FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES)

    @property
    def use_cliques(self) -> bool:
        return self.gate(FeatureGate.COMPUTE_DOMAIN_CLIQUES)

    @property
    def hostname_prefix(self) -> str:
        """The slot-name prefix: the controller's IMEX_HOSTNAME_PREFIX when given, else derived the same way."""
        return self.hostname_prefix_text or hostname_prefix(self.cd_uid)

    @property
    def imex_config_overrides(self) -> dict[str, str]:
        return parse_imex_config_overrides(self.imex_config_overrides_text)

    @property
    def imexd_cfg_path(self) -> Path:
        return Path(self.imexd_dir) / "imexd.cfg"

    @property
    def nodes_cfg_path(self) -> Path:
        return Path(self.imexd_dir) / "nodes.cfg"

    @property
    def clique_object_name(self) -> str:
        """``<cdUID>.<cliqueID>``: the ComputeDomainClique this daemon registers in."""
        return clique_name(self.cd_uid, self.clique_id)

    def validate_for_run(self) -> None:
        """The identity `run` needs; one line per problem, the most fundamental first."""
        if not self.cd_uid:
            raise SettingsError(
                "COMPUTE_DOMAIN_UUID is empty: the CDI container edits of the daemon claim did not apply "
                "-- is CDI enabled in the container runtime?"
            )
        try:
            uuid.UUID(self.cd_uid)
        except ValueError:
            raise SettingsError(f"COMPUTE_DOMAIN_UUID {self.cd_uid!r} is not a UUID") from None
        for env, value in (
            ("NODE_NAME", self.node_name),
            ("POD_NAME", self.pod_name),
            ("POD_NAMESPACE", self.pod_namespace),
            ("POD_UID", self.pod_uid),
            ("POD_IP", self.pod_ip),
        ):
            if not value:
                raise SettingsError(f"{env} is required (set it from the downward API)")
        check_node_name(self.node_name)
        if not self.use_cliques and not self.cd_name:
            raise SettingsError("COMPUTE_DOMAIN_NAME is required with ComputeDomainCliques=false (CDI env)")
