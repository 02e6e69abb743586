"""The kubelet's probes for simulated containers: exec, gRPC health, HTTP GET, TCP; startup, readiness, liveness.

`python -m imex daemon check` (the IMEX daemon's probe) runs in-process, calling the same `check` function
the command calls with the same settings: the kubelet would start it as a fresh process every period for
every daemon, which two shared cores cannot afford at 72 daemons. It still executes `nvidia-imex-ctl` (the
simulator's) against the daemon's command service, as the real probe does. Any other exec probe runs as a
process with the container's env.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from tests.testbed.sim.containers import ContainerPlan, expand, local_argv

ProbeResult = tuple[bool, str]


async def _exec(command: list[str], plan: ContainerPlan, deadline_s: float) -> ProbeResult:
    argv = local_argv([expand(c, plan.env) for c in command])
    program = tuple(argv[1:]) if argv[0] != command[0] else tuple(argv)
    if program[:4] == ("-m", "imex", "daemon", "check"):
        from computedomain.settings import SettingsError, load_settings
        from imex.daemon.check import check
        from imex.daemon.settings import DaemonSettings

        try:
            result = await asyncio.wait_for(
                check(load_settings(DaemonSettings, program[4:], environ=plan.env)), deadline_s
            )
        except (SettingsError, TimeoutError) as exc:
            return False, str(exc) or "probe timed out"
        return result.ready, result.message
    proc = await asyncio.create_subprocess_exec(
        *argv, env=plan.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), deadline_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return False, f"probe timed out after {deadline_s:g}s"
    return proc.returncode == 0, out.decode(errors="replace").strip()[:300]


async def _grpc(host: str, port: int, service: str, deadline_s: float) -> ProbeResult:
    import grpc

    from tests.testbed.kubelet_client import health_check, health_pb2

    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        try:
            status = await health_check(channel, service, deadline_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    return status == health_pb2.HealthCheckResponse.SERVING, str(status)


async def _http(host: str, port: int, path: str, deadline_s: float) -> ProbeResult:
    # The kubelet's httpGet probe: one GET on a fresh connection, redirects not followed.
    host = f"[{host}]" if ":" in host else host
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=deadline_s)) as session,
            session.get(f"http://{host}:{port}{path}", allow_redirects=False) as resp,
        ):
            return 200 <= resp.status < 400, f"HTTP {resp.status}"
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


async def run_probe(
    probe: Mapping[str, Any], plan: ContainerPlan, ports: Mapping[str, int], pod_ip: str
) -> ProbeResult:
    timeout = float(probe.get("timeoutSeconds", 1))
    if "exec" in probe:
        return await _exec(list(probe["exec"]["command"]), plan, timeout)
    if "grpc" in probe:
        host, port = plan.endpoint(probe["grpc"]["port"], ports, pod_ip)
        return await _grpc(host, port, probe["grpc"].get("service", ""), timeout)
    if "httpGet" in probe:
        host, port = plan.endpoint(probe["httpGet"]["port"], ports, pod_ip)
        return await _http(host, port, probe["httpGet"].get("path", "/"), timeout)
    if "tcpSocket" in probe:
        host, port = plan.endpoint(probe["tcpSocket"]["port"], ports, pod_ip)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, TimeoutError) as exc:
            return False, str(exc)
        writer.close()
        return True, "connected"
    return True, "no handler"


class Prober:
    """Runs one container's probes like the kubelet: startup first (liveness and readiness wait for it), then
    readiness (sets `ready`) and liveness (calls `on_failed_liveness` after failureThreshold failures)."""

    def __init__(
        self,
        container: Mapping[str, Any],
        plan: ContainerPlan,
        ports: Mapping[str, int],
        pod_ip: str,
        *,
        on_ready: Callable[[bool], None],
        on_failed_liveness: Callable[[str], None],
        period_scale: float = 1.0,
    ) -> None:
        self.container = container
        self.plan = plan
        self.ports = ports
        self.pod_ip = pod_ip
        self.on_ready = on_ready
        self.on_failed_liveness = on_failed_liveness
        self.scale = period_scale
        self.last_message = ""

    async def _loop(self, probe: Mapping[str, Any], *, until_success: bool, report: Callable[[bool], None]) -> bool:
        period = float(probe.get("periodSeconds", 10)) * self.scale
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)) * self.scale)
        threshold = int(probe.get("failureThreshold", 3))
        success_needed = int(probe.get("successThreshold", 1))
        failures = successes = 0
        while True:
            ok, message = await run_probe(probe, self.plan, self.ports, self.pod_ip)
            self.last_message = message
            if ok:
                failures, successes = 0, successes + 1
                if successes >= success_needed:
                    report(True)
                    if until_success:
                        return True
            else:
                successes, failures = 0, failures + 1
                if failures >= threshold:
                    report(False)
                    if until_success:
                        return False
            await asyncio.sleep(period)

    async def run(self) -> None:
        startup = self.container.get("startupProbe")
        if startup and not await self._loop(startup, until_success=True, report=lambda _ok: None):
            self.on_failed_liveness(f"startup probe failed: {self.last_message}")
            return
        readiness = self.container.get("readinessProbe")
        liveness = self.container.get("livenessProbe")
        if readiness is None:
            self.on_ready(True)
        async with asyncio.TaskGroup() as tasks:
            if readiness is not None:
                tasks.create_task(self._loop(readiness, until_success=False, report=self.on_ready))
            if liveness is not None:

                def live(ok: bool) -> None:
                    if not ok:
                        self.on_failed_liveness(f"liveness probe failed: {self.last_message}")

                tasks.create_task(self._loop(liveness, until_success=False, report=live))
