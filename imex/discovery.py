"""Hardware discovery: what a node's NVIDIA driver says about IMEX, as plain data.

This module owns
- the data types every hardware source produces (driver version, per-GPU fabric info, device majors,
  the ``fabric-imex-mgmt`` capability),
- the two injected collaborators: ``FabricSource`` (NVML of the driver root; unit tests pass plain data) and
  ``ProcSource`` (the driver's ``/proc`` files), and the ``HardwareDiscovery`` view the node agent and the
  IMEX daemon use,
- the pure rules on top of them: driver version parsing and the ``>= 570.158.01`` requirement for DNS
  names (SPEC section 3 rule 6), and the clique-ID derivation from per-GPU fabric info (SPEC section 6),
- the error classes of the hardware side. Every message is one line.

No I/O happens here; ``imex.procfs``, ``imex.nvml`` and ``imex.driver_root`` do it. Everything is
synchronous: NVML and ``/proc`` reads are quick, and callers on an event loop wrap them in
``asyncio.to_thread``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import total_ordering
from typing import NewType, Protocol

from computedomain.api.limits import brief

CliqueID = NewType("CliqueID", str)
"""``<clusterUUID>.<cliqueId>``: the value of the ``nvidia.com/gpu.clique`` label."""

# Default of the nvidia.ko parameter NVreg_ImexChannelCount; also what the params file says on a stock driver.
DEFAULT_IMEX_CHANNEL_COUNT = 2048

ZERO_UUID = uuid.UUID(int=0)


# --------------------------------------------------------------------------------------------------------
# Errors


class HardwareError(Exception):
    """Base of everything this package raises about the node's hardware. Messages are one line."""

    def __init__(self, message: str) -> None:
        # A multi-line message breaks the one-line log/Event contract; flatten whatever we were given.
        super().__init__(" ".join(message.split()))


class DriverVersionError(HardwareError):
    """The driver version string could not be parsed."""


class DriverTooOldError(HardwareError):
    """The installed driver cannot run IMEX with DNS names."""


class FabricError(HardwareError):
    """NVLink fabric registration is incomplete or failed, or GPUs disagree about their clique."""


class FabricNotReadyError(FabricError):
    """A GPU's fabric registration has not completed (NOT_STARTED / IN_PROGRESS) in strict mode."""


class FabricInconsistentError(FabricError):
    """The GPUs of one node report different cluster UUIDs or clique IDs."""


class ProcFormatError(HardwareError):
    """A driver ``/proc`` file does not have the format we expect. The message names file and line."""


class DeviceNotFoundError(HardwareError):
    """A character device the driver should have registered is missing from ``/proc/devices``."""


class NvmlError(HardwareError):
    """NVML failed. ``code`` is the NVML return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnavailableError(NvmlError):
    """The NVML library is not installed or the driver is not loaded on this machine."""


# --------------------------------------------------------------------------------------------------------
# Driver version


_VERSION_RE = re.compile(r"^([0-9]{1,9})\.([0-9]{1,9})(?:\.([0-9]{1,9}))?$", re.ASCII)


@total_ordering
@dataclass(frozen=True, eq=False)
class DriverVersion:
    """An NVIDIA driver version such as ``580.159.04``. Compares numerically, field by field."""

    major: int
    minor: int
    patch: int = 0
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> DriverVersion:
        match = _VERSION_RE.match(text.strip())
        if match is None:
            raise DriverVersionError(
                f"cannot parse NVIDIA driver version {brief(text)}: want <major>.<minor>[.<patch>]"
            )
        major, minor, patch = match.groups()
        return cls(int(major), int(minor), int(patch or 0), text.strip())

    def _key(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DriverVersion):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __lt__(self, other: DriverVersion) -> bool:
        return self._key() < other._key()

    def __str__(self) -> str:
        # Keep the driver's own spelling ("570.158.01", not "570.158.1") so users recognise it.
        return self.text or f"{self.major}.{self.minor}.{self.patch:02d}"


MIN_DRIVER_FOR_DNS_NAMES = DriverVersion.parse("570.158.01")


def check_driver_for_dns_names(version: DriverVersion) -> None:
    """SPEC section 3 rule 6: IMEX with DNS names needs driver >= 570.158.01.

    The node agent calls this at start in driverManaged mode with IMEXDaemonsWithDNSNames on; older IMEX
    daemons do not re-resolve names on SIGUSR1, so the domain would silently never heal after an IP change.
    """
    if version < MIN_DRIVER_FOR_DNS_NAMES:
        raise DriverTooOldError(
            f"NVIDIA driver {version} is too old for feature gate IMEXDaemonsWithDNSNames "
            f"(needs >= {MIN_DRIVER_FOR_DNS_NAMES}): upgrade the driver, "
            "or set FEATURE_GATES=IMEXDaemonsWithDNSNames=false (which also needs ComputeDomainCliques=false)"
        )


# --------------------------------------------------------------------------------------------------------
# Fabric info and clique derivation


class FabricState(StrEnum):
    """NVML ``nvmlGpuFabricState_t``, by name. ``from_nvml`` maps the numeric value."""

    NOT_SUPPORTED = "NOT_SUPPORTED"
    NOT_STARTED = "NOT_STARTED"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"

    @classmethod
    def from_nvml(cls, value: int) -> FabricState:
        try:
            return _FABRIC_STATE_BY_NVML[value]
        except KeyError:
            raise FabricError(f"NVML reported unknown GPU fabric state {value}") from None


_FABRIC_STATE_BY_NVML = {
    0: FabricState.NOT_SUPPORTED,
    1: FabricState.NOT_STARTED,
    2: FabricState.IN_PROGRESS,
    3: FabricState.COMPLETED,
}


@dataclass(frozen=True)
class GpuFabricInfo:
    """One GPU's NVLink fabric registration, as NVML reports it.

    ``status_ok`` is the registration's own result (the struct's ``status`` field == NVML_SUCCESS);
    ``status_text`` says what it was otherwise. ``gpu`` names the GPU in messages (index or UUID).
    """

    gpu: str
    state: FabricState
    cluster_uuid: uuid.UUID = ZERO_UUID
    clique_id: int = 0
    status_ok: bool = True
    status_text: str = ""

    @classmethod
    def not_supported(cls, gpu: str) -> GpuFabricInfo:
        return cls(gpu=gpu, state=FabricState.NOT_SUPPORTED)


def derive_clique_id(infos: Sequence[GpuFabricInfo], *, crash_on_fabric_errors: bool) -> CliqueID | None:
    """The node's clique ID from its GPUs' fabric info, or None when the node is not on an MNNVL fabric.

    Per GPU, in this order (the order matters: a GPU still registering has an all-zero UUID, and checking
    the UUID first would turn "registration not finished" into "no fabric" and defeat the strict gate):
    - state NOT_SUPPORTED: no fabric on this GPU, skip it;
    - state NOT_STARTED / IN_PROGRESS: strict -> FabricNotReadyError; lenient -> skip;
    - COMPLETED with a failed status: strict -> FabricError; lenient -> skip;
    - COMPLETED with an all-zero cluster UUID: NVLink-capable but not MNNVL (upstream #864), skip;
    - otherwise the GPU contributes ``<clusterUUID>.<cliqueId>``.
    No GPU contributing -> None. GPUs contributing different values -> FabricInconsistentError: a node
    whose GPUs sit in two cliques cannot be placed in one IMEX domain.
    """
    found: dict[CliqueID, list[str]] = {}
    for info in infos:
        if info.state is FabricState.NOT_SUPPORTED:
            continue
        if info.state is not FabricState.COMPLETED:
            if crash_on_fabric_errors:
                raise FabricNotReadyError(
                    f"GPU {info.gpu}: NVLink fabric registration is {info.state} (not COMPLETED); refusing to "
                    "start because CrashOnNVLinkFabricErrors is on: check nvidia-fabricmanager / NVLink "
                    "health, or disable the gate to run without a clique"
                )
            continue
        if not info.status_ok:
            if crash_on_fabric_errors:
                raise FabricError(
                    f"GPU {info.gpu}: NVLink fabric registration failed ({info.status_text or 'error'}); "
                    "refusing to start because CrashOnNVLinkFabricErrors is on"
                )
            continue
        if info.cluster_uuid == ZERO_UUID:
            continue
        found.setdefault(CliqueID(f"{info.cluster_uuid}.{info.clique_id}"), []).append(info.gpu)
    if not found:
        return None
    if len(found) > 1:
        detail = "; ".join(f"{clique} on GPU {','.join(gpus)}" for clique, gpus in sorted(found.items()))
        raise FabricInconsistentError(f"GPUs of this node disagree about their NVLink clique: {detail}")
    return next(iter(found))


# --------------------------------------------------------------------------------------------------------
# /proc facts


@dataclass(frozen=True)
class CapabilityInfo:
    """An nvidia-caps capability file (``/proc/driver/nvidia/capabilities/<name>``).

    The device node for it is ``/dev/nvidia-caps/nvidia-cap<minor>`` with the ``nvidia-caps`` major.
    """

    name: str
    minor: int
    mode: int
    modify: int

    @property
    def device_path(self) -> str:
        return f"/dev/nvidia-caps/nvidia-cap{self.minor}"


def imex_channel_path(channel: int) -> str:
    """Container path of IMEX channel ``channel`` (a char device with the channels major, minor = channel)."""
    return f"/dev/nvidia-caps-imex-channels/channel{channel}"


# --------------------------------------------------------------------------------------------------------
# Injected collaborators


class FabricSource(Protocol):
    """Where the driver version and per-GPU fabric info come from: NVML (``imex.nvml``)."""

    def driver_version(self) -> DriverVersion: ...

    def gpu_fabric_infos(self) -> list[GpuFabricInfo]: ...


class ProcSource(Protocol):
    """The driver's ``/proc`` files (``imex.procfs.ProcFS`` against a real or fake root)."""

    def imex_channel_major(self) -> int: ...

    def nvidia_caps_major(self) -> int: ...

    def imex_channel_count(self) -> int: ...

    def fabric_imex_mgmt(self) -> CapabilityInfo | None: ...


class HardwareDiscovery(Protocol):
    """Everything the node agent and the IMEX daemon ask about the node's hardware."""

    def driver_version(self) -> DriverVersion: ...

    def clique_id(self, *, crash_on_fabric_errors: bool) -> CliqueID | None: ...

    def imex_channel_major(self) -> int: ...

    def nvidia_caps_major(self) -> int: ...

    def imex_channel_count(self) -> int: ...

    def fabric_imex_mgmt(self) -> CapabilityInfo | None: ...


class Discovery:
    """``HardwareDiscovery`` composed of a fabric source and a ``/proc`` source.

    Nothing is cached: the node agent refreshes the clique label periodically, and a driver reload can
    change majors, so every call reads afresh.
    """

    def __init__(self, fabric: FabricSource, proc: ProcSource) -> None:
        self._fabric = fabric
        self._proc = proc

    def driver_version(self) -> DriverVersion:
        return self._fabric.driver_version()

    def clique_id(self, *, crash_on_fabric_errors: bool) -> CliqueID | None:
        return derive_clique_id(self._fabric.gpu_fabric_infos(), crash_on_fabric_errors=crash_on_fabric_errors)

    def imex_channel_major(self) -> int:
        return self._proc.imex_channel_major()

    def nvidia_caps_major(self) -> int:
        return self._proc.nvidia_caps_major()

    def imex_channel_count(self) -> int:
        return self._proc.imex_channel_count()

    def fabric_imex_mgmt(self) -> CapabilityInfo | None:
        return self._proc.fabric_imex_mgmt()
