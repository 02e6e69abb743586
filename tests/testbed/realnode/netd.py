"""The real nodes' link to the control plane on the machine's loopback: two small TCP relays in one process.

    python -m tests.testbed.realnode.netd --hub-netns /proc/PID/ns/net --apiserver 127.0.0.1:PORT \
        --service 10.96.0.1:443 --egress-socket PATH

- **Service relay**: listens on the `kubernetes` Service address (10.96.0.1:443) inside the hub network
  namespace, which every node namespace routes to, and relays each connection to the apiserver on the host's
  loopback. Kubelets and pods reach the apiserver as in a cluster without kube-proxy: through the Service IP
  (the apiserver's certificate names it).
- **Egress proxy**: the apiserver's `cluster` egress selector (kubelet logs, exec, port-forward) sends an HTTP
  CONNECT over a unix socket; addresses of the test bed's range (198.18.0.0/15: node and pod IPs) are dialled
  from inside the hub namespace, anything else is refused (nothing leaves this machine through the proxy).

Sockets belong to the network namespace of the thread that creates them: the listening socket and each
dialled one are created after setns(2) into the hub namespace and the thread switches back at once, so
everything else of this process stays in the host's namespace. Connections are relayed byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
TESTBED_RANGE = ipaddress.ip_network("198.18.0.0/15")
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def in_netns(path: str) -> Iterator[None]:
    """Run the block with this thread in the network namespace at `path`, then return to the current one."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - would leave the thread stranded
                os._exit(70)
    finally:
        os.close(target)
        os.close(home)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


async def _relay(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        for _, writer in (a, b):
            writer.close()


def _dial_socket(host: str, port: int, netns: str | None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if netns is None:
        sock = socket.socket(family, socket.SOCK_STREAM)
    else:
        with in_netns(netns):
            sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


async def dial(host: str, port: int, netns: str | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = _dial_socket(host, port, netns)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), 10)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


def service_handler(apiserver: tuple[str, int]) -> Callable[..., object]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await dial(apiserver[0], apiserver[1], None)
        except (OSError, TimeoutError):
            writer.close()
            return
        await _relay((reader, writer), upstream)

    return handle


def egress_handler(hub_netns: str) -> Callable[..., object]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        request = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        status = "400 Bad Request"
        upstream = None
        if len(request) == 3 and request[0] == "CONNECT":
            host, _, port = request[1].rpartition(":")
            host = host.strip("[]")
            try:
                address = ipaddress.ip_address(host)
                if address not in TESTBED_RANGE:
                    status = "403 Forbidden"
                else:
                    upstream = await dial(str(address), int(port), hub_netns)
                    status = "200 Connection established"
            except ValueError:
                status = "400 Bad Request"
            except (OSError, TimeoutError):
                status = "502 Bad Gateway"
        writer.write(f"HTTP/1.1 {status}\r\n\r\n".encode())
        with contextlib.suppress(OSError):
            await writer.drain()
        if upstream is None:
            writer.close()
            return
        await _relay((reader, writer), upstream)

    return handle


async def serve(args: argparse.Namespace) -> None:
    host, _, port = args.service.rpartition(":")
    with in_netns(args.hub_netns):
        listener = socket.create_server((host, int(port)), backlog=128)
    api_host, _, api_port = args.apiserver.rpartition(":")
    service = await asyncio.start_server(service_handler((api_host, int(api_port))), sock=listener)
    socket_path = Path(args.egress_socket)
    egress = await asyncio.start_unix_server(egress_handler(args.hub_netns), path=socket_path)
    await asyncio.to_thread(socket_path.chmod, 0o600)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"netd: serving {args.service} (hub) -> {args.apiserver}, egress on {args.egress_socket}", flush=True)
    async with service, egress:
        await stop.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed.realnode.netd")
    parser.add_argument("--hub-netns", required=True)
    parser.add_argument("--apiserver", required=True, help="HOST:PORT on this machine's loopback")
    parser.add_argument("--service", default="10.96.0.1:443", help="HOST:PORT to listen on in the hub")
    parser.add_argument("--egress-socket", required=True)
    args = parser.parse_args(argv)
    Path(args.egress_socket).unlink(missing_ok=True)
    try:
        asyncio.run(serve(args))
    finally:
        Path(args.egress_socket).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
