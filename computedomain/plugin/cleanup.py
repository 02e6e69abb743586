"""Startup and periodic cleanup of what the node agent left behind (SPEC section 6: "stale
partially-prepared claims are undone at start and periodically").

One round (`Cleanup.run_once`), never concurrent with itself:

1. expire tombstones older than their TTL (`checkpoint.expire_tombstones`);
2. for every `PrepareStarted` entry (a Prepare that crashed, timed out and was never retried, or was
   invalidated by a reboot) whose ResourceClaim is gone or was replaced by another claim of the same name:
   run the normal Unprepare for it, which removes its CDI spec and its channel record entry and leaves a
   tombstone. Entries whose claim still exists are left alone: the kubelet will retry or
   unprepare them. `PrepareCompleted` entries are never touched here; only the kubelet's Unprepare ends
   them (a running workload must keep its channel even while the API server is unreachable);
3. CDI spec files of ours that no live checkpoint entry lists (a crash between writing the spec and
   recording it, or a hand-made file) are removed;
4. per-domain `/imexd` directories whose ComputeDomain is gone and that no live entry uses are removed
   (upstream deletes them only here too, never at Unprepare, to avoid racing a re-created daemon pod);
5. channel isolation: claims this node still lists in a domain's channel record although the checkpoint no
   longer holds them (their release at Unprepare failed) are taken off (`Preparer.release_stale_channels`);
   claims it holds whose entry went from the record are listed again (`Preparer.hold_prepared_channels`).

The claim lookup is a live GET with the client's deadline; an API error skips that entry until the next
round. Rounds run on a one-key convergence loop (`kube.converge`): at start and every `interval_s`; a round
that fails is retried with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Final

from computedomain.kube.clock import utcnow
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.plugin.cdi import CdiSpecDir
from computedomain.plugin.checkpoint import DEFAULT_TOMBSTONE_TTL, Checkpoint, ClaimState, expire_tombstones
from computedomain.plugin.prepare import Preparer

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S: Final = 600.0

ClaimUidLookup = Callable[[str, str], Awaitable[str | None]]
DomainsKnown = Callable[[], set[str] | None]


@dataclass
class CleanupReport:
    expired_tombstones: int = 0
    undone_claims: list[str] = field(default_factory=list)
    removed_specs: list[str] = field(default_factory=list)
    removed_domain_dirs: list[str] = field(default_factory=list)
    released_channels: list[str] = field(default_factory=list)
    relisted_channels: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class Cleanup:
    def __init__(
        self,
        preparer: Preparer,
        cdi_dir: CdiSpecDir,
        *,
        claim_uid: ClaimUidLookup,
        known_domains: DomainsKnown,
        domains_dir: Path,
        interval_s: float = DEFAULT_INTERVAL_S,
        tombstone_ttl: timedelta = DEFAULT_TOMBSTONE_TTL,
        clock: Callable[[], datetime] = utcnow,
        retries: Retries = DEFAULT_RETRIES,
    ) -> None:
        """known_domains returns the UIDs of existing ComputeDomains, or None while that is unknown (cache
        not synced): then no domain directory is removed."""
        self.preparer = preparer
        self.store = preparer.store
        self.cdi = cdi_dir
        self.claim_uid = claim_uid
        self.known_domains = known_domains
        self.domains_dir = domains_dir
        self.interval_s = interval_s
        self.tombstone_ttl = tombstone_ttl
        self.clock = clock
        self._lock = asyncio.Lock()
        self.loop: Converger[str] = Converger("cleanup", self._reconcile, every=interval_s, retries=retries)

    async def run(self) -> None:
        self.loop.add("cleanup")
        await self.loop.run()

    async def _reconcile(self, _key: str) -> ReconcileResult:
        await self.run_once()
        return DONE

    async def run_once(self) -> CleanupReport:
        async with self._lock:
            report = CleanupReport()
            now = self.clock()

            def expire(cp: Checkpoint) -> tuple[Checkpoint, int]:
                new = expire_tombstones(cp, now=now, ttl=self.tombstone_ttl)
                return new, len(cp.claims) - len(new.claims)

            report.expired_tombstones = await self.store.update_async(expire)
            checkpoint = await self.store.read_async()
            for entry in checkpoint.in_state(ClaimState.PREPARE_STARTED):
                try:
                    current = await self.claim_uid(entry.namespace, entry.name)
                except Exception as exc:
                    report.skipped.append(entry.uid)
                    log.info(
                        "cleanup: cannot look up claim %s/%s; next round error=%r", entry.namespace, entry.name, exc
                    )
                    continue
                if current == entry.uid:
                    continue
                why = "gone" if current is None else f"replaced by {current}"
                log.info(
                    "cleanup: undoing stale partially prepared claim=%s/%s:%s (its ResourceClaim is %s)",
                    entry.namespace,
                    entry.name,
                    entry.uid,
                    why,
                )
                try:
                    await self.preparer.undo(entry.uid)
                except Exception as exc:
                    report.skipped.append(entry.uid)
                    log.warning("cleanup: undo failed claim=%s; next round error=%r", entry.uid, exc)
                    continue
                report.undone_claims.append(entry.uid)
            # List the files before reading the checkpoint: Prepare records a claim before it writes its spec,
            # so every file listed here belongs to a claim the checkpoint read below already knows.
            specs = await asyncio.to_thread(self.cdi.list_claims)
            dirs = await asyncio.to_thread(self._list_domain_dirs)
            checkpoint = await self.store.read_async()
            live = {e.uid for e in checkpoint.claims.values() if not e.state.is_tombstone}
            listed = {f for e in checkpoint.claims.values() if not e.state.is_tombstone for f in e.cdi_spec_files}
            for uid, path in specs.items():
                if uid in live or str(path) in listed:
                    continue
                if await asyncio.to_thread(self.cdi.remove, uid):
                    report.removed_specs.append(uid)
                    log.info("cleanup: removed CDI spec of a claim this node does not hold path=%s", path)
            await self._domain_dirs(dirs, checkpoint, report)
            try:
                report.released_channels = await self.preparer.release_stale_channels()
            except Exception as exc:
                log.warning("cleanup: could not release stale IMEX channel claims; next round error=%r", exc)
            for uid in report.released_channels:
                log.info("cleanup: released the IMEX channel of a claim this node no longer holds claim=%s", uid)
            try:
                report.relisted_channels = await self.preparer.hold_prepared_channels()
            except Exception as exc:
                log.warning("cleanup: could not check the channel records of prepared claims; next round error=%r", exc)
            return report

    def _list_domain_dirs(self) -> list[Path]:
        if not self.domains_dir.is_dir():
            return []
        return sorted(p for p in self.domains_dir.iterdir() if p.is_dir())

    async def _domain_dirs(self, dirs: list[Path], checkpoint: Checkpoint, report: CleanupReport) -> None:
        known = self.known_domains()
        if known is None:
            return
        used = {r.domain_id for e in checkpoint.claims.values() if not e.state.is_tombstone for r in e.resources}
        for path in dirs:
            if path.name in known or path.name in used:
                continue
            await asyncio.to_thread(shutil.rmtree, path, True)
            report.removed_domain_dirs.append(path.name)
            log.info("cleanup: removed the IMEX config directory of a deleted ComputeDomain path=%s", path)
