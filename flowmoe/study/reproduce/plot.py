"""`flowmoe reproduce --plot`: how far the simulator lands from each paper, as a dot plot sized for a
column of a two-column paper.

Two panels sharing the papers as rows: every published absolute figure (tokens/s, hit rates) and
every published speedup, each as its ratio simulated / paper, one dot per figure (spread across the
row so dots do not hide each other), the paper's median as a bar, a line at 1.0 (equal to the paper)
and the band of the reproduction's target around it. The ratio axis is logarithmic (base 2), so a
figure twice too high and one twice too low lie equally far from 1.0; dots have no baseline to
exaggerate. The rows name each paper with its count of figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowmoe.core.figure import COLUMN, check_suffix, pyplot, save
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard
from flowmoe.study.reproduce.run import TARGETS

ROW = 0.17  # inches per paper row
SPREAD = 0.6  # of a row's height, over which its dots are spread
LANES = 5  # distinct heights a row's dots take, in turn
LEGEND = 0.35  # inches under the axes for the legend
MEDIAN_FROM = 3  # a row shows its median from this many figures
ABSOLUTE_BAND = next(
    bound for _, group, figure, bound in TARGETS if (group, figure) == ("absolute", "median_off")
)
SPEEDUP_BAND = next(
    bound for _, group, figure, bound in TARGETS if (group, figure) == ("speedups", "median_off")
)
Ratios = dict[str, list[tuple[float, str]]]  # per paper: (simulated / paper, metric) of each figure
THROUGHPUT, HIT_RATE, SPEEDUP = ("tab:blue", "o"), ("tab:orange", "D"), ("tab:green", "^")


def plot_reproduction(results: Sequence[dict[str, Any]], path: Path, guard: Guard = DEFAULT_GUARD) -> Any:
    """Draw and write the figure; returns the matplotlib Figure."""
    check_suffix(path, "--plot")
    absolute: Ratios = {}
    speedups: Ratios = {}
    for result in results:
        absolute.setdefault(result["paper"], []).extend(
            (r["ratio"], r["metric"]) for r in result["rows"] if r["ratio"]
        )
        speedups.setdefault(result["paper"], []).extend(
            (s["ratio"], "speedup") for s in result["speedups"] if s["ratio"]
        )
    with pyplot() as plt:
        panels = [
            (f"absolute figures, band {ABSOLUTE_BAND:g}×", _kept(absolute), ABSOLUTE_BAND),
            (f"speedups between systems, band {SPEEDUP_BAND:g}×", _kept(speedups), SPEEDUP_BAND),
        ]
        panels = [p for p in panels if p[1]] or panels[:1]
        heights = [max(1, len(p[1])) * ROW + 0.35 for p in panels]
        fig, axes = plt.subplots(len(panels), 1, figsize=(COLUMN, sum(heights) + 0.3 + LEGEND), sharex=True,
                                 gridspec_kw={"height_ratios": heights}, squeeze=False)  # fmt: skip
        for ax, (title, rows, band) in zip(axes[:, 0], panels, strict=True):
            _panel(ax, title, rows, band)
        _ratio_axis(axes[-1, 0], [v for _, rows, _ in panels for values in rows.values() for v, _ in values])
        axes[-1, 0].set_xlabel("simulated / paper")
        fig.legend(*_legend(axes), loc="lower center", ncol=3, handletextpad=0.3, columnspacing=0.8)
        fig.tight_layout(h_pad=0.6, rect=(0, LEGEND / fig.get_figheight(), 1, 1))
        save(fig, path, guard)
    return fig


def _kept(rows: Ratios) -> Ratios:
    return {paper: values for paper, values in rows.items() if values}


def _panel(ax: Any, title: str, rows: Ratios, band: float) -> None:
    ax.axvspan(1 / band, band, color="0.9", zorder=0)
    ax.axvline(1.0, color="0.3", linewidth=0.8, zorder=1)
    for y, values in enumerate(rows.values()):
        for i, (ratio, metric) in enumerate(sorted(values)):
            color, marker = (
                HIT_RATE if metric == "hit rate" else SPEEDUP if metric == "speedup" else THROUGHPUT
            )
            offset = (i % LANES - (LANES - 1) / 2) * SPREAD / (LANES - 1)
            ax.plot([ratio], [y + offset], linestyle="none", marker=marker, color=color, markersize=3,
                    alpha=0.85, zorder=3, markeredgewidth=0)  # fmt: skip
        if len(values) < MEDIAN_FROM:
            continue
        median = statistics.median(v for v, _ in values)
        ax.plot([median], [y], linestyle="none", marker="|", color="black", markersize=9, markeredgewidth=1.2,
                zorder=4)  # fmt: skip
    if not rows:
        ax.text(0.5, 0.5, "no published figure was simulated", transform=ax.transAxes, ha="center")
    ax.set_yticks(range(len(rows)), [f"{paper} ({len(values)})" for paper, values in rows.items()])
    ax.set_ylim(max(1, len(rows)) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)
    ax.set_title(title, loc="left")
    ax.grid(True, axis="x", alpha=0.3)


def _ratio_axis(ax: Any, ratios: list[float]) -> None:
    """Base-2 log ticks labelled as plain ratios, spanning the dots and at least 0.5 to 2."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    low = min([0.5, *ratios]) / 1.15
    high = max([2.0, *ratios]) * 1.15
    ax.set_xscale("log", base=2)
    ax.set_xlim(low, high)
    ticks = [2.0**k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _legend(axes: Any) -> tuple[list[Any], list[str]]:
    """One entry per mark drawn: each kind of dot found, the median, the line at 1.0, the band."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    drawn = {(line.get_color(), line.get_marker()) for ax in axes[:, 0] for line in ax.get_lines()}
    kinds = [(THROUGHPUT, "tokens/s"), (HIT_RATE, "hit rate"), (SPEEDUP, "speedup")]
    handles: list[Any] = [
        Line2D([], [], linestyle="none", color=c, marker=m, markersize=4)
        for (c, m), _ in kinds
        if (c, m) in drawn
    ]
    labels = [label for style, label in kinds if style in drawn]
    median = Line2D([], [], linestyle="none", marker="|", color="black", markersize=8, markeredgewidth=1.2)
    handles += [median, Line2D([], [], color="0.3", linewidth=0.8), Patch(color="0.9")]
    labels += [f"median (≥{MEDIAN_FROM})", "equal (1.0)", "target band"]
    return handles, labels
