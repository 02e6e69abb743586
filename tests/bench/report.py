"""Writes what `make bench` measured: `summary.txt` (the lines it printed), `report.md` and its plots.

Per benchmark section: a table of figures (median, p99, spread over rounds, rounds and samples, failures,
the SPEC section 9 target and whether it is met, what was simulated), then the plots:

- latency figures (several samples per round): the distribution of each round as an ECDF, one curve per
  round, so rounds and spread are visible, with the target as a vertical line;
- per-round values (memory, requests per domain, ratios): the median with the range over rounds as an
  error bar, the target as a marker;
- series: the quantities over time (convergence, memory), with the target time where there is one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from tests.bench.figures import Figure, Section, Series


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _scale(unit: str) -> tuple[float, str]:
    return (1000.0, "ms") if unit == "s" else (1.0, unit)


def _plot_distribution(figure: Figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    factor, unit = _scale(figure.unit)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for index, samples in enumerate(figure.rounds):
        if not samples:
            continue
        xs = sorted(v * factor for v in samples)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"round {index + 1} (n={len(xs)})", linewidth=1.2)
    if figure.target is not None:
        ax.axvline(figure.target.limit * factor, color="red", linestyle="--", linewidth=1)
        ax.text(figure.target.limit * factor, 0.02, f" target: {figure.target.text}", color="red", fontsize=8)
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=0.8)
    values = [v for v in figure.samples if v > 0]
    if values and max(values) / min(values) > 50:
        ax.set_xscale("log")
    ax.set_xlabel(unit)
    ax.set_ylabel("fraction of samples <= x")
    ax.set_title(figure.title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_values(figures: Sequence[Figure], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(figures), 1, figsize=(7, 1.1 + 0.9 * len(figures)), squeeze=False)
    for ax, figure in zip(axes[:, 0], figures, strict=True):
        factor, unit = _scale(figure.unit)
        median = figure.stat("median") * factor
        lo, hi = (v * factor for v in figure.spread)
        ax.barh([0], [median], xerr=[[median - lo], [hi - median]], color="#4c72b0", capsize=4, height=0.5)
        for index, samples in enumerate(figure.rounds):
            ax.plot(
                [v * factor for v in samples], [0] * len(samples), "k.", markersize=4, label=None if index else "rounds"
            )
        right = max(hi, median)
        if figure.target is not None:
            limit = figure.target.limit * factor
            ax.axvline(limit, color="red", linestyle="--", linewidth=1)
            ax.text(limit, 0.3, f" {figure.target.text}", color="red", fontsize=7)
            right = max(right, limit)
        ax.set_xlim(0, right * 1.25 if right > 0 else 1)
        ax.set_yticks([])
        ax.set_xlabel(unit, fontsize=8)
        ax.set_title(f"{figure.title} ({len(figure.rounds)} rounds)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_series(series: Series, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, points in series.curves.items():
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            ax.step(xs, ys, where="post", label=name, linewidth=1.2)
    if series.target_x is not None:
        ax.axvline(series.target_x, color="red", linestyle="--", linewidth=1)
        ax.text(series.target_x, 0, f" {series.target_text}", color="red", fontsize=8)
    ax.set_xlabel(series.xlabel)
    ax.set_ylabel(series.ylabel)
    ax.set_title(series.title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(figure: Figure, which: str) -> str:
    if which == "p99" and all(len(r) == 1 for r in figure.rounds):
        return "-"
    return figure.show(figure.stat(which))  # type: ignore[arg-type]


def _table(figures: Sequence[Figure]) -> list[str]:
    rows = [
        "| figure | median | p99 | spread (round medians) | rounds / samples | failures | SPEC 9 target | met | simulated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lo, hi = f.spread
        met = {True: "yes", False: "**no**", None: "-"}[f.met]
        rows.append(
            f"| {f.title} | {_cell(f, 'median')} | {_cell(f, 'p99')} | {f.show(lo)} .. {f.show(hi)} | "
            f"{len(f.rounds)} / {len(f.samples)} | {f.failures} | {f.target.text if f.target else '-'} | {met} | "
            f"{f.simulated or '-'} |"
        )
    return rows


def write(sections: Sequence[Section], out: Path, *, header: Sequence[str] = (), plots: bool = True) -> Path:
    """Write report.md (and plots/) into `out`; returns the report's path."""
    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmark report", "", *header, ""]
    for section in sections:
        slug = _slug(section.key or section.name)
        lines += [f"## {section.name}", ""]
        if section.failed:
            lines += [f"**Did not finish:** {section.failed}", ""]
        lines += [f"- {n}" for n in section.notes]
        if section.figures:
            lines += ["", *_table(section.figures), ""]
        notes = [f"- {f.title}: {f.note}" for f in section.figures if f.note]
        lines += notes + ([""] if notes else [])
        if not plots:
            continue
        for figure in section.figures:
            if figure.samples and not all(len(r) == 1 for r in figure.rounds):
                name = f"{slug}-{_slug(figure.key)}.png"
                _plot_distribution(figure, plot_dir / name)
                lines += [f"![{figure.title}](plots/{name})", ""]
        values = [f for f in section.figures if f.samples and all(len(r) == 1 for r in f.rounds)]
        if values:
            name = f"{slug}-values.png"
            _plot_values(values, plot_dir / name)
            lines += [f"![{section.name}: values per round](plots/{name})", ""]
        for series in section.series:
            if any(series.curves.values()):
                name = f"{slug}-{_slug(series.key)}.png"
                _plot_series(series, plot_dir / name)
                caption = series.title + (f" (simulated: {series.simulated})" if series.simulated else "")
                lines += [f"![{caption}](plots/{name})", "", f"*{caption}*", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def summary(sections: Sequence[Section]) -> str:
    """The text summary: every figure's line, per section."""
    out: list[str] = []
    for section in sections:
        out.append(f"== {section.name}")
        if section.failed:
            out.append(f"   did not finish: {section.failed}")
        out += [f"   {f.line()}" for f in section.figures]
    return "\n".join(out) + "\n"
