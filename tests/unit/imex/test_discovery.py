"""Driver version rule and clique derivation (pure rules; the NVML source against the mock library is test_nvml)."""

from __future__ import annotations

import uuid

import pytest

from imex.discovery import (
    ZERO_UUID,
    DriverTooOldError,
    DriverVersion,
    DriverVersionError,
    FabricError,
    FabricInconsistentError,
    FabricNotReadyError,
    FabricState,
    GpuFabricInfo,
    check_driver_for_dns_names,
    derive_clique_id,
)

UUID_A = uuid.UUID("6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40")
UUID_B = uuid.UUID("0b7a4c3e-9d21-4f6a-8c55-3e2d1f0a9b88")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("580.159.04", (580, 159, 4)),
        ("570.158.01", (570, 158, 1)),
        (" 535.104.05\n", (535, 104, 5)),
        ("560.35", (560, 35, 0)),
    ],
)
def test_driver_version_parses(text: str, expected: tuple[int, int, int]) -> None:
    version = DriverVersion.parse(text)
    assert (version.major, version.minor, version.patch) == expected
    assert str(version) == text.strip()


@pytest.mark.parametrize("text", ["", "580", "580.x.04", "v580.159.04", "580.159.04.1", "580..04"])
def test_driver_version_rejects_garbage(text: str) -> None:
    with pytest.raises(DriverVersionError, match="cannot parse"):
        DriverVersion.parse(text)


def test_driver_versions_compare_numerically_not_as_strings() -> None:
    assert DriverVersion.parse("570.158.01") < DriverVersion.parse("570.172.08")
    assert DriverVersion.parse("570.99.99") < DriverVersion.parse("570.158.01")  # "99" > "158" as strings
    assert DriverVersion.parse("1000.1.1") > DriverVersion.parse("999.999.99")
    assert DriverVersion.parse("570.158.1") == DriverVersion.parse("570.158.01")


@pytest.mark.parametrize("text", ["570.158.01", "570.172.08", "580.159.04", "571.0"])
def test_dns_names_accept_new_enough_driver(text: str) -> None:
    check_driver_for_dns_names(DriverVersion.parse(text))


@pytest.mark.parametrize("text", ["570.148.08", "570.158.00", "565.57.01", "550.163.01"])
def test_dns_names_reject_old_driver_with_one_line_fix(text: str) -> None:
    with pytest.raises(DriverTooOldError) as info:
        check_driver_for_dns_names(DriverVersion.parse(text))
    message = str(info.value)
    assert "\n" not in message
    assert text in message and "570.158.01" in message
    assert "upgrade the driver" in message and "IMEXDaemonsWithDNSNames=false" in message


def gpu(
    state: FabricState,
    cluster: uuid.UUID = UUID_A,
    clique: int = 1,
    ok: bool = True,
    name: str = "0",
) -> GpuFabricInfo:
    return GpuFabricInfo(gpu=name, state=state, cluster_uuid=cluster, clique_id=clique, status_ok=ok)


C = FabricState.COMPLETED
NS = FabricState.NOT_SUPPORTED
NST = FabricState.NOT_STARTED
IP = FabricState.IN_PROGRESS

CLIQUE_TABLE = [
    # id, infos, strict result, lenient result (a type means "raises")
    ("no gpus", [], None, None),
    ("real H200: not supported, zero uuid, clique 0", [gpu(NS, ZERO_UUID, 0)], None, None),
    ("completed", [gpu(C), gpu(C, name="1")], f"{UUID_A}.1", f"{UUID_A}.1"),
    ("completed clique 0 is a clique", [gpu(C, clique=0)], f"{UUID_A}.0", f"{UUID_A}.0"),
    ("completed but zero uuid: NVLink without MNNVL", [gpu(C, ZERO_UUID, 7)], None, None),
    ("not started", [gpu(NST, ZERO_UUID, 0)], FabricNotReadyError, None),
    ("in progress", [gpu(IP)], FabricNotReadyError, None),
    ("in progress next to completed", [gpu(C), gpu(IP, name="1")], FabricNotReadyError, f"{UUID_A}.1"),
    ("completed with failed status", [gpu(C, ok=False)], FabricError, None),
    ("unsupported gpu ignored", [gpu(NS, ZERO_UUID, 0), gpu(C, name="1")], f"{UUID_A}.1", f"{UUID_A}.1"),
    (
        "clique ids disagree",
        [gpu(C, clique=1), gpu(C, clique=2, name="1")],
        FabricInconsistentError,
        FabricInconsistentError,
    ),
    (
        "cluster uuids disagree",
        [gpu(C, UUID_A), gpu(C, UUID_B, name="1")],
        FabricInconsistentError,
        FabricInconsistentError,
    ),
]


@pytest.mark.parametrize(
    ("infos", "strict", "lenient"), [row[1:] for row in CLIQUE_TABLE], ids=[row[0] for row in CLIQUE_TABLE]
)
def test_clique_derivation(infos: list[GpuFabricInfo], strict: object, lenient: object) -> None:
    for crash, expected in ((True, strict), (False, lenient)):
        if isinstance(expected, type):
            with pytest.raises(expected) as info:
                derive_clique_id(infos, crash_on_fabric_errors=crash)
            assert "\n" not in str(info.value)
        else:
            assert derive_clique_id(infos, crash_on_fabric_errors=crash) == expected


def test_uuid_is_canonical_lowercase_and_clique_decimal() -> None:
    upper = uuid.UUID("6F1C2A52-0D4E-4B5E-9A77-5C3E0C1D2F40")
    assert derive_clique_id([gpu(C, upper, 4294967295)], crash_on_fabric_errors=True) == (
        "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.4294967295"
    )


def test_disagreement_message_names_the_gpus() -> None:
    with pytest.raises(FabricInconsistentError, match=r"\.1 on GPU 0,1; .*\.2 on GPU 2"):
        derive_clique_id([gpu(C, name="0"), gpu(C, name="1"), gpu(C, clique=2, name="2")], crash_on_fabric_errors=True)


def test_strict_error_tells_how_to_proceed() -> None:
    with pytest.raises(FabricNotReadyError, match=r"GPU 3: .*IN_PROGRESS.*CrashOnNVLinkFabricErrors"):
        derive_clique_id([gpu(IP, name="3")], crash_on_fabric_errors=True)


def test_fabric_state_from_nvml_numbers() -> None:
    assert [FabricState.from_nvml(n) for n in range(4)] == [NS, NST, IP, C]
    with pytest.raises(FabricError, match="unknown GPU fabric state 9"):
        FabricState.from_nvml(9)
