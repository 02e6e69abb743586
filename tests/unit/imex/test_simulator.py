"""The IMEX simulator as real processes on per-node loopback addresses, driven like the real daemon.

Every wait has a generous deadline that only guards against hangs; no assertion depends on timing.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from imex.hosts_file import SENTINEL_ADDRESS
from tests.unit.imex.conftest import SimDomain, dump_logs, send_signal, wait_until

MakeDomain = Callable[..., SimDomain]


def all_ready(domain: SimDomain) -> None:
    for node in domain.nodes:
        wait_until(f"node {node.slot} READY\n{dump_logs(domain)}", lambda n=node: n.state() == "READY")  # type: ignore[misc]


def test_nodes_reach_ready_together_and_report_their_node_ids(sim_domain: MakeDomain) -> None:
    domain = sim_domain(3, slots=4)  # slot 3 is free: mapped to the sentinel, ignored
    for node in domain.nodes:
        domain.start(node)
    all_ready(domain)
    for node in domain.nodes:
        status = node.status()
        assert status is not None
        assert status["node_id"] == node.slot
        assert status["name"] == f"{domain.prefix}-{node.slot:04d}"
        links = {entry["index"]: entry["link"] for entry in status["nodes"]}
        assert links[node.slot] == "SELF"
        assert links[3] == "SENTINEL"
        assert [links[i] for i in range(3) if i != node.slot] == ["CONNECTED", "CONNECTED"]
    # The ctl, through the wrapper script, with the config file as the daemon pod's probe uses it.
    out = subprocess.run(
        [str(domain.bin_dir / "nvidia-imex-ctl"), "-c", str(domain.nodes[0].cfg), "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (0, "READY\n")
    out = subprocess.run(
        [str(domain.bin_dir / "nvidia-imex-ctl"), "-c", str(domain.nodes[1].cfg), "-N", "-j"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    document = json.loads(out.stdout)
    assert document["status"] == "UP" and document["nodeId"] == 1
    assert document["nodes"]["3"]["address"] == SENTINEL_ADDRESS


def test_a_lone_node_waits_for_its_listed_peers(sim_domain: MakeDomain) -> None:
    domain = sim_domain(2, slots=2)
    domain.start(domain.nodes[0])
    wait_until("node 0 up", lambda: domain.nodes[0].state() is not None)
    wait_until("node 0 waiting", lambda: domain.nodes[0].state() == "WAITING_FOR_PEERS")
    domain.start(domain.nodes[1])
    all_ready(domain)


def test_killed_peer_stops_counting(sim_domain: MakeDomain) -> None:
    domain = sim_domain(3, slots=3)
    for node in domain.nodes:
        domain.start(node)
    all_ready(domain)
    victim = domain.nodes[2]
    assert victim.proc is not None
    victim.proc.kill()  # SIGKILL: no goodbye, the peers must notice by themselves
    victim.proc.wait()
    for node in domain.nodes[:2]:
        wait_until(f"node {node.slot} drops the dead peer", lambda n=node: n.state() == "WAITING_FOR_PEERS")  # type: ignore[misc]
        assert node.link(2)["link"] == "CONNECTING"
        assert node.link(1 - node.slot)["link"] == "CONNECTED"
    domain.start(victim)
    all_ready(domain)


def test_stalled_peer_is_dropped_by_heartbeat(sim_domain: MakeDomain) -> None:
    """A process that stops answering (SIGSTOP) keeps its sockets open: only heartbeats reveal it."""
    domain = sim_domain(2, slots=2)
    for node in domain.nodes:
        domain.start(node)
    all_ready(domain)
    stalled = domain.nodes[1]
    send_signal(stalled, signal.SIGSTOP)
    try:
        wait_until("peer dropped", lambda: domain.nodes[0].state() == "WAITING_FOR_PEERS")
    finally:
        send_signal(stalled, signal.SIGCONT)
    all_ready(domain)


def test_peer_ip_change_picked_up_via_hosts_file_and_sigusr1(sim_domain: MakeDomain) -> None:
    domain = sim_domain(3, slots=3)
    for node in domain.nodes:
        domain.start(node)
    all_ready(domain)
    a, b, old_c = domain.nodes
    assert old_c.proc is not None
    old_c.proc.kill()
    old_c.proc.wait()
    # The rescheduled pod for slot 2 gets a new IP; its own hosts file already knows it.
    new_c = domain.move(old_c, f"{domain.net}.99")
    domain.write_hosts(new_c, {0: a.ip, 1: b.ip, 2: new_c.ip})
    domain.start(new_c)
    wait_until("new node up", lambda: new_c.state() is not None)
    # Without the new mapping A and B keep dialling the old address.
    for node in (a, b):
        wait_until("waiting", lambda n=node: n.state() == "WAITING_FOR_PEERS")  # type: ignore[misc]
        assert node.link(2)["address"] == old_c.ip
    # A gets the new mapping and SIGUSR1; B only the mapping (no signal): only A reconnects.
    assert domain.write_hosts(a, {0: a.ip, 1: b.ip, 2: new_c.ip}) is True
    assert domain.write_hosts(b, {0: a.ip, 1: b.ip, 2: new_c.ip}) is True
    send_signal(a, signal.SIGUSR1)
    wait_until("A READY after SIGUSR1", lambda: a.state() == "READY")
    assert a.link(2) | {"detail": ""} == {
        "index": 2,
        "name": f"{domain.prefix}-0002",
        "address": new_c.ip,
        "link": "CONNECTED",
        "detail": "",
    }
    assert b.state() == "WAITING_FOR_PEERS"
    assert b.link(2)["address"] == old_c.ip
    send_signal(b, signal.SIGUSR1)
    wait_until("B READY after SIGUSR1", lambda: b.state() == "READY")
    wait_until("new C READY", lambda: new_c.state() == "READY")


def test_sigusr1_coalesced_to_one_reresolve_per_interval(sim_domain: MakeDomain) -> None:
    domain = sim_domain(2, slots=3, IMEX_SIM_SIGUSR1_INTERVAL="3600")
    a, b = domain.nodes
    for node in domain.nodes:
        domain.start(node)
    all_ready(domain)

    def counters() -> dict[str, int]:
        status = a.status()
        assert status is not None
        return status["counters"]  # type: ignore[no-any-return]

    domain.write_hosts(a, {0: a.ip, 1: b.ip, 2: f"{domain.net}.50"})
    send_signal(a, signal.SIGUSR1)
    wait_until("first SIGUSR1 handled", lambda: counters()["sigusr1_received"] == 1)
    assert counters()["reresolves"] == 1
    assert a.link(2)["address"] == f"{domain.net}.50"
    # A second change inside the window: the signal is dropped, the new address is not seen.
    domain.write_hosts(a, {0: a.ip, 1: b.ip, 2: f"{domain.net}.51"})
    send_signal(a, signal.SIGUSR1)
    wait_until("second SIGUSR1 handled", lambda: counters()["sigusr1_received"] == 2)
    assert counters()["reresolves"] == 1
    assert counters()["sigusr1_ignored"] == 1
    assert a.link(2)["address"] == f"{domain.net}.50"


def test_sigusr1_honoured_again_after_the_interval(sim_domain: MakeDomain) -> None:
    domain = sim_domain(1, slots=2, IMEX_SIM_SIGUSR1_INTERVAL="0.3")
    (a,) = domain.nodes
    domain.start(a)
    wait_until("up", lambda: a.state() is not None and a.state() != "INITIALIZING")
    for round_number, last_octet in enumerate((60, 61, 62), start=1):
        domain.write_hosts(a, {0: a.ip, 1: f"{domain.net}.{last_octet}"})
        # Each signal goes out only after the previous re-resolve is visible and the window has passed.
        time.sleep(0.4)  # longer than the 0.3 s window since the previous honoured signal
        send_signal(a, signal.SIGUSR1)
        wait_until(
            f"re-resolve {round_number}",
            lambda r=round_number: (a.status() or {}).get("counters", {}).get("reresolves") == r,  # type: ignore[misc]
        )
        assert a.link(1)["address"] == f"{domain.net}.{last_octet}"


def test_sigterm_shuts_down_gracefully_and_peers_notice(sim_domain: MakeDomain) -> None:
    domain = sim_domain(2, slots=2)
    a, b = domain.nodes
    for node in domain.nodes:
        domain.start(node)
    all_ready(domain)
    b.fault_file.write_text("hold-shutdown\n")  # keep b in SHUTTING_DOWN until we have looked
    send_signal(b, signal.SIGTERM)
    wait_until("b SHUTTING_DOWN", lambda: b.state() == "SHUTTING_DOWN")
    wait_until("a drops b", lambda: a.state() == "WAITING_FOR_PEERS")
    assert a.link(1)["link"] == "CONNECTING"
    assert b.proc is not None and b.proc.poll() is None
    b.fault_file.write_text("")
    assert b.proc.wait(timeout=60) == 0
    assert "shutdown complete" in b.log()


def test_index_disagreement_is_detected(sim_domain: MakeDomain) -> None:
    """Two daemons whose hosts files swap slots 0 and 1 (upstream #1418) never count each other."""
    domain = sim_domain(2, slots=2)
    a, b = domain.nodes
    # b believes it holds slot 0 and a holds slot 1; a believes the opposite.
    domain.write_hosts(b, {0: b.ip, 1: a.ip})
    for node in domain.nodes:
        domain.start(node)
    wait_until("a rejected by b", lambda: a.state() is not None and a.link(1)["link"] == "REJECTED")
    wait_until("b rejected by a", lambda: b.state() is not None and b.link(1)["link"] == "REJECTED")
    # Each daemon answers "I am <slot 0 name>" to a caller that dialled the slot 1 name.
    assert a.link(1)["detail"] == f"I am {domain.prefix}-0000, not {domain.prefix}-0001"
    assert b.link(1)["detail"] == f"I am {domain.prefix}-0000, not {domain.prefix}-0001"
    # Both expose node ID 0: the collision is visible to anyone comparing node IDs.
    ids = [(n.status() or {}).get("node_id") for n in (a, b)]
    assert ids == [0, 0]
    assert a.state() == "WAITING_FOR_PEERS"
    assert b.state() == "WAITING_FOR_PEERS"


def test_fault_refuse_peers_and_crash(sim_domain: MakeDomain) -> None:
    domain = sim_domain(2, slots=2)
    a, b = domain.nodes
    b.fault_file.write_text("refuse-peers\n")
    for node in domain.nodes:
        domain.start(node)
    wait_until("a rejected", lambda: a.state() is not None and a.link(1)["link"] == "REJECTED")
    assert "fault refuse-peers" in a.link(1)["detail"]
    assert a.state() == "WAITING_FOR_PEERS"
    b.fault_file.write_text("")
    all_ready(domain)
    b.fault_file.write_text("crash\n")
    assert b.proc is not None and b.proc.wait(timeout=60) == 1
    wait_until("a drops crashed b", lambda: a.state() == "WAITING_FOR_PEERS")


def test_force_state_fault(sim_domain: MakeDomain) -> None:
    domain = sim_domain(1, slots=1)
    (a,) = domain.nodes
    domain.start(a)
    wait_until("ready", lambda: a.state() == "READY")
    a.fault_file.write_text("force-state=WAITING_FOR_PEERS\n")
    wait_until("forced", lambda: a.state() == "WAITING_FOR_PEERS")
    a.fault_file.write_text("")
    wait_until("ready again", lambda: a.state() == "READY")


def test_no_matching_address_exits_like_real_imex(sim_domain: MakeDomain) -> None:
    domain = sim_domain(2, slots=2)
    a = domain.nodes[0]
    domain.write_hosts(a, {1: domain.nodes[1].ip})  # a's own name maps to the sentinel
    domain.start(a)
    assert a.proc is not None and a.proc.wait(timeout=60) == 1
    assert "No matching network interface found" in a.log()


def test_unix_socket_command_service_and_long_flag(sim_domain: MakeDomain, tmp_path: object) -> None:
    domain = sim_domain(1, slots=1)
    (a,) = domain.nodes
    sock = a.dir / "imex_ctrl.sock"
    a.cfg.write_text(a.cfg.read_text().replace("IMEX_CMD_UNIX_DOMAIN_PATH=", f"IMEX_CMD_UNIX_DOMAIN_PATH={sock}"))
    domain.start(a)
    wait_until("ready", lambda: a.state() == "READY")
    for flags in (["-u", str(sock)], [f"--u={sock}"]):
        out = subprocess.run(
            [str(domain.bin_dir / "nvidia-imex-ctl"), "-q", *flags], capture_output=True, text=True, timeout=60
        )
        assert (out.returncode, out.stdout) == (0, "READY\n"), out.stderr


def test_ctl_reports_unavailable_without_daemon(sim_bin: object, tmp_path: object) -> None:
    from pathlib import Path

    out = subprocess.run(
        [str(Path(str(sim_bin)) / "nvidia-imex-ctl"), "-q", "-u", "/nonexistent/imex.sock"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stdout == "UNAVAILABLE\n"
    assert "cannot connect" in out.stderr


def test_ctl_gives_up_on_a_daemon_that_never_answers_and_loads_no_asyncio(sim_bin: object, tmp_path: Path) -> None:
    # A command socket that accepts and then says nothing: -q must end at its -t deadline, as UNAVAILABLE.
    sock_path = tmp_path / "mute.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)
    try:
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "tests.testbed.imex_simulator.ctl",
             "-q", "-u", str(sock_path), "-t", "300"],
            capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[3],
        )  # fmt: skip
    finally:
        server.close()
    assert (out.returncode, out.stdout) == (1, "UNAVAILABLE\n"), out.stderr
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "asyncio" not in imported  # each hostManaged Prepare runs it: its start must stay cheap
    assert "timed out" in out.stderr


def test_the_driver_roots_native_ctl_answers_like_the_simulators_and_hands_on_the_rest(
    sim_domain: MakeDomain, tmp_path: Path
) -> None:
    # What a fake driver root carries: the native ctl for the service's two queries, the simulator's beside it.
    import shutil

    from tests.testbed.fake_driver_root.build import SIMULATED_CTL, native_imex_ctl

    domain = sim_domain(2, slots=2)
    a = domain.nodes[0]
    sock = a.dir / "imex_ctrl.sock"
    a.cfg.write_text(a.cfg.read_text().replace("IMEX_CMD_UNIX_DOMAIN_PATH=", f"IMEX_CMD_UNIX_DOMAIN_PATH={sock}"))
    root_bin = tmp_path / "root-bin"
    root_bin.mkdir()
    native = root_bin / "nvidia-imex-ctl"
    shutil.copy2(native_imex_ctl(), native)
    shutil.copy2(domain.bin_dir / "nvidia-imex-ctl", root_bin / SIMULATED_CTL)

    def both(*args: str) -> tuple[tuple[int, str], tuple[int, str]]:
        runs = [subprocess.run([str(ctl), *args], capture_output=True, text=True, timeout=60)
                for ctl in (native, domain.bin_dir / "nvidia-imex-ctl")]  # fmt: skip
        return (runs[0].returncode, runs[0].stdout), (runs[1].returncode, runs[1].stdout)

    down = both("-q", "-u", str(sock))  # nothing listens yet
    assert down[0] == down[1] == (1, "UNAVAILABLE\n")
    domain.start(a)
    wait_until("a waits for its peer", lambda: a.state() == "WAITING_FOR_PEERS")
    for args in (["-c", str(a.cfg), "-q"], ["-q", "-u", str(sock)], ["-u", str(sock), "-q"], ["-q", f"--u={sock}"]):
        native_run, simulated_run = both(*args)
        assert native_run == simulated_run == (0, "WAITING_FOR_PEERS\n"), args
    native_run, simulated_run = both("-c", str(a.cfg), "-N", "-j")  # not one of the two: the simulator's answers
    assert native_run == simulated_run and json.loads(native_run[1])["nodeId"] == 0
    (root_bin / SIMULATED_CTL).unlink()
    alone = subprocess.run([str(native), "-N", "-c", str(a.cfg)], capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "answers only -q" in alone.stderr and SIMULATED_CTL in alone.stderr
