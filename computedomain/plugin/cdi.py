"""Per-claim CDI specs: how a prepared claim reaches the container.

The kubelet hands the container runtime the CDI device IDs we return from NodePrepareResources; the runtime
looks them up in the spec files of its CDI directories and applies their container edits. This module owns
those files for kind `k8s.compute-domain.nvidia.com/claim`: one JSON spec per claim,
`<cdi root>/k8s.compute-domain.nvidia.com-claim_<claim uid>.json`, one CDI device per prepared device,
named `<claim uid>-<device>` (e.g. `...-channel-0`).

- Channel devices get one character device node per IMEX channel
  (`/dev/nvidia-caps-imex-channels/channel<N>`, type `c`, the major of `nvidia-caps-imex-channels`, minor
  N, mode 0666): channel 0, or every channel in `All` mode. Nothing is created with mknod on the host; the
  runtime creates the node inside the container from type, major and minor.
- Daemon devices get the per-domain config directory bind-mounted at `/imexd`, the `CLIQUE_ID` and
  `COMPUTE_DOMAIN_*` environment, and on fabric nodes the `fabric-imex-mgmt` capability device node.

Building a spec is pure (`ClaimSpec` and the `*_edits` helpers); `CdiSpecDir` does the file I/O: atomic
writes (runtimes watch these directories and must never read half a file), removal, and listing our spec
files so that specs of claims the checkpoint does not know can be cleaned up. The reference driver names the
same spec `...-claim_<claim uid>.yaml`: such files (claims taken over from its checkpoint) are listed and
removed like ours, never written, and one is removed before ours of the same claim is written, so that no
device is ever defined by two files (a runtime refuses such a device).

`cdiVersion` is 0.5.0, the lowest version that allows device names starting with a digit (claim UIDs may);
nothing newer is used. The base spec (`.../device=all`, the driver's files for the IMEX daemons) is
`cdi_base`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from computedomain.atomic import fsync_dir, write_atomically

log = logging.getLogger(__name__)

CDI_VERSION: Final = "0.5.0"
CDI_VENDOR: Final = "k8s.compute-domain.nvidia.com"
CLAIM_CLASS: Final = "claim"
CLAIM_KIND: Final = f"{CDI_VENDOR}/{CLAIM_CLASS}"
# The base spec (cdi_base): daemon containers get nvidia-imex and the driver's files from it.
BASE_DEVICE_ID: Final = f"{CDI_VENDOR}/device=all"
DEFAULT_CDI_ROOT: Final = Path("/var/run/cdi")

IMEX_CHANNEL_DIR: Final = "/dev/nvidia-caps-imex-channels"
NVIDIA_CAPS_DIR: Final = "/dev/nvidia-caps"
CHANNEL_FILE_MODE: Final = 0o666
IMEXD_CONTAINER_PATH: Final = "/imexd"
IMEXD_MOUNT_OPTIONS: Final = ("rw", "nosuid", "nodev", "bind")

CHANNEL_DEVICE: Final = "channel-0"
DAEMON_DEVICE: Final = "daemon-0"

_SPEC_PREFIX: Final = f"{CDI_VENDOR}-{CLAIM_CLASS}_"
_SPEC_SUFFIX: Final = ".json"
REFERENCE_SPEC_SUFFIX: Final = ".yaml"
# Claim UIDs are UUIDs; anything else must not reach a file name or a CDI device name.
UID_PATTERN: Final = re.compile(r"^[0-9a-z]([0-9a-z-]{0,61}[0-9a-z])?$")
_UID = UID_PATTERN
# CDI device names: alphanumerics first and last, `-_.:` allowed between.
_CDI_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


class CdiError(ValueError):
    """Input that would produce an invalid CDI spec."""


def _check_uid(uid: str) -> str:
    if not _UID.fullmatch(uid):
        raise CdiError(f"claim UID {uid!r} is not a Kubernetes UID")
    return uid


# --- container edits (pure) --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceNode:
    path: str
    major: int
    minor: int
    file_mode: int = CHANNEL_FILE_MODE
    type: str = "c"

    def to_cdi(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "type": self.type,
            "major": self.major,
            "minor": self.minor,
            "fileMode": self.file_mode,
        }


@dataclass(frozen=True, slots=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()

    def to_cdi(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hostPath": self.host_path, "containerPath": self.container_path}
        if self.options:
            out["options"] = list(self.options)
        return out


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts)

    def to_cdi(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.env:
            out["env"] = list(self.env)
        if self.device_nodes:
            out["deviceNodes"] = [d.to_cdi() for d in self.device_nodes]
        if self.mounts:
            out["mounts"] = [m.to_cdi() for m in self.mounts]
        return out


@dataclass(frozen=True, slots=True)
class CapabilityDevice:
    """An NVIDIA capability device (`/proc/driver/nvidia/capabilities/...`), e.g. fabric-imex-mgmt."""

    major: int  # of `nvidia-caps` in /proc/devices
    minor: int  # DeviceFileMinor
    file_mode: int  # DeviceFileMode

    @property
    def path(self) -> str:
        return f"{NVIDIA_CAPS_DIR}/nvidia-cap{self.minor}"


def channel_device(index: int, *, isolated: bool = True) -> str:
    """The name of a published channel device: ``channel-0``; with channel isolation also ``channel-1`` ...,
    without it (each a further place for a claim on channel 0) ``channel-0-1`` ..."""
    if isolated or index == 0:
        return f"channel-{index}"
    return f"{CHANNEL_DEVICE}-{index}"


def channel_path(channel: int) -> str:
    return f"{IMEX_CHANNEL_DIR}/channel{channel}"


def channel_ids(all_channels: bool, channel_count: int) -> range:
    """Channel 0 (Single), or every channel the driver offers (All, `ImexChannelCount`)."""
    if channel_count < 1:
        raise CdiError(f"IMEX channel count must be positive, got {channel_count}")
    return range(channel_count) if all_channels else range(1)


def channel_edits(major: int, channels: Iterable[int]) -> ContainerEdits:
    """One character device node per IMEX channel; minor = channel ID."""
    if major < 0:
        raise CdiError(f"invalid device major {major}")
    nodes = tuple(DeviceNode(channel_path(c), major, c) for c in channels)
    if any(n.minor < 0 for n in nodes):
        raise CdiError("IMEX channel IDs must not be negative")
    return ContainerEdits(device_nodes=nodes)


def daemon_edits(
    *,
    domain_dir: Path,
    clique_id: str,
    domain_uid: str,
    domain_name: str,
    domain_namespace: str,
    fabric_imex_mgmt: CapabilityDevice | None,
) -> ContainerEdits:
    """What an IMEX daemon container of one domain gets: its config dir at /imexd, its identity as env,
    and (fabric nodes only) the capability device that lets nvidia-imex manage the fabric."""
    if not domain_dir.is_absolute():
        raise CdiError(f"domain directory {domain_dir} must be absolute")
    env = (
        f"CLIQUE_ID={clique_id}",
        f"COMPUTE_DOMAIN_UUID={domain_uid}",
        f"COMPUTE_DOMAIN_NAME={domain_name}",
        f"COMPUTE_DOMAIN_NAMESPACE={domain_namespace}",
    )
    nodes: tuple[DeviceNode, ...] = ()
    if fabric_imex_mgmt is not None:
        cap = fabric_imex_mgmt
        nodes = (DeviceNode(cap.path, cap.major, cap.minor, file_mode=cap.file_mode),)
    mount = Mount(str(domain_dir), IMEXD_CONTAINER_PATH, IMEXD_MOUNT_OPTIONS)
    return ContainerEdits(env=env, device_nodes=nodes, mounts=(mount,))


# --- specs (pure) ------------------------------------------------------------------------------------------


def device_name(claim_uid: str, device: str) -> str:
    name = f"{_check_uid(claim_uid)}-{device}"
    if not _CDI_NAME.fullmatch(name):
        raise CdiError(f"{name!r} is not a valid CDI device name")
    return name


def qualified_id(name: str) -> str:
    """The fully qualified CDI device ID the kubelet passes to the runtime."""
    return f"{CLAIM_KIND}={name}"


def spec_file_name(claim_uid: str, *, reference: bool = False) -> str:
    """Our spec file's name for the claim, or (`reference`) the name the reference driver gives it."""
    return f"{_SPEC_PREFIX}{_check_uid(claim_uid)}{REFERENCE_SPEC_SUFFIX if reference else _SPEC_SUFFIX}"


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """The CDI spec of one claim: device (e.g. `channel-0`) -> its edits. Devices without edits are left
    out, and a spec without devices is not written at all (a channel claim on a node without a clique)."""

    claim_uid: str
    edits: Mapping[str, ContainerEdits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for device in self.edits:
            device_name(self.claim_uid, device)  # validates both parts

    @property
    def file_name(self) -> str:
        return spec_file_name(self.claim_uid)

    @property
    def empty(self) -> bool:
        return all(e.empty for e in self.edits.values())

    def device_ids(self, device: str) -> tuple[str, ...]:
        """The CDI IDs to return to the kubelet for one device: none when it has no edits."""
        edits = self.edits.get(device)
        if edits is None or edits.empty:
            return ()
        return (qualified_id(device_name(self.claim_uid, device)),)

    def to_cdi(self) -> dict[str, Any]:
        return {
            "cdiVersion": CDI_VERSION,
            "kind": CLAIM_KIND,
            "devices": [
                {"name": device_name(self.claim_uid, device), "containerEdits": edits.to_cdi()}
                for device, edits in self.edits.items()
                if not edits.empty
            ],
        }


# --- files -------------------------------------------------------------------------------------------------


class CdiSpecDir:
    """Our claim spec files in one CDI directory (e.g. /var/run/cdi)."""

    def __init__(self, root: Path = DEFAULT_CDI_ROOT) -> None:
        self.root = root

    def path_for(self, claim_uid: str) -> Path:
        return self.root / spec_file_name(claim_uid)

    def write(self, spec: ClaimSpec) -> Path | None:
        """Write (or replace) the claim's spec atomically. Returns its path, or None for an empty spec,
        whose stale file, if any, is removed."""
        if spec.empty:
            self.remove(spec.claim_uid)
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        self._unlink(self.root / spec_file_name(spec.claim_uid, reference=True))
        path = self.path_for(spec.claim_uid)
        write_atomically(path, json.dumps(spec.to_cdi(), separators=(",", ":")) + "\n", mode=0o644)
        log.debug("wrote CDI spec claim=%s path=%s", spec.claim_uid, path)
        return path

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec (ours, and the reference driver's if there is one); True if there was one.
        Idempotent."""
        removed = [self._unlink(self.root / spec_file_name(claim_uid, reference=r)) for r in (False, True)]
        return any(removed)

    def _unlink(self, path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            fsync_dir(self.root)
        log.debug("removed CDI spec path=%s", path)
        return True

    def remove_recorded(self, recorded: str) -> bool:
        """Remove a spec file named in the checkpoint, but only one of ours directly in this directory. The
        checkpoint is a file on the host: a path in it that points elsewhere (edited, or written under
        another CDI_ROOT) is reported and left alone, never unlinked."""
        path = Path(recorded)
        uid = self._claim_uid(path.name)
        if path.parent != self.root or uid is None:
            log.warning("not removing a recorded CDI spec outside %s or not of ours path=%r", self.root, recorded[:200])
            return False
        return self.remove(uid)

    @staticmethod
    def _claim_uid(name: str) -> str | None:
        suffix = next((s for s in (_SPEC_SUFFIX, REFERENCE_SPEC_SUFFIX) if name.endswith(s)), None)
        if suffix is None or not name.startswith(_SPEC_PREFIX):
            return None
        uid = name[len(_SPEC_PREFIX) : -len(suffix)]
        return uid if _UID.fullmatch(uid) else None

    def list_claims(self) -> dict[str, Path]:
        """Claim UID -> spec file, for every claim spec of ours (or the reference driver's) in the directory."""
        if not self.root.is_dir():
            return {}
        out: dict[str, Path] = {}
        for path in self.root.iterdir():
            uid = self._claim_uid(path.name)
            if uid is not None:
                out[uid] = path
        return out

    def read(self, claim_uid: str) -> dict[str, Any] | None:
        """The parsed spec of a claim, or None (for diagnostics and tests)."""
        try:
            parsed: dict[str, Any] = json.loads(self.path_for(claim_uid).read_text())
        except FileNotFoundError:
            return None
        return parsed
