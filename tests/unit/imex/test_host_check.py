"""Host-managed readiness check: socket path validation, finding the ctl, running it chrooted with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from imex.config import render_imexd_cfg
from imex.host_check import (
    CommandResult,
    HostImexNotReadyError,
    HostImexTimeoutError,
    ImexCtlNotFoundError,
    ImexState,
    SocketPathError,
    check_host_imex_ready,
    ctl_argv,
    find_imex_ctl,
    run_command,
    validate_socket_path,
)
from tests.testbed.imex_simulator.wrappers import install_wrappers
from tests.unit.imex.conftest import wait_until

SOCKET = "/etc/nvidia-imex/imex_ctrl.sock"


@pytest.mark.parametrize("path", [SOCKET, "/run/imex.sock", "/a"])
def test_valid_socket_paths(path: str) -> None:
    assert validate_socket_path(path) == PurePosixPath(path)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "is empty"),
        ("etc/nvidia-imex/imex_ctrl.sock", "is not absolute"),
        ("/etc/nvidia-imex/../../tmp/x.sock", "contains '..'"),
        ("/etc/nvidia-imex/..", "contains '..'"),
        ("/etc//nvidia-imex/imex_ctrl.sock", "is not normalised"),
        ("/etc/nvidia-imex/./imex_ctrl.sock", "is not normalised"),
        ("/etc/nvidia-imex/", "is not normalised"),
        ("//etc/imex.sock", "is not normalised"),
        ("/etc/imex.sock\n", "control characters"),
    ],
)
def test_bad_socket_paths_name_the_setting_and_the_fix(path: str, why: str) -> None:
    with pytest.raises(SocketPathError) as info:
        validate_socket_path(path)
    message = str(info.value)
    assert why in message
    assert message.startswith("IMEX_HOST_SOCKET_PATH") and "set IMEX_HOST_SOCKET_PATH to an absolute" in message
    assert "\n" not in message
    assert info.value.retryable is False


def make_ctl(root: Path, where: str, body: str) -> Path:
    path = root / where.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_find_ctl_search_order(tmp_path: Path) -> None:
    make_ctl(tmp_path, "/usr/sbin/nvidia-imex-ctl", "")
    assert find_imex_ctl(tmp_path) == PurePosixPath("/usr/sbin/nvidia-imex-ctl")
    make_ctl(tmp_path, "/usr/bin/nvidia-imex-ctl", "")
    assert find_imex_ctl(tmp_path) == PurePosixPath("/usr/bin/nvidia-imex-ctl")
    make_ctl(tmp_path, "/opt/bin/nvidia-imex-ctl", "")
    assert find_imex_ctl(tmp_path) == PurePosixPath("/opt/bin/nvidia-imex-ctl")


def test_find_ctl_resolves_absolute_symlinks_inside_the_root(tmp_path: Path) -> None:
    """A host driver root's /usr/bin/x -> /opt/nvidia/x must be followed inside the root, not on our side."""
    make_ctl(tmp_path, "/opt/nvidia/imex/nvidia-imex-ctl", "")
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-imex-ctl").symlink_to("/opt/nvidia/imex/nvidia-imex-ctl")
    assert find_imex_ctl(tmp_path) == PurePosixPath("/opt/nvidia/imex/nvidia-imex-ctl")


def test_find_ctl_ignores_directories_dangling_links_and_non_executables(tmp_path: Path) -> None:
    (tmp_path / "usr/bin/nvidia-imex-ctl").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/nvidia-imex-ctl").symlink_to("/nowhere/nvidia-imex-ctl")
    (tmp_path / "sbin").mkdir()
    (tmp_path / "sbin/nvidia-imex-ctl").write_text("not executable")
    with pytest.raises(ImexCtlNotFoundError) as info:
        find_imex_ctl(tmp_path)
    assert f"nvidia-imex-ctl not found under driver root {tmp_path}" in str(info.value)
    assert "/usr/sbin" in str(info.value) and "is nvidia-imex installed" in str(info.value)
    assert info.value.retryable is True


def test_argv_uses_chroot_except_for_slash(tmp_path: Path) -> None:
    ctl = PurePosixPath("/usr/bin/nvidia-imex-ctl")
    sock = PurePosixPath(SOCKET)
    assert ctl_argv(Path("/"), ctl, sock) == [str(ctl), "-q", "-u", SOCKET]
    assert ctl_argv(tmp_path, ctl, sock, chroot="/usr/sbin/chroot") == [
        "/usr/sbin/chroot",
        str(tmp_path),
        str(ctl),
        "-q",
        "-u",
        SOCKET,
    ]


class FakeRunner:
    def __init__(self, result: CommandResult | BaseException) -> None:
        self.result = result
        self.calls: list[tuple[list[str], float]] = []

    async def __call__(self, argv: list[str], *, timeout_s: float) -> CommandResult:
        self.calls.append((argv, timeout_s))
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


@pytest.fixture
def root_with_ctl(tmp_path: Path) -> Path:
    make_ctl(tmp_path, "/usr/bin/nvidia-imex-ctl", "")
    return tmp_path


@pytest.mark.parametrize("output", ["READY", "READY\n", "  READY \n"])
async def test_ready_only_on_exact_ready(root_with_ctl: Path, output: str) -> None:
    runner = FakeRunner(CommandResult(0, output))
    await check_host_imex_ready(driver_root=root_with_ctl, runner=runner, timeout_s=3)
    argv, timeout_s = runner.calls[0]
    assert argv[-4:] == ["/usr/bin/nvidia-imex-ctl", "-q", "-u", SOCKET] and timeout_s == 3


@pytest.mark.parametrize(
    ("result", "state"),
    [
        (CommandResult(0, "WAITING_FOR_PEERS\n"), ImexState.WAITING_FOR_PEERS),
        (CommandResult(0, "INITIALIZING"), ImexState.INITIALIZING),
        (CommandResult(0, "NOT_READY"), ImexState.UNKNOWN),  # contains READY: upstream would accept it
        (CommandResult(0, "READY\nbut also a warning"), ImexState.READY),
        (CommandResult(0, ""), ImexState.UNKNOWN),
        (CommandResult(1, "READY"), ImexState.READY),  # non-zero exit is never ready
        (CommandResult(1, "UNAVAILABLE\nconnect: no such file"), ImexState.UNAVAILABLE),
    ],
)
async def test_not_ready_carries_state_and_output(root_with_ctl: Path, result: CommandResult, state: ImexState) -> None:
    with pytest.raises(HostImexNotReadyError) as info:
        await check_host_imex_ready(driver_root=root_with_ctl, runner=FakeRunner(result))
    error = info.value
    assert error.state is state and error.output == result.output and error.exit_code == result.exit_code
    assert error.retryable is True
    assert f"state {state}" in str(error) and "\n" not in str(error)


async def test_timeout_is_retryable_error(root_with_ctl: Path) -> None:
    with pytest.raises(HostImexTimeoutError, match="timed out after 2s") as info:
        await check_host_imex_ready(driver_root=root_with_ctl, runner=FakeRunner(TimeoutError()), timeout_s=2)
    assert info.value.retryable


async def test_socket_validated_before_anything_runs(root_with_ctl: Path) -> None:
    runner = FakeRunner(CommandResult(0, "READY"))
    with pytest.raises(SocketPathError):
        await check_host_imex_ready(driver_root=root_with_ctl, socket_path="/x/../y", runner=runner)
    assert runner.calls == []


async def test_missing_binary(tmp_path: Path) -> None:
    runner = FakeRunner(CommandResult(0, "READY"))
    with pytest.raises(ImexCtlNotFoundError):
        await check_host_imex_ready(driver_root=tmp_path, runner=runner)
    assert runner.calls == []


# ---------------------------------------------------------------------------------------------------------
# The real runner, with real processes


async def test_runner_combines_stdout_and_stderr(tmp_path: Path) -> None:
    script = make_ctl(tmp_path, "ctl", "echo out; echo err >&2; exit 3")
    result = await run_command([str(script)], timeout_s=30)
    assert result.exit_code == 3
    assert result.output.split() == ["out", "err"]


async def test_runner_kills_the_whole_group_on_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    # The script forks a grandchild: killing only the direct child would leave it running.
    script = make_ctl(tmp_path, "ctl", f"sleep 600 & echo $! > {pid_file}; wait")
    with pytest.raises(TimeoutError):
        await run_command([str(script)], timeout_s=1)
    grandchild = int(pid_file.read_text())
    wait_until("grandchild gone", lambda: not _alive(grandchild), timeout_s=10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


# ---------------------------------------------------------------------------------------------------------
# chroot into a fake driver root, with the simulator as the host daemon


def start_host_daemon(root: Path, tmp_path: Path, *, peers: list[str]) -> subprocess.Popen[bytes]:
    """A simulated host nvidia-imex serving only a unix socket at <root>/run/nvidia-imex/imex_ctrl.sock."""
    own = "127.77.0.1"
    (tmp_path / "nodes.cfg").write_text("".join(f"{ip}\n" for ip in [own, *peers]))
    cfg = tmp_path / "host-imex.cfg"
    cfg.write_text(
        render_imexd_cfg(cmd_bind_ip=own, nodes_config_file=str(tmp_path / "nodes.cfg"), bind_interface_ip=own)
        .replace(f"IMEX_CMD_BIND_INTERFACE_IP={own}", "IMEX_CMD_BIND_INTERFACE_IP=")
        .replace("IMEX_CMD_UNIX_DOMAIN_PATH=", f"IMEX_CMD_UNIX_DOMAIN_PATH={root}/run/nvidia-imex/imex_ctrl.sock")
        .replace("SERVER_PORT=50000", "SERVER_PORT=50100")
    )
    log = (tmp_path / "host-imex.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.testbed.imex_simulator.imexd", "-c", str(cfg)],
        stdout=log,
        stderr=log,
        env={**os.environ, "IMEX_SIM_HOSTS_FILE": "/dev/null"},
    )
    wait_until("host daemon socket", lambda: (root / "run/nvidia-imex/imex_ctrl.sock").exists())
    return proc


async def test_chroot_check_ready_against_simulated_host_daemon(chroot_driver_root: Path, tmp_path: Path) -> None:
    root = chroot_driver_root
    install_wrappers(root / "opt" / "bin")
    daemon = start_host_daemon(root, tmp_path, peers=[])
    try:
        # The socket path is interpreted inside the chroot: /run/... is <root>/run/... here.
        await check_host_imex_ready(driver_root=root, socket_path="/run/nvidia-imex/imex_ctrl.sock", timeout_s=60)
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=30) == 0


async def test_chroot_check_not_ready_reports_daemon_state(chroot_driver_root: Path, tmp_path: Path) -> None:
    root = chroot_driver_root
    install_wrappers(root / "opt" / "bin")
    daemon = start_host_daemon(root, tmp_path, peers=["127.77.0.2"])  # a peer that never comes
    try:
        with pytest.raises(HostImexNotReadyError) as info:
            await check_host_imex_ready(driver_root=root, socket_path="/run/nvidia-imex/imex_ctrl.sock", timeout_s=60)
        assert info.value.state in (ImexState.WAITING_FOR_PEERS, ImexState.INITIALIZING)
        assert "WAITING_FOR_PEERS" in str(info.value) or "INITIALIZING" in str(info.value)
    finally:
        daemon.kill()
        daemon.wait(timeout=30)


async def test_chroot_check_without_daemon_is_unavailable(chroot_driver_root: Path) -> None:
    install_wrappers(chroot_driver_root / "opt" / "bin")
    with pytest.raises(HostImexNotReadyError) as info:
        await check_host_imex_ready(driver_root=chroot_driver_root, socket_path="/run/none.sock", timeout_s=60)
    assert info.value.state is ImexState.UNAVAILABLE and info.value.exit_code == 1


async def test_chroot_check_hung_ctl_is_killed(chroot_driver_root: Path) -> None:
    root = chroot_driver_root
    # Runs inside the chroot: /run/ctl.pid is <root>/run/ctl.pid.
    make_ctl(root, "/opt/bin/nvidia-imex-ctl", "echo $$ > /run/ctl.pid; exec sleep 600")
    with pytest.raises(HostImexTimeoutError):
        await check_host_imex_ready(driver_root=root, socket_path=SOCKET, timeout_s=2)
    pid = int((root / "run/ctl.pid").read_text())
    wait_until("hung ctl gone", lambda: not _alive(pid), timeout_s=10)


async def test_chroot_check_sees_the_roots_binary_not_ours(chroot_driver_root: Path) -> None:
    """The ctl runs with the driver root as its / : it sees a file that exists only inside the root."""
    marker = _make_marker(chroot_driver_root)
    make_ctl(chroot_driver_root, "/opt/bin/nvidia-imex-ctl", f'test -f {marker} && echo READY || echo "NOT IN ROOT"')
    await check_host_imex_ready(driver_root=chroot_driver_root, socket_path=SOCKET, timeout_s=30)


def _make_marker(root: Path) -> str:
    marker = "/imex-fake-driver-root-marker"
    assert not Path(marker).exists()
    (root / marker.lstrip("/")).write_text("")
    return marker
