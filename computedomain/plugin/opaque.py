"""Which ComputeDomain config applies to which allocated device of a claim.

Input is the raw JSON of a ResourceClaim's `status.allocation` (resource.k8s.io/v1); output is one
`ResolvedDevice` per device allocated from our driver, carrying its kind (channel or daemon) and its
strictly decoded opaque config (`computedomain.api.models`). Pure: no I/O, no clock; runs before any side
effect of Prepare, so a bad claim fails without leaving anything behind.

Rules (the DRA ones, as the reference driver applies them, with clearer failures):

- configs from the DeviceClass (`FromClass`) come first, then those from the claim (`FromClaim`), list
  order kept within each; opaque configs of other drivers are ignored;
- for each allocated device, the *last* config that applies wins: one that names the device's request
  (or the request of which it is a subrequest) applies and must be of the device's kind; one that names no
  request applies to every device of its kind;
- every `compute-domain.nvidia.com` config is decoded strictly, also ones that end up unused: a typo is a
  permanent error naming the config and the field, not a silently ignored setting.

Every error here is permanent: the allocation of a claim never changes, so retrying cannot help.
Upstream retried a claim without any applicable config until the kubelet's deadline ran out; we say why
at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from computedomain.api.constants import DRIVER_NAME
from computedomain.api.limits import brief
from computedomain.api.models import (
    AllocationMode,
    ComputeDomainChannelConfig,
    ComputeDomainDaemonConfig,
    OpaqueConfig,
    OpaqueConfigError,
    decode_opaque_config,
)
from computedomain.plugin.checkpoint import DeviceKind

FROM_CLASS: Final = "FromClass"
FROM_CLAIM: Final = "FromClaim"
_KIND_OF_CONFIG: Final[dict[type[Any], DeviceKind]] = {
    ComputeDomainChannelConfig: DeviceKind.CHANNEL,
    ComputeDomainDaemonConfig: DeviceKind.DAEMON,
}


class ConfigError(ValueError):
    """A claim whose allocation or configs cannot be prepared. Permanent; the message is one line meant
    for the pod's Events."""


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    request: str
    pool: str
    device: str
    admin_access: bool = False

    @property
    def kind(self) -> DeviceKind:
        return device_kind(self.device)


@dataclass(frozen=True, slots=True)
class ResolvedDevice:
    device: AllocatedDevice
    config: OpaqueConfig

    @property
    def kind(self) -> DeviceKind:
        return self.device.kind

    @property
    def domain_id(self) -> str:
        return self.config.domain_id

    @property
    def all_channels(self) -> bool:
        return isinstance(self.config, ComputeDomainChannelConfig) and self.config.allocation_mode == AllocationMode.ALL


@dataclass(frozen=True, slots=True)
class _Config:
    position: str  # for messages: "config[2] (FromClaim)"
    requests: tuple[str, ...]
    config: OpaqueConfig

    @property
    def kind(self) -> DeviceKind:
        return _KIND_OF_CONFIG[type(self.config)]


def device_kind(device_name: str) -> DeviceKind:
    """`channel-<n>` / `channel-0-<n>` / `daemon-<n>`, the device names this driver publishes."""
    kind, _, index = device_name.rpartition("-")
    if kind == "channel-0":  # a further place on channel 0 (design note 0014)
        kind = "channel"
    if index.isdigit():
        for candidate in DeviceKind:
            if kind == candidate.value:
                return candidate
    raise ConfigError(
        f"device {brief(device_name)} is not a {DRIVER_NAME} device (expected channel-N, channel-0-N or daemon-N)"
    )


def _as_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list")
    return value


def _devices(allocation: Mapping[str, Any]) -> Mapping[str, Any]:
    devices = allocation.get("devices") or {}
    if not isinstance(devices, Mapping):
        raise ConfigError("allocation.devices must be an object")
    return devices


def _results(allocation: Mapping[str, Any], driver: str) -> list[AllocatedDevice]:
    devices = _devices(allocation)
    out = []
    for i, raw in enumerate(_as_list(devices.get("results"), "allocation.devices.results")):
        if not isinstance(raw, Mapping) or raw.get("driver") != driver:
            continue
        request, pool, device = raw.get("request"), raw.get("pool"), raw.get("device")
        if not (isinstance(request, str) and isinstance(pool, str) and isinstance(device, str)):
            raise ConfigError(f"allocation.devices.results[{i}] lacks request, pool or device")
        out.append(AllocatedDevice(request, pool, device, bool(raw.get("adminAccess"))))
    return out


def _configs(allocation: Mapping[str, Any], driver: str) -> list[_Config]:
    devices = _devices(allocation)
    by_source: dict[str, list[_Config]] = {FROM_CLASS: [], FROM_CLAIM: []}
    for i, raw in enumerate(_as_list(devices.get("config"), "allocation.devices.config")):
        where = f"allocation.devices.config[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be an object")
        source = raw.get("source")
        if not isinstance(source, str) or source not in by_source:
            raise ConfigError(f"{where}: unknown source {brief(source)}; expected {FROM_CLASS} or {FROM_CLAIM}")
        opaque = raw.get("opaque")
        if not isinstance(opaque, Mapping):
            # Only opaque configs exist today; a newer config type is not ours to interpret.
            continue
        if opaque.get("driver") != driver:
            continue
        parameters = opaque.get("parameters")
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, Mapping):
            # dict() would turn a list of pairs into an object; the apiserver and the admission policy see a list.
            raise ConfigError(f"{where} ({source}): opaque.parameters must be a JSON object")
        try:
            config = decode_opaque_config(dict(parameters))
        except OpaqueConfigError as exc:
            raise ConfigError(f"{where} ({source}): {exc}") from None
        requests = tuple(str(r) for r in _as_list(raw.get("requests"), f"{where}.requests"))
        by_source[source].append(_Config(f"{where} ({source})", requests, config))
    return by_source[FROM_CLASS] + by_source[FROM_CLAIM]


def _names_request(config: _Config, request: str) -> bool:
    parent = request.split("/", 1)[0]
    return request in config.requests or parent in config.requests


def resolve(allocation: Mapping[str, Any] | None, *, driver: str = DRIVER_NAME) -> list[ResolvedDevice]:
    """One ResolvedDevice per device of `driver` in the allocation, in allocation order."""
    if not allocation:
        raise ConfigError("claim is not allocated (status.allocation is empty)")
    if not isinstance(allocation, Mapping):
        raise ConfigError("status.allocation must be an object")
    results = _results(allocation, driver)
    if not results:
        raise ConfigError(f"claim has no device allocated from driver {driver}")
    configs = _configs(allocation, driver)
    resolved = []
    for result in results:
        kind = result.kind
        chosen: _Config | None = None
        for config in reversed(configs):
            if config.requests:
                if not _names_request(config, result.request):
                    continue
                if config.kind is not kind:
                    raise ConfigError(
                        f"{config.position}: a {type(config.config).__name__} cannot configure {kind} "
                        f"device {result.device} of request {result.request!r}"
                    )
                chosen = config
                break
            if config.kind is kind:
                chosen = config
                break
        if chosen is None:
            wanted = "ComputeDomainChannelConfig" if kind is DeviceKind.CHANNEL else "ComputeDomainDaemonConfig"
            raise ConfigError(
                f"no {wanted} applies to device {result.device} of request {result.request!r}; claims for "
                f"{driver} devices must come from a ComputeDomain's ResourceClaimTemplate"
            )
        resolved.append(ResolvedDevice(result, chosen.config))
    return resolved
