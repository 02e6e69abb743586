"""Building the fake driver root's executables once, cached by the hash of their sources.

- ``mock_nvml_library()``: ``mock_nvml.c`` compiled with the machine's C compiler into a shared library
  with soname ``libnvidia-ml.so.1`` (the stand-in for NVML, see the C file's header for where it differs).
- ``native_imex_ctl()``: ``fast_ctl.go`` built with the machine's Go toolchain into a static
  ``nvidia-imex-ctl`` that answers the service's two queries (``-q -u <socket>``, ``-c <cfg> -q``) without an
  interpreter, as the C binary does in milliseconds, and runs the simulator's ctl (``SIMULATED_CTL`` beside
  it) for anything else; see the Go file's header.
- ``imex_simulator_apps(interpreter)``: the IMEX simulator as two self-contained Python zip applications,
  ``nvidia-imex`` and ``nvidia-imex-ctl``: one file each, like the NVIDIA binaries, so a CDI spec can
  mount them into a container and the daemon finds them on its PATH. They need the ``imex`` package
  (the service's image has it) and run with ``interpreter`` (``sys.executable`` on this machine,
  ``/usr/bin/env python3`` inside the service's image). Each archive carries its modules' bytecode next to
  their sources (an interpreter of another version compiles the sources instead), and the ctl starts
  without the ``site`` module (``-S``): the node agent runs it in every hostManaged Prepare, where the C
  binary costs milliseconds (a run: 36 -> 20 ms here with the ctl's own changes; design note 0003).

Both land in ``${XDG_CACHE_HOME:-~/.cache}/computedomain-fakeroot/<kind>-<hash>/``, written to a temp name
and renamed, so parallel test processes and worktrees share them safely. Nothing is ever deleted there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import os
import py_compile
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent
MOCK_NVML_SOURCE: Final = HERE / "mock_nvml.c"
NATIVE_CTL_SOURCE: Final = HERE / "fast_ctl.go"
#: where a driver root keeps the simulator's ctl, beside the native one that hands it other command lines
SIMULATED_CTL: Final = "nvidia-imex-ctl.sim"
SIMULATOR: Final = HERE.parent / "imex_simulator"
CFLAGS: Final = (
    "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-fvisibility=hidden",
    "-Wl,-soname,libnvidia-ml.so.1", "-pthread",
)  # fmt: skip
IMEX_APPS: Final = {
    "nvidia-imex": "tests.testbed.imex_simulator.imexd",
    "nvidia-imex-ctl": "tests.testbed.imex_simulator.ctl",
}
# Interpreter options per app. The ctl needs only the standard library and its archive (its `-c` mode loads
# the rest itself), so it skips `site` and its path files.
IMEX_APP_FLAGS: Final = {"nvidia-imex-ctl": "-S"}


class BuildError(RuntimeError):
    pass


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "computedomain-fakeroot"


def _publish(target: Path, write: Callable[[Path], None]) -> Path:
    """Create ``target`` through ``write(temp path)`` unless it exists; atomic for concurrent builders."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        tmp.chmod(0o755)
        tmp.replace(target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target


def mock_nvml_library() -> Path:
    """The mock ``libnvidia-ml.so.1`` for this machine, built on first use."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise BuildError(
            f"no C compiler (gcc/cc, or $CC): the mock libnvidia-ml.so.1 is built from {MOCK_NVML_SOURCE}; install gcc"
        )
    digest = hashlib.sha256(MOCK_NVML_SOURCE.read_bytes() + " ".join(CFLAGS).encode() + os.uname().machine.encode())
    target = cache_root() / f"mock-nvml-{digest.hexdigest()[:16]}" / "libnvidia-ml.so.1"

    def build(tmp: Path) -> None:
        result = subprocess.run(
            [compiler, *CFLAGS, "-o", str(tmp), str(MOCK_NVML_SOURCE)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise BuildError(f"building the mock libnvidia-ml.so.1 failed: {result.stderr.strip()[-2000:]}")

    return _publish(target, build)


@functools.cache  # once per process: every fake driver root copies it, and `go env` is a process of its own
def native_imex_ctl() -> Path:
    """The native ``nvidia-imex-ctl`` (``fast_ctl.go``, static, no cgo), built on first use."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).is_file():
        raise BuildError(
            f"no Go toolchain (go on PATH): the fake driver root's nvidia-imex-ctl is built from {NATIVE_CTL_SOURCE}"
        )
    version = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60).stdout.strip()
    digest = hashlib.sha256(NATIVE_CTL_SOURCE.read_bytes() + version.encode() + os.uname().machine.encode())
    target = cache_root() / f"imex-ctl-{digest.hexdigest()[:16]}" / "nvidia-imex-ctl"

    def build(tmp: Path) -> None:
        env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "",
               "GOCACHE": os.environ.get("GOCACHE") or str(cache_root() / "go-build")}  # fmt: skip
        result = subprocess.run(
            [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(tmp), NATIVE_CTL_SOURCE.name],
            cwd=HERE, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if result.returncode != 0:
            raise BuildError(f"building the native nvidia-imex-ctl failed: {result.stderr.strip()[-2000:]}")

    return _publish(target, build)


def _simulator_files() -> dict[str, bytes]:
    files = {"tests/__init__.py": b"", "tests/testbed/__init__.py": (HERE.parent / "__init__.py").read_bytes()}
    for path in sorted(SIMULATOR.glob("*.py")):
        files[f"tests/testbed/imex_simulator/{path.name}"] = path.read_bytes()
    return files


def _with_bytecode(files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` and, beside each ``x.py``, ``x.pyc`` (where zipimport looks first; its tracebacks name the
    module's path in the repository, since copies of the archive live anywhere). Unchecked hash-based
    bytecode: the archive's entries share one timestamp, so only the hash could tell, and the archive is
    rebuilt whenever a source changes anyway. zipimport skips a ``.pyc`` of another Python's magic number
    and compiles the source."""
    out = dict(files)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            if not name.endswith(".py"):
                continue
            source, compiled = Path(tmp) / "module.py", Path(tmp) / "module.pyc"
            source.write_bytes(data)
            py_compile.compile(
                str(source), str(compiled), dfile=name, doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )  # fmt: skip
            out[name + "c"] = compiled.read_bytes()
    return out


def shebang(interpreter: str, flags: str) -> str:
    """``#!<interpreter> <flags>``; through ``env -S`` when the interpreter is itself an ``env`` command line
    (the kernel passes everything after the program as one argument)."""
    if not flags:
        return f"#!{interpreter}"
    if " " in interpreter:
        program, rest = interpreter.split(" ", 1)
        return f"#!{program} -S {rest} {flags}"
    return f"#!{interpreter} {flags}"


def imex_simulator_apps(interpreter: str) -> dict[str, Path]:
    """``nvidia-imex`` and ``nvidia-imex-ctl`` as zip applications for ``interpreter``; name -> cached file."""
    files = _simulator_files()
    digest = hashlib.sha256(interpreter.encode() + repr(sorted(IMEX_APP_FLAGS.items())).encode())
    digest.update(importlib.util.MAGIC_NUMBER)
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + data)
    directory = cache_root() / f"imex-simulator-{digest.hexdigest()[:16]}"
    shared = functools.cache(lambda: _with_bytecode(files))  # compiled once for both archives, on a miss only
    out = {}
    for app, module in IMEX_APPS.items():
        main = f"import sys\nfrom {module} import main\nsys.exit(main())\n".encode()
        first_line = shebang(interpreter, IMEX_APP_FLAGS.get(app, ""))

        def write(tmp: Path, main: bytes = main, first_line: str = first_line) -> None:
            buffer = io.BytesIO()
            with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
                for name, data in {**shared(), **_with_bytecode({"__main__.py": main})}.items():
                    # A fixed timestamp: the same sources give the same bytes.
                    archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
            tmp.write_bytes(f"{first_line}\n".encode() + buffer.getvalue())

        out[app] = _publish(directory / app, write)
    return out
