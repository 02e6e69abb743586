"""Resolution of ComputeDomain opaque configs against a claim's allocation results."""

from __future__ import annotations

from typing import Any

import pytest

from computedomain.plugin.checkpoint import DeviceKind
from computedomain.plugin.opaque import ConfigError, device_kind, resolve

DRIVER = "compute-domain.nvidia.com"
CD1 = "6f1c2d3e-0000-4000-8000-00000000cd01"
CD2 = "6f1c2d3e-0000-4000-8000-00000000cd02"


def result(request: str = "channel", device: str = "channel-0", driver: str = DRIVER) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": "node-a", "device": device}


def channel_cfg(domain: str = CD1, mode: str | None = None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig"}
    params["domainID"] = domain
    if mode is not None:
        params["allocationMode"] = mode
    params.update(extra)
    return params


def daemon_cfg(domain: str = CD1) -> dict[str, Any]:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainDaemonConfig", "domainID": domain}


def config(
    params: dict[str, Any], source: str = "FromClaim", requests: list[str] | None = None, driver: str = DRIVER
) -> dict[str, Any]:
    out: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": params}}
    if requests is not None:
        out["requests"] = requests
    return out


def allocation(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"devices": {"results": results, "config": configs}}


def test_channel_claim_from_template() -> None:
    [r] = resolve(allocation([result()], [config(channel_cfg(mode="All"), requests=["channel"])]))
    assert r.kind is DeviceKind.CHANNEL
    assert r.domain_id == CD1
    assert r.all_channels
    assert r.device.device == "channel-0" and r.device.pool == "node-a"


def test_single_is_the_default_mode() -> None:
    [r] = resolve(allocation([result()], [config(channel_cfg())]))
    assert not r.all_channels


def test_daemon_claim() -> None:
    [r] = resolve(allocation([result("daemon", "daemon-0")], [config(daemon_cfg())]))
    assert r.kind is DeviceKind.DAEMON and r.domain_id == CD1


def test_last_matching_config_wins_and_claim_overrides_class() -> None:
    configs = [
        config(channel_cfg(CD2), source="FromClaim", requests=["channel"]),
        config(channel_cfg(CD1), source="FromClass"),
    ]
    # FromClass is ordered before FromClaim regardless of list position, so the claim's config wins.
    [r] = resolve(allocation([result()], configs))
    assert r.domain_id == CD2


def test_untargeted_config_applies_only_to_its_kind() -> None:
    configs = [config(channel_cfg(CD1)), config(daemon_cfg(CD2))]
    resolved = resolve(allocation([result(), result("daemon", "daemon-0")], configs))
    assert [(r.kind, r.domain_id) for r in resolved] == [(DeviceKind.CHANNEL, CD1), (DeviceKind.DAEMON, CD2)]


def test_subrequest_matches_parent_request() -> None:
    [r] = resolve(allocation([result("channel/fast")], [config(channel_cfg(CD2), requests=["channel"])]))
    assert r.domain_id == CD2


def test_other_drivers_are_ignored() -> None:
    results = [result(), result("gpu", "gpu-0", driver="gpu.nvidia.com")]
    configs = [config({"anything": True}, driver="gpu.nvidia.com"), config(channel_cfg())]
    [r] = resolve(allocation(results, configs))
    assert r.device.device == "channel-0"


def test_unknown_field_is_permanent_and_named() -> None:
    with pytest.raises(ConfigError, match=r"config\[0\] \(FromClaim\).*unknown field 'domainId'"):
        resolve(allocation([result()], [config(channel_cfg(domainId="x"))]))


def test_unused_config_is_still_decoded_strictly() -> None:
    configs = [config(channel_cfg(), requests=["channel"]), config(daemon_cfg("not-a-uuid"), requests=["other"])]
    with pytest.raises(ConfigError, match=r"config\[1\].*domainID"):
        resolve(allocation([result()], configs))


def test_kind_mismatch_for_named_request() -> None:
    with pytest.raises(ConfigError, match="ComputeDomainDaemonConfig cannot configure channel device"):
        resolve(allocation([result()], [config(daemon_cfg(), requests=["channel"])]))


def test_no_applicable_config() -> None:
    with pytest.raises(ConfigError, match="no ComputeDomainChannelConfig applies to device channel-0"):
        resolve(allocation([result()], [config(daemon_cfg())]))


@pytest.mark.parametrize(
    ("alloc", "message"),
    [
        (None, "not allocated"),
        ({}, "not allocated"),
        (allocation([result(driver="gpu.nvidia.com")], []), "no device allocated from driver"),
        (allocation([result(device="gpu-0")], []), "not a compute-domain.nvidia.com device"),
        (allocation([result()], [{"source": "FromElsewhere"}]), "unknown source"),
        (allocation([{"driver": DRIVER, "pool": "p"}], []), r"results\[0\] lacks"),
    ],
)
def test_bad_allocations(alloc: dict[str, Any] | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(alloc)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("channel-0", DeviceKind.CHANNEL), ("channel-2047", DeviceKind.CHANNEL), ("daemon-0", DeviceKind.DAEMON)],
)
def test_device_kind(name: str, kind: DeviceKind) -> None:
    assert device_kind(name) is kind


@pytest.mark.parametrize("name", ["channel", "channel-x", "gpu-0", "daemon-", ""])
def test_device_kind_rejects(name: str) -> None:
    with pytest.raises(ConfigError):
        device_kind(name)
