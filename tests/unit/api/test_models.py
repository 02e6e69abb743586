"""Decoding of API objects (lenient) and of opaque configs (strict, one-line errors naming the field)."""

import pytest

from computedomain.api.models import (
    AllocationMode,
    ComputeDomain,
    ComputeDomainChannelConfig,
    ComputeDomainDaemonConfig,
    ComputeDomainNode,
    ComputeDomainStatus,
    OpaqueConfigError,
    ReadyStatus,
    decode_opaque_config,
)

UID = "6f1b8f0e-3c2a-4a57-9d0e-2b7c1e5a9f10"


def test_compute_domain_decodes_server_objects_leniently() -> None:
    cd = ComputeDomain.model_validate(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "a", "namespace": "ns", "uid": UID, "managedFields": [{}]},
            "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "t"}}},
            "status": {"status": "Ready", "futureField": 1},
        }
    )
    assert cd.uid == UID
    assert cd.spec.channel.allocation_mode is AllocationMode.SINGLE
    assert cd.status is not None and cd.status.status is ReadyStatus.READY


def test_status_omits_empty_nodes_and_always_writes_index() -> None:
    assert "nodes" not in ComputeDomainStatus(nodes=[]).to_api()
    node = ComputeDomainNode(name="n", ip_address="10.0.0.1", clique_id="", index=0)
    body = ComputeDomainStatus(nodes=[node]).to_api()
    assert body["nodes"] == [{"name": "n", "ipAddress": "10.0.0.1", "cliqueID": "", "index": 0, "status": "NotReady"}]


def test_channel_config_decodes() -> None:
    config = decode_opaque_config(
        '{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig",'
        f'"domainID":"{UID}","allocationMode":"All"}}'
    )
    assert isinstance(config, ComputeDomainChannelConfig)
    assert config.allocation_mode is AllocationMode.ALL


def test_daemon_config_decodes() -> None:
    config = decode_opaque_config(
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainDaemonConfig", "domainID": UID}
    )
    assert isinstance(config, ComputeDomainDaemonConfig)
    assert config.domain_id == UID


BASE = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": UID}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({**BASE, "allocationMod": "All"}, "unknown field 'allocationMod'"),
        ({**BASE, "domainID": "../../etc"}, "field 'domainID'"),
        ({**BASE, "domainID": UID.upper()}, "canonical lower-case"),
        ({k: v for k, v in BASE.items() if k != "domainID"}, "field 'domainID' is required"),
        ({**BASE, "allocationMode": "Some"}, "field 'allocationMode'"),
        ({**BASE, "apiVersion": "resource.nvidia.com/v1"}, "apiVersion must be"),
        ({**BASE, "kind": "GpuConfig"}, "unknown kind 'GpuConfig'"),
        ("not json", "not valid JSON"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_opaque_configs_fail_with_one_line_naming_the_field(raw: object, expected: str) -> None:
    with pytest.raises(OpaqueConfigError) as excinfo:
        decode_opaque_config(raw if isinstance(raw, str | dict) else str(raw))
    message = str(excinfo.value)
    assert expected in message
    assert "\n" not in message
