"""Simulated daemons started through the fork server behave, to the process that started them, like exec'd
ones: peers connect, signals reach the simulator, its exit status comes back, and killing the starter takes
the simulator down with it."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.testbed.imex_simulator.forkserver import client_script
from tests.testbed.imex_simulator.wrappers import package_root
from tests.unit.imex.conftest import SimDomain, dump_logs, send_signal, wait_until

MakeDomain = Callable[..., SimDomain]


@pytest.fixture
def forked(tmp_path: Path) -> Iterator[Callable[[SimDomain], None]]:
    """Points a domain's `nvidia-imex` at the fork server's client (the binary stays its fallback)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.testbed.imex_simulator.forkserver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=package_root(),
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())

    def use(domain: SimDomain) -> None:
        client = tmp_path / "nvidia-imex-forked"
        client.write_text(client_script(port))
        client.chmod(0o755)
        real = domain.bin_dir / "nvidia-imex"
        bin_dir = tmp_path / "forked-bin"
        bin_dir.mkdir()
        (bin_dir / "nvidia-imex").write_text(f'#!/bin/sh\nexec {client} {real} "$@"\n')
        (bin_dir / "nvidia-imex").chmod(0o755)
        domain.bin_dir = bin_dir

    yield use
    assert server.stdin is not None
    server.stdin.close()  # the server's end: it kills what it still runs
    assert server.wait(timeout=30) == 0


def test_forked_daemons_connect_take_signals_and_report_their_exit(
    sim_domain: MakeDomain, forked: Callable[[SimDomain], None]
) -> None:
    domain = sim_domain(3, slots=3)
    forked(domain)
    for node in domain.nodes:
        domain.start(node)
    for node in domain.nodes:
        wait_until(f"node {node.slot} READY\n{dump_logs(domain)}", lambda n=node: n.state() == "READY")  # type: ignore[misc]
    a, b, c = domain.nodes
    status = a.status()
    assert status is not None and status["pid"] != a.proc.pid  # type: ignore[union-attr]  # a fork, not the starter

    send_signal(a, signal.SIGUSR1)  # to the starter, as the daemon wrapper sends it
    wait_until("SIGUSR1 forwarded", lambda: (a.status() or {}).get("counters", {}).get("sigusr1_received") == 1)

    send_signal(b, signal.SIGTERM)
    assert b.proc is not None and b.proc.wait(timeout=60) == 0
    assert "shutdown complete" in b.log()

    assert c.proc is not None
    sim_pid = (c.status() or {})["pid"]
    c.proc.kill()  # SIGKILL of the starter: a container's death
    c.proc.wait()
    wait_until("the killed starter's simulator gone", lambda: _gone(sim_pid) and c.status() is None)
    wait_until("a drops c", lambda: a.state() == "WAITING_FOR_PEERS")


def test_exit_status_of_a_failed_start_comes_back(sim_domain: MakeDomain, forked: Callable[[SimDomain], None]) -> None:
    domain = sim_domain(2, slots=2)
    forked(domain)
    a = domain.nodes[0]
    domain.write_hosts(a, {1: domain.nodes[1].ip})  # a's own name maps to the sentinel: no address is ours
    domain.start(a)
    assert a.proc is not None and a.proc.wait(timeout=60) == 1
    assert "No matching network interface" in a.log()


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" in status.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
