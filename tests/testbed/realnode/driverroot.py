"""A real node's fake NVIDIA driver root: what a GB200 node's driver installation offers, without the hardware.

The root is an overlay mounted inside the node's mount namespace (`nodes`). Its lower layers are the
service image's unpacked layers (`tests.testbed.image`): Debian's Python 3 and the `imex` package, which the
IMEX simulator needs wherever it runs (in a chroot into this root: the node agent's hostManaged check, and
the node's own IMEX service). Its upper layer holds this node's own files, written by `lay_out` through
`tests.testbed.fake_driver_root`, exactly as for the simulated nodes:

- the driver's `/proc` files, with a channel major and a channel count of the node's own, so a test can tell
  a real read from a default (`DriverFacts`);
- the mock `libnvidia-ml.so.1` and its answers (both nodes in one NVLink clique), with the root's
  `ld.so.cache`;
- `usr/bin/nvidia-imex` and `usr/bin/nvidia-imex-ctl` (the simulator as zip applications run by
  `/usr/bin/env python3`), which the node agent's base CDI spec hands to the IMEX daemon containers;
- `etc/nvidia-imex/`: the host IMEX service's config for hostManaged mode (its peers are the nodes' IPs; the
  command socket is `/etc/nvidia-imex/imex_ctrl.sock` inside the root).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from imex.config import render_imexd_cfg, render_nodes_cfg_ips
from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, write_fake_driver_root

IMEX_DIR = "etc/nvidia-imex"
SOCKET = "/etc/nvidia-imex/imex_ctrl.sock"
# Every real node of a test bed is a tray of this one rack.
CLUSTER_UUID = uuid.UUID("5f1c0a8e-3b6d-4c2a-9e7f-1d2c3b4a5e6f")
CLIQUE_ID = 7


@dataclass(frozen=True)
class DriverFacts:
    """What a node's driver reports; each node gets its own values."""

    channels_major: int
    channel_count: int

    @property
    def clique(self) -> str:
        return f"{CLUSTER_UUID}.{CLIQUE_ID}"


def lay_out(upper: Path, name: str, facts: DriverFacts, *, node_ip: str, peer_ips: list[str]) -> None:
    """Write this node's files into the overlay's upper directory."""
    node = SimulatedNode(name=name, clique=SimulatedClique(cluster_uuid=CLUSTER_UUID, clique_id=CLIQUE_ID))
    write_fake_driver_root(
        upper,
        node,
        interpreter="/usr/bin/env python3",
        channels_major=facts.channels_major,
        imex_channel_count=facts.channel_count,
    )
    # A host's root has a hosts file (the IMEX service reads it); a container image's may not.
    (upper / "etc" / "hosts").write_text(f"127.0.0.1\tlocalhost\n{node_ip}\t{name}\n")
    conf = upper / IMEX_DIR
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "nodes_config.cfg").write_text(render_nodes_cfg_ips(peer_ips))
    (conf / "config.cfg").write_text(
        render_imexd_cfg(
            cmd_bind_ip=node_ip, nodes_config_file=f"/{IMEX_DIR}/nodes_config.cfg", cmd_unix_domain_path=SOCKET
        )
    )
