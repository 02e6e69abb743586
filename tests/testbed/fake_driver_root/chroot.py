"""Showing the machine's system directories inside a fake driver root, for programs run chrooted there.

hostManaged mode runs the host's ``nvidia-imex-ctl`` chrooted into the driver root. A fake driver root's
ctl is native for that query, but the simulator's ctl it hands other command lines to (and the tests'
wrappers) is a Python program, so the root needs the machine's ``/usr`` (and the interpreter and
repository) at the same paths. A fake driver root already keeps the driver's own files in ``usr/`` (the mock NVML library,
the IMEX binaries) and ``etc/`` (its ld cache); a plain bind mount would hide them. So a directory the root
already has gets a read-only overlay with the root's files on top of the system's, as on a host where the
driver is installed into ``/usr``; an empty or missing one gets a read-only bind mount. Needs root.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def mount_system_dir(source: Path, target: Path) -> None:
    """Show ``source`` read-only at ``target``; ``subprocess.CalledProcessError`` if mount(8) fails."""
    target.mkdir(parents=True, exist_ok=True)
    if any(target.iterdir()):
        argv = ["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={target}:{source}", str(target)]
    else:
        argv = ["mount", "--bind", "-o", "ro", str(source), str(target)]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)
