"""The IMEX simulator's zip applications: what the node agent runs in every hostManaged Prepare must start
like a small binary, not like a Python program with its site packages."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from tests.testbed.fake_driver_root import build


@pytest.fixture
def apps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # built here, not taken from the cache
    return build.imex_simulator_apps(sys.executable)


def answer_once(path: Path, document: dict[str, object]) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(json.dumps(document).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_the_ctl_starts_without_site_typing_or_argparse_and_answers(apps: dict[str, Path], tmp_path: Path) -> None:
    ctl = apps["nvidia-imex-ctl"]
    assert ctl.read_bytes().split(b"\n", 1)[0] == f"#!{sys.executable} -S".encode()
    sock = tmp_path / "imex.sock"
    server = answer_once(sock, {"state": "READY"})
    out = subprocess.run(
        [str(ctl), "-q", "-u", str(sock)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )  # fmt: skip
    server.join(10)
    assert (out.returncode, out.stdout) == (0, "READY\n"), out.stderr
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "tests.testbed.imex_simulator.ctl" in imported  # the profile is there, so its absences count
    assert not imported & {"site", "typing", "argparse", "pathlib", "asyncio"}


def test_the_ctl_without_site_still_reads_a_config(apps: dict[str, Path], tmp_path: Path) -> None:
    # `-c` needs the installed `imex` package, which only `site` puts on the path.
    sock = tmp_path / "imex.sock"
    cfg = tmp_path / "config.cfg"
    cfg.write_text(f"IMEX_CMD_UNIX_DOMAIN_PATH={sock}\n", encoding="utf-8")
    server = answer_once(sock, {"state": "WAITING_FOR_PEERS"})
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    out = subprocess.run(
        [str(apps["nvidia-imex-ctl"]), "-c", str(cfg), "-q"], capture_output=True, text=True, timeout=60, env=env
    )
    server.join(10)
    assert (out.returncode, out.stdout) == (0, "WAITING_FOR_PEERS\n"), out.stderr


@pytest.mark.parametrize("argv", [["-q", "-t", "soon"], ["-q", "-i", "127.0.0.1"], ["-q", "extra"], ["-u", "/x"]])
def test_the_ctl_refuses_a_bad_command_line_with_its_usage(apps: dict[str, Path], argv: list[str]) -> None:
    out = subprocess.run([str(apps["nvidia-imex-ctl"]), *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("nvidia-imex-ctl (simulated): ") and "usage: nvidia-imex-ctl" in out.stderr


def test_each_archive_carries_bytecode_of_this_python_beside_every_module(apps: dict[str, Path]) -> None:
    for app in apps.values():
        with zipfile.ZipFile(app) as archive:
            names = set(archive.namelist())
            sources = {name for name in names if name.endswith(".py")}
            assert "tests/testbed/imex_simulator/ctl.py" in sources
            for source in sources:
                pyc = archive.read(source + "c")
                assert pyc[:4] == importlib.util.MAGIC_NUMBER
                assert pyc[8:16] == importlib.util.source_hash(archive.read(source))


def test_an_env_interpreter_gets_its_flags_through_env_split() -> None:
    assert build.shebang("/usr/bin/env python3", "-S") == "#!/usr/bin/env -S python3 -S"
    assert build.shebang("/usr/bin/python3", "-S") == "#!/usr/bin/python3 -S"
    assert build.shebang("/usr/bin/env python3", "") == "#!/usr/bin/env python3"
