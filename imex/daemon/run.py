"""The ``run`` command: the life of one compute-domain daemon, from its pod label to SIGTERM.

Sequence:

1. Validate the identity (CD UID from CDI, pod identity from the downward API); connect to the apiserver;
   answer the pod's probes on ``<pod IP>:CHECK_PORT`` (``probe``: ``GET /ready``, ``check``'s verdict, 200
   only on exactly READY, one ctl for any number of requests).
2. Label our own pod ``resource.nvidia.com/computeDomain.cliqueID=<CLIQUE_ID>`` (JSON merge patch). The value
   is empty on a node without NVLink fabric: that label *is* such a node's registration. It cannot have a
   ComputeDomainClique (``<uid>.`` is no valid name), so the controller reports it from the pod (IP, Ready
   condition, no index), as upstream does; ``check`` succeeds there, so the pod turns Ready and counts as
   ready. Such a daemon runs no IMEX and writes nothing else; it waits for SIGTERM.
3. Write ``imexd.cfg`` (command service on the pod IP) and, in DNS-names mode, the static ``nodes.cfg``
   with the per-CD prefix.
4. Register our entry (``registration.Registry``): our index is kept or allocated, status NotReady (IMEX is
   not up yet; the readiness mirror takes over from the pod's condition).
5. Run the peer loop (hosts file / nodes.cfg, start, SIGUSR1, restart) and the readiness mirror until a
   signal or a failure.
Steps 2 and 4 are retried on transient API errors (no answer within the client's deadline, 5xx, 429) with
growing pauses, as the loops of step 5 are: a slow apiserver delays the daemon instead of crash-looping it
(each restart costs a back-off, a fresh registration and a churn of the clique for every peer). Permanent
errors (RBAC, admission) still end the daemon at once with the server's message.

6. On SIGTERM/SIGINT: stop the loops, stop IMEX gracefully (it tells its peers), remove our entry (bounded
   by ``SHUTDOWN_TIMEOUT``), exit 0. A fatal error exits 1 after the same cleanup, so the container restarts
   and the restart count shows it.

Concurrency: one event loop; the peer loop, the readiness mirror, their informers and the IMEX supervisor
are tasks of one ``TaskGroup``. Signal handlers only set an event.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tenacity import retry_if_exception

from computedomain.api.constants import CLIQUE_LABEL
from computedomain.atomic import write_atomically
from computedomain.http import EndpointError
from computedomain.kube.client import PODS, KubeClient
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.converge import Retries
from computedomain.kube.errors import KubeError
from computedomain.kube.informer import Informer
from computedomain.kube.version import UnsupportedServerError, require_supported
from computedomain.retry import Backoff, log_retry, retrying
from imex.config import ImexConfigError, render_imexd_cfg, render_nodes_cfg_dns
from imex.daemon.check import check
from imex.daemon.peers import PeerFiles, PeerSync
from imex.daemon.probe import serve_check
from imex.daemon.process import ImexProcess
from imex.daemon.readiness import ReadinessMirror
from imex.daemon.registration import (
    CliqueBackend,
    Identity,
    RegistrationError,
    Registry,
    StatusBackend,
    pod_owner_reference,
)
from imex.daemon.settings import DaemonSettings

__all__ = ["Daemon", "run_daemon"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Daemon:
    """The wired-up parts of one daemon (exposed so tests can observe them)."""

    settings: DaemonSettings
    client: KubeClient
    registry: Registry | None = None
    process: ImexProcess | None = None
    peers: PeerSync | None = None
    readiness: ReadinessMirror | None = None


async def label_own_pod(client: KubeClient, settings: DaemonSettings) -> None:
    await client.merge_patch(
        PODS,
        settings.pod_name,
        {"metadata": {"labels": {CLIQUE_LABEL: settings.clique_id}}},
        namespace=settings.pod_namespace,
    )
    log.info(
        "labelled own pod pod=%s/%s %s=%r", settings.pod_namespace, settings.pod_name, CLIQUE_LABEL, settings.clique_id
    )


def write_imex_config(settings: DaemonSettings) -> None:
    settings.imexd_cfg_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(
        settings.imexd_cfg_path,
        render_imexd_cfg(
            cmd_bind_ip=settings.pod_ip,
            nodes_config_file=str(settings.nodes_cfg_path),
            overrides=settings.imex_config_overrides,
        ),
        mode=0o644,
        if_changed=True,
    )
    if settings.dns_names:
        write_atomically(
            settings.nodes_cfg_path,
            render_nodes_cfg_dns(settings.hostname_prefix, settings.max_nodes),
            mode=0o644,
            if_changed=True,
        )


def build(settings: DaemonSettings, client: KubeClient) -> Daemon:
    me = Identity(node_name=settings.node_name, ip_address=settings.pod_ip, clique_id=settings.clique_id)
    backend: CliqueBackend | StatusBackend
    if settings.use_cliques:
        backend = CliqueBackend(namespace=settings.pod_namespace, cd_uid=settings.cd_uid, clique_id=settings.clique_id)
    else:
        backend = StatusBackend(namespace=settings.cd_namespace, name=settings.cd_name, cd_uid=settings.cd_uid)
    registry = Registry(
        client,
        backend,
        me,
        max_nodes=settings.max_nodes,
        owner=pod_owner_reference(settings.pod_name, settings.pod_uid),
    )
    process = ImexProcess(
        [settings.imex_binary, "-c", str(settings.imexd_cfg_path)],
        stop_timeout=settings.imex_stop_timeout,
        backoff_initial=settings.restart_backoff_initial,
        backoff_max=settings.restart_backoff_max,
        reload_interval=settings.sigusr1_interval,
    )
    files = PeerFiles(
        hosts_file=Path(settings.hosts_file),
        hosts_block=settings.cd_uid,
        hostname_prefix=settings.hostname_prefix,
        nodes_cfg=settings.nodes_cfg_path,
        max_nodes=settings.max_nodes,
    )
    retries = Retries.of(settings)
    peers = PeerSync(client, registry, process, files, dns_names=settings.dns_names, retries=retries)
    readiness = ReadinessMirror(
        client,
        registry,
        namespace=settings.pod_namespace,
        pod_name=settings.pod_name,
        pod_uid=settings.pod_uid,
        retries=retries,
        own_check=functools.partial(check, settings),
        imex_started=process.spawned,
    )
    return Daemon(settings, client, registry, process, peers, readiness)


async def run_daemon(
    settings: DaemonSettings, *, stop: asyncio.Event | None = None, client: KubeClient | None = None
) -> int:
    """Run until ``stop`` is set (SIGTERM/SIGINT set it when not given); the exit status."""
    settings.validate_for_run()
    stop = stop or _signal_event()
    own_client = client is None
    if client is None:
        client = await KubeClient.for_component(settings, field_manager="compute-domain-daemon")
    try:
        try:
            await require_supported(client, "the IMEX daemon")
        except UnsupportedServerError as exc:
            log.error("%s", exc)
            return 1
        return await _run(settings, client, stop)
    finally:
        if own_client:
            await client.close()


async def _run(settings: DaemonSettings, client: KubeClient, stop: asyncio.Event) -> int:
    caches: list[Informer[Any]] = []  # filled once the daemon is built; the probes read it
    try:
        probes = await serve_check(settings, caches)
    except (EndpointError, OSError) as exc:
        log.error("cannot answer the probes on %s port %d: %s", settings.pod_ip, settings.check_port, exc)
        return 1
    try:
        return await _registered(settings, client, stop, caches)
    finally:
        if probes is not None:
            await probes.cleanup()


async def _registered(
    settings: DaemonSettings, client: KubeClient, stop: asyncio.Event, caches: list[Informer[Any]]
) -> int:
    log.info(
        "starting daemon node=%s pod=%s/%s ip=%s cd=%s clique=%r dns_names=%s cliques=%s",
        settings.node_name,
        settings.pod_namespace,
        settings.pod_name,
        settings.pod_ip,
        settings.cd_uid,
        settings.clique_id,
        settings.dns_names,
        settings.use_cliques,
    )
    retries = Retries.of(settings)
    try:
        await persist("label own pod", lambda: label_own_pod(client, settings), stop, retries)
    except KubeError as exc:
        log.error("cannot label own pod: %s", exc)
        return 1
    if stop.is_set():
        return 0
    if not settings.clique_id:
        log.info("no NVLink clique on this node: running no IMEX daemon; waiting for SIGTERM")
        await stop.wait()
        log.info("SIGTERM: exiting")
        return 0

    daemon = build(settings, client)
    assert daemon.registry and daemon.process and daemon.peers and daemon.readiness
    caches += [daemon.peers.informer, daemon.readiness.informer]
    exit_code = 0
    try:
        write_imex_config(settings)
        entry = await persist("register our entry", daemon.registry.register, stop, retries)
        if entry is not None:
            log.info("our slot node=%s index=%d", entry.node_name, entry.index)
            exit_code = await _serve(daemon, stop)
    except (KubeError, RegistrationError, ImexConfigError, OSError) as exc:
        log.error("daemon failed: %s", exc)
        exit_code = 1
    finally:
        await _shutdown(daemon)
    return exit_code


async def _serve(daemon: Daemon, stop: asyncio.Event) -> int:
    """Run the loops until ``stop``; 0 on a requested stop, 1 when a loop failed."""
    assert daemon.peers and daemon.readiness
    failed: list[BaseException] = []
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(daemon.peers.run(), name="peers")
            tasks.create_task(daemon.readiness.run(), name="readiness")
            await stop.wait()
            log.info("stop requested: shutting down")
            raise _Stop
    except* _Stop:
        pass
    except* Exception as group:
        failed.extend(group.exceptions)
    for exc in failed:
        log.error("daemon loop failed: %r", exc)
    return 1 if failed else 0


class _Stop(Exception):  # noqa: N818 (a control-flow signal, not an error)
    pass


async def _shutdown(daemon: Daemon) -> None:
    settings = daemon.settings
    if daemon.process is not None:
        code = await daemon.process.stop()
        if code is not None:
            log.info("nvidia-imex stopped exit=%s", code)
    if daemon.registry is not None:
        try:
            async with asyncio.timeout(settings.shutdown_timeout):
                await daemon.registry.unregister()
        except (TimeoutError, KubeError, RegistrationError) as exc:
            log.warning("could not remove our entry; the controller prunes it: %r", exc)


async def _until(stop: asyncio.Event, coro: Awaitable[T]) -> T | None:
    """Run ``coro`` unless ``stop`` is set first (then cancel it and return None)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # unlike `await task`, this cannot mistake our own cancellation for its
    return None


async def persist(
    what: str,
    step: Callable[[], Awaitable[T]],
    stop: asyncio.Event,
    retries: Retries,
    clock: Clock | None = None,
) -> T | None:
    """``step()`` until it succeeds (its result) or ``stop`` is set (None); a transient ``KubeError`` is
    retried (a tenacity loop) after a pause that doubles from ``backoff_initial`` (at least 0.5 s) up to
    ``backoff_max``, logged at DEBUG and from the ``warn_after``-th attempt at WARNING. A permanent error is
    raised."""
    clock = clock or MonotonicClock()

    async def once() -> T | None:
        return None if stop.is_set() else await _until(stop, step())

    async def sleep(seconds: float) -> None:
        await _until(stop, clock.sleep(seconds))

    loop = retrying(
        clock,
        wait=Backoff(max(retries.backoff_initial, 0.5), retries.backoff_max, spread=0),
        retry=retry_if_exception(lambda exc: isinstance(exc, KubeError) and not exc.permanent),
        before_sleep=log_retry(log, what, warn_after=retries.warn_after),
        sleep=sleep,
    )
    result: T | None = await loop(once)
    return result


def _signal_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
