"""A test clock for retry loops: monotonic time that moves only when someone sleeps on it, recording the sleeps
(tenacity's waits are read off ``sleeps``; no real time passes)."""

from __future__ import annotations

import asyncio


class JumpClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += max(seconds, 0.0)
        await asyncio.sleep(0)  # a turn of the loop, as a real sleep gives
