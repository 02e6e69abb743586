"""Our block in an /etc/hosts-style file: atomic rewrite, foreign lines kept, change detection."""

from __future__ import annotations

from pathlib import Path

import pytest

from imex.hosts_file import (
    SENTINEL_ADDRESS,
    HostEntry,
    HostsFileError,
    parse_hosts,
    read_block,
    slot_entries,
    update_hosts_file,
)

FOREIGN = "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n10.0.0.9\tmy-pod\n"
PREFIX = "compute-domain-daemon-aa"


def test_slot_entries_fill_free_slots_with_sentinel() -> None:
    entries = slot_entries(PREFIX, {0: "10.0.0.1", 2: "10.0.0.3"}, max_nodes=4)
    assert entries == [
        HostEntry("10.0.0.1", f"{PREFIX}-0000"),
        HostEntry(SENTINEL_ADDRESS, f"{PREFIX}-0001"),
        HostEntry("10.0.0.3", f"{PREFIX}-0002"),
        HostEntry(SENTINEL_ADDRESS, f"{PREFIX}-0003"),
    ]


def test_sentinel_is_not_loopback_or_routable_to_a_daemon() -> None:
    import ipaddress

    sentinel = ipaddress.ip_address(SENTINEL_ADDRESS)
    assert not sentinel.is_loopback  # simulated daemons (and a pod's own ports) live on loopback
    assert sentinel in ipaddress.ip_network("192.0.2.0/24")  # TEST-NET-1: assigned to no host


@pytest.mark.parametrize(("index", "address"), [(4, "10.0.0.1"), (-1, "10.0.0.1"), (0, "not-an-ip")])
def test_slot_entries_validate(index: int, address: str) -> None:
    with pytest.raises(HostsFileError):
        slot_entries(PREFIX, {index: address}, max_nodes=4)


def test_first_write_keeps_foreign_lines_and_reports_change(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)
    entries = slot_entries(PREFIX, {0: "10.0.0.1"}, max_nodes=2)
    assert update_hosts_file(hosts, "cd-a", entries) is True
    text = hosts.read_text()
    assert text.startswith(FOREIGN)
    assert parse_hosts(text)[f"{PREFIX}-0000"] == "10.0.0.1"
    assert parse_hosts(text)[f"{PREFIX}-0001"] == SENTINEL_ADDRESS
    assert read_block(hosts, "cd-a") == entries


def test_same_mapping_is_no_change_and_no_write(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)
    entries = slot_entries(PREFIX, {0: "10.0.0.1"}, max_nodes=2)
    update_hosts_file(hosts, "cd-a", entries)
    inode = hosts.stat().st_ino
    assert update_hosts_file(hosts, "cd-a", entries) is False
    assert hosts.stat().st_ino == inode  # not even rewritten


def test_changed_mapping_replaces_our_block_only(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)
    update_hosts_file(hosts, "cd-a", slot_entries(PREFIX, {0: "10.0.0.1"}, max_nodes=2))
    with hosts.open("a") as f:
        f.write("10.9.9.9\tadded-later-by-someone\n")
    assert update_hosts_file(hosts, "cd-a", slot_entries(PREFIX, {0: "10.0.0.1", 1: "10.0.0.7"}, max_nodes=2))
    text = hosts.read_text()
    assert text.count("# BEGIN") == 1 and text.count("# END") == 1  # markers do not pile up (upstream wart)
    assert "added-later-by-someone" in text and "my-pod" in text
    assert parse_hosts(text)[f"{PREFIX}-0001"] == "10.0.0.7"


def test_stray_unmarked_lines_for_our_names_are_dropped(tmp_path: Path) -> None:
    """An older writer left a line for one of our names: two mappings would make resolution order-dependent."""
    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN + f"10.6.6.6\t{PREFIX}-0000\n")
    update_hosts_file(hosts, "cd-a", slot_entries(PREFIX, {0: "10.0.0.1"}, max_nodes=1))
    assert "10.6.6.6" not in hosts.read_text()
    assert parse_hosts(hosts.read_text())[f"{PREFIX}-0000"] == "10.0.0.1"


def test_two_blocks_coexist(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.1", "a-0000")])
    update_hosts_file(hosts, "cd-b", [HostEntry("10.0.0.2", "b-0000")])
    update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.3", "a-0000")])
    table = parse_hosts(hosts.read_text())
    assert table == {"a-0000": "10.0.0.3", "b-0000": "10.0.0.2"}


def test_write_is_atomic_rename_and_keeps_mode(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)
    hosts.chmod(0o644)
    old_inode = hosts.stat().st_ino
    # A reader holding the old file keeps seeing the complete old content: it was replaced, not truncated.
    with hosts.open() as reader:
        update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.1", "a-0000")])
        assert reader.read() == FOREIGN
    assert hosts.stat().st_ino != old_inode
    assert hosts.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]  # no temp files left behind


def test_failed_rename_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)

    def denied(self: Path, target: Path) -> Path:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "replace", denied)
    with pytest.raises(HostsFileError, match=r"cannot write .*hosts: Permission denied"):
        update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.1", "a-0000")])
    assert hosts.read_text() == FOREIGN
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]


def test_missing_directory_is_a_hosts_file_error(tmp_path: Path) -> None:
    with pytest.raises(HostsFileError, match="cannot write"):
        update_hosts_file(tmp_path / "gone" / "hosts", "cd-a", [HostEntry("10.0.0.1", "a-0000")])


def test_bind_mounted_file_is_rewritten_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rename() over a bind-mounted /etc/hosts fails with EBUSY; the content must still be updated."""
    import errno

    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)
    inode = hosts.stat().st_ino

    def busy(self: Path, target: Path) -> Path:
        raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr(Path, "replace", busy)
    assert update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.1", "a-0000")])
    assert hosts.stat().st_ino == inode
    assert parse_hosts(hosts.read_text())["a-0000"] == "10.0.0.1"
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]


def test_invalid_entries_rejected_before_touching_the_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(FOREIGN)
    with pytest.raises(HostsFileError):
        update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.1", "two names")])
    with pytest.raises(HostsFileError):
        update_hosts_file(hosts, "cd-a", [HostEntry("10.0.0.300", "a")])
    assert hosts.read_text() == FOREIGN


def test_parse_hosts_first_match_wins_and_skips_junk() -> None:
    table = parse_hosts("10.0.0.1 a b # c\n10.0.0.2 a\nnot-an-ip d\n\n# x\nfd00::1 e\n")
    assert table == {"a": "10.0.0.1", "b": "10.0.0.1", "e": "fd00::1"}
