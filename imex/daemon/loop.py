"""The daemon's watch-driven loops: run one step whenever a watched object changed, never concurrently,
retrying failed steps with capped exponential backoff.

Watch handlers only set `changed`; the loop coalesces any number of events into one step, and a step that
fails sets `changed` again after its backoff so the same (latest) state is retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from computedomain.kube.clock import Clock

log = logging.getLogger(__name__)


async def run_on_changes(
    changed: asyncio.Event,
    step: Callable[[], Awaitable[Any]],
    *,
    retry_on: tuple[type[BaseException], ...],
    clock: Clock,
    first_delay: float,
    max_delay: float,
    what: str,
) -> None:
    """Run `step` once now and then after every change; never returns (cancel to stop)."""
    failures = 0
    changed.set()
    while True:
        await changed.wait()
        changed.clear()
        try:
            await step()
            failures = 0
        except retry_on as exc:
            failures += 1
            delay = min(max_delay, first_delay * 2 ** min(failures - 1, 6))
            log.warning("%s failed failures=%d retry_in=%.1fs error=%s", what, failures, delay, exc)
            await clock.sleep(delay)
            changed.set()
