"""Taking over the reference driver's checkpoint: each of its layouts, built from its documented shape, read by
the store at start-up, then replayed, guarded and unprepared like our own entries; what does not fit is one
error naming the field (and at start-up the file is moved aside)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from computedomain.plugin import checkpoint as ck
from computedomain.plugin import checkpoint_reference as ref
from computedomain.plugin.cdi import CdiSpecDir
from computedomain.plugin.checkpoint import CheckpointCorruptError, CheckpointStore, ClaimState, DeviceKind
from tests.testbed import reference as leftovers
from tests.testbed.reference import RefClaim

NOW = datetime(2026, 6, 1, 8, 0, 0, tzinfo=UTC)
CD = "6f1c2d3e-0000-4000-8000-00000000cd01"
NODE = "gb-rack1-07"
CHANNEL = RefClaim("aaaaaaaa-0000-4000-8000-000000000001", CD, NODE, name="job-0-channel-x7k2", namespace="team-a")
DAEMON = RefClaim(
    "dddddddd-0000-4000-8000-000000000004",
    CD,
    NODE,
    kind="daemon",
    name="computedomain-daemon-x-daemon-abcde",
    namespace="nvidia-dra-driver-gpu",
)
STARTED = RefClaim(
    "bbbbbbbb-0000-4000-8000-000000000002", CD, NODE, state="PrepareStarted", name="job-1-ch", namespace="team-a"
)
ABORTED = RefClaim(
    "cccccccc-0000-4000-8000-000000000003",
    CD,
    NODE,
    state="PrepareAborted",
    name="job-2-ch",
    namespace="team-a",
    aborted_at="2026-05-31T23:59:00Z",
)


def convert(doc: dict[str, Any], tmp_path: Path, cdi_root: Path | None = None) -> tuple[ck.Checkpoint, str]:
    text = leftovers.go_json(doc)
    cp, layout = ck.decode(text, tmp_path / "checkpoint.json", cdi_root=cdi_root, now=NOW)
    assert layout is not None
    return cp, layout


def test_v2_with_every_state(tmp_path: Path) -> None:
    doc = leftovers.checkpoint_v2([CHANNEL, DAEMON, STARTED, ABORTED], boot_id="boot-7")
    cp, layout = convert(doc, tmp_path, cdi_root=Path("/var/run/cdi"))
    assert layout == "v2" and cp.boot_id == "boot-7"
    channel = cp.claims[CHANNEL.uid]
    assert channel.state is ClaimState.PREPARE_COMPLETED
    assert (channel.namespace, channel.name) == ("team-a", "job-0-channel-x7k2")
    assert channel.fingerprint == ck.claim_fingerprint(CHANNEL.status())
    (resource,) = channel.resources
    assert resource.kind is DeviceKind.CHANNEL and resource.domain_id == CD and resource.channels == (0,)
    assert resource.node_label == ck.NodeLabel(key=COMPUTE_DOMAIN_LABEL, value=CD)
    assert channel.cdi_spec_files == (f"/var/run/cdi/k8s.compute-domain.nvidia.com-claim_{CHANNEL.uid}.yaml",)
    (device,) = channel.devices
    assert device.device_name == "channel-0" and device.pool_name == NODE and device.request_names == ("channel",)
    assert device.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={CHANNEL.uid}-channel-0",)

    daemon = cp.claims[DAEMON.uid]
    assert daemon.resources[0].kind is DeviceKind.DAEMON
    assert daemon.resources[0].domain_dir == str(tmp_path / "domains" / CD)
    assert daemon.devices[0].cdi_device_ids[0] == "k8s.compute-domain.nvidia.com/device=all"

    started = cp.claims[STARTED.uid]
    assert started.state is ClaimState.PREPARE_STARTED and started.devices == () and started.resources
    aborted = cp.claims[ABORTED.uid]
    assert aborted.state is ClaimState.PREPARE_ABORTED and aborted.resources == () and aborted.cdi_spec_files == ()
    assert aborted.tombstoned_at == datetime(2026, 5, 31, 23, 59, tzinfo=UTC)
    assert "reference driver" in channel.note


def test_v2_wins_over_the_v1_copy_and_tolerates_newer_fields(tmp_path: Path) -> None:
    doc = leftovers.checkpoint_v2([CHANNEL], boot_id="b", with_version=False)
    doc["v1"]["preparedClaims"]["ffffffff-0000-4000-8000-00000000000f"] = doc["v1"]["preparedClaims"][CHANNEL.uid]
    doc["v2"]["preparedClaims"][CHANNEL.uid]["someNewerField"] = {"x": 1}
    doc["v3"] = {"whatever": True}
    cp, _ = convert(doc, tmp_path)
    assert list(cp.claims) == [CHANNEL.uid]


def test_an_empty_reference_checkpoint(tmp_path: Path) -> None:
    cp, layout = convert(leftovers.checkpoint_v2([]), tmp_path)
    assert (cp.claims, cp.boot_id, layout) == ({}, "", "v2")


def test_v1_only_layout_is_all_completed(tmp_path: Path) -> None:
    cp, layout = convert(leftovers.checkpoint_v1([CHANNEL, DAEMON]), tmp_path)
    assert layout == "v1" and cp.boot_id == ""
    assert {e.state for e in cp.claims.values()} == {ClaimState.PREPARE_COMPLETED}
    assert cp.claims[CHANNEL.uid].name == ""  # v1 never kept names


def test_25_3_layout_with_protobuf_device_names(tmp_path: Path) -> None:
    all_mode = RefClaim(CHANNEL.uid, CD, NODE, channels=(0, 1, 2))
    cp, layout = convert(leftovers.checkpoint_25_3([all_mode, DAEMON]), tmp_path)
    assert layout == "25.3"
    entry = cp.claims[CHANNEL.uid]
    assert entry.resources[0].channels == (0, 1, 2)
    assert entry.devices[0].pool_name == NODE and entry.devices[0].request_names == ("channel",)


def test_empty_checkpoint_state_is_taken_as_started(tmp_path: Path) -> None:
    unset = RefClaim(STARTED.uid, CD, NODE, state="", name="n", namespace="team-a")
    cp, _ = convert(leftovers.checkpoint_v2([unset]), tmp_path)
    assert cp.claims[unset.uid].state is ClaimState.PREPARE_STARTED


def _doc_with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = leftovers.checkpoint_v2([CHANNEL], boot_id="b")
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


GROUP = ("v2", "preparedClaims", CHANNEL.uid, "preparedDevices", 0)


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("version",), "v9", "version"),
        (("checksum",), -1, "checksum"),
        (("checksum",), "sha256:x", "checksum"),
        (("v2",), [], "v2"),
        (("v2", "nodeBootID"), 7, "v2.nodeBootID"),
        (("v2", "preparedClaims", CHANNEL.uid, "checkpointState"), "Prepared?", "checkpointState"),
        (("v2", "preparedClaims", CHANNEL.uid, "status"), "x", ".status"),
        (("v2", "preparedClaims", CHANNEL.uid, "name"), "a\nb", ".name"),
        ((*GROUP, "configState", "Type"), "gpu", "configState.Type"),
        ((*GROUP, "configState", "ComputeDomain"), "../../etc", "configState.ComputeDomain"),
        ((*GROUP, "devices", 0, "daemon"), {"info": {"id": 0}}, "exactly one 'channel'"),
        ((*GROUP, "devices", 0, "channel", "info", "id"), 2**40, "info.id"),
        ((*GROUP, "devices", 0, "channel", "device", "PoolName"), None, "PoolName"),
        ((*GROUP, "devices", 0, "channel", "device", "CDIDeviceIDs"), "x", "CDIDeviceIDs"),
    ],
)
def test_what_does_not_fit_is_named(tmp_path: Path, path: tuple[Any, ...], value: Any, where: str) -> None:
    with pytest.raises(CheckpointCorruptError) as err:
        convert(_doc_with(path, value), tmp_path)
    message = str(err.value)
    assert where in message and "reference driver checkpoint" in message and "\n" not in message


def test_a_claim_uid_that_is_no_uid_is_named(tmp_path: Path) -> None:
    doc = leftovers.checkpoint_v2([RefClaim("../x", CD, NODE)])
    with pytest.raises(CheckpointCorruptError, match="is not a Kubernetes UID"):
        convert(doc, tmp_path)


def test_ours_is_not_taken_for_the_reference() -> None:
    ours = json.loads(ck.dumps(ck.Checkpoint(boot_id="b")))
    assert not ref.is_reference(ours)
    assert ref.is_reference(leftovers.checkpoint_v2([])) and ref.is_reference(leftovers.checkpoint_25_3([]))
    assert ref.is_reference({"checksum": 0})


# --- through the store: start-up takeover, then Prepare replay, the channel guard and Unprepare ----------


@pytest.fixture
def boot_file(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("boot-now\n")
    return path


def test_store_takes_over_once_and_keeps_the_original(
    tmp_path: Path, boot_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = tmp_path / "plugin"
    original = leftovers.go_json(leftovers.checkpoint_v2([CHANNEL, STARTED], boot_id="boot-now"))
    (plugin).mkdir()
    (plugin / "checkpoint.json").write_text(original)
    store = CheckpointStore(plugin, boot_id_path=boot_file, cdi_root=tmp_path / "cdi")
    caplog.set_level(logging.INFO)
    ref._checksum_said = False
    report = store.open()
    assert (report.reference_layout, report.taken_over, report.moved_aside, report.invalidated) == ("v2", 2, None, ())
    assert (plugin / ck.REFERENCE_COPY).read_text() == original
    raw = json.loads((plugin / "checkpoint.json").read_text())
    assert raw["version"] == 1 and raw["bootID"] == "boot-now"  # now in our format
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot be recomputed outside Go" in m for m in messages) == 1
    assert any("took over the reference driver's checkpoint" in m and "claims=2" in m for m in messages)
    assert store.open() == ck.OpenReport()  # ours from now on

    cp = store.read()
    assert ck.check_prepare(cp, CHANNEL.uid, "any") == cp.claims[CHANNEL.uid]  # a repeated Prepare replays
    held = ck.channel_holder(cp, [0], except_uid="another")
    assert held == (0, CHANNEL.uid)  # channel 0 stays guarded against a second claim


def test_a_reboot_since_the_reference_wrote_it_invalidates_its_claims(tmp_path: Path, boot_file: Path) -> None:
    plugin = tmp_path / "plugin"
    leftovers.write_checkpoint(plugin, leftovers.checkpoint_v2([CHANNEL], boot_id="boot-before"))
    report = CheckpointStore(plugin, boot_id_path=boot_file).open()
    assert [e.uid for e in report.invalidated] == [CHANNEL.uid]
    entry = CheckpointStore(plugin, boot_id_path=boot_file).read().claims[CHANNEL.uid]
    assert entry.state is ClaimState.PREPARE_STARTED and entry.resources[0].node_label is not None


def test_a_reference_file_that_does_not_fit_is_moved_aside(tmp_path: Path, boot_file: Path) -> None:
    plugin = tmp_path / "plugin"
    doc = _doc_with((*GROUP, "configState", "Type"), "gpu")
    leftovers.write_checkpoint(plugin, doc)
    report = CheckpointStore(plugin, boot_id_path=boot_file).open()
    assert report.moved_aside is not None and "configState.Type" in report.moved_aside.reason
    assert report.reference_layout is None and json.loads(report.moved_aside.to.read_text()) == doc


def test_unprepare_of_a_taken_over_claim_removes_the_reference_spec(tmp_path: Path, boot_file: Path) -> None:
    cdi_root = tmp_path / "cdi"
    yaml_spec = leftovers.write_claim_spec(cdi_root, CHANNEL.uid, {"channel-0": leftovers.channel_edits(511)})
    other = leftovers.write_claim_spec(cdi_root, "eeeeeeee-0000-4000-8000-00000000000e", {})
    plugin = tmp_path / "plugin"
    leftovers.write_checkpoint(plugin, leftovers.checkpoint_v2([CHANNEL], boot_id="boot-now"))
    store = CheckpointStore(plugin, boot_id_path=boot_file, cdi_root=cdi_root)
    store.open()
    specs = CdiSpecDir(cdi_root)
    assert specs.list_claims() == {CHANNEL.uid: yaml_spec, "eeeeeeee-0000-4000-8000-00000000000e": other}
    entry = ck.undo_plan(store.read(), CHANNEL.uid)
    assert entry is not None
    for recorded in entry.cdi_spec_files:
        assert specs.remove_recorded(recorded)
    assert not yaml_spec.exists() and other.exists()
    store.update(lambda cp: (ck.finish_unprepare(cp, CHANNEL.uid, now=NOW), None))
    assert store.read().claims[CHANNEL.uid].state is ClaimState.UNPREPARE_COMPLETED


def test_writing_our_spec_drops_the_reference_one_of_the_same_claim(tmp_path: Path) -> None:
    from computedomain.plugin.cdi import ClaimSpec, channel_edits

    cdi_root = tmp_path / "cdi"
    yaml_spec = leftovers.write_claim_spec(cdi_root, CHANNEL.uid, {"channel-0": leftovers.channel_edits(511)})
    written = CdiSpecDir(cdi_root).write(ClaimSpec(CHANNEL.uid, {"channel-0": channel_edits(511, [0])}))
    assert written is not None and written.suffix == ".json" and not yaml_spec.exists()
