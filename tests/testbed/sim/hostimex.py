"""hostManaged mode's host IMEX: one simulated `nvidia-imex` "systemd service" per fabric node.

On a real hostManaged node, `nvidia-imex` runs on the host, configured for the rack (`nodes_config.cfg` lists
the rack's node IPs) with its command service on a unix socket, and the node agent checks it by running
`nvidia-imex-ctl -q -u <socket>` chrooted into the driver root. Here each fabric node gets

- `<node>/etc/nvidia-imex/config.cfg` + `nodes_config.cfg` (its rack's host IPs) and the simulator bound to
  the node's host IP (peers) and to `<node>/etc/nvidia-imex/imex_ctrl.sock` (command service), so the socket
  is at `/etc/nvidia-imex/imex_ctrl.sock` as seen from the node's root;
- a driver root the chroot can run the simulator's ctl in: `/usr`, the Python installation and the
  repository mounted read-only (`/usr` as an overlay under the fake driver's own `usr/` files:
  `tests.testbed.fake_driver_root.chroot`), the usual `bin -> usr/bin` links, and the ctl wrapper at
  `<node>/opt/bin/nvidia-imex-ctl` (one of the places the node agent looks).

`stop(node)` / `start(node)` are the operator's `systemctl stop|start nvidia-imex`. Bind mounts need root and
mount(2); `unmount_all` undoes them and must run before anything deletes the node trees.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from imex.config import render_imexd_cfg, render_nodes_cfg_ips
from tests.testbed.fake_driver_root.chroot import mount_system_dir
from tests.testbed.sim.containers import REPO
from tests.testbed.sim.topology import SimNode, SimTopology

IMEX_DIR = "/etc/nvidia-imex"
SOCKET = "/etc/nvidia-imex/imex_ctrl.sock"


class HostImexError(RuntimeError):
    pass


def _python_roots() -> list[Path]:
    """What the chrooted ctl needs: the system, the interpreter and the repository (with its venv)."""
    out: list[Path] = []
    for root in sorted({Path("/usr"), Path(sys.base_prefix).resolve(), REPO}, key=lambda p: len(p.parts)):
        if not any(root.is_relative_to(kept) for kept in out):
            out.append(root)
    return out


def mounted_below(root: Path) -> list[Path]:
    """Mount points at or below `root`, from /proc/self/mountinfo."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = Path(line.split()[4].replace("\\040", " "))
            if point == root or root in point.parents:
                out.append(point)
    return out


class HostImex:
    def __init__(self, topology: SimTopology, log_dir: Path) -> None:
        self.topology = topology
        self.log_dir = log_dir
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.mounts: list[Path] = []

    def prepare_root(self, node: SimNode) -> None:
        if os.geteuid() != 0:
            raise HostImexError("hostManaged simulation needs root (chroot and bind mounts into the driver roots)")
        for link, link_target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            path = node.root / link
            if not path.exists() and not path.is_symlink() and (Path("/") / link).is_symlink():
                path.symlink_to(link_target)
        for source in _python_roots():
            target = node.root / source.relative_to("/")
            if any(m == target for m in mounted_below(node.root)):
                continue
            try:
                mount_system_dir(source, target)
            except subprocess.CalledProcessError as exc:
                raise HostImexError(
                    f"cannot mount {source} into {node.name}'s driver root: {exc.stderr.decode().strip()}"
                ) from None
            self.mounts.append(target)
        ctl = node.host_path("/opt/bin/nvidia-imex-ctl")
        ctl.parent.mkdir(parents=True, exist_ok=True)
        ctl.write_text(
            "#!/bin/sh\n# The host's nvidia-imex-ctl: the IMEX simulator's (tests/testbed/sim/hostimex.py)\n"
            f'PYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -S -m tests.testbed.imex_simulator.ctl "$@"\n'
        )
        ctl.chmod(0o755)
        conf = node.host_path(IMEX_DIR)
        conf.mkdir(parents=True, exist_ok=True)
        peers = [n.host_ip for n in self.topology.cliques()[node.clique]]
        (conf / "nodes_config.cfg").write_text(render_nodes_cfg_ips(peers))
        (conf / "config.cfg").write_text(
            render_imexd_cfg(
                cmd_bind_ip=node.host_ip,
                nodes_config_file=str(conf / "nodes_config.cfg"),
                cmd_unix_domain_path=str(node.host_path(SOCKET)),
            )
        )

    async def start(self, node: SimNode) -> None:
        if node.name in self.procs and self.procs[node.name].returncode is None:
            return
        env = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(REPO),
            "IMEX_SIM_NODE_IP": node.host_ip,
            "IMEX_SIM_HOSTS_FILE": str(node.host_path("/etc/hosts")),
            "IMEX_SIM_FAULT_FILE": str(node.host_path(IMEX_DIR) / "faults"),
        }
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"host-imex_{node.name}.log").open("ab") as log:
            self.procs[node.name] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.testbed.imex_simulator.imexd", "-c", str(node.host_path(IMEX_DIR) / "config.cfg"),
                env=env, stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=REPO, start_new_session=True,
            )  # fmt: skip

    async def stop(self, node: SimNode) -> None:
        proc = self.procs.pop(node.name, None)
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def start_all(self) -> None:
        for node in self.topology:
            if node.clique:
                self.prepare_root(node)
                await self.start(node)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(self.topology.by_name[n]) for n in list(self.procs)))

    def unmount_all(self) -> None:
        for target in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30, check=False)
        self.mounts.clear()
