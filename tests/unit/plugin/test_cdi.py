"""CDI claim specs: content, file naming, atomic writes, removal and listing."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from computedomain.plugin import cdi
from computedomain.plugin.cdi import CapabilityDevice, CdiError, CdiSpecDir, ClaimSpec

UID = "0a1b2c3d-0000-4000-8000-000000000001"
CD_UID = "6f1c2d3e-0000-4000-8000-00000000cd01"
IMEX_MAJOR = 242
CAPS_MAJOR = 241


def test_single_channel_spec() -> None:
    spec = ClaimSpec(UID, {cdi.CHANNEL_DEVICE: cdi.channel_edits(IMEX_MAJOR, cdi.channel_ids(False, 2048))})
    body = spec.to_cdi()
    assert body["cdiVersion"] == "0.5.0"
    assert body["kind"] == "k8s.compute-domain.nvidia.com/claim"
    [device] = body["devices"]
    assert device["name"] == f"{UID}-channel-0"
    assert device["containerEdits"] == {
        "deviceNodes": [
            {
                "path": "/dev/nvidia-caps-imex-channels/channel0",
                "type": "c",
                "major": 242,
                "minor": 0,
                "fileMode": 0o666,
            }
        ]
    }
    assert spec.device_ids(cdi.CHANNEL_DEVICE) == (f"k8s.compute-domain.nvidia.com/claim={UID}-channel-0",)
    assert spec.file_name == f"k8s.compute-domain.nvidia.com-claim_{UID}.json"


@pytest.mark.parametrize("count", [1, 7, 2048])
def test_all_mode_injects_every_channel(count: int) -> None:
    edits = cdi.channel_edits(IMEX_MAJOR, cdi.channel_ids(True, count))
    nodes = ClaimSpec(UID, {cdi.CHANNEL_DEVICE: edits}).to_cdi()["devices"][0]["containerEdits"]["deviceNodes"]
    assert len(nodes) == count
    assert [n["minor"] for n in nodes] == list(range(count))
    assert [n["path"] for n in nodes][-1] == f"/dev/nvidia-caps-imex-channels/channel{count - 1}"
    assert {(n["type"], n["major"], n["fileMode"]) for n in nodes} == {("c", IMEX_MAJOR, 438)}


def test_channel_count_must_be_positive() -> None:
    with pytest.raises(CdiError):
        cdi.channel_ids(True, 0)


def test_daemon_spec_on_fabric_node() -> None:
    edits = cdi.daemon_edits(
        domain_dir=Path("/var/lib/kubelet/plugins/compute-domain.nvidia.com/domains") / CD_UID,
        clique_id="8c3e1f5a-1111-2222-3333-444455556666.32766",
        domain_uid=CD_UID,
        domain_name="my-cd",
        domain_namespace="team-a",
        fabric_imex_mgmt=CapabilityDevice(major=CAPS_MAJOR, minor=4323, file_mode=0o444),
    )
    spec = ClaimSpec(UID, {cdi.DAEMON_DEVICE: edits})
    [device] = spec.to_cdi()["devices"]
    assert device["name"] == f"{UID}-daemon-0"
    ce = device["containerEdits"]
    assert ce["env"] == [
        "CLIQUE_ID=8c3e1f5a-1111-2222-3333-444455556666.32766",
        f"COMPUTE_DOMAIN_UUID={CD_UID}",
        "COMPUTE_DOMAIN_NAME=my-cd",
        "COMPUTE_DOMAIN_NAMESPACE=team-a",
    ]
    assert ce["mounts"] == [
        {
            "hostPath": f"/var/lib/kubelet/plugins/compute-domain.nvidia.com/domains/{CD_UID}",
            "containerPath": "/imexd",
            "options": ["rw", "nosuid", "nodev", "bind"],
        }
    ]
    assert ce["deviceNodes"] == [
        {"path": "/dev/nvidia-caps/nvidia-cap4323", "type": "c", "major": 241, "minor": 4323, "fileMode": 0o444}
    ]
    assert spec.device_ids(cdi.DAEMON_DEVICE) == (f"k8s.compute-domain.nvidia.com/claim={UID}-daemon-0",)


def test_daemon_spec_without_fabric_has_no_device_node_and_empty_clique() -> None:
    edits = cdi.daemon_edits(
        domain_dir=Path("/d") / CD_UID,
        clique_id="",
        domain_uid=CD_UID,
        domain_name="my-cd",
        domain_namespace="team-a",
        fabric_imex_mgmt=None,
    )
    ce = ClaimSpec(UID, {cdi.DAEMON_DEVICE: edits}).to_cdi()["devices"][0]["containerEdits"]
    assert "deviceNodes" not in ce
    assert ce["env"][0] == "CLIQUE_ID="
    with pytest.raises(CdiError, match="absolute"):
        cdi.daemon_edits(
            domain_dir=Path("rel"),
            clique_id="",
            domain_uid=CD_UID,
            domain_name="n",
            domain_namespace="ns",
            fabric_imex_mgmt=None,
        )


def test_no_clique_channel_claim_writes_nothing(tmp_path: Path) -> None:
    spec = ClaimSpec(UID, {cdi.CHANNEL_DEVICE: cdi.ContainerEdits()})
    assert spec.empty
    assert spec.device_ids(cdi.CHANNEL_DEVICE) == ()
    assert spec.to_cdi()["devices"] == []
    store = CdiSpecDir(tmp_path)
    assert store.write(spec) is None
    assert store.list_claims() == {}


@pytest.mark.parametrize("bad", ["../../etc/passwd", "", "UPPER-case", "a/b", "-lead", "x" * 64])
def test_bad_claim_uids_are_refused(bad: str) -> None:
    with pytest.raises(CdiError):
        ClaimSpec(bad, {cdi.CHANNEL_DEVICE: cdi.channel_edits(IMEX_MAJOR, [0])})
    with pytest.raises(CdiError):
        cdi.spec_file_name(bad)


def _channel_spec(uid: str = UID, channels: range = range(1)) -> ClaimSpec:
    return ClaimSpec(uid, {cdi.CHANNEL_DEVICE: cdi.channel_edits(IMEX_MAJOR, channels)})


def test_write_read_remove_list(tmp_path: Path) -> None:
    root = tmp_path / "cdi"
    store = CdiSpecDir(root)
    path = store.write(_channel_spec())
    assert path == root / f"k8s.compute-domain.nvidia.com-claim_{UID}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads(path.read_text()) == _channel_spec().to_cdi()
    assert store.read(UID) == _channel_spec().to_cdi()

    other = "0a1b2c3d-0000-4000-8000-000000000002"
    store.write(_channel_spec(other))
    # Files of other vendors/classes, temp files and odd names are not ours.
    (root / "nvidia.com-gpu.yaml").write_text("{}")
    (root / "k8s.compute-domain.nvidia.com-device_base.yaml").write_text("{}")
    (root / f".k8s.compute-domain.nvidia.com-claim_{UID}.json.tmp-x").write_text("{")
    (root / "k8s.compute-domain.nvidia.com-claim_NOT..VALID.json").write_text("{}")
    assert store.list_claims() == {UID: path, other: root / f"k8s.compute-domain.nvidia.com-claim_{other}.json"}

    assert store.remove(UID) is True
    assert not path.exists()
    assert store.remove(UID) is False
    assert store.read(UID) is None
    assert set(store.list_claims()) == {other}


def test_rewrite_replaces_and_empty_rewrite_removes(tmp_path: Path) -> None:
    store = CdiSpecDir(tmp_path)
    store.write(_channel_spec())
    store.write(_channel_spec(channels=range(4)))
    body = store.read(UID)
    assert body is not None
    assert len(body["devices"][0]["containerEdits"]["deviceNodes"]) == 4
    assert store.write(ClaimSpec(UID, {cdi.CHANNEL_DEVICE: cdi.ContainerEdits()})) is None
    assert store.read(UID) is None


def test_interrupted_write_keeps_old_spec_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CdiSpecDir(tmp_path)
    path = store.write(_channel_spec())
    assert path is not None
    old = path.read_text()

    def crash(self: Path, target: Path) -> Path:
        raise OSError("disk full at rename")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        store.write(_channel_spec(channels=range(8)))
    monkeypatch.undo()
    assert path.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_list_claims_of_missing_root(tmp_path: Path) -> None:
    assert CdiSpecDir(tmp_path / "absent").list_claims() == {}
