"""Which peers IMEX sees, and what a change of them triggers: hosts file, nodes.cfg, SIGUSR1 or restart."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import pytest

from computedomain.api.models import ReadyStatus
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient
from imex.config import hostname_prefix
from imex.daemon.peers import Action, Applied, PeerFiles, PeerSync, decide, peer_view
from imex.daemon.process import ImexProcess
from imex.daemon.registration import (
    CliqueBackend,
    DaemonEntry,
    Identity,
    Registry,
    pod_owner_reference,
    slot_preference,
)
from imex.hosts_file import SENTINEL_ADDRESS, parse_hosts, read_block
from tests.unit.imex.daemon.fakes import FakeApi

A = "cluster-a.0"
B = "cluster-b.1"
CD = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"


def e(node: str, index: int, ip: str, clique: str = A) -> DaemonEntry:
    return DaemonEntry(node, ip, clique, index, ReadyStatus.NOT_READY)


def view(entries: list[DaemonEntry], num_nodes: int | None = None, max_nodes: int = 4) -> Any:
    return peer_view(entries, node_name="me", clique_id=A, max_nodes=max_nodes, num_nodes=num_nodes)


def test_peer_view_keeps_our_clique_and_reports_bad_entries() -> None:
    v = view(
        [
            e("me", 1, "10.0.0.1"),
            e("p0", 0, "10.0.0.2"),
            e("other", 2, "10.5.0.1", clique=B),
            e("high", 9, "10.0.0.9"),
            e("noip", 3, ""),
        ]
    )
    assert v.own == e("me", 1, "10.0.0.1")
    assert dict(v.addresses) == {0: "10.0.0.2", 1: "10.0.0.1"}
    assert any("index 9 outside" in p for p in v.problems)
    assert any("noip" in p for p in v.problems)


def test_peer_view_duplicate_index_goes_to_the_smaller_name() -> None:
    v = view([e("me", 1, "10.0.0.1"), e("zz", 0, "10.0.0.3"), e("aa", 0, "10.0.0.2")])
    assert dict(v.addresses) == {0: "10.0.0.2", 1: "10.0.0.1"}
    assert v.problems == ("index 0 claimed by aa and zz",)


MINE = e("me", 1, "10.0.0.1")
P0 = e("p0", 0, "10.0.0.2")
P2 = e("p2", 2, "10.0.0.3")
RUNNING = Applied(running=True, index=1, addresses={0: "10.0.0.2", 1: "10.0.0.1"})

# (case, entries, applied, expected action, dns_names)
DNS_CASES: list[tuple[str, list[DaemonEntry], Applied, Action]] = [
    ("no own entry: wait", [P0], Applied(), Action.WAIT),
    ("first start as soon as our entry exists", [MINE], Applied(), Action.START),
    ("same mapping: nothing", [MINE, P0], RUNNING, Action.NONE),
    ("peer joins: SIGUSR1, no restart", [MINE, P0, P2], RUNNING, Action.RELOAD),
    ("peer leaves: SIGUSR1", [MINE], RUNNING, Action.RELOAD),
    ("peer IP changes: SIGUSR1", [MINE, e("p0", 0, "10.0.0.77")], RUNNING, Action.RELOAD),
    (
        "peer status flip alone: nothing",
        [MINE, DaemonEntry("p0", "10.0.0.2", A, 0, ReadyStatus.READY)],
        RUNNING,
        Action.NONE,
    ),
    ("our own IP changes: SIGUSR1 (index kept)", [e("me", 1, "10.0.0.50"), P0], RUNNING, Action.RELOAD),
    ("our own index changes: restart", [e("me", 3, "10.0.0.1"), P0], RUNNING, Action.RESTART),
    ("another clique's change: nothing", [MINE, P0, e("x", 2, "10.9.0.1", B)], RUNNING, Action.NONE),
]


@pytest.mark.parametrize(("case", "entries", "applied", "want"), DNS_CASES, ids=[c[0] for c in DNS_CASES])
def test_decide_dns_names(case: str, entries: list[DaemonEntry], applied: Applied, want: Action) -> None:
    decision = decide(view(entries), applied, dns_names=True)
    assert decision.action is want, (case, decision)
    if want is not Action.WAIT:
        assert decision.addresses == dict(view(entries).addresses)
        assert decision.nodes_cfg is None  # DNS mode never rewrites nodes.cfg


IP_APPLIED = Applied(running=True, nodes_cfg="10.0.0.2\n10.0.0.1\n")
IP_CASES: list[tuple[str, list[DaemonEntry], int, Applied, Action, str | None]] = [
    ("too few daemons for numNodes: wait", [MINE], 2, Applied(), Action.WAIT, None),
    ("numNodes reached: start", [MINE, P0], 2, Applied(), Action.START, "10.0.0.2\n10.0.0.1\n"),
    ("other cliques count toward numNodes", [MINE, e("x", 0, "10.9.0.1", B)], 2, Applied(), Action.START, "10.0.0.1\n"),
    ("unchanged: nothing", [P0, MINE], 2, IP_APPLIED, Action.NONE, "10.0.0.2\n10.0.0.1\n"),
    ("member joins: restart", [MINE, P0, P2], 2, IP_APPLIED, Action.RESTART, "10.0.0.2\n10.0.0.1\n10.0.0.3\n"),
    ("peer IP changes: restart", [MINE, e("p0", 0, "10.0.0.9")], 2, IP_APPLIED, Action.RESTART, "10.0.0.9\n10.0.0.1\n"),
]


@pytest.mark.parametrize(
    ("case", "entries", "num_nodes", "applied", "want", "nodes_cfg"), IP_CASES, ids=[c[0] for c in IP_CASES]
)
def test_decide_ip_mode(
    case: str, entries: list[DaemonEntry], num_nodes: int, applied: Applied, want: Action, nodes_cfg: str | None
) -> None:
    decision = decide(view(entries, num_nodes=num_nodes), applied, dns_names=False)
    assert decision.action is want, (case, decision)
    assert decision.nodes_cfg == nodes_cfg  # ordered by index, so every node derives the same node IDs
    assert decision.addresses is None


# --------------------------------------------------------------------------------------------------------
# The executor: hosts file and process calls, with a recording fake process


class RecordingProcess:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.wanted = False

    async def start(self) -> bool:
        self.calls.append("start")
        self.wanted = True
        return True

    async def restart(self, reason: str) -> None:
        self.calls.append("restart")

    def request_reload(self) -> None:
        self.calls.append("reload")


def make_sync(tmp_path: Path, api: FakeApi, node: str, ip: str) -> tuple[PeerSync, RecordingProcess]:
    registry = Registry(
        cast(KubeClient, api),
        CliqueBackend(namespace="ns", cd_uid=CD, clique_id=A),
        Identity(node, ip, A),
        max_nodes=4,
        owner=pod_owner_reference(node, f"uid-{node}"),
        rng=random.Random(0),
    )
    process = RecordingProcess()
    hosts = tmp_path / f"hosts-{node}"
    hosts.write_text("127.0.0.1\tlocalhost\n")
    files = PeerFiles(
        hosts_file=hosts,
        hosts_block=CD,
        hostname_prefix=hostname_prefix(CD),
        nodes_cfg=tmp_path / "nodes.cfg",
        max_nodes=4,
    )
    sync = PeerSync(cast(KubeClient, api), registry, cast(ImexProcess, process), files, dns_names=True)
    return sync, process


async def test_peer_sync_writes_hosts_then_starts_then_signals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi()
    sync, process = make_sync(tmp_path, api, "me", "127.1.0.1")
    name = f"{CD}.{A}"
    monkeypatch.setattr(sync, "current", lambda: api.read(COMPUTE_DOMAIN_CLIQUES, "ns", name))

    first = await sync.sync_once()  # no object: we register first and wait for the write to come back
    assert first.action is Action.WAIT
    assert process.calls == []
    d = await sync.sync_once()
    assert d.action is Action.START
    prefix = hostname_prefix(CD)
    table = parse_hosts(sync.files.hosts_file.read_text())
    assert table["localhost"] == "127.0.0.1"  # foreign lines kept
    mine = slot_preference("me", 4)[0]
    assert table[f"{prefix}-{mine:04d}"] == "127.1.0.1"
    assert [table[f"{prefix}-{i:04d}"] for i in range(4) if i != mine] == [SENTINEL_ADDRESS] * 3
    assert process.calls == ["start"]

    # A peer registers: mapping changes -> SIGUSR1, no restart.
    peer, _ = make_sync(tmp_path, api, "peer", "127.1.0.2")
    theirs = (await peer.registry.register()).index
    d = await sync.sync_once()
    assert d.action is Action.RELOAD
    assert process.calls == ["start", "reload"]
    mapped = {x.name: x.address for x in read_block(sync.files.hosts_file, CD)}
    assert (mapped[f"{prefix}-{mine:04d}"], mapped[f"{prefix}-{theirs:04d}"]) == ("127.1.0.1", "127.1.0.2")

    # Nothing changed: no signal.
    assert (await sync.sync_once()).action is Action.NONE
    assert process.calls == ["start", "reload"]

    # Someone pruned our entry: we re-register (same index) before anything else.
    obj = api.read(COMPUTE_DOMAIN_CLIQUES, "ns", name)
    assert obj is not None
    obj["daemons"] = [d for d in obj["daemons"] if d["nodeName"] != "me"]
    api.put(COMPUTE_DOMAIN_CLIQUES, "ns", obj)
    assert (await sync.sync_once()).action is Action.WAIT
    again = api.read(COMPUTE_DOMAIN_CLIQUES, "ns", name)
    assert again is not None
    assert {d["nodeName"]: d["index"] for d in again["daemons"]} == {"peer": theirs, "me": mine}
    assert (await sync.sync_once()).action is Action.NONE
    assert process.calls == ["start", "reload"]
