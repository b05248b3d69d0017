"""`flowmoe trace summarize TRACE.json`: the run statistics of each trace group (traces/stats.py:
the same figures `run`, `simulate` and `compare` report), the critical path and, where the trace has
kernel tracks (--trace-kernels), each GPU lane's device-busy time and the launch-bound nodes
(traces/device_stats.py). `flowmoe trace plot TRACE... -o FIG`: the runs' lanes over time as a figure
(traces/plot.py)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from attrs import evolve
from rich.markup import escape
from rich.table import Table

from flowmoe.cli.args import OUTPUT_FILE
from flowmoe.cli.ui import NO_GPU, out
from flowmoe.cli.ui import table as ui_table
from flowmoe.cli.writes import add_force_flag, write_guard
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.figure import PLOT, check_suffix
from flowmoe.core.write_guard import Named
from flowmoe.traces.chrome import EMULATED
from flowmoe.traces.device_stats import LAUNCH_BOUND, DeviceStats
from flowmoe.traces.plot import panels, plot_trace
from flowmoe.traces.stats import RunStats
from flowmoe.traces.summary import TraceSummary, summarize
from flowmoe.traces.trace_file import read_trace


def register(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="work with Chrome traces written by --trace")
    verbs = trace.add_subparsers(dest="verb", required=True)
    summary = verbs.add_parser(
        "summarize",
        help="per-lane bytes, busy share, bubbles, overlap, cache figures, critical path; device-busy "
        "time and launch-bound nodes where the trace has kernel tracks (--trace-kernels)",
    )
    summary.add_argument("path", type=Path)
    summary.set_defaults(handler=_summarize)
    plot = verbs.add_parser(
        "plot",
        help="draw a run's lanes over time, nodes coloured by operation (.png, .svg or .pdf); two traces "
        "(or a comparison trace) stacked on one time axis",
    )
    plot.add_argument("paths", nargs="+", type=Path, metavar="TRACE", help="a trace (.json or .json.gz)")
    plot.add_argument(
        "-o", "--output", type=OUTPUT_FILE, required=True, help="the figure (.png, .svg or .pdf)"
    )
    window = plot.add_mutually_exclusive_group()
    window.add_argument(
        "--steps", type=_steps, metavar="A:B",
        help="draw steps A to B-1 of each run (counted from 0; A: or :B leaves that side open)",
    )  # fmt: skip
    window.add_argument(
        "--window", type=_window_ms, metavar="START_MS:END_MS",
        help="draw this time window, in ms from each run's first node (either side may be left open)",
    )  # fmt: skip
    add_force_flag(plot)
    plot.set_defaults(handler=_plot)


def load_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace in either of its formats: an object with traceEvents, or a bare event array,
    read event by event (traces/trace_file.py), keeping what the summary reads."""
    if path.is_dir() or not path.exists():  # a FIFO or a device is refused by read_trace
        raise FlowmoeError(f"{path}: {'a folder, not a trace file' if path.is_dir() else 'no such file'}")
    data = read_trace(path)
    if not isinstance(data.get("traceEvents"), list):
        raise FlowmoeError(f"{path}: no traceEvents list; not a Chrome trace")
    return data


def _plot(args: argparse.Namespace) -> int:
    guard = write_guard(
        args, [("--output", args.output, PLOT)], *(Named("a trace to plot", p) for p in args.paths)
    )
    check_suffix(args.output, "--output")
    traces = [(_run_name(path), load_trace(path)) for path in args.paths]
    plot_trace(panels(traces, args.steps, args.window), args.output, guard)
    out.print(f"plot: {escape(str(args.output))}", highlight=False)
    return 0


def _run_name(path: Path) -> str:
    """A trace file's name less .json and .gz: the title of its run."""
    name = path.name
    for suffix in (".gz", ".json"):
        name = name.removesuffix(suffix)
    return name or path.name


def _bounds(text: str, number: type) -> tuple[Any, Any]:
    first, colon, stop = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r}: give A:B (either side may be left out)")
    try:
        low = number(first) if first.strip() else None
        high = number(stop) if stop.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: A and B must be {number.__name__}s") from None
    if any(v is not None and (v < 0 or not math.isfinite(v)) for v in (low, high)):
        raise argparse.ArgumentTypeError(f"{text!r}: A and B must be finite and >= 0")
    if low is not None and high is not None and high <= low:
        raise argparse.ArgumentTypeError(f"{text!r}: B must be past A")
    return low, high


def _steps(text: str) -> tuple[int | None, int | None]:
    return _bounds(text, int)


def _window_ms(text: str) -> tuple[float | None, float | None]:
    return _bounds(text, float)


def _summarize(args: argparse.Namespace) -> int:
    data = load_trace(args.path)
    try:
        summaries = summarize(data)
    except FlowmoeError as exc:  # an event the summary cannot read: name the file
        raise FlowmoeError(f"{args.path}: {exc}") from exc
    if any(e.get("name") == "process_labels" and EMULATED in str(e.get("args")) for e in data["traceEvents"]):
        out.print(NO_GPU, highlight=False)
    if any(s.device is None and any(lane.lane.startswith("gpu") for lane in s.lanes) for s in summaries):
        out.print(SPANS_NOTE, highlight=False)
    for summary in summaries:
        shown = plain(summary)
        out.print(summary_table(shown))
        if shown.device is not None:
            out.print(device_table(shown.group, shown.device))
            if shown.device.launch_bound:
                out.print(launch_bound_table(shown.device))
    return 0


SPANS_NOTE = (
    "GPU spans are launch-to-completion intervals (a node's begin event to its end event on its "
    "stream), not device-busy time: the device idles inside them while the host launches the next "
    "kernel; run with --trace-kernels for the kernels that ran"
)


def device_table(name: str, device: DeviceStats) -> Table:
    """Each GPU lane's span-busy and device-busy time (its kernels' union) and launch gap."""
    title = (
        f"{name}: the device, from its kernels: {device.bound_nodes} of {device.gpu_nodes} GPU nodes "
        f"launch-bound (span >= {LAUNCH_BOUND:g}x its kernels)"
    )
    columns = ("lane", "span busy ms", "device busy ms", "device share", "gap ms", "gap share")
    table = ui_table(title, columns, "right")
    for lane in device.lanes:
        table.add_row(
            lane.lane, f"{lane.span_busy_seconds * 1e3:.3f}", f"{lane.device_busy_seconds * 1e3:.3f}",
            f"{lane.device_share:.1%}", f"{lane.gap_seconds * 1e3:.3f}", f"{lane.gap_share:.1%}",
        )  # fmt: skip
    return table


def launch_bound_table(device: DeviceStats) -> Table:
    """The launch-bound nodes that wasted the most time (span less its kernels' busy time)."""
    table = ui_table("launch-bound nodes, most wasted first", ("node", "lane", "span us", "kernels us",
                                                               "wasted us"), "right")  # fmt: skip
    for node in device.launch_bound:
        table.add_row(
            node.label, node.lane, f"{node.span_us:.1f}", f"{node.kernel_us:.1f}", f"{node.wasted_us:.1f}"
        )
    return table


def plain(summary: TraceSummary) -> TraceSummary:
    """The summary with the names a trace gave (groups, lanes, ops) escaped, so a name such as
    `[/x]` prints as itself, not as rich markup (or a markup error)."""
    stats = evolve(
        summary.stats, lanes=tuple(evolve(lane, lane=escape(lane.lane)) for lane in summary.stats.lanes)
    )
    path = tuple(evolve(record, op=escape(record.op)) for record in summary.critical_path)
    device = summary.device
    if device is not None:
        device = evolve(
            device,
            lanes=tuple(evolve(lane, lane=escape(lane.lane)) for lane in device.lanes),
            launch_bound=tuple(
                evolve(n, label=escape(n.label), lane=escape(n.lane)) for n in device.launch_bound
            ),
        )
    return TraceSummary(escape(summary.group), stats, path, device)


def summary_table(summary: TraceSummary) -> Table:
    table = stats_table(summary.group, summary.stats)
    path = summary.critical_path
    shares = ", ".join(f"{op} {us / 1e3:.2f} ms" for op, us in list(summary.critical_by_op().items())[:5])
    table.caption = f"critical path: {len(path)} nodes; {shares}"
    return table


def stats_table(name: str, stats: RunStats) -> Table:
    """The run statistics (traces/stats.py) as `run`, `trace summarize` and the CLI print them."""
    title = f"{name}: makespan {stats.makespan_seconds * 1e3:.3f} ms, {stats_line(stats)}"
    table = ui_table(title, ("lane", "nodes", "MB moved", "busy ms", "busy share", "bubbles ms"), "right")
    for lane in stats.lanes:
        busy, bubbles = f"{lane.busy_seconds * 1e3:.3f}", f"{lane.bubble_seconds * 1e3:.3f}"
        table.add_row(
            lane.lane, f"{lane.nodes:.0f}", f"{lane.bytes / 1e6:.1f}", busy, f"{lane.share:.1%}", bubbles
        )
    return table


def stats_line(stats: RunStats) -> str:
    """Overlap, cache and host figures in one line (those the trace holds)."""
    parts = [f"overlap {stats.overlap:.2f}"]
    if stats.expert_cache_hit_rate is not None:
        parts.append(f"expert-cache hit rate {stats.expert_cache_hit_rate:.1%}")
    if stats.prefetch_accuracy is not None:
        parts.append(f"prefetch accuracy {stats.prefetch_accuracy:.1%}")
    if stats.host_seconds_per_step is not None:
        parts.append(f"host {stats.host_seconds_per_step * 1e3:.2f} ms/step")
    launches = [(lane.lane, lane.launch_seconds) for lane in stats.lanes if lane.launch_seconds is not None]
    if launches and stats.steps:
        each = ", ".join(f"{lane} {seconds / stats.steps * 1e3:.2f}" for lane, seconds in launches)
        parts.append(f"launching threads in launches, ms/step: {each}")
    return ", ".join(parts)
