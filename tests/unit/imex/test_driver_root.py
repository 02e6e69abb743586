"""Finding the driver's files in a driver root: the ld.so.cache reader (against real glibc caches and
hostile bytes), library and binary lookup with links resolved inside the root, the driver's libraries."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from imex.driver_root import (
    LdCacheError,
    driver_libraries,
    find_binary,
    find_library,
    library_dirs,
    machine_triplet,
    parse_ld_cache,
    read_ld_cache,
)
from tests.testbed.fake_driver_root.ldcache import render_ld_cache

TRIPLET = machine_triplet()
LIBS = f"/usr/lib/{TRIPLET}"


def test_reads_this_machines_real_ld_cache() -> None:
    """The reader against what glibc's own ldconfig wrote."""
    cache = Path("/etc/ld.so.cache")
    if not cache.exists():
        pytest.skip("this machine has no /etc/ld.so.cache (not a glibc system)")
    entries = read_ld_cache(Path("/"))
    assert any(e.name == "libc.so.6" and Path(e.path).exists() for e in entries)
    assert all(e.path.startswith("/") for e in entries)


def test_written_cache_reads_back_and_ldconfig_agrees(tmp_path: Path) -> None:
    libraries = [
        ("libnvidia-ml.so.1", f"{LIBS}/libnvidia-ml.so.1"),
        ("libcuda.so.1", f"{LIBS}/libcuda.so.1"),
        ("libnvidia-ml.so", f"{LIBS}/libnvidia-ml.so"),
    ]
    data = render_ld_cache(libraries)
    entries = parse_ld_cache(data, source="t")
    assert sorted((e.name, e.path) for e in entries) == sorted(libraries)
    path = tmp_path / "ld.so.cache"
    path.write_bytes(data)
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    out = subprocess.run([ldconfig, "-p", "-C", str(path)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0].startswith("3 libs found in cache")
    for name, target in libraries:
        assert f"{name} (" in out and f"=> {target}" in out


def test_old_and_new_format_together(tmp_path: Path) -> None:
    """glibc < 2.32 wrote the old format first ("compat"); the new one follows it, 8-byte aligned."""
    new = render_ld_cache([("libnvidia-ml.so.1", f"{LIBS}/libnvidia-ml.so.1")])
    old = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + b"\0" * 16  # header 16 + one 12-byte entry, padded to 32
    (entry,) = parse_ld_cache(old + new, source="compat")
    assert entry.name == "libnvidia-ml.so.1"


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda d: b"not a cache at all" + d, "not a glibc ld.so.cache"),
        (lambda d: d[:30], "truncated header"),
        (lambda d: d[:20] + struct.pack("<I", 10**6) + d[24:], "entry count 1000000 exceeds the file size"),
        (lambda d: d[:48] + d[48:52] + struct.pack("<I", 10**6) + d[56:], "offset 1000000 outside the file"),
        (lambda d: d.rstrip(b"\0"), "unterminated string"),
        (lambda d: b"ld.so-1.7.0\0" + struct.pack("<I", 10**6) + d, "old-format entry count"),
    ],
)
def test_hostile_caches_are_one_line_errors(mangle: object, message: str) -> None:
    data = render_ld_cache([("libnvidia-ml.so.1", f"{LIBS}/libnvidia-ml.so.1")])
    with pytest.raises(LdCacheError, match=message) as info:
        parse_ld_cache(mangle(data), source="/r/etc/ld.so.cache")  # type: ignore[operator]
    assert str(info.value).startswith("/r/etc/ld.so.cache: ") and "\n" not in str(info.value)


def test_oversized_cache_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    with (tmp_path / "etc/ld.so.cache").open("wb") as f:
        f.truncate(33 << 20)
    with pytest.raises(LdCacheError, match="larger than 32 MiB"):
        read_ld_cache(tmp_path)


def _lib(root: Path, path: str, content: bytes = b"\x7fELF") -> Path:
    file = root / path.lstrip("/")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(content)
    return file


def test_corrupt_cache_falls_back_to_standard_dirs_and_says_so(tmp_path: Path) -> None:
    _lib(tmp_path, "/etc/ld.so.cache", b"garbage")
    with pytest.raises(Exception, match=r"not a glibc ld\.so\.cache"):
        find_library(tmp_path, "libnvidia-ml.so.1")
    _lib(tmp_path, f"{LIBS}/libnvidia-ml.so.1")
    assert find_library(tmp_path, "libnvidia-ml.so.1").path == PurePosixPath(f"{LIBS}/libnvidia-ml.so.1")


def test_entries_of_another_abi_are_not_taken(tmp_path: Path) -> None:
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("ABI flags are checked on x86_64 and aarch64 only")
    _lib(tmp_path, "/usr/lib32/libnvidia-ml.so.1")
    data = bytearray(render_ld_cache([("libnvidia-ml.so.1", "/usr/lib32/libnvidia-ml.so.1")]))
    data[48:52] = struct.pack("<i", 0x0003)  # libc6 without the 64-bit ABI bits: a 32-bit library
    _lib(tmp_path, "/etc/ld.so.cache", bytes(data))
    with pytest.raises(Exception, match="not found"):
        find_library(tmp_path, "libnvidia-ml.so.1")


def test_standard_dirs_are_this_machines() -> None:
    assert f"usr/lib/{TRIPLET}" in library_dirs() and library_dirs()[0] == "usr/lib64"


def test_find_binary_resolves_links_in_the_root_and_needs_exec(tmp_path: Path) -> None:
    real = _lib(tmp_path, "/opt/nvidia/bin/nvidia-imex")
    real.chmod(0o755)
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-imex").symlink_to("/opt/nvidia/bin/nvidia-imex")  # absolute: inside the root
    assert find_binary(tmp_path, "nvidia-imex") == PurePosixPath("/opt/nvidia/bin/nvidia-imex")
    plain = _lib(tmp_path, "/usr/bin/nvidia-imex-ctl")
    plain.chmod(0o644)
    assert find_binary(tmp_path, "nvidia-imex-ctl") is None, "not executable"
    (tmp_path / "sbin").symlink_to("../../../../../..")  # climbs out of the root: leads nowhere
    assert find_binary(tmp_path, "nothing") is None


def test_driver_libraries_of_the_installed_version(tmp_path: Path) -> None:
    version = "570.172.08"
    for name in (f"libnvidia-ml.so.{version}", f"libcuda.so.{version}", "libnvidia-ml.so.535.1", "libfoo.so.1"):
        _lib(tmp_path, f"{LIBS}/{name}")
    (tmp_path / LIBS.lstrip("/") / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{version}")
    (tmp_path / LIBS.lstrip("/") / "libcuda.so.1").symlink_to(f"/{LIBS.lstrip('/')}/libcuda.so.{version}")
    (tmp_path / "lib").symlink_to("usr/lib")  # the same directory twice: listed once
    _lib(tmp_path, "/opt/drv/lib/libnvidia-cfg.so." + version)
    _lib(
        tmp_path,
        "/etc/ld.so.cache",
        render_ld_cache([("libnvidia-cfg.so.1", f"/opt/drv/lib/libnvidia-cfg.so.{version}")]),
    )
    found = {str(lib.path): lib.file.name for lib in driver_libraries(tmp_path, version)}
    assert found == {
        f"{LIBS}/libcuda.so.1": f"libcuda.so.{version}",
        f"{LIBS}/libcuda.so.{version}": f"libcuda.so.{version}",
        f"{LIBS}/libnvidia-ml.so.1": f"libnvidia-ml.so.{version}",
        f"{LIBS}/libnvidia-ml.so.{version}": f"libnvidia-ml.so.{version}",
        f"/opt/drv/lib/libnvidia-cfg.so.{version}": f"libnvidia-cfg.so.{version}",
    }
