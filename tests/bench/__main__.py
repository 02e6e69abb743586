"""`python -m tests.bench [NAME ...]`: run the named benchmarks (default: all) and print one report.

Each benchmark is a module `tests.bench.<name>` with `async def main() -> None` that prints its own
section. They share the local control plane (started if none runs, stopped afterwards if started here).
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time

from tests.testbed.cluster import running_cluster

BENCHMARKS = ("controller", "plugin", "system")


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    missing: list[str] = []
    with running_cluster():
        for name in names:
            try:
                module = importlib.import_module(f"tests.bench.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"tests.bench.{name}":
                    raise
                missing.append(name)
                continue
            print(f"\n=== benchmark: {name} ===", flush=True)
            start = time.monotonic()
            asyncio.run(module.main())
            print(f"--- {name} took {time.monotonic() - start:.1f}s", flush=True)
    if missing:
        print(f"\nnot available yet: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
