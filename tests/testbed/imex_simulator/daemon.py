"""The simulated IMEX daemon: peers over real TCP, a command service, signals, liveness, faults.

Concurrency model: one asyncio loop in one process. Tasks: the command service(s), the peer server, one
link task per peer slot (connect, handshake, heartbeat, reconnect), and a tick task that re-reads the
fault file. State is derived, never stored: ``state()`` looks at the links each time it is asked, and a
transition is logged when the derived value changes. Signal handlers only set flags or start tasks.

Own address: ``BIND_INTERFACE_IP`` when set, else ``IMEX_SIM_NODE_IP``, else the command-service IP when
it is one of the resolved ``nodes.cfg`` addresses. The real daemon matches local interface addresses;
every simulated node shares the host's loopback, where all of 127/8 is local, so that rule would match
every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imex.config import ImexConfig, parse_nodes_cfg
from imex.host_check import ImexState
from imex.hosts_file import SENTINEL_ADDRESS, parse_hosts
from tests.testbed.imex_simulator import wire
from tests.testbed.imex_simulator.faults import Faults, FaultSpecError, read_faults

log = logging.getLogger("tests.testbed.imex_simulator")

Clock = Callable[[], float]


class LinkState(enum.StrEnum):
    SELF = "SELF"
    SENTINEL = "SENTINEL"  # slot mapped to the sentinel address: nobody holds it, not counted
    UNRESOLVED = "UNRESOLVED"  # name not in the hosts file: not counted
    CONNECTING = "CONNECTING"
    CONNECTED = "CONNECTED"
    INDEX_MISMATCH = "INDEX_MISMATCH"  # the peer at that address says it holds another slot
    REJECTED = "REJECTED"  # the peer refused us (other domain, or fault)


COUNTED_LINK_STATES = frozenset(
    {LinkState.CONNECTING, LinkState.CONNECTED, LinkState.INDEX_MISMATCH, LinkState.REJECTED}
)


@dataclass(frozen=True)
class Settings:
    """Simulator knobs that the real daemon does not have, from ``IMEX_SIM_*`` env vars."""

    hosts_file: Path = Path("/etc/hosts")
    node_ip: str = ""
    faults_env: str = ""
    fault_file: Path | None = None
    sigusr1_interval_s: float = 5.0
    heartbeat_s: float = 0.5
    heartbeat_misses: int = 3
    reconnect_s: float = 0.2
    shutdown_grace_s: float = 0.2

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        fault_file = env.get("IMEX_SIM_FAULT_FILE", "")
        return cls(
            hosts_file=Path(env.get("IMEX_SIM_HOSTS_FILE", "/etc/hosts")),
            node_ip=env.get("IMEX_SIM_NODE_IP", ""),
            faults_env=env.get("IMEX_SIM_FAULTS", ""),
            fault_file=Path(fault_file) if fault_file else None,
            sigusr1_interval_s=float(env.get("IMEX_SIM_SIGUSR1_INTERVAL", "5")),
            heartbeat_s=float(env.get("IMEX_SIM_HEARTBEAT_INTERVAL", "0.5")),
            heartbeat_misses=int(env.get("IMEX_SIM_HEARTBEAT_MISSES", "3")),
            reconnect_s=float(env.get("IMEX_SIM_RECONNECT_INTERVAL", "0.2")),
            shutdown_grace_s=float(env.get("IMEX_SIM_SHUTDOWN_GRACE", "0.2")),
        )


class ReResolveLimiter:
    """IMEX honours SIGUSR1 at most once per interval and drops the rest (it does not defer them)."""

    def __init__(self, interval_s: float, clock: Clock = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None

    def allow(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        return True


class StartupError(Exception):
    """The daemon cannot start (the real one logs and exits non-zero in the same situations)."""


@dataclass
class Link:
    slot: int
    name: str
    address: str | None
    state: LinkState
    task: asyncio.Task[None] | None = None
    detail: str = ""
    connects: int = 0


@dataclass
class Counters:
    sigusr1_received: int = 0
    sigusr1_ignored: int = 0
    reresolves: int = 0
    peers_accepted: int = 0
    peers_rejected: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class SimulatedImexDaemon:
    def __init__(self, cfg: ImexConfig, settings: Settings, *, clock: Clock = time.monotonic) -> None:
        self.cfg = cfg
        self.settings = settings
        self.limiter = ReResolveLimiter(settings.sigusr1_interval_s, clock)
        self.counters = Counters()
        self.faults = Faults()
        self.names: list[str] = []
        self.links: dict[int, Link] = {}
        self.node_id: int | None = None
        self.address = ""
        self._initialized = False
        self._shutting_down = False
        self._last_state: ImexState | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._peer_writers: set[asyncio.StreamWriter] = set()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._faults_changed = asyncio.Event()

    # ---------------------------------------------------------------- state

    def state(self) -> ImexState:
        if self._shutting_down:
            return ImexState.SHUTTING_DOWN
        if self.faults.force_state is not None:
            return self.faults.force_state
        if not self._initialized:
            return ImexState.INITIALIZING
        counted = [link for link in self.links.values() if link.state in COUNTED_LINK_STATES]
        if all(link.state is LinkState.CONNECTED for link in counted):
            return ImexState.READY
        return ImexState.WAITING_FOR_PEERS

    def _note_state(self) -> None:
        state = self.state()
        if state != self._last_state:
            connected = sum(1 for link in self.links.values() if link.state is LinkState.CONNECTED)
            counted = sum(1 for link in self.links.values() if link.state in COUNTED_LINK_STATES)
            log.info("state %s -> %s (%d/%d peers connected)", self._last_state, state, connected, counted)
            self._last_state = state

    def status(self) -> dict[str, Any]:
        state = self.state()
        counted = [link for link in self.links.values() if link.state in COUNTED_LINK_STATES]
        connected = [link for link in counted if link.state is LinkState.CONNECTED]
        if state is ImexState.READY and len(connected) == len(counted):
            domain = "UP"
        elif not connected and state is not ImexState.READY:
            domain = "DOWN"
        else:
            domain = "DEGRADED"
        return {
            "state": str(state),
            "domain": domain,
            "node_id": self.node_id,
            "name": self.names[self.node_id] if self.node_id is not None else None,
            "address": self.address,
            "pid": os.getpid(),
            "nodes": [
                {
                    "index": link.slot,
                    "name": link.name,
                    "address": link.address,
                    "link": str(link.state),
                    "detail": link.detail,
                }
                for link in sorted(self.links.values(), key=lambda link: link.slot)
            ],
            "counters": {
                "sigusr1_received": self.counters.sigusr1_received,
                "sigusr1_ignored": self.counters.sigusr1_ignored,
                "reresolves": self.counters.reresolves,
                "peers_accepted": self.counters.peers_accepted,
                "peers_rejected": self.counters.peers_rejected,
            },
        }

    # ---------------------------------------------------------------- lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._refresh_faults()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self._on_sigterm)
        loop.add_signal_handler(signal.SIGUSR1, self._on_sigusr1)
        self._spawn(self._tick())
        try:
            await self._start_command_service()
            self._note_state()
            if self.faults.startup_delay_s > 0:
                await asyncio.sleep(self.faults.startup_delay_s)
            self.names = self._read_nodes_cfg()
            resolved = self._resolve()
            self._pick_self(resolved)
            await self._start_peer_server()
            for slot, name in enumerate(self.names):
                self.links[slot] = Link(slot, name, resolved[slot], LinkState.CONNECTING)
                self._arm_link(self.links[slot])
            self._initialized = True
            log.info(
                "node id %d (%s) at %s, %d slots",
                self.node_id,
                self.names[self.node_id or 0],
                self.address,
                len(self.names),
            )
            self._note_state()
            await self._stop.wait()
            await self._shutdown()
            return 0
        except StartupError as exc:
            log.error("%s", exc)
            return 1
        finally:
            await self._close_everything()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_sigterm(self) -> None:
        log.info("SIGTERM: shutting down")
        self._stop.set()

    def _on_sigusr1(self) -> None:
        self.counters.sigusr1_received += 1
        if not self._initialized or self._shutting_down:
            self.counters.sigusr1_ignored += 1
            return
        if not self.limiter.allow():
            self.counters.sigusr1_ignored += 1
            log.info("SIGUSR1 ignored: less than %gs since the last re-resolve", self.limiter.interval_s)
            return
        self.reresolve()

    def reresolve(self) -> None:
        """Re-read the hosts file; restart links whose address changed (nodes.cfg itself is not re-read)."""
        self.counters.reresolves += 1
        try:
            resolved = self._resolve()
        except StartupError as exc:
            log.error("re-resolve failed: %s", exc)
            return
        changed = 0
        for slot, link in self.links.items():
            if slot == self.node_id or resolved[slot] == link.address:
                continue
            log.info("slot %d (%s): %s -> %s", slot, link.name, link.address, resolved[slot])
            changed += 1
            if link.task is not None:
                link.task.cancel()
            link.address = resolved[slot]
            self._arm_link(link)
        log.info("SIGUSR1: re-resolved nodes, %d address(es) changed", changed)
        self._note_state()

    async def _shutdown(self) -> None:
        self._shutting_down = True
        self._note_state()
        for writer in list(self._peer_writers):
            with contextlib.suppress(OSError, ConnectionError):
                await asyncio.wait_for(wire.send(writer, {"type": "bye"}), 1.0)
        for link in self.links.values():
            if link.task is not None:
                link.task.cancel()
        for server in self._servers:
            if getattr(server, "_imex_kind", "") == "peer":
                server.close()
        await asyncio.sleep(self.settings.shutdown_grace_s)
        while self.faults.hold_shutdown:
            await self._faults_changed.wait()
        log.info("shutdown complete")

    async def _close_everything(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._peer_writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for link in self.links.values():
            if link.task is not None:
                link.task.cancel()
        if self.cfg.cmd_unix_domain_path:
            _remove(Path(self.cfg.cmd_unix_domain_path))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            self._refresh_faults()
            self._note_state()

    def _refresh_faults(self) -> None:
        try:
            faults = read_faults(self.settings.faults_env, self.settings.fault_file)
        except FaultSpecError as exc:
            log.error("ignoring fault spec: %s", exc)
            return
        if faults != self.faults:
            log.info("faults now %s", faults)
            self.faults = faults
            # Wake everyone waiting on the old fault set, then arm a fresh event for the next change.
            self._faults_changed.set()
            self._faults_changed = asyncio.Event()
        if self.faults.crash:
            log.error("fault 'crash': exiting without telling peers")
            sys.stderr.flush()
            os._exit(1)

    async def _wait_unstalled(self) -> None:
        while self.faults.stall:
            await self._faults_changed.wait()

    # ---------------------------------------------------------------- config and names

    def _read_nodes_cfg(self) -> list[str]:
        path = Path(self.cfg.node_config_file)
        try:
            names = parse_nodes_cfg(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise StartupError(f"cannot read node config file {path}: {exc.strerror}") from None
        if not names:
            raise StartupError(f"node config file {path} lists no nodes")
        return names

    def _resolve(self) -> list[str | None]:
        try:
            table = parse_hosts(self.settings.hosts_file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise StartupError(f"cannot read hosts file {self.settings.hosts_file}: {exc.strerror}") from None
        resolved: list[str | None] = []
        for name in self.names:
            if _is_ip(name):
                resolved.append(name)
            else:
                resolved.append(table.get(name))
        return resolved

    def _pick_self(self, resolved: list[str | None]) -> None:
        wanted = self.cfg.bind_interface_ip or self.settings.node_ip or self.cfg.cmd_bind_ip
        if wanted and wanted in resolved:
            self.node_id = resolved.index(wanted)
            self.address = wanted
            return
        raise StartupError(
            "No matching network interface found for any IP addresses in the node configuration file "
            f"(own address {wanted or 'unknown'}, nodes resolve to {[a for a in resolved if a]})"
        )

    # ---------------------------------------------------------------- command service

    async def _start_command_service(self) -> None:
        if not self.cfg.cmd_enabled:
            return
        if self.cfg.cmd_bind_ip:
            try:
                server = await asyncio.start_server(
                    self._serve_command, self.cfg.cmd_bind_ip, self.cfg.cmd_port, reuse_address=True
                )
            except OSError as exc:
                raise StartupError(
                    f"cannot bind command service to {self.cfg.cmd_bind_ip}:{self.cfg.cmd_port}: {exc.strerror}"
                ) from None
            self._servers.append(server)
        if self.cfg.cmd_unix_domain_path:
            path = Path(self.cfg.cmd_unix_domain_path)
            # A socket left by a killed predecessor would make bind() fail.
            _remove(path)
            _mkdir(path.parent)
            self._servers.append(await asyncio.start_unix_server(self._serve_command, str(path)))

    async def _serve_command(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await wire.receive(reader)
            await self._wait_unstalled()
            if request is None:
                return
            if request.get("cmd") == "status":
                await wire.send(writer, self.status())
            else:
                await wire.send(writer, {"error": f"unknown command {request.get('cmd')!r}"})
        except (OSError, wire.ProtocolError) as exc:
            log.debug("command client: %s", exc)
        finally:
            await wire.close(writer)

    # ---------------------------------------------------------------- peers: accepting side

    async def _start_peer_server(self) -> None:
        try:
            server = await asyncio.start_server(
                self._serve_peer, self.address, self.cfg.server_port, reuse_address=True
            )
        except OSError as exc:
            raise StartupError(f"cannot listen on {self.address}:{self.cfg.server_port}: {exc.strerror}") from None
        server._imex_kind = "peer"  # type: ignore[attr-defined]
        self._servers.append(server)

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._peer_writers.add(writer)
        try:
            hello = await asyncio.wait_for(wire.receive(reader), self._liveness_s())
            if hello is None or hello.get("type") != "hello":
                return
            reason = self._reject_reason(hello)
            if reason:
                self.counters.peers_rejected += 1
                log.info("rejecting peer %s: %s", hello.get("from_name"), reason)
                await wire.send(writer, {"type": "reject", "reason": reason})
                return
            self.counters.peers_accepted += 1
            await wire.send(writer, {"type": "welcome", "node_id": self.node_id, "name": self.names[self.node_id or 0]})
            while True:
                message = await wire.receive(reader)
                if message is None or message.get("type") == "bye":
                    return
                await self._wait_unstalled()
                if message.get("type") == "ping":
                    await wire.send(writer, {"type": "pong"})
        except (OSError, TimeoutError, wire.ProtocolError) as exc:
            log.debug("peer connection ended: %s", exc)
        finally:
            self._peer_writers.discard(writer)
            await wire.close(writer)

    def _reject_reason(self, hello: dict[str, Any]) -> str:
        if self._shutting_down:
            return "shutting down"
        if self.faults.refuse_peers:
            return "fault refuse-peers"
        own = self.names[self.node_id or 0]
        if hello.get("to_name") != own:
            # The caller's hosts file maps someone else's name to our address: a stale mapping, or a
            # daemon of another domain after IP reuse (upstream #1447). Talking would corrupt both domains.
            return f"I am {own}, not {hello.get('to_name')}"
        from_name, from_id = hello.get("from_name"), hello.get("from_id")
        if from_name not in self.names:
            return f"{from_name} is not in my node config"
        if self.names.index(from_name) != from_id:
            return f"{from_name} claims node id {from_id}, my config says {self.names.index(from_name)}"
        return ""

    # ---------------------------------------------------------------- peers: connecting side

    def _liveness_s(self) -> float:
        return self.settings.heartbeat_s * self.settings.heartbeat_misses

    def _arm_link(self, link: Link) -> None:
        if link.slot == self.node_id:
            link.state = LinkState.SELF
            link.task = None
        elif link.address is None:
            link.state = LinkState.UNRESOLVED
            link.task = None
        elif link.address == SENTINEL_ADDRESS:
            link.state = LinkState.SENTINEL
            link.task = None
        else:
            link.state = LinkState.CONNECTING
            link.task = self._spawn(self._run_link(link, link.address))

    async def _run_link(self, link: Link, address: str) -> None:
        while not self._shutting_down:
            try:
                await self._connect_once(link, address)
            except (OSError, TimeoutError, wire.ProtocolError) as exc:
                link.detail = f"{type(exc).__name__}: {exc}"
            if link.state is LinkState.CONNECTED:
                log.info("peer %d (%s) at %s lost: %s", link.slot, link.name, address, link.detail)
            if link.state not in (LinkState.INDEX_MISMATCH, LinkState.REJECTED):
                link.state = LinkState.CONNECTING
            self._note_state()
            await asyncio.sleep(self.settings.reconnect_s)

    async def _connect_once(self, link: Link, address: str) -> None:
        liveness = self._liveness_s()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address, self.cfg.server_port, local_addr=(self.address, 0)), liveness
        )
        try:
            await wire.send(
                writer,
                {
                    "type": "hello",
                    "from_id": self.node_id,
                    "from_name": self.names[self.node_id or 0],
                    "to_id": link.slot,
                    "to_name": link.name,
                },
            )
            answer = await asyncio.wait_for(wire.receive(reader), liveness)
            if answer is None:
                link.detail = "closed during handshake"
                return
            if answer.get("type") == "reject":
                link.state = LinkState.REJECTED
                link.detail = str(answer.get("reason"))
                return
            if answer.get("node_id") != link.slot:
                # Index disagreement (upstream #1418): the daemon at this address thinks it holds another slot.
                link.state = LinkState.INDEX_MISMATCH
                link.detail = f"peer at {address} says it is node {answer.get('node_id')} ({answer.get('name')})"
                log.warning("slot %d: %s", link.slot, link.detail)
                return
            link.state = LinkState.CONNECTED
            link.detail = ""
            link.connects += 1
            log.info("peer %d (%s) at %s connected", link.slot, link.name, address)
            self._note_state()
            self._peer_writers.add(writer)
            while True:
                await wire.send(writer, {"type": "ping"})
                deadline = asyncio.get_running_loop().time() + liveness
                while True:
                    remaining = deadline - asyncio.get_running_loop().time()
                    message = await asyncio.wait_for(wire.receive(reader), max(remaining, 0.001))
                    if message is None:
                        link.detail = "connection closed"
                        return
                    if message.get("type") == "bye":
                        link.detail = "peer shut down"
                        return
                    if message.get("type") == "pong":
                        break
                await asyncio.sleep(self.settings.heartbeat_s)
        finally:
            self._peer_writers.discard(writer)
            await wire.close(writer)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
