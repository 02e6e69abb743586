"""The /proc readers: strict formats, the real H200 values, defaults and errors naming file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from imex.discovery import DeviceNotFoundError, ProcFormatError
from imex.procfs import (
    ProcFS,
    lookup_major,
    parse_capability,
    parse_char_devices,
    parse_key_values,
    parse_params,
)
from tests.testbed.fake_driver_root import write_proc_files

# The real H200 file (driver 580.159.04), trimmed of unrelated devices; note 195 is shared by two names.
REAL_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
 10 misc
195 nvidia
195 nvidiactl
226 drm
238 nvidia-uvm
239 nvidia-nvswitch
240 nvidia-nvlink
241 nvidia-caps
242 nvidia-caps-imex-channels

Block devices:
  7 loop
  8 sd
259 blkext
"""


def test_real_devices_file_majors() -> None:
    devices = parse_char_devices(REAL_DEVICES, source="/proc/devices")
    assert lookup_major(devices, "nvidia-caps-imex-channels", source="x") == 242
    assert lookup_major(devices, "nvidia-caps", source="x") == 241
    assert devices["tty"] == [4]
    assert devices["nvidia"] == [195] and devices["nvidiactl"] == [195]
    assert "loop" not in devices  # block devices are a different namespace of majors


def test_block_device_names_do_not_leak_into_char_lookup() -> None:
    text = "Character devices:\n  1 mem\n\nBlock devices:\n242 nvidia-caps-imex-channels\n"
    devices = parse_char_devices(text, source="f")
    with pytest.raises(DeviceNotFoundError, match="no character device 'nvidia-caps-imex-channels'"):
        lookup_major(devices, "nvidia-caps-imex-channels", source="f")


def test_whole_name_match_only() -> None:
    """``nvidia-caps`` must not match the ``nvidia-caps-imex-channels`` line (or the reverse)."""
    devices = parse_char_devices("Character devices:\n242 nvidia-caps-imex-channels\n", source="f")
    with pytest.raises(DeviceNotFoundError):
        lookup_major(devices, "nvidia-caps", source="f")


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("Character devices:\n  1 mem\nabc nvidia-caps\n", 3),
        ("Character devices:\n  1 mem\n242\n", 3),
        ("Character devices:\n242 nvidia caps\n", 2),
        ("Character devices:\n99999 huge\n", 2),
    ],
)
def test_malformed_device_lines_name_file_and_line(text: str, line: int) -> None:
    with pytest.raises(ProcFormatError, match=rf"^/fake/proc/devices:{line}: "):
        parse_char_devices(text, source="/fake/proc/devices")


def test_missing_header_is_an_error() -> None:
    with pytest.raises(ProcFormatError, match="does not start with 'Character devices:'"):
        parse_char_devices("242 nvidia-caps-imex-channels\n", source="f")


def test_duplicate_registration_is_ambiguous() -> None:
    devices = parse_char_devices("Character devices:\n242 nvidia-caps\n243 nvidia-caps\n", source="f")
    with pytest.raises(ProcFormatError, match="listed 2 times"):
        lookup_major(devices, "nvidia-caps", source="f")


def test_params_real_values() -> None:
    params = parse_params(
        'ResmanDebugLevel: 4294967295\nRegistryDwords: ""\nImexChannelCount: 2048\nCreateImexChannel0: 0\n',
        source="params",
    )
    assert params.imex_channel_count == 2048
    assert params.create_imex_channel0 is False


# The whole params file of the real H200 (driver 580.159.04), as read in the GPU lane.
REAL_PARAMS = """ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
NvLinkDisable: 1
EnableGpuFirmware: 18
OpenRmEnableUnsupportedGpus: 1
DmaRemapPeerMmio: 1
ImexChannelCount: 2048
CreateImexChannel0: 0
GrdmaPciTopoCheckOverride: 0
CoherentGPUMemoryMode: ""
RegistryDwords: ""
RegistryDwordsPerDevice: ""
RmMsg: ""
GpuBlacklist: ""
TemporaryFilePath: ""
ExcludedGpus: ""
"""


def test_real_h200_params_file() -> None:
    params = parse_params(REAL_PARAMS, source="/proc/driver/nvidia/params")
    assert (params.imex_channel_count, params.create_imex_channel0) == (2048, False)


def test_params_without_channel_count_default_to_2048() -> None:
    assert parse_params("ModifyDeviceFiles: 1\n", source="p").imex_channel_count == 2048


def test_params_custom_count() -> None:
    assert parse_params("ImexChannelCount: 16\nCreateImexChannel0: 1\n", source="p").imex_channel_count == 16


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ImexChannelCount: lots\n", "ImexChannelCount is 'lots'"),
        ("ImexChannelCount: -1\n", "ImexChannelCount is '-1'"),
        ("ModifyDeviceFiles 1\n", r"^p:1: malformed line"),
        ("A: 1\nImexChannelCount: 2\nImexChannelCount: 3\n", r"^p:3: ImexChannelCount listed twice"),
    ],
)
def test_params_malformed(text: str, match: str) -> None:
    with pytest.raises(ProcFormatError, match=match):
        parse_params(text, source="p")


def test_capability_file() -> None:
    cap = parse_capability(
        "DeviceFileMinor: 4323\nDeviceFileMode: 256\nDeviceFileModify: 1\n", name="fabric-imex-mgmt", source="c"
    )
    assert (cap.minor, cap.mode, cap.modify) == (4323, 256, 1)


def test_capability_file_needs_minor() -> None:
    with pytest.raises(ProcFormatError, match="DeviceFileMinor and DeviceFileMode are required"):
        parse_capability("DeviceFileMode: 256\n", name="x", source="c")


def test_key_values_keep_quoted_values() -> None:
    assert parse_key_values('RmMsg: ""\nA: b c\n', source="p") == {"RmMsg": '""', "A": "b c"}


def test_procfs_against_fake_root_defaults_to_h200(tmp_path: Path) -> None:
    proc = ProcFS(write_proc_files(tmp_path))
    assert proc.imex_channel_major() == 242
    assert proc.nvidia_caps_major() == 241
    assert proc.imex_channel_count() == 2048
    assert proc.params().create_imex_channel0 is False
    cap = proc.fabric_imex_mgmt()
    assert cap is not None and cap.minor == 4323


def test_procfs_driver_without_imex(tmp_path: Path) -> None:
    root = write_proc_files(tmp_path, channels_major=None, imex_channel_count=None, fabric_imex_mgmt_minor=None)
    proc = ProcFS(root)
    with pytest.raises(DeviceNotFoundError, match=rf"{tmp_path}/proc/devices: no character device"):
        proc.imex_channel_major()
    assert proc.imex_channel_count() == 2048
    assert proc.fabric_imex_mgmt() is None


def test_procfs_missing_files(tmp_path: Path) -> None:
    proc = ProcFS(tmp_path)
    with pytest.raises(DeviceNotFoundError, match="file not found"):
        proc.imex_channel_major()
    with pytest.raises(DeviceNotFoundError, match="is the NVIDIA driver loaded"):
        proc.imex_channel_count()


def test_alternative_devices_path(tmp_path: Path) -> None:
    write_proc_files(tmp_path / "root")
    alt = tmp_path / "alt-devices"
    alt.write_text("Character devices:\n235 nvidia-caps-imex-channels\n236 nvidia-caps\n")
    proc = ProcFS(tmp_path / "root", devices_path=alt)
    assert proc.imex_channel_major() == 235


def test_non_utf8_file_is_a_format_error(tmp_path: Path) -> None:
    root = write_proc_files(tmp_path)
    (root / "proc/devices").write_bytes(b"Character devices:\n\xff\xfe\n")
    with pytest.raises(ProcFormatError, match="not UTF-8"):
        ProcFS(root).imex_channel_major()
