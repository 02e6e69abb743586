"""`python -m tests.bench.retry_cost [--calls N] [--rounds R]`: the CPU that the Prepare budget's tenacity
loop adds to one claim's Prepare, in process, without the API or the kubelet.

Three ways to run an attempt that answers at once, each ``--calls`` times on one event loop, timed with
``time.process_time`` (median of ``--rounds``, microseconds per call):

* ``bare``: the attempt under the budget's cut alone (``run_within``), what a Prepare costs with no retries;
* ``budget``: ``within_budget``, as every Prepare and Unprepare runs (tenacity's loop, our stop, wait and
  log hooks, one attempt);
* ``budget+retry``: ``within_budget`` whose first attempt fails retryably (no backoff, so no time is slept):
  what each retry adds.

``budget - bare`` is the price of running the budget on tenacity for a claim that prepares on its first
attempt. Design note 0013 ("Retries") has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

from computedomain.kube.clock import MonotonicClock, run_within
from computedomain.plugin.budget import Budget, within_budget
from computedomain.plugin.failures import RetryableError
from computedomain.plugin.preparer import ClaimRef, ClaimUid

REF = ClaimRef("bench", "claim", ClaimUid("00000000-0000-4000-8000-000000000000"))


async def _per_call(calls: int, one: Callable[[], Awaitable[object]]) -> float:
    for _ in range(min(calls, 200)):  # warm up
        await one()
    began = time.process_time()
    for _ in range(calls):
        await one()
    return (time.process_time() - began) / calls * 1e6


async def measure(calls: int, rounds: int) -> dict[str, float]:
    clock = MonotonicClock()
    rng = random.Random(1)
    budget = Budget(40.0, backoff_initial=0.0, backoff_max=0.0)

    async def answer(deadline: float) -> str:
        return "prepared"

    failures = 0

    async def fails_once(deadline: float) -> str:
        nonlocal failures
        failures += 1
        if failures % 2:
            raise RetryableError("daemon not ready")
        return "prepared"

    async def bare() -> object:
        return await run_within(clock, 40.0, answer(clock.now() + 40.0))

    async def budgeted() -> object:
        return await within_budget(budget, REF, "Prepare", answer, str, clock=clock, rng=rng)

    async def retried() -> object:
        return await within_budget(budget, REF, "Prepare", fails_once, str, clock=clock, rng=rng)

    runs: dict[str, list[float]] = {"bare": [], "budget": [], "budget+retry": []}
    for _ in range(rounds):
        runs["bare"].append(await _per_call(calls, bare))
        runs["budget"].append(await _per_call(calls, budgeted))
        runs["budget+retry"].append(await _per_call(calls, retried))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.retry_cost", description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.calls, args.rounds))
    for name, us in figures.items():
        print(f"{name:>13}: {us:7.1f} us of CPU per call")
    print(
        f"{'tenacity':>13}: {figures['budget'] - figures['bare']:7.1f} us per Prepare on its first attempt, "
        f"{figures['budget+retry'] - figures['budget']:.1f} us more per retry"
    )


if __name__ == "__main__":
    main()
