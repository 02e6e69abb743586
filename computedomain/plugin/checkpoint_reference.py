"""The reference driver's node checkpoint, read once when this node agent takes over a node.

Owns everything this project knows about the Go driver's `checkpoint.json`, which lives at the same path as
ours (`<plugins dir>/compute-domain.nvidia.com/checkpoint.json`), and its conversion into our `Checkpoint`
(`checkpoint.py`), so that claims the reference prepared can be replayed, guarded and unprepared by us.
Layouts understood (docs/design/0004-checkpoint.md shows each):

* **v2** (current): top level `checksum` (uint, covers `v1`), optional `version` ("v2"), `v1` (a downgrade
  copy of the completed claims) and `v2` `{checksum, preparedClaims, nodeBootID}`; every claim has
  `checkpointState` (`PrepareStarted`, `PrepareCompleted`, the tombstones `PrepareAborted` /
  `UnprepareCompleted`, or empty), `status` (the ResourceClaimStatus at Prepare time), `preparedDevices`,
  and optionally `name`, `namespace`, `abortedAt` / `unpreparedAt`. When `v2` is there it is the truth.
* **v1** only (older): `v1.preparedClaims{uid: {status, preparedDevices}}`, every claim completed.
* **25.3** (the release candidate layout the reference itself still converts): `v1.preparedClaims{uid:
  [group, ...]}`, devices in the kubelet's protobuf JSON shape (`request_names`, `pool_name`, ...).

A group of `preparedDevices` is `{"devices": [...], "configState": {"Type": "channel"|"daemon",
"ComputeDomain": "<CD UID>"}}`; a device is `{"channel": {"info": {"id": N}, "device": D}, "daemon": null}`
or the other way round, `D` = `{Requests, PoolName, DeviceName, CDIDeviceIDs}`.

What a converted claim records (our undo information, derived from what the reference did on Prepare): a
channel group is channel IDs (the one-holder guard) plus the node label `resource.nvidia.com/computeDomain=<CD
UID>` the reference set; a daemon group is the domain's `/imexd` directory `<plugin dir>/domains/<CD UID>`;
the claim's CDI spec is the reference's file `<CDI root>/k8s.compute-domain.nvidia.com-claim_<claim UID>.yaml`.
The devices are kept exactly as returned to the kubelet, so a repeated Prepare replays the reference's CDI
device IDs (the same names ours use). An empty `checkpointState` is taken as `PrepareStarted`: nothing is
assumed to be in place, everything known is undone.

Checks: the structure, field by field, with bounds (a claim UID is a Kubernetes UID, a domain ID a UUID, a
channel ID within 0..2^31); any violation is one `CheckpointCorruptError` naming the field. The reference's
checksums are FNV-32a over a Go-specific deep print of its structs and cannot be recomputed outside Go: they
are type-checked, not verified, and the log says so once per process. Unknown fields are ignored, as the
reference itself decodes its checkpoint leniently (newer releases add fields). No I/O here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.api.limits import brief
from computedomain.plugin.cdi import UID_PATTERN, spec_file_name
from computedomain.plugin.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointDevice,
    ClaimEntry,
    ClaimState,
    DeviceKind,
    NodeLabel,
    PreparedResource,
    claim_fingerprint,
)

log = logging.getLogger(__name__)

DOMAINS_DIR: Final = "domains"

LAYOUT_V2: Final = "v2"
LAYOUT_V1: Final = "v1"
LAYOUT_25_3: Final = "25.3"

MAX_CLAIMS: Final = 4096
MAX_GROUPS: Final = 64
MAX_DEVICES: Final = 4096
MAX_CHANNEL_ID: Final = 2**31 - 1
MAX_UINT64: Final = 2**64 - 1

_STATES: Final = {
    "PrepareStarted": ClaimState.PREPARE_STARTED,
    "": ClaimState.PREPARE_STARTED,
    "PrepareCompleted": ClaimState.PREPARE_COMPLETED,
    "PrepareAborted": ClaimState.PREPARE_ABORTED,
    "UnprepareCompleted": ClaimState.UNPREPARE_COMPLETED,
}
_KINDS: Final = {"channel": DeviceKind.CHANNEL, "daemon": DeviceKind.DAEMON}
# The kubelet's protobuf JSON (25.3) and the Go struct field names (v1/v2) of a returned device.
_DEVICE_FIELDS: Final = {
    LAYOUT_25_3: ("request_names", "pool_name", "device_name", "cdi_device_ids"),
    LAYOUT_V1: ("Requests", "PoolName", "DeviceName", "CDIDeviceIDs"),
}

_checksum_said = False


def is_reference(raw: Mapping[str, Any]) -> bool:
    """Whether a decoded `checkpoint.json` is the reference's: it has a `v1` or `v2` section or an integer
    `checksum`, and not our integer `version`."""
    version = raw.get("version")
    if isinstance(version, int) and not isinstance(version, bool):
        return False
    checksum = raw.get("checksum")
    return "v1" in raw or "v2" in raw or (isinstance(checksum, int) and not isinstance(checksum, bool))


class _Reader:
    """One conversion: the file's path (for messages and the plugin directory), the CDI root, the time."""

    def __init__(self, path: Path, cdi_root: Path | None, now: datetime) -> None:
        self.path = path
        self.cdi_root = cdi_root
        self.now = now

    def fail(self, where: str, problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(self.path, f"reference driver checkpoint: {where}: {problem}")

    def obj(self, value: Any, where: str, *, optional: bool = False) -> Mapping[str, Any]:
        if value is None and optional:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(where, f"expected an object, got {brief(value)}")
        return value

    def seq(self, value: Any, where: str, limit: int) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(where, f"expected a list, got {brief(value)}")
        if len(value) > limit:
            raise self.fail(where, f"{len(value)} items, more than the {limit} a node can hold")
        return value

    def text(self, value: Any, where: str, *, optional: bool = True) -> str:
        if value is None and optional:
            return ""
        if not isinstance(value, str) or len(value) > 1024 or not value.isprintable():
            raise self.fail(where, f"expected a short printable string, got {brief(value)}")
        return value

    def texts(self, value: Any, where: str) -> tuple[str, ...]:
        return tuple(self.text(v, f"{where}[{i}]", optional=False) for i, v in enumerate(self.seq(value, where, 64)))

    def uint(self, value: Any, where: str, limit: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise self.fail(where, f"expected an integer from 0 to {limit}, got {brief(value)}")
        return value

    def uid(self, value: str, where: str) -> str:
        if not UID_PATTERN.fullmatch(value):
            raise self.fail(where, f"{brief(value)} is not a Kubernetes UID")
        return value

    def domain(self, value: Any, where: str) -> str:
        text = self.text(value, where, optional=False)
        try:
            canonical = str(uuid.UUID(text))
        except ValueError:
            canonical = ""
        if canonical != text:
            raise self.fail(where, f"{brief(text)} is not a ComputeDomain UID")
        return text

    def time(self, value: Any, where: str) -> datetime | None:
        if value is None:
            return None
        text = self.text(value, where, optional=False)
        try:
            return datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise self.fail(where, f"{brief(text)} is not an RFC 3339 time") from None

    # -- the layouts

    def convert(self, raw: Mapping[str, Any]) -> tuple[Checkpoint, str]:
        version = raw.get("version")
        if version not in (None, "", "v1", "v2"):
            raise self.fail("version", f"{brief(version)} is newer than this node agent understands (v1, v2)")
        if "checksum" in raw:
            self.uint(raw["checksum"], "checksum", MAX_UINT64)
        if raw.get("v2") is not None:
            v2 = self.obj(raw["v2"], "v2")
            if "checksum" in v2:
                self.uint(v2["checksum"], "v2.checksum", MAX_UINT64)
            boot_id = self.text(v2.get("nodeBootID"), "v2.nodeBootID")
            claims = self.claims(v2.get("preparedClaims"), "v2.preparedClaims", LAYOUT_V2)
            return Checkpoint(boot_id=boot_id, claims=claims), LAYOUT_V2
        v1 = self.obj(raw.get("v1"), "v1", optional=True)
        prepared = self.obj(v1.get("preparedClaims"), "v1.preparedClaims", optional=True)
        layout = LAYOUT_25_3 if any(isinstance(v, list) for v in prepared.values()) else LAYOUT_V1
        return Checkpoint(claims=self.claims(prepared, "v1.preparedClaims", layout)), layout

    def claims(self, value: Any, where: str, layout: str) -> dict[str, ClaimEntry]:
        prepared = self.obj(value, where, optional=True)
        if len(prepared) > MAX_CLAIMS:
            raise self.fail(where, f"{len(prepared)} claims, more than the {MAX_CLAIMS} a node can hold")
        out: dict[str, ClaimEntry] = {}
        for uid, claim in prepared.items():
            at = f"{where}[{brief(uid)}]"
            self.uid(uid, at)
            out[uid] = self.claim(uid, claim, at, layout)
        return out

    def claim(self, uid: str, value: Any, where: str, layout: str) -> ClaimEntry:
        if layout == LAYOUT_25_3:
            body: Mapping[str, Any] = {"preparedDevices": value}
            if not isinstance(value, list):
                raise self.fail(where, f"expected a list of device groups, got {brief(value)}")
        else:
            body = self.obj(value, where)
        raw_state = body.get("checkpointState", "PrepareCompleted") if layout == LAYOUT_V2 else "PrepareCompleted"
        state = _STATES.get(raw_state) if isinstance(raw_state, str) else None
        if state is None:
            raise self.fail(f"{where}.checkpointState", f"unknown state {brief(raw_state)}")
        status = self.obj(body.get("status"), f"{where}.status", optional=True)
        resources: list[PreparedResource] = []
        devices: list[CheckpointDevice] = []
        groups = self.seq(body.get("preparedDevices"), f"{where}.preparedDevices", MAX_GROUPS)
        for g, group in enumerate(groups):
            resource, group_devices = self.group(group, f"{where}.preparedDevices[{g}]", layout)
            resources.append(resource)
            devices.extend(group_devices)
        claim_device = any("/claim=" in i for d in devices for i in d.cdi_device_ids)
        spec_files = (
            (str(self.cdi_root / spec_file_name(uid, reference=True)),)
            if self.cdi_root is not None and claim_device
            else ()
        )
        tombstoned = self.time(body.get("abortedAt") or body.get("unpreparedAt"), f"{where}.abortedAt")
        return ClaimEntry(
            uid=uid,
            namespace=self.text(body.get("namespace"), f"{where}.namespace"),
            name=self.text(body.get("name"), f"{where}.name"),
            state=state,
            fingerprint=claim_fingerprint(status) if status else "",
            resources=() if state.is_tombstone else tuple(resources),
            cdi_spec_files=() if state.is_tombstone else spec_files,
            devices=tuple(devices) if state is ClaimState.PREPARE_COMPLETED else (),
            started_at=self.now,
            updated_at=self.now,
            completed_at=self.now if state is ClaimState.PREPARE_COMPLETED else None,
            tombstoned_at=(tombstoned or self.now) if state.is_tombstone else None,
            note=f"taken over from the reference driver's checkpoint ({layout}, state {raw_state or 'unset'})",
        )

    def group(self, value: Any, where: str, layout: str) -> tuple[PreparedResource, list[CheckpointDevice]]:
        group = self.obj(value, where)
        config = self.obj(group.get("configState"), f"{where}.configState")
        type_ = config.get("Type")
        kind = _KINDS.get(type_) if isinstance(type_, str) else None
        if kind is None:
            raise self.fail(f"{where}.configState.Type", f"expected 'channel' or 'daemon', got {brief(type_)}")
        domain = self.domain(config.get("ComputeDomain"), f"{where}.configState.ComputeDomain")
        channels: list[int] = []
        devices: list[CheckpointDevice] = []
        for d, item in enumerate(self.seq(group.get("devices"), f"{where}.devices", MAX_DEVICES)):
            at = f"{where}.devices[{d}]"
            entry = self.obj(item, at)
            present = [k for k in ("channel", "daemon") if entry.get(k) is not None]
            if present != [kind.value]:
                raise self.fail(at, f"expected exactly one {kind.value!r} device, found {present or 'none'}")
            prepared = self.obj(entry[kind.value], f"{at}.{kind.value}")
            info = self.obj(prepared.get("info"), f"{at}.{kind.value}.info", optional=True)
            ident = self.uint(info.get("id", 0), f"{at}.{kind.value}.info.id", MAX_CHANNEL_ID)
            if kind is DeviceKind.CHANNEL:
                channels.append(ident)
            if prepared.get("device") is not None:
                devices.append(self.device(prepared["device"], f"{at}.{kind.value}.device", layout))
        if kind is DeviceKind.CHANNEL:
            resource = PreparedResource(
                kind=kind,
                domain_id=domain,
                channels=tuple(sorted(set(channels))) or (0,),
                node_label=NodeLabel(key=COMPUTE_DOMAIN_LABEL, value=domain),
            )
        else:
            resource = PreparedResource(
                kind=kind, domain_id=domain, domain_dir=str(self.path.parent / DOMAINS_DIR / domain)
            )
        return resource, devices

    def device(self, value: Any, where: str, layout: str) -> CheckpointDevice:
        device = self.obj(value, where)
        requests, pool, name, cdi_ids = _DEVICE_FIELDS[LAYOUT_25_3 if layout == LAYOUT_25_3 else LAYOUT_V1]
        share = device.get("ShareID")
        return CheckpointDevice(
            request_names=self.texts(device.get(requests), f"{where}.{requests}"),
            pool_name=self.text(device.get(pool), f"{where}.{pool}", optional=False),
            device_name=self.text(device.get(name), f"{where}.{name}", optional=False),
            cdi_device_ids=self.texts(device.get(cdi_ids), f"{where}.{cdi_ids}"),
            share_id=self.text(share, f"{where}.ShareID") or None if share is not None else None,
        )


def convert(raw: Mapping[str, Any], *, path: Path, cdi_root: Path | None, now: datetime) -> tuple[Checkpoint, str]:
    """Our checkpoint for the reference's file `raw` at `path`, and the layout it had (`v2`, `v1`, `25.3`).
    Raises `CheckpointCorruptError` naming the first field that does not fit. `cdi_root` None: the claims'
    CDI spec files are not recorded (their Unprepare then leaves the reference's spec file behind)."""
    global _checksum_said
    converted = _Reader(path, cdi_root, now).convert(raw)
    if not _checksum_said:
        _checksum_said = True
        log.warning(
            "reading the reference driver's checkpoint path=%s layout=%s: its checksums are FNV-32a over a Go deep "
            "print of its structs and cannot be recomputed outside Go; its structure was checked field by field "
            "instead",
            path,
            converted[1],
        )
    return converted
