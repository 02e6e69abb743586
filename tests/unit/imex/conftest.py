"""Fixtures for the imex tests: a harness that runs simulated IMEX daemons as real processes, and a fake
driver root for chroot tests built from read-only bind mounts of what Python needs."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from imex.config import hostname_prefix, render_imexd_cfg, render_nodes_cfg_dns, slot_hostname
from imex.hosts_file import SENTINEL_ADDRESS, HostEntry, update_hosts_file
from tests.testbed.fake_driver_root.chroot import mount_system_dir
from tests.testbed.imex_simulator.ctl import query_status
from tests.testbed.imex_simulator.wrappers import install_wrappers, package_root

# Generous: only a guard against hangs on a loaded machine, never a measured expectation.
WAIT_S = 40.0


def wait_until(what: str, predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        time.sleep(0.05)


@dataclass
class SimNode:
    slot: int
    ip: str
    dir: Path
    cfg: Path
    hosts: Path
    fault_file: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def status(self) -> dict[str, Any] | None:
        """The daemon's status document, or None while it cannot be reached."""
        try:
            return query_status((self.ip, 50005), 5)
        except (OSError, TimeoutError, Exception):
            return None

    def state(self) -> str | None:
        status = self.status()
        return None if status is None else str(status["state"])

    def link(self, slot: int) -> dict[str, Any]:
        status = self.status()
        assert status is not None, f"node {self.slot} unreachable"
        return next(node for node in status["nodes"] if node["index"] == slot)

    def log(self) -> str:
        path = self.dir / "imexd.log"
        return path.read_text() if path.exists() else ""


class SimDomain:
    """N simulated daemons of one domain on 127.a.b.x, one hosts file per node (like one per pod)."""

    def __init__(self, root: Path, bin_dir: Path, size: int, slots: int, env: dict[str, str]) -> None:
        self.root = root
        self.bin_dir = bin_dir
        self.env = env
        self.prefix = hostname_prefix("1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2")
        # A random /16 inside 127/8 so concurrent test runs on one machine do not collide.
        self.net = f"127.{random.randint(20, 250)}.{random.randint(1, 250)}"
        self.slots = slots
        self.nodes_cfg = root / "nodes.cfg"
        self.nodes_cfg.write_text(render_nodes_cfg_dns(self.prefix, slots))
        self.nodes: list[SimNode] = [self._make_node(slot, f"{self.net}.{slot + 1}") for slot in range(size)]
        for node in self.nodes:
            self.write_hosts(node, {n.slot: n.ip for n in self.nodes})

    def _make_node(self, slot: int, ip: str) -> SimNode:
        directory = self.root / f"node{slot}-{ip}"
        directory.mkdir()
        cfg = directory / "imexd.cfg"
        cfg.write_text(render_imexd_cfg(cmd_bind_ip=ip, nodes_config_file=str(self.nodes_cfg)))
        return SimNode(slot, ip, directory, cfg, directory / "hosts", directory / "faults")

    def write_hosts(self, node: SimNode, ip_by_slot: dict[int, str]) -> bool:
        entries = [
            HostEntry(ip_by_slot.get(i, SENTINEL_ADDRESS), slot_hostname(self.prefix, i)) for i in range(self.slots)
        ]
        return update_hosts_file(node.hosts, "test", entries)

    def start(self, node: SimNode, **extra_env: str) -> SimNode:
        env = {
            **os.environ,
            **self.env,
            **node.extra_env,
            **extra_env,
            "IMEX_SIM_HOSTS_FILE": str(node.hosts),
            "IMEX_SIM_FAULT_FILE": str(node.fault_file),
        }
        log = (node.dir / "imexd.log").open("ab")
        node.proc = subprocess.Popen(
            [str(self.bin_dir / "nvidia-imex"), "-c", str(node.cfg)], env=env, stdout=log, stderr=log
        )
        log.close()
        return node

    def move(self, node: SimNode, new_ip: str) -> SimNode:
        """The same slot's daemon, restarted on a new IP (a rescheduled pod)."""
        moved = self._make_node(node.slot, new_ip)
        self.nodes[node.slot] = moved
        return moved

    def stop_all(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()


@pytest.fixture
def sim_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    install_wrappers(bin_dir)
    return bin_dir


@pytest.fixture
def sim_domain(tmp_path: Path, sim_bin: Path) -> Iterator[Callable[..., SimDomain]]:
    made: list[SimDomain] = []

    def make(size: int, slots: int = 4, **env: str) -> SimDomain:
        base = {"IMEX_SIM_HEARTBEAT_INTERVAL": "0.2", "IMEX_SIM_RECONNECT_INTERVAL": "0.1"}
        root = tmp_path / f"domain{len(made)}"
        root.mkdir()
        domain = SimDomain(root, sim_bin, size, slots, {**base, **env})
        made.append(domain)
        return domain

    yield make
    for domain in made:
        domain.stop_all()


def dump_logs(domain: SimDomain) -> str:
    return "\n".join(f"--- node {n.slot} ({n.ip})\n{n.log()}" for n in domain.nodes)


def send_signal(node: SimNode, sig: signal.Signals) -> None:
    assert node.proc is not None
    node.proc.send_signal(sig)


# ------------------------------------------------------------------------------------------------------
# Fake driver root for chroot


@pytest.fixture
def chroot_driver_root(tmp_path: Path) -> Iterator[Path]:
    """A driver root with read-only bind mounts of the system and Python dirs, and ``opt/bin`` to fill.

    Needs root and mount(2). If that is not available the test fails with the reason (set
    IMEX_SKIP_CHROOT_TESTS=1 to turn it into an explicit skip on machines known to lack it).
    """
    root = tmp_path / "driver-root"
    root.mkdir()
    with system_in_root(root):
        yield root


@contextlib.contextmanager
def system_in_root(root: Path) -> Iterator[Path]:
    """Mount the system and Python dirs read-only into ``root`` (files the root already has stay on top)."""
    if os.environ.get("IMEX_SKIP_CHROOT_TESTS") == "1":
        pytest.skip("IMEX_SKIP_CHROOT_TESTS=1: chroot tests need root and bind mounts")
    if os.geteuid() != 0:
        pytest.fail("chroot tests need root (or set IMEX_SKIP_CHROOT_TESTS=1 to skip them explicitly)")
    (root / "dev").mkdir(exist_ok=True)
    (root / "run").mkdir(exist_ok=True)
    (root / "opt" / "bin").mkdir(parents=True, exist_ok=True)
    sources = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", sys.base_prefix, sys.prefix, str(package_root())]
    # Parents first, so a child already visible through its parent's mount is skipped.
    sources.sort(key=lambda s: len(Path(s).parts))
    mounted: list[Path] = []
    try:
        for source in dict.fromkeys(sources):
            src = Path(source)
            if not src.exists():
                continue
            target = root / src.relative_to("/")
            if src.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists() and not target.is_symlink():
                    target.symlink_to(src.readlink())
                continue
            if any(src.is_relative_to(Path("/") / m.relative_to(root)) for m in mounted):
                continue  # already visible through a parent mount
            try:
                mount_system_dir(src, target)
            except subprocess.CalledProcessError as exc:
                pytest.fail(f"cannot mount {src} for the chroot test: {exc.stderr.decode().strip()}")
            mounted.append(target)
            # pytest later deletes tmp_path; a writable bind mount there would let it delete the real tree.
            probe = target / ".imex-rw-probe"
            try:
                probe.touch()
            except OSError:
                pass
            else:
                probe.unlink()
                pytest.fail(f"bind mount of {src} is writable; refusing to continue")
        yield root
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True, timeout=30)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
