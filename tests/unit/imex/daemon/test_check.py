"""``check``: ready only on exactly READY from a ctl that exited 0; a hung ctl is killed; no clique is ready;
and the same verdict over the daemon's probe endpoint, one ctl for any number of requests."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, KubeClient
from computedomain.kube.clock import FakeClock
from computedomain.kube.config import Credentials
from computedomain.kube.informer import Informer
from computedomain.settings import load_settings
from imex.daemon.check import CheckResult, check, is_ready_output, report
from imex.daemon.probe import FRESH_S, SETTLE_EVERY_S, SETTLE_S, SharedCheck, serve_check, settled_check
from imex.daemon.settings import DaemonSettings
from imex.host_check import CommandResult, ImexState

CASES = [
    (0, "READY\n", True),
    (0, "READY", True),
    (1, "READY\n", False),  # the ctl failed, whatever it printed
    (0, "READY\n\n", False),
    (0, " READY\n", False),
    (0, "NOT READY\n", False),
    (0, "READY\nbut something else\n", False),
    (0, "WAITING_FOR_PEERS\n", False),
    (0, "ready\n", False),
    (0, "", False),
]


@pytest.mark.parametrize(("code", "output", "ready"), CASES)
def test_is_ready_output_is_exact(code: int, output: str, ready: bool) -> None:
    assert is_ready_output(code, output) is ready


def settings(tmp_path: Path, clique: str = "c.0", **env: str) -> DaemonSettings:
    return load_settings(
        DaemonSettings,
        environ={"CLIQUE_ID": clique, "IMEXD_DIR": str(tmp_path), "CHECK_TIMEOUT": "0.5", **env},
    )


async def test_check_runs_the_ctl_with_the_config_and_reports_the_state(tmp_path: Path) -> None:
    seen: list[list[str]] = []

    async def runner(argv: list[str], *, timeout_s: float) -> CommandResult:
        seen.append(argv)
        assert timeout_s == 0.5
        return CommandResult(0, "WAITING_FOR_PEERS\n")

    result = await check(settings(tmp_path, IMEX_CTL_BINARY="/x/nvidia-imex-ctl"), runner=runner)
    assert seen == [["/x/nvidia-imex-ctl", "-c", str(tmp_path / "imexd.cfg"), "-q"]]
    assert not result.ready
    assert "state WAITING_FOR_PEERS" in result.message and "exit code 0" in result.message


async def test_check_without_clique_succeeds_without_running_anything(tmp_path: Path) -> None:
    async def runner(argv: list[str], *, timeout_s: float) -> CommandResult:
        raise AssertionError("must not run")

    result = await check(settings(tmp_path, clique=""), runner=runner)
    assert result.ready and "no NVLink clique" in result.message


async def test_check_kills_a_hung_ctl(tmp_path: Path) -> None:
    hung = tmp_path / "hung-ctl"
    hung.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    hung.chmod(0o755)
    result = await check(settings(tmp_path, IMEX_CTL_BINARY=str(hung)))
    assert not result.ready
    assert "did not answer within 0.5s" in result.message


async def test_check_missing_ctl_and_real_ready_ctl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = await check(settings(tmp_path, IMEX_CTL_BINARY=str(tmp_path / "nope")))
    assert not missing.ready and "cannot run" in missing.message
    ok = tmp_path / "ok-ctl"
    ok.write_text("#!/bin/sh\necho READY\n")
    ok.chmod(0o755)
    result = await check(settings(tmp_path, IMEX_CTL_BINARY=str(ok)))
    assert result.ready
    assert report(result) == 0
    assert report(missing) == 1
    assert capsys.readouterr().out.splitlines() == ["READY", missing.message]


async def test_the_daemon_answers_its_probes_with_the_check(tmp_path: Path) -> None:
    """`run` serves GET /ready on the pod IP: the kubelet's httpGet probe gets `check`'s exact verdict."""
    ctl = tmp_path / "ctl"
    state = tmp_path / "state"
    state.write_text("INITIALIZING")
    ctl.write_text(f"#!/bin/sh\ncat {state}\necho\n")
    ctl.chmod(0o755)
    with socket.socket() as s:  # a free port on the "pod IP"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = settings(tmp_path, IMEX_CTL_BINARY=str(ctl), POD_IP="127.0.0.1", CHECK_PORT=str(port))
    peers: Informer[object] = Informer(
        KubeClient(Credentials("http://127.0.0.1:9")), COMPUTE_DOMAIN_CLIQUES, decode=lambda raw: raw
    )
    clock = FakeClock()
    server = await serve_check(daemon, [peers], clock=clock)
    assert server is not None
    session = aiohttp.ClientSession(f"http://127.0.0.1:{port}")

    async def get(path: str) -> tuple[int, bytes]:
        async with session.get(path) as resp:
            return resp.status, await resp.read()

    try:
        status, body = await get("/ready")
        assert status == 503 and b"state INITIALIZING" in body
        state.write_text("READY")
        await clock.advance(FRESH_S)  # the verdict answers the requests of the next FRESH_S
        assert await get("/ready") == (200, b"READY\n")
        # A cache the apiserver refuses (as the informer records a Forbidden list or watch): unready, and why.
        peers.failure = "forbidden: watch computedomaincliques in ns: grant it"
        assert await get("/ready") == (503, b"forbidden: watch computedomaincliques in ns: grant it\n")
        assert (await get("/healthz"))[0] == 200
    finally:
        await session.close()
        await server.cleanup()
    assert await serve_check(settings(tmp_path, CHECK_PORT="0")) is None


def _states(*states: str) -> tuple[list[str], object]:
    """A `check` whose ctl answers `states` in turn (the last one for ever); records each call."""
    calls: list[str] = []

    async def run(_settings: DaemonSettings) -> CheckResult:
        state = states[min(len(calls), len(states) - 1)]
        calls.append(state)
        if state == "READY":
            return CheckResult(True, "READY")
        return CheckResult(False, f"IMEX daemon not ready: state {state}", ImexState(state))

    return calls, run


async def test_ready_waits_out_imex_connecting_to_a_peer_that_just_joined(tmp_path: Path) -> None:
    clock = FakeClock()
    calls, run = _states("WAITING_FOR_PEERS", "WAITING_FOR_PEERS", "READY")
    task = asyncio.create_task(settled_check(settings(tmp_path), clock, run=run))  # type: ignore[arg-type]
    await clock.advance(2 * SETTLE_EVERY_S + 0.01)
    assert task.done() and task.result().ready and calls == ["WAITING_FOR_PEERS", "WAITING_FOR_PEERS", "READY"]


async def test_ready_fails_when_a_peer_stays_unconnected(tmp_path: Path) -> None:
    clock = FakeClock()
    calls, run = _states("WAITING_FOR_PEERS")
    task = asyncio.create_task(settled_check(settings(tmp_path), clock, run=run))  # type: ignore[arg-type]
    await clock.advance(SETTLE_S + SETTLE_EVERY_S)
    assert task.done()
    result = task.result()
    assert not result.ready and "WAITING_FOR_PEERS" in result.message
    assert 1 + SETTLE_S / SETTLE_EVERY_S - 1 <= len(calls) <= 2 + SETTLE_S / SETTLE_EVERY_S


async def test_ready_answers_other_states_at_once(tmp_path: Path) -> None:
    calls, run = _states("INITIALIZING", "READY")
    result = await settled_check(settings(tmp_path), FakeClock(), run=run)  # type: ignore[arg-type]
    assert not result.ready and calls == ["INITIALIZING"]


async def test_a_flood_of_probe_requests_runs_one_ctl(tmp_path: Path) -> None:
    """Any pod may reach the probe port: forty requests at once and forty more after them start the ctl once
    (main forked it once per request, up to twenty times each while IMEX waited for a peer)."""
    ctl, runs = tmp_path / "ctl", tmp_path / "runs"
    ctl.write_text(f"#!/bin/sh\necho run >> {runs}\nsleep 0.2\necho READY\n")
    ctl.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = settings(tmp_path, IMEX_CTL_BINARY=str(ctl), POD_IP="127.0.0.1", CHECK_PORT=str(port))
    clock = FakeClock()
    server = await serve_check(daemon, clock=clock)
    assert server is not None
    try:
        sessions = [  # eight connections from each of five addresses (the endpoint's per-peer cap)
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8, local_addr=(f"127.0.0.{2 + i}", 0)))
            for i in range(5)
        ]

        async def ready(session: aiohttp.ClientSession) -> int:
            async with session.get(f"http://127.0.0.1:{port}/ready") as resp:
                return resp.status

        try:
            first = await asyncio.gather(*(ready(sessions[i % 5]) for i in range(40)))
            then = await asyncio.gather(*(ready(sessions[i % 5]) for i in range(40)))
            assert first == then == [200] * 40
            assert runs.read_text().splitlines() == ["run"]
            await clock.advance(FRESH_S)
            assert await ready(sessions[0]) == 200
            assert runs.read_text().splitlines() == ["run", "run"]
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
    finally:
        await server.cleanup()


async def test_shared_check_waits_with_the_one_in_flight_and_reuses_its_verdict(tmp_path: Path) -> None:
    clock = FakeClock()
    calls, run = _states("WAITING_FOR_PEERS", "READY", "INITIALIZING")
    shared = SharedCheck(settings(tmp_path), clock, run=run)  # type: ignore[arg-type]
    waiting = [asyncio.create_task(shared.verdict()) for _ in range(10)]
    await clock.advance(SETTLE_EVERY_S + 0.01)  # IMEX between peers: one settling pass for all ten
    assert all(t.done() and t.result().ready for t in waiting) and calls == ["WAITING_FOR_PEERS", "READY"]
    await clock.advance(FRESH_S / 2)
    assert (await shared.verdict()).ready and len(calls) == 2  # still fresh
    await clock.advance(FRESH_S)
    assert not (await shared.verdict()).ready and calls[-1] == "INITIALIZING"
