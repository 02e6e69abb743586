"""The controller process: caches, guard, leader election, work queue, workers, sweeps, HTTP, signals.

Concurrency model (one asyncio event loop, no threads):

* one task per informer (``caches``); their handlers only enqueue CD UIDs (or request a sweep for objects of
  unknown domains) and return;
* nothing else starts before every cache has synced; then the mode-switch guard runs (read-only, in every
  replica) and may end the process;
* with leader election on, the ``LeaderElector`` task campaigns; standbys keep warm caches and write nothing.
  The leader's term runs the work queue (``WorkQueue[str]`` keyed by CD UID: deduplicated, never one key twice
  at once, per-key backoff), ``WORKERS`` reconcile tasks, the orphan ``Sweeper`` and (driverManaged) the
  node-label loop keyed by node name (``nodes.NodeLabeller``). Losing the lease cancels
  them and ends the process (exit 1), so every term starts from clean memory;
* SIGTERM/SIGINT cancel the main task: the term's work stops, the Lease is released (a standby takes over at
  once), the process exits 0. SIGUSR2 writes every asyncio task's stack (and every thread's) to stderr;
* an aiohttp server on ``HTTP_ENDPOINT`` serves ``/metrics`` (prometheus-client), ``/healthz`` (the loop
  answers) and ``/readyz`` (caches synced and the guard passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import signal
import sys
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any, TextIO

from computedomain.controller import adoption, guard
from computedomain.controller.caches import Caches
from computedomain.controller.channel_assigner import ChannelAssigner
from computedomain.controller.executor import Reconciler, Sweeper, Writer
from computedomain.controller.nodes import NodeLabeller
from computedomain.controller.report import DomainReporter
from computedomain.http import HttpServer, start_http
from computedomain.kube.client import KubeClient
from computedomain.kube.converge import Converger, Retries
from computedomain.kube.events import EventRecorder
from computedomain.kube.informer import event_reporter
from computedomain.kube.informer import problems as informer_problems
from computedomain.kube.leader import LeaderElector, LeadershipLost, make_identity
from computedomain.kube.version import UnsupportedServerError, require_supported
from computedomain.metrics import REGISTRY, Collector, GaugeMetricFamily
from computedomain.settings import ControllerSettings, describe

log = logging.getLogger("computedomain.controller")

QUEUE_NAME = "computedomain"
CHANNEL_QUEUE_NAME = "imex-channels"
CHANNEL_WORKERS = 4
NODE_LABEL_QUEUE_NAME = "node-labels"
NODE_LABEL_WORKERS = 4

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_GUARD = 3


# --- metrics: ComputeDomains by status, read from the CD cache at scrape time ----------------------------


class _DomainStatusCollector(Collector):
    def __init__(self) -> None:
        self.caches: Caches | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ours = GaugeMetricFamily("computedomain_compute_domains", "ComputeDomains by status.", labels=["status"])
        # The reference driver's name, so existing dashboards keep working.
        upstream = GaugeMetricFamily(
            "nvidia_dra_compute_domain_info", "ComputeDomains by global status.", labels=["status"]
        )
        counts: Tally[str] = Tally({"Ready": 0, "NotReady": 0})
        if self.caches is not None and self.caches.cds.synced:
            for cd in self.caches.cds.list():
                if cd.metadata.deletion_timestamp is not None:
                    counts["Terminating"] += 1
                elif cd.status is None:
                    counts["Unknown"] += 1
                else:
                    counts[cd.status.status.value] += 1
        for status, n in sorted(counts.items()):
            ours.add_metric([status], n)
            if status in ("Ready", "NotReady"):
                upstream.add_metric([status], n)
        yield ours
        yield upstream
        yield from self._per_domain()

    def _per_domain(self) -> Iterator[GaugeMetricFamily]:
        """Per domain (not terminating): Ready or not, and its IMEX daemons by readiness (from its cliques,
        else its status.nodes), for alerts that name the domain. The labels are cd_namespace and cd_name:
        a scrape adds `namespace` (the controller pod's) to every series."""
        ready = GaugeMetricFamily(
            "computedomain_compute_domain_ready",
            "1 while a ComputeDomain's status is Ready, else 0.",
            labels=["cd_namespace", "cd_name"],
        )
        daemons = GaugeMetricFamily(
            "computedomain_imex_daemons",
            "IMEX daemons registered for a ComputeDomain, by readiness.",
            labels=["cd_namespace", "cd_name", "status"],
        )
        if self.caches is not None and self.caches.cds.synced:
            by_uid: dict[str, Tally[str]] = {}
            for clique in self.caches.all_cliques():
                tally = by_uid.setdefault(clique.domain_uid, Tally())
                tally.update(d.status.value for d in clique.daemons or ())
            for cd in self.caches.cds.list():
                if cd.metadata.deletion_timestamp is not None:
                    continue
                key = [cd.metadata.namespace or "", cd.metadata.name or ""]
                ready.add_metric(key, 1 if cd.status is not None and cd.status.status.value == "Ready" else 0)
                nodes = (cd.status.nodes if cd.status else None) or ()
                seen = by_uid.get(cd.metadata.uid or "") or Tally(n.status.value for n in nodes)
                for status in ("Ready", "NotReady"):
                    daemons.add_metric([*key, status], seen[status])
        yield ready
        yield daemons


DOMAIN_STATUS = _DomainStatusCollector()
REGISTRY.register(DOMAIN_STATUS)


# --- logging and stack dumps ---------------------------------------------------------------------------


def dump_tasks(stream: TextIO | None = None) -> None:
    """Every asyncio task's stack, then every thread's (SIGUSR2)."""
    out = stream or sys.stderr
    tasks = asyncio.all_tasks()
    print(f"=== {len(tasks)} asyncio tasks ===", file=out)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"--- {task.get_name()}: {task.get_coro()!r}", file=out)
        task.print_stack(file=out)
    out.flush()
    with contextlib.suppress(Exception):
        faulthandler.dump_traceback(file=out, all_threads=True)


# --- the process ---------------------------------------------------------------------------------------


class Controller:
    """One controller process (or an in-process instance in tests)."""

    def __init__(
        self,
        settings: ControllerSettings,
        client: KubeClient,
        *,
        identity: str | None = None,
        cd_namespace: str | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.identity = identity or make_identity(settings.pod_name)
        self.caches = Caches(client, settings, cd_namespace=cd_namespace)
        # Events on a budget of their own: a burst of them never delays a reconcile's writes.
        self.recorder = EventRecorder(
            client.with_own_budget(), component="computedomain-controller", instance=self.identity
        )
        self.ready = False
        self.leading = False
        self.loop: Converger[str] | None = None
        self.sweeper: Sweeper | None = None
        self.channels: Converger[str] | None = None
        self.labeller: Converger[str] | None = None

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``/readyz``: caches synced, guard passed, and no cache refused (a 403 list or watch says which
        verb on which resource is missing)."""
        problems = informer_problems(*self.caches.informers())
        if not self.ready and not problems:
            unsynced = [i.name for i in self.caches.informers() if not i.synced]
            if unsynced:
                problems = [f"caches not synced yet: {', '.join(unsynced)}"]
        details = {"ready": self.ready and not problems, "leading": self.leading, "identity": self.identity}
        return self.ready and not problems, {**details, "problems": problems}

    async def run(self) -> None:
        """Until cancelled (graceful stop), or raising ``ModeConflictError`` / ``LeadershipLost``."""
        DOMAIN_STATUS.caches = self.caches
        informers = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self.caches.informers()]
        try:
            await self.caches.wait_synced()
            log.info("caches synced informers=%d", len(informers))
            cds = self.caches.cds.list()
            children = adoption.children_of(cds, self.caches.children(), self.settings)
            findings = guard.check(self.settings.imex_mode, cds, children, self.caches.nodes.list())
            if findings:
                raise guard.ModeConflictError(self.settings.imex_mode, findings)
            if self.settings.host_managed:
                findings = guard.check_isolation(self.settings.imex_isolation, cds, children)
                if findings:
                    raise guard.isolation_conflict(self.settings.imex_isolation, findings)
            self.ready = True
            if self.settings.leader_election_enabled:
                elector = LeaderElector(
                    self.client,
                    namespace=self.settings.leader_election_namespace,
                    name=self.settings.leader_election_name,
                    identity=self.identity,
                    lease_duration=self.settings.leader_election_lease_duration,
                    renew_deadline=self.settings.leader_election_renew_deadline,
                    retry_period=self.settings.leader_election_retry_period,
                    on_started_leading=self._lead,
                )
                await elector.run()
            else:
                await self._lead()
        finally:
            self.ready = False
            for task in informers:
                task.cancel()
            await asyncio.gather(*informers, return_exceptions=True)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self.recorder.aclose()
            if DOMAIN_STATUS.caches is self.caches:
                DOMAIN_STATUS.caches = None

    async def _lead(self) -> None:
        self.leading = True
        log.info("leading identity=%s mode=%s", self.identity, self.settings.imex_mode.value)
        s = self.settings
        retries = Retries.of(s)
        caches = self.caches

        def reconcile_all() -> None:
            for uid in caches.known_uids():
                loop.add(uid)

        writer = Writer(self.client, caches, self.recorder, on_conditions_kept=reconcile_all)
        sweeper = Sweeper(writer, period=s.sweep_period, retries=retries)
        reconciler = Reconciler(writer, s, after_reconcile=sweeper.request)
        loop: Converger[str] = Converger(
            QUEUE_NAME, reconciler.reconcile, workers=s.workers, reporter=DomainReporter(writer), retries=retries
        )
        self.loop, self.sweeper = loop, sweeper

        def on_uid(uid: str) -> None:
            if caches.cd(uid) is not None:
                loop.add(uid)
            else:
                sweeper.request()  # labelled for a domain we do not know: maybe an orphan

        caches.add_handlers(on_uid)  # replays every cached object: every domain gets reconciled once
        report = event_reporter(self.recorder)  # objects the caches skip, told by the leader only
        for informer in caches.informers():
            informer.add_handler(on_reject=report)
        assigner: Converger[str] | None = None
        if s.channel_isolation:
            # Keyed by clique: one clique's channels are never planned twice at once (channel_assigner).
            assigner = Converger(
                CHANNEL_QUEUE_NAME,
                ChannelAssigner(writer, s).reconcile,
                workers=CHANNEL_WORKERS,
                every=s.sweep_period,
                retries=retries,
            )
            caches.add_channel_handlers(assigner.add)
        self.channels = assigner
        labeller: Converger[str] | None = None
        if not s.host_managed:
            # Keyed by node: the CD label follows the channel claims allocated there (``nodes``). Every input
            # is watched, so no periodic pass: a node is looked at when a claim, its label or a domain changes.
            labeller = Converger(
                NODE_LABEL_QUEUE_NAME,
                NodeLabeller(writer, request_sweep=sweeper.request).reconcile,
                workers=NODE_LABEL_WORKERS,
                retries=retries,
            )
            caches.add_node_handlers(labeller.add)
        self.labeller = labeller
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(sweeper.run(), name="orphan-sweeper")
                tg.create_task(loop.run(), name="workers")
                if assigner is not None:
                    tg.create_task(assigner.run(), name="imex-channels")
                if labeller is not None:
                    tg.create_task(labeller.run(), name="node-labels")
        finally:
            self.leading = False


async def main(settings: ControllerSettings, *, cd_namespace: str | None = None) -> int:
    """Run the controller until SIGTERM/SIGINT; the exit code says how it ended."""
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    assert current is not None
    stopping = False

    def stop() -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            log.info("signal received, shutting down")
            current.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
    settings_line: dict[str, Any] = describe(settings)
    log.info("starting controller settings=%s", json.dumps(settings_line, default=str, sort_keys=True))
    client = await KubeClient.for_component(settings, field_manager="computedomain-controller")
    controller = Controller(settings, client, cd_namespace=cd_namespace)
    runner: HttpServer | None = None
    try:
        await require_supported(client, "the controller")
        if settings.http_endpoint:
            runner = await start_http(
                settings.http_endpoint,
                metrics_path=settings.metrics_path,
                readiness=controller.readiness,
            )
        await controller.run()
        return EXIT_OK
    except asyncio.CancelledError:
        if not stopping:
            raise
        return EXIT_OK
    except guard.ModeConflictError as exc:
        log.error("%s", exc)
        return EXIT_GUARD
    except UnsupportedServerError as exc:
        log.error("%s", exc)
        return EXIT_FAILED
    except LeadershipLost as exc:
        log.error("leadership lost, exiting: %s", exc)
        return EXIT_FAILED
    finally:
        if runner is not None:
            await runner.cleanup()
        await client.close()
