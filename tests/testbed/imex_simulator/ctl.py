"""``python -m tests.testbed.imex_simulator.ctl``: the simulated ``nvidia-imex-ctl`` (see ``tests.testbed.imex_simulator``).

Connection: ``-u <socket>`` (also spelt ``--u=<socket>``, the form upstream documents), ``-i <ip> <port>``,
or ``-c <config>`` (command-service IP:port from the config, else its unix socket; default config
``/etc/nvidia-imex/config.cfg``). Modes: ``-q`` prints the local daemon state; ``-N`` prints the domain
status once (``-j`` for JSON); ``--sim-status`` (simulator only) prints the daemon's whole status document
as JSON: node ID, per-slot links, signal counters. ``-t <ms>`` bounds the whole exchange (default 5000).

When the daemon cannot be reached, ``-q`` prints ``UNAVAILABLE`` and a reason and exits 1.

Where it differs from the real binary: it is a Python program, so each run pays an interpreter start. To keep
that near the C binary's few milliseconds it stays on blocking sockets and the standard library's cheapest
modules (no asyncio, which alone costs 50-90 ms to import on the shared cores; no ``typing`` at run time;
``pathlib`` and the config parser only for ``-c``), and its archive starts without ``site`` and with its
bytecode (``tests.testbed.fake_driver_root.build``): the node agent runs it for every hostManaged Prepare,
and what the benchmarks measure there should be the agent's cost, not the stand-in's.
"""

from __future__ import annotations

import getopt
import json
import socket
import sys
import time

from tests.testbed.imex_simulator.wire import MAX_LINE, ProtocolError, decode

# What the real ctl prints when the daemon cannot be reached (`imex.host_check.ImexState.UNAVAILABLE`, not
# imported: that module loads asyncio).
UNAVAILABLE = "UNAVAILABLE"
DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"

TYPE_CHECKING = False  # `typing` alone is 2 ms of a run
if TYPE_CHECKING:
    from typing import Any


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


def _target(args: Args) -> tuple[str, int] | str:
    if args.unix:
        return str(args.unix)
    if args.ip:
        return args.ip
    if "site" not in sys.modules:  # started with -S (the archive's shebang): the `imex` package is installed
        import site

        site.main()
    from pathlib import Path

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


USAGE = (
    "usage: nvidia-imex-ctl [-c CONFIG | -u SOCKET | -i IP PORT] (-q | -N [-j] | --sim-status) [-t MS]\n"
    "  -c config file, -u (--u=) command service unix socket, -i command service address;\n"
    "  -q the local daemon state, -N the domain status once (-j: JSON), --sim-status (simulator only) the\n"
    "  whole status document; -t the whole exchange's timeout in milliseconds (default 5000)"
)


class Args:
    """The parsed command line (getopt, not argparse: argparse and what it loads are 7 ms of every run)."""

    def __init__(self, argv: list[str]) -> None:
        opts, rest = getopt.gnu_getopt(argv, "c:u:i:qNjt:h", ["u=", "sim-status", "help"])
        self.config: str | None = None
        self.unix: str | None = None
        self.ip: tuple[str, int] | None = None
        self.query = self.domain_once = self.json = self.sim_status = self.help = False
        self.timeout_ms = 5000
        for opt, value in opts:
            if opt == "-c":
                self.config = value
            elif opt in ("-u", "--u"):
                self.unix = value
            elif opt == "-i":
                if not rest:
                    raise getopt.GetoptError("-i takes an IP and a port")
                self.ip = (value, int(rest.pop(0)))
            elif opt == "-t":
                self.timeout_ms = int(value)
            elif opt in ("-h", "--help"):
                self.help = True
                return
            else:
                setattr(
                    self, {"-q": "query", "-N": "domain_once", "-j": "json", "--sim-status": "sim_status"}[opt], True
                )
        if rest:
            raise getopt.GetoptError(f"unexpected arguments: {' '.join(rest)}")
        if not (self.query or self.domain_once or self.sim_status):
            raise getopt.GetoptError("one of -q, -N, --sim-status is required")


def main(argv: list[str] | None = None) -> int:
    try:
        args = Args(sys.argv[1:] if argv is None else argv)
    except (getopt.GetoptError, ValueError) as exc:  # ValueError: -t or -i's port not a number
        print(f"nvidia-imex-ctl (simulated): {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if args.help:
        print(USAGE)
        return 0
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
