"""Atomic writes of the daemon's own files under ``/imexd`` (``imexd.cfg``, ``nodes.cfg``).

Temp file in the same directory, fsync, rename, fsync of the directory: ``nvidia-imex`` (and ``nvidia-imex-ctl``
in a probe) reads either the old or the new file, never a torn one. The hosts file is not written here
(``imex.hosts_file`` owns it, including the bind-mount fallback). Synchronous and small; called from the
daemon's event loop, where a few hundred bytes of local I/O do not need a thread.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_file_atomically"]


def write_file_atomically(path: Path, text: str, *, mode: int = 0o644) -> bool:
    """Write ``text`` to ``path`` unless it already holds exactly that. True when the file changed."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        tmp.chmod(mode)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True
