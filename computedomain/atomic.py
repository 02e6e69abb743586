"""Crash-safe replacement of small files: the one writer for the checkpoint, CDI specs, the IMEX config
files and the hosts file.

Readers (the node agent itself, container runtimes watching the CDI directories, ``nvidia-imex`` reading its
config or re-resolving peer names) must only ever see the old or the new content of a file, never a partial
one, also across a crash or power loss: temp file in the same directory, fsync, rename over the file, fsync
of the directory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["NoTempFile", "fsync_dir", "write_atomically"]


class NoTempFile(OSError):  # noqa: N818 (an OSError with its errno)
    """The temp file could not be made next to the target (a read-only or missing directory)."""


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in directory durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(
    path: Path, text: str, *, mode: int | None = None, tmp_prefix: str | None = None, if_changed: bool = False
) -> bool:
    """Replace path with text; True when the file was written.

    `mode` None keeps the mode of the file being replaced (0644 for a new one). With `if_changed` a file that
    already holds exactly `text` is left alone. The temp name is `tmp_prefix` (default `.<name>.tmp-`) plus a
    random part, with no extension, so watchers that load `*.json`/`*.yaml` never pick up a half-written
    file. Raises OSError (``NoTempFile`` when no temp file could be made); the temp file is gone then (a failed
    rename, e.g. EBUSY over a bind mount, included).
    """
    if if_changed:
        with contextlib.suppress(FileNotFoundError):
            if path.read_text(encoding="utf-8") == text:
                return False
    directory = path.parent
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=tmp_prefix or f".{path.name}.tmp-", dir=directory)
    except OSError as exc:
        raise NoTempFile(exc.errno, exc.strerror, str(directory)) from exc
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(directory)
    return True
