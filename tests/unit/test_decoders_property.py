"""Every decoder of outside input, fed arbitrary and almost-valid input by hypothesis: each ends in a value
or in its own one-line error naming the field, never in another exception.

Covered: opaque configs and claim allocations (claims are written by tenants), settings (env and flags),
the driver's /proc files, the checkpoint file, the CDI spec paths recorded in it, nvidia-imex-ctl output
(host check and daemon probe), imexd.cfg and hosts files, NVML fabric info to clique IDs, and other daemons'
clique entries to the hosts-file mapping.

Seeds: the `ci` profile (tests/conftest.py) derandomizes, so every run tries the same examples and a failure
replays as is; `HYPOTHESIS_PROFILE=explore` searches further with a random seed that hypothesis prints on a
failure (replay with `--hypothesis-seed=N`), together with the failing example and a `@reproduce_failure`
blob.
"""

from __future__ import annotations

import asyncio
import json
import re
import string
import tempfile
import uuid
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from computedomain.api.constants import DRIVER_NAME, GROUP_VERSION
from computedomain.api.models import (
    ComputeDomainChannelConfig,
    OpaqueConfigError,
    decode_opaque_config,
)
from computedomain.plugin.cdi import CdiSpecDir, spec_file_name
from computedomain.plugin.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimState,
    _checksum,
    decode,
    dumps,
    loads,
)
from computedomain.plugin.opaque import ConfigError, resolve
from computedomain.settings import ControllerSettings, PluginSettings, SettingsError, flag_name, load_settings
from imex.config import ImexConfig, ImexConfigError, hostname_prefix
from imex.daemon.check import check
from imex.daemon.peers import peer_view
from imex.daemon.registration import CliqueBackend
from imex.daemon.settings import DaemonSettings
from imex.discovery import (
    ZERO_UUID,
    DeviceNotFoundError,
    DriverVersion,
    DriverVersionError,
    FabricError,
    FabricState,
    GpuFabricInfo,
    ProcFormatError,
    derive_clique_id,
)
from imex.host_check import CommandResult, HostImexNotReadyError, ImexState, check_host_imex_ready
from imex.hosts_file import parse_hosts, slot_entries
from imex.procfs import (
    IMEX_CHANNELS_DEVICE,
    MAX_IMEX_CHANNEL_COUNT,
    NVIDIA_CAPS_DEVICE,
    lookup_major,
    parse_capability,
    parse_char_devices,
    parse_params,
)
from tests.testbed import reference as reference_state
from tests.testbed.reference import RefClaim

MAX_MESSAGE = 1200


def one_line(exc: BaseException, *names: str) -> str:
    """The error is one bounded line that names one of `names` (the field, setting or file)."""
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    assert len(text) <= MAX_MESSAGE, len(text)
    assert any(name in text for name in names), text
    return text


# --- strategies --------------------------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=24)
)
JSON: st.SearchStrategy[Any] = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=12,
)
UUIDS = st.uuids().map(str)
# Arabic-Indic, full-width and superscript digits: what `\d` and `int` accept beyond ASCII.
DIGITS = st.text(alphabet="0123456789\u0663\uff13\u00b2 -+.eE", max_size=12)


def near_opaque_config() -> st.SearchStrategy[dict[str, Any]]:
    known = st.fixed_dictionaries(
        {},
        optional={
            "apiVersion": st.sampled_from([GROUP_VERSION, "resource.nvidia.com/v1", ""]) | JSON,
            "kind": st.sampled_from(["ComputeDomainChannelConfig", "ComputeDomainDaemonConfig", "Other"]) | JSON,
            "domainID": UUIDS | UUIDS.map(str.upper) | st.text(max_size=40) | JSON,
            "allocationMode": st.sampled_from(["Single", "All", "all", None]) | JSON,
        },
    )
    extra = st.dictionaries(st.text(max_size=10), JSON, max_size=2)
    return st.builds(lambda a, b: {**b, **a}, known, extra)


OPAQUE = near_opaque_config()


# --- opaque configs and allocations ------------------------------------------------------------------------


@given(OPAQUE | JSON | st.text(max_size=60) | st.binary(max_size=60) | OPAQUE.map(json.dumps))
def test_opaque_config_decoder(raw: Any) -> None:
    try:
        config = decode_opaque_config(raw)
    except OpaqueConfigError as exc:
        one_line(exc, "opaque config", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig")
    else:
        assert str(uuid.UUID(config.domain_id)) == config.domain_id
        if isinstance(config, ComputeDomainChannelConfig):
            assert config.allocation_mode in (None, "Single", "All")


RESULT = st.fixed_dictionaries(
    {
        "request": st.sampled_from(["channel", "daemon", "channel/sub"]) | JSON,
        "driver": st.sampled_from([DRIVER_NAME, "gpu.nvidia.com"]) | JSON,
        "pool": st.just("gb-1") | JSON,
        "device": st.sampled_from(["channel-0", "daemon-0", "channel-x", "gpu-0"]) | JSON,
    },
    optional={"adminAccess": JSON},
)
CONFIG = st.fixed_dictionaries(
    {
        "source": st.sampled_from(["FromClass", "FromClaim"]) | JSON,
        "opaque": st.fixed_dictionaries({"driver": st.sampled_from([DRIVER_NAME, "x"]), "parameters": OPAQUE | JSON})
        | JSON,
    },
    optional={"requests": st.lists(st.sampled_from(["channel", "daemon"]), max_size=2) | JSON},
)
ALLOCATION = (
    st.fixed_dictionaries(
        {},
        optional={
            "devices": st.fixed_dictionaries(
                {},
                optional={
                    "results": st.lists(RESULT | JSON, max_size=3) | JSON,
                    "config": st.lists(CONFIG | JSON, max_size=3) | JSON,
                },
            )
            | JSON
        },
    )
    | JSON
)


@given(ALLOCATION)
def test_claim_allocation_resolver(allocation: Any) -> None:
    try:
        resolved = resolve(allocation)
    except ConfigError as exc:
        one_line(exc, "allocation", "device", "claim")
    else:
        assert resolved and all(r.device.kind.value in r.device.device for r in resolved)


# --- settings ----------------------------------------------------------------------------------------------

CLASSES = (ControllerSettings, PluginSettings, DaemonSettings)
ENVS = sorted({f.metadata["env"] for cls in CLASSES for f in fields(cls) if "env" in f.metadata})
VALUES = (
    st.text(max_size=30)
    | DIGITS
    | st.sampled_from(["", "0", "-1", "1e400", "nan", "inf", "true", "hostManaged", "/x", "//x", ":80", "a.1"])
    | st.sampled_from(["HostManagedIMEXDaemon=true,", "IMEXDaemonsWithDNSNames=false", str(uuid.UUID(int=1))])
    # The reference's Go forms: durations, ParseBool values, klog verbosities.
    | st.sampled_from(["15s", "1m30s", ".5h", "500ms", "7", "IMEXDaemonsWithDNSNames=t", "ComputeDomainCliques=0"])
)


@given(
    cls=st.sampled_from(CLASSES),
    env=st.dictionaries(st.sampled_from(ENVS), VALUES, max_size=6),
    argv=st.lists(st.sampled_from([flag_name(e) for e in ENVS]) | VALUES, max_size=4),
)
def test_settings_decoder(cls: type[ControllerSettings], env: dict[str, str], argv: list[str]) -> None:
    try:
        settings = load_settings(cls, argv, environ=env)
        if isinstance(settings, DaemonSettings):
            settings.validate_for_run()
    except SettingsError as exc:
        one_line(exc, *ENVS, "flag", "argument")


# --- /proc -------------------------------------------------------------------------------------------------

DEVICE_LINE = st.builds(
    lambda n, name: f"{n} {name}",
    st.integers(-1, 10**6).map(str) | DIGITS,
    st.sampled_from([IMEX_CHANNELS_DEVICE, NVIDIA_CAPS_DEVICE, "mem"]) | st.text(max_size=8),
)
DEVICES_TEXT = st.builds(
    lambda header, lines: header + "\n".join(lines),
    st.sampled_from(["Character devices:\n", "", "Block devices:\n"]),
    st.lists(DEVICE_LINE | st.text(max_size=12) | st.sampled_from(["", "Block devices:", "  1 mem"]), max_size=6),
)
KEYS = ["ImexChannelCount", "CreateImexChannel0", "DeviceFileMinor", "DeviceFileMode", "DeviceFileModify"]
KEY_VALUE_TEXT = st.lists(
    st.builds(
        lambda k, v: f"{k}: {v}",
        st.sampled_from(KEYS) | st.text(max_size=8),
        st.integers(-1, 2**40).map(str) | DIGITS | st.text(max_size=10),
    )
    | st.text(max_size=12),
    max_size=6,
).map("\n".join)


@given(DEVICES_TEXT | st.text(max_size=80))
def test_proc_devices_decoder(text: str) -> None:
    try:
        devices = parse_char_devices(text, source="proc/devices")
        major = lookup_major(devices, IMEX_CHANNELS_DEVICE, source="proc/devices")
    except (ProcFormatError, DeviceNotFoundError) as exc:
        one_line(exc, "proc/devices")
    else:
        assert 0 <= major < 4096


@given(KEY_VALUE_TEXT | st.text(max_size=80))
def test_proc_params_and_capability_decoders(text: str) -> None:
    try:
        params = parse_params(text, source="params")
    except ProcFormatError as exc:
        one_line(exc, "params")
    else:
        assert 0 <= params.imex_channel_count <= MAX_IMEX_CHANNEL_COUNT
    try:
        cap = parse_capability(text, name="fabric-imex-mgmt", source="capability")
    except ProcFormatError as exc:
        one_line(exc, "capability")
    else:
        assert 0 <= cap.minor < 1 << 20 and 0 <= cap.mode <= 0o7777


@given(st.text(max_size=30) | st.builds(lambda a, b, c: f"{a}.{b}.{c}", DIGITS, DIGITS, DIGITS))
def test_driver_version_decoder(text: str) -> None:
    try:
        version = DriverVersion.parse(text)
    except DriverVersionError as exc:
        one_line(exc, "driver version")
    else:
        assert version.major >= 0 and str(version)


# --- the checkpoint ----------------------------------------------------------------------------------------

PATH = Path("/var/lib/kubelet/plugins/compute-domain.nvidia.com/checkpoint.json")
TIMES = st.datetimes(timezones=st.just(UTC)).map(datetime.isoformat)
ENTRY = st.fixed_dictionaries(
    {
        "uid": UUIDS | JSON,
        "namespace": st.text(max_size=8),
        "name": st.text(max_size=8),
        "state": st.sampled_from([s.value for s in ClaimState]) | JSON,
        "startedAt": TIMES | JSON,
        "updatedAt": TIMES,
    },
    optional={
        "cdiSpecFiles": st.lists(st.text(max_size=20), max_size=2) | JSON,
        "resources": st.lists(
            st.fixed_dictionaries(
                {"kind": st.sampled_from(["channel", "daemon"]) | JSON, "domainID": UUIDS},
                optional={"channels": st.lists(st.integers(-1, 5), max_size=2) | JSON, "domainDir": JSON},
            ),
            max_size=2,
        )
        | JSON,
        "devices": JSON,
        "tombstonedAt": TIMES | JSON,
    },
)
PAYLOAD = st.fixed_dictionaries(
    {"bootID": st.text(max_size=8) | JSON},
    optional={"claims": st.dictionaries(st.text(max_size=8), ENTRY | JSON, max_size=3)},
)


def _signed(payload: dict[str, Any], version: Any) -> str:
    return json.dumps({"version": version, "checksum": _checksum(payload), **payload})


@given(st.text(max_size=120) | JSON.map(json.dumps) | st.builds(_signed, PAYLOAD, st.just(1) | JSON))
def test_checkpoint_loader(text: str) -> None:
    try:
        checkpoint = loads(text, PATH)
    except CheckpointCorruptError as exc:
        one_line(exc, "checkpoint")
    else:
        assert isinstance(checkpoint, Checkpoint)
        assert loads(dumps(checkpoint), PATH) == checkpoint


NAMES = st.text(alphabet=string.ascii_lowercase + string.digits + "-.", max_size=12)
# The reference driver's layouts, valid as tests/testbed/reference.py builds them, then one value anywhere in
# the document replaced by arbitrary JSON (or left alone).
REF_CLAIM = st.builds(
    RefClaim,
    uid=UUIDS,
    domain=UUIDS,
    node=NAMES.filter(bool),
    kind=st.sampled_from(["channel", "daemon"]),
    state=st.sampled_from(["PrepareStarted", "PrepareCompleted", "PrepareAborted", "UnprepareCompleted", ""]),
    name=NAMES,
    namespace=NAMES,
    channels=st.lists(st.integers(0, 2047), min_size=1, max_size=3),
)
REF_DOC = st.tuples(
    st.sampled_from([reference_state.checkpoint_v2, reference_state.checkpoint_v1, reference_state.checkpoint_25_3]),
    st.lists(REF_CLAIM, max_size=3, unique_by=lambda c: c.uid),
).map(lambda made: made[0](made[1]))


def _paths(doc: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*here, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*here, i))
    return out


@given(REF_DOC, st.data())
def test_reference_checkpoint_loader(doc: dict[str, Any], data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(_paths(doc)) | st.none())
    if path:
        target: Any = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = data.draw(JSON)
    try:
        checkpoint, layout = decode(
            json.dumps(doc), PATH, cdi_root=Path("/var/run/cdi"), now=datetime(2026, 1, 1, tzinfo=UTC)
        )
    except CheckpointCorruptError as exc:
        one_line(exc, "checkpoint")
    else:
        assert layout in ("v2", "v1", "25.3") or (layout is None and path)
        assert isinstance(checkpoint, Checkpoint)
        assert loads(dumps(checkpoint), PATH) == checkpoint  # what it became is a valid checkpoint of ours


@given(st.data())
def test_recorded_spec_paths_never_leave_the_cdi_directory(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp)
        root = top / "cdi"
        root.mkdir()
        outside = top / spec_file_name(str(uuid.UUID(int=7)))
        outside.write_text("{}")
        ours = root / spec_file_name(str(uuid.UUID(int=9)))
        ours.write_text("{}")
        foreign = root / "nvidia.yaml"
        foreign.write_text("{}")
        recorded = data.draw(
            st.sampled_from(
                [str(outside), f"{root}/../{outside.name}", str(foreign), f"{root}//{ours.name}", str(ours), str(root)]
            )
            | st.builds(lambda s: f"{root}/{s}", st.text(max_size=30))
            | st.text(max_size=40)
        )
        CdiSpecDir(root).remove_recorded(recorded)
        assert outside.exists() and foreign.exists()
        assert ours.exists() or Path(recorded).resolve() == ours.resolve()


# --- nvidia-imex-ctl output --------------------------------------------------------------------------------

OUTPUT = st.text(max_size=200) | st.sampled_from(
    ["READY", "READY\n", " READY ", "NOT READY", "READY\nREADY", "WAITING_FOR_PEERS\nx", "\x00READY", "READY\r\n"]
)


@pytest.fixture(scope="module")
def ctl_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("driver-root")
    ctl = root / "usr" / "bin" / "nvidia-imex-ctl"
    ctl.parent.mkdir(parents=True)
    ctl.write_text("#!/bin/sh\n")
    ctl.chmod(0o755)
    return root


@given(exit_code=st.integers(-255, 255), output=OUTPUT)
def test_host_check_reads_any_ctl_output(ctl_root: Path, exit_code: int, output: str) -> None:
    async def runner(argv: list[str], *, timeout_s: float) -> CommandResult:
        return CommandResult(exit_code, output)

    try:
        asyncio.run(check_host_imex_ready(driver_root=ctl_root, runner=runner, chroot="/usr/sbin/chroot"))
    except HostImexNotReadyError as exc:
        one_line(exc, "host nvidia-imex daemon not ready")
        assert exc.state in ImexState
        assert not (exit_code == 0 and output.strip() == "READY")
    else:
        assert exit_code == 0 and output.strip() == "READY"


@given(exit_code=st.integers(-255, 255), output=OUTPUT)
def test_daemon_probe_reads_any_ctl_output(exit_code: int, output: str) -> None:
    async def runner(argv: list[str], *, timeout_s: float) -> CommandResult:
        return CommandResult(exit_code, output)

    settings = load_settings(DaemonSettings, environ={"CLIQUE_ID": "a.1"})
    result = asyncio.run(check(settings, runner=runner))
    assert "\n" not in result.message and len(result.message) <= MAX_MESSAGE
    assert result.ready == (exit_code == 0 and output in ("READY", "READY\n"))


@given(st.lists(st.text(max_size=20) | st.builds(lambda k, v: f"{k}={v}", st.text(max_size=8), DIGITS), max_size=6))
def test_imexd_cfg_decoder(lines: list[str]) -> None:
    try:
        config = ImexConfig.parse("\n".join(lines), source="imexd.cfg")
    except ImexConfigError as exc:
        one_line(exc, "imexd.cfg")
    else:
        assert isinstance(config.server_port, int)


@given(st.text(max_size=200))
def test_hosts_file_decoder(text: str) -> None:
    table = parse_hosts(text)
    assert all(" " not in name and name for name in table)


# --- node and clique names ---------------------------------------------------------------------------------

LABEL_VALUE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
FABRIC = st.builds(
    GpuFabricInfo,
    gpu=st.text(max_size=6),
    state=st.sampled_from(list(FabricState)),
    cluster_uuid=st.uuids() | st.just(ZERO_UUID),
    clique_id=st.integers(0, 2**32 - 1),
    status_ok=st.booleans(),
    status_text=st.text(max_size=10),
)


@given(st.lists(FABRIC, max_size=4), st.booleans())
def test_clique_id_from_fabric_info(infos: list[GpuFabricInfo], strict: bool) -> None:
    try:
        clique = derive_clique_id(infos, crash_on_fabric_errors=strict)
    except FabricError as exc:
        one_line(exc, "GPU", "NVLink")
    else:
        if clique is not None:
            # It becomes a label value, part of an object name and the daemons' CLIQUE_ID.
            assert LABEL_VALUE.fullmatch(clique), clique
            assert load_settings(DaemonSettings, environ={"CLIQUE_ID": clique}).clique_id == clique


@given(UUIDS | st.text(max_size=40))
def test_hostname_prefix_of_any_domain_uid(uid: str) -> None:
    try:
        prefix = hostname_prefix(uid)
    except ImexConfigError as exc:
        one_line(exc, "ComputeDomain UID")
    else:
        assert re.fullmatch(r"[a-z0-9-]{1,58}", prefix)


CLIQUE = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"
DAEMON_ITEM = st.fixed_dictionaries(
    {
        "nodeName": st.text(max_size=8),
        "ipAddress": st.ip_addresses().map(str) | st.text(max_size=16),
        "cliqueID": st.sampled_from([CLIQUE, "other.2", ""]),
    },
    optional={"index": st.integers(-3, 40) | JSON, "status": st.sampled_from(["Ready", "NotReady"]) | JSON},
)


@given(st.lists(DAEMON_ITEM, max_size=8), st.sampled_from(["n1", ""]))
def test_other_daemons_entries_to_hosts_mapping(items: list[dict[str, Any]], node: str) -> None:
    backend = CliqueBackend(namespace="driver", cd_uid=str(uuid.UUID(int=3)), clique_id=CLIQUE)
    entries = [backend.decode(item) for item in items]
    view = peer_view(entries, node_name=node, clique_id=CLIQUE, max_nodes=18)
    # Whatever the peers wrote, the hosts file of this clique can be rendered: bad entries are only problems.
    slot_entries(hostname_prefix(str(uuid.UUID(int=3))), view.addresses, max_nodes=18)
    assert all("\n" not in p for p in view.problems)
