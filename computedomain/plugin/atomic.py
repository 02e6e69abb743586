"""Crash-safe file replacement, shared by the checkpoint and the CDI spec writer.

Readers (the kubelet plugin itself, container runtimes watching the CDI directories) must only ever see
the old or the new content of a file, never a partial one, also across a crash or power loss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in directory durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, *, mode: int = 0o644, tmp_prefix: str | None = None) -> None:
    """Replace path with text: temp file in the same directory, fsync, rename over path, fsync the directory.

    The temp name is `tmp_prefix` (default `.<name>.tmp-`) plus a random part, with no extension, so
    watchers that load `*.json`/`*.yaml` never pick up a half-written file."""
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=tmp_prefix or f".{path.name}.tmp-", dir=directory)
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
