"""From the domain's registrations to IMEX's view of its peers: hosts file, nodes.cfg, SIGUSR1, restarts.

What it owns:

* ``peer_view`` and ``decide`` (pure, table-tested): which peers of our clique exist at which index and IP,
  and what follows from a change.
  DNS-names mode (IMEXDaemonsWithDNSNames=true, the default): ``nodes.cfg`` is static (one name per slot,
  per-CD prefix) and never rewritten; the hosts file maps each slot name to its holder's IP, free slots to
  the sentinel address. IMEX starts as soon as our own entry exists (it needs its own name resolvable). A
  changed mapping means SIGUSR1 to a running IMEX, never a restart; only a change of our *own* index
  restarts it, because IMEX reads its node ID from ``nodes.cfg`` once at start.
  Legacy IP mode (IMEXDaemonsWithDNSNames=false): ``nodes.cfg`` lists the clique's peer IPs ordered by index
  (so every node derives the same node IDs), IMEX starts only once ``spec.numNodes`` daemons registered, and
  any change of the list restarts it.
* ``PeerSync``: the loop that watches the object holding the entries (our ComputeDomainClique, or the
  ComputeDomain in legacy mode) through an informer, re-registers us when our entry is missing or stale
  (deleted object, pruned entry, new pod IP), and applies ``decide``'s plan: files first, then the process.

Concurrency: a one-key convergence loop (``kube.converge``). The informer's handlers only add the key; a pass
works on the newest stored object, so a burst of events becomes one pass (level-based, no periodic resync).
A failed pass (API errors, a full clique) is retried with backoff, quietly at first, with one warning when it
keeps failing; a refusal (403) waits for the next event or the long recheck.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from computedomain.api.limits import brief, shown
from computedomain.atomic import write_atomically
from computedomain.kube.client import KubeClient, Raw
from computedomain.kube.clock import Clock
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.kube.informer import Informer
from imex.config import render_nodes_cfg_ips
from imex.daemon.process import ImexProcess
from imex.daemon.registration import DaemonEntry, Registry
from imex.hosts_file import HostEntry, is_ip_address, slot_entries, update_hosts_file

__all__ = ["Action", "Applied", "Decision", "PeerSync", "PeerView", "decide", "peer_view"]

log = logging.getLogger(__name__)

_KEY = "peers"


@dataclass(frozen=True)
class PeerView:
    """What IMEX's configuration depends on, from one snapshot of the entries."""

    own: DaemonEntry | None
    #: index -> IP of every entry of our clique with a valid index (ours included)
    addresses: Mapping[int, str]
    #: legacy IP mode: whether ``spec.numNodes`` daemons have registered
    enough: bool = True
    #: entries that were left out, with the reason (logged; a controller or a peer must fix them)
    problems: tuple[str, ...] = ()

    @property
    def ips_by_index(self) -> tuple[str, ...]:
        return tuple(self.addresses[i] for i in sorted(self.addresses))


def peer_view(
    entries: Sequence[DaemonEntry],
    *,
    node_name: str,
    clique_id: str,
    max_nodes: int,
    num_nodes: int | None = None,
) -> PeerView:
    own = next((e for e in entries if e.node_name == node_name and e.clique_id == clique_id), None)
    addresses: dict[int, str] = {}
    holder: dict[int, str] = {}
    problems: list[str] = []
    for entry in sorted(entries, key=lambda e: e.node_name):
        if entry.clique_id != clique_id:
            continue
        if not 0 <= entry.index < max_nodes:
            problems.append(f"node {shown(entry.node_name)}: index {entry.index} outside 0..{max_nodes - 1}")
            continue
        if not entry.ip_address:
            problems.append(f"node {shown(entry.node_name)}: no IP address")
            continue
        if not is_ip_address(entry.ip_address):
            # Another daemon's entry: one bad address must not stop the hosts file of the whole clique.
            problems.append(f"node {shown(entry.node_name)}: {brief(entry.ip_address)} is not an IP address")
            continue
        if entry.index in holder:
            # Transient while the later holder moves (registration.allocate_index): the smaller name wins.
            problems.append(f"index {entry.index} claimed by {shown(holder[entry.index])} and {shown(entry.node_name)}")
            continue
        holder[entry.index] = entry.node_name
        addresses[entry.index] = entry.ip_address
    enough = num_nodes is None or len(entries) >= num_nodes
    return PeerView(own=own, addresses=addresses, enough=enough, problems=tuple(problems))


class Action(StrEnum):
    WAIT = "wait"  # not enough information to run IMEX (no own entry yet; legacy: too few daemons)
    START = "start"
    RESTART = "restart"
    RELOAD = "reload"  # SIGUSR1
    NONE = "none"


@dataclass(frozen=True)
class Applied:
    """What the running IMEX was configured with (None/empty before the first start)."""

    running: bool = False
    index: int | None = None
    addresses: Mapping[int, str] = field(default_factory=dict)
    nodes_cfg: str | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    #: DNS mode: the mapping the hosts file must hold (written before the action)
    addresses: Mapping[int, str] | None = None
    #: legacy IP mode: the nodes.cfg text (written before the action)
    nodes_cfg: str | None = None


def decide(view: PeerView, applied: Applied, *, dns_names: bool) -> Decision:
    if view.own is None:
        return Decision(Action.WAIT, "our entry is not registered yet")
    if dns_names:
        addresses = dict(view.addresses)
        if view.own.index not in addresses or addresses[view.own.index] != view.own.ip_address:
            return Decision(Action.WAIT, f"our index {view.own.index} is not resolvable to our IP yet")
        if not applied.running:
            return Decision(Action.START, "first start", addresses=addresses)
        if applied.index != view.own.index:
            return Decision(
                Action.RESTART, f"our index changed {applied.index} -> {view.own.index}", addresses=addresses
            )
        if addresses != dict(applied.addresses):
            return Decision(Action.RELOAD, "peer mapping changed", addresses=addresses)
        return Decision(Action.NONE, "nothing changed", addresses=addresses)
    if not view.enough:
        return Decision(Action.WAIT, "fewer daemons registered than spec.numNodes")
    nodes_cfg = render_nodes_cfg_ips(view.ips_by_index)
    if not applied.running:
        return Decision(Action.START, "first start", nodes_cfg=nodes_cfg)
    if nodes_cfg != applied.nodes_cfg:
        return Decision(Action.RESTART, "peer list changed", nodes_cfg=nodes_cfg)
    return Decision(Action.NONE, "nothing changed", nodes_cfg=nodes_cfg)


# --------------------------------------------------------------------------------------------------------
# The executor


@dataclass(frozen=True)
class PeerFiles:
    hosts_file: Path
    hosts_block: str
    hostname_prefix: str
    nodes_cfg: Path
    max_nodes: int


class PeerSync:
    """Watch the entries, keep our registration, and drive the files and IMEX (see the module)."""

    def __init__(
        self,
        client: KubeClient,
        registry: Registry,
        process: ImexProcess,
        files: PeerFiles,
        *,
        dns_names: bool,
        retries: Retries = DEFAULT_RETRIES,
        clock: Clock | None = None,
    ) -> None:
        self._client = client
        self.registry = registry
        self.process = process
        self.files = files
        self.dns_names = dns_names
        self.applied = Applied()
        b = registry.backend
        self.informer: Informer[Raw] = Informer(
            client,
            b.resource,
            decode=lambda raw: raw,
            namespace=b.namespace,
            field_selector=f"metadata.name={b.name}",
            name=f"peers/{b.name}",
        )
        self.loop: Converger[str] = Converger(f"peers/{b.name}", self._reconcile, retries=retries, clock=clock)
        self.informer.add_handler(
            on_add=lambda _o: self.loop.add(_KEY),
            on_update=lambda _o, _n: self.loop.add(_KEY),
            on_delete=lambda _o: self.loop.add(_KEY),
        )
        self.passes = 0

    def current(self) -> Raw | None:
        b = self.registry.backend
        return self.informer.get(b.name, b.namespace)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.informer.run(), name="peers-informer")
            tasks.create_task(self._loop(), name="peers-loop")

    async def _loop(self) -> None:
        await self.informer.has_synced()
        self.loop.add(_KEY)
        await self.loop.run()

    async def _reconcile(self, _key: str) -> ReconcileResult:
        await self.sync_once()
        return DONE

    async def sync_once(self) -> Decision:
        self.passes += 1
        obj = self.current()
        self.registry.observe(obj)
        if self.registry.needs_write(obj):
            await self.registry.register()
            # Our write comes back as a watch event; the next pass works on that object.
            return Decision(Action.WAIT, "(re-)registered; waiting for the write to come back")
        assert obj is not None
        view = peer_view(
            self.registry.entries(obj),
            node_name=self.registry.me.node_name,
            clique_id=self.registry.me.clique_id,
            max_nodes=self.files.max_nodes,
            num_nodes=_num_nodes(obj),
        )
        for problem in view.problems:
            log.warning("ignoring entry object=%s problem=%s", self.registry.backend.name, problem)
        applied = Applied(
            running=self.process.wanted,
            index=self.applied.index,
            addresses=self.applied.addresses,
            nodes_cfg=self.applied.nodes_cfg,
        )
        decision = decide(view, applied, dns_names=self.dns_names)
        await self.apply(decision, view)
        return decision

    async def apply(self, decision: Decision, view: PeerView) -> None:
        if decision.action is Action.WAIT:
            log.info("imex waiting reason=%s", decision.reason)
            return
        if decision.addresses is not None:
            changed = self._write_hosts(decision.addresses)
            if changed:
                log.info("hosts file updated mapping=%s", _describe(decision.addresses, self.files.hostname_prefix))
        if decision.nodes_cfg is not None and decision.nodes_cfg != self.applied.nodes_cfg:
            write_atomically(self.files.nodes_cfg, decision.nodes_cfg, if_changed=True)
            log.info("nodes.cfg written peers=%s", decision.nodes_cfg.split())
        assert view.own is not None
        if decision.action is Action.START:
            await self.process.start()
        elif decision.action is Action.RESTART:
            await self.process.restart(decision.reason)
        elif decision.action is Action.RELOAD:
            self.process.request_reload()
        if decision.action is not Action.NONE:
            log.info("imex action=%s reason=%s index=%d", decision.action, decision.reason, view.own.index)
        self.applied = Applied(
            running=True,
            index=view.own.index,
            addresses=dict(decision.addresses or {}),
            nodes_cfg=decision.nodes_cfg,
        )

    def _write_hosts(self, addresses: Mapping[int, str]) -> bool:
        entries: list[HostEntry] = slot_entries(self.files.hostname_prefix, addresses, max_nodes=self.files.max_nodes)
        return update_hosts_file(self.files.hosts_file, self.files.hosts_block, entries)


def _num_nodes(obj: Raw) -> int | None:
    if obj.get("kind") != "ComputeDomain":
        return None
    value = (obj.get("spec") or {}).get("numNodes")
    return value if isinstance(value, int) else 0


def _describe(addresses: Mapping[int, str], prefix: str) -> str:
    slots = ",".join(f"{i}={addresses[i]}" for i in sorted(addresses))
    return f"{prefix}-NNNN {slots or '(none)'}"
