"""Daemon processes with the IMEX simulator against the real apiserver: one clique of four simulated nodes.

What must hold (SPEC section 5):
- all four reach READY together, each simulated IMEX holding the node ID equal to its entry's index, and the
  entries turn Ready from the pods' Ready condition (written by the probe, seen through the pod watch);
- a peer that comes back on a new pod IP is picked up through the hosts file and SIGUSR1: the other IMEX
  processes are not restarted (same pids) and re-resolve;
- an IMEX that keeps crashing is dropped by its peers (their link to it is down, they leave READY) and its
  entry turns NotReady; when it comes back everything is READY again;
- a daemon terminated with SIGTERM stops its IMEX, removes its entry and exits 0; its peers map its slot to
  the sentinel address and are READY without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from imex.config import hostname_prefix
from imex.hosts_file import SENTINEL_ADDRESS, parse_hosts
from tests.cluster.imex.harness import GUARD_S, DaemonNode, Domain, ProbeKubelet, wait_until
from tests.conftest import REPO, Cluster

pytestmark = pytest.mark.cluster

CLIQUE = "5a1b2c3d-0000-4000-8000-0000000000c1.7"

SIM_ENV = {
    "IMEX_SIGUSR1_INTERVAL": "1",
    "IMEX_SIM_SIGUSR1_INTERVAL": "1",
    "IMEX_SIM_HEARTBEAT_INTERVAL": "0.2",
    "IMEX_SIM_HEARTBEAT_MISSES": "3",
    "IMEX_SIM_RECONNECT_INTERVAL": "0.1",
    "IMEX_RESTART_BACKOFF_INITIAL": "0.5",
    "IMEX_RESTART_BACKOFF_MAX": "2",
    "CHECK_TIMEOUT": "5",
}


@pytest.fixture
def domain(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Domain]:
    d = Domain(cluster, namespace, tmp_path, imex="simulator", env=SIM_ENV)
    yield d
    d.cleanup()


def state(n: DaemonNode) -> str | None:
    status = n.sim_status()
    return None if status is None else str(status["state"])


def link(n: DaemonNode, index: int) -> str | None:
    status = n.sim_status()
    if status is None:
        return None
    return next(str(x["link"]) for x in status["nodes"] if x["index"] == index)


def all_ready(domain: Domain, nodes: list[DaemonNode]) -> bool:
    entries = domain.entries(CLIQUE)
    return all(state(n) == "READY" for n in nodes) and all(
        n.node in entries and entries[n.node]["status"] == "Ready" and entries[n.node]["ipAddress"] == n.ip
        for n in nodes
    )


def test_daemons_reach_ready_and_follow_peer_changes(domain: Domain) -> None:
    nodes = domain.add([(f"n{i}", CLIQUE) for i in range(4)])
    prefix = hostname_prefix(domain.cd_uid)
    with ProbeKubelet(domain, nodes) as probe:
        for n in nodes:
            n.start()

        # ---- READY together; node ID == index; entries Ready through the pod watch
        wait_until("all READY and Ready", lambda: all_ready(domain, nodes), on_fail=lambda: domain.logs())
        entries = domain.entries(CLIQUE)
        assert len({e["index"] for e in entries.values()}) == 4 and all(0 <= e["index"] < 18 for e in entries.values())
        index = {n.node: entries[n.node]["index"] for n in nodes}
        free = min(set(range(18)) - set(index.values()))  # slots are taken in a per-node order, not 0..3
        for n in nodes:
            status = n.sim_status()
            assert status is not None
            assert status["node_id"] == index[n.node]
            assert status["name"] == f"{prefix}-{index[n.node]:04d}"
            table = parse_hosts(n.hosts.read_text())
            for peer in nodes:
                assert table[f"{prefix}-{index[peer.node]:04d}"] == peer.ip
            assert table[f"{prefix}-{free:04d}"] == SENTINEL_ADDRESS
        sim_pids = {n.node: n.sim_status()["pid"] for n in nodes}  # type: ignore[index]

        # ---- a peer comes back on a new pod IP: hosts + SIGUSR1, nobody else restarts
        moved = nodes[3]
        before = {n.node: n.sim_status()["counters"]["reresolves"] for n in nodes[:3]}  # type: ignore[index]
        moved.kill()
        domain.replace_pod(moved, domain.new_ip())
        moved.start()
        wait_until(
            "all READY again with the moved peer's new IP",
            lambda: all_ready(domain, nodes),
            on_fail=lambda: domain.logs(),
        )
        assert domain.entries(CLIQUE)[moved.node]["index"] == index[moved.node]
        for n in nodes[:3]:
            status = n.sim_status()
            assert status is not None
            assert status["pid"] == sim_pids[n.node], f"{n.node}: nvidia-imex was restarted"
            assert status["counters"]["reresolves"] > before[n.node]
            assert parse_hosts(n.hosts.read_text())[f"{prefix}-{index[moved.node]:04d}"] == moved.ip
            assert "restarting nvidia-imex" not in n.log()
        sim_pids[moved.node] = moved.sim_status()["pid"]  # type: ignore[index]

        # ---- an IMEX that keeps crashing: peers drop it, its entry turns NotReady
        crashing = nodes[1]
        slot = index[crashing.node]
        crashing.fault_file.write_text("crash\n")
        others = [n for n in nodes if n is not crashing]
        wait_until(
            "crashing node NotReady and dropped by its peers",
            lambda: (
                domain.entries(CLIQUE)[crashing.node]["status"] == "NotReady"
                and all(link(n, slot) not in (None, "CONNECTED") and state(n) == "WAITING_FOR_PEERS" for n in others)
            ),
            on_fail=lambda: domain.logs(),
        )
        wait_until("restarted with backoff, crashing again", lambda: crashing.log().count("exited unexpectedly") >= 2)
        assert crashing.proc is not None and crashing.proc.poll() is None, "the daemon itself must keep running"
        assert domain.entries(CLIQUE)[crashing.node]["index"] == slot
        crashing.fault_file.unlink()
        wait_until("recovered", lambda: all_ready(domain, nodes), on_fail=lambda: domain.logs())
        for n in others:
            assert n.sim_status()["pid"] == sim_pids[n.node]  # type: ignore[index]

        # ---- SIGTERM: IMEX stopped, entry removed, exit 0; peers map the slot to the sentinel
        leaving = nodes[2]
        leaving_sim = leaving.sim_status()["pid"]  # type: ignore[index]
        probe.nodes = [n for n in nodes if n is not leaving]
        assert leaving.terminate() == 0
        assert leaving.node not in domain.entries(CLIQUE)
        with pytest.raises(ProcessLookupError):
            os.kill(leaving_sim, 0)
        remaining = [n for n in nodes if n is not leaving]
        gone = index[leaving.node]
        wait_until(
            "peers READY without the terminated node",
            lambda: all_ready(domain, remaining) and all(link(n, gone) == "SENTINEL" for n in remaining),
            on_fail=lambda: domain.logs(),
        )
        for n in remaining:
            assert parse_hosts(n.hosts.read_text())[f"{prefix}-{gone:04d}"] == SENTINEL_ADDRESS
        assert "nvidia-imex stopped exit=0" in leaving.log()
        assert not probe.errors, probe.errors

    # ---- the probe command itself: exactly READY -> 0; a stopped daemon -> 1 with the state
    def cli_check(n: DaemonNode) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "imex", "daemon", "check"],
            env={**os.environ, **n.daemon_env()},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=GUARD_S,
        )

    ok = cli_check(nodes[0])
    assert (ok.returncode, ok.stdout) == (0, "READY\n"), ok.stderr
    down = cli_check(leaving)
    assert down.returncode == 1
    assert "state UNAVAILABLE" in down.stdout
