"""What a benchmark reports: figures measured over several rounds, and series over time (no I/O here).

A `Figure` keeps every sample per round (latencies in seconds, or one value per round for sizes such as
memory), and failures apart from them: an operation that failed has no latency and is counted, never folded
into the percentiles. Its statistics: median and p99 over all samples of all rounds, and the spread, the
lowest and highest per-round median (how much a figure moves from one round to the next). Its `Target`
is the SPEC section 9 line it answers, checked against the same statistics.

A `Series` is a quantity over time within one run (how many daemons are Ready, t seconds after the create
request), for the convergence and memory plots.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Stat = Literal["median", "p99", "max"]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): a value that was measured, never an interpolation."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Target:
    """A SPEC section 9 target: `stat` of the figure below `limit` (in the figure's base unit)."""

    stat: Stat
    limit: float
    text: str  # as the SPEC says it, e.g. "p99 < 1 s"

    def met(self, figure: Figure) -> bool | None:
        value = figure.stat(self.stat)
        return None if math.isnan(value) else value < self.limit


@dataclass
class Figure:
    key: str  # stable id, e.g. "controller.burst"
    title: str
    unit: str = "s"  # base unit of the samples: "s", "MiB", "requests", "x", "%"
    target: Target | None = None
    simulated: str = ""  # what of the measured path is simulated (shown beside the figure)
    rounds: list[list[float]] = field(default_factory=list)
    failures: int = 0
    note: str = ""

    def round(self, samples: Sequence[float], failures: int = 0) -> None:
        self.rounds.append(list(samples))
        self.failures += failures

    @property
    def samples(self) -> list[float]:
        return [v for r in self.rounds for v in r]

    def stat(self, which: Stat) -> float:
        samples = self.samples
        if not samples:
            return math.nan
        if which == "median":
            return statistics.median(samples)
        if which == "p99":
            return percentile(samples, 99)
        return max(samples)

    @property
    def spread(self) -> tuple[float, float]:
        medians = [statistics.median(r) for r in self.rounds if r]
        return (min(medians), max(medians)) if medians else (math.nan, math.nan)

    @property
    def met(self) -> bool | None:
        return self.target.met(self) if self.target else None

    def show(self, value: float) -> str:
        return show(value, self.unit)

    def line(self) -> str:
        """One line of the text summary."""
        n = len(self.samples)
        head = f"{self.title}: "
        if not n:
            return head + f"no samples ({self.failures} failed)"
        lo, hi = self.spread
        single = all(len(r) == 1 for r in self.rounds)
        parts = [f"median {self.show(self.stat('median'))}"]
        if not single:
            parts.append(f"p99 {self.show(self.stat('p99'))}")
        parts.append(f"spread {self.show(lo)}..{self.show(hi)}")
        counts = f"{len(self.rounds)} round{'s' if len(self.rounds) != 1 else ''}"
        if not single:
            counts += f", n={n}"
        text = head + ", ".join(parts) + f" ({counts}; failures {self.failures})"
        if self.target is not None:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[self.met]
            text += f"   [SPEC 9: {self.target.text}: {verdict}]"
        return text


def show(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{value:.2f}%"
    return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"


@dataclass
class Series:
    """Named curves of (t seconds, value) points; all curves of one series share their time origin."""

    key: str
    title: str
    ylabel: str
    xlabel: str = "seconds since the create request"
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    target_x: float | None = None  # e.g. the SPEC's 30 s, drawn as a vertical line
    target_text: str = ""
    simulated: str = ""

    def add(self, curve: str, t: float, value: float) -> None:
        self.curves.setdefault(curve, []).append((t, value))


@dataclass
class Section:
    """One benchmark's results: its figures, its series, and free text lines (setup, sizes, caveats)."""

    name: str
    key: str = ""  # short, for file names (the benchmark's module name)
    figures: list[Figure] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: str = ""  # one line when the benchmark could not finish

    def figure(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        return figure

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(text, flush=True)
