"""Writing a glibc ``ld.so.cache`` (format "glibc-ld.so.cache1.1", what ldconfig of glibc >= 2.32 writes).

A driver root's ld cache is how the service finds ``libnvidia-ml.so.1`` in a GPU Operator driver root, so
the fake driver root has one. ``ldconfig -r`` cannot write it here (it chroots, and needs the libraries'
ELF headers to be real), so this small writer does; ``ldconfig -p -C <file>`` reads what it writes (a unit
test checks that), and so does the service's reader (``imex.driver_root``).

Layout: a 48-byte header, one 24-byte entry per library, then the strings; string offsets count from the
start of the file. Entries are in the order glibc's loader binary-searches them (descending by
``_dl_cache_libcmp``: text compares by character, digit runs by value).
"""

from __future__ import annotations

import functools
import os
import struct
import sys
from collections.abc import Iterable

_HEADER = struct.Struct("<20sIIB3xI12x")
_ENTRY = struct.Struct("<iIIIQ")
_ELF_LIBC6 = 0x0003
_ABI = {"x86_64": 0x0300, "aarch64": 0x0A00}
_ENDIAN_LITTLE, _ENDIAN_BIG = 2, 3


def _libcmp(a: str, b: str) -> int:
    """glibc's ``_dl_cache_libcmp``."""
    i = j = 0
    while i < len(a):
        if a[i].isdigit():
            if j >= len(b) or not b[j].isdigit():
                return 1
            i2, j2 = i, j
            while i2 < len(a) and a[i2].isdigit():
                i2 += 1
            while j2 < len(b) and b[j2].isdigit():
                j2 += 1
            if int(a[i:i2]) != int(b[j:j2]):
                return int(a[i:i2]) - int(b[j:j2])
            i, j = i2, j2
        elif j < len(b) and b[j].isdigit():
            return -1
        elif j >= len(b) or a[i] != b[j]:
            return ord(a[i]) - (ord(b[j]) if j < len(b) else 0)
        else:
            i, j = i + 1, j + 1
    return 0 - (ord(b[j]) if j < len(b) else 0)


def render_ld_cache(libraries: Iterable[tuple[str, str]]) -> bytes:
    """(soname, absolute path inside the root) pairs -> cache bytes, entries flagged for this machine's ABI."""
    flags = _ELF_LIBC6 | _ABI.get(os.uname().machine, 0)

    def descending(x: tuple[str, str], y: tuple[str, str]) -> int:
        return _libcmp(y[0], x[0])

    ordered = sorted(libraries, key=functools.cmp_to_key(descending))
    strings = bytearray()
    entries = bytearray()
    base = _HEADER.size + _ENTRY.size * len(ordered)
    for name, path in ordered:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += path.encode() + b"\0"
        entries += _ENTRY.pack(flags, key, value, 0, 0)
    endian = _ENDIAN_LITTLE if sys.byteorder == "little" else _ENDIAN_BIG
    header = _HEADER.pack(b"glibc-ld.so.cache1.1", len(ordered), len(strings), endian, 0)
    return header + bytes(entries) + bytes(strings)
