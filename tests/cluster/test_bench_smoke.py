"""Every `make bench*` target works on a fresh cluster: each runs at its smoke size (a handful of domains, a
few nodes, one round) against a control plane started for this module, with nothing of this service
installed, and must leave nothing of its own behind.

The module's cluster is its own (a fresh `.cluster`-like directory), not the session's: the session's has
the CRDs installed already, which is exactly what hid the benchmarks' missing setup before. Cost: one
control plane start plus about a minute of benchmarks on two cores, and about two minutes for the real-node
one (two real nodes, the chart installed in both modes).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testbed.cluster import REPO, LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

# What each target must report (one line per figure, from the summary): a benchmark whose setup or
# measurement broke reports no such line, or "did not finish".
FIGURES = {
    "controller": ["CD created -> all 3 children observed", "last clique entry Ready -> CD Ready observed",
                   "API writes per domain lifecycle", "controller RSS with"],
    "plugin": ["channel Prepare, ready domain (in-process)", "channel Prepare, ready domain (agent process + API)",
               "50 daemon claims in one call"],
    "system": ["create -> CD Ready", "last clique entry Ready -> CD Ready", "controller's own part"],
    "fleet": ["domains created at once -> all Ready observed", "controller API requests per domain lifecycle",
              "controller RSS,"],
    "channels": ["channel record created -> channel seen", "channel records at once -> all assigned",
                 "extra time per Prepare with channel isolation"],
    "realnode": ["pod without a claim, create -> Running", "pod with a channel claim, create -> Running",
                 "node agent Prepare of the channel claim", "node agent RSS", "IMEX daemon wrapper RSS",
                 "process start -> serving"],
}  # fmt: skip


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("bench-cluster"))
    local.up()
    try:
        yield local
    finally:
        local.down()


def left_behind(local: LocalCluster) -> list[str]:
    """Objects of this service or of a benchmark that remain on the cluster."""
    out = local.kubectl("get", "crd,deviceclass,namespace,node", "-o", "name").stdout.split()
    return [o for o in out if "nvidia.com" in o or "/bench-" in o or "/fleet-" in o]


def make(target: str, local: LocalCluster, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    args = f"--smoke --cluster={local.root} --out={out}"
    return subprocess.run(
        ["make", "--no-print-directory", target, f"BENCH_ARGS={args}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize("name", list(FIGURES))
def test_bench_target_reports_on_a_fresh_cluster_and_cleans_up(name: str, fresh: LocalCluster, tmp_path: Path) -> None:
    assert not left_behind(fresh), "the module's cluster is not fresh"
    result = make(f"bench-{name}", fresh, tmp_path)
    assert result.returncode == 0, f"make bench-{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = (tmp_path / "summary.txt").read_text()
    assert "did not finish" not in summary
    for title in FIGURES[name]:
        lines = [line for line in summary.splitlines() if title in line]
        assert lines, f"no figure {title!r} in the summary:\n{summary}"
        assert all(re.search(r"median [0-9.]+", line) for line in lines), lines
    report = (tmp_path / "report.md").read_text()
    plots = re.findall(r"\]\((plots/[^)]+\.png)\)", report)
    assert plots and all((tmp_path / p).stat().st_size > 1000 for p in plots), report
    assert "Unclosed" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not left_behind(fresh), f"bench-{name} left {left_behind(fresh)}"


def test_a_failing_benchmark_ends_with_one_line(fresh: LocalCluster, tmp_path: Path) -> None:
    result = make("bench-controller", fresh, tmp_path, BENCH_QPS="not-a-number")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("bench controller")]
    assert lines == ["bench controller failed while starting: could not convert string to float: 'not-a-number'"], (
        result.stderr
    )
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr, result.stderr
    assert not left_behind(fresh)


def test_unknown_benchmark_is_refused_by_name() -> None:
    result = subprocess.run(
        ["python", "-m", "tests.bench", "nosuch"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{REPO / '.venv/bin'}:{os.environ.get('PATH', '')}"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown benchmark(s) nosuch" in result.stderr
