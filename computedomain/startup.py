"""A process's imports without the cyclic garbage collector (the start-up of every program of the service).

Imports create what a process keeps for its whole life (modules, classes, functions and their constants):
about 105,000 objects the collector tracks, in the node agent. While they are created, every few hundred
allocations start a collection, each of which walks the objects made since the last, and now and then one
walks all of them: 143 collections and 35 ms of the node agent's 350 ms of imports, 15 ms of it a single
full collection. That is a tenth of its start-up to serving, and more where a node's processes start at once
on few cores. `imports_without_gc` turns the collector off for the imports, then moves everything alive
into the permanent generation (`gc.freeze`), which later collections do not walk either, and turns the
collector back on. The price is the garbage cycles the imports left (about 1,900 objects in the node
agent, under 1 MiB): they are never freed.

Used by the entry points only (`python -m computedomain ...`, `python -m imex ...`), never on import: a test
process that imports the service keeps its collector as it was.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["imports_without_gc"]


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """The collector off inside; on leaving, what is alive is frozen and the collector is as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
