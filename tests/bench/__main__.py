"""`python -m tests.bench [--smoke] [--out DIR] [--cluster DIR] [NAME ...]`: run benchmarks, write the report.

Each benchmark is a module `tests.bench.<name>` with `async def run(bench: Bench) -> None` that fills its
`Section` (figures, series, notes). They share the local control plane under `--cluster` (default
`.cluster/`; started if none runs there, stopped afterwards if started here). Before the first benchmark the
CRDs and DeviceClasses are installed as the test fixtures install them, and removed at the end if they
were not there before; each benchmark removes what it created itself.

Output: every figure's line as it is measured, the summary at the end, and in `--out` (default `.bench/`)
`summary.txt`, `report.md` and `plots/`. `--smoke` runs each benchmark at a size of seconds (a handful of
domains, a few nodes, one round): what `make test` runs to prove every `make bench*` target still works.
`--apf` runs them on a control plane of its own (`.cluster-apf/`) whose apiserver has API Priority and
Fairness on, as production clusters do, with the benchmarked controller as a ServiceAccount (classified as
an in-cluster controller is); the default test bed has it off.

A benchmark that fails prints one line (`bench NAME failed while <step>: <reason>`), the others still run,
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from pathlib import Path

from tests.bench.figures import Section
from tests.bench.harness import Bench
from tests.bench.report import summary, write
from tests.testbed.cluster import DEFAULT_ROOT, REPO, LocalCluster, running_cluster

BENCHMARKS = ("controller", "plugin", "system", "fleet", "channels", "realnode")
TITLES = {
    "controller": "Controller: create burst vs the API-write floor, Ready latency, domains at scale (SPEC 9)",
    "plugin": "Node agent: channel Prepare latency (SPEC 9)",
    "system": "System: one domain over simulated NVL72 racks, end to end (SPEC 9: a rack in seconds)",
    "fleet": "Fleet: kwok nodes and many domains at once (controller convergence, requests, memory)",
    "channels": "Channel isolation: assignment of many domains at once, the extra time per Prepare",
    "realnode": "Real nodes: what a channel claim costs on a real kubelet; node-side memory and start-up",
}


async def _run_one(name: str, local: LocalCluster, section: Section, smoke: bool) -> None:
    bench = Bench(local, section, smoke=smoke)
    # Other work on the machine moves every wall-clock figure: say how busy it was.
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    section.notes.append(f"machine: {os.cpu_count()} cores, load average (1/5/15 min) at start {load}")
    try:
        module = importlib.import_module(f"tests.bench.{name}")
        await module.run(bench)
    except Exception as exc:  # the one line is the report
        section.failed = bench.failure(exc)
    except asyncio.CancelledError:  # Ctrl-C: clean up below, then stop the whole run
        section.failed = f"interrupted while {bench.current}"
        raise
    finally:
        load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
        section.notes.append(f"load average (1/5/15 min) at the end {load}")
        with bench.step("cleaning up"):
            try:
                await bench.close()
            except Exception as exc:
                section.failed = section.failed or bench.failure(exc)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {BENCHMARKS})")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: proves the benchmarks work")
    parser.add_argument("--out", type=Path, default=REPO / ".bench", help="report directory (default .bench/)")
    parser.add_argument("--cluster", type=Path, help="cluster directory (default .cluster/, with --apf .cluster-apf/)")
    parser.add_argument("--apf", action="store_true",
                        help="the apiserver with API Priority and Fairness on, the controller as a ServiceAccount")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true", help="report without plots")
    args = parser.parse_args(argv)
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    sections: list[Section] = []
    started = time.monotonic()
    try:
        root = args.cluster or (DEFAULT_ROOT.with_name(".cluster-apf") if args.apf else DEFAULT_ROOT)
        with running_cluster(root, priority_and_fairness=args.apf) as local:
            added = local.install_base()
            try:
                for name in names:
                    section = Section(TITLES[name], key=name)
                    sections.append(section)
                    print(f"\n=== benchmark: {name}{' (smoke size)' if args.smoke else ''} ===", flush=True)
                    t0 = time.monotonic()
                    try:
                        asyncio.run(_run_one(name, local, section, args.smoke))
                    except KeyboardInterrupt:
                        print(f"bench {name} {section.failed or 'interrupted'}", file=sys.stderr, flush=True)
                        return 130
                    for figure in section.figures:
                        print(f"  {figure.line()}", flush=True)
                    if section.failed:
                        print(f"bench {name} {section.failed}", file=sys.stderr, flush=True)
                    print(f"--- {name} took {time.monotonic() - t0:.1f}s", flush=True)
            finally:
                local.remove_base(added)
    except Exception as exc:
        print(f"bench: {' '.join(str(exc).split())[:400] or type(exc).__name__}", file=sys.stderr)
        return 1
    text = summary(sections)
    print(f"\n===== summary ({time.monotonic() - started:.0f}s) =====\n{text}", end="", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.txt").write_text(text)
    header = [
        f"`python -m tests.bench {' '.join(argv)}`".replace("  ", " "),
        "",
        "Medians and p99 over all samples of all rounds; spread: the lowest and highest per-round median. "
        "Failed operations are counted apart and never enter a latency. Latencies run from the request that "
        "causes a change to the watch event that shows it, on one clock.",
    ]
    try:
        report = write(sections, args.out, header=header, plots=not args.no_plots)
        print(f"report: {report}  (summary: {args.out / 'summary.txt'})")
    except Exception as exc:
        print(f"bench: writing the report failed: {exc}", file=sys.stderr)
        return 1
    return 1 if any(s.failed for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
