"""``python -m tests.testbed.imex_simulator.ctl``: the simulated ``nvidia-imex-ctl`` (see ``tests.testbed.imex_simulator``).

Connection: ``-u <socket>`` (also spelt ``--u=<socket>``, the form upstream documents), ``-i <ip> <port>``,
or ``-c <config>`` (command-service IP:port from the config, else its unix socket; default config
``/etc/nvidia-imex/config.cfg``). Modes: ``-q`` prints the local daemon state; ``-N`` prints the domain
status once (``-j`` for JSON); ``--sim-status`` (simulator only) prints the daemon's whole status document
as JSON: node ID, per-slot links, signal counters. ``-t <ms>`` bounds the whole exchange (default 5000).

When the daemon cannot be reached, ``-q`` prints ``UNAVAILABLE`` and a reason and exits 1.

Where it differs from the real binary: it is a Python program, so each run pays an interpreter start. To keep
that near the C binary's few milliseconds it stays on blocking sockets and the standard library's cheapest
modules (no asyncio, which alone costs 50-90 ms to import on the shared cores; the config parser only for
``-c``): the node agent runs it for every hostManaged Prepare, and what the benchmarks measure there should
be the agent's cost, not the stand-in's.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tests.testbed.imex_simulator.wire import MAX_LINE, ProtocolError, decode

# What the real ctl prints when the daemon cannot be reached (`imex.host_check.ImexState.UNAVAILABLE`, not
# imported: that module loads asyncio).
UNAVAILABLE = "UNAVAILABLE"
DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"


class UnreachableError(Exception):
    pass


class ConfigError(Exception):
    """The config named by ``-c`` cannot be read or parsed."""


def query_status(target: tuple[str, int] | str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The daemon's status document, the whole exchange within `timeout_s` (`TimeoutError` after it)."""
    deadline = time.monotonic() + timeout_s
    try:
        if isinstance(target, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(target)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(target, timeout=timeout_s)
    except TimeoutError:
        raise
    except OSError as exc:
        raise UnreachableError(
            f"cannot connect to the IMEX command service at {_show(target)}: {exc.strerror or exc}"
        ) from None
    with sock:
        sock.sendall(b'{"cmd":"status"}\n')
        line = b""
        while not line.endswith(b"\n"):
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(65536)
            if not chunk:
                break
            line += chunk
            if len(line) > MAX_LINE:
                raise ProtocolError(f"an answer longer than {MAX_LINE} bytes from {_show(target)}")
    if not line:
        raise UnreachableError(f"IMEX command service at {_show(target)} closed the connection")
    return decode(line)


def _show(target: tuple[str, int] | str) -> str:
    return target if isinstance(target, str) else f"{target[0]}:{target[1]}"


def _target(args: argparse.Namespace) -> tuple[str, int] | str:
    if args.unix:
        return str(args.unix)
    if args.ip:
        return (args.ip[0], int(args.ip[1]))
    from imex.config import ImexConfig, ImexConfigError  # only here: the `-q -u` of every Prepare never needs it

    config = args.config or DEFAULT_CONFIG
    try:
        cfg = ImexConfig.parse(Path(config).read_text(encoding="utf-8"), source=config)
    except (OSError, ImexConfigError) as exc:
        raise ConfigError(str(exc)) from None
    if cfg.cmd_bind_ip:
        return (cfg.cmd_bind_ip, cfg.cmd_port)
    if cfg.cmd_unix_domain_path:
        return cfg.cmd_unix_domain_path
    return ("127.0.0.1", cfg.cmd_port)


def _print_domain(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        nodes = {
            str(node["index"]): {"host": node["name"], "address": node["address"], "link": node["link"]}
            for node in status.get("nodes", [])
        }
        print(json.dumps({"status": status.get("domain"), "nodeId": status.get("node_id"), "nodes": nodes}))
        return
    for node in status.get("nodes", []):
        print(f"Node #{node['index']} - {node['name']} - {node['address']} - {node['link']}")
    print(f"Domain State: {status.get('domain')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-imex-ctl", description="IMEX control simulator")
    parser.add_argument("-c", dest="config", help="config file")
    parser.add_argument("-u", "--u", dest="unix", help="command service unix socket")
    parser.add_argument("-i", dest="ip", nargs=2, metavar=("IP", "PORT"), help="command service address")
    parser.add_argument("-q", dest="query", action="store_true", help="print the local daemon state")
    parser.add_argument("-N", dest="domain_once", action="store_true", help="print the domain status once")
    parser.add_argument("-j", dest="json", action="store_true", help="JSON output for -N")
    parser.add_argument("-t", dest="timeout_ms", type=int, default=5000, help="timeout in milliseconds")
    parser.add_argument("--sim-status", action="store_true", help="simulator only: full status document")
    args = parser.parse_args(argv)
    if not (args.query or args.domain_once or args.sim_status):
        parser.error("one of -q, -N, --sim-status is required")
    try:
        target = _target(args)
    except ConfigError as exc:
        print(f"nvidia-imex-ctl (simulated): {exc}", file=sys.stderr)
        return 1
    try:
        status = query_status(target, args.timeout_ms / 1000)
    except (UnreachableError, ProtocolError, OSError) as exc:  # OSError: TimeoutError, a reset mid-answer
        if args.query:
            print(UNAVAILABLE)
        print(f"{exc or 'timed out waiting for the IMEX command service'}", file=sys.stderr)
        return 1
    if args.sim_status:
        print(json.dumps(status, indent=2))
    elif args.domain_once:
        _print_domain(status, args.json)
    else:
        print(status.get("state", UNAVAILABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
