"""``python -m tests.testbed.imex_simulator.imexd -c <cfg>``: the simulated ``nvidia-imex`` (see ``tests.testbed.imex_simulator``).

Runs in the foreground whatever DAEMONIZE says (our daemon pods need that anyway), logs to stderr, and
exits 0 after a graceful SIGTERM, 1 when it cannot start (unreadable config, no own address, port taken).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path

from imex.config import ImexConfig, ImexConfigError
from tests.testbed.imex_simulator.daemon import Settings, SimulatedImexDaemon

DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-imex", description="IMEX daemon simulator")
    parser.add_argument("-c", dest="config", default=DEFAULT_CONFIG, help="config file (default %(default)s)")
    parser.add_argument("-p", dest="port", type=int, default=None, help="override SERVER_PORT")
    parser.add_argument("--nogpu", action="store_true", help="accepted for compatibility; the simulator has no GPU")
    args = parser.parse_args(argv)
    try:
        cfg = ImexConfig.parse(Path(args.config).read_text(encoding="utf-8"), source=args.config)
    except OSError as exc:
        print(f"nvidia-imex (simulated): cannot read config {args.config}: {exc.strerror}", file=sys.stderr)
        return 1
    except ImexConfigError as exc:
        print(f"nvidia-imex (simulated): {exc}", file=sys.stderr)
        return 1
    if args.port is not None:
        cfg = dataclasses.replace(cfg, server_port=args.port)
    settings = Settings.from_env()
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s imex-sim[{settings.node_ip or cfg.cmd_bind_ip or '-'}] %(levelname)s %(message)s",
    )
    return asyncio.run(SimulatedImexDaemon(cfg, settings).run())


if __name__ == "__main__":
    sys.exit(main())
