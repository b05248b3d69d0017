"""`flowmoe trace summarize TRACE.json`: per-lane utilisation, bubbles, makespan, critical path."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from flowmoe.cli.ui import out
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.traces.summary import TraceSummary, summarize


def register(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="work with Chrome traces written by --trace")
    verbs = trace.add_subparsers(dest="verb", required=True)
    summary = verbs.add_parser("summarize", help="per-lane busy time, utilisation, bubbles, critical path")
    summary.add_argument("path", type=Path)
    summary.set_defaults(handler=_summarize)


def load_trace(path: Path) -> dict:
    data = read_json_object(path)
    if "traceEvents" not in data:
        raise FlowmoeError(f"{path}: no traceEvents; not a Chrome trace")
    return data


def _summarize(args: argparse.Namespace) -> int:
    for summary in summarize(load_trace(args.path)):
        out.print(summary_table(summary))
    return 0


def summary_table(summary: TraceSummary) -> Table:
    table = Table(title=f"{summary.group}: makespan {summary.makespan_us / 1e3:.3f} ms")
    for column in ("lane", "nodes", "busy ms", "utilisation", "bubbles ms"):
        table.add_column(column, justify="right")
    for lane in summary.lanes:
        table.add_row(lane.lane, str(lane.nodes), f"{lane.busy_us / 1e3:.3f}", f"{lane.utilisation:.1%}",
                      f"{lane.bubble_us / 1e3:.3f}")  # fmt: skip
    path = summary.critical_path
    shares = ", ".join(f"{op} {us / 1e3:.2f} ms" for op, us in list(summary.critical_by_op().items())[:5])
    table.caption = f"critical path: {len(path)} nodes; {shares}"
    return table
