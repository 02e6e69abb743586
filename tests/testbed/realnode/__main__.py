"""`python -m tests.testbed.realnode up|down|status`: real nodes on the running local cluster (see `nodes`)."""

from __future__ import annotations

import argparse
import sys

from tests.testbed.cluster import LocalCluster
from tests.testbed.realnode.nodes import RealNodes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed.realnode")
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--nodes", type=int, default=2, help="how many real nodes (up)")
    args = parser.parse_args(argv)
    cluster = LocalCluster()
    nodes = RealNodes(cluster, count=args.nodes)
    if args.command == "up":
        if not cluster.healthy(patience=5.0):
            print("the local cluster is not running; run `make cluster-up` first", file=sys.stderr)
            return 1
        nodes.up(owned=False)
        for name, value in nodes.timings.items():
            print(f"  {name:16} {value:6.1f}")
        for name, mib in nodes.memory_mib().items():
            print(f"  {name:32} {mib:7.1f} MiB")
        return 0
    if args.command == "down":
        nodes.down()
        return 0
    nodes.state = nodes.load()
    if nodes.state is None:
        print("no real nodes")
        return 1
    for node in nodes.nodes:
        alive = {n: bool(p and p.alive()) for n, p in (("kubelet", node.kubelet), ("containerd", node.containerd))}
        print(f"{node.name} {node.ip} {alive}")
    for name, mib in nodes.memory_mib().items():
        print(f"  {name:32} {mib:7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
