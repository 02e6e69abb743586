"""Telling users why a ComputeDomain is stuck: the controller's ``Reporter`` for the convergence loop.

The loop (``kube.converge``) calls ``escalated`` when a domain's reconcile failed permanently (RBAC,
quota, an invalid child or spec: nothing changes until the cause is fixed) or keeps failing. The domain
then gets

* a Warning Event whose reason is the failure's (``Forbidden``, ``QuotaExceeded``, ``Invalid``,
  ``InvalidSpec``, ...) and whose message names the permission or field and the fix, and
* its ``Ready`` condition set to ``False`` with the same reason and message (``status`` ``NotReady``), so
  ``kubectl describe`` says it from the first failed reconcile on, also before any child exists.

A domain that is Ready keeps its status through failures that are only repeated (API weather such as an
apiserver restart): its daemons and workloads are fine, and the Event and log line say enough. Nothing is
done on recovery: the next successful reconcile writes the domain's real status anyway.

Status writes go through the reconcile's own writer (the status subresource, with the cached
resourceVersion), so this is still the only writer of the field; the loop never runs a report and a
reconcile of the same domain at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from computedomain.api.models import ReadyStatus
from computedomain.controller import status
from computedomain.controller.executor import Writer
from computedomain.kube.clock import utcnow
from computedomain.kube.converge import Failure, Severity
from computedomain.kube.events import EventType

log = logging.getLogger(__name__)


class DomainReporter:
    """``kube.converge.Reporter`` keyed by ComputeDomain UID."""

    def __init__(self, writer: Writer, *, now: Callable[[], datetime] = utcnow) -> None:
        self.writer = writer
        self._now = now

    async def escalated(self, key: str, failure: Failure) -> None:
        cd = self.writer.caches.cd(key)
        if cd is None:
            return
        self.writer.event(cd, EventType.WARNING, failure.reason, failure.message)
        if failure.severity is Severity.REPEATED and cd.status is not None and cd.status.status is ReadyStatus.READY:
            return
        nodes = list(cd.status.nodes or ()) if cd.status else []
        new = status.build_status(cd, status.failure_verdict(failure.reason, failure.message), nodes, self._now())
        if status.status_differs(cd.status, new, conditions=not self.writer.schema.pruned):
            await self.writer.write_status(cd, new)
            log.info("status written cd=%s/%s reason=%s", cd.metadata.namespace, cd.metadata.name, failure.reason)

    async def recovered(self, key: str) -> None:
        """Nothing to undo: the successful reconcile has written the real status."""
