"""Finding the NVIDIA driver's files in a driver root, the way the dynamic loader and a shell would there.

A driver root is a directory laid out like a root filesystem that holds the NVIDIA driver's user-space
files: ``/`` for a driver installed on the host, ``/run/nvidia/driver`` for the GPU Operator's driver
container. The node agent sees it wherever its pod mounts it (the chart: ``/driver-root``), so every
lookup here takes the root as a parameter and resolves symlinks *inside* it: an absolute link in the
driver root points into the driver root, not into the container that looks at it.

This module owns
- ``resolve_in_root``: a path inside the root with its symlinks resolved relative to the root;
- ``find_binary``: an executable by name in the root's usual binary directories (``nvidia-imex``,
  ``nvidia-imex-ctl``);
- ``read_ld_cache``: the root's ``etc/ld.so.cache`` (glibc's binary format, "glibc-ld.so.cache1.1"),
  decoded with bounds on every size and offset, since it is a file from outside;
- ``find_library``: a library by its soname (``libnvidia-ml.so.1``), first through the root's ld cache,
  then in the standard library directories, as the reference driver does for GPU Operator roots;
- ``driver_libraries``: the driver's own libraries of one version (``libnvidia-*.so.<version>``,
  ``libcuda.so.<version>`` and the links to them), for the base CDI spec.

Every failure is one line that names the path and what to check.
"""

from __future__ import annotations

import os
import posixpath
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from imex.discovery import HardwareError

# Where executables live in a driver root, in search order. "" is the root itself (some driver packages
# unpack flat). The host-managed readiness check uses the same list.
BIN_SEARCH_DIRS = ("", "opt/bin", "usr/bin", "usr/sbin", "bin", "sbin")
LD_CACHE = "etc/ld.so.cache"

# glibc's ld.so.cache: the "new" format, alone (glibc >= 2.32) or after the old one ("compat").
_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, extension offset
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap
_OLD_ENTRY_SIZE = 12
_MAX_LD_CACHE_BYTES = 32 << 20  # a real cache is ~100 KiB; anything near this is not one
_MAX_PATH = 4096
_MAX_DIR_ENTRIES = 20000

# Bits 8-15 of an entry's flags: the ABI the library needs (glibc's ldconfig.h). Entries of another ABI
# (a 32-bit libnvidia-ml next to the 64-bit one) must not be loaded.
_ABI_FLAGS = {"x86_64": 0x0300, "aarch64": 0x0A00}
_ABI_MASK = 0xFF00

_DRIVER_LIBRARY = re.compile(r"^lib(nvidia-[A-Za-z0-9_.+-]+|cuda)\.so(\.[0-9]+)+$")


class DriverRootError(HardwareError):
    """Something the node needs is missing from, or unreadable in, the driver root."""


class LdCacheError(DriverRootError):
    """The driver root's ld.so.cache is not a glibc cache we can read."""


def machine_triplet() -> str:
    """The multiarch directory name of this machine (``x86_64-linux-gnu``, ``aarch64-linux-gnu``)."""
    return f"{os.uname().machine}-linux-gnu"


def library_dirs() -> tuple[str, ...]:
    """Standard library directories inside a root, in the loader's order for this machine."""
    triplet = machine_triplet()
    return ("usr/lib64", f"usr/lib/{triplet}", "usr/lib", "lib64", f"lib/{triplet}", "lib")


def resolve_in_root(root: Path, relative: PurePosixPath, hops: int = 0) -> Path | None:
    """``relative`` under ``root`` with symlinks resolved as if ``root`` were ``/``; None if it leads nowhere.

    The result need not exist. A link that climbs above the root, or more than 40 links, leads nowhere.
    """
    if hops > 40:
        return None
    current = root
    parts = list(relative.parts)
    while parts:
        part = parts.pop(0)
        if part in ("", "/"):
            continue
        candidate = current / part
        if candidate.is_symlink():
            try:
                target = PurePosixPath(candidate.readlink())
            except OSError:
                return None
            rest = PurePosixPath(*parts) if parts else PurePosixPath()
            if target.is_absolute():
                return resolve_in_root(root, target.relative_to("/") / rest, hops + 1)
            base = current.relative_to(root)
            joined = PurePosixPath(posixpath.normpath(str(PurePosixPath(base) / target / rest)))
            if joined.parts and joined.parts[0] == "..":
                return None
            return resolve_in_root(root, joined, hops + 1)
        current = candidate
    return current


def in_root(root: Path, path: Path) -> PurePosixPath:
    """``path`` (below ``root``) as the root's own absolute path, e.g. ``/usr/bin/nvidia-imex``."""
    return PurePosixPath("/") / path.relative_to(root)


def find_binary(root: Path, name: str) -> PurePosixPath | None:
    """An executable regular file called ``name`` in the root's binary directories, as a path inside the root."""
    for directory in BIN_SEARCH_DIRS:
        resolved = resolve_in_root(root, PurePosixPath(directory) / name)
        if resolved is not None and resolved.is_file() and os.access(resolved, os.X_OK):
            return in_root(root, resolved)
    return None


def searched_bin_dirs() -> str:
    return ", ".join("/" + d if d else "/" for d in BIN_SEARCH_DIRS)


# --------------------------------------------------------------------------------------------------------
# ld.so.cache


@dataclass(frozen=True)
class LdCacheEntry:
    name: str  # the soname, e.g. libnvidia-ml.so.1
    path: str  # where the root has it, e.g. /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
    flags: int


def _c_string(data: bytes, offset: int, *, source: str) -> str:
    if not 0 <= offset < len(data):
        raise LdCacheError(f"{source}: string offset {offset} outside the file ({len(data)} bytes)")
    end = data.find(b"\0", offset, offset + _MAX_PATH)
    if end < 0:
        raise LdCacheError(f"{source}: unterminated string at offset {offset}")
    try:
        return data[offset:end].decode()
    except UnicodeDecodeError:
        raise LdCacheError(f"{source}: string at offset {offset} is not UTF-8") from None


def parse_ld_cache(data: bytes, *, source: str) -> list[LdCacheEntry]:
    """Entries of a glibc ld.so.cache, in file order (the loader's preference order)."""
    start = 0
    if data.startswith(_OLD_MAGIC):
        if len(data) < 16:
            raise LdCacheError(f"{source}: truncated old-format header")
        (old_count,) = struct.unpack_from("<I", data, 12)
        if old_count > len(data) // _OLD_ENTRY_SIZE:
            raise LdCacheError(f"{source}: old-format entry count {old_count} exceeds the file size")
        start = (16 + old_count * _OLD_ENTRY_SIZE + 7) & ~7  # the new format follows, 8-byte aligned
    if not data.startswith(_NEW_MAGIC, start):
        raise LdCacheError(f"{source}: not a glibc ld.so.cache (no {_NEW_MAGIC.decode()!r} header)")
    if len(data) < start + _NEW_HEADER.size:
        raise LdCacheError(f"{source}: truncated header")
    _, count, _, _, _ = _NEW_HEADER.unpack_from(data, start)
    table = start + _NEW_HEADER.size
    if count > (len(data) - table) // _NEW_ENTRY.size:
        raise LdCacheError(f"{source}: entry count {count} exceeds the file size")
    # Offsets of the new format count from its header.
    strings = data[start:]
    entries = []
    for index in range(count):
        flags, key, value, _, _ = _NEW_ENTRY.unpack_from(data, table + index * _NEW_ENTRY.size)
        entries.append(
            LdCacheEntry(_c_string(strings, key, source=source), _c_string(strings, value, source=source), flags)
        )
    return entries


def read_ld_cache(root: Path) -> list[LdCacheEntry]:
    """The root's ld cache; [] when it has none. Raises ``LdCacheError`` for an unreadable or foreign file."""
    path = root / LD_CACHE
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_LD_CACHE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise LdCacheError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > _MAX_LD_CACHE_BYTES:
        raise LdCacheError(f"{path}: larger than {_MAX_LD_CACHE_BYTES >> 20} MiB, not an ld.so.cache")
    return parse_ld_cache(data, source=str(path))


def _abi_matches(flags: int) -> bool:
    wanted = _ABI_FLAGS.get(os.uname().machine)
    return wanted is None or flags & _ABI_MASK == wanted


# --------------------------------------------------------------------------------------------------------
# Libraries


@dataclass(frozen=True)
class Library:
    """A library found in a driver root: its path as the root names it, and the file behind it."""

    path: PurePosixPath  # inside the root, e.g. /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
    file: Path  # the regular file behind it, as this process reaches it (below the root)


def _regular_file(root: Path, path: PurePosixPath) -> Path | None:
    resolved = resolve_in_root(root, path.relative_to("/") if path.is_absolute() else path)
    if resolved is None or not resolved.is_file():
        return None
    return resolved


def find_library(root: Path, soname: str) -> Library:
    """``soname`` in the root: its ld cache first (entries of this machine's ABI), then the standard dirs.

    Raises ``DriverRootError`` naming every place it looked.
    """
    cache_note = ""
    try:
        entries = read_ld_cache(root)
    except LdCacheError as exc:
        entries, cache_note = [], f"; {exc}"
    for entry in entries:
        if entry.name == soname and _abi_matches(entry.flags) and entry.path.startswith("/"):
            path = PurePosixPath(entry.path)
            file = _regular_file(root, path)
            if file is not None:
                return Library(path, file)
    for directory in library_dirs():
        path = PurePosixPath("/") / directory / soname
        file = _regular_file(root, path)
        if file is not None:
            return Library(path, file)
    searched = ", ".join(f"/{d}" for d in library_dirs())
    raise DriverRootError(
        f"{soname} not found under driver root {root} (looked in {root / LD_CACHE} and {searched}{cache_note}): "
        "is the NVIDIA driver installed there? Set nvidiaDriverRoot to the driver root "
        "(/ for a host-installed driver, /run/nvidia/driver for the GPU Operator)"
    )


def _listing(directory: Path) -> Iterable[str]:
    try:
        with os.scandir(directory) as it:
            for count, entry in enumerate(it):
                if count >= _MAX_DIR_ENTRIES:
                    return
                yield entry.name
    except OSError:
        return


def driver_libraries(root: Path, version: str) -> list[Library]:
    """The driver's libraries of ``version``: every ``libnvidia-*``/``libcuda`` name in the root's library
    directories (those of its ld cache and the standard ones) that leads to a file ``*.so.<version>``.

    Links keep their own path (``libnvidia-ml.so.1`` and ``libnvidia-ml.so.<version>`` both appear), so a
    container given these files at these paths loads them by either name without a link of its own.
    """
    directories: dict[str, None] = {}
    try:
        for entry in read_ld_cache(root):
            if _DRIVER_LIBRARY.match(entry.name) and entry.path.startswith("/") and _abi_matches(entry.flags):
                directories[posixpath.dirname(entry.path)] = None
    except LdCacheError:
        pass  # the standard directories below still find a conventional install
    for directory in library_dirs():
        directories["/" + directory] = None
    suffix = f".so.{version}"
    found: dict[PurePosixPath, Library] = {}
    scanned: set[Path] = set()
    for directory in directories:
        resolved_dir = resolve_in_root(root, PurePosixPath(directory).relative_to("/"))
        # /lib is often a link to /usr/lib: one directory, scanned (and mounted) once.
        if resolved_dir is None or resolved_dir in scanned or not resolved_dir.is_dir():
            continue
        scanned.add(resolved_dir)
        for name in sorted(_listing(resolved_dir)):
            if not _DRIVER_LIBRARY.match(name):
                continue
            path = PurePosixPath(directory) / name
            file = _regular_file(root, path)
            if file is not None and file.name.endswith(suffix) and path not in found:
                found[path] = Library(path, file)
    return sorted(found.values(), key=lambda lib: str(lib.path))
