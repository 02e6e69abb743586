"""A real node's fake NVIDIA driver root: what a GB200 node's driver installation offers, without the hardware.

The node's driver root is an overlay mounted inside the node's mount namespace: the lower layer is the
image's Debian root filesystem (a Python 3 for the IMEX simulator, the usual `bin -> usr/bin` links), the
upper layer this node's own files, written by `lay_out`:

- `proc/devices`, `proc/driver/nvidia/params`, the `fabric-imex-mgmt` capability (`imex.simulated`), with a
  channel major and channel count of the node's own, so a test can tell a real read from a default;
- `usr/bin/nvidia-imex` and `usr/bin/nvidia-imex-ctl`: the IMEX simulator as self-contained zipapps (the
  simulator and the `imex` package it reads its config with; standard library only) with a `/usr/bin/python3`
  shebang. They run wherever that Python exists: in the daemon container (the image's), in a chroot into
  this root (the node agent's hostManaged check), and on the "host" (the node's systemd-like IMEX service);
- `etc/nvidia-imex/`: the host IMEX service's config for hostManaged mode (`nodes_config.cfg` lists the
  nodes' IPs; the command socket is `etc/nvidia-imex/imex_ctrl.sock`).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

from imex.config import render_imexd_cfg, render_nodes_cfg_ips
from imex.simulated import write_fake_driver_root

REPO = Path(__file__).resolve().parents[3]
SIMULATOR = {
    "nvidia-imex": "tests.testbed.imex_simulator.imexd",
    "nvidia-imex-ctl": "tests.testbed.imex_simulator.ctl",
}
IMEX_DIR = "etc/nvidia-imex"
SOCKET = "/etc/nvidia-imex/imex_ctrl.sock"


@dataclass(frozen=True)
class DriverFacts:
    """What a node's driver reports; each node gets its own values."""

    channels_major: int
    channel_count: int


def simulator_zipapp(module: str) -> bytes:
    """The IMEX simulator as one executable file: `#!/usr/bin/python3` + a zip of its modules."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for package in (REPO / "imex", REPO / "tests" / "testbed" / "imex_simulator"):
            for path in sorted(package.rglob("*.py")):
                archive.write(path, path.relative_to(REPO).as_posix())
        for init in ("tests/__init__.py", "tests/testbed/__init__.py"):
            archive.writestr(init, "")
        archive.writestr("__main__.py", f"import sys\nfrom {module} import main\n\nsys.exit(main())\n")
    return b"#!/usr/bin/python3\n" + buffer.getvalue()


def lay_out(upper: Path, facts: DriverFacts, *, node_ip: str, peer_ips: list[str]) -> None:
    """Write this node's files into the overlay's upper directory."""
    write_fake_driver_root(upper, channels_major=facts.channels_major, imex_channel_count=facts.channel_count)
    bin_dir = upper / "usr" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, module in SIMULATOR.items():
        path = bin_dir / name
        path.write_bytes(simulator_zipapp(module))
        path.chmod(0o755)
    conf = upper / IMEX_DIR
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "nodes_config.cfg").write_text(render_nodes_cfg_ips(peer_ips))
    (conf / "config.cfg").write_text(
        render_imexd_cfg(
            cmd_bind_ip=node_ip, nodes_config_file=f"/{IMEX_DIR}/nodes_config.cfg", cmd_unix_domain_path=SOCKET
        )
    )
