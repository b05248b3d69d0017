"""`flowmoe trace plot`: a run's lanes over time as a figure for a paper.

One row per lane, each node a bar coloured by its operation (the legend names every operation
drawn); where the trace has kernel tracks (--trace-kernels), a thin row under a lane holds the
kernels that ran for it. Several runs (two trace files, or a comparison trace's schedulers) are
stacked on one time axis, each panel titled by its run and each timed from its own start, so the
same lanes line up and their lengths compare. A window of steps (the step windows flowmoe writes) or
of time narrows every panel alike; nodes are clipped to it.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from attrs import evolve, frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.figure import COLUMN, check_suffix, pyplot, save
from flowmoe.core.plan import Lane, Op
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard
from flowmoe.traces.stats import SpanRecord, Window
from flowmoe.traces.summary import kernels_by_group, records_by_group, windows_by_group

RUN = "run"  # the group of a trace of one run (traces/summary.py)
START, EACH = "the run's start", "each run's start"  # time 0 of a panel, of several
ROW, KERNEL_ROW = 0.16, 0.08  # inches: a lane's row, its kernels' row
BAR, KERNEL_BAR = 0.8, 0.7  # of a row's height: a node's bar, a kernel's
TITLE, AXIS, LEGEND_ROW = 0.3, 0.4, 0.14  # inches: a panel's title, the time axis, a legend row
LEGEND_COLUMNS = 4
PIXELS = 3000  # intervals of an op closer than the window / PIXELS are drawn as one bar
KERNELS = "kernels"
KERNEL_COLOR = "0.25"
# tab20's and tab20b's colours by family: attention blues, experts greens and olives, copies reds,
# oranges and browns, embedding and head greys; an operation no flowmoe trace has takes tab10's
TAB20: dict[str, int] = {
    Op.GPU_ATTN: 0, Op.PRE_ATTN: 1, Op.CPU_ATTN: 18, Op.POST_ATTN: 19,
    Op.EXPERT_FFN: 4, Op.SHARED_FFN: 5, Op.GATE: 16, Op.PREGATE: 17, Op.COMBINE: 9,
    Op.PAGE_COPY: 6, Op.EXPERT_LOAD: 7, Op.KV_LOAD: 2, Op.KV_STORE: 3, Op.HIDDEN_LOAD: 12,
    Op.HIDDEN_OFFLOAD: 13, Op.QKV_OFFLOAD: 10, Op.ACT_STORE: 11, Op.ACT_LOAD: 8,
    Op.EMBED: 14, Op.LM_HEAD: 15,
}  # fmt: skip
TAB20B: dict[str, int] = {Op.DISK_LOAD: 12, Op.W_STAGE: 10, Op.EVICT: 19, Op.LAYER: 0}  # LAYER: a dark blue
OTHERS = "tab10"


Key = tuple[str | None, bool, str]  # a panel's bars: (lane, a kernels' row, operation)


@frozen
class Panel:
    """One run's nodes and kernels in the drawn window, on the panel's clock (µs): from the run's
    first node, or from the first step drawn."""

    title: str
    bars: dict[Key, list[tuple[float, float]]]  # (start, end) of each node or kernel
    first: float  # the window on the panel's clock
    last: float
    origin: str  # what time 0 is, in words

    @property
    def ops(self) -> set[str]:
        return {op for _, kernel, op in self.bars if not kernel}


def panels(
    traces: Sequence[tuple[str, dict[str, Any]]],
    steps: tuple[int | None, int | None] | None = None,
    window_ms: tuple[float | None, float | None] | None = None,
) -> list[Panel]:
    """A panel per run of the (name, trace) pairs: a trace of one run is titled by its name, a
    comparison trace's runs by their schedulers (and the name where two panels would share a
    title); `steps` (first, end: half open, counted from 0) or `window_ms` (from the run's first
    node) narrows each."""
    found = []
    for name, data in traces:
        records = records_by_group(data)
        if not records:
            raise FlowmoeError(f'{name}: no complete ("ph": "X") events to plot')
        windows, kernels = windows_by_group(data), kernels_by_group(data)
        for group, spans in records.items():
            label = name if group == RUN else f"{name}: {group}"
            origin, lo, hi, words = _window(label, spans, windows.get(group), steps, window_ms)
            nodes = (((s.lane, False, s.op), s.start, s.end) for s in spans)
            ran = (((k.lane, True, KERNELS), k.start, k.end) for k in kernels.get(group, ()))
            drawn = _clipped(itertools.chain(nodes, ran), lo, hi, origin)
            found.append(
                (name if group == RUN else group, label, Panel("", drawn, lo - origin, hi - origin, words))
            )
    titles = [title for title, _, _ in found]
    return [evolve(p, title=title if titles.count(title) == 1 else label) for title, label, p in found]


def _window(
    name: str,
    spans: list[SpanRecord],
    windows: list[Window] | None,
    steps: tuple[int | None, int | None] | None,
    window_ms: tuple[float | None, float | None] | None,
) -> tuple[float, float, float, str]:
    """The panel's time 0, the drawn interval, on the trace's clock (µs), and time 0 in words."""
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    if steps is not None:
        if not windows:
            raise FlowmoeError(
                f"{name}: no step windows (flowmoe writes them; another tool's trace has none): "
                "use --window START_MS:END_MS"
            )
        first, stop = steps
        chosen = windows[slice(first, stop)]
        if not chosen:
            raise FlowmoeError(
                f"{name}: steps {_shown(first)}:{_shown(stop)} hold none of its {len(windows)} steps "
                f"(0 to {len(windows) - 1})"
            )
        return chosen[0].start, chosen[0].start, chosen[-1].end, f"step {first or 0}'s start"
    if window_ms is not None:
        first_ms, stop_ms = window_ms
        lo = start + (first_ms or 0.0) * 1e3
        hi = end if stop_ms is None else start + stop_ms * 1e3
        if lo >= end:
            raise FlowmoeError(
                f"{name}: --window starts at {first_ms:g} ms, after the run's {(end - start) / 1e3:.3g} ms"
            )
        return start, lo, hi, START
    return start, start, end, START


def _shown(value: int | None) -> str:
    return "" if value is None else str(value)


def _clipped(
    items: Iterable[tuple[Key, float, float]], lo: float, hi: float, origin: float
) -> dict[Key, list[tuple[float, float]]]:
    """The intervals meeting [lo, hi], cut to it, on a clock from `origin`, by key."""
    bars: dict[Key, list[tuple[float, float]]] = defaultdict(list)
    for key, start, end in items:
        if end > lo and start < hi:
            bars[key].append((max(start, lo) - origin, min(end, hi) - origin))
    return dict(bars)


def plot_trace(shown: Sequence[Panel], path: Path, guard: Guard = DEFAULT_GUARD) -> Any:
    """Draw the panels stacked on one time axis and write the figure; returns the matplotlib Figure."""
    check_suffix(path, "--output")
    rows = _rows(shown)
    ops = _ops(shown)
    kernels = any(row.kernels for row in rows)
    first, last = min(p.first for p in shown), max(p.last for p in shown)
    unit, scale = ("ms", 1e3) if last - first >= 1e3 else ("µs", 1.0)
    height = rows[-1].bottom if rows else ROW
    legend = math.ceil((len(ops) + kernels) / LEGEND_COLUMNS) * LEGEND_ROW + 0.1
    size = (COLUMN, (height + TITLE) * len(shown) + AXIS + legend)
    with pyplot() as plt:
        colors = _colors(plt, ops)
        fig, axes = plt.subplots(len(shown), 1, figsize=size, sharex=True, squeeze=False)
        for ax, panel in zip(axes[:, 0], shown, strict=True):
            _draw(ax, panel, rows, colors, scale, (last - first) / PIXELS)
        axes[-1, 0].set_xlim(first / scale, last / scale)
        origins = {p.origin for p in shown}
        origin = origins.pop() if len(origins) == 1 else EACH
        origin = EACH if origin == START and len(shown) > 1 else origin
        axes[-1, 0].set_xlabel(f"time ({unit}) from {origin}")
        handles = [_patch(colors[op]) for op in ops] + ([_patch(KERNEL_COLOR)] if kernels else [])
        labels = ops + ([KERNELS] if kernels else [])
        fig.legend(handles, labels, loc="lower center", ncol=LEGEND_COLUMNS, handlelength=1.0,
                   handletextpad=0.4, columnspacing=0.8)  # fmt: skip
        fig.tight_layout(h_pad=0.4, rect=(0, legend / size[1], 1, 1))
        save(fig, path, guard)
    return fig


@frozen
class Row:
    """A row of every panel: a lane's nodes, or the kernels that ran for it, inches from the top."""

    lane: str | None
    kernels: bool
    top: float
    height: float

    @property
    def bottom(self) -> float:
        return self.top + self.height


def _rows(shown: Sequence[Panel]) -> list[Row]:
    """Every lane a panel draws, in flowmoe's lane order (others after, by name), each with its
    kernels' row right under it where a panel has kernels for it; kernels for no lane last. The
    same rows in every panel, so they line up."""
    names = {lane for p in shown for lane, kernel, _ in p.bars if not kernel}
    known = [str(lane) for lane in Lane if str(lane) in names]
    lanes: list[str | None] = [*known, *sorted(str(n) for n in names - set(known))]
    kernel_lanes = {lane for p in shown for lane, kernel, _ in p.bars if kernel}
    rows: list[Row] = []
    for lane in [*lanes, None]:
        if lane is not None:
            rows.append(Row(lane, False, rows[-1].bottom if rows else 0.0, ROW))
        if lane in kernel_lanes:
            rows.append(Row(lane, True, rows[-1].bottom if rows else 0.0, KERNEL_ROW))
    return rows


def _ops(shown: Sequence[Panel]) -> list[str]:
    names = set().union(*(p.ops for p in shown))
    known = [str(op) for op in Op if str(op) in names]
    return known + sorted(names - set(known))


def _colors(plt: Any, ops: list[str]) -> dict[str, Any]:
    tab20, tab20b, others = (plt.get_cmap(name).colors for name in ("tab20", "tab20b", OTHERS))
    spare = itertools.cycle(others)
    return {
        op: tab20[TAB20[op]] if op in TAB20 else tab20b[TAB20B[op]] if op in TAB20B else next(spare)
        for op in ops
    }


def _patch(color: Any) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color)


def _draw(ax: Any, panel: Panel, rows: list[Row], colors: dict[str, Any], scale: float, merge: float) -> None:
    """The panel's bars row by row, an operation's bars closer than `merge` (µs) joined."""
    for row in rows:
        shown = [(KERNELS, KERNEL_COLOR)] if row.kernels else colors.items()
        share = KERNEL_BAR if row.kernels else BAR
        for op, color in shown:
            bars = _merged(panel.bars.get((row.lane, row.kernels, op), []), merge)
            if bars:
                pad = row.height * (1 - share) / 2
                ax.broken_barh([(start / scale, (end - start) / scale) for start, end in bars],
                               (row.top + pad, row.height - 2 * pad), color=color, linewidth=0)  # fmt: skip
    ax.set_yticks([row.top + row.height / 2 for row in rows],
                  [_row_label(row) for row in rows])  # fmt: skip
    for label, row in zip(ax.get_yticklabels(), rows, strict=True):
        if row.kernels:
            label.set(fontsize=5.5, color=KERNEL_COLOR)
    ax.set_ylim(rows[-1].bottom if rows else ROW, 0)
    ax.tick_params(axis="y", length=0)
    ax.set_title(panel.title, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def _row_label(row: Row) -> str:
    if not row.kernels:
        return str(row.lane)
    return "kernels" if row.lane is not None else "kernels, no node"


def _merged(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """The intervals sorted, those closer than `gap` joined: what is drawn stays bounded for
    millions of nodes (the joins are under a pixel wide)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
