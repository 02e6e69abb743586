"""Our block of name -> address lines in an ``/etc/hosts``-style file, and reading such files.

This module owns
- building the slot mapping of one IMEX domain (every slot name of ``nodes.cfg``; slots nobody holds map
  to ``SENTINEL_ADDRESS``, so every name resolves but an empty slot reaches no daemon);
- rewriting our block between marker lines, keeping every line that is not ours, and reporting whether
  the mapping changed (the caller sends SIGUSR1 to ``nvidia-imex`` only then);
- ``parse_hosts``, the resolver view (first match wins, as in glibc) the IMEX simulator uses.

Writes are atomic (``computedomain.atomic``): temp file in the same directory, fsync, rename, fsync of the
directory, so a reader
(``nvidia-imex`` re-resolving after SIGUSR1) sees the old or the new file, never half of one. Inside a pod
``/etc/hosts`` is a kubelet bind mount, and rename() over a mount point fails with EBUSY; only then do we
fall back to rewriting in place with a single write() call (the best a bind-mounted file allows).

Not thread-safe for one file: the IMEX daemon has a single writer (its update loop).
"""

from __future__ import annotations

import errno
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from computedomain.atomic import NoTempFile, write_atomically
from imex.config import MAX_NODES_PER_IMEX_DOMAIN, slot_hostname
from imex.discovery import HardwareError

# TEST-NET-1 (RFC 5737): assigned to no host anywhere, so a connect to an empty slot can reach no IMEX
# daemon in any network namespace. Upstream used 127.0.0.2, which in a pod (and in our simulator, where all
# daemons share loopback) can reach a local listener.
SENTINEL_ADDRESS = "192.0.2.1"

_BEGIN = "# BEGIN compute-domain IMEX names"
_END = "# END compute-domain IMEX names"


class HostsFileError(HardwareError):
    """The hosts file could not be read or written, or an entry is invalid."""


@dataclass(frozen=True)
class HostEntry:
    address: str
    name: str

    def line(self) -> str:
        return f"{self.address}\t{self.name}"


def slot_entries(
    prefix: str,
    address_by_index: Mapping[int, str],
    *,
    max_nodes: int = MAX_NODES_PER_IMEX_DOMAIN,
    sentinel: str = SENTINEL_ADDRESS,
) -> list[HostEntry]:
    """One entry per slot ``0..max_nodes-1``: the holder's address, or the sentinel for a free slot."""
    for index, address in address_by_index.items():
        if not 0 <= index < max_nodes:
            raise HostsFileError(f"IMEX slot index {index} outside 0..{max_nodes - 1}")
        _check_address(address)
    return [
        HostEntry(address_by_index.get(index, sentinel), slot_hostname(prefix, index)) for index in range(max_nodes)
    ]


def render_block(block_id: str, entries: Sequence[HostEntry]) -> list[str]:
    return [f"{_BEGIN} {block_id}", *(entry.line() for entry in entries), f"{_END} {block_id}"]


def update_hosts_file(path: Path, block_id: str, entries: Sequence[HostEntry]) -> bool:
    """Make our block ``block_id`` in ``path`` hold exactly ``entries``. True when the file changed.

    Lines outside our block are kept byte for byte, except stray lines that name one of our hosts (left
    by an older writer without markers): a second mapping for the same name would make resolution depend
    on line order.
    """
    for entry in entries:
        _check_address(entry.address)
        if not entry.name or any(ch.isspace() for ch in entry.name):
            raise HostsFileError(f"invalid host name {entry.name!r}")
    try:
        old = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        old = ""
    except OSError as exc:
        raise HostsFileError(f"cannot read {path}: {exc.strerror}") from None
    new = _merge(old, block_id, entries)
    if new == old:
        return False
    _write(path, new)
    return True


def read_block(path: Path, block_id: str) -> list[HostEntry]:
    """The entries of our block ``block_id`` in ``path`` (empty when there is none)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    inside = False
    entries = []
    for line in lines:
        if line == f"{_BEGIN} {block_id}":
            inside = True
        elif line == f"{_END} {block_id}":
            inside = False
        elif inside:
            fields = line.split()
            if len(fields) >= 2:
                entries.append(HostEntry(fields[0], fields[1]))
    return entries


def parse_hosts(text: str) -> dict[str, str]:
    """Name -> address, first occurrence winning, comments stripped; lines with a bad address skipped."""
    table: dict[str, str] = {}
    for raw in text.splitlines():
        fields = raw.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        try:
            ipaddress.ip_address(fields[0])
        except ValueError:
            continue
        for name in fields[1:]:
            table.setdefault(name, fields[0])
    return table


def _merge(old: str, block_id: str, entries: Sequence[HostEntry]) -> str:
    ours = {entry.name for entry in entries}
    kept: list[str] = []
    inside = False
    for line in old.splitlines():
        if line == f"{_BEGIN} {block_id}":
            inside = True
            continue
        if line == f"{_END} {block_id}":
            inside = False
            continue
        if inside:
            continue
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and ours.intersection(fields[1:]):
            continue
        kept.append(line)
    return "\n".join([*kept, *render_block(block_id, entries)]) + "\n"


def _write(path: Path, text: str) -> None:
    try:
        write_atomically(path, text)
    except OSError as exc:
        # A bind-mounted file (a pod's /etc/hosts) cannot be replaced (EBUSY, EXDEV); a read-only root filesystem
        # around it has no room for the temp file while the file itself is writable (EROFS, EACCES). Rewrite it
        # in place then.
        no_room = isinstance(exc, NoTempFile) and exc.errno in (errno.EROFS, errno.EACCES) and path.exists()
        if not (no_room or exc.errno in (errno.EBUSY, errno.EXDEV)):
            raise HostsFileError(f"cannot write {path}: {exc.strerror or exc}") from None
        try:
            _write_in_place(path, text.encode("utf-8"))
        except OSError as inner:
            raise HostsFileError(f"cannot write {path}: {inner.strerror or inner}") from None


def _write_in_place(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_address(address: str) -> None:
    if not is_ip_address(address):
        raise HostsFileError(f"{address!r} is not an IP address")
