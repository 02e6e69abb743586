"""Writes ``nvidia-imex`` / ``nvidia-imex-ctl`` wrapper scripts with absolute paths.

The checked-in scripts in ``bin/`` find the repository relative to themselves, which breaks once copied
into a fake driver root or a PATH directory; these copies name the Python interpreter and the import
path explicitly. Inside a chroot both paths must exist there too (tests bind-mount them).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

SCRIPTS = {
    "nvidia-imex": "tests.testbed.imex_simulator.imexd",
    "nvidia-imex-ctl": "tests.testbed.imex_simulator.ctl",
}


def package_root() -> Path:
    """The repository root: it holds both the ``imex`` package and the ``tests`` package of the simulator."""
    return Path(__file__).resolve().parents[3]


def install_wrappers(
    directory: Path, *, python: str = sys.executable, pythonpath: Path | None = None
) -> dict[str, Path]:
    """Write both wrappers into ``directory`` (created if needed); returns name -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    root = pythonpath or package_root()
    written = {}
    for name, module in SCRIPTS.items():
        path = directory / name
        path.write_text(
            "#!/bin/sh\n"
            f"# Simulated {name}, written by tests.testbed.imex_simulator.wrappers.\n"
            f'PYTHONPATH={shlex.quote(str(root))} exec {shlex.quote(python)} -m {module} "$@"\n',
            encoding="utf-8",
        )
        path.chmod(0o755)
        written[name] = path
    return written
