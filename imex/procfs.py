"""Readers of the NVIDIA driver's ``/proc`` files, strict about their format.

This module owns
- ``/proc/devices`` (character-device section only): the majors of ``nvidia-caps-imex-channels`` (IMEX
  channel nodes) and ``nvidia-caps`` (capability nodes such as ``fabric-imex-mgmt``);
- ``/proc/driver/nvidia/params``: ``ImexChannelCount`` (2048 when the driver does not list it) and
  ``CreateImexChannel0``;
- ``/proc/driver/nvidia/capabilities/fabric-imex-mgmt``: ``DeviceFileMinor`` / ``DeviceFileMode`` /
  ``DeviceFileModify``.

Every path is relative to an injectable root (``PROC_ROOT``'s parent), so test nodes point it at their fake
driver root's ``proc/``. A malformed file is an error naming the file and line:
a wrong major silently injects the wrong device into every workload, so guessing is worse than failing.
Reads are synchronous and cheap; nothing is cached (a driver reload may change majors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from computedomain.api.limits import brief
from imex.discovery import (
    DEFAULT_IMEX_CHANNEL_COUNT,
    CapabilityInfo,
    DeviceNotFoundError,
    ProcFormatError,
)

IMEX_CHANNELS_DEVICE = "nvidia-caps-imex-channels"
NVIDIA_CAPS_DEVICE = "nvidia-caps"
FABRIC_IMEX_MGMT = "fabric-imex-mgmt"

PROC_DEVICES = "proc/devices"
PROC_PARAMS = "proc/driver/nvidia/params"
PROC_CAPABILITIES = "proc/driver/nvidia/capabilities"

# Linux char majors are 12 bits (MAJOR() of a dev_t); anything larger is a corrupt file.
_MAX_MAJOR = (1 << 12) - 1
# Minors are 20 bits: an IMEX channel N is minor N, so no driver offers more channels than this.
_MINOR_BITS = 20
MAX_IMEX_CHANNEL_COUNT = 1 << _MINOR_BITS
# Flags the driver prints as unsigned 32-bit values.
_U32_MAX = (1 << 32) - 1

# ASCII only: `\d` also matches other scripts' digits, which `int` would accept. Digit counts are bounded so
# a corrupt file is a format error, not a 5,000-digit int.
_DEVICE_LINE = re.compile(r"^\s*([0-9]{1,7}) (\S+)$", re.ASCII)
_KEY_VALUE_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*):[ \t]*(.*)$", re.ASCII)
_DECIMAL = re.compile(r"[0-9]{1,10}", re.ASCII)


# --------------------------------------------------------------------------------------------------------
# Pure parsers (text in, data out)


def parse_char_devices(text: str, *, source: str) -> dict[str, list[int]]:
    """Name -> majors of the ``Character devices:`` section of a ``/proc/devices`` text.

    The block-device section and anything after it is ignored. A name can in principle be registered
    under several majors, so each maps to a list; ``lookup_major`` insists on exactly one.
    """
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None or lines[first].strip() != "Character devices:":
        raise ProcFormatError(f"{source}: does not start with 'Character devices:'")
    devices: dict[str, list[int]] = {}
    for number, line in enumerate(lines[first + 1 :], start=first + 2):
        if line.strip() == "":
            # A blank line ends the section; only the block-device header may follow it.
            continue
        if line.strip() == "Block devices:":
            break
        match = _DEVICE_LINE.match(line)
        if match is None:
            raise ProcFormatError(f"{source}:{number}: malformed character-device line {brief(line)}")
        major = int(match.group(1))
        if major > _MAX_MAJOR:
            raise ProcFormatError(f"{source}:{number}: major {major} out of range in {brief(line)}")
        devices.setdefault(match.group(2), []).append(major)
    return devices


def lookup_major(devices: dict[str, list[int]], name: str, *, source: str) -> int:
    majors = devices.get(name, [])
    if not majors:
        raise DeviceNotFoundError(
            f"{source}: no character device {name!r}: is the NVIDIA driver loaded, and new enough for IMEX?"
        )
    if len(majors) > 1:
        raise ProcFormatError(f"{source}: character device {name!r} listed {len(majors)} times ({majors})")
    return majors[0]


def parse_key_values(text: str, *, source: str) -> dict[str, str]:
    """``Key: value`` lines, as in the driver's params and capability files. Quotes are kept as-is."""
    values: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip() == "":
            continue
        match = _KEY_VALUE_LINE.match(line.rstrip())
        if match is None:
            raise ProcFormatError(f"{source}:{number}: malformed line {brief(line)}, want 'Key: value'")
        key, value = match.groups()
        if key in values:
            raise ProcFormatError(f"{source}:{number}: {key} listed twice")
        values[key] = value
    return values


def _int_value(values: dict[str, str], key: str, *, source: str, maximum: int) -> int | None:
    raw = values.get(key)
    if raw is None:
        return None
    if not _DECIMAL.fullmatch(raw) or int(raw) > maximum:
        raise ProcFormatError(f"{source}: {key} is {brief(raw)}, want a decimal integer from 0 to {maximum}")
    return int(raw)


@dataclass(frozen=True)
class DriverParams:
    """The parts of ``/proc/driver/nvidia/params`` that matter for IMEX."""

    imex_channel_count: int
    create_imex_channel0: bool


def parse_params(text: str, *, source: str) -> DriverParams:
    values = parse_key_values(text, source=source)
    count = _int_value(values, "ImexChannelCount", source=source, maximum=MAX_IMEX_CHANNEL_COUNT)
    create0 = _int_value(values, "CreateImexChannel0", source=source, maximum=_U32_MAX)
    return DriverParams(
        # Drivers that predate the parameter behave like the default.
        imex_channel_count=DEFAULT_IMEX_CHANNEL_COUNT if count is None else count,
        create_imex_channel0=bool(create0),
    )


def parse_capability(text: str, *, name: str, source: str) -> CapabilityInfo:
    values = parse_key_values(text, source=source)
    minor = _int_value(values, "DeviceFileMinor", source=source, maximum=(1 << _MINOR_BITS) - 1)
    mode = _int_value(values, "DeviceFileMode", source=source, maximum=0o7777)
    modify = _int_value(values, "DeviceFileModify", source=source, maximum=_U32_MAX)
    if minor is None or mode is None:
        raise ProcFormatError(f"{source}: DeviceFileMinor and DeviceFileMode are required")
    return CapabilityInfo(name=name, minor=minor, mode=mode, modify=1 if modify is None else modify)


# --------------------------------------------------------------------------------------------------------
# The ProcSource implementation


class ProcFS:
    """``imex.discovery.ProcSource`` reading files under ``root`` (``/`` on a real node).

    ``devices_path`` overrides where ``/proc/devices`` is read from (upstream's ALT_PROC_DEVICES_PATH:
    a container's ``/proc/devices`` is the host's, but test beds substitute a file).
    """

    def __init__(self, root: Path = Path("/"), *, devices_path: Path | None = None) -> None:
        self.root = root
        self.devices_path = devices_path or root / PROC_DEVICES

    def _read(self, path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ProcFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None

    def char_devices(self) -> dict[str, list[int]]:
        try:
            text = self._read(self.devices_path)
        except FileNotFoundError:
            raise DeviceNotFoundError(f"{self.devices_path}: file not found") from None
        return parse_char_devices(text, source=str(self.devices_path))

    def imex_channel_major(self) -> int:
        return lookup_major(self.char_devices(), IMEX_CHANNELS_DEVICE, source=str(self.devices_path))

    def nvidia_caps_major(self) -> int:
        return lookup_major(self.char_devices(), NVIDIA_CAPS_DEVICE, source=str(self.devices_path))

    def params(self) -> DriverParams:
        path = self.root / PROC_PARAMS
        try:
            text = self._read(path)
        except FileNotFoundError:
            raise DeviceNotFoundError(f"{path}: file not found: is the NVIDIA driver loaded?") from None
        return parse_params(text, source=str(path))

    def imex_channel_count(self) -> int:
        return self.params().imex_channel_count

    def capability(self, name: str) -> CapabilityInfo | None:
        path = self.root / PROC_CAPABILITIES / name
        try:
            text = self._read(path)
        except FileNotFoundError:
            return None
        return parse_capability(text, name=name, source=str(path))

    def fabric_imex_mgmt(self) -> CapabilityInfo | None:
        return self.capability(FABRIC_IMEX_MGMT)
