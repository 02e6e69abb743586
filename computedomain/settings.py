"""Process settings: one typed, frozen object per process, read from the environment and flags.

Every process (controller, node agent, IMEX daemon) builds its settings once at start through
`load_settings`. Flags win over environment variables, which win over defaults; names follow the
reference driver (`FEATURE_GATES`, `IMEX_MODE`, ...), so the upstream chart's env keeps working.

Validation is the SPEC section 3 rule set, checked in a fixed order so the first problem an operator
sees is the most fundamental one. A violation raises `SettingsError` whose message is one line that
names the setting and the fix; `main` turns it into a non-zero exit. The Helm chart renders the same
messages (`manifests/`), so `helm template` and the binaries agree.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Final, TypeVar

from computedomain.api.constants import DEFAULT_HOST_SOCKET_PATH, HEALTH_PORT, MAX_NODES_PER_IMEX_DOMAIN
from computedomain.api.limits import brief
from computedomain.goformats import GO_FALSE, GO_TRUE, klog_level, parse_duration


class SettingsError(ValueError):
    """An invalid setting. The message is one line naming the setting and the fix."""


# --- Feature gates -------------------------------------------------------------------------------------


class FeatureGate(StrEnum):
    IMEX_DAEMONS_WITH_DNS_NAMES = "IMEXDaemonsWithDNSNames"
    COMPUTE_DOMAIN_CLIQUES = "ComputeDomainCliques"
    CRASH_ON_NVLINK_FABRIC_ERRORS = "CrashOnNVLinkFabricErrors"
    HOST_MANAGED_IMEX_DAEMON = "HostManagedIMEXDaemon"
    IMEX_CHANNEL_ISOLATION = "IMEXChannelIsolation"


class Stage(StrEnum):
    ALPHA = "alpha"
    BETA = "beta"


@dataclass(frozen=True)
class GateSpec:
    stage: Stage
    default: bool


GATES: Final[Mapping[FeatureGate, GateSpec]] = {
    FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES: GateSpec(Stage.BETA, True),
    FeatureGate.COMPUTE_DOMAIN_CLIQUES: GateSpec(Stage.BETA, True),
    FeatureGate.CRASH_ON_NVLINK_FABRIC_ERRORS: GateSpec(Stage.BETA, True),
    FeatureGate.HOST_MANAGED_IMEX_DAEMON: GateSpec(Stage.ALPHA, False),
    FeatureGate.IMEX_CHANNEL_ISOLATION: GateSpec(Stage.ALPHA, False),
}

# Gates of the reference driver's GPU plugin. The shared chart renders one FEATURE_GATES string for all
# components, so these are accepted and ignored here; anything else is a typo and is rejected.
FOREIGN_GATES: Final = frozenset(
    {
        "TimeSlicingSettings",
        "MPSSupport",
        "PassthroughSupport",
        "DynamicMIG",
        "NVMLDeviceHealthCheck",
        "DeviceMetadata",
        "FabricManagerPartitioning",
        "DRAListTypeAttributes",
        "ConsumableShares",
        "AllAlpha",
        "AllBeta",
        "ContextualLogging",
        "LoggingAlphaOptions",
        "LoggingBetaOptions",
    }
)


@dataclass(frozen=True)
class FeatureGates:
    explicit: Mapping[FeatureGate, bool] = field(default_factory=dict)

    def enabled(self, gate: FeatureGate) -> bool:
        return self.explicit.get(gate, GATES[gate].default)

    def with_overrides(self, overrides: Mapping[FeatureGate, bool]) -> FeatureGates:
        return FeatureGates({**self.explicit, **overrides})

    def render(self) -> str:
        """The effective value of every gate, in FEATURE_GATES syntax (handed to the daemons)."""
        return ",".join(f"{gate.value}={str(self.enabled(gate)).lower()}" for gate in FeatureGate)

    @classmethod
    def parse(cls, text: str) -> FeatureGates:
        """Parse `A=true,B=false,` (empty items, e.g. a trailing comma, are ignored)."""
        explicit: dict[FeatureGate, bool] = {}
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            # Go's strconv.ParseBool forms (1, t, TRUE, ...) as the reference reads them, and any case.
            if not sep or not (value.lower() in ("true", "false") or value in GO_TRUE | GO_FALSE):
                raise SettingsError(f"FEATURE_GATES: item {brief(item)} must look like Name=true or Name=false")
            if name in FOREIGN_GATES:
                continue
            try:
                gate = FeatureGate(name)
            except ValueError:
                known = ", ".join(g.value for g in FeatureGate)
                raise SettingsError(f"FEATURE_GATES: unknown gate {brief(name)}; known gates: {known}") from None
            explicit[gate] = value.lower() == "true" or value in GO_TRUE
        return cls(explicit)


# --- IMEX ----------------------------------------------------------------------------------------------


class ImexMode(StrEnum):
    DRIVER_MANAGED = "driverManaged"
    HOST_MANAGED = "hostManaged"


class ImexIsolation(StrEnum):
    DOMAIN = "domain"
    CHANNEL = "channel"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def validate_host_socket_path(path: str) -> str:
    """SPEC section 3 rule 7 (the reference does not check this). POSIX keeps a leading `//` through
    normalisation, and a control character passes it too; both are refused here."""
    if (
        not path.startswith("/")
        or path.startswith("//")
        or ".." in path.split("/")
        or posixpath.normpath(path) != path
        or _CONTROL.search(path)
    ):
        raise SettingsError(
            f"IMEX_HOST_SOCKET_PATH {brief(path)} must be an absolute, normalised path without '..' "
            f"(relative to the driver root), e.g. {DEFAULT_HOST_SOCKET_PATH}"
        )
    return path


# ASCII only: `str.isdigit` and `int` also take superscripts and other scripts' digits.
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
# A host name, an IPv4 address or an IPv6 literal (brackets removed); empty means every address.
_HOST = re.compile(r"[A-Za-z0-9._:-]{0,253}", re.ASCII)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`HTTP_ENDPOINT` (`host:port`, `:port`, `[v6]:port`) -> (host, port); empty host -> "0.0.0.0"."""
    host, sep, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not _PORT.fullmatch(port) or int(port) > 65535 or not _HOST.fullmatch(host):
        raise EndpointError(
            f"HTTP_ENDPOINT {brief(endpoint)} must look like host:port, :port or [v6]:port (port 0-65535)"
        )
    return (host or "0.0.0.0"), int(port)


class EndpointError(SettingsError):
    """An `HTTP_ENDPOINT` that is not `host:port`."""


# --- IMEX config overrides and the daemon pods ----------------------------------------------------------

# nvidia-imex settings the service writes itself and relies on: overriding one would break a domain's
# daemons on every node, so it is refused (the reference refuses the first two).
DRIVER_OWNED_IMEX_KEYS: Final[Mapping[str, str]] = {
    "IMEX_CMD_BIND_INTERFACE_IP": "the pod IP, where the probes reach the command service",
    "IMEX_NODE_CONFIG_FILE": "the domain's nodes.cfg, which the daemon writes",
    "IMEX_CMD_ENABLED": "the probes need the command service",
    "IMEX_CMD_PORT": "the probes and the daemons' NetworkPolicy use 50005",
    "SERVER_PORT": "the peers and the daemons' NetworkPolicy use 50000",
    "DAEMONIZE": "the daemon supervises nvidia-imex in the foreground",
}
MAX_IMEX_OVERRIDES: Final = 64
MAX_IMEX_OVERRIDE_VALUE: Final = 1024
_IMEX_KEY = re.compile(r"[A-Z][A-Z0-9_]{0,63}", re.ASCII)
_NEWLINE = re.compile(r"[\r\n]")


def parse_imex_config_overrides(text: str) -> dict[str, str]:
    """IMEX_CONFIG_OVERRIDES, the reference's ``KEY=VALUE,KEY=VALUE,`` form of the chart's map
    ``resources.computeDomains.imex.config``: nvidia-imex settings written over (or added to) the daemons'
    imexd.cfg. Empty items are ignored and keys and values trimmed, as the reference does. Refused, with one
    line naming the key: a newline in a key or value (it would add a line of its own to the file), a key that
    is not an IMEX setting name, a key the service owns, and more than the bounds allow."""
    overrides: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if _NEWLINE.search(key):
            raise SettingsError(f"IMEX_CONFIG_OVERRIDES: key {brief(key)} contains a newline; one key per setting")
        if _NEWLINE.search(value):
            raise SettingsError(
                f"IMEX_CONFIG_OVERRIDES: the value of {brief(key)} contains a newline; a value is one line"
            )
        if not sep or not _IMEX_KEY.fullmatch(key):
            raise SettingsError(
                f"IMEX_CONFIG_OVERRIDES: item {brief(item)} must look like KEY=VALUE with an nvidia-imex setting "
                "name (upper case, digits, '_') as KEY, and no ',' in VALUE"
            )
        if key in DRIVER_OWNED_IMEX_KEYS:
            raise SettingsError(
                f"IMEX_CONFIG_OVERRIDES: {key} is set by the service ({DRIVER_OWNED_IMEX_KEYS[key]}); remove it"
            )
        if len(value) > MAX_IMEX_OVERRIDE_VALUE or _CONTROL.search(value):
            raise SettingsError(
                f"IMEX_CONFIG_OVERRIDES: the value of {key} must be printable and at most "
                f"{MAX_IMEX_OVERRIDE_VALUE} characters"
            )
        overrides[key] = value
    if len(overrides) > MAX_IMEX_OVERRIDES:
        raise SettingsError(f"IMEX_CONFIG_OVERRIDES: {len(overrides)} settings, at most {MAX_IMEX_OVERRIDES}")
    return overrides


def render_imex_config_overrides(overrides: Mapping[str, str]) -> str:
    """The inverse of `parse_imex_config_overrides`, in the chart's order (sorted keys)."""
    return "".join(f"{key}={overrides[key]}," for key in sorted(overrides))


# A PriorityClass name: a DNS subdomain.
_PRIORITY_CLASS = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", re.ASCII)
# Quantities of a container's resources (Kubernetes' quantity syntax, without exponents).
_QUANTITY = re.compile(r"[0-9]{1,15}(\.[0-9]{1,9})?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?", re.ASCII)


def parse_daemon_resources(text: str) -> dict[str, str]:
    """CD_DAEMON_RESOURCES (chart: ``controller.daemonResources``), ``cpu=250m,memory=256Mi,``: the IMEX daemon
    container's requests and limits both, so its pods are of the Guaranteed QoS class. Both resources or
    none."""
    resources: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in ("cpu", "memory"):
            raise SettingsError(f"CD_DAEMON_RESOURCES: item {brief(item)} must be cpu=QUANTITY or memory=QUANTITY")
        if not _QUANTITY.fullmatch(value) or not any(c in "123456789" for c in value):
            raise SettingsError(
                f"CD_DAEMON_RESOURCES: {name} {brief(value)} is not a positive quantity (e.g. 250m, 256Mi)"
            )
        resources[name] = value
    if resources and set(resources) != {"cpu", "memory"}:
        raise SettingsError(
            "CD_DAEMON_RESOURCES: set both cpu and memory (requests equal to limits: Guaranteed QoS), or neither"
        )
    return resources


# --- Settings objects ----------------------------------------------------------------------------------


def setting(env: str, help: str, **extra: Any) -> Any:
    """Declare a setting of a settings dataclass: its env var, help text and default. The flag is derived
    from the env name; `load_settings` fills the field from flag, env or default."""
    default = extra.pop("default", None)
    factory = extra.pop("default_factory", None)
    meta = {"env": env, "help": help, **extra}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# Client-side request rate and burst: beyond this the limiter no longer protects the apiserver.
MAX_KUBE_API_RATE: Final = 100_000
# Slot names end in a four-digit index (imex.config.slot_hostname).
MAX_NODES_LIMIT: Final = 10_000
# NVreg_ImexChannelCount's default, and the largest count a 20-bit device minor can number.
DEFAULT_IMEX_CHANNEL_COUNT: Final = 2048
MAX_IMEX_CHANNEL_COUNT: Final = 1 << 20
# One ResourceSlice holds at most 128 devices.
MAX_CHANNEL_CLAIMS_PER_NODE: Final = 128


def _duration(env: str, _kind: Any, raw: str) -> float:
    """A duration setting: seconds, or a Go duration as the reference's flags take it ("15s")."""
    try:
        return parse_duration(env, raw)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _klog_level(env: str, raw: str) -> str:
    try:
        return klog_level(env, raw)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


@dataclass(frozen=True)
class CommonSettings:
    feature_gates_text: str = setting("FEATURE_GATES", "Feature gates, e.g. 'A=true,B=false'", default="")
    imex_mode_text: str = setting("IMEX_MODE", "driverManaged or hostManaged", default="driverManaged")
    imex_isolation_text: str = setting(
        "IMEX_ISOLATION",
        "domain, or channel (a channel per ComputeDomain; hostManaged, gate IMEXChannelIsolation)",
        default="domain",
    )
    imex_host_socket_path: str = setting(
        "IMEX_HOST_SOCKET_PATH",
        "host IMEX command socket, relative to the driver root",
        default=DEFAULT_HOST_SOCKET_PATH,
    )
    namespace: str = setting("NAMESPACE", "the driver namespace", default="default")
    additional_namespaces: str = setting(
        "ADDITIONAL_NAMESPACES",
        "more namespaces the daemons may run in (managed by the controller; the node agent prepares daemon "
        "claims only in these and NAMESPACE), comma separated",
        default="",
    )
    pod_name: str = setting(
        "POD_NAME", "this pod's name (downward API): Event source, leader identity, daemon pod", default=""
    )
    kubeconfig: str = setting("KUBECONFIG", "kubeconfig path; empty means in-cluster", default="")
    kube_api_qps: float = setting("KUBE_API_QPS", "client-side request rate limit", default=20.0)
    kube_api_burst: int = setting("KUBE_API_BURST", "client-side burst", default=40)
    kube_api_timeout: float = setting("KUBE_API_TIMEOUT", "seconds one API request may take", default=10.0)
    retry_warn_after: int = setting(
        "RETRY_WARN_AFTER", "failed attempts of one object before a warning (and a condition)", default=5
    )
    stuck_recheck_period: float = setting(
        "STUCK_RECHECK_PERIOD",
        "seconds before an object stuck on a permanent error (RBAC, quota, invalid) is tried again unasked",
        default=300.0,
    )
    log_level: str = setting("LOG_LEVEL", "debug, info, warning or error", default="info")
    log_format: str = setting("LOG_FORMAT", "text or json", default="text")
    log_verbosity: str = setting(
        "LOG_VERBOSITY", "the reference's klog verbosity; when set it decides LOG_LEVEL (6 and up: debug)", default=""
    )

    # Derived in __post_init__; never read from the environment.
    feature_gates: FeatureGates = field(default_factory=FeatureGates, metadata={"derived": True})
    imex_mode: ImexMode = field(default=ImexMode.DRIVER_MANAGED, metadata={"derived": True})
    imex_isolation: ImexIsolation = field(default=ImexIsolation.DOMAIN, metadata={"derived": True})

    def __post_init__(self) -> None:
        if self.log_verbosity:
            object.__setattr__(self, "log_level", _klog_level("LOG_VERBOSITY", self.log_verbosity))
        gates = FeatureGates.parse(self.feature_gates_text)
        mode = _validate_imex(gates, self.imex_mode_text, self.imex_isolation_text)
        if mode is ImexMode.HOST_MANAGED:
            # No daemons exist in this mode, so the DNS-name and clique gates mean nothing; force them off
            # so no code path can act on their Beta defaults.
            gates = gates.with_overrides(
                {FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES: False, FeatureGate.COMPUTE_DOMAIN_CLIQUES: False}
            )
        elif gates.enabled(FeatureGate.COMPUTE_DOMAIN_CLIQUES) and not gates.enabled(
            FeatureGate.IMEX_DAEMONS_WITH_DNS_NAMES
        ):
            raise SettingsError(
                "FEATURE_GATES: ComputeDomainCliques=true requires IMEXDaemonsWithDNSNames=true; "
                "enable IMEXDaemonsWithDNSNames or set ComputeDomainCliques=false"
            )
        validate_host_socket_path(self.imex_host_socket_path)
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise SettingsError(f"LOG_LEVEL {brief(self.log_level)}: use debug, info, warning or error")
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"LOG_FORMAT {brief(self.log_format)}: use text or json")
        if not 0 < self.kube_api_qps <= MAX_KUBE_API_RATE:
            raise SettingsError(f"KUBE_API_QPS {self.kube_api_qps!r} must be above 0 and at most {MAX_KUBE_API_RATE}")
        if not 1 <= self.kube_api_burst <= MAX_KUBE_API_RATE:
            raise SettingsError(f"KUBE_API_BURST {self.kube_api_burst!r} must be between 1 and {MAX_KUBE_API_RATE}")
        _non_negative(self, "kube_api_timeout", "stuck_recheck_period")
        if self.kube_api_timeout <= 0:
            raise SettingsError(f"KUBE_API_TIMEOUT {self.kube_api_timeout!r} must be positive")
        if self.retry_warn_after < 1:
            raise SettingsError(f"RETRY_WARN_AFTER {self.retry_warn_after!r} must be at least 1")
        object.__setattr__(self, "feature_gates", gates)
        object.__setattr__(self, "imex_mode", mode)
        object.__setattr__(self, "imex_isolation", ImexIsolation(self.imex_isolation_text))

    @property
    def host_managed(self) -> bool:
        return self.imex_mode is ImexMode.HOST_MANAGED

    @property
    def channel_isolation(self) -> bool:
        """Every ComputeDomain gets an IMEX channel of its own per clique (design note 0012)."""
        return self.imex_isolation is ImexIsolation.CHANNEL

    def gate(self, gate: FeatureGate) -> bool:
        return self.feature_gates.enabled(gate)

    @property
    def managed_namespaces(self) -> tuple[str, ...]:
        """NAMESPACE, then ADDITIONAL_NAMESPACES: where the IMEX daemons may run."""
        extra = [ns.strip() for ns in self.additional_namespaces.split(",") if ns.strip()]
        return tuple(dict.fromkeys([self.namespace, *extra]))


# A Node's name: a DNS subdomain (RFC 1123). It becomes a pool name, a label value and part of object names.
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", re.ASCII)


def check_node_name(value: str) -> None:
    if not _NODE_NAME.fullmatch(value):
        raise SettingsError(
            f"NODE_NAME {brief(value)} is not a Node name (a lower-case DNS subdomain); "
            "set it from the downward API: spec.nodeName"
        )


def check_max_nodes(value: int) -> None:
    if not 1 <= value <= MAX_NODES_LIMIT:
        raise SettingsError(
            f"MAX_NODES_PER_IMEX_DOMAIN must be at least 1 and at most {MAX_NODES_LIMIT} (GB200/GB300 NVL72: 18)"
        )


def _non_negative(settings: CommonSettings, *names: str) -> None:
    """One line naming the first setting among ``names`` (field names) whose value is negative."""
    by_name = {f.name: f for f in fields(settings)}
    for name in names:
        value = getattr(settings, name)
        if value < 0:
            raise SettingsError(f"{by_name[name].metadata['env']} {value!r} must not be negative")


def _validate_imex(gates: FeatureGates, mode_text: str, isolation_text: str) -> ImexMode:
    """SPEC section 3 rules 1-4, in order: the mode (and its gate) before the isolation. Without the gate
    IMEXChannelIsolation, `channel` is refused with the message it always had."""
    try:
        mode = ImexMode(mode_text)
    except ValueError:
        raise SettingsError(f"IMEX_MODE {brief(mode_text)} is unknown; use driverManaged or hostManaged") from None
    if mode is ImexMode.HOST_MANAGED and not gates.enabled(FeatureGate.HOST_MANAGED_IMEX_DAEMON):
        raise SettingsError(
            "IMEX_MODE=hostManaged requires the feature gate HostManagedIMEXDaemon=true (FEATURE_GATES)"
        )
    gated = gates.enabled(FeatureGate.IMEX_CHANNEL_ISOLATION)
    if isolation_text == ImexIsolation.CHANNEL:
        if not gated:
            raise SettingsError("IMEX_ISOLATION=channel is not implemented yet; use domain")
        if mode is not ImexMode.HOST_MANAGED:
            raise SettingsError(
                "IMEX_ISOLATION=channel needs IMEX_MODE=hostManaged: in driverManaged mode every ComputeDomain "
                "runs an IMEX domain of its own, which isolates it already; use domain"
            )
    elif isolation_text != ImexIsolation.DOMAIN:
        known = "domain or channel" if gated else "domain"
        raise SettingsError(f"IMEX_ISOLATION {brief(isolation_text)} is unknown; use {known}")
    return mode


# The controller's client limits (the node agents and daemons keep CommonSettings' 20/40: there are thousands of
# them). They are a safety net against a runaway loop of our own, not what protects the apiserver: API Priority
# and Fairness does (the controller's ServiceAccount lands in the workload-low priority level, fair-queued per
# flow; a full queue answers 429 with Retry-After, which the client and the work queue honour), which is why
# client libraries now leave their limiter off by default. A domain's lifecycle costs 12 requests (6 to create
# it, 6 to tear it down), so creating and deleting 100 domains a few seconds apart takes ~1,200 tokens: at 100
# qps every burst after the first waited for the bucket (p99 3.3-3.9 s against the floor's 0.7-0.8 s, 4-5x)
# however large the burst. At 500 qps the bucket refills within two seconds of a teardown and the 100-domain
# burst runs as fast as the apiserver answers (1.1-1.4x the floor); a loop of our own is still held below what
# one apiserver on two cores takes (~700 writes/s here), and stops where APF pushes back. The burst of
# 1,000 lets 100 domains be created at once while another 100 are torn down. Events and status writes have a
# bucket of the same size of their own (``KubeClient.with_own_budget``). Measured: docs/design/0002-controller.md,
# `make bench-controller`.
CONTROLLER_KUBE_API_QPS: Final = 500.0
CONTROLLER_KUBE_API_BURST: Final = 1000


@dataclass(frozen=True)
class ControllerSettings(CommonSettings):
    kube_api_qps: float = setting(
        "KUBE_API_QPS",
        "client-side request rate limit (a safety net; API Priority and Fairness protects the apiserver)",
        default=CONTROLLER_KUBE_API_QPS,
    )
    kube_api_burst: int = setting(
        "KUBE_API_BURST",
        "client-side burst (covers the create writes of 100 domains while 100 are torn down)",
        default=CONTROLLER_KUBE_API_BURST,
    )
    image_name: str = setting("IMAGE_NAME", "image of the IMEX daemon pods", default="")
    daemon_image_pull_secrets: str = setting(
        "CD_DAEMON_IMAGE_PULL_SECRET_NAMES", "pull secrets of the daemon pods, comma separated", default=""
    )
    daemon_log_level: str = setting("LOG_LEVEL_CD_DAEMON", "log level handed to the daemons", default="info")
    daemon_log_verbosity: str = setting(
        "LOG_VERBOSITY_CD_DAEMON",
        "the reference's klog verbosity for the daemons; when set it decides theirs",
        default="",
    )
    max_nodes_per_imex_domain: int = setting(
        "MAX_NODES_PER_IMEX_DOMAIN", "DNS slots per clique", default=MAX_NODES_PER_IMEX_DOMAIN
    )
    http_endpoint: str = setting("HTTP_ENDPOINT", "host:port for /metrics, /healthz, /readyz", default="")
    metrics_path: str = setting("METRICS_PATH", "path of the metrics endpoint", default="/metrics")
    leader_election_enabled: bool = setting("LEADER_ELECTION_ENABLED", "use a Lease to elect one writer", default=False)
    daemon_network_policy: bool = setting(
        "DAEMON_NETWORK_POLICY",
        "give each domain's IMEX daemons a NetworkPolicy: only the domain's own daemons reach the peer port",
        default=False,
    )
    leader_election_namespace: str = setting(
        "LEADER_ELECTION_LEASE_LOCK_NAMESPACE", "namespace of the Lease", default="default"
    )
    leader_election_name: str = setting(
        "LEADER_ELECTION_LEASE_LOCK_NAME", "name of the Lease", default="nvidia-compute-domain-controller"
    )
    leader_election_lease_duration: float = setting(
        "LEADER_ELECTION_LEASE_DURATION", "seconds or a Go duration (15s)", default=15.0, convert=_duration
    )
    leader_election_renew_deadline: float = setting(
        "LEADER_ELECTION_RENEW_DEADLINE", "seconds or a Go duration (10s)", default=10.0, convert=_duration
    )
    leader_election_retry_period: float = setting(
        "LEADER_ELECTION_RETRY_PERIOD", "seconds or a Go duration (2s)", default=2.0, convert=_duration
    )
    # A reconcile is a few write round trips, so under a burst a domain waits (domains / workers) waves of them:
    # with 32 workers the 100-domain burst's p99 was 2.6x the API-write floor, with 100 it is within 2x
    # (`make bench-controller`). Workers are tasks, not threads; requests in flight stay capped by the client.
    workers: int = setting("WORKERS", "ComputeDomains reconciled at the same time", default=100)
    sweep_period: float = setting(
        "SWEEP_PERIOD", "seconds between full orphan sweeps (they also run on events)", default=600.0
    )
    retry_backoff_initial: float = setting(
        "RETRY_BACKOFF_INITIAL", "first delay before a failed reconcile is retried (doubles)", default=0.005
    )
    retry_backoff_max: float = setting("RETRY_BACKOFF_MAX", "longest delay between retries", default=300.0)
    imex_config_overrides_text: str = setting(
        "IMEX_CONFIG_OVERRIDES",
        "driverManaged: nvidia-imex settings over the daemons' defaults, KEY=VALUE,KEY=VALUE (checked at start)",
        default="",
    )
    daemon_priority_class: str = setting(
        "CD_DAEMON_PRIORITY_CLASS_NAME", "PriorityClass of the IMEX daemon pods; empty: none", default=""
    )
    daemon_resources_text: str = setting(
        "CD_DAEMON_RESOURCES",
        "requests and limits of the IMEX daemon container, cpu=250m,memory=256Mi (Guaranteed QoS); empty: none",
        default="",
    )
    imex_channel_count: int = setting(
        "IMEX_CHANNEL_COUNT",
        "IMEX channels of every node (NVreg_ImexChannelCount): IMEX_ISOLATION=channel assigns 1 to this - 1",
        default=DEFAULT_IMEX_CHANNEL_COUNT,
    )
    imex_channel_idle_release: float = setting(
        "IMEX_CHANNEL_IDLE_RELEASE",
        "IMEX_ISOLATION=channel: seconds (or a Go duration) after which a channel no claim of its domain holds in "
        "a clique is taken back; 0: kept while the domain exists",
        default=300.0,
        convert=_duration,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.daemon_log_verbosity:
            object.__setattr__(
                self, "daemon_log_level", _klog_level("LOG_VERBOSITY_CD_DAEMON", self.daemon_log_verbosity)
            )
        if self.http_endpoint:
            parse_endpoint(self.http_endpoint)
        check_max_nodes(self.max_nodes_per_imex_domain)
        parse_imex_config_overrides(self.imex_config_overrides_text)
        if self.daemon_priority_class and not _PRIORITY_CLASS.fullmatch(self.daemon_priority_class):
            raise SettingsError(
                f"CD_DAEMON_PRIORITY_CLASS_NAME {brief(self.daemon_priority_class)} is not a PriorityClass name "
                "(a lower-case DNS subdomain, e.g. system-node-critical)"
            )
        parse_daemon_resources(self.daemon_resources_text)
        if not 2 <= self.imex_channel_count <= MAX_IMEX_CHANNEL_COUNT:
            raise SettingsError(
                f"IMEX_CHANNEL_COUNT {self.imex_channel_count!r} must be between 2 and {MAX_IMEX_CHANNEL_COUNT} "
                f"(channel 0 is reserved; the driver's default NVreg_ImexChannelCount is {DEFAULT_IMEX_CHANNEL_COUNT})"
            )
        _non_negative(self, "sweep_period", "retry_backoff_initial", "retry_backoff_max", "imex_channel_idle_release")
        if self.workers < 1:
            raise SettingsError(f"WORKERS {self.workers!r} must be at least 1")
        if self.leader_election_enabled and not (
            self.leader_election_lease_duration
            > self.leader_election_renew_deadline
            > self.leader_election_retry_period
            > 0
        ):
            raise SettingsError(
                "LEADER_ELECTION_*: need lease duration > renew deadline > retry period > 0 (defaults 15/10/2)"
            )
        if self.leader_election_enabled and not self.pod_name:
            raise SettingsError("POD_NAME is required with LEADER_ELECTION_ENABLED=true (set it from the downward API)")

    @property
    def imex_config_overrides(self) -> dict[str, str]:
        """driverManaged only: in hostManaged mode the host owns its IMEX config (the reference ignores it too)."""
        return {} if self.host_managed else parse_imex_config_overrides(self.imex_config_overrides_text)

    @property
    def daemon_resources(self) -> dict[str, str]:
        return parse_daemon_resources(self.daemon_resources_text)

    @property
    def pull_secrets(self) -> tuple[str, ...]:
        return tuple(s for s in self.daemon_image_pull_secrets.replace(",", " ").split() if s)


@dataclass(frozen=True)
class PluginSettings(CommonSettings):
    node_name: str = setting("NODE_NAME", "this node's name", default="")
    kubelet_registrar_dir: str = setting(
        "KUBELET_REGISTRAR_DIRECTORY_PATH", "kubelet plugin registry dir", default="/var/lib/kubelet/plugins_registry"
    )
    kubelet_plugins_dir: str = setting(
        "KUBELET_PLUGINS_DIRECTORY_PATH", "kubelet plugins dir", default="/var/lib/kubelet/plugins"
    )
    cdi_root: str = setting("CDI_ROOT", "where CDI specs are written", default="/var/run/cdi")
    driver_root: str = setting(
        "NVIDIA_DRIVER_ROOT",
        "the NVIDIA driver root as the host has it (/: host-installed; /run/nvidia/driver: GPU Operator)",
        default="/",
    )
    container_driver_root: str = setting(
        "CONTAINER_DRIVER_ROOT",
        "where this process sees NVIDIA_DRIVER_ROOT (the chart mounts it at /driver-root); empty: at that path",
        default="",
    )
    proc_root: str = setting(
        "PROC_ROOT", "where the host's /proc (the driver's devices, params, capabilities) is visible", default="/proc"
    )
    health_port: int = setting("HEALTHCHECK_PORT", "gRPC health port (negative disables)", default=HEALTH_PORT)
    pod_ip: str = setting(
        "POD_IP", "this pod's IP (downward API status.podIP): the health server binds it; empty: all", default=""
    )
    gpu_clique_label_enabled: bool = setting(
        "GPU_CLIQUE_LABEL_ENABLED", "maintain the nvidia.com/gpu.clique node label", default=False
    )
    prepare_budget: float = setting(
        "PREPARE_BUDGET", "seconds one claim's Prepare may take (below the kubelet's 45 s deadline)", default=40.0
    )
    prepare_backoff_initial: float = setting(
        "PREPARE_BACKOFF_INITIAL", "first delay between Prepare attempts of one claim (doubles)", default=0.25
    )
    prepare_backoff_max: float = setting("PREPARE_BACKOFF_MAX", "longest delay between Prepare attempts", default=3.0)
    cleanup_interval: float = setting(
        "CLEANUP_INTERVAL", "seconds between cleanups of stale claims, specs and domain dirs", default=600.0
    )
    clique_refresh_interval: float = setting(
        "CLIQUE_REFRESH_INTERVAL", "seconds between reads of the NVLink clique (and the node label)", default=600.0
    )
    retry_backoff_initial: float = setting(
        "RETRY_BACKOFF_INITIAL", "first delay before failed background work is retried (doubles)", default=0.2
    )
    retry_backoff_max: float = setting("RETRY_BACKOFF_MAX", "longest delay between retries", default=30.0)
    http_endpoint: str = setting("HTTP_ENDPOINT", "host:port for /metrics, /healthz; empty: no server", default="")
    metrics_path: str = setting("METRICS_PATH", "path of the metrics endpoint", default="/metrics")
    imex_channel_claims_per_node: int = setting(
        "IMEX_CHANNEL_CLAIMS_PER_NODE",
        "channel devices this node publishes, i.e. channel claims prepared here at once",
        default=8,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.http_endpoint:
            parse_endpoint(self.http_endpoint)
        if not 1 <= self.imex_channel_claims_per_node <= MAX_CHANNEL_CLAIMS_PER_NODE:
            raise SettingsError(
                f"IMEX_CHANNEL_CLAIMS_PER_NODE {self.imex_channel_claims_per_node!r} must be between 1 and "
                f"{MAX_CHANNEL_CLAIMS_PER_NODE} (one ResourceSlice holds {MAX_CHANNEL_CLAIMS_PER_NODE} devices)"
            )
        if not self.node_name:
            raise SettingsError("NODE_NAME is required (set it from the downward API: spec.nodeName)")
        check_node_name(self.node_name)
        if self.health_port > 65535:
            raise SettingsError(
                f"HEALTHCHECK_PORT {self.health_port} must be at most 65535 (negative: no health server)"
            )
        _non_negative(
            self,
            "prepare_backoff_initial",
            "prepare_backoff_max",
            "cleanup_interval",
            "clique_refresh_interval",
            "retry_backoff_initial",
            "retry_backoff_max",
        )
        if not 0 < self.prepare_budget < 45:
            raise SettingsError(
                f"PREPARE_BUDGET {self.prepare_budget!r} must be above 0 and below 45: the kubelet gives up on a "
                "Prepare call after 45 s, and the answer must reach it before"
            )
        for env, value in (
            ("CDI_ROOT", self.cdi_root),
            ("NVIDIA_DRIVER_ROOT", self.driver_root),
            ("CONTAINER_DRIVER_ROOT", self.container_driver_root or "/"),
            ("PROC_ROOT", self.proc_root),
        ):
            if not value.startswith("/"):
                raise SettingsError(f"{env} {brief(value)} must be an absolute path")
        if self.pod_ip:
            try:
                ipaddress.ip_address(self.pod_ip)
            except ValueError:
                raise SettingsError(
                    f"POD_IP {brief(self.pod_ip)} is not an IP address (set it from the downward API: status.podIP)"
                ) from None

    @property
    def driver_root_mount(self) -> str:
        """Where this process reads the driver root (NVML library, IMEX binaries, the host-managed chroot)."""
        return self.container_driver_root or self.driver_root


S = TypeVar("S", bound=CommonSettings)

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off", "")


# ASCII digits only (`int` and `float` also accept other scripts' digits), and few enough of them.
_INT = re.compile(r"[+-]?[0-9]{1,18}", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]{1,18}(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?", re.ASCII)


def _convert(env: str, kind: Any, raw: str) -> Any:
    if kind in (bool, "bool"):
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise SettingsError(f"{env} {brief(raw)} must be true or false")
    if kind in (int, "int"):
        if not _INT.fullmatch(raw.strip()):
            raise SettingsError(f"{env} {brief(raw)} must be an integer")
        return int(raw)
    if kind in (float, "float"):
        text = raw.strip().removesuffix("s")
        if len(text) > 64 or not _FLOAT.fullmatch(text) or not math.isfinite(float(text)):
            raise SettingsError(f"{env} {brief(raw)} must be a finite number (seconds for durations)")
        return float(text)
    return raw


def flag_name(env: str) -> str:
    return "--" + env.lower().replace("_", "-")


def load_settings(cls: type[S], argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> S:
    """Build `cls` from flags (`--imex-mode hostManaged`) over env vars (`IMEX_MODE`) over defaults."""
    environ = os.environ if environ is None else environ
    options = [f for f in fields(cls) if "env" in f.metadata]
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    for option in options:
        parser.add_argument(flag_name(option.metadata["env"]), dest=option.name, default=None)
    try:
        parsed, unknown = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise SettingsError(str(exc)) from None
    if unknown:
        raise SettingsError(f"unknown flag {brief(unknown[0])}; flags mirror the env vars, e.g. --imex-mode")
    values: dict[str, Any] = {}
    for option in options:
        env = option.metadata["env"]
        raw = getattr(parsed, option.name)
        if raw is None:
            raw = environ.get(env)
        if raw is not None:
            values[option.name] = option.metadata.get("convert", _convert)(env, option.type, raw)
    return cls(**values)


def describe(settings: CommonSettings) -> dict[str, Any]:
    """The effective settings, for the startup log line and `check-settings`."""
    out: dict[str, Any] = {}
    for option in fields(settings):
        if "env" in option.metadata:
            out[option.metadata["env"]] = getattr(settings, option.name)
    out["FEATURE_GATES"] = settings.feature_gates.render()
    return out


def help_text(cls: type[CommonSettings]) -> str:
    lines = []
    for option in fields(cls):
        if "env" in option.metadata:
            env = option.metadata["env"]
            lines.append(f"  {flag_name(env):42} {env:38} {option.metadata['help']}")
    return "\n".join(lines)


__all__ = [
    "GATES",
    "CommonSettings",
    "ControllerSettings",
    "EndpointError",
    "FeatureGate",
    "FeatureGates",
    "ImexIsolation",
    "ImexMode",
    "PluginSettings",
    "SettingsError",
    "check_max_nodes",
    "check_node_name",
    "describe",
    "load_settings",
    "parse_daemon_resources",
    "parse_endpoint",
    "parse_imex_config_overrides",
    "render_imex_config_overrides",
    "setting",
    "validate_host_socket_path",
]
